"""Sweeps: one job file, many chains (``[sweep]``).

``[sweep.grid]`` maps parameter names to lists (their product is the set of
configurations), or ``[[sweep.points]]`` lists configurations; ``reps = N``
repeats each. Every configuration x repetition becomes a chain of its own,
named ``NAME-<8 hex digits of the params' hash>-r<rep>`` (stable: the same
configuration submitted again has the same name), with its own checkpoint
directory. The command gets each value as a ``{param}`` placeholder,
substituted shell-quoted in one pass (a value that holds ``{other}`` stays as
it is), and as ``CHAINRUN_PARAM_<NAME>``, ``CHAINRUN_PARAMS`` (JSON) and
``CHAINRUN_REP`` in its environment; ``checkpoint_dir`` may use ``{name}``,
``{rep}`` and ``{param}`` (without any, ``/{name}`` is added). Each chain also gets its own
seed (``CHAINRUN_SEED``): from the sweep's name, the configuration and the repetition, so the
same chain submitted again gets the same one, and no two chains of a sweep share one.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from chainrun.errors import JobFileError
from chainrun.model import SEED_LIMIT, JobSpec, seed_of
from chainrun.text import quote

PARAM_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_CHAINS = 100_000  # refused beyond this: a typo in a grid, not a sweep anyone can run
_PLACEHOLDER = re.compile(r"(?<!\$)\{([A-Za-z_][A-Za-z0-9_]*)\}")  # {lr}, never bash's ${lr}
_HASH_DIGITS = 8
_SUFFIX_RESERVE = 1 + _HASH_DIGITS + 2  # "-" hash "-r", then the rep's digits

Config = tuple[tuple[str, str], ...]  # (name, value as JSON) in the job file's order


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
    """One spec per configuration x repetition; a spec without a sweep is itself."""
    if not spec.sweep:
        return [spec]
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


def _one(spec: JobSpec, config: Config, rep: int, seed: int) -> JobSpec:
    name = f"{spec.name}-{digest(config)}-r{rep}"
    values = {k: param_text(v) for k, v in config}

    def in_command(m: re.Match[str]) -> str:
        key = m.group(1)
        return quote(values[key]) if key in values else m.group(0)

    path_values = {**values, "name": name, "rep": str(rep)}

    def in_path(m: re.Match[str]) -> str:
        key = m.group(1)
        if key not in path_values:
            return m.group(0)
        value = path_values[key]
        if "/" in value or value in ("", ".", ".."):
            raise JobFileError(
                f"{spec.source}: checkpoint_dir uses {{{key}}}, whose value {value!r} cannot be part "
                "of a directory name; use other parameters, or {name}"
            )
        return value

    checkpoint_dir = _PLACEHOLDER.sub(in_path, spec.checkpoint_dir)
    if checkpoint_dir == spec.checkpoint_dir:  # no placeholder: each chain its own directory anyway
        checkpoint_dir = f"{spec.checkpoint_dir.rstrip('/')}/{name}"
    return replace(
        spec,
        name=name,
        command=_PLACEHOLDER.sub(in_command, spec.command),
        checkpoint_dir=checkpoint_dir,
        sweep=(),
        reps=1,
        sweep_name=spec.name,
        params=config,
        rep=rep,
        seed=seed,
    )
