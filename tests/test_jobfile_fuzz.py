"""Hostile job files (issue 10): hundreds of malformed ones, generated from a fixed seed, each
refused by `chainrun check` and `chainrun submit` with exit 2 within 5 s, one line on stderr
naming the file and the field (or why the file itself is unusable), and no chain stored.

Each case is one valid job file (itself random: local, Slurm, SGE or remote; optional fields
in or out) with exactly one thing wrong, so the field the error must name is known. The bulk
runs the CLI in-process (click's CliRunner, under a 5 s alarm: FIFOs included); a sample of the
nastiest runs the real `python -m chainrun` as a user would, /dev/zero included, held to 5 s of
CPU (a busy machine stretches a Python start, not that) and 30 s of wall time (a hang)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sqlite3
import stat
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
from click.testing import CliRunner
from conftest import holding_scheduler
from test_jobfile import HANG_S, _TimedOut, within

from chainrun import schema
from chainrun.cli import main
from chainrun.fields import format_duration

REPO = Path(__file__).resolve().parent.parent
SEED = 10  # issue 10; change it to explore, keep it fixed to reproduce
CASES = 520
CHUNKS = 8  # the in-process cases run in this many tests, spread over the workers
LIMIT_S = 5.0
SANDBOX = "@SANDBOX@"  # stands for the directory of odd files a case's paths may point into


class Raw(str):
    """A TOML value written as it is: deep nesting, datetimes, numbers tomllib chokes on."""


def toml_str(s: str) -> str:
    # A JSON string is a TOML basic string, but for DEL, which TOML wants escaped (and astral
    # characters, which JSON escapes as surrogate pairs and TOML refuses: written as they are).
    return json.dumps(s, ensure_ascii=False).replace("\x7f", "\\u007f")


def toml_key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else toml_str(k)


def toml_value(v: Any) -> str:
    if isinstance(v, Raw):
        return str(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return toml_str(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(v)


def render(doc: dict[str, Any]) -> str:
    """``doc`` as TOML: plain keys first, then each table (scheduler, env) as a [section]."""
    lines = [f"{toml_key(k)} = {toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    for k, v in doc.items():
        if isinstance(v, dict):
            lines.append(f"[{toml_key(k)}]")
            lines += [f"{toml_key(ik)} = {toml_value(iv)}" for ik, iv in v.items()]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Case:
    """One malformed job file: its content, how the file itself exists, what the error must say."""

    label: str
    content: bytes = b""
    where: str = (
        "file"  # file, fifo, dir, loop, dangling, link-fifo, link-dir, socket, under-file, or a /dev path
    )
    needles: tuple[str, ...] = ()  # one of these must be in the error line (as well as the file's path)


def case(label: str, doc: dict[str, Any], *needles: str) -> Case:
    return Case(label, render(doc).encode(), "file", needles)


# ---- valid job files to break -------------------------------------------------------------


def duration(rng: random.Random, seconds: int) -> str:
    if seconds < 86400 and rng.random() < 0.3:
        return f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
    if rng.random() < 0.15:
        d, rest = divmod(seconds, 86400)
        return f"{d}-{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return format_duration(seconds)


def base(rng: random.Random, kind: Optional[str] = None) -> dict[str, Any]:
    """A valid job file; ``kind``: local, slurm, sge (on this machine) or remote."""
    kind = kind or rng.choice(["local", "local", "slurm", "sge", "remote"])
    walltime = rng.choice([60, 600, 3600, 4 * 3600, 86400])
    doc: dict[str, Any] = {
        "name": rng.choice(["cifar", "resnet-50", "run.v2", "A_1", "x"])
        + rng.choice(["", f"-{rng.randrange(99)}"]),
        "command": rng.choice(
            ["python train.py", "python3 t.py --lr 0.1 'a b'", 'exec ./run.sh "$X"', "echo héllo\ntrue"]
        ),
        "total_time": duration(rng, walltime * rng.choice([1, 2, 3, 10])),
        "walltime": duration(rng, walltime),
    }
    if rng.random() < 0.5:
        doc["target_epoch"] = rng.randrange(1, 500)
    if rng.random() < 0.5:
        doc["max_failures"] = rng.randrange(0, 6)
    if rng.random() < 0.4:
        doc["signal"] = rng.choice(["USR1", "usr2", "SIGTERM"])
    if rng.random() < 0.4:
        doc["grace"] = duration(rng, rng.choice([walltime // 4, walltime // 2, 30]))
    if kind == "remote":
        doc["workdir"] = "/scratch/u/run"
    elif rng.random() < 0.5:
        doc["workdir"] = rng.choice([f"{SANDBOX}/work", "."])
    if rng.random() < 0.5:
        doc["checkpoint_dir"] = rng.choice(["ckpt", f"{SANDBOX}/work", f"{SANDBOX}/work/new/ckpt"])
    if rng.random() < 0.3:
        doc["on_end"] = "echo done"
    if rng.random() < 0.3:
        doc["webhook"] = "https://hooks.example.org/chainrun?t=1"
    if kind == "slurm":
        # A partition the test Slurm has: check asks Slurm about the segment (sbatch --test-only).
        doc["scheduler"] = {"kind": "slurm", "queue": "debug", "options": ["--mem=1G"]}
    elif kind == "sge":
        doc["scheduler"] = {"kind": "sge", "queue": "all.q"}
    elif kind == "remote":
        # .invalid never resolves: old code that let a case through fails fast, not on a timeout.
        doc["scheduler"] = {"kind": "slurm", "host": "login.invalid"}
    elif rng.random() < 0.3:
        doc["scheduler"] = {"kind": "local"}
    if rng.random() < 0.4:
        doc["env"] = {"DATA": "/data", "SEED": 7, "LR": 0.1}
    return doc


def scheduler_of(doc: dict[str, Any], kind: str = "slurm") -> dict[str, Any]:
    sched = doc.setdefault("scheduler", {"kind": kind})
    assert isinstance(sched, dict)
    return sched


# ---- what goes wrong ----------------------------------------------------------------------

UNICODE_DIGITS = ["\uff10", "\u0660", "\u06f0", "\u0966", "\u09e6", "\U0001d7ce", "\U0001d7ec", "\u0e50"]
TRAILERS = ["\n", "\r", "\t", "\u00a0", "\u2028", "\x0b", "\r\n"]
BAD_DURATIONS = [
    "",
    " ",
    "0s",
    "00:00",
    "0:00:00",
    "-5m",
    "+5m",
    "4x",
    "h",
    "1:99:00",
    "1:00:99",
    "1e3s",
    "\u00bdh",
    "4 h",
    "4hh",
    "1-",
    "--1:00:00",
    "1:2:3:4",
    "0x10s",
    "5.5h",
    "213503982334601d",
    "366d",
    "8761h",
    "31536001s",
    "9999-00:00:00",
    "9" * 30 + "s",
    "9" * 5000 + "s",
    "4\uff48",
    "\u0664h",
]
KEYS_WITH_VALUES: dict[str, Any] = {
    "name": "x",
    "command": "true",
    "workdir": ".",
    "checkpoint_dir": "ckpt",
    "signal": "USR1",
    "on_end": "echo done",
    "webhook": "https://hooks.example.org/x",
    "total_time": "1h",
    "walltime": "20m",
    "grace": "1m",
}
WRONG_TYPES: list[Any] = [
    5,
    1.5,
    True,
    ["a"],
    {"a": 1},
    Raw("1979-05-27T07:32:00Z"),
    Raw("07:32:00"),
    Raw("1979-05-27"),
    Raw("nan"),
]
BAD_NAMES = [
    "",
    " ",
    "a/b",
    "my run",
    "-x",
    ".x",
    "_x",
    "a" * 65,
    "a\n",
    "\na",
    "\uff41",
    "\u540d\u524d",
    "a;b",
    "a$b",
    "a'b",
    "x\u200b",
    "a\tb",
]
BAD_ENV_KEYS = [
    "BAD-NAME",
    "1X",
    "A\n",
    "A B",
    "\u00c4",
    "CHAINRUN_SEGMENT",
    "CHAINRUN_",
    "",
    "A=B",
    "A\x00",
    "A\u0660",
]
BAD_URLS = [
    "ftp://h.example.org/x",
    "file:///etc/passwd",
    "http:///x",
    "https://",
    "http://",
    "http:/h.example.org",
    "https:h.example.org",
    "javascript:alert(1)",
    "data:,x",
    "ws://h.example.org",
    "gopher://h.example.org",
    "http://exa mple.org/",
    "http://h.example.org/a b",
    "https://h.example.org/\n",
    "http://h\u00a0x.org/",
    "http://-bad-.org/",
    "http://bad-.org/",
    "http://a..b/",
    "http://h.example.org:99999/",
    "http://h:port/",
    "http://[::1/",
    "http://[zz::1]/",
    "\thttp://h.example.org/",
    "h.example.org",
    "",
    "http://\u3000/",
]
BAD_SIGNALS = [
    "KILL",
    "SIGKILL",
    "INT",
    "",
    "usr1\n",
    "\uff35\uff33\uff32\uff11",
    "9",
    "SIG",
    "USR3",
    "SIGSIGUSR1",
]
BAD_KINDS = ["pbs", "", "SLURM", "slurm\n", "\uff53lurm", " slurm", "lsf", "local\t"]
BAD_HOSTS = ["a b", "h\n", "", "h;rm", "\uff48ost", "-oProxyCommand", "-v", "h/x", "h" * 300, "h$x"]
BAD_QUEUES = ["a b", "q\n", "", "q;x", "\uff51", "-q", "--partition", "q" * 300, "q/x", "q\u200b"]
BAD_OPTIONS: list[Any] = [
    "--mem=1G",
    5,
    [1],
    [["a"]],
    [True],
    {"a": 1},
    ["a\nb"],
    [""],
    ["  "],
    ["a\tb"],
    ["a\rb"],
    ["--x=" + "y" * 5000],
    ["--mem=1G"] * 300,
]
PATHS_NEVER_A_DIR = [
    f"{SANDBOX}/file",
    "/dev/null",
    "/dev/zero",
    f"{SANDBOX}/fifo",
    f"{SANDBOX}/loop1",
    f"{SANDBOX}/sock",
    f"{SANDBOX}/dangling",
    f"{SANDBOX}/file/sub",
    "/dev/null/x",
    "~nosuchuser-chainrun/x",
    "~nosuchuser-chainrun",
    "",
    "   ",
    "/" + "a" * 5000,
]
PATHS_MISSING = [f"{SANDBOX}/missing", f"{SANDBOX}/missing/deeper", "not-here"]


def one_of(rng: random.Random, items: list[Any]) -> Any:
    return rng.choice(items)


def big_string(rng: random.Random, floor: int = 65 << 10) -> str:
    """Past 64 KiB in bytes, if not always in characters (é is two bytes)."""
    unit = rng.choice(["x", "\u00e9", "ab", "\u4e2d"])
    n = floor // len(unit.encode()) + rng.randrange(1, 3 << 10)
    return unit * n


def nested(rng: random.Random, depth: int) -> Raw:
    if rng.random() < 0.5:
        return Raw("[" * depth + "1" + "]" * depth)
    return Raw("{a = " * depth + "1" + "}" * depth)


def m_missing(rng: random.Random, k: int = 0) -> Case:
    doc = base(rng)
    field = one_of(rng, ["name", "command", "total_time", "walltime"])
    del doc[field]
    return case(f"missing {field}", doc, f"{field}: missing")


def m_unknown_key(rng: random.Random, k: int = 0) -> Case:
    doc = base(rng)
    in_scheduler = rng.random() < 0.3
    allowed = schema.SCHEDULER_KEYS if in_scheduler else schema.TOP_KEYS
    known = one_of(rng, list(allowed))
    edits: list[Callable[[str], str]] = [
        lambda k: k[:-1],
        lambda k: k + k[-1],
        lambda k: k[1] + k[0] + k[2:],
        lambda k: k.upper(),
        lambda k: k + " ",
        lambda k: (
            k.replace("a", "\u0430").replace("e", "\u0435") + ("_" if "a" not in k and "e" not in k else "")
        ),
        lambda k: k + "\n",
        lambda k: k + "\x00",
        lambda k: "\u540d\u524d",
        lambda k: "",
        lambda k: k * rng.randrange(100, 3000),
    ]
    key = one_of(rng, edits)(known)
    if key in allowed:
        key += "2"
    value = one_of(rng, ["x", 1, True, [1], {"a": 1}])
    if in_scheduler:
        scheduler_of(doc, "local")[key] = value
    elif isinstance(value, dict):
        doc[key] = value  # rendered as a [table] of its own
    else:
        doc = {key: value, **doc}
    return case(f"unknown key {key[:20]!r}", doc, "unknown key")


def m_mistyped(rng: random.Random, k: int = 0) -> Case:
    doc = base(rng, rng.choice(["local", "slurm"]))
    target = one_of(
        rng,
        [
            *KEYS_WITH_VALUES,
            "target_epoch",
            "max_failures",
            "scheduler",
            "env",
            "sched.kind",
            "sched.host",
            "sched.queue",
            "sched.options",
            "env.X",
        ],
    )
    if target in ("target_epoch", "max_failures"):
        bad = one_of(
            rng, ["10", 1.5, True, [1], Raw("nan"), Raw("inf"), Raw("-inf"), Raw("1979-05-27"), {"a": 1}]
        )
    elif target == "scheduler":
        bad = one_of(rng, ["slurm", 1, ["slurm"], True, 1.5])
    elif target == "env":
        bad = one_of(rng, ["A=1", 5, [1], True])
    elif target == "env.X":
        bad = one_of(rng, [True, [1], {"a": 1}, Raw("1979-05-27T07:32:00Z"), Raw("07:32:00")])
    elif target == "sched.options":
        bad = one_of(rng, BAD_OPTIONS[:6])
    else:
        bad = one_of(rng, WRONG_TYPES)
        if target in ("total_time", "walltime", "grace"):
            bad = one_of(rng, [3600, 1.5, True, ["4h"], Raw("1979-05-27T07:32:00Z"), {"h": 4}])
    return _set(doc, target, bad, f"mistyped {target} = {toml_value(bad)[:20]}")


def _set(doc: dict[str, Any], target: str, value: Any, label: str, *needles: str) -> Case:
    """Case with ``target`` (``name``, ``sched.queue``, ``env.X``) set to ``value``; the error names
    the field (or one of ``needles``, when given)."""
    if target.startswith("sched."):
        key = target.split(".", 1)[1]
        scheduler_of(doc)[key] = value
        if key == "host" and "scheduler" in doc:
            doc["workdir"] = "/scratch/u/run"
        field = "scheduler." + key
    elif target.startswith("env."):
        key = target.split(".", 1)[1]
        env = doc.get("env")
        if not isinstance(env, dict):
            env = doc["env"] = {}
        env[key] = value
        field = "env." + key if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", key) else "env."
    else:
        doc[target] = value
        field = target
    return case(label, doc, *(needles or (field,)))


def m_bad_duration(rng: random.Random, k: int = 0) -> Case:
    doc = base(rng)
    field = one_of(rng, ["total_time", "walltime", "grace"])
    style = rng.randrange(4)
    if style == 0:
        digit = one_of(rng, UNICODE_DIGITS)
        bad = digit * rng.randrange(1, 3) + one_of(rng, ["s", "m", "h", "d", ":00:00"])
        if rng.random() < 0.5:
            bad = "1" + bad
    elif style == 1:
        good = one_of(rng, ["8s", "1h30m", "01:00:00", "4h", "2d"])
        trailer = one_of(rng, TRAILERS)
        bad = good + trailer if rng.random() < 0.7 else trailer + good
    elif style == 2:
        bad = one_of(
            rng,
            [
                f"{rng.randrange(366, 10**6)}d",
                f"{10 ** rng.randrange(9, 19)}s",
                f"{rng.randrange(8761, 10**7)}h",
            ],
        )
    else:
        bad = one_of(rng, BAD_DURATIONS)
    return _set(doc, field, bad, f"duration {field} = {bad[:20]!r}")


def m_nul(rng: random.Random, k: int = 0) -> Case:
    doc = base(rng, rng.choice(["local", "slurm", "remote"]))
    target = one_of(
        rng,
        [
            *KEYS_WITH_VALUES,
            "sched.kind",
            "sched.queue",
            "sched.host",
            "sched.options",
            "env.X",
            "env-key",
            "top-key",
        ],
    )

    def poison(s: str) -> str:
        at = rng.randrange(len(s) + 1)
        return s[:at] + "\x00" + s[at:]

    if target == "env-key":
        doc["env"] = {poison("KEY"): "1"}
        return case("NUL in an env name", doc, "env.")
    if target == "top-key":
        doc = {poison("name"): "x", **doc}
        return case("NUL in a key", doc, "unknown key")
    if target == "sched.options":
        return _set(doc, target, ["--mem=1G", poison("--time=1")], "NUL in an option")
    current = {"sched.kind": "slurm", "sched.queue": "gpu", "sched.host": "login", "env.X": "value"}.get(
        target, KEYS_WITH_VALUES.get(target, "x")
    )
    if target == "sched.host":
        doc["workdir"] = "/scratch/u/run"
    return _set(doc, target, poison(current), f"NUL in {target}")


def m_huge(rng: random.Random, k: int = 0) -> Case:
    doc = base(rng, rng.choice(["local", "slurm"]))
    target = one_of(
        rng,
        [
            "command",
            "on_end",
            "env.BIG",
            "webhook",
            "workdir",
            "checkpoint_dir",
            "name",
            "signal",
            "total_time",
            "sched.queue",
            "sched.host",
            "sched.options",
            "env-total",
            "key",
        ],
    )
    if target in ("command", "on_end", "env.BIG"):
        return _set(doc, target, big_string(rng), f"huge {target}")
    if target == "webhook":
        return _set(doc, target, "https://h.example.org/" + "a" * rng.randrange(9000, 20000), "huge webhook")
    if target in ("workdir", "checkpoint_dir"):
        return _set(doc, target, "/" + "d" * rng.randrange(4100, 9000), f"huge {target}")
    if target == "name":
        return _set(doc, target, "n" * rng.randrange(65, 100_000), "huge name")
    if target == "signal":
        return _set(doc, target, "USR1" * rng.randrange(20, 1000), "huge signal")
    if target == "total_time":
        return _set(doc, target, "1" * rng.randrange(200, 3000) + "s", "huge duration")
    if target == "sched.options":
        return _set(doc, target, one_of(rng, BAD_OPTIONS[-2:]), "huge options")
    if target in ("sched.queue", "sched.host"):
        return _set(doc, target, target[6] * rng.randrange(256, 5000), f"huge {target}")
    if target == "key":
        return case("huge key", {"k" * rng.randrange(100, 50_000): 1, **doc}, "unknown key")
    # Each variable within 64 KiB, all together past the kernel's limit (the file stays under 1 MiB).
    budget = schema.arg_budget()
    size = 60 << 10
    doc["env"] = {f"V{i}": "v" * size for i in range(budget // size + 1)}
    return case("environment past ARG_MAX", doc, "env")


def m_deep(rng: random.Random, k: int = 0) -> Case:
    doc = base(rng)
    target = one_of(
        rng,
        [
            "target_epoch",
            "max_failures",
            "name",
            "command",
            "total_time",
            "workdir",
            "webhook",
            "env.X",
            "sched.options",
            "sched.kind",
        ],
    )
    depth = one_of(rng, [20, 100, 300, 600, 1000, 2000, 5000])
    label = f"{target} nested {depth} deep"
    return _set(doc, target, nested(rng, depth), label, _field(target), "nested too deeply")


def _field(target: str) -> str:
    return target.replace("sched.", "scheduler.")


def m_bad_path(rng: random.Random, k: int = 0) -> Case:
    doc = base(rng, rng.choice(["local", "local", "slurm", "sge"]))
    field = one_of(rng, ["workdir", "checkpoint_dir"])
    choices = PATHS_NEVER_A_DIR + (PATHS_MISSING if field == "workdir" else [])
    value = one_of(rng, choices)
    if value.startswith("~nosuchuser"):
        value = value.replace("user", f"user{rng.randrange(1000)}", 1)
    return _set(doc, field, value, f"{field} = {value[:40]!r}")


def m_job_file_itself(rng: random.Random, k: int = 0) -> Case:
    kinds = {
        "fifo": ("FIFO",),
        "dir": ("directory",),
        "loop": ("symbolic links",),
        "dangling": ("no such job file",),
        "link-fifo": ("FIFO",),
        "link-dir": ("directory",),
        "socket": ("socket",),
        "under-file": ("not a directory",),
        "/dev/null": ("character device",),
        "big": ("1 MiB",),
        "not-utf8": ("UTF-8",),
        "empty": ("name",),
    }
    where = sorted(kinds)[k % len(kinds)]  # every kind, in turn
    if where == "big":
        text = render(base(rng)) + "# " + "p" * rng.randrange(1 << 20, (1 << 20) + 5000) + "\n"
        return Case("job file over 1 MiB", text.encode(), "file", kinds[where])
    if where == "not-utf8":
        text = render(base(rng)).encode()
        at = rng.randrange(len(text))
        bad = one_of(rng, [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80"])
        return Case("job file not UTF-8", text[:at] + bad + text[at:], "file", kinds[where])
    if where == "empty":
        return Case(
            "empty job file", one_of(rng, [b"", b"\n", b"# nothing\n", b"   \n"]), "file", kinds[where]
        )
    return Case(f"job file is {where}", b"", where, kinds[where])


def m_local_queue(rng: random.Random, k: int = 0) -> Case:
    doc = base(rng, "local")
    sched: dict[str, Any] = {} if rng.random() < 0.5 else {"kind": "local"}
    if rng.random() < 0.3:
        sched["host"] = "login.invalid"
        doc["workdir"] = "/scratch/u/run"
    which = rng.randrange(3)
    if which in (0, 2):
        sched["queue"] = one_of(rng, ["gpu", "all.q", "long"])
    if which in (1, 2):
        sched["options"] = one_of(rng, [["--mem=1G"], ["-l h_vmem=8G", "-pe smp 4"], []])
    if sched:
        doc["scheduler"] = sched
    return case(
        "queue or options with the local runner",
        doc,
        "scheduler.queue" if which != 1 else "scheduler.options",
    )


def m_webhook(rng: random.Random, k: int = 0) -> Case:
    return _set(base(rng), "webhook", one_of(rng, BAD_URLS), "bad webhook")


def m_name(rng: random.Random, k: int = 0) -> Case:
    return _set(base(rng), "name", one_of(rng, BAD_NAMES), "bad name")


def m_env_key(rng: random.Random, k: int = 0) -> Case:
    doc = base(rng)
    doc["env"] = {"OK": "1", one_of(rng, BAD_ENV_KEYS): "x"}
    return case("bad env name", doc, "env.")


def m_range(rng: random.Random, k: int = 0) -> Case:
    doc = base(rng)
    field = one_of(rng, ["target_epoch", "max_failures"])
    if field == "target_epoch":
        bad = one_of(rng, [0, -1, -(2**63), 10**9 + 1, 10**18, Raw("9" * 25), Raw("-" + "9" * 40)])
    else:
        bad = one_of(rng, [-1, -(2**63), 10**6 + 1, 2**63 - 1, Raw("1" * 30)])
    if rng.random() < 0.1:
        return case(f"{field} with 5000 digits", {**doc, field: Raw("9" * 5000)}, "not valid TOML")
    return _set(doc, field, bad, f"{field} = {str(bad)[:20]}")


def m_scheduler_value(rng: random.Random, k: int = 0) -> Case:
    target = one_of(rng, ["signal", "sched.kind", "sched.host", "sched.queue"])
    doc = base(rng, "slurm")
    bad = one_of(
        rng,
        {"signal": BAD_SIGNALS, "sched.kind": BAD_KINDS, "sched.host": BAD_HOSTS, "sched.queue": BAD_QUEUES}[
            target
        ],
    )
    return _set(doc, target, bad, f"{target} = {bad[:20]!r}")


def m_toml_syntax(rng: random.Random, k: int = 0) -> Case:
    text = render(base(rng))
    lines = text.splitlines(keepends=True)
    breakers: list[Callable[[], str]] = [
        lambda: text + "= =\n",
        lambda: text.replace("\n", '\nx = "unterminated\n', 1),
        lambda: lines[0] + text,  # a key twice
        lambda: text + "[scheduler]\n[scheduler]\n",
        lambda: text.replace('"', '"\x01', 1),
        lambda: text + "a = 1 2\n",
        lambda: text + "[env\n",
        lambda: text + 'a = """\n',
        lambda: text + "}{][\n",
        lambda: lines[0].rstrip("\n") + " trailing\n" + "".join(lines[1:]),
        lambda: text.replace("\n", "\x00\n", 1),
        lambda: "name.x = 1\n" + text,  # then name = "..." overwrites a table
    ]
    return Case("invalid TOML", one_of(rng, breakers)().encode(), "file", ("not valid TOML",))


MUTATIONS: list[Callable[[random.Random, int], Case]] = [
    m_missing,
    m_unknown_key,
    m_mistyped,
    m_bad_duration,
    m_nul,
    m_huge,
    m_deep,
    m_bad_path,
    m_job_file_itself,
    m_local_queue,
    m_webhook,
    m_name,
    m_env_key,
    m_range,
    m_scheduler_value,
    m_toml_syntax,
]


def generate(seed: int = SEED, count: int = CASES) -> list[Case]:
    rng = random.Random(seed)
    return [MUTATIONS[i % len(MUTATIONS)](rng, i // len(MUTATIONS)) for i in range(count)]


ALL = generate()


# ---- running them -------------------------------------------------------------------------


SCRIPTS = ("train.py", "t.py", "run.sh")  # what ``base``'s commands name


def make_sandbox(root: Path) -> Path:
    """Things a path may point at that are no directory (and one that is)."""
    root.mkdir()
    (root / "work").mkdir()
    for script in SCRIPTS:
        (root / "work" / script).write_text("")
    (root / "file").write_text("x")
    os.mkfifo(root / "fifo")
    (root / "loop1").symlink_to(root / "loop2")
    (root / "loop2").symlink_to(root / "loop1")
    (root / "dangling").symlink_to(root / "nothing")
    os.mknod(root / "sock", 0o600 | stat.S_IFSOCK)
    return root


def materialize(c: Case, n: int, sandbox: Path) -> Path:
    """Lay case ``c`` out in its own directory; returns the path to hand to the CLI."""
    d = sandbox / f"case-{n}"
    d.mkdir()
    job = d / "job.toml"
    if c.where.startswith("/dev/"):
        return Path(c.where)
    if c.where == "file":
        job.write_bytes(c.content.replace(SANDBOX.encode(), str(sandbox).encode()))
        for script in SCRIPTS:  # the scripts the valid job files' commands name, in workdir "."
            (d / script).write_text("")
    elif c.where == "fifo":
        os.mkfifo(job)
    elif c.where == "dir":
        job.mkdir()
    elif c.where == "loop":
        job.symlink_to(d / "other.toml")
        (d / "other.toml").symlink_to(job)
    elif c.where == "dangling":
        job.symlink_to(d / "gone.toml")
    elif c.where == "link-fifo":
        os.mkfifo(d / "pipe")
        job.symlink_to(d / "pipe")
    elif c.where == "link-dir":
        job.symlink_to(d)
    elif c.where == "socket":
        os.mknod(job, 0o600 | stat.S_IFSOCK)
    elif c.where == "under-file":
        (d / "file").write_text("x")
        job = d / "file" / "job.toml"
    else:
        raise AssertionError(c.where)
    return job


def chains_stored(home: Path) -> int:
    db = home / "chainrun.db"
    if not db.exists():
        return 0
    with sqlite3.connect(db) as conn:
        try:
            return int(conn.execute("SELECT count(*) FROM chains").fetchone()[0])
        except sqlite3.OperationalError:  # no table yet
            return 0


def judge(c: Case, job: Path, code: Optional[int], stderr: str, elapsed: float) -> Optional[str]:
    """What is wrong with how the CLI answered case ``c``; None when all is right."""
    if code is None:
        return "still running: hung"
    if code != 2:
        return f"exit {code}, not 2: {stderr[-300:]!r}"
    if elapsed > LIMIT_S:
        return f"took {elapsed:.1f} s"
    lines = stderr.splitlines()
    if len(lines) != 1 or not stderr.endswith("\n") or stderr.count("\n") != 1:
        return f"{len(lines)} lines on stderr: {stderr[:300]!r}"
    line = lines[0]
    if not line.startswith("chainrun: "):
        return f"not chainrun's line: {line[:300]!r}"
    if str(job) not in line:
        return f"does not name the file: {line[:300]!r}"
    rest = line.replace(str(job), "", 1)
    if c.needles and not any(n in rest for n in c.needles):
        return f"names none of {c.needles}: {line[:300]!r}"
    return None


def in_process(runner: CliRunner, home: Path, c: Case, job: Path) -> list[str]:
    problems = []
    stored = chains_stored(home)
    for command in ("check", "submit"):
        start = time.process_time()  # CPU time: what the case costs, however busy the machine
        try:
            argv = ["--home", str(home), command, str(job)]
            result = within(LIMIT_S, lambda: runner.invoke(main, argv))  # noqa: B023 - called at once
        except _TimedOut:
            code, stderr = None, ""
        else:
            code, stderr = result.exit_code, result.stderr
            if result.exception is not None and not isinstance(result.exception, SystemExit):
                stderr += f"[{type(result.exception).__name__}: {result.exception}]"
        problem = judge(c, job, code, stderr, time.process_time() - start)
        if problem:
            problems.append(f"{command}: {problem}")
    if chains_stored(home) > stored:
        problems.append("a chain was stored")
    return problems


def report(failures: list[str]) -> str:
    return f"{len(failures)} case(s) handled wrong:\n" + "\n".join(failures[:25])


def test_the_cases_are_many_varied_and_the_same_every_run() -> None:
    assert len(ALL) >= 500
    assert generate() == ALL  # seeded: a failure names a case that the next run has too
    labels = " ".join(c.label for c in ALL)
    for what in [
        "missing",
        "unknown key",
        "mistyped",
        "duration",
        "NUL",
        "huge",
        "nested",
        "webhook",
        "local runner",
        "invalid TOML",
        "environment past ARG_MAX",
        "workdir",
        "checkpoint_dir",
        "~nosuchuser",
        "not UTF-8",
        "over 1 MiB",
    ]:
        assert what in labels, what
    wheres = {c.where for c in ALL}
    assert {"fifo", "dir", "loop", "socket", "link-fifo", "/dev/null"} <= wheres


def test_the_job_files_the_cases_start_from_are_valid(tmp_path: Path) -> None:
    """Each case breaks one thing in a valid job file: so the error it gets is for that thing.
    `check` asks the test Slurm and SGE whether they would ever start a segment of a Slurm or
    SGE file's shape: they are held, as every test that uses them holds them, so that no test
    takes slurmctld down meanwhile (right after a restart it refuses shapes until its node
    registers again; a full run under load at 86b91e2 caught it)."""
    rng = random.Random(SEED + 1)
    sandbox = make_sandbox(tmp_path / "sandbox")
    runner = CliRunner()
    with holding_scheduler("slurm"), holding_scheduler("sge"):
        for n in range(40):
            doc = base(rng, ["local", "slurm", "sge", "remote"][n % 4] if n < 8 else None)
            job = materialize(case("valid", doc), n, sandbox)
            result = runner.invoke(main, ["--home", str(tmp_path / "home"), "check", str(job)])
            assert result.exit_code == 0, (render(doc)[:500], result.output)


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_malformed_job_files_are_refused_in_one_line_with_nothing_stored(tmp_path: Path, chunk: int) -> None:
    """`check` and `submit` on each case: exit 2 within 5 s, one line naming the file and the
    field (or what is wrong with the file itself), and no chain in the database."""
    sandbox = make_sandbox(tmp_path / "sandbox")
    home = tmp_path / "home"
    runner = CliRunner()
    failures = []
    for n in range(chunk, len(ALL), CHUNKS):
        c = ALL[n]
        job = materialize(c, n, sandbox)
        for problem in in_process(runner, home, c, job):
            failures.append(f"#{n} {c.label}: {problem}")
    assert not failures, report(failures)


# ---- the real command line ----------------------------------------------------------------


def sample() -> list[Case]:
    """The nastiest kinds, through `python -m chainrun` as a user runs it."""
    rng = random.Random(SEED + 2)

    def on(field: str, value: Any) -> Case:
        return _set(base(rng, "local"), field, value, f"{field} = {str(value)[:30]!r}")

    budget = schema.arg_budget()
    env_doc = base(rng, "local")
    env_doc["env"] = {f"V{i}": "v" * (60 << 10) for i in range(budget // (60 << 10) + 1)}
    return [
        Case("job file is a FIFO", b"", "fifo", ("FIFO",)),
        Case("job file is a symlink to a FIFO", b"", "link-fifo", ("FIFO",)),
        Case("job file is /dev/zero", b"", "/dev/zero", ("character device",)),
        Case("job file is /dev/urandom", b"", "/dev/urandom", ("character device",)),
        Case("job file is /dev/null", b"", "/dev/null", ("character device",)),
        Case("job file is a directory", b"", "dir", ("directory",)),
        Case("job file is a symlink loop", b"", "loop", ("symbolic links",)),
        Case("job file is a socket", b"", "socket", ("socket",)),
        Case(
            "job file over 1 MiB", (render(base(rng)) + "#" * (2 << 20) + "\n").encode(), "file", ("1 MiB",)
        ),
        case(
            "array nested 2000 deep",
            {**base(rng), "target_epoch": Raw("[" * 2000 + "]" * 2000)},
            "nested too deeply",
        ),
        on("total_time", "213503982334601d"),
        on("walltime", "\uff18s"),
        on("grace", "8s\n"),
        on("command", "x" * 200_000),
        on("env.A", "a\x00b"),
        on("workdir", "~nosuchuser-chainrun/x"),
        on("workdir", "/dev/null"),
        on("checkpoint_dir", f"{SANDBOX}/file"),
        case(
            "queue with the local runner",
            {**base(rng, "local"), "scheduler": {"queue": "gpu"}},
            "scheduler.queue",
        ),
        on("webhook", "ftp://h.example.org/x"),
        Case("environment past ARG_MAX", render(env_doc).encode(), "file", ("env",)),
    ]


def run_cli(home: Path, command: str, job: Path) -> tuple[Optional[int], str, float]:
    """``python -m chainrun COMMAND JOB``: its exit code, stderr and the CPU seconds it used.

    Under a 1 GiB address-space limit: reading /dev/zero whole then fails fast instead of
    filling the box. The 5 s are counted in CPU time, which a busy machine does not stretch (this
    suite shares two cores with five other workers: starting Python alone can take seconds
    there); a process still running after HANG_S is hung, blocked on a FIFO or such."""
    env = dict(os.environ, CHAINRUN_HOME=str(home), PYTHONPATH=str(REPO))
    with tempfile.TemporaryFile("w+") as clock:
        fd = clock.fileno()
        script = f'ulimit -v {1 << 20}; "$0" -m chainrun "$@"; rc=$?; times >&{fd}; exit $rc'
        proc = subprocess.Popen(
            ["bash", "-c", script, sys.executable, command, str(job)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            pass_fds=(fd,),
            start_new_session=True,  # so a hung chainrun dies with its bash
        )
        try:
            _, stderr = proc.communicate(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return None, "", HANG_S
        clock.seek(0)
        # `times`: the shell's user and system time, then its children's: chainrun's.
        spent = re.findall(r"(\d+)m([\d.]+)s", clock.read())
    cpu = sum(int(m) * 60 + float(sec) for m, sec in spent[2:4])
    return proc.returncode, stderr, cpu


def test_the_real_command_line_refuses_the_nastiest_in_one_line(tmp_path: Path) -> None:
    cases = sample()
    assert len(cases) >= 20
    sandbox = make_sandbox(tmp_path / "sandbox")
    home = tmp_path / "home"
    jobs = [materialize(c, n, sandbox) for n, c in enumerate(cases)]
    work = [(c, job, command) for c, job in zip(cases, jobs) for command in ("check", "submit")]

    def one(item: tuple[Case, Path, str]) -> Optional[str]:
        c, job, command = item
        problem = judge(c, job, *run_cli(home, command, job))
        return f"{c.label} ({command}): {problem}" if problem else None

    with ThreadPoolExecutor(max_workers=2) as pool:
        failures = [p for p in pool.map(one, work) if p]
    if chains_stored(home):
        failures.append(f"{chains_stored(home)} chain(s) stored")
    assert not failures, report(failures)
