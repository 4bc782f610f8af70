"""Inputs shared by the decode benchmarks (``decode.py``, ``decode_floor.py``): KV caches of any
size filled a chunk at a time, in bf16 and ``fp8_ds_mla``, and each token's distinct random rows
over the whole cache (on a cache of tens of GB they land on pages spread as an engine's allocator
leaves them); the paged GQA decode steps of ``decode.py``'s ``gqa`` and ``graph`` sections, their
pages optionally scattered over a pool of a given size (``kv_pool.place_pages``)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from kv_pool import place_pages, pool_pages

from shardattn.ops.gqa_decode_reference import gqa_paged_decode_reference
from shardattn.ops.kv_fp8 import dequantize_kv, quantize_kv
from shardattn.plan.kv_format import FP8_DS_MLA_ROW_BYTES

__all__ = [
    "CHUNK", "GQA_BATCH", "GQA_CONTEXT", "GQA_PAGE_SHAPE", "ROW_BYTES", "GqaCache", "build_caches", "distinct_rows",
    "fp8_cache_and_values", "gqa_cache", "gqa_inputs", "gqa_pool_pages", "gqa_reference",
]  # fmt: skip

#: Bytes of a KV row in each format.
ROW_BYTES = {"bf16": 576 * 2, "fp8_ds_mla": FP8_DS_MLA_ROW_BYTES}
#: Rows filled at a time.
CHUNK = 1 << 20
#: The ``gqa`` section's requests, context, and page of 32 tokens x 8 KV heads x 64 (bf16).
GQA_BATCH, GQA_CONTEXT, GQA_PAGE_SHAPE = 64, 8192, (32, 8, 64)


def build_caches(rows: int, formats: list[str], seed: int = 0, device: str = "cuda") -> dict[str, torch.Tensor]:
    """The cache in each format, filled a chunk at a time: ``bf16`` ``[rows, 576]``; ``fp8_ds_mla``
    ``[rows, 656]`` uint8, the same values quantised."""
    g = torch.Generator(device=device).manual_seed(seed)
    caches = {f: torch.empty(rows, ROW_BYTES[f] // (2 if f == "bf16" else 1), device=device,
                             dtype=torch.bfloat16 if f == "bf16" else torch.uint8) for f in formats}  # fmt: skip
    for start in range(0, rows, CHUNK):
        x = torch.randn(min(CHUNK, rows - start), 576, device=device, generator=g)
        if "bf16" in caches:
            caches["bf16"][start : start + x.shape[0]] = x.bfloat16()
        if "fp8_ds_mla" in caches:
            caches["fp8_ds_mla"][start : start + x.shape[0]] = quantize_kv(x)
    return caches


def distinct_rows(batch: int, topk: int, num_rows: int, g: torch.Generator) -> torch.Tensor:
    """``[batch, topk]`` int32 on ``g``'s device: each row ``topk`` distinct ids of ``[0, num_rows)``
    in random order."""
    if topk > num_rows:
        raise ValueError(f"topk ({topk}) exceeds the cache's rows ({num_rows})")
    draw = torch.randint(0, num_rows, (batch, 2 * topk + 64), device=g.device, generator=g).sort(1).values
    dup = torch.zeros_like(draw, dtype=torch.bool)
    dup[:, 1:] = draw[:, 1:] == draw[:, :-1]
    draw = torch.where(dup, num_rows, draw).sort(1).values[:, :topk]  # duplicates last, then cut
    if bool((draw >= num_rows).any()):
        raise RuntimeError("too few distinct rows drawn; use a larger cache")
    order = torch.rand(batch, topk, device=g.device, generator=g).argsort(1)
    return draw.gather(1, order).int()


def fp8_cache_and_values(rows: int, seed: int = 0, device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """An ``fp8_ds_mla`` cache ``[rows, 656]`` and the bf16 rows ``[rows, 576]`` it dequantises to
    (the same values), filled a chunk at a time."""
    kv8 = build_caches(rows, ["fp8_ds_mla"], seed, device)["fp8_ds_mla"]
    kv = torch.empty(rows, 576, device=kv8.device, dtype=torch.bfloat16)
    for start in range(0, rows, CHUNK):
        kv[start : start + CHUNK] = dequantize_kv(kv8[start : start + CHUNK])
    return kv8, kv


class GqaCache(NamedTuple):
    """A paged GQA cache of :func:`gqa_cache` and the state of the generator after drawing it."""

    k: torch.Tensor
    v: torch.Tensor
    table: torch.Tensor
    lens: torch.Tensor
    rng_state: torch.Tensor


def gqa_cache(batch, ctx, hkv=8, d=64, page=32, seed=0, pool_gb=None, device="cuda") -> GqaCache:
    """The K / V pages of ``batch`` requests of ``ctx`` tokens (shuffled, exactly their pages; with
    ``pool_gb``, the same pages at scattered ids of a pool of that many GB, ``kv_pool.place_pages``)."""
    g = torch.Generator(device=device).manual_seed(seed)
    pages_per = -(-ctx // page)
    num_pages = batch * pages_per
    k = torch.randn(num_pages, page, hkv, d, device=device, generator=g).bfloat16()
    v = torch.randn(num_pages, page, hkv, d, device=device, generator=g).bfloat16()
    table = torch.randperm(num_pages, device=device, generator=g).view(batch, pages_per).int()
    (k, v), table = place_pages((k, v), table, pool_gb, seed)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return GqaCache(k, v, table, lens, g.get_state())


def gqa_inputs(batch, ctx, q_len, hq=64, hkv=8, d=64, page=32, ragged=False, seed=0, cache=None, device="cuda"):
    """A paged GQA decode step: ``(q, k, v, table, lens)`` and the query-length keywords; on
    ``cache`` (a :func:`gqa_cache` of the same shapes) when given, else on a new one."""
    if cache is None:
        cache = gqa_cache(batch, ctx, hkv, d, page, seed, device=device)
    g = torch.Generator(device=device)
    g.set_state(cache.rng_state)  # the queries: the same draws on a cache built once or each time
    if ragged:
        q_lens = torch.randint(1, q_len + 1, (batch,), generator=torch.Generator().manual_seed(seed))
        cu = torch.zeros(batch + 1, dtype=torch.int32)
        cu[1:] = q_lens.cumsum(0)
        kw, total = {"cu_q_lens": cu.to(device), "max_q_len": q_len}, int(cu[-1])
    else:
        kw, total = {"q_len_per_req": q_len}, batch * q_len
    q = torch.randn(total, hq, d, device=device, generator=g).bfloat16()
    return (q, cache.k, cache.v, cache.table, cache.lens), kw


def gqa_pool_pages(pool_gb: float) -> int:
    """Pages of the ``gqa`` section's shape in a pool of ``pool_gb`` GB (``ValueError`` when they
    are fewer than its requests need)."""
    page = 2 * 2 * GQA_PAGE_SHAPE[0] * GQA_PAGE_SHAPE[1] * GQA_PAGE_SHAPE[2]  # K and V, bf16
    return pool_pages(pool_gb, page, GQA_BATCH * -(-GQA_CONTEXT // GQA_PAGE_SHAPE[0]))


def gqa_reference(args: tuple, kw: dict, requests: int = 4) -> torch.Tensor:
    """fp32 reference output of the first ``requests`` requests of a :func:`gqa_inputs` step."""
    q, k, v, table, lens = args
    if "cu_q_lens" in kw:
        cu = kw["cu_q_lens"][: requests + 1]
    else:
        cu = torch.arange(requests + 1, dtype=torch.int32, device=q.device) * kw["q_len_per_req"]
    out, _ = gqa_paged_decode_reference(q[: int(cu[-1])], k, v, table[:requests], lens[:requests], cu,
                                        scale=q.shape[-1] ** -0.5)  # fmt: skip
    return out
