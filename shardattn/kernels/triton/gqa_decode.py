"""The Triton GQA paged-decode kernel and its launcher (the math: :mod:`shardattn.ops.gqa_decode`).

One program per request, query tile, KV head and KV split; the group's heads times the tile's
queries form the rows of one ``tl.dot``; splits are merged by
:func:`~shardattn.ops.lse_merge.launch_lse_merge`. Called through
:func:`~shardattn.ops.gqa_decode.gqa_paged_decode`, which validates the inputs first.
"""

from __future__ import annotations

import math

import torch

from shardattn.kernels.backend import COMPILE_OPTIONS, sm_count, unit_stride
from shardattn.kernels.triton.lse_merge import launch_lse_merge, split_partials

try:  # Triton is optional: without it every path runs the torch reference.
    import triton
    import triton.language as tl

    from shardattn.kernels.triton.online_softmax import online_softmax_finish, online_softmax_step
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None

__all__ = ["HAVE_TRITON", "MIN_SPLIT_TOKENS", "choose_num_splits", "run_triton"]

HAVE_TRITON = triton is not None

LOG2E = 1.4426950408889634
#: Smallest KV range one split covers (tokens); fewer make the merge cost more than it saves.
MIN_SPLIT_TOKENS = 256


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


def run_triton(
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
    seq_lens, cu_q_lens, sinks = unit_stride(seq_lens), unit_stride(cu_q_lens), unit_stride(sinks)
    block_table = unit_stride(block_table)  # the kernel steps a row's pages by 1
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    batch, max_pages = block_table.shape
    group = hq // hkv
    block_q, block_m, n_qtiles = _tiles(group, max_q)
    max_kv = max_pages * page
    if num_splits is None:
        num_splits = choose_num_splits(batch * n_qtiles * hkv, max_kv, sm_count(q.device))
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
        **COMPILE_OPTIONS,
    )
    if num_splits > 1:
        launch_lse_merge(part_out, part_lse, out, lse)


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
