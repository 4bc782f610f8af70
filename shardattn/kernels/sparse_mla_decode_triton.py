"""The Triton split-KV kernel of sparse-MLA decode and its launcher (no checks, no routing).

One program per (head block, token, split of the top-k row) runs the online softmax
(:mod:`~shardattn.kernels.online_softmax`) over its slice of the row's KV rows and writes an fp32
partial and LSE (or, with one split, the result). The contract, the configuration and the merge
of the partials live in :mod:`~shardattn.kernels.sparse_mla_decode`.

The spread one-launch merge (``SPREAD``): a barrier per (token, head block) of two int32 words,
an arrival count and a generation. A program reads the generation when it starts; after it
stores its partial it arrives (a block barrier, then ``atomic_add`` on the count, acquire-release
at GPU scope). The last of the ``S`` arrivals resets the count to 0 and bumps the generation
(release); the others spin until the generation differs from the one they read (``atomic_add(0)``,
acquire). Then each of the ``S`` programs merges ``1/S`` of the (head, column) cells of that block
over all ``S`` partials (:func:`~shardattn.kernels.lse_merge.merge_partials_tile`, the column
merge's math). The count is 0 again after every launch and the generation only ever changes
(compared for equality, so its wrap-around is harmless): graph replays need no reset. A spin
barrier needs every program of a (token, head block) resident at once: the caller launches it
only when the whole grid fits in one wave (``programs <= SMs``). Triton's interpreter runs
programs one after another, where a spin could never end: there the same kernel runs as two
launches, ``SPREAD_ARRIVE`` (attention, partial, arrival, the last one's reset) then
``SPREAD_MERGE`` (the launch boundary is the barrier: no wait; the merge).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardattn.kernels.lse_merge import gdc_launch_dependents, gdc_wait, merge_partials_tile
from shardattn.kernels.online_softmax import online_softmax_finish, online_softmax_step

LOG2E = 1.4426950408889634

#: ``SPREAD`` modes of ``_sparse_mla_decode_kernel``: no spread merge; attention, arrival, wait
#: and the merge of this program's cells in one launch; the first half (attention and arrival)
#: and the second half (the merge) as two launches (the interpreter's way).
SPREAD_OFF, SPREAD_ONE_LAUNCH, SPREAD_ARRIVE, SPREAD_MERGE = 0, 1, 2, 3


def launch_split_kernel(
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    topk_length: torch.Tensor | None,
    sinks: torch.Tensor | None,
    dst_out: torch.Tensor,
    dst_lse: torch.Tensor,
    out: torch.Tensor,
    lse_out: torch.Tensor,
    counters: torch.Tensor,
    cfg: dict,
    scale: float,
    spread: int = SPREAD_OFF,
    pdl: bool = False,
) -> None:
    """Launch ``_sparse_mla_decode_kernel`` on validated tensors (no checks, no allocation, no sync).

    Args:
        q ``[T, H, D]``, kv ``[R, D]``, rows ``[T, K]`` int32, topk_length ``[T]`` / sinks ``[H]`` or None.
        dst_out ``[S, T, H, Dv]`` (fp32 or q's dtype) / dst_lse ``[S, T, H]`` fp32 partials
        (``out`` / ``lse_out`` when ``cfg["num_splits"] == 1``); out ``[T, H, Dv]``, lse_out
        ``[T, H]``: the result (written here only with one split or ``spread``); counters: int32
        zeros for ``spread`` (at least ``2 * T * ceil(H / BLOCK_H)``: counts in the first half,
        generations in the second), else unused.
        cfg: :func:`sparse_mla_decode_config`'s dict. spread: a ``SPREAD_*`` mode (module docstring).
        pdl: a programmatic dependent launch (only where
            :func:`~shardattn.kernels.backend.pdl_supported`): the kernel waits for the grid before
            it in the stream before reading anything, and lets the next one (a PDL merge) launch
            once every program has stored its partial. (Letting it launch when the programs
            start measured faster at 16 heads x 1-2 tokens and slower everywhere else:
            docs/DECISIONS.md, D24.)
    """
    t, h, d = q.shape
    v_dim = out.shape[-1]
    dr = d - v_dim
    splits = cfg["num_splits"]
    topk = rows.shape[1]
    if splits > 1:
        s_os, s_ls = dst_out.stride(0), dst_lse.stride(0)
    else:
        s_os, s_ls = 0, 0
    grid = (triton.cdiv(h, cfg["BLOCK_H"]), t, splits)
    # the spread merge's pieces: each head of a block is cut into ``pieces`` column slices of
    # ``merge_c`` columns, so that a head block has about ``splits`` pieces (one per program)
    heads_in_block = min(cfg["BLOCK_H"], h)
    merge_c = triton.next_power_of_2(-(-v_dim // max(1, splits // heads_in_block)))
    pieces = -(-v_dim // merge_c)
    _sparse_mla_decode_kernel[grid](
        q,
        kv,
        rows,
        topk_length if topk_length is not None else rows,
        sinks if sinks is not None else q,
        dst_out,
        dst_lse,
        out,
        lse_out,
        counters,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        kv.stride(0),
        kv.stride(1),
        rows.stride(0),
        rows.stride(1),
        dst_out.stride(-3),
        dst_out.stride(-2),
        dst_out.stride(-1),
        s_os,
        dst_lse.stride(-2),
        dst_lse.stride(-1),
        s_ls,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        lse_out.stride(0),
        lse_out.stride(1),
        splits,
        h,
        kv.shape[0],
        topk,
        cfg["chunk"],
        pieces if spread else 1,  # fixed when unused: no recompile
        counters.numel() // 2 if spread else 0,
        float(scale) * LOG2E,
        DV=v_dim,
        DR=dr,
        BLOCK_DV=triton.next_power_of_2(v_dim),
        BLOCK_DR=max(16, triton.next_power_of_2(max(dr, 1))),
        BLOCK_H=cfg["BLOCK_H"],
        BLOCK_N=cfg["BLOCK_N"],
        HAS_TOPK_LEN=topk_length is not None,
        HAS_SINKS=sinks is not None,
        HAS_ROPE=dr > 0,
        IEEE=q.dtype == torch.float32,
        SPREAD=spread,
        BLOCK_S=max(2, triton.next_power_of_2(splits)) if spread else 2,  # fixed when unused: no recompile
        MERGE_C=merge_c if spread else 16,
        PDL=pdl,
        num_warps=cfg["num_warps"],
        num_stages=cfg.get("num_stages", 2),
        launch_pdl=pdl,
    )


@triton.jit
def _sparse_mla_decode_kernel(
    Q,
    KV,
    Rows,
    TopkLen,
    Sinks,
    Out,
    Lse,
    FinalOut,
    FinalLse,
    Counters,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kvr,
    stride_kvd,
    stride_rt,
    stride_rk,
    stride_ot,
    stride_oh,
    stride_od,
    stride_os,
    stride_lt,
    stride_lh,
    stride_ls,
    stride_yt,
    stride_yh,
    stride_yd,
    stride_zt,
    stride_zh,
    num_splits,
    H,
    R,
    K,
    chunk,
    pieces_per_head,
    gen_offset,
    qk_scale,
    DV: tl.constexpr,
    DR: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_TOPK_LEN: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    IEEE: tl.constexpr,
    SPREAD: tl.constexpr,
    BLOCK_S: tl.constexpr,
    MERGE_C: tl.constexpr,
    PDL: tl.constexpr,
):
    """One (head block, token, split): online softmax over rows ``[split*chunk, ...)`` of the top-k;
    with ``SPREAD`` every split merges its share of the cells once all splits arrived; with ``PDL``
    it waits for the grid before it and lets the next one launch after its stores."""
    tl.static_assert(BLOCK_H >= 16, "tl.dot needs at least 16 rows")
    if PDL:  # the grid before this one (a union build, an indexer) wrote q / rows: wait for it
        gdc_wait()
    pid_h = tl.program_id(0)
    tok = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    gen0 = 0
    count = Counters + tok * tl.num_programs(0) + pid_h  # the spread merge's arrival count, and
    gen = count + gen_offset  # its generation in the buffer's second half (the same slot for any T)
    if SPREAD == 1:  # the generation before this launch's arrivals (read early: off the critical path)
        gen0 = tl.load(gen, volatile=True)
    if SPREAD != 3:  # not the merge-only half (SPREAD_MERGE): the attention and the partial
        heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < H
        offs_v = tl.arange(0, BLOCK_DV)
        offs_r = tl.arange(0, BLOCK_DR)
        vmask = offs_v < DV
        rmask = offs_r < DR
        q_base = Q + tok * stride_qt + heads[:, None] * stride_qh
        q_nope = tl.load(q_base + offs_v[None, :] * stride_qd, mask=hmask[:, None] & vmask[None, :], other=0.0)
        if HAS_ROPE:
            q_pe = tl.load(q_base + (DV + offs_r[None, :]) * stride_qd, mask=hmask[:, None] & rmask[None, :], other=0.0)
        k_len = K
        if HAS_TOPK_LEN:
            k_len = tl.minimum(tl.load(TopkLen + tok), K)
        lo = split * chunk
        hi = tl.minimum(lo + chunk, k_len)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        if HAS_SINKS:
            if split == 0:
                m_i = tl.load(Sinks + heads, mask=hmask, other=0.0) * 1.4426950408889634
                l_i = tl.zeros([BLOCK_H], tl.float32) + 1.0
        acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            nmask = offs_n < hi
            r = tl.load(Rows + tok * stride_rt + offs_n * stride_rk, mask=nmask, other=-1)
            valid = nmask & (r >= 0) & (r < R)
            row_ptr = KV + tl.where(valid, r, 0).to(tl.int64)[:, None] * stride_kvr
            k_nope = tl.load(row_ptr + offs_v[None, :] * stride_kvd, mask=valid[:, None] & vmask[None, :], other=0.0)
            if IEEE:
                s = tl.dot(q_nope, tl.trans(k_nope), input_precision="ieee")
            else:
                s = tl.dot(q_nope, tl.trans(k_nope))
            if HAS_ROPE:
                k_pe = tl.load(
                    row_ptr + (DV + offs_r[None, :]) * stride_kvd, mask=valid[:, None] & rmask[None, :], other=0.0
                )
                if IEEE:
                    s += tl.dot(q_pe, tl.trans(k_pe), input_precision="ieee")
                else:
                    s += tl.dot(q_pe, tl.trans(k_pe))
            s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
            p, alpha, m_new, l_i = online_softmax_step(s, m_i, l_i)
            if IEEE:
                pv = tl.dot(p.to(k_nope.dtype), k_nope, input_precision="ieee")
            else:
                pv = tl.dot(p.to(k_nope.dtype), k_nope)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        res, lse = online_softmax_finish(acc, m_i, l_i)
        o_ptrs = Out + split * stride_os + tok * stride_ot + heads[:, None] * stride_oh + offs_v[None, :] * stride_od
        tl.store(o_ptrs, res.to(Out.dtype.element_ty), mask=hmask[:, None] & vmask[None, :])
        tl.store(Lse + split * stride_ls + tok * stride_lt + heads * stride_lh, lse, mask=hmask)
    if PDL:  # the partial is stored: the merge may launch (it waits for this grid to complete)
        gdc_launch_dependents()
    if SPREAD != 0:
        _spread_merge(
            Out, Lse, FinalOut, FinalLse, count, gen, gen0, tok,
            pid_h * BLOCK_H, split,
            num_splits, H, pieces_per_head, stride_ot, stride_oh, stride_od, stride_os, stride_lt, stride_lh,
            stride_ls, stride_yt, stride_yh, stride_yd, stride_zt, stride_zh, SPREAD, DV, BLOCK_H, BLOCK_S, MERGE_C,
        )  # fmt: skip


@triton.jit
def _spread_merge(
    Out,
    Lse,
    FinalOut,
    FinalLse,
    Count,
    Gen,
    gen0,
    tok,
    head0,
    split,
    num_splits,
    H,
    pieces_per_head,
    stride_ot,
    stride_oh,
    stride_od,
    stride_os,
    stride_lt,
    stride_lh,
    stride_ls,
    stride_yt,
    stride_yh,
    stride_yd,
    stride_zt,
    stride_zh,
    SPREAD: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
    MERGE_C: tl.constexpr,
):
    """The spread merge of one program (module docstring): arrive at ``Count`` (``SPREAD`` 1 or 2;
    the last arrival resets it and bumps ``Gen``), wait until ``Gen`` is no longer ``gen0`` (1),
    merge pieces ``split, split + S, ...`` of the head block's ``BLOCK_H x pieces_per_head``
    (head, ``MERGE_C`` columns) pieces (1 or 3)."""
    if SPREAD != 3:  # arrive: every thread's partial stores precede the release
        tl.debug_barrier()
        arrived = tl.atomic_add(Count, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:  # the last: every partial is stored; open the barrier
            tl.atomic_xchg(Count, 0, sem="relaxed", scope="gpu")
            tl.atomic_add(Gen, 1, sem="release", scope="gpu")
        elif SPREAD == 1:
            while tl.atomic_add(Gen, 0, sem="acquire", scope="gpu") == gen0:
                pass
    if SPREAD != 2:  # merge this program's pieces
        offs_s = tl.arange(0, BLOCK_S)
        smask = offs_s < num_splits
        offs_c = tl.arange(0, MERGE_C)
        for piece in range(split, BLOCK_H * pieces_per_head, num_splits):
            head = head0 + piece // pieces_per_head
            if head < H:
                cols = (piece % pieces_per_head) * MERGE_C + offs_c
                cmask = cols < DV
                # .cg: the partials were written by other SMs; read them from L2, not a stale L1
                li = tl.load(
                    Lse + offs_s * stride_ls + tok * stride_lt + head * stride_lh,
                    mask=smask,
                    other=float("-inf"),
                    cache_modifier=".cg",
                )
                o_ptrs = Out + offs_s[:, None] * stride_os + tok * stride_ot + head * stride_oh
                o = tl.load(
                    o_ptrs + cols[None, :] * stride_od,
                    mask=smask[:, None] & cmask[None, :],
                    other=0.0,
                    cache_modifier=".cg",
                )
                res, lse = merge_partials_tile(li, o)
                y_ptrs = FinalOut + tok * stride_yt + head * stride_yh + cols * stride_yd
                tl.store(y_ptrs, res.to(FinalOut.dtype.element_ty), mask=cmask)
                if piece % pieces_per_head == 0:
                    tl.store(FinalLse + tok * stride_zt + head * stride_zh, lse)
