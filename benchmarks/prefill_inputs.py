"""Inputs and timing shared by the prefill benchmarks (``sparse_prefill.py``, ``union_build.py``):
DSA shapes, top-k rows through a shuffled block table, q / KV draws (caches of tens of GB filled a
chunk at a time) and their FP8 rows, output buffers, L2-flushed medians."""

from __future__ import annotations

import statistics
import time

import torch
from kv_pool import scattered_pages

from shardattn.ops.kv_fp8 import dequantize_kv, quantize_kv
from shardattn.ops.topk import convert_topk
from shardattn.plan.kv_format import FP8_DS_MLA_ROW_BYTES
from shardattn.workload import synthetic_topk

D_V, D_R, BLOCK = 512, 64, 64
#: Largest relative error against the fp32 reference a bf16 path may show (measured ~2e-3).
TOLERANCE = 2e-2
#: KV rows drawn (and quantised) at a time.
CHUNK = 1 << 20

#: GPU cycles the device spins after each flush (~0.25 ms at the H200's 1.98 GHz), so the host's
#: launches are queued before the timed region starts: ``timed`` measures the GPU's time, not the
#: host's Python overhead (which a union build of ~0.04 ms otherwise showed: 0.083 against 0.045).
HOST_LEAD_CYCLES = 500_000


def default_kv_rows(tokens: int) -> int:
    """KV rows of a benchmark request: 65,536 up to 4,096 tokens, 131,072 above."""
    return 65536 if tokens <= 4096 else 131072


def l2_flush(device: torch.device) -> torch.Tensor | None:
    """A 256 MiB buffer whose write evicts the L2 (``None`` off CUDA: :func:`timed` then uses the host clock)."""
    return torch.empty(256 << 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None


def timed(fn, flush: torch.Tensor | None, reps: int) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs after one warm-up run.

    On CUDA (``flush`` given): CUDA events, the L2 flushed before each run and the device held
    :data:`HOST_LEAD_CYCLES` after the flush, so the host's launches are ahead. On the CPU
    (``flush`` None): the host clock around each run."""
    fn()
    if flush is None:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
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


def make_case(
    tokens: int,
    kv_rows: int,
    topk: int,
    workload: str,
    seed: int,
    pool_rows: int | None = None,
    device: torch.device | str = "cuda",
):
    """Top-k positions -> global rows through a shuffled block table (one request of ``kv_rows``
    tokens whose blocks are drawn from a cache of ``pool_rows`` rows, default ``kv_rows``).

    Returns ``(pos, req, table, seq, rows, counts)``: ``rows [T, topk]`` int32 global rows (``-1``
    invalid) and ``counts [T]`` their valid entries."""
    dev = torch.device(device)
    pos = synthetic_topk(tokens, topk, start_position=kv_rows - tokens, overlap=workload, seed=seed, device=dev)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks = scattered_pages(kv_rows // BLOCK, (pool_rows or kv_rows) // BLOCK, gen)
    table = blocks.to(torch.int32)[None, :].to(dev)
    req = torch.zeros(tokens, dtype=torch.int32, device=dev)
    seq = torch.tensor([kv_rows], dtype=torch.int32, device=dev)
    rows, counts = convert_topk(pos, req, table, block_size=BLOCK, seq_lens=seq)
    return pos, req, table, seq, rows, counts


def random_qkv(tokens: int, heads: int, kv_rows: int, seed: int, device: torch.device, dtype=torch.bfloat16):
    """Queries ``[tokens, heads, D_V + D_R]``, then KV rows ``[kv_rows, D_V + D_R]``: normal draws
    from one generator on ``device`` seeded ``seed``, in ``dtype``; the rows drawn :data:`CHUNK` at a
    time, so a cache of tens of GB needs no fp32 copy of itself."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(tokens, heads, D_V + D_R, device=device, generator=gen).to(dtype)
    kv = torch.empty(kv_rows, D_V + D_R, device=device, dtype=dtype)
    for start in range(0, kv_rows, CHUNK):
        n = min(CHUNK, kv_rows - start)
        kv[start : start + n] = torch.randn(n, D_V + D_R, device=device, generator=gen).to(dtype)
    return q, kv


def fp8_rows_of(kv: torch.Tensor) -> torch.Tensor:
    """``kv``'s rows quantised to ``fp8_ds_mla`` (``[R, 656]`` uint8), and ``kv`` overwritten with
    the values they dequantise to, :data:`CHUNK` rows at a time."""
    kv8 = torch.empty(kv.shape[0], FP8_DS_MLA_ROW_BYTES, device=kv.device, dtype=torch.uint8)
    for start in range(0, kv.shape[0], CHUNK):
        end = min(kv.shape[0], start + CHUNK)
        kv8[start:end] = quantize_kv(kv[start:end])
        kv[start:end] = dequantize_kv(kv8[start:end], kv.dtype)
    return kv8


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


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in fp32 (Frobenius norms)."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
