"""Observe: what a tick learns of the world, writing nothing.

Per cluster, one batched poll of the scheduler serves every chain on it (``poll``). For
each chain the observer reads what it needs (the wrapper's markers of jobs that left the
listing or ended, each kept once read; the checkpoint, whose directory, when it holds no
sidecar, is listed while the chain's segment just runs only when due, as that listing
then only feeds what ``status`` shows; why a stuck job is stuck) into
the plain ``Facts`` that ``decide`` takes, and asks accounting in one command for the jobs
gone without a marker that are due (``retry.accounting_due``) and for those whose marker
says a signal killed the command (an OOM kill, which accounting names). A listed job is a
segment's only under its id and its name (``chain.listed_as_its``): a cluster back with its state
lost may give the id to another job. Accounting is read by id alone: right after a job
ends, sacct may name it ``allocation`` until its record is complete.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Optional, TypeVar, Union

from chainrun.cluster import Cluster
from chainrun.decide import Facts, JobFacts, placement
from chainrun.decide.carry import applies
from chainrun.decide.chain import listed_as_its
from chainrun.decide.retry import accounting_again, accounting_due
from chainrun.errors import SchedulerError, TransportError
from chainrun.logsetup import get_logger
from chainrun.markers import MarkerReader
from chainrun.model import Carried, Chain, ListedJob, Outcome, Phase, Segment
from chainrun.progress import ProgressReader, listing_every, sidecar_watched
from chainrun.schedulers.segment import ARRAY_PREFIX, SegmentJob, parse_claim, parse_tag, tag_for

log = get_logger(__name__)

_K = TypeVar("_K")
_V = TypeVar("_V")

ClusterKey = tuple[str, str]  # a cluster: (scheduler kind, host; "" for this machine)


Tagged = dict[str, dict[int, tuple[ListedJob, ...]]]  # listed jobs tagged cr.CHAIN.N, by chain and N
Tasks = dict[tuple[str, int], tuple[ListedJob, ...]]  # listed array tasks, by array name and index

_SERIALS = itertools.count(1)  # each poll's number


@dataclass(frozen=True)
class Polled:
    """One cluster as this tick's poll found it, and what changed since the poll before."""

    key: ClusterKey
    cluster: Cluster
    jobs: dict[str, ListedJob]  # every job the poll listed, by id
    tagged: Tagged
    tasks: Tasks
    serial: int = 0  # this poll's number
    # The number of the poll before, which ``moved`` and ``touched`` are counted from (None:
    # not counted; every chain compares its jobs with those it saw).
    since: Optional[int] = None
    # The jobs listed anew, listed differently (a new object: the backend gives the same one
    # for a job listed the same) or no longer, by id; and the chains and array tasks they are of.
    moved: frozenset[str] = frozenset()
    touched: frozenset[Union[str, tuple[str, int]]] = frozenset()


def poll(key: ClusterKey, cluster: Cluster, before: Optional[Polled] = None) -> Polled:
    """Poll ``cluster`` once, its jobs indexed by the chain and segment their tags name; with
    the poll ``before`` it, what changed since, and when little did, its index with only
    the chains that changed indexed anew. Raises TransportError or SchedulerError when the
    poll fails."""
    cluster.prepare()
    jobs = cluster.poll()
    serial = next(_SERIALS)
    if before is not None:
        old = before.jobs
        moved = [j for i, j in jobs.items() if old.get(i) is not j]
        moved += [j for i, j in old.items() if jobs.get(i) is not j]
        if len(moved) * 4 <= len(jobs):
            index = _reindex(cluster, before, jobs, moved)
            if index is not None:
                tagged, tasks, touched = index
                ids = frozenset(j.job_id for j in moved)
                return Polled(key, cluster, jobs, tagged, tasks, serial, before.serial, ids, touched)
    tagged, tasks = _index(cluster, jobs.values())
    return Polled(key, cluster, jobs, tagged, tasks, serial)


def _place(cluster: Cluster, job: ListedJob) -> Optional[tuple[bool, tuple[str, int]]]:
    """Where ``job`` is indexed: (True, (array name, index)) for an array task, (False,
    (chain id, N)) for a job tagged cr.CHAIN.N; None: neither."""
    if cluster.arrays is not None and job.name.startswith(ARRAY_PREFIX):
        index = cluster.arrays.task_index(job.job_id)
        return None if index is None else (True, (job.name, index))
    tag = parse_tag(job.name)
    return None if tag is None else (False, tag)


def _index(cluster: Cluster, jobs: Iterable[ListedJob]) -> tuple[Tagged, Tasks]:
    """``jobs`` indexed by the chain and segment their tags name, and array tasks by their
    array's name and index, each place's jobs in the listing's order."""
    tagged: Tagged = defaultdict(dict)
    tasks: Tasks = {}
    for job in jobs:
        place = _place(cluster, job)
        if place is None:
            continue
        is_task, (name, n) = place
        if is_task:
            tasks[(name, n)] = (*tasks.get((name, n), ()), job)
        else:
            found = tagged[name]
            found[n] = (*found.get(n, ()), job)
    return tagged, tasks


def _reindex(
    cluster: Cluster, before: Polled, jobs: dict[str, ListedJob], moved: list[ListedJob]
) -> Optional[tuple[Tagged, Tasks, frozenset[Union[str, tuple[str, int]]]]]:
    """The index of the poll ``before``, with the chains and array tasks of the ``moved``
    jobs indexed anew from ``jobs`` (the others keep their very entries), and those chains
    and tasks; None when one of them has two jobs in one place (their order is the
    listing's, which only a whole index keeps)."""
    touched: set[Union[str, tuple[str, int]]] = set()
    for job in moved:
        place = _place(cluster, job)
        if place is not None:
            touched.add(place[1] if place[0] else place[1][0])
    chains = [t for t in touched if isinstance(t, str)]
    keys = [t for t in touched if not isinstance(t, str)]
    members = [j for c in chains for found in before.tagged.get(c, {}).values() for j in found]
    members += [j for k in keys for j in before.tasks.get(k, ())]
    current = {j.job_id: j for j in [*members, *moved] if jobs.get(j.job_id) is j}
    new_tagged, new_tasks = _index(cluster, current.values())
    if any(len(f) > 1 for entry in new_tagged.values() for f in entry.values()) or any(
        len(f) > 1 for f in new_tasks.values()
    ):
        return None
    return (
        _patched(before.tagged, chains, new_tagged),
        _patched(before.tasks, keys, new_tasks),
        frozenset(touched),
    )


def _patched(before: Mapping[_K, _V], keys: Iterable[_K], anew: Mapping[_K, _V]) -> dict[_K, _V]:
    """``before`` with each of ``keys`` as ``anew`` has it now (gone where ``anew`` has none)."""
    patched = dict(before)
    for key in keys:
        if key in anew:
            patched[key] = anew[key]
        else:
            patched.pop(key, None)
    return patched


def _job_of(polled: Polled, chain: Chain, seg: Segment) -> Optional[ListedJob]:
    """``seg``'s job as the scheduler lists it, if the job listed under its id is its own."""
    return listed_as_its(polled.jobs, seg, tag_for(chain.id, seg.n))


def _first_claim(polled: Polled, chain: Chain) -> Optional[int]:
    """The segment whose claim to look for first: the chain's newest (itself, when it was
    never submitted, else the one after it); None, no claim looked for, when its segments
    may not queue their successors or that segment waits in the queue, which is the usual
    case (a successor queued ahead): no segment after it can have run yet."""
    last = max(chain.segments, key=lambda s: s.n, default=None)
    if last is None or not applies(chain.spec):
        return None
    if last.job_id is None:
        return last.n
    listed = _job_of(polled, chain, last)
    return None if listed is not None and listed.phase is Phase.PENDING else last.n + 1


def _carried(polled: Polled, chain: Chain) -> dict[int, Carried]:
    """The successors that segments queued themselves while the service was away, by their
    claims, from ``_first_claim`` on."""
    n = _first_claim(polled, chain)
    found: dict[int, Carried] = {}
    while n is not None:
        data = polled.cluster.transport.read_file(SegmentJob(chain.id, n, chain.spec, 0).claim_path)
        claim = parse_claim(data) if data is not None else None
        if claim is None:
            return found
        found[n] = claim
        n += 1
    return found


@dataclass
class _Settled:
    """A chain's facts, gathered while its segments just ran or waited, with every marker
    they need kept, no claim to look for and its checkpoint listed: the same facts again
    for as long as the chain as stored, the listing of its jobs (``facts.jobs``, each
    live segment's, and ``facts.tagged``) and its checkpoint's reading stay the same. One
    is kept for each such chain, so it has slots."""

    __slots__ = ("chain", "facts", "serial", "started", "task", "window")
    chain: Chain
    facts: Facts
    window: tuple[
        float, float
    ]  # from, until: while its checkpoint's last listing stands (``ProgressReader.standing``)
    started: Optional[float]  # when its newest running segment started (``sidecar_watched``)
    serial: int  # the last poll whose listing of its jobs was found the same (``Polled.serial``)
    task: Optional[tuple[str, int]]  # its first segment's array task (array name, index), if one


def _listed(facts: Facts, chain: Chain) -> tuple[Optional[ListedJob], ...]:
    """The listing of the chain's live segments' jobs that ``facts`` (settled) were of."""
    return tuple(facts.jobs[s.job_id].listed for s in chain.live if s.job_id is not None)


class Observer:
    """What observing keeps from tick to tick: markers read, sidecars' last reads, the
    facts of chains that just run (``_Settled``), and when to ask accounting again of each
    job it did not know."""

    def __init__(self) -> None:
        self.markers = MarkerReader()
        self.progress = ProgressReader()  # re-reads a sidecar only when it changed
        self.settled: dict[str, _Settled] = {}  # by chain id
        # Per cluster, jobs gone from the listing without an end marker that accounting
        # did not know: when to ask again, and the interval after that.
        self.unaccounted: dict[ClusterKey, dict[str, tuple[float, float]]] = {}

    def facts(self, polled: Polled, chain: Chain, now: float) -> Facts:
        """What ``decide`` needs to know of ``chain`` at ``now`` (accounting aside: ``account``)."""
        settled = self.settled.get(chain.id)
        transport = polled.cluster.transport
        if (
            settled is not None
            and settled.chain is chain
            and settled.serial == polled.since
            and chain.id not in polled.touched
            and polled.moved.isdisjoint(settled.facts.jobs)
            and (settled.task is None or settled.task not in polled.touched)
            and not sidecar_watched(settled.started, now)
        ):
            # Seen at a glance: none of its jobs changed in the listing since the poll before,
            # whose listing was found the same as the one its facts were of.
            settled.serial = polled.serial
            if settled.window[0] <= now < settled.window[1]:
                return settled.facts  # asleep
            # Its checkpoint's listing came due, the one thing that may have changed.
            every = listing_every(settled.started, now)
            progress = self.progress.progress(transport, chain.spec, now, True, False, every)
            window = self.progress.standing(transport, chain.spec)
            facts = (
                settled.facts
                if progress == settled.facts.progress
                else replace(settled.facts, progress=progress)
            )
            if window is None:  # a sidecar came: read from now on at every tick
                self.settled.pop(chain.id)
            else:
                settled.window, settled.facts = window, facts
            return facts
        jobs: dict[str, JobFacts] = {}
        tagged = polled.tagged.get(chain.id, {})
        first = chain.segments[0] if chain.segments else None
        task = None
        if first is not None and first.array is not None and first.task is not None:
            # A first segment sent as an array task is found under the array's name and its index.
            task = (first.array, first.task)
            found_tasks = polled.tasks.get(task, ())
            if found_tasks:
                tagged = {**tagged, first.n: (*tagged.get(first.n, ()), *found_tasks)}
        listed_now = tuple(_job_of(polled, chain, s) for s in chain.live)
        if (
            settled is not None
            and settled.window[0] <= now < settled.window[1]
            and settled.chain is chain
            and _listed(settled.facts, chain) == listed_now
            and settled.facts.tagged == tagged
            and not (sidecar_watched(settled.started, now) and self.progress.present(transport, chain.spec))
        ):
            settled.serial = polled.serial
            return settled.facts  # a chain that just runs sleeps until one of these changes
        found = {}
        # Whether its segments just run or wait, as this tick's listing shows them: then no
        # segment is judged on the checkpoint this tick, and a directory without a sidecar
        # is listed only when due (its listing only feeds what ``status`` shows).
        running = bool(chain.live) and chain.cancel_requested_at is None
        markers_kept = True  # every marker its segments need is read and kept
        started: Optional[float] = -math.inf  # its newest running segment's start (None: unknown)
        for seg in chain.live:
            if seg.phase is Phase.SUBMITTING and seg.n not in tagged:
                start = self.markers.start(transport, chain, seg.n)
                if start is not None and start.job_id:
                    found[seg.n] = start.job_id
            if seg.job_id is None:
                running = False
                continue
            listed = _job_of(polled, chain, seg)
            if listed is not None and listed.phase is Phase.PENDING and not listed.stuck:
                end = None
                if seg.started_at is not None:
                    running = False
                    # Requeued: its markers are of the run before, and it runs again.
                    self.markers.forget(chain.id, seg.n)
                    end = self.markers.end(transport, chain, seg.n, keep=False)
                jobs[seg.job_id] = JobFacts(listed=listed, end=end)
                continue
            start = self.markers.start(transport, chain, seg.n)
            if listed is not None and listed.phase is Phase.RUNNING and not listed.stuck:
                jobs[seg.job_id] = JobFacts(listed=listed, start=start)
                markers_kept = markers_kept and start is not None
                at = start.at if start is not None else None
                started = None if started is None or at is None else max(started, at)
                continue
            running = False  # ended, gone or held: judged now, on the checkpoint as it is now
            end = self.markers.end(transport, chain, seg.n)
            why = polled.cluster.explain(listed.job_id) if listed is not None and listed.stuck else ""
            # A job that failed on its own: its nodes, in case one died under it unnoticed.
            failed = listed is not None and listed.outcome is Outcome.FAILED
            down = polled.cluster.down(listed.nodes) if listed is not None and failed else ()
            jobs[seg.job_id] = JobFacts(listed=listed, end=end, start=start, why_stuck=why, down=down)
        facts = Facts(
            jobs=jobs,
            tagged=tagged,
            found=found,
            carried=_carried(polled, chain),
            progress=self.progress.progress(
                transport,
                chain.spec,
                now,
                running,
                sidecar_watched(started, now),
                listing_every(started, now),
            ),
            arrays=polled.cluster.arrays is not None,
        )
        window = self.progress.standing(transport, chain.spec) if running and markers_kept else None
        if window is not None and _first_claim(polled, chain) is None:
            if settled is not None and settled.chain is chain and settled.facts == facts:
                # The same facts (a listing that found the same checkpoint): the ones kept,
                # which the engine's quiet answer holds too, so that one copy is kept.
                self.settled[chain.id] = replace(
                    settled, window=window, started=started, serial=polled.serial
                )
                return settled.facts
            self.settled[chain.id] = _Settled(chain, facts, window, started, polled.serial, task)
        else:
            self.settled.pop(chain.id, None)
        return facts

    def keep_only(self, chain_ids: Collection[str]) -> None:
        """Forget the settled facts of chains other than these (ended, or removed)."""
        self.settled = {k: v for k, v in self.settled.items() if k in chain_ids}

    def unanswered(self, unpolled: Polled, chain: Chain, now: float) -> Facts:
        """Facts of a chain with several places whose scheduler did not answer this tick
        (``unpolled``: its cluster, with nothing listed), which need not wait for it: of its
        jobs, those whose runner's end marker is there (it ended as the marker says), the
        checkpoint as it is now. Nothing is learned of its other jobs: none is taken for gone.
        A requeued job's end marker is of its run before: not read."""
        transport = unpolled.cluster.transport
        jobs: dict[str, JobFacts] = {}
        for seg in chain.live:
            if seg.job_id is None or (seg.phase is Phase.PENDING and seg.started_at is not None):
                continue
            end = self.markers.end(transport, chain, seg.n)
            if end is not None:
                jobs[seg.job_id] = JobFacts(end=end, start=self.markers.start(transport, chain, seg.n))
        return Facts(jobs=jobs, progress=self.progress.progress(transport, chain.spec, now))

    def away(self, polled: Polled, chain: Chain, lost: str) -> Facts:
        """Facts of a pool chain looked at from another host than its own, which did not
        answer: nothing of its jobs (their ids are that host's); the checkpoint when the
        workdir is shared (else unknown); ``lost``: why its live segments are lost."""
        progress = (
            self.progress.progress(polled.cluster.transport, chain.spec) if placement.shared(chain) else None
        )
        return Facts(progress=progress, host_lost=lost, arrays=polled.cluster.arrays is not None)

    def account(
        self, polled: Polled, chains: list[Chain], gathered: dict[str, Facts], now: float
    ) -> dict[str, Facts]:
        """``gathered`` with what accounting says, asked in one command, of the cluster's jobs
        that are due (``retry.accounting_due``): gone from the listing without a marker,
        or killed by a signal other than the walltime one."""
        unknown, killed = [], []
        for facts in gathered.values():
            for job_id, job in facts.jobs.items():
                if job.listed is None:
                    if job.end is None:
                        unknown.append(job_id)
                    elif job.end.killed:
                        killed.append(job_id)
        before = self.unaccounted.get(polled.key, {})
        waiting = self.unaccounted[polled.key] = {j: before[j] for j in unknown if j in before}
        if not unknown and not killed:
            return gathered
        missing = {s.job_id: s.missing_since for c in chains for s in c.live if s.job_id is not None}
        due = accounting_due(unknown, killed, waiting, missing, now)
        if not due:
            return gathered
        try:
            found = polled.cluster.accounting(due)
        except (TransportError, SchedulerError) as exc:
            log.warning("accounting failed; asking again next tick", error=str(exc))
            return gathered
        if found is None:  # the backend keeps no accounting (the local runner's view keeps ended jobs)
            return gathered
        for job_id in due:
            if job_id not in found and job_id not in killed:
                waiting[job_id] = accounting_again(job_id, waiting, now)
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
