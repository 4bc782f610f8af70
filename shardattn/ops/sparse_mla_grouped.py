"""Grouped sparse-MLA prefill: ``G`` consecutive queries share one tile and one gathered union.

With ``H`` heads per query a Hopper matrix tile of 64 rows is mostly idle for one query
(8 heads: 7/8 padding). Consecutive queries pick mostly the same KV rows, so ``G = 64 / H``
queries are packed into one 64-row tile; the tile gathers the sorted union of their rows once
(:func:`shardattn.ops.union.build_union`) and each row of the tile sees only its own
query's rows through a membership bit: exact, not approximate.

Path selection (:func:`~shardattn.ops.dispatch.prefill_path`, also used by the warm-up):

* ``group_size`` given: that ``G`` (:func:`shardattn.plan.routing.tile_group_size` fills a 64-row
  tile: 8 heads -> 8, 16 -> 4, 32 -> 2, 64 and 128 -> 1; a 128-row Triton tile spills registers);
* default: the planner's routing (:func:`shardattn.plan.routing.grouped_group_size`): grouped only
  up to :data:`~shardattn.plan.crossovers.GROUPED_MAX_HEADS` heads per rank on the Triton kernel;
* on sm_90 with Gluon in Triton the tile runs the Gluon kernel where the routing's measured
  crossovers send ``(heads, G)`` (:func:`shardattn.plan.routing.route_prefill_kernel`), and
  ``group_size=None`` takes the grouped Gluon kernel's ``G``
  (:func:`shardattn.plan.routing.gluon_grouped_group_size`) where that kernel runs;
* on a KV cache of more than ``2**24 - 1`` rows (24-bit packed rows) a kernel call with no
  ``prepared_union`` whose route groups 4 or more queries (8-16 heads) gathers the blocks its rows
  touch into a compact cache first (:mod:`shardattn.ops.kv_compact`, one host sync; not during
  CUDA-graph capture) and runs grouped when they fit (a ``union`` workspace, sized per query
  there, serves as the grouped buffers when it holds them); otherwise, and on explicit
  ``group_size=1``, the per-query path;
* the torch reference on CPU tensors or shapes the kernel does not support.

Duplicate rows within one query's list are one key on every path (the reference too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, overload

import torch

from shardattn._checks import check_bool, check_disjoint, check_int
from shardattn.kernels.backend import kernel_destination, use_triton, written_back
from shardattn.kernels.gluon.sparse_mla import gluon_unsupported_reason, launch_gluon_attention
from shardattn.kernels.triton.sparse_mla import (
    launch_attention,
    tile_config,
)
from shardattn.kernels.union_layout import MAX_PACKED_ROWS
from shardattn.ops.dispatch import prefill_path
from shardattn.ops.head_blocked import q_heads_view, store_result
from shardattn.ops.kv_compact import compact_rows
from shardattn.ops.prepared_union import PreparedUnion, check_prepared_union, union_for_call
from shardattn.ops.sparse_mla import empty_kv_result, has_keys, sparse_mla_reference
from shardattn.ops.sparse_mla_checks import check_destinations, check_sparse_prefill_inputs, check_union_workspace
from shardattn.ops.union import GROUP_SIZES
from shardattn.plan.crossovers import COMPACT_MIN_GROUP


def _compacts(q3, kv, v_dim, group_size, prepared_union) -> bool:
    """Whether a call gathers the blocks its rows touch first (:mod:`shardattn.ops.kv_compact`): a
    kernel call on a cache too large for packed union entries, whose route on a cache that fits
    them groups at least ``COMPACT_MIN_GROUP`` queries (8-16 heads), with no prepared union (built
    per query for this cache) and not in CUDA-graph capture (the count is a host sync)."""
    if kv.shape[0] <= MAX_PACKED_ROWS or group_size == 1 or prepared_union is not None:
        return False
    if not kv.is_cuda or not use_triton(q3, kv) or torch.cuda.is_current_stream_capturing():
        return False
    path = prefill_path(q3, kv[:MAX_PACKED_ROWS], v_dim=v_dim, group_size=group_size)
    return path.group_size >= COMPACT_MIN_GROUP


def _union_views(union: tuple[torch.Tensor, torch.Tensor], rows_shape, g: int):
    """The caller's union workspace (sized for the per-query union this cache's route gives) as
    ``G = g`` buffers ``([ceil(T/g), g*K], [ceil(T/g)])`` where it holds as many entries, else
    ``None`` (the build allocates them)."""
    u, lens = union
    groups, width = -(-rows_shape[0] // g), g * rows_shape[1]
    if u.dtype != torch.int32 or lens.dtype != torch.int32 or not (u.is_contiguous() and lens.is_contiguous()):
        return None
    if u.numel() < groups * width or lens.numel() < groups:
        return None
    return u.view(-1)[: groups * width].view(groups, width), lens.view(-1)[:groups]


@overload
def sparse_mla_grouped_prefill(
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv: torch.Tensor, rows: torch.Tensor, *, scale: float,
    v_dim: int = ..., topk_length: torch.Tensor | None = ..., sinks: torch.Tensor | None = ...,
    group_size: int | None = ..., return_lse: Literal[True] = ...,
    union: tuple[torch.Tensor, torch.Tensor] | None = ..., out: torch.Tensor | None = ...,
    lse_out: torch.Tensor | None = ..., q_ready: Callable[[], None] | None = ..., rows_sorted: bool = ...,
    prepared_union: PreparedUnion | None = ..., kv_format: str | None = ..., rows_unique: bool = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip
@overload
def sparse_mla_grouped_prefill(
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv: torch.Tensor, rows: torch.Tensor, *, scale: float,
    v_dim: int = ..., topk_length: torch.Tensor | None = ..., sinks: torch.Tensor | None = ...,
    group_size: int | None = ..., return_lse: Literal[False],
    union: tuple[torch.Tensor, torch.Tensor] | None = ..., out: torch.Tensor | None = ...,
    lse_out: torch.Tensor | None = ..., q_ready: Callable[[], None] | None = ..., rows_sorted: bool = ...,
    prepared_union: PreparedUnion | None = ..., kv_format: str | None = ..., rows_unique: bool = ...,
) -> torch.Tensor: ...  # fmt: skip
@overload
def sparse_mla_grouped_prefill(
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv: torch.Tensor, rows: torch.Tensor, *, scale: float,
    v_dim: int = ..., topk_length: torch.Tensor | None = ..., sinks: torch.Tensor | None = ...,
    group_size: int | None = ..., return_lse: bool = ...,
    union: tuple[torch.Tensor, torch.Tensor] | None = ..., out: torch.Tensor | None = ...,
    lse_out: torch.Tensor | None = ..., q_ready: Callable[[], None] | None = ..., rows_sorted: bool = ...,
    prepared_union: PreparedUnion | None = ..., kv_format: str | None = ..., rows_unique: bool = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip
def sparse_mla_grouped_prefill(
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    kv: torch.Tensor,
    rows: torch.Tensor,
    *,
    scale: float,
    v_dim: int = 512,
    topk_length: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    group_size: int | None = None,
    return_lse: bool = True,
    union: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    q_ready: Callable[[], None] | None = None,
    rows_sorted: bool = False,
    prepared_union: PreparedUnion | None = None,
    kv_format: str | None = None,
    rows_unique: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA prefill with consecutive queries grouped into shared tiles.

    Same contract as :func:`shardattn.ops.sparse_mla.sparse_mla_attention`.

    Args:
        q: ``[T, H, D]`` fp16/bf16 (fp32 allowed), or ``(q_latent, q_rope)``; consecutive
            tokens are grouped, so pass them in the order whose neighbours overlap (token-major).
        kv: ``[R, D]`` KV rows in q's dtype (the value is ``kv[:, :v_dim]``), or ``fp8_ds_mla``
            rows, uint8 ``[R, 656]`` (dequantised in the kernel); either paged, ``[P, page, D]`` /
            ``[P, page, 656]`` (row ``p * page + i``).
        rows: ``[T, K]`` int32 global rows; ``-1`` / out of range = invalid, anywhere;
            a row listed twice by one query is one key.
        scale: softmax scale, the model's (:func:`~shardattn.plan.spec.mla_softmax_scale`).
        v_dim: value width (512 for DSA models).
        topk_length: ``[T]`` int32, optional. sinks: ``[H]`` fp32, optional.
        group_size: ``G`` in ``(1, 2, 4, 8)``; default :func:`default_group_size`.
        return_lse: also return the LSE.
        union: optional preallocated ``(union [ceil(T/G), G*K] int32, lens [ceil(T/G)] int32)``
            workspace for the union build: contiguous, on rows' device, not sharing bytes with each
            other (:func:`~shardattn.ops.sparse_mla_checks.check_union_workspace`), ``out``,
            ``lse_out`` or an input.
        out / lse_out: optional destinations (``[T, H, v_dim]`` q's dtype / ``[T, H]`` fp32, any
            strides; an ``out`` whose last dim is not unit-stride is written through a dense
            buffer), written in place, sharing no memory with each other nor with an input
            (:func:`~shardattn.ops.sparse_mla_checks.check_destinations`). ``q``, ``out`` and
            ``lse_out`` may also be head-blocked, ``[B, T, H/B, ...]`` (head ``b * H/B + i`` at
            ``[b, t, i]``: an all-to-all buffer read or written in place; see
            :func:`~shardattn.kernels.triton.sparse_mla.launch_attention`).
        q_ready: optional callable run once before any kernel reads ``q`` (e.g. the wait of the
            exchange that fills it): the union build, which reads only ``rows``, is issued before
            it and so overlaps whatever fills ``q``.
        rows_sorted: the caller guarantees each query's valid rows are ascending in list order
            (invalid entries anywhere; e.g. a top-k sorted by row): the union build skips its row
            sort (trusted, not checked; :func:`~shardattn.ops.union.build_union`).
        prepared_union: the union of exactly these ``rows`` / ``topk_length`` built ahead for the
            path's ``G`` (:func:`~shardattn.ops.prepared_union.prepare_union`, e.g. a
            ``G``-aligned slice of a whole share's): no union is built (not with ``union``); the
            reference path checks and ignores it.
        kv_format: the format ``kv`` must hold (as
            :func:`~shardattn.ops.sparse_mla.sparse_mla_attention`'s); ``None`` takes ``kv``'s.
        rows_unique: the caller guarantees no row appears twice in a query's list (an indexer's
            top-k; FlashMLA's contract): a per-query kernel call (``G = 1``) on rows in q's dtype
            builds no union but packs each query's valid rows to the front of its list, in order
            (:func:`~shardattn.ops.prepared_union.union_for_call`; a duplicate would then count
            twice there, not in the reference); grouped tiles and ``fp8_ds_mla`` rows build their
            union as without it.
    Returns:
        ``out [T, H, v_dim]`` in q's dtype and ``lse [T, H]`` fp32 natural log (the given
        destinations when passed); an empty row is ``(0, -inf)`` (with sinks: ``(0, sink)``).

    Example:
        >>> q, kv = torch.randn(5, 2, 48), torch.randn(20, 48)
        >>> rows = torch.randint(-1, 20, (5, 4), dtype=torch.int32)
        >>> out, lse = sparse_mla_grouped_prefill(q, kv, rows, scale=0.1, v_dim=32)
        >>> tuple(out.shape), tuple(lse.shape)
        ((5, 2, 32), (5, 2))
    """
    q, q3, kv = check_sparse_prefill_inputs(
        q, kv, rows, v_dim=v_dim, topk_length=topk_length, sinks=sinks, scale=scale, kv_format=kv_format,
        return_lse=return_lse, out=out, lse_out=lse_out,
    )  # fmt: skip
    check_bool("rows_sorted", rows_sorted)
    check_bool("rows_unique", rows_unique)
    if group_size is not None and check_int("group_size", group_size) not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES} or None, got {group_size!r}")
    if prepared_union is not None:
        check_prepared_union(prepared_union, rows)
        if union is not None:
            raise ValueError("pass union (a workspace to build into) or prepared_union (built already), not both")
    if union is not None:  # checked on every path, the reference's too (which builds no union)
        union = check_union_workspace(union, rows.device)
    # the union is built before the attention reads q and written while the build reads rows
    dests = {"out": out, "lse_out": lse_out, "union[0]": None, "union[1]": None}
    if union is not None:
        dests["union[0]"], dests["union[1]"] = union
        check_disjoint(**dests)
    prepared = None if prepared_union is None else (prepared_union.union, prepared_union.lens)
    check_destinations(dests, q, kv, rows, topk_length, sinks, prepared)
    compacted = False
    if rows.shape[1] > 0 and _compacts(q3, kv, v_dim, group_size, prepared_union):
        compact = compact_rows(kv, rows, topk_length, max_rows=MAX_PACKED_ROWS)  # one host sync
        if compact is not None:  # the touched blocks fit packed entries: the call runs grouped
            (kv, rows), compacted = compact, True
    if not has_keys(kv, rows):  # every row is empty, on every backend
        if q_ready is not None:
            q_ready()
        out, lse_out = store_result(empty_kv_result(q3, v_dim, sinks), out, lse_out)
        return (out, lse_out) if return_lse else out
    path = prefill_path(q3, kv, v_dim=v_dim, group_size=group_size)
    if path.backend == "reference":
        if q_ready is not None:
            q_ready()
        with torch.no_grad():  # inference, as the kernels: no autograd history on any device
            result = sparse_mla_reference(
                q_heads_view(q), kv, rows, scale=scale, v_dim=v_dim, topk_length=topk_length, sinks=sinks
            )
        out, lse_out = store_result(result, out, lse_out)
    else:
        g = path.group_size
        if compacted and union is not None:
            union = _union_views(union, rows.shape, g)
        if prepared_union is not None:
            check_prepared_union(prepared_union, rows, group_size=g)
        kv, u, lens = union_for_call(  # fp8_ds_mla rows: staged where it pays
            prepared_union, rows, kv, group_size=g, dtype=q3.dtype, topk_length=topk_length, out=union,
            rows_sorted=rows_sorted, rows_unique=rows_unique,
        )  # fmt: skip
        if q_ready is not None:  # the union is built: now the kernels may wait for q
            q_ready()
        dense = kernel_destination(out)  # the kernels write out's last dim with unit stride
        if path.backend == "gluon" and gluon_unsupported_reason(q, kv, v_dim) is None:
            # sm_90: the Gluon kernel (per-query or grouped); head-blocked q / out / lse are used in place
            written, lse_out = launch_gluon_attention(
                q, kv, u, lens, scale=scale, v_dim=v_dim, sinks=sinks, out=dense, lse=lse_out, group_size=g
            )
        else:
            tile = path.tile or tile_config(q3.shape[1], g)  # q's own strides did not suit the Gluon kernel
            written, lse_out = launch_attention(
                q, kv, u, lens, scale=scale, v_dim=v_dim, config=tile, sinks=sinks, out=dense, lse=lse_out
            )
        out = written_back(out, written)
    return (out, lse_out) if return_lse else out
