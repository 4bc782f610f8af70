"""The tile geometry and epilogue of the warp-specialised Gluon sparse-MLA kernel (sm_90).

A program of :mod:`shardattn.kernels.gluon.sparse_mla_kernel` owns a 64-row tile: ``G`` consecutive
query tokens (a group) times ``64 / G`` heads (``G = 1``: one token and 64 heads, 128 heads take
two programs per token; ``G = 2 / 4 / 8``: the grouped path for 32 / 16 / 8 heads). Here are
the tile's row geometry (:func:`_tile_rows`) and its epilogue: the sinks folded into the online
softmax's state, the LSE stored (``(0, -inf)`` for an empty row) and each consumer warpgroup's
half of the output columns stored through shared memory, 16 bytes a thread
(:func:`_ws_epilogue_staged`).

``q``, ``out`` and ``lse`` are addressed with (block, token, head) strides and ``HB`` heads per
block, so head-blocked ``[B, T, H/B, ...]`` buffers (an all-to-all buffer read or written in
place) run as they are: head ``h`` of token ``t`` sits at ``t * st + (h // HB) * sb + (h % HB) * sh``
(plain ``[T, H, ...]`` tensors: ``HB = H``, block 0).
"""

from __future__ import annotations

from shardattn.kernels.gluon.compat import HAS_GLUON

if HAS_GLUON:
    from shardattn.kernels.gluon.compat import cta_barrier as _cta_barrier
    from shardattn.kernels.gluon.compat import gl, gluon

#: Warps of the default partition; the two workers take 4 warps each. Registers per thread of the
#: kernel (``maxnreg``); the default partition gets what the workers' registers leave.
WS_NUM_WARPS = 4
WS_MAXNREG = 168

if HAS_GLUON:

    @gluon.jit
    def _tile_rows(g, hb, T, H, HB, G: gl.constexpr, lay: gl.constexpr):
        """Tile rows ``m`` (layout ``lay``): ``(token int64, head block int64, head in block, head,
        row is real)`` for query ``g * G + m // (64 / G)``, head ``hb * 64 / G + m % (64 / G)``."""
        HPB: gl.constexpr = 64 // G
        m = gl.arange(0, 64, layout=lay)
        t = g * G + m // HPB
        h = hb * HPB + m % HPB
        return t, (h // HB).to(gl.int64), h % HB, h, (t < T) & (h < H)

    @gluon.jit
    def _row_lse(m_i, l_i):
        """A finished row's ``(divisor, LSE)`` from its base-2 running max ``m_i`` and sum ``l_i``: the
        divisor is ``l_i`` (1 for a row with no key), the LSE natural-log (``-inf`` for a row with no key;
        a NaN sum, from a NaN logit, gives NaN). The Gluon kernels' one finish of the online softmax."""
        empty = l_i == 0.0
        l_safe = gl.where(empty, 1.0, l_i)
        return l_safe, gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)

    @gluon.jit
    def _ws_finish(acc, m_i, l_i, out_args, W: gl.constexpr, HAS_SINK: gl.constexpr, G: gl.constexpr):
        """Folds the sinks in, stores the LSE (warpgroup 0) and returns the normalised output tile
        (fp32, ``acc``'s layout); an empty row gives 0 and ``-inf``."""
        (_OUT, LSE, SINKS, g, hb, T, H, HB, _sob, _sot, _soh, stride_lb, stride_lt, stride_lh) = out_args
        row_l: gl.constexpr = m_i.type.layout
        acc_l: gl.constexpr = acc.type.layout
        t, hblk, hin, h, ok = _tile_rows(g, hb, T, H, HB, G, row_l)
        if HAS_SINK:
            sink = gl.load(SINKS + h, mask=h < H, other=0.0) * 1.4426950408889634
            m_f = gl.maximum(m_i, sink)
            alpha = gl.exp2(m_i - m_f)
            l_i = l_i * alpha + gl.exp2(sink - m_f)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc_l))[:, None]
            m_i = m_f
        l_safe, lse = _row_lse(m_i, l_i)
        if W == 0:
            gl.store(LSE + t * stride_lt + hblk * stride_lb + hin * stride_lh, lse, mask=ok)
        return acc / gl.convert_layout(l_safe, gl.SliceLayout(1, acc_l))[:, None]

    @gluon.jit
    def _out_ptrs(out_args, W: gl.constexpr, D_V: gl.constexpr, G: gl.constexpr, rows_l: gl.constexpr,
                  cols_l: gl.constexpr):  # fmt: skip
        """Pointers ``[64, D_V / 2]`` to warpgroup ``W``'s output columns of the tile, and the mask of
        its rows that exist, in the layout whose row / column slices are ``rows_l`` / ``cols_l`` (the
        slices, not the layout: Triton 3.6 passes no wgmma layout to a function)."""
        (OUT, _LSE, _SINKS, g, hb, T, H, HB, stride_ob, stride_ot, stride_oh, _slb, _slt, _slh) = out_args
        HALF: gl.constexpr = D_V // 2
        t_o, hblk_o, hin_o, _h_o, ok_o = _tile_rows(g, hb, T, H, HB, G, rows_l)
        d_o = W * HALF + gl.arange(0, HALF, layout=cols_l)
        row_o = t_o * stride_ot + hblk_o * stride_ob + hin_o.to(gl.int64) * stride_oh
        return OUT + row_o[:, None] + d_o[None, :], ok_o[:, None]

    @gluon.jit
    def _store_from_registers(out, out_args, W: gl.constexpr, D_V: gl.constexpr, G: gl.constexpr):
        """Stores warpgroup ``W``'s output columns ``out`` (fp32) in the layout they are in."""
        lay: gl.constexpr = out.type.layout
        ptrs, ok = _out_ptrs(out_args, W, D_V, G, gl.SliceLayout(1, lay), gl.SliceLayout(0, lay))
        gl.store(ptrs, out.to(ptrs.dtype.element_ty), mask=ok)

    @gluon.jit
    def _ws_epilogue_staged(acc, m_i, l_i, out_args, stage, W: gl.constexpr, D_V: gl.constexpr,
                            HAS_SINK: gl.constexpr, G: gl.constexpr):  # fmt: skip
        """:func:`_ws_epilogue` through ``stage``, a free ``[64, D_V / 2]`` shared-memory tile of the
        output's dtype that only this warpgroup touches now. The accumulator layout holds 4 bytes
        of a row per thread, so a direct store writes each 32-byte sector in two halves; read back
        from shared memory, each thread stores 16 bytes and a warp two whole rows. With another
        output dtype (fp32 partials) it stores as :func:`_ws_epilogue` does."""
        out = _ws_finish(acc, m_i, l_i, out_args, W, HAS_SINK, G)
        if out_args[0].dtype.element_ty == stage.dtype:
            stage.store(out.to(stage.dtype))
            _cta_barrier()  # this warpgroup's 128 threads (a named barrier inside a partition)
            lay: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
            ptrs, ok = _out_ptrs(out_args, W, D_V, G, gl.SliceLayout(1, lay), gl.SliceLayout(0, lay))
            gl.store(ptrs, stage.load(lay), mask=ok)
        else:
            _store_from_registers(out, out_args, W, D_V, G)
