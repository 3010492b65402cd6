"""The read model of ``chainrun status``: what its table shows of a chain (``Glance``) read
in SQL from the few columns it uses, the service's counts, and the chains that cannot be
read back (``DamagedChain``), each with the command that removes it.
"""

from __future__ import annotations

import enum
import json
import re
import shlex
import sqlite3
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

from chainrun.decide.startup import IN_A_ROW, slow_start
from chainrun.model import Chain, ChainState, Outcome, Phase, Segment
from chainrun.store.rows import word

LIVE_STATES = (ChainState.ACTIVE.value, ChainState.STUCK.value)  # the chains a tick moves
_PLAIN_ID = re.compile(r"[A-Za-z0-9._-]+")  # what chainrun's own ids are made of


@dataclass(frozen=True)
class DamagedChain:
    """A chain whose row cannot be read back. The ticks never see it (its jobs, if any,
    are left alone); ``chainrun status`` shows it with how to remove it."""

    id: str  # as stored, escaped where it is not printable
    name: str
    problem: str  # what could not be read, e.g. "state 'bogus' is not one of active, ..."
    jobs: tuple[str, ...]  # job ids of segments not recorded as ended: may still be queued or running
    removal: str  # the shell command that removes it from the database

    @property
    def reason(self) -> str:
        """One line: what is wrong, what chainrun does about it, and the way out."""
        jobs = ""
        if self.jobs:
            jobs = (
                f"; its jobs {', '.join(self.jobs)} may still be queued or running: "
                "cancel them with the scheduler's own command"
            )
        return (
            f"damaged: {self.problem}; the service skips it and `chainrun cancel` cannot act on it"
            f"{jobs}; remove it with: {self.removal}"
        )


# A segment ended so, and never started: it did not run (a queued successor cancelled).
_NOT_RUN = frozenset({Outcome.CANCELLED, Outcome.REJECTED, Outcome.LOST})


def ran(seg: Segment) -> bool:
    """Whether the segment's job ran: a successor cancelled while queued did not."""
    if seg.started_at is not None or seg.phase is Phase.RUNNING:
        return True
    return seg.phase is Phase.ENDED and seg.outcome not in _NOT_RUN


class SegmentGlance(NamedTuple):
    """What ``chainrun status`` reads of a segment that has not ended."""

    n: int
    phase: Phase
    job_id: Optional[str]
    after: Optional[str]
    walltime: int
    started_at: Optional[float]
    retry_at: Optional[float]
    reason: str
    host: Optional[str]


class Glance(NamedTuple):
    """What the status table shows of a chain: a few columns of its row, four fields of
    its spec, its progress's epochs, counts of its segments, and its live segments."""

    id: str
    state: ChainState
    reason: str
    failures: int
    used: float
    epoch: Optional[int]  # the latest progress's
    baseline_epoch: Optional[int]  # the epoch checkpoint_dir held at submission
    target_epoch: Optional[int]
    max_failures: int
    total_time: int
    walltime: int
    max_concurrent: Optional[int]
    segments: int  # how many it has
    ran: int  # how many of them ran (``ran``)
    live: tuple[SegmentGlance, ...]
    name: str = ""  # the job file's name
    sweep: str = ""  # the sweep's name, for a chain of a sweep
    slow_start: str = ""  # its segments barely train: start-up takes most of each (decide.startup)

    @property
    def max_segments(self) -> int:
        """Segments the time budget allows if every one uses its whole walltime."""
        return -(-self.total_time // self.walltime)

    @classmethod
    def of(cls, chain: Chain) -> Glance:
        """The same, from a chain read in full."""
        spec = chain.spec
        live = tuple(
            SegmentGlance(
                s.n, s.phase, s.job_id, s.after, s.walltime, s.started_at, s.retry_at, s.reason, s.host
            )
            for s in chain.live
        )
        return cls(
            chain.id,
            chain.state,
            chain.reason,
            chain.failures,
            chain.used,
            chain.latest.epoch,
            chain.baseline.epoch,
            spec.target_epoch,
            spec.max_failures,
            spec.total_time,
            spec.walltime,
            spec.max_concurrent,
            len(chain.segments),
            sum(1 for s in chain.segments if ran(s)),
            live,
            spec.name,
            spec.sweep_name,
            slow_start(chain.segments),
        )


def damaged(row: sqlite3.Row, segs: list[sqlite3.Row], problem: str, path: str) -> DamagedChain:
    """The chain in ``row`` (with its segments' rows ``segs``), which cannot be read back:
    what is wrong (``problem``), and how to remove it from the database at ``path``."""
    raw = row["id"]
    if isinstance(raw, str) and _PLAIN_ID.fullmatch(raw):
        sql = f"DELETE FROM segments WHERE chain_id = '{raw}'; DELETE FROM chains WHERE id = '{raw}';"
        quoted = f'"{sql}"'  # nothing in it a shell expands inside double quotes
    else:  # an id that is awkward to type: its row's number
        rowid = int(row["rowid_"])
        sql = (
            f"DELETE FROM segments WHERE chain_id = (SELECT id FROM chains WHERE rowid = {rowid});"
            f" DELETE FROM chains WHERE rowid = {rowid};"
        )
        quoted = shlex.quote(sql)
    return DamagedChain(
        id=word(raw),
        name=word(row["name"]),
        problem=problem,
        jobs=tuple(
            word(s["job_id"]) for s in segs if s["job_id"] is not None and s["phase"] != Phase.ENDED.value
        ),
        removal=f"sqlite3 {shlex.quote(path)} {quoted}",
    )


def shown_where(ended_since: Optional[float]) -> tuple[str, tuple[Any, ...]]:
    """The SQL condition on ``chains`` of what `status` shows: the chains that have not
    ended and those that ended after ``ended_since`` (every chain when None)."""
    if ended_since is None:
        return "1", ()
    finals = tuple(s.value for s in ChainState if s.final)
    marks = ", ".join("?" * len(finals))
    return f"(chains.state NOT IN ({marks}) OR chains.ended_at > ?)", (*finals, ended_since)


def _sql_words(kind: type[enum.Enum]) -> str:
    return ", ".join(f"'{m.value}'" for m in kind)


# A JSON column of progress: NULL, or an object whose epoch is a whole number or null.
_PROGRESS_OK = """CASE WHEN c.{0} IS NULL THEN 1
    WHEN typeof(c.{0}) = 'text' AND json_valid(c.{0}) THEN json_type(c.{0}) = 'object'
        AND coalesce(json_type(c.{0}, '$.epoch'), 'null') IN ('integer', 'null')
    ELSE 0 END"""
# The spec's fields the table reads, and a check that the spec is a JSON object in which
# they are of their types.
_SPEC_FIELDS = ("target_epoch", "max_failures", "total_time", "walltime", "max_concurrent")
_SPEC_OK = """CASE WHEN typeof(c.spec) = 'text' AND json_valid(c.spec) THEN json_type(c.spec) = 'object'
        AND json_type(c.spec, '$.target_epoch') IN ('integer', 'null')
        AND json_type(c.spec, '$.max_failures') = 'integer'
        AND json_type(c.spec, '$.total_time') = 'integer' AND json_extract(c.spec, '$.total_time') > 0
        AND json_type(c.spec, '$.walltime') = 'integer' AND json_extract(c.spec, '$.walltime') > 0
        AND coalesce(json_type(c.spec, '$.max_concurrent'), 'null') IN ('integer', 'null')
        AND json_type(c.spec, '$.scheduler') = 'object'
        AND coalesce(json_type(c.spec, '$.scheduler.hosts'), 'array') = 'array'
    ELSE 0 END"""
# Every column of a segment as ``rows.decode_segment`` reads it back.
_SEGMENT_OK = f"""typeof(s.n) = 'integer' AND typeof(s.walltime) = 'integer'
    AND s.phase IN ({_sql_words(Phase)}) AND (s.outcome IS NULL OR s.outcome IN ({_sql_words(Outcome)}))
    AND typeof(s.attempts) = 'integer' AND typeof(s.reason) = 'text'
    AND typeof(s.exit_code) IN ('null', 'integer') AND typeof(s.task) IN ('null', 'integer')
    AND typeof(s.job_id) IN ('null', 'text') AND typeof(s.after) IN ('null', 'text')
    AND typeof(s.host) IN ('null', 'text') AND typeof(s.array) IN ('null', 'text')
    AND typeof(s.retry_at) IN ('null', 'integer', 'real')
    AND typeof(s.submitted_at) IN ('null', 'integer', 'real')
    AND typeof(s.started_at) IN ('null', 'integer', 'real')
    AND typeof(s.ended_at) IN ('null', 'integer', 'real')
    AND typeof(s.missing_since) IN ('null', 'integer', 'real')
    AND typeof(s.signalled_at) IN ('null', 'integer', 'real')
    AND typeof(s.ready_at) IN ('null', 'integer', 'real')"""
_RAN = (
    f"s.started_at IS NOT NULL OR s.phase = '{Phase.RUNNING.value}' OR (s.phase = '{Phase.ENDED.value}'"
    f" AND (s.outcome IS NULL OR s.outcome NOT IN ({', '.join(repr(o.value) for o in _NOT_RUN)})))"
)
_OK = " AND ".join(
    f"({check})"
    for check in (_SPEC_OK, *(_PROGRESS_OK.format(c) for c in ("progress", "latest", "baseline")))
)


def _field(column: str, path: str) -> str:
    """A field of a JSON column; NULL where the column does not parse (the chain is then
    read in full: ``_OK`` is false)."""
    return f"CASE WHEN json_valid({column}) THEN json_extract({column}, '{path}') END"


GLANCE_SQL = f"""SELECT c.rowid, c.id, c.state, c.reason, c.failures, c.used, c.created_at, c.ended_at,
    CASE WHEN {_OK} THEN 1 ELSE 0 END AS ok,
    {_field("coalesce(c.latest, c.progress)", "$.epoch")}, {_field("c.baseline", "$.epoch")},
    {", ".join(_field("c.spec", f"$.{name}") for name in _SPEC_FIELDS)},
    count(s.rowid), sum(CASE WHEN s.rowid IS NOT NULL AND ({_RAN}) THEN 1 ELSE 0 END),
    sum(CASE WHEN s.rowid IS NULL OR ({_SEGMENT_OK}) THEN 0 ELSE 1 END),
    c.name, coalesce({_field("c.spec", "$.sweep_name")}, ''),
    (SELECT json_group_array(json_array(t.n, t.outcome, t.started_at, t.signalled_at, t.ready_at))
     FROM (SELECT * FROM segments t WHERE t.chain_id = c.id AND t.started_at IS NOT NULL
        AND t.outcome IS NOT NULL ORDER BY t.n DESC LIMIT {IN_A_ROW}) t)
FROM chains c LEFT JOIN segments s ON s.chain_id = c.id
WHERE {{picked}} GROUP BY c.rowid ORDER BY c.created_at, c.rowid"""
SEGMENT_GLANCE_SQL = f"""SELECT c.rowid,
    s.n, s.phase, s.job_id, s.after, s.walltime, s.started_at, s.retry_at, s.reason, s.host
FROM chains c JOIN segments s ON s.chain_id = c.id
WHERE {{picked}} AND s.phase != '{Phase.ENDED.value}' ORDER BY c.rowid, s.n"""

_STATES = {m.value: m for m in ChainState}
_PHASES = {m.value: m for m in Phase}
_NUMBER = frozenset({int, float})
_MAYBE_NUMBER = frozenset({int, float, type(None)})
_MAYBE_TEXT = frozenset({str, type(None)})


def read_glance(r: sqlite3.Row, live: list[Optional[SegmentGlance]]) -> Optional[Glance]:
    """A row of ``GLANCE_SQL`` with its live segments as the table shows them; None when
    any of it is not as chainrun writes it (the chain is then read in full)."""
    (_, id_, state, reason, failures, used, created, ended, ok) = r[:9]
    segments_ok = not r[18] and None not in live
    row_ok = type(id_) is str and id_.isprintable() and id_ != "" and type(reason) is str
    numbers_ok = type(failures) is int and type(used) in _NUMBER and type(created) in _NUMBER
    if not (ok and segments_ok and row_ok and numbers_ok and type(ended) in _MAYBE_NUMBER):
        return None
    if state not in _STATES:
        return None
    epoch, base, target, max_failures, total, walltime, concurrent, count, ran = r[9:18]
    name, sweep = r[19:21]
    if type(name) is not str or type(sweep) is not str:
        return None
    segs = tuple(s for s in live if s is not None)
    return Glance(
        id_,
        _STATES[state],
        reason,
        failures,
        used,
        epoch,
        base,
        target,
        max_failures,
        total,
        walltime,
        concurrent,
        count,
        ran,
        segs,
        name,
        sweep,
        _last_ran(id_, walltime, r[21]),
    )


def _last_ran(chain_id: str, walltime: int, text: Any) -> str:
    """``decide.startup.slow_start`` of the segments in ``GLANCE_SQL``'s last column (the last
    that ran); "" where any of them is not as chainrun writes it."""
    try:
        rows = json.loads(text) if type(text) is str else []
        segs = [
            Segment(
                chain_id,
                n,
                walltime,
                Phase.ENDED,
                outcome=Outcome(o),
                started_at=a,
                signalled_at=s,
                ready_at=r,
            )
            for n, o, a, s, r in sorted(rows)
            if type(n) is int and {type(a), type(s), type(r)} <= _MAYBE_NUMBER
        ]
    except (ValueError, TypeError):
        return ""
    return slow_start(segs) if len(segs) == len(rows) else ""


def read_segment_glance(r: sqlite3.Row) -> Optional[SegmentGlance]:
    """A row of ``SEGMENT_GLANCE_SQL``; None when it is not as chainrun writes it."""
    (_, n, phase, job_id, after, walltime, started, retry, reason, host) = r
    if type(n) is not int or type(walltime) is not int or phase not in _PHASES or type(reason) is not str:
        return None
    if type(job_id) not in _MAYBE_TEXT or type(after) not in _MAYBE_TEXT or type(host) not in _MAYBE_TEXT:
        return None
    if type(started) not in _MAYBE_NUMBER or type(retry) not in _MAYBE_NUMBER:
        return None
    return SegmentGlance(n, _PHASES[phase], job_id, after, walltime, started, retry, reason, host)


SUMMARY_SQL = """SELECT
    (SELECT COUNT(*) FROM chains c WHERE c.state IN (?, ?) AND EXISTS
     (SELECT 1 FROM segments s WHERE s.chain_id = c.id AND s.phase = 'running')) AS running,
    (SELECT COUNT(*) FROM chains c WHERE c.state IN (?, ?) AND EXISTS
     (SELECT 1 FROM segments s WHERE s.chain_id = c.id AND s.phase = 'pending')) AS queued,
    (SELECT COUNT(*) FROM chains WHERE state IN (?, ?)) AS active,
    (SELECT COUNT(*) FROM chains WHERE state = 'stuck') AS stuck,
    (SELECT COUNT(*) FROM chains WHERE state = 'failed') AS failed"""


# Per chain, the time its segments held an allocation (start to end; a running one up to
# ``?``: now, at most its walltime) and the part of it before the signal: the accounting's
# totals (``chainrun.accounting``) for a table of every chain, in one query.
ALLOCATION_SQL = """SELECT chain_id,
    sum(max(0, coalesce(ended_at, min(?1, started_at + walltime)) - started_at)),
    sum(max(0, coalesce(CASE WHEN signalled_at BETWEEN started_at AND ended_at THEN signalled_at END,
        ended_at, min(?1, started_at + walltime)) - started_at))
FROM segments WHERE typeof(started_at) IN ('integer', 'real') AND typeof(walltime) = 'integer'
    AND (ended_at IS NOT NULL OR phase = 'running') GROUP BY chain_id"""

# Per chain and metric, the lowest and highest value its progress records held: a sweep's
# best values without decoding every record (``?``: a JSON array of the chains' ids).
METRIC_RANGE_SQL = """SELECT p.chain_id, json_extract(m.value, '$[0]'), min(json_extract(m.value, '$[1]')),
    max(json_extract(m.value, '$[1]'))
FROM progress_log p, json_each(p.progress, '$.metrics') m
WHERE p.chain_id IN (SELECT value FROM json_each(?)) AND json_valid(p.progress)
    AND json_type(m.value) = 'array' AND json_type(m.value, '$[1]') IN ('integer', 'real')
GROUP BY p.chain_id, json_extract(m.value, '$[0]')"""
