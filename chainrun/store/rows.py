"""Reading rows back: every column decoded and checked, so that a row chainrun did not
write (a value of the wrong type, bad JSON, text that is not UTF-8) makes its chain
*damaged* (``Unreadable``, with what is wrong) instead of failing the load of the others.
"""

from __future__ import annotations

import json
import sqlite3
import typing
from dataclasses import dataclass
from typing import Any, Optional, Union

from chainrun.decide.places import current
from chainrun.model import Chain, ChainState, JobSpec, Outcome, Phase, Progress, Segment
from chainrun.store.checked import Unfit, check, fits, kind_of
from chainrun.text import clip


@dataclass(frozen=True)
class Event:
    id: int
    chain_id: str
    segment: Optional[int]
    at: float
    kind: str
    message: str


class Garbled(bytes):
    """A TEXT value that is not UTF-8: what a damaged row may hold."""


def text_factory(data: bytes) -> Union[str, Garbled]:
    """SQLite TEXT to str; bytes that are not UTF-8 stay bytes, so that one bad value
    damages its chain instead of failing the query that read it."""
    try:
        return data.decode()
    except UnicodeDecodeError:
        return Garbled(data)


class Unreadable(Exception):
    """What of a chain's row cannot be read back."""


def checked(obj: Any) -> None:
    """Raise Unreadable naming the first field of dataclass ``obj`` that is not of its type."""
    try:
        check(obj)
    except Unfit as exc:
        what = (
            "not valid UTF-8"
            if isinstance(exc.value, Garbled)
            else f"{brief(exc.value)}, not {kind_of(exc.hint)}"
        )
        raise Unreadable(f"{exc.field} is {what}") from None


def brief(value: Any) -> str:
    """A stored value for a message saying what is wrong with it."""
    if isinstance(value, Garbled):
        return "text that is not UTF-8"
    return clip(repr(value), 40, "...")


def word(value: Any) -> str:
    """A stored id, name or job id as one printable word."""
    if isinstance(value, str) and value.isprintable() and value:
        return value
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    return clip(repr(value), 80, "...")


def _json(value: Any, column: str) -> Any:
    if value is None:
        return None
    if isinstance(value, Garbled):
        raise Unreadable(f"{column} is not valid UTF-8")
    if not isinstance(value, str):
        raise Unreadable(f"{column} is {brief(value)}, not JSON text")
    try:
        return json.loads(value)
    except (ValueError, RecursionError) as exc:
        raise Unreadable(f"{column} is not valid JSON ({exc})") from None


_EnumT = typing.TypeVar("_EnumT", ChainState, Phase, Outcome)


def _enum(kind: type[_EnumT], value: Any, column: str) -> _EnumT:
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(str(m.value) for m in kind)
        raise Unreadable(f"{column} is {brief(value)}, not one of {allowed}") from None


def _progress(value: Any, column: str) -> Progress:
    data = _json(value, column)
    if data is not None and not isinstance(data, dict):
        raise Unreadable(f"{column} is {brief(data)}, not a JSON object")
    try:
        return Progress.from_json(data)
    except TypeError as exc:
        raise Unreadable(f"{column} is not progress ({exc})") from None


def decode_progress(value: Any) -> Progress:
    """A progress record as ``chains.latest`` and ``progress_log`` store it."""
    return _progress(value, "progress")


def decode_spec(value: Any) -> JobSpec:
    data = _json(value, "spec")
    try:
        return JobSpec.from_json(data)
    except KeyError as exc:
        raise Unreadable(f"spec is not a job spec (no {exc})") from None
    except (TypeError, ValueError, AttributeError) as exc:
        raise Unreadable(f"spec is not a job spec ({exc})") from None


def decode_chain(row: sqlite3.Row, segments: tuple[Segment, ...]) -> Chain:
    """A chain as stored; one with several places has its spec as seen at the place it is at
    (``decide.places.current``)."""
    spec = decode_spec(row["spec"])
    try:
        spec = spec.at(current(segments, spec.places))
    except KeyError as exc:
        raise Unreadable(f"a segment's place {exc} is not one of the job file's") from None
    chain = Chain(
        id=row["id"],
        spec=spec,
        state=_enum(ChainState, row["state"], "state"),
        created_at=row["created_at"],
        segments=segments,
        failures=row["failures"],
        used=row["used"],
        progress=_progress(row["progress"], "progress"),
        latest=_progress(row["latest"] or row["progress"], "latest"),
        baseline=_progress(row["baseline"], "baseline"),
        # Asked for before chainrun kept the time: long ago.
        cancel_requested_at=row["cancel_requested_at"]
        if row["cancel_requested_at"] is not None
        else (0.0 if row["cancel_requested"] else None),
        reason=row["reason"],
        ended_at=row["ended_at"],
    )
    checked(chain)
    if not (isinstance(chain.id, str) and chain.id.isprintable() and chain.id):
        raise Unreadable(f"its id {brief(chain.id)} is not a printable word")
    for field in ("total_time", "walltime"):
        if getattr(chain.spec, field) <= 0:
            raise Unreadable(
                f"spec.{field} is {getattr(chain.spec, field)}, not a positive number of seconds"
            )
    return chain


def decode_segment(row: sqlite3.Row) -> Segment:
    data: dict[str, Any] = dict(row)
    label = f"segment {data['n']}" if isinstance(data["n"], int) else "a segment"
    try:
        segment = Segment(
            chain_id=data["chain_id"],
            n=data["n"],
            walltime=data["walltime"],
            phase=_enum(Phase, data["phase"], "phase"),
            job_id=data["job_id"],
            after=data["after"],
            attempts=data["attempts"],
            retry_at=data["retry_at"],
            submitted_at=data["submitted_at"],
            started_at=data["started_at"],
            ended_at=data["ended_at"],
            missing_since=data["missing_since"],
            outcome=_enum(Outcome, data["outcome"], "outcome") if data["outcome"] is not None else None,
            exit_code=data["exit_code"],
            charged=bool(data["charged"]),
            reason=data["reason"],
            tail=_tail(data["tail"]),
            host=data["host"],
            array=data["array"],
            task=data["task"],
            signalled_at=data["signalled_at"],
            stop=data["stop"],
            ready_at=data["ready_at"],
            place=data["place"],
            copy_seconds=data["copy_seconds"],
            copy_bytes=data["copy_bytes"],
            copy_digest=data["copy_digest"],
        )
        checked(segment)
    except Unreadable as exc:
        raise Unreadable(f"{label}: {exc}") from None
    return segment


def _tail(raw: Optional[str]) -> tuple[str, ...]:
    """A segment's stored output tail; one that cannot be read is shown as none."""
    try:
        lines = json.loads(raw) if raw else []
    except ValueError:
        return ()
    return tuple(line for line in lines if isinstance(line, str)) if isinstance(lines, list) else ()


def decode_event(row: sqlite3.Row) -> Event:
    """An event as stored; a damaged one still shows, saying what is wrong with it."""
    at, segment, message = row["at"], row["segment"], row["message"]
    problems = [
        f"{name} is {brief(value)}"
        for name, value, hint in (("at", at, float), ("message", message, str))
        if not fits(hint)(value)
    ]
    return Event(
        id=row["id"],
        chain_id=word(row["chain_id"]),
        segment=segment if fits(Optional[int])(segment) else None,
        at=float(at) if fits(float)(at) else 0.0,
        kind=word(row["kind"]),
        message=f"(event {row['id']} is damaged: {'; '.join(problems)})" if problems else message,
    )
