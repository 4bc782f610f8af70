"""The 8-warp Gluon sparse-MLA prefill kernel for Hopper (sm_90): the ``"pipelined"`` variant.

As fast as the Triton kernel; kept as the baseline the benchmarks time beside the routed,
warp-specialised kernels (:mod:`shardattn.kernels.sparse_mla_gluon_ws64`,
:mod:`shardattn.kernels.sparse_mla_gluon_ws`). Launched through
:func:`shardattn.kernels.sparse_mla_gluon.launch_gluon_attention` with its configuration.

A program owns one query token and ``BLOCK_H = 64`` heads (128 heads: two programs per query)
with two consumer warpgroups (8 warps). It walks the token's sorted, de-duplicated rows
(``union[t, :lens[t]]`` from :func:`shardattn.kernels.union.build_union` with ``G = 1``)
``BLOCK_N`` at a time:

* every KV row (``Dv + Dr`` bf16, 576 for DSA models) is gathered with ``cp.async`` into a
  ``STAGES``-deep shared-memory ring (nope ``[BLOCK_N, Dv]`` and rope ``[BLOCK_N, Dr]`` parts,
  128-byte swizzled), ``STAGES - 1`` tiles ahead of the tile being consumed;
* ``S = Q K^T`` and ``O += P V`` run on ``wgmma`` (``warpgroup_mma``) with Q held in shared
  memory for the whole loop; the two warpgroups split S by key columns and O by value columns
  (``[64, 256]`` fp32 accumulators each, 128 registers), P passes between them through shared
  memory;
* the fp32 online softmax is the library's (base 2, ``(0, -inf)`` for an empty row, sinks
  folded in after the loop), masked past ``lens[t]``.
"""

from __future__ import annotations

from shardattn.kernels.gluon_compat import HAS_GLUON
from shardattn.kernels.sparse_mla_gluon_ws import NOT_SPECIALIZED

#: Warps of a program (two consumer warpgroups).
NUM_WARPS = 8

if HAS_GLUON:
    from shardattn.kernels.gluon_compat import async_load as _async_load
    from shardattn.kernels.gluon_compat import (
        cp,
        fence_async_shared,
        gl,
        gluon,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from shardattn.kernels.gluon_compat import cta_barrier as _cta_barrier
    from shardattn.kernels.gluon_compat import nvmma_layout as _nvmma


if HAS_GLUON:

    @gluon.constexpr_function
    def _gather_layout(inner: int):
        """Blocked layout for ``[rows, inner]`` gathers: 16-byte vectors, a warp along one row."""
        tpc = min(32, inner // 8)
        return gl.BlockedLayout([1, 8], [32 // tpc, tpc], [NUM_WARPS, 1], [1, 0])

    @gluon.jit
    def _issue_tile(
        KV, u_base, n_len, stride_kvr, j, nope_ring, rope_ring,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr,
    ):  # fmt: skip
        """cp.async tile ``j`` of the row list into ring slot ``j % STAGES`` (zeros past ``n_len``)."""
        lv: gl.constexpr = _gather_layout(D_V)
        lr: gl.constexpr = _gather_layout(D_R)
        slot = j % STAGES
        n_v = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, lv))
        ok_v = n_v < n_len
        row_v = gl.load(u_base + n_v, mask=ok_v, other=0).to(gl.int64)
        dv = gl.arange(0, D_V, layout=gl.SliceLayout(0, lv))
        _async_load(nope_ring.index(slot), KV + row_v[:, None] * stride_kvr + dv[None, :], mask=ok_v[:, None])
        n_r = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, lr))
        ok_r = n_r < n_len
        row_r = gl.load(u_base + n_r, mask=ok_r, other=0).to(gl.int64)
        dr = gl.arange(0, D_R, layout=gl.SliceLayout(0, lr))
        _async_load(rope_ring.index(slot), KV + row_r[:, None] * stride_kvr + D_V + dr[None, :], mask=ok_r[:, None])
        cp.commit_group()

    @gluon.jit(do_not_specialize=NOT_SPECIALIZED)
    def _sparse_mla_gluon_fwd(
        Q, KV, UNION, LENS, SINKS, OUT, LSE,
        T, H, HB,
        stride_qb, stride_qt, stride_qh, stride_kvr, stride_ut,
        stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, stride_lh,
        qk_scale,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        D_V: gl.constexpr, D_R: gl.constexpr, HAS_SINK: gl.constexpr,
    ):  # fmt: skip
        BH: gl.constexpr = 64
        dtype: gl.constexpr = Q.dtype.element_ty
        t = gl.program_id(0).to(gl.int64)
        hb = gl.program_id(1)

        mma_s: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16]
        )
        mma_o: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D_V // 2, 16]
        )
        p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
        lv: gl.constexpr = _gather_layout(D_V)
        lr: gl.constexpr = _gather_layout(D_R)

        q_nope = gl.allocate_shared_memory(dtype, [BH, D_V], _nvmma(D_V, 16))
        q_rope = gl.allocate_shared_memory(dtype, [BH, D_R], _nvmma(D_R, 16))
        nope_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_V], _nvmma(D_V, 16))
        rope_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_R], _nvmma(D_R, 16))

        # Q tile (rows past H zero-filled), its own cp.async group
        h_v = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, lv))
        dv = gl.arange(0, D_V, layout=gl.SliceLayout(0, lv))
        row_v = t * stride_qt + (h_v // HB).to(gl.int64) * stride_qb + (h_v % HB).to(gl.int64) * stride_qh
        _async_load(q_nope, Q + row_v[:, None] + dv[None, :], mask=(h_v < H)[:, None])
        h_r = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, lr))
        dr = gl.arange(0, D_R, layout=gl.SliceLayout(0, lr))
        row_r = t * stride_qt + (h_r // HB).to(gl.int64) * stride_qb + (h_r % HB).to(gl.int64) * stride_qh
        _async_load(q_rope, Q + row_r[:, None] + D_V + dr[None, :], mask=(h_r < H)[:, None])
        cp.commit_group()

        n_len = gl.load(LENS + t)
        u_base = UNION + t * stride_ut
        for j0 in gl.static_range(STAGES - 1):
            _issue_tile(KV, u_base, n_len, stride_kvr, j0, nope_ring, rope_ring, BLOCK_N, STAGES, D_V, D_R)

        m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, mma_s))
        l_i = gl.zeros([BH], gl.float32, layout=gl.SliceLayout(1, mma_s))
        acc = gl.zeros([BH, D_V], gl.float32, layout=mma_o)
        s_zero = gl.zeros([BH, BLOCK_N], gl.float32, layout=mma_s)
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_s))
        n_tiles = gl.cdiv(n_len, BLOCK_N)
        for j in range(n_tiles):
            # slot (j - 1) % STAGES was consumed last iteration: every warp is past its wgmma
            _cta_barrier()
            _issue_tile(KV, u_base, n_len, stride_kvr, j + STAGES - 1, nope_ring, rope_ring, BLOCK_N, STAGES, D_V, D_R)
            cp.wait_group(STAGES - 1)
            _cta_barrier()
            fence_async_shared()
            slot = j % STAGES
            kn = nope_ring.index(slot)
            kr = rope_ring.index(slot)
            s = warpgroup_mma(q_nope, kn.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma(q_rope, kr.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            s = gl.where((j * BLOCK_N + cols < n_len)[None, :], s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=1))  # finite: a tile holds >= 1 valid key
            p = gl.exp2(s - m_new[:, None])
            alpha = gl.exp2(m_i - m_new)
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, mma_o))[:, None]
            pa = gl.convert_layout(p.to(dtype), p_op)
            acc = warpgroup_mma(pa, kn, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        cp.wait_group(0)

        h = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, mma_s))
        if HAS_SINK:
            sink = gl.load(SINKS + h, mask=h < H, other=0.0) * 1.4426950408889634
            m_f = gl.maximum(m_i, sink)
            alpha = gl.exp2(m_i - m_f)
            l_i = l_i * alpha + gl.exp2(sink - m_f)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, mma_o))[:, None]
            m_i = m_f
        has = l_i > 0.0
        l_safe = gl.where(has, l_i, 1.0)
        lse = gl.where(has, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        gl.store(LSE + t * stride_lt + (h // HB).to(gl.int64) * stride_lb + (h % HB) * stride_lh, lse, mask=h < H)
        out = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, mma_o))[:, None]
        h_o = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, mma_o))
        d_o = gl.arange(0, D_V, layout=gl.SliceLayout(0, mma_o))
        row_o = t * stride_ot + (h_o // HB).to(gl.int64) * stride_ob + (h_o % HB).to(gl.int64) * stride_oh
        o_ptr = OUT + row_o[:, None] + d_o[None, :]
        gl.store(o_ptr, out.to(dtype), mask=(h_o < H)[:, None])


def pipelined_kernel():
    """The 8-warp kernel; needs Gluon."""
    return _sparse_mla_gluon_fwd
