"""Containers in the job file: validation, the runtime found on PATH, and the line that runs
the command inside. Chains that really run in a Charliecloud image are in test_contract.py."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import answers, have, need, settings_of, wait_for
from test_contract import SSH_CONFIG, TEST_IMAGE

from chainrun import container, jobfile
from chainrun.errors import JobFileError
from chainrun.schedulers.script import render_script
from chainrun.schedulers.segment import SegmentJob
from chainrun.schedulers.slurm import SlurmScheduler

CLI = Callable[..., "subprocess.CompletedProcess[str]"]
Service = Callable[..., "subprocess.Popen[bytes]"]
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
    assert (settings_of(script)["container"], settings_of(script)["command"]) == (words, "python3 train.py")


def test_a_snapshot_of_a_job_in_a_subdirectory_binds_the_parent_its_working_copy_links_in(
    tmp_path: Path,
) -> None:
    """The working copy pairs the repository's top with the workdir's parent (``../data``):
    inside the container those links must lead somewhere."""
    work, img = tmp_path / "repo" / "exp", tmp_path / "img"
    for d in (work, img / str(work.parent).lstrip("/")):
        d.mkdir(parents=True)
    spec = load(tmp_path, 'workdir = "repo/exp"\ncontainer = "img"\n', fake_runtime(tmp_path, "ch-run"))
    assert container.binds(spec) == [str(work)]
    snap = replace(spec, snapshot_commit="c0ffee", snapshot_subdir="exp")
    assert container.binds(snap) == [str(work.parent)]
    assert container.binds(replace(snap, snapshot_subdir="")) == [str(work)]


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
    """The runner gets exactly the words chainrun meant: they travel as JSON, no shell reads them."""
    work = tmp_path / "w $(id) 'q'\nx"
    (work / "img" / str(work).lstrip("/")).mkdir(parents=True)
    path = work / "job.toml"
    path.write_text(BASE + 'container = "img"\ncontainer_options = ["--set-env=A=$(id)", "-w"]\n')
    spec = jobfile.load(path, environ=fake_runtime(tmp_path, "ch-run"))
    script = render_script(SlurmScheduler(), SegmentJob("t-1", 1, spec, 3600))
    words = [*settings_of(script)["container"], "bash", "-c", settings_of(script)["command"]]
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


def test_container_gpus_renders_the_runtime_s_gpu_option(tmp_path: Path, image: Path) -> None:
    """Apptainer and Singularity get --nv in the segment's command line; ch-run has no GPU
    option (Charliecloud puts the driver's libraries into the image: ch-fromhost --nvidia), so
    its line is as without container_gpus."""
    for runtime in ("apptainer", "singularity"):
        spec = load(
            tmp_path,
            f'container = "{image}"\ncontainer_runtime = "{runtime}"\ncontainer_gpus = true\n',
            fake_runtime(tmp_path, runtime),
        )
        script = render_script(SlurmScheduler(), SegmentJob("t-1", 1, spec, 3600))
        work = str(tmp_path)
        words = [runtime, "exec", "--bind", work, "--pwd", work, "--nv", str(image)]
        assert settings_of(script)["container"] == words
    plain = load(tmp_path, f'container = "{image}"\n', fake_runtime(tmp_path, "ch-run"))
    gpus = load(tmp_path, f'container = "{image}"\ncontainer_gpus = true\n', fake_runtime(tmp_path, "ch-run"))
    assert container.argv(gpus, gpus.workdir) == container.argv(plain, plain.workdir)
    with pytest.raises(JobFileError, match="only applies with container = IMAGE"):
        load(tmp_path, "container_gpus = true\n", {})
    with pytest.raises(JobFileError, match=r"container_gpus = 'yes': .*true or false"):
        load(tmp_path, f'container = "{image}"\ncontainer_gpus = "yes"\n', fake_runtime(tmp_path, "ch-run"))


def test_a_charliecloud_image_without_gpu_libraries_is_refused_at_submit_with_ch_fromhost(
    tmp_path: Path, image: Path, chainrun: CLI
) -> None:
    """container_gpus with a Charliecloud image that lacks the driver's libraries: submit says
    to run ch-fromhost --nvidia on it, and stores nothing; with libcuda.so in it, it is stored."""
    need("ch-run", have("ch-run"), "apt-get install charliecloud")
    path = tmp_path / "job.toml"
    path.write_text(BASE + f'container = "{image}"\ncontainer_gpus = true\n')
    (tmp_path / "train.py").write_text("pass\n")
    refused = chainrun("submit", str(path))
    assert refused.returncode == 2, refused.stderr
    assert f"ch-fromhost --nvidia {image}" in refused.stderr and "\n" not in refused.stderr.strip()
    assert chainrun("status", "--json", check=True).stdout.strip() == "[]"
    libs = image / "usr" / "lib" / "x86_64-linux-gnu"
    libs.mkdir(parents=True)
    (libs / "libcuda.so.1").write_text("")
    chain_id = chainrun("submit", str(path), check=True).stdout.strip()
    chainrun("cancel", chain_id, check=True)


@pytest.mark.ssh
@pytest.mark.parametrize(
    ("runtime", "image", "needle"),
    [
        (
            "apptainer",
            str(TEST_IMAGE),
            "apptainer (apptainer) is not on PATH on crtest-local, where the segments run",
        ),
        ("charliecloud", "/nonexistent/image", "/nonexistent/image: no such image on crtest-local"),
    ],
    ids=["runtime-missing-there", "image-missing-there"],
)
def test_the_container_is_checked_on_the_host_that_runs_the_segments(
    tmp_path: Path, chainrun: CLI, monkeypatch: pytest.MonkeyPatch, runtime: str, image: str, needle: str
) -> None:
    """host set: the runtime and the image are looked for over SSH, on that host, at submit; a
    missing one is one line naming the host, and nothing is stored."""
    need("the test sshd", answers("ssh", "-F", SSH_CONFIG, "crtest-local", "true"), "scripts/start-sshd")
    monkeypatch.setenv("CHAINRUN_SSH_CONFIG", SSH_CONFIG)
    path = tmp_path / "job.toml"
    path.write_text(
        BASE
        + f'workdir = "/tmp"\ncheckpoint_dir = "/tmp/ck-{os.getpid()}"\ncontainer = "{image}"\n'
        + f'container_runtime = "{runtime}"\n[scheduler]\nhost = "crtest-local"\n'
    )
    result = chainrun("submit", str(path))
    assert result.returncode == 2, result.stdout + result.stderr
    assert needle in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert chainrun("status", "--json", check=True).stdout.strip() == "[]"


def test_an_image_missing_when_the_segment_runs_ends_the_chain_at_once_in_ch_run_s_words(
    tmp_path: Path, chainrun: CLI, service: Service
) -> None:
    """The image is there at submit and gone when the first segment runs: real ch-run fails to
    start the command, and the chain ends then, failed, one failure charged, with ch-run's own
    message, not after spending max_failures = 3 on the same crash."""
    need(
        "the Charliecloud test image", have("ch-run") and TEST_IMAGE.is_dir(), "sudo scripts/build-test-image"
    )
    link = tmp_path / "img"
    link.symlink_to(TEST_IMAGE)
    path = tmp_path / "job.toml"
    path.write_text(
        'name = "t"\ncommand = "echo ran"\ntotal_time = "10m"\nwalltime = "1m"\nmax_failures = 3\n'
        f'container = "{link}"\n'
    )
    chain_id = chainrun("submit", str(path), check=True).stdout.strip()
    link.unlink()
    service()
    wait_for(lambda: status(chainrun, chain_id)["state"] != "active", 180, "the chain to end")
    st = status(chainrun, chain_id)
    assert st["state"] == "failed" and st["failures"] == 1, st
    assert [s["n"] for s in st["segments"] if s["charged"]] == [1], st["segments"]
    assert f"ch-run could not start the command in {link}" in st["reason"], st["reason"]
    assert "error: can't stat" in st["reason"] and str(link) in st["reason"], st["reason"]


def status(chainrun: CLI, chain_id: str) -> dict[str, Any]:
    return json.loads(chainrun("status", chain_id, "--json", check=True).stdout)[0]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("runtime", "code", "last", "said"),
    [
        (
            "apptainer",
            255,
            "\x1b[31mFATAL:   \x1b[0mcould not open image /x.sif: lstat /x.sif: no such file",
            True,
        ),
        ("singularity", 255, "FATAL:   container creation failed: mount /proc->/proc error", True),
        ("apptainer", 255, "Traceback: FATAL: in my own script", False),
        ("apptainer", 1, "FATAL:   printed by the command, which exited 1", False),
        (
            "charliecloud",
            31,
            "ch-run[812]: error: can't stat: /img: No such file or directory (ch_core.c:255 2)",
            True,
        ),
        ("charliecloud", 2, "ch-run[812]: error: can't stat: /img", False),
        (
            "charliecloud",
            127,
            "/var/spool/slurm/job12/slurm_script: line 240: ch-run: command not found",
            True,
        ),
        ("charliecloud", 127, "bash: line 1: pyhton: command not found", False),
    ],
)
def test_the_runtime_s_own_start_failure_is_told_by_its_exit_status_and_last_line(
    tmp_path: Path, runtime: str, code: int, last: str, said: bool
) -> None:
    """Apptainer's sylog.Fatalf (FATAL:, exit 255), ch-run's error line with its exit status,
    and bash not finding the runtime; not a command's own output or exit status."""
    spec = load(tmp_path, f'container = "docker://x"\ncontainer_runtime = "{runtime}"\n', {})
    found = container.start_failure(spec, code, ("an earlier line", last))
    assert bool(found) is said, found
    if said:
        assert f"(exit {code})" in found or "not on PATH" in found
