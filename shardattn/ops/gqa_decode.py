"""GQA decode over a paged KV cache, with speculative drafts, windows, sinks and split-KV.

Every request ``b`` has ``Q_b`` query tokens (1 for plain decode, the draft length under
speculative decoding) and ``L_b = seq_lens[b]`` keys, the drafts included: its query ``j`` sits at
position ``p = L_b - Q_b + j`` and sees keys ``k`` with::

    lo <= k < hi,   hi = p + 1 (causal) or L_b (non-causal),
                    lo = max(0, p - window_left) with a window (window_left >= 0), else 0

A key of request ``b`` at position ``k`` lives at ``cache[block_table[b, k // page], k % page]``.
Query head ``h`` reads KV head ``h // (Hq // Hkv)``. Attention sinks add one fp32 logit per query
head to the softmax denominator (the LSE includes it). LSE: fp32 natural log.

Empty rows: a request with ``seq_lens[b] == 0`` is padding and writes ``(out 0, lse -inf)`` even
with sinks; a query with no visible key writes ``(0, -inf)`` (``(0, sink)`` with sinks). Rows of
``q`` past ``cu_q_lens[-1]`` belong to no request and write ``(0, -inf)``.

Implementations: :func:`~shardattn.ops.gqa_decode_reference.gqa_paged_decode_reference` (fp32
torch, built on :func:`~shardattn.ops.sparse_mla.sparse_mla_reference`, so the softmax-with-sink
math exists once), the Triton kernel of :mod:`~shardattn.kernels.triton.gqa_decode` (one program per
request, query tile, KV head and KV split; the group's heads times the tile's queries form the
rows of one ``tl.dot``; splits are merged by :func:`~shardattn.ops.lse_merge.launch_lse_merge`),
and FlashInfer's XQA kernel through :mod:`shardattn.kernels.flashinfer_xqa`. :func:`gqa_paged_decode` picks one.

Capture safety: the Triton path never synchronises with the host, and with ``out=``,
``lse_out=`` and ``workspace=`` given it allocates nothing; its grid depends only on shapes,
``q_len_per_req`` / ``max_q_len`` and ``num_splits``.
"""

from __future__ import annotations

import itertools
import math
from typing import Literal, overload

import torch

from shardattn._checks import (
    INDEX_DTYPES,
    check_bool,
    check_choice,
    check_cu_q_lens,
    check_disjoint,
    check_int,
    check_max_q_len,
    check_not_inputs,
    check_page_size,
    check_pages_in_use,
    check_queries_fit,
    check_queries_tensor,
    check_same_device,
    check_scale,
    check_sink_logits,
    check_split_workspace,
    check_tensor,
)
from shardattn.kernels.backend import unsupported_reason
from shardattn.kernels.triton.gqa_decode import HAVE_TRITON, run_triton
from shardattn.ops.gqa_decode_reference import gqa_paged_decode_reference

__all__ = [
    "BACKENDS",
    "gqa_paged_decode",
    "gqa_paged_decode_reference",
    "run_gqa_paged_decode",
]

BACKENDS = ("auto", "triton", "flashinfer", "reference")


def _check_inputs(q, k_cache, v_cache, block_table, seq_lens, q_len_per_req, cu_q_lens, max_q_len, window_left, sinks):
    check_queries_tensor("q", q)
    total_q, hq, d = q.shape
    check_tensor("k_cache", k_cache, dtypes=(q.dtype,), ndim=4)
    num_pages, page, hkv, dk = k_cache.shape
    check_page_size("k_cache", k_cache)
    if dk != d:
        raise ValueError(f"q must have last dim {dk} (k_cache's head_dim), got {d} (q {list(q.shape)})")
    check_tensor("v_cache", v_cache, dtypes=(q.dtype,), shape=tuple(k_cache.shape))
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"q heads ({hq}) must be a multiple of k_cache's KV heads ({hkv})")
    check_tensor("block_table", block_table, dtypes=INDEX_DTYPES, ndim=2)
    batch = block_table.shape[0]
    check_tensor("seq_lens", seq_lens, dtypes=INDEX_DTYPES, shape=(batch,))
    if q_len_per_req is not None and cu_q_lens is not None:
        raise ValueError("give q_len_per_req (uniform drafts) or cu_q_lens (ragged drafts), not both")
    if max_q_len is not None:  # read with cu_q_lens only, checked whenever given
        check_int("max_q_len", max_q_len, minimum=0)
    if cu_q_lens is not None:
        check_tensor("cu_q_lens", cu_q_lens, dtypes=INDEX_DTYPES, shape=(batch + 1,))
    else:
        q_len = 1 if q_len_per_req is None else check_int("q_len_per_req", q_len_per_req, minimum=1)
        if total_q != batch * q_len:
            raise ValueError(
                f"q must have batch * q_len_per_req = {batch} * {q_len} = {batch * q_len} rows, got {total_q}"
            )
    check_int("window_left", window_left, minimum=-1)
    if sinks is not None:
        check_sink_logits(sinks, hq)
    check_same_device(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table,
        seq_lens=seq_lens,
        cu_q_lens=cu_q_lens,
        sinks=sinks,
    )
    if seq_lens.device.type == "cpu":  # value checks only where they cost no device sync
        if bool((seq_lens < 0).any()):
            raise ValueError("seq_lens must be >= 0")
        if bool((seq_lens > block_table.shape[1] * page).any()):
            raise ValueError(f"seq_lens must be <= max_pages * page_size = {block_table.shape[1] * page}")
        if bool(((block_table < 0) | (block_table >= num_pages)).any()):
            check_pages_in_use(block_table, seq_lens, page_size=page, num_pages=num_pages, whose="requests")
        if cu_q_lens is not None:
            cu = cu_q_lens.tolist()
            check_cu_q_lens(cu, total_q)
            queries = [b - a for a, b in itertools.pairwise(cu)]
            if max_q_len is not None:  # the Triton kernel's tiles are sized from it
                check_max_q_len(max_q_len, queries)
        else:
            queries = [q_len] * batch
        check_queries_fit(seq_lens.tolist(), queries)


def _xqa():
    """The FlashInfer XQA adapter (imported on first use: it imports the planner's policy)."""
    from shardattn.kernels import flashinfer_xqa

    return flashinfer_xqa


@overload
def gqa_paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    *, q_len_per_req: int | None = ..., cu_q_lens: torch.Tensor | None = ..., max_q_len: int | None = ...,
    causal: bool = ..., window_left: int = ..., sinks: torch.Tensor | None = ..., return_lse: Literal[False] = ...,
    scale: float | None = ..., backend: str = ..., out: torch.Tensor | None = ..., lse_out: torch.Tensor | None = ...,
    workspace: torch.Tensor | None = ...,
) -> torch.Tensor: ...  # fmt: skip
@overload
def gqa_paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    *, q_len_per_req: int | None = ..., cu_q_lens: torch.Tensor | None = ..., max_q_len: int | None = ...,
    causal: bool = ..., window_left: int = ..., sinks: torch.Tensor | None = ..., return_lse: Literal[True],
    scale: float | None = ..., backend: str = ..., out: torch.Tensor | None = ..., lse_out: torch.Tensor | None = ...,
    workspace: torch.Tensor | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip
@overload
def gqa_paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    *, q_len_per_req: int | None = ..., cu_q_lens: torch.Tensor | None = ..., max_q_len: int | None = ...,
    causal: bool = ..., window_left: int = ..., sinks: torch.Tensor | None = ..., return_lse: bool = ...,
    scale: float | None = ..., backend: str = ..., out: torch.Tensor | None = ..., lse_out: torch.Tensor | None = ...,
    workspace: torch.Tensor | None = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip
def gqa_paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    q_len_per_req: int | None = None,
    cu_q_lens: torch.Tensor | None = None,
    max_q_len: int | None = None,
    causal: bool = True,
    window_left: int = -1,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    scale: float | None = None,
    backend: str = "auto",
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """GQA decode attention over a paged KV cache (see the module docstring for the masks).

    Args:
        q: ``[total_q, Hq, D]`` fp16/bf16/fp32, requests' queries packed in order.
        k_cache, v_cache: ``[num_pages, page_size, Hkv, D]`` in q's dtype (``Hq % Hkv == 0``).
        block_table: ``[B, max_pages]`` int32 page ids per request.
        seq_lens: ``[B]`` int32 keys per request, drafts included, so at least its queries
            (checked on the CPU); 0 marks a padded request.
        q_len_per_req: uniform queries per request (``total_q == B * q_len_per_req``); default 1.
        cu_q_lens: ``[B + 1]`` int32 offsets of ragged drafts (0-length requests allowed; rows past
            ``cu_q_lens[-1]`` are padding). Exclusive with ``q_len_per_req``.
        max_q_len: host bound on the ragged query lengths: at least the most queries of a request
            (the Triton kernel's query tiles per request are sized from it). Checked against
            ``cu_q_lens`` where that is a CPU tensor; on a GPU it is the caller's promise (reading
            ``cu_q_lens`` back would sync): with a smaller bound the Triton kernel leaves the
            queries past its tiles ``(0, -inf)``. Without it the CUDA path reads ``cu_q_lens``
            (one sync; refused under CUDA-graph capture).
        causal: drafts see each other causally (else every query sees all ``L`` keys).
        window_left: sliding window, query at ``p`` sees keys ``[p - window_left, p]``; -1 = off.
        sinks: ``[Hq]`` fp32 sink logits, optional.
        return_lse: also return the fp32 natural-log LSE (never with the FlashInfer backend).
        scale: softmax scale, default ``D ** -0.5``.
        backend: ``"auto"`` (Triton on CUDA, else FlashInfer XQA when usable and no LSE is
            asked, else the reference), ``"triton"``, ``"flashinfer"`` or ``"reference"``.
        out, lse_out, workspace: optional destinations ``[total_q, Hq, D]`` (q's dtype),
            ``[total_q, Hq]`` fp32, and a flat fp32 split buffer
            (:func:`~shardattn.kernels.triton.lse_merge.split_partials_numel`); with them the Triton path
            allocates nothing.
            They share no memory with each other nor with an input (``q`` included: the
            kernel's programs read inputs after others wrote their results).
    Returns:
        ``out [total_q, Hq, D]`` in q's dtype, and ``lse [total_q, Hq]`` fp32 when ``return_lse``.

    Example:
        >>> q = torch.randn(2, 4, 16)
        >>> k, v = torch.randn(3, 16, 2, 16), torch.randn(3, 16, 2, 16)
        >>> table = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32)
        >>> lens = torch.tensor([20, 0], dtype=torch.int32)
        >>> out, lse = gqa_paged_decode(q, k, v, table, lens, return_lse=True)
        >>> tuple(out.shape), bool(lse[1].isneginf().all()), float(out[1].abs().sum())
        ((2, 4, 16), True, 0.0)
    """
    check_choice("backend", backend, BACKENDS)
    _check_inputs(q, k_cache, v_cache, block_table, seq_lens, q_len_per_req, cu_q_lens, max_q_len, window_left, sinks)
    check_bool("causal", causal)
    check_bool("return_lse", return_lse)
    total_q, hq, d = q.shape
    scale = d**-0.5 if scale is None else check_scale("scale", scale)
    if out is not None:
        check_tensor("out", out, dtypes=(q.dtype,), shape=(total_q, hq, d), device=q.device)
    if lse_out is not None:
        check_tensor("lse_out", lse_out, dtypes=(torch.float32,), shape=(total_q, hq), device=q.device)
    if workspace is not None:
        check_split_workspace(workspace, q.device)
    check_disjoint(out=out, lse_out=lse_out, workspace=workspace)
    check_not_inputs(
        {"out": out, "lse_out": lse_out, "workspace": workspace},
        {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_table": block_table, "seq_lens": seq_lens,
         "cu_q_lens": cu_q_lens, "sinks": sinks},
    )  # fmt: skip
    return run_gqa_paged_decode(
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        q_len_per_req=q_len_per_req,
        cu_q_lens=cu_q_lens,
        max_q_len=max_q_len,
        causal=causal,
        window_left=window_left,
        sinks=sinks,
        return_lse=return_lse,
        scale=scale,
        backend=backend,
        out=out,
        lse_out=lse_out,
        workspace=workspace,
    )


def run_gqa_paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    q_len_per_req: int | None,
    cu_q_lens: torch.Tensor | None,
    max_q_len: int | None,
    causal: bool,
    window_left: int,
    sinks: torch.Tensor | None,
    return_lse: bool,
    scale: float,
    backend: str,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`gqa_paged_decode` on arguments already checked (by it, or by a parallel step that
    validated its own inputs and built these from them): picks the backend and runs it, with no
    argument checks. Raises ``ValueError`` only for a backend that cannot run here, before any
    kernel. Arguments and return value: :func:`gqa_paged_decode` (``scale`` resolved to a float),
    and the Triton path's launch knob ``num_splits`` (KV splits; default about two waves of programs),
    which tests and benchmarks set.
    """
    if num_splits is not None:
        check_int("num_splits", num_splits, minimum=1)
    total_q, hq, _ = q.shape
    batch = block_table.shape[0]
    ragged = cu_q_lens is not None
    q_len = 0 if ragged else (1 if q_len_per_req is None else q_len_per_req)
    if cu_q_lens is not None and max_q_len is None:
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise ValueError("max_q_len is required with cu_q_lens under CUDA-graph capture (no host sync)")
        max_q_len = int((cu_q_lens[1:] - cu_q_lens[:-1]).max()) if batch > 0 else 0
    max_q = max_q_len if ragged else q_len

    triton_ok = False
    if backend in ("auto", "triton"):
        reason = "triton is not installed" if not HAVE_TRITON else unsupported_reason(q)
        triton_ok = reason is None
        if backend == "triton" and not triton_ok:
            raise ValueError(f"backend='triton' is unavailable: {reason}")
    drafts = not causal and (ragged or q_len > 1)  # non-causal drafts (one query: the same either way)
    if backend == "auto":  # Triton matched or beat XQA on the H200 (docs/DECISIONS.md, D46)
        if triton_ok:
            backend = "triton"
        elif not return_lse and _xqa().unavailable_reason(q, k_cache, non_causal_drafts=drafts) is None:
            backend = "flashinfer"
        else:
            backend = "reference"
    if backend == "flashinfer":
        if return_lse:
            raise ValueError("backend='flashinfer' (XQA) returns no LSE; use backend='triton' with return_lse")
        flashinfer_xqa = _xqa()
        reason = flashinfer_xqa.unavailable_reason(q, k_cache, non_causal_drafts=drafts)
        if reason is not None:
            raise ValueError(f"backend='flashinfer' is unavailable: {reason}")
        return flashinfer_xqa.xqa_paged_decode(
            q,
            k_cache,
            v_cache,
            block_table,
            seq_lens,
            q_len_per_req=q_len if not ragged else None,
            cu_q_lens=cu_q_lens,
            max_q_len=max_q,
            causal=causal,
            window_left=window_left,
            sinks=sinks,
            scale=scale,
            out=out,
        )
    if backend == "triton":
        out = torch.empty_like(q) if out is None else out
        lse = torch.empty(total_q, hq, dtype=torch.float32, device=q.device) if lse_out is None else lse_out
        if total_q > 0 and batch > 0:
            run_triton(
                q,
                k_cache,
                v_cache,
                block_table,
                seq_lens,
                cu_q_lens,
                q_len,
                max_q,
                causal,
                window_left,
                sinks,
                scale,
                num_splits,
                out,
                lse,
                workspace,
            )
        elif total_q > 0:
            out.zero_()
            lse.fill_(-math.inf)
        return (out, lse) if return_lse else out
    cu = cu_q_lens if cu_q_lens is not None else torch.arange(batch + 1, dtype=torch.int32, device=q.device) * q_len
    with torch.no_grad():  # inference, as the kernels: no autograd history on any device
        ref_out, ref_lse = gqa_paged_decode_reference(
            q,
            k_cache,
            v_cache,
            block_table,
            seq_lens,
            cu,
            causal=causal,
            window_left=window_left,
            sinks=sinks,
            scale=scale,
        )
    if out is not None:
        ref_out = out.copy_(ref_out)
    if lse_out is not None:
        ref_lse = lse_out.copy_(ref_lse)
    return (ref_out, ref_lse) if return_lse else ref_out
