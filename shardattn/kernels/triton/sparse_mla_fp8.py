"""The key loops of the Triton sparse-MLA kernels on ``fp8_ds_mla`` rows, by scale tile.

A bf16 kernel gathers a step's ``[BLOCK_N, 512]`` latent tile straight into shared memory
(``cp.async``) for ``Q.K^T`` and ``P.V``. An FP8 kernel must dequantise the tile in registers first;
done whole, the ``[BLOCK_N, 512]`` values (64 registers a thread at 64 keys and 8 warps) sit beside
the fp32 accumulator and ptxas spills. So here the latent is worked in its four 128-column scale
tiles: ``S = Q.K^T`` as four dots chained over the tiles (``k``-steps in the bf16 kernel's order,
then the rope's as the bf16 kernel adds it), ``P.V`` into four ``[rows, 128]`` accumulators; each
tile's values are dequantised (:func:`~shardattn.kernels.triton.kv_fp8_read.load_fp8_tile`) when a
dot needs them. The codes load to registers (their first use is a conversion, so Triton's pipeline
does not stage them in shared memory as it does a bf16 tile): the decode loop fetches the next
block's codes while it computes this one's (up to 32 heads). Every output element sees the same
products as in the bf16 kernel on :func:`~shardattn.ops.kv_fp8.dequantize_kv`'s rows, but Triton
schedules the split dots' fp32 accumulation differently, so a score (and so a rounding of P) may
differ in its last bits: on the GPU the outputs are as close to fp64 as the bf16 kernel's, not
equal bit for bit (the Gluon kernels' are). The online softmax is :mod:`~shardattn.kernels.triton.online_softmax`'s.
"""

from __future__ import annotations

import triton
import triton.language as tl

from shardattn.kernels.triton.kv_fp8_read import dequant_fp8, load_fp8_codes, load_fp8_rope, load_fp8_tile
from shardattn.kernels.triton.online_softmax import online_softmax_finish, online_softmax_step


@triton.jit
def _dot(a, b, acc, PREC: tl.constexpr):
    return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def load_q_tiles(q_base, mask, stride_d):
    """``q``'s latent as four ``[M, 128]`` tiles and its rope ``[M, 64]`` (``q_base [M, 1]``
    pointers to each row's first column, ``stride_d`` between columns; rows where ``mask [M, 1]``
    is false read 0)."""
    c = tl.arange(0, 128)[None, :]
    q0 = tl.load(q_base + c * stride_d, mask=mask, other=0.0)
    q1 = tl.load(q_base + (128 + c) * stride_d, mask=mask, other=0.0)
    q2 = tl.load(q_base + (256 + c) * stride_d, mask=mask, other=0.0)
    q3 = tl.load(q_base + (384 + c) * stride_d, mask=mask, other=0.0)
    q_rope = tl.load(q_base + (512 + tl.arange(0, 64)[None, :]) * stride_d, mask=mask, other=0.0)
    return q0, q1, q2, q3, q_rope


@triton.jit
def fp8_prefill_loop(q_base, q_ok, KV, stride_kvr, u_base, n_len, qj, qk_scale, M: tl.constexpr,
                     G: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """The prefill kernel's key loop on FP8 rows (its bf16 loop's steps: union entries ``BLOCK_N``
    at a time, membership bits when ``G > 1``, the rope dot chained after the latent's, ``acc``
    rescaled then accumulated by the dot); returns ``(acc0, acc1, acc2, acc3, m_i, l_i)``."""
    q0, q1, q2, q3, q_rope = load_q_tiles(q_base, q_ok, 1)
    dt: tl.constexpr = q0.dtype
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc0 = tl.zeros([M, 128], tl.float32)
    acc1 = tl.zeros([M, 128], tl.float32)
    acc2 = tl.zeros([M, 128], tl.float32)
    acc3 = tl.zeros([M, 128], tl.float32)
    for n0 in range(0, n_len, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_len
        e = tl.load(u_base + offs_n, mask=n_ok, other=0)
        if G > 1:
            kv_row = (e & 0xFFFFFF).to(tl.int64)
        else:
            kv_row = e.to(tl.int64)
        row = KV + kv_row * stride_kvr
        k0 = load_fp8_tile(row, n_ok, 0, dt)
        k1 = load_fp8_tile(row, n_ok, 1, dt)
        k2 = load_fp8_tile(row, n_ok, 2, dt)
        k3 = load_fp8_tile(row, n_ok, 3, dt)
        s = tl.dot(q0, tl.trans(k0), input_precision=PREC)
        s = _dot(q1, tl.trans(k1), s, PREC)
        s = _dot(q2, tl.trans(k2), s, PREC)
        s = _dot(q3, tl.trans(k3), s, PREC)
        s = _dot(q_rope, tl.trans(load_fp8_rope(row, n_ok, dt)), s, PREC)
        if G > 1:
            bits = (e >> 24) & 0xFF
            member = (((bits[None, :] >> qj[:, None]) & 1) != 0) & n_ok[None, :]
        else:
            member = (qj[:, None] >= 0) & n_ok[None, :]
        s = tl.where(member, s * qk_scale, float("-inf"))
        p, alpha, m_new, l_i = online_softmax_step(s, m_i, l_i)
        p = p.to(dt)
        acc0 = _dot(p, k0, acc0 * alpha[:, None], PREC)
        acc1 = _dot(p, k1, acc1 * alpha[:, None], PREC)
        acc2 = _dot(p, k2, acc2 * alpha[:, None], PREC)
        acc3 = _dot(p, k3, acc3 * alpha[:, None], PREC)
        m_i = m_new
    return acc0, acc1, acc2, acc3, m_i, l_i


@triton.jit
def _entries(Rows, stride_rk, n0, hi, BLOCK_N: tl.constexpr):
    """Entries ``[n0, n0 + BLOCK_N)`` of a token's row list ``Rows``; -1 at and past ``hi``."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    return tl.load(Rows + offs_n * stride_rk, mask=offs_n < hi, other=-1)


@triton.jit
def _block_codes(KV, stride_kvr, r, R):
    """A key block's rows ``r [N]`` (entries outside ``[0, R)`` no key) as byte pointers, which are
    keys, and their four scale tiles' codes and scales (:func:`load_fp8_codes`, as stored)."""
    valid = (r >= 0) & (r < R)
    row = KV + tl.where(valid, r, 0).to(tl.int64) * stride_kvr
    c0, s0 = load_fp8_codes(row, valid, 0)
    c1, s1 = load_fp8_codes(row, valid, 1)
    c2, s2 = load_fp8_codes(row, valid, 2)
    c3, s3 = load_fp8_codes(row, valid, 3)
    return row, valid, c0, c1, c2, c3, s0, s1, s2, s3


@triton.jit
def fp8_decode_loop(q_base, stride_qd, hmask, KV, stride_kvr, Rows, stride_rk, lo, hi, R, m_i, l_i, qk_scale,
                    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """The split decode kernel's key loop on FP8 rows (its bf16 loop's steps: rows ``[lo, hi)`` of
    the token's list ``Rows`` (already offset to the token), entries outside ``[0, R)`` no key, the
    rope dot added to the latent's, ``acc = acc * alpha + P.V``), from the running ``(m_i, l_i)``;
    returns ``(acc0, acc1, acc2, acc3, m_i, l_i)``.

    The codes go to registers, not through the pipeline's shared memory (their first use is a
    conversion, not a dot). Up to 32 heads the loop prefetches by hand: while block ``i`` is
    computed, block ``i + 1``'s codes and block ``i + 2``'s entries are in flight (a block past
    ``hi`` loads nothing). At 64 heads the accumulators leave no registers for a second block's
    codes (ptxas spilled 1.7 KB): each block's codes load at its step.
    """
    PREFETCH: tl.constexpr = BLOCK_H <= 32
    q0, q1, q2, q3, q_rope = load_q_tiles(q_base, hmask[:, None], stride_qd)
    dt: tl.constexpr = q0.dtype
    acc0 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc1 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc2 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc3 = tl.zeros([BLOCK_H, 128], tl.float32)
    if PREFETCH:
        first = _entries(Rows, stride_rk, lo, hi, BLOCK_N)
        row, valid, c0, c1, c2, c3, s0, s1, s2, s3 = _block_codes(KV, stride_kvr, first, R)
        r_next = _entries(Rows, stride_rk, lo + BLOCK_N, hi, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        if PREFETCH:
            row_n, valid_n, c0_n, c1_n, c2_n, c3_n, s0_n, s1_n, s2_n, s3_n = _block_codes(KV, stride_kvr, r_next, R)
            r_next = _entries(Rows, stride_rk, n0 + 2 * BLOCK_N, hi, BLOCK_N)
        else:
            here = _entries(Rows, stride_rk, n0, hi, BLOCK_N)
            row, valid, c0, c1, c2, c3, s0, s1, s2, s3 = _block_codes(KV, stride_kvr, here, R)
        k0 = dequant_fp8(c0, s0, dt)
        k1 = dequant_fp8(c1, s1, dt)
        k2 = dequant_fp8(c2, s2, dt)
        k3 = dequant_fp8(c3, s3, dt)
        s = tl.dot(q0, tl.trans(k0), input_precision=PREC)
        s = _dot(q1, tl.trans(k1), s, PREC)
        s = _dot(q2, tl.trans(k2), s, PREC)
        s = _dot(q3, tl.trans(k3), s, PREC)
        s += tl.dot(q_rope, tl.trans(load_fp8_rope(row, valid, dt)), input_precision=PREC)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        p, alpha, m_new, l_i = online_softmax_step(s, m_i, l_i)
        p = p.to(dt)
        acc0 = acc0 * alpha[:, None] + tl.dot(p, k0, input_precision=PREC)
        acc1 = acc1 * alpha[:, None] + tl.dot(p, k1, input_precision=PREC)
        acc2 = acc2 * alpha[:, None] + tl.dot(p, k2, input_precision=PREC)
        acc3 = acc3 * alpha[:, None] + tl.dot(p, k3, input_precision=PREC)
        m_i = m_new
        if PREFETCH:
            row, valid, c0, c1, c2, c3 = row_n, valid_n, c0_n, c1_n, c2_n, c3_n
            s0, s1, s2, s3 = s0_n, s1_n, s2_n, s3_n
    return acc0, acc1, acc2, acc3, m_i, l_i


@triton.jit
def store_tiles(o_base, stride_d, mask, acc0, acc1, acc2, acc3, m_i, l_i):
    """Normalise the four ``[M, 128]`` accumulators (:func:`online_softmax_finish`) and store them
    at ``o_base [M, 1]`` (``stride_d`` between columns) in its element type where ``mask [M, 1]``;
    returns the LSE."""
    c = tl.arange(0, 128)[None, :] * stride_d
    dt: tl.constexpr = o_base.dtype.element_ty
    out, lse = online_softmax_finish(acc0, m_i, l_i)
    tl.store(o_base + c, out.to(dt), mask=mask)
    out, lse = online_softmax_finish(acc1, m_i, l_i)
    tl.store(o_base + 128 * stride_d + c, out.to(dt), mask=mask)
    out, lse = online_softmax_finish(acc2, m_i, l_i)
    tl.store(o_base + 256 * stride_d + c, out.to(dt), mask=mask)
    out, lse = online_softmax_finish(acc3, m_i, l_i)
    tl.store(o_base + 384 * stride_d + c, out.to(dt), mask=mask)
    return lse
