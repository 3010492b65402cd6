"""A cluster as the service reaches it: one scheduler backend and one transport, and the one
function through which every scheduler command goes (``Cluster.call``).

The backend builds each command and parses its answer; the transport runs it, on this
machine or over SSH. ``call`` does both, so a failure is always one of two typed errors:
``TransportError`` (the command could not be run or did not answer: retried, never
charged) or the ``SchedulerError`` the backend's parser raises (transient, or permanent
in the scheduler's own words). Nothing else in chainrun runs a scheduler command.
"""

from __future__ import annotations

import posixpath
import time
from collections.abc import Sequence
from typing import Callable, Optional, TypeVar

from chainrun import rundir
from chainrun.decide.carry import abandoned
from chainrun.errors import ClaimedError, SchedulerError, TransportError
from chainrun.model import CommandResult, JobSpec, ListedJob
from chainrun.schedulers.base import (
    ArrayScheduler,
    HelperFile,
    NodeStateProbe,
    NodeSubmitProbe,
    Scheduler,
    ShapeProbe,
    StartProbe,
    parse_cancel,
)
from chainrun.schedulers.script import render_script, runner_path
from chainrun.schedulers.segment import SegmentJob, claim_job, claim_text, parse_claim
from chainrun.schedulers.ship import SEGMENT_RUNNER
from chainrun.starts import Start, cannot
from chainrun.transport import Transport

POLL_TIMEOUT = 60.0
SUBMIT_TIMEOUT = 120.0

_T = TypeVar("_T")


class Cluster:
    """One scheduler reached through one transport."""

    def __init__(self, scheduler: Scheduler, transport: Transport) -> None:
        self.scheduler = scheduler
        self.transport = transport
        # The backend with job arrays (Slurm's --array), or None.
        self.arrays: Optional[ArrayScheduler] = scheduler if isinstance(scheduler, ArrayScheduler) else None
        self.placed: set[str] = set()  # the helper files found or written through this cluster

    def call(self, argv: Sequence[str], parse: Callable[[CommandResult], _T], timeout: float) -> _T:
        """Run one scheduler command through the transport and parse its answer with the
        backend: the one place a scheduler command runs."""
        return parse(self.transport.run(argv, timeout=timeout))

    def prepare(self) -> None:
        """Place the files the backend's commands need (the local runner's copy on a remote
        workstation)."""
        for helper in self.scheduler.helper_files():
            self.place(helper)

    def place(self, helper: HelperFile) -> None:
        """Write ``helper`` unless the one there is this one and this user's alone (looked at
        once per cluster: a tick that submits many segments asks once per workdir)."""
        if helper.path in self.placed:
            return
        info = self.transport.stat(helper.path)
        if (
            info is not None
            and info.is_file
            and info.size == len(helper.data)
            and info.uid == self.transport.user_id()
            and not info.mode & 0o022
        ):
            self.placed.add(helper.path)
            return
        self.transport.makedirs(posixpath.dirname(helper.path), mode=0o700)
        self.transport.write_file(helper.path, helper.data, mode=0o600)  # whole or not at all
        self.placed.add(helper.path)

    def poll(self) -> dict[str, ListedJob]:
        """Every job of this user's the scheduler lists, by id: one command."""
        return self.call(self.scheduler.poll_argv(), self.scheduler.parse_poll, POLL_TIMEOUT)

    def write_script(self, job: SegmentJob) -> None:
        """Write ``job``'s script into its run directory (trusted by the caller), and the
        segment runner it runs beside it, once."""
        self.place(HelperFile(runner_path(job.spec), SEGMENT_RUNNER.data()))
        rundir.write_script(self.transport, job.script_path, render_script(self.scheduler, job))

    def submit(self, job: SegmentJob, by: str) -> str:
        """Claim segment ``job.n``, write its script and queue it; the job id.

        The one claim protocol: whoever queues a segment (the service, or the segment before
        it carrying the chain, ``by``) first creates its claim (``seg-N.queued``)
        exclusively, so a segment is never queued twice however the two interleave. A claim
        ``by`` holds already (its own submission tried before) is taken again; another's
        raises ClaimedError, unless it is abandoned (``decide.carry.abandoned``): then it is
        taken over. A submission the scheduler refused frees the claim;
        one that answered records its job there."""
        text = claim_text(job.walltime, job.after or "", by, time.time())
        if not self.transport.create_file(job.claim_path, text):
            held = parse_claim(self.transport.read_file(job.claim_path) or b"")
            if held is None or held.by != by:
                info = self.transport.stat(job.claim_path)
                if not abandoned(held, None if info is None else time.time() - info.mtime):
                    raise ClaimedError(job.n, held)
                self.transport.write_file(job.claim_path, text)  # abandoned: taken over
        self.write_script(job)
        try:
            job_id = self.call(self.scheduler.submit_argv(job), self.scheduler.parse_submit, SUBMIT_TIMEOUT)
        except SchedulerError:
            self.transport.remove(job.claim_path)  # nothing was queued: free to claim again
            raise
        self.transport.write_file(job.claim_path, text + claim_job(job_id))
        return job_id

    def submit_array(self, stem: str, spec: JobSpec, indices: Sequence[int]) -> str:
        """Queue the array job whose script is ``stem``.sh (written by the caller), for its task
        ``indices``, at most ``spec.max_concurrent`` at once; the id its tasks' ids start with."""
        assert self.arrays is not None, "a backend without job arrays"
        argv = self.arrays.array_submit_argv(
            stem + ".sh", stem + ".log", spec.workdir, indices, spec.max_concurrent
        )
        return self.call(argv, self.scheduler.parse_submit, SUBMIT_TIMEOUT)

    def cancel(self, job_ids: list[str]) -> None:
        """Cancel every one of ``job_ids``: one command."""
        self.call(self.scheduler.cancel_argv(job_ids), parse_cancel, POLL_TIMEOUT)

    def accounting(self, job_ids: list[str]) -> Optional[dict[str, ListedJob]]:
        """What accounting knows of ``job_ids`` (one command); None for a backend without it."""
        argv = self.scheduler.accounting_argv(job_ids)
        if argv is None:
            return None
        return self.call(argv, self.scheduler.parse_accounting, POLL_TIMEOUT)

    def nodes_cannot_submit(self, queue: Optional[str]) -> str:
        """Why this cluster's compute nodes cannot submit jobs (to ``queue``), from its
        configuration; "" when they can, or when the backend cannot tell."""
        if not isinstance(self.scheduler, NodeSubmitProbe):
            return ""
        results = [
            self.call(argv, lambda r: r, POLL_TIMEOUT) for argv in self.scheduler.node_submit_argvs(queue)
        ]
        return self.scheduler.parse_node_submit(results)

    def never_starts(self, job: SegmentJob) -> str:
        """The scheduler's own reason it would never start ``job`` (asked without queueing
        it); "" when it would, or when the backend has nothing to ask. Raises SchedulerError
        (transient) when the scheduler did not answer."""
        if not isinstance(self.scheduler, ShapeProbe):
            return ""
        answer = self.call(self.scheduler.shape_argv(job), lambda r: r, POLL_TIMEOUT)
        explain = [] if answer.ok else self.scheduler.shape_explain_argvs(job, answer)
        results = [answer, *(self.call(argv, lambda r: r, POLL_TIMEOUT) for argv in explain)]
        return self.scheduler.parse_shape(job, results)

    def down(self, nodes: str) -> tuple[str, ...]:
        """Which of ``nodes`` (an ended job's, ``ListedJob.nodes``) the scheduler holds down
        now; none when the backend cannot tell."""
        if not nodes or not isinstance(self.scheduler, NodeStateProbe):
            return ()
        return tuple(self.call(self.scheduler.down_argv(nodes), self.scheduler.parse_down, POLL_TIMEOUT))

    def expected_start(self, job: SegmentJob, now: Optional[float] = None) -> Start:
        """When ``job`` would start here if it were queued now, asked without queueing it (the
        backend's ``StartProbe``: Slurm's ``sbatch --test-only``, SGE's slots and pending jobs,
        the local runner's slots), and why. Never raises: a place that cannot be asked (its
        controller or its host does not answer) cannot start it now (``at`` None). ``now``:
        the caller's clock (the service's), else this machine's."""
        if not isinstance(self.scheduler, StartProbe):
            return cannot(f"{self.scheduler.kind} cannot tell when a job would start")
        results: list[CommandResult] = []
        try:
            self.prepare()  # a pool host asked before any tick polled it: the runner's copy first
            for argv in self.scheduler.start_argvs(job):
                results.append(self.call(argv, lambda r: r, POLL_TIMEOUT))
                if not results[0].ok:
                    break  # the question failed: the rest only refine an answer
            return self.scheduler.parse_start(job, results, time.time() if now is None else now)
        except TransportError as exc:
            return cannot(f"does not answer: {exc}")
        except SchedulerError as exc:
            return cannot(str(exc))

    def explain(self, job_id: str) -> str:
        """The scheduler's own words for why a job is held in an error state; "" if none."""
        argv = self.scheduler.explain_argv(job_id)
        if argv is None:
            return ""
        return self.call(argv, self.scheduler.parse_explain, POLL_TIMEOUT)
