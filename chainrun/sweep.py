"""Sweeps: one job file, many chains (``[sweep]``).

``[sweep.grid]`` maps parameter names to lists (their product is the set of
configurations), or ``[[sweep.points]]`` lists configurations; ``reps = N``
repeats each. Every configuration x repetition becomes a chain of its own,
named ``NAME-<8 hex digits of the params' hash>-r<rep>`` (stable: the same
configuration submitted again has the same name), with its own checkpoint
directory. Placeholders (``{param}``, ``{name}``, ``{rep}``) are filled in by
one renderer (``render``), in one pass (a value that holds ``{other}`` stays as
it is): in the command (shell-quoted), ``[env]`` values, ``[scheduler] options``
and the paths (``workdir``, ``checkpoint_dir``, ``tensorboard_dir``, ``progress``;
a value there is one directory name). An unknown name is an error; ``{{`` and
``}}`` write a brace, and ``${VAR}`` or shell brace expansion stay as they are.
The command also gets each value as ``CHAINRUN_PARAM_<NAME>``, ``CHAINRUN_PARAMS``
(JSON) and ``CHAINRUN_REP`` in its environment; without a placeholder of its own
in ``checkpoint_dir``, ``/{name}`` is added to it. Each chain also gets its own
seed (``CHAINRUN_SEED``): from the sweep's name, the configuration and the repetition, so the
same chain submitted again gets the same one, and no two chains of a sweep share one.
"""

from __future__ import annotations

import difflib
import hashlib
import itertools
import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, Optional, Tuple  # noqa: UP035

from chainrun.errors import JobFileError
from chainrun.model import SEED_LIMIT, JobSpec, seed_of
from chainrun.text import quote

PARAM_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
RESERVED = ("name", "rep")  # placeholders chainrun fills in: never a parameter's name
MAX_CHAINS = 100_000  # refused beyond this: a typo in a grid, not a sweep anyone can run
# One pass over a template: an escaped brace, bash's ${...} (left alone), or a placeholder.
_TOKEN = re.compile(r"\{\{|\}\}|\$\{[^{}]*\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")
_ESCAPES = {"{{": "{", "}}": "}"}
_HASH_DIGITS = 8
_SUFFIX_RESERVE = 1 + _HASH_DIGITS + 2  # "-" hash "-r", then the rep's digits

# (name, value as JSON) in the job file's order; typing's Tuple: the carrier runs on Python 3.8
Config = Tuple[Tuple[str, str], ...]  # noqa: UP006


def param_text(value_json: str) -> str:
    """A sweep parameter's value as the command and environment see it: a string as it
    is, anything else as in JSON (``0.1``, ``true``)."""
    value = json.loads(value_json)
    return value if isinstance(value, str) else value_json


def configurations(
    grid: Mapping[str, Sequence[Any]], points: Sequence[Mapping[str, Any]]
) -> Iterator[Config]:
    """The configurations of a grid (its product) or a list of points, values as JSON."""
    if points:
        for point in points:
            yield tuple((k, json.dumps(v)) for k, v in point.items())
        return
    names = list(grid)
    for values in itertools.product(*(grid[n] for n in names)):
        yield tuple((n, json.dumps(v)) for n, v in zip(names, values))


def count(grid: Mapping[str, Sequence[Any]], points: Sequence[Mapping[str, Any]], reps: int) -> int:
    """How many chains a sweep makes, without making them."""
    configs = len(points) if points else 1
    if not points:
        for values in grid.values():
            configs *= len(values)
    return configs * reps


def digest(config: Config) -> str:
    """The short, stable hash that names a configuration (its names and values, sorted)."""
    canonical = json.dumps({k: json.loads(v) for k, v in config}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:_HASH_DIGITS]


def max_base_name(reps: int) -> int:
    """The longest sweep name whose chains' names still fit the 64 characters allowed."""
    return 64 - _SUFFIX_RESERVE - len(str(max(0, reps - 1)))


def expand(spec: JobSpec) -> list[JobSpec]:
    """One spec per configuration x repetition, its placeholders filled in; a spec without a
    sweep is itself, with ``{name}`` and escaped braces filled in."""
    if not spec.sweep:
        return [_rendered(spec, {"name": spec.name})]
    out = []
    seeds: set[int] = set()
    for config in spec.sweep:
        for rep in range(spec.reps):
            # 32 bits can coincide (among 100,000 chains, about once): the later one moves on.
            seed = seed_of(spec.name, digest(config), str(rep))
            while seed in seeds:
                seed = (seed + 1) % SEED_LIMIT
            seeds.add(seed)
            out.append(_one(spec, config, rep, seed))
    return out


def render(template: str, values: Mapping[str, str], where: str, convert: Callable[[str], str] = str) -> str:
    """``template`` with each ``{name}`` replaced by ``convert`` of its value, in one pass (a
    value holding ``{other}`` stays as it is). ``{{`` and ``}}`` write a brace; ``${VAR}`` and
    braces around anything but a name (``{a,b}``, ``{1..3}``, ``{ cmd; }``) stay as they are.
    An unknown name raises, naming it, ``where`` it is and the names known."""

    def one(m: re.Match[str]) -> str:
        token, key = m.group(0), m.group(1)
        if key is None:
            return _ESCAPES.get(token, token)
        if key not in values:
            raise JobFileError(_unknown(key, values, where))
        return convert(values[key])

    return _TOKEN.sub(one, template)


def _unknown(key: str, values: Mapping[str, str], where: str) -> str:
    close = difflib.get_close_matches(key, list(values), n=1)
    hint = f" (did you mean {{{close[0]}}}?)" if close else ""
    known = ", ".join(f"{{{k}}}" for k in values)
    literal = "write {{ or }} for a literal brace"
    return f"{where} uses {{{key}}}, which is unknown{hint}; known: {known}; {literal}"


def _rendered(spec: JobSpec, values: Mapping[str, str], checkpoint_dir: Optional[str] = None) -> JobSpec:
    """``spec`` with every field that takes placeholders filled in from ``values``: the command
    (each value shell-quoted), ``[env]`` values and ``[scheduler] options`` (as they are), and
    the paths (each value one directory name)."""
    source = spec.source or "the job file"

    def path(key: str, template: str) -> str:
        def part(value: str) -> str:
            if "/" in value or value in ("", ".", "..") or not value.isprintable():
                raise JobFileError(
                    f"{source}: {key} uses a placeholder whose value {value!r} cannot be part of "
                    "a directory name; use other parameters, or {name}"
                )
            return value

        return render(template, values, f"{source}: {key}", part)

    def option(value: str) -> str:
        # A directive line is read by the scheduler itself: a line break would start another.
        if not value.isprintable():
            raise JobFileError(
                f"{source}: scheduler.options uses a placeholder whose value {value!r} is not one "
                "line of printable characters"
            )
        return value

    return replace(
        spec,
        command=render(spec.command, values, f"{source}: command", quote),
        env=tuple((k, render(v, values, f"{source}: env.{k}")) for k, v in spec.env),
        scheduler=replace(
            spec.scheduler,
            options=tuple(
                render(o, values, f"{source}: scheduler.options", option) for o in spec.scheduler.options
            ),
        ),
        workdir=path("workdir", spec.workdir),
        checkpoint_dir=path("checkpoint_dir", checkpoint_dir or spec.checkpoint_dir),
        tensorboard_dir=path("tensorboard_dir", spec.tensorboard_dir),
        progress_file=path("progress", spec.progress_file) if spec.progress_file else spec.progress_file,
    )


def check(spec: JobSpec) -> None:
    """Refuse a placeholder that names nothing, in any field that takes them, before any chain
    is made: with each set of names the sweep's configurations have (points may differ)."""
    for names in dict.fromkeys(tuple(k for k, _ in config) for config in spec.sweep or [()]):
        known = [*names, "name", "rep"] if spec.sweep else ["name"]
        _rendered(spec, dict.fromkeys(known, "x"))


def placeholders(template: str) -> list[str]:
    """The names ``template`` uses as placeholders."""
    return [m.group(1) for m in _TOKEN.finditer(template) if m.group(1)]


def _one(spec: JobSpec, config: Config, rep: int, seed: int) -> JobSpec:
    name = f"{spec.name}-{digest(config)}-r{rep}"
    values = {**{k: param_text(v) for k, v in config}, "name": name, "rep": str(rep)}
    checkpoint_dir = spec.checkpoint_dir
    # Its own placeholders, not the workdir's it sits in: without any, each chain its own directory.
    workdir = spec.workdir.rstrip("/") + "/"
    own = checkpoint_dir[len(workdir) :] if checkpoint_dir.startswith(workdir) else checkpoint_dir
    if not placeholders(own):
        checkpoint_dir = f"{checkpoint_dir.rstrip('/')}/{{name}}"
    return replace(
        _rendered(spec, values, checkpoint_dir),
        name=name,
        sweep=(),
        reps=1,
        sweep_name=spec.name,
        params=config,
        rep=rep,
        seed=seed,
    )
