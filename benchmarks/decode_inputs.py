"""Inputs shared by the decode benchmarks (``decode.py``, ``decode_floor.py``): KV caches of any
size filled a chunk at a time, in bf16 and ``fp8_ds_mla``, and each token's distinct random rows
over the whole cache (on a cache of tens of GB they land on pages spread as an engine's allocator
leaves them)."""

from __future__ import annotations

import torch

from shardattn.ops.kv_fp8 import dequantize_kv, quantize_kv
from shardattn.plan.kv_format import FP8_DS_MLA_ROW_BYTES

__all__ = ["CHUNK", "ROW_BYTES", "build_caches", "distinct_rows", "fp8_cache_and_values"]

#: Bytes of a KV row in each format.
ROW_BYTES = {"bf16": 576 * 2, "fp8_ds_mla": FP8_DS_MLA_ROW_BYTES}
#: Rows filled at a time.
CHUNK = 1 << 20


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
