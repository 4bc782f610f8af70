"""Runtime construction errors a user meets on a group: heads that do not divide over the group,
named as the user passed them (the spec's heads and the group's size; the Runtime takes no tp_size).
Two gloo ranks, CPU."""

from __future__ import annotations

import dataclasses

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
