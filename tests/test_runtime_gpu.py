"""The Runtime on a GPU: after construction no step compiles a kernel (bf16 and FP8 caches); allowed graph
captures replay exactly.

On the CPU every kernel is the torch reference, so "compiles nothing" is vacuous there; the CPU
side of the warm-up (every key a route can produce is warmed) is in tests/test_runtime.py.
"""

from __future__ import annotations

import importlib
import itertools
import pkgutil

import pytest
import torch
import torch.distributed as dist

from shardattn.launch.gqa_workloads import build_gqa_decode
from shardattn.launch.workloads import build_decode, build_prefill
from shardattn.ops.kv_fp8 import dequantize_kv, quantize_kv
from shardattn.ops.sparse_mla import sparse_mla_reference
from shardattn.ops.topk import DcpShard
from shardattn.plan.spec import ModelSpec
from shardattn.runtime.cudagraph import GraphInput
from shardattn.runtime.runtime import Runtime

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]


def _jit_kernels() -> dict[str, object]:
    """Every Triton kernel of ``shardattn.kernels`` (module-level, and the lazily built ones)."""
    from triton.runtime.jit import JITFunction

    import shardattn.kernels as pkg

    found: dict[str, object] = {}
    for info in pkgutil.walk_packages(pkg.__path__, prefix="shardattn.kernels."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if isinstance(value, JITFunction) and value.__module__ == module.__name__:
                found[f"{info.name.removeprefix('shardattn.kernels.')}.{name}"] = value
    from shardattn.ops import topk

    if hasattr(topk, "_kernel"):
        found["topk._convert_topk_kernel"] = topk._kernel()
    return found


def _compiled() -> dict[str, int]:
    from shardattn.runtime.warmup import compiled_variants

    return {name: compiled_variants(k) for name, k in _jit_kernels().items()}


def _no_compile_body(group, kind: str, device: str = "cuda") -> dict:
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    # decode16: 16 heads a rank, where small batches run the small-batch Gluon kernel (both its tiles)
    spec = ModelSpec("sparse_mla", 16, 1, 576, 512, 2048, 64, softmax_scale=0.0625) if kind == "decode16" else "glm5"
    fp8 = kind == "prefill_fp8"  # an fp8_ds_mla cache: prefill stages the rows its unions read
    rt = Runtime(
        spec, group, max_batched_tokens=4096, mode="mixed", device=dev, topk=2048, max_decode_tokens=64,
        kv_dtype="fp8_ds_mla" if fp8 else None,
    )  # fmt: skip
    h = rt.heads_per_rank
    before = _compiled()
    errors = []
    if kind.startswith("prefill"):
        # grouped (>= 1024 tokens a rank), per-query (below), with and without topk_length
        # and per-query on a cache past the bitmap's count, where each query's rows are hashed, then packed
        for tokens, requests, cached in ((4096, 2, 4096), (2048 * world, 1, 0), (300, 3, 2500), (64, 1, 300_000)):
            step = build_prefill(
                heads=64,
                head_dim=576,
                tokens=tokens,
                requests=requests,
                cached=(cached,) * requests,
                topk=2048,
                overlap="dsa",
                dtype=torch.bfloat16,
                device=dev,
                seed=1,
            )
            kv = quantize_kv(step.kv) if fp8 else step.kv
            values = dequantize_kv(kv) if fp8 else step.kv  # what the FP8 rows hold
            lengths = (None, torch.full((tokens,), 1500, dtype=torch.int32, device=dev))
            # topk_unique: a per-query call packs each query's rows (pack_rows), not the union build
            for length, unique in itertools.product(lengths, (False, True)):
                out, _ = rt.prefill(
                    step.q[:, rank * h : (rank + 1) * h].contiguous(),
                    kv,
                    step.rows,
                    query_lens=step.query_lens,
                    prefix_lens=step.prefix_lens,
                    topk_length=length,
                    topk_unique=unique,
                )
                # GLM-5's softmax scale, 256 ** -0.5
                ref, _ = sparse_mla_reference(step.q, values, step.rows, scale=0.0625, topk_length=length)
                errors.append(float((out.float() - ref[:, rank * h : (rank + 1) * h].float()).abs().max()))
    else:
        batches = ((1,) * 64, (1, 3, 2, 4), (2,) * 16)
        for q_lens in batches + (((1, 2), (2,) * 4) if kind == "decode16" else ()):
            s = build_decode(
                heads=64,
                head_dim=576,
                requests=len(q_lens),
                cached=(5000,) * len(q_lens),
                q_lens=q_lens,
                topk=2048,
                overlap="dsa",
                causal=True,
                dtype=torch.bfloat16,
                device=dev,
                seed=2,
                shard=DcpShard(world, 1, rank),
                block_size=64,
            )
            ref, _ = sparse_mla_reference(s.q, s.kv, s.rows, scale=0.0625)
            for unique in (False, True):  # topk_unique: no de-duplication sort (its own kernel variants)
                out, _ = rt.decode(
                    s.q[:, rank * h : (rank + 1) * h].contiguous(),
                    s.local_kv,
                    s.local_table,
                    s.seq_lens,
                    topk_pos=s.positions,
                    req_ids=s.req_ids,
                    topk_unique=unique,
                )
                errors.append(float((out.float() - ref[:, rank * h : (rank + 1) * h].float()).abs().max()))
    if dev.type == "cuda":
        torch.cuda.synchronize()
    after = _compiled()
    grew = {k: (before.get(k, 0), v) for k, v in after.items() if v != before.get(k, 0)}
    return {"grew": grew, "err": max(errors), "warmed": len(rt.warmed_keys)}


@pytest.mark.parametrize("kind", ["prefill", "prefill_fp8", "decode", "decode16"])
def test_warmed_runtime_compiles_nothing(dist_pool, kind: str) -> None:
    res = dist_pool.run(_no_compile_body, kind, world_size=1, backend="nccl")[0]
    assert res["grew"] == {}, f"kernels compiled after warm-up: {res['grew']}"
    assert res["err"] <= 3e-2, res["err"]


def _capture_body(group) -> dict:
    dev = torch.device("cuda", torch.cuda.current_device())
    rt = Runtime("gqa-64-8", group, max_batched_tokens=64, mode="headtp", device=dev, max_decode_tokens=64)
    g = build_gqa_decode(
        q_heads=64,
        kv_heads=8,
        head_dim=64,
        sinks=True,
        requests=3,
        cached=(900, 50, 3000),
        q_lens=(2, 2, 2),
        dtype=torch.bfloat16,
        device=dev,
        seed=4,
        shard=DcpShard(1, 1, 0),
        block_size=32,
    )
    k, v = g.k_cache, g.v_cache

    def step(q, block_table, seq_lens):
        return rt.decode(q, (k, v), block_table, seq_lens, q_len_per_req=2, sinks=g.sinks, check=False)

    inputs = [
        GraphInput("q", (64, 64), torch.bfloat16, per="token"),
        GraphInput("block_table", (g.block_table.shape[1],), torch.int32),
        GraphInput("seq_lens", (), torch.int32),
    ]
    out: dict = {"level": rt.cudagraph_support("decode").name}
    try:
        rt.check_capture("decode", q_len_per_req=2, ragged=True)
        out["ragged"] = None
    except ValueError as e:
        out["ragged"] = str(e)
    runner = rt.capture_decode(step, inputs, batch_sizes=[1, 4], q_len_per_req=2)
    replay = runner.run(3, q=g.q, block_table=g.block_table, seq_lens=g.seq_lens)
    replay = tuple(t.clone() for t in replay)
    eager = runner.eager(3, q=g.q, block_table=g.block_table, seq_lens=g.seq_lens)
    out["bitwise"] = all(torch.equal(a, b) for a, b in zip(replay, eager))
    out["shape"] = tuple(replay[0].shape)
    return out


def test_allowed_capture_replays_eager_and_forbidden_one_raises(dist_pool) -> None:
    res = dist_pool.run(_capture_body, world_size=1, backend="nccl")[0]
    assert res["level"] == "UNIFORM_BATCH"
    assert "ragged" in res["ragged"] and "ALWAYS is needed" in res["ragged"]
    assert res["bitwise"] and res["shape"] == (6, 64, 64)
