"""Job files with several places (``[[cluster]]``): each place in full, one clear error line
for each kind of bad input, and one table read exactly as a ``[scheduler]``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from chainrun import schema
from chainrun.errors import JobFileError
from chainrun.model import JobSpec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

TOP = """
name = "two"
command = "python3 train.py"
total_time = "10m"
walltime = "2m"
checkpoint_dir = "ckpt"
"""
TWO = (
    TOP
    + """
[[cluster]]
kind = "slurm"
queue = "debug"

[[cluster]]
kind = "sge"
walltime = "90s"
checkpoint_dir = "ckpt-sge"
"""
)


def parse(text: str, base: Path) -> JobSpec:
    return schema.parse(tomllib.loads(text), "job.toml", base)


def error(text: str, base: Path) -> str:
    with pytest.raises(JobFileError) as info:
        parse(text, base)
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_each_place_is_read_in_full_and_the_first_is_the_specs_own(tmp_path: Path) -> None:
    spec = parse(TWO, tmp_path)
    assert [p.name for p in spec.places] == ["slurm", "sge"]
    assert spec.scheduler.kind == "slurm" and spec.place_name == "slurm"
    sge = spec.at("sge")
    assert sge.scheduler.kind == "sge" and sge.place == "sge"
    assert sge.checkpoint_dir == str(tmp_path / "ckpt-sge") and spec.checkpoint_dir == str(tmp_path / "ckpt")
    assert sge.walltime == 90 and spec.walltime == 120  # the place's limit caps the job file's walltime
    assert sge.grace == spec.grace == 30  # one grace at every place: the job file's default
    assert sge.places == spec.places and sge.at("slurm") == spec


def test_the_store_keeps_the_spec_of_the_first_place_whatever_place_it_is_seen_at(tmp_path: Path) -> None:
    spec = parse(TWO, tmp_path)
    assert JobSpec.from_json(spec.at("sge").to_json()) == spec
    assert JobSpec.from_json(spec.to_json()) == spec


def test_one_cluster_table_is_exactly_a_scheduler_table(tmp_path: Path) -> None:
    one = parse(TOP + '[[cluster]]\nkind = "sge"\nqueue = "all.q"\n', tmp_path)
    scheduler = parse(TOP + '[scheduler]\nkind = "sge"\nqueue = "all.q"\n', tmp_path)
    assert one == scheduler and one.places == ()


def test_a_place_named_by_its_host(tmp_path: Path) -> None:
    text = TOP.replace('"ckpt"', '"/abs/ckpt"') + 'workdir = "/abs"\n'
    text += '[[cluster]]\nkind = "slurm"\n[[cluster]]\nkind = "slurm"\nhost = "login1"\n'
    assert [p.name for p in parse(text, tmp_path).places] == ["slurm", "slurm@login1"]


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ('[scheduler]\nkind = "local"\n', "both [scheduler] and [[cluster]]"),
        (
            '[[cluster]]\nkind = "sge"\nqueue = "bad queue"\n',
            "cluster[3].queue = 'bad queue': not a queue name",
        ),
        (
            '[[cluster]]\nkind = "sge"\nwaltime = "1h"\n',
            "unknown key cluster[3].waltime; did you mean cluster[3].walltime?",
        ),
        (
            '[[cluster]]\nkind = "slurm"\nname = "slurm"\n',
            "cluster[3].name = 'slurm': cluster[1] is named slurm too",
        ),
        (
            '[[cluster]]\nkind = "slurm"\nname = "sge"\nwalltime = "30s"\n',
            "cluster[3].walltime = '30s': too short for slurm",
        ),
        ('[[cluster]]\nkind = "sge"\nname = "x"\nhost = "login"\n', "with cluster[3].host (or hosts) set"),
        (
            '[[cluster]]\nname = "pool"\nhosts = ["a", "a"]\n',
            "cluster[3].hosts = ['a', 'a']: names a host twice",
        ),
        ('[[cluster]]\nkind = "pbs"\n', "cluster[3].kind = 'pbs': allowed: local, slurm, sge"),
        ('[[cluster]]\nkind = "sge"\nname = "no spaces"\n', "cluster[3].name = 'no spaces'"),
        ("[sweep]\n[sweep.grid]\nlr = [1, 2]\n", "a sweep cannot yet run at several places"),
    ],
)
def test_a_bad_place_is_one_line_naming_its_table(tmp_path: Path, extra: str, says: str) -> None:
    assert says in error(TWO + extra, tmp_path)


def test_cluster_must_be_tables(tmp_path: Path) -> None:
    assert "expected [[cluster]] tables" in error(TOP + 'cluster = "slurm"\n', tmp_path)
    assert "expected [[cluster]] tables" in error(TOP + "cluster = []\n", tmp_path)


def test_a_pool_is_one_place_among_others_with_its_own_absolute_workdir(tmp_path: Path) -> None:
    """A pool (``hosts``) is a place like any other (issue 39): its hosts, slots and GPUs per
    slot are that place's; its workdir there must be absolute, as on any remote host."""
    pool = '[[cluster]]\nname = "lab"\nhosts = ["gpu1", "gpu2"]\nslots = 2\ngpus_per_slot = 1\n'
    spec = parse(TWO + pool + 'workdir = "/home/me/two"\n', tmp_path)
    lab = spec.at("lab")
    assert (lab.scheduler.hosts, lab.scheduler.slots, lab.scheduler.gpus_per_slot) == (("gpu1", "gpu2"), 2, 1)
    assert lab.checkpoint_dir == "/home/me/two/ckpt" and spec.scheduler.hosts == ()
    # The job file's workdir, relative, is none on those hosts.
    assert "workdir: with cluster[3].host (or hosts) set, give an absolute path" in error(
        TWO + pool, tmp_path
    )
