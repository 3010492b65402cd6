"""The Son of Grid Engine backend: qsub, qstat -xml, qacct and qdel, built and parsed.

Paths travel on qsub's command line (quoted by the transport); the ``#$``
directives hold the tag, the shell, the limit and the queue, then the user's
options verbatim. Every behaviour relied on here was measured on a real SGE
8.1.9 (tests/cluster/sge_facts.md). qstat and qacct print local time without
a zone, so they run under ``TZ=UTC``: a cluster in another zone cannot skew
the times chainrun charges.
"""

from __future__ import annotations

import fnmatch
import re
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, ClassVar, Optional

from chainrun.errors import SchedulerError
from chainrun.model import CommandResult, ListedJob, Outcome, Phase
from chainrun.schedulers.base import (
    HelperFile,
    command_error,
    count_of,
    directive_words,
    option_words,
    refusal,
    refused_start,
    submitted_id,
)
from chainrun.schedulers.segment import SegmentJob
from chainrun.starts import Start, cannot, expected, starts_now, unknown

UTC_ENV = ["env", "TZ=UTC"]
QSTAT_TIME = "%Y-%m-%dT%H:%M:%S"  # 2026-11-25T22:15:05
QACCT_TIME = "%a %b %d %H:%M:%S %Y"  # Wed Nov 25 22:15:05 2026

# One table from SGE's state letters to ours: (phase, outcome when ended, words).
# A state is a string of letters (qw, hqw, hRwq, Rr, dr, Eqw, ...); the first
# letter of this table found in it decides. d (being deleted) and R
# (rescheduled) only qualify another letter: dr is still running, Rq queued.
STATES: dict[str, tuple[Phase, Optional[Outcome], str]] = {
    "E": (Phase.ENDED, Outcome.FAILED, "error state, SGE will not run it"),
    "s": (Phase.RUNNING, None, "suspended"),
    "S": (Phase.RUNNING, None, "suspended with its queue"),
    "T": (Phase.RUNNING, None, "suspended at a load threshold"),
    "t": (Phase.RUNNING, None, "starting"),
    "r": (Phase.RUNNING, None, ""),
    "h": (Phase.PENDING, None, "held"),  # -hold_jid on a job still queued, or qhold
    "q": (Phase.PENDING, None, ""),
    "w": (Phase.PENDING, None, ""),
}

# qsub/qstat errors that say "qmaster is away, try again", not "this can never work".
TRANSIENT = re.compile(
    r"unable to send message to qmaster|unable to contact qmaster|commlib error|got send error|"
    r"connection refused|receive timeout|temporarily unavailable|try again",
    re.IGNORECASE,
)

# qacct's "failed" codes (man sge_status) that blame the host, not the job:
# prolog/epilog, PE start/stop, a crashed shepherd, daemons, groups.
HOST_FAILURES = frozenset({*range(1, 17), *range(18, 22), 36, 38})

# A tag SGE keeps intact: -N refuses a leading digit, / : @ \ * ? and
# non-ASCII, and qstat -xml mangles < (sge_facts.md, "Job name rules").
TAG_RE = re.compile(r"[A-Za-z][A-Za-z0-9._-]{0,510}\Z")
PATH_REWRITES = re.compile(r",|\$(HOME|USER|JOB_ID|JOB_NAME|HOSTNAME|TASK_ID)")


# What qsub puts before the reason it refuses a job for ("Unable to run job: ...").
_REFUSAL_NOISE = re.compile(r"^(?:Unable to run job: |error: )+", re.IGNORECASE)


def _utc(text: str, fmt: str) -> Optional[float]:
    try:
        return datetime.strptime(text.strip(), fmt).replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return None  # "-/-" for a job that never started


def _error(tool: str, result: CommandResult) -> SchedulerError:
    missing = "is SGE installed and on PATH (source $SGE_ROOT/$SGE_CELL/common/settings.sh)?"
    return command_error(tool, result, TRANSIENT, missing)


def _number(text: str) -> int:
    """The leading integer of a qacct value: ``37  : qmaster ...``, ``137 (Killed)``, ``6s``."""
    m = re.match(r"\s*(\d+)", text)
    return int(m.group(1)) if m else 0


def _acct_state(block: dict[str, str]) -> tuple[Phase, Optional[Outcome]]:
    failed, code = _number(block.get("failed", "")), _number(block.get("exit_status", ""))
    h_rt = re.search(r"\bh_rt=(\d+)", block.get("category", ""))
    wallclock = _number(block.get("ru_wallclock", ""))
    killed_at_limit = code == 137 and h_rt is not None and wallclock >= int(h_rt[1])
    if failed in (24, 25):  # migrating or rescheduled (exit 99): it runs again under this id
        return Phase.PENDING, None
    if failed == 37 or killed_at_limit:  # h_rt: SIGKILL at h_rt + ~1 s, no warning
        return Phase.ENDED, Outcome.TIMEOUT
    if failed in (17, 100):  # killed after it started: qdel (measured: 100 / 137), a limit, its host
        return Phase.ENDED, Outcome.CANCELLED
    if failed in HOST_FAILURES:
        return Phase.ENDED, Outcome.NODE_FAIL
    if failed or code:  # 26-30: output file, shell, working directory, exit 100; or the exit code
        return Phase.ENDED, Outcome.FAILED
    return Phase.ENDED, Outcome.COMPLETED


class SgeScheduler:
    kind: ClassVar[str] = "sge"
    # No s_rt: after its warning SGE holds the h_rt kill back by 90 s and the
    # warning goes to the whole process group, workers included
    # (sge_facts.md, "Signals and limits"). The wrapper's own timer sends the
    # signal ``grace`` seconds before h_rt instead.
    wrapper_signals: ClassVar[bool] = True
    preempting_shell: ClassVar[str] = "false"  # nothing in the job tells it
    # h_rt counts from when the job script starts, after a queue's prolog: measured with a
    # 15 s prolog, a job with h_rt=30 began at once and was killed 30 s after its script began
    # (qacct's start_time is the script's too). So the runner's own start is the job's.
    started_shell: ClassVar[str] = "true"
    granted_shell: ClassVar[str] = ""  # no range of limits: a range runs for its longest
    shape_hint: ClassVar[str] = "qconf -sql lists the queues, qstat -f their hosts and slots"

    def gpus_asked(self, options: Sequence[str]) -> int:
        """``-l gpu=N`` (or ``gpus=N``) in a resource list."""
        words = option_words(options)
        return sum(
            count_of(count)
            for word, value in zip(words, words[1:])
            if word == "-l"
            for name, _, count in (item.partition("=") for item in value.split(","))
            if name in ("gpu", "gpus")
        )

    def helper_files(self) -> list[HelperFile]:
        return []  # its tools are the cluster's own

    def directives(self, job: SegmentJob) -> list[str]:
        spec = job.spec
        if not TAG_RE.match(job.tag):
            raise SchedulerError(f"sge: {job.tag!r} is not a job name SGE keeps intact", transient=False)
        lines = [
            f"#$ -N {job.tag}",
            "#$ -S /bin/bash",
            "#$ -j y",
            f"#$ -l h_rt={job.walltime}",
            "#$ -V",  # like Slurm's --export=ALL: SGE resets PATH otherwise
        ]
        if spec.scheduler.queue:
            lines.append(f"#$ -q {spec.scheduler.queue}")
        return lines + [f"#$ {opt}" for opt in spec.scheduler.options]

    def submit_argv(self, job: SegmentJob) -> list[str]:
        # -o takes "[host:]path[,...]": a leading ":" keeps a ":" in the path,
        # nothing keeps a ","; and in -o and -wd SGE replaces $HOME, $USER, ...
        # (a prefix is enough: $HOMEx too), but not $x, ${JOB_ID} (measured).
        if PATH_REWRITES.search(job.log_path):
            raise SchedulerError(
                f"sge: qsub cannot write the log {job.log_path!r}: SGE splits -o paths at ',' "
                "and replaces $HOME, $USER, $JOB_ID, $JOB_NAME, $HOSTNAME and $TASK_ID in them; "
                "use a workdir without these",
                transient=False,
            )
        argv = ["qsub", "-terse", "-o", ":" + job.log_path, "-wd", job.spec.workdir]
        if job.after:
            argv += ["-hold_jid", job.after]
        return [*argv, job.script_path]

    def shape_argv(self, job: SegmentJob) -> list[str]:
        # -w v: the qmaster verifies the job could run in an empty cluster, queueing nothing.
        words = directive_words(self.directives(job), "#$ ")
        return ["qsub", "-w", "v", *words, "-b", "y", "true"]

    def shape_explain_argvs(self, job: SegmentJob, refused: CommandResult) -> list[list[str]]:
        # -w v weighs an empty cluster: its refusal needs no explaining.
        return []

    def parse_shape(self, job: SegmentJob, results: Sequence[CommandResult]) -> str:
        return refusal("qsub -w v", results[0], TRANSIENT, _REFUSAL_NOISE)

    def start_argvs(self, job: SegmentJob) -> list[list[str]]:
        # SGE reckons no start: the shape question first (a queue it does not have, a PE),
        # then the queues' slots and states, then every user's jobs with their limits.
        return [self.shape_argv(job), ["qstat", "-g", "c"], [*UTC_ENV, "qstat", "-xml", "-r", "-u", "*"]]

    def parse_start(self, job: SegmentJob, results: Sequence[CommandResult], now: float) -> Start:
        """Now when the job's queues have a free slot and no job waits for one ahead of it;
        else when enough running jobs reach their ``h_rt`` to free a slot for it and for each
        job pending ahead (an upper bound for them, and pending jobs of higher priority may
        come first: "about"); "not known when" if the jobs there have no ``h_rt``. A queue
        all of whose slots are disabled, suspended, in alarm or unknown cannot start it. The
        segment is taken to need one slot (a parallel environment's count is not read)."""
        failed = refused_start("qsub -w v", results[0], TRANSIENT, _REFUSAL_NOISE, "qmaster")
        if failed is not None:
            return failed
        if not results[1].ok:
            return cannot(f"qstat -g c: {results[1].describe()}")
        words = directive_words(self.directives(job), "#$ ")
        asked = [q.split("@")[0] for w, v in zip(words, words[1:]) if w == "-q" for q in v.split(",")]

        def ours(queue: str) -> bool:
            return not asked or any(fnmatch.fnmatchcase(queue.split("@")[0], q) for q in asked)

        rows = [r for r in _queue_summary(results[1].stdout) if ours(r.name)]
        names = ", ".join(r.name for r in rows) or ", ".join(asked)
        total, free = sum(r.total for r in rows), sum(r.avail for r in rows)
        if not total:
            return cannot(f"queue {names} has no slots (qstat -g c)")
        if free == 0 and sum(r.blocked for r in rows) >= total:
            return cannot(f"queue {names} is disabled, suspended, in alarm or unknown (qstat -g c)")
        listed = _running_ends_and_ahead(results[2], ours)
        ends, ahead = listed or ([], 0)
        slots = f"{free} of {total} slot{'s' * (total > 1)} free on queue {names}"
        if ahead:
            slots += f", {ahead} job{'s' * (ahead > 1)} pending"
        if listed is None:
            slots += "; its jobs not read (qstat -xml -r -u '*' failed)"
        if free > ahead:
            return starts_now(now, slots)
        needed = ahead - free  # the running jobs that must end first: this one's slot is the next
        if needed < len(ends):
            return expected(
                max(now, sorted(ends)[needed]), now, f"when running jobs reach their h_rt; {slots}"
            )
        return unknown(now, slots)

    def parse_submit(self, result: CommandResult) -> str:
        if not result.ok:
            raise _error("qsub", result)
        return submitted_id("qsub", result, ".")  # -terse: the bare id ("ID.1-N:1" for an array job)

    def poll_argv(self) -> list[str]:
        return [*UTC_ENV, "qstat", "-xml"]  # without -u: only the caller's jobs

    def parse_poll(self, result: CommandResult) -> dict[str, ListedJob]:
        if not result.ok:
            raise _error("qstat", result)
        try:
            root = ET.fromstring(result.stdout) if result.stdout.strip() else None
        except ET.ParseError as exc:
            raise SchedulerError(f"qstat: unreadable XML ({exc})", transient=True) from exc
        jobs = {}
        # Running jobs under queue_info, pending ones (Eqw too) under job_info. A
        # rescheduled job shows in both (Rr ending, Rq queued): the later one wins.
        for item in root.iter("job_list") if root is not None else ():
            job_id, code = item.findtext("JB_job_number", ""), item.findtext("state", "")
            if "z" in code:
                continue  # finished (qstat -s z): accounting knows how it ended
            phase, outcome, words = next((STATES[c] for c in STATES if c in code), (Phase.RUNNING, None, ""))
            start = item.findtext("JAT_start_time")
            jobs[job_id] = ListedJob(
                job_id=job_id,
                name=item.findtext("JB_name", ""),
                phase=phase,
                outcome=outcome,
                started_at=_utc(start, QSTAT_TIME) if start else None,
                reason=f"{words} ({code})" if words else "",
                stuck=phase is Phase.ENDED,
            )
        return jobs

    def cancel_argv(self, job_ids: list[str]) -> list[str]:
        # qdel of a predecessor releases its -hold_jid successor: successors first.
        return ["qdel", *sorted(job_ids, key=lambda i: int(i) if i.isdigit() else -1, reverse=True)]

    def accounting_argv(self, job_ids: list[str]) -> Optional[list[str]]:
        # qacct -j takes one job (a second -j replaces the first): loop in one round trip.
        return [*UTC_ENV, "sh", "-c", 'for j; do qacct -j "$j"; done', "sh", *job_ids]

    def parse_accounting(self, result: CommandResult) -> dict[str, ListedJob]:
        # No rc check: the loop's status is the last qacct's, and an id not yet in
        # the accounting file ("error: job id N not found") is simply left out.
        jobs = {}
        for chunk in re.split(r"^=+$", result.stdout, flags=re.MULTILINE):
            block = {k: v.strip() for k, _, v in (line.partition(" ") for line in chunk.splitlines())}
            job_id = block.get("jobnumber", "")
            if not job_id:
                continue
            phase, outcome = _acct_state(block)
            failed = " ".join(block.get("failed", "0").split())  # "37 : qmaster enforced h_rt, ..."
            exit_code = _number(block.get("exit_status", ""))
            jobs[job_id] = ListedJob(  # a rerun writes a later block: the last one wins
                job_id=job_id,
                name=block.get("jobname", ""),
                phase=phase,
                outcome=outcome,
                exit_code=exit_code,
                started_at=_utc(block.get("start_time", ""), QACCT_TIME),
                ended_at=_utc(block.get("end_time", ""), QACCT_TIME),
                reason=f"qacct: failed {failed}" if failed != "0" else f"qacct: exit_status {exit_code}",
            )
        return jobs

    def explain_argv(self, job_id: str) -> Optional[list[str]]:
        return ["qstat", "-j", job_id]

    def node_submit_argvs(self, queue: Optional[str]) -> list[list[str]]:
        return [["qconf", "-ss"], ["qconf", "-sel"]]

    def parse_node_submit(self, results: Sequence[CommandResult]) -> str:
        """Only submit hosts (``qconf -ss``) may qsub: every execution host must be one."""
        if len(results) != 2 or not all(r.ok for r in results):
            return ""
        submit, execution = ({h.split(".")[0] for h in r.stdout.split()} for r in results)
        missing = sorted(execution - submit)
        if not missing:
            return ""
        return f"execution hosts {', '.join(missing)} are no submit hosts (qconf -ss)"

    def parse_explain(self, result: CommandResult) -> str:
        # "error reason    1:      11/25/2026 22:15:11 [0:2863]: error: can't chdir to ..."
        found = re.findall(r"^error reason\s+\d+:\s*(?:\S+ \S+ \[[^\]]*\]:\s*)?(.*)$", result.stdout, re.M)
        return "; ".join(dict.fromkeys(r.strip() for r in found if r.strip()))


@dataclass(frozen=True)
class _Queue:
    """One row of ``qstat -g c``: a cluster queue's slots, and those in queue instances that
    are disabled, suspended, in alarm, unknown or in error (its aoACDS and cdsuE columns)."""

    name: str
    avail: int
    total: int
    blocked: int


def _queue_summary(text: str) -> list[_Queue]:
    """``qstat -g c``'s rows, read by its header's names."""
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("---")]
    if not lines:
        return []
    names = lines[0].split()[2:]  # after "CLUSTER QUEUE", the one name with a space in it
    rows = []
    for line in lines[1:]:
        name, *cells = line.split()
        if len(cells) != len(names):
            continue
        n = {k: int(v) if v.isdigit() else 0 for k, v in zip(names, cells)}
        rows.append(
            _Queue(name, n.get("AVAIL", 0), n.get("TOTAL", 0), n.get("aoACDS", 0) + n.get("cdsuE", 0))
        )
    return rows


def _seconds(text: str) -> Optional[int]:
    """A time limit as qstat -r shows it: ``300``, or ``0:5:0`` / ``00:05:00``."""
    parts = text.strip().split(":")
    if not all(p.isdigit() for p in parts) or len(parts) > 3:
        return None
    seconds = 0
    for part in parts:
        seconds = seconds * 60 + int(part)
    return seconds


def _running_ends_and_ahead(
    result: CommandResult, ours: Callable[[str], bool]
) -> Optional[tuple[list[float], int]]:
    """From ``qstat -xml -r -u '*'``: when each slot held in ``ours`` queues frees at the
    latest (start + ``h_rt``; none for a job without one), and how many jobs pend for a slot
    there (waiting for nothing else: no hold, no error). A job holds its slots from dispatch:
    running, being sent to its host (``t``, for seconds or more on a busy host) or suspended,
    as ``qstat -g c`` counts them; only a job in a queue instance has a ``queue_name``. None
    when the listing failed or cannot be read."""
    if not result.ok:
        return None
    try:
        root = ET.fromstring(result.stdout) if result.stdout.strip() else None
    except ET.ParseError:
        return None
    ends: list[float] = []
    ahead = 0
    for item in root.iter("job_list") if root is not None else ():
        state, queue = item.findtext("state", ""), item.findtext("queue_name", "")
        if queue and ours(queue):
            start = _utc(item.findtext("JAT_start_time", ""), QSTAT_TIME)
            limit = next(
                (_seconds(r.text or "") for r in item.iter("hard_request") if r.get("name") == "h_rt"), None
            )
            slots = item.findtext("slots", "1")
            if start is not None and limit is not None:
                ends += [start + limit] * (int(slots) if slots.isdigit() else 1)
        elif state.endswith("qw") and not set(state) & {"h", "E"}:
            wanted = [q.text or "" for q in item.iter("hard_req_queue")]
            ahead += not wanted or any(ours(q) for q in wanted)
    return ends, ahead
