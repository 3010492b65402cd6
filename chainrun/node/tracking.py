"""``[tracking] mlflow = true`` in the job: the chain's one MLflow run, found for each segment.

MLflow makes its run ids itself, and ``MLFLOW_RUN_ID`` must name a run that exists, so no id
can be set ahead of the first segment. Instead every segment's command gets MLflow's own
``MLFLOW_RUN_CONTEXT``: the tags of each run it makes, the chain's ``chainrun.run_id`` among
them, and its name (``mlflow.runName``, where the script gives none). The run the command's first
``mlflow.start_run()`` makes, in whatever experiment the script picks, is the chain's. Before
each command, a short snippet run by the command's own Python (where mlflow is installed, in
its container, its directory and its environment) looks for that run in every experiment;
found, its id becomes the command's ``MLFLOW_RUN_ID``, so that the script's unchanged
``start_run()`` continues it. Where the snippet fails (no mlflow there, the tracking server
down), the command runs anyway and the log says why in one line.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from typing import Optional

from chainrun.checkpoint._tracking import MLFLOW_TAG as TAG  # the tag that names a run as a chain's

LOOKUP_SECONDS = 120  # at most, before the command starts without the run
# Only the snippet's own: fewer and shorter retries than MLflow's (minutes) against a server down.
LOOKUP_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
_PYTHON = re.compile(r"python[0-9.]*")

# argv[1]: the tag, argv[2]: the chain's run id. Prints the run's id (nothing when there is none yet), or one
# line saying what went wrong and exits 1.
SNIPPET = """\
import sys
try:
    import mlflow
    runs = mlflow.search_runs(
        search_all_experiments=True,
        filter_string="tags.`" + sys.argv[1] + "` = '" + sys.argv[2] + "'",
        order_by=["attributes.start_time ASC"],
        output_format="list",
    )
except Exception as exc:
    why = " ".join(str(exc).split())
    print("%s: %s" % (type(exc).__name__, why if len(why) <= 240 else why[:110] + " ... " + why[-110:]))
    sys.exit(1)
top = [r.info.run_id for r in runs if "mlflow.parentRunId" not in r.data.tags]
print(top[0] if top else "")
"""


def python_of(command: str) -> str:
    """The Python the command runs: its first word where that is one (``/venv/bin/python
    train.py``), ``python3`` on its PATH otherwise."""
    try:
        words = shlex.split(command)
    except ValueError:
        words = []
    first = words[0] if words else ""
    return first if _PYTHON.fullmatch(os.path.basename(first)) else "python3"


def continue_runs(trackers: list[str], container: list[str], command: str, env: dict[str, str]) -> list[str]:
    """Set what the trackers need in the command's environment ``env``; the lines to log."""
    if "mlflow" not in trackers:
        return []
    run_id = env.get("CHAINRUN_RUN_ID", "")
    env["MLFLOW_RUN_CONTEXT"] = json.dumps({"mlflow.runName": run_id, **_tags(env), TAG: run_id})
    if env.get("MLFLOW_RUN_ID"):  # [env]'s own run id wins
        return []
    python = python_of(command)
    try:
        done = subprocess.run(
            [*container, python, "-c", SNIPPET, TAG, run_id],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            env={**env, **LOOKUP_ENV},
            timeout=LOOKUP_SECONDS,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return [_failed(python, _why(exc))]
    lines = done.stdout.decode(errors="replace").strip().splitlines()
    if done.returncode != 0:
        errors = done.stderr.decode(errors="replace").strip().splitlines()
        return [_failed(python, (lines or errors or [f"exit {done.returncode}"])[-1][:400])]
    found: Optional[str] = lines[-1].strip() if lines else None
    if not found:
        return [f"no MLflow run of this chain yet: the command's start_run() makes it ({TAG}={run_id})"]
    env["MLFLOW_RUN_ID"] = found
    return [f"continuing MLflow run {found} ({TAG}={run_id})"]


def _tags(env: dict[str, str]) -> dict[str, object]:
    """The tags [env] gave in its own ``MLFLOW_RUN_CONTEXT``, kept."""
    try:
        tags = json.loads(env.get("MLFLOW_RUN_CONTEXT") or "{}")
    except ValueError:
        return {}
    return tags if isinstance(tags, dict) else {}


def _why(exc: BaseException) -> str:
    if isinstance(exc, subprocess.TimeoutExpired):
        return f"no answer in {LOOKUP_SECONDS}s"
    return getattr(exc, "strerror", None) or str(exc)


def _failed(python: str, why: str) -> str:
    return f"cannot find the chain's MLflow run with {python} ({why}); start_run() makes a new one"
