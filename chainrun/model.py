"""The words of chainrun as data: job spec, chain, segment, progress, the wrapper's markers,
actions (a command's result: ``chainrun.result``; where a chain runs: ``chainrun.places``;
when a place would start a segment: ``chainrun.starts``).

Everything here is a plain value: frozen dataclasses and Enums with no I/O,
so the decision logic can be tested exhaustively and the store can round-trip
them through JSON.
"""

from __future__ import annotations

import enum
import hashlib
import signal as signals
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional, Union

from chainrun.places import HOST_TIMEOUT as HOST_TIMEOUT
from chainrun.places import PlaceSpec as PlaceSpec
from chainrun.places import SchedulerSpec as SchedulerSpec
from chainrun.result import CommandResult as CommandResult
from chainrun.starts import Start as Start
from chainrun.values import SLOTS


class Outcome(enum.Enum):
    """How a segment ended, in the scheduler-neutral words of DESIGN.md."""

    COMPLETED = "completed"
    TIMEOUT = "timeout"
    PREEMPTED = "preempted"
    FAILED = "failed"
    OOM = "oom"
    NODE_FAIL = "node_fail"
    CANCELLED = "cancelled"
    LOST = "lost"
    REJECTED = "rejected"  # the scheduler refused the submission for good
    FENCED = "fenced"  # a newer segment of the chain owned the checkpoint: stopped, free
    SKIPPED = "skipped"  # it started after the goal was reached, and ran nothing: free

    @property
    def crashed(self) -> bool:
        """True when the segment costs budget whatever its progress."""
        return self in _CRASHES


_CRASHES = frozenset({Outcome.FAILED, Outcome.OOM, Outcome.NODE_FAIL, Outcome.CANCELLED, Outcome.LOST})


class Phase(enum.Enum):
    """Where a segment's job is, as far as chainrun knows."""

    SUBMITTING = "submitting"  # journaled, job id not yet recorded
    PENDING = "pending"
    RUNNING = "running"
    ENDED = "ended"

    @property
    def live(self) -> bool:
        return self is not Phase.ENDED


class ChainState(enum.Enum):
    """The state of a whole chain; every state but ACTIVE and STUCK is final."""

    ACTIVE = "active"
    # Its ticks kept failing (a bug, an unreadable file): retried now and then, active after a good one.
    STUCK = "stuck"
    COMPLETED = "completed"
    EXHAUSTED = "exhausted"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def final(self) -> bool:
        return self not in (ChainState.ACTIVE, ChainState.STUCK)


def new_chain_id(name: str) -> str:
    """A fresh chain id: the chain's name and six random hex digits."""
    import secrets  # here: the commands that only read (`status`) need not import it (6 ms)

    return f"{name}-{secrets.token_hex(3)}"


# How the reason of a pool's chain begins while it waits, unsubmitted, for a free slot.
WAITING_FOR_A_SLOT = "waiting for a "


SEED_LIMIT = 2**32  # seeds are below it: NumPy's legacy seed must be; torch, random and TF take them


def seed_of(*words: str) -> int:
    """A seed from ``words`` (the same words, the same seed), below ``SEED_LIMIT``."""
    whole = hashlib.sha256("\0".join(words).encode()).digest()
    return int.from_bytes(whole[:4], "big") % SEED_LIMIT


def chain_seed(spec: JobSpec, chain_id: str) -> int:
    """The chain's ``CHAINRUN_SEED``, the same in each of its segments: a sweep chain's own
    (from its sweep, configuration and repetition: ``sweep.expand``), else one from the chain
    id, so that each chain submitted is a run of its own, also from the same job file."""
    return spec.seed if spec.seed is not None else seed_of(chain_id)


# JobSpec fields JSON gives back as lists, made tuples again by from_json.
_SPEC_TUPLES = (
    "scheduler",
    "tracking",
    "env",
    "inherit_env",
    "inherited",
    "container_options",
    "sweep",
    "params",
    "checkpoint_machines",
    "places",
)
# The fields of a JobSpec that differ between places (``PlaceSpec``), besides the scheduler.
_PLACE_FIELDS = (
    "workdir",
    "checkpoint_dir",
    "walltime",
    "container",
    "checkpoint_real",
    "checkpoint_machines",
)


@dataclass(frozen=True, **SLOTS)
class JobSpec:
    """A validated job file. Durations are whole seconds, paths absolute."""

    name: str
    command: str
    workdir: str
    total_time: int
    walltime: int
    target_epoch: Optional[int]
    max_failures: int
    checkpoint_dir: str
    signal: str
    grace: int  # the job file's, or the default: min(5m, walltime/4)
    scheduler: SchedulerSpec = field(default_factory=SchedulerSpec)
    env: tuple[tuple[str, str], ...] = ()
    inherit_env: tuple[str, ...] = ()  # names taken from the submitting shell
    inherited: tuple[tuple[str, str], ...] = ()  # their values there, applied before [env]
    on_end: Optional[str] = None  # a command run (locally) when the chain ends
    webhook: Optional[str] = None  # an http(s) URL that gets a JSON POST when the chain ends
    source: str = ""
    # walltime = "MIN..MAX": the shortest a segment may be granted (Slurm's --time-min); 0: one length
    walltime_min: int = 0
    # progress = "FILE:KEY": the epoch is KEY (dotted) of the script's own JSON file,
    # not the helper's sidecar; None: the sidecar (or the newest file's mtime).
    progress_file: Optional[str] = None
    progress_key: str = ""
    container: Optional[str] = None  # the image the command runs in; None: none
    container_runtime: str = ""  # charliecloud, apptainer or singularity
    container_options: tuple[str, ...] = ()
    container_gpus: bool = False  # the runtime's GPU option (Apptainer's --nv)
    snapshot: str = ""  # "git": every segment runs the code as it was at submit
    snapshot_commit: str = ""  # set at submit: the commit captured
    snapshot_subdir: str = ""  # where in that commit's tree the command runs
    tensorboard_dir: str = ""  # where `chainrun tensorboard` looks (absolute; "": workdir/runs)
    tracking: tuple[str, ...] = ()  # [tracking]: the trackers whose own variables name the chain's run
    # [sweep] as read (configurations of (name, JSON value) pairs; repetitions): sweep.expand's.
    sweep: tuple[tuple[tuple[str, str], ...], ...] = ()
    reps: int = 1
    # One chain of a sweep: the sweep's name, its configuration, its repetition.
    sweep_name: str = ""
    params: tuple[tuple[str, str], ...] = ()
    rep: int = 0
    max_concurrent: Optional[int] = None  # [sweep]: at most this many of its chains under way at once
    # A sweep chain's CHAINRUN_SEED, set by ``sweep.expand``; None: one from the chain id.
    seed: Optional[int] = None
    # While the service is away, a segment queues its own successor (``decide.carry``),
    # unless the job file says self_queue = false, or the probes at submit found that the
    # cluster's nodes cannot submit, or that the carrier does not run there (why, in words).
    self_queue: bool = True
    nodes_cannot_submit: str = ""
    carrier_cannot_run: str = ""
    # No grace in the job file: each segment's comes of its chain's stops, at most grace (decide/grace.py).
    adaptive_grace: bool = False
    # Set at submit (``chainrun.location``): where checkpoint_dir really is, for its hold
    # (``decide.holds``): the path as resolved on its host, and the names of the machines
    # it is seen from. "": a chain stored before holds were settled at submit.
    checkpoint_real: str = ""
    checkpoint_machines: tuple[str, ...] = ()
    # [[cluster]]: the places a chain may run at, in order of preference (each in full; the
    # first is this spec's own fields); () for a chain with one. ``place``: the one this
    # spec is seen at (``at``), "" for the first.
    places: tuple[PlaceSpec, ...] = ()
    place: str = ""

    @property
    def place_name(self) -> str:
        """The name of the place this spec is seen at ("" for a chain with one place)."""
        return self.place or (self.places[0].name if self.places else "")

    def at(self, name: Optional[str]) -> JobSpec:
        """The spec as a segment at place ``name`` sees it (None, or a chain with one place:
        the spec as it is): that place's scheduler, workdir, checkpoint directory, walltime,
        container, and the hold settled for it; a progress file or TensorBoard directory
        under the first place's workdir is under that place's. Raises KeyError for a name
        the job file has no place of."""
        if name is None or not self.places or name == self.place_name:
            return self
        there = next((p for p in self.places if p.name == name), None)
        if there is None:
            raise KeyError(name)
        first = self.places[0]

        def moved(path: Optional[str]) -> Optional[str]:
            if path is None or not (
                path == first.workdir or path.startswith(first.workdir.rstrip("/") + "/")
            ):
                return path
            return there.workdir + path[len(first.workdir) :]

        return replace(
            self,
            scheduler=there.scheduler,
            place=name if name != first.name else "",
            progress_file=moved(self.progress_file),
            tensorboard_dir=moved(self.tensorboard_dir) or "",
            **{f: getattr(there, f) for f in _PLACE_FIELDS},
        )

    @property
    def max_segments(self) -> int:
        """Segments the time budget allows if every one uses its whole walltime."""
        return -(-self.total_time // self.walltime)

    def to_json(self) -> dict[str, Any]:
        """As JSON: the spec as the job file gave it, seen at its first place (the store
        keeps that one, whatever place its chain is at)."""
        return asdict(self.at(self.places[0].name) if self.place else self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JobSpec:
        return cls(
            **{k: v for k, v in data.items() if k not in _SPEC_TUPLES},
            scheduler=SchedulerSpec.from_json(data["scheduler"]),
            places=tuple(PlaceSpec.from_json(p) for p in data.get("places", ())),
            env=tuple((k, v) for k, v in data["env"]),
            inherit_env=tuple(data.get("inherit_env", ())),
            inherited=tuple((k, v) for k, v in data.get("inherited", ())),
            container_options=tuple(data.get("container_options", ())),
            sweep=tuple(tuple((k, v) for k, v in config) for config in data.get("sweep", ())),
            params=tuple((k, v) for k, v in data.get("params", ())),
            checkpoint_machines=tuple(data.get("checkpoint_machines", ())),
            tracking=tuple(data.get("tracking", ())),
        )


@dataclass(frozen=True, **SLOTS)
class Progress:
    """What the checkpoint says. All fields optional: a script may write none."""

    epoch: Optional[int] = None
    step: Optional[int] = None
    file: Optional[str] = None
    sha256: Optional[str] = None
    saved_at: Optional[float] = None
    done: bool = False
    segment: Optional[int] = None
    metrics: tuple[tuple[str, float], ...] = ()  # the sidecar's numeric metrics (loss, accuracy, ...)

    @property
    def key(self) -> tuple[int, int, float]:
        """Totally ordered measure of advance: a larger key is more progress."""
        return (
            -1 if self.epoch is None else self.epoch,
            -1 if self.step is None else self.step,
            -1.0 if self.saved_at is None else self.saved_at,
        )

    def advanced_from(self, before: Progress) -> bool:
        return self.key > before.key

    def describe(self) -> str:
        if self.epoch is not None:
            text = f"epoch {self.epoch}"
            if self.step:
                text += f" step {self.step}"
            return text + (" (done)" if self.done else "")
        if self.saved_at is not None:
            # A moment, not an age: this text is stored in reasons and events.
            saved = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.saved_at))
            return f"checkpoint {self.file or '?'} saved {saved}"
        return "no checkpoint yet"

    def to_json(self) -> dict[str, Any]:
        """As JSON: ``metrics`` an object, name to value, in the sidecar's order."""
        return {**asdict(self), "metrics": dict(self.metrics)}

    @classmethod
    def from_json(cls, data: Optional[dict[str, Any]]) -> Progress:
        """From ``to_json``'s JSON; ``metrics`` also as the list of pairs stored before."""
        if not data:
            return cls()
        raw = data.get("metrics") or ()
        pairs = raw.items() if isinstance(raw, dict) else raw
        return cls(**{**data, "metrics": tuple((str(k), float(v)) for k, v in pairs)})


NO_PROGRESS = Progress()


@dataclass(frozen=True, **SLOTS)
class StartMarker:
    """The wrapper's record of a segment's start: its job, time and checkpoint."""

    job_id: str
    at: Optional[float]
    progress: Optional[Progress]
    walltime: Optional[int] = None  # the limit its clock counted from (granted: node/granted.py)


@dataclass(frozen=True, **SLOTS)
class EndMarker:
    """The wrapper's record of how the command ended, and the checkpoint it left."""

    exit_code: int
    original: int
    signal: str
    skipped: bool
    at: Optional[float]
    progress: Optional[Progress] = None
    path: str = ""  # the PATH the command ran with
    tail: tuple[str, ...] = ()  # the last lines of the command's output, when it failed
    preempted: bool = False  # the signal came because the scheduler preempted the job
    signalled_at: Optional[float] = None  # when the signal was passed on to the command
    grace: Optional[int] = None  # the grace the segment ran with
    ready: str = ""  # "1": the command said it takes the signal; "0": not this time (held); "": never
    ready_at: Optional[float] = None  # when all its processes had said so, as the runner saw
    save_seconds: Optional[float] = None  # how long the last save took, as the sidecar says
    fenced: str = ""  # who owned the checkpoint directory when this segment was fenced; "" if not
    skip: str = ""  # why the segment skipped its command (the goal reached, and by whom)
    # A snapshot chain's files kept beside the workdir's own (node.share): NAME.chainrun-<chain-id>.
    beside: tuple[str, ...] = ()

    @property
    def stop_seconds(self) -> Optional[float]:
        """How long the command took from the walltime signal to its end."""
        if self.signalled_at is None or self.at is None:
            return None
        return max(0.0, self.at - self.signalled_at)

    @property
    def stopped_by_signal(self) -> bool:
        """The walltime (or preemption) signal came and the command then stopped cleanly."""
        return bool(self.signal) and (self.original == 0 or self.died_of_signal)

    @property
    def died_of_signal(self) -> bool:
        """The walltime (or preemption) signal killed the command: it had no handler set."""
        signum = getattr(signals, "SIG" + self.signal, None) if self.signal else None
        return signum is not None and self.original == 128 + signum

    @property
    def killed(self) -> bool:
        """The command died of a signal that was not the walltime one (a SIGKILL from the
        kernel's OOM killer, say): accounting may know better than "failed"."""
        return self.original > 128 and not self.stopped_by_signal

    def outcome(self) -> Outcome:
        if self.fenced:
            return Outcome.FENCED
        if self.skipped:
            return Outcome.SKIPPED
        if self.preempted:
            return Outcome.PREEMPTED
        if self.stopped_by_signal:
            return Outcome.TIMEOUT
        return Outcome.COMPLETED if self.original == 0 else Outcome.FAILED

    def describe(self) -> str:
        if self.fenced:
            return f"fenced: {self.fenced} of the chain owns the checkpoint; stopped without committing"
        if self.skipped:
            return self.skip or "the goal was already reached"
        how = f"after SIG{self.signal}" if self.signal else "on its own"
        if self.preempted:
            how += " (the job was preempted)"
        if self.beside:
            how += f"; kept beside the workdir's own files, which had changed: {', '.join(self.beside)}"
        return f"the command exited {self.original} {how}"


@dataclass(frozen=True, **SLOTS)
class Segment:
    """One scheduler job of a chain, as recorded in the store."""

    chain_id: str
    n: int
    walltime: int
    phase: Phase
    job_id: Optional[str] = None
    after: Optional[str] = None
    attempts: int = 0
    retry_at: Optional[float] = None
    submitted_at: Optional[float] = None
    started_at: Optional[float] = None
    ended_at: Optional[float] = None
    missing_since: Optional[float] = None
    outcome: Optional[Outcome] = None
    exit_code: Optional[int] = None
    charged: bool = False
    reason: str = ""
    tail: tuple[str, ...] = ()  # the last lines of its output, when the command failed
    host: Optional[str] = None  # where a pool placed it (None: the chain's scheduler.host)
    array: Optional[str] = None  # a first segment sent as an array task: the array's name
    task: Optional[int] = None  # and its task index there
    signalled_at: Optional[float] = None  # when the walltime (or another) signal reached its command
    stop: Optional[float] = None  # seconds it needed to stop (decide/grace.py); None: not seen
    ready_at: Optional[float] = None  # when its command was ready for the signal (end marker)
    place: Optional[str] = None  # the place it runs at (None: the first, or the only one)
    # The checkpoint copied to its place before it was submitted there (``Move``): seconds,
    # bytes and the checkpoint's digest; None: no copy was made.
    copy_seconds: Optional[float] = None
    copy_bytes: Optional[int] = None
    copy_digest: Optional[str] = None


@dataclass(frozen=True, **SLOTS)
class Chain:
    """A long run: its spec, its history so far, and where it stands."""

    id: str
    spec: JobSpec
    state: ChainState
    created_at: float
    segments: tuple[Segment, ...] = ()
    failures: int = 0
    used: float = 0.0
    progress: Progress = NO_PROGRESS  # the mark: progress when the last segment ended
    latest: Progress = NO_PROGRESS  # the newest progress seen, for display
    baseline: Progress = NO_PROGRESS  # what checkpoint_dir held at submission
    # When a cancel was asked for (a segment running then has its grace to save); None: not asked.
    cancel_requested_at: Optional[float] = None
    reason: str = ""
    ended_at: Optional[float] = None
    # Its segments not ended, derived once (a tick reads them several times per chain, and a
    # chain never changes); not an argument, not compared, not stored.
    live: tuple[Segment, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "live", tuple(s for s in self.segments if s.phase is not Phase.ENDED))

    @property
    def cancel_requested(self) -> bool:
        return self.cancel_requested_at is not None

    @property
    def placed(self) -> Optional[str]:
        """A pool's chain: its newest segment's host at the place it is at (a pool may be one
        of several), else the host its checkpoint was found on at submit (None before it has
        either, and for others)."""
        return self.host_at(self.spec.place_name) or self.spec.scheduler.checkpoint_host

    def host_at(self, place: str) -> Optional[str]:
        """The pool host of its newest segment placed at place ``place`` ("": its only one)."""
        first = self.spec.places[0].name if self.spec.places else ""
        return next((s.host for s in reversed(self.segments) if s.host and (s.place or first) == place), None)

    @property
    def host(self) -> Optional[str]:
        """Where the chain runs, or ran last: a pool's chain on its newest segment's host."""
        return self.placed or self.spec.scheduler.first_host

    def ran_on(self, placed: Optional[str]) -> bool:
        """A segment was submitted to the pool host ``placed`` (None: a chain not in a pool)."""
        return any(s.job_id is not None and s.host == placed for s in self.segments)

    @property
    def cluster_key(self) -> tuple[str, str]:
        """The cluster whose poll serves the chain: a pool's, its live segment's host."""
        if not self.spec.scheduler.hosts:
            return self.spec.scheduler.cluster_key
        return (self.spec.scheduler.kind, self.host or "")

    @property
    def next_n(self) -> int:
        return max((s.n for s in self.segments), default=0) + 1

    @property
    def failing(self) -> Optional[Segment]:
        """The last segment whose end cost failure budget (for a failed chain: the one
        its reason is about); None when none did."""
        return next((s for s in reversed(self.segments) if s.charged), None)

    @property
    def max_segments(self) -> int:
        """Segments the time budget allows if every one uses its whole walltime."""
        return self.spec.max_segments


@dataclass(frozen=True, **SLOTS)
class ListedJob:
    """One job as the scheduler shows it (squeue, qstat, sacct, the local runner)."""

    job_id: str
    name: str
    phase: Phase
    outcome: Optional[Outcome] = None  # set when the view shows a finished job
    exit_code: Optional[int] = None
    started_at: Optional[float] = None
    ended_at: Optional[float] = None
    reason: str = ""
    # Held by the scheduler in an error state (SGE's Eqw, Slurm's DependencyNeverSatisfied): never runs.
    stuck: bool = False
    slot: Optional[int] = None  # the local runner's slot it holds (a pool: its GPUs follow)
    nodes: str = ""  # the nodes an ended job had, as the scheduler names them (a Slurm hostlist)


# Actions returned by decide(); the engine carries them out in order and
# records each, with its reason, in one transaction per chain and tick.


@dataclass(frozen=True)
class Submit:
    """Queue segment ``n`` (journaled first), after job ``after`` if set: on pool host
    ``host`` (None: where the chain is), or as a task of a sweep's array job (``task``)."""

    n: int
    walltime: int
    after: Optional[str] = None
    host: Optional[str] = None
    task: bool = False


@dataclass(frozen=True)
class Move:
    """Queue segment ``n`` at another place (``place``; a pool: on its host ``host``):
    journaled there, the checkpoint copied there from the place the chain was at and
    verified, then submitted."""

    n: int
    walltime: int
    place: str
    reason: str
    host: Optional[str] = None


@dataclass(frozen=True)
class Adopt:
    """Record ``job_id`` as segment ``n``'s job: a submission that answered, or one an
    interrupted service left behind. With ``walltime``, a segment not yet in the store: one
    that the segment before it queued while the service was away (``Carried``)."""

    n: int
    job_id: str
    how: str
    walltime: Optional[int] = None
    after: Optional[str] = None
    submitted_at: Optional[float] = None  # a carried segment's: when its claim was made


@dataclass(frozen=True)
class Carried:
    """A successor that a segment queued itself while the service was away, as its claim
    (``seg-NNNN.queued``, written before the submission) says."""

    job_id: str  # "" while its submission has not answered (or never did)
    walltime: int
    after: str  # the job of the segment that queued it
    by: str = ""  # who claimed it: "service", or "segment N" (the one before it)
    at: Optional[float] = None  # when: its submission came right after (None: an older claim)


@dataclass(frozen=True)
class RetryLater:
    """A submission failed for a passing reason: try segment ``n`` again at ``at``."""

    n: int
    at: float
    reason: str


@dataclass(frozen=True)
class Reject:
    """The scheduler refused segment ``n`` for good (unknown partition)."""

    n: int
    reason: str


@dataclass(frozen=True)
class Cancel:
    """Cancel segment ``n``'s job (if it has one) and end the segment, free of charge. A job
    that ran keeps the time it ran (``elapsed``) and the progress it made (``progress``:
    None when it made none)."""

    n: int
    job_id: Optional[str]
    reason: str
    elapsed: float = 0.0
    progress: Optional[Progress] = None


@dataclass(frozen=True)
class Remove:
    """Cancel job ``job_id`` of segment ``n`` in the scheduler, leaving the segment's
    record to the other actions: a stuck job, a second job of one segment, or one a pool
    host (``host``; None: where the chain is) runs of a segment ended as lost there."""

    n: int
    job_id: str
    reason: str
    host: Optional[str] = None


@dataclass(frozen=True)
class Track:
    """What is now known of segment ``n``'s job while it has not ended."""

    n: int
    phase: Phase
    reason: str
    started_at: Optional[float]
    missing_since: Optional[float]
    preempted: bool = False  # it ran, was preempted and is queued again (requeued)
    walltime: Optional[int] = None  # a shorter limit than asked, granted as it started (a range)


@dataclass(frozen=True)
class EndSegment:
    n: int
    outcome: Outcome
    exit_code: Optional[int]
    charged: bool
    elapsed: float
    ended_at: float
    reason: str
    progress: Progress
    tail: tuple[str, ...] = ()  # the last lines of the segment's output, when it failed
    signalled_at: Optional[float] = None  # when the signal reached the command (end marker)
    stop: Optional[float] = None  # the seconds it needed to stop (decide/grace.py)
    ready_at: Optional[float] = None  # when its command was ready for the signal (end marker)


@dataclass(frozen=True)
class Finish:
    state: ChainState
    reason: str


@dataclass(frozen=True)
class Wait:
    """A pool's chain waits, unsubmitted, for a free slot, and says why; "" once it goes on."""

    reason: str


@dataclass(frozen=True)
class SetGrace:
    """The grace later segments get (written where their wrapper reads it), and why."""

    seconds: int
    reason: str


@dataclass(frozen=True)
class MarkStuck:
    """The chain's ticks keep failing: it is stuck, and tried again now and then."""

    reason: str


@dataclass(frozen=True)
class Unstick:
    """A stuck chain's tick worked again: it is active again."""

    reason: str


Action = Union[
    Submit,
    Move,
    Adopt,
    RetryLater,
    Reject,
    Cancel,
    Remove,
    Track,
    EndSegment,
    Finish,
    Wait,
    SetGrace,
    MarkStuck,
    Unstick,
]
