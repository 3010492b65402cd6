"""Containers in the job file: validation, the runtime found on PATH, and the line that runs
the command inside. Chains that really run in a Charliecloud image are in test_contract.py."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from chainrun import container, jobfile
from chainrun.errors import JobFileError
from chainrun.schedulers.script import render_script
from chainrun.schedulers.segment import SegmentJob
from chainrun.schedulers.slurm import SlurmScheduler

BASE = 'name = "t"\ncommand = "python3 train.py"\ntotal_time = "2h"\nwalltime = "1h"\n'


def fake_runtime(tmp_path: Path, program: str) -> dict[str, str]:
    """A PATH holding only ``program`` (an executable that does nothing)."""
    bin_dir = tmp_path / f"bin-{program}"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / program).write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / program).chmod(0o755)
    return {"PATH": str(bin_dir)}


def load(tmp_path: Path, text: str, environ: dict[str, str]) -> jobfile.JobSpec:  # type: ignore[name-defined]
    path = tmp_path / "job.toml"
    path.write_text(BASE + text)
    return jobfile.load(path, environ=environ)


@pytest.fixture
def image(tmp_path: Path) -> Path:
    """A Charliecloud image directory with the test's workdir (tmp_path) as a mount point."""
    img = tmp_path / "img"
    (img / str(tmp_path).lstrip("/")).mkdir(parents=True)
    return img


def test_the_runtime_is_found_on_path_charliecloud_first(tmp_path: Path, image: Path) -> None:
    both = {
        "PATH": fake_runtime(tmp_path, "apptainer")["PATH"] + ":" + fake_runtime(tmp_path, "ch-run")["PATH"]
    }
    assert load(tmp_path, f'container = "{image}"\n', both).container_runtime == "charliecloud"
    only = fake_runtime(tmp_path, "singularity")
    assert load(tmp_path, f'container = "{image}"\n', only).container_runtime == "singularity"


def test_charliecloud_binds_workdir_and_an_outside_checkpoint_dir_and_execs_in_place(tmp_path: Path) -> None:
    work, ckpt, img = tmp_path / "w", tmp_path / "ck", tmp_path / "img"
    for d in (work, img / str(work).lstrip("/"), img / str(ckpt).lstrip("/")):
        d.mkdir(parents=True)
    spec = load(
        tmp_path,
        f'workdir = "w"\ncheckpoint_dir = "{ckpt}"\ncontainer = "img"\ncontainer_options = ["--private-tmp"]\n',
        fake_runtime(tmp_path, "ch-run"),
    )
    words = ["ch-run", "-b", str(work), "-b", str(ckpt), "-c", str(work), "--private-tmp", str(img), "--"]
    assert container.argv(spec, spec.workdir) == words
    script = render_script(SlurmScheduler(), SegmentJob("t-1", 1, spec, 3600))
    assert f"{shlex.join(words)} bash -c 'python3 train.py' &" in script


def test_apptainer_execs_the_image_with_binds_and_the_workdir(tmp_path: Path) -> None:
    spec = load(
        tmp_path,
        'container = "docker://python:3.11"\ncontainer_runtime = "apptainer"\ncontainer_options = ["--nv"]\n',
        {},
    )
    work = str(tmp_path)
    assert container.argv(spec, spec.workdir) == [
        "apptainer", "exec", "--bind", work, "--pwd", work, "--nv", "docker://python:3.11"
    ]  # fmt: skip


def test_hostile_paths_and_options_stay_single_words_in_the_script(tmp_path: Path) -> None:
    """bash itself reads the rendered line back into exactly the words chainrun meant."""
    work = tmp_path / "w $(id) 'q'\nx"
    (work / "img" / str(work).lstrip("/")).mkdir(parents=True)
    path = work / "job.toml"
    path.write_text(BASE + 'container = "img"\ncontainer_options = ["--set-env=A=$(id)", "-w"]\n')
    spec = jobfile.load(path, environ=fake_runtime(tmp_path, "ch-run"))
    script = render_script(SlurmScheduler(), SegmentJob("t-1", 1, spec, 3600))
    line = next(x for x in script.splitlines() if x.endswith(" bash -c 'python3 train.py' &"))[: -len(" &")]
    probe = tmp_path / "probe.sh"
    probe.write_text(f"set -- {line}\nprintf '%s\\0' \"$@\"\n")
    words = (
        subprocess.run(["bash", str(probe)], capture_output=True, check=True).stdout.decode().split("\0")[:-1]
    )
    assert words == [*container.argv(spec, spec.workdir), "bash", "-c", "python3 train.py"]
    assert "--set-env=A=$(id)" in words and str(work / "img") in words


@pytest.mark.parametrize(
    ("text", "environ", "needle"),
    [
        ('container = "nope"\n', "ch-run", "container = 'nope': "),
        ('container = "img"\n', "", "no container runtime on PATH"),
        ('container = "img"\ncontainer_runtime = "docker"\n', "ch-run", "allowed: charliecloud, apptainer"),
        ('container_options = ["-w"]\n', "ch-run", "only applies with container = IMAGE"),
        ('container = "img"\ncontainer_options = "-w"\n', "ch-run", "expected a list of strings"),
        ('container = ""\n', "ch-run", "must name an image"),
        (
            'container = "/cluster/img"\n[scheduler]\nkind = "slurm"\nhost = "login"\n',
            "ch-run",
            'container_runtime = "charliecloud"',
        ),
    ],
)
def test_bad_container_settings_are_one_line_naming_the_key(
    tmp_path: Path, text: str, environ: str, needle: str
) -> None:
    (tmp_path / "img").mkdir()
    env = fake_runtime(tmp_path, environ) if environ else {"PATH": str(tmp_path / "empty")}
    if "host" in text:
        text = text.replace("[scheduler]", 'workdir = "/cluster/w"\n[scheduler]')
    with pytest.raises(JobFileError) as err:
        load(tmp_path, text, env)
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert err.value.exit_code == 2


def test_an_image_without_the_mount_point_is_refused_with_what_to_do(tmp_path: Path) -> None:
    """ch-run binds only at paths the image has (its /tmp is the host's): say so at check,
    not at the first segment; with -w ch-run makes the mount point itself."""
    work = Path("/var/tmp") / f"chainrun-test-{os.getpid()}"
    work.mkdir(exist_ok=True)
    try:
        img = tmp_path / "img"
        img.mkdir()
        path = work / "job.toml"
        path.write_text(BASE + f'container = "{img}"\n')
        with pytest.raises(JobFileError) as err:
            jobfile.load(path, environ=fake_runtime(tmp_path, "ch-run"))
        assert f"the image has no {work} to bind it at" in str(err.value)
        assert f"mkdir -p {img}{work}" in str(err.value)
        path.write_text(BASE + f'container = "{img}"\ncontainer_options = ["-w"]\n')
        assert jobfile.load(path, environ=fake_runtime(tmp_path, "ch-run")).container == str(img)
    finally:
        for p in work.iterdir():
            p.unlink()
        work.rmdir()
