"""The Python API: submit chains and sweeps from a script, follow them, cancel them.

``submit`` takes a job file, or a dict shaped like one, validated by the same
code as ``chainrun submit`` (so bad input raises the same ``ChainrunError``
with the same one line); ``params`` and ``reps`` give or replace its
``[sweep]``. It writes the store directly: no service needs to run, and the
one that runs (or starts later) picks the chains up. ``chains`` finds chains
already stored. Each is a ``Chain``: a handle (state directory and id) whose
``state``, ``progress`` and ``status()`` read the store afresh at every call.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Union

from chainrun import control, jobfile
from chainrun import model as _model
from chainrun.errors import StoreUnavailable, UsageError
from chainrun.model import JobSpec, Progress
from chainrun.status import to_json
from chainrun.store import Store, default_home

__all__ = ["Chain", "chains", "submit"]

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
        return to_json(self._read(), time.time())

    def wait(self, timeout: Optional[float] = None, poll: float = POLL) -> str:
        """Wait until the chain ends, looking every ``poll`` seconds; its final state.

        A chain moves only while a service runs (``chainrun daemon``). Raises
        TimeoutError when it has not ended within ``timeout`` seconds (None: no limit).
        A moment the database is busy is waited out like any other look."""
        if not (math.isfinite(poll) and poll > 0):
            raise ValueError(f"poll={poll!r}: give a number of seconds above 0")
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"timeout={timeout!r}: give a number of seconds, 0 or more, or None")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                state = self._read().state
            except StoreUnavailable:
                state = None
            if state is not None and state.final:
                return state.value
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                now = "the database was busy" if state is None else f"still {state.value}"
                raise TimeoutError(f"chain {self.id}: {now} after {timeout:g}s")
            time.sleep(poll if left is None else min(poll, left))

    def cancel(self) -> str:
        """Cancel the chain, as ``chainrun cancel`` does: its queued and running jobs are
        cancelled, here at once when no service runs, else by the service at its next
        tick. Its state after: cancelled, still active (the service has yet to act), or
        the final state it had already reached."""
        with _store(self.home) as store:
            chain = store.chain(self.id)
            if not chain.state.final:
                control.cancel(self.home, store, [chain])
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
        submitted = control.submit_all(store, [spec], fresh=fresh)
    return [Chain(where, chain_id, one) for chain_id, one, _ in submitted]


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
