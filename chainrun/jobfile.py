"""Job files on this machine: read one, validate it (``schema``), and check it against this
machine, which only it can tell: the workdir is a directory, the checkpoint directory is one
or can be made, the container image is there and a runtime on PATH runs it, and the code of
a snapshot chain is in a git repository.

A chain on another host (``scheduler.host`` or ``hosts``) is not checked against this
machine's directories: its paths are the cluster's. Its container is checked where it runs
(``where_it_runs``, at check and submit): the runtime on that machine's PATH, the image there.
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional

from chainrun import container, schema, snapshot, sweep
from chainrun.errors import JobFileError, TransportError
from chainrun.fields import Fields, file_kind, path_shown, read_toml, why
from chainrun.model import JobSpec
from chainrun.text import quote
from chainrun.transport import Transport, transport_for


def load(
    path: str | os.PathLike[str],
    environ: Optional[Mapping[str, str]] = None,
    edit: Optional[Callable[[dict[str, Any]], dict[str, Any]]] = None,
) -> JobSpec:
    """Read and validate the job file at ``path``; ``inherit_env`` is taken from ``environ``
    (default: this process's environment, the shell that submits). ``edit`` changes the
    document before it is validated (the Python API's ``params`` and ``reps``)."""
    p = Path(path)
    try:
        data = read_toml(p, "a job file")
    except FileNotFoundError:
        raise JobFileError(f"{path_shown(p)}: no such job file") from None
    if edit is not None:
        data = edit(data)
    try:
        base = p.resolve().parent
    except (OSError, RuntimeError) as exc:  # it changed under us since it was read
        raise JobFileError(f"{path_shown(p)}: cannot resolve the job file's directory: {exc}") from None
    return parse(data, str(p), base=base, environ=os.environ if environ is None else environ)


def parse(
    data: dict[str, Any], path: str, base: Path, environ: Optional[Mapping[str, str]] = None
) -> JobSpec:
    """Validate an already-parsed TOML document (``schema.parse``) and check it against this
    machine. Paths on this machine (no ``scheduler.host``) must be usable: the workdir a
    directory; the checkpoint directory missing (the wrapper makes it) or a directory."""
    spec = schema.parse(data, path, base, environ)
    spec = replace(spec, source=str(Path(path).resolve()) if path else "")
    f = Fields(path, data)
    remote = spec.scheduler.remote
    templated = bool(sweep.placeholders(spec.workdir))
    if spec.snapshot and templated:
        raise f.error("snapshot", "needs one workdir for all chains; take the placeholders out of workdir")
    if not remote:
        # A workdir of placeholders is each chain's own, made at its first segment: its
        # directory above the first placeholder must be there.
        fixed = os.path.dirname(spec.workdir[: spec.workdir.find("{")]) if templated else spec.workdir
        _local_dir(f, "workdir", fixed, must_exist=True)
        _local_dir(f, "checkpoint_dir", spec.checkpoint_dir, must_exist=False)
        spec = _container(f, spec, environ or {})
    if spec.snapshot and snapshot.repository(snapshot.source_dir(spec)) is None:
        where = "the job file's directory" if remote else "workdir"
        raise f.error("snapshot", f"{where} {snapshot.source_dir(spec)} is not inside a git repository")
    return spec


def detect_runtime(environ: Mapping[str, str]) -> Optional[str]:
    """The first container runtime found on ``environ``'s PATH (Charliecloud first), or None."""
    path = environ.get("PATH", os.defpath)
    return next(
        (name for name, program in container.RUNTIMES.items() if shutil.which(program, path=path)), None
    )


def image_problem(spec: JobSpec) -> Optional[str]:
    """What stops a Charliecloud image directory on this machine from holding the bind mounts:
    ch-run mounts only at paths the image has (or under its /tmp, which is the host's), unless
    it may write the image (``-w``). None when nothing does, or it cannot be known here."""
    image = spec.container
    if spec.container_runtime != "charliecloud" or not image or not os.path.isdir(image):
        return None
    options = set(spec.container_options)
    if options & {"-w", "--write"}:
        return None
    host_tmp = not options & {"-t", "--private-tmp"}
    for directory in container.binds(spec):
        if os.path.isdir(os.path.join(image, directory.lstrip("/"))):
            continue
        if host_tmp and container.within(directory, "/tmp"):
            continue
        return (
            f"the image has no {directory} to bind it at: make it there "
            f"(mkdir -p {os.path.join(image, directory.lstrip('/'))}), "
            'or let ch-run make it with container_options = ["-w"]'
        )
    return None


def _container(f: Fields, spec: JobSpec, environ: Mapping[str, str]) -> JobSpec:
    """A container image on this machine is there, and a runtime runs it: the one the job
    file names, else the first found on PATH."""
    image = spec.container
    if image is None:
        return spec
    if "://" not in image and not os.path.exists(image):
        raise f.error("container", f"{path_shown(image)}: no such image; give the image's path")
    if not spec.container_runtime:
        runtime = detect_runtime(environ)
        if runtime is None:
            raise f.error(
                "container",
                "no container runtime on PATH (ch-run, apptainer or singularity): load or install one "
                "(module load charliecloud?), or set container_runtime",
            )
        spec = replace(spec, container_runtime=runtime)
    problem = image_problem(spec)
    if problem:
        raise f.error("container", problem)
    return spec


# The segment runner's interpreter, as a segment's shell finds it.
_PYTHON_PROBE = (
    "python3 -c 'import sys; sys.exit(sys.version_info < (3, 8))' >/dev/null 2>&1 || echo no-python3"
)


_SCRIPT_SUFFIXES = (".py", ".sh", ".bash", ".R", ".jl", ".pl")
_REDIRECTS = ("<", ">", ">>", ">&", "&>", "<<", "<<<")


def scripts_named(command: str) -> list[str]:
    """The script files a command names (``python3 train.py``, ``bash run.sh``, ``torchrun
    --nproc-per-node 4 x.py``, ``./go``), as written: each word that ends in a script's suffix
    or starts with ``./``, but not one the shell makes (``$``, ``*``, ``~``, braces), one a
    redirection writes or reads, the code of ``-c`` or the module of ``-m``, or an option's
    value; none at all for a command that changes directory first, where a relative path
    means something else."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError:
        return []
    if {"cd", "pushd"} & set(words):
        return []
    found = []
    for before, word in zip(["", *words], words):
        if before in _REDIRECTS or before in ("-c", "-m") or word.startswith("-") or "=" in word:
            continue
        if any(c in word for c in "$*?[]~{}`\\") or word in found:
            continue
        if word.endswith(_SCRIPT_SUFFIXES) or (word.startswith("./") and len(word) > 2):
            found.append(word)
    return found


def where_it_runs(spec: JobSpec, transports: Callable[[Optional[str]], Transport] = transport_for) -> None:
    """What a segment needs is there on each machine that runs the segments (the host, each
    host of a pool, else this one), as a segment's shell finds it: a ``python3`` for the
    segment runner, the container's runtime and image, and each script the command names
    (``scripts_named``; a snapshot chain's, in the repository it is taken from, on this
    machine). One probe through the transport each; JobFileError naming the machine when
    not; TransportError when one cannot be asked."""
    script, args = container.probe(spec) if spec.container else ("", [])
    scripts = [s for s in scripts_named(spec.command) if not (spec.container and s.startswith("/"))]
    if spec.snapshot:
        _scripts_there(spec, scripts, snapshot.source_dir(spec), "this machine", None)
        scripts = []
    elif scripts:
        # No. i of the scripts is missing: by number, so that no name's spaces split the answer.
        each = " ".join(quote(s) for s in scripts)
        look = f'i=0; for f in {each}; do [ -e "$f" ] || echo "no-script-$i"; i=$((i + 1)); done'
        script = (script + "; " if script else "") + f"(cd -- {quote(spec.workdir)} 2>/dev/null && {look})"
    argv = ["sh", "-c", f"{_PYTHON_PROBE}; {script}" if script else _PYTHON_PROBE, "probe", *args]
    for host in spec.scheduler.hosts or (spec.scheduler.host,):
        where = host or "this machine"
        result = transports(host).run(argv, timeout=60)
        if not result.ok:
            raise TransportError(f"cannot check {where}, where the segments run: {result.describe()}")
        if "no-python3" in result.stdout.split():
            raise JobFileError(
                f"{path_shown(spec.source)}: no python3 (3.8 or later) on PATH on {where}, where the "
                "segments run: the segment runner needs one; install it, or load its module in that "
                "login shell's profile"
            )
        problem = container.probe_problem(spec, result.stdout, where) if spec.container else None
        if problem:
            raise JobFileError(f"{path_shown(spec.source)}: container: {problem}")
        missing = [s for i, s in enumerate(scripts) if f"no-script-{i}" in result.stdout.split()]
        _scripts_there(spec, scripts, spec.workdir, where, missing)


def _scripts_there(
    spec: JobSpec, scripts: list[str], directory: str, where: str, missing: Optional[list[str]]
) -> None:
    """JobFileError for the first of ``scripts`` that is not in ``directory`` (on ``where``;
    ``missing``: as a probe there found, None: look here, on this machine)."""
    if missing is None:
        missing = [s for s in scripts if not os.path.exists(os.path.join(directory, s))]
    if missing:
        raise JobFileError(
            f"{path_shown(spec.source)}: command: {missing[0]} is not in {path_shown(directory)} on {where}, "
            "where the command runs; fix the command, or the workdir"
        )


def _local_dir(f: Fields, key: str, path: str, must_exist: bool) -> None:
    """``path`` on this machine is a directory; or, unless ``must_exist``, nothing yet."""
    at = f"{path_shown(path)}: " if path != f.table.get(key) else ""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if must_exist:
            raise f.error(key, f"{at}no such directory") from None
        if os.path.islink(path):
            raise f.error(key, f"{at}a symlink to nothing; the checkpoints could not be written") from None
        return  # the wrapper makes it
    except NotADirectoryError:
        raise f.error(key, f"{at}part of the path is a file, not a directory") from None
    except OSError as exc:  # a symlink loop, a name too long, no permission
        raise f.error(key, f"{at}cannot be used: {why(exc)}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise f.error(key, f"{at}{file_kind(st.st_mode)}, not a directory")
    if must_exist and not os.access(path, os.X_OK):
        raise f.error(key, f"{at}a directory this user may not enter")
