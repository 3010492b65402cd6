"""The chain's run in the trackers, as the framework helpers and the segment runner name it."""

from __future__ import annotations

import os
from typing import Optional

RUN_ID_VAR = "CHAINRUN_RUN_ID"  # the chain's tracker-safe id, the same in every segment
MLFLOW_TAG = "chainrun.run_id"  # the tag that names an MLflow run as a chain's


def run_id() -> Optional[str]:
    """The chain's tracker-safe run id (``CHAINRUN_RUN_ID``, the same in every segment), or None
    outside a chain."""
    return os.environ.get(RUN_ID_VAR, "").strip() or None
