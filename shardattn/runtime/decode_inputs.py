"""The checks of a decode step's arguments: :func:`check_decode_inputs` -> :class:`DecodeInputs`.

One rank's arguments of :meth:`Runtime.decode <shardattn.runtime.runtime.Runtime.decode>` are
checked under the names it gives them, and host lists and int64 indices converted once to int32
(:func:`~shardattn.runtime.args.as_index`): ``q [T, H/W, D]``; a sparse-MLA step's cache rows
``kv [R, row]`` (the Runtime's KV format) with ``topk_pos [T, K]`` and ``req_ids [T]``; a GQA
step's ``(k_cache, v_cache)`` pages ``[P, page, Hkv, D]`` of this rank's KV heads, and its drafts
(``q_len_per_req`` / ``cu_q_lens``) or DCP plan (``batch`` / ``meta``). A bad argument raises
``TypeError`` / ``ValueError``; the step turns that into every rank's error
(:func:`~shardattn.runtime.args.reject`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from shardattn._checks import FLOAT_DTYPES, check_int, check_sink_logits, check_tensor
from shardattn.plan.decode_batch import DecodeBatch
from shardattn.runtime.args import (
    as_index,
    check_drafts_on_host,
    check_gqa_cache,
    check_paged_rows,
    check_plan_lengths,
    check_sinks_declared,
    check_table_on_host,
    check_topk_unique,
)

if TYPE_CHECKING:
    from shardattn.runtime.decode import DecodeStep

__all__ = ["DecodeInputs", "SparseCache", "check_decode_inputs"]


class SparseCache(NamedTuple):
    """A sparse-MLA decode step's checked cache and top-k: ``kv [R, row]`` rows (the Runtime's KV
    format), ``topk_pos [T, K]`` and ``req_ids [T]`` int32."""

    kv: torch.Tensor
    topk_pos: torch.Tensor
    req_ids: torch.Tensor


class DecodeInputs(NamedTuple):
    """A decode step's checked arguments, the indices int32 (:func:`check_decode_inputs`).

    Attributes:
        seq_lens: ``[B]`` on q's device. block_table: ``[B or T, pages]``.
        topk_length: ``[T]`` valid top-k entries per query (sparse MLA), or ``None``.
        cu_q_lens: ``[B + 1]`` on q's device (GQA drafts), or ``None``.
        cache: a sparse-MLA step's :class:`SparseCache`, or a GQA step's ``(k_cache, v_cache)``.
    """

    seq_lens: torch.Tensor
    block_table: torch.Tensor
    topk_length: torch.Tensor | None
    cu_q_lens: torch.Tensor | None
    cache: SparseCache | tuple[torch.Tensor, torch.Tensor]


def check_decode_inputs(
    step: DecodeStep,
    q: torch.Tensor,
    kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    block_table: torch.Tensor,
    seq_lens: torch.Tensor | Sequence[int],
    *,
    topk_pos: torch.Tensor | None,
    req_ids: torch.Tensor | Sequence[int] | None,
    topk_length: torch.Tensor | None,
    topk_unique: bool,
    q_len_per_req: int | None,
    cu_q_lens: torch.Tensor | Sequence[int] | None,
    max_q_len: int | None,
    window_left: int,
    sinks: torch.Tensor | None,
    batch: DecodeBatch | None,
    meta: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None,
    check: bool,
) -> DecodeInputs:
    """Check one rank's decode arguments for ``step`` (its model, heads, mode and workspace) and
    convert its indices; arguments as :meth:`DecodeStep.__call__
    <shardattn.runtime.decode.DecodeStep.__call__>` takes them. With ``batch`` and ``check``, the
    plan's lengths are checked against those passed beside it where those are on the host.

    Raises:
        TypeError / ValueError: naming the argument (nothing has run).
    """
    dcp = step.dcp
    heads, dim = step.heads_per_rank, step.spec.head_dim
    t, h, d = check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3).shape
    if d != dim:
        raise ValueError(f"q must have last dim {dim} (the model's head_dim), got shape {list(q.shape)}")
    if h != heads:
        world = step.comm.world_size
        raise ValueError(
            f"q must hold this rank's {heads} heads (H/W: {step.spec.num_heads} heads over {world} ranks), "
            f"got {h} heads (shape {list(q.shape)})"
        )
    check_sinks_declared(sinks, has_sinks=step.spec.has_sinks, heads=step.spec.num_heads)
    check_topk_unique(topk_unique, kind=step.spec.kind)
    check_int("window_left", window_left, minimum=-1)
    if window_left >= 0 and (dcp or step.spec.kind != "gqa"):
        raise ValueError(
            f"window_left={window_left}: sliding windows are supported by head-TP GQA decode only "
            + ("(under DCP a global window is not a local one; use mode 'headtp')" if dcp else "(sparse MLA)")
        )
    given_seq_lens, given_cu_q_lens = seq_lens, cu_q_lens  # as passed: host lists move to q's device here
    seq_lens = as_index("seq_lens", seq_lens, q.device)
    block_table = as_index("block_table", block_table)
    topk_pos, topk_length = as_index("topk_pos", topk_pos), as_index("topk_length", topk_length)
    req_ids, cu_q_lens = as_index("req_ids", req_ids, q.device), as_index("cu_q_lens", cu_q_lens, q.device)
    k = step.ws.topk  # the step's top-k width: a sparse-MLA step's (a GQA step's topk_pos is refused below)
    if step.spec.kind == "sparse_mla" and isinstance(topk_pos, torch.Tensor) and topk_pos.dim() == 2:
        k = int(topk_pos.shape[1])
    step.ws.check("decode", "dcp" if dcp else "headtp", tokens=t, topk=k)
    if sinks is not None and not dcp:  # every head's, before head-TP takes the rank's (DCP checks them)
        check_sink_logits(sinks, step.spec.num_heads, device=q.device)
    cache: SparseCache | tuple[torch.Tensor, torch.Tensor]
    if step.spec.kind == "sparse_mla":
        gqa_only = {"q_len_per_req": q_len_per_req, "cu_q_lens": cu_q_lens, "max_q_len": max_q_len}
        for name, x in {**gqa_only, "batch": batch, "meta": meta}.items():
            if x is not None:
                raise ValueError(f"{name} is GQA decode's; a sparse-MLA step reads topk_pos: pass None")
        if topk_pos is None or req_ids is None:
            raise ValueError("sparse-MLA decode needs topk_pos [T, K] and req_ids [T]")
        if isinstance(topk_pos, torch.Tensor) and topk_pos.dim() == 2 and topk_pos.shape[0] != t:  # q's T
            raise ValueError(f"topk_pos must have one row per query ({t}), got shape {list(topk_pos.shape)}")
        if not isinstance(kv_cache, torch.Tensor):
            raise TypeError("kv_cache of a sparse-MLA model must be one [R, D] tensor")
        if kv_cache.dim() == 3:  # paged rows: the block table's pages are the model's
            check_paged_rows("kv_cache", kv_cache, step.spec.page_size)
        passed = kv_cache
        if step.kv_rows is not None:  # the Runtime's KV format (rows in q's dtype, or fp8_ds_mla)
            kv_cache = step.kv_rows("kv_cache", kv_cache)
        if kv_cache.dtype != torch.uint8:  # rows in q's dtype, named as the caller passed them
            check_tensor("kv_cache", kv_cache, dtypes=(q.dtype,), ndim=2)
            if kv_cache.shape[1] != dim:  # q has the model's width: the cache is the odd one
                raise ValueError(
                    f"kv_cache must have last dim {dim} (the model's head_dim), got shape {list(passed.shape)}"
                )
        if not dcp:  # positions past the table would read no key (the DCP step checks its shard's)
            check_table_on_host(
                block_table,
                seq_lens,
                page_size=step.spec.page_size,
                kv_rows=kv_cache.shape[0] * (kv_cache.shape[1] if kv_cache.dim() == 3 else 1),
            )
        cache = SparseCache(kv_cache, topk_pos, req_ids)
    else:
        for name, x in (("topk_pos", topk_pos), ("req_ids", req_ids), ("topk_length", topk_length)):
            if x is not None:
                raise ValueError(f"{name} is sparse MLA's; a GQA decode attends every earlier token: pass None")
        cache = check_gqa_cache(
            kv_cache, page_size=step.spec.page_size, kv_heads=step.kv_heads[1] - step.kv_heads[0],
            head_dim=dim, dtype=q.dtype, device=q.device, kv_heads_from=lambda: step.kv_heads_from,
        )  # fmt: skip
        if not dcp and (batch is not None or meta is not None):
            raise ValueError(
                f"{'batch' if batch is not None else 'meta'} is a DCP decode's plan; a head-TP step plans "
                "nothing: pass None"
            )
        if batch is not None and meta is not None:
            raise ValueError("pass batch (a host plan) or meta (its metadata on the device), not both")
        if dcp and batch is not None and check:  # its lengths replace those passed beside it
            check_plan_lengths(batch, given_seq_lens, given_cu_q_lens, q_len_per_req=q_len_per_req)
        if max_q_len is not None:  # a promise about the drafts, in every mode (DCP reads no bound)
            check_int("max_q_len", max_q_len, minimum=0)
        planned = dcp and (batch is not None or meta is not None)  # a DCP plan's metadata replaces the drafts
        if not planned and isinstance(block_table, torch.Tensor) and block_table.dim() == 2:
            # the drafts against the values as passed (on a device the op reads none)
            check_drafts_on_host(
                given_seq_lens, given_cu_q_lens, q_len_per_req=q_len_per_req,
                max_q_len=max_q_len, tokens=t, requests=block_table.shape[0],
            )  # fmt: skip
    return DecodeInputs(seq_lens, block_table, topk_length, cu_q_lens, cache)
