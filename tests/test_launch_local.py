"""``run_ranks``, the examples' and the calibration tool's way onto a world of ranks: which backend
and GPU each rank takes (the process group itself is faked: no GPU is needed to ask)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardattn.launch import local


@pytest.fixture
def joined(monkeypatch):
    """Fake GPUs and process-group creation; returns what ``run_ranks`` asked for."""
    seen: dict = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: seen.setdefault("gpu", i))
    monkeypatch.setattr(local, "nccl_options", lambda: None)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.update(backend=backend, **kw))
    monkeypatch.setattr(local, "world_group", lambda: "world")
    monkeypatch.setattr(local, "destroy_groups", lambda: None)
    return seen


@pytest.mark.parametrize(
    ("world", "local_world", "local_rank", "backend", "gpu"),
    [(16, 8, 3, "nccl", 3), (8, 8, 7, "nccl", 7), (2, 2, 1, "nccl", 1), (9, 9, 0, "gloo", None)],
    ids=["two-hosts-of-8", "one-host-of-8", "two-of-8", "nine-on-8-gpus"],
)
def test_run_ranks_under_torchrun_takes_a_gpu_per_local_rank(
    monkeypatch, joined, world, local_world, local_rank, backend, gpu
) -> None:
    """NCCL wherever this host has a GPU for each of its ranks, the rank on ``cuda:LOCAL_RANK``:
    a world of two 8-GPU hosts (``torchrun --nnodes 2 --nproc-per-node 8``, the calibration tool's
    documented command) ran gloo, every rank on GPU 0, as 16 ranks outnumber one host's GPUs."""
    env = {"RANK": str(8 + local_rank if world == 16 else local_rank), "WORLD_SIZE": str(world)}
    env |= {"LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_world)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    groups: list = []
    local.run_ranks(groups.append)
    assert groups == ["world"]
    assert (joined["backend"], joined.get("gpu"), joined["world_size"]) == (backend, gpu, world)
