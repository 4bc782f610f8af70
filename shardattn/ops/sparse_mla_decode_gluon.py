"""The Gluon decode path (sm_90): row lists, pseudo-query slices, sinks and the merge.

:func:`sparse_mla_decode_gluon` runs the Gluon per-query kernel (:mod:`shardattn.kernels.gluon.sparse_mla_decode`)
on a decode call that :func:`~shardattn.ops.sparse_mla_decode.sparse_mla_decode` validated and
routed here:

* **row lists**: with the default ``rows_unique=False`` the rows are first sorted and
  de-duplicated by :func:`~shardattn.ops.union.build_union` (a row listed twice is one key); with
  ``rows_unique=True`` they are taken as given (a duplicate then counts twice, exactly as on the
  Triton path). One slice of unique rows needs no packing: the kernel reads the caller's ``[T, K]``
  rows in place and masks each entry (an entry outside ``[0, R)`` or past ``topk_length`` is no
  key), so the whole path is one launch. Otherwise the valid rows are packed into slices
  (:func:`~shardattn.kernels.triton.split_rows.split_rows`).
* **q** of pseudo-query ``p`` is ``q[p mod T]``: a stride-0 view for one token, else ``S`` copies.
* **partials** land in ``[S, T, H, Dv]`` / ``[S, T, H]`` fp32 (the layout of
  :func:`~shardattn.kernels.triton.lse_merge.split_partials`, so a caller's ``workspace`` serves)
  and the LSE merge combines them into ``out`` / ``lse``. With one slice the kernel writes
  ``out`` / ``lse`` directly.
* **sinks** with ``S`` slices: every slice gets ``sink - log(S)``, so the merged denominator holds
  ``S * exp(sink) / S = exp(sink)`` once (exact; an all-empty row gives ``(0, sink)``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from shardattn.kernels.gluon.sparse_mla_decode import gluon_attend, gluon_decode_plan, reads_raw_rows
from shardattn.kernels.triton.lse_merge import HAVE_TRITON, launch_lse_merge, split_partials
from shardattn.kernels.triton.split_rows import split_rows
from shardattn.ops.lse_merge import lse_merge_reference
from shardattn.ops.union import build_union

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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse-MLA decode through the Gluon kernel (inputs validated by
    :func:`~shardattn.ops.sparse_mla_decode.sparse_mla_decode`, which routes here).

    Args:
        q: ``[T, H, D]`` bf16/fp16; kv: ``[R, D]``; rows: ``[T, K]`` int32 (invalid anywhere).
        out, lse_out: destinations ``[T, H, v_dim]`` (q's dtype) and ``[T, H]`` fp32.
        num_sms: SMs of the device (the split model). num_splits: slices asked for (None = model).
        rows_unique: skip the de-duplication (duplicates then count twice, as on the Triton path).
        workspace: optional flat fp32 buffer for the partials (fewer slices if it is too small).
        attend: the per-pseudo-query kernel ``attend(q, kv, union, lens, *, scale, v_dim, sinks,
            out, lse, raw_rows)``; default the Gluon kernel (tests pass a torch stand-in to check
            the slicing, sinks and merge on the CPU). ``raw_rows=True``: ``union`` is the caller's
            rows (invalid entries anywhere) and ``lens`` its ``topk_length`` (None = all ``K``).
    Returns:
        ``(out, lse_out)``.
    """
    attend = gluon_attend if attend is None else attend
    t, h, _ = q.shape
    r = kv.shape[0]
    k = rows.shape[1]
    src, src_len = rows, topk_length
    deduped = not rows_unique and k > 1
    if deduped:
        src, src_len = build_union(rows, group_size=1, num_kv_rows=r, topk_length=topk_length)
    limit = None if workspace is None else workspace.numel()
    plan = gluon_decode_plan(t, h, k, num_sms, num_splits, v_dim=v_dim, head_dim=q.shape[-1], max_partial_elems=limit)
    s, chunk = plan["num_splits"], plan["chunk"]
    if s == 1:
        if deduped:  # the union's entries past lens are masked by the kernel
            union, lens = src, src_len
        elif reads_raw_rows(src, src_len):  # one launch: rows read in place
            attend(q, kv, src, src_len, scale=scale, v_dim=v_dim, sinks=sinks, out=out, lse=lse_out, raw_rows=True)
            return out, lse_out
        else:
            union, lens = split_rows(src, num_kv_rows=r, num_splits=1, chunk=max(chunk, k), topk_length=src_len)
        attend(q, kv, union, lens, scale=scale, v_dim=v_dim, sinks=sinks, out=out, lse=lse_out)
        return out, lse_out
    union, lens = split_rows(src, num_kv_rows=r, num_splits=s, chunk=chunk, topk_length=src_len)
    q_p = q.expand(s, h, q.shape[-1]) if t == 1 else q.unsqueeze(0).expand(s, t, h, q.shape[-1]).reshape(s * t, h, -1)
    part_out, part_lse = split_partials(workspace, s, t, h, v_dim, q.device)
    sinks_p = None if sinks is None else sinks - math.log(s)  # S shares of exp(sink): once in the merge
    attend(
        q_p, kv, union, lens, scale=scale, v_dim=v_dim, sinks=sinks_p,
        out=part_out.view(s * t, h, v_dim), lse=part_lse.view(s * t, h),
    )  # fmt: skip
    if q.is_cuda and HAVE_TRITON:
        launch_lse_merge(part_out, part_lse, out, lse_out)
    else:
        ref_out, ref_lse = lse_merge_reference(part_out, part_lse)
        out.copy_(ref_out)
        lse_out.copy_(ref_lse)
    return out, lse_out
