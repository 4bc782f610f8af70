"""Which builder makes a group's union of top-k rows (``build_union(method="auto")``), and why.

The bitmap builds count one bit per KV row (their cost follows the cache size), the sorting builds
sort the entries; :func:`route_union_method` weighs the two with the measured crossovers of
:mod:`shardattn.plan.crossovers`.
"""

from __future__ import annotations

from shardattn._checks import check_bool
from shardattn.plan.crossovers import (
    BITMAP_SCAN_RATIO,
    DEDUP_HASH_MAX_TOKENS,
    SMEM_SCAN_RATIO,
    SMEM_SORTED_RATIO,
    UNION_METHOD,
)
from shardattn.plan.routing import MAX_GROUPED_KV_ROWS

#: Most entries a token may list for the hash de-duplication (its kernel holds a row in one
#: program: :data:`shardattn.kernels.triton.unique_rows.MAX_ENTRIES`).
MAX_UNIQUE_ENTRIES = 8192

__all__ = ["ROW_DEDUP_METHODS", "UNION_METHODS", "route_row_dedup", "route_union_method"]

UNION_METHODS = ("sort", "fused", "bitmap")
#: What :func:`route_row_dedup` picks from.
ROW_DEDUP_METHODS = ("union", "unique")


def route_union_method(
    group_size: int, topk: int, num_kv_rows: int, *, rows_sorted: bool = False, shared_memory: bool = False
) -> str:
    """The union builder ``build_union(method="auto")`` runs.

    The bitmap builds count one bit per KV row (their cost follows the cache size), the sorting
    builds sort the entries. With ``shared_memory`` (the bitmap runs on the shared-memory Gluon
    kernel: sm_90, Gluon) it is ``"bitmap"`` while ``ceil(R / 32)`` stays within
    :data:`~shardattn.plan.crossovers.SMEM_SCAN_RATIO` times the group's entries ``G * K`` on
    unsorted rows, and within :data:`~shardattn.plan.crossovers.SMEM_SORTED_RATIO` times on sorted
    rows at ``G > 1``. Otherwise ``"fused"`` on sorted rows; on unsorted rows ``"bitmap"`` (the
    Triton kernel) within :data:`~shardattn.plan.crossovers.BITMAP_SCAN_RATIO`, else the builder of
    :data:`~shardattn.plan.crossovers.UNION_METHOD` (``G = 1``: the row sort). Caches of
    :data:`MAX_GROUPED_KV_ROWS` rows or more never take the bitmap.

    >>> route_union_method(4, 2048, 1 << 16), route_union_method(4, 2048, 1 << 22)
    ('bitmap', 'fused')
    >>> route_union_method(2, 2048, 1 << 16, rows_sorted=True), route_union_method(2, 2048, 1 << 16, shared_memory=True)
    ('fused', 'bitmap')
    """
    check_bool("rows_sorted", rows_sorted)
    check_bool("shared_memory", shared_memory)
    words = -(-num_kv_rows // 32)
    entries = group_size * max(topk, 1)
    fits = num_kv_rows <= MAX_GROUPED_KV_ROWS
    if rows_sorted:  # G = 1 keeps the fused build of sorted rows (no count at all)
        smem_ratio = SMEM_SORTED_RATIO if group_size > 1 else 0
    else:
        smem_ratio = SMEM_SCAN_RATIO
    if shared_memory and fits and words <= smem_ratio * entries:
        return "bitmap"
    if rows_sorted:
        return "fused"
    if fits and words <= BITMAP_SCAN_RATIO * entries:
        return "bitmap"
    return UNION_METHOD[group_size]


def route_row_dedup(topk: int, num_kv_rows: int, *, tokens: int | None = None, shared_memory: bool = False) -> str:
    """How a step without ``rows_unique`` de-duplicates each of its ``tokens``' ``topk`` rows where
    one query is a group (decode; a per-query prefill kernel call on rows in q's dtype):
    ``"unique"`` (:func:`~shardattn.ops.unique_rows.unique_rows`: repeats dropped in place, a
    cost that follows ``topk`` alone; a prefill then packs the kept rows, and asks without
    ``tokens``) up to
    :data:`~shardattn.plan.crossovers.DEDUP_HASH_MAX_TOKENS` tokens, and beyond where the union
    would sort; ``"union"`` (:func:`~shardattn.ops.union.build_union` with ``group_size=1``: rows
    sorted) where that build takes its bitmap (:func:`route_union_method`) from more tokens (or
    ``tokens=None``), and where ``topk`` is past the hash kernel's
    :data:`~shardattn.kernels.triton.unique_rows.MAX_ENTRIES`.

    >>> route_row_dedup(2048, 1 << 16, tokens=64, shared_memory=True), route_row_dedup(2048, 40_000_000)
    ('union', 'unique')
    >>> route_row_dedup(2048, 1 << 16, tokens=8, shared_memory=True)
    'unique'
    """
    if topk > MAX_UNIQUE_ENTRIES:
        return "union"
    if tokens is not None and tokens <= DEDUP_HASH_MAX_TOKENS:
        return "unique"
    if route_union_method(1, topk, num_kv_rows, shared_memory=shared_memory) == "bitmap":
        return "union"
    return "unique"
