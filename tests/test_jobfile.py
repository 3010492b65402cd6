"""Job files: durations, defaults, and one clear error line for every kind of bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from chainrun import jobfile
from chainrun.errors import JobFileError

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
    assert jobfile.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "4", "4x", "h", "1:99:00", "-5m", "5 m m"])
def test_non_durations_are_refused(text: str) -> None:
    """Anything else is not a duration."""
    with pytest.raises(ValueError):
        jobfile.parse_duration(text)


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


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('command="true"\ntotal_time="1h"\nwalltime="20m"\n', "name: missing"),
        ('name="a"\ntotal_time="1h"\nwalltime="20m"\n', "command: missing"),
        (BASE + 'walltme = "4h"\n', "unknown key walltme"),
        (BASE + '[scheduler]\nkind="slurm"\nqueu="gpu"\n', "unknown key scheduler.queu"),
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
        (BASE + '[scheduler]\nkind="slurm"\nhost="login"\n', "workdir: with scheduler.host set"),
        (BASE + '[env]\nCHAINRUN_X = "1"\n', "env.CHAINRUN_X"),
        (BASE + '[env]\n"BAD-NAME" = "1"\n', "env.BAD-NAME"),
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
