"""The Ray actor pool: N actors form one gloo group, run functions and Runtime steps (skips without Ray)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardattn.kernels.sparse_mla import sparse_mla_reference
from shardattn.launch.ray_pool import RayRankPool, ray_unavailable_reason
from shardattn.launch.workloads import build_prefill
from shardattn.plan.spec import ModelSpec

REASON = ray_unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"optional dependency missing: {REASON}")

MLA = ModelSpec("sparse_mla", 8, 1, 48, 32, 16, 16, dtype="float32")


def test_pool_forms_a_group_and_runs_runtime_steps() -> None:
    world = 2
    with RayRankPool(world, device="cpu", timeout_s=120) as pool:
        assert pool.backend == "gloo"
        assert pool.run(dist.get_rank) == [0, 1]
        assert pool.run(dist.get_world_size) == [world, world]
        built = pool.build_runtime(MLA, max_batched_tokens=64, mode="shardq", min_shard_tokens=1)
        assert [b["rank"] for b in built] == [0, 1] and all(b["workspace_bytes"] > 0 for b in built)
        step = build_prefill(
            heads=8,
            head_dim=48,
            tokens=40,
            requests=2,
            cached=(3, 20),
            topk=16,
            overlap="dsa",
            dtype=torch.float32,
            device=torch.device("cpu"),
            seed=0,
            block_size=16,
        )
        h = MLA.num_heads // world
        args = [(step.q[:, r * h : (r + 1) * h].contiguous(), step.kv, step.rows) for r in range(world)]
        results = pool.step("prefill", args, seq_lens=step.seq_lens, prefix_lens=step.prefix_lens)
        ref, _ = sparse_mla_reference(step.q, step.kv, step.rows, scale=48**-0.5, v_dim=32)
        for r, (out, lse) in enumerate(results):
            assert out.shape == (40, h, 32) and lse.shape == (40, h)
            assert torch.allclose(out, ref[:, r * h : (r + 1) * h], atol=1e-5, rtol=0)
        with pytest.raises(ValueError, match="per_rank_args must have one tuple per rank"):
            pool.step("prefill", args[:1])
