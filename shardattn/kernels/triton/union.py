"""The sorting union builder's Triton kernels and launchers (the contract: :mod:`shardattn.ops.union`).

``"sort"``: a keys kernel writes ``row * 8 + j`` per entry (int32: ``row < 2**24`` so keys stay
below ``2**27``), ``torch.sort`` sorts each group's ``G * K`` keys, and a compaction kernel (one
program per group) marks run ends and ORs each run's bits with prefix sums. With ``G = 1`` this
is the per-query row sort (sorted, de-duplicated rows). :func:`sorted_row_keys` is that row sort
alone, the first step of the fused build of unsorted rows.
"""

from __future__ import annotations

import torch

from shardattn._ints import next_pow2
from shardattn.kernels.backend import COMPILE_OPTIONS, unit_stride
from shardattn.kernels.gluon.union_smem import smem_kernels
from shardattn.kernels.triton.union_bitmap import bitmap_kernels
from shardattn.kernels.triton.union_fused import fused_kernel
from shardattn.kernels.union_layout import MAX_PLAIN_ROW

try:
    import triton
    import triton.language as tl

    from shardattn.kernels.triton.union_fused import compact_sorted_keys
except ImportError:  # the torch reference still works
    triton = None

__all__ = ["sort_union", "sorted_row_keys", "union_kernels", "union_launch_config"]


if triton is not None:

    @triton.jit(do_not_specialize=["T", "max_row"])
    def _union_keys_kernel(
        ROWS, TOPK_LEN, KEYS,
        T, K, max_row, stride_rows_t,
        G: tl.constexpr, BLOCK_K: tl.constexpr, HAS_LEN: tl.constexpr,
    ):  # fmt: skip
        # keys[t, k] = row * 8 + (t % G) (plain row for G == 1), INT32_MAX when invalid or t >= T
        SHIFT: tl.constexpr = 3 if G > 1 else 0
        t = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_end = tl.where(t < T, K, 0)
        if HAS_LEN:
            k_end = tl.minimum(k_end, tl.load(TOPK_LEN + t, mask=t < T, other=0))
        ok = c < k_end
        row = tl.load(ROWS + t * stride_rows_t + c, mask=ok, other=-1)
        ok = ok & (row >= 0) & (row <= max_row)
        key = tl.where(ok, (row << SHIFT) | (t % G).to(tl.int32), 2147483647)
        tl.store(KEYS + t * K + c, key, mask=c < K)

    @triton.jit
    def _union_compact_kernel(
        SORTED, UNION, LENS,
        width, stride_sorted_g, stride_union_g,
        G: tl.constexpr, CHUNK: tl.constexpr,
    ):  # fmt: skip
        # one program per group over its sorted keys (compact_sorted_keys)
        g = tl.program_id(0).to(tl.int64)
        n = compact_sorted_keys(SORTED + g * stride_sorted_g, UNION + g * stride_union_g, width, G, CHUNK)
        tl.store(LENS + g, n)


def union_kernels() -> tuple:
    """The Triton union kernels (keys, compact, fused, bitmap), for warm-up and compile counting."""
    return (_union_keys_kernel, _union_compact_kernel, fused_kernel(), *bitmap_kernels(), *smem_kernels())


def union_launch_config(group_size: int, topk: int) -> dict[str, int]:
    """Constexprs of the union kernels for ``(G, K)`` (the warm-up key): ``BLOCK_K`` / ``CHUNK`` of
    the keys and compaction kernels."""
    kp = max(16, next_pow2(topk))
    return {"G": group_size, "BLOCK_K": min(kp, 1024), "CHUNK": min(group_size * kp, 2048)}


def sorted_row_keys(rows: torch.Tensor, topk_length: torch.Tensor | None, num_kv_rows: int) -> torch.Tensor:
    """``[T, K]`` int32: each query's valid rows ascending, INT32_MAX (invalid) at the end."""
    topk_length = unit_stride(topk_length)
    t, k = rows.shape
    cfg = union_launch_config(1, k)
    keys = torch.empty(t, k, dtype=torch.int32, device=rows.device)
    _union_keys_kernel[(t, triton.cdiv(k, cfg["BLOCK_K"]))](
        rows, topk_length if topk_length is not None else keys, keys, t, k, min(num_kv_rows - 1, MAX_PLAIN_ROW),
        rows.stride(0), HAS_LEN=topk_length is not None, BLOCK_K=cfg["BLOCK_K"], G=1, **COMPILE_OPTIONS,
    )  # fmt: skip
    return torch.sort(keys, dim=1).values


def sort_union(
    rows: torch.Tensor,
    topk_length: torch.Tensor | None,
    num_kv_rows: int,
    group_size: int,
    union: torch.Tensor,
    lens: torch.Tensor,
) -> None:
    """The ``"sort"`` builder into ``union`` / ``lens``: keys kernel, ``torch.sort`` of each group's
    keys, compaction (inputs checked by :func:`~shardattn.ops.union.build_union`)."""
    topk_length = unit_stride(topk_length)
    cfg = union_launch_config(group_size, rows.shape[1])
    t, k = rows.shape
    g_count = union.shape[0]
    keys = torch.empty(g_count * group_size, k, dtype=torch.int32, device=rows.device)
    _union_keys_kernel[(g_count * group_size, triton.cdiv(k, cfg["BLOCK_K"]))](
        rows, topk_length if topk_length is not None else lens, keys, t, k, min(num_kv_rows - 1, MAX_PLAIN_ROW),
        rows.stride(0), G=group_size, BLOCK_K=cfg["BLOCK_K"], HAS_LEN=topk_length is not None, **COMPILE_OPTIONS,
    )  # fmt: skip
    ordered = torch.sort(keys.view(g_count, group_size * k), dim=1).values
    _union_compact_kernel[(g_count,)](
        ordered, union, lens, group_size * k, ordered.stride(0), union.stride(0),
        G=group_size, CHUNK=cfg["CHUNK"], **COMPILE_OPTIONS,
    )  # fmt: skip
