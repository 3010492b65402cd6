"""One tick of the service: observe, decide, act and record.

**Observe** writes nothing: the active chains come from one load of the
store (which decodes again only the chains that changed); per cluster, one
batched poll of the scheduler serves every chain on it; for each chain the
engine reads what it needs (the wrapper's markers of jobs that left the live
view or ended, each kept once read; the checkpoint; why a stuck job is
stuck) and asks accounting in one command for the jobs gone without a marker
that are due: at once, then after growing intervals, and always in the tick
that would find one lost. **Decide** is ``decide()``: facts in, actions out;
a chain whose last answer was "nothing to do" is not asked again while its
stored row and its facts stay the same, until ``quiet_until`` (the first clock
rule due) says the answer could change.
**Act and record**: a submission is journaled, then made; cancels go out in
one command; then everything the tick learned and did for the chain is
written in one transaction (nothing, when nothing changed).

A fault in one chain's tick is that chain's: it is logged, counted, retried
next tick, and after ``STUCK_AFTER`` failing ticks the chain is marked stuck
(retried every ``STUCK_RETRY``); the other chains go on. A database that
cannot be written (``StoreUnavailable``) is an outage of the whole service:
the tick stops there and the service retries; nothing is charged for it.
"""

from __future__ import annotations

import gc
import time
import typing
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field, replace
from typing import Optional, TypeVar

from chainrun import watch
from chainrun.decide import LOST_AFTER, Facts, JobFacts, after_submit, decide, quiet_until
from chainrun.errors import ChainrunError, SchedulerError, StoreUnavailable, TransportError, UnsafePathError
from chainrun.logs import get_logger
from chainrun.model import (
    Action,
    Adopt,
    Cancel,
    Chain,
    ChainState,
    EndSegment,
    Finish,
    LiveJob,
    Phase,
    Reject,
    Remove,
    RetryLater,
    Submit,
    Track,
)
from chainrun.schedulers import scheduler_for
from chainrun.schedulers.base import Scheduler
from chainrun.schedulers.segment import (
    EndMarker,
    SegmentJob,
    StartMarker,
    final_path,
    render_script,
    trust_run_dir,
    trust_script,
)
from chainrun.store import Store
from chainrun.transport import Transport, transport_for

log = get_logger(__name__)
_T = TypeVar("_T")
_M = TypeVar("_M", StartMarker, EndMarker)

ACCOUNTING_FIRST = 10.0  # seconds before accounting is asked again of a job it did not know
ACCOUNTING_MAX = 120.0  # the interval doubles up to this
SUBMIT_TIMEOUT = 120.0
POLL_TIMEOUT = 60.0
STUCK_AFTER = 3  # failing ticks in a row before a chain is marked stuck
STUCK_RETRY = 600.0  # seconds between tries of a stuck chain


@dataclass
class TickSummary:
    """What a tick saw, for the service's one-line status."""

    running: int = 0
    queued: int = 0
    active: int = 0
    failed: int = 0
    stuck: int = 0
    errors: list[str] = field(default_factory=list)
    # Clusters (scheduler kind, host) whose poll failed this tick, with why: their chains wait.
    unreachable: dict[tuple[str, str], ChainrunError] = field(default_factory=dict)
    # Seconds until the engine wants its next tick (a submission's backoff
    # ends sooner than the interval); None: the service's interval.
    next_in: Optional[float] = None

    def line(self) -> str:
        text = f"{self.running} running, {self.queued} queued, {self.failed} failed"
        if self.stuck:
            text += f", {self.stuck} stuck"
        return text + (f"; {len(self.errors)} errors" if self.errors else "")


@dataclass(frozen=True)
class _Cluster:
    key: tuple[str, str]
    scheduler: Scheduler
    transport: Transport
    live: dict[str, LiveJob]
    tagged: dict[str, dict[int, tuple[LiveJob, ...]]]  # live jobs tagged cr.CHAIN.N, by chain and N


class Engine:
    """Moves every active chain forward by one tick."""

    def __init__(
        self,
        store: Store,
        clock: Callable[[], float] = time.time,
        transports: Callable[[Optional[str]], Transport] = transport_for,
        schedulers: Callable[[str, Optional[str]], Scheduler] = scheduler_for,
        on_end: Optional[Callable[[Chain], None]] = None,
    ) -> None:
        self.store = store
        self.clock = clock
        self.transports = transports
        self.schedulers = schedulers
        self.on_end = on_end  # told of every chain that reaches a final state
        self.failing: dict[str, int] = {}  # chain id -> failing ticks in a row
        self.stuck_until: dict[str, float] = {}  # chain id -> when a stuck chain is tried again
        # The wrapper's markers never change once written: each is read once, by (chain, segment, suffix).
        self.markers: dict[tuple[str, int, str], object] = {}
        # Per cluster, jobs gone from the live view without an end marker that accounting
        # did not know: when to ask again, and the interval after that.
        self.unaccounted: dict[tuple[str, str], dict[str, tuple[float, float]]] = {}
        self.progress = watch.ProgressReader()  # re-reads a sidecar only when it changed
        # Chains decide() last had nothing for: the chain as loaded, its facts, and until when
        # that answer holds for them (see _quiet).
        self.quiet: dict[str, tuple[Chain, Facts, float]] = {}

    def tick(self, only: Optional[Collection[str]] = None) -> TickSummary:
        """Move every active chain (or only the chains with the ids in ``only``) forward once.

        Raises StoreUnavailable when the database cannot be used (an outage)."""
        # A tick makes many short-lived objects, which reference counting frees. With
        # the cyclic collector on, they would set off full collections that walk every
        # object the service keeps, twice a tick at 10,000 chains (a third of its CPU).
        # Cycles made during the tick wait for the collection after it.
        paused = gc.isenabled()
        gc.disable()
        try:
            return self._tick(only)
        finally:
            if paused:
                gc.enable()

    def _tick(self, only: Optional[Collection[str]]) -> TickSummary:
        summary = TickSummary()
        now = self.clock()
        groups: dict[tuple[str, str], list[Chain]] = defaultdict(list)
        retries: list[float] = []  # when submissions that failed want their next try
        loaded = self.store.chains(active_only=True)
        for chain in loaded:
            if (only is None or chain.id in only) and now >= self.stuck_until.get(chain.id, 0.0):
                groups[chain.spec.scheduler.cluster_key].append(chain)
        if len(self.quiet) > len(loaded):  # chains that ended, or were removed, since
            active = {c.id for c in loaded}
            self.quiet = {k: v for k, v in self.quiet.items() if k in active}
        for (kind, host), chains in groups.items():
            try:
                cluster = self._poll((kind, host))
            except (TransportError, SchedulerError) as exc:
                log.warning("poll failed; retrying next tick", scheduler=kind, host=host, error=str(exc))
                summary.errors.append(str(exc))
                summary.unreachable[(kind, host)] = exc
                continue
            gathered: dict[str, Facts] = {}
            for chain in chains:
                facts = self._guarded(chain, summary, self._observe, cluster, chain)
                if facts is not None:
                    gathered[chain.id] = facts
            gathered = self._account(cluster, chains, gathered, now)
            for chain in chains:
                if chain.id in gathered:
                    retries += (
                        self._guarded(chain, summary, self._act, cluster, chain, gathered[chain.id]) or []
                    )
        counts = self.store.summary()
        summary.running, summary.queued = counts["running"], counts["queued"]
        summary.active, summary.failed, summary.stuck = counts["active"], counts["failed"], counts["stuck"]
        if retries:
            summary.next_in = max(0.0, min(retries) - self.clock())
        return summary

    def _poll(self, key: tuple[str, str]) -> _Cluster:
        kind, host = key
        scheduler = self.schedulers(kind, host or None)
        transport = self.transports(host or None)
        result = transport.run(scheduler.poll_argv(), timeout=POLL_TIMEOUT)
        live = scheduler.parse_poll(result)
        tagged: dict[str, dict[int, tuple[LiveJob, ...]]] = defaultdict(dict)
        for job in live.values():
            chain_id, _, n = job.name[3:].rpartition(".") if job.name.startswith("cr.") else ("", "", "")
            if chain_id and n.isascii() and n.isdigit():
                jobs, k = tagged[chain_id], int(n)
                jobs[k] = (*jobs.get(k, ()), job)
        return _Cluster(key, scheduler, transport, live, tagged)

    def _guarded(
        self, chain: Chain, summary: TickSummary, step: Callable[..., _T], *args: object
    ) -> Optional[_T]:
        """One chain's step; a fault in it stays the chain's (None). An outage stops the tick."""
        try:
            return step(*args)
        except StoreUnavailable:
            raise
        except Exception as exc:  # a bug or a broken file must not stop the other chains
            expected = isinstance(exc, (TransportError, SchedulerError))
            message = str(exc) if expected else f"{type(exc).__name__}: {exc}"
            count = self.failing[chain.id] = self.failing.get(chain.id, 0) + 1
            log.warning(
                "tick of a chain failed; retrying next tick",
                chain=chain.id,
                failures=count,
                error=message,
                exc_info=not expected,  # a bug: its traceback goes to the log
            )
            summary.errors.append(f"{chain.id}: {message}")
            if count >= STUCK_AFTER:
                self.stuck_until[chain.id] = self.clock() + STUCK_RETRY
                if chain.state is not ChainState.STUCK:
                    reason = (
                        f"{count} ticks in a row failed, the last with {message}; "
                        f"tried again every {STUCK_RETRY:.0f}s"
                    )
                    self.store.set_stuck(chain.id, True, reason, self.clock())
                    log.error("chain stuck", chain=chain.id, reason=reason)
            return None

    # -- observe: facts, nothing written -------------------------------------------

    def _observe(self, cluster: _Cluster, chain: Chain) -> Facts:
        jobs: dict[str, JobFacts] = {}
        tagged = cluster.tagged.get(chain.id, {})
        found = {}
        for seg in chain.live:
            if seg.phase is Phase.SUBMITTING and seg.n not in tagged:
                start = self._start(cluster, chain, seg.n)
                if start is not None and start.job_id:
                    found[seg.n] = start.job_id
            if seg.job_id is None:
                continue
            live = cluster.live.get(seg.job_id)
            if live is not None and live.phase is Phase.PENDING and not live.stuck:
                jobs[seg.job_id] = JobFacts(live=live)
                continue
            start = self._start(cluster, chain, seg.n)
            if live is not None and live.phase is Phase.RUNNING and not live.stuck:
                jobs[seg.job_id] = JobFacts(live=live, start=start)
                continue
            end = self._marker(cluster, chain, seg.n, ".end", EndMarker.parse)
            why = self._explain(cluster, live.job_id) if live is not None and live.stuck else ""
            jobs[seg.job_id] = JobFacts(live=live, end=end, start=start, why_stuck=why)
        return Facts(
            jobs=jobs,
            tagged=tagged,
            found=found,
            progress=self.progress.progress(cluster.transport, chain.spec),
        )

    def _start(self, cluster: _Cluster, chain: Chain, n: int) -> Optional[StartMarker]:
        return self._marker(cluster, chain, n, ".start", StartMarker.parse)

    def _marker(
        self, cluster: _Cluster, chain: Chain, n: int, suffix: str, parse: Callable[[bytes], Optional[_M]]
    ) -> Optional[_M]:
        """Segment ``n``'s marker ``suffix``, read until it is there, then kept."""
        key = (chain.id, n, suffix)
        if key not in self.markers:
            data = cluster.transport.read_file(SegmentJob(chain.id, n, chain.spec, 0).stem + suffix)
            marker = parse(data) if data is not None else None
            if marker is None:  # not written yet (or not whole yet: read again next tick)
                return None
            self.markers[key] = marker
        return typing.cast(_M, self.markers[key])

    def _explain(self, cluster: _Cluster, job_id: str) -> str:
        argv = cluster.scheduler.explain_argv(job_id)
        if argv is None:
            return ""
        return cluster.scheduler.parse_explain(cluster.transport.run(argv, timeout=POLL_TIMEOUT))

    def _account(
        self, cluster: _Cluster, chains: list[Chain], gathered: dict[str, Facts], now: float
    ) -> dict[str, Facts]:
        """Ask accounting, in one command, of the cluster's jobs gone from the view without a
        marker that are due: each at once, then after growing intervals, and always in the
        tick that would find it lost."""
        unknown = [
            job_id
            for facts in gathered.values()
            for job_id, job in facts.jobs.items()
            if job.live is None and job.end is None
        ]
        before = self.unaccounted.get(cluster.key, {})
        waiting = self.unaccounted[cluster.key] = {j: before[j] for j in unknown if j in before}
        if not unknown:
            return gathered
        missing = {s.job_id: s.missing_since for c in chains for s in c.live if s.job_id is not None}
        due = [
            job_id
            for job_id in unknown
            if job_id not in waiting
            or now >= waiting[job_id][0]
            or now - (missing.get(job_id) or now) >= LOST_AFTER
        ]
        argv = cluster.scheduler.accounting_argv(due) if due else None
        if argv is None:
            return gathered
        try:
            found = cluster.scheduler.parse_accounting(cluster.transport.run(argv, timeout=POLL_TIMEOUT))
        except (TransportError, SchedulerError) as exc:
            log.warning("accounting failed; asking again next tick", error=str(exc))
            return gathered
        for job_id in due:
            if job_id not in found:
                interval = (
                    min(2 * waiting[job_id][1], ACCOUNTING_MAX) if job_id in waiting else ACCOUNTING_FIRST
                )
                waiting[job_id] = (now + interval, interval)
        return {
            chain_id: replace(
                facts,
                jobs={
                    job_id: replace(job, accounting=found.get(job_id)) if job_id in found else job
                    for job_id, job in facts.jobs.items()
                },
            )
            if not found.keys().isdisjoint(facts.jobs)
            else facts
            for chain_id, facts in gathered.items()
        }

    # -- act and record ------------------------------------------------------------

    def _act(self, cluster: _Cluster, chain: Chain, facts: Facts) -> list[float]:
        """Decide, carry out, record; returns when failed submissions want their next try."""
        now = self.clock()
        if self._quiet(chain, facts, now):
            # decide() would answer nothing again, and the tick that asked it last wrote
            # nothing (a write makes the store load the chain anew): nothing to do or record.
            self.failing.pop(chain.id, None)
            self.stuck_until.pop(chain.id, None)
            return self._waiting(chain, now)
        actions = decide(chain, facts, now)
        if actions:
            self.quiet.pop(chain.id, None)
        else:
            self.quiet[chain.id] = (chain, facts, quiet_until(chain, now))
        warnings: list[str] = []
        if any(isinstance(a, Finish) for a in actions):
            # Written first: a successor that starts anyway exits at once.
            try:
                cluster.transport.write_file(final_path(chain.spec, chain.id), b"chain ended\n")
            except TransportError as exc:
                warnings.append(f"could not write the final marker ({exc}); a late successor may start")
        self._cancel(cluster, [a for a in actions if isinstance(a, (Cancel, Remove))], warnings)
        done: list[Action] = []
        for action in actions:
            if isinstance(action, Submit):
                done.append(self._submit(cluster, chain, action))
            else:
                done.append(action)
        latest = facts.progress if facts.progress is not None and facts.progress != chain.latest else None
        if chain.state is ChainState.STUCK:
            self.store.set_stuck(chain.id, False, "a tick succeeded again", now)
        if done or latest is not None or warnings:  # a tick that changed nothing writes nothing
            self.store.record(chain.id, done, latest, warnings, now)
        for action in done:
            if isinstance(action, (EndSegment, Cancel, Reject)):  # its markers are no longer read
                self.markers.pop((chain.id, action.n, ".start"), None)
                self.markers.pop((chain.id, action.n, ".end"), None)
        for action in done:
            _log(chain.id, action)
        self.failing.pop(chain.id, None)
        self.stuck_until.pop(chain.id, None)
        if self.on_end is not None and any(isinstance(a, Finish) for a in done):
            self.on_end(self.store.chain(chain.id))
        return [a.at for a in done if isinstance(a, RetryLater)] + self._waiting(chain, now)

    def _quiet(self, chain: Chain, facts: Facts, now: float) -> bool:
        """Whether ``decide(chain, facts, now)`` would answer nothing, known without calling it:
        it answered nothing for this very chain (the store loads a chain anew when its rows
        change) and equal facts, and the first clock rule (``quiet_until``) is not due yet."""
        kept = self.quiet.get(chain.id)
        return kept is not None and kept[0] is chain and now < kept[2] and kept[1] == facts

    def _waiting(self, chain: Chain, now: float) -> list[float]:
        """When the chain's failed submissions want their next try."""
        return [
            s.retry_at
            for s in chain.live
            if s.phase is Phase.SUBMITTING and s.retry_at is not None and s.retry_at > now
        ]

    def _cancel(self, cluster: _Cluster, actions: Iterable[Cancel | Remove], warnings: list[str]) -> None:
        ids = [a.job_id for a in actions if a.job_id]
        if not ids:
            return
        try:
            result = cluster.transport.run(cluster.scheduler.cancel_argv(ids), timeout=POLL_TIMEOUT)
            if not result.ok:
                warnings.append(f"cancel: {result.describe()}")
        except TransportError as exc:
            warnings.append(
                f"could not cancel jobs {', '.join(ids)} ({exc}); they exit at once if they start"
            )

    def _submit(self, cluster: _Cluster, chain: Chain, sub: Submit) -> Action:
        """Journal, then submit: the job's id, or what its failure means."""
        now = self.clock()
        attempts = self.store.journal_submit(chain.id, sub, now)
        job = SegmentJob(chain.id, sub.n, chain.spec, sub.walltime, sub.after)
        try:
            trust_run_dir(cluster.transport, chain.spec, chain.id, create=True)
            cluster.transport.write_file(
                job.script_path, render_script(cluster.scheduler, job).encode(), mode=0o700
            )
            trust_script(cluster.transport, job.script_path)
            result = cluster.transport.run(cluster.scheduler.submit_argv(job), timeout=SUBMIT_TIMEOUT)
            job_id = cluster.scheduler.parse_submit(result)
        except (TransportError, SchedulerError, UnsafePathError) as exc:
            return after_submit(sub.n, attempts, exc, now)
        return Adopt(
            n=sub.n, job_id=job_id, how="submitted" + (f" after job {sub.after}" if sub.after else "")
        )


def _log(chain_id: str, action: Action) -> None:
    bound = log.bind(chain=chain_id, segment=getattr(action, "n", None))
    if isinstance(action, Adopt):
        bound.info("job recorded", job=action.job_id, how=action.how)
    elif isinstance(action, RetryLater):
        bound.warning("submission failed; will retry", error=action.reason, at=action.at)
    elif isinstance(action, Finish):
        bound.info("chain ended", state=action.state.value, reason=action.reason)
    elif isinstance(action, Remove):
        bound.warning("job removed", job=action.job_id, reason=action.reason)
    elif isinstance(action, Cancel):
        bound.info("segment cancelled", job=action.job_id, reason=action.reason)
    elif isinstance(action, EndSegment):
        bound.info(
            "segment ended", outcome=action.outcome.value, charged=action.charged, reason=action.reason
        )
    elif isinstance(action, Reject):
        bound.error("submission rejected", error=action.reason)
    elif isinstance(action, Track):
        bound.debug("job seen", phase=action.phase.value, reason=action.reason)
