"""Warp-specialised Gluon sparse-MLA prefill for Hopper (sm_90) on 64-key blocks, FlashMLA's schedule.

One program owns one query token and 64 heads (128 heads: two programs per token) and walks the
token's sorted, de-duplicated rows (``union[t, :lens[t]]`` from
:func:`shardattn.kernels.union.build_union`) as *pairs* of 64-key blocks. Two more modes share
the pipeline (compile-time; only the row ids the producer gathers and the keys each tile row
keeps change, :func:`_block_rows` / :func:`_block_keep`):

* **grouped** (``G = 2, 4, 8``): the tile's 64 rows are ``G`` consecutive queries x ``64 / G``
  heads; the program walks the group's union of packed entries (row in 24 bits, one membership
  bit per query above it) and each row keeps only its query's keys (the 32-key kernel's scheme);
* **raw rows** (``RAW_ROWS``, decode): the program walks the caller's ``[T, K]`` rows in place,
  the first ``topk_length`` of them (all ``K`` without it), and masks each entry outside
  ``[0, R)``; no union build, no packing, a duplicate counts twice.

In both a pair's first block may hold no key for a row, so the online softmax reads a running
max of ``-inf`` as 0 there (:func:`_finite`). Three warpgroups (12 warps) share the work
through shared memory and mbarriers:

* **producer** (4 warps): gathers the pair's two blocks with ``cp.async`` into a one-pair ring,
  each block split in a left half (nope columns ``[0, Dv/2)``) and a right half (nope
  ``[Dv/2, Dv)`` plus rope), each half with its own ``ready`` / ``free`` mbarriers, in the order
  0L, 1R, 0R, 1L (each half is refilled as soon as its last reader releases it);
* **consumer WG0** (block 0 of the pair, output columns ``[0, Dv/2)``): ``S0 = Q K0^T``, its row
  max ``m0`` (with the running max) to WG1, ``P0`` at ``m0``, ``O_L += P0 V0_L`` from registers
  (then 0L is free), waits for WG1's final max ``m1``, rescales ``P0`` to it and writes it into
  block 0's rope slot (``S0`` has read it), rescales ``O_L`` and adds ``P1 V1_L`` from shared
  memory (``PREFETCH_QK``: with the next pair's ``Q K0_L^T`` issued behind it, FlashMLA's
  overlap; measured slower here, benchmarks/RESULTS.md);
* **consumer WG1** (block 1, columns ``[Dv/2, Dv)``): ``S1 = Q K1^T``, ``m1 = max(m0, rowmax S1)``
  to WG0, ``O_R += P1 V1_R`` from registers, ``P1`` to shared memory, ``O_R += P0 V0_R``.

The max travels one way per pair (WG0 -> WG1 -> WG0), so WG0's first ``P V`` runs while WG1 does
its softmax. The online softmax is the library's (base 2, running max shared by both warpgroups
after each pair, row sums combined at the end, sinks folded in after the loop, ``(0, -inf)`` for
an empty row); block 0 of a pair always holds a key, block 1 may be empty (masked past
``lens[t]``). q / out / lse use the (block, token, head) strides of
:mod:`shardattn.kernels.sparse_mla_gluon_ws` (head-blocked buffers in place).

``STAGED_OUT``: each consumer warpgroup writes its normalised ``[64, Dv/2]`` output tile into a
key buffer it alone still reads (WG0 block 0's left half, WG1 block 1's right half: their last
reader was this warpgroup's final ``P V``), syncs its 128 threads and stores from there 16 bytes
per thread; from the accumulator's registers a thread holds 4 bytes of a row, and every 32-byte
sector of the output was written in two halves (twice the L2 write sectors, 8x the write
requests, measured). Other output dtypes (fp32 decode partials) store from the registers.

The producer is the default partition and gets the registers the consumers leave (a consumer
there spilled more). ``EARLY_KV``: the producer loads Q too, so the gather starts without
waiting for it; ``HEADS_FASTEST``: a 1-D grid with a token's head blocks adjacent;
``OPAQUE_SLOTS``: the consumers index their buffers with a per-iteration opaque 0 so the wgmma
descriptors are not hoisted out of the key loop and spilled (:func:`_slot0`).

Shared memory (DSA shapes): Q 72 KB + 2 x 72 KB blocks + one 8 KB P buffer (block 0's P lives in
block 0's rope slot) + row maxima / sums and barriers = 230,600 B of sm_90's 232,448.
"""

from __future__ import annotations

from shardattn.kernels.gluon_compat import HAS_GLUON

if HAS_GLUON:
    from shardattn.kernels.gluon_compat import async_load as _async_load
    from shardattn.kernels.gluon_compat import (
        cp,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from shardattn.kernels.gluon_compat import cta_barrier as _cta_barrier
    from shardattn.kernels.gluon_compat import nvmma_layout as _nvmma
    from shardattn.kernels.sparse_mla_gluon_ws import _tile_rows, _ws_epilogue, _ws_epilogue_staged

#: Launch arguments never specialised (as the 32-key kernel: token count, LSE head-block geometry).
NOT_SPECIALIZED = ["T", "HB", "stride_lb", "stride_lt", "R", "K"]
#: Keys per block.
BLOCK_N = 64

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
    def _load_q(dst, Q, g, hb, T, H, HB, stride_qb, stride_qt, stride_qh, col0, WIDTH: gl.constexpr, G: gl.constexpr):
        """cp.async the tile's q columns ``[col0, col0 + WIDTH)`` (rows past H or T zero-filled)."""
        lay: gl.constexpr = _gather_layout()
        t, blk, hin, _h, ok = _tile_rows(g, hb, T, H, HB, G, gl.SliceLayout(1, lay))
        row = t * stride_qt + blk * stride_qb + hin.to(gl.int64) * stride_qh
        d = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, lay))
        _async_load(dst, Q + row[:, None] + col0 + d[None, :], mask=ok[:, None])

    @gluon.jit
    def _producer(args, D_V: gl.constexpr, D_R: gl.constexpr, EARLY_KV: gl.constexpr, G: gl.constexpr,
                  RAW_ROWS: gl.constexpr):  # fmt: skip
        (KV, u_base, n_len, stride_kvr, n_pairs, q_l, q_r, q_rope, k_l, k_r, k_rope, _p1, _m_buf, _l_bufs, ready,
         free, _m0_ready, _m1_ready, _p0_ready, _p1_ready, _l_ready, _qk_scale, q_ready, q_src, R) = args  # fmt: skip
        HALF: gl.constexpr = D_V // 2
        lay: gl.constexpr = _gather_layout()
        if EARLY_KV:  # Q first, then straight on to the KV rows (the consumers wait for q_ready)
            (Q, g, hb, T, H, HB, stride_qb, stride_qt, stride_qh) = q_src
            _load_q(q_l.index(0), Q, g, hb, T, H, HB, stride_qb, stride_qt, stride_qh, 0, HALF, G)
            _load_q(q_r.index(0), Q, g, hb, T, H, HB, stride_qb, stride_qt, stride_qh, HALF, HALF, G)
            _load_q(q_rope.index(0), Q, g, hb, T, H, HB, stride_qb, stride_qt, stride_qh, D_V, D_R, G)
            cp.mbarrier_arrive(q_ready, increment_count=False)
        r0 = _block_rows(u_base, n_len, 0, lay, G, RAW_ROWS, R)
        r1 = _block_rows(u_base, n_len, 1, lay, G, RAW_ROWS, R)
        for i in range(n_pairs):
            ph = (i & 1) ^ 1
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
            r0 = r0_next
            r1 = r1_next

    @gluon.constexpr_function
    def _mma_s_layout():
        """Accumulator layout of a consumer's ``S`` tile ``[64 rows, 64 keys]`` (one warpgroup)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])

    @gluon.constexpr_function
    def _mma_o_layout(d_v):
        """Accumulator layout of a consumer's ``O`` half ``[64 rows, Dv / 2]`` (one warpgroup)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, d_v // 2, 16])

    @gluon.jit
    def _consumer_start(D_V: gl.constexpr, G: gl.constexpr):
        """A consumer's starting state: ``(m_i = -inf, l_i = 0, acc = 0, a zero S, the S tile's key
        index per column, the group's query per row)``."""
        mma_s: gl.constexpr = _mma_s_layout()
        row_l: gl.constexpr = gl.SliceLayout(1, mma_s)
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
    def _combine_l(l_i, l_bufs, l_ready, W: gl.constexpr):
        """Both warpgroups' row sums added (each keeps the total)."""
        l_bufs.index(W).store(l_i)
        mbarrier.arrive(l_ready.index(W), count=1)
        mbarrier.wait(l_ready.index(1 - W), 0)
        return l_i + l_bufs.index(1 - W).load(l_i.type.layout)

    @gluon.jit
    def _slot0(i, OPAQUE_SLOTS: gl.constexpr):
        """Index 0 of the consumers' shared-memory buffers in key-loop iteration ``i``.

        ``OPAQUE_SLOTS``: produced in every iteration by an instruction the compiler cannot see
        through, so the loop's wgmma descriptors are built inside the loop; with a constant 0
        they are hoisted before it (36 per ``Q K^T``, all live across the loop) and ptxas spills
        them in one consumer and reloads them every pair (benchmarks/RESULTS.md)."""
        if OPAQUE_SLOTS:
            return gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [i], dtype=gl.int32, is_pure=False, pack=1)
        else:
            return 0

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
    def _consumer0(args, D_V: gl.constexpr, PREFETCH_QK: gl.constexpr, EARLY_KV: gl.constexpr,
                   OPAQUE_SLOTS: gl.constexpr, G: gl.constexpr, RAW_ROWS: gl.constexpr):  # fmt: skip
        """WG0: block ``2i`` of each pair, output columns ``[0, Dv/2)``; returns ``(acc, m_i, l_i)``."""
        (_KV, u_base, n_len, _stride_kvr, n_pairs, q_l, q_r, q_rope, k_l, k_r, k_rope, p1_buf, m_buf, l_bufs,
         ready, free, m0_ready, m1_ready, p0_ready, p1_ready, l_ready, qk_scale, q_ready, _q_src, R) = args  # fmt: skip
        if EARLY_KV:
            mbarrier.wait(q_ready, 0)
        dtype: gl.constexpr = q_l.dtype
        mma_s: gl.constexpr = _mma_s_layout()
        mma_o: gl.constexpr = _mma_o_layout(D_V)
        p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
        row_l: gl.constexpr = gl.SliceLayout(1, mma_s)
        m_i, l_i, acc, s_zero, cols, qj = _consumer_start(D_V, G)
        s = s_zero
        if PREFETCH_QK:  # pair 0's S0 here; pair i + 1's at the end of pair i
            if n_pairs > 0:
                s = _qk0_right(q_r, q_rope, k_r, k_rope, ready, 0, _qk0_left(q_l, k_l, ready, 0, s_zero, 0), 0)
        for i in range(n_pairs):
            ph = i & 1
            z = _slot0(i, OPAQUE_SLOTS)
            keep = _block_keep(u_base, n_len, 2 * i, cols, qj, G, RAW_ROWS, R)  # read while the gather lands
            if not PREFETCH_QK:
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
            if PREFETCH_QK:
                if i + 1 < n_pairs:  # the next S0's left half runs behind P1 V1_L
                    s_l = _qk0_left(q_l, k_l, ready, ph ^ 1, s_zero, z)
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc_t,))
                    mbarrier.arrive(free.index(_L1), count=1)
                    s = _qk0_right(q_r, q_rope, k_r, k_rope, ready, ph ^ 1, s_l, z)
                else:
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_t,))
            else:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_t,))
                mbarrier.arrive(free.index(_L1), count=1)
        return acc, m_i, _combine_l(l_i, l_bufs, l_ready, 0)

    @gluon.jit
    def _consumer1(args, D_V: gl.constexpr, EARLY_KV: gl.constexpr, OPAQUE_SLOTS: gl.constexpr, G: gl.constexpr,
                   RAW_ROWS: gl.constexpr):  # fmt: skip
        """WG1: block ``2i + 1`` of each pair, output columns ``[Dv/2, Dv)``; returns ``(acc, m_i, l_i)``."""
        (_KV, u_base, n_len, _stride_kvr, n_pairs, q_l, q_r, q_rope, k_l, k_r, k_rope, p1_buf, m_buf, l_bufs,
         ready, free, m0_ready, m1_ready, p0_ready, p1_ready, l_ready, qk_scale, q_ready, _q_src, R) = args  # fmt: skip
        if EARLY_KV:
            mbarrier.wait(q_ready, 0)
        dtype: gl.constexpr = q_l.dtype
        mma_s: gl.constexpr = _mma_s_layout()
        mma_o: gl.constexpr = _mma_o_layout(D_V)
        p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
        row_l: gl.constexpr = gl.SliceLayout(1, mma_s)
        m_i, l_i, acc, s_zero, cols, qj = _consumer_start(D_V, G)
        for i in range(n_pairs):
            ph = i & 1
            z = _slot0(i, OPAQUE_SLOTS)
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
        return acc, m_i, _combine_l(l_i, l_bufs, l_ready, 1)

    @gluon.jit
    def _wg0(args, out_args, D_V: gl.constexpr, D_R: gl.constexpr, HAS_SINK: gl.constexpr,
             PREFETCH_QK: gl.constexpr, EARLY_KV: gl.constexpr, OPAQUE_SLOTS: gl.constexpr, G: gl.constexpr,
             RAW_ROWS: gl.constexpr, STAGED_OUT: gl.constexpr):  # fmt: skip
        acc, m_i, l_i = _consumer0(args, D_V, PREFETCH_QK, EARLY_KV, OPAQUE_SLOTS, G, RAW_ROWS)
        if STAGED_OUT:  # block 0's left half: read by this warpgroup alone, its last reader done
            _ws_epilogue_staged(acc, m_i, l_i, out_args, args[8].index(0), 0, D_V, HAS_SINK, G)
        else:
            _ws_epilogue(acc, m_i, l_i, out_args, 0, D_V, HAS_SINK, G)

    @gluon.jit
    def _wg1(args, out_args, D_V: gl.constexpr, D_R: gl.constexpr, HAS_SINK: gl.constexpr,
             PREFETCH_QK: gl.constexpr, EARLY_KV: gl.constexpr, OPAQUE_SLOTS: gl.constexpr, G: gl.constexpr,
             RAW_ROWS: gl.constexpr, STAGED_OUT: gl.constexpr):  # fmt: skip
        acc, m_i, l_i = _consumer1(args, D_V, EARLY_KV, OPAQUE_SLOTS, G, RAW_ROWS)
        if STAGED_OUT:  # block 1's right half: read by this warpgroup alone, its last reader done
            _ws_epilogue_staged(acc, m_i, l_i, out_args, args[9].index(1), 1, D_V, HAS_SINK, G)
        else:
            _ws_epilogue(acc, m_i, l_i, out_args, 1, D_V, HAS_SINK, G)

    @gluon.jit
    def _load(args, out_args, D_V: gl.constexpr, D_R: gl.constexpr, HAS_SINK: gl.constexpr,
              PREFETCH_QK: gl.constexpr, EARLY_KV: gl.constexpr, OPAQUE_SLOTS: gl.constexpr, G: gl.constexpr,
              RAW_ROWS: gl.constexpr, STAGED_OUT: gl.constexpr):  # fmt: skip
        _producer(args, D_V, D_R, EARLY_KV, G, RAW_ROWS)

    @gluon.jit(do_not_specialize=NOT_SPECIALIZED)
    def _sparse_mla_gluon_ws64_fwd(
        Q, KV, UNION, LENS, SINKS, OUT, LSE,
        T, H, HB,
        stride_qb, stride_qt, stride_qh, stride_kvr, stride_ug,
        stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, stride_lh,
        qk_scale, R, K,
        D_V: gl.constexpr, D_R: gl.constexpr, HAS_SINK: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PREFETCH_QK: gl.constexpr, HEADS_FASTEST: gl.constexpr,
        EARLY_KV: gl.constexpr, OPAQUE_SLOTS: gl.constexpr,
        G: gl.constexpr = 1, RAW_ROWS: gl.constexpr = False, HAS_LENS: gl.constexpr = True,
        STAGED_OUT: gl.constexpr = False,
    ):  # fmt: skip
        dtype: gl.constexpr = Q.dtype.element_ty
        HALF: gl.constexpr = D_V // 2
        if HEADS_FASTEST:  # 1-D grid, a token's head blocks adjacent
            n_hb = gl.cdiv(H, 64 // G)
            pid = gl.program_id(0)
            g = (pid // n_hb).to(gl.int64)
            hb = pid % n_hb
        else:
            g = gl.program_id(0).to(gl.int64)
            hb = gl.program_id(1)
        q_l = gl.allocate_shared_memory(dtype, [1, 64, HALF], _nvmma(HALF, 16))
        q_r = gl.allocate_shared_memory(dtype, [1, 64, HALF], _nvmma(HALF, 16))
        q_rope = gl.allocate_shared_memory(dtype, [1, 64, D_R], _nvmma(D_R, 16))
        k_l = gl.allocate_shared_memory(dtype, [2, 64, HALF], _nvmma(HALF, 16))
        k_r = gl.allocate_shared_memory(dtype, [2, 64, HALF], _nvmma(HALF, 16))
        # block 0's rope slot doubles as the P0 buffer ([64 heads, 64 keys], the same layout when D_R = 64)
        k_rope = gl.allocate_shared_memory(dtype, [2, 64, D_R], _nvmma(D_R, 16))
        p1_buf = gl.allocate_shared_memory(dtype, [64, 64], _nvmma(64, 16))
        vec_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        m_buf = gl.allocate_shared_memory(gl.float32, [64], vec_l)
        l_bufs = gl.allocate_shared_memory(gl.float32, [2, 64], vec_l)
        bar_l: gl.constexpr = mbarrier.MBarrierLayout()
        ready = gl.allocate_shared_memory(gl.int64, [4, 1], bar_l)
        free = gl.allocate_shared_memory(gl.int64, [4, 1], bar_l)
        sync = gl.allocate_shared_memory(gl.int64, [4, 1], bar_l)  # m0, m1, P0, P1 ready
        l_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
        for s in gl.static_range(4):
            mbarrier.init(ready.index(s), count=128)  # one cp.async arrival per producer thread
            mbarrier.init(free.index(s), count=1)
        for s in gl.static_range(4):
            mbarrier.init(sync.index(s), count=1)
        for s in gl.static_range(2):
            mbarrier.init(l_ready.index(s), count=1)

        q_ready = gl.allocate_shared_memory(gl.int64, [1], bar_l)
        mbarrier.init(q_ready, count=128)  # EARLY_KV: one cp.async arrival per producer thread
        if not EARLY_KV:  # Q by the 4 warps here, before the partitions start
            _load_q(q_l.index(0), Q, g, hb, T, H, HB, stride_qb, stride_qt, stride_qh, 0, HALF, G)
            _load_q(q_r.index(0), Q, g, hb, T, H, HB, stride_qb, stride_qt, stride_qh, HALF, HALF, G)
            _load_q(q_rope.index(0), Q, g, hb, T, H, HB, stride_qb, stride_qt, stride_qh, D_V, D_R, G)
            cp.commit_group()
            cp.wait_group(0)
            fence_async_shared()
        _cta_barrier()

        if RAW_ROWS:  # the token's own row: its first topk_length entries (all K without lengths)
            n_len = K
            if HAS_LENS:
                n_len = gl.minimum(gl.maximum(gl.load(LENS + g), 0), K)
        else:
            n_len = gl.load(LENS + g)
        n_pairs = gl.cdiv(gl.cdiv(n_len, 64), 2)
        args = (KV, UNION + g * stride_ug, n_len, stride_kvr, n_pairs, q_l, q_r, q_rope, k_l, k_r, k_rope, p1_buf,
                m_buf, l_bufs, ready, free, sync.index(0), sync.index(1), sync.index(2), sync.index(3),
                l_ready, qk_scale, q_ready, (Q, g, hb, T, H, HB, stride_qb, stride_qt, stride_qh), R)  # fmt: skip
        out_args = (OUT, LSE, SINKS, g, hb, T, H, HB, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
                    stride_lh)  # fmt: skip
        # the producer is the default partition (it gets what the consumers leave of the kernel's
        # registers): the default partition also holds the values of the code above, and a consumer
        # there spilled (``benchmarks/RESULTS.md``)
        gl.warp_specialize(
            [
                (_load, (args, out_args, D_V, D_R, HAS_SINK, PREFETCH_QK, EARLY_KV, OPAQUE_SLOTS, G, RAW_ROWS,
                         STAGED_OUT)),
                (_wg0, (args, out_args, D_V, D_R, HAS_SINK, PREFETCH_QK, EARLY_KV, OPAQUE_SLOTS, G, RAW_ROWS,
                         STAGED_OUT)),
                (_wg1, (args, out_args, D_V, D_R, HAS_SINK, PREFETCH_QK, EARLY_KV, OPAQUE_SLOTS, G, RAW_ROWS,
                         STAGED_OUT)),
            ],
            [4, 4],
            [CONSUMER_REGS, CONSUMER_REGS],
        )  # fmt: skip


def ws64_kernel():
    """The 64-key warp-specialised Gluon prefill kernel; needs Gluon."""
    return _sparse_mla_gluon_ws64_fwd
