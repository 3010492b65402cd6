"""The scripts a segment's job runs: the backend's directives and the segment runner every
backend shares (``chainrun.node.runner``, shipped as one archive, ``runner_archive``), with the
segment's settings as JSON; and the script of an array job whose tasks each run one chain's
segment script.

Nothing from the job file is read by the shell: the settings travel as JSON in a quoted
here-document, and the one path on a command line is shell-quoted (``text.quote``).
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Sequence

from chainrun import container
from chainrun.model import JobSpec, chain_seed
from chainrun.schedulers.base import ArrayScheduler, Scheduler
from chainrun.schedulers.segment import (
    RUN_DIR_NAME,
    SegmentJob,
    code_dir,
    made_dirs,
    share_settings,
    sweep_environment,
    tracker_run_id,
    tracking_environment,
)
from chainrun.schedulers.ship import SEGMENT_RUNNER
from chainrun.text import quote


def render_array_script(scheduler: ArrayScheduler, name: str, tasks: Sequence[tuple[int, SegmentJob]]) -> str:
    """An array job's script: each task runs its chain's own segment script (wrapper, markers
    and signal handling as for any segment; ``exec``, so the scheduler's signal reaches the
    wrapper) with its output in that segment's log, and tells it the id it runs as."""
    lines = ["#!/bin/bash", *scheduler.array_directives(tasks[0][1], name)]
    lines.append(f'case "{scheduler.task_index_shell}" in')
    lines += [f"{i}) script={quote(job.script_path)} log={quote(job.log_path)} ;;" for i, job in tasks]
    lines += [
        f'*) echo "chainrun: array task {scheduler.task_index_shell} has no segment" >&2 && exit 1 ;;',
        "esac",
        f'export CHAINRUN_JOB_ID="{scheduler.task_id_shell}"',
        'exec >>"$log" 2>&1',
        'exec "$script"',
    ]
    return "\n".join(lines) + "\n"


def render_script(scheduler: Scheduler, job: SegmentJob) -> str:
    """The batch script: shebang, the backend's directives, and the segment runner, with the
    segment's settings as JSON in a quoted here-document (nothing in it is expanded; JSON
    escapes every newline, so no value can end it early)."""
    spec = job.spec
    settings = {
        "chain": job.chain_id,
        "run_id": tracker_run_id(job.chain_id),
        "segment": job.n,
        "seed": chain_seed(spec, job.chain_id),
        "walltime": job.walltime,
        "grace": spec.grace,
        "adaptive": spec.adaptive_grace,
        "signal": spec.signal,
        "wrapper_signals": scheduler.wrapper_signals,
        "started": scheduler.started_shell,
        "granted": scheduler.granted_shell if job.shortest else "",
        "preempting": scheduler.preempting_shell,
        "run_dir": job.run_dir,
        "workdir": spec.workdir,
        "code": code_dir(spec, job.chain_id),
        "share": share_settings(spec, job.chain_id),
        "checkpoint_dir": spec.checkpoint_dir,
        "made_dirs": made_dirs(spec),
        "progress_file": spec.progress_file or "",
        "progress_key": spec.progress_key,
        "target": spec.target_epoch,
        # [env] wins over [tracking], which wins over what the submitting shell had.
        "env": dict(
            [*spec.inherited, *sweep_environment(spec), *tracking_environment(spec, job.chain_id), *spec.env]
        ),
        "container": container.argv(spec, code_dir(spec, job.chain_id)),
        "tracking": list(spec.tracking),  # mlflow's run is found in the job (node.tracking)
        "command": spec.command,
    }
    return "\n".join(
        [
            "#!/bin/bash",
            *scheduler.directives(job),
            f"# chainrun: segment {job.n} of its chain. The segment runner (chainrun/node/runner.py) reads",
            "# the settings below; bash would die of the walltime signal until it catches it.",
            "trap '' USR1 USR2 ALRM",
            "command -v python3 >/dev/null || { echo 'chainrun: the segment runner needs python3"
            " (3.8 or later) on the node' >&2; exit 127; }",
            f"exec python3 -I {quote(runner_path(spec))} <<'{_END}'",
            json.dumps(settings, indent=1),
            _END,
            "",
        ]
    )


_END = "CHAINRUN_SETTINGS"  # no line of indented JSON is this


def runner_path(spec: JobSpec) -> str:
    """Where the segment runner is placed for a chain: in the workdir's run directory."""
    return posixpath.join(spec.workdir, RUN_DIR_NAME, SEGMENT_RUNNER.name())
