"""The host side of async saves: buffers allocated ahead and reused, copies waited for on every
device, and the device of the DDP stop flag (issue 38). This machine has no GPU: CUDA tensors
are stood in for by CPU tensors that say they live on a GPU, so the staging code takes the
same path as on a GPU machine, pinned memory aside (allocated only where CUDA is)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_support import no_chainrun_env, restore_signal_handlers  # noqa: F401

from chainrun.checkpoint import CheckpointError, SegmentClock
from chainrun.checkpoint import torch as ckpt_torch
from chainrun.checkpoint.torch import Checkpointer, _Stager


def model_and_adam() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(3, 8)).square().sum().backward()
    optimizer.step()


def reserved(ckpt: Checkpointer) -> dict[tuple[Any, ...], int]:
    """The host buffers allocated so far, once the allocation in progress is done."""
    if ckpt._reserving is not None:
        ckpt._reserving.join(timeout=60)
        assert not ckpt._reserving.is_alive(), "the buffers were never allocated"
    return {key: buffer.data_ptr() for key, buffer in ckpt._staging.items()}


def test_async_checkpointer_allocates_its_host_buffers_ahead_and_the_first_save_reuses_them(
    tmp_path: Path,
) -> None:
    """Buffers for the model at creation, for Adam's state right after its first step (Adam has
    none before), each in a background thread; the first save copies into those very buffers."""
    model, optimizer = model_and_adam()
    ckpt = Checkpointer(
        tmp_path, model=model, optimizer=optimizer, clock=SegmentClock(install=False), async_save=True
    )
    at_creation = reserved(ckpt)
    params = {("objects", "model", name) for name, _ in model.state_dict().items()}
    assert set(at_creation) == params
    step(model, optimizer)
    after_step = reserved(ckpt)
    adam = {key for key in after_step if key[:3] == ("objects", "optimizer", "state")}
    assert len(adam) == 3 * len(params), sorted(adam)  # step, exp_avg and exp_avg_sq per parameter
    assert {key: after_step[key] for key in at_creation} == at_creation
    ckpt.save(1, 0)
    saved = ckpt.wait()
    assert saved is not None
    assert {key: ptr for key, ptr in reserved(ckpt).items() if key in after_step} == after_step
    loaded = torch.load(saved.path, weights_only=True)["objects"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded["model"][name], tensor), name


def test_restore_reserves_the_buffers_of_the_state_it_loaded(tmp_path: Path) -> None:
    """A resumed segment has the optimizer's state from restore(): its buffers are allocated then."""
    model, optimizer = model_and_adam()
    step(model, optimizer)
    Checkpointer(tmp_path, model=model, optimizer=optimizer, clock=SegmentClock(install=False)).save(1, 0)
    model2, optimizer2 = model_and_adam()
    ckpt = Checkpointer(
        tmp_path, model=model2, optimizer=optimizer2, clock=SegmentClock(install=False), async_save=True
    )
    ckpt.restore()
    keys = set(reserved(ckpt))
    assert sum(key[:3] == ("objects", "optimizer", "state") for key in keys) == 3 * len(model2.state_dict())


def test_a_synchronous_checkpointer_allocates_no_host_buffers(tmp_path: Path) -> None:
    """Without async_save nothing is staged, so nothing is allocated ahead either."""
    model, optimizer = model_and_adam()
    ckpt = Checkpointer(tmp_path, model=model, optimizer=optimizer, clock=SegmentClock(install=False))
    step(model, optimizer)
    assert ckpt._reserving is None and ckpt._staging == {}


def on_gpu(index: int) -> type[torch.Tensor]:
    """A tensor class that says it lives on ``cuda:index`` (its data stays in host memory)."""

    class OnGpu(torch.Tensor):
        @property
        def is_cuda(self) -> bool:  # type: ignore[override]
            return True

        @property
        def device(self) -> torch.device:  # type: ignore[override]
            return torch.device("cuda", index)

    return OnGpu


def test_staging_waits_for_the_copies_of_every_device_it_copied_from(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors on two GPUs: stage() waits for cuda:0 and cuda:1 (each device's copies run on its
    own stream), not only for the current device, which let a tensor be written mid-copy."""
    waited: list[Any] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    state = {
        "a": torch.arange(4.0).as_subclass(on_gpu(0)),
        "b": torch.arange(6.0).as_subclass(on_gpu(1)),
        "c": torch.ones(2),
    }
    staged = _Stager({}).stage(state)
    assert sorted(waited, key=str) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert torch.equal(staged["b"], torch.arange(6.0)) and type(staged["b"]) is torch.Tensor


class Group:
    """Stands in for torch.distributed under NCCL, which needs GPUs: what _flag_device asks of it."""

    def get_backend(self) -> str:
        return "nccl"

    def get_rank(self) -> int:
        return 1


def gpus(monkeypatch: pytest.MonkeyPatch, count: int, current: int) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)


def test_the_ddp_stop_flag_refuses_a_rank_left_on_another_ranks_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Local rank 1 that never called torch.cuda.set_device(1) is on cuda:0, rank 0's GPU: the flag
    would go there. It is an error that says which call is missing."""
    gpus(monkeypatch, count=2, current=0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(CheckpointError, match=r"torch\.cuda\.set_device\(1\)"):
        ckpt_torch._flag_device(Group())


@pytest.mark.parametrize(
    ("env", "count", "current", "device"),
    [
        ({"LOCAL_RANK": "1"}, 2, 1, "cuda:1"),  # set_device(local_rank) called
        ({"SLURM_LOCALID": "1"}, 2, 1, "cuda:1"),  # srun without torchrun
        ({"LOCAL_RANK": "1"}, 1, 0, "cuda:0"),  # one GPU visible per rank (CUDA_VISIBLE_DEVICES)
        ({}, 2, 0, "cuda:0"),  # no local rank known: nothing to check against
    ],
)
def test_the_ddp_stop_flag_goes_on_the_ranks_own_gpu(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], count: int, current: int, device: str
) -> None:
    gpus(monkeypatch, count, current)
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert ckpt_torch._flag_device(Group()) == device
