"""Inputs and timing shared by the prefill benchmarks: DSA shapes, top-k rows, q/KV draws, output
buffers, L2-flushed medians, and the JSON file of results that a run rewrites after each case."""

from __future__ import annotations

import json
import math
import statistics

import torch

from shardattn.ops.topk import convert_topk
from shardattn.workload import synthetic_topk

D_V, D_R, BLOCK = 512, 64, 64


#: GPU cycles the device spins after each flush (~0.25 ms at the H200's 1.98 GHz), so the host's
#: launches are queued before the timed region starts: ``timed`` measures device time, not the
#: host's Python overhead (which a union build of ~0.04 ms otherwise showed: 0.083 against 0.045).
HOST_LEAD_CYCLES = 500_000


def timed(fn, flush: torch.Tensor, reps: int) -> float:
    """Median device milliseconds of ``fn`` over ``reps`` runs, L2 flushed before each (and the
    device held :data:`HOST_LEAD_CYCLES` after the flush, so the host's launches are ahead)."""
    fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        flush.zero_()
        torch.cuda._sleep(HOST_LEAD_CYCLES)
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def make_case(tokens: int, kv_rows: int, topk: int, workload: str, seed: int, pool_rows: int | None = None):
    """Top-k positions -> global rows through a shuffled block table (one request of ``kv_rows``
    tokens whose blocks are drawn from a cache of ``pool_rows`` rows, default ``kv_rows``)."""
    dev = torch.device("cuda")
    pos = synthetic_topk(tokens, topk, start_position=kv_rows - tokens, overlap=workload, seed=seed, device=dev)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks = torch.randperm((pool_rows or kv_rows) // BLOCK, generator=gen)[: kv_rows // BLOCK]
    table = blocks.to(torch.int32)[None, :].to(dev)
    req = torch.zeros(tokens, dtype=torch.int32, device=dev)
    seq = torch.tensor([kv_rows], dtype=torch.int32, device=dev)
    rows, counts = convert_topk(pos, req, table, block_size=BLOCK, seq_lens=seq)
    return pos, req, table, seq, rows, counts


def random_qkv(tokens: int, heads: int, kv_rows: int, seed: int, device: torch.device):
    """bf16 queries ``[tokens, heads, D_V + D_R]``, then KV rows ``[kv_rows, D_V + D_R]``: normal
    draws from one generator on ``device`` seeded ``seed``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(tokens, heads, D_V + D_R, device=device, generator=gen).to(torch.bfloat16)
    kv = torch.randn(kv_rows, D_V + D_R, device=device, generator=gen).to(torch.bfloat16)
    return q, kv


def union_buffers(tokens: int, topk: int, g: int, device: torch.device):
    """``build_union``'s ``out=`` buffers at group size ``g``: entries ``[ceil(T/g), g * topk]`` and
    lengths ``[ceil(T/g)]``, int32 (``g = 1``: the per-query rows)."""
    n_groups = -(-tokens // g)
    return (
        torch.empty(n_groups, g * topk, dtype=torch.int32, device=device),
        torch.empty(n_groups, dtype=torch.int32, device=device),
    )


def attention_buffers(q: torch.Tensor):
    """An attention launch's ``out=`` ``[T, H, D_V]`` (q's dtype) and ``lse=`` ``[T, H]`` fp32 buffers."""
    t, h = q.shape[:2]
    return (
        torch.empty(t, h, D_V, dtype=q.dtype, device=q.device),
        torch.empty(t, h, dtype=torch.float32, device=q.device),
    )


def baseline_gather_bmm(q, kv, rows, scale, chunk=256):
    """torch: gather each token's rows, two bmms, fp32 softmax (duplicates not removed)."""
    t, h, _ = q.shape
    out = torch.empty(t, h, D_V, dtype=q.dtype, device=q.device)
    for t0 in range(0, t, chunk):
        r = rows[t0 : t0 + chunk]
        valid = r >= 0
        keys = kv[r.clamp_min(0).long()]  # [c, K, D]
        s = torch.bmm(q[t0 : t0 + chunk], keys.transpose(1, 2)).float() * scale
        s.masked_fill_(~valid[:, None, :], -math.inf)
        p = torch.softmax(s, dim=-1).nan_to_num_(0.0).to(q.dtype)
        out[t0 : t0 + chunk] = torch.bmm(p, keys[..., :D_V])
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def save_json(path: str | None, results) -> None:
    """Rewrites ``path`` with ``results`` (nothing when ``path`` is None)."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


def keep_time(results: dict, r: dict, out: str | None) -> None:
    """Appends one timed case to ``results["times"]``, prints it, and rewrites ``out``, so a run cut
    short keeps what it measured."""
    results["times"].append(r)
    print("   time:", json.dumps(r), flush=True)
    save_json(out, results)


def keep_kernels(results: dict, kernels: list[dict], out: str | None) -> None:
    """Stores the compiled kernels' report as ``results["kernels"]``, prints it, and rewrites ``out``."""
    results["kernels"] = kernels
    for k in kernels:
        print("   kernel:", json.dumps(k), flush=True)
    save_json(out, results)
