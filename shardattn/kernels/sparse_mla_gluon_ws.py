"""Warp-specialised Gluon sparse-MLA prefill kernel for Hopper (sm_90), FlashMLA-style.

One program owns a 64-row tile: ``G`` consecutive query tokens (a group) times ``64 / G`` heads
(``G = 1``: one token and 64 heads, 128 heads take two programs per token; ``G = 2 / 4 / 8``: the
grouped path for 32 / 16 / 8 heads). Three warpgroups (12 warps) share the work through shared
memory and mbarriers:

* **producer** (4 warps): gathers the group's KV rows (``union[g, :lens[g]]``, sorted unique,
  from :func:`shardattn.kernels.union.build_union`; with ``G > 1`` each entry packs the row in
  24 bits and one membership bit per query above it) ``BLOCK_N`` at a time with
  ``cp.async`` into a 4-slot ring (nope ``[BLOCK_N, Dv]`` + rope ``[BLOCK_N, Dr]`` per slot),
  keeps two blocks in flight and marks each ready once its copies landed;
* **consumer WG0 / WG1** (4 warps each): key blocks go in pairs, block ``2i`` to WG0 and
  ``2i + 1`` to WG1. Each computes its full ``S = Q K^T`` (``[64, BLOCK_N]``, Q in shared
  memory), the two exchange their row maxima (so both scale by the same running max), each
  writes its ``P`` to shared memory and keeps ``O[:, half]`` (``[64, Dv / 2]`` fp32) for its half
  of the value columns: ``O_w += P_own V_own[:, half_w] + P_other V_other[:, half_w]``.

With ``G > 1`` each tile row masks the keys its query did not pick through its membership bit
(the consumers read the block's entries beside the gather), exactly as the Triton grouped kernel.
The online softmax is the library's (base 2, running max shared by both warpgroups, the row
sums combined at the end, sinks folded in after the loop, ``(0, -inf)`` for an empty row; a
row whose query has no key in a block yet stays at ``-inf`` without NaNs).

``q``, ``out`` and ``lse`` are addressed with (block, token, head) strides and ``HB`` heads per
block, so head-blocked ``[B, T, H/B, ...]`` buffers (an all-to-all buffer read or written in
place) run as they are: head ``h`` of token ``t`` sits at ``t * st + (h // HB) * sb + (h % HB) * sh``
(plain ``[T, H, ...]`` tensors: ``HB = H``, block 0).
Shared memory (DSA shapes, ``BLOCK_N = 32``): Q 72 KB + 4 x 36 KB ring + 2 x 4 KB P buffers.
"""

from __future__ import annotations

from shardattn.kernels.gluon_compat import HAS_GLUON as HAS_GLUON_WS

if HAS_GLUON_WS:
    from shardattn.kernels.gluon_compat import async_load as _async_load
    from shardattn.kernels.gluon_compat import (
        cp,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )
    from shardattn.kernels.gluon_compat import cta_barrier as _cta_barrier
    from shardattn.kernels.gluon_compat import nvmma_layout as _nvmma

#: Warps of the default partition (consumer WG0); the workers are consumer WG1 and the producer,
#: 4 warps each. Registers per thread of the workers (``WG1_REGS``, ``LOAD_REGS``); the default
#: partition gets what the kernel's ``maxnreg`` leaves.
WS_NUM_WARPS = 4
WS_MAXNREG = 168
#: (WG1_REGS, LOAD_REGS): the fewest spills found in the compiled kernel (sm_90, Triton 3.6);
#: the default partition gets ``3 * WS_MAXNREG - WG1_REGS - LOAD_REGS``.
WS_REGS = (224, 56)
#: Launch arguments the launcher never specialises: the token count and the head-block geometry of
#: the LSE (plain ``[T, H]`` and head-blocked ``[B, T, H/B]`` then share one compiled kernel).
NOT_SPECIALIZED = ["T", "HB", "stride_lb", "stride_lt"]

if HAS_GLUON_WS:

    @gluon.constexpr_function
    def _gather4(inner: int):
        """``[rows, inner]`` gathers by 4 warps: 16-byte vectors, a warp along a row."""
        tpc = min(32, inner // 8)
        return gl.BlockedLayout([1, 8], [32 // tpc, tpc], [4, 1], [1, 0])

    @gluon.jit
    def _ws_rows(u_base, n_len, k, BLOCK_N: gl.constexpr, G: gl.constexpr, lay: gl.constexpr):
        """Row ids of block ``k`` in the slice layout of ``lay`` (-1 past ``n_len``; ``G > 1``:
        the 24-bit row of each packed entry)."""
        n = k * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, lay))
        e = gl.load(u_base + n, mask=n < n_len, other=-1)
        if G > 1:
            e = gl.where(n < n_len, e & 0xFFFFFF, -1)
        return e

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
    def _ws_producer(
        args, BLOCK_N: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr, ASYNC_ARRIVE: gl.constexpr, G: gl.constexpr
    ):
        (KV, u_base, n_len, stride_kvr, n_pairs, _q_nope, _q_rope, nope_ring, rope_ring, _p_bufs, _mx_bufs, _l_bufs,
         ready, free, _mx_ready, _p_ready, _l_ready, _qk_scale) = args  # fmt: skip
        lv: gl.constexpr = _gather4(D_V)
        lr: gl.constexpr = _gather4(D_R)
        dv = gl.arange(0, D_V, layout=gl.SliceLayout(0, lv))
        dr = gl.arange(0, D_R, layout=gl.SliceLayout(0, lr))
        # row ids of the next block are loaded one block ahead (their latency hides behind a block)
        rv = _ws_rows(u_base, n_len, 0, BLOCK_N, G, lv)
        rr = _ws_rows(u_base, n_len, 0, BLOCK_N, G, lr)
        for k in range(2 * n_pairs):
            i = k // 2
            slot = k % 2 + 2 * (i % 2)
            rv_next = _ws_rows(u_base, n_len, k + 1, BLOCK_N, G, lv)
            rr_next = _ws_rows(u_base, n_len, k + 1, BLOCK_N, G, lr)
            mbarrier.wait(free.index(slot), ((i // 2) & 1) ^ 1)
            _async_load(
                nope_ring.index(slot), KV + rv.to(gl.int64)[:, None] * stride_kvr + dv[None, :], mask=(rv >= 0)[:, None]
            )
            _async_load(
                rope_ring.index(slot),
                KV + rr.to(gl.int64)[:, None] * stride_kvr + D_V + dr[None, :],
                mask=(rr >= 0)[:, None],
            )
            if ASYNC_ARRIVE:  # each thread's arrival fires when its copies land (ready counts 128)
                cp.mbarrier_arrive(ready.index(slot), increment_count=False)
            else:
                cp.commit_group()
                if k > 0:  # block k - 1 has landed: publish it (two blocks stay in flight)
                    cp.wait_group(1)
                    fence_async_shared()
                    pk = k - 1
                    mbarrier.arrive(ready.index(pk % 2 + 2 * ((pk // 2) % 2)), count=1)
            rv = rv_next
            rr = rr_next
        if not ASYNC_ARRIVE:
            if n_pairs > 0:
                cp.wait_group(0)
                fence_async_shared()
                pk = 2 * n_pairs - 1
                mbarrier.arrive(ready.index(pk % 2 + 2 * ((pk // 2) % 2)), count=1)

    @gluon.jit
    def _ws_qk(q_nope, q_rope, nope_ring, rope_ring, ready, slot, phase, s_zero):
        """Wait for ring slot ``slot`` and issue ``S = Q K^T`` on it (async; two wgmma groups)."""
        mbarrier.wait(ready.index(slot), phase)
        s = warpgroup_mma(q_nope, nope_ring.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        return warpgroup_mma(q_rope, rope_ring.index(slot).permute((1, 0)), s, is_async=True)

    @gluon.jit
    def _ws_consumer(
        args, W: gl.constexpr, BLOCK_N: gl.constexpr, D_V: gl.constexpr, PREFETCH_QK: gl.constexpr, G: gl.constexpr
    ):
        """Consumer warpgroup ``W``: blocks ``2i + W``; returns ``(acc, m_i, l_i)`` (its value half).

        ``G > 1``: tile row ``m`` belongs to query ``m // (64 / G)`` of the group and keeps a key
        only where that query's membership bit is set in the key's union entry.

        ``PREFETCH_QK``: issue the next pair's ``S`` before waiting for this pair's ``P V``, so the
        tensor cores run it while this warpgroup hands its slots back.
        """
        (_KV, u_base, n_len, _stride_kvr, n_pairs, q_nope, q_rope, nope_ring, rope_ring, p_bufs, mx_bufs, l_bufs,
         ready, free, mx_ready, p_ready, l_ready, qk_scale) = args  # fmt: skip
        HALF: gl.constexpr = D_V // 2
        dtype: gl.constexpr = q_nope.dtype
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        mma_o: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16]
        )
        p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
        row_l: gl.constexpr = gl.SliceLayout(1, mma_s)
        m_i = gl.full([64], float("-inf"), gl.float32, layout=row_l)
        l_i = gl.zeros([64], gl.float32, layout=row_l)
        acc = gl.zeros([64, HALF], gl.float32, layout=mma_o)
        s_zero = gl.zeros([64, BLOCK_N], gl.float32, layout=mma_s)
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_s))
        qj = gl.arange(0, 64, layout=row_l) // (64 // G)  # query of the group per tile row
        s_next = warpgroup_mma_init(s_zero)  # the async-accumulator type, carried through the loop
        if PREFETCH_QK:
            if n_pairs > 0:
                s_next = _ws_qk(q_nope, q_rope, nope_ring, rope_ring, ready, W, 0, s_zero)
        for i in range(n_pairs):
            par = i % 2
            own = W + 2 * par
            other = (1 - W) + 2 * par
            ph_pair = i & 1
            n = (2 * i + W) * BLOCK_N + cols
            if G > 1:  # the block's entries (membership bits), read while the gather lands
                bits = (gl.load(u_base + n, mask=n < n_len, other=0) >> 24) & 0xFF
            if PREFETCH_QK:
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s_next,))
            else:
                s = _ws_qk(q_nope, q_rope, nope_ring, rope_ring, ready, own, (i // 2) & 1, s_zero)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            if G > 1:
                member = ((bits[None, :] >> qj[:, None]) & 1) != 0
            else:
                member = (n < n_len)[None, :]
            s = gl.where(member, s * qk_scale, float("-inf"))
            m_loc = gl.max(s, axis=1)
            mx_bufs.index(W).store(m_loc)
            mbarrier.arrive(mx_ready.index(W), count=1)
            mbarrier.wait(mx_ready.index(1 - W), ph_pair)
            m_oth = mx_bufs.index(1 - W).load(row_l)
            m_new = gl.maximum(m_i, gl.maximum(m_loc, m_oth))  # G = 1: finite (block 2i holds a key)
            if G > 1:  # a query with no key so far stays at -inf: scale by 0, not NaN
                m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_use = m_new
            p = gl.exp2(s - m_use[:, None])
            alpha = gl.exp2(m_i - m_use)
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            pb = p.to(dtype)
            p_bufs.index(W).store(pb)
            fence_async_shared()
            mbarrier.arrive(p_ready.index(W), count=1)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, mma_o))[:, None]
            v_own = nope_ring.index(own).slice(W * HALF, HALF, dim=1)
            acc_o = warpgroup_mma(gl.convert_layout(pb, p_op), v_own, acc, is_async=True)
            mbarrier.wait(p_ready.index(1 - W), ph_pair)
            v_oth = nope_ring.index(other).slice(W * HALF, HALF, dim=1)
            acc_t = warpgroup_mma(p_bufs.index(1 - W), v_oth, acc_o, is_async=True)
            if PREFETCH_QK:
                if i + 1 < n_pairs:  # next pair's S runs behind this P V; wait for the P V only
                    nxt = W + 2 * ((i + 1) % 2)
                    s_next = _ws_qk(q_nope, q_rope, nope_ring, rope_ring, ready, nxt, ((i + 1) // 2) & 1, s_zero)
                    acc = warpgroup_mma_wait(num_outstanding=2, deps=(acc_t,))
                else:
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_t,))
            else:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_t,))
            mbarrier.arrive(free.index(own), count=1)
            mbarrier.arrive(free.index(other), count=1)
        # combine the row sums of both warpgroups
        l_bufs.index(W).store(l_i)
        mbarrier.arrive(l_ready.index(W), count=1)
        mbarrier.wait(l_ready.index(1 - W), 0)
        l_i = l_i + l_bufs.index(1 - W).load(row_l)
        return acc, m_i, l_i

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
        has = l_i > 0.0
        l_safe = gl.where(has, l_i, 1.0)
        if W == 0:
            lse = gl.where(has, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
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
    def _ws_epilogue(acc, m_i, l_i, out_args, W: gl.constexpr, D_V: gl.constexpr, HAS_SINK: gl.constexpr,
                     G: gl.constexpr):  # fmt: skip
        """Sinks, LSE and warpgroup ``W``'s output columns, stored from the accumulator's registers."""
        _store_from_registers(_ws_finish(acc, m_i, l_i, out_args, W, HAS_SINK, G), out_args, W, D_V, G)

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

    @gluon.jit
    def _ws_default(args, out_args, BLOCK_N: gl.constexpr, D_R: gl.constexpr, D_V: gl.constexpr,
                    HAS_SINK: gl.constexpr, ASYNC_ARRIVE: gl.constexpr, PREFETCH_QK: gl.constexpr,
                    G: gl.constexpr):  # fmt: skip
        acc, m_i, l_i = _ws_consumer(args, 0, BLOCK_N, D_V, PREFETCH_QK, G)
        _ws_epilogue(acc, m_i, l_i, out_args, 0, D_V, HAS_SINK, G)

    @gluon.jit
    def _ws_second(args, out_args, BLOCK_N: gl.constexpr, D_R: gl.constexpr, D_V: gl.constexpr,
                   HAS_SINK: gl.constexpr, ASYNC_ARRIVE: gl.constexpr, PREFETCH_QK: gl.constexpr,
                   G: gl.constexpr):  # fmt: skip
        acc, m_i, l_i = _ws_consumer(args, 1, BLOCK_N, D_V, PREFETCH_QK, G)
        _ws_epilogue(acc, m_i, l_i, out_args, 1, D_V, HAS_SINK, G)

    @gluon.jit
    def _ws_load(args, out_args, BLOCK_N: gl.constexpr, D_R: gl.constexpr, D_V: gl.constexpr,
                 HAS_SINK: gl.constexpr, ASYNC_ARRIVE: gl.constexpr, PREFETCH_QK: gl.constexpr,
                 G: gl.constexpr):  # fmt: skip
        _ws_producer(args, BLOCK_N, D_V, D_R, ASYNC_ARRIVE, G)

    @gluon.jit(do_not_specialize=NOT_SPECIALIZED)
    def _sparse_mla_gluon_ws_fwd(
        Q, KV, UNION, LENS, SINKS, OUT, LSE,
        T, H, HB,
        stride_qb, stride_qt, stride_qh, stride_kvr, stride_ug,
        stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, stride_lh,
        qk_scale,
        G: gl.constexpr, BLOCK_N: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr, HAS_SINK: gl.constexpr,
        WG1_REGS: gl.constexpr, LOAD_REGS: gl.constexpr, ASYNC_ARRIVE: gl.constexpr, PREFETCH_QK: gl.constexpr,
        HEADS_FASTEST: gl.constexpr,
    ):  # fmt: skip
        dtype: gl.constexpr = Q.dtype.element_ty
        HPB: gl.constexpr = 64 // G
        if HEADS_FASTEST:  # 1-D grid, a group's head blocks adjacent: the second one finds its rows in L2
            n_hb = gl.cdiv(H, HPB)
            pid = gl.program_id(0)
            g = (pid // n_hb).to(gl.int64)
            hb = pid % n_hb
        else:
            g = gl.program_id(0).to(gl.int64)
            hb = gl.program_id(1)
        q_nope = gl.allocate_shared_memory(dtype, [64, D_V], _nvmma(D_V, 16))
        q_rope = gl.allocate_shared_memory(dtype, [64, D_R], _nvmma(D_R, 16))
        nope_ring = gl.allocate_shared_memory(dtype, [4, BLOCK_N, D_V], _nvmma(D_V, 16))
        rope_ring = gl.allocate_shared_memory(dtype, [4, BLOCK_N, D_R], _nvmma(D_R, 16))
        p_bufs = gl.allocate_shared_memory(dtype, [2, 64, BLOCK_N], _nvmma(BLOCK_N, 16))
        vec_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        mx_bufs = gl.allocate_shared_memory(gl.float32, [2, 64], vec_l)
        l_bufs = gl.allocate_shared_memory(gl.float32, [2, 64], vec_l)
        bar_l: gl.constexpr = mbarrier.MBarrierLayout()
        ready = gl.allocate_shared_memory(gl.int64, [4, 1], bar_l)
        free = gl.allocate_shared_memory(gl.int64, [4, 1], bar_l)
        mx_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
        p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
        l_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
        for s in gl.static_range(4):
            mbarrier.init(ready.index(s), count=128 if ASYNC_ARRIVE else 1)
            mbarrier.init(free.index(s), count=2)
        for w in gl.static_range(2):
            mbarrier.init(mx_ready.index(w), count=1)
            mbarrier.init(p_ready.index(w), count=1)
            mbarrier.init(l_ready.index(w), count=1)

        # Q (rows past H or T zero-filled) by the 4 warps of the parent region
        lv: gl.constexpr = _gather4(D_V)
        lr: gl.constexpr = _gather4(D_R)
        t_v, blk_v, hin_v, _h, ok_v = _tile_rows(g, hb, T, H, HB, G, gl.SliceLayout(1, lv))
        row_v = t_v * stride_qt + blk_v * stride_qb + hin_v.to(gl.int64) * stride_qh
        dv = gl.arange(0, D_V, layout=gl.SliceLayout(0, lv))
        _async_load(q_nope, Q + row_v[:, None] + dv[None, :], mask=ok_v[:, None])
        t_r, blk_r, hin_r, _h, ok_r = _tile_rows(g, hb, T, H, HB, G, gl.SliceLayout(1, lr))
        row_r = t_r * stride_qt + blk_r * stride_qb + hin_r.to(gl.int64) * stride_qh
        dr = gl.arange(0, D_R, layout=gl.SliceLayout(0, lr))
        _async_load(q_rope, Q + row_r[:, None] + D_V + dr[None, :], mask=ok_r[:, None])
        cp.commit_group()
        cp.wait_group(0)
        fence_async_shared()
        _cta_barrier()

        n_len = gl.load(LENS + g)
        n_pairs = gl.cdiv(gl.cdiv(n_len, BLOCK_N), 2)
        u_base = UNION + g * stride_ug
        args = (KV, u_base, n_len, stride_kvr, n_pairs, q_nope, q_rope, nope_ring, rope_ring, p_bufs, mx_bufs,
                l_bufs, ready, free, mx_ready, p_ready, l_ready, qk_scale)  # fmt: skip
        out_args = (OUT, LSE, SINKS, g, hb, T, H, HB, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
                    stride_lh)  # fmt: skip
        # the argument tuples are written out so their constexprs stay constexprs
        gl.warp_specialize(
            [
                (_ws_default, (args, out_args, BLOCK_N, D_R, D_V, HAS_SINK, ASYNC_ARRIVE, PREFETCH_QK, G)),
                (_ws_second, (args, out_args, BLOCK_N, D_R, D_V, HAS_SINK, ASYNC_ARRIVE, PREFETCH_QK, G)),
                (_ws_load, (args, out_args, BLOCK_N, D_R, D_V, HAS_SINK, ASYNC_ARRIVE, PREFETCH_QK, G)),
            ],
            [4, 4],
            [WG1_REGS, LOAD_REGS],
        )  # fmt: skip


def ws_kernel():
    """The warp-specialised Gluon prefill kernel; needs Gluon."""
    return _sparse_mla_gluon_ws_fwd
