"""The scripts a segment's job runs: the one wrapper every backend shares (``segment.sh``),
under the backend's own directives, and the script of an array job whose tasks each run one
chain's segment script.

Every value from the job file is shell-quoted (``text.quote``), and placeholders are
replaced in one pass, so nothing in a value is ever expanded or read as a directive.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from importlib import resources

from chainrun import container
from chainrun.model import chain_seed
from chainrun.schedulers.base import ArrayScheduler, Scheduler
from chainrun.schedulers.segment import SegmentJob, code_dir, code_names, made_dirs, sweep_environment
from chainrun.text import quote

_PLACEHOLDER = re.compile(r"@@([A-Z_]+)@@")


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
    """The batch script: shebang, the backend's directives, the shared wrapper.

    Placeholders are replaced in one pass over the template, so a value that
    holds ``@@NAME@@`` arrives as it is, never expanded again."""
    spec = job.spec
    q = quote
    values = {
        "CHAIN": q(job.chain_id),
        "SEGMENT": str(job.n),
        "SEED": str(chain_seed(spec, job.chain_id)),
        "SEGMENT_PADDED": f"{job.n:04d}",
        "PREVIOUS": str(job.n - 1),
        "PREVIOUS_PADDED": f"{job.n - 1:04d}",
        "CHECKPOINT_DIR": q(spec.checkpoint_dir),
        "SIGNAL": q(spec.signal),
        "RUN_DIR": q(job.run_dir),
        "WALLTIME": str(job.walltime),
        "GRACE": str(spec.grace),
        "ADAPTIVE": "1" if spec.adaptive_grace else "",
        "WRAPPER_SIGNALS": "1" if scheduler.wrapper_signals else "",
        "PREEMPTING": scheduler.preempting_shell,
        "STARTED": scheduler.started_shell,
        "INHERITED": "\n".join(f"export {key}={q(value)}" for key, value in spec.inherited),
        "ENV": "\n".join(f"export {key}={q(value)}" for key, value in (*sweep_environment(spec), *spec.env)),
        "TARGET": q("" if spec.target_epoch is None else str(spec.target_epoch)),
        "PROGRESS_FILE": q(spec.progress_file or ""),
        "PROGRESS_KEY": q(spec.progress_key),
        "WORKDIR": q(spec.workdir),
        "CODE": q(code_dir(spec)),
        "CODE_NAMES": q(code_names(spec) if spec.snapshot_commit else ""),
        "CODE_PATH": q(f"{spec.snapshot_subdir}/" if spec.snapshot_subdir else ""),
        "MADE_DIRS": " ".join(q(d) for d in made_dirs(spec)),
        "COMMAND": q(spec.command),
        "CONTAINER": "".join(f"{q(word)} " for word in container.argv(spec, code_dir(spec))),
    }
    template = resources.files("chainrun.schedulers").joinpath("segment.sh").read_text()
    body = _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)
    header = ["#!/bin/bash", *scheduler.directives(job)]
    return "\n".join(header) + "\n" + body
