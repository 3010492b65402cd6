"""Parse and validate a job file (TOML) into a frozen ``JobSpec``.

Validation is written out by hand rather than delegated to a schema library
so that every error reads the same way: the file, the field, the bad value,
and what is allowed. Unknown keys are errors: a typo must never be ignored.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from chainrun.errors import JobFileError
from chainrun.model import JobSpec, SchedulerSpec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on old Pythons only
    import tomli as tomllib

SCHEDULER_KINDS = ("local", "slurm", "sge")
# INT is left out: bash starts background commands with SIGINT ignored.
SIGNALS = ("USR1", "USR2", "TERM")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
DURATION_HELP = "a duration such as 90s, 45m, 4h, 2d, 1h30m, HH:MM:SS or D-HH:MM:SS"

_UNITS_RE = re.compile(r"^(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")
_CLOCK_RE = re.compile(r"^(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)$")

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
    "env",
)
SCHEDULER_KEYS = ("kind", "host", "queue", "options")


def parse_duration(text: str) -> int:
    """Seconds in ``text``; raises ValueError when it is not a duration."""
    s = text.strip().lower()
    m = _UNITS_RE.match(s)
    if s and m and any(m.groups()):
        d, h, mi, se = (int(g or 0) for g in m.groups())
        return ((d * 24 + h) * 60 + mi) * 60 + se
    m = _CLOCK_RE.match(s)
    if m:
        d, h, mi, se = (int(g or 0) for g in m.groups())
        if mi < 60 and se < 60:
            return ((d * 24 + h) * 60 + mi) * 60 + se
    raise ValueError(text)


def format_duration(seconds: float) -> str:
    """``5400`` -> ``1h30m``: the inverse of parse_duration for display."""
    s = round(seconds)
    if s <= 0:
        return "0s"
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if s >= size:
            parts.append(f"{s // size}{unit}")
            s %= size
    return "".join(parts)


class _Fields:
    """Reads fields out of one TOML table, raising errors that name them."""

    def __init__(self, path: str, table: dict[str, Any], prefix: str = "") -> None:
        self.path = path
        self.table = table
        self.prefix = prefix

    def error(self, key: str, problem: str) -> JobFileError:
        name = self.prefix + key
        if key in self.table:
            return JobFileError(f"{self.path}: {name} = {self.table[key]!r}: {problem}")
        return JobFileError(f"{self.path}: {name}: {problem}")

    def check_keys(self, allowed: tuple[str, ...]) -> None:
        for key in self.table:
            if key not in allowed:
                known = ", ".join(allowed)
                raise JobFileError(f"{self.path}: unknown key {self.prefix}{key!s}; allowed here: {known}")

    def get(
        self,
        key: str,
        kind: type,
        what: str,
        default: Any = None,
        required: bool = False,
    ) -> Any:
        if key not in self.table:
            if required:
                raise self.error(key, f"missing; give {what}")
            return default
        value = self.table[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.error(key, f"expected {what}")
        return value

    def duration(self, key: str, default: Optional[int] = None, required: bool = False) -> Any:
        raw = self.get(key, str, DURATION_HELP + ' (quoted, e.g. "4h")', required=required)
        if raw is None:
            return default
        try:
            seconds = parse_duration(raw)
        except ValueError:
            raise self.error(key, f"not a duration; use {DURATION_HELP}") from None
        if seconds <= 0:
            raise self.error(key, "must be longer than zero")
        return seconds

    def checked(self, key: str, value: Any, ok: Callable[[Any], object], problem: str) -> Any:
        if value is not None and not ok(value):
            raise self.error(key, problem)
        return value


def load(path: str | os.PathLike[str]) -> JobSpec:
    """Read and validate the job file at ``path``."""
    p = Path(path)
    try:
        data = read_toml(p, "a job file")
    except FileNotFoundError:
        raise JobFileError(f"{p}: no such job file") from None
    return parse(data, str(p), base=p.resolve().parent)


def read_toml(path: Path, what: str) -> dict[str, Any]:
    """``what`` (a job file, the service config) as TOML: FileNotFoundError passes
    through; any other trouble is one JobFileError line naming the file."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise JobFileError(f"{path}: cannot read {what}: {exc.strerror}") from None
    try:
        data: dict[str, Any] = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise JobFileError(f"{path}: not UTF-8 text; {what} is TOML") from None
    except tomllib.TOMLDecodeError as exc:
        raise JobFileError(f"{path}: not valid TOML: {exc}") from None
    return data


def parse(data: dict[str, Any], path: str, base: Path) -> JobSpec:
    """Validate an already-parsed TOML document; relative paths start at ``base``."""
    f = _Fields(path, data)
    f.check_keys(TOP_KEYS)

    name = f.get("name", str, "a name of letters, digits, . _ -", required=True)
    f.checked(
        "name",
        name,
        NAME_RE.match,
        "use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit",
    )
    command = f.get("command", str, "the shell command that trains", required=True)
    f.checked("command", command, lambda c: c.strip(), "must not be empty")
    f.checked("command", command, lambda c: "\0" not in c, "must not contain NUL bytes")

    total_time = f.duration("total_time", required=True)
    walltime = f.duration("walltime", required=True)
    if walltime > total_time:
        raise f.error(
            "walltime",
            f"longer than total_time ({format_duration(total_time)}); make walltime at most total_time",
        )
    target_epoch = f.get("target_epoch", int, "a whole number of epochs")
    f.checked("target_epoch", target_epoch, lambda v: v >= 1, "must be 1 or more")
    max_failures = f.get("max_failures", int, "a whole number", default=3)
    f.checked("max_failures", max_failures, lambda v: v >= 0, "must be 0 or more")

    signal = f.get("signal", str, "a signal name: " + ", ".join(SIGNALS), default="USR1")
    signal = signal.upper().removeprefix("SIG")
    if signal not in SIGNALS:
        raise f.error("signal", "allowed: " + ", ".join(SIGNALS))
    grace = f.duration("grace", default=min(300, walltime // 4))
    if grace >= walltime:
        raise f.error(
            "grace",
            f"must be shorter than walltime ({format_duration(walltime)}): "
            "it is how long before the walltime the signal is sent",
        )

    sched = _scheduler(path, f.get("scheduler", dict, "a table [scheduler]", default={}))
    remote = sched.host is not None
    workdir = _path(f, "workdir", ".", base, remote)
    checkpoint_dir = _path(f, "checkpoint_dir", "checkpoints", Path(workdir), remote)

    env_table = f.get("env", dict, "a table [env] of NAME = value", default={})
    env = []
    for key, value in env_table.items():
        fe = _Fields(path, env_table, "env.")
        fe.checked(key, key, ENV_RE.match, "not a valid environment variable name")
        fe.checked(
            key,
            key,
            lambda k: not k.startswith("CHAINRUN_"),
            "names starting with CHAINRUN_ are set by chainrun",
        )
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise fe.error(key, "expected a string or number")
        env.append((key, str(value)))

    on_end = f.get("on_end", str, "a shell command run when the chain ends")
    f.checked("on_end", on_end, lambda c: c.strip() and "\0" not in c, "must be a non-empty command")
    webhook = f.get("webhook", str, "an http:// or https:// URL")
    f.checked(
        "webhook", webhook, lambda u: re.match(r"^https?://\S+$", u), "must be an http:// or https:// URL"
    )

    return JobSpec(
        name=name,
        command=command,
        workdir=workdir,
        total_time=total_time,
        walltime=walltime,
        target_epoch=target_epoch,
        max_failures=max_failures,
        checkpoint_dir=checkpoint_dir,
        signal=signal,
        grace=grace,
        scheduler=sched,
        env=tuple(env),
        on_end=on_end,
        webhook=webhook,
        source=str(Path(path).resolve()) if path else "",
    )


def _path(f: _Fields, key: str, default: str, base: Path, remote: bool) -> str:
    raw = f.get(key, str, "a directory path", default=default)
    f.checked(key, raw, lambda v: v.strip() and "\0" not in v, "must be a non-empty path")
    p = Path(raw).expanduser() if not remote else Path(raw)
    if p.is_absolute():
        return str(p)
    if remote and key == "workdir":
        raise f.error(key, "with scheduler.host set, give an absolute path on the cluster")
    return os.path.normpath(base / p)


def _scheduler(path: str, table: dict[str, Any]) -> SchedulerSpec:
    f = _Fields(path, table, "scheduler.")
    f.check_keys(SCHEDULER_KEYS)
    kind = f.get("kind", str, "one of " + ", ".join(SCHEDULER_KINDS), default="local")
    f.checked("kind", kind, SCHEDULER_KINDS.__contains__, "allowed: " + ", ".join(SCHEDULER_KINDS))
    host = f.get("host", str, "an ssh host or ~/.ssh/config alias")
    f.checked("host", host, lambda h: re.match(r"^[\w.@:\[\]-]+$", h), "not a host name")
    queue = f.get("queue", str, "a partition or queue name")
    f.checked("queue", queue, lambda q: re.match(r"^[\w.@,-]+$", q), "not a queue name")
    options = f.get("options", list, 'a list of strings, e.g. ["--mem=16G"]', default=[])
    for opt in options:
        if not isinstance(opt, str) or "\n" in opt or not opt.strip():
            raise f.error("options", "each option must be a one-line string")
    return SchedulerSpec(kind=kind, host=host or None, queue=queue, options=tuple(options))
