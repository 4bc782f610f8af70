"""Which union builder ``build_union(method="auto")`` runs: measured rules, no kernels.

:func:`auto_method` weighs the bitmap builders' count (one bit per KV row, so their cost follows
the cache size) against the sorting builders' sort (which follows the entries); the ratios and
the per-``G`` table are H200 measurements (benchmarks/RESULTS.md).
"""

from __future__ import annotations

from types import MappingProxyType

from shardattn.kernels.triton.union_bitmap import MAX_ROWS as MAX_BITMAP_ROWS
from shardattn.kernels.triton.union_bitmap import bitmap_words

#: Triton builder per ``G`` for ``method="auto"`` on unsorted rows: the fastest measured on an
#: H200 (T = 4K / 16K, K = 2048, DSA-like rows; benchmarks/RESULTS.md): the fused build at G = 4 / 8,
#: the sort at G = 2 (the fused build 0.76-0.78x of it there). With ``rows_sorted=True`` ``"auto"`` is
#: ``"fused"`` (no row sort: 2.1-2.6x the old builder at G = 2 / 4 / 8) unless the shared-memory
#: bitmap takes it (:data:`SMEM_SORTED_RATIO`).
UNION_METHOD = MappingProxyType({1: "sort", 2: "sort", 4: "fused", 8: "fused"})
METHODS = ("auto", "sort", "fused", "bitmap")
#: ``"auto"`` takes the bitmap builder on unsorted rows when the words it counts per group,
#: ``ceil(R / 32)``, are at most this many times the group's entries ``G * K``. Measured on an
#: H200 (benchmarks/RESULTS.md, K = 2048, DSA-like rows, T = 4K / 16K): at ratio 1 / 2 it took
#: 0.18 / 0.93 ms against the row sort's 0.31 / 1.12 (G = 1) and 0.17-0.19 against 0.34-0.50 at
#: G = 2-8; at ratio 2 (a 1M-row cache, G = 8) 0.49 / 1.72 against 0.51 / 1.89; at ratio 4 it
#: lost (0.61 against 0.44 ms).
BITMAP_SCAN_RATIO = 2
#: On the shared-memory bitmap kernel (:mod:`shardattn.kernels.gluon.union_smem`) the same rule with
#: this ratio on unsorted rows, and :data:`SMEM_SORTED_RATIO` on sorted rows at ``G > 1`` (the
#: fused build of sorted rows keeps ``G = 1`` and larger caches). Measured on an H200
#: (benchmarks/RESULTS.md, "Seventh session", K = 2048, DSA-like rows, ms per 4K tokens): at
#: ratio <= 1 (64K-128K rows) 0.04-0.06 at G = 2-8 against 0.12-0.23 for the fused build of
#: sorted rows (G = 1: 0.058 against 0.041); on a 256K-row cache 0.074 / 0.100 / 0.091 / 0.121
#: at G = 8 / 4 / 2 / 1 (the row sort: 0.31); on a 1M-row cache (ratio 2 / 4 / 8 / 16)
#: 0.25 / 0.34 / 0.30 / 0.42 against the unsorted builds' 0.51 / 0.44 / 0.35 / 0.31 and the
#: sorted ones' 0.23 / 0.16 / 0.12. Its cost grows with the windows of 131,072 rows, the others'
#: do not, so ratio 4 keeps it below the others at every ``G`` measured.
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
