"""Act: carry out what ``decide`` answered, through the cluster, and say what was done.

A ``Finish`` first writes the final marker (a successor that starts anyway exits at
once); cancels go out in one command (one that fails is owed, and sent once the scheduler
answers: ``cancel_owed``); a submission is journaled (the one write before the
tick's record), then made, with what its segment needs to carry the chain while the
service is away (``carry.leave_record``), on the pool host ``decide`` chose for it, if any;
at a place the chain moved to, once the checkpoint is copied there, the checkpoint
directory left fenced for it (a job of the chain still queued there trains nothing). A
move to a pool goes to the host ``decide`` placed it on; a copy from a pool is read on the
host the chain ran on there. A sweep's first segments that ``decide`` marked as array tasks
go out together after the cluster's chains have acted (``submit_arrays``): one array job per
set of chains whose directives and workdir are the same. What was done is kept in each
chain's ``ChainTick``, which the engine records in one transaction.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from chainrun import carry, rundir, snapshot
from chainrun.cluster import Cluster
from chainrun.decide import placement, places
from chainrun.decide.retry import after_submit, array_refused, owed_given_up, owed_to_send
from chainrun.engine.observe import ClusterKey, Polled
from chainrun.errors import ClaimedError, SchedulerError, StoreUnavailable, TransportError, UnsafePathError
from chainrun.logsetup import get_logger
from chainrun.model import (
    Action,
    Adopt,
    Cancel,
    Chain,
    Finish,
    ListedJob,
    Move,
    Phase,
    Progress,
    Remove,
    Segment,
    SetGrace,
    Submit,
)
from chainrun.schedulers.base import ArrayScheduler
from chainrun.schedulers.script import render_array_script
from chainrun.schedulers.segment import SegmentJob, array_stem, array_tag, tag_for
from chainrun.store import OwedCancel, Store
from chainrun.transfer import TransferError, fence_left, move_checkpoint

log = get_logger(__name__)


@dataclass
class ChainTick:
    """One chain's tick: what was carried out (each action with its reason), the newest
    progress seen and what went wrong on the way, to be recorded at once, at ``now``."""

    chain: Chain
    now: float
    done: list[Action] = field(default_factory=list)
    latest: Optional[Progress] = None
    warnings: list[str] = field(default_factory=list)


@dataclass
class TickClusters:
    """The clusters one tick polled, and the slots its placements have taken on each."""

    polled: dict[ClusterKey, Polled]
    placed: dict[ClusterKey, int] = field(default_factory=lambda: defaultdict(int))
    unreachable: dict[ClusterKey, Exception] = field(default_factory=dict)  # whose poll failed: why

    def free(self, key: ClusterKey, slots: int) -> int:
        """A pool host's slots not in use by its jobs (running or ready) nor taken this tick."""
        return placement.free_slots(slots, self.polled[key].jobs.values(), self.placed[key])

    def reached(self, kind: str) -> set[str]:
        """The hosts of scheduler ``kind`` whose poll answered this tick."""
        return {host for k, host in self.polled if k == kind}

    def pool(self, chain: Chain) -> tuple[dict[str, int], dict[str, dict[int, tuple[ListedJob, ...]]]]:
        """For a chain with a pool (at its place, or at another of its places), each of the
        pools' hosts that answered: the slots free there now, and the jobs listed there of
        this chain, by N (the facts ``decide`` places and fences by)."""
        slots = {(p.kind, h): p.slots or 1 for p in placement.pools(chain.spec) for h in p.hosts}
        keys = [key for key in slots if key in self.polled]
        free = {key[1]: self.free(key, slots[key]) for key in keys}
        jobs = {
            key[1]: self.polled[key].tagged[chain.id] for key in keys if chain.id in self.polled[key].tagged
        }
        return free, jobs


class Executor:
    """Carries actions out through the clusters; journals submissions in the store."""

    def __init__(
        self, store: Store, clock: Callable[[], float], clusters: Callable[[ClusterKey], Cluster]
    ) -> None:
        self.store = store
        self.clock = clock
        self.clusters = clusters  # a cluster this tick did not poll: another place of a chain
        # By chain, a grace decided on that could not be written yet: written again each tick.
        self.owed_grace: dict[str, int] = {}
        # By cluster, the jobs whose cancel did not reach the scheduler (its controller or host
        # did not answer), each with its chain and segment: the engine polls that cluster each
        # tick, and once it answers, those it still lists are cancelled (``cancel_owed``). Kept
        # in the store too, so that a service restarted meanwhile owes them as well.
        # A cancel owed for longer than ``retry.CANCEL_OWED_FOR`` is given up (``give_up_owed``).
        self.owed_cancels: dict[ClusterKey, dict[str, OwedCancel]] = store.owed_cancels()

    def write_grace(self, polled: Polled, chain: Chain, seconds: int, warnings: list[str]) -> None:
        """Write the grace later segments get where their runner reads it; one that cannot be
        written is owed, and tried again at the chain's next tick (said once)."""
        try:
            rundir.write_grace(polled.cluster.transport, chain.spec, chain.id, seconds)
        except TransportError as exc:
            if chain.id not in self.owed_grace:
                warnings.append(
                    f"could not write the grace for later segments ({exc}); trying again each tick, "
                    "while they keep the one before"
                )
            self.owed_grace[chain.id] = seconds
            return
        self.owed_grace.pop(chain.id, None)

    def execute(
        self,
        polled: Polled,
        chain: Chain,
        actions: list[Action],
        step: ChainTick,
        tick: TickClusters,
        arrays: list[tuple[ChainTick, Submit]],
    ) -> None:
        """Carry ``actions`` out for ``chain`` into ``step``. A sweep's first segment that can
        go out as an array task is left in ``arrays``."""
        if chain.cancel_requested or any(isinstance(a, Finish) for a in actions):
            # Written first: a successor that starts anyway exits at once, and a running
            # segment of a cancelled chain stops (its runner watches for it), saving first.
            try:
                rundir.write_final(polled.cluster.transport, chain.spec, chain.id)
            except TransportError as exc:
                step.warnings.append(f"could not write the final marker ({exc}); a late successor may start")
        for grace in (a for a in actions if isinstance(a, SetGrace)):
            self.write_grace(polled, chain, grace.seconds, step.warnings)
        self._cancel(
            tick, polled, chain, [a for a in actions if isinstance(a, (Cancel, Remove))], step.warnings
        )
        for action in actions:
            if isinstance(action, Submit) and action.task:
                arrays.append((step, action))
            elif isinstance(action, Move):
                there = chain.spec.at(action.place)
                moved = replace(chain, spec=there)
                key = (
                    there.scheduler.cluster_key
                    if action.host is None
                    else (there.scheduler.kind, action.host)
                )
                if action.host is not None:
                    tick.placed[key] += 1  # the pool host's slot it takes
                target = self._polled(tick, key)
                step.done.append(action)
                step.done.append(self.submit(target, moved, Submit(action.n, action.walltime), tick))
            elif isinstance(action, Submit):
                target = polled
                if action.host is not None:
                    key = (chain.spec.scheduler.kind, action.host)
                    tick.placed[key] += 1
                    target = tick.polled[key]
                step.done.append(self.submit(target, chain, action, tick))
            else:
                step.done.append(action)

    def _cancel(
        self,
        tick: TickClusters,
        polled: Polled,
        chain: Chain,
        actions: Iterable[Cancel | Remove],
        warnings: list[str],
    ) -> None:
        """Cancel the actions' jobs: one command per cluster (a ``Remove`` with a host: that
        pool host's). A cancel that fails is owed: sent again once the cluster answers."""
        by_cluster: dict[ClusterKey, dict[str, int]] = defaultdict(dict)
        for action in actions:
            host = action.host if isinstance(action, Remove) else None
            key = polled.key if host is None else (chain.spec.scheduler.kind, host)
            if action.job_id:
                by_cluster[key][action.job_id] = action.n
        for key, jobs in by_cluster.items():
            there = polled if key == polled.key else tick.polled[key]
            try:
                there.cluster.cancel(list(jobs))
            except (SchedulerError, TransportError) as exc:
                warnings.append(
                    f"could not cancel jobs {', '.join(jobs)} ({exc}); cancelled once the scheduler answers"
                )
                now = self.clock()
                # Each with the name it is listed with (not listed: its segment's tag), so
                # that the cancel never reaches another job that took its id.
                listed = there.jobs
                owed = {
                    job_id: OwedCancel(
                        chain.id, n, now, listed[job_id].name if job_id in listed else tag_for(chain.id, n)
                    )
                    for job_id, n in jobs.items()
                }
                self.store.owe_cancels(key, owed)
                for job_id, cancel in owed.items():
                    self.owed_cancels.setdefault(key, {}).setdefault(job_id, cancel)

    def cancel_owed(self, polled: Polled) -> dict[str, list[Action]]:
        """Send the cancels owed on ``polled``'s cluster, which answered, as
        ``retry.owed_to_send`` says; by chain, what was sent, for its history. The others
        are owed nothing more; a cancel that fails again is still owed."""
        owed = self.owed_cancels.pop(polled.key, {})
        sent = owed_to_send({job_id: (cancel.n, cancel.name) for job_id, cancel in owed.items()}, polled.jobs)
        try:
            if sent:
                polled.cluster.cancel([action.job_id for action in sent])
        except (SchedulerError, TransportError) as exc:
            live = {action.job_id: owed[action.job_id] for action in sent}
            log.warning("cancel failed again; retrying next tick", jobs=list(live), error=str(exc))
            self.owed_cancels[polled.key] = live
            self.store.settle_cancels(polled.key, [j for j in owed if j not in live])
            return {}
        self.store.settle_cancels(polled.key, owed)
        done: dict[str, list[Action]] = defaultdict(list)
        for action in sent:
            done[owed[action.job_id].chain_id].append(action)
        return done

    def give_up_owed(self, now: float) -> dict[str, list[str]]:
        """Forget the cancels ``retry.owed_given_up`` gives up: their cluster is no longer
        polled for them. By chain, what is said of each in its history."""
        said: dict[str, list[str]] = defaultdict(list)
        for key, owed in list(self.owed_cancels.items()):
            where = f"{key[0]} on {key[1]}" if key[1] else key[0]
            given_up = owed_given_up({job_id: cancel.since for job_id, cancel in owed.items()}, where, now)
            if not given_up:
                continue
            self.store.settle_cancels(key, list(given_up))
            for job_id, why in given_up.items():
                said[owed.pop(job_id).chain_id].append(why)
            if not owed:
                del self.owed_cancels[key]
        return said

    def _polled(self, tick: Optional[TickClusters], key: ClusterKey) -> Polled:
        """Cluster ``key`` as this tick polled it, or, not polled, reached now (unpolled)."""
        if tick is not None and key in tick.polled:
            return tick.polled[key]
        return Polled(key, self.clusters(key), {}, {}, {})

    def submit(
        self, polled: Polled, chain: Chain, sub: Submit, tick: Optional[TickClusters] = None
    ) -> Action:
        """Journal, then submit: the job's id, or what its failure means. A segment of a chain
        with several places is journaled at the place ``chain.spec`` is at, and the checkpoint
        is copied there first when the chain ran elsewhere last (``places.copy_from``)."""
        now = self.clock()
        host = polled.key[1] if chain.spec.scheduler.hosts else None
        place = chain.spec.place_name or None
        attempts = self.store.journal_submit(chain.id, sub, now, host, place=place)
        job = SegmentJob(chain.id, sub.n, chain.spec, sub.walltime, sub.after)
        try:
            new_place = place is not None and not any(
                s.job_id is not None and (s.place or chain.spec.places[0].name) == place
                for s in chain.segments
            )
            if (host is not None and not chain.ran_on(host)) or new_place:  # a host or place new to the chain
                snapshot.deliver_to(polled.cluster.transport, chain.spec)
            self._copy(tick, polled, chain, sub)
            ran_there = chain.ran_on(host) and not new_place
            rundir.trust_run_dir(polled.cluster.transport, chain.spec, chain.id, ran_there=ran_there)
            carry.leave_record(polled.cluster, chain, self.store.home)
            job_id = polled.cluster.submit(job, by="service")
        except (
            snapshot.SnapshotError,
            TransferError,
        ) as exc:  # tried again later, as a host that did not answer
            return after_submit(sub.n, attempts, TransportError(str(exc)), now)
        except (TransportError, SchedulerError, UnsafePathError, ClaimedError) as exc:
            return after_submit(sub.n, attempts, exc, now)  # claimed: the segment before it queues it
        return Adopt(
            n=sub.n, job_id=job_id, how="submitted" + (f" after job {sub.after}" if sub.after else "")
        )

    def _copy(self, tick: Optional[TickClusters], polled: Polled, chain: Chain, sub: Submit) -> None:
        """Copy the chain's checkpoint to the place segment ``sub.n`` is submitted at, from the
        place it ran at last, when those differ and no copy was recorded (``places.copy_from``);
        the copy is recorded before the submission. Raises TransferError."""
        seg = next((s for s in chain.segments if s.n == sub.n), None)
        seg = seg or Segment(chain.id, sub.n, sub.walltime, Phase.SUBMITTING, place=chain.spec.place_name)
        source = places.copy_from(chain, seg)
        if source is None:
            return
        there = chain.spec.at(source)
        src = self._polled(
            tick, (there.scheduler.kind, places.copy_host(chain, source) or "")
        ).cluster.transport
        if src.stat(there.checkpoint_dir) is None:
            saved = places.saved(chain)
            if saved is None:
                return  # no checkpoint yet: the segment starts from nothing there too
            raise TransferError(
                f"checkpoint not copied from {source}: {there.checkpoint_dir} is not there, though the "
                f"chain saved {saved.describe()} in it; the copy is tried again once it is back"
            )
        try:
            moved = move_checkpoint(
                src, there.checkpoint_dir, polled.cluster.transport, chain.spec.checkpoint_dir
            )
            fence_left(src, there.checkpoint_dir, chain.id, sub.n)
        except TransportError as exc:
            raise TransferError(f"checkpoint not copied from {source}: {exc}") from None
        what = f"{len(moved.files)} files, {moved.bytes} bytes" + (
            f", sha256 {moved.digest}" if moved.digest else ""
        )
        message = (
            f"checkpoint copied from {source} ({there.checkpoint_dir}) to {chain.spec.place_name} "
            f"({chain.spec.checkpoint_dir}) in {moved.seconds:.1f}s: {what}, verified"
        )
        self.store.record_copy(
            chain.id, sub.n, moved.seconds, moved.bytes, moved.digest, message, self.clock()
        )

    def submit_arrays(
        self, polled: Polled, arrays: list[tuple[ChainTick, Submit]], errors: list[str]
    ) -> None:
        """Submit first segments of sweeps as array tasks: one array job per set of chains whose
        directives and workdir are the same, each chain journaled as its task first; what
        came of each goes into its step.

        A chain keeps the array name and task index it was first journaled with: when that
        submission may have failed (or the service died around it), the same task is sent
        again under the same name, so a job that landed anyway is one of two tasks of one
        segment (decide removes the second), never a stranger."""
        scheduler = polled.cluster.arrays
        if not arrays or scheduler is None:
            return
        groups: dict[str, list[tuple[ChainTick, Submit, int]]] = defaultdict(list)
        fresh: dict[object, list[tuple[ChainTick, Submit]]] = defaultdict(list)
        for step, sub in sorted(arrays, key=lambda a: a[0].chain.id):
            chain = step.chain
            first = chain.segments[0] if chain.segments else None
            if first is not None and first.array is not None and first.task is not None:
                groups[first.array].append((step, sub, first.task))
            else:
                job = SegmentJob(chain.id, sub.n, chain.spec, sub.walltime)
                fresh[(tuple(scheduler.array_directives(job, "")), chain.spec.workdir)].append((step, sub))
        for members in fresh.values():
            for start in range(0, len(members), scheduler.max_tasks):
                chunk = members[start : start + scheduler.max_tasks]
                groups[array_tag(chunk[0][0].chain.id)] = [(s, sub, i) for i, (s, sub) in enumerate(chunk)]
        for name, group in groups.items():
            try:
                submitted = self._submit_array(polled, scheduler, name, group)
            except StoreUnavailable:
                raise
            except Exception as exc:  # a bug: journaled, its chains are adopted or sent again next tick
                log.warning(
                    "array submission failed; retrying next tick", array=name, error=str(exc), exc_info=True
                )
                errors.append(f"array {name}: {type(exc).__name__}: {exc}")
                continue
            for step, action in submitted:
                step.done.append(action)

    def _submit_array(
        self,
        polled: Polled,
        scheduler: ArrayScheduler,
        name: str,
        group: list[tuple[ChainTick, Submit, int]],
    ) -> list[tuple[ChainTick, Action]]:
        """Journal each chain as its task, write each chain's own segment script and the
        array's script, submit the array once: each chain's Adopt, or what its failure means.
        An array the scheduler refuses for good is sent again as single jobs
        (``retry.array_refused``)."""
        now = self.clock()
        cluster = polled.cluster
        outcome: list[tuple[ChainTick, Action]] = []
        tasks: list[tuple[int, SegmentJob, ChainTick, Submit, int]] = []
        for step, sub, index in group:
            chain = step.chain
            attempts = self.store.journal_submit(chain.id, sub, now, task=(name, index))
            job = SegmentJob(chain.id, sub.n, chain.spec, sub.walltime)
            try:
                rundir.trust_run_dir(cluster.transport, chain.spec, chain.id)
                carry.leave_record(cluster, chain, self.store.home)
                cluster.write_script(job)
            except (TransportError, SchedulerError, UnsafePathError) as exc:
                outcome.append((step, after_submit(sub.n, attempts, exc, now)))  # that chain's alone
                continue
            tasks.append((index, job, step, sub, attempts))
        if not tasks:
            return outcome
        spec = tasks[0][1].spec
        stem = array_stem(spec, name)
        try:
            rundir.trust_run_dir(cluster.transport, spec, None)
            script = render_array_script(scheduler, name, [(t[0], t[1]) for t in tasks])
            rundir.write_script(cluster.transport, stem + ".sh", script)
            base = cluster.submit_array(stem, spec, [t[0] for t in tasks])
        except SchedulerError as exc:
            if not array_refused(exc):
                return outcome + [(step, after_submit(1, tries, exc, now)) for _, _, step, _, tries in tasks]
            log.warning("array refused; submitting its chains one by one", array=name, error=str(exc))
            return outcome + [(step, self.submit(polled, step.chain, sub)) for _, _, step, sub, _ in tasks]
        except (TransportError, UnsafePathError) as exc:
            return outcome + [(step, after_submit(1, tries, exc, now)) for _, _, step, _, tries in tasks]
        return outcome + [
            (
                step,
                Adopt(
                    n=job.n, job_id=scheduler.task_id(base, i), how=f"submitted as task {i} of array {base}"
                ),
            )
            for i, job, step, _, _ in tasks
        ]
