"""Issue 36, finding 8: segments whose command spends most of its time starting are warned of.

A chain on the local runner whose command sleeps (as a heavy import would) until 3 s before
the walltime signal in every segment: after two such segments, ``status`` (its table, its
JSON and ``-v``), ``run``'s line and the webhook say that start-up takes most of each
segment, with the numbers and what to change. Before this, nothing did: the chain ran out
of its budget one step a segment."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import test_contract
from conftest import cli_env, wait_for
from test_contract import CLI, Cluster, write_job
from test_notify import Server, url
from test_notify import server as server  # the fixture: a webhook receiver

cluster = test_contract.cluster
work = test_contract.work

SLOW_TO_START = """\
import os, time
deadline, grace = float(os.environ["CHAINRUN_DEADLINE"]), float(os.environ["CHAINRUN_GRACE"])
time.sleep(max(0.0, deadline - grace - 3 - time.time()))  # importing, 3 s before the signal
from chainrun.checkpoint import CheckpointDir, SegmentClock
clock = SegmentClock(margin=0)
while not clock.should_stop():
    time.sleep(0.1)
segment = int(os.environ["CHAINRUN_SEGMENT"])
CheckpointDir(os.environ["CHAINRUN_CHECKPOINT_DIR"]).save(b"state", epoch=segment, step=0)
"""
WARNED = "start-up takes most of each segment"


@pytest.mark.parametrize("cluster", [pytest.param("local")], indirect=True)
def test_segments_that_start_up_for_most_of_their_time_are_warned_of(
    cluster: Cluster, work: Path, home: Path, chainrun: CLI, service: Callable[..., Any], server: Server
) -> None:
    (work / "slow.py").write_text(SLOW_TO_START)
    path = write_job(work, cluster, "python3 slow.py", walltime=20, grace=6, target_epoch=3, max_failures=0)
    path.write_text(f'webhook = "{url(server)}"\n' + path.read_text())
    chain_id = chainrun("submit", str(path), check=True).stdout.strip()
    service(interval=0.5)

    def shown() -> dict[str, Any]:
        return json.loads(chainrun("status", chain_id, "--json", check=True).stdout)[0]

    wait_for(lambda: WARNED in str(shown()["attention"]), 240, "status to warn of the slow start")
    st = shown()
    assert st["state"] == "active" and st["failures"] == 0, st
    first, second = (s for s in st["segments"] if s["outcome"] == "timeout")
    for seg in (first, second):  # ready 3 s before the signal, 14 s after the start
        start, ready = seg["started_at"], seg["ready_at"]
        assert ready is not None and seg["signalled_at"] - 5 <= ready <= seg["signalled_at"], seg
        assert ready - start > 0.5 * (seg["signalled_at"] - start), seg
    attention = st["attention"]
    assert f"segment {first['n']} " in attention and f"segment {second['n']} " in attention, attention
    assert "a longer walltime, a smaller grace" in attention, attention
    table = " ".join(chainrun("status").stdout.split())  # the glance, read with SQL
    assert f"{chain_id}: {WARNED}" in table, table
    details = " ".join(chainrun("status", chain_id, "-v", check=True).stdout.split())
    assert f"warning: {WARNED}" in details, details
    follow = subprocess.run(  # `run` of the same job file follows the chain the service drives
        [sys.executable, "-m", "chainrun", "run", str(path)],
        env=cli_env(home),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert f"warning: {WARNED}" in follow.stdout, follow.stdout + follow.stderr

    def told() -> list[dict[str, Any]]:
        return [r["body"] for r in server.received if r["body"].get("event") == "chain_warning"]

    wait_for(lambda: bool(told()), 60, "the webhook to be told")
    wait_for(lambda: shown()["state"] == "completed", 240, "the chain to complete")
    (body,) = told()  # once, not once a tick
    assert body["chain"] == chain_id and WARNED in body["warning"], body
