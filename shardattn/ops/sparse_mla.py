"""Sparse MLA attention: every query token attends to its own top-k KV rows.

After weight absorption a query token has ``H`` heads of ``D = 576`` dims (512 latent + 64
rope); the KV cache holds one ``D``-dim row per token, whose first ``Dv = 512`` dims are the
value::

    out[t, h] = softmax(scale * q[t, h] . kv[rows[t]]^T) @ kv[rows[t], :Dv]

``rows`` holds global KV row ids; ``-1`` or any value outside ``[0, R)`` is invalid, anywhere in
a row; ``topk_length[t]`` (optional) truncates row ``t`` to its first entries. A row with no
valid key gives ``(out = 0, lse = -inf)``. A row listed twice by one query is one key (later
duplicates are ignored), on every path. Attention sinks add one logit per head to the
softmax denominator (``lse`` then includes the sink term; an empty row gives ``(0, sink)``).

This module holds the public entry point, its per-query kernel path and the fp32 torch reference;
the argument checks every sparse-MLA entry shares are :mod:`shardattn.ops.sparse_mla_checks`'s, and
``q``, ``out`` and ``lse_out`` may be plain or head-blocked (:mod:`shardattn.ops.head_blocked`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, overload

import torch

from shardattn._checks import check_bool
from shardattn.kernels.backend import kernel_destination, written_back
from shardattn.ops.head_blocked import q_heads_view, store_result
from shardattn.ops.row_entries import first_occurrences, valid_mask
from shardattn.ops.softmax_rows import softmax_rows
from shardattn.ops.sparse_mla_checks import (
    check_destinations,
    check_kv_rows,  # noqa: F401 (public here too)
    check_sparse_prefill_inputs,
)

if TYPE_CHECKING:
    from shardattn.ops.prepared_union import PreparedUnion

#: Bytes of fp32 gathered KV the reference materialises at once (bounds CPU memory).
REFERENCE_CHUNK_BYTES = 256 << 20


def has_keys(kv: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether an entry of ``rows [T, K]`` can be a key: ``kv [R, row]`` has rows and ``rows`` has
    entries (else every row of the call is empty, on every backend: :func:`empty_kv_result`)."""
    return kv.shape[0] > 0 and rows.shape[1] > 0


def empty_kv_result(q: torch.Tensor, v_dim: int, sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The result of sparse MLA over a KV cache with no rows: every row is empty.

    Args:
        q: ``[T, H, D]``; v_dim: value width; sinks: ``[H]`` fp32 or None.
    Returns:
        ``(out [T, H, v_dim] zeros in q's dtype, lse [T, H] fp32)``: ``-inf``, or the sink logit
        with sinks (an empty row with a sink is ``(0, sink)``).
    """
    t, h, _ = q.shape
    out = q.new_zeros(t, h, v_dim)
    if sinks is None:
        lse = torch.full((t, h), -math.inf, dtype=torch.float32, device=q.device)
    else:
        lse = sinks.float()[None, :].expand(t, h).clone()
    return out, lse


def sparse_mla_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    *,
    scale: float,
    v_dim: int = 512,
    topk_length: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (or fp64) torch reference, chunked over tokens so memory stays bounded.

    Args:
        q: ``[T, H, D]``; kv: ``[R, D]``, or ``[R, 656]`` uint8 ``fp8_ds_mla`` rows (the gathered
            rows dequantised in ``compute_dtype``: exact in fp64, and in fp32 for power-of-two
            scales); rows: ``[T, K]`` int32 global rows.
        scale: softmax scale. v_dim: value width (first ``v_dim`` dims of a KV row).
        topk_length: ``[T]`` int32 or None. sinks: ``[H]`` fp32 or None.
        compute_dtype: float32 or float64.
    Returns:
        ``(out [T, H, v_dim] in q.dtype, lse [T, H] fp32)``.
    """
    from shardattn.ops.kv_fp8 import dequantize_kv

    t, h, d = q.shape
    k = rows.shape[1]
    r = kv.shape[0]
    if t == 0 or k == 0:  # no tokens, or no entries: every row is empty
        return empty_kv_result(q, v_dim, sinks)
    out = torch.empty(t, h, v_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(t, h, dtype=torch.float32, device=q.device)
    valid = first_occurrences(rows, valid_mask(rows, r, topk_length))
    if r == 0:  # no row is valid; gather from one zero row so the indexing below stays in range
        kv = kv.new_zeros(1, kv.shape[-1])
    bytes_per_token = max(1, k * d * torch.finfo(compute_dtype).bits // 8)
    chunk = max(1, min(t, REFERENCE_CHUNK_BYTES // bytes_per_token))
    sink = sinks.to(compute_dtype) if sinks is not None else None
    for t0 in range(0, t, chunk):
        t1 = min(t, t0 + chunk)
        safe_rows = torch.where(valid[t0:t1], rows[t0:t1], torch.zeros_like(rows[t0:t1])).long()
        keys = kv[safe_rows]  # [c, K, D] (fp8_ds_mla: [c, K, 656] bytes, only the gathered rows dequantised)
        keys = dequantize_kv(keys, compute_dtype) if keys.dtype == torch.uint8 else keys.to(compute_dtype)
        qc = q[t0:t1].to(compute_dtype)  # [c, H, D]
        s = torch.einsum("chd,ckd->chk", qc, keys) * scale
        s = s.masked_fill(~valid[t0:t1, None, :], -math.inf)
        p, row_lse = softmax_rows(s, None if sink is None else sink[None, :])  # [c, H, K], [c, H]
        out[t0:t1] = torch.einsum("chk,ckd->chd", p, keys[..., :v_dim]).to(q.dtype)
        lse[t0:t1] = row_lse.float()
    return out, lse


@overload
def sparse_mla_attention(
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv: torch.Tensor, rows: torch.Tensor, *, scale: float,
    v_dim: int = ..., topk_length: torch.Tensor | None = ..., sinks: torch.Tensor | None = ...,
    return_lse: Literal[True] = ..., out: torch.Tensor | None = ..., lse_out: torch.Tensor | None = ...,
    q_ready: Callable[[], None] | None = ..., prepared_union: PreparedUnion | None = ..., kv_format: str | None = ...,
    rows_unique: bool = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip
@overload
def sparse_mla_attention(
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv: torch.Tensor, rows: torch.Tensor, *, scale: float,
    v_dim: int = ..., topk_length: torch.Tensor | None = ..., sinks: torch.Tensor | None = ...,
    return_lse: Literal[False], out: torch.Tensor | None = ..., lse_out: torch.Tensor | None = ...,
    q_ready: Callable[[], None] | None = ..., prepared_union: PreparedUnion | None = ..., kv_format: str | None = ...,
    rows_unique: bool = ...,
) -> torch.Tensor: ...  # fmt: skip
@overload
def sparse_mla_attention(
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv: torch.Tensor, rows: torch.Tensor, *, scale: float,
    v_dim: int = ..., topk_length: torch.Tensor | None = ..., sinks: torch.Tensor | None = ...,
    return_lse: bool = ..., out: torch.Tensor | None = ..., lse_out: torch.Tensor | None = ...,
    q_ready: Callable[[], None] | None = ..., prepared_union: PreparedUnion | None = ..., kv_format: str | None = ...,
    rows_unique: bool = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip
def sparse_mla_attention(
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    kv: torch.Tensor,
    rows: torch.Tensor,
    *,
    scale: float,
    v_dim: int = 512,
    topk_length: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = True,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    q_ready: Callable[[], None] | None = None,
    prepared_union: PreparedUnion | None = None,
    kv_format: str | None = None,
    rows_unique: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA attention over per-token global KV rows.

    CUDA tensors run the per-query Gluon kernel (:mod:`shardattn.kernels.gluon.sparse_mla`) on
    sm_90 where it is faster, else the per-query Triton kernel
    (:mod:`shardattn.kernels.triton.sparse_mla`) when its shape limits allow
    (:func:`shardattn.ops.dispatch.sparse_prefill_kernel` says which and why); everything
    else runs the fp32 torch reference.

    Args:
        q: ``[T, H, D]`` fp16/bf16/fp32 (``D = 576`` for DSA models), or
            ``(q_latent [T, H, 512], q_rope [T, H, 64])``.
        kv: ``[R, D]`` KV rows in q's dtype (the value is ``kv[:, :v_dim]``), or ``fp8_ds_mla``
            rows (:mod:`shardattn.ops.kv_fp8`): uint8 ``[R, 656]``, dequantised in the kernel
            (``D = 576``, ``v_dim = 512``); either paged, ``[P, page, D]`` / ``[P, page, 656]``
            (row ``p * page + i``; pages that follow one another).
        rows: ``[T, K]`` int32 global row ids; ``-1`` / out of range = invalid, anywhere;
            a row listed twice by one query is one key.
        scale: softmax scale, finite and > 0: the model's, not ``D ** -0.5`` of the absorbed rows
            (:func:`~shardattn.plan.spec.mla_softmax_scale`; DeepSeek-V3.2: about 0.1352).
        v_dim: value width, 512 for DSA models.
        topk_length: ``[T]`` int32, optional per-row count of leading entries to use.
        sinks: ``[H]`` fp32 per-head sink logits, optional.
        return_lse: also return the LSE.
        out / lse_out: optional destinations ``[T, H, v_dim]`` (q's dtype) / ``[T, H]`` fp32, written
            in place; ``q``, ``out`` and ``lse_out`` may be head-blocked ``[B, T, H/B, ...]`` (head
            ``b * H/B + i`` at ``[b, t, i]``, e.g. an all-to-all buffer; see
            :mod:`~shardattn.ops.head_blocked`). They share no memory with each other nor with an
            input (the kernels' programs write outputs while others still read q, rows and keys).
        q_ready: optional callable run once before any kernel reads ``q`` (e.g. the wait of the
            exchange that fills it); only ``q``'s shape is looked at before.
        prepared_union: the ``G = 1`` union of exactly these ``rows`` and ``topk_length``, built
            ahead (:func:`~shardattn.ops.prepared_union.prepare_union`, e.g. a slice of a
            whole share's): the kernel paths then build none; the reference path ignores it.
        kv_format: the format ``kv`` must hold (``"bfloat16"`` / ``"bf16"``, ``"fp16"``,
            ``"fp32"``, ``"fp8_ds_mla"``: :data:`shardattn.plan.kv_format.KV_FORMATS`); ``None``
            takes it from ``kv``'s dtype (uint8: ``fp8_ds_mla``).
        rows_unique: the caller guarantees no row appears twice in a query's list (an indexer's
            top-k; FlashMLA's contract): on rows in q's dtype the kernel paths pack each query's
            valid rows instead of de-duplicating them (a duplicate would then count twice there,
            not in the reference; :func:`~shardattn.ops.prepared_union.union_for_call`).
    Returns:
        ``out [T, H, v_dim]`` in q's dtype, and ``lse [T, H]`` fp32 natural log when
        ``return_lse`` (the given destinations when passed); a row with no valid key is ``(0, -inf)``
        (so is every row when ``kv`` has no rows or ``rows`` no entries).
    Raises:
        TypeError / ValueError: naming the argument (dtype, shape, device, ``scale`` not finite
            and > 0), before any kernel runs.

    Example:
        >>> q, kv = torch.randn(3, 2, 16), torch.randn(10, 16)
        >>> rows = torch.tensor([[0, 1], [-1, 9], [-1, -1]], dtype=torch.int32)
        >>> out, lse = sparse_mla_attention(q, kv, rows, scale=0.25, v_dim=8)
        >>> tuple(out.shape), bool(lse[2].isneginf().all()), float(out[2].abs().sum())
        ((3, 2, 8), True, 0.0)
    """
    q, q3, kv = check_sparse_prefill_inputs(
        q, kv, rows, v_dim=v_dim, topk_length=topk_length, sinks=sinks, scale=scale, kv_format=kv_format,
        return_lse=return_lse, out=out, lse_out=lse_out,
    )  # fmt: skip
    check_bool("rows_unique", rows_unique)
    if prepared_union is not None:
        from shardattn.ops.prepared_union import check_prepared_union

        check_prepared_union(prepared_union, rows, group_size=1)
    prepared = None if prepared_union is None else (prepared_union.union, prepared_union.lens)
    check_destinations({"out": out, "lse_out": lse_out}, q, kv, rows, topk_length, sinks, prepared)
    if q_ready is not None:
        q_ready()
    if not has_keys(kv, rows):  # every row is empty, on every backend
        out, lse_out = store_result(empty_kv_result(q3, v_dim, sinks), out, lse_out)
    elif (kernel := _per_query_kernel(q, q3, kv, rows, v_dim)) is not None:
        # head-blocked q / out / lse are read and written in place through their strides
        dense = kernel_destination(out)  # the kernels write out's last dim with unit stride
        written, lse_out = sparse_mla_per_query(
            q, kv, rows, scale=scale, v_dim=v_dim, topk_length=topk_length, sinks=sinks, out=dense, lse_out=lse_out,
            prepared_union=prepared_union, kernel=kernel, rows_unique=rows_unique,
        )  # fmt: skip
        out = written_back(out, written)
    else:
        with torch.no_grad():  # inference, as the kernels: no autograd history on any device
            result = sparse_mla_reference(
                q_heads_view(q), kv, rows, scale=scale, v_dim=v_dim, topk_length=topk_length, sinks=sinks
            )
        out, lse_out = store_result(result, out, lse_out)
    return (out, lse_out) if return_lse else out


def _per_query_kernel(
    q: torch.Tensor, q3: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, v_dim: int
) -> str | None:
    """The per-query kernel that runs a call of :func:`sparse_mla_attention` on these tensors:
    ``"gluon"`` (sm_90, where the routing sends it and q's own strides, head-blocked too, suit
    cp.async), ``"triton"`` where its shape limits allow, else ``None`` (the torch reference).
    ``q3``: q's ``[T, H, D]`` stand-in (:func:`~shardattn.ops.head_blocked.shape_stand_in`)."""
    if not q.is_cuda:
        return None
    from shardattn.kernels.gluon.sparse_mla import gluon_unsupported_reason
    from shardattn.kernels.triton.sparse_mla import kernel_unsupported_reason
    from shardattn.ops.dispatch import sparse_prefill_kernel, use_triton

    if sparse_prefill_kernel(q3, kv, v_dim)[0] == "gluon" and gluon_unsupported_reason(q, kv, v_dim) is None:
        return "gluon"
    if use_triton(q3, kv, rows) and kernel_unsupported_reason(q3, kv, v_dim) is None:
        return "triton"
    return None


def sparse_mla_per_query(
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    *,
    scale: float,
    v_dim: int = 512,
    topk_length: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    prepared_union: PreparedUnion | None = None,
    kernel: str = "triton",
    rows_unique: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-query kernel path (``G = 1``): each query's rows de-duplicated (the union of one
    query, or on a large cache the hash's kept rows packed: ``union_for_call``), then attended by
    ``kernel`` (``"triton"`` or ``"gluon"``, sm_90). Inputs already validated (the public entry is
    :func:`sparse_mla_attention`); no kernel routing.

    Args:
        q: ``[T, H, D]`` (or head-blocked ``[B, T, H/B, D]``); kv: ``[R, D]``; rows: ``[T, K]``
            int32 global rows (-1 / out of range invalid); topk_length: ``[T]`` int32 or None;
            sinks: ``[H]`` fp32 or None.
        out / lse_out: optional destinations, plain or head-blocked, ``out`` with a unit last-dim
            stride (:func:`sparse_mla_attention` passes a dense one).
        prepared_union: the ``G = 1`` union of ``rows`` built ahead (checked by the caller), else built here.
        rows_unique: no row twice in a query's list (trusted): the valid rows packed, not de-duplicated.
    Returns:
        ``(out [T, H, v_dim] q.dtype, lse [T, H] fp32)`` (the given destinations when passed).
    """
    from shardattn.kernels.backend import interpreter_enabled
    from shardattn.ops.prepared_union import union_for_call

    # fp8_ds_mla rows: staged where it pays
    kv, union, lens = union_for_call(
        prepared_union, rows, kv, group_size=1, dtype=q.dtype, topk_length=topk_length, rows_unique=rows_unique
    )
    if kernel == "gluon":
        from shardattn.kernels.gluon.sparse_mla import launch_gluon_attention

        return launch_gluon_attention(q, kv, union, lens, scale=scale, v_dim=v_dim, sinks=sinks, out=out, lse=lse_out)
    from shardattn.kernels.triton.sparse_mla import launch_attention, tile_config

    heads = q.shape[0] * q.shape[2] if q.dim() == 4 else q.shape[1]
    cfg = tile_config(heads, 1, interpret=interpreter_enabled())
    return launch_attention(q, kv, union, lens, scale=scale, v_dim=v_dim, config=cfg, sinks=sinks, out=out, lse=lse_out)


def flops(valid_keys: int, heads: int, d_qk: int = 576, d_v: int = 512) -> float:
    """Sparse prefill FLOPs on real heads: ``2 * valid_keys * heads * (d_qk + d_v)``."""
    return 2.0 * valid_keys * heads * (d_qk + d_v)
