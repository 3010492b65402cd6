"""One run in the tracker, whatever the segments (issue 37): every segment's command gets the
chain's id and a tracker-safe run id, the same in each of its segments."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import socket
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import need
from test_wrapper import run_wrapper, work, wrapper_env, wrapper_spec, write_segment  # noqa: F401 (work: the fixture)

from chainrun.errors import JobFileError
from chainrun.model import JobSpec, new_chain_id
from chainrun.node.tracking import continue_runs, python_of
from chainrun.schedulers.local import LocalScheduler
from chainrun.schedulers.script import render_script
from chainrun.schedulers.segment import RUN_ID_MAX, SegmentJob, tracker_run_id, tracking_environment
from chainrun.schema import parse

CLI = Callable[..., "subprocess.CompletedProcess[str]"]
SAFE = re.compile(r"[a-z0-9-]+")


@pytest.mark.parametrize(
    ("chain_id", "run_id"),
    [
        ("cifar-resnet-1a2b3c", "cifar-resnet-1a2b3c"),
        ("My_Run.v2-abcdef", "my-run-v2-abcdef"),
        ("A" * 64 + "-0f0f0f", "a" * 57 + "-0f0f0f"),
    ],
)
def test_the_run_id_is_the_chain_id_lowercase_letters_digits_and_hyphens_with_its_random_end_kept(
    chain_id: str, run_id: str
) -> None:
    assert tracker_run_id(chain_id) == run_id
    assert SAFE.fullmatch(run_id) and len(run_id) <= RUN_ID_MAX


def test_every_chain_name_gives_a_safe_run_id_that_keeps_its_chains_apart() -> None:
    """The longest names (64 characters, a sweep's -HASH-rN within them) keep the random end,
    so two chains of one name still get two runs."""
    for name in ("x", "Name.With_Dots-and-CAPS", "n" * 64, "s" * 50 + "-0123abcd-r12"):
        ids = {tracker_run_id(new_chain_id(name)) for _ in range(20)}
        assert all(SAFE.fullmatch(i) and len(i) <= RUN_ID_MAX for i in ids)
        assert len(ids) == 20


def test_each_segment_of_a_chain_sees_its_chain_id_and_the_same_run_id(work: Path) -> None:  # noqa: F811
    """The segment runner exports CHAINRUN_CHAIN_ID and CHAINRUN_RUN_ID to the command."""
    seen = []
    for n in (1, 2, 3):
        proc, job = run_wrapper(work, 'echo "$CHAINRUN_CHAIN_ID $CHAINRUN_RUN_ID" > seen', n=n)
        assert proc.returncode == 0, proc.stderr
        seen.append((work / "seen").read_text().split())
    assert seen == [[job.chain_id, tracker_run_id(job.chain_id)]] * 3


# A training script as its author wrote it for W&B, unchanged: nothing in it names a run. Each
# segment trains one epoch of four steps (a stand-in for a walltime stop) and commits its progress.
WANDB_TRAINER = """\
import os
import wandb
from chainrun.checkpoint import load_progress, write_progress

ckdir = os.environ["CHAINRUN_CHECKPOINT_DIR"]
os.makedirs(ckdir, exist_ok=True)
done = load_progress(ckdir)
epoch = done["epoch"] if done else 0
run = wandb.init(project="chainrun-test")
for step in range(epoch * 4, epoch * 4 + 4):
    wandb.log({"loss": 1.0 / (step + 1)}, step=step)
wandb.finish()
with open(os.path.join(ckdir, "model.txt"), "w") as f:
    f.write(str(epoch + 1))
write_progress(ckdir, epoch=epoch + 1, step=epoch * 4 + 4, file="model.txt")
"""


def wandb_records(path: Path) -> list[Any]:
    """The records of an offline run's ``.wandb`` file, read as W&B writes it (a LevelDB-style
    log of 32 KiB blocks after a 7-byte header) into W&B's own protobuf ``Record``."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, whole, found = 7, b"", []
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        whole = chunk if kind in (FULL, FIRST) else whole + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(whole)
            found.append(record)
    return found


BLOCK, FULL, FIRST, LAST = 32768, 1, 2, 4


def wandb_offline_runs(directory: Path) -> tuple[set[str], list[tuple[int, dict[str, Any]]]]:
    """What offline W&B wrote under ``directory`` (one ``offline-run-*`` per segment, read in
    time order): the run ids its records name, and each history record as (its step, its row
    by key: a nested key joined by '/', the value parsed from JSON)."""
    ids, history = set(), []
    for run in sorted(directory.glob("offline-run-*")):
        for record in wandb_records(next(run.glob("*.wandb"))):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                history.append((record.history.step.num, row))
    return ids, history


@pytest.mark.slow
def test_a_chain_of_three_segments_is_one_wandb_run_with_every_segments_steps(
    tmp_path: Path, chainrun: CLI
) -> None:
    """[tracking] wandb = true: each segment's unchanged wandb.init() continues the chain's one
    run (offline here: W&B writes each segment's part to a directory of its own, all of one id)."""
    need("wandb", importlib.util.find_spec("wandb") is not None, "pip install 'chainrun[wandb]'")
    home = tmp_path / "work"
    home.mkdir()
    (home / "train.py").write_text(WANDB_TRAINER)
    path = home / "job.toml"
    path.write_text(
        f'name = "Tracked_Run"\ncommand = "{sys.executable} train.py"\n'
        'total_time = "30m"\nwalltime = "5m"\ntarget_epoch = 3\n'
        '[tracking]\nwandb = true\n[env]\nWANDB_MODE = "offline"\nWANDB_SILENT = "true"\n'
    )
    result = chainrun("run", str(path), "--interval", "0.3", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    chain_id = json.loads(chainrun("status", "--json", check=True).stdout)[0]["id"]
    runs = sorted((home / "wandb").glob("offline-run-*"))
    assert len(runs) == 3, runs  # one directory per segment ...
    ids, history = wandb_offline_runs(home / "wandb")
    assert ids == {tracker_run_id(chain_id)}  # ... and all of them the one run
    assert [step for step, _ in history] == list(range(12))


BASE = {"name": "t", "command": "python train.py", "total_time": "1h", "walltime": "10m"}


def test_tracking_sets_the_trackers_own_variables_and_env_still_wins(tmp_path: Path) -> None:
    spec = parse({**BASE, "tracking": {"wandb": True}}, "job.toml", tmp_path)
    assert spec.tracking == ("wandb",)
    assert JobSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec  # as stored
    assert tracking_environment(spec, "t-0a0b0c") == [("WANDB_RUN_ID", "t-0a0b0c"), ("WANDB_RESUME", "allow")]
    assert parse({**BASE, "tracking": {"wandb": False}}, "job.toml", tmp_path).tracking == ()
    env = parse({**BASE, "tracking": {"wandb": True}, "env": {"WANDB_RUN_ID": "mine"}}, "job.toml", tmp_path)
    settings = render_script(LocalScheduler(), SegmentJob("t-0a0b0c", 1, env, 600))
    assert '"WANDB_RUN_ID": "mine"' in settings and '"WANDB_RESUME": "allow"' in settings


@pytest.mark.parametrize(
    ("table", "said"),
    [
        ({"wandbb": True}, "unknown key tracking.wandbb; did you mean tracking.wandb?"),
        ({"weights_and_biases": True}, "unknown key tracking.weights_and_biases; chainrun's is wandb"),
        ({"wandb": "yes"}, "tracking.wandb"),
        ({"ml_flow": True}, "unknown key tracking.ml_flow; chainrun's is mlflow"),
    ],
)
def test_a_wrong_tracking_table_says_what_to_write(tmp_path: Path, table: dict[str, Any], said: str) -> None:
    with pytest.raises(JobFileError) as caught:
        parse({**BASE, "tracking": table}, "job.toml", tmp_path)
    assert said in str(caught.value) and "\n" not in str(caught.value)


# A PyTorch loop that logs every step to TensorBoard and saves mid-epoch (after its third step)
# and at each epoch's end. Segment 1 logs two more steps past its mid-epoch save of epoch 1,
# flushes them, and is killed with SIGKILL: those steps are on disk but not in any checkpoint.
TENSORBOARD_TRAINER = """\
import os, signal, sys
import torch
from torch.utils.tensorboard import SummaryWriter
from chainrun.checkpoint.torch import Checkpointer

PURGE = sys.argv[1] == "purge"
torch.manual_seed(0)
data = [(torch.randn(8, 3), torch.randn(8, 1)) for _ in range(5)]  # 5 steps an epoch
model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ckpt = Checkpointer(model=model, optimizer=opt)
start = ckpt.restore()
writer = SummaryWriter(os.path.join("runs", os.environ["CHAINRUN_RUN_ID"]),
                       purge_step=start.global_step(len(data)) if PURGE else None)
for epoch in range(start.epoch, 3):
    for step, (x, y) in ckpt.steps(data, epoch):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        writer.add_scalar("loss", loss.item(), epoch * len(data) + step)
        if step == 2:
            ckpt.save(epoch, step + 1)
        if os.environ["CHAINRUN_SEGMENT"] == "1" and epoch == 1 and step == 4:
            writer.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.save(epoch + 1, 0, done=epoch + 1 == 3)
writer.close()
"""


def logged_steps(logdir: Path) -> list[int]:
    """Every step of the scalar "loss" as TensorBoard shows it: read by tensorboard's own
    reader, which drops what a writer's purge_step voided."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(logdir))
    accumulator.Reload()
    return [event.step for event in accumulator.Scalars("loss")]


@pytest.mark.slow
@pytest.mark.parametrize("purge", [True, False])
def test_after_a_crash_between_two_saves_tensorboard_shows_every_step_once(
    tmp_path: Path, chainrun: CLI, purge: bool
) -> None:
    """Segment 1 is killed (SIGKILL) two steps past its last save; segment 2 resumes from that
    save and trains those steps again. With purge_step=start.global_step(...) each step is
    on the curve once; without it (the control), the two retrained steps are there twice."""
    need("torch", importlib.util.find_spec("torch") is not None, "pip install 'chainrun[torch]'")
    need(
        "tensorboard",
        importlib.util.find_spec("tensorboard") is not None,
        "pip install 'chainrun[tensorboard]'",
    )
    home = tmp_path / "work"
    home.mkdir()
    (home / "train.py").write_text(TENSORBOARD_TRAINER)
    path = home / "job.toml"
    path.write_text(
        f'name = "tb"\ncommand = "{sys.executable} train.py {"purge" if purge else "keep"}"\n'
        'total_time = "30m"\nwalltime = "5m"\ntarget_epoch = 3\n'
    )
    result = chainrun("run", str(path), "--interval", "0.3", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    (chain,) = json.loads(chainrun("status", "--json", check=True).stdout)
    assert [s["outcome"] for s in chain["segments"]][:2] == [
        "failed",
        "completed",
    ]  # then a successor cancelled
    (logdir,) = (home / "runs").iterdir()
    assert logdir.name == tracker_run_id(chain["id"])
    # Segment 1 logged steps 0-9 and was killed; its last save was after step 7 (epoch 1, 3 steps).
    zigzag = [*range(10), *range(8, 15)]  # without purge_step: 8 and 9 twice, the curve going back
    assert logged_steps(logdir) == (list(range(15)) if purge else zigzag)


# A training script as its author wrote it for MLflow, unchanged: it picks its experiment and
# starts a run, naming none. Each segment logs three steps of one epoch and commits its progress.
MLFLOW_TRAINER = """\
import os
import mlflow
from chainrun.checkpoint import load_progress, write_progress

ckdir = os.environ["CHAINRUN_CHECKPOINT_DIR"]
os.makedirs(ckdir, exist_ok=True)
done = load_progress(ckdir)
epoch = done["epoch"] if done else 0
mlflow.set_experiment("chainrun-test")
with mlflow.start_run():
    for step in range(epoch * 3, epoch * 3 + 3):
        mlflow.log_metric("loss", 1.0 / (step + 1), step=step)
with open(os.path.join(ckdir, "model.txt"), "w") as f:
    f.write(str(epoch + 1))
write_progress(ckdir, epoch=epoch + 1, step=0, file="model.txt")
"""

# Every run of the store, deleted ones too, read back by MLflow's own client: its name, its
# experiment's name, its chainrun.run_id tag, whether it is deleted, and the (step, value) of
# each point of the metric argv[1], by step.
MLFLOW_READER = """\
import json, sys, mlflow
from mlflow.entities import ViewType
client = mlflow.MlflowClient()
runs = mlflow.search_runs(search_all_experiments=True, output_format="list", run_view_type=ViewType.ALL)
print(json.dumps([{"name": r.info.run_name, "experiment": client.get_experiment(r.info.experiment_id).name,
                   "tag": r.data.tags.get("chainrun.run_id"), "deleted": r.info.lifecycle_stage == "deleted",
                   "points": sorted([m.step, m.value] for m in client.get_metric_history(r.info.run_id, sys.argv[1]))}
                  for r in runs]))
"""


def mlflow_env(store: Path) -> dict[str, str]:
    """A local file store (MLflow 3 refuses one unless told it is meant)."""
    return {"MLFLOW_TRACKING_URI": f"file://{store}", "MLFLOW_ALLOW_FILE_STORE": "true"}


def mlflow_runs(store: Path, metric: str = "loss") -> list[dict[str, Any]]:
    found = subprocess.run(
        [sys.executable, "-c", MLFLOW_READER, metric],
        env={**os.environ, **mlflow_env(store)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert found.returncode == 0, found.stderr
    return json.loads(found.stdout)


@pytest.mark.slow
def test_a_chain_of_three_segments_is_one_mlflow_run_with_every_segments_steps(
    tmp_path: Path, chainrun: CLI
) -> None:
    """[tracking] mlflow = true: the run the first segment's start_run() makes carries the
    chain's tag and name; each later segment's unchanged start_run() continues it."""
    need("mlflow", importlib.util.find_spec("mlflow") is not None, "pip install 'chainrun[mlflow]'")
    home = tmp_path / "work"
    home.mkdir()
    (home / "train.py").write_text(MLFLOW_TRAINER)
    store = home / "mlruns"
    path = home / "job.toml"
    path.write_text(
        f'name = "ML_flow.run"\ncommand = "{sys.executable} train.py"\n'
        'total_time = "30m"\nwalltime = "5m"\ntarget_epoch = 3\n[tracking]\nmlflow = true\n[env]\n'
        + "".join(f'{k} = "{v}"\n' for k, v in mlflow_env(store).items())
    )
    result = chainrun("run", str(path), "--interval", "0.3", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    (chain,) = json.loads(chainrun("status", "--json", check=True).stdout)
    assert len(chain["segments"]) >= 3
    rid = tracker_run_id(chain["id"])
    points = [[step, 1.0 / (step + 1)] for step in range(9)]
    assert mlflow_runs(store) == [
        {"name": rid, "experiment": "chainrun-test", "tag": rid, "deleted": False, "points": points}
    ]


def tracked_segment(
    home: Path, command: str, **env: str
) -> tuple[subprocess.CompletedProcess[str], SegmentJob]:
    """One segment of a chain with [tracking] mlflow = true, run as a scheduler would."""
    job = SegmentJob(
        "hostile-1a2b3c", 2, replace(wrapper_spec(home), command=command, tracking=("mlflow",)), 60
    )
    os.makedirs(job.run_dir, exist_ok=True)
    write_segment(job)
    proc = subprocess.run(
        ["bash", job.script_path], env={**wrapper_env(), **env}, capture_output=True, text=True, timeout=120
    )
    return proc, job


SHOW_RUN = "import os; print(os.environ.get('MLFLOW_RUN_ID', 'none'), os.environ['MLFLOW_RUN_CONTEXT'])"


def test_a_segment_gets_the_chains_mlflow_run_and_not_a_nested_one(work: Path) -> None:  # noqa: F811
    """The run is looked for in every experiment; a nested run tagged as the chain's is not it."""
    need("mlflow", importlib.util.find_spec("mlflow") is not None, "pip install 'chainrun[mlflow]'")
    store = work / "mlruns"
    rid = tracker_run_id("hostile-1a2b3c")
    maker = (
        "import mlflow, sys\n"
        "mlflow.set_experiment('elsewhere')\n"
        "with mlflow.start_run(tags={'chainrun.run_id': sys.argv[1]}) as top:\n"
        "    mlflow.start_run(nested=True, tags={'chainrun.run_id': sys.argv[1]}); mlflow.end_run()\n"
        "print(top.info.run_id)\n"
    )
    made = subprocess.run(
        [sys.executable, "-c", maker, rid],
        env={**os.environ, **mlflow_env(store)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    top = made.stdout.split()[-1]
    proc, _ = tracked_segment(work, f'{sys.executable} -c "{SHOW_RUN}" > seen', **mlflow_env(store))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_id, context = (work / "seen").read_text().split(" ", 1)
    assert run_id == top
    assert json.loads(context) == {"mlflow.runName": rid, "chainrun.run_id": rid}
    assert f"chainrun: segment 2: continuing MLflow run {top} (chainrun.run_id={rid})\n" in proc.stdout


def test_an_mlflow_run_id_in_env_is_used_as_it_is_and_its_run_context_tags_are_kept(tmp_path: Path) -> None:
    spec = parse({**BASE, "tracking": {"mlflow": True}}, "job.toml", tmp_path)
    assert spec.tracking == ("mlflow",) and tracking_environment(spec, "t-0a0b0c") == []  # set in the job
    env = {
        "CHAINRUN_RUN_ID": "t-0a0b0c",
        "MLFLOW_RUN_ID": "mine",
        "MLFLOW_RUN_CONTEXT": '{"team": "a", "chainrun.run_id": "other"}',
    }
    untracked = dict(env)
    assert continue_runs(["wandb"], ["false"], "python train.py", untracked) == [] and untracked == env
    assert continue_runs(["mlflow"], ["false"], "python train.py", env) == []  # "false": no lookup ran
    assert env["MLFLOW_RUN_ID"] == "mine"
    tags = json.loads(env["MLFLOW_RUN_CONTEXT"])
    assert tags == {"mlflow.runName": "t-0a0b0c", "team": "a", "chainrun.run_id": "t-0a0b0c"}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("fault", ["no mlflow", "server down"])
def test_where_the_lookup_fails_the_segment_runs_and_its_log_says_why_in_one_line(
    work: Path,  # noqa: F811
    fault: str,
) -> None:
    """No mlflow in the command's Python (this one, without its site-packages: -S), or a
    tracking server that does not answer: the command runs without MLFLOW_RUN_ID."""
    need("mlflow", importlib.util.find_spec("mlflow") is not None, "pip install 'chainrun[mlflow]'")
    python = work / "bin" / "python"
    python.parent.mkdir()
    python.write_text(
        f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {"-S " if fault == "no mlflow" else ""}"$@"\n'
    )
    python.chmod(0o755)
    env = mlflow_env(work / "mlruns")
    if fault == "server down":
        env["MLFLOW_TRACKING_URI"] = f"http://127.0.0.1:{closed_port()}"
    proc, job = tracked_segment(work, f'{shlex.quote(str(python))} -c "{SHOW_RUN}" > seen', **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (work / "seen").read_text().split(" ", 1)[0] == "none"
    (said,) = [line for line in proc.stdout.splitlines() if "MLflow" in line]
    start = f"chainrun: segment 2: cannot find the chain's MLflow run with {python} ("
    assert said.startswith(start) and said.endswith("); start_run() makes a new one")
    why = said[len(start) :]
    assert why.startswith(
        "ModuleNotFoundError: No module named 'mlflow'" if fault == "no mlflow" else "MlflowException: "
    ), said
    assert "exit=0" in Path(job.stem + ".end").read_text()


@pytest.mark.parametrize(
    ("command", "python"),
    [
        ("/opt/venv/bin/python train.py", "/opt/venv/bin/python"),
        ("python3.11 -m torch.distributed.run train.py", "python3.11"),
        ("'/my dir/python' x", "/my dir/python"),
        ("torchrun --nproc-per-node 2 train.py", "python3"),
        ("cd src && python train.py", "python3"),
        ("echo 'unclosed", "python3"),
    ],
)
def test_the_lookup_runs_the_commands_python_or_python3(command: str, python: str) -> None:
    assert python_of(command) == python
