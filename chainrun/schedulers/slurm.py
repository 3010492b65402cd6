"""The Slurm backend: sbatch, squeue, sacct and scancel, built and parsed.

Paths travel on sbatch's command line (quoted by the transport), so nothing
from the job file needs quoting inside ``#SBATCH`` lines; the directives hold
the tag, limits and signal, then the user's options verbatim.

A sweep's first segments may go out as one job array (``ArrayScheduler``):
``squeue --array`` lists each task on a line of its own as ``BASE_INDEX``
(pending ones too), and ``--dependency=afterany:``, ``scancel`` and
``sacct --jobs=`` all take that form, so a task is a job like any other here.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import ClassVar, Optional

from chainrun.errors import SchedulerError
from chainrun.model import CommandResult, ListedJob, Outcome, Phase
from chainrun.schedulers.base import (
    HelperFile,
    ListingMemo,
    command_error,
    count_of,
    directive_words,
    option_words,
    refusal,
    refused_start,
    submitted_id,
)
from chainrun.schedulers.segment import SegmentJob
from chainrun.starts import Start, cannot, expected

# Times as epoch seconds: Slurm prints local time without a zone otherwise, and
# the service may run in another zone than the cluster (over SSH).
EPOCH_ENV = ["env", "SLURM_TIME_FORMAT=%s"]

# squeue and sacct fields; "|" cannot occur in any of them but the name, which is our tag.
SQUEUE_FORMAT = "%i|%j|%T|%r|%S|%e|%N"
SACCT_FORMAT = "JobID,JobName,State,ExitCode,Start,End"

# One table from Slurm's job states to ours: (phase, outcome when ended).
STATES: dict[str, tuple[Phase, Optional[Outcome]]] = {
    "PENDING": (Phase.PENDING, None),
    "REQUEUED": (Phase.PENDING, None),
    "REQUEUE_HOLD": (Phase.PENDING, None),
    "REQUEUE_FED": (Phase.PENDING, None),
    "CONFIGURING": (Phase.RUNNING, None),
    "RUNNING": (Phase.RUNNING, None),
    "COMPLETING": (Phase.RUNNING, None),  # ending: the verdict comes next
    "SUSPENDED": (Phase.RUNNING, None),
    "STOPPED": (Phase.RUNNING, None),
    "SIGNALING": (Phase.RUNNING, None),
    "STAGE_OUT": (Phase.RUNNING, None),
    "RESIZING": (Phase.RUNNING, None),
    "RESV_DEL_HOLD": (Phase.PENDING, None),
    "COMPLETED": (Phase.ENDED, Outcome.COMPLETED),
    "FAILED": (Phase.ENDED, Outcome.FAILED),
    "TIMEOUT": (Phase.ENDED, Outcome.TIMEOUT),
    "DEADLINE": (Phase.ENDED, Outcome.TIMEOUT),
    "PREEMPTED": (Phase.ENDED, Outcome.PREEMPTED),
    "NODE_FAIL": (Phase.ENDED, Outcome.NODE_FAIL),
    "BOOT_FAIL": (Phase.ENDED, Outcome.NODE_FAIL),
    "OUT_OF_MEMORY": (Phase.ENDED, Outcome.OOM),
    "CANCELLED": (Phase.ENDED, Outcome.CANCELLED),
    "REVOKED": (Phase.ENDED, Outcome.CANCELLED),
    "SPECIAL_EXIT": (Phase.ENDED, Outcome.FAILED),
}

# sbatch/squeue errors that say "try again later", not "this can never work".
TRANSIENT = re.compile(
    r"socket timed out|unable to contact slurm controller|temporarily unavailable|"
    r"temporarily unable|connection refused|zero bytes were transmitted|"
    r"slurm_persist_conn|communication connection failure|not responding|"
    r"resource temporarily|try again|job submit/allocate failed: .*time",
    re.IGNORECASE,
)

# sinfo's short states (%t) of a node that is down or failed; a trailing "*": not responding.
DOWN_STATES = frozenset({"down", "fail", "failg"})

# What sbatch puts before the reason it refuses a job for ("sbatch: error: ...",
# "allocation failure: Requested node configuration is not available").
_REFUSAL_NOISE = re.compile(r"^(?:sbatch: (?:error: )?|allocation failure: )+", re.IGNORECASE)

# sbatch --test-only's refusal for a shape no node it weighs can take.
_NO_NODE_FITS = "Requested node configuration is not available"
# sinfo's short states (%t) of a node that takes jobs now; any other (down, drain, drng, unk,
# fail, maint, resv, ...) or a trailing "*" (not responding) is left out of --test-only's
# weighing. Power-saving marks ("~", "#", "%") are not: such a node is booted for a job.
_TAKES_JOBS = frozenset({"idle", "mix", "alloc", "comp", "plnd"})

# sbatch --test-only's answer (on stderr): "sbatch: Job 5429 to start at 1795946616 using 1
# processors on nodes node3 in partition multi" (SLURM_TIME_FORMAT=%s).
_WILL_START = re.compile(r"to start at (\d+) using \d+ processors on nodes (\S+) in partition (\S+)")
# Pending jobs that wait for nothing but their turn (not a dependency, a hold or a begin time).
_NOT_AHEAD = ("Dependency", "DependencyNeverSatisfied", "JobHeldUser", "JobHeldAdmin", "BeginTime")

# --gres=gpu:2, --gres=gpu:a100:2, --gres=gpu (one), in a comma list of resources.
_GRES_GPU = re.compile(r"^gpu(?::[A-Za-z][\w.-]*)?(?::(\d+))?$")


def slurm_time(seconds: int) -> str:
    """Slurm's --time has minute resolution: round up, so the wrapper's deadline comes first."""
    minutes = max(1, -(-seconds // 60))
    days, rest = divmod(minutes, 1440)
    return f"{days}-{rest // 60:02d}:{rest % 60:02d}:00"


def _words(line: str) -> list[tuple[str, str]]:
    """``Key=Value`` words of an ``scontrol --oneliner`` line."""
    return [tuple(w.split("=", 1)) for w in line.split() if "=" in w]  # type: ignore[misc]


def hostlist(text: str) -> Optional[set[str]]:
    """The hosts of a Slurm hostlist (``vm``, ``node[01-03,7],login1``); None for one this
    cannot read."""
    items, depth, word = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            items.append(word)
            word = ""
        else:
            word += ch
    items.append(word)
    hosts: set[str] = set()
    for item in filter(None, items):
        match = re.fullmatch(r"([^\[\]]*)\[([0-9,-]+)\]([^\[\]]*)", item)
        if match is None:
            if "[" in item or "]" in item:
                return None
            hosts.add(item)
            continue
        prefix, ranges, suffix = match.groups()
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            if not first.isdigit() or (last and not last.isdigit()):
                return None
            hosts.update(
                f"{prefix}{i:0{len(first)}d}{suffix}" for i in range(int(first), int(last or first) + 1)
            )
    return hosts


def _partitions(words: Sequence[str]) -> Optional[set[str]]:
    """The partitions sbatch's ``words`` ask for (--partition=P, --partition P, -p P, -pP; the
    last wins; a comma list); None for the default partition."""
    asked: Optional[set[str]] = None
    for word, following in zip(words, [*words[1:], ""]):
        if word.startswith("--partition="):
            value = word.partition("=")[2]
        elif word in ("-p", "--partition"):
            value = following
        elif word.startswith("-p") and len(word) > 2:
            value = word[2:]
        else:
            continue
        asked = set(filter(None, value.split(",")))
    return asked


def _away(listing: str, partitions: Optional[set[str]]) -> list[str]:
    """The nodes of ``partitions`` (None: the default one) that cannot take a job now, as
    "node3 (drain)", from sinfo's ``%P|%t|%N`` lines (the default partition's name ends in "*")."""
    away: list[str] = []
    for line in listing.splitlines():
        name, _, rest = line.strip().partition("|")
        state, _, nodes = rest.partition("|")
        ours = name.endswith("*") if partitions is None else name.rstrip("*") in partitions
        if ours and state.rstrip("~#%!@^-") not in _TAKES_JOBS:
            away.append(f"{nodes} ({state})")
    return list(dict.fromkeys(away))


def _stamp(text: str) -> Optional[float]:
    """A time printed under SLURM_TIME_FORMAT=%s; "N/A", "NONE", "Unknown" are no time."""
    return float(text) if text.strip().isdigit() else None


def _error(tool: str, result: CommandResult) -> SchedulerError:
    return command_error(tool, result, TRANSIENT, "is Slurm installed and on PATH?")


def _fields(line: str, count: int) -> Optional[list[str]]:
    """The ``count`` fields of one squeue/sacct line: id, name, then the rest. The name is
    the one field that may hold "|" (the user's other jobs), so it is what is left between."""
    job_id, _, rest = line.partition("|")
    fields = rest.rsplit("|", count - 2)
    return [job_id.strip(), *fields] if len(fields) == count - 1 else None


def _state(text: str) -> tuple[Phase, Optional[Outcome]]:
    """Phase and outcome of a state as squeue and sacct print it ("CANCELLED by 0", "COMPLETING+")."""
    return STATES.get(text.split()[0].rstrip("+") if text.strip() else "", (Phase.RUNNING, None))


def _exit_code(text: str, outcome: Optional[Outcome]) -> Optional[int]:
    """sacct's ExitCode "code:signal" as a shell reports it: 128+signal for a script a signal
    killed. Slurm's own mark (0:125 for OUT_OF_MEMORY) and the 0:0 it shows for jobs it
    ended itself (TIMEOUT, NODE_FAIL, ...) are no exit code."""
    code, _, sig = text.partition(":")
    signum = int(sig) if sig.isdigit() else 0
    if 0 < signum < 65:
        return 128 + signum
    if signum or not code.isdigit():
        return None
    if int(code) == 0 and outcome not in (Outcome.COMPLETED, Outcome.FAILED):
        return None
    return int(code)


def _listed(line: str) -> Optional[ListedJob]:
    """One line of ``squeue --format=SQUEUE_FORMAT``; None for one that is not a job's."""
    fields = _fields(line, 7)
    if fields is None:
        return None
    job_id, name, state, reason, start, end, nodes = fields
    if reason == "DependencyNeverSatisfied":  # a user option's dependency failed: never runs
        return ListedJob(job_id, name, Phase.ENDED, Outcome.FAILED, reason=reason, stuck=True)
    phase, outcome = _state(state)
    return ListedJob(
        job_id=job_id,
        name=name,
        phase=phase,
        outcome=outcome,
        started_at=_stamp(start) if phase is not Phase.PENDING else None,
        ended_at=_stamp(end) if phase is Phase.ENDED else None,
        reason=state if phase is Phase.ENDED else ("" if reason == "None" else reason),
        nodes=nodes.strip() if phase is Phase.ENDED else "",
    )


_POLLED = ListingMemo(_listed)  # squeue's last listing


class SlurmScheduler:
    kind: ClassVar[str] = "slurm"
    wrapper_signals: ClassVar[bool] = False
    # A job being preempted has a PreemptTime; with SlurmctldParameters=preempt_send_user_signal
    # its --signal comes then, at the start of the partition's GraceTime.
    # Each question about the job asks by the id the listing lists it under: an array task by
    # its BASE_INDEX (CHAINRUN_JOB_ID), since the last task's own id is the base's, which names
    # every task.
    preempting_shell: ClassVar[str] = (
        '[ -n "${SLURM_JOB_ID:-}" ] && timeout 20 scontrol show job "${CHAINRUN_JOB_ID:-$SLURM_JOB_ID}"'
        ' 2>/dev/null | grep -Eq "(^|[[:space:]])PreemptTime=[0-9]"'
    )
    # Slurm 23.02 and later tell the job its start; before, the controller does.
    started_shell: ClassVar[str] = (
        'echo "${SLURM_JOB_START_TIME:-$([ -n "${SLURM_JOB_ID:-}" ] && SLURM_TIME_FORMAT=%s timeout 20'
        ' squeue --noheader --jobs="${CHAINRUN_JOB_ID:-$SLURM_JOB_ID}" --format=%S)}"'
    )
    # The limit backfill granted a job asked with --time-min (none in the job's environment).
    granted_shell: ClassVar[str] = (
        '[ -n "${SLURM_JOB_ID:-}" ] && timeout 20 squeue --noheader'
        ' --jobs="${CHAINRUN_JOB_ID:-$SLURM_JOB_ID}" --format=%l'
    )
    shape_hint: ClassVar[str] = "sinfo -o '%P %l %D %c %G' shows partitions' limits, nodes, CPUs, GPUs"
    max_tasks: ClassVar[int] = 1000
    task_index_shell: ClassVar[str] = "${SLURM_ARRAY_TASK_ID:-}"
    task_id_shell: ClassVar[str] = "${SLURM_ARRAY_JOB_ID:-}_${SLURM_ARRAY_TASK_ID:-}"

    def gpus_asked(self, options: Sequence[str]) -> int:
        """``--gres=gpu[:TYPE]:N`` and ``--gpus-per-node`` (per node, times ``--nodes``),
        ``--gpus[=TYPE:]N`` and ``-G N`` (the whole job)."""
        words = option_words(options)
        nodes, per_node, total = 1, 0, 0
        for i, word in enumerate(words):
            value = words[i + 1] if i + 1 < len(words) else ""
            if word in ("--nodes", "-N") and value.split("-")[0].isdigit():
                nodes = int(value.split("-")[0])
            elif word == "--gres":
                for item in value.split(","):
                    found = _GRES_GPU.match(item)
                    if found:
                        per_node += int(found.group(1) or 1)
            elif word == "--gpus-per-node":
                per_node += count_of(value)
            elif word in ("--gpus", "-G"):
                total += count_of(value)
            elif word.startswith("-G") and word[2:].isdigit():
                total += int(word[2:])
        return total + per_node * nodes

    def helper_files(self) -> list[HelperFile]:
        return []  # its tools are the cluster's own

    def directives(self, job: SegmentJob) -> list[str]:
        return self.array_directives(job, job.tag)

    def array_directives(self, job: SegmentJob, name: str) -> list[str]:
        spec = job.spec
        lines = [
            f"#SBATCH --job-name={name}",
            f"#SBATCH --comment={name}",
            f"#SBATCH --time={slurm_time(job.walltime)}",
            f"#SBATCH --signal=B:{spec.signal}@{spec.grace}",
            "#SBATCH --open-mode=append",
            "#SBATCH --export=ALL",
        ]
        if job.shortest:  # backfill may start it sooner with a limit cut down, to this at least
            lines.append(f"#SBATCH --time-min={slurm_time(job.shortest)}")
        if spec.scheduler.queue:
            lines.append(f"#SBATCH --partition={spec.scheduler.queue}")
        lines += [f"#SBATCH {opt}" for opt in spec.scheduler.options]
        return lines

    def submit_argv(self, job: SegmentJob) -> list[str]:
        argv = [
            "sbatch",
            "--parsable",
            f"--output={job.log_path}",
            f"--chdir={job.spec.workdir}",
        ]
        if job.after:
            argv.append(f"--dependency=afterany:{job.after}")
        return [*argv, job.script_path]

    def shape_argv(self, job: SegmentJob) -> list[str]:
        # --test-only: slurmctld answers when the job would start, queueing nothing. It reads
        # the same options from the command line as from the script's #SBATCH lines.
        words = directive_words(self.directives(job), "#SBATCH ")
        return ["sbatch", "--test-only", "--output=/dev/null", *words, "--wrap=true"]

    def shape_explain_argvs(self, job: SegmentJob, refused: CommandResult) -> list[list[str]]:
        # sinfo: which nodes of which partitions cannot take a job now; then the question once
        # more, whose refusal, asked after a listing with every node back, is one that stands.
        if _NO_NODE_FITS not in refused.stderr + refused.stdout:
            return []
        return [["sinfo", "--noheader", "--format=%P|%t|%N"], self.shape_argv(job)]

    def parse_shape(self, job: SegmentJob, results: Sequence[CommandResult]) -> str:
        """Slurm's reason it would never start ``job``. --test-only weighs only the nodes that
        can take a job now: a shape that would fit were a drained, down, or not yet registered
        node of its partition back (every node, for seconds after slurmctld restarts) is
        refused as one that never fits. While such a node is away that refusal tells nothing,
        and nothing can be told now (a transient SchedulerError). When sinfo shows every node
        of the partition back, the answer is the question's, asked again after that listing:
        a node that registered between the first refusal and sinfo would have fitted."""
        reason = refusal("sbatch --test-only", results[0], TRANSIENT, _REFUSAL_NOISE)
        if _NO_NODE_FITS not in reason:
            return reason
        listing = results[1] if len(results) > 1 else None
        if listing is None or not listing.ok:
            raise SchedulerError(
                f"sbatch --test-only: {reason}; sinfo did not say which nodes are away", transient=True
            )
        away = _away(listing.stdout, _partitions(directive_words(self.directives(job), "#SBATCH ")))
        if away:
            raise SchedulerError(
                f"sbatch --test-only: {reason}, but it weighs only the nodes that can take a job now, "
                f"and {', '.join(away)} cannot",
                transient=True,
            )
        return refusal("sbatch --test-only", results[2], TRANSIENT, _REFUSAL_NOISE)

    def start_argvs(self, job: SegmentJob) -> list[list[str]]:
        # The shape question answers with the start too; sinfo then says whether its partition
        # is up, squeue how many jobs pend there for their turn (all users').
        return [
            [*EPOCH_ENV, *self.shape_argv(job)],
            ["sinfo", "--noheader", "--format=%R|%a"],
            ["squeue", "--noheader", "--states=PENDING", "--format=%P|%r"],
        ]

    def parse_start(self, job: SegmentJob, results: Sequence[CommandResult], now: float) -> Start:
        """``sbatch --test-only``'s start, which on Slurm 22.05 does not see the backfill
        scheduler's plan for pending jobs (slurm_facts.md, "Asking without submitting"): it
        answers as if nothing pended, so the jobs pending in the partition are counted beside
        it (an estimate that may be early), and a partition sinfo does not show ``up`` cannot
        start it, whatever the estimate."""
        failed = refused_start("sbatch --test-only", results[0], TRANSIENT, _REFUSAL_NOISE, "slurmctld")
        if failed is not None:
            return failed
        found = _WILL_START.search(results[0].stderr + results[0].stdout)
        if found is None:
            return cannot(f"sbatch --test-only: unexpected answer {results[0].stderr.strip()[:200]!r}")
        at, nodes, partition = float(found.group(1)), found.group(2), found.group(3)
        if len(results) > 1 and results[1].ok:
            for line in results[1].stdout.splitlines():
                name, _, avail = line.strip().partition("|")
                if name == partition and avail != "up":
                    return cannot(f"partition {partition} is {avail} (sinfo)")
        how = f"on {nodes} in partition {partition}, sbatch --test-only"
        if len(results) > 2 and results[2].ok:
            ahead = sum(
                partition in parts.split(",") and reason not in _NOT_AHEAD
                for parts, _, reason in (
                    line.strip().partition("|") for line in results[2].stdout.splitlines()
                )
            )
            if ahead:
                how += f"; {ahead} job{'s' * (ahead > 1)} pending there, which it does not count"
        return expected(at, now, how)

    def array_submit_argv(
        self, script_path: str, log_path: str, workdir: str, indices: Sequence[int], limit: Optional[int]
    ) -> list[str]:
        tasks = ",".join(str(i) for i in indices)
        if list(indices) == list(range(indices[0], indices[0] + len(indices))) and len(indices) > 1:
            tasks = f"{indices[0]}-{indices[-1]}"
        return [
            "sbatch",
            "--parsable",
            f"--array={tasks}" + (f"%{limit}" if limit else ""),
            f"--output={log_path}",
            f"--chdir={workdir}",
            script_path,
        ]

    def task_id(self, base: str, index: int) -> str:
        return f"{base}_{index}"

    def task_index(self, job_id: str) -> Optional[int]:
        base, _, index = job_id.partition("_")
        return int(index) if base.isdigit() and index.isascii() and index.isdigit() else None

    def parse_submit(self, result: CommandResult) -> str:
        if not result.ok:
            raise _error("sbatch", result)
        return submitted_id("sbatch", result, ";")  # --parsable: "jobid" or "jobid;cluster"

    def poll_argv(self) -> list[str]:
        # --array: one line per array task ("123_4"), pending ones too, never "123_[5-9%2]".
        return [
            *EPOCH_ENV,
            "squeue",
            "--me",
            "--array",
            "--noheader",
            "--states=all",
            f"--format={SQUEUE_FORMAT}",
        ]

    def parse_poll(self, result: CommandResult) -> dict[str, ListedJob]:
        if not result.ok:
            raise _error("squeue", result)
        return _POLLED.jobs(result.stdout)

    def cancel_argv(self, job_ids: list[str]) -> list[str]:
        return ["scancel", *job_ids]

    def accounting_argv(self, job_ids: list[str]) -> Optional[list[str]]:
        # --allocations: the job's own line, not its steps'; without --duplicates a requeued
        # job shows only its latest run. With --jobs, sacct looks back to the epoch.
        return [
            *EPOCH_ENV,
            "sacct",
            "--noheader",
            "--parsable2",
            "--allocations",
            "--jobs=" + ",".join(job_ids),
            f"--format={SACCT_FORMAT}",
        ]

    def parse_accounting(self, result: CommandResult) -> dict[str, ListedJob]:
        if not result.ok:
            # "Slurm accounting storage is disabled", or slurmdbd away: no answer, and the
            # engine goes on without one (a job nothing knows of ends "lost" in the end).
            return {}
        jobs = {}
        for line in result.stdout.splitlines():
            fields = _fields(line, 6)
            if fields is None:
                continue
            job_id, name, state, exit_code, start, end = fields
            phase, outcome = _state(state)
            jobs[job_id] = ListedJob(
                job_id=job_id,
                name=name,
                phase=phase,
                outcome=outcome,
                exit_code=_exit_code(exit_code, outcome) if phase is Phase.ENDED else None,
                started_at=_stamp(start) if phase is not Phase.PENDING else None,  # else: expected
                ended_at=_stamp(end) if phase is Phase.ENDED else None,
                reason=f"{state} (sacct)",
            )
        return jobs

    def explain_argv(self, job_id: str) -> Optional[list[str]]:
        return None  # no state here holds a job forever

    def down_argv(self, nodes: str) -> list[str]:
        return ["sinfo", "--noheader", "--Node", f"--nodes={nodes}", "--format=%N|%t"]

    def parse_down(self, result: CommandResult) -> list[str]:
        """Nodes down, failed or not responding (``down*``, ``idle*``: a node that died
        unnoticed is ``*`` first, then ``down*``); listed once each (a node of two partitions
        is on two lines). Drained nodes are not: a drain does not end a job."""
        if not result.ok:
            return []  # "Invalid node name", or no controller: nothing is known to be down
        down = []
        for line in result.stdout.splitlines():
            node, _, state = line.strip().partition("|")
            if (state.endswith("*") or state in DOWN_STATES) and node not in down:
                down.append(node)
        return down

    def parse_explain(self, result: CommandResult) -> str:
        return ""

    def node_submit_argvs(self, queue: Optional[str]) -> list[list[str]]:
        return [["scontrol", "show", "partition", "--oneliner", *([queue] if queue else [])]]

    def parse_node_submit(self, results: Sequence[CommandResult]) -> str:
        """A partition's ``AllocNodes`` lists the hosts jobs may be submitted to it from:
        ALL, or hosts that must include the partition's own nodes."""
        if len(results) != 1 or not results[0].ok:
            return ""
        lines = [dict(_words(line)) for line in results[0].stdout.splitlines() if "PartitionName=" in line]
        part = lines[0] if len(lines) == 1 else next((p for p in lines if p.get("Default") == "YES"), None)
        if part is None or part.get("AllocNodes", "ALL") == "ALL":
            return ""
        allowed, nodes = hostlist(part["AllocNodes"]), hostlist(part.get("Nodes", ""))
        if allowed is None or nodes is None or nodes <= allowed:
            return ""
        return (
            f"partition {part.get('PartitionName')} takes jobs from AllocNodes={part['AllocNodes']} "
            f"only, not from its nodes {part.get('Nodes')}"
        )
