"""Runtime construction errors a user meets on a group: heads that do not divide over the group,
named as the user passed them (the spec's heads and the group's size; the Runtime takes no tp_size),
and ranks given different specs or modes, refused on every rank by the construction's one
all-gather. Two gloo ranks, CPU."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch.distributed as dist

from shardattn.runtime.runtime import Runtime
from tests.test_runtime import MLA


def _heads_body(group: dist.ProcessGroup) -> str:
    try:
        Runtime(dataclasses.replace(MLA, num_heads=3), group, max_batched_tokens=8, mode="headtp", warmup=False)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.distributed
def test_heads_that_do_not_divide_name_the_spec_and_the_group_size(dist_pool) -> None:
    for msg in dist_pool.run(_heads_body, world_size=2):
        assert msg == "the spec's num_heads (3) must be divisible by the group's size (2)", msg
        assert "tp_size" not in msg


def _disagree_body(group: dist.ProcessGroup, field: str) -> dict:
    rank = dist.get_rank(group)
    spec, mode = MLA, "headtp"
    if rank == 1 and field == "spec":
        spec = dataclasses.replace(MLA, num_heads=4)  # divides over the ranks too: only agreement catches it
    if rank == 1 and field == "mode":
        mode = "mixed"
    start = time.monotonic()
    try:
        Runtime(spec, group, max_batched_tokens=8, mode=mode, warmup=False)
    except ValueError as e:
        return {"error": str(e), "s": time.monotonic() - start}
    return {"error": None, "s": time.monotonic() - start}


@pytest.mark.distributed
@pytest.mark.parametrize("field", ["spec", "mode"])
def test_ranks_given_different_specs_or_modes_all_fail_at_construction(dist_pool, field: str) -> None:
    results = dist_pool.run(_disagree_body, field, world_size=2)
    for rank, res in enumerate(results):
        msg = res["error"]
        assert msg is not None, f"rank {rank} built its Runtime"
        assert msg.startswith(f"Runtime {field}: rank(s) [1] disagree with rank(s) [0]; every rank must pass"), msg
        assert res["s"] < 30, res  # at once, not after a collective's timeout
    own = {"spec": ("num_heads=8", "num_heads=4"), "mode": ("'headtp'", "'mixed'")}[field]
    assert all(value in res["error"] for value, res in zip(own, results)), results  # each rank's own value


def _agree_body(group: dist.ProcessGroup) -> int:
    return Runtime(MLA, group, max_batched_tokens=8, mode="headtp", warmup=False).heads_per_rank


@pytest.mark.distributed
def test_ranks_given_the_same_spec_build(dist_pool) -> None:
    assert dist_pool.run(_agree_body, world_size=2) == [4, 4]
