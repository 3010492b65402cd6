"""One tick of the service: gather facts, decide, carry out.

Per cluster, one batched poll of the scheduler serves every chain on it. For
each chain the engine works out what happened to its jobs (the live view, the
wrapper's end marker, accounting, or "lost"), reads its progress, asks the
pure ``decide`` what to do, and carries the actions out through the backend's
commands and the transport, recording each one in the store.
"""

from __future__ import annotations

import posixpath
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Optional

import structlog

from chainrun import watch
from chainrun.decide import decide
from chainrun.errors import SchedulerError, TransportError
from chainrun.model import (
    Action,
    Cancel,
    Chain,
    ChainState,
    EndSegment,
    Finish,
    Observation,
    Outcome,
    Phase,
    Segment,
    Submit,
)
from chainrun.schedulers import scheduler_for
from chainrun.schedulers.base import (
    EndMarker,
    LiveJob,
    Scheduler,
    SegmentJob,
    render_script,
    resolve,
    run_dir,
)
from chainrun.store import Store
from chainrun.transport import Transport, transport_for

log = structlog.get_logger(__name__)

LOST_AFTER = 180.0  # seconds a job may be gone without a trace before it is "lost"
SUBMIT_TIMEOUT = 120.0
POLL_TIMEOUT = 60.0


def backoff(attempts: int) -> float:
    """Seconds before retrying a submission that failed ``attempts`` times."""
    return float(min(300, 5 * 2 ** max(0, attempts - 1)))


@dataclass
class TickSummary:
    """What a tick saw, for the service's one-line status."""

    running: int = 0
    queued: int = 0
    active: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    # Seconds until the engine wants its next tick (a submission's backoff
    # ends sooner than the interval); None: the service's interval.
    next_in: Optional[float] = None

    def line(self) -> str:
        text = f"{self.running} running, {self.queued} queued, {self.failed} failed"
        return text + (f"; {len(self.errors)} cluster errors" if self.errors else "")


@dataclass(frozen=True)
class _Cluster:
    scheduler: Scheduler
    transport: Transport
    live: dict[str, LiveJob]


class Engine:
    """Moves every active chain forward by one tick."""

    def __init__(
        self,
        store: Store,
        clock: Callable[[], float] = time.time,
        transports: Callable[[Optional[str]], Transport] = transport_for,
        on_end: Optional[Callable[[Chain], None]] = None,
    ) -> None:
        self.store = store
        self.clock = clock
        self.transports = transports
        self.on_end = on_end  # told of every chain that reaches a final state

    def tick(self, only: Optional[str] = None) -> TickSummary:
        """Move every active chain (or only the chain with id ``only``) forward once.

        Raises StoreUnavailable when the database cannot be used (an outage)."""
        summary = TickSummary()
        groups: dict[tuple[str, str], list[Chain]] = defaultdict(list)
        for chain in self.store.chains(active_only=True):
            if only is not None and chain.id != only:
                continue
            groups[chain.spec.scheduler.cluster_key].append(chain)
        for (kind, host), chains in groups.items():
            try:
                cluster = self._poll(kind, host or None)
            except (TransportError, SchedulerError) as exc:
                log.warning("poll failed; retrying next tick", scheduler=kind, host=host, error=str(exc))
                summary.errors.append(str(exc))
                continue
            for chain in chains:
                try:
                    self._tick_chain(cluster, chain)
                except (TransportError, SchedulerError) as exc:
                    log.warning("tick failed; retrying next tick", chain=chain.id, error=str(exc))
                    summary.errors.append(str(exc))
        for chain in self.store.chains():
            summary.failed += chain.state is ChainState.FAILED
            if chain.state is ChainState.ACTIVE:
                summary.active += 1
                summary.running += any(s.phase is Phase.RUNNING for s in chain.segments)
                summary.queued += any(s.phase is Phase.PENDING for s in chain.segments)
        return summary

    def _poll(self, kind: str, host: Optional[str]) -> _Cluster:
        scheduler = scheduler_for(kind, host)
        transport = self.transports(host)
        result = transport.run(scheduler.poll_argv(), timeout=POLL_TIMEOUT)
        return _Cluster(scheduler, transport, scheduler.parse_poll(result))

    # -- facts ------------------------------------------------------------------

    def _tick_chain(self, cluster: _Cluster, chain: Chain) -> None:
        now = self.clock()
        observations = self._observe(cluster, chain, now)
        chain = self.store.chain(chain.id)  # observe() may have recorded start times
        progress = watch.progress(cluster.transport, chain.spec)
        if progress is not None and progress != chain.latest:
            self.store.note_progress(chain.id, progress)
        actions = decide(chain, observations, progress, now)
        self._execute(cluster, chain, actions, now)

    def _observe(self, cluster: _Cluster, chain: Chain, now: float) -> dict[str, Observation]:
        observations: dict[str, Observation] = {}
        unknown: list[Segment] = []
        for seg in chain.live:
            if seg.job_id is None:
                continue
            job = cluster.live.get(seg.job_id)
            if job is not None and job.phase is not Phase.ENDED:
                changed = (job.phase, job.reason) != (seg.phase, seg.reason)
                if changed or seg.missing_since or (job.started_at and not seg.started_at):
                    self.store.observe(chain.id, seg.n, job.phase, job.reason, job.started_at, None, now)
                observations[seg.job_id] = Observation(
                    seg.job_id, job.phase, started_at=job.started_at, reason=job.reason
                )
                continue
            obs = self._unstick(cluster, job) if job is not None and job.stuck else None
            obs = obs or self._ended(cluster, chain, seg, job)
            if obs is None:
                unknown.append(seg)
            else:
                observations[seg.job_id] = obs
        if unknown:
            observations.update(self._account_or_lose(cluster, chain, unknown, now))
        return observations

    def _ended(
        self, cluster: _Cluster, chain: Chain, seg: Segment, job: Optional[LiveJob]
    ) -> Optional[Observation]:
        job_ = SegmentJob(chain.id, seg.n, chain.spec, seg.walltime)
        data = cluster.transport.read_file(job_.stem + ".end")
        marker = EndMarker.parse(data) if data is not None else None
        obs = resolve(job, marker)
        if obs is None:
            return None
        started = obs.started_at or seg.started_at or self._started_at(cluster, job_)
        return replace(obs, job_id=seg.job_id or "", started_at=started)

    def _unstick(self, cluster: _Cluster, job: LiveJob) -> Observation:
        """A job the scheduler holds in an error state: learn why, then remove it."""
        reason = job.reason
        argv = cluster.scheduler.explain_argv(job.job_id)
        if argv is not None:
            reason = (
                cluster.scheduler.parse_explain(cluster.transport.run(argv, timeout=POLL_TIMEOUT)) or reason
            )
        result = cluster.transport.run(cluster.scheduler.cancel_argv([job.job_id]), timeout=POLL_TIMEOUT)
        if not result.ok:
            log.warning("could not remove a stuck job", job=job.job_id, error=result.describe())
        return Observation(job.job_id, Phase.ENDED, outcome=job.outcome or Outcome.FAILED, reason=reason)

    def _started_at(self, cluster: _Cluster, job: SegmentJob) -> Optional[float]:
        data = cluster.transport.read_file(job.stem + ".start")
        for line in (data or b"").decode(errors="replace").splitlines():
            if line.startswith("at="):
                try:
                    return float(line[3:])
                except ValueError:
                    return None
        return None

    def _account_or_lose(
        self, cluster: _Cluster, chain: Chain, segs: list[Segment], now: float
    ) -> dict[str, Observation]:
        ids = [s.job_id for s in segs if s.job_id]
        found: dict[str, LiveJob] = {}
        argv = cluster.scheduler.accounting_argv(ids)
        if argv is not None:
            found = cluster.scheduler.parse_accounting(cluster.transport.run(argv, timeout=POLL_TIMEOUT))
        observations = {}
        for seg in segs:
            assert seg.job_id is not None
            job = found.get(seg.job_id)
            if job is not None and job.phase is Phase.ENDED:
                obs = self._ended(cluster, chain, seg, job)
                if obs is not None:
                    observations[seg.job_id] = obs
                    continue
            if seg.missing_since is None:
                self.store.observe(chain.id, seg.n, seg.phase, "gone from the queue", None, now, now)
            elif now - seg.missing_since >= LOST_AFTER:
                observations[seg.job_id] = Observation(
                    seg.job_id,
                    Phase.ENDED,
                    outcome=Outcome.LOST,
                    reason=f"gone from the scheduler for {now - seg.missing_since:.0f}s "
                    "with no record of how it ended",
                )
        return observations

    # -- actions ----------------------------------------------------------------

    def _execute(self, cluster: _Cluster, chain: Chain, actions: list[Action], now: float) -> None:
        if any(isinstance(a, Finish) for a in actions):
            # Written first: a successor that starts anyway exits at once.
            path = posixpath.join(run_dir(chain.spec, chain.id), "final")
            try:
                cluster.transport.write_file(path, b"chain ended\n")
            except TransportError as exc:
                log.warning("could not write the final marker", chain=chain.id, error=str(exc))
        cancels = [a for a in actions if isinstance(a, Cancel)]
        if cancels:
            self._cancel(cluster, chain, cancels, now)
        for action in actions:
            bound = log.bind(chain=chain.id)
            if isinstance(action, Submit):
                self._submit(cluster, chain, action)
            elif isinstance(action, EndSegment):
                self.store.apply(chain.id, action, now)
                bound.info(
                    "segment ended",
                    segment=action.n,
                    outcome=action.outcome.value,
                    charged=action.charged,
                    reason=action.reason,
                )
            elif isinstance(action, Finish):
                self.store.apply(chain.id, action, now)
                bound.info("chain ended", state=action.state.value, reason=action.reason)
                if self.on_end is not None:
                    self.on_end(self.store.chain(chain.id))

    def _cancel(self, cluster: _Cluster, chain: Chain, cancels: list[Cancel], now: float) -> None:
        ids = []
        for c in cancels:
            job_id = c.job_id or self._find(cluster, chain, c.n)
            if job_id:
                ids.append(job_id)
        if ids:
            try:
                result = cluster.transport.run(cluster.scheduler.cancel_argv(ids), timeout=POLL_TIMEOUT)
                if not result.ok:
                    self.store.event(chain.id, None, "warning", f"cancel: {result.describe()}")
            except TransportError as exc:
                self.store.event(
                    chain.id,
                    None,
                    "warning",
                    f"could not cancel jobs {', '.join(ids)} ({exc}); they exit at once if they start",
                )
        for c in cancels:
            self.store.apply(chain.id, c, now)

    def _find(self, cluster: _Cluster, chain: Chain, n: int) -> Optional[str]:
        """The job of segment ``n`` if an earlier attempt reached the scheduler."""
        job = SegmentJob(chain.id, n, chain.spec, 0)
        for live in cluster.live.values():
            if live.name == job.tag:
                return live.job_id
        data = cluster.transport.read_file(job.stem + ".start")
        for line in (data or b"").decode(errors="replace").splitlines():
            if line.startswith("job=") and line[4:].strip():
                return line[4:].strip()
        return None

    def _submit(self, cluster: _Cluster, chain: Chain, sub: Submit) -> None:
        now = self.clock()
        earlier = self.store.journal_submit(chain.id, sub, now)
        if earlier:
            found = self._find(cluster, chain, sub.n)
            if found:
                self.store.record_job(chain.id, sub.n, found, "adopted after a restart", now)
                log.info("adopted job", chain=chain.id, segment=sub.n, job=found)
                return
        job = SegmentJob(chain.id, sub.n, chain.spec, sub.walltime, sub.after)
        attempts = next((s.attempts for s in chain.segments if s.n == sub.n), 0) + 1
        try:
            cluster.transport.makedirs(job.run_dir)
            cluster.transport.write_file(
                job.script_path, render_script(cluster.scheduler, job).encode(), mode=0o700
            )
            result = cluster.transport.run(cluster.scheduler.submit_argv(job), timeout=SUBMIT_TIMEOUT)
            job_id = cluster.scheduler.parse_submit(result)
        except (TransportError, SchedulerError) as exc:
            if isinstance(exc, SchedulerError) and not exc.transient:
                self.store.reject(chain.id, sub.n, str(exc), now)
                log.error("submission rejected", chain=chain.id, segment=sub.n, error=str(exc))
                return
            self.store.submit_failed(chain.id, sub.n, str(exc), now + backoff(attempts), now)
            log.warning("submission failed; will retry", chain=chain.id, segment=sub.n, error=str(exc))
            return
        after = f" after job {sub.after}" if sub.after else ""
        self.store.record_job(chain.id, sub.n, job_id, f"submitted{after}", now)
        log.info("submitted", chain=chain.id, segment=sub.n, job=job_id, after=sub.after)
