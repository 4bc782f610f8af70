"""The streaming sparse-MLA decode kernel (sm_90, Gluon): persistent programs that walk their
(token, slice) tiles 64 rows at a time through a ``cp.async`` ring, ``S^T = K Q^T`` and
``O^T = V^T P^T`` on ``wgmma`` with the heads as N. What it computes and why it is shaped so, its
plan and launcher: :mod:`shardattn.kernels.gluon.sparse_mla_decode_stream`.
"""

from __future__ import annotations

from shardattn.kernels.gluon.compat import HAS_GLUON
from shardattn.kernels.triton.kv_fp8_read import ROPE_OFFSET, SCALE_OFFSET

__all__ = ["NOT_SPECIALIZED"]

#: Launch arguments never specialised: the token count, top-k and cache rows, the plan's blocks and
#: programs, and the strides that follow them (a row list's, a partial LSE's slice), so that every
#: batch a step may run uses the kernel its warm-up compiled (Triton otherwise compiles one variant
#: per class of an int argument's value: 1, a multiple of 16, any other). The slice count ``S``
#: stays specialised: on ``fp8_ds_mla`` rows the kernel unspecialised on it ran 1.07-1.24x longer
#: at one slice (docs/DECISIONS.md, D59); the warm-up runs every slice count a plan can take.
NOT_SPECIALIZED = ["T", "K", "R", "NB", "n_prog", "stride_rt", "stride_ls"]

if HAS_GLUON:
    from shardattn.kernels.gluon.compat import (
        async_load,
        cp,
        cta_barrier,
        fence_async_shared,
        gl,
        gluon,
        grid_dependency,
        nvmma_layout,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from shardattn.kernels.gluon.e4m3 import e4m3_times_bf16
    from shardattn.kernels.gluon.sparse_mla_decode_small_kernel import (
        _acc_layout,
        _gather_layout,
        _latent_layout,
        _p_operand,
    )
    from shardattn.kernels.gluon.sparse_mla_epilogue import _row_lse

    FP8_SCALE_OFFSET = gl.constexpr(SCALE_OFFSET)
    FP8_ROPE_OFFSET = gl.constexpr(ROPE_OFFSET)
    #: Latent columns of one dequantised chunk (one fp8 scale tile).
    CW = gl.constexpr(128)

    @gluon.constexpr_function
    def _codes_layout():
        """``[64, 512]`` fp8 codes as they are gathered: 16 bytes a thread, a warp across a row."""
        return gl.BlockedLayout([1, 16], [1, 32], [4, 1], [1, 0])

    @gluon.constexpr_function
    def _scales_layout():
        """One scale tile's ``[64]`` fp32 scales as they are gathered (4-byte copies, a lane per row;
        the warps repeat them)."""
        return gl.BlockedLayout([1], [32], [4], [0])

    @gluon.constexpr_function
    def _rope_layout():
        """``[*, 64]`` bf16 rope columns: 16 bytes a thread, 8 threads across a row."""
        return gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

    @gluon.jit
    def _tile_of(c, pid, n_prog, S, NB):
        """``(i, b, t, s)`` of the program's block ``c``: its ``i``-th tile (tile ``pid + i * n_prog``,
        token ``t``, slice ``s``) and the block's place ``b`` in it."""
        i = c // NB
        b = c - i * NB
        u = pid + i * n_prog
        t = u // S
        return i, b, t, u - t * S

    @gluon.constexpr_function
    def _ids_layout():
        """A block's 64 entries as prefetched: one a thread (the warps repeat them)."""
        return gl.BlockedLayout([1], [32], [4], [0])

    @gluon.jit
    def _block_ids(c, n_blocks, pid, n_prog, S, NB, T, Rows, TopkLen, stride_rt, stride_rk, K,
                   HAS_TOPK_LEN: gl.constexpr):  # fmt: skip
        """The program's block ``c``'s 64 entries ``[64]`` int32 as loaded: the caller's entry, or -1
        past the top-k, ``K`` or ``topk_length`` or with ``c`` past the program's last block (an entry
        outside ``[0, R)`` is masked where :func:`_issue` stores them). Loaded an iteration before
        their block is issued and not read until then, so the load's latency hides behind that
        iteration's work (a mask applied here waits for the load at once)."""
        _i, b, t, s = _tile_of(c, pid, n_prog, S, NB)
        t = gl.minimum(t, T - 1)
        pos = s * (NB * 64) + b * 64 + gl.arange(0, 64, layout=_ids_layout())
        k_len = K
        if HAS_TOPK_LEN:
            k_len = gl.minimum(gl.load(TopkLen + t), K)
        in_row = (pos < k_len) & (c < n_blocks)
        return gl.load(Rows + t.to(gl.int64) * stride_rt + pos * stride_rk, mask=in_row, other=-1)

    @gluon.jit
    def _rows_in(slot, layout: gl.constexpr):
        """``(row, is_key)`` of a block's entries (:func:`_block_ids`, stored in the key ring's
        ``slot``) in ``layout`` (rows no key read 0)."""
        r = slot.load(layout)
        return gl.maximum(r, 0), r >= 0

    @gluon.jit
    def _issue(c, ids, pid, n_prog, S, NB, T, R, Q, KV, stride_qt, stride_qh, stride_kvr, H, bufs,
               HP: gl.constexpr, DV: gl.constexpr, DR: gl.constexpr, STAGES: gl.constexpr,
               KV_FP8: gl.constexpr):  # fmt: skip
        """Block ``c``'s rows (``ids``: :func:`_block_ids`, an entry outside ``[0, R)`` made -1 here) into
        ring stage ``c % STAGES`` as one ``cp.async`` group, with its tile's Q into Q buffer ``i % 2``
        when the block is its tile's first; past the program's last block an empty group, so that
        ``cp.wait_group(STAGES - 1)`` always means "block ``c`` landed". The entries go to the stage's
        slot of the key ring first: the gathers read them back in their own layouts behind one
        barrier (a layout conversion each costs a barrier more), and the softmax reads there which
        rows are keys."""
        (q_nope, q_rope, k_nope, k_rope, k_codes, k_scales, keys) = bufs
        i, b, t, _s = _tile_of(c, pid, n_prog, S, NB)
        st = c % STAGES
        slot = keys.index(st)
        slot.store(gl.where((ids >= 0) & (ids < R), ids, -1))
        cta_barrier()  # every gather reads the entries back in its own layout
        lay_r: gl.constexpr = _rope_layout()
        cols_r = gl.arange(0, DR, layout=gl.SliceLayout(0, lay_r))
        r_r, key_r = _rows_in(slot, gl.SliceLayout(1, lay_r))
        row_r = KV + r_r.to(gl.int64) * stride_kvr
        if KV_FP8:
            lay_c: gl.constexpr = _codes_layout()
            r_c, key_c = _rows_in(slot, gl.SliceLayout(1, lay_c))
            cols_c = gl.arange(0, DV, layout=gl.SliceLayout(0, lay_c))
            row_c = KV + r_c.to(gl.int64) * stride_kvr
            async_load(k_codes.index(st), (row_c[:, None] + cols_c[None, :]).to(gl.pointer_type(gl.float8e4nv)),
                       mask=key_c[:, None])  # fmt: skip
            r_s, key_s = _rows_in(slot, _scales_layout())
            row_s = (KV + r_s.to(gl.int64) * stride_kvr + FP8_SCALE_OFFSET).to(gl.pointer_type(gl.float32))
            for c in gl.static_range(DV // CW):  # scale tile c of the 64 rows to [c * 64, c * 64 + 64)
                async_load(k_scales.index(st).slice(c * 64, 64), row_s + c, mask=key_s)
            rope = (row_r + FP8_ROPE_OFFSET).to(gl.pointer_type(Q.dtype.element_ty))
            async_load(k_rope.index(st), rope[:, None] + cols_r[None, :], mask=key_r[:, None])
        else:
            lay_v: gl.constexpr = _gather_layout(DV, 4)
            r_v, key_v = _rows_in(slot, gl.SliceLayout(1, lay_v))
            cols_v = gl.arange(0, DV, layout=gl.SliceLayout(0, lay_v))
            async_load(k_nope.index(st), KV + r_v.to(gl.int64)[:, None] * stride_kvr + cols_v[None, :],
                       mask=key_v[:, None])  # fmt: skip
            async_load(k_rope.index(st), row_r[:, None] + DV + cols_r[None, :], mask=key_r[:, None])
        if (b == 0) & (t < T):  # the tile's first block: its token's Q joins the group
            lay_q: gl.constexpr = _gather_layout(DV, 4)
            h_v = gl.arange(0, HP, layout=gl.SliceLayout(1, lay_q))
            h_r = gl.arange(0, HP, layout=gl.SliceLayout(1, lay_r))
            cols_q = gl.arange(0, DV, layout=gl.SliceLayout(0, lay_q))
            q_base = Q + t.to(gl.int64) * stride_qt
            async_load(q_nope.index(i % 2), q_base + h_v[:, None] * stride_qh + cols_q[None, :],
                       mask=(h_v < H)[:, None])  # fmt: skip
            async_load(q_rope.index(i % 2), q_base + h_r[:, None] * stride_qh + DV + cols_r[None, :],
                       mask=(h_r < H)[:, None])  # fmt: skip
        cp.commit_group()

    @gluon.jit
    def _codes_and_scale(st, k_codes, k_scales, c: gl.constexpr, lay: gl.constexpr):
        """Chunk ``c``'s ``[64, CW]`` codes of ring stage ``st`` and their ``[64, 1]`` bf16 scales."""
        codes = k_codes.index(st).slice(c * CW, CW, dim=1).load(lay)
        scale = k_scales.index(st).slice(c * 64, 64).load(gl.SliceLayout(1, lay))
        return codes, scale.to(gl.bfloat16)[:, None]

    @gluon.jit
    def _scores(st, par, bufs, s_zero, HP: gl.constexpr, DV: gl.constexpr, KV_FP8: gl.constexpr):
        """``S^T [64, HP] = K Q^T`` of the block in stage ``st`` against Q buffer ``par``; ``fp8_ds_mla``
        rows are dequantised into ``k_nope`` first, chunk by chunk, each chunk's codes and scales read
        from the ring before the chunk ahead of it is stored (read in turn, each waited on its store:
        0.3-4 % slower; D71), behind one proxy fence and barrier for the four chunks (a fence and
        barrier per chunk, each chunk's ``wgmma`` overlapping the next chunk's conversion, was 1-2 %
        slower; docs/DECISIONS.md, D68)."""
        (q_nope, q_rope, k_nope, k_rope, k_codes, k_scales, _keys) = bufs
        q_n = q_nope.index(par)
        s = warpgroup_mma(k_rope.index(st), q_rope.index(par).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)  # fmt: skip
        if KV_FP8:
            lay: gl.constexpr = _latent_layout(CW, 4, True)
            gl.static_assert(DV // CW == 4, "four scale tiles a row")
            # chunk c + 1's codes and scales are read before chunk c is stored (shared-memory reads
            # are not moved past stores), so each read's latency overlaps a conversion
            codes0, scale0 = _codes_and_scale(st, k_codes, k_scales, 0, lay)
            codes1, scale1 = _codes_and_scale(st, k_codes, k_scales, 1, lay)
            k_nope.index(0).slice(0 * CW, CW, dim=1).store(e4m3_times_bf16(codes0, scale0))
            codes2, scale2 = _codes_and_scale(st, k_codes, k_scales, 2, lay)
            k_nope.index(0).slice(1 * CW, CW, dim=1).store(e4m3_times_bf16(codes1, scale1))
            codes3, scale3 = _codes_and_scale(st, k_codes, k_scales, 3, lay)
            k_nope.index(0).slice(2 * CW, CW, dim=1).store(e4m3_times_bf16(codes2, scale2))
            k_nope.index(0).slice(3 * CW, CW, dim=1).store(e4m3_times_bf16(codes3, scale3))
            fence_async_shared()
            cta_barrier()
            for c in gl.static_range(DV // CW):
                chunk = k_nope.index(0).slice(c * CW, CW, dim=1)
                s = warpgroup_mma(chunk, q_n.slice(c * CW, CW, dim=1).permute((1, 0)), s, is_async=True)
        else:
            for c in gl.static_range(DV // CW):
                k_c = k_nope.index(st).slice(c * CW, CW, dim=1)
                s = warpgroup_mma(k_c, q_n.slice(c * CW, CW, dim=1).permute((1, 0)), s, is_async=True)
        return warpgroup_mma_wait(num_outstanding=0, deps=(s,))

    @gluon.jit
    def _store_tile(acc, m_i, l_i, t, s, Out, Lse, Sinks, stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
                    stride_lh, H, HP: gl.constexpr, DV: gl.constexpr, HAS_SINKS: gl.constexpr):  # fmt: skip
        """A finished tile's ``O^T [DV, HP]`` (normalised) and LSE (natural log) to slice ``s`` of token
        ``t``; sinks join slice 0's denominator; a head with no key gives ``(0, -inf)``."""
        o_layout: gl.constexpr = _acc_layout(HP, 4)
        heads = gl.arange(0, HP, layout=gl.SliceLayout(0, o_layout))
        if HAS_SINKS:  # the sink is one more logit of slice 0 (no value)
            sink = gl.load(Sinks + heads, mask=(heads < H) & (s == 0), other=float("-inf")) * 1.4426950408889634
            m_f = gl.maximum(m_i, sink)
            m_fs = gl.where(m_f == float("-inf"), 0.0, m_f)
            rescale = gl.exp2(m_i - m_fs)
            l_i = l_i * rescale + gl.exp2(sink - m_fs)
            acc = acc * rescale[None, :]
        else:
            m_fs = gl.where(m_i == float("-inf"), 0.0, m_i)
        d_safe, lse = _row_lse(m_fs, l_i)
        o = acc / d_safe[None, :]
        cols = gl.arange(0, DV, layout=gl.SliceLayout(1, o_layout))
        base = Out + s.to(gl.int64) * stride_os + t.to(gl.int64) * stride_ot
        gl.store(base + heads[None, :] * stride_oh + cols[:, None], o.to(Out.dtype.element_ty),
                 mask=(heads < H)[None, :])  # fmt: skip
        gl.store(Lse + s * stride_ls + t * stride_lt + heads * stride_lh, lse, mask=heads < H)

    @gluon.jit(do_not_specialize=NOT_SPECIALIZED)
    def _stream_decode_kernel(Q, KV, Rows, TopkLen, Sinks, Out, Lse,
                              stride_qt, stride_qh, stride_kvr, stride_rt, stride_rk, T, K, R, H, S, NB, n_prog,
                              stride_os, stride_ot, stride_oh, stride_ls, stride_lt, stride_lh, qk_scale,
                              HP: gl.constexpr, DV: gl.constexpr, DR: gl.constexpr, STAGES: gl.constexpr,
                              HAS_TOPK_LEN: gl.constexpr, HAS_SINKS: gl.constexpr, PDL: gl.constexpr,
                              KV_FP8: gl.constexpr):  # fmt: skip
        """Program ``pid`` of ``n_prog``: tiles ``pid, pid + n_prog, ...`` of the ``T * S`` (token, slice)
        tiles, ``NB`` blocks of 64 entries each, as one stream of blocks through a ``STAGES``-deep
        ``cp.async`` ring (the ring runs on across tiles); per block ``S^T = K Q^T``, the online softmax
        down each head, ``O^T += V^T P^T``; per tile its output (``S == 1``) or slice partial."""
        gl.static_assert(DV == 512 and DR == 64, "sparse-MLA rows: 512 latent and 64 rope columns")
        gl.static_assert(not KV_FP8 or STAGES >= 3, "fp8_ds_mla rows: a ring of at least 3 stages")
        if PDL:  # the grid before this one (a union build, an indexer) wrote q / rows: wait for it
            grid_dependency("griddepcontrol.wait")
        pid = gl.program_id(0)
        dtype: gl.constexpr = Q.dtype.element_ty
        n_tiles = T * S
        n_blocks = gl.cdiv(gl.maximum(n_tiles - pid, 0), n_prog) * NB
        q_nope = gl.allocate_shared_memory(dtype, [2, HP, DV], nvmma_layout(DV, 16))
        q_rope = gl.allocate_shared_memory(dtype, [2, HP, DR], nvmma_layout(DR, 16))
        k_rope = gl.allocate_shared_memory(dtype, [STAGES, 64, DR], nvmma_layout(DR, 16))
        plain: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        if KV_FP8:  # raw codes and scales per stage, one dequantised block
            k_nope = gl.allocate_shared_memory(dtype, [1, 64, DV], nvmma_layout(DV, 16))
            k_codes = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 64, DV], plain)
            # a stage's scales tile-major: [c * 64 + row] (the chunk's 64 scales in one slice)
            k_scales = gl.allocate_shared_memory(gl.float32, [STAGES, 4 * 64], gl.SwizzledSharedLayout(
                vec=1, per_phase=1, max_phase=1, order=[0]))  # fmt: skip
        else:
            k_nope = gl.allocate_shared_memory(dtype, [STAGES, 64, DV], nvmma_layout(DV, 16))
            k_codes = k_nope
            k_scales = k_nope
        p_t = _p_operand(dtype, 64, HP)
        keys = gl.allocate_shared_memory(gl.int32, [STAGES, 64], gl.SwizzledSharedLayout(
            vec=1, per_phase=1, max_phase=1, order=[0]))  # fmt: skip
        bufs = (q_nope, q_rope, k_nope, k_rope, k_codes, k_scales, keys)

        s_layout: gl.constexpr = _acc_layout(HP, 4)
        s_zero = gl.zeros([64, HP], gl.float32, s_layout)
        m_i = gl.full([HP], float("-inf"), gl.float32, layout=gl.SliceLayout(0, s_layout))
        l_rows = gl.zeros([64, HP], gl.float32, s_layout)
        acc = gl.zeros([DV, HP], gl.float32, s_layout)
        for c in gl.static_range(STAGES - 1):  # the ring's first blocks
            ids = _block_ids(c, n_blocks, pid, n_prog, S, NB, T, Rows, TopkLen, stride_rt, stride_rk, K,
                             HAS_TOPK_LEN)  # fmt: skip
            _issue(c, ids, pid, n_prog, S, NB, T, R, Q, KV, stride_qt, stride_qh, stride_kvr, H, bufs, HP, DV, DR,
                   STAGES, KV_FP8)  # fmt: skip
        ids = _block_ids(STAGES - 1, n_blocks, pid, n_prog, S, NB, T, Rows, TopkLen, stride_rt, stride_rk, K,
                         HAS_TOPK_LEN)  # fmt: skip
        for c in range(n_blocks):
            # the stage block c - 1 used is free (the last iteration ended on a barrier): refill it, and
            # load the entries of the block after (used in the next iteration)
            _issue(c + STAGES - 1, ids, pid, n_prog, S, NB, T, R, Q, KV, stride_qt, stride_qh, stride_kvr, H, bufs,
                   HP, DV, DR, STAGES, KV_FP8)  # fmt: skip
            ids = _block_ids(c + STAGES, n_blocks, pid, n_prog, S, NB, T, Rows, TopkLen, stride_rt, stride_rk, K,
                             HAS_TOPK_LEN)  # fmt: skip
            i, b, t, s = _tile_of(c, pid, n_prog, S, NB)
            st = c % STAGES
            if b == 0:  # a new tile
                m_i = gl.full([HP], float("-inf"), gl.float32, layout=gl.SliceLayout(0, s_layout))
                l_rows = gl.zeros([64, HP], gl.float32, s_layout)
                acc = gl.zeros([DV, HP], gl.float32, s_layout)
            cp.wait_group(STAGES - 1)  # block c's group (and its tile's Q) landed
            fence_async_shared()
            cta_barrier()
            key = keys.index(st).load(gl.SliceLayout(1, s_layout)) >= 0
            sc = _scores(st, i % 2, bufs, s_zero, HP, DV, KV_FP8)
            sc = gl.where(key[:, None], sc * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(sc, axis=0))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_safe)  # 0 while the head had no key (its l and acc are 0)
            p = gl.exp2(sc - m_safe[None, :])
            # the denominator kept per row slot (summed down the rows once, at the tile's end): no
            # reduction across the warps in the loop but the max
            l_rows = l_rows * alpha[None, :] + p
            m_i = m_new
            acc = acc * alpha[None, :]
            p_t.store(p.to(dtype))
            fence_async_shared()
            cta_barrier()
            if KV_FP8:
                acc = warpgroup_mma(k_nope.index(0).permute((1, 0)), p_t, acc, is_async=True)
            else:
                acc = warpgroup_mma(k_nope.index(st).permute((1, 0)), p_t, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            if b == NB - 1:
                _store_tile(acc, m_i, gl.sum(l_rows, axis=0), t, s, Out, Lse, Sinks, stride_os, stride_ot, stride_oh,
                            stride_ls, stride_lt, stride_lh, H, HP, DV, HAS_SINKS)  # fmt: skip
            cta_barrier()  # every warp is done with stage st (and P^T) before either is refilled
        cp.wait_group(0)
        if PDL:  # the outputs are stored: the merge may launch (it waits for this grid to complete)
            grid_dependency("griddepcontrol.launch_dependents")
