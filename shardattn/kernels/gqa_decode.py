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

Implementations: :func:`gqa_paged_decode_reference` (fp32 torch, built on
:func:`~shardattn.kernels.sparse_mla.sparse_mla_reference`, so the softmax-with-sink math exists
once), the Triton kernel ``_gqa_decode_kernel`` (one program per request, query tile, KV head and
KV split; the group's heads times the tile's queries form the rows of one ``tl.dot``; splits are
merged by :func:`~shardattn.kernels.lse_merge.launch_lse_merge`), and FlashInfer's XQA kernel
through :mod:`shardattn.kernels.flashinfer_xqa`. :func:`gqa_paged_decode` picks one.

Capture safety: the Triton path never synchronises with the host, and with ``out=``,
``lse_out=`` and ``workspace=`` given it allocates nothing; its grid depends only on shapes,
``q_len_per_req`` / ``max_q_len`` and ``num_splits``.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch

from shardattn._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_choice,
    check_int,
    check_same_device,
    check_scale,
    check_tensor,
)
from shardattn.kernels.lse_merge import launch_lse_merge, split_partials, split_partials_numel
from shardattn.kernels.registry import unsupported_reason, use_triton
from shardattn.kernels.sparse_mla import sparse_mla_reference

try:  # Triton is optional: without it every path runs the torch reference.
    import triton
    import triton.language as tl

    from shardattn.kernels.online_softmax import online_softmax_finish, online_softmax_step
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None

__all__ = ["BACKENDS", "gqa_decode_workspace_numel", "gqa_paged_decode", "gqa_paged_decode_reference"]

BACKENDS = ("auto", "triton", "flashinfer", "reference")
LOG2E = 1.4426950408889634
#: Smallest KV range one split covers (tokens); fewer make the merge cost more than it saves.
MIN_SPLIT_TOKENS = 256


def _positions(cu: list[int], b: int, seq_len: int) -> tuple[int, int, int]:
    start, end = cu[b], cu[b + 1]
    return start, end, seq_len - (end - start)


def gqa_paged_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_q_lens: torch.Tensor,
    *,
    causal: bool = True,
    window_left: int = -1,
    sinks: torch.Tensor | None = None,
    scale: float,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (or fp64) torch reference of :func:`gqa_paged_decode` (reads ``seq_lens`` on the host).

    Args:
        q: ``[total_q, Hq, D]``; k_cache, v_cache: ``[num_pages, page, Hkv, D]``.
        block_table: ``[B, max_pages]`` int32; seq_lens: ``[B]`` int32 (drafts included).
        cu_q_lens: ``[B + 1]`` int32 query offsets (uniform drafts: ``arange(B + 1) * Q``).
        causal, window_left, sinks (``[Hq]`` fp32), scale: as in :func:`gqa_paged_decode`.
        compute_dtype: float32 or float64.
    Returns:
        ``(out [total_q, Hq, D] in q.dtype, lse [total_q, Hq] fp32)``.
    """
    total_q, hq, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    out = torch.zeros(total_q, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.full((total_q, hq), -math.inf, dtype=torch.float32, device=q.device)
    cu = [int(x) for x in cu_q_lens.tolist()]
    lens = [int(x) for x in seq_lens.tolist()]
    for b, seq_len in enumerate(lens):
        start, end, first = _positions(cu, b, seq_len)
        if end <= start or seq_len <= 0:
            continue  # a padded request: (0, -inf)
        pages = block_table[b, : -(-seq_len // page)].long()
        keys = k_cache[pages].reshape(-1, hkv, d)[:seq_len]
        values = v_cache[pages].reshape(-1, hkv, d)[:seq_len]
        pos = first + torch.arange(end - start, device=q.device)  # [Q]
        key_pos = torch.arange(seq_len, device=q.device)
        hi = pos + 1 if causal else torch.full_like(pos, seq_len)
        lo = (pos - window_left).clamp(min=0) if window_left >= 0 else torch.zeros_like(pos)
        visible = (key_pos[None, :] >= lo[:, None]) & (key_pos[None, :] < hi[:, None])
        rows = torch.where(visible, key_pos[None, :], torch.full_like(visible, -1, dtype=torch.long))
        for g in range(hkv):
            heads = slice(g * group, (g + 1) * group)
            # value first, key second: sparse MLA's "value = first v_dim dims of a row" layout
            kv = torch.cat([values[:, g], keys[:, g]], dim=-1)
            qg = torch.cat([torch.zeros_like(q[start:end, heads]), q[start:end, heads]], dim=-1)
            o, l = sparse_mla_reference(
                qg,
                kv,
                rows.to(torch.int32),
                scale=scale,
                v_dim=d,
                sinks=None if sinks is None else sinks[heads],
                compute_dtype=compute_dtype,
            )
            out[start:end, heads] = o
            lse[start:end, heads] = l
    return out, lse


def _check_inputs(q, k_cache, v_cache, block_table, seq_lens, q_len_per_req, cu_q_lens, window_left, sinks):
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3)
    total_q, hq, d = q.shape
    check_tensor("k_cache", k_cache, dtypes=(q.dtype,), ndim=4)
    num_pages, page, hkv, dk = k_cache.shape
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
        check_tensor("sinks", sinks, dtypes=(torch.float32,), shape=(hq,))
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
            bad = [
                b
                for b in range(batch)
                if bool(
                    (
                        (block_table[b, : -(-int(seq_lens[b]) // page)] < 0)
                        | (block_table[b, : -(-int(seq_lens[b]) // page)] >= num_pages)
                    ).any()
                )
            ]
            if bad:
                raise ValueError(f"block_table holds pages outside [0, {num_pages}) for requests {bad[:8]}")
        if cu_q_lens is not None:
            cu = cu_q_lens.tolist()
            if cu[0] != 0 or any(b < a for a, b in itertools.pairwise(cu)) or cu[-1] > total_q:
                raise ValueError(f"cu_q_lens must start at 0, not decrease and end <= {total_q}, got {cu}")
            lens = seq_lens.tolist()
            short = [b for b in range(batch) if lens[b] > 0 and cu[b + 1] - cu[b] > lens[b]]
            if short:
                raise ValueError(f"requests {short[:8]} have more queries than keys (seq_lens counts the drafts)")


def gqa_decode_workspace_numel(total_q: int, num_q_heads: int, head_dim: int, num_splits: int) -> int:
    """fp32 elements the split-KV path needs (partial outputs and LSEs); 0 when not split."""
    return split_partials_numel(num_splits, total_q, num_q_heads, head_dim)


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _tiles(group: int, max_q: int) -> tuple[int, int, int]:
    """``(BLOCK_Q, BLOCK_M, n_qtiles)``: queries per tile, rows per tile (>= 16), tiles per request."""
    block_q = min(triton.next_power_of_2(max(1, max_q)), max(1, 64 // group))
    block_m = max(16, triton.next_power_of_2(block_q * group))
    return block_q, block_m, triton.cdiv(max(1, max_q), block_q)


def choose_num_splits(programs: int, max_kv: int, num_sms: int) -> int:
    """Split the KV range so that about two waves of programs run; host-side, shape-only."""
    if programs <= 0 or max_kv <= 0:
        return 1
    want = -(-2 * num_sms // programs)
    return max(1, min(want, max_kv // MIN_SPLIT_TOKENS, 64))


def _run_triton(
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
):
    total_q, hq, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    batch, max_pages = block_table.shape
    group = hq // hkv
    block_q, block_m, n_qtiles = _tiles(group, max_q)
    max_kv = max_pages * page
    if num_splits is None:
        num_splits = choose_num_splits(batch * n_qtiles * hkv, max_kv, _num_sms(q.device))
    block_n = 64 if d <= 128 else 32
    chunk = triton.cdiv(triton.cdiv(max(1, max_kv), num_splits), block_n) * block_n
    num_splits = triton.cdiv(max(1, max_kv), chunk)
    ragged = cu_q_lens is not None
    if num_splits > 1:
        part_out, part_lse = split_partials(workspace, num_splits, total_q, hq, d, q.device)
        if ragged:
            part_lse.fill_(-math.inf)  # rows of no request stay empty
        dst_out, dst_lse = part_out, part_lse
        s_os, s_ls = part_out.stride(0), part_lse.stride(0)
    else:
        if ragged:
            out.zero_()
            lse.fill_(-math.inf)
        dst_out, dst_lse, s_os, s_ls = out, lse, 0, 0
    dummy = seq_lens
    grid = (batch * n_qtiles, hkv, num_splits)
    _gqa_decode_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        cu_q_lens if ragged else dummy,
        sinks if sinks is not None else dummy,
        dst_out,
        dst_lse,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.stride(3),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        v_cache.stride(3),
        block_table.stride(0),
        dst_out.stride(-3),
        dst_out.stride(-2),
        dst_out.stride(-1),
        s_os,
        dst_lse.stride(-2),
        dst_lse.stride(-1),
        s_ls,
        float(scale) * LOG2E,
        window_left,
        chunk,
        n_qtiles,
        Q_LEN=0 if ragged else q_len,
        GROUP=group,
        PAGE=page,
        HEAD_DIM=d,
        BLOCK_D=triton.next_power_of_2(d),
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        CAUSAL=bool(causal),
        HAS_WINDOW=window_left >= 0,
        HAS_SINKS=sinks is not None,
        IEEE=q.dtype == torch.float32,
        num_warps=4,
        num_stages=3,
    )
    if num_splits > 1:
        launch_lse_merge(part_out, part_lse, out, lse)


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
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """GQA decode attention over a paged KV cache (see the module docstring for the masks).

    Args:
        q: ``[total_q, Hq, D]`` fp16/bf16/fp32, requests' queries packed in order.
        k_cache, v_cache: ``[num_pages, page_size, Hkv, D]`` in q's dtype (``Hq % Hkv == 0``).
        block_table: ``[B, max_pages]`` int32 page ids per request.
        seq_lens: ``[B]`` int32 keys per request, drafts included; 0 marks a padded request.
        q_len_per_req: uniform queries per request (``total_q == B * q_len_per_req``); default 1.
        cu_q_lens: ``[B + 1]`` int32 offsets of ragged drafts (0-length requests allowed; rows past
            ``cu_q_lens[-1]`` are padding). Exclusive with ``q_len_per_req``.
        max_q_len: host bound on the ragged query lengths; without it the CUDA path reads
            ``cu_q_lens`` (one sync; refused under CUDA-graph capture).
        causal: drafts see each other causally (else every query sees all ``L`` keys).
        window_left: sliding window, query at ``p`` sees keys ``[p - window_left, p]``; -1 = off.
        sinks: ``[Hq]`` fp32 sink logits, optional.
        return_lse: also return the fp32 natural-log LSE (never with the FlashInfer backend).
        scale: softmax scale, default ``D ** -0.5``.
        backend: ``"auto"`` (Triton on CUDA, else FlashInfer XQA when usable and no LSE is
            asked, else the reference), ``"triton"``, ``"flashinfer"`` or ``"reference"``.
        num_splits: KV splits of the Triton path (default: about two waves of programs).
        out, lse_out, workspace: optional destinations ``[total_q, Hq, D]`` (q's dtype),
            ``[total_q, Hq]`` fp32, and a flat fp32 split buffer
            (:func:`gqa_decode_workspace_numel`); with them the Triton path allocates nothing.
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
    _check_inputs(q, k_cache, v_cache, block_table, seq_lens, q_len_per_req, cu_q_lens, window_left, sinks)
    total_q, hq, d = q.shape
    batch = block_table.shape[0]
    scale = d**-0.5 if scale is None else check_scale("scale", scale)
    if num_splits is not None:
        check_int("num_splits", num_splits, minimum=1)
    if out is not None:
        check_tensor("out", out, dtypes=(q.dtype,), shape=(total_q, hq, d), device=q.device)
    if lse_out is not None:
        check_tensor("lse_out", lse_out, dtypes=(torch.float32,), shape=(total_q, hq), device=q.device)
    ragged = cu_q_lens is not None
    q_len = 0 if ragged else (1 if q_len_per_req is None else q_len_per_req)
    if ragged:
        if max_q_len is None:
            if q.is_cuda and torch.cuda.is_current_stream_capturing():
                raise ValueError("max_q_len is required with cu_q_lens under CUDA-graph capture (no host sync)")
            max_q_len = int((cu_q_lens[1:] - cu_q_lens[:-1]).max()) if batch > 0 else 0
        check_int("max_q_len", max_q_len, minimum=0)
    max_q = max_q_len if ragged else q_len

    from shardattn.kernels import flashinfer_xqa  # local: the adapter imports the planner's policy

    if backend == "auto":  # Triton matched or beat XQA on the H200 (benchmarks/RESULTS.md, "Decode")
        if triton is not None and use_triton(q):
            backend = "triton"
        elif not return_lse and flashinfer_xqa.unavailable_reason(q, k_cache) is None:
            backend = "flashinfer"
        else:
            backend = "reference"
    if backend == "flashinfer":
        if return_lse:
            raise ValueError("backend='flashinfer' (XQA) returns no LSE; use backend='triton' with return_lse")
        reason = flashinfer_xqa.unavailable_reason(q, k_cache)
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
        reason = "triton is not installed" if triton is None else unsupported_reason(q)
        if reason is not None:
            raise ValueError(f"backend='triton' is unavailable: {reason}")
        out = torch.empty_like(q) if out is None else out
        lse = torch.empty(total_q, hq, dtype=torch.float32, device=q.device) if lse_out is None else lse_out
        if total_q > 0 and batch > 0:
            _run_triton(
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
    cu = cu_q_lens if ragged else torch.arange(batch + 1, dtype=torch.int32, device=q.device) * q_len
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


if triton is not None:

    @triton.jit
    def _gqa_decode_kernel(
        Q,
        K,
        V,
        BlockTable,
        SeqLens,
        CuQ,
        Sinks,
        Out,
        Lse,
        stride_qt,
        stride_qh,
        stride_qd,
        stride_kp,
        stride_ks,
        stride_kh,
        stride_kd,
        stride_vp,
        stride_vs,
        stride_vh,
        stride_vd,
        stride_btb,
        stride_ot,
        stride_oh,
        stride_od,
        stride_os,
        stride_lt,
        stride_lh,
        stride_ls,
        qk_scale,
        window_left,
        chunk,
        n_qtiles,
        Q_LEN: tl.constexpr,
        GROUP: tl.constexpr,
        PAGE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        HAS_SINKS: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """One (request, query tile, KV head, KV split): rows = the tile's queries x the group's heads."""
        tl.static_assert(BLOCK_M >= 16, "tl.dot needs at least 16 rows")
        tl.static_assert(BLOCK_Q * GROUP <= BLOCK_M, "a tile's rows must fit BLOCK_M")
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        b = pid // n_qtiles
        qt = pid % n_qtiles
        if Q_LEN > 0:
            q_start = b * Q_LEN
            q_len = Q_LEN
        else:
            q_start = tl.load(CuQ + b)
            q_len = tl.load(CuQ + b + 1) - q_start
        seq_len = tl.load(SeqLens + b)
        if qt * BLOCK_Q < q_len:
            offs_m = tl.arange(0, BLOCK_M)
            offs_d = tl.arange(0, BLOCK_D)
            j = qt * BLOCK_Q + offs_m // GROUP
            head = kvh * GROUP + offs_m % GROUP
            row_ok = (offs_m < BLOCK_Q * GROUP) & (j < q_len)
            tok = (q_start + j).to(tl.int64)
            dmask = offs_d < HEAD_DIM
            q = tl.load(
                Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & dmask[None, :],
                other=0.0,
            )
            pos = seq_len - q_len + j  # [BLOCK_M]
            if CAUSAL:
                hi_row = pos + 1
            else:
                hi_row = tl.zeros_like(pos) + seq_len
            hi_row = tl.minimum(hi_row, seq_len)
            if HAS_WINDOW:
                lo_row = tl.maximum(pos - window_left, 0)
            else:
                lo_row = tl.zeros_like(pos)
            # the program's key range: union over its rows, cut to its split
            j_last = tl.minimum(q_len, qt * BLOCK_Q + BLOCK_Q) - 1
            if CAUSAL:
                hi = tl.minimum(seq_len - q_len + j_last + 1, seq_len)
            else:
                hi = seq_len
            if HAS_WINDOW:
                lo = tl.maximum(seq_len - q_len + qt * BLOCK_Q - window_left, 0)
            else:
                lo = 0
            lo = tl.maximum(lo, split * chunk)
            hi = tl.minimum(hi, split * chunk + chunk)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            if HAS_SINKS:
                if split == 0:
                    sink = tl.load(Sinks + head, mask=row_ok, other=0.0) * 1.4426950408889634
                    live = row_ok & (seq_len > 0)
                    m_i = tl.where(live, sink, m_i)
                    l_i = tl.where(live, 1.0, l_i)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            bt = BlockTable + b.to(tl.int64) * stride_btb
            start = (lo // BLOCK_N) * BLOCK_N
            for n0 in range(start, hi, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                nmask = (offs_n >= lo) & (offs_n < hi)
                page_id = tl.load(bt + offs_n // PAGE, mask=nmask, other=0).to(tl.int64)
                slot = offs_n % PAGE
                kmask = nmask[:, None] & dmask[None, :]
                k = tl.load(
                    K
                    + page_id[:, None] * stride_kp
                    + slot[:, None] * stride_ks
                    + kvh * stride_kh
                    + offs_d[None, :] * stride_kd,
                    mask=kmask,
                    other=0.0,
                )
                v = tl.load(
                    V
                    + page_id[:, None] * stride_vp
                    + slot[:, None] * stride_vs
                    + kvh * stride_vh
                    + offs_d[None, :] * stride_vd,
                    mask=kmask,
                    other=0.0,
                )
                if IEEE:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                seen = nmask[None, :] & (offs_n[None, :] >= lo_row[:, None]) & (offs_n[None, :] < hi_row[:, None])
                s = tl.where(seen, s * qk_scale, float("-inf"))
                p, alpha, m_new, l_i = online_softmax_step(s, m_i, l_i)
                if IEEE:
                    pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
                else:
                    pv = tl.dot(p.to(v.dtype), v)
                acc = acc * alpha[:, None] + pv
                m_i = m_new
            res, lse = online_softmax_finish(acc, m_i, l_i)
            o_ptrs = (
                Out
                + split * stride_os
                + tok[:, None] * stride_ot
                + head[:, None] * stride_oh
                + offs_d[None, :] * stride_od
            )
            tl.store(o_ptrs, res.to(Out.dtype.element_ty), mask=row_ok[:, None] & dmask[None, :])
            tl.store(Lse + split * stride_ls + tok * stride_lt + head * stride_lh, lse, mask=row_ok)
