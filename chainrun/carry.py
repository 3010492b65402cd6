"""The chain carries itself while the service is away: the carrier, which a segment's runner
asks now and then while its command runs, and when it has ended.

It reads what it can in the run directory (``carry.json``, what the service recorded when
it last submitted; the markers of the segments since; the final marker; the checkpoint) and
the service's beat in the run root (``beat_path``, which the engine writes each tick on the
cluster's own file system), asks ``decide.carry`` whether to queue the successor, and if so
makes sure the scheduler lists no job under its tag, and claims and submits it through
``Cluster.submit``, as the service does (the claim, ``seg-NNNN.queued``, made exclusively:
never two successors of one segment), for the service to adopt when it returns. It prints
the seconds until it wants to be asked again (nothing: never, for this segment); what it
did, it says on stderr, in the segment's log. The service leaves ``carry.json``, the
``carry`` launcher and the carrier itself, shipped as an archive (``ship.CARRIER``), there
(``leave_record``) when the chain may carry itself (``decide.carry.applies``). The carrier
runs with the interpreter known to be there: the segment runner's own on a cluster's node
(over SSH too), the service's for the local runner, whose jobs run on the service's machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Optional

from chainrun import progress, rundir
from chainrun.cluster import Cluster
from chainrun.decide import JobFacts
from chainrun.decide.carry import (
    ASK_EVERY,
    TICKS_AWAY,
    CarryAnswer,
    Recorded,
    SegmentView,
    applies,
    away_bound,
    carry,
)
from chainrun.errors import ChainrunError, ClaimedError, SchedulerError
from chainrun.localrunner import machine_id
from chainrun.model import NO_PROGRESS, Chain, JobSpec, Progress
from chainrun.schedulers import scheduler_for
from chainrun.schedulers.base import HelperFile
from chainrun.schedulers.segment import (
    CARRY_NAME,
    FINAL_NAME,
    RUN_DIR_NAME,
    SegmentJob,
    parse_end_marker,
    parse_start_marker,
    parse_tag,
    run_dir,
)
from chainrun.schedulers.ship import CARRIER, SEGMENT_RUNNER
from chainrun.transport import LocalTransport, Transport

LAUNCHER_NAME = "carry"  # in the run directory: runs the carrier (``_launcher``)
# Never handed on to the successor's submission: the segment's own, set again by its wrapper.
_JOB_ONLY = ("CHAINRUN_", "SLURM_", "SBATCH_")
_KEPT = ("CHAINRUN_HOME", "SLURM_CONF")
PYTHON_VAR = "CHAINRUN_PYTHON"  # the segment runner's interpreter, set for the launcher alone
PROBE = "--probe"  # ``main``'s argument at submit: can this interpreter run the carrier here?
MIN_PYTHON = (3, 8)  # as the segment runner's


def beat_path(spec: JobSpec, home: Path) -> str:
    """Where the service whose state directory is ``home`` says it ticks, for the segments of
    ``spec``'s chains: ``service-HASH.beat`` in their run root (``WORKDIR/.chainrun``, on
    the cluster's file system), HASH of this machine and ``home``, so that two services
    whose chains share a workdir never read as each other."""
    who = hashlib.sha256(f"{machine_id()}:{Path(home).resolve()}".encode()).hexdigest()[:16]
    return posixpath.join(spec.workdir, RUN_DIR_NAME, f"service-{who}.beat")


def beat(interval: float) -> bytes:
    """A beat's content: the service's tick interval (and, for a person, when and who). Its
    age is its file's mtime, which a node compares with its own clock: the cluster's file
    system and nodes share time, whatever the service's machine's clock says."""
    return json.dumps({"at": time.time(), "interval": interval, "pid": os.getpid()}).encode()


def carrier_path(spec: JobSpec) -> str:
    """Where the carrier's archive is placed for a chain: in its run root, by its hash."""
    return posixpath.join(spec.workdir, RUN_DIR_NAME, CARRIER.name())


def _service_python(spec: JobSpec) -> Optional[str]:
    """The interpreter the carrier runs with where it is not the segment runner's own (which
    runs where the segment runs): the service's, for the local runner on this machine, whose
    commands need chainrun installed (its jobs run on this machine)."""
    return sys.executable if spec.scheduler.kind == "local" and not spec.scheduler.remote else None


def leave_record(cluster: Cluster, chain: Chain, home: Path) -> None:
    """Write what a segment needs to carry the chain alone (before each submission): the
    chain as recorded now, the carrier, and the launcher its runner looks for; nothing for a
    chain that may not carry itself. Raises TransportError when it cannot be written."""
    if not applies(chain.spec):
        return
    transport = cluster.transport
    ended = [s for s in chain.segments if not s.phase.live]
    record = {
        "chain": chain.id,
        "beat": beat_path(chain.spec, home),
        # The local runner's state is the service's (its jobs run on the service's machine).
        "home": str(home) if chain.spec.scheduler.kind == "local" else None,
        "through": max((s.n for s in ended), default=0),
        "failures": chain.failures,
        "used": chain.used,
        "mark": chain.progress.to_json(),
        "spec": chain.spec.to_json(),
    }
    where = run_dir(chain.spec, chain.id)
    # Written only when changed: most submissions find both as they left them (a sweep's
    # first segments, a successor queued ahead before anything ended), and a write syncs.
    record_path, launcher_path = posixpath.join(where, CARRY_NAME), posixpath.join(where, LAUNCHER_NAME)
    data = json.dumps(record).encode()
    if transport.read_file(record_path) != data:
        transport.write_file(record_path, data)
    cluster.place(HelperFile(carrier_path(chain.spec), CARRIER.data()))
    launcher = _launcher(chain.spec, home)
    if transport.read_file(launcher_path) != launcher.encode():
        rundir.write_script(transport, launcher_path, launcher)


def _launcher(spec: JobSpec, home: Path) -> str:
    """The runner's way in. What ``decide.carry`` would answer from the beat's age alone is
    answered here, with no interpreter started (as most questions are): a running segment
    asks again while the beat is younger than the bound (at its smallest: the service's
    interval may make it longer); an ended one leaves it to a service that ticks. Else it
    runs the carrier."""
    bound = int(away_bound(spec, None))
    status = shlex.quote(beat_path(spec, home))
    own = _service_python(spec)
    python = shlex.quote(own) if own else f'"${{{PYTHON_VAR}:-python3}}"'
    return (
        "#!/bin/sh\n"
        f"age=$(( $(date +%s) - $(stat -c %Y {status} 2>/dev/null || echo 0) ))\n"
        f'if [ "$4" = running ] && [ "$age" -lt {bound} ]; then\n'
        f"    wait=$(({bound} - age + 1)); [ $wait -gt {int(ASK_EVERY)} ] && wait={int(ASK_EVERY)}\n"
        '    echo "$wait"; exit 0\n'
        "fi\n"
        f"interval=$(grep -o '\"interval\": [0-9]*' {status} 2>/dev/null | grep -o '[0-9]*$')\n"
        f'if [ "$4" = ended ] && [ -n "$interval" ] && [ "$age" -lt $(({TICKS_AWAY} * interval)) ]; then\n'
        "    exit 0 # the service ticks (its interval in whole seconds): it queues the next segment\n"
        "fi\n"
        f'exec {python} -I {shlex.quote(carrier_path(spec))} "$@"\n'
    )


def probe(transport: Transport, spec: JobSpec) -> str:
    """Whether the carrier runs where ``transport`` runs commands, with the interpreter its
    launcher would use there (at submit; the archive placed first): "" when it does, else
    why not, in a few words. Raises TransportError when it cannot be asked."""
    path = carrier_path(spec)
    Cluster(scheduler_for(spec.scheduler.kind, None), transport).place(HelperFile(path, CARRIER.data()))
    python = _service_python(spec) or "python3"  # as the batch script runs the segment runner
    result = transport.run([python, "-I", path, PROBE, SEGMENT_RUNNER.name()], timeout=60)
    if result.returncode == 0 and result.stdout.strip() == "ok":
        return ""
    said = (result.stderr.strip() or result.stdout.strip() or f"exit {result.returncode}").splitlines()
    return f"the carrier does not run with {python} there ({said[-1][:200]})"


def _probed(expected: str) -> int:
    """``--probe``: this interpreter runs the carrier and makes the same segment runner."""
    if sys.version_info < MIN_PYTHON:
        print(f"Python {sys.version.split()[0]}; the carrier needs 3.8 or later", file=sys.stderr)
        return 1
    if SEGMENT_RUNNER.name() != expected:
        print("it builds another segment runner than the service", file=sys.stderr)
        return 1
    print("ok")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    """``RUN_DIR N JOB running|ended``: ask once for segment N (job JOB) of the chain in
    RUN_DIR, whose command runs or has ended; its walltime ends at $CHAINRUN_DEADLINE."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == PROBE:
        return _probed(args[1])
    if len(args) != 4 or not args[1].isdigit():
        print("usage: python -m chainrun.carry RUN_DIR SEGMENT JOB running|ended", file=sys.stderr)
        return 2
    where, n, job_id, ended = args[0], int(args[1]), args[2], args[3] == "ended"
    deadline = os.environ.get("CHAINRUN_DEADLINE", "")
    try:
        again = ask(
            LocalTransport(), where, n, job_id, time.time(), ended, float(deadline) if deadline else None
        )
    except (ChainrunError, OSError, ValueError, KeyError, TypeError) as exc:
        say(n, f"cannot queue its successor ({exc}); the service queues it when it is back")
        return 0
    if again is not None:
        print(f"{again:.0f}")
    return 0


def ask(
    transport: Transport,
    where: str,
    n: int,
    job_id: str,
    now: float,
    ended: bool = False,
    deadline: Optional[float] = None,
) -> Optional[float]:
    """Ask ``decide.carry`` once for segment ``n``, and queue its successor if it says so;
    when to ask again (None: never)."""
    data = transport.read_file(posixpath.join(where, CARRY_NAME))
    if data is None or not job_id:
        return None
    record: dict[str, Any] = json.loads(data)
    spec = JobSpec.from_json(record["spec"])
    chain_id = str(record["chain"])
    home = record.get("home")
    rundir.trust_run_dir(transport, spec, chain_id, create=False)
    known = Recorded(
        through=int(record["through"]),
        failures=int(record["failures"]),
        used=float(record["used"]),
        mark=Progress.from_json(record["mark"]),
    )
    heard_at, interval = _heard(transport, record.get("beat"))
    alone = SegmentView(
        spec=spec,
        n=n,
        job_id=job_id,
        known=known,
        since=[_markers(transport, spec, chain_id, m) for m in range(known.through + 1, n + 1)],
        progress=progress.read(transport, spec) or NO_PROGRESS,
        final=transport.stat(posixpath.join(where, FINAL_NAME)) is not None,
        heard_at=heard_at,
        interval=interval,
        deadline=deadline,
        ended=ended,
    )
    verdict = carry(alone, now)
    if verdict.submit is None:
        if verdict.again is None:
            say(n, f"will not queue segment {n + 1} itself: {verdict.reason}")
        return verdict.again
    return _queue(transport, home, spec, chain_id, verdict)


def _heard(transport: Transport, path: Optional[str]) -> tuple[Optional[float], Optional[float]]:
    """When the service last said it ticks, by its beat's mtime, and its interval; (None,
    None) when the beat is missing or cannot be read (``decide.carry``: the service is then
    taken to be there)."""
    try:
        info = transport.stat(path) if path else None
        data = transport.read_file(path) if info is not None and path else None
    except (ChainrunError, OSError):
        return None, None
    if info is None:
        return None, None
    try:
        said = json.loads(data or b"")
    except ValueError:
        said = None
    return info.mtime, _number(said.get("interval")) if isinstance(said, dict) else None


def _queue(
    transport: Transport, home: Optional[str], spec: JobSpec, chain_id: str, verdict: CarryAnswer
) -> Optional[float]:
    """Make sure no job has the successor's tag, then claim and submit it (``Cluster.submit``,
    as the service does); when to ask again."""
    sub = verdict.submit
    assert sub is not None
    job = SegmentJob(chain_id, sub.n, spec, sub.walltime, sub.after)
    _environment(home)
    cluster = Cluster(scheduler_for(spec.scheduler.kind, None), transport)
    queued = [j for j in cluster.poll().values() if parse_tag(j.name) == (chain_id, sub.n)]
    if queued:
        say(sub.n - 1, f"finds segment {sub.n} queued already as job {queued[0].job_id}")
        return None
    try:
        job_id = cluster.submit(job, by=f"segment {sub.n - 1}")
    except ClaimedError:
        return None  # claimed already (by the service, or a run of this check before): theirs
    except SchedulerError as exc:
        say(sub.n - 1, f"could not queue segment {sub.n}: {exc}")
        return ASK_EVERY if exc.transient else None
    say(sub.n - 1, f"queued segment {sub.n} as job {job_id} after job {sub.after}: {verdict.reason}")
    return None


def _markers(transport: Transport, spec: JobSpec, chain_id: str, m: int) -> JobFacts:
    stem = SegmentJob(chain_id, m, spec, 0).stem
    start = transport.read_file(stem + ".start")
    end = transport.read_file(stem + ".end")
    return JobFacts(
        start=parse_start_marker(start) if start is not None else None,
        end=parse_end_marker(end) if end is not None else None,
    )


def _environment(home: Optional[str]) -> None:
    """The submission's environment: the segment's own variables go (the successor's wrapper
    sets its own); the local runner's state is the service's."""
    for key in list(os.environ):
        if key.startswith(_JOB_ONLY) and key not in _KEPT:
            del os.environ[key]
    if home is not None:
        os.environ["CHAINRUN_HOME"] = home


def _number(value: object) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def say(n: int, text: str) -> None:
    print(f"chainrun: segment {n} {text}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
