"""One tick of the service: observe, decide, act and record.

**Observe** writes nothing: the active chains come from one load of the
store (which decodes again only the chains that changed); per cluster, one
batched poll of the scheduler serves every chain on it; for each chain the
engine reads what it needs (the wrapper's markers of jobs that left the live
view or ended, each kept once read; the checkpoint; why a stuck job is
stuck) and asks accounting in one command for the jobs gone without a marker
that are due (at once, then after growing intervals, and always in the tick
that would find one lost) and for those whose marker says a signal killed
the command (an OOM kill, which accounting names). **Decide** is ``decide()``:
facts in, actions out; a chain whose last answer was "nothing to do" is not
asked again while its stored row and its facts stay the same, until
``quiet_until`` (the first clock rule due) says the answer could change.
**Act and record**: a submission is journaled, then made; cancels go out in
one command; then everything the tick learned and did for the chain is
written in one transaction (nothing, when nothing changed). On a backend
with job arrays, the first segments of a sweep's chains that a tick submits
go out together after the cluster's chains have acted (``_submit_arrays``):
one array job per set of chains whose scheduler directives are the same.

A pool's chain (``scheduler.hosts``) is polled with the host of its live
segment. One with none is observed where it ran last (else on the first host
that answered), and its new segment is placed by ``place()`` on a host with a
free slot by this tick's polls, or waits unsubmitted, saying so.

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
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Optional, TypeVar

from chainrun import watch
from chainrun.decide import LOST_AFTER, Facts, JobFacts, after_submit, decide, place, quiet_until
from chainrun.errors import ChainrunError, SchedulerError, StoreUnavailable, TransportError, UnsafePathError
from chainrun.logs import get_logger
from chainrun.model import (
    WAITING_FOR_A_SLOT,
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
from chainrun.schedulers.base import ArrayScheduler, Scheduler
from chainrun.schedulers.segment import (
    ARRAY_PREFIX,
    EndMarker,
    SegmentJob,
    StartMarker,
    array_stem,
    array_tag,
    final_path,
    render_array_script,
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
    tasks: dict[tuple[str, int], tuple[LiveJob, ...]]  # live array tasks, by array name and index
    arrays: Optional[ArrayScheduler]  # the scheduler, when it has job arrays


@dataclass
class _Round:
    """The clusters one tick polled, and the slots its placements have taken on each."""

    clusters: dict[tuple[str, str], _Cluster]
    placed: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))

    def free(self, key: tuple[str, str], slots: int) -> int:
        """A pool host's slots not in use by its jobs (running or ready) nor taken this tick."""
        return slots - _busy(self.clusters[key]) - self.placed[key]


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
        floating: list[Chain] = []  # a pool's chains with no live segment: placed this tick
        retries: list[float] = []  # when submissions that failed want their next try
        loaded = self.store.chains(active_only=True)
        held = _held(loaded)
        for chain in loaded:
            if (only is None or chain.id in only) and now >= self.stuck_until.get(chain.id, 0.0):
                if chain.spec.scheduler.hosts and not chain.live:
                    floating.append(chain)
                else:
                    groups[chain.cluster_key].append(chain)
        if len(self.quiet) > len(loaded):  # chains that ended, or were removed, since
            ids = {c.id for c in loaded}
            self.quiet = {k: v for k, v in self.quiet.items() if k in ids}
        # One poll per cluster: every cluster a chain lives on, and every host of a pool
        # that has a chain to place (its free slots are counted from the poll).
        wanted = dict.fromkeys([*groups, *(k for c in floating for k in _pool_keys(c))])
        tick = _Round({})
        clusters = tick.clusters
        for kind, host in wanted:
            try:
                clusters[(kind, host)] = self._poll((kind, host))
            except (TransportError, SchedulerError) as exc:
                log.warning("poll failed; retrying next tick", scheduler=kind, host=host, error=str(exc))
                summary.errors.append(str(exc))
                summary.unreachable[(kind, host)] = exc
        for chain in floating:
            # Observed where it ran last (its checkpoint may be on that host's disk), else on
            # the first of its hosts that answered; with none, it waits like any unreached chain.
            home = next((k for k in [chain.cluster_key, *_pool_keys(chain)] if k in clusters), None)
            if home is not None:
                groups[home].append(chain)
        for key, chains in groups.items():
            cluster = clusters.get(key)
            if cluster is None:
                continue
            gathered: dict[str, Facts] = {}
            for chain in chains:
                facts = self._guarded(chain, summary, self._observe, cluster, chain)
                if facts is not None:
                    gathered[chain.id] = replace(facts, may_start=False) if chain.id in held else facts
            gathered = self._account(cluster, chains, gathered, now)
            arrays: list[tuple[Chain, Submit]] = []  # first segments to submit as array tasks
            for chain in chains:
                if chain.id in gathered:
                    retries += (
                        self._guarded(
                            chain, summary, self._act, cluster, chain, gathered[chain.id], tick, arrays
                        )
                        or []
                    )
            retries += self._submit_arrays(cluster, arrays, summary)
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
        scheduler.prepare(transport)
        result = transport.run(scheduler.poll_argv(), timeout=POLL_TIMEOUT)
        live = scheduler.parse_poll(result)
        tagged: dict[str, dict[int, tuple[LiveJob, ...]]] = defaultdict(dict)
        tasks: dict[tuple[str, int], tuple[LiveJob, ...]] = {}
        arrays = scheduler if isinstance(scheduler, ArrayScheduler) else None
        for job in live.values():
            if arrays is not None and job.name.startswith(ARRAY_PREFIX):
                index = arrays.task_index(job.job_id)
                if index is not None:
                    tasks[(job.name, index)] = (*tasks.get((job.name, index), ()), job)
                continue
            chain_id, _, n = job.name[3:].rpartition(".") if job.name.startswith("cr.") else ("", "", "")
            if chain_id and n.isascii() and n.isdigit():
                jobs, k = tagged[chain_id], int(n)
                jobs[k] = (*jobs.get(k, ()), job)
        return _Cluster(key, scheduler, transport, live, tagged, tasks, arrays)

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
        first = chain.segments[0] if chain.segments else None
        if first is not None and first.array is not None and first.task is not None:
            # A first segment sent as an array task is found under the array's name and its index.
            found_tasks = cluster.tasks.get((first.array, first.task), ())
            if found_tasks:
                tagged = {**tagged, first.n: (*tagged.get(first.n, ()), *found_tasks)}
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
        marker that are due (each at once, then after growing intervals, and always in the
        tick that would find it lost), and of those whose marker says a signal other than the
        walltime one killed the command (an OOM kill under cgroups, which only accounting
        names once the view has forgotten the job; asked once, as the segment ends now)."""
        unknown, killed = [], []
        for facts in gathered.values():
            for job_id, job in facts.jobs.items():
                if job.live is None:
                    if job.end is None:
                        unknown.append(job_id)
                    elif job.end.killed:
                        killed.append(job_id)
        before = self.unaccounted.get(cluster.key, {})
        waiting = self.unaccounted[cluster.key] = {j: before[j] for j in unknown if j in before}
        if not unknown and not killed:
            return gathered
        missing = {s.job_id: s.missing_since for c in chains for s in c.live if s.job_id is not None}
        due = killed + [
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
            if job_id not in found and job_id not in killed:
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

    def _act(
        self,
        cluster: _Cluster,
        chain: Chain,
        facts: Facts,
        tick: _Round,
        arrays: list[tuple[Chain, Submit]],
    ) -> list[float]:
        """Decide, carry out, record; returns when failed submissions want their next try.
        A sweep's first segment that can go out as an array task is left in ``arrays``."""
        now = self.clock()
        if self._quiet(chain, facts, now):
            # decide() would answer nothing again, and the tick that asked it last wrote
            # nothing (a write makes the store load the chain anew): nothing to do or record.
            self.failing.pop(chain.id, None)
            self.stuck_until.pop(chain.id, None)
            return self._retries(chain, now)
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
        waiting = ""
        for action in actions:
            if isinstance(action, Submit) and _arrayable(cluster, chain, action):
                arrays.append((chain, action))
            elif isinstance(action, Submit):
                target = self._place(cluster, chain, action, tick)
                if target is None:  # a pool with no free slot: the chain waits, unsubmitted
                    waiting = _waiting(chain, tick.clusters)
                    continue
                done.append(self._submit(target, chain, action))
            else:
                done.append(action)
        if (
            chain.spec.scheduler.hosts
            and chain.reason != waiting
            and (waiting or chain.reason.startswith(WAITING_FOR_A_SLOT))
        ):
            self.store.set_waiting(chain.id, waiting, now)
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
        return [a.at for a in done if isinstance(a, RetryLater)] + self._retries(chain, now)

    def _place(
        self,
        cluster: _Cluster,
        chain: Chain,
        sub: Submit,
        tick: _Round,
    ) -> Optional[_Cluster]:
        """Where segment ``sub.n`` is submitted: a pool's new segment with no predecessor goes
        to a host with a free slot (``place``), or nowhere yet (None); any other, where the
        chain is (a successor queues behind its predecessor, on its host)."""
        sched = chain.spec.scheduler
        if not sched.hosts or sub.after is not None or any(s.n == sub.n for s in chain.segments):
            return cluster
        free = {
            host: tick.free(key, sched.slots or 1)
            for host, key in zip(sched.hosts, _pool_keys(chain))
            if key in tick.clusters
        }
        host = place(sched.hosts, chain.host if chain.segments else None, free)
        if host is None:
            return None
        tick.placed[(sched.kind, host)] += 1
        return tick.clusters[(sched.kind, host)]

    def _quiet(self, chain: Chain, facts: Facts, now: float) -> bool:
        """Whether ``decide(chain, facts, now)`` would answer nothing, known without calling it:
        it answered nothing for this very chain (the store loads a chain anew when its rows
        change) and equal facts, and the first clock rule (``quiet_until``) is not due yet."""
        kept = self.quiet.get(chain.id)
        return kept is not None and kept[0] is chain and now < kept[2] and kept[1] == facts

    def _retries(self, chain: Chain, now: float) -> list[float]:
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
        host = cluster.key[1] if chain.spec.scheduler.hosts else None
        attempts = self.store.journal_submit(chain.id, sub, now, host)
        job = SegmentJob(chain.id, sub.n, chain.spec, sub.walltime, sub.after)
        try:
            trust_run_dir(cluster.transport, chain.spec, chain.id, ran_there=chain.ran_on(host))
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

    def _submit_arrays(
        self, cluster: _Cluster, arrays: list[tuple[Chain, Submit]], summary: TickSummary
    ) -> list[float]:
        """Submit first segments of sweeps as array tasks: one array job per set of chains whose
        directives and workdir are the same, each chain journaled as its task first; returns
        when failed submissions want their next try.

        A chain keeps the array name and task index it was first journaled with: when that
        submission may have failed (or the service died around it), the same task is sent
        again under the same name, so a job that landed anyway is one of two tasks of one
        segment (decide removes the second), never a stranger."""
        scheduler = cluster.arrays
        if not arrays or scheduler is None:
            return []
        groups: dict[str, list[tuple[Chain, Submit, int]]] = defaultdict(list)
        fresh: dict[object, list[tuple[Chain, Submit]]] = defaultdict(list)
        for chain, sub in sorted(arrays, key=lambda a: a[0].id):
            first = chain.segments[0] if chain.segments else None
            if first is not None and first.array is not None and first.task is not None:
                groups[first.array].append((chain, sub, first.task))
            else:
                job = SegmentJob(chain.id, sub.n, chain.spec, sub.walltime)
                fresh[(tuple(scheduler.array_directives(job, "")), chain.spec.workdir)].append((chain, sub))
        for members in fresh.values():
            for start in range(0, len(members), scheduler.max_tasks):
                chunk = members[start : start + scheduler.max_tasks]
                groups[array_tag(chunk[0][0].id)] = [(c, s, i) for i, (c, s) in enumerate(chunk)]
        retries: list[float] = []
        for name, group in groups.items():
            try:
                submitted = self._submit_array(cluster, scheduler, name, group)
            except StoreUnavailable:
                raise
            except Exception as exc:  # a bug: journaled, its chains are adopted or sent again next tick
                log.warning(
                    "array submission failed; retrying next tick", array=name, error=str(exc), exc_info=True
                )
                summary.errors.append(f"array {name}: {type(exc).__name__}: {exc}")
                continue
            for chain, action in submitted:
                self.store.record(chain.id, [action], None, [], self.clock())
                _log(chain.id, action)
                if isinstance(action, RetryLater):
                    retries.append(action.at)
        return retries

    def _submit_array(
        self,
        cluster: _Cluster,
        scheduler: ArrayScheduler,
        name: str,
        group: list[tuple[Chain, Submit, int]],
    ) -> list[tuple[Chain, Action]]:
        """Journal each chain as its task, write each chain's own segment script and the
        array's script, submit the array once: each chain's Adopt, or what its failure means.
        An array the scheduler refuses for good (a site's MaxArraySize below its size, say)
        is sent again as single jobs, so each chain gets the scheduler's own verdict."""
        now = self.clock()
        outcome: list[tuple[Chain, Action]] = []
        tasks: list[tuple[int, SegmentJob, Chain, Submit, int]] = []
        for chain, sub, index in group:
            attempts = self.store.journal_submit(chain.id, sub, now, task=(name, index))
            job = SegmentJob(chain.id, sub.n, chain.spec, sub.walltime)
            try:
                trust_run_dir(cluster.transport, chain.spec, chain.id)
                cluster.transport.write_file(
                    job.script_path, render_script(scheduler, job).encode(), mode=0o700
                )
                trust_script(cluster.transport, job.script_path)
            except (TransportError, SchedulerError, UnsafePathError) as exc:
                outcome.append((chain, after_submit(sub.n, attempts, exc, now)))  # that chain's alone
                continue
            tasks.append((index, job, chain, sub, attempts))
        if not tasks:
            return outcome
        spec = tasks[0][1].spec
        stem = array_stem(spec, name)
        try:
            trust_run_dir(cluster.transport, spec, None)
            script = render_array_script(scheduler, name, [(t[0], t[1]) for t in tasks])
            cluster.transport.write_file(stem + ".sh", script.encode(), mode=0o700)
            trust_script(cluster.transport, stem + ".sh")
            argv = scheduler.array_submit_argv(
                stem + ".sh", stem + ".log", spec.workdir, [t[0] for t in tasks], spec.max_concurrent
            )
            base = scheduler.parse_submit(cluster.transport.run(argv, timeout=SUBMIT_TIMEOUT))
        except SchedulerError as exc:
            if exc.transient:
                return outcome + [
                    (chain, after_submit(1, tries, exc, now)) for _, _, chain, _, tries in tasks
                ]
            log.warning("array refused; submitting its chains one by one", array=name, error=str(exc))
            return outcome + [(chain, self._submit(cluster, chain, sub)) for _, _, chain, sub, _ in tasks]
        except (TransportError, UnsafePathError) as exc:
            return outcome + [(chain, after_submit(1, tries, exc, now)) for _, _, chain, _, tries in tasks]
        return outcome + [
            (
                chain,
                Adopt(
                    n=job.n, job_id=scheduler.task_id(base, i), how=f"submitted as task {i} of array {base}"
                ),
            )
            for i, job, chain, _, _ in tasks
        ]


def _held(active: Iterable[Chain]) -> set[str]:
    """The chains of sweeps with ``max_concurrent`` that wait to start: as many of a sweep's
    chains are under way (a segment submitted, not ended) as it allows, the first ones
    (by creation, then id) that have not started counted in."""
    room: dict[str, int] = {}
    waiting: dict[str, list[Chain]] = defaultdict(list)
    for chain in active:
        limit, sweep = chain.spec.max_concurrent, chain.spec.sweep_name
        if limit is None:
            continue
        room[sweep] = room.get(sweep, limit) - bool(chain.segments)
        if not chain.segments:
            waiting[sweep].append(chain)
    held: set[str] = set()
    for sweep, chains in waiting.items():
        chains.sort(key=lambda c: (c.created_at, c.id))
        held.update(c.id for c in chains[max(0, room[sweep]) :])
    return held


def _arrayable(cluster: _Cluster, chain: Chain, sub: Submit) -> bool:
    """A sweep's first segment, on a backend with job arrays, goes out as an array task."""
    return sub.n == 1 and bool(chain.spec.sweep_name) and cluster.arrays is not None


def _pool_keys(chain: Chain) -> list[tuple[str, str]]:
    """The clusters of a pool chain's hosts, in the job file's order."""
    return [(chain.spec.scheduler.kind, host) for host in chain.spec.scheduler.hosts]


def _busy(cluster: _Cluster) -> int:
    """A host's slots in use: its jobs running or ready to run (a job waiting for its
    predecessor takes that one's slot, so it is not counted)."""
    return sum(
        1
        for job in cluster.live.values()
        if job.phase is Phase.RUNNING or (job.phase is Phase.PENDING and job.reason != "Dependency")
    )


def _waiting(chain: Chain, clusters: Mapping[tuple[str, str], _Cluster]) -> str:
    """Why a pool's chain waits unsubmitted."""
    hosts = chain.spec.scheduler.hosts
    up = [h for h, key in zip(hosts, _pool_keys(chain)) if key in clusters]
    down = [h for h in hosts if h not in up]
    text = f"waiting for a free slot on hosts {', '.join(up)}" if up else "waiting for a host to answer"
    return text + (f" ({', '.join(down)} not reached)" if down and up else "")


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
