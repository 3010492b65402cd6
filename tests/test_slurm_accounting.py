"""Outcomes read from sacct on the real Slurm with accounting on (slurmdbd on MariaDB, started by
scripts/start-slurm), and the same path with accounting off, as at sites that run without it.

sacct matters for a job that left squeue (MinJobAge passed, often while the service was away)
without the wrapper's end marker: its node died, or its whole step was killed. The tests let
a real job end that way while the service is stopped, then start the service again as it
would find things later: squeue no longer lists the ended job (a shim on the service's PATH
drops ended jobs from the real squeue's answer, as MinJobAge=300 would some minutes later),
and the end marker is gone (the wrapper here survives long enough to write one; on a node
that died, it would not). Everything else is real: the CLI, the service, sbatch, sacct,
slurmdbd, the memory cgroup and the node failure. The common OOM, whose wrapper outlives the
kill of its command and writes its marker (exit 137), is named by sacct too once squeue has
forgotten it.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import REPO, answers, cli_env, holding_scheduler, need, slurm_answers, wait_for

from chainrun.model import Phase
from chainrun.schedulers.slurm import SACCT_FORMAT, STATES

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

CLI = Callable[..., "subprocess.CompletedProcess[str]"]
Service = Callable[..., "subprocess.Popen[bytes]"]

# What sacct prints (on stderr, exit 1) where slurm.conf says AccountingStorageType=
# accounting_storage/none: copied from this machine's Slurm 22.05 before accounting was on.
ACCOUNTING_DISABLED = "Slurm accounting storage is disabled\n"

# Once the file "go" appears, takes and holds 500 MiB (written, so every page is really used).
HOG = """\
import os, time
while not os.path.exists("go"):
    time.sleep(0.2)
hog = b"x" * (500 << 20)
print("holding", len(hog), flush=True)
time.sleep(600)
"""
# Runs until the scheduler stops it, saving an epoch a second.
LONG = "python3 trainer.py --epochs 1000 --epoch-time 1"


@pytest.fixture
def slurm() -> Iterator[None]:
    """The real Slurm with accounting, shared with the tests beside this one."""
    with holding_scheduler("slurm"):
        need(
            "a running Slurm with accounting",
            slurm_answers() and answers("sacct", "--noheader", "--jobs=1"),
            "sudo scripts/start-slurm",
        )
        yield


@pytest.fixture
def memory_limits() -> None:
    """Slurm enforces --mem (start-slurm turns on task/cgroup where cgroup v1 has a memory controller)."""
    config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=60).stdout
    need(
        "a Slurm that enforces --mem (TaskPlugin=task/cgroup)",
        any(
            line.split("=")[-1].strip() == "task/cgroup"
            for line in config.splitlines()
            if line.startswith("TaskPlugin ")
        ),
        "sudo scripts/start-slurm on a machine with the cgroup v1 memory controller",
    )


@pytest.fixture
def work(tmp_path: Path) -> Path:
    path = tmp_path / "work dir 'q'"
    path.mkdir()
    shutil.copy(REPO / "tests" / "data" / "trainer.py", path / "trainer.py")
    (path / "hog.py").write_text(HOG)
    return path


@pytest.fixture
def shims(tmp_path: Path) -> Path:
    """A directory for the service's PATH with an squeue that, like the real one once
    MinJobAge has passed, no longer lists jobs that ended."""
    path = tmp_path / "shims"
    path.mkdir()
    ended = "|".join(sorted(state for state, (phase, _) in STATES.items() if phase is Phase.ENDED))
    real = shutil.which("squeue")
    assert real is not None
    script = path / "squeue"
    script.write_text(
        "#!/bin/bash\n"
        f'out=$({real} "$@") || {{ rc=$?; printf \'%s\' "$out"; exit $rc; }}\n'
        f"printf '%s\\n' \"$out\" | grep -Ev '^[^|]*[|][^|]*[|]({ended})[|]' || true\n"
    )
    script.chmod(0o755)
    return path


def node_usable(node: str) -> bool:
    out = subprocess.run(
        ["sinfo", "--noheader", "--Node", f"--nodes={node}", "--format=%t"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.stdout.split()[:1] in (["idle"], ["mix"], ["alloc"])


def write_job(work: Path, command: str, options: list[str]) -> Path:
    path = work / "t.toml"
    path.write_text(
        f'name = "t"\ncommand = {json.dumps(command)}\nworkdir = {json.dumps(str(work))}\n'
        'total_time = "2h"\nwalltime = "10m"\ngrace = "30s"\ntarget_epoch = 1000\nmax_failures = 5\n'
        f'[scheduler]\nkind = "slurm"\noptions = {json.dumps(options)}\n'
    )
    return path


def sacct_state(job_id: str) -> str:
    out = subprocess.run(
        ["sacct", "--noheader", "--parsable2", "--allocations", f"--jobs={job_id}", "--format=State"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return out.strip().split(" ")[0]


@pytest.fixture
def chains() -> Iterator[list[str]]:
    """Chain ids whose jobs are cancelled in Slurm at the end (the service is gone by then)."""
    ids: list[str] = []
    yield ids
    for chain_id in ids:
        cancel_jobs(chain_id)


def cancel_jobs(chain_id: str) -> None:
    out = subprocess.run(
        ["squeue", "--me", "--noheader", "--format=%i|%j"], capture_output=True, text=True, timeout=60
    ).stdout
    ids = [
        i
        for i, _, name in (line.partition("|") for line in out.splitlines())
        if name.startswith(f"cr.{chain_id}.")
    ]
    if ids:
        subprocess.run(["scancel", *ids], capture_output=True, timeout=60)


class Scene:
    """A chain whose first job ends while the service is away, and the service's return."""

    def __init__(self, chainrun: CLI, service: Service, path: str, chains: list[str]) -> None:
        self.chainrun, self.service, self.path, self.chains = chainrun, service, path, chains

    def status(self, chain_id: str) -> dict[str, Any]:
        return json.loads(self.chainrun("status", chain_id, "--json", check=True).stdout)[0]  # type: ignore[no-any-return]

    def end_unseen(
        self, job_file: Path, end: Callable[[str], None], state: str, keep_marker: bool = False
    ) -> tuple[str, str]:
        """Submit the chain and, while its first job runs, stop the service; ``end`` ends the
        job, which sacct must then show in ``state``; its end marker is taken away unless
        ``keep_marker``. Returns the chain id and the job id; the service is left stopped."""
        chain_id = self.chainrun("submit", str(job_file), check=True).stdout.strip()
        self.chains.append(chain_id)
        daemon = self.service(interval=1, PATH=self.path)

        def running() -> bool:
            segs = self.status(chain_id)["segments"]
            return bool(segs) and segs[0]["phase"] == "running" and segs[0]["job_id"] is not None

        wait_for(running, 180, "the first segment to run")
        job_id = str(self.status(chain_id)["segments"][0]["job_id"])
        daemon.kill()
        daemon.wait()
        end(job_id)
        wait_for(lambda: sacct_state(job_id) == state, 180, f"sacct to show job {job_id} {state}")
        # The wrapper outlived its command here and wrote its marker; a dead node's would not.
        marker = job_file.parent / ".chainrun" / chain_id / "seg-0001.end"
        wait_for(marker.exists, 60, "the wrapper's end marker")
        if not keep_marker:
            marker.unlink()
        return chain_id, job_id

    def judged(self, chain_id: str, timeout: float = 120) -> dict[str, Any]:
        """Start the service again; the first segment once the service has judged it."""
        self.service(interval=1, PATH=self.path)
        wait_for(
            lambda: self.status(chain_id)["segments"][0]["outcome"] is not None,
            timeout,
            "the service to judge the first segment",
        )
        return self.status(chain_id)["segments"][0]  # type: ignore[no-any-return]


@pytest.fixture
def scene(chainrun: CLI, service: Service, shims: Path, home: Path, chains: list[str]) -> Scene:
    return Scene(chainrun, service, f"{shims}{os.pathsep}{cli_env(home)['PATH']}", chains)


def test_oom_killed_segment_is_out_of_memory_from_sacct(
    slurm: None, memory_limits: None, work: Path, scene: Scene
) -> None:
    """A segment over its --mem=50M is killed by the memory cgroup; found later only in sacct
    (OUT_OF_MEMORY), it shows as out of memory and costs failure budget."""
    job_file = write_job(work, "exec python3 hog.py", ["--mem=50M"])
    # The memory cgroup kills the command as it takes 500 MiB.
    chain_id, _ = scene.end_unseen(job_file, lambda job_id: (work / "go").touch(), "OUT_OF_MEMORY")
    seg = scene.judged(chain_id)
    assert (seg["outcome"], seg["charged"]) == ("oom", True), seg
    assert "OUT_OF_MEMORY (sacct)" in seg["reason"], seg
    assert scene.status(chain_id)["failures"] >= 1


def test_oom_killed_segment_with_its_end_marker_is_out_of_memory_after_squeue_forgot(
    slurm: None, memory_limits: None, work: Path, scene: Scene
) -> None:
    """The usual OOM under cgroups: the kernel kills the command, the wrapper writes exit 137.
    Once the job has left squeue, only sacct still says OUT_OF_MEMORY; the marker's exit code
    is kept."""
    job_file = write_job(work, "exec python3 hog.py", ["--mem=50M"])
    chain_id, _ = scene.end_unseen(
        job_file, lambda job_id: (work / "go").touch(), "OUT_OF_MEMORY", keep_marker=True
    )
    seg = scene.judged(chain_id)
    assert (seg["outcome"], seg["exit_code"], seg["charged"]) == ("oom", 137, True), seg
    assert "OUT_OF_MEMORY (sacct)" in seg["reason"] and "exited 137" in seg["reason"], seg


@pytest.mark.takes_down_a_node
def test_segment_on_a_failed_node_is_node_fail_from_sacct(slurm: None, work: Path, scene: Scene) -> None:
    """The node of a running segment goes down (scontrol: as slurmctld marks a node that stopped
    answering); found later only in sacct (NODE_FAIL), the segment shows as a node failure,
    free when the checkpoint it left is intact, else charged. --no-requeue, as at sites that do
    not requeue: else Slurm runs the job again. The job runs in the multi-node partition, whose
    nodes this test has to itself: the tests beside it go on on the others."""
    with holding_scheduler("slurm-nodes", exclusive=True):
        need(
            "the multi-node Slurm (partition multi)",
            answers("scontrol", "show", "partition", "multi"),
            "sudo scripts/start-slurm --nodes 3",
        )
        job_file = write_job(work, LONG, ["--no-requeue", "--partition=multi"])
        nodes: list[str] = []

        def fail_the_node(job_id: str) -> None:
            node = subprocess.run(
                ["squeue", "--noheader", f"--jobs={job_id}", "--format=%N"],
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout.strip()
            assert node, f"job {job_id} has no node"
            nodes.append(node)
            subprocess.run(
                ["scontrol", "update", f"nodename={node}", "state=down", "reason=chainrun accounting test"],
                check=True,
                timeout=60,
            )

        try:
            chain_id, _ = scene.end_unseen(job_file, fail_the_node, "NODE_FAIL")
        finally:
            for node in nodes:
                # The node comes back by itself once its slurmd answers (ReturnToService=2); if
                # not, this resumes it.
                subprocess.run(
                    ["scontrol", "update", f"nodename={node}", "state=resume"],
                    capture_output=True,
                    timeout=60,
                )
                wait_for(lambda node=node: node_usable(node), 300, f"{node} to be usable again")  # type: ignore[misc]
    seg = scene.judged(chain_id)
    # Free when the segment had saved a checkpoint that is intact (issue 27): only the time
    # since it is lost; charged when it had saved nothing yet (when the node goes down decides).
    intact = "the checkpoint is intact" in seg["reason"]
    assert (seg["outcome"], seg["charged"]) == ("node_fail", not intact), seg
    assert "NODE_FAIL (sacct)" in seg["reason"], seg


def test_with_accounting_disabled_a_vanished_segment_ends_lost(
    slurm: None, work: Path, scene: Scene, shims: Path
) -> None:
    """Where sacct answers "accounting storage is disabled" (a shim on the service's PATH that
    answers exactly that), a segment gone without a trace is asked about, then ends "lost",
    charged, and the chain goes on: no error, no stuck chain."""
    job_file = write_job(work, LONG, [])
    log = work.parent / "sacct-calls.log"
    (shims / "sacct").write_text(
        f"#!/bin/bash\nprintf '%s\\n' \"$*\" >> {shlex.quote(str(log))}\n"
        f"printf '%s' {shlex.quote(ACCOUNTING_DISABLED)} >&2\nexit 1\n"
    )
    (shims / "sacct").chmod(0o755)

    def cancel(job_id: str) -> None:
        subprocess.run(["scancel", job_id], check=True, timeout=60)

    chain_id, job_id = scene.end_unseen(job_file, cancel, "CANCELLED")
    seg = scene.judged(chain_id, timeout=400)
    assert (seg["outcome"], seg["charged"]) == ("lost", True), seg
    calls = log.read_text().split()
    asked = {i for arg in calls if arg.startswith("--jobs=") for i in arg[len("--jobs=") :].split(",")}
    assert job_id in asked and f"--format={SACCT_FORMAT}" in calls, calls
    st = scene.status(chain_id)
    assert st["state"] == "active", st["reason"]
    assert len(st["segments"]) >= 2, "the chain did not go on after the lost segment"
