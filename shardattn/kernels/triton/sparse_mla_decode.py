"""The Triton split-KV kernel of sparse-MLA decode: the kernel, its launcher and its runner.

One program per (head block, token, split of the top-k row) runs the online softmax
(:mod:`~shardattn.kernels.triton.online_softmax`) over its slice of the row's KV rows and writes an
fp32 partial and LSE (or, with one split, the result); the LSE merge
(:mod:`~shardattn.kernels.triton.lse_merge`) combines the splits. The head blocks of a token are
the fastest grid axis, so they read the same rows while those are in L2. Splits write partial
outputs in fp32 (in q's 2-byte dtype under the row merge, which reads them all with few
programs: :func:`partials_dtype`). On sm_90 and newer the kernel and its merge are programmatic
dependent launches: the kernel waits for the grid before it (a union build, a caller's indexer)
and lets the merge launch once its partials are stored.

:func:`~shardattn.kernels.triton.sparse_mla_decode_config.decode_launch` shapes a launch
(:mod:`~shardattn.kernels.triton.sparse_mla_decode_config`), :func:`run_split_decode` runs one
(benchmarks shape theirs with their own ``num_splits`` / ``config``). The contract and the routing
live in :mod:`shardattn.ops.sparse_mla_decode`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardattn.kernels.backend import COMPILE_OPTIONS, pdl_supported, unit_stride
from shardattn.kernels.triton.lse_merge import (
    gdc_launch_dependents,
    gdc_wait,
    launch_lse_merge,
    launch_lse_merge_columns,
    split_partials,
)
from shardattn.kernels.triton.online_softmax import online_softmax_finish, online_softmax_step
from shardattn.kernels.triton.sparse_mla_decode_config import (
    DecodeLaunchConfig,
    partials_dtype,
)
from shardattn.kernels.triton.sparse_mla_fp8 import fp8_decode_loop, store_tiles

__all__ = ["launch_split_kernel", "run_split_decode"]

LOG2E = 1.4426950408889634


def run_split_decode(
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    *,
    scale: float,
    topk_length: torch.Tensor | None,
    sinks: torch.Tensor | None,
    out: torch.Tensor,
    lse_out: torch.Tensor,
    launch: DecodeLaunchConfig,
    workspace: torch.Tensor | None = None,
) -> None:
    """The split-KV kernel and the merge ``launch`` routes, into ``out`` / ``lse_out``.

    Validated tensors (:func:`~shardattn.ops.sparse_mla_decode.sparse_mla_decode` checks them and
    de-duplicates the rows first unless they are unique): ``q [T, H, D]``, ``kv [R, D]``,
    ``rows [T, K]`` int32, ``out [T, H, v_dim]``, ``lse_out [T, H]`` fp32, ``workspace`` an
    optional flat fp32 buffer of at least
    :func:`~shardattn.kernels.triton.lse_merge.split_partials_numel` elements for the partials.
    ``launch``: :func:`~shardattn.kernels.triton.sparse_mla_decode_config.decode_launch`'s for
    these shapes (benchmarks pass their own ``num_splits`` / ``config`` to it). Capture-safe: no
    host sync; the grid depends on shapes and the split count only.
    """
    t, h, _ = q.shape
    v_dim = out.shape[-1]
    splits = launch["num_splits"]
    if splits > 1:
        out_dtype = partials_dtype(q.dtype, launch["merge"], launch.get("partials", "auto"))
        dst_out, dst_lse = split_partials(workspace, splits, t, h, v_dim, q.device, out_dtype=out_dtype)
    else:
        dst_out, dst_lse = out, lse_out
    pdl = launch.get("pdl", True) and pdl_supported(q.device)
    launch_split_kernel(q, kv, rows, topk_length, sinks, dst_out, dst_lse, out, lse_out, launch, scale, pdl=pdl)
    if splits > 1:
        if launch.get("merge") == "columns":
            launch_lse_merge_columns(dst_out, dst_lse, out, lse_out, pdl=pdl)
        else:
            launch_lse_merge(dst_out, dst_lse, out, lse_out, pdl=pdl)


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
    cfg: DecodeLaunchConfig,
    scale: float,
    pdl: bool = False,
) -> None:
    """Launch ``_sparse_mla_decode_kernel`` on validated tensors (no checks, no allocation, no sync).

    Args:
        q ``[T, H, D]``, kv ``[R, D]`` in q's dtype or ``[R, 656]`` uint8 ``fp8_ds_mla`` rows
        (``D = 576``; dequantised in the kernel, :mod:`~shardattn.kernels.triton.sparse_mla_fp8`),
        rows ``[T, K]`` int32, topk_length ``[T]`` / sinks ``[H]`` or None.
        dst_out ``[S, T, H, Dv]`` (fp32 or q's dtype) / dst_lse ``[S, T, H]`` fp32 partials
        (``out`` / ``lse_out`` when ``cfg["num_splits"] == 1``); out ``[T, H, Dv]``, lse_out
        ``[T, H]``: the result (written by the kernel only with one split; else by the merge).
        cfg: :func:`sparse_mla_decode_config`'s dict.
        pdl: a programmatic dependent launch (only where
            :func:`~shardattn.kernels.backend.pdl_supported`): the kernel waits for the grid before
            it in the stream before reading anything, and lets the next one (a PDL merge) launch
            once every program has stored its partial. (Letting it launch when the programs
            start measured faster at 16 heads x 1-2 tokens and slower everywhere else:
            docs/PERFORMANCE.md.)
    """
    topk_length, sinks = unit_stride(topk_length), unit_stride(sinks)
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
    _sparse_mla_decode_kernel[grid](
        q,
        kv,
        rows,
        topk_length if topk_length is not None else rows,
        sinks if sinks is not None else q,
        dst_out,
        dst_lse,
        out,  # FinalOut, FinalLse, Counters: unused (the kernel's signature, see its docstring)
        lse_out,
        lse_out,
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
        1,  # pieces_per_head, gen_offset: unused
        0,
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
        PDL=pdl,
        KV_FP8=kv.dtype == torch.uint8,
        num_warps=cfg["num_warps"],
        num_stages=cfg.get("num_stages", 2),
        launch_pdl=pdl,
        **COMPILE_OPTIONS,
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
    PDL: tl.constexpr,
    KV_FP8: tl.constexpr = False,
):
    """One (head block, token, split): online softmax over rows ``[split*chunk, ...)`` of the top-k;
    with ``PDL`` it waits for the grid before it and lets the next one launch after its stores.

    ``FinalOut``, ``FinalLse``, ``Counters``, ``stride_y*``, ``stride_z*``, ``num_splits``,
    ``pieces_per_head`` and ``gen_offset`` are unused (they served a merge inside this kernel that
    was removed, docs/DECISIONS.md): they stay in the signature so the compiled kernel is the
    measured one (``tests/ptx_digests.json``); dropping them is a kernel change of its own.
    """
    tl.static_assert(BLOCK_H >= 16, "tl.dot needs at least 16 rows")
    tl.static_assert(
        not KV_FP8 or (DV == 512 and DR == 64 and BLOCK_DV == DV and BLOCK_DR == DR),
        "fp8_ds_mla rows hold 512 latent + 64 rope",
    )
    if PDL:  # the grid before this one (a union build, an indexer) wrote q / rows: wait for it
        gdc_wait()
    pid_h = tl.program_id(0)
    tok = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    if KV_FP8:  # fp8_ds_mla rows (uint8, stride_kvr bytes), dequantised a scale tile at a time
        _fp8_partial(
            Q, KV, Rows, TopkLen, Sinks, Out, Lse, tok, pid_h, split,
            stride_qt, stride_qh, stride_qd, stride_kvr, stride_rt, stride_rk, stride_ot, stride_oh, stride_od,
            stride_os, stride_lt, stride_lh, stride_ls, H, R, K, chunk, qk_scale,
            BLOCK_H, BLOCK_N, HAS_TOPK_LEN, HAS_SINKS, IEEE,
        )  # fmt: skip
    else:
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


@triton.jit
def _fp8_partial(
    Q, KV, Rows, TopkLen, Sinks, Out, Lse, tok, pid_h, split,
    stride_qt, stride_qh, stride_qd, stride_kvr, stride_rt, stride_rk, stride_ot, stride_oh, stride_od,
    stride_os, stride_lt, stride_lh, stride_ls, H, R, K, chunk, qk_scale,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HAS_TOPK_LEN: tl.constexpr, HAS_SINKS: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    """``_sparse_mla_decode_kernel``'s attention and partial for one (head block, token, split) on
    ``fp8_ds_mla`` rows: the bf16 path's split bounds and sink start, the key loop a scale tile at a
    time (:func:`~shardattn.kernels.triton.sparse_mla_fp8.fp8_decode_loop`), its stores."""
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
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
    acc0, acc1, acc2, acc3, m_i, l_i = fp8_decode_loop(
        Q + tok * stride_qt + heads[:, None] * stride_qh, stride_qd, hmask, KV, stride_kvr, Rows + tok * stride_rt,
        stride_rk, lo, hi, R, m_i, l_i, qk_scale, BLOCK_H, BLOCK_N, "ieee" if IEEE else "tf32",
    )  # fmt: skip
    o_base = Out + split * stride_os + tok * stride_ot + heads[:, None] * stride_oh
    lse = store_tiles(o_base, stride_od, hmask[:, None], acc0, acc1, acc2, acc3, m_i, l_i)
    tl.store(Lse + split * stride_ls + tok * stride_lt + heads * stride_lh, lse, mask=hmask)
