"""Triton sparse-MLA forward over union lists: one kernel for the per-query and grouped paths.

A program owns one tile of ``BLOCK_M = G * BLOCK_H`` rows: ``G`` consecutive query tokens (a
group) times ``BLOCK_H`` heads (``program_id(1)`` picks the head block). It walks the group's
union (``union[g, :lens[g]]``, from :mod:`shardattn.ops.union`) ``BLOCK_N`` entries at a time,
gathers those KV rows once for the whole tile, masks each tile row's non-member keys through
its query's membership bit (``G > 1``; with ``G = 1`` every listed row is a member), and keeps an
fp32 online softmax (``m_i, l_i, acc``, base 2). Outputs follow :func:`sparse_mla_attention`:
``out [T, H, Dv]`` in q's dtype, ``lse [T, H]`` fp32 natural log, an empty row ``(0, -inf)``;
sinks add one logit per head.

Shapes: ``q [T, H, Dv + Dr]``, ``kv [R, Dv + Dr]`` with ``Dv`` and ``Dr`` powers of two >= 16
(512 + 64 for DSA models; tests use 32 + 16). :func:`kernel_unsupported_reason` says whether a shape runs.

The per-query path (:func:`~shardattn.ops.sparse_mla.sparse_mla_per_query`) is this kernel with
``G = 1`` over each query's sorted, de-duplicated rows (so a row listed twice is one key, as in the grouped path and
the reference); it has no 24-bit row limit and serves any head count (128 heads: two 64-row
programs per query).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardattn._ints import next_pow2
from shardattn.kernels.backend import COMPILE_OPTIONS, unit_stride
from shardattn.kernels.union_layout import num_groups

try:
    import triton
    import triton.language as tl

    from shardattn.kernels.triton.online_softmax import online_softmax_finish, online_softmax_step
    from shardattn.kernels.triton.sparse_mla_fp8 import fp8_prefill_loop, store_tiles
except ImportError:  # the torch reference still works
    triton = None

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class TileConfig:
    """Compile-time shape of one attention launch (part of the warm-up key)."""

    group_size: int
    block_h: int
    block_n: int
    num_warps: int
    num_stages: int

    @property
    def block_m(self) -> int:
        return self.group_size * self.block_h


def tile_config(heads: int, group_size: int, *, interpret: bool = False) -> TileConfig:
    """The tile for ``heads`` heads per query and ``G`` queries per tile.

    ``BLOCK_H = min(next_pow2(H), 64 // G)`` (at least ``16 // G`` so a tile has 16 rows), so a
    program holds at most 64 rows (the anchor: 128 rows in one Triton program spill registers).
    """
    block_h = max(min(next_pow2(heads), max(64 // group_size, 1)), max(16 // group_size, 1))
    if interpret:
        return TileConfig(group_size, block_h, 16, 4, 1)
    block_m = group_size * block_h
    return TileConfig(group_size, block_h, 64, 8 if block_m >= 64 else 4, 2)


def kernel_unsupported_reason(q: torch.Tensor, kv: torch.Tensor, v_dim: int) -> str | None:
    """``None`` when the Triton kernel runs these shapes/dtypes, else the reason it does not."""
    d = q.shape[-1]
    d_rope = d - v_dim
    for name, n in (("v_dim", v_dim), ("rope dim (D - v_dim)", d_rope)):
        if n < 16 or n & (n - 1):
            return f"{name} = {n} is not a power of two >= 16"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {q.dtype} unsupported"
    if q.stride(-1) != 1 or kv.stride(-1) != 1:
        return "q and kv need a unit last-dim stride"
    return None


if triton is not None:

    @triton.jit(do_not_specialize=["T"])
    def _sparse_mla_fwd_kernel(
        Q, KV, UNION, LENS, SINKS, OUT, LSE,
        T, H, HB,
        stride_qt, stride_qh, stride_kvr, stride_ug, stride_ot, stride_oh, stride_lt, stride_lh,
        stride_qb, stride_ob, stride_lb,
        qk_scale,
        G: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
        D_V: tl.constexpr, D_R: tl.constexpr, HAS_SINK: tl.constexpr, IEEE: tl.constexpr,
        KV_FP8: tl.constexpr = False,
    ):  # fmt: skip
        BLOCK_M: tl.constexpr = G * BLOCK_H
        tl.static_assert(BLOCK_M >= 16, "tl.dot needs at least 16 rows")
        tl.static_assert(G <= 8, "the membership byte holds 8 queries")
        tl.static_assert(not KV_FP8 or (D_V == 512 and D_R == 64), "fp8_ds_mla rows hold 512 latent + 64 rope")
        PREC: tl.constexpr = "ieee" if IEEE else "tf32"
        g = tl.program_id(0).to(tl.int64)
        hb = tl.program_id(1)
        m = tl.arange(0, BLOCK_M)
        qj = m // BLOCK_H  # query of the group this tile row belongs to
        h = hb * BLOCK_H + m % BLOCK_H
        t = g * G + qj
        row_ok = (t < T) & (h < H)
        hblk = h // HB  # head block (the source rank of a head-blocked q) and head within it
        hin = h % HB
        if KV_FP8:  # fp8_ds_mla rows (uint8, stride_kvr bytes), dequantised a scale tile at a time
            q_base = Q + t[:, None] * stride_qt + hblk[:, None] * stride_qb + hin[:, None] * stride_qh
            acc0, acc1, acc2, acc3, m_i, l_i = fp8_prefill_loop(
                q_base, row_ok[:, None], KV, stride_kvr, UNION + g * stride_ug, tl.load(LENS + g), qj, qk_scale,
                BLOCK_M, G, BLOCK_N, PREC,
            )  # fmt: skip
            if HAS_SINK:
                sink = tl.load(SINKS + h, mask=h < H, other=0.0) * 1.4426950408889634
                m_f = tl.maximum(m_i, sink)
                alpha = tl.math.exp2(m_i - m_f)
                l_i = l_i * alpha + tl.math.exp2(sink - m_f)
                acc0 = acc0 * alpha[:, None]
                acc1 = acc1 * alpha[:, None]
                acc2 = acc2 * alpha[:, None]
                acc3 = acc3 * alpha[:, None]
                m_i = m_f
            o_base = OUT + t[:, None] * stride_ot + hblk[:, None] * stride_ob + hin[:, None] * stride_oh
            lse = store_tiles(o_base, 1, row_ok[:, None], acc0, acc1, acc2, acc3, m_i, l_i)
            tl.store(LSE + t * stride_lt + hblk * stride_lb + hin * stride_lh, lse, mask=row_ok)
        else:
            dv = tl.arange(0, D_V)
            dr = tl.arange(0, D_R)
            q_base = Q + t[:, None] * stride_qt + hblk[:, None] * stride_qb + hin[:, None] * stride_qh
            q_nope = tl.load(q_base + dv[None, :], mask=row_ok[:, None], other=0.0)
            q_rope = tl.load(q_base + D_V + dr[None, :], mask=row_ok[:, None], other=0.0)

            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, D_V], tl.float32)
            n_len = tl.load(LENS + g)
            u_base = UNION + g * stride_ug
            for n0 in range(0, n_len, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                n_ok = offs_n < n_len
                e = tl.load(u_base + offs_n, mask=n_ok, other=0)
                if G > 1:
                    kv_row = (e & 0xFFFFFF).to(tl.int64)
                else:
                    kv_row = e.to(tl.int64)
                kv_base = KV + kv_row[:, None] * stride_kvr
                k_nope = tl.load(kv_base + dv[None, :], mask=n_ok[:, None], other=0.0)
                k_rope = tl.load(kv_base + D_V + dr[None, :], mask=n_ok[:, None], other=0.0)
                s = tl.dot(q_nope, tl.trans(k_nope), input_precision=PREC)
                s = tl.dot(q_rope, tl.trans(k_rope), s, input_precision=PREC)
                if G > 1:
                    bits = (e >> 24) & 0xFF
                    member = (((bits[None, :] >> qj[:, None]) & 1) != 0) & n_ok[None, :]
                else:
                    member = (qj[:, None] >= 0) & n_ok[None, :]
                s = tl.where(member, s * qk_scale, float("-inf"))
                p, alpha, m_new, l_i = online_softmax_step(s, m_i, l_i)
                acc = acc * alpha[:, None]
                acc = tl.dot(p.to(k_nope.dtype), k_nope, acc, input_precision=PREC)
                m_i = m_new

            if HAS_SINK:
                sink = tl.load(SINKS + h, mask=h < H, other=0.0) * 1.4426950408889634
                m_f = tl.maximum(m_i, sink)
                alpha = tl.math.exp2(m_i - m_f)
                l_i = l_i * alpha + tl.math.exp2(sink - m_f)
                acc = acc * alpha[:, None]
                m_i = m_f
            out, lse = online_softmax_finish(acc, m_i, l_i)
            o_ptr = OUT + t[:, None] * stride_ot + hblk[:, None] * stride_ob + hin[:, None] * stride_oh + dv[None, :]
            tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=row_ok[:, None])
            tl.store(LSE + t * stride_lt + hblk * stride_lb + hin * stride_lh, lse, mask=row_ok)


def attention_kernel():
    """The Triton attention kernel (for warm-up and compile counting); needs Triton."""
    return _sparse_mla_fwd_kernel


def head_block_strides(x: torch.Tensor, blocked: bool, heads_per_block: int) -> tuple[int, int, int]:
    """``(stride_block, stride_token, stride_head)`` of ``x``: head-blocked ``[B, T, H/B, ...]`` or
    plain ``[T, H, ...]`` (whose block stride is ``heads_per_block`` head strides)."""
    if blocked:
        return x.stride(0), x.stride(1), x.stride(2)
    return heads_per_block * x.stride(1), x.stride(0), x.stride(1)


def heads_per_block(h: int, **blocked: torch.Tensor | None) -> int:
    """Heads per block shared by the head-blocked tensors among ``blocked`` (``h`` when none is)."""
    sizes = {name: x.shape[2] for name, x in blocked.items() if x is not None}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"head-blocked tensors must have the same heads per block, got {sizes}")
    return next(iter(sizes.values()), h)


def launch_destinations(
    q: torch.Tensor, v_dim: int, out: torch.Tensor | None, lse: torch.Tensor | None
) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """``(T, H, out, lse)`` of an attention launch on ``q`` (plain ``[T, H, D]`` or head-blocked
    ``[B, T, H/B, D]``): the given destinations, or new ``[T, H, v_dim]`` q.dtype / ``[T, H]`` fp32."""
    t = q.shape[-3]
    h = q.shape[0] * q.shape[2] if q.dim() == 4 else q.shape[1]
    if out is None:
        out = torch.empty(t, h, v_dim, dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(t, h, dtype=torch.float32, device=q.device)
    return t, h, out, lse


def launch_strides(
    h: int, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
) -> tuple[int, tuple[int, int, int], tuple[int, int, int], tuple[int, int, int]]:
    """``(heads per block, q's, out's and lse's (block, token, head) strides)`` of a launch whose
    ``q`` / ``out`` / ``lse`` may each be head-blocked (one more leading dim than plain)."""
    q_blk, o_blk, l_blk = q.dim() == 4, out.dim() == 4, lse.dim() == 3
    hb = heads_per_block(h, q=q if q_blk else None, out=out if o_blk else None, lse=lse if l_blk else None)
    return (
        hb,
        head_block_strides(q, q_blk, hb),
        head_block_strides(out, o_blk, hb),
        head_block_strides(lse, l_blk, hb),
    )


def launch_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    union: torch.Tensor,
    lens: torch.Tensor,
    *,
    scale: float,
    v_dim: int,
    config: TileConfig,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the attention kernel on prepared unions (inputs already validated).

    ``q``, ``out`` and ``lse`` may each be *head-blocked*: ``[B, T, H/B, ...]`` holds head
    ``b * H/B + i`` of token ``t`` at ``[b, t, i]`` (an all-to-all receive or send buffer, read or
    written in place with strides); otherwise ``[T, H, ...]``. Any strides, unit last-dim stride.

    Args:
        q: ``[T, H, D]`` or ``[B, T, H/B, D]``; kv: ``[R, D]`` in q's dtype, or ``[R, 656]`` uint8
            ``fp8_ds_mla`` rows (``D = 576``; dequantised in the kernel,
            :mod:`~shardattn.kernels.triton.kv_fp8_read`); union: ``[ceil(T/G), W]`` int32;
            lens: ``[ceil(T/G)]``.
        config: :func:`tile_config` for ``(H, G)``.
        out / lse: optional destinations ``[T, H, v_dim]`` / ``[T, H]`` (or head-blocked
            ``[B', T, H/B', v_dim]`` / ``[B', T, H/B']``), q's dtype / fp32.
    Returns:
        ``(out, lse)``: the given destinations, or new ``[T, H, v_dim]`` q.dtype and ``[T, H]`` fp32.
    """
    d = q.shape[-1]
    lens, sinks = unit_stride(lens), unit_stride(sinks)
    t, h, out, lse = launch_destinations(q, v_dim, out, lse)
    if t == 0 or h == 0:
        return out, lse
    hb, (qb, qt, qh), (ob, ot, oh), (lb, lt, lh) = launch_strides(h, q, out, lse)
    grid = (num_groups(t, config.group_size), triton.cdiv(h, config.block_h))
    _sparse_mla_fwd_kernel[grid](
        q, kv, union, lens, sinks if sinks is not None else lse, out, lse,
        t, h, hb,
        qt, qh, kv.stride(0), union.stride(0), ot, oh, lt, lh,
        qb, ob, lb,
        scale * LOG2E,
        G=config.group_size, BLOCK_H=config.block_h, BLOCK_N=config.block_n,
        D_V=v_dim, D_R=d - v_dim, HAS_SINK=sinks is not None, IEEE=q.dtype == torch.float32,
        KV_FP8=kv.dtype == torch.uint8,
        num_warps=config.num_warps, num_stages=config.num_stages, **COMPILE_OPTIONS,
    )  # fmt: skip
    return out, lse


__all__ = [
    "TileConfig",
    "attention_kernel",
    "kernel_unsupported_reason",
    "launch_attention",
    "tile_config",
]
