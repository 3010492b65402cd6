"""The Python API: submit chains and sweeps from a script, follow them, cancel them.

``submit`` takes a job file, or a dict shaped like one, validated by the same
code as ``chainrun submit`` (so bad input raises the same ``ChainrunError``
with the same one line); ``params`` and ``reps`` give or replace its
``[sweep]``. It writes the store directly: no service needs to run, and the
one that runs (or starts later) picks the chains up. ``chains`` finds chains
already stored. Each is a ``Chain``: a handle (state directory and id) whose
``state``, ``progress`` and ``status()`` read the store afresh at every call.
``wait`` (and ``Chain.wait``) never waits on a chain that nothing moves: with no
service running for the state directory, it is the service, as ``chainrun run``
is, until the chains have ended.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from chainrun import cancel as cancelling
from chainrun import jobfile, logsetup, submission
from chainrun import model as _model
from chainrun.constants import DEFAULT_INTERVAL
from chainrun.errors import AlreadyRunning, StoreUnavailable, UsageError
from chainrun.lock import lock_for
from chainrun.model import JobSpec, Progress
from chainrun.status import to_json
from chainrun.store import Store, default_home

if TYPE_CHECKING:
    from chainrun.service import Service

__all__ = ["Chain", "chains", "submit", "wait"]

JobSource = Union[str, "os.PathLike[str]", Mapping[str, Any]]
Params = Union[Mapping[str, Sequence[Any]], Sequence[Mapping[str, Any]]]
DICT_SOURCE = "job dict"  # how errors and the chain's history name a job given as a dict
POLL = 1.0  # seconds between looks at the store while waiting


class Chain:
    """One chain in a state directory: what never changes (``id``, ``name``, and for a
    sweep's chain ``sweep``, ``params`` and ``rep``) is kept; ``state``, ``progress`` and
    ``status()`` read the store at each call. Two are equal when they name the same chain."""

    def __init__(self, home: Path, chain_id: str, spec: JobSpec) -> None:
        self.home = home
        self.id = chain_id
        self.name = spec.name
        self.sweep: Optional[str] = spec.sweep_name or None
        # Values as the job gave them; a chain outside a sweep has none ({}) and rep 0.
        self.params: dict[str, Any] = {k: json.loads(v) for k, v in spec.params}
        self.rep = spec.rep

    def __repr__(self) -> str:
        return f"<chainrun.Chain {self.id} {self.name}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Chain) and (self.home, self.id) == (other.home, other.id)

    def __hash__(self) -> int:
        return hash((self.home, self.id))

    @property
    def state(self) -> str:
        """The chain's state now: active, stuck, completed, exhausted, failed or cancelled."""
        return self._read().state.value

    @property
    def progress(self) -> Progress:
        """The newest progress seen in its checkpoint (epoch, step, file, done, ...)."""
        return self._read().latest

    def status(self) -> dict[str, Any]:
        """Everything about the chain now, as its entry in ``chainrun status --json``."""
        with _store(self.home, readonly=True) as store:
            return to_json(store.chain(self.id), time.time(), store.owed_for(self.id))

    def wait(self, timeout: Optional[float] = None, poll: float = POLL) -> str:
        """Wait until the chain ends; its final state. See ``chainrun.wait``."""
        return wait([self], timeout, poll)[0]

    def cancel(self) -> str:
        """Cancel the chain, as ``chainrun cancel`` does: its queued jobs are cancelled, its
        running segment has the signal to save and stop (within its grace), here when no
        service runs (this waits for the save), else by the service at its next tick. Its
        state after: cancelled, still active (the service has yet to act), or the final
        state it had already reached."""
        with _store(self.home) as store:
            chain = store.chain(self.id)
            if not chain.state.final:
                cancelling.cancel(self.home, store, [chain], wait=lambda _: None)
            return store.chain(self.id).state.value

    def _read(self) -> _model.Chain:
        with _store(self.home, readonly=True) as store:
            return store.chain(self.id)


def submit(
    jobfile_or_dict: JobSource,
    params: Optional[Params] = None,
    reps: Optional[int] = None,
    home: Union[str, os.PathLike[str], None] = None,
    fresh: bool = False,
) -> list[Chain]:
    """Store the chains of a job file (a path) or of a dict shaped like one, and return
    one ``Chain`` for each: a chain still active from an earlier submission of the same
    job is left as it is (said on stderr) and returned, never started twice.

    ``params`` gives the sweep: a dict of name -> list of values (a grid: every
    combination), or a list of dicts (points); it replaces a ``[sweep]`` grid or points
    in the job. ``reps`` sets the repetitions of each configuration. A dict's relative
    paths start at the current directory. ``home`` is the state directory (default
    ``$CHAINRUN_HOME`` or ``~/.local/state/chainrun``); ``fresh`` first moves each
    checkpoint directory aside, as ``chainrun submit --fresh``.

    Raises ``JobFileError`` for a bad job, and the other ``ChainrunError`` of
    ``chainrun submit`` (a checkpoint already complete, another active chain training
    into the same checkpoint directory, a cluster that cannot be reached) with the same
    message; nothing is stored then.
    """
    where = _home(home)
    spec = _spec(jobfile_or_dict, params, reps)
    with _store(where) as store:
        submitted = submission.submit_all(store, [spec], fresh=fresh)
    return [Chain(where, chain_id, one) for chain_id, one, _ in submitted]


def wait(chains: Sequence[Chain], timeout: Optional[float] = None, poll: float = POLL) -> list[str]:
    """Wait until every one of ``chains`` (a sweep's, say) has ended; their final states,
    in order.

    Chains move only while a service runs for their state directory. While one runs
    (``chainrun daemon``, the systemd unit, a ``chainrun run``), this looks every ``poll``
    seconds. While none does, this process is the service, as ``chainrun run`` is: it
    ticks every chain of that directory until these have ended (or the timeout), and
    stops. Raises TimeoutError when they have not all ended within ``timeout`` seconds
    (None: no limit), and KeyboardInterrupt on Ctrl-C; the chains go on either way. A
    service that cannot start here (a broken config, say) raises its ChainrunError at once.
    """
    if not (math.isfinite(poll) and poll > 0):
        raise ValueError(f"poll={poll!r}: give a number of seconds above 0")
    if timeout is not None and not timeout >= 0:
        raise ValueError(f"timeout={timeout!r}: give a number of seconds, 0 or more, or None")
    deadline = None if timeout is None else time.monotonic() + timeout
    homes = list(dict.fromkeys(c.home for c in chains))
    while True:
        states = {c: _final_state(c) for c in chains}
        left = [c for c, state in states.items() if state is None]
        if not left:
            return [states[c] or "" for c in chains]
        if deadline is not None and time.monotonic() >= deadline:
            raise _late(chains, left, timeout or 0.0)
        home = next(h for h in homes if any(c.home == h for c in left))
        if not lock_for(home).held_elsewhere():
            _drive(home, [c for c in left if c.home == home], deadline, poll)
            continue
        time.sleep(poll if deadline is None else max(0.0, min(poll, deadline - time.monotonic())))


def _final_state(chain: Chain) -> Optional[str]:
    """The chain's final state, None while it is active (or the database is busy a moment)."""
    try:
        state = chain._read().state
    except StoreUnavailable:
        return None
    return state.value if state.final else None


def _late(chains: Sequence[Chain], left: Sequence[Chain], timeout: float) -> TimeoutError:
    """What ``wait`` says of the chains ``left`` active at its timeout."""
    if len(chains) == 1:
        try:
            now = f"still {left[0].state}"
        except StoreUnavailable:
            now = "the database was busy"
        return TimeoutError(f"chain {left[0].id}: {now} after {timeout:g}s")
    names = ", ".join(c.id for c in left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
    return TimeoutError(f"{len(left)} of {len(chains)} chains still active after {timeout:g}s: {names}")


def _drive(home: Path, chains: Sequence[Chain], deadline: Optional[float], poll: float) -> None:
    """Be the service for ``home`` until ``chains`` have ended or ``deadline`` (monotonic)
    passes; return at once if another service took the directory meanwhile. Ticks come as
    often as ``chainrun run``'s for their shortest walltime, and at least every ``poll``
    seconds; KeyboardInterrupt when a signal stopped it first."""
    from chainrun.service import Service

    walltime = min(c._read().spec.walltime for c in chains)
    step = max(0.2, min(poll, DEFAULT_INTERVAL, max(1.0, walltime / 8)))

    def ended() -> bool:
        return all(_final_state(c) is not None for c in chains)

    with _trouble_only():
        _run(Service(home, interval=step, stop_when=ended), deadline, ended)


@contextmanager
def _trouble_only() -> Iterator[None]:
    """While ``wait`` is the service: its log lines on stderr only for trouble (warnings and
    errors), as under ``chainrun run``, unless this process set chainrun's logging up itself;
    after, the logging it had."""
    if logsetup.configured():
        yield
        return
    level = logging.getLogger().level
    logsetup.setup("warning")
    try:
        yield
    finally:
        logsetup.reset()
        logging.getLogger().setLevel(level)


def _run(service: Service, deadline: Optional[float], ended: Callable[[], bool]) -> None:
    """Run ``service`` until it stops, or ``deadline`` (monotonic) passes."""
    late = threading.Event()

    def stop_at_deadline() -> None:
        late.set()
        service.stop()

    timer = None
    if deadline is not None:
        timer = threading.Timer(max(0.0, deadline - time.monotonic()), stop_at_deadline)
        timer.daemon = True
        timer.start()
    try:
        service.run()
    except AlreadyRunning:
        return  # started elsewhere meanwhile: it moves the chains; wait looks
    finally:
        if timer is not None:
            timer.cancel()
    if not late.is_set() and not ended():
        raise KeyboardInterrupt


def chains(name: Optional[str] = None, home: Union[str, os.PathLike[str], None] = None) -> list[Chain]:
    """The chains of the sweep ``name``, else the chain ``name`` (an id, a unique prefix of
    one, or a chain name: its newest chain), else, without ``name``, every chain; oldest
    first. ``UsageError`` when ``name`` names none."""
    where = _home(home)
    with _store(where, readonly=True) as store:
        found = store.chains() if name is None else store.sweep(name) or [store.find(name)]
    return [Chain(where, c.id, c.spec) for c in found]


def _home(home: Union[str, os.PathLike[str], None]) -> Path:
    if home is None:
        return default_home()
    if not os.fspath(home):
        raise UsageError("home: an empty path; give the state directory, or leave home out")
    return Path(home)


@contextmanager
def _store(home: Path, readonly: bool = False) -> Iterator[Store]:
    store = Store(home, readonly=readonly)
    try:
        yield store
    finally:
        store.close()


def _spec(source: JobSource, params: Optional[Params], reps: Optional[int]) -> JobSpec:
    """The job, with ``params`` and ``reps`` put into its ``[sweep]``, validated."""

    def edit(data: dict[str, Any]) -> dict[str, Any]:
        return {**data, **_sweep(data, params, reps)}

    if isinstance(source, Mapping):
        spec = jobfile.parse(edit(dict(source)), DICT_SOURCE, base=Path.cwd(), environ=os.environ)
        return replace(spec, source=DICT_SOURCE)  # no file: parse made a path of the name
    return jobfile.load(source, edit=edit)


def _sweep(data: Mapping[str, Any], params: Optional[Params], reps: Optional[int]) -> dict[str, Any]:
    """The ``sweep`` table ``params`` and ``reps`` make of the job's own (nothing when
    neither is given), for the job file's validation to check like any other."""
    if params is None and reps is None:
        return {}
    table = data.get("sweep")
    table = dict(table) if isinstance(table, Mapping) else {}
    if isinstance(params, Mapping):
        table.pop("points", None)
        table["grid"] = {k: _listed(v) for k, v in params.items()}
    elif params is not None:
        if isinstance(params, (str, bytes)):
            raise UsageError(f"params={params!r}: give a dict of name -> list of values, or a list of dicts")
        table.pop("grid", None)
        table["points"] = [dict(p) if isinstance(p, Mapping) else p for p in params]
    if reps is not None:
        table["reps"] = reps
    return {"sweep": table}


def _listed(values: Any) -> Any:
    """A tuple or other sequence of values as the list TOML would give; anything else as it is."""
    if isinstance(values, Sequence) and not isinstance(values, (str, bytes)):
        return list(values)
    return values
