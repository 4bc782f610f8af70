"""Warp-specialised Gluon sparse-MLA prefill for Hopper (sm_90) on 64-key blocks, FlashMLA's schedule.

One program owns one query token and 64 heads (128 heads: two programs per token) and walks the
token's sorted, de-duplicated rows (``union[t, :lens[t]]`` from
:func:`shardattn.ops.union.build_union`) as *pairs* of 64-key blocks. Two more modes share
the pipeline (compile-time; only the row ids the producer gathers and the keys each tile row
keeps change, :func:`_block_rows` / :func:`_block_keep`):

* **grouped** (``G = 2, 4, 8``): the tile's 64 rows are ``G`` consecutive queries x ``64 / G``
  heads; the program walks the group's union of packed entries (row in 24 bits, one membership
  bit per query above it) and each row keeps only its query's keys;
* **raw rows** (``RAW_ROWS``, decode): the program walks the caller's ``[T, K]`` rows in place,
  the first ``topk_length`` of them (all ``K`` without it), and masks each entry outside
  ``[0, R)``; no union build, no packing, a duplicate counts twice.

Per-query tiles may also cut each token's list into ``QS`` slices (decode's split-KV, a runtime
argument): tile ``g`` takes token ``g // QS``'s q and slice ``g % QS`` of its list, the caller's
``[T, QS * W]`` lists viewed as ``[T * QS, W]``, its length ``lens[g // QS] - (g % QS) * W``
clamped to ``[0, W]`` (:func:`_tile_len`); ``QS = 1`` is the plain kernel.

In both a pair's first block may hold no key for a row, so the online softmax reads a running
max of ``-inf`` as 0 there (:func:`_finite`). Three warpgroups (12 warps) share the work
through shared memory and mbarriers:

* **producer** (4 warps): gathers the pair's two blocks with ``cp.async`` into a one-pair ring,
  each block split in a left half (nope columns ``[0, Dv/2)``) and a right half (nope
  ``[Dv/2, Dv)`` plus rope), each half with its own ``ready`` / ``free`` mbarriers, in the order
  0L, 1R, 0R, 1L (each half is refilled as soon as its last reader releases it); on
  ``fp8_ds_mla`` rows (``KV_FP8``) it copies each half's raw bytes into the half's buffer and
  dequantises them there (:mod:`shardattn.kernels.gluon.kv_fp8_fill`);
* **consumer WG0** (block 0 of the pair, output columns ``[0, Dv/2)``): ``S0 = Q K0^T``, its row
  max ``m0`` (with the running max) to WG1, ``P0`` at ``m0``, ``O_L += P0 V0_L`` from registers
  (then 0L is free), waits for WG1's final max ``m1``, rescales ``P0`` to it and writes it into
  block 0's rope slot (``S0`` has read it), rescales ``O_L`` and adds ``P1 V1_L`` from shared
  memory;
* **consumer WG1** (block 1, columns ``[Dv/2, Dv)``): ``S1 = Q K1^T``, ``m1 = max(m0, rowmax S1)``
  to WG0, ``O_R += P1 V1_R`` from registers, ``P1`` to shared memory, ``O_R += P0 V0_R``.

The max travels one way per pair (WG0 -> WG1 -> WG0), so WG0's first ``P V`` runs while WG1 does
its softmax. The online softmax is the library's (base 2, running max shared by both warpgroups
after each pair, row sums combined at the end, sinks folded in after the loop, ``(0, -inf)`` for
an empty row); block 0 of a pair always holds a key, block 1 may be empty (masked past
``lens[t]``). q / out / lse use the (block, token, head) strides of
:mod:`shardattn.kernels.gluon.sparse_mla_epilogue` (head-blocked buffers in place).

The output is staged: each consumer warpgroup writes its normalised ``[64, Dv/2]`` output tile
into a key buffer it alone still reads (WG0 block 0's left half, WG1 block 1's right half: their
last reader was this warpgroup's final ``P V``), syncs its 128 threads and stores from there 16
bytes per thread; from the accumulator's registers a thread holds 4 bytes of a row, and every
32-byte sector of the output would be written in two halves. Other output dtypes (fp32 decode
partials) store from the registers.

``PERSISTENT``: one program per SM walks tiles ``p, p + P, ...`` (a token's head blocks adjacent
with ``HEADS_FASTEST``, else token groups fastest). Each partition runs the same tile loop; the
ring's and the pair barriers' phases run on across tiles (pair ``c0 + i`` of the program), the
row-sum exchange alternates two buffer / barrier sets between even and odd tiles (a warpgroup may
reach the next tile's exchange before the other has read this one's), and the producer gathers
the next tile's first pair while the consumers finish this one. Q is reloaded per tile by the
producer, after that first pair and once ``q_free`` (both consumers' epilogues) fires, since the
output is staged through Q's buffers (dead after the tile's last ``Q K^T``): staged in a key
buffer it would hold the slot the next tile's first gathers need. Per program this saves the
prologue (barrier set-up, the Q and first-pair latencies) and the epilogue's idle producer: at
64 heads a one-tile program spends about a tenth of its time in them (docs/PERFORMANCE.md).

The producer is the default partition and gets the registers the consumers leave (a consumer
there spilled more): 56 on bf16 rows, 104 on ``fp8_ds_mla`` rows, where it dequantises through
registers (``CONSUMER_REGS`` 224 or 200, :mod:`shardattn.kernels.gluon.sparse_mla`).
``EARLY_KV``: the producer loads Q too, so the gather starts without waiting for it;
``HEADS_FASTEST``: a 1-D grid with a token's head blocks adjacent. The consumers index their
buffers with a per-iteration opaque 0 so the wgmma descriptors are not hoisted out of the key loop
and spilled (:func:`~shardattn.kernels.gluon.sparse_mla_partitions._slot0`).

Shared memory (DSA shapes): Q 72 KB + 2 x 72 KB blocks + one 8 KB P buffer (block 0's P lives in
block 0's rope slot) + row maxima / sums and barriers = 231,184 B of sm_90's 232,448.
"""

from __future__ import annotations

from shardattn.kernels.gluon.compat import HAS_GLUON

if HAS_GLUON:
    from shardattn.kernels.gluon.compat import cp, fence_async_shared, gl, gluon, grid_dependency, mbarrier
    from shardattn.kernels.gluon.compat import cta_barrier as _cta_barrier
    from shardattn.kernels.gluon.compat import nvmma_layout as _nvmma
    from shardattn.kernels.gluon.sparse_mla_epilogue import _ws_epilogue_staged
    from shardattn.kernels.gluon.sparse_mla_partitions import _consumer0, _consumer1, _load_q, _producer

#: Launch arguments never specialised: the token count, the LSE head-block geometry (plain [T, H] and
#: head-blocked [B, T, H/B] share one compiled kernel), the row counts and the slices a token's rows
#: are cut into (one kernel for one slice and for several).
NOT_SPECIALIZED = ["T", "HB", "stride_lb", "stride_lt", "R", "K", "QS"]
#: Keys per block.
BLOCK_N = 64

if HAS_GLUON:

    @gluon.jit
    def _tile_len(LENS, K, g, QS, RAW_ROWS: gl.constexpr, HAS_LENS: gl.constexpr):
        """Entries of tile-row group ``g``'s row list of ``K``: slice ``g % QS`` of token ``g // QS``'s
        list, whose length is ``lens`` (raw rows: ``topk_length``, every entry without it), so
        ``lens[g // QS] - (g % QS) * K`` clamped to ``[0, K]`` (``lens[g]`` with one slice)."""
        if RAW_ROWS and not HAS_LENS:
            n_len = K
        else:
            gi = g.to(gl.int32)  # < 2**31 queries: 32-bit division (the 64-bit one spills in the FP8 producer)
            n_len = gl.minimum(gl.maximum(gl.load(LENS + gi // QS) - (gi % QS) * K, 0), K)
        return n_len

    @gluon.jit
    def _q_query(g, QS):
        """The query whose q tile-row group ``g`` reads: token ``g // QS`` of ``QS`` slices a token
        (int64, as ``g``: a token's offset in q may pass 2**31; the division in 32 bits, as the 64-bit
        one spills in the FP8 producer)."""
        return (g.to(gl.int32) // QS).to(gl.int64)

    @gluon.jit
    def _retile(args, out_args, pctx, tile, G: gl.constexpr, RAW_ROWS: gl.constexpr, HAS_LENS: gl.constexpr,
                HEADS_FASTEST: gl.constexpr):  # fmt: skip
        """``(args, out_args, pairs)`` of persistent tile ``tile``: token group and head block (a
        token's head blocks adjacent with ``HEADS_FASTEST``, else token groups fastest, as the grid
        of the one-tile kernel), its row list, length and pair count."""
        (UNION, LENS, stride_ug, K, QS, n_g, n_hb, _q_free, _first, _step, _n_tiles) = pctx
        if HEADS_FASTEST:
            g = (tile // n_hb).to(gl.int64)
            hb = tile % n_hb
        else:
            g = (tile % n_g).to(gl.int64)
            hb = tile // n_g
        n_len = _tile_len(LENS, K, g, QS, RAW_ROWS, HAS_LENS)
        n_pairs = gl.cdiv(gl.cdiv(n_len, 64), 2)
        (KV, _u, _n, stride_kvr, _np, q_l, q_r, q_rope, k_l, k_r, k_rope, p1_buf, m_buf, l_bufs, ready, free,
         m0_ready, m1_ready, p0_ready, p1_ready, l_ready, qk_scale, q_ready, q_src, R) = args  # fmt: skip
        (Q, _g, _hb, T_Q, H, HB, stride_qb, stride_qt, stride_qh) = q_src  # T_Q: q's tokens (T // QS)
        t_args = (KV, UNION + g * stride_ug, n_len, stride_kvr, n_pairs, q_l, q_r, q_rope, k_l, k_r, k_rope, p1_buf,
                  m_buf, l_bufs, ready, free, m0_ready, m1_ready, p0_ready, p1_ready, l_ready, qk_scale, q_ready,
                  (Q, _q_query(g, QS), hb, T_Q, H, HB, stride_qb, stride_qt, stride_qh), R)  # fmt: skip
        (OUT, LSE, SINKS, _g2, _hb2, T2, H2, HB2, sob, sot, soh, slb, slt, slh) = out_args
        return t_args, (OUT, LSE, SINKS, g, hb, T2, H2, HB2, sob, sot, soh, slb, slt, slh), n_pairs

    @gluon.jit
    def _consume_tile(args, out_args, stage, W: gl.constexpr, D_V: gl.constexpr, HAS_SINK: gl.constexpr,
                      EARLY_KV: gl.constexpr, G: gl.constexpr, RAW_ROWS: gl.constexpr, c0, j):  # fmt: skip
        """Consumer warpgroup ``W``'s work on one tile and its epilogue (staged through ``stage``)."""
        if W == 0:
            acc, m_i, l_i = _consumer0(args, D_V, EARLY_KV, G, RAW_ROWS, c0, j)
        else:
            acc, m_i, l_i = _consumer1(args, D_V, EARLY_KV, G, RAW_ROWS, c0, j)
        _ws_epilogue_staged(acc, m_i, l_i, out_args, stage, W, D_V, HAS_SINK, G)

    @gluon.jit
    def _wg(args, out_args, pctx, W: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr, HAS_SINK: gl.constexpr,
            EARLY_KV: gl.constexpr, G: gl.constexpr, RAW_ROWS: gl.constexpr, PERSISTENT: gl.constexpr,
            HAS_LENS: gl.constexpr, HEADS_FASTEST: gl.constexpr):  # fmt: skip
        """Consumer warpgroup ``W`` (0: block ``2i``, output columns ``[0, Dv/2)``; 1: block ``2i + 1``,
        ``[Dv/2, Dv)``). One tile: its output staged in the key buffer it alone still reads (WG0
        block 0's left half, WG1 block 1's right half). ``PERSISTENT``: tile after tile, the output
        staged in Q's half ``W`` (dead after the tile's last ``Q K^T``), then ``q_free``."""
        if PERSISTENT:
            (_U, _L, _s, _K, _qs, _ng, _nhb, q_free, first, step, n_tiles) = pctx
            c0 = first * 0
            j = first * 0
            for tile in range(first, n_tiles, step):
                t_args, t_out, n_pairs = _retile(args, out_args, pctx, tile, G, RAW_ROWS, HAS_LENS, HEADS_FASTEST)
                stage = args[5 + W].index(0)  # q_l / q_r
                _consume_tile(t_args, t_out, stage, W, D_V, HAS_SINK, True, G, RAW_ROWS, c0, j)
                mbarrier.arrive(q_free, count=1)
                c0 += n_pairs
                j += 1
        else:
            stage = args[8 + W].index(W)  # k_l[0] / k_r[1]
            _consume_tile(args, out_args, stage, W, D_V, HAS_SINK, EARLY_KV, G, RAW_ROWS, 0, 0)

    @gluon.jit
    def _load(args, out_args, pctx, D_V: gl.constexpr, D_R: gl.constexpr, HAS_SINK: gl.constexpr,
              EARLY_KV: gl.constexpr, G: gl.constexpr, RAW_ROWS: gl.constexpr, PERSISTENT: gl.constexpr,
              HAS_LENS: gl.constexpr, HEADS_FASTEST: gl.constexpr, KV_FP8: gl.constexpr):  # fmt: skip
        if PERSISTENT:
            (_U, _L, _s, _K, _qs, _ng, _nhb, q_free, first, step, n_tiles) = pctx
            c0 = first * 0
            j = first * 0
            for tile in range(first, n_tiles, step):
                t_args, _t_out, n_pairs = _retile(args, out_args, pctx, tile, G, RAW_ROWS, HAS_LENS, HEADS_FASTEST)
                _producer(t_args, D_V, D_R, True, G, RAW_ROWS, True, c0, j, q_free, KV_FP8)
                c0 += n_pairs
                j += 1
        else:
            _producer(args, D_V, D_R, EARLY_KV, G, RAW_ROWS, False, 0, 0, pctx[7], KV_FP8)

    @gluon.jit(do_not_specialize=NOT_SPECIALIZED)
    def _sparse_mla_gluon_ws64_fwd(
        Q, KV, UNION, LENS, SINKS, OUT, LSE,
        T, H, HB,
        stride_qb, stride_qt, stride_qh, stride_kvr, stride_ug,
        stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, stride_lh,
        qk_scale, R, K, QS,
        D_V: gl.constexpr, D_R: gl.constexpr, HAS_SINK: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, HEADS_FASTEST: gl.constexpr, EARLY_KV: gl.constexpr,
        G: gl.constexpr = 1, RAW_ROWS: gl.constexpr = False, HAS_LENS: gl.constexpr = True,
        PERSISTENT: gl.constexpr = False, KV_FP8: gl.constexpr = False, PDL: gl.constexpr = False,
    ):  # fmt: skip
        if PDL:  # a programmatic dependent launch: wait for the grid before it (it wrote q / rows),
            grid_dependency("griddepcontrol.wait")  # then let the one after it (the merge) launch
            grid_dependency("griddepcontrol.launch_dependents")  # (it waits for this grid to complete)
        dtype: gl.constexpr = Q.dtype.element_ty
        HALF: gl.constexpr = D_V // 2
        n_hb = gl.cdiv(H, 64 // G)
        if HEADS_FASTEST or PERSISTENT:  # 1-D grid, a token's head blocks adjacent
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
        l_bufs = gl.allocate_shared_memory(gl.float32, [4, 64], vec_l)  # [tile parity x warpgroup]
        bar_l: gl.constexpr = mbarrier.MBarrierLayout()
        ready = gl.allocate_shared_memory(gl.int64, [4, 1], bar_l)
        free = gl.allocate_shared_memory(gl.int64, [4, 1], bar_l)
        sync = gl.allocate_shared_memory(gl.int64, [4, 1], bar_l)  # m0, m1, P0, P1 ready
        l_ready = gl.allocate_shared_memory(gl.int64, [4, 1], bar_l)
        for s in gl.static_range(4):
            mbarrier.init(ready.index(s), count=128)  # one cp.async arrival per producer thread
            mbarrier.init(free.index(s), count=1)
        for s in gl.static_range(4):
            mbarrier.init(sync.index(s), count=1)
            mbarrier.init(l_ready.index(s), count=1)

        q_ready = gl.allocate_shared_memory(gl.int64, [1], bar_l)
        mbarrier.init(q_ready, count=128)  # EARLY_KV: one cp.async arrival per producer thread
        q_free = gl.allocate_shared_memory(gl.int64, [1], bar_l)
        mbarrier.init(q_free, count=2)  # PERSISTENT: both consumers' epilogues done with Q's buffers
        if not EARLY_KV and not PERSISTENT:  # Q by the 4 warps here, before the partitions start
            _load_q(q_l.index(0), Q, _q_query(g, QS), hb, T // QS, H, HB, stride_qb, stride_qt, stride_qh, 0, HALF, G)
            _load_q(
                q_r.index(0), Q, _q_query(g, QS), hb, T // QS, H, HB, stride_qb, stride_qt, stride_qh, HALF, HALF, G
            )
            _load_q(
                q_rope.index(0), Q, _q_query(g, QS), hb, T // QS, H, HB, stride_qb, stride_qt, stride_qh, D_V, D_R, G
            )
            cp.commit_group()
            cp.wait_group(0)
            fence_async_shared()
        _cta_barrier()

        n_len = _tile_len(LENS, K, g, QS, RAW_ROWS, HAS_LENS)
        n_pairs = gl.cdiv(gl.cdiv(n_len, 64), 2)
        q_src = (Q, _q_query(g, QS), hb, T // QS, H, HB, stride_qb, stride_qt, stride_qh)
        args = (KV, UNION + g * stride_ug, n_len, stride_kvr, n_pairs, q_l, q_r, q_rope, k_l, k_r, k_rope, p1_buf,
                m_buf, l_bufs, ready, free, sync.index(0), sync.index(1), sync.index(2), sync.index(3),
                l_ready, qk_scale, q_ready, q_src, R)  # fmt: skip
        out_args = (OUT, LSE, SINKS, g, hb, T, H, HB, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
                    stride_lh)  # fmt: skip
        # PERSISTENT: program p runs tiles p, p + P, ... of the n_g x n_hb tiles
        n_g = gl.cdiv(T, G)
        pctx = (UNION, LENS, stride_ug, K, QS, n_g, n_hb, q_free, gl.program_id(0), gl.num_programs(0), n_g * n_hb)
        # the producer is the default partition (it gets what the consumers leave of the kernel's
        # registers): the default partition also holds the values of the code above, and a consumer
        # there spilled (measured on an H200)
        gl.warp_specialize(
            [
                (_load, (args, out_args, pctx, D_V, D_R, HAS_SINK, EARLY_KV, G, RAW_ROWS, PERSISTENT, HAS_LENS,
                         HEADS_FASTEST, KV_FP8)),
                (_wg, (args, out_args, pctx, 0, D_V, D_R, HAS_SINK, EARLY_KV, G, RAW_ROWS, PERSISTENT, HAS_LENS,
                       HEADS_FASTEST)),
                (_wg, (args, out_args, pctx, 1, D_V, D_R, HAS_SINK, EARLY_KV, G, RAW_ROWS, PERSISTENT, HAS_LENS,
                       HEADS_FASTEST)),
            ],
            [4, 4],
            [CONSUMER_REGS, CONSUMER_REGS],
        )  # fmt: skip


def ws64_kernel():
    """The 64-key warp-specialised Gluon prefill kernel; needs Gluon."""
    return _sparse_mla_gluon_ws64_fwd
