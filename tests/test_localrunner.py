"""The local runner under faults (issue 9): a full CHAINRUN_HOME costs a job
nothing, and submit is idempotent by job name.

The full-disk tests mount a small tmpfs as CHAINRUN_HOME (so they need root)
and fill it; the jobs' scripts and output live outside it, as a training
run's do.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, cli_env, need, wait_for

from chainrun.localrunner import MACHINE_FILE, REFRESH, SILENT, SLACK, identity, judge, machine_dir
from chainrun.node.proc import alive

PAGE = 4096


def runner(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m chainrun.localrunner ARGS``, as the local backend runs it."""
    env = cli_env(home)
    env.pop("CHAINRUN_LOCAL_SUBMIT_DELAY", None)
    return subprocess.run(
        [sys.executable, "-m", "chainrun.localrunner", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def submit_argv(tmp_path: Path, name: str, script: Path, *options: str) -> list[str]:
    return ["submit", "--name", name, "--output", str(tmp_path / "out.log"), *options, str(script)]


def poll(home: Path) -> dict[int, dict[str, Any]]:
    result = runner(home, "poll")
    assert result.returncode == 0, result.stderr
    return {line["id"]: line for line in map(json.loads, result.stdout.splitlines())}


def make_script(tmp_path: Path, body: str) -> Path:
    """A job script outside CHAINRUN_HOME; it notes its pid, so teardown can reap what a failure left."""
    script = tmp_path / "job.sh"
    script.write_text(f"echo $$ >>{tmp_path}/pids\n{body}\n")
    return script


def ended(home: Path, job_id: int) -> dict[str, Any]:
    """Wait until poll reports job ``job_id`` ended; its poll line."""
    last: dict[str, Any] = {}

    def has_ended() -> bool:
        last.update(poll(home)[job_id])
        return bool(last["state"] == "ended")

    wait_for(has_ended, 120, "the job's end")
    return last


def fill(path: Path, spare_pages: int = 0) -> Path:
    """Fill the file system of ``path`` but ``spare_pages``; the filler file, to free it with."""
    spare = path / "spare"
    spare.write_bytes(b"\0" * PAGE * spare_pages)
    filler = path / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)
    spare.unlink()
    return filler


def _kill_ours(pid: int, marker: str, group: bool) -> None:
    """SIGKILL ``pid`` (its process group if ``group``) if its command line names ``marker``."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return
    if marker.encode() in cmdline:
        with contextlib.suppress(OSError):
            (os.killpg if group else os.kill)(pid, signal.SIGKILL)


def reap(tmp_path: Path) -> None:
    """SIGKILL this test's supervisors, then its job scripts (nothing else): no job end is recorded."""
    for path in (machine_dir(tmp_path / "home" / "local") / "jobs").glob("*/supervisor.pid"):
        with contextlib.suppress(OSError, ValueError):
            _kill_ours(int(path.read_text().split()[0]), str(tmp_path), group=False)
    pids = tmp_path / "pids"
    for pid in pids.read_text().split() if pids.exists() else []:
        _kill_ours(int(pid), str(tmp_path), group=True)  # the script leads its session and group


@pytest.fixture
def small_home(tmp_path: Path) -> Iterator[Path]:
    """CHAINRUN_HOME on a 4 MiB tmpfs of its own, which the test may fill."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs as a fillable CHAINRUN_HOME needs root")
    path = tmp_path / "home"
    path.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
    try:
        yield path
    finally:
        reap(tmp_path)
        subprocess.run(["umount", "--lazy", str(path)], check=True)


@pytest.fixture
def local_home(home: Path, tmp_path: Path) -> Iterator[Path]:
    """CHAINRUN_HOME on an ordinary directory; leftover jobs are reaped."""
    yield home
    reap(tmp_path)


def test_full_home_when_the_job_starts_costs_nothing(small_home: Path, tmp_path: Path) -> None:
    """start.json cannot be written: the walltime is still enforced, and the job is never called ended early."""
    home = small_home
    got = tmp_path / "signals"
    script = make_script(
        tmp_path,
        f"trap 'echo USR1 >>{got}; exit 0' USR1\necho started >{tmp_path}/started\nwhile :; do sleep 0.1; done",
    )
    # The job waits for a dependency the test holds, so that the disk is full
    # before the job starts: then start.json cannot be written.
    gate = subprocess.Popen(["sleep", "600"])
    try:
        dependency = machine_dir(home / "local") / "jobs" / "1000"
        dependency.mkdir(mode=0o700, parents=True)
        (dependency / "supervisor.pid").write_text(identity(gate.pid))
        result = runner(
            home,
            *submit_argv(
                tmp_path,
                "cr.x.1",
                script,
                "--walltime",
                "6",
                "--signal",
                "USR1",
                "--grace",
                "2",
                "--after",
                "1000",
            ),
        )
        assert result.returncode == 0, result.stderr
        job_id = int(result.stdout)
        filler = fill(home)
    finally:
        gate.kill()
        gate.wait()

    def running_until(done: Path) -> bool:
        line = poll(home)[job_id]
        assert line["state"] in ("pending", "running"), f"poll said {line} while the command ran"
        return done.exists()

    wait_for(lambda: running_until(tmp_path / "started"), 60, "the job's command to start")
    wait_for(lambda: running_until(got), 60, "the walltime signal, on a full disk")
    assert not (machine_dir(home / "local") / "jobs" / str(job_id) / "start.json").exists(), (
        "the disk was not full"
    )
    filler.unlink()

    line = ended(home, job_id)
    # Exiting 0 on the signal, before the walltime, is "completed"; a job still
    # running at the walltime would be a "timeout".
    assert (line["outcome"], line["exit_code"]) == ("completed", 0), line
    assert got.read_text() == "USR1\n"
    assert not alive(int((tmp_path / "pids").read_text()))


def test_full_home_when_the_job_ends_costs_nothing(small_home: Path, tmp_path: Path) -> None:
    """end.json cannot be written at first: the job stays running, then ends with its real exit code."""
    home = small_home
    go = tmp_path / "go"
    script = make_script(
        tmp_path,
        f"sleep 600 &\necho $! >{tmp_path}/child\nwhile [ ! -e {go} ]; do sleep 0.1; done\nexit 3",
    )
    result = runner(home, *submit_argv(tmp_path, "cr.x.1", script, "--walltime", "600"))
    assert result.returncode == 0, result.stderr
    job_id = int(result.stdout)
    wait_for(lambda: poll(home)[job_id]["state"] == "running", 60, "the job to run")
    wait_for(lambda: (tmp_path / "child").exists(), 60, "the script's child")
    script_pid = int((tmp_path / "pids").read_text())
    supervisor = int(
        (machine_dir(home / "local") / "jobs" / str(job_id) / "supervisor.pid").read_text().split()[0]
    )

    filler = fill(home)
    go.touch()
    wait_for(lambda: not Path(f"/proc/{script_pid}").exists(), 60, "the supervisor to reap the script")
    # The disk stays full for a while: the job's end is not known yet, and
    # above all it is no "node_fail".
    until = time.monotonic() + 3
    while time.monotonic() < until:
        line = poll(home)[job_id]
        assert line["state"] == "running", f"poll said {line} while end.json could not be written"
    assert not (machine_dir(home / "local") / "jobs" / str(job_id) / "end.json").exists(), (
        "the disk was not full"
    )
    filler.unlink()

    line = ended(home, job_id)
    assert (line["outcome"], line["exit_code"]) == ("failed", 3), line
    assert (
        json.loads((machine_dir(home / "local") / "jobs" / str(job_id) / "end.json").read_text())["exit_code"]
        == 3
    )
    assert not alive(int((tmp_path / "child").read_text())), "a process of the job outlived it"
    wait_for(lambda: not alive(supervisor), 60, "the supervisor to exit")


@pytest.mark.parametrize("spare_pages", [0, 1], ids=["first-write", "after-mkdir"])
def test_submit_on_a_full_home_fails_in_one_line_and_leaves_no_job(
    small_home: Path, tmp_path: Path, spare_pages: int
) -> None:
    """Exit 1 (the service tries again later), one line on stderr, and no job; once there is room, submit works."""
    home = small_home
    script = make_script(tmp_path, "exit 0")
    first = runner(home, *submit_argv(tmp_path, "cr.x.1", script, "--walltime", "60"))
    assert first.returncode == 0, first.stderr
    first_id = int(first.stdout)
    ended(home, first_id)

    # With a page to spare, the counter is written, the job's directory made
    # and its supervisor started before a write fails: that half-made job
    # must go too.
    filler = fill(home, spare_pages)
    result = runner(home, *submit_argv(tmp_path, "cr.x.2", script, "--walltime", "60"))
    assert result.returncode == 1, result
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and "No space left on device" in result.stderr, result.stderr
    assert list(poll(home)) == [first_id]
    assert [p.name for p in (machine_dir(home / "local") / "jobs").iterdir()] == [str(first_id)]
    assert not (machine_dir(home / "local") / "new").exists()

    filler.unlink()
    again = runner(home, *submit_argv(tmp_path, "cr.x.2", script, "--walltime", "60"))
    assert again.returncode == 0, again.stderr
    assert ended(home, int(again.stdout))["outcome"] == "completed"


def test_two_submits_of_one_name_run_one_job(local_home: Path, tmp_path: Path) -> None:
    """Submitted twice at once (a service restarted mid-submission), a segment runs once; both get its id."""
    home = local_home
    go, runs = tmp_path / "go", tmp_path / "runs"
    script = make_script(tmp_path, f"echo run >>{runs}\nwhile [ ! -e {go} ]; do sleep 0.1; done")
    env = cli_env(home)
    env.pop("CHAINRUN_LOCAL_SUBMIT_DELAY", None)
    argv = [
        sys.executable,
        "-m",
        "chainrun.localrunner",
        *submit_argv(tmp_path, "cr.x.1", script, "--walltime", "60"),
    ]
    procs = [
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    results = [(proc.communicate(timeout=120), proc.returncode) for proc in procs]
    assert [rc for _, rc in results] == [0, 0], results
    ids = {out.strip() for (out, _), _ in results}
    assert len(ids) == 1, results
    (job_id,) = ids
    notes = sorted(err for (_, err), _ in results)
    assert notes == ["", f"localrunner: job cr.x.1 already queued as {job_id}\n"]
    assert [p.name for p in (machine_dir(home / "local") / "jobs").iterdir()] == [job_id]

    go.touch()
    assert ended(home, int(job_id))["outcome"] == "completed"
    assert runs.read_text() == "run\n"

    # Once that job has ended, the name no longer stands for it.
    again = runner(home, *submit_argv(tmp_path, "cr.x.1", script, "--walltime", "60"))
    assert again.returncode == 0 and again.stderr == "", again
    assert again.stdout.strip() != job_id
    assert ended(home, int(again.stdout))["outcome"] == "completed"
    assert runs.read_text() == "run\nrun\n"


def test_a_job_whose_supervisor_died_does_not_hold_its_name(local_home: Path, tmp_path: Path) -> None:
    """A job reported node_fail has ended: a new submit of its name queues a new job."""
    home = local_home
    script = make_script(tmp_path, "sleep 600")
    first = runner(home, *submit_argv(tmp_path, "cr.x.1", script, "--walltime", "600"))
    assert first.returncode == 0, first.stderr
    first_id = int(first.stdout)
    wait_for(lambda: poll(home)[first_id]["state"] == "running", 60, "the job to run")
    reap(tmp_path)
    wait_for(lambda: poll(home)[first_id].get("outcome") == "node_fail", 60, "node_fail")

    again = runner(home, *submit_argv(tmp_path, "cr.x.1", script, "--walltime", "600"))
    assert again.returncode == 0 and again.stderr == "", again
    assert int(again.stdout) != first_id
    runner(home, "cancel", again.stdout.strip())
    assert ended(home, int(again.stdout))["outcome"] == "cancelled"


def test_slots_let_no_more_jobs_run_than_the_machine_has_and_name_each_its_gpus(
    local_home: Path, tmp_path: Path
) -> None:
    """With --slots 2, a third ready job waits ("Resources") until a slot frees; each job gets
    its slot as CHAINRUN_SLOT and, with --gpus-per-slot 2, that slot's GPUs."""
    home = local_home
    ids = []
    for name in ("a", "b", "c"):
        script = tmp_path / f"{name}.sh"
        script.write_text(
            f"echo $$ >>{tmp_path}/pids\necho $CHAINRUN_SLOT $CUDA_VISIBLE_DEVICES >{tmp_path}/{name}.saw\n"
            f"while [ ! -e {tmp_path}/{name}.go ]; do sleep 0.1; done\n"
        )
        options = ("--walltime", "120", "--slots", "2", "--gpus-per-slot", "2")
        result = runner(home, *submit_argv(tmp_path, f"cr.{name}.1", script, *options))
        assert result.returncode == 0, result.stderr
        ids.append(int(result.stdout))
        if name != "c":  # a and b take the two slots before c is queued
            wait_for((tmp_path / f"{name}.saw").exists, 60, f"job {name} to start")
    a, b, c = ids
    assert {(tmp_path / n).read_text() for n in ("a.saw", "b.saw")} == {"0 0,1\n", "1 2,3\n"}
    wait_for(lambda: poll(home)[c].get("reason") == "Resources", 60, "job c to wait for a slot")
    assert not (tmp_path / "c.saw").exists() and poll(home)[c]["state"] == "pending"

    (tmp_path / "a.go").touch()
    assert ended(home, a)["outcome"] == "completed"
    wait_for(lambda: (tmp_path / "c.saw").exists(), 60, "job c to start in a's slot")
    assert (tmp_path / "c.saw").read_text() == (tmp_path / "a.saw").read_text()
    assert poll(home)[b]["state"] == "running"
    for name in ("b", "c"):
        (tmp_path / f"{name}.go").touch()
    assert ended(home, c)["slot"] == poll(home)[a]["slot"]


def test_nothing_the_job_started_outlives_it_not_even_what_left_its_session(
    local_home: Path, tmp_path: Path
) -> None:
    """The command leaves behind a process in a session of its own, deaf to TERM and orphaned
    (as torchrun's ranks are when the walltime signal kills torchrun during their rendezvous):
    once the job has ended, that process is gone, as a scheduler's cgroup would see to. It
    lived on, outside the session the runner killed."""
    stray = tmp_path / "stray.pid"
    body = (
        f"setsid bash -c 'trap \"\" TERM HUP USR1; echo $$ >{stray}; exec sleep 600' </dev/null >/dev/null 2>&1 &\n"
        f"while [ ! -s {stray} ]; do sleep 0.1; done"
    )
    result = runner(
        local_home, *submit_argv(tmp_path, "cr.s.1", make_script(tmp_path, body), "--walltime", "60")
    )
    assert result.returncode == 0, result.stderr
    assert ended(local_home, int(result.stdout))["outcome"] == "completed"
    pid = int(stray.read_text())
    try:
        wait_for(lambda: _gone(pid), 30, "the stray process to be gone")
    finally:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _gone(pid: int) -> bool:
    """The process has ended (a zombie has too)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].startswith("Z")
    except FileNotFoundError:
        return True


def _recorded_job(home: Path, job_id: int, supervisor: str) -> None:
    """A job record as a supervisor left it: job.json and its supervisor.pid, nothing else."""
    jobdir = machine_dir(home / "local") / "jobs" / str(job_id)
    jobdir.mkdir(mode=0o700, parents=True)
    (home / "local").chmod(0o700)
    job = {"id": job_id, "name": f"cr.x.{job_id}", "after": None, "slots": None}
    (jobdir / "job.json").write_text(json.dumps(job))
    (jobdir / "supervisor.pid").write_text(supervisor)


def test_a_reused_pid_or_a_record_from_before_a_restart_is_not_a_running_job(tmp_path: Path) -> None:
    """A supervisor is its PID with its start time and the boot it ran in: a live process
    under the recorded PID (reused after a reboot, or in a new PID namespace) is not it,
    and a record from an earlier boot is a job the machine's restart ended."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    stranger = subprocess.Popen(["sleep", "600"])
    try:
        _recorded_job(home, 1, f"{stranger.pid}\n")  # a bare PID, now some other process's
        pid, start, _ = identity(stranger.pid).split()
        _recorded_job(home, 2, f"{pid} {start} 00000000-0000-0000-0000-000000000000\n")
        _recorded_job(home, 3, identity(stranger.pid))  # the very process, this boot: it runs
        shown = poll(home)
    finally:
        stranger.kill()
        stranger.wait()
    assert (shown[1]["state"], shown[1]["reason"]) == ("ended", "the local supervisor died")
    assert (shown[2]["state"], shown[2]["outcome"]) == ("ended", "node_fail")
    assert "machine restarted" in shown[2]["reason"]
    assert shown[3]["state"] == "pending"


def test_each_machine_keeps_its_own_state_under_a_shared_home(tmp_path: Path) -> None:
    """The runner's state is under the machine's identity (/etc/machine-id), named with its
    hostname and boot, so that machines sharing one home over NFS never read each other's jobs."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    script = make_script(tmp_path, "true")
    assert runner(home, *submit_argv(tmp_path, "cr.x.1", script, "--walltime", "60")).returncode == 0
    mine = machine_dir(home / "local")
    assert mine.parent == home / "local" / "machines"
    assert mine.name == Path("/etc/machine-id").read_text().strip()
    noted = json.loads((mine / MACHINE_FILE).read_text())
    assert noted["host"] == os.uname().nodename
    assert noted["boot"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert [p.name for p in (mine / "jobs").iterdir()] == ["1"]


def test_jobs_of_a_runner_from_before_machine_state_are_still_seen_after_an_upgrade(tmp_path: Path) -> None:
    """A job the runner queued before each machine had its own state (``local/jobs``, its
    supervisor a bare PID) is still listed, judged by that PID and cancellable; new jobs are
    numbered on from it, so no id names two jobs."""
    home = tmp_path / "home"
    legacy = home / "local" / "jobs" / "4"
    legacy.mkdir(parents=True)
    for path in (home, home / "local"):
        path.chmod(0o700)
    (home / "local" / "next_id").write_text("5\n")
    (legacy / "job.json").write_text(json.dumps({"id": 4, "name": "cr.old.1", "after": None, "slots": None}))
    supervisor = subprocess.Popen(["sleep", "600"])
    try:
        (legacy / "supervisor.pid").write_text(f"{supervisor.pid}\n")
        (legacy / "start.json").write_text(json.dumps({"pid": supervisor.pid, "started_at": time.time()}))
        assert poll(home)[4]["state"] == "running"
        script = make_script(tmp_path, "true")
        submitted = runner(home, *submit_argv(tmp_path, "cr.new.1", script, "--walltime", "60"))
        assert submitted.stdout.strip() == "5", submitted
        assert runner(home, "cancel", "4").returncode == 0 and (legacy / "cancel").exists()
    finally:
        supervisor.kill()
        supervisor.wait()
    assert poll(home)[4]["reason"] == "the local supervisor died"


def test_the_job_is_told_when_its_walltime_began(local_home: Path, tmp_path: Path) -> None:
    """The wrapper counts the walltime from the supervisor's start, as from a scheduler's
    StartTime, not from its own (tests/test_slurm_prolog.py shows why on Slurm)."""
    seen = tmp_path / "seen"
    script = make_script(tmp_path, f"echo $CHAINRUN_LOCAL_STARTED >{seen}")
    submitted = runner(local_home, *submit_argv(tmp_path, "cr.t.1", script, "--walltime", "60"))
    assert submitted.returncode == 0, submitted.stderr
    line = ended(local_home, int(submitted.stdout))
    assert line["outcome"] == "completed", line
    assert int(seen.read_text()) == int(line["started_at"]), line


ME = {"boot": "b2", "host": "hoff"}
BOOTED, NOW = 1000.0, 2000.0  # this boot began at 1000; it is 2000 now


@pytest.mark.parametrize(
    ("record", "writes", "other"),
    [
        (None, {**ME, "seen": NOW}, None),  # the first use
        ({**ME, "seen": NOW - 1}, None, None),  # noted just now: nothing written
        ({**ME, "seen": NOW - REFRESH}, {**ME, "seen": NOW}, None),  # noted again
        ({"boot": "b2", "host": "old-name", "seen": NOW - 1}, {**ME, "seen": NOW}, None),  # renamed
        ({"boot": "b1", "host": "hoff", "seen": BOOTED - 30}, {**ME, "seen": NOW}, None),  # restarted
        ({"boot": "b1", "host": "hoff", "seen": BOOTED + 2}, {**ME, "seen": NOW}, None),  # clocks' slack
        (  # another boot said so since this one began: another machine with this id
            {"boot": "b1", "host": "norman", "seen": NOW - 60},
            None,
            "norman",
        ),
        ({"boot": "b1", "host": "norman", "seen": NOW - SILENT}, {**ME, "seen": NOW}, None),  # gone quiet
    ],
)
def test_a_machine_directory_is_refused_to_a_second_machine_with_the_same_id(
    record: dict[str, Any] | None, writes: dict[str, Any] | None, other: str | None
) -> None:
    """``judge``'s table: a restart, a rename or a machine gone quiet take the directory over;
    another boot seen since this one began is another machine: this one is refused."""
    assert judge(record, ME, BOOTED, NOW) == (writes, other)


def _twin(tmp_path: Path, name: str, command: str) -> subprocess.Popen[str]:
    """``command`` run on a lab machine (scripts/lab-machine: its own boot id and uptime)
    called ``name``, whose /etc/machine-id is the one every twin of this test has."""
    identity_dir = tmp_path / "machines" / name
    identity_dir.mkdir(parents=True, exist_ok=True)
    (identity_dir / "machine-id").write_text("0123456789abcdef0123456789abcdef\n")
    run = f"{sys.executable} -m chainrun.localrunner"
    return subprocess.Popen(
        [
            str(REPO / "scripts" / "lab-machine"),
            name,
            str(identity_dir),
            "bash",
            "-c",
            command.format(run=run),
        ],
        env=cli_env(tmp_path / "home"),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_two_machines_with_one_machine_id_on_one_home_are_refused_and_a_restart_is_not(
    tmp_path: Path,
) -> None:
    """Cloned images: lab-a runs a job; lab-b, the same /etc/machine-id, started after it and
    sharing the home, is refused with one line instead of reading lab-a's running job as
    ended by a restart; lab-a goes on. lab-a started again (a new boot of the same machine)
    takes its directory back and reads the job its restart ended as ended."""
    need("root, and util-linux's unshare with time namespaces", os.geteuid() == 0, "scripts/test as root")
    (tmp_path / "home").mkdir(mode=0o700)
    script = make_script(tmp_path, "sleep 60")
    submit = " ".join(submit_argv(tmp_path, "cr.twin.1", script, "--walltime", "120"))
    wait = "while [ ! -e {0} ]; do sleep 0.1; done"
    a = _twin(tmp_path, "lab-a", f"{{run}} {submit} && {wait.format('a-go')} && {{run}} poll")
    wait_for(lambda: list((tmp_path / "home").glob("local/machines/*/jobs/1/start.json")), 30, "lab-a's job")
    # lab-b is polled once lab-a's supervisor has said again, more than the clocks' slack after
    # lab-b booted, that lab-a uses the directory, as a service's tick finds it on a machine
    # that booted a while ago.
    b = _twin(tmp_path, "lab-b", f"touch b-up && {wait.format('b-go')} && {{run}} poll")
    wait_for(lambda: (tmp_path / "b-up").exists(), 60, "lab-b to boot")
    b_booted = time.time()  # lab-b booted before this
    (record,) = (tmp_path / "home").glob(f"local/machines/*/{MACHINE_FILE}")
    wait_for(lambda: json.loads(record.read_text())["seen"] > b_booted + SLACK, 60, "lab-a's next note")
    (tmp_path / "b-go").touch()
    out, err = b.communicate(timeout=60)
    assert b.returncode == 2, (out, err)
    assert (
        err.count("\n") == 1
        and "machine id 0123456789abcdef0123456789abcdef is also used by host lab-a" in err
    )
    assert "cloned image" in err and out == ""
    (tmp_path / "a-go").touch()
    out, err = a.communicate(timeout=60)
    assert a.returncode == 0, err
    assert json.loads(out.splitlines()[-1])["state"] == "running"  # lab-a's job, judged by lab-a
    again = _twin(tmp_path, "lab-a", "{run} poll")  # the same identity, a new boot
    out, err = again.communicate(timeout=60)
    assert again.returncode == 0, err
    job = json.loads(out)
    assert (job["state"], job["outcome"]) == ("ended", "node_fail") and "machine restarted" in job["reason"]
