"""``import chainrun.checkpoint`` pulls in the standard library only, and nothing else of chainrun."""

from __future__ import annotations

import json
import subprocess
import sys

from ckpt_support import no_chainrun_env, restore_signal_handlers, script_env  # noqa: F401

PROBE = """
import json, sys
before = set(sys.modules)
import chainrun.checkpoint
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def imported_by_checkpoint() -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=script_env(), check=True
    ).stdout
    return list(json.loads(out))


def test_import_chainrun_checkpoint_loads_no_third_party_module() -> None:
    """Training jobs on bare cluster Pythons can import the helper."""
    third_party = [
        m
        for m in imported_by_checkpoint()
        if m.split(".")[0] not in sys.stdlib_module_names and m.split(".")[0] != "chainrun"
    ]
    assert third_party == []


def test_import_chainrun_checkpoint_depends_on_nothing_else_of_chainrun() -> None:
    """The helper runs without the service's modules (errors, model, ...) being importable."""
    ours = [m for m in imported_by_checkpoint() if m.split(".")[0] == "chainrun"]
    assert all(
        m == "chainrun" or m == "chainrun.checkpoint" or m.startswith("chainrun.checkpoint._") for m in ours
    ), ours
