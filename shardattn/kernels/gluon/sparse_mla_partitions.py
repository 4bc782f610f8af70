"""The partitions of the 64-key warp-specialised Gluon kernel: producer and both consumers, for one tile.

:mod:`shardattn.kernels.gluon.sparse_mla_kernel` holds the kernel (shared memory, barriers, the
tile loop of the persistent variant) and describes the schedule; here are the pieces each
partition runs on one tile: the producer's gathers in the order 0L, 1R, 0R, 1L of a pair
(:func:`_producer`), consumer WG0's block ``2i`` and output columns ``[0, Dv/2)``
(:func:`_consumer0`), consumer WG1's block ``2i + 1`` and columns ``[Dv/2, Dv)``
(:func:`_consumer1`), and what they share (row ids and key masks of a block, the online softmax's
row-sum exchange, the opaque slot index). Pair and tile numbers (``c0``, ``j``) give each
mbarrier's phase, so a program may run several tiles back to back.
"""

from __future__ import annotations

from shardattn.kernels.gluon.compat import HAS_GLUON

if HAS_GLUON:
    from shardattn.kernels.gluon.compat import async_load as _async_load
    from shardattn.kernels.gluon.compat import (
        cp,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from shardattn.kernels.gluon.kv_fp8_fill import _convert_fp8, _issue_fp8, _prefetch_rows_l2
    from shardattn.kernels.gluon.sparse_mla_epilogue import _tile_rows

if HAS_GLUON:
    # ready / free barrier of each half: block 0 left / right, block 1 left / right
    _L0 = gl.constexpr(0)
    _R0 = gl.constexpr(1)
    _L1 = gl.constexpr(2)
    _R1 = gl.constexpr(3)

    @gluon.constexpr_function
    def _gather_layout():
        """``[rows, 64 * k]`` gathers by 4 warps: 8 threads x 16 bytes along 64 columns, 16 rows per pass
        (every tile of a block shares the rows' registers)."""
        return gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

    @gluon.jit
    def _block_rows(u_base, n_len, blk, lay: gl.constexpr, G: gl.constexpr, RAW_ROWS: gl.constexpr, R):
        """Row ids of 64-key block ``blk`` in the row slice of ``lay``: -1 past ``n_len``; ``G > 1``:
        the 24-bit row of each packed entry; ``RAW_ROWS``: -1 for an entry outside ``[0, R)``."""
        n = blk * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, lay))
        e = gl.load(u_base + n, mask=n < n_len, other=-1)
        if G > 1:
            e = gl.where(n < n_len, e & 0xFFFFFF, -1)
        if RAW_ROWS:
            e = gl.where((e >= 0) & (e < R), e, -1)
        return e

    @gluon.jit
    def _block_keep(u_base, n_len, blk, cols, qj, G: gl.constexpr, RAW_ROWS: gl.constexpr, R):
        """Which tile rows keep which keys of block ``blk`` (``[64, 64]``, or ``[1, 64]`` when every
        row keeps the same keys): keys before ``n_len``; ``G > 1``: where the row's query has its
        membership bit; ``RAW_ROWS``: entries in ``[0, R)``. ``cols`` / ``qj``: key and query index
        vectors in the S layout's column / row slices."""
        n = blk * 64 + cols
        if G > 1:
            bits = (gl.load(u_base + n, mask=n < n_len, other=0) >> 24) & 0xFF
            keep = ((bits[None, :] >> qj[:, None]) & 1) != 0
        elif RAW_ROWS:
            e = gl.load(u_base + n, mask=n < n_len, other=-1)
            keep = ((e >= 0) & (e < R))[None, :]
        else:
            keep = (n < n_len)[None, :]
        return keep

    @gluon.jit
    def _finite(m, G: gl.constexpr, RAW_ROWS: gl.constexpr):
        """``m`` with ``-inf`` (a row with no key yet) read as 0, so ``exp2(x - m)`` is 0, not NaN. Needed
        only where a pair's first block may hold no key for a row (``G > 1`` or ``RAW_ROWS``); a
        sorted union's block ``2i`` always holds one."""
        if G > 1 or RAW_ROWS:
            return gl.where(m == float("-inf"), 0.0, m)
        else:
            return m

    @gluon.jit
    def _gather(dst, KV, rows, stride_kvr, col0, WIDTH: gl.constexpr, lay: gl.constexpr):
        """cp.async ``kv[rows, col0:col0 + WIDTH]`` into ``dst`` (rows < 0 zero-filled)."""
        d = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, lay))
        ptr = KV + rows.to(gl.int64)[:, None] * stride_kvr + col0 + d[None, :]
        _async_load(dst, ptr, mask=(rows >= 0)[:, None])

    @gluon.jit
    def _fill_pair_fp8(args, r0, r1, i, ph, D_V: gl.constexpr, lay: gl.constexpr, G: gl.constexpr,
                       RAW_ROWS: gl.constexpr):  # fmt: skip
        """The producer's pair ``i`` from ``fp8_ds_mla`` rows (blocks 0 / 1 of rows ``r0`` / ``r1``): the
        halves in the bf16 gathers' order (0L, 1R, 0R, 1L), each copied raw into its own buffer as its
        ``free`` barrier (phase ``ph``) allows (:func:`~shardattn.kernels.gluon.kv_fp8_fill._issue_fp8`)
        and dequantised there one half behind the copies
        (:func:`~shardattn.kernels.gluon.kv_fp8_fill._convert_fp8`), so each copy's latency hides behind
        the previous half's conversion. No half waits across the pair's end: a half's ``free`` never
        depends on a later half of the same pair (the consumers release 0L, 1R, 0R, 1L of the last
        pair in turn). The next pair's row ids load first; once half 0L is stored their rows are asked
        of the L2 (:func:`_prefetch_rows_l2`). Returns those row ids."""
        (KV, u_base, n_len, stride_kvr, _np, _q_l, _q_r, _q_rope, k_l, k_r, k_rope, _p1, _m_buf, _l_bufs, ready,
         free, _m0_ready, _m1_ready, _p0_ready, _p1_ready, _l_ready, _qk_scale, _q_ready, _q_src, R) = args  # fmt: skip
        HALF: gl.constexpr = D_V // 2
        r0_next = _block_rows(u_base, n_len, 2 * i + 2, lay, G, RAW_ROWS, R)
        r1_next = _block_rows(u_base, n_len, 2 * i + 3, lay, G, RAW_ROWS, R)
        _issue_fp8(k_l.index(0), k_rope.index(0), KV, r0, stride_kvr, ready.index(_L0), free.index(_L0), ph, 0, False,
                   lay)  # fmt: skip
        _issue_fp8(k_r.index(1), k_rope.index(1), KV, r1, stride_kvr, ready.index(_R1), free.index(_R1), ph, HALF, True,
                   lay)  # fmt: skip
        _convert_fp8(k_l.index(0), ready.index(_L0), 1)
        _prefetch_rows_l2(KV, r0_next, stride_kvr)
        _prefetch_rows_l2(KV, r1_next, stride_kvr)
        _issue_fp8(k_r.index(0), k_rope.index(0), KV, r0, stride_kvr, ready.index(_R0), free.index(_R0), ph, HALF, True,
                   lay)  # fmt: skip
        _convert_fp8(k_r.index(1), ready.index(_R1), 1)
        _issue_fp8(k_l.index(1), k_rope.index(1), KV, r1, stride_kvr, ready.index(_L1), free.index(_L1), ph, 0, False,
                   lay)  # fmt: skip
        _convert_fp8(k_r.index(0), ready.index(_R0), 1)
        _convert_fp8(k_l.index(1), ready.index(_L1), 0)
        return r0_next, r1_next

    @gluon.jit
    def _load_q(dst, Q, g, hb, T, H, HB, stride_qb, stride_qt, stride_qh, col0, WIDTH: gl.constexpr, G: gl.constexpr):
        """cp.async the tile's q columns ``[col0, col0 + WIDTH)`` (rows past H or T zero-filled)."""
        lay: gl.constexpr = _gather_layout()
        t, blk, hin, _h, ok = _tile_rows(g, hb, T, H, HB, G, gl.SliceLayout(1, lay))
        row = t * stride_qt + blk * stride_qb + hin.to(gl.int64) * stride_qh
        d = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, lay))
        _async_load(dst, Q + row[:, None] + col0 + d[None, :], mask=ok[:, None])

    @gluon.jit
    def _load_tile_q(args, D_V: gl.constexpr, D_R: gl.constexpr, G: gl.constexpr):
        """The producer's cp.async of the tile's Q; ``q_ready`` fires when its copies land."""
        (_KV, _u, _n, _skv, _np, q_l, q_r, q_rope, _k_l, _k_r, _k_rope, _p1, _m_buf, _l_bufs, _ready, _free,
         _m0r, _m1r, _p0r, _p1r, _l_ready, _qk_scale, q_ready, q_src, _R) = args  # fmt: skip
        (Q, g, hb, T, H, HB, stride_qb, stride_qt, stride_qh) = q_src
        HALF: gl.constexpr = D_V // 2
        _load_q(q_l.index(0), Q, g, hb, T, H, HB, stride_qb, stride_qt, stride_qh, 0, HALF, G)
        _load_q(q_r.index(0), Q, g, hb, T, H, HB, stride_qb, stride_qt, stride_qh, HALF, HALF, G)
        _load_q(q_rope.index(0), Q, g, hb, T, H, HB, stride_qb, stride_qt, stride_qh, D_V, D_R, G)
        cp.mbarrier_arrive(q_ready, increment_count=False)

    @gluon.jit
    def _producer(args, D_V: gl.constexpr, D_R: gl.constexpr, EARLY_KV: gl.constexpr, G: gl.constexpr,
                  RAW_ROWS: gl.constexpr, PERSISTENT: gl.constexpr, c0, j, q_free,
                  KV_FP8: gl.constexpr = False):  # fmt: skip
        """The producer's work on one tile: its pairs are the program's pairs ``c0, c0 + 1, ...`` (the
        ring's phases run on across tiles); ``PERSISTENT``: the tile's Q (the ``j``-th of the program)
        is loaded after its first pair's gathers, once ``q_free`` says the last tile's epilogues are done
        (the program's first tile: before them)."""
        (KV, u_base, n_len, stride_kvr, n_pairs, _q_l, _q_r, _q_rope, k_l, k_r, k_rope, _p1, _m_buf, _l_bufs, ready,
         free, _m0_ready, _m1_ready, _p0_ready, _p1_ready, _l_ready, _qk_scale, _q_ready, _q_src, R) = args  # fmt: skip
        HALF: gl.constexpr = D_V // 2
        lay: gl.constexpr = _gather_layout()
        if PERSISTENT:
            if j == 0:  # the program's first tile: Q first (Q's buffers are free)
                _load_tile_q(args, D_V, D_R, G)
        elif EARLY_KV:  # Q first, then straight on to the KV rows (the consumers wait for q_ready)
            _load_tile_q(args, D_V, D_R, G)
        r0 = _block_rows(u_base, n_len, 0, lay, G, RAW_ROWS, R)
        r1 = _block_rows(u_base, n_len, 1, lay, G, RAW_ROWS, R)
        for i in range(n_pairs):
            ph = ((c0 + i) & 1) ^ 1
            if KV_FP8:  # the same halves in the same order, copied raw and dequantised in place
                r0, r1 = _fill_pair_fp8(args, r0, r1, i, ph, D_V, lay, G, RAW_ROWS)
            else:
                # the next pair's row ids, loaded a pair ahead (their latency hides behind the copies)
                r0_next = _block_rows(u_base, n_len, 2 * i + 2, lay, G, RAW_ROWS, R)
                r1_next = _block_rows(u_base, n_len, 2 * i + 3, lay, G, RAW_ROWS, R)
                mbarrier.wait(free.index(_L0), ph)
                _gather(k_l.index(0), KV, r0, stride_kvr, 0, HALF, lay)
                cp.mbarrier_arrive(ready.index(_L0), increment_count=False)
                mbarrier.wait(free.index(_R1), ph)
                _gather(k_r.index(1), KV, r1, stride_kvr, HALF, HALF, lay)
                _gather(k_rope.index(1), KV, r1, stride_kvr, D_V, D_R, lay)
                cp.mbarrier_arrive(ready.index(_R1), increment_count=False)
                mbarrier.wait(free.index(_R0), ph)
                _gather(k_r.index(0), KV, r0, stride_kvr, HALF, HALF, lay)
                _gather(k_rope.index(0), KV, r0, stride_kvr, D_V, D_R, lay)
                cp.mbarrier_arrive(ready.index(_R0), increment_count=False)
                mbarrier.wait(free.index(_L1), ph)
                _gather(k_l.index(1), KV, r1, stride_kvr, 0, HALF, lay)
                cp.mbarrier_arrive(ready.index(_L1), increment_count=False)
            if PERSISTENT:
                if (i == 0) & (j > 0):  # the first pair is in flight: now the tile's Q (once the last
                    mbarrier.wait(q_free, (j & 1) ^ 1)  # tile's epilogues, staged in Q, are done)
                    _load_tile_q(args, D_V, D_R, G)
            if not KV_FP8:
                r0 = r0_next
                r1 = r1_next
        if PERSISTENT:
            if (n_pairs == 0) & (j > 0):  # an empty tile still takes its Q turn (the phases stay in step)
                mbarrier.wait(q_free, (j & 1) ^ 1)
                _load_tile_q(args, D_V, D_R, G)

    @gluon.constexpr_function
    def _mma_s_layout():
        """Accumulator layout of a consumer's ``S`` tile ``[64 rows, 64 keys]`` (one warpgroup)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])

    @gluon.constexpr_function
    def _mma_o_layout(d_v):
        """Accumulator layout of a consumer's ``O`` half ``[64 rows, Dv / 2]`` (one warpgroup)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, d_v // 2, 16])

    @gluon.constexpr_function
    def _row_layout():
        """Layout of a per-row vector of ``S`` (row max, row sum)."""
        return gl.SliceLayout(1, _mma_s_layout())

    @gluon.constexpr_function
    def _p_operand_layout(d_v):
        """``P`` as the register ``A`` operand of ``P V`` into the ``O`` half's accumulator."""
        return gl.DotOperandLayout(operand_index=0, parent=_mma_o_layout(d_v), k_width=2)

    @gluon.jit
    def _consumer_start(q_ready, j, D_V: gl.constexpr, G: gl.constexpr, EARLY_KV: gl.constexpr):
        """A consumer's start on the program's ``j``-th tile: ``EARLY_KV``: wait for the producer's Q;
        then ``(m_i = -inf, l_i = 0, acc = 0, a zero S, the S tile's key index per column, the
        group's query per row)``."""
        if EARLY_KV:
            mbarrier.wait(q_ready, j & 1)
        mma_s: gl.constexpr = _mma_s_layout()
        row_l: gl.constexpr = _row_layout()
        m_i = gl.full([64], float("-inf"), gl.float32, layout=row_l)
        l_i = gl.zeros([64], gl.float32, layout=row_l)
        acc = gl.zeros([64, D_V // 2], gl.float32, layout=_mma_o_layout(D_V))
        s_zero = gl.zeros([64, 64], gl.float32, layout=mma_s)
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, mma_s))
        qj = gl.arange(0, 64, layout=row_l) // (64 // G)
        return m_i, l_i, acc, s_zero, cols, qj

    @gluon.jit
    def _rows_of(x, mma_o: gl.constexpr):
        """A row vector of the S layout as a row vector of the O layout (``[64, 1]``)."""
        return gl.convert_layout(x, gl.SliceLayout(1, mma_o))[:, None]

    @gluon.jit
    def _combine_l(l_i, l_bufs, l_ready, W: gl.constexpr, j):
        """Both warpgroups' row sums of the program's ``j``-th tile added (each keeps the total);
        buffers and barriers alternate between even and odd tiles (a warpgroup may reach the next
        tile's exchange before the other has read this one's)."""
        b = (j & 1) * 2
        l_bufs.index(b + W).store(l_i)
        mbarrier.arrive(l_ready.index(b + W), count=1)
        mbarrier.wait(l_ready.index(b + 1 - W), (j >> 1) & 1)
        return l_i + l_bufs.index(b + 1 - W).load(l_i.type.layout)

    @gluon.jit
    def _slot0(i):
        """Index 0 of the consumers' shared-memory buffers in key-loop iteration ``i``, produced in every
        iteration by an instruction the compiler cannot see through, so the loop's wgmma descriptors
        are built inside the loop; with a constant 0 they are hoisted before it (36 per ``Q K^T``, all
        live across the loop) and ptxas spills them in one consumer and reloads them every pair
        (measured slower: docs/PERFORMANCE.md)."""
        return gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [i], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _qk0_left(q_l, k_l, ready, phase, s_zero, z):
        """Wait for block 0's left half and issue its part of ``S0 = Q K0^T`` (async)."""
        mbarrier.wait(ready.index(_L0), phase)
        return warpgroup_mma(q_l.index(z), k_l.index(z).permute((1, 0)), s_zero, use_acc=False, is_async=True)

    @gluon.jit
    def _qk0_right(q_r, q_rope, k_r, k_rope, ready, phase, s_l, z):
        """Wait for block 0's right half, add its part (nope right + rope) to ``s_l``; the finished ``S0``."""
        mbarrier.wait(ready.index(_R0), phase)
        s = warpgroup_mma(q_r.index(z), k_r.index(z).permute((1, 0)), s_l, is_async=True)
        s = warpgroup_mma(q_rope.index(z), k_rope.index(z).permute((1, 0)), s, is_async=True)
        return warpgroup_mma_wait(num_outstanding=0, deps=(s,))

    @gluon.jit
    def _consumer0(args, D_V: gl.constexpr, EARLY_KV: gl.constexpr, G: gl.constexpr, RAW_ROWS: gl.constexpr, c0, j):
        """WG0: block ``2i`` of each pair, output columns ``[0, Dv/2)``; returns ``(acc, m_i, l_i)``.
        The tile's pairs are the program's pairs ``c0, c0 + 1, ...``, the tile its ``j``-th."""
        (_KV, u_base, n_len, _stride_kvr, n_pairs, q_l, q_r, q_rope, k_l, k_r, k_rope, p1_buf, m_buf, l_bufs,
         ready, free, m0_ready, m1_ready, p0_ready, p1_ready, l_ready, qk_scale, q_ready, _q_src, R) = args  # fmt: skip
        dtype: gl.constexpr = q_l.dtype
        mma_o: gl.constexpr = _mma_o_layout(D_V)
        p_op: gl.constexpr = _p_operand_layout(D_V)
        row_l: gl.constexpr = _row_layout()
        m_i, l_i, acc, s_zero, cols, qj = _consumer_start(q_ready, j, D_V, G, EARLY_KV)
        s = s_zero
        for i in range(n_pairs):
            ph = (c0 + i) & 1
            z = _slot0(i)
            keep = _block_keep(u_base, n_len, 2 * i, cols, qj, G, RAW_ROWS, R)  # read while the gather lands
            s = _qk0_right(q_r, q_rope, k_r, k_rope, ready, ph, _qk0_left(q_l, k_l, ready, ph, s_zero, z), z)
            s_m = gl.where(keep, s * qk_scale, float("-inf"))
            m0 = gl.maximum(m_i, gl.max(s_m, axis=1))  # finite for a sorted union: block 2i holds a key
            m_buf.store(m0)
            mbarrier.arrive(m0_ready, count=1)
            m0_f = _finite(m0, G, RAW_ROWS)
            alpha = gl.exp2(m_i - m0_f)
            p = gl.exp2(s_m - m0_f[:, None])
            l_i = l_i * alpha + gl.sum(p, axis=1)
            acc = acc * _rows_of(alpha, mma_o)
            acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_op), k_l.index(z), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(free.index(_L0), count=1)
            # WG1's final max of the pair: P0 rescaled to it goes to WG1 through block 0's rope slot
            mbarrier.wait(m1_ready, ph)
            m1 = m_buf.load(row_l)
            sc = gl.exp2(m0 - _finite(m1, G, RAW_ROWS))  # 0 while the row has no key (its P is 0)
            k_rope.index(z).store((p * sc[:, None]).to(dtype))
            fence_async_shared()
            mbarrier.arrive(p0_ready, count=1)
            acc = acc * _rows_of(sc, mma_o)
            l_i = l_i * sc
            m_i = m1
            mbarrier.wait(p1_ready, ph)
            acc_t = warpgroup_mma(p1_buf, k_l.index(1 + z), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_t,))
            mbarrier.arrive(free.index(_L1), count=1)
        return acc, m_i, _combine_l(l_i, l_bufs, l_ready, 0, j)

    @gluon.jit
    def _consumer1(args, D_V: gl.constexpr, EARLY_KV: gl.constexpr, G: gl.constexpr, RAW_ROWS: gl.constexpr, c0, j):
        """WG1: block ``2i + 1`` of each pair, output columns ``[Dv/2, Dv)``; returns ``(acc, m_i, l_i)``
        (pairs and tile numbered as in :func:`_consumer0`)."""
        (_KV, u_base, n_len, _stride_kvr, n_pairs, q_l, q_r, q_rope, k_l, k_r, k_rope, p1_buf, m_buf, l_bufs,
         ready, free, m0_ready, m1_ready, p0_ready, p1_ready, l_ready, qk_scale, q_ready, _q_src, R) = args  # fmt: skip
        dtype: gl.constexpr = q_l.dtype
        mma_o: gl.constexpr = _mma_o_layout(D_V)
        p_op: gl.constexpr = _p_operand_layout(D_V)
        row_l: gl.constexpr = _row_layout()
        m_i, l_i, acc, s_zero, cols, qj = _consumer_start(q_ready, j, D_V, G, EARLY_KV)
        for i in range(n_pairs):
            ph = (c0 + i) & 1
            z = _slot0(i)
            keep = _block_keep(u_base, n_len, 2 * i + 1, cols, qj, G, RAW_ROWS, R)  # read while the gather lands
            mbarrier.wait(ready.index(_R1), ph)
            s = warpgroup_mma(q_r.index(z), k_r.index(1 + z).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma(q_rope.index(z), k_rope.index(1 + z).permute((1, 0)), s, is_async=True)
            mbarrier.wait(ready.index(_L1), ph)
            s = warpgroup_mma(q_l.index(z), k_l.index(1 + z).permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            s = gl.where(keep, s * qk_scale, float("-inf"))
            mbarrier.wait(m0_ready, ph)
            m1 = gl.maximum(m_buf.load(row_l), gl.max(s, axis=1))  # WG0's m0 already holds the running max
            m_buf.store(m1)
            mbarrier.arrive(m1_ready, count=1)
            m1_f = _finite(m1, G, RAW_ROWS)
            alpha = gl.exp2(m_i - m1_f)
            p = gl.exp2(s - m1_f[:, None])
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m1
            acc = acc * _rows_of(alpha, mma_o)
            pb = p.to(dtype)
            acc = warpgroup_mma(gl.convert_layout(pb, p_op), k_r.index(1 + z), acc, is_async=True)
            p1_buf.store(pb)
            fence_async_shared()
            mbarrier.wait(p0_ready, ph)
            acc = warpgroup_mma(k_rope.index(z), k_r.index(z), acc, is_async=True)
            mbarrier.arrive(p1_ready, count=1)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(free.index(_R1), count=1)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(free.index(_R0), count=1)
        return acc, m_i, _combine_l(l_i, l_bufs, l_ready, 1, j)
