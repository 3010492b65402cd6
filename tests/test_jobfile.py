"""Job files: durations, defaults, and one clear error line for every kind of bad input."""

from __future__ import annotations

import json
import os
import resource
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

from chainrun import jobfile, schema
from chainrun.config import load_config
from chainrun.errors import JobFileError
from chainrun.fields import parse_duration

REPO = Path(__file__).resolve().parent.parent

GOOD = """
name = "cifar-resnet"
command = "python train.py --epochs 200"
total_time = "72h"
walltime = "4h"
target_epoch = 200
max_failures = 3
checkpoint_dir = "ckpt"
signal = "SIGUSR1"
grace = "5m"

[scheduler]
kind = "slurm"
queue = "gpu"
options = ["--gres=gpu:1", "--mem=16G"]

[env]
DATA_DIR = "/disk/scratch/data"
SEED = 7
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "job.toml"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90s", 90),
        ("45m", 2700),
        ("4h", 14400),
        ("2d", 172800),
        ("1h30m", 5400),
        ("01:30:00", 5400),
        ("10:00", 600),
        ("1-02:00:00", 93600),
        ("1d12h", 129600),
    ],
)
def test_durations_in_every_accepted_form(text: str, seconds: int) -> None:
    """90s, 45m, 4h, 2d, 1h30m, HH:MM:SS (and Slurm's D-HH:MM:SS) all parse."""
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "4", "4x", "h", "1:99:00", "-5m", "5 m m"])
def test_non_durations_are_refused(text: str) -> None:
    """Anything else is not a duration."""
    with pytest.raises(ValueError):
        parse_duration(text)


def test_full_job_file_parses_into_spec(tmp_path: Path) -> None:
    """Every field lands in the spec; paths become absolute, relative to the job file."""
    spec = jobfile.load(write(tmp_path, GOOD))
    assert spec.name == "cifar-resnet"
    assert (spec.total_time, spec.walltime, spec.grace) == (259200, 14400, 300)
    assert spec.workdir == str(tmp_path)
    assert spec.checkpoint_dir == str(tmp_path / "ckpt")
    assert spec.signal == "USR1"
    assert spec.scheduler.kind == "slurm" and spec.scheduler.queue == "gpu"
    assert spec.scheduler.options == ("--gres=gpu:1", "--mem=16G")
    assert spec.env == (("DATA_DIR", "/disk/scratch/data"), ("SEED", "7"))


def test_minimal_job_file_gets_defaults(tmp_path: Path) -> None:
    """Only name, command, total_time and walltime are required."""
    spec = jobfile.load(write(tmp_path, 'name="a"\ncommand="true"\ntotal_time="1h"\nwalltime="20m"\n'))
    assert spec.scheduler.kind == "local"
    assert spec.max_failures == 3 and spec.target_epoch is None
    assert spec.grace == 300 and spec.signal == "USR1"


BASE = 'name="a"\ncommand="true"\ntotal_time="1h"\nwalltime="20m"\n'


TIMES = 'name="a"\ncommand="python train.py"\ntotal_time="1h"\n'
SLURM, SGE = '[scheduler]\nkind="slurm"\n', '[scheduler]\nkind="sge"\n'


@pytest.mark.parametrize(
    ("times", "error"),
    [
        (
            'walltime="59s"\n' + SLURM,
            "walltime = '59s': too short for slurm, which counts walltime in whole minutes; at least 1m",
        ),
        (
            'walltime="10m"\ngrace="2s"\n' + SGE,
            "grace = '2s': too short to save between the signal and the kill on sge; at least 3s",
        ),
        (
            'walltime="8s"\n' + SGE,
            "grace: too short (the default: a quarter of walltime, 2s) to save between the signal and "
            "the kill on sge; at least 3s",
        ),
        (
            'walltime="3s"\ngrace="2s"\n',
            "walltime = '3s': leaves 1s before the signal (grace 2s) to start the command; at least 4s, "
            "or a shorter grace",
        ),
        (
            'walltime="2s"\n',
            "walltime = '2s': leaves 1s before the signal (grace 1s) to start the command; at least 3s, "
            "or a shorter grace",
        ),
    ],
)
def test_a_walltime_too_short_to_start_and_save_is_refused_with_the_least_that_works(
    tmp_path: Path, times: str, error: str
) -> None:
    """One line naming the field, its value (or the default's) and the least that works."""
    path = write(tmp_path, TIMES + times)
    with pytest.raises(JobFileError) as err:
        jobfile.load(path)
    assert str(err.value) == f"{path}: {error}"


@pytest.mark.parametrize(
    ("times", "grace"),
    [
        ('walltime="3s"\n', 1),  # the tests' shortest local segments; the default grace is 1s at least
        ('walltime="6s"\ngrace="1s"\n', 1),
        ('walltime="1m"\n' + SLURM, 15),
        ('walltime="10s"\ngrace="4s"\n' + SGE, 4),  # the SGE contract suite's segments
        ('walltime="5s"\ngrace="3s"\n' + SGE, 3),
    ],
)
def test_the_least_walltime_and_grace_that_work_are_accepted(tmp_path: Path, times: str, grace: int) -> None:
    assert jobfile.load(write(tmp_path, TIMES + times)).grace == grace


def test_check_refuses_a_walltime_too_short_in_one_line_and_stores_nothing(
    tmp_path: Path, chainrun: Callable[..., subprocess.CompletedProcess[str]], home: Path
) -> None:
    """Through the real CLI: `check` and `submit` exit 2 with the one line, no traceback, no chain."""
    path = write(tmp_path, TIMES + 'walltime="30s"\n' + SLURM)
    for command in ("check", "submit"):
        result = chainrun(command, str(path))
        assert result.returncode == 2, result.stdout + result.stderr
        assert result.stderr.strip().count("\n") == 0, result.stderr
        assert "walltime = '30s': too short for slurm" in result.stderr and "at least 1m" in result.stderr
    db = home / "chainrun.db"
    assert not db.exists() or sqlite3.connect(db).execute("select count(*) from chains").fetchone()[0] == 0


def test_progress_names_the_scripts_own_json_file_and_the_key_of_its_epoch(tmp_path: Path) -> None:
    """progress = "FILE:KEY": FILE from the workdir (the last colon splits), KEY dotted."""
    spec = jobfile.load(write(tmp_path, BASE + 'progress = "ckpt/a:b.json:meta.epoch"\n'))
    assert spec.progress_file == str(tmp_path / "ckpt" / "a:b.json")
    assert spec.progress_key == "meta.epoch"
    assert jobfile.load(write(tmp_path, BASE)).progress_file is None


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('command="true"\ntotal_time="1h"\nwalltime="20m"\n', "name: missing"),
        ('name="a"\ntotal_time="1h"\nwalltime="20m"\n', "command: missing"),
        (BASE + 'walltme = "4h"\n', "unknown key walltme; did you mean walltime? Allowed here: name,"),
        (
            BASE + '[scheduler]\nkind="slurm"\nqueu="gpu"\n',
            "unknown key scheduler.queu; did you mean scheduler.queue?",
        ),
        (BASE + 'nosuch = "4h"\n', "unknown key nosuch; allowed here: name, command,"),
        # What other tools call chainrun's keys: what to write instead, in one line.
        (BASE + "max_epochs = 90\n", "unknown key max_epochs; chainrun's is target_epoch"),
        (
            BASE + 'time = "4h"\n',
            'unknown key time; chainrun\'s is walltime = "24h" (each segment; total_time',
        ),
        (BASE + 'partition = "gpu"\n', 'unknown key partition; chainrun\'s is queue = "NAME" in [scheduler]'),
        (BASE + 'image = "x.sif"\n', "unknown key image; chainrun's is container"),
        (
            BASE + '[scheduler]\nPartition="gpu"\n',
            'unknown key scheduler.Partition; chainrun\'s is queue = "NAME"',
        ),
        (
            BASE + "[scheduler]\ncpus_per_task=4\n",
            'unknown key scheduler.cpus_per_task; chainrun\'s is options = ["--cpus-per-task=..."], the',
        ),
        (BASE + '[scheduler]\ntime="1h"\n', "unknown key scheduler.time; chainrun's is walltime, at the top"),
        (BASE + 'target_epoch = "ten"\n', "target_epoch = 'ten': expected a whole number"),
        (BASE + "max_failures = true\n", "max_failures = True: expected a whole number"),
        (BASE + "max_failures = -1\n", "max_failures = -1: must be 0 or more"),
        (
            'name="a"\ncommand="true"\ntotal_time="0s"\nwalltime="20m"\n',
            "total_time = '0s': must be longer than zero",
        ),
        ('name="a"\ncommand="true"\ntotal_time="1h"\nwalltime="-5m"\n', "walltime = '-5m': not a duration"),
        (
            'name="a"\ncommand="true"\ntotal_time="1h"\nwalltime=3600\n',
            "walltime = 3600: expected a duration",
        ),
        (
            'name="a"\ncommand="true"\ntotal_time="1h"\nwalltime="2h"\n',
            "walltime = '2h': longer than total_time",
        ),
        (BASE + 'grace = "30m"\n', "grace = '30m': must be shorter than walltime"),
        ('name="a/b"\ncommand="true"\ntotal_time="1h"\nwalltime="20m"\n', "name = 'a/b'"),
        ('name="my run"\ncommand="true"\ntotal_time="1h"\nwalltime="20m"\n', "name = 'my run'"),
        (BASE + 'signal = "KILL"\n', "signal = 'KILL': allowed: USR1, USR2, TERM"),
        (BASE + '[scheduler]\nkind="pbs"\n', "scheduler.kind = 'pbs': allowed: local, slurm, sge"),
        (BASE + '[scheduler]\nkind="slurm"\noptions="--mem=1G"\n', "scheduler.options"),
        (BASE + '[scheduler]\nkind="slurm"\nhost="login"\n', "workdir: with scheduler.host (or hosts) set"),
        # '~' would be this machine's home, not the host's: never a directory named '~' in workdir
        (
            BASE + 'workdir="/w"\ncheckpoint_dir="~/ckpt"\n[scheduler]\nkind="slurm"\nhost="login"\n',
            "checkpoint_dir = '~/ckpt': with scheduler.host (or hosts) set, '~' is not expanded",
        ),
        (
            BASE + 'workdir="/w"\nprogress="~/s.json:epoch"\n[scheduler]\nkind="slurm"\nhost="login"\n',
            "progress = '~/s.json:epoch': with scheduler.host (or hosts) set, '~' is not expanded",
        ),
        (BASE + '[env]\nCHAINRUN_X = "1"\n', "env.CHAINRUN_X"),
        (BASE + '[env]\n"BAD-NAME" = "1"\n', "env.BAD-NAME"),
        (BASE + 'progress = "state.json"\n', "progress = 'state.json': expected \"FILE.json:KEY\""),
        (BASE + 'progress = "state.json:"\n', "progress = 'state.json:': expected"),
        (BASE + 'progress = ":epoch"\n', "progress = ':epoch': expected"),
        (BASE + 'progress = "s.json:a..b"\n', "progress = 's.json:a..b': expected"),
        (BASE + "progress = 3\n", "progress = 3: expected a JSON file and the key of its epoch"),
        (BASE + 'name = "dup"\n', "not valid TOML"),
        ("name = \n", "not valid TOML"),
    ],
)
def test_bad_job_file_gives_one_line_naming_the_field(tmp_path: Path, text: str, needle: str) -> None:
    """Each bad input: a JobFileError (exit 2) whose one line names the file and the field."""
    path = write(tmp_path, text)
    with pytest.raises(JobFileError) as err:
        jobfile.load(path)
    message = str(err.value)
    assert needle in message
    assert str(path) in message
    assert "\n" not in message.strip() or "TOML" in message
    assert err.value.exit_code == 2


def test_missing_job_file_is_a_clear_error(tmp_path: Path) -> None:
    """A path that does not exist says so."""
    with pytest.raises(JobFileError, match="no such job file"):
        jobfile.load(tmp_path / "nope.toml")


# ---- hostile input (issue 10): one clear line, nothing run, nothing lost ----


class _TimedOut(BaseException):
    """Raised by the alarm: a BaseException, so no ``except Exception`` in the code under test eats it."""


HANG_S = 30.0  # past this, in wall time, a call is hung (blocked on a FIFO), however busy the machine


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """``fn()``, interrupted (a failure, not a hang) once it has used ``seconds`` of CPU time,
    which a busy machine does not stretch, or after HANG_S, in which a blocked call uses none."""

    def alarm(signum: int, frame: object) -> None:
        raise _TimedOut(f"still running after {seconds} s of CPU time or {HANG_S:g} s")

    old = {sig: signal.signal(sig, alarm) for sig in (signal.SIGALRM, signal.SIGPROF)}
    signal.setitimer(signal.ITIMER_PROF, seconds)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, HANG_S))
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.setitimer(signal.ITIMER_PROF, 0)
        for sig, handler in old.items():
            signal.signal(sig, handler)


def refused(path: Path | str, *needles: str) -> str:
    """The one-line JobFileError ``load(path)`` raises, within 5 s of CPU time, holding every needle."""
    try:
        within(5, lambda: jobfile.load(path))
    except JobFileError as err:
        message = str(err)
        assert err.exit_code == 2
        assert "\n" not in message and "\r" not in message, message
        assert len(message) < 1000, message
        for needle in needles:
            assert needle in message, message
        return message
    except _TimedOut:
        pytest.fail(f"load({path}) hung")
    pytest.fail(f"load({path}) accepted it")


def test_a_fifo_as_the_job_file_is_refused_without_blocking(tmp_path: Path) -> None:
    """Nothing writes to the FIFO: opening it for reading must not wait for a writer."""
    fifo = tmp_path / "job.toml"
    os.mkfifo(fifo)
    refused(fifo, str(fifo), "FIFO", "regular file")


def test_a_symlink_to_a_fifo_is_refused_too(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "job.toml").symlink_to(tmp_path / "pipe")
    refused(tmp_path / "job.toml", "FIFO")


def test_a_device_as_the_job_file_is_refused_unread() -> None:
    """/dev/null would read as an empty file (and /dev/zero forever): a device is not a job file."""
    refused("/dev/null", "/dev/null", "character device")


def test_dev_zero_as_the_job_file_is_refused_at_once(tmp_path: Path) -> None:
    """Read to its end, /dev/zero fills the memory: the real CLI refuses it in one line, under a
    memory limit that turns an attempt to read it all into a quick failure rather than a swapping box."""

    def limit() -> None:  # runs in the child only
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    env = dict(os.environ, CHAINRUN_HOME=str(tmp_path / "home"), PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-m", "chainrun", "check", "/dev/zero"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        preexec_fn=limit,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert (
        result.stderr.count("\n") == 1
        and "/dev/zero" in result.stderr
        and "character device" in result.stderr
    )


def test_a_directory_or_a_symlink_loop_as_the_job_file_is_one_line(tmp_path: Path) -> None:
    refused(tmp_path, str(tmp_path), "directory")
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    refused(tmp_path / "a", str(tmp_path / "a"), "symbolic links")


def test_a_symlink_to_a_job_file_is_read(tmp_path: Path) -> None:
    """The common case: chain.toml linked from elsewhere. Relative paths start at the target's directory."""
    (tmp_path / "real").mkdir()
    target = write(tmp_path / "real", BASE)
    (tmp_path / "link.toml").symlink_to(target)
    spec = jobfile.load(tmp_path / "link.toml")
    assert spec.workdir == str(tmp_path / "real")


def test_a_job_file_over_1_mib_is_refused(tmp_path: Path) -> None:
    """Valid TOML, but 1 MiB of it is no job file."""
    path = write(tmp_path, BASE + ("# padding\n" * 110_000))
    refused(path, str(path), "1 MiB")


def test_the_service_config_goes_through_the_same_reader(tmp_path: Path) -> None:
    """The service config is read by read_toml too: a FIFO there never blocks the service."""
    fifo = tmp_path / "config.toml"
    os.mkfifo(fifo)
    with pytest.raises(JobFileError, match="FIFO") as err:
        within(5, lambda: load_config(fifo))
    assert str(fifo) in str(err.value) and "the service config" in str(err.value)


@pytest.mark.parametrize("value", ["[" * 2000 + "]" * 2000, "{a = " * 2000 + "1" + "}" * 2000])
def test_toml_nested_too_deeply_is_one_line(tmp_path: Path, value: str) -> None:
    """tomllib recurses once per level: 2,000 levels is a RecursionError, which must not escape."""
    path = write(tmp_path, BASE + f"target_epoch = {value}\n")
    refused(path, str(path), "nested too deeply")


def test_an_integer_past_pythons_digit_limit_is_one_line(tmp_path: Path) -> None:
    """tomllib lets int()'s ValueError (over 4,300 digits) through: it is invalid TOML to us."""
    path = write(tmp_path, BASE + "target_epoch = " + "9" * 5000 + "\n")
    refused(path, str(path), "not valid TOML")


@pytest.mark.parametrize("workdir", ["~nosuchuser-chainrun/x", "~nosuchuser-chainrun"])
def test_a_tilde_of_no_user_is_one_line(tmp_path: Path, workdir: str) -> None:
    refused(write(tmp_path, BASE + f'workdir = "{workdir}"\n'), "workdir = '~nosuchuser-chainrun", "'~'")


@pytest.mark.parametrize(
    "text",
    [
        "\uff18s",
        "\u0668s",
        "\U0001d7e0s",
        "4\uff48",
        "8s\n",
        "1h30m\n",
        "\n8s",
        "4h\t",
        "1:00:00\n",
        "９:００",
    ],
)
def test_durations_take_ascii_digits_and_nothing_after(text: str) -> None:
    """Python's \\d and int() take any script's digits, and $ matches before a final newline."""
    with pytest.raises(ValueError):
        parse_duration(text)


@pytest.mark.parametrize("text", ["213503982334601d", "366d", "8761h", "31536001s", "9999-00:00:00"])
def test_durations_past_a_year_are_refused(tmp_path: Path, text: str) -> None:
    """A huge total_time passed check, then every tick overflowed: at most 365 days."""
    path = write(tmp_path, f'name="a"\ncommand="true"\ntotal_time="{text}"\nwalltime="20m"\n')
    refused(path, f"total_time = '{text}'", "365 days")


def test_a_year_is_the_longest_duration(tmp_path: Path) -> None:
    spec = jobfile.load(write(tmp_path, 'name="a"\ncommand="true"\ntotal_time="365d"\nwalltime="8760h"\n'))
    assert spec.total_time == spec.walltime == 365 * 86400


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ("on_end = {}\n", "on_end = "),
        ("[env]\nBIG = {}\n", "env.BIG = "),
    ],
)
def test_strings_past_64_kib_are_refused(tmp_path: Path, extra: str, needle: str) -> None:
    """A 200,000-character value passed check, then every segment exited 126 (E2BIG)."""
    path = write(tmp_path, BASE + extra.format('"' + "x" * 200_000 + '"'))
    message = refused(path, needle, "64 KiB")
    assert "x" * 300 not in message  # the value is shown cut short


def test_a_command_past_64_kib_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, 'name="a"\ncommand="' + "x" * 200_000 + '"\ntotal_time="1h"\nwalltime="20m"\n')
    refused(path, "command = ", "64 KiB")


def test_an_environment_past_the_kernels_limit_is_refused(tmp_path: Path) -> None:
    """Each variable under 64 KiB, but together past what exec() takes with the command."""
    n = schema.arg_budget() // (60 << 10) + 1
    values = "".join(f'V{i} = "{"x" * (60 << 10)}"\n' for i in range(n))
    path = write(tmp_path, BASE + "[env]\n" + values)
    refused(path, str(path), "env = ", "kernel's limit")


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ('[env]\nA = "a\\u0000b"\n', "env.A"),
        ('webhook = "https://h.example.org/\\u0000"\n', "webhook"),
        ('on_end = "echo\\u0000"\n', "on_end"),
        ('checkpoint_dir = "ck\\u0000"\n', "checkpoint_dir"),
        ('workdir = "w\\u0000"\n', "workdir"),
        ('signal = "USR1\\u0000"\n', "signal"),
        ('[scheduler]\nkind = "slurm"\noptions = ["--mem=1G\\u0000"]\n', "scheduler.options"),
        ('[scheduler]\nkind = "slurm"\nqueue = "gpu\\u0000"\n', "scheduler.queue"),
        ('[scheduler]\nkind = "slurm\\u0000"\n', "scheduler.kind"),
    ],
)
def test_a_nul_anywhere_is_refused_naming_the_field(tmp_path: Path, extra: str, needle: str) -> None:
    """NUL cannot pass through exec() or a script: it was dropped silently, changing the value."""
    refused(write(tmp_path, BASE + extra), needle, "\\x00")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('name="a\\n"\ncommand="true"\ntotal_time="1h"\nwalltime="20m"\n', "name = 'a\\n'"),
        (BASE + '[env]\n"A\\n" = "1"\n', "env.'A\\n'"),
        (BASE + '[scheduler]\nkind="slurm"\nhost="h\\n"\nworkdir="/w"\n', "scheduler."),
        (BASE + '[scheduler]\nkind="slurm"\nqueue="q\\n"\n', "scheduler.queue"),
        (BASE + '[scheduler]\nkind="slurm"\nqueue="q\uff51"\n', "scheduler.queue"),
    ],
)
def test_a_trailing_newline_or_non_ascii_letter_does_not_slip_past_a_pattern(
    tmp_path: Path, text: str, needle: str
) -> None:
    refused(write(tmp_path, text), needle)


@pytest.fixture
def odd_paths(tmp_path: Path) -> dict[str, str]:
    """Things a directory setting may point at, none of them a usable directory."""
    (tmp_path / "file").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    return {
        "file": str(tmp_path / "file"),
        "fifo": str(tmp_path / "fifo"),
        "devnull": "/dev/null",
        "loop": str(tmp_path / "loop1"),
        "under-a-file": str(tmp_path / "file" / "x"),
        "dangling": str(tmp_path / "dangling"),
        "missing": str(tmp_path / "missing"),
    }


@pytest.mark.parametrize("kind", ["file", "fifo", "devnull", "loop", "under-a-file", "dangling", "missing"])
def test_workdir_must_be_an_existing_directory(tmp_path: Path, odd_paths: dict[str, str], kind: str) -> None:
    (tmp_path / "job").mkdir()
    path = write(tmp_path / "job", BASE + f'workdir = "{odd_paths[kind]}"\n')
    refused(path, f"workdir = '{odd_paths[kind]}'")


@pytest.mark.parametrize("kind", ["file", "fifo", "devnull", "loop", "under-a-file", "dangling"])
def test_checkpoint_dir_must_not_be_something_else(
    tmp_path: Path, odd_paths: dict[str, str], kind: str
) -> None:
    (tmp_path / "job").mkdir()
    path = write(tmp_path / "job", BASE + f'checkpoint_dir = "{odd_paths[kind]}"\n')
    refused(path, f"checkpoint_dir = '{odd_paths[kind]}'")


def test_a_missing_checkpoint_dir_is_fine(tmp_path: Path) -> None:
    """The wrapper creates it."""
    spec = jobfile.load(write(tmp_path, BASE + 'checkpoint_dir = "not/yet/there"\n'))
    assert spec.checkpoint_dir == str(tmp_path / "not" / "yet" / "there")


def test_paths_of_a_remote_chain_are_not_checked_here(tmp_path: Path) -> None:
    """With scheduler.host set, workdir and checkpoint_dir are on the cluster."""
    text = (
        BASE
        + 'workdir = "/dev/null"\ncheckpoint_dir = "/etc/passwd"\n[scheduler]\nkind="slurm"\nhost="login"\n'
    )
    spec = jobfile.load(write(tmp_path, text))
    assert (spec.workdir, spec.checkpoint_dir) == ("/dev/null", "/etc/passwd")


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ('[scheduler]\nqueue = "gpu"\n', "scheduler.queue = 'gpu'"),
        ('[scheduler]\nkind = "local"\noptions = ["--mem=1G"]\n', "scheduler.options = ['--mem=1G']"),
    ],
)
def test_queue_and_options_are_refused_for_the_local_runner(tmp_path: Path, extra: str, needle: str) -> None:
    """They were accepted and ignored: a user who set them expects them to matter."""
    refused(write(tmp_path, BASE + extra), needle, 'only applies to kind = "slurm" or "sge"')


@pytest.mark.parametrize(
    "url",
    [
        "ftp://h.example.org/x",
        "file:///etc/passwd",
        "http:///x",
        "https://",
        "http://exa mple.org/",
        "http://h.example.org/a b",
        "http://h\u00a0x.org/",
        "http://-bad-.org/",
        "http://a..b/",
        "http://h.example.org:99999/",
        "http://[::1/",
        "javascript:alert(1)",
        "https:h.example.org",
    ],
)
def test_a_webhook_must_be_http_with_a_valid_host(tmp_path: Path, url: str) -> None:
    refused(write(tmp_path, BASE + f'webhook = "{url}"\n'), "webhook = ", "URL")


@pytest.mark.parametrize(
    "url",
    [
        "https://hooks.example.org/chainrun?t=1",
        "http://127.0.0.1:8080/x",
        "http://[::1]:9/",
    ],
)
def test_good_webhooks_pass(tmp_path: Path, url: str) -> None:
    assert jobfile.load(write(tmp_path, BASE + f'webhook = "{url}"\n')).webhook == url


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ("target_epoch = 99999999999999999999999\n", "target_epoch"),
        ("max_failures = 9223372036854775807\n", "max_failures"),
        ('"a\\nb" = 1\n', "unknown key 'a\\nb'"),
        ('"' + "k" * 5000 + '" = 1\n', "unknown key 'kkk"),
    ],
)
def test_numbers_and_keys_that_would_break_later_are_one_short_line(
    tmp_path: Path, extra: str, needle: str
) -> None:
    """An integer SQLite cannot store; a key that would break the line or flood the terminal."""
    refused(write(tmp_path, BASE + extra), needle)


@pytest.mark.parametrize(
    ("command", "scripts"),
    [
        ("python train.py --lr 0.1", ["train.py"]),
        ("exec python3 -u train.py", ["train.py"]),
        ("bash run.sh && ./post", ["run.sh", "./post"]),
        ("torchrun --nproc-per-node 4 src/main.py --config=conf.py", ["src/main.py"]),
        ("srun python 'my script.py' 2>&1 | tee log.txt", ["my script.py"]),
        ("python -m pkg.main", []),
        ("python -c 'import x.py'", []),
        ("python train.py > out.py", ["train.py"]),
        ("python $SCRIPT.py {lr}.py ~/x.py *.py", []),
        ("cd sub && python train.py", []),
        ("python 'unterminated", []),
    ],
)
def test_the_scripts_a_command_names(command: str, scripts: list[str]) -> None:
    assert jobfile.scripts_named(command) == scripts


def test_check_and_submit_refuse_a_command_whose_script_is_not_in_the_workdir(
    tmp_path: Path, chainrun: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    """`python trian.py` would fail in every segment: check and submit say so at once, in one
    line naming the script, the directory and the machine; nothing is stored."""
    path = tmp_path / "job.toml"
    path.write_text(BASE.replace('command="true"', 'command="python3 trian.py --epochs 3"'))
    (tmp_path / "train.py").write_text("pass\n")
    for command in ("check", "submit"):
        result = chainrun(command, str(path))
        assert result.returncode == 2, result
        assert result.stderr == (
            f"chainrun: {path}: command: trian.py is not in {tmp_path} on this machine, where the command "
            "runs; fix the command, or the workdir\n"
        )
    assert json.loads(chainrun("status", "--json", "--all", check=True).stdout) == []
    path.write_text(BASE.replace('command="true"', 'command="python3 train.py --epochs 3"'))
    assert chainrun("check", str(path)).returncode == 0
