"""Union builders: the sorted union of a query group's KV rows, one membership bit per query.

Grouped sparse-MLA prefill packs ``G`` consecutive query tokens into one tile; the tile gathers
the union of their top-k rows once and masks, per query, the rows it did not pick. Group ``g``
holds queries ``g*G .. g*G + G - 1`` (a group may span requests: every query keeps its own
rows through its bit); its entries pack the row and one membership bit per query
(:mod:`shardattn.kernels.union_layout`), sorted by row, unique, padded with ``-1`` up to the
buffer width ``G * K``; ``lens[g]`` counts them. With ``G = 1`` entries are plain rows (no bits,
any int32 row): the sorted, de-duplicated valid rows of each query.

Rules:
    * an entry ``rows[t, k]`` is valid when ``0 <= row < num_kv_rows`` and ``k < topk_length[t]``;
    * a row a query lists twice is one key (one bit): duplicates never count twice;
    * queries past ``T`` (the tail of the last group) have no rows; their outputs are discarded;
    * ``G > 1`` needs ``num_kv_rows <= 2**24 - 1``, else :func:`build_union` raises (route such
      steps to the per-query path, ``G = 1``); nothing is truncated.

Triton paths (``method``; the cost depends on ``G * K`` per group, never on the sequence length):

* ``"sort"`` (:mod:`shardattn.kernels.triton.union`): keys, ``torch.sort`` of each group's keys,
  compaction. With ``G = 1`` this is the per-query row sort (sorted, de-duplicated rows).
* ``"fused"`` (:mod:`shardattn.kernels.triton.union_fused`): one launch, one program per group: its
  query lists (filtered, de-duplicated), every merge level (merge path: one binary search per
  8 outputs, then a serial merge) and the compaction. With ``rows_sorted=True`` (each query's
  valid rows already ascending, e.g. a sorted indexer top-k) there is no row sort at all;
  otherwise the row sort (``torch.sort`` of ``[T, K]`` keys) comes first.
* ``"bitmap"`` (:mod:`shardattn.kernels.triton.union_bitmap`): no sort; one bit per KV row, so its cost
  follows the entries and the KV cache size, not the row order; ``num_kv_rows <= 2**24 - 1``.
  On sm_90 with Gluon it runs in shared memory (:mod:`shardattn.kernels.gluon.union_smem`, several
  times the Triton kernel's speed: docs/PERFORMANCE.md); the Triton kernel runs elsewhere.
* ``"auto"`` (:func:`~shardattn.plan.union_routing.route_union_method`) takes ``"bitmap"`` on the
  shared-memory kernel when the KV cache is small enough for its count, else ``"fused"`` whenever
  ``rows_sorted``, ``"bitmap"`` when the cache is small enough for the Triton kernel's count, and
  otherwise the sorting builder per ``G`` (the measured crossovers of :mod:`shardattn.plan.crossovers`).

On the Triton path entries past ``lens[g]`` are left unspecified (the attention kernel never
reads them).

Example:
    >>> rows = torch.tensor([[5, 3, -1], [3, 9, 3], [7, 7, 2]], dtype=torch.int32)
    >>> union, lens = build_union(rows, group_size=2, num_kv_rows=10)
    >>> lens.tolist()
    [3, 2]
    >>> [(e & 0xFFFFFF, (e >> 24) & 0xFF) for e in union[0, :3].tolist()]
    [(3, 3), (5, 1), (9, 2)]
    >>> union[1].tolist()
    [16777218, 16777223, -1, -1, -1, -1]
"""

from __future__ import annotations

import torch

from shardattn._checks import (
    INDEX_DTYPES,
    check_bool,
    check_choice,
    check_disjoint,
    check_int,
    check_not_inputs,
    check_same_device,
    check_tensor,
)
from shardattn.kernels.backend import use_triton
from shardattn.kernels.gluon.union_smem import smem_union, smem_unsupported_reason
from shardattn.kernels.triton.union import sort_union, sorted_row_keys
from shardattn.kernels.triton.union_bitmap import MAX_ROWS as MAX_BITMAP_ROWS
from shardattn.kernels.triton.union_bitmap import bitmap_union
from shardattn.kernels.triton.union_fused import fused_union
from shardattn.kernels.union_layout import (  # noqa: F401 (the encoding's names, public here too)
    GROUP_SIZES,
    MAX_PACKED_ROWS,
    MAX_PLAIN_ROW,
    ROW_BITS,
    num_groups,
    pack_entries,
    unpack_entries,
)
from shardattn.ops.kv_fp8_stage import STAGE_BLOCK_ROWS, mark_touched_blocks
from shardattn.ops.sparse_mla_checks import check_union_workspace
from shardattn.plan.crossovers import UNION_METHOD  # noqa: F401 (public here too)
from shardattn.plan.union_routing import UNION_METHODS, route_union_method

#: ``method=`` values of :func:`build_union`.
METHODS = ("auto", *UNION_METHODS)


def check_union_args(
    rows: torch.Tensor, group_size: int, num_kv_rows: int, topk_length: torch.Tensor | None, rows_sorted: bool = False
) -> None:
    """The arguments of a union build: ``rows [T, K]`` int32, ``group_size`` in :data:`GROUP_SIZES`,
    ``num_kv_rows >= 0`` (``<= 2**24 - 1`` when ``G > 1``), ``topk_length [T]`` int32 or ``None``, on
    rows' device. Raises ``TypeError`` / ``ValueError`` naming the argument."""
    check_tensor("rows", rows, dtypes=INDEX_DTYPES, ndim=2)
    check_bool("rows_sorted", rows_sorted)
    check_int("group_size", group_size)
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    check_int("num_kv_rows", num_kv_rows, minimum=0)
    if group_size > 1 and num_kv_rows > MAX_PACKED_ROWS:
        raise ValueError(
            f"num_kv_rows must be <= {MAX_PACKED_ROWS} for group_size > 1 (24-bit packed rows), got "
            f"{num_kv_rows}; route this step to the per-query path (group_size=1)"
        )
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtypes=INDEX_DTYPES, shape=(rows.shape[0],))
    check_same_device(rows=rows, topk_length=topk_length)


def build_union_reference(
    rows: torch.Tensor,
    *,
    group_size: int,
    num_kv_rows: int,
    topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`build_union` (same outputs, exactly)."""
    check_union_args(rows, group_size, num_kv_rows, topk_length)
    t, k = rows.shape
    g_count = num_groups(t, group_size)
    dev = rows.device
    union = torch.full((g_count, group_size * k), -1, dtype=torch.int32, device=dev)
    lens = torch.zeros(g_count, dtype=torch.int32, device=dev)
    if t == 0 or k == 0:
        return union, lens
    r = rows.long()
    span = min(max(num_kv_rows, 1), MAX_PLAIN_ROW + 1)  # every valid row is below it; keys fit int64
    valid = (r >= 0) & (r < min(num_kv_rows, span))
    if topk_length is not None:
        valid &= torch.arange(k, device=dev)[None, :] < topk_length.long()[:, None]
    tok = torch.arange(t, device=dev)[:, None].expand(t, k)
    grp, j, r = (tok // group_size)[valid], (tok % group_size)[valid], r[valid]
    keys = torch.unique((grp * span + r) * 8 + j)  # sorted; (group, row, query) once
    group_row, bit = keys // 8, torch.ones_like(keys) << (keys % 8)
    uniq, inverse = torch.unique_consecutive(group_row, return_inverse=True)
    bits = torch.zeros_like(uniq).scatter_add_(0, inverse, bit)
    ug, ur = uniq // span, uniq % span
    counts = torch.bincount(ug, minlength=g_count)
    start = torch.cumsum(counts, 0) - counts
    slot = torch.arange(uniq.numel(), device=dev) - start[ug]
    union[ug, slot] = pack_entries(ur, bits) if group_size > 1 else ur.to(torch.int32)
    return union, counts.to(torch.int32)


def _resolve(
    group_size: int, method: str, rows_sorted: bool, topk: int, num_kv_rows: int, shared_memory: bool = False
) -> str:
    check_choice("method", method, METHODS)
    if method == "auto":
        method = route_union_method(group_size, topk, num_kv_rows, rows_sorted=rows_sorted, shared_memory=shared_memory)
    if group_size == 1 and method != "bitmap" and not (method == "fused" and rows_sorted):
        method = "sort"  # one query per group: the row sort is the whole build
    return method


def build_union(
    rows: torch.Tensor,
    *,
    group_size: int,
    num_kv_rows: int,
    topk_length: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    method: str = "auto",
    rows_sorted: bool = False,
    block_marks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted union of each group's valid rows with membership bits (see the module docstring).

    Args:
        rows: ``[T, K]`` int32 global KV rows, ``-1`` / out of range = invalid, anywhere.
        group_size: ``G`` in ``(1, 2, 4, 8)``.
        num_kv_rows: ``R``, rows of the KV cache (valid rows are ``< R``); ``<= 2**24 - 1``
            when ``G > 1``.
        topk_length: ``[T]`` int32, optional per-row count of leading entries to use.
        out: optional preallocated ``(union [ceil(T/G), G*K] int32, lens [ceil(T/G)] int32)``, both
            contiguous and not sharing bytes with each other, ``block_marks``, ``rows`` or
            ``topk_length`` (the builders' programs write them while others still read the rows).
        method: Triton builder, ``"auto"`` (:func:`~shardattn.plan.union_routing.route_union_method`),
            ``"sort"``, ``"fused"`` or ``"bitmap"`` (same outputs; ignored by the torch reference;
            ``G = 1`` is the row sort unless ``"fused"`` on sorted rows or ``"bitmap"``).
        rows_sorted: the caller guarantees that each query's *valid* entries are non-decreasing
            in list order (invalid ones anywhere, repeats allowed; the sorted-input contract of
            :mod:`shardattn.kernels.triton.union_fused`). Trusted, not checked: the ``"fused"`` builder
            then skips the row sort (a list that breaks the order gets an unspecified, in-bounds
            union); the ``"sort"`` builder and the reference sort anyway.
        block_marks: optional int32 ``[ceil(R / 64)]``: set to 1 at every 64-row block
            (:data:`~shardattn.ops.kv_fp8_stage.STAGE_BLOCK_ROWS`) the union
            has a row in (others left as they are): the blocks an ``fp8_ds_mla`` prefill stages
            (:func:`~shardattn.ops.kv_fp8_stage.stage_marks`). The shared-memory build marks them
            as it counts its bitmap (no second read of the union); every other path marks them
            after the build (:func:`~shardattn.ops.kv_fp8_stage.mark_touched_blocks`).
    Returns:
        ``(union [ceil(T/G), G*K] int32, lens [ceil(T/G)] int32)``; on the Triton path the
        entries past ``lens[g]`` are unspecified (the reference fills them with ``-1``).
    """

    check_union_args(rows, group_size, num_kv_rows, topk_length, rows_sorted)
    if block_marks is not None:
        check_tensor("block_marks", block_marks, dtypes=(torch.int32,), shape=(-(-num_kv_rows // STAGE_BLOCK_ROWS),),
                     device=rows.device)  # fmt: skip
    union, lens, marked = _build(rows, group_size, num_kv_rows, topk_length, out, method, rows_sorted, block_marks)
    if block_marks is not None and not marked:
        mark_touched_blocks(union, lens, block_marks, group_size=group_size)
    return union, lens


def _build(
    rows: torch.Tensor,
    group_size: int,
    num_kv_rows: int,
    topk_length: torch.Tensor | None,
    out: tuple[torch.Tensor, torch.Tensor] | None,
    method: str,
    rows_sorted: bool,
    block_marks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """:func:`build_union` on checked arguments: ``(union, lens, whether block_marks were marked)``."""
    shared_memory = smem_unsupported_reason(rows, group_size) is None
    method = _resolve(group_size, method, rows_sorted, rows.shape[1], num_kv_rows, shared_memory)
    if method == "bitmap" and num_kv_rows > MAX_BITMAP_ROWS:
        raise ValueError(f"num_kv_rows must be <= {MAX_BITMAP_ROWS} for method='bitmap', got {num_kv_rows}")
    t, k = rows.shape
    g_count = num_groups(t, group_size)
    if out is not None:
        union, lens = check_union_workspace(out, rows.device, name="out")  # a pair, contiguous, disjoint
        check_tensor("out[0]", union, shape=(g_count, group_size * k))
    # the builders write union, lens and marks while other programs still read rows
    written = {"out[0]": None, "out[1]": None, "block_marks": block_marks}
    if out is not None:
        written["out[0]"], written["out[1]"] = union, lens
        check_disjoint(**written)
    check_not_inputs(written, {"rows": rows, "topk_length": topk_length})
    if not use_triton(rows, topk_length):
        ref_union, ref_lens = build_union_reference(
            rows, group_size=group_size, num_kv_rows=num_kv_rows, topk_length=topk_length
        )
        if out is None:
            return ref_union, ref_lens, False
        union.copy_(ref_union)
        lens.copy_(ref_lens)
        return union, lens, False
    if out is None:
        union = torch.empty(g_count, group_size * k, dtype=torch.int32, device=rows.device)
        lens = torch.empty(g_count, dtype=torch.int32, device=rows.device)
    if g_count == 0:
        return union, lens, False
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    if method == "bitmap":  # the kernel known above: no second look at the device
        if shared_memory:
            smem_union(rows, topk_length, num_kv_rows, group_size, union, lens, block_marks=block_marks,
                       mark_block_rows=STAGE_BLOCK_ROWS)  # fmt: skip
            return union, lens, block_marks is not None
        bitmap_union(rows, topk_length, num_kv_rows, group_size, union, lens)
        return union, lens, False
    if method == "fused":
        max_row = min(num_kv_rows - 1, MAX_PLAIN_ROW)
        if rows_sorted:
            fused_union(rows, topk_length, max_row, group_size, union, lens)
        else:  # each query's rows sorted first (invalid = INT32_MAX at the end, topk_length applied)
            keys = sorted_row_keys(rows, topk_length, num_kv_rows)
            fused_union(keys, None, max_row, group_size, union, lens)
        return union, lens, False
    sort_union(rows, topk_length, num_kv_rows, group_size, union, lens)
    return union, lens, False
