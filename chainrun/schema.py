"""The job file's schema: a TOML document in, a frozen ``JobSpec`` out, or one error line.

Validation is written out by hand rather than delegated to a schema library
so that every error reads the same way: the file, the field, the bad value,
and what is allowed. Unknown keys are errors: a typo must never be ignored.

Nothing here looks at a machine: whether the workdir exists, which container
runtime is on PATH, whether the code is in a git repository are checked by
``jobfile``, which reads a job file on this machine and validates it here.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from chainrun import container, sweep
from chainrun.errors import JobFileError
from chainrun.fields import Fields, format_duration, kib, path_shown, show, size, web_url
from chainrun.model import HOST_TIMEOUT, JobSpec, PlaceSpec, SchedulerSpec

SCHEDULER_KINDS = ("local", "slurm", "sge")
# INT is left out: bash starts background commands with SIGINT ignored.
SIGNALS = ("USR1", "USR2", "TERM")
# Every pattern is matched with fullmatch and spells its classes out in ASCII:
# ``$`` matches before a trailing newline, and ``\d``/``\w`` accept any script's
# digits and letters.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
ENV_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
KEY_PATH_RE = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*")  # progress = "FILE:a.b.c"
# No leading '-': a host or queue must never read as an option of ssh or sbatch.
HOST_RE = re.compile(r"[A-Za-z0-9_.@:\[\]][A-Za-z0-9_.@:\[\]-]*")
QUEUE_RE = re.compile(r"[A-Za-z0-9_.@,][A-Za-z0-9_.@,-]*")
# Bounds that keep a valid job file workable for its whole life (durations and strings are
# bounded in ``fields``): a command or variable past 128 KiB (Linux's MAX_ARG_STRLEN) makes
# every segment exit 126.
MAX_PATH_BYTES = 4096
MAX_OPTION_BYTES = 4096
MAX_OPTIONS = 256
MAX_URL_BYTES = 8192
MAX_TARGET_EPOCH = 10**9
MAX_FAILURES = 10**6
# The least a segment needs to start the command and save before it is killed. The shortest
# real start-and-save, python3 starting a stdlib script (tests/data/trainer.py) that writes
# one checkpoint, took 0.7-0.9 s on a loaded two-core machine; with the wrapper's own start
# that is the 2 s between a segment's start and its signal that the tests' shortest local
# segments (walltime 3s, grace 1s) have. A script importing torch needs far more: docs/resuming.md
# says how to make the clock first, and a segment the signal kills before it saved says so.
MIN_START = 2
# Seconds between the signal and the kill. The local runner, like Slurm at its limit, sends
# SIGTERM at the walltime and SIGKILL a while later (10 s; Slurm's KillWait, 30 s by default),
# and the helper saves on SIGTERM too: 1 s keeps the signal apart from that SIGTERM. SGE's
# h_rt kill is a SIGKILL with no warning, so the wrapper signals by its own timer, which reads
# the clock once a second (the signal may come a second late), and ends the command a second
# before the deadline: under 3 s no second is left to save.
MIN_GRACE = {"local": 1, "slurm": 1, "sge": 3}
# Slurm counts --time in whole minutes and checks limits every 30 s: a shorter walltime still
# takes a one-minute allocation, with the signal anywhere in it. SGE's h_rt counts seconds.
MIN_WALLTIME = {"local": 0, "slurm": 60, "sge": 0}

TOP_KEYS = (
    "name",
    "command",
    "workdir",
    "total_time",
    "walltime",
    "target_epoch",
    "max_failures",
    "checkpoint_dir",
    "signal",
    "grace",
    "on_end",
    "webhook",
    "scheduler",
    "cluster",
    "env",
    "inherit_env",
    "progress",
    "container",
    "container_runtime",
    "container_options",
    "container_gpus",
    "snapshot",
    "sweep",
    "tensorboard_dir",
    "self_queue",
    "tracking",
)
SCHEDULER_KEYS = ("kind", "host", "queue", "options", "hosts", "slots", "gpus_per_slot", "host_timeout")
# A [[cluster]] table: a scheduler table, its name, and what differs at that place.
PLACE_KEYS = ("name", "workdir", "checkpoint_dir", "walltime", "container")
MAX_PLACES = 16
PLACE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")  # a place's name: by default kind@host
# What other tools (sbatch, submitit, Hydra, Lightning) call a key of chainrun's: the error
# for one of these says what to write instead.
_PER_SEGMENT = 'walltime = "24h" (each segment; total_time: the whole run)'
TOP_ALIASES = {
    **dict.fromkeys(("time", "time_limit", "timeout", "timeout_min"), _PER_SEGMENT),
    **dict.fromkeys(("epochs", "max_epochs", "num_epochs", "n_epochs"), "target_epoch"),
    **dict.fromkeys(("retries", "max_retries", "max_restarts", "max_num_timeout"), "max_failures"),
    **dict.fromkeys(("cwd", "chdir", "working_dir", "working_directory"), "workdir"),
    **dict.fromkeys(("environment", "environ"), "env"),
    **dict.fromkeys(("image", "singularity", "apptainer"), "container"),
    **dict.fromkeys(("checkpoint", "checkpoints", "ckpt_dir", "ckpt_path", "output_dir"), "checkpoint_dir"),
    **{k: f"{k} in [scheduler]" for k in ("kind", "queue", "options", "host", "hosts")},
    "partition": 'queue = "NAME" in [scheduler] (the Slurm partition, the SGE queue)',
}
SCHEDULER_ALIASES = {
    "partition": 'queue = "NAME" (the Slurm partition, the SGE queue)',
    **dict.fromkeys(("type", "backend", "cluster", "scheduler"), 'kind = "slurm", "sge" or "local"'),
    **{
        k: f'options = ["--{k.replace("_", "-")}=..."], the scheduler\'s own options as on its command line'
        for k in (
            "account",
            "qos",
            "gres",
            "gpus",
            "gpus_per_node",
            "nodes",
            "ntasks",
            "ntasks_per_node",
            "cpus_per_task",
            "mem",
            "mem_per_cpu",
            "constraint",
            "reservation",
        )
    },
    **dict.fromkeys(("time", "walltime", "time_limit"), "walltime, at the top of the job file"),
}
TRACKERS = ("wandb", "mlflow")  # [tracking]: each sets its own variables (schedulers.segment, node.tracking)
TRACKING_ALIASES = {
    **dict.fromkeys(("w&b", "weights_and_biases", "weightsandbiases"), "wandb"),
    "ml_flow": "mlflow",
    "tensorboard": "none: name the log directory after $CHAINRUN_RUN_ID (docs: One run in the tracker)",
}
MAX_HOSTS = 1000  # hosts in a pool
MAX_SLOTS = 1024  # runs per host at once


# What makes the command findable and runnable as it is in the shell that submits:
# the chain takes these along, so the service's own environment does not decide.
INHERITED_BY_DEFAULT = (
    "PATH",
    "VIRTUAL_ENV",
    "CONDA_PREFIX",
    "CONDA_DEFAULT_ENV",
    "PYTHONPATH",
    "LD_LIBRARY_PATH",
    "MODULEPATH",
    "LOADEDMODULES",
)


def arg_budget() -> int:
    """Bytes the command and [env] may take: a quarter of the kernel's limit on a
    command's arguments and environment together, the rest left to the environment
    the job inherits and to the wrapper's own."""
    try:
        arg_max = os.sysconf("SC_ARG_MAX")
    except (ValueError, OSError):
        arg_max = -1
    return max(arg_max, 128 << 10) // 4


def parse(
    data: dict[str, Any], path: str, base: Path, environ: Optional[Mapping[str, str]] = None
) -> JobSpec:
    """Validate an already-parsed TOML document; relative paths start at ``base``, and
    ``inherit_env`` takes its values from ``environ``. The spec's ``source`` is ``path``
    as given; a container runtime not given is left "" for ``jobfile`` to find."""
    f = Fields(path, data)
    f.check_keys(TOP_KEYS, TOP_ALIASES)
    if "cluster" in data:
        return _places(f, base, environ)

    name = f.get("name", str, "a name of letters, digits, . _ -", required=True)
    f.checked(
        "name",
        name,
        NAME_RE.fullmatch,
        "use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit",
    )
    command = f.get("command", str, "the shell command that trains", required=True)
    f.checked("command", command, lambda c: c.strip(), "must not be empty")

    total_time = f.duration("total_time", required=True)
    shortest, walltime = f.duration_range("walltime")
    if walltime > total_time:
        raise f.error(
            "walltime",
            f"longer than total_time ({format_duration(total_time)}); make walltime at most total_time",
        )
    target_epoch = f.get("target_epoch", int, "a whole number of epochs")
    f.checked("target_epoch", target_epoch, lambda v: v >= 1, "must be 1 or more")
    f.checked("target_epoch", target_epoch, lambda v: v <= MAX_TARGET_EPOCH, f"at most {MAX_TARGET_EPOCH}")
    max_failures = f.get("max_failures", int, "a whole number", default=3)
    f.checked("max_failures", max_failures, lambda v: v >= 0, "must be 0 or more")
    f.checked("max_failures", max_failures, lambda v: v <= MAX_FAILURES, f"at most {MAX_FAILURES}")

    signal = f.get("signal", str, "a signal name: " + ", ".join(SIGNALS), default="USR1", max_bytes=64)
    signal = signal.upper()
    signal = signal[3:] if signal.startswith("SIG") else signal  # not removeprefix: Python 3.8 runs this
    if signal not in SIGNALS:
        raise f.error("signal", "allowed: " + ", ".join(SIGNALS))
    grace = f.duration("grace", default=default_grace(shortest))
    sched = _scheduler(path, f.get("scheduler", dict, "a table [scheduler]", default={}))
    _start_and_save(f, sched.kind, shortest, grace)
    remote = sched.remote
    workdir = _path(f, "workdir", ".", base, remote)
    checkpoint_dir = _path(f, "checkpoint_dir", "checkpoints", Path(workdir), remote)
    progress_file, progress_key = _progress(f, workdir, remote)
    tb = "tensorboard_dir"
    tensorboard_dir = _path(f, tb, ".", Path(workdir), remote) if tb in f.table else ""
    image, runtime, container_options, container_gpus = _container(f, base, remote)
    configs, reps, max_concurrent = _sweep(f, name)
    snap = f.get("snapshot", str, '"git" (run the code as it was at submit), or leave it out', max_bytes=16)
    f.checked("snapshot", snap, lambda v: v == "git", 'the only kind is "git"')

    env_table = f.get("env", dict, "a table [env] of NAME = value", default={})
    env = []
    fe = Fields(path, env_table, "env.")
    for key, value in env_table.items():
        fe.checked(key, key, ENV_RE.fullmatch, "not a valid environment variable name")
        fe.checked(
            key,
            key,
            lambda k: not k.startswith("CHAINRUN_"),
            "names starting with CHAINRUN_ are set by chainrun",
        )
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise fe.error(key, "expected a string or number")
        if isinstance(value, str):
            fe.text(key, value)
        env.append((key, str(value)))
    default = () if remote else INHERITED_BY_DEFAULT  # a remote cluster's PATH is not this shell's
    names = f.get("inherit_env", list, "a list of environment variable names", default=list(default))
    for name_ in names:
        f.checked("inherit_env", name_, lambda n: isinstance(n, str) and ENV_RE.fullmatch(n), "not a name")
        f.checked("inherit_env", name_, lambda n: not n.startswith("CHAINRUN_"), "set by chainrun")
    environ = environ or {}
    inherited = tuple((n, environ[n]) for n in dict.fromkeys(names) if n in environ)
    # The command is one argument of `bash -c` and each variable one string of
    # the job's environment: together they must fit the kernel's limit.
    used = size(command) + sum(size(k) + size(v) + 2 for k, v in (*env, *inherited))
    budget = arg_budget()
    if used > budget:
        raise f.error(
            "env" if env else "command",
            f"the command and [env] come to {used} bytes; at most {budget} fit the "
            "kernel's limit on a command's arguments and environment, with room to spare",
        )

    on_end = f.get("on_end", str, "a shell command run when the chain ends")
    f.checked("on_end", on_end, lambda c: c.strip(), "must be a non-empty command")
    webhook = f.get("webhook", str, "an http:// or https:// URL", max_bytes=MAX_URL_BYTES)
    f.checked("webhook", webhook, web_url, "must be an http:// or https:// URL with a valid host")
    tracking = _tracking(f)
    self_queue = f.get(
        "self_queue",
        bool,
        "true (segments queue their successor while the service is away) or false",
        default=True,
    )

    spec = JobSpec(
        name=name,
        command=command,
        workdir=workdir,
        total_time=total_time,
        walltime=walltime,
        walltime_min=shortest if shortest < walltime else 0,
        target_epoch=target_epoch,
        max_failures=max_failures,
        checkpoint_dir=checkpoint_dir,
        progress_file=progress_file,
        progress_key=progress_key,
        container=image,
        container_runtime=runtime,
        container_options=container_options,
        container_gpus=container_gpus,
        snapshot=snap or "",
        tensorboard_dir=tensorboard_dir,
        tracking=tracking,
        sweep=configs,
        reps=reps,
        max_concurrent=max_concurrent,
        signal=signal,
        grace=grace,
        # SIGTERM is never held back (it may be a preemption): the scheduler's comes at the default.
        adaptive_grace="grace" not in f.table and signal != "TERM",
        scheduler=sched,
        env=tuple(env),
        inherit_env=tuple(dict.fromkeys(names)),
        inherited=inherited,
        on_end=on_end,
        webhook=webhook,
        source=path,
        self_queue=self_queue,
    )
    sweep.check(spec)
    return spec


def _places(f: Fields, base: Path, environ: Optional[Mapping[str, str]]) -> JobSpec:
    """A job file with ``[[cluster]]`` tables: each place is read as the job file with that
    table for its ``[scheduler]`` and the table's workdir, checkpoint_dir, container and
    walltime limit for the job file's, so that every rule holds at every place; an error
    names the table (``cluster[N].KEY``). One table is exactly a ``[scheduler]``."""
    data = f.table
    if "scheduler" in data:
        raise JobFileError(
            f"{path_shown(f.path)}: both [scheduler] and [[cluster]]; give either [scheduler] (one place) "
            "or [[cluster]] tables (several places), not both"
        )
    tables = data["cluster"]
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise f.error("cluster", "expected [[cluster]] tables, each a scheduler table as [scheduler] is")
    if len(tables) > MAX_PLACES:
        raise f.error("cluster", f"{len(tables)} places; at most {MAX_PLACES}")
    if len(tables) > 1 and "sweep" in data:
        raise f.error(
            "sweep", "a sweep cannot yet run at several places; give one [[cluster]] or [scheduler]"
        )
    shortest, longest = f.duration_range("walltime")
    grace = {"grace": f.table["grace"]} if "grace" in f.table else {"grace": f"{default_grace(shortest)}s"}
    specs: list[JobSpec] = []
    names: dict[str, int] = {}
    for i, table in enumerate(tables, 1):
        fc = Fields(f.path, table, f"cluster[{i}].")
        fc.check_keys(SCHEDULER_KEYS + PLACE_KEYS, SCHEDULER_ALIASES)
        view = {k: v for k, v in data.items() if k != "cluster"}
        view["scheduler"] = {k: v for k, v in table.items() if k in SCHEDULER_KEYS}
        view.update({k: table[k] for k in ("workdir", "checkpoint_dir", "container") if k in table})
        limit = fc.duration("walltime")
        if limit is not None and limit < longest:
            low = min(shortest, limit)
            view["walltime"] = f"{low}s..{limit}s" if low < limit else f"{limit}s"
        view.update(grace if len(tables) > 1 else {})
        try:
            spec = parse(view, f.path, base, environ)
        except JobFileError as exc:
            raise JobFileError(_at_place(str(exc), f.path, i, table)) from None
        kind, host = spec.scheduler.kind, spec.scheduler.host
        name = fc.get(
            "name", str, "a name for this place", default=f"{kind}@{host}" if host else kind, max_bytes=64
        )
        fc.checked("name", name, PLACE_RE.fullmatch, "use 1-64 letters, digits, '.', '_', '@' or '-'")
        if name in names:
            raise fc.error(
                "name", f'cluster[{names[name]}] is named {name} too; give each place a name = "..."'
            )
        names[name] = i
        specs.append(replace(spec, place=name))
    if len(specs) == 1:
        return replace(specs[0], place="")
    first = specs[0]
    places = tuple(
        PlaceSpec(s.place, s.scheduler, s.workdir, s.checkpoint_dir, s.walltime, s.container) for s in specs
    )
    return replace(
        first, places=places, place="", adaptive_grace="grace" not in f.table and first.signal != "TERM"
    )


def _at_place(message: str, path: str, i: int, table: dict[str, Any]) -> str:
    """An error of the job file as read at place ``i`` (``_places``), naming that place's table:
    ``scheduler.KEY`` is ``cluster[i].KEY``, and so is a key the table gave."""
    head = f"{path_shown(path)}: "
    if not message.startswith(head):
        return message
    rest = message[len(head) :]
    unknown = "unknown key "
    lead = unknown if rest.startswith(unknown) else ""
    rest = rest[len(lead) :]
    if rest.startswith("scheduler."):
        rest = f"cluster[{i}]." + rest[len("scheduler.") :]
    elif rest.split(" ", 1)[0].split(":", 1)[0] in table:
        rest = f"cluster[{i}]." + rest
    return head + lead + rest.replace("scheduler.host", f"cluster[{i}].host")


def default_grace(walltime: int) -> int:
    """The grace a job file without one gets: a quarter of the walltime, at most 5 minutes
    (and, made adaptive, the most its segments get: decide/grace.py)."""
    return max(1, min(300, walltime // 4))


def _start_and_save(f: Fields, kind: str, walltime: int, grace: int) -> None:
    """Refuse a walltime and grace that leave too little time to start the command, or to
    save between the signal and the kill, on scheduler ``kind``."""
    least = MIN_WALLTIME[kind]
    if walltime < least:
        raise f.error(
            "walltime",
            f"too short for {kind}, which counts walltime in whole minutes; "
            f"at least {format_duration(least)}",
        )
    if grace >= walltime:
        raise f.error(
            "grace",
            f"must be shorter than walltime ({format_duration(walltime)}): "
            "it is how long before the walltime the signal is sent",
        )
    least = MIN_GRACE[kind]
    if grace < least:
        shown = (
            "" if "grace" in f.table else f" (the default: a quarter of walltime, {format_duration(grace)})"
        )
        raise f.error(
            "grace",
            f"too short{shown} to save between the signal and the kill on {kind}; "
            f"at least {format_duration(least)}",
        )
    if walltime - grace < MIN_START:
        raise f.error(
            "walltime",
            f"leaves {format_duration(walltime - grace)} before the signal (grace {format_duration(grace)}) "
            f"to start the command; at least {format_duration(grace + MIN_START)}, or a shorter grace",
        )


def _path(f: Fields, key: str, default: str, base: Path, remote: bool) -> str:
    raw = f.get(key, str, "a directory path", default=default, max_bytes=MAX_PATH_BYTES)
    f.checked(key, raw, lambda v: v.strip(), "must be a non-empty path")
    return _resolve(f, key, raw, base, remote)


def _progress(f: Fields, workdir: str, remote: bool) -> tuple[Optional[str], str]:
    """``progress = "FILE:KEY"``: the script's own JSON file (relative to the workdir) and
    the dotted key of its epoch; ``(None, "")`` when the job file has none."""
    raw = f.get(
        "progress", str, 'a JSON file and the key of its epoch, "FILE.json:KEY"', max_bytes=MAX_PATH_BYTES
    )
    if raw is None:
        return None, ""
    file, colon, key = raw.rpartition(":")
    if not colon or not file.strip() or not KEY_PATH_RE.fullmatch(key):
        raise f.error(
            "progress",
            'expected "FILE.json:KEY": the JSON file your script writes, a colon, and the key that '
            'holds the epoch (dotted for a nested one, as in "state.json:meta.epoch")',
        )
    return _resolve(f, "progress", file, Path(workdir), remote), key


def _resolve(f: Fields, key: str, raw: str, base: Path, remote: bool) -> str:
    """``raw`` as an absolute path: ``~`` expanded on this machine, a relative one from ``base``."""
    if remote and raw.startswith("~"):
        raise f.error(
            key,
            "with scheduler.host (or hosts) set, '~' is not expanded: give an absolute path on the cluster",
        )
    try:
        p = Path(raw).expanduser() if not remote else Path(raw)
    except RuntimeError:  # ~nosuchuser, or ~ with no home directory known
        raise f.error(
            key, "cannot expand '~': no such user or home directory; give an absolute path"
        ) from None
    if p.is_absolute():
        return str(p)
    if remote and key == "workdir":
        raise f.error(key, "with scheduler.host (or hosts) set, give an absolute path on the cluster")
    return os.path.normpath(base / p)


def _tracking(f: Fields) -> tuple[str, ...]:
    """``[tracking]``: ``TRACKER = true`` for each tracker that continues one run per chain."""
    table = f.get("tracking", dict, "a table [tracking] of TRACKER = true", default={})
    ft = Fields(f.path, table, "tracking.")
    ft.check_keys(TRACKERS, TRACKING_ALIASES)
    return tuple(k for k in TRACKERS if ft.get(k, bool, "true or false", default=False))


def _scheduler(path: str, table: dict[str, Any]) -> SchedulerSpec:
    f = Fields(path, table, "scheduler.")
    f.check_keys(SCHEDULER_KEYS, SCHEDULER_ALIASES)
    kind = f.get("kind", str, "one of " + ", ".join(SCHEDULER_KINDS), default="local", max_bytes=64)
    f.checked("kind", kind, SCHEDULER_KINDS.__contains__, "allowed: " + ", ".join(SCHEDULER_KINDS))
    host = f.get("host", str, "an ssh host or ~/.ssh/config alias", max_bytes=255)
    f.checked("host", host, HOST_RE.fullmatch, "not a host name")
    queue = f.get("queue", str, "a partition or queue name", max_bytes=255)
    f.checked("queue", queue, QUEUE_RE.fullmatch, "not a queue name")
    options = _options(f, "options", '["--mem=16G"]')
    if kind == "local":
        for key in ("queue", "options"):
            if key in table:
                raise f.error(
                    key, 'only applies to kind = "slurm" or "sge"; the local runner has no queues or options'
                )
    else:
        for key in ("hosts", "slots", "gpus_per_slot", "host_timeout"):
            if key in table:
                raise f.error(
                    key, f'only applies to kind = "local" (a pool of machines); {kind} places jobs itself'
                )
    hosts = f.get("hosts", list, 'a list of ssh hosts or ~/.ssh/config aliases, e.g. ["gpu1", "gpu2"]')
    if hosts is not None:
        if host is not None:
            raise f.error("hosts", "give either host (one machine) or hosts (a pool), not both")
        if not hosts or len(hosts) > MAX_HOSTS:
            raise f.error("hosts", f"give 1 to {MAX_HOSTS} hosts")
        for one in hosts:
            if not isinstance(one, str) or len(one) > 255 or not HOST_RE.fullmatch(one):
                raise f.error("hosts", f"{show(one)} is not a host name")
        if len(set(hosts)) != len(hosts):
            raise f.error("hosts", "names a host twice")
    slots = f.get("slots", int, "a whole number of runs per host at once, e.g. 1 (one per GPU)")
    f.checked("slots", slots, lambda v: 1 <= v <= MAX_SLOTS, f"must be 1 to {MAX_SLOTS}")
    gpus = f.get("gpus_per_slot", int, "a whole number of GPUs per run, e.g. 1")
    f.checked("gpus_per_slot", gpus, lambda v: 1 <= v <= MAX_SLOTS, f"must be 1 to {MAX_SLOTS}")
    if hosts and slots is None:
        slots = 1  # a pool runs one segment per host at a time unless told otherwise
    if gpus is not None and slots is None:
        raise f.error("gpus_per_slot", "needs slots (how many runs share the host's GPUs)")
    host_timeout = f.duration("host_timeout", HOST_TIMEOUT)
    if "host_timeout" in table and not hosts:
        raise f.error("host_timeout", "needs hosts (a pool: how long one of them may not answer)")
    return SchedulerSpec(
        kind=kind,
        host=host or None,
        queue=queue,
        options=options,
        hosts=tuple(hosts or ()),
        slots=slots,
        gpus_per_slot=gpus,
        host_timeout=host_timeout,
    )


def _sweep(f: Fields, name: str) -> tuple[tuple[sweep.Config, ...], int, Optional[int]]:
    """``[sweep]``: its configurations (grid or points), repetitions and ``max_concurrent``;
    ``((), 1, None)`` without."""
    table = f.get("sweep", dict, "a table [sweep] with grid or points, and reps")
    if table is None:
        return (), 1, None
    fs = Fields(f.path, table, "sweep.")
    fs.check_keys(("grid", "points", "reps", "max_concurrent"))
    grid = fs.get("grid", dict, "a table [sweep.grid] of NAME = [values]", default={})
    points = fs.get("points", list, "a list of tables [[sweep.points]]", default=[])
    if bool(grid) == bool(points):
        raise f.error("sweep", "give either [sweep.grid] (NAME = [values], all combined) or [[sweep.points]]")
    reps = fs.get("reps", int, "a whole number of repetitions", default=1)
    fs.checked("reps", reps, lambda v: 1 <= v <= sweep.MAX_CHAINS, f"must be 1 to {sweep.MAX_CHAINS}")
    limit = fs.get("max_concurrent", int, "a whole number of chains under way at once", default=None)
    if limit is not None:
        fs.checked("max_concurrent", limit, lambda v: v >= 1, "must be at least 1")
    fg = Fields(f.path, grid, "sweep.grid.")
    for key, values in grid.items():
        fg.checked(key, key, sweep.PARAM_RE.fullmatch, "a parameter name is letters, digits and _")
        fg.checked(key, key, lambda k: k not in sweep.RESERVED, "{name} and {rep} are chainrun's")
        if not isinstance(values, list) or not values:
            raise fg.error(key, "expected a non-empty list of values")
        for value in values:
            _param_value(fg, key, value)
        if len({json.dumps(v) for v in values}) != len(values):
            raise fg.error(key, "a value is listed twice")
    for i, point in enumerate(points, 1):
        if not isinstance(point, dict) or not point:
            raise fs.error("points", f"point {i} is not a table of NAME = value")
        fp = Fields(f.path, point, f"sweep.points[{i}].")
        for key, value in point.items():
            fp.checked(key, key, sweep.PARAM_RE.fullmatch, "a parameter name is letters, digits and _")
            fp.checked(key, key, lambda k: k not in sweep.RESERVED, "{name} and {rep} are chainrun's")
            _param_value(fp, key, value)
    total = sweep.count(grid, points, reps)
    if total > sweep.MAX_CHAINS:
        raise f.error("sweep", f"{total} chains; at most {sweep.MAX_CHAINS} (is a grid larger than meant?)")
    longest = sweep.max_base_name(reps)
    if len(name) > longest:
        raise f.error("name", f"a sweep's name is at most {longest} characters: its chains add -HASH-rN")
    configs = tuple(sweep.configurations(grid, points))
    seen: dict[str, int] = {}
    for i, config in enumerate(configs, 1):
        first = seen.setdefault(sweep.digest(config), i)
        if first != i:
            raise fs.error("points", f"points {first} and {i} are the same configuration")
    return configs, reps, limit


def _param_value(f: Fields, key: str, value: Any) -> None:
    """A sweep value: a string, a whole number, a finite float or a boolean."""
    if isinstance(value, float) and not math.isfinite(value):
        raise f.error(key, "not a finite number")
    if not isinstance(value, (str, int, float, bool)):
        raise f.error(key, "a value is a string, number or boolean")
    if isinstance(value, str):
        f.text(key, value, MAX_OPTION_BYTES)


def _options(f: Fields, key: str, example: str) -> tuple[str, ...]:
    """A list of command-line options, each one printable line."""
    options = f.get(key, list, f"a list of strings, e.g. {example}", default=[])
    if len(options) > MAX_OPTIONS:
        raise f.error(key, f"{len(options)} options; at most {MAX_OPTIONS}")
    for opt in options:
        if isinstance(opt, str) and "\0" in opt:
            raise f.error(key, "must not contain NUL bytes")
        if not isinstance(opt, str) or not opt.strip() or not opt.isprintable():
            raise f.error(key, "each option must be a one-line string, free of control characters")
        if size(opt) > MAX_OPTION_BYTES:
            raise f.error(key, f"each option must be at most {kib(MAX_OPTION_BYTES)}")
    return tuple(options)


def _container(f: Fields, base: Path, remote: bool) -> tuple[Optional[str], str, tuple[str, ...], bool]:
    """``container``, its runtime ("" on this machine when not given: the machine's PATH
    decides, ``jobfile``), its options, and whether it gets the runtime's GPU option."""
    image = f.get(
        "container", str, "an image: a directory, a .sif or .sqfs file, or a URI", max_bytes=MAX_PATH_BYTES
    )
    runtime = f.get("container_runtime", str, "one of " + ", ".join(container.RUNTIMES), max_bytes=64)
    f.checked(
        "container_runtime",
        runtime,
        container.RUNTIMES.__contains__,
        "allowed: " + ", ".join(container.RUNTIMES),
    )
    options = _options(f, "container_options", '["--private-tmp"]')
    gpus = f.get("container_gpus", bool, "true or false", default=False)
    if image is None:
        for key in ("container_runtime", "container_options", "container_gpus"):
            if key in f.table:
                raise f.error(key, "only applies with container = IMAGE")
        return None, "", (), False
    f.checked("container", image, lambda v: v.strip(), "must name an image")
    if "://" not in image:  # a path; a URI (docker://, oras://, library://) the runtime pulls
        image = _resolve(f, "container", image, base, remote)
    if runtime is None and remote:
        raise f.error(
            "container",
            "with scheduler.host set, say which runtime: "
            'container_runtime = "charliecloud", "apptainer" or "singularity"',
        )
    return image, runtime or "", options, gpus
