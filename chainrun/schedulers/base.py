"""What every scheduler backend provides, and the parsing they share.

A backend is a set of pure command builders and output parsers: it never runs
anything itself, and never touches a file. ``cluster.Cluster.call`` runs the
commands it builds through a transport and hands the results back to its
parsers. What a segment's job looks like to every backend (names, paths and
markers) is in ``segment``; the scripts it runs, in ``script``.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Optional, Protocol, runtime_checkable

from chainrun.errors import SchedulerError
from chainrun.model import CommandResult, ListedJob
from chainrun.schedulers.segment import SegmentJob
from chainrun.starts import Start, cannot


@dataclass(frozen=True)
class HelperFile:
    """A file a backend's commands need on the host they run on (the local runner's own
    copy, on a remote workstation), placed there before the first command runs."""

    path: str  # "~/..." for the login directory
    data: bytes


class ListingMemo:
    """The lines of the last listing a backend parsed (one job a line), each with the job it
    says: a line the same since (most are, tick after tick) is not parsed again and gives the
    very same object, by which the engine sees at a glance which jobs changed
    (``engine.observe.poll``). A line says all there is of its job, so this only saves work.
    It holds one listing: with two clusters of one backend, each poll's listing replaces the
    other's, and every line is parsed."""

    def __init__(self, parse: Callable[[str], Optional[ListedJob]]) -> None:
        self._parse = parse  # one line; None for one that is not a job's
        self._lines: dict[str, ListedJob] = {}

    def jobs(self, text: str) -> dict[str, ListedJob]:
        """The jobs of the listing ``text``, by id."""
        jobs: dict[str, ListedJob] = {}
        parsed: dict[str, ListedJob] = {}
        for line in text.splitlines():
            job = self._lines.get(line) or self._parse(line)
            if job is not None:
                jobs[job.job_id] = parsed[line] = job
        self._lines = parsed
        return jobs


class Scheduler(Protocol):
    """A backend: builds commands, parses their output. Never runs anything."""

    kind: ClassVar[str]
    # True when the scheduler cannot send the warning signal ``grace`` seconds
    # before its walltime kill; the wrapper then sends it to itself.
    wrapper_signals: ClassVar[bool]
    # A shell command, run in the job, that succeeds while the scheduler is preempting
    # the job (``false`` where it cannot tell, or never preempts).
    preempting_shell: ClassVar[str]
    # A shell command, run in the job, that prints when the scheduler started the job (epoch
    # seconds), or nothing where it cannot tell: its walltime counts from then, which may be
    # well before the batch script runs (a prolog first).
    started_shell: ClassVar[str]
    # A shell command, run in the job of a segment asked with a range of walltimes, that prints
    # the time limit the scheduler granted it (``chainrun.node.granted`` reads it); "" where
    # every job gets the walltime it asks for.
    granted_shell: ClassVar[str]

    def gpus_asked(self, options: Sequence[str]) -> int:
        """The GPUs each job asks for through the job file's ``options``, in this scheduler's
        own syntax; 0 when it asks for none."""

    def helper_files(self) -> list[HelperFile]:
        """The files this backend's commands need where they run (none for a cluster's own
        tools); placed, once, before a tick runs any of them."""

    def directives(self, job: SegmentJob) -> list[str]:
        """Header lines (``#SBATCH ...``) placed right after the shebang."""

    def submit_argv(self, job: SegmentJob) -> list[str]:
        """The command that queues ``job.script_path``, after ``job.after`` if set."""

    def parse_submit(self, result: CommandResult) -> str:
        """The new job id; raises SchedulerError (transient or permanent)."""

    def poll_argv(self) -> list[str]:
        """One command listing all of this user's jobs on the cluster."""

    def parse_poll(self, result: CommandResult) -> dict[str, ListedJob]:
        """Job id -> listing; raises SchedulerError when the poll failed."""

    def cancel_argv(self, job_ids: list[str]) -> list[str]:
        """One command cancelling all of ``job_ids``."""

    def accounting_argv(self, job_ids: list[str]) -> Optional[list[str]]:
        """One command asking accounting about finished jobs, or None if none."""

    def parse_accounting(self, result: CommandResult) -> dict[str, ListedJob]:
        """Job id -> final state from accounting; empty when it knows nothing yet."""

    def explain_argv(self, job_id: str) -> Optional[list[str]]:
        """One command saying why a stuck job is stuck, or None if there is none."""

    def parse_explain(self, result: CommandResult) -> str:
        """The scheduler's reason from explain_argv's output; empty if none."""


@runtime_checkable
class ArrayScheduler(Scheduler, Protocol):
    """An optional capability: a backend that queues many first segments as one array job
    (Slurm's ``--array``). Each task runs one chain's own segment script (``segment``'s
    ``render_array_script``); the listing lists each task under its own id."""

    max_tasks: ClassVar[int]  # the most tasks one array holds (Slurm's MaxArraySize default: 1001)
    task_index_shell: ClassVar[str]  # in a task's script: its index
    task_id_shell: ClassVar[str]  # in a task's script: its id as the listing lists it

    def array_directives(self, job: SegmentJob, name: str) -> list[str]:
        """The array script's header: ``job``'s directives, under the array's name."""

    def array_submit_argv(
        self, script_path: str, log_path: str, workdir: str, indices: Sequence[int], limit: Optional[int]
    ) -> list[str]:
        """The command that queues the array script's ``indices``, at most ``limit`` at once."""

    def task_id(self, base: str, index: int) -> str:
        """Task ``index``'s id, from the id the array's submission printed."""

    def task_index(self, job_id: str) -> Optional[int]:
        """The index of a task in the listing, or None if ``job_id`` is no array task."""


@runtime_checkable
class NodeStateProbe(Protocol):
    """An optional capability: a backend that can say which nodes the scheduler now holds
    down (Slurm's ``sinfo``). A node that dies before the scheduler notices may take a job
    with it that ends on its own, failed (a step that could not start there, a rank that
    lost its peer), not as a node failure: its nodes' state tells. The listing names an ended
    job's nodes (``ListedJob.nodes``)."""

    def down_argv(self, nodes: str) -> list[str]:
        """The command that shows the state of ``nodes`` (as ``ListedJob.nodes`` names them)."""

    def parse_down(self, result: CommandResult) -> list[str]:
        """The nodes down, failed or not responding; none when it cannot tell."""


@runtime_checkable
class NodeSubmitProbe(Protocol):
    """An optional capability: a backend that can tell from its configuration whether its
    compute nodes may submit jobs (which a segment needs to queue its own successor while the
    service is away). A backend without it is taken to allow it (the local runner does)."""

    def node_submit_argvs(self, queue: Optional[str]) -> list[list[str]]:
        """The commands whose answers tell, for jobs sent to ``queue`` (None: the default)."""

    def parse_node_submit(self, results: Sequence[CommandResult]) -> str:
        """Why the nodes cannot submit, in a line; "" when they can or it cannot be told."""


@runtime_checkable
class ShapeProbe(Protocol):
    """An optional capability: a backend whose scheduler can say, without queueing anything,
    whether a job of a segment's shape (its limits, queue and options) could ever start
    (Slurm's ``sbatch --test-only``, SGE's ``qsub -w v``). A backend without it has nothing
    to ask (the local runner)."""

    shape_hint: ClassVar[str]  # where a person sees what the cluster offers

    def shape_argv(self, job: SegmentJob) -> list[str]:
        """The command that asks about ``job``'s shape, its directives on the command line."""

    def shape_explain_argvs(self, job: SegmentJob, refused: CommandResult) -> list[list[str]]:
        """The commands, run in order, that tell what the question's refusal ``refused`` of
        ``job`` means (their results follow it to ``parse_shape``); none for a refusal that
        needs none, or a scheduler that did not answer."""

    def parse_shape(self, job: SegmentJob, results: Sequence[CommandResult]) -> str:
        """The scheduler's own reason it would never start the job, in a line; "" when it
        would. Raises SchedulerError (transient) when the scheduler did not answer, or when
        its refusal may be for now only."""


@runtime_checkable
class StartProbe(Protocol):
    """An optional capability: a backend that can say when a job of a segment's shape would
    start if it were queued now (``Cluster.expected_start``), without queueing anything.

    The first command is the question; the others, if any, refine its answer and are run only
    when it answered (exit 0): a controller that does not answer is asked once, not thrice."""

    def start_argvs(self, job: SegmentJob) -> list[list[str]]:
        """The commands, the question first."""

    def parse_start(self, job: SegmentJob, results: Sequence[CommandResult], now: float) -> Start:
        """When ``job`` would start, from the answers (one per command run, in order: only the
        first when it failed), ``now`` being when they were asked."""


# A count, maybe with a type before it: --gpus=a100:3 (Slurm), gpu=2 in SGE's -l list.
_COUNT = re.compile(r"^(?:[A-Za-z0-9_.-]+:)?(\d+)$")


def option_words(options: Sequence[str]) -> list[str]:
    """The job file's ``options`` as the scheduler's command line reads them, each split as
    the shell would and ``--a=b`` split at ``=``."""
    words: list[str] = []
    for option in options:
        try:
            parts = shlex.split(option)
        except ValueError:
            parts = option.split()
        for part in parts:
            if part.startswith("--") and "=" in part:
                words.extend(part.split("=", 1))
            else:
                words.append(part)
    return words


def count_of(value: str) -> int:
    """The number in ``N`` or ``TYPE:N``; 0 when there is none."""
    found = _COUNT.match(value)
    return int(found.group(1)) if found else 0


def command_error(
    tool: str, result: CommandResult, transient: re.Pattern[str], missing: str
) -> SchedulerError:
    """A failed scheduler command as one line in the tool's own words; transient when
    ``transient`` matches it; a tool not found (exit 127) is permanent, with ``missing``."""
    text = result.stderr.strip() or result.stdout.strip() or f"exit {result.returncode}"
    lines = [line.strip() for line in text.splitlines() if line.strip() not in ("", "Exiting.")]
    message = f"{tool}: " + " ".join(lines[-3:])
    if result.returncode == 127:
        return SchedulerError(f"{tool} not found: {missing} ({message})", transient=False)
    return SchedulerError(message, transient=bool(transient.search(message)))


def parse_cancel(result: CommandResult) -> None:
    """A cancel's answer, the same for every backend: nothing, or what went wrong."""
    if not result.ok:
        raise SchedulerError(f"cancel: {result.describe()}", transient=True)


def submitted_id(tool: str, result: CommandResult, separator: str) -> str:
    """The job id a successful submit printed on its last line, before ``separator``."""
    lines = result.stdout.strip().splitlines()
    job_id = lines[-1].split(separator)[0].strip() if lines else ""
    if not job_id.isdigit():
        raise SchedulerError(f"{tool}: unexpected output {result.stdout.strip()!r}", transient=True)
    return job_id


def directive_words(lines: Sequence[str], prefix: str) -> list[str]:
    """Header lines (``#SBATCH --time=...``) as the words of a command line, each split as the
    scheduler splits its directives: the same options, asked about before a script exists."""
    words: list[str] = []
    for line in lines:
        rest = line[len(prefix) :] if line.startswith(prefix) else line
        try:
            words += shlex.split(rest)
        except ValueError:
            words += rest.split()
    return words


def refusal(tool: str, result: CommandResult, transient: re.Pattern[str], noise: re.Pattern[str]) -> str:
    """A ``ShapeProbe`` answer: "" for a job that could start; else the scheduler's reason,
    its lines joined and each stripped of ``noise`` (the tool's own prefixes). A scheduler
    that did not answer raises a transient SchedulerError: nothing can be told now."""
    if result.ok:
        return ""
    text = result.stderr.strip() or result.stdout.strip()
    if result.returncode == 127 or not text or transient.search(text):
        raise SchedulerError(f"{tool}: {text or f'exit {result.returncode}'}", transient=True)
    lines = [noise.sub("", line).strip() for line in text.splitlines()]
    return "; ".join(dict.fromkeys(line for line in lines if line and line != "Exiting."))


def refused_start(
    tool: str, result: CommandResult, transient: re.Pattern[str], noise: re.Pattern[str], controller: str
) -> Optional[Start]:
    """A ``StartProbe``'s question that failed, as the place's answer: it cannot start the job,
    because the scheduler refused its shape (in its words) or ``controller`` did not answer;
    None when the question was answered."""
    try:
        reason = refusal(tool, result, transient, noise)
    except SchedulerError as exc:
        return cannot(f"{controller} does not answer: {exc}")
    return cannot(f"{tool} refuses it: {reason}") if reason else None
