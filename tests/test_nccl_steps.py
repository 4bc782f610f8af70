"""The parallel steps on GPUs with NCCL: the gloo tests' cases, moved to ``cuda:rank`` on each rank.

Each rank moves its copy of the case's tensors to its GPU, runs the same step function as the
CPU tests (so the Triton kernels and NCCL collectives run), and returns CPU tensors, which the
CPU tests' checks compare with the fp64 and single-process references. Skips without 2 GPUs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests import parallel_helpers, test_dcp, test_pcp, test_shardq

WORLD = 2


def _move(x: Any, device: torch.device) -> Any:
    """``x`` with every tensor inside dicts, lists and tuples moved to ``device``."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: _move(v, device) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_move(v, device) for v in x)
    return x


def _on_gpu(group: dist.ProcessGroup, run: Callable[..., Any], case: dict, *args: Any) -> Any:
    device = torch.device("cuda", torch.cuda.current_device())
    result = run(group, _move(case, device), *args)
    torch.cuda.synchronize(device)
    return _move(result, torch.device("cpu"))


@pytest.fixture
def gpu_tolerance(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel_helpers, "REFERENCE_ERROR_FACTOR", 4.0)
    # the single-process reference on a GPU is the Triton kernel (bf16 probabilities): more ulps from the oracle
    monkeypatch.setattr(parallel_helpers, "REFERENCE_ULPS", 8.0)


@pytest.mark.gpu
@pytest.mark.distributed
def test_shardq_prefill_on_nccl(dist_pool, gpu_tolerance) -> None:
    case = test_shardq._case(11, [700, 333], [0, 64], WORLD, 8, 128, sinks=True)
    results = dist_pool.run(_on_gpu, test_shardq._run, case, 0, 8, world_size=WORLD, backend="nccl")
    assert all(sharded for *_, sharded in results)
    test_shardq._check(results, case, WORLD)


@pytest.mark.gpu
@pytest.mark.distributed
def test_dcp_sparse_mla_decode_on_nccl(dist_pool, gpu_tolerance) -> None:
    case = test_dcp._mla_case(
        12, [90, 0, 230, 20], [1, 1, 2, 1], WORLD, 2, heads_per_rank=8, k=64, block_size=16, sinks=True
    )
    results = dist_pool.run(_on_gpu, test_dcp._run_mla, case, world_size=WORLD, backend="nccl")
    test_dcp._check_mla(results, case, WORLD)


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(test_dcp.GQA_CASES))
def test_dcp_gqa_decode_on_nccl(dist_pool, gpu_tolerance, name: str) -> None:
    case = test_dcp._gqa_case(13, world=WORLD, interleave=2, **test_dcp.GQA_CASES[name])
    results = dist_pool.run(_on_gpu, test_dcp._run_gqa, case, world_size=WORLD, backend="nccl")
    test_dcp._check_gqa(results, case, WORLD)


@pytest.mark.gpu
@pytest.mark.distributed
def test_pcp_prefill_on_nccl(dist_pool, gpu_tolerance) -> None:
    case = test_pcp._case(14, [110, 20, 170], [50, 0, 90], heads=16, k=64, block_size=16, sinks=True)
    results = dist_pool.run(_on_gpu, test_pcp._run, case, True, world_size=WORLD, backend="nccl")
    test_pcp._check(results, case, WORLD, True)


def _runtime_dsa_prefill(group: dist.ProcessGroup, case: dict, mode: str) -> dict:
    """A bf16 Runtime prefill at DSA dims (576 / 512) with 32 heads per rank: head-TP runs 32 heads
    per kernel call, ShardQ all 64 from its in-place (head-blocked) all-to-all buffers, so on sm_90
    both take the Gluon kernel when it is there."""
    from shardattn.ops.dispatch import sparse_prefill_kernel
    from shardattn.plan.spec import ModelSpec
    from shardattn.runtime.options import PrefillOptions
    from shardattn.runtime.runtime import Runtime

    q, kv, rows = case["q"], case["kv"], case["rows"]
    spec = ModelSpec(
        "sparse_mla", q.shape[1], 1, 576, 512, rows.shape[1], 64, dtype="bfloat16", softmax_scale=576**-0.5
    )
    rt = Runtime(
        spec, group, max_batched_tokens=q.shape[0], mode=mode, warmup=False,
        prefill_options=PrefillOptions(min_shard_tokens=1, cost_model=None),
    )  # fmt: skip
    # cost_model=None: the gate alone routes, so mode "shardq" runs ShardQ
    h = rt.heads_per_rank
    out, lse = rt.prefill(q[:, rt.rank * h : (rt.rank + 1) * h].contiguous(), kv, rows, query_lens=case["lens"])
    heads = spec.num_heads if mode == "shardq" else h
    kernel = sparse_prefill_kernel(q[:, :heads], kv, 512)[0]
    return {"out": out.float(), "lse": lse, "kernel": kernel, "step": rt.plan_prefill(case["lens"]).step}


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["shardq", "headtp"])
def test_runtime_dsa_prefill_on_nccl_matches_the_fp32_reference(dist_pool, mode: str) -> None:
    from shardattn.ops.sparse_mla import sparse_mla_reference

    gen = torch.Generator().manual_seed(23)
    t, heads, k, r = 1300, 64, 256, 5000
    q = torch.randn(t, heads, 576, generator=gen).to(torch.bfloat16)
    kv = torch.randn(r, 576, generator=gen).to(torch.bfloat16)
    rows = torch.randint(-1, r + 40, (t, k), generator=gen, dtype=torch.int32)  # invalid and out of range anywhere
    rows[7] = -1  # a row with no valid key
    case = {"q": q, "kv": kv, "rows": rows, "lens": [700, 600]}
    results = dist_pool.run(_on_gpu, _runtime_dsa_prefill, case, mode, world_size=WORLD, backend="nccl")
    ref_out, ref_lse = sparse_mla_reference(q.float(), kv.float(), rows, scale=576**-0.5, v_dim=512)
    for rank, res in enumerate(results):
        assert res["step"] == mode, res["step"]
        h = heads // WORLD
        want_out, want_lse = ref_out[:, rank * h : (rank + 1) * h], ref_lse[:, rank * h : (rank + 1) * h]
        assert torch.isfinite(res["out"]).all(), (rank, res["kernel"])
        err = float((res["out"] - want_out).norm() / want_out.norm())
        assert err < 1e-2, (rank, res["kernel"], err)  # bf16 inputs and probabilities
        assert torch.equal(res["lse"][7].isneginf(), torch.ones(h, dtype=torch.bool)), "empty row: lse = -inf"
        finite = want_lse.isfinite()
        assert float((res["lse"][finite] - want_lse[finite]).abs().max()) < 2e-2, (rank, res["kernel"])
