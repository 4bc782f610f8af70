"""Which union builder ``build_union(method="auto")`` runs: measured rules, no kernels.

:func:`auto_method` weighs the bitmap builders' count (one bit per KV row, so their cost follows
the cache size) against the sorting builders' sort (which follows the entries); the ratios and
the per-``G`` table are H200 measurements (docs/DECISIONS.md, D12-D15).
"""

from __future__ import annotations

from types import MappingProxyType

from shardattn.kernels.union_bitmap import MAX_ROWS as MAX_BITMAP_ROWS
from shardattn.kernels.union_bitmap import bitmap_words

#: Triton builder per ``G`` for ``method="auto"`` on unsorted rows: the fastest measured on an
#: H200 (K = 2048, DSA-like rows; docs/DECISIONS.md, D12): the fused build at G = 4 / 8, the group
#: sort at G = 1 / 2. With ``rows_sorted=True`` ``"auto"`` is ``"fused"`` (no row sort) unless the
#: shared-memory bitmap takes it (:data:`SMEM_SORTED_RATIO`).
UNION_METHOD = MappingProxyType({1: "sort", 2: "sort", 4: "fused", 8: "fused"})
METHODS = ("auto", "sort", "merge", "fused", "bitmap")
#: ``"auto"`` takes the bitmap builder on unsorted rows when the words it counts per group,
#: ``ceil(R / 32)``, are at most this many times the group's entries ``G * K``: on an H200 it was
#: faster than the sorting builds up to ratio 2 and slower at 4 (K = 2048, DSA-like rows;
#: docs/DECISIONS.md, D14).
BITMAP_SCAN_RATIO = 2
#: On the shared-memory bitmap kernel (:mod:`shardattn.kernels.union_smem`) the same rule with
#: this ratio on unsorted rows, and :data:`SMEM_SORTED_RATIO` on sorted rows at ``G > 1`` (the
#: fused build of sorted rows keeps ``G = 1`` and larger caches). Its cost grows with the windows
#: of 131,072 rows it counts, the sorting builds' does not; measured on an H200 (K = 2048,
#: DSA-like rows, caches of 64K to 1M rows; docs/DECISIONS.md, D15), ratio 4 keeps it below the
#: others at every ``G`` measured (at ``G = 1`` on a 1M-row cache, ratio 16, the row sort wins), and
#: on sorted rows it wins over the fused build only up to ratio 1.
SMEM_SCAN_RATIO = 4
SMEM_SORTED_RATIO = 1


def auto_method(
    group_size: int, topk: int, num_kv_rows: int, rows_sorted: bool = False, shared_memory: bool = False
) -> str:
    """The builder ``method="auto"`` runs.

    With ``shared_memory`` (the bitmap runs on the shared-memory Gluon kernel: sm_90, Gluon) it is
    ``"bitmap"`` while ``ceil(R / 32)`` stays within :data:`SMEM_SCAN_RATIO` times the group's
    entries ``G * K`` on unsorted rows, and within :data:`SMEM_SORTED_RATIO` times on sorted rows
    at ``G > 1``. Otherwise ``"fused"`` on sorted rows; on unsorted rows ``"bitmap"`` (the Triton
    kernel) within :data:`BITMAP_SCAN_RATIO`, else :data:`UNION_METHOD` (``G = 1``: the row sort).
    """
    words = bitmap_words(num_kv_rows)
    entries = group_size * max(topk, 1)
    if rows_sorted:  # G = 1 keeps the fused build of sorted rows (no count at all)
        smem_ratio = SMEM_SORTED_RATIO if group_size > 1 else 0
    else:
        smem_ratio = SMEM_SCAN_RATIO
    if shared_memory and num_kv_rows <= MAX_BITMAP_ROWS and words <= smem_ratio * entries:
        return "bitmap"
    if rows_sorted:
        return "fused"
    if num_kv_rows <= MAX_BITMAP_ROWS and words <= BITMAP_SCAN_RATIO * entries:
        return "bitmap"
    return UNION_METHOD[group_size]
