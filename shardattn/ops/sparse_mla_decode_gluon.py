"""The Gluon decode path (sm_90): row lists, pseudo-query slices, sinks and the merge.

:func:`sparse_mla_decode_gluon` runs the Gluon per-query kernel (:mod:`shardattn.kernels.gluon.sparse_mla_decode`)
on a decode call that :func:`~shardattn.ops.sparse_mla_decode.sparse_mla_decode` validated and
routed here:

* **row lists**: with the default ``rows_unique=False`` the rows are first de-duplicated by
  :func:`~shardattn.ops.unique_rows.decode_rows` (a row listed twice is one key); with
  ``rows_unique=True`` they are taken as given (a duplicate then counts twice, exactly as on the
  Triton path). Contiguous int32 rows need no packing: the kernel reads the caller's ``[T, K]``
  rows in place and masks each entry (an entry outside ``[0, R)`` or past ``topk_length`` is no
  key), so the whole path is one launch (two with slices: the merge). Rows it cannot read in place
  are packed first (:func:`~shardattn.kernels.triton.pack_rows.pack_rows`).
* **slices**: with ``S > 1`` each token's list (of width ``S * W``) is cut into ``S`` slices of
  ``W`` entries, run as queries of their own in place (the kernel's ``q_slices``): query
  ``p = t * S + s`` reads token ``t``'s q and slice ``s`` of its list; no copy of q or of the rows.
* **partials** land in ``[T, S, H, Dv]`` / ``[T, S, H]`` fp32 (a caller's ``workspace`` of
  :func:`~shardattn.kernels.triton.lse_merge.split_partials_numel` elements serves) and the column
  merge combines them into ``out`` / ``lse``: each program loads every slice's partials of a few
  (token, head) rows at once (:func:`~shardattn.kernels.gluon.sparse_mla_decode.gluon_merge_tile`),
  launched as a programmatic dependent launch where the device has it. A sliced kernel is one too:
  it waits for the grid before it at its start and lets the merge launch at once, and the hash ahead
  of it triggers it (D98). With one slice the kernel writes ``out`` / ``lse`` directly, a plain launch.
* **sinks** with ``S`` slices: every slice gets ``sink - log(S)``, so the merged denominator holds
  ``S * exp(sink) / S = exp(sink)`` once (exact; an all-empty row gives ``(0, sink)``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from shardattn.kernels.backend import pdl_supported
from shardattn.kernels.gluon.sparse_mla_decode import gluon_attend, gluon_decode_plan, gluon_merge_tile, reads_raw_rows
from shardattn.kernels.triton.lse_merge import HAVE_TRITON, launch_lse_merge_columns, split_partials
from shardattn.kernels.triton.pack_rows import pack_rows
from shardattn.ops.lse_merge import lse_merge_reference
from shardattn.ops.unique_rows import decode_rows

__all__ = ["sparse_mla_decode_gluon"]


def sparse_mla_decode_gluon(
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    *,
    scale: float,
    v_dim: int,
    out: torch.Tensor,
    lse_out: torch.Tensor,
    num_sms: int,
    topk_length: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    num_splits: int | None = None,
    rows_unique: bool = False,
    workspace: torch.Tensor | None = None,
    attend: Callable[..., None] | None = None,
    persistent: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse-MLA decode through the Gluon kernel (inputs validated by
    :func:`~shardattn.ops.sparse_mla_decode.sparse_mla_decode`, which routes here).

    Args:
        q: ``[T, H, D]`` bf16/fp16; kv: ``[R, D]``; rows: ``[T, K]`` int32 (invalid anywhere).
        out, lse_out: destinations ``[T, H, v_dim]`` (q's dtype) and ``[T, H]`` fp32.
        num_sms: SMs of the device (the split model). num_splits: slices asked for (None = model).
        persistent: the kernel's grid asked for (None = the plan's: persistent where bf16 / fp16
            tiles outnumber the SMs, :func:`~shardattn.kernels.gluon.sparse_mla_decode.gluon_decode_plan`).
        rows_unique: skip the de-duplication (duplicates then count twice, as on the Triton path).
        workspace: optional flat fp32 buffer for the partials (fewer slices if it is too small).
        attend: the kernel, ``attend(q, kv, union, lens, *, scale, v_dim, sinks, out, lse,
            raw_rows, q_slices=1, persistent=False)`` (the arguments of
            :func:`~shardattn.kernels.gluon.sparse_mla_decode.gluon_attend`); default the Gluon
            kernel (tests pass a torch stand-in to check the slicing, sinks and merge on the CPU).
            ``raw_rows=True``: ``union`` is the caller's rows (invalid entries anywhere) and
            ``lens`` its ``topk_length`` (None = all ``K``).
    Returns:
        ``(out, lse_out)``.
    """
    attend = gluon_attend if attend is None else attend
    t, h, _ = q.shape
    r = kv.shape[0]
    k = rows.shape[1]
    limit = None if workspace is None else workspace.numel()
    plan = gluon_decode_plan(
        t, h, k, num_sms, num_splits, v_dim=v_dim, max_partial_elems=limit, kv_fp8=kv.dtype == torch.uint8,
        persistent=persistent,
    )  # fmt: skip
    s, chunk, grid = plan["num_splits"], plan["chunk"], bool(plan["persistent"])
    src, src_len, packed = rows, topk_length, False
    if not rows_unique and k > 1:
        # a sliced launch is a programmatic dependent launch (gluon_attend): the hash lets it launch at once
        src, src_len, packed = decode_rows(rows, num_kv_rows=r, topk_length=topk_length, pdl=s > 1)
    width = k if s == 1 else s * chunk
    # a union is valid rows packed at the front (the kernel masks past lens); raw rows (the
    # caller's, or the hash's with repeats -1) are masked per entry; either is read in place when it
    # is [T, width] int32 rows, else packed first
    in_place = _in_place(src, width) and (packed or reads_raw_rows(src, src_len))
    raw = in_place and not packed
    if not in_place:
        src, src_len = pack_rows(src, num_kv_rows=r, width=width, topk_length=src_len)
    if s == 1:
        attend(
            q, kv, src, src_len, scale=scale, v_dim=v_dim, sinks=sinks, out=out, lse=lse_out, raw_rows=raw,
            persistent=grid,
        )  # fmt: skip
        return out, lse_out
    # the room of [S, T] partials, as [T, S] ones: query t * S + s writes row t * S + s
    outs, lses = split_partials(workspace, s, t, h, v_dim, q.device)
    part_out, part_lse = outs.view(t, s, h, v_dim), lses.view(t, s, h)
    sinks_p = None if sinks is None else sinks - math.log(s)  # S shares of exp(sink): once in the merge
    attend(
        q, kv, src.view(t * s, chunk), src_len, scale=scale, v_dim=v_dim, sinks=sinks_p,
        out=part_out.view(t * s, h, v_dim), lse=part_lse.view(t * s, h), raw_rows=raw, q_slices=s,
        persistent=grid,
    )  # fmt: skip
    part_out, part_lse = part_out.transpose(0, 1), part_lse.transpose(0, 1)  # [S, T, ...] for the merge
    if q.is_cuda and HAVE_TRITON:
        block_rows, block_d = gluon_merge_tile(s, v_dim)
        launch_lse_merge_columns(
            part_out, part_lse, out, lse_out, block_d=block_d, block_rows=block_rows, pdl=pdl_supported(q.device)
        )
    else:
        ref_out, ref_lse = lse_merge_reference(part_out, part_lse)
        out.copy_(ref_out)
        lse_out.copy_(ref_lse)
    return out, lse_out


def _in_place(rows: torch.Tensor, width: int) -> bool:
    """Whether the kernel reads ``rows`` in place as lists of ``width`` entries (cut into slices by
    a ``[T * S, W]`` view): int32, ``width`` entries a token, contiguous."""
    return rows.dtype == torch.int32 and rows.shape[1] == width and rows.is_contiguous()
