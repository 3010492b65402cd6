"""One tick of the service: observe, decide, act and record.

**Observe** (``observe``) writes nothing: the active chains come from one load
of the store (which decodes again only the chains that changed); per cluster,
one batched poll of the scheduler serves every chain on it; for each chain the
observer reads its markers, checkpoint and accounting into plain facts.
**Decide** is ``decide()``: facts in, actions out; a chain whose last answer
was "nothing to do" is not asked again while its stored row and its facts stay
the same, until ``quiet_until`` (the first clock rule due) says the answer
could change. **Act** (``act``) carries the actions out: a submission is
journaled, then made; cancels go out in one command; a sweep's first segments
go out as array jobs after the cluster's chains have acted. **Record**:
everything the tick learned and did for one chain is written in one
transaction (nothing, when nothing changed).

A pool's chain (``scheduler.hosts``) is looked at where ``placement.observe_on``
says: with the host of its live segment, else where it ran last or on the first
host that answered; its facts hold each answering host's free slots and jobs,
from which ``decide`` places its new segment (or has it wait, saying so) and
cancels what a host that is back still runs of segments ended as lost there.

A chain with several places whose cluster's poll failed (its controller stopped) does not
wait for it: it is looked at by its segments' end markers alone (``Observer.unanswered``),
so a segment that ended there is judged, and ``decide`` moves the chain where a segment
starts now (that place answers that it cannot). A cancel that did not reach its scheduler
is owed (``Executor.owed_cancels``, kept in the store for the services after this one):
that cluster is polled each tick, and once it answers, the jobs it still lists are
cancelled (``retry.owed_to_send``); one owed for over a week is given up
(``retry.owed_given_up``), said in its chain's history. A chain with one place waits for its cluster.

The engine calls ``decide`` and, besides it, only the rules that say what to
observe and what a carried-out action came to: ``placement.held_back`` and
``placement.observe_on`` (which chains may start, where each is looked at),
``chain.listed_as_its`` (which listed job is a segment's: its id and its name),
``quiet_until`` (when ``decide`` may answer anew), ``retry.after_fault``,
``retry.after_submit``, ``retry.array_refused``, ``retry.accounting_due``,
``retry.accounting_again``, ``retry.owed_to_send`` and ``retry.owed_given_up`` (what an
owed cancel comes to), ``carry.applies``, ``placement.free_slots``,
``placement.shared``, ``placement.pools`` (the pool hosts polled for a chain, at its place
or at another of its places), and for a chain with several places ``places.asks`` (when to
ask each place when it would start the next segment, at most every ``places.ASK_EVERY``: the
answers are ``Facts.starts``, from which ``decide`` chooses; a pool's from its hosts'
answers, ``places.pool_start``), ``places.copy_from`` (the checkpoint copied before a
segment is submitted at another place) and ``places.copy_host`` (the host it is read on)
(``tests/test_layers.py`` holds it to this list).

A fault in one chain's tick is that chain's: it is logged, counted, retried
next tick, and after ``retry.STUCK_AFTER`` failing ticks the chain is marked
stuck and tried again every ``retry.STUCK_RETRY`` (``retry.after_fault``); the
other chains go on. A database that cannot be written (``StoreUnavailable``)
is an outage of the whole service: the tick stops there and the service
retries; nothing is charged for it.
"""

from __future__ import annotations

import gc
import math
import time
from collections import defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from typing import Any, Optional, TypeVar

from chainrun import carry
from chainrun.cluster import Cluster
from chainrun.decide import Facts, decide, placement, places, quiet_until
from chainrun.decide.carry import applies
from chainrun.decide.chain import questions
from chainrun.decide.retry import after_fault
from chainrun.decide.startup import slow_start
from chainrun.engine.act import ChainTick, Executor, TickClusters
from chainrun.engine.observe import ClusterKey, Observer, Polled, poll
from chainrun.errors import ChainrunError, SchedulerError, StoreUnavailable, TransportError
from chainrun.logsetup import get_logger
from chainrun.model import (
    Action,
    Adopt,
    Cancel,
    Chain,
    ChainState,
    EndSegment,
    Finish,
    ListedJob,
    MarkStuck,
    Phase,
    Reject,
    Remove,
    RetryLater,
    SetGrace,
    Start,
    Submit,
    Track,
)
from chainrun.schedulers import scheduler_for
from chainrun.schedulers.base import Scheduler
from chainrun.schedulers.pending import will_not_start
from chainrun.schedulers.segment import SegmentJob
from chainrun.store import Store
from chainrun.transport import Transport, transport_for

__all__ = ["Engine", "TickSummary"]

log = get_logger(__name__)
_T = TypeVar("_T")

# A cluster's poll is kept for the next to be counted from (``observe.poll``) from its
# third on: the entries of a chain whose jobs do not change are kept from poll to poll,
# and kept from the first ticks, which read every chain (the first, and the one after it
# records what the first found), they pin those ticks' garbage: 6 MB of RSS at 10,000
# chains, measured.
KEEP_POLLS_FROM = 3


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
    unreachable: dict[ClusterKey, ChainrunError] = field(default_factory=dict)
    # Each pool host polled: whether it answered when last polled, since when, and the jobs
    # it listed this tick (None: not polled this tick, or it did not answer).
    pool: dict[ClusterKey, tuple[bool, float, Optional[dict[str, ListedJob]]]] = field(default_factory=dict)
    # Seconds until the engine wants its next tick (a submission's backoff
    # ends sooner than the interval); None: the service's interval.
    next_in: Optional[float] = None

    def hosts(self) -> dict[str, Any]:
        """Each pool host as ``status --hosts`` reads it: whether it answers and since when,
        and (when it answered) its jobs not ended, with the slot each holds."""
        return {
            host: {
                "answers": answers,
                "since": since,
                "jobs": None
                if jobs is None
                else [
                    {
                        "id": j.job_id,
                        "name": j.name,
                        "phase": j.phase.value,
                        "reason": j.reason,
                        "slot": j.slot,
                    }
                    for j in jobs.values()
                    if j.phase is not Phase.ENDED
                ],
            }
            for (_, host), (answers, since, jobs) in self.pool.items()
        }

    def line(self) -> str:
        text = f"{self.running} running, {self.queued} queued, {self.failed} failed"
        if self.stuck:
            text += f", {self.stuck} stuck"
        return text + (f"; {len(self.errors)} errors" if self.errors else "")


@dataclass(frozen=True)
class _Loaded:
    """What the tick derives from one load of the store alone, kept while the store gives
    that very load again (nothing was written since)."""

    chains: list[Chain]
    held: set[str]  # the chains of sweeps that wait to start (``placement.held_back``)
    groups: dict[ClusterKey, list[Chain]]  # the chains not of a pool, by the cluster they are on
    pooled: list[Chain]  # a pool's chains: grouped once its hosts are polled
    pools: list[ClusterKey]  # every host of every pool
    counts: tuple[int, int, int]  # the status line's: with a running job, with a queued one, stuck

    @classmethod
    def of(cls, loaded: list[Chain]) -> _Loaded:
        groups: dict[ClusterKey, list[Chain]] = defaultdict(list)
        pooled: list[Chain] = []
        running = queued = stuck = 0
        for chain in loaded:
            (pooled if chain.spec.scheduler.hosts else groups[chain.cluster_key]).append(chain)
            phases = {s.phase for s in chain.live}
            running += Phase.RUNNING in phases
            queued += Phase.PENDING in phases
            stuck += chain.state is ChainState.STUCK
        pools = [(p.kind, h) for c in loaded for p in placement.pools(c.spec) for h in p.hosts]
        return cls(loaded, placement.held_back(loaded), dict(groups), pooled, pools, (running, queued, stuck))


class Engine:
    """Moves every active chain forward by one tick."""

    def __init__(
        self,
        store: Store,
        clock: Callable[[], float] = time.time,
        transports: Callable[[Optional[str]], Transport] = transport_for,
        schedulers: Callable[[str, Optional[str]], Scheduler] = scheduler_for,
        on_end: Optional[Callable[[Chain], None]] = None,
        on_problem: Optional[Callable[[Chain, int, str, str], None]] = None,
        on_warning: Optional[Callable[[Chain, str], None]] = None,
    ) -> None:
        self.store = store
        self.clock = clock
        self.transports = transports
        self.schedulers = schedulers
        self.on_end = on_end  # told of every chain that reaches a final state
        # told of each segment the scheduler keeps pending for a reason that will not clear
        # by itself (segment, reason, what to change), once per change of its reason
        self.on_problem = on_problem
        # told once per service run of a chain whose segments start up for most of their time
        self.on_warning = on_warning
        self.warned: set[str] = set()
        self.observer = Observer()
        self.executor = Executor(store, clock, self._cluster)
        # By chain with several places: when its places were last asked, and their answers.
        self.starts: dict[str, tuple[float, dict[str, Start]]] = {}
        self.failing: dict[str, int] = {}  # chain id -> failing ticks in a row
        self.stuck_until: dict[str, float] = {}  # chain id -> when a stuck chain is tried again
        # Chains decide() last had nothing for: the chain as loaded, its facts, and until when
        # that answer holds for them (see _quiet).
        self.quiet: dict[str, tuple[Chain, Facts, float]] = {}
        # Each cluster polled: whether its last poll answered, and since when that is so.
        self.answers: dict[ClusterKey, tuple[bool, float]] = {}
        self.polls: dict[ClusterKey, Polled] = {}  # each cluster's last poll that answered
        self.polled: dict[ClusterKey, int] = {}  # each cluster's polls that answered
        self.loaded: Optional[_Loaded] = None  # what the last load of the store gave
        self.pool_hosts: set[ClusterKey] = set()  # every pool host polled since the service started
        self.failed: set[str] = set()  # the chains that failed while this service ran
        # The service's tick interval: set, each tick says in the run roots of the chains that
        # may carry themselves that the service ticks (``carry.beat_path``); None: a tick of
        # a command (``cancel``), which is no service.
        self.beat_every: Optional[float] = None
        self.beaten: dict[tuple[ClusterKey, str], float] = {}  # when each run root's beat was written
        self.beat_failed: set[tuple[ClusterKey, str]] = set()  # said once until a write works again

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
        loaded = self.store.chains(active_only=True)
        if self.loaded is None or self.loaded.chains is not loaded:  # the store read anew
            self.loaded = _Loaded.of(loaded)
        held = self.loaded.held
        if only is None and not self.stuck_until:
            groups = defaultdict(list, {key: list(chains) for key, chains in self.loaded.groups.items()})
            pooled = list(self.loaded.pooled)
        else:
            groups, pooled = defaultdict(list), []
            for chain in loaded:
                if (only is None or chain.id in only) and now >= self.stuck_until.get(chain.id, 0.0):
                    (pooled if chain.spec.scheduler.hosts else groups[chain.cluster_key]).append(chain)
        if (
            len(self.quiet) > len(loaded)
            or len(self.observer.settled) > len(loaded)
            or len(self.starts) > len(loaded)
        ):
            ids = {c.id for c in loaded}  # chains ended, or removed, since: forgotten
            self.quiet = {k: v for k, v in self.quiet.items() if k in ids}
            self.starts = {k: v for k, v in self.starts.items() if k in ids}
            self.observer.keep_only(ids)
        # One poll per cluster: every cluster a chain lives on, every host of a pool (free
        # slots are counted from its poll; one that stops answering is noticed), and every
        # cluster owed a cancel (sent once it answers).
        pools = self.loaded.pools
        tick = TickClusters({})
        for chain_id, given_up in self.executor.give_up_owed(now).items():
            self.store.record(chain_id, [], None, given_up, now)
            log.warning("owed cancels given up", chain=chain_id, why=given_up)
        for key in dict.fromkeys([*groups, *pools, *self.executor.owed_cancels]):
            kind, host = key
            try:
                tick.polled[key] = poll(key, self._cluster(key), self.polls.get(key))
                self.polled[key] = self.polled.get(key, 0) + 1
                if self.polled[key] >= KEEP_POLLS_FROM:
                    self.polls[key] = tick.polled[key]
            except (TransportError, SchedulerError) as exc:
                log.warning("poll failed; retrying next tick", scheduler=kind, host=host, error=str(exc))
                summary.errors.append(str(exc))
                summary.unreachable[key] = tick.unreachable[key] = exc
            answers = key in tick.polled
            if key not in self.answers or self.answers[key][0] is not answers:
                self.answers[key] = (answers, now)  # since when it answers, or does not
        self.pool_hosts.update(pools)
        summary.pool = {
            key: (*self.answers[key], tick.polled[key].jobs if key in tick.polled else None)
            for key in self.pool_hosts
        }
        for key in [k for k in self.executor.owed_cancels if k in tick.polled]:
            for chain_id, removed in self.executor.cancel_owed(tick.polled[key]).items():
                self.store.record(chain_id, removed, None, [], now)
                for action in removed:
                    _log(chain_id, action)
        away = self._group(pooled, groups, tick, now)
        retries: list[float] = []  # when submissions that failed want their next try
        for key, chains in groups.items():
            polled = tick.polled.get(key)
            if polled is None:
                retries += self._unanswered(key, chains, tick, summary, now)
                continue
            gathered: dict[str, Facts] = {}
            for chain in chains:
                if chain.id in away:  # its host is gone, or holds its checkpoint and is away
                    facts = self._guarded(chain, summary, self.observer.away, polled, chain, away[chain.id])
                else:
                    facts = self._guarded(chain, summary, self.observer.facts, polled, chain, now)
                if facts is None:
                    continue
                if chain.id in held:
                    facts = replace(facts, may_start=False)
                elif self._asleep(chain, facts, now):
                    continue  # every job of it listed, so nothing to ask accounting; nothing to do
                gathered[chain.id] = facts
            gathered = self.observer.account(polled, chains, gathered, now)
            steps: list[ChainTick] = []
            arrays: list[tuple[ChainTick, Submit]] = []  # first segments to submit as array tasks
            for chain in chains:
                facts = gathered.get(chain.id)
                if facts is not None and not self._asleep(chain, facts, now):
                    step = self._guarded(chain, summary, self._act, polled, chain, facts, tick, arrays)
                    if step is not None:
                        steps.append(step)
            self.executor.submit_arrays(polled, arrays, summary.errors)
            for step in steps:
                retries += self._guarded(step.chain, summary, self._record, step) or []
            self._beat(polled, chains, now)
        summary.running, summary.queued, summary.stuck = self.loaded.counts
        summary.active = len(loaded)
        summary.failed = len(self.failed)
        if retries:
            summary.next_in = max(0.0, min(retries) - self.clock())
        return summary

    def _unanswered(
        self, key: ClusterKey, chains: list[Chain], tick: TickClusters, summary: TickSummary, now: float
    ) -> list[float]:
        """The chains with several places on cluster ``key``, whose poll failed this tick, move
        on without it: each is looked at by its markers (``Observer.unanswered``), and a
        segment that ended there is judged, its place asked (it answers that it cannot start
        one) and the chain moved where one starts; a chain with one place waits for it, as
        one whose markers cannot be read either (its host does not answer) does. Returns when
        their failed submissions want their next try."""
        unpolled = Polled(key, self._cluster(key), {}, {}, {})
        retries: list[float] = []
        for chain in chains:
            if not chain.spec.places:
                continue
            facts = self._guarded(chain, summary, self._by_markers, unpolled, chain, now)
            step = (
                None
                if facts is None
                else self._guarded(chain, summary, self._act, unpolled, chain, facts, tick, [])
            )
            if step is not None:
                retries += self._guarded(chain, summary, self._record, step) or []
        return retries

    def _by_markers(self, unpolled: Polled, chain: Chain, now: float) -> Optional[Facts]:
        """``Observer.unanswered``; None when the markers cannot be read (the host does not
        answer either): the chain waits, at no cost."""
        try:
            return self.observer.unanswered(unpolled, chain, now)
        except TransportError:
            return None

    def _group(
        self, pooled: list[Chain], groups: dict[ClusterKey, list[Chain]], tick: TickClusters, now: float
    ) -> dict[str, str]:
        """Group each pool chain with the host it is looked at from this tick
        (``placement.observe_on``); returns why each chain looked at from another host than
        its own is away ("" for one that only waits)."""
        away: dict[str, str] = {}
        for chain in pooled:
            kind = chain.spec.scheduler.kind
            answered, since = self.answers.get(chain.cluster_key, (True, now))
            where = placement.observe_on(chain, tick.reached(kind), None if answered else since, now)
            if where is None:
                continue
            host, why = where
            groups[(kind, host)].append(chain)
            if why is not None:
                away[chain.id] = why
        return away

    def _beat(self, polled: Polled, chains: list[Chain], now: float) -> None:
        """Say, in the run root of each of these chains that may carry itself, that the service
        ticks: one small write per run root (after the chains acted: a new chain's root exists
        then), at most every half interval. A write that fails is logged, and its segments
        may take the service for away: the beat is how the service is heard."""
        if self.beat_every is None:
            return
        data = carry.beat(self.beat_every)
        roots = {carry.beat_path(c.spec, self.store.home) for c in chains if applies(c.spec)}
        for gone in [k for k in self.beaten if k[0] == polled.key and k[1] not in roots]:
            del self.beaten[gone]  # no chain there any more: forgotten, written again if one comes
        for path in roots:
            key = (polled.key, path)
            if now - self.beaten.get(key, -math.inf) < self.beat_every / 2:
                continue
            try:
                polled.cluster.transport.write_file(path, data)
            except TransportError as exc:
                if key not in self.beat_failed:
                    log.warning(
                        "cannot write the service's beat", path=path, host=polled.key[1], error=str(exc)
                    )
                self.beat_failed.add(key)
                continue
            self.beat_failed.discard(key)
            self.beaten[key] = now

    def _cluster(self, key: ClusterKey) -> Cluster:
        kind, host = key
        return Cluster(self.schedulers(kind, host or None), self.transports(host or None))

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
            now = self.clock()
            again, stuck = after_fault(chain, count, message, now)
            if again is not None:
                self.stuck_until[chain.id] = again
            if stuck is not None:
                self.store.record(chain.id, [stuck], None, [], now)
                _log(chain.id, stuck)
            return None

    def _act(
        self,
        polled: Polled,
        chain: Chain,
        facts: Facts,
        tick: TickClusters,
        arrays: list[tuple[ChainTick, Submit]],
    ) -> ChainTick:
        """Decide and carry out; a sweep's first segment that can go out as an array task
        is left in ``arrays``."""
        now = self.clock()
        step = ChainTick(chain, now)
        slow = slow_start(chain.segments) if self.on_warning is not None else ""
        if slow and chain.id not in self.warned and self.on_warning is not None:
            self.warned.add(chain.id)
            self.on_warning(chain, slow)
        if chain.id in self.executor.owed_grace:
            self.executor.write_grace(polled, chain, self.executor.owed_grace[chain.id], step.warnings)
        if placement.pools(chain.spec):
            free, jobs = tick.pool(chain)
            facts = replace(facts, free=free, pool_jobs=jobs)
        if places.asks(chain):
            facts = replace(facts, starts=self._starts(chain, tick, now))
        if self._quiet(chain, facts, now):
            # decide() would answer nothing again, and the tick that asked it last wrote
            # nothing (a write makes the store load the chain anew): nothing to do or record.
            return step
        actions = decide(chain, facts, now)
        if actions:
            self.quiet.pop(chain.id, None)
            # Its rows change: the store loads it anew, and its settled facts (which hold
            # this chain object) are of no use; let both go now.
            self.observer.settled.pop(chain.id, None)
        else:
            self.quiet[chain.id] = (chain, facts, quiet_until(chain, now))
        self.executor.execute(polled, chain, actions, step, tick, arrays)
        if facts.progress is not None and facts.progress != chain.latest:
            step.latest = facts.progress
        return step

    def _starts(self, chain: Chain, tick: TickClusters, now: float) -> dict[str, Start]:
        """When each place of a chain with several would start its next segment: asked at
        most every ``places.ASK_EVERY`` per chain, a place whose poll failed this tick
        answering that it cannot."""
        kept = self.starts.get(chain.id)
        if kept is not None and now - kept[0] < places.ASK_EVERY:
            return kept[1]
        starts: dict[str, Start] = {}
        for name, there, walltime in questions(chain):
            job = SegmentJob(chain.id, chain.next_n, there, walltime)
            if there.scheduler.hosts:  # a pool: each host that answered this tick is asked
                keys = [(there.scheduler.kind, h) for h in there.scheduler.hosts]
                answers = {
                    k[1]: tick.polled[k].cluster.expected_start(job, now) for k in keys if k in tick.polled
                }
                starts[name] = places.pool_start(chain, name, answers)
                continue
            key = there.scheduler.cluster_key
            if key in tick.unreachable:
                starts[name] = Start(None, f"its scheduler did not answer: {tick.unreachable[key]}")
                continue
            cluster = tick.polled[key].cluster if key in tick.polled else self._cluster(key)
            starts[name] = cluster.expected_start(job, now)
        self.starts[chain.id] = (now, starts)
        log.info(
            "places asked",
            chain=chain.id,
            starts={k: (None if v.at is None else round(v.at - now), v.reason) for k, v in starts.items()},
        )
        return starts

    def _record(self, step: ChainTick) -> list[float]:
        """Write what the chain's tick learned and did, in one transaction (nothing, when
        nothing changed); returns when its failed submissions want their next try."""
        chain = step.chain
        ended: Optional[Chain] = None
        if step.done or step.latest is not None or step.warnings:
            ended = self.store.record(chain.id, step.done, step.latest, step.warnings, step.now)
        for action in step.done:
            if isinstance(action, (EndSegment, Cancel, Reject)):  # its markers are no longer read
                self.observer.markers.forget(chain.id, action.n)
        for action in step.done:
            _log(chain.id, action)
        self.failing.pop(chain.id, None)
        self.stuck_until.pop(chain.id, None)
        if ended is not None and ended.state is ChainState.FAILED:
            self.failed.add(ended.id)
        if self.on_end is not None and ended is not None:
            self.on_end(ended)
        tracked = [a for a in step.done if isinstance(a, Track) and a.phase is Phase.PENDING]
        for track in tracked if self.on_problem is not None else []:
            change = will_not_start(track.reason)
            if change and self.on_problem is not None:
                self.on_problem(chain, track.n, track.reason, change)
        retries = [a.at for a in step.done if isinstance(a, RetryLater)]
        return retries + [
            s.retry_at
            for s in chain.live
            if s.phase is Phase.SUBMITTING and s.retry_at is not None and s.retry_at > step.now
        ]

    def _asleep(self, chain: Chain, facts: Facts, now: float) -> bool:
        """Whether the chain's tick would do and record nothing, seen at a glance: its facts
        are the very ones ``decide`` last had nothing for, for this very chain (the observer
        gives them again while nothing of the chain changes), the first clock rule is not due,
        and nothing is owed it (a grace to write, failing ticks to clear). The act step
        would find it ``_quiet``."""
        kept = self.quiet.get(chain.id)
        return (
            kept is not None
            and kept[1] is facts
            and chain.id not in self.executor.owed_grace
            and chain.id not in self.failing
            and self._quiet(chain, facts, now)
        )

    def _quiet(self, chain: Chain, facts: Facts, now: float) -> bool:
        """Whether ``decide(chain, facts, now)`` would answer nothing, known without calling it:
        it answered nothing for this very chain (the store loads a chain anew when its rows
        change) and equal facts, and the first clock rule (``quiet_until``) is not due yet."""
        kept = self.quiet.get(chain.id)
        return (
            kept is not None and kept[0] is chain and now < kept[2] and (kept[1] is facts or kept[1] == facts)
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
    elif isinstance(action, SetGrace):
        bound.info("grace changed", seconds=action.seconds, reason=action.reason)
    elif isinstance(action, MarkStuck):
        bound.error("chain stuck", reason=action.reason)
