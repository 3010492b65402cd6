"""``chainrun check``: what a job file will do, said before anything is submitted.

``preflight`` builds the first segment's script and submit command without running them,
so that what the backend refuses is a job file error before any chain exists; ``summary``
is the plan a person reads (segments, walltimes, budget, where the epoch comes from);
``warnings`` what may surprise them.
"""

from __future__ import annotations

import os
import posixpath
import shlex
from collections.abc import Sequence
from dataclasses import replace
from typing import Optional

from chainrun import carry, rundir, snapshot, sweep
from chainrun.cluster import Cluster
from chainrun.decide import grace
from chainrun.decide.carry import applies, away_bound, off_because
from chainrun.errors import JobFileError, SchedulerError, TransportError
from chainrun.fields import format_duration
from chainrun.model import JobSpec, new_chain_id
from chainrun.schedulers import scheduler_for
from chainrun.schedulers.base import ShapeProbe
from chainrun.schedulers.script import render_script
from chainrun.schedulers.segment import SegmentJob
from chainrun.sweep import param_text
from chainrun.text import one_line
from chainrun.transport import LocalTransport, Transport, transport_for


def preflight(spec: JobSpec) -> tuple[str, list[str]]:
    """Build the first segment's script and submit command without running them, so what the
    backend refuses (a job name, a path SGE would rewrite) is a job file error before any chain
    exists; and, for a chain on this machine, refuse a run directory someone else could change.
    Returns the script and the submit command, for ``check --show-script``."""
    scheduler = scheduler_for(spec.scheduler.kind, spec.scheduler.first_host)
    job = SegmentJob(new_chain_id(spec.name), 1, spec, spec.walltime)
    try:
        script = render_script(scheduler, job)
        argv = scheduler.submit_argv(job)
        scheduler.submit_argv(SegmentJob(job.chain_id, 2, spec, spec.walltime, after="1"))
    except SchedulerError as exc:
        raise JobFileError(f"{spec.source}: {exc}") from None
    if not spec.scheduler.remote:
        rundir.trust_run_dir(LocalTransport(), spec, None, create=False)
    return script, argv


def probe_nodes(spec: JobSpec, transport: Optional[Transport] = None) -> tuple[JobSpec, str]:
    """Ask the cluster where the chain's segments will run, at check and at submit (``transport``:
    where the chain's commands run, its workdir there already). First whether its scheduler would
    ever start a segment of this shape (``never_starts``): a refusal is a job file error, in the
    scheduler's own words. Then, for a chain whose segments may queue their successors while
    the service is away, whether the cluster's compute nodes may submit jobs at all, and, at
    submit, whether the carrier runs there with the interpreter its launcher would use
    (``carry.probe``); where either may not, the spec says why and the chain waits for the
    service as before. What cannot be told here a segment finds out, and says in its log.
    Returns the spec so found, and a note for the user when the shape question went
    unanswered ("" when it was answered, or there is none to ask)."""
    host = spec.scheduler.host
    scheduler = scheduler_for(spec.scheduler.kind, host)
    if not isinstance(scheduler, ShapeProbe) and not applies(spec):
        return spec, ""
    cluster = Cluster(scheduler, transport or transport_for(host))
    note = never_starts(spec, cluster)
    if not applies(spec):
        return spec, note
    try:
        why = cluster.nodes_cannot_submit(spec.scheduler.queue)
    except (TransportError, SchedulerError):
        why = ""
    if why:
        return replace(spec, nodes_cannot_submit=why), note
    if transport is None:
        return spec, note
    try:
        cannot = carry.probe(transport, spec)
    except TransportError as exc:
        cannot = f"the carrier could not be placed and run there ({exc})"
    return (replace(spec, carrier_cannot_run=cannot) if cannot else spec), note


def never_starts(spec: JobSpec, cluster: Cluster) -> str:
    """Refuse the job file (JobFileError) when the scheduler says it would never start a
    segment of its shape: its reason, and what to change. A scheduler that cannot tell now
    (its controller does not answer, a node of the partition is away) refuses nothing: the
    note returned says so, and that the submission finds out ("" when it answered)."""
    scheduler = cluster.scheduler
    if not isinstance(scheduler, ShapeProbe):
        return ""
    # A sweep's options may hold placeholders: each shape its chains have is asked once.
    shapes = {(one.scheduler.queue, one.scheduler.options): one for one in sweep.expand(spec)}
    for one in shapes.values():
        try:
            why = cluster.never_starts(SegmentJob(new_chain_id(one.name), 1, one, one.walltime))
        except (TransportError, SchedulerError) as exc:
            return (
                f"{spec.source}: {scheduler.kind} could not tell whether it would ever start a segment "
                f"of this shape ({exc}); a segment it cannot start waits in the queue, and "
                "`chainrun status` shows why"
            )
        if why:
            raise JobFileError(
                f"{spec.source}: {scheduler.kind} would never start a segment of this shape: {why}; "
                f"change [scheduler] queue or options, or walltime, to what the cluster offers "
                f"({scheduler.shape_hint})"
            )
    return ""


def summary(path: str, spec: JobSpec, chains: Sequence[JobSpec], shared: str = "") -> list[str]:
    """The plan of the job file at ``path``, whose chains are ``chains``, line by line; for a
    pool, ``shared`` says whether its workdir is shared (``rundir.probe_shared``)."""
    if spec.sweep:
        lines = [f"{path}: valid job file for a sweep of {len(chains)} chains named {spec.name!r}"]
    else:
        lines = [f"{path}: valid job file for chain {spec.name!r}"]
    lines += [f"  {label:<11} {value}" for label, value in _plan(spec, shared)]
    if spec.sweep:
        shown = SWEEP_SHOWN if len(chains) > SWEEP_SHOWN + 1 else len(chains)
        for one in chains[:shown]:
            values = " ".join(f"{k}={param_text(v)}" for k, v in one.params)
            lines.append(f"    {one.name}  {one_line(values, 200)}")
            lines.append(f"      checkpoint_dir {_within(spec.workdir, one.checkpoint_dir)}, seed {one.seed}")
        if len(chains) > shown:
            lines.append(f"    ... and {len(chains) - shown} more")
    return lines


def warnings(spec: JobSpec) -> list[str]:
    """What in the job file may not do what its writer expects."""
    if spec.target_epoch is not None and not spec.progress_file and not _uses_the_helper(spec):
        return [
            "warning: target_epoch needs an epoch: if the command does not save with chainrun.checkpoint, "
            'set progress = "FILE.json:KEY" (its own JSON file and the key of the epoch); without an '
            "epoch, the chain completes when the command exits 0 on its own"
        ]
    return []


def script_text(spec: JobSpec, script: str, argv: list[str]) -> str:
    """``--show-script``: the command that submits the first segment, and its script."""
    where = f" on {spec.scheduler.host}" if spec.scheduler.host else ""
    return (
        f"\nsubmitted{where} with (the chain id is made at submit):\n  {shlex.join(argv)}\n"
        f"\nthe first segment's script:\n{script}"
    )


SWEEP_SHOWN = 5  # chains of a sweep `check` lists


def _uses_the_helper(spec: JobSpec) -> bool:
    """Whether a Python script the command names (in the workdir, on this machine) uses
    chainrun's checkpoint helper, which writes the epoch chainrun reads."""
    if spec.scheduler.host:
        return False
    try:
        words = shlex.split(spec.command)
    except ValueError:
        return False
    for word in words:
        path = os.path.join(spec.workdir, word)
        if word.endswith(".py") and os.path.isfile(path):
            try:
                with open(path, "rb") as f:
                    text = f.read(1 << 20)
            except OSError:
                continue
            if b"chainrun.checkpoint" in text or b"from chainrun import checkpoint" in text:
                return True
    return False


def _plan(spec: JobSpec, shared: str) -> list[tuple[str, str]]:
    full, rest = divmod(spec.total_time, spec.walltime)
    wt = format_duration(spec.walltime)
    if rest == 0:
        segments = f"{full} x {wt}"
    elif rest <= spec.grace:
        segments = f"{full} x {wt} (the {format_duration(rest)} left over is shorter than grace)"
    else:
        segments = f"{full} x {wt} + 1 x {format_duration(rest)} (the last one clamped to the budget)"
    if spec.walltime_min and _grants(spec):
        segments += ", more where backfill grants shorter limits"
    sched = f"{spec.scheduler.kind} on {spec.scheduler.where}"
    if spec.scheduler.queue:
        sched += f", queue {spec.scheduler.queue}"
    if spec.scheduler.options:
        sched += ", options " + " ".join(spec.scheduler.options)
    plan = [
        ("command", spec.command),
        ("workdir", spec.workdir + (f" ({shared})" if shared else "")),
        ("scheduler", sched),
        ("time", f"total_time {format_duration(spec.total_time)}, {_walltime(spec)}"),
        ("segments", f"at most {segments}"),
        (
            "target",
            f"epoch {spec.target_epoch}" if spec.target_epoch else "until the command exits 0 on its own",
        ),
        ("failures", f"budget {spec.max_failures}: the chain fails at failure {spec.max_failures + 1}"),
        ("signal", f"SIG{spec.signal} at walltime - grace, sent by the segment's own timer"),
        ("grace", grace.rule(spec)),
        ("environment", _environment(spec)),
        ("progress", _progress_source(spec)),
        ("away", _away(spec)),
    ]
    if spec.container:
        gpus = ", with the GPUs" if spec.container_gpus else ""
        plan.append(("container", f"{spec.container} ({spec.container_runtime}{gpus})"))
    if spec.sweep:
        configs = f"{len(spec.sweep)} configurations x {spec.reps} repetitions"
        at_once = (
            f"; at most {spec.max_concurrent} under way at once (max_concurrent)"
            if spec.max_concurrent
            else "; all under way at once (no max_concurrent)"
        )
        plan.append(("sweep", f"{configs}: one chain each, with its own checkpoint_dir and seed{at_once}"))
        plan.append(("seed", "CHAINRUN_SEED, from the sweep's name, configuration and repetition"))
    else:
        plan.append(("seed", "CHAINRUN_SEED, the chain's own (from its id, made at submit)"))
    if spec.snapshot:
        plan.append(("code", f"a git snapshot of {snapshot.source_dir(spec)}'s repository, taken at submit"))
    return plan


def _walltime(spec: JobSpec) -> str:
    """The walltime each segment asks for, and what a range of them does on this scheduler."""
    wt = format_duration(spec.walltime)
    if not spec.walltime_min:
        return f"walltime {wt} per segment"
    least, kind = format_duration(spec.walltime_min), spec.scheduler.kind
    if _grants(spec):
        return (
            f"walltime {least}..{wt} per segment: the scheduler's backfill may start a segment "
            f"sooner with its limit cut down, to {least} at least (Slurm's --time-min); its signal "
            "and the budget count from the limit granted"
        )
    return f"walltime {wt} per segment ({kind} grants no shorter limits: {least}..{wt} runs its longest)"


def _grants(spec: JobSpec) -> bool:
    """The chain's scheduler may grant a segment a shorter limit than it asks for."""
    return bool(scheduler_for(spec.scheduler.kind, spec.scheduler.first_host).granted_shell)


def _away(spec: JobSpec) -> str:
    """What happens while the service is away, beyond the successor queued ahead."""
    off = off_because(spec)
    if off:
        return f"after one walltime the chain waits for the service (self-queueing off: {off})"
    bound = format_duration(int(away_bound(spec, None)))
    return f"a running segment queues the next itself once the service is silent for {bound} (self_queue)"


def _within(workdir: str, path: str) -> str:
    """``path`` as the job file likely wrote it: relative to the workdir when inside it."""
    rel = posixpath.relpath(path, workdir)
    return path if rel == ".." or rel.startswith("../") else rel


def _progress_source(spec: JobSpec) -> str:
    if spec.progress_file:
        return f"the epoch is {spec.progress_key} in {spec.progress_file}"
    where = "each chain's own checkpoint_dir (below)" if spec.sweep else spec.checkpoint_dir
    return f"chainrun.checkpoint's sidecar in {where}, else the time of the newest file there (no epoch)"


def _environment(spec: JobSpec) -> str:
    """Which variables the job takes from this shell (inherit_env) and from [env]."""
    taken = ", ".join(k for k, _ in spec.inherited) or "nothing"
    text = f"{taken} from this shell (inherit_env)"
    missing = [k for k in spec.inherit_env if k not in dict(spec.inherited)]
    if missing:
        text += f"; not set here: {', '.join(missing)}"
    if spec.env:
        text += "; [env] " + ", ".join(k for k, _ in spec.env)
    return text
