"""``chainrun submit`` (and ``run``'s submit, and the Python API's): job files into chains.

It works on the store directly, so it needs no service running: a submitted chain waits
in the store until a service picks it up. Before a chain exists its checkpoint directory is
held (no other unended chain may write there), its starting point read (a checkpoint
left by an earlier chain, or a fresh start), and its first segment's script built
(``check.preflight``). Notes a user should see (a chain left as it was, a checkpoint
directory moved aside) go to stderr; refusals are raised as ``ChainrunError`` with the one
line the CLI prints.
"""

from __future__ import annotations

import os
import posixpath
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Generic, NamedTuple, Optional, TypeVar

from chainrun import doorbell, jobfile, location, progress, rundir, snapshot, sweep
from chainrun.check import preflight, probe_nodes
from chainrun.decide.carry import applies, carry_line
from chainrun.decide.goal import goal_reached, reached_target
from chainrun.decide.holds import Hold, Holder, ancestors, clashing, hold, inside, same_job, written
from chainrun.errors import ChainrunError, JobFileError, TransportError, UsageError
from chainrun.model import NO_PROGRESS, ChainState, JobSpec, Progress, SchedulerSpec, chain_seed
from chainrun.store import Store
from chainrun.transport import Transport, transport_for


def _note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Submitted(NamedTuple):
    """A chain a job file names: stored now ("submitted"), already active and left as it is
    ("running"), or the chain that already completed its checkpoint ("completed")."""

    chain_id: str
    spec: JobSpec
    how: str

    @property
    def new(self) -> bool:
        return self.how == "submitted"


class _Left(NamedTuple):
    """An ended chain that trained into a checkpoint directory."""

    chain_id: str
    name: str
    state: ChainState
    spec: JobSpec


def submit_all(store: Store, specs: Sequence[JobSpec], fresh: bool = False) -> list[Submitted]:
    """Store a chain for each spec, and for each chain of a sweep, all in one transaction:
    none is stored when one cannot be. What checkpoint_dir holds is each one's starting point.

    One chain per checkpoint directory (``decide.holds``): a chain whose job file was
    submitted before and is still active is left as it is, said so, and returned again, so
    that submitting twice never runs twice; any other active chain training into the same
    directory (at any of its places, at any of the new chain's) is refused, naming it. The
    check is made again inside the transaction that stores, so two commands submitting at
    once cannot both pass it.

    A checkpoint that already says the run is complete is not run again: the chain that
    completed it is returned as it is, said so; where no chain here completed it, it is
    refused (exit 1, nothing stored). A chain that resumes a checkpoint says from where, and
    which chain left it, and keeps that chain's seed (a sweep's chain keeps its configuration's).
    With ``fresh`` each checkpoint
    directory is first moved aside (never deleted), so the chain starts from nothing; a
    directory an active chain trains into is never moved. A service running for the store's
    home is asked to tick now (``doorbell``). Returns every chain the job files name, in order.
    """
    holds = _Holds(store.unended())
    left: _Near[_Left] = _Near()
    if not fresh:  # --fresh moves every checkpoint aside: no chain's is resumed
        for ended in store.ended():
            left.add(_hold(ended[3]).path, _Left(*ended))
    out: list[Optional[Submitted]] = []  # None: stored below
    new: list[tuple[JobSpec, Progress]] = []
    mines: list[_Mine] = []  # the holds of each in ``new``
    pins: list[Optional[snapshot.Snapshot]] = []
    chains: list[tuple[JobSpec, int, Optional[snapshot.Snapshot]]] = []  # with its job file's index
    files: list[tuple[JobSpec, Transport]] = []
    origin: list[int] = []  # the job file of each in ``new``
    for spec in specs:
        preflight(spec)
        for view in [spec, *(spec.at(p.name) for p in spec.places[1:])]:  # each pool, at any place
            if view.scheduler.hosts:
                shared, words = probe_shared(view, create=True)
                at = f" at {view.place_name}" if spec.places else ""
                _note(f"{spec.name}: workdir {view.workdir}{at} {words}")
                spec = _with_scheduler(spec, view.place_name, replace(view.scheduler, workdir_shared=shared))
        transport = transport_for(spec.scheduler.first_host)
        with _reaching(spec):
            jobfile.where_it_runs(spec)
        for place in spec.places[1:]:  # what a segment needs is there at every place that answers
            try:
                jobfile.where_it_runs(spec.at(place.name))
            except TransportError as exc:
                _note(f"{spec.name}: place {place.name} not reached now ({exc}); its segments go elsewhere")
        with _reaching(spec):
            # The code is captured once per job file: a sweep's chains all run the same commit.
            spec, snap = snapshot.prepare(transport, spec)
        chains.extend((one, len(files), snap) for one in sweep.expand(spec))
        files.append((spec, transport))
    # Each host is asked once, for all the checkpoint directories on it.
    located = location.locate([one for one, _, _ in chains])
    for one, (_, i, snap) in zip(located, chains):
        transport = files[i][1]
        mine = _holds_of(one)
        holds.take(mine)
        met = holds.holder(one, mine)
        if met is not None:
            view, held = met
            if not same_job(one.name, _hold(view), held) or fresh:
                raise ChainrunError(_refusal(view, _hold(view), held, fresh))
            _note(f"{one.name}: still running as chain {held.chain_id}; left as it is")
            out.append(Submitted(held.chain_id, one, "running"))
            continue
        with _reaching(one):
            one, baseline = _starting_point(one, transport, fresh)
        first = mine[0][1]  # where it starts: an ended chain's checkpoint there is resumed
        last = next((c for c in left.near(first.path) if _hold(c.spec).path == first.path), None)
        why = _complete(one, baseline)
        again = "; to start over, add --fresh (it moves the directory aside, deleting nothing)"
        if why and last is not None and last.state is ChainState.COMPLETED:
            _note(f"{one.name}: already completed as chain {last.chain_id} ({why}){again}")
            out.append(Submitted(last.chain_id, one, "completed"))
            continue
        if why:
            where = f"the checkpoint in {one.checkpoint_dir}"
            raise ChainrunError(f"{where} is already complete ({why}){'' if fresh else again}")
        if baseline != NO_PROGRESS:
            one = _resuming(one, baseline, last)
        new.append((one, baseline))
        mines.append(mine)
        pins.append(snap)
        origin.append(i)
        out.append(None)
    for i, (spec, transport) in enumerate(files):  # asked once per job file, once nothing refuses it
        of_file = [k for k, o in enumerate(origin) if o == i]
        if of_file:
            with _reaching(spec):
                probed = _probed(spec, transport, [new[k] for k in of_file])
            for k, chain in zip(of_file, probed):
                new[k] = chain

    def vet(unended: list[tuple[str, str, JobSpec]]) -> None:
        now = _Holds(unended)
        for (one, _), mine in zip(new, mines):
            met = now.holder(one, mine)
            if met is not None:
                view, held = met
                meanwhile = " (it was submitted meanwhile; nothing stored)"
                raise ChainrunError(_refusal(view, _hold(view), held, fresh) + meanwhile)

    ids = store.add_chains(new, time.time(), vet)
    for chain_id, snap in zip(ids, pins):
        if snap is not None:
            snapshot.pin(snap, chain_id)
    if ids:
        doorbell.ring(store.home)  # a running service queues their first segments now
    stored = iter(Submitted(chain_id, one, "submitted") for chain_id, (one, _) in zip(ids, new))
    return [item or next(stored) for item in out]


@contextmanager
def _reaching(spec: JobSpec) -> Iterator[None]:
    """A transport error while ``spec``'s host is reached, said as that host not reached."""
    try:
        yield
    except TransportError as exc:
        if spec.scheduler.first_host is None:
            raise
        raise TransportError(f"cannot reach {spec.scheduler.first_host}: {exc}") from None


def _probed(
    spec: JobSpec, transport: Transport, chains: list[tuple[JobSpec, Progress]]
) -> list[tuple[JobSpec, Progress]]:
    """The new ``chains`` of one job file (each with its starting point) as the probes
    from where they run find them (``plan.probe_nodes``); said when they may not carry
    themselves."""
    try:
        found, unasked = probe_nodes(spec, transport)
    except JobFileError as exc:
        if not spec.places:
            raise
        # One of several places refusing is skipped while it does (``decide.places``).
        _note(f"{spec.name}: its first place, {spec.place_name}, refuses it now ({exc}); it runs elsewhere")
        found, unasked = spec, ""
    if unasked:
        _note(unasked)
    if found.self_queue and not applies(found):
        _note(f"{spec.name}: {carry_line(found)}")
    return [
        (
            replace(
                one,
                nodes_cannot_submit=found.nodes_cannot_submit,
                carrier_cannot_run=found.carrier_cannot_run,
            ),
            b,
        )
        for one, b in chains
    ]


def probe_shared(spec: JobSpec, create: bool = False) -> tuple[Optional[bool], str]:
    """Whether a pool's workdir is one directory on all its hosts, found out through them
    (``create``: the workdir made first where it is missing, as for a submission)."""
    return rundir.probe_shared(spec, transport_for, create)


def meet_holds(store: Store, chains: Sequence[JobSpec]) -> list[str]:
    """``check``'s look at what ``submit`` would meet: refused (raised) when another active
    chain trains into one of these checkpoint directories; a note for each chain that is
    still active from an earlier submission, and would be returned as it is."""
    holds = _Holds(store.unended())
    notes: list[str] = []
    for one in location.locate(chains):
        mine = _holds_of(one)
        holds.take(mine)
        met = holds.holder(one, mine)
        if met is not None and not same_job(one.name, _hold(met[0]), met[1]):
            raise ChainrunError(_refusal(met[0], _hold(met[0]), met[1], False))
        if met is not None:
            held = met[1]
            running = f"{one.name} is still running as chain {held.chain_id}"
            notes.append(f"note: {running}; submit returns it as it is")
    return notes


def _hold(spec: JobSpec) -> Hold:
    """``spec``'s hold on its checkpoint directory, as settled at its submit
    (``location.locate``). A chain stored before holds were settled there is compared as it
    was then: on this machine the path resolved now, elsewhere as written."""
    settled = hold(spec)
    if settled is not None:
        return settled
    path = spec.checkpoint_dir if spec.scheduler.remote else os.path.realpath(spec.checkpoint_dir)
    return written(spec, posixpath.normpath(path))


_Mine = list[tuple[JobSpec, Hold]]  # a chain's holds: at each place, its spec seen there and its hold


def _holds_of(spec: JobSpec) -> _Mine:
    """``spec``'s hold at each of its places (its first place's first): a chain with several
    holds the checkpoint directory of each, which its checkpoint moves between."""
    views = [spec, *(spec.at(p.name) for p in spec.places[1:])]
    return [(view, _hold(view)) for view in views]


_T = TypeVar("_T")


class _Near(Generic[_T]):
    """Holds by directory, found by a directory, those within it and those it is within
    (a sweep of thousands of chains compares each path with the few near it)."""

    def __init__(self) -> None:
        self._at: dict[str, list[_T]] = {}
        self._under: dict[str, list[_T]] = {}  # by each directory a hold is within

    def add(self, path: str, item: _T) -> None:
        self._at.setdefault(path, []).append(item)
        for directory in ancestors(path):
            self._under.setdefault(directory, []).append(item)

    def near(self, path: str) -> list[_T]:
        return [
            *self._at.get(path, ()),
            *self._under.get(path, ()),
            *(item for directory in ancestors(path) for item in self._at.get(directory, ())),
        ]


class _Holds:
    """The holds a submission meets: the active chains', and those of the submission's own
    chains so far."""

    def __init__(self, unended: Sequence[tuple[str, str, JobSpec]]) -> None:
        self._active: _Near[Holder] = _Near()
        for chain_id, name, spec in unended:
            for view, theirs in _holds_of(spec):
                place = view.place_name if spec.places else ""
                self._active.add(theirs.path, Holder(chain_id, name, theirs, place))
        self._own: _Near[tuple[JobSpec, Hold]] = _Near()

    def holder(self, spec: JobSpec, mine: _Mine) -> Optional[tuple[JobSpec, Holder]]:
        """The active chain that holds a directory of ``spec``'s, and ``spec`` at the place it
        does (see ``decide.holds.clashing``)."""
        near = {id(h): h for _, one in mine for h in self._active.near(one.path)}
        met = clashing(spec.name, [one for _, one in mine], near.values())
        return None if met is None else (mine[met[0]][0], met[1])

    def take(self, mine: _Mine) -> None:
        """Add a chain's holds to the submission's; refused when another of its chains has one."""
        for spec, hold_ in mine:
            for other, theirs in self._own.near(hold_.path):
                if theirs.clashes(hold_):
                    how = "is also" if theirs.path == hold_.path else f"{_relation(hold_, theirs)}, which is"
                    raise ChainrunError(
                        f"{spec.source}: checkpoint_dir {_written(spec, hold_)} {how} {other.name}'s, "
                        "submitted with it; give each job a checkpoint_dir of its own"
                    )
        for spec, hold_ in mine:
            self._own.add(hold_.path, (spec, hold_))


def _written(spec: JobSpec, mine: Hold) -> str:
    """``spec``'s checkpoint_dir as the job file gives it and, where that differs, what it
    resolved to, and where; and at which place, for a chain with several."""
    at = f" (at place {spec.place_name})" if spec.places else ""
    if mine.path == spec.checkpoint_dir:
        return spec.checkpoint_dir + at
    return f"{spec.checkpoint_dir} ({mine.path} on {spec.scheduler.first_host or 'this machine'}){at}"


def _trains(held: Holder) -> str:
    """Where ``held`` trains: at which of its places, for a chain with several."""
    return "still trains" + (f" (at place {held.place})" if held.place else "")


def _relation(mine: Hold, theirs: Hold) -> str:
    """How ``mine``'s directory stands to ``theirs``, one within the other."""
    return f"{'is inside' if inside(mine.path, theirs.path) else 'holds'} {theirs.path}"


def _refusal(spec: JobSpec, mine: Hold, held: Holder, fresh: bool) -> str:
    """Why ``spec`` cannot be stored while ``held`` trains into its checkpoint directory, or
    into one within it or around it."""
    cancel = f"`chainrun cancel {held.chain_id}`"
    if held.hold.path != mine.path:
        return (
            f"{spec.source}: checkpoint_dir {_written(spec, mine)} {_relation(mine, held.hold)}, where "
            f"chain {held.chain_id} ({held.name}) {_trains(held)}: their checkpoints would mix, and --fresh "
            f"on the outer one would move the inner one's aside; give this job a checkpoint_dir of its "
            f"own, or cancel that chain first ({cancel})"
        )
    if held.name == spec.name and fresh:
        return (
            f"chain {held.chain_id} of {spec.name} still trains in {_written(spec, mine)}, so --fresh "
            f"would move its checkpoints from under it; cancel it first ({cancel}), then add --fresh"
        )
    return (
        f"{spec.source}: checkpoint_dir {_written(spec, mine)} is where chain {held.chain_id} "
        f"({held.name}) {_trains(held)}, and two chains there would resume from each other's "
        f"checkpoints; give this job a checkpoint_dir of its own, or cancel that chain first ({cancel})"
    )


def _resuming(spec: JobSpec, baseline: Progress, last: Optional[_Left]) -> JobSpec:
    """Say where a new chain resumes, and from whose checkpoint; it keeps the seed of the
    chain that left it (the checkpoint's random states were drawn from it), where its own
    is not set already (a sweep's chain has its configuration's)."""
    host = spec.scheduler.first_host
    where = f"{spec.checkpoint_dir} on {host}" if host else spec.checkpoint_dir
    if last is None:
        _note(f"{spec.name}: resuming {baseline.describe()} from {where}, left by no chain chainrun knows of")
        return spec
    kept = ""
    if spec.seed is None:
        spec = replace(spec, seed=chain_seed(last.spec, last.chain_id))
        kept = f"; keeping its seed {spec.seed}"
    _note(
        f"{spec.name}: resuming {baseline.describe()} from {where}, left by chain {last.chain_id} "
        f"({last.state.value}){kept}"
    )
    return spec


def _complete(spec: JobSpec, baseline: Progress) -> str:
    """Why the checkpoint already says the run is complete; "" when it does not."""
    if not goal_reached(baseline, spec.target_epoch):
        return ""
    if reached_target(baseline, spec.target_epoch):
        return f"epoch {baseline.epoch}, target_epoch {spec.target_epoch}"
    return "the training script marked it done"


def _starting_point(spec: JobSpec, transport: Transport, fresh: bool) -> tuple[JobSpec, Progress]:
    """What a new chain starts from: its checkpoint, read (with ``fresh``, first moved aside)
    where it is (``transport``: the chain's host). A pool whose workdir is not known to be
    shared may hold it on any host's own disk: each host is looked at, and the chain is to
    start on the one with the furthest checkpoint (``checkpoint_host``)."""
    sched = spec.scheduler
    if not sched.hosts or sched.workdir_shared:
        if fresh:
            _move_aside(transport, spec)
        return spec, progress.read(transport, spec) or NO_PROGRESS
    found: list[tuple[str, Progress]] = []
    for host in sched.hosts:
        try:
            there = transport_for(host)
            if fresh:
                _move_aside(there, spec)
            found.append((host, progress.read(there, spec) or NO_PROGRESS))
        except TransportError as exc:
            raise TransportError(
                f"cannot reach {host} ({exc}), whose own disk may hold {spec.name}'s checkpoint"
            ) from None
    host, baseline = max(found, key=lambda f: f[1].key)  # the first listed, on a tie
    if baseline == NO_PROGRESS:
        return spec, baseline  # no checkpoint anywhere: it may start on any host
    others = [h for h, p in found if p != NO_PROGRESS and h != host]
    if others:
        _note(
            f"{spec.name}: checkpoints in {spec.checkpoint_dir} on {host} and {', '.join(others)}; "
            f"starting from {host}'s, the furthest"
        )
    return _with_scheduler(spec, spec.place_name, replace(sched, checkpoint_host=host)), baseline


def _with_scheduler(spec: JobSpec, place: str, sched: SchedulerSpec) -> JobSpec:
    """``spec`` (at its first place) with the scheduler of its place ``place`` ("": its only
    one) found out at submit: ``sched``."""
    places = tuple(replace(p, scheduler=sched) if p.name == place else p for p in spec.places)
    first = not spec.places or place == spec.places[0].name
    return replace(spec, places=places, scheduler=sched if first else spec.scheduler)


def _move_aside(transport: Transport, spec: JobSpec) -> None:
    """``--fresh``: rename checkpoint_dir to ``<dir>.old-<UTC time>`` (``-2``, ``-3``, ... on a
    clash), saying so on stderr; nothing to do when it does not exist. Refused, with nothing
    moved, when that would move the workdir or would not start over (the progress file
    lies outside checkpoint_dir)."""
    ckpt = spec.checkpoint_dir
    if posixpath.commonpath([ckpt, spec.workdir]) == ckpt:
        raise UsageError(
            f"--fresh: checkpoint_dir {ckpt} holds the workdir {spec.workdir}, so moving it aside "
            "would move the job's own files; move the old checkpoints yourself, or give the job "
            "a checkpoint_dir of its own"
        )
    if spec.progress_file and posixpath.commonpath([ckpt, spec.progress_file]) != ckpt:
        raise UsageError(
            f"--fresh: the progress file {spec.progress_file} is outside checkpoint_dir {ckpt}, so "
            "moving that aside would not start over; set checkpoint_dir to the directory the "
            "script saves in"
        )
    if transport.stat(ckpt) is None:
        return
    stem = f"{ckpt}.old-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    target, n = stem, 1
    while transport.stat(target) is not None:
        n += 1
        target = f"{stem}-{n}"
    transport.rename(ckpt, target)
    _note(f"moved the old checkpoint directory aside: {ckpt} -> {target}")
