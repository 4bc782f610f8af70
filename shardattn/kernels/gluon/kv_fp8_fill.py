"""The warp-specialised Gluon kernel's producer on ``fp8_ds_mla`` rows: one half key block dequantised
through registers into the bf16 operand buffers, and the L2 prefetch of the rows to come.

The 656-byte row (:mod:`shardattn.ops.kv_fp8`): 512 e4m3 latent codes, four fp32 scales (one per
128 codes, each a power of two), 64 bf16 rope values. :func:`_fill_fp8` runs in the producer
partition (4 warps) of :mod:`shardattn.kernels.gluon.sparse_mla_kernel`, once per half block, in
the order :func:`~shardattn.kernels.gluon.sparse_mla_partitions._fill_pair_fp8` gives.
"""

from __future__ import annotations

from shardattn.kernels.gluon.compat import HAS_GLUON
from shardattn.kernels.triton.kv_fp8_read import ROPE_OFFSET, ROW_BYTES, SCALE_OFFSET, TILE

#: Bytes the L2 prefetch asks for from a row's start rounded down to 16 (the instruction's
#: alignment): the row and the up to 16 bytes before it, a multiple of 16.
PREFETCH_BYTES = -(-(ROW_BYTES + 16) // 16) * 16

if HAS_GLUON:
    from shardattn.kernels.gluon.compat import async_load as _async_load
    from shardattn.kernels.gluon.compat import cp, fence_async_shared, gl, gluon, mbarrier

if HAS_GLUON:
    # the fp8_ds_mla row layout (shardattn.ops.kv_fp8): latent tile width, byte offsets of scales and rope
    FP8_TILE = gl.constexpr(TILE)
    FP8_SCALE_OFFSET = gl.constexpr(SCALE_OFFSET)
    FP8_ROPE_OFFSET = gl.constexpr(ROPE_OFFSET)
    # one lane in 8 (those sharing a row) asks for its row, when the row is a key
    _PREFETCH_ASM = gl.constexpr(
        "{ .reg .pred p, q; .reg .b32 l; .reg .b64 a; mov.u32 l, %laneid; and.b32 l, l, 7; "
        "setp.eq.u32 q, l, 0; setp.ge.s32 p, $2, 0; and.pred p, p, q; and.b64 a, $1, -16; "
        f"@p cp.async.bulk.prefetch.L2.global [a], {PREFETCH_BYTES}; mov.u32 $0, 0; }}"
    )

    @gluon.constexpr_function
    def _fp8_layout():
        """``[rows, 128]`` FP8 codes (one scale tile) by 4 warps: 8 threads x 16 bytes along the 128
        columns, 16 rows per pass (the rows' thread mapping is the producer's gather layout's,
        :func:`~shardattn.kernels.gluon.sparse_mla_partitions._gather_layout`)."""
        return gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])

    @gluon.jit
    def _fp8_tile_codes(row, ok, col0: gl.constexpr, lay: gl.constexpr):
        """The ``[64, 128]`` e4m3 codes of the scale tile at latent column ``col0`` of the rows at byte
        pointers ``row`` (``ok``: rows that are keys; others read 0), 16 bytes a load."""
        d = gl.arange(0, FP8_TILE, layout=gl.SliceLayout(0, lay))
        return gl.load((row[:, None] + col0 + d[None, :]).to(gl.pointer_type(gl.float8e4nv)), mask=ok[:, None],
                       other=0.0)  # fmt: skip

    @gluon.jit
    def _store_scaled(dst, codes, row, ok, col0: gl.constexpr):
        """``codes`` times their tile's fp32 scale (at column ``col0``), in ``dst``'s dtype, into ``dst``."""
        scale = gl.load((row + FP8_SCALE_OFFSET + 4 * (col0 // FP8_TILE)).to(gl.pointer_type(gl.float32)), mask=ok,
                        other=0.0)  # fmt: skip
        dst.store((codes.to(gl.float32) * scale[:, None]).to(dst.dtype))

    @gluon.jit
    def _fill_fp8(k_half, k_rope, KV, rows, stride_kvr, ready, free, ph, col0: gl.constexpr, ROPE: gl.constexpr,
                  lay: gl.constexpr):  # fmt: skip
        """One half of a key block from ``fp8_ds_mla`` rows (uint8 rows of ``stride_kvr`` bytes;
        ``rows`` in ``lay``'s row slice), latent columns ``[col0, col0 + 256)``, once ``free`` (phase
        ``ph``) says the half's buffers are free: with ``ROPE`` (a right half) the rope columns by
        cp.async (each thread's copies counted by ``ready`` as they land); the codes of both scale
        tiles into registers (16-byte loads, eight a thread, all in flight at once); each tile times
        its fp32 scale stored in ``k_half``'s dtype (rows < 0 read 0), fenced for the async proxy.
        ``ready`` (128 arrivals) completes once every producer thread's stores are fenced and its
        copies landed."""
        lay8: gl.constexpr = _fp8_layout()
        mbarrier.wait(free, ph)  # (codes loaded before the wait stay live across its loop: ptxas spills them)
        if ROPE:
            d = gl.arange(0, 64, layout=gl.SliceLayout(0, lay))
            rope_row = (KV + rows.to(gl.int64) * stride_kvr + FP8_ROPE_OFFSET).to(gl.pointer_type(k_rope.dtype))
            _async_load(k_rope, rope_row[:, None] + d[None, :], mask=(rows >= 0)[:, None])
            cp.mbarrier_arrive(ready, increment_count=True)
        r = gl.convert_layout(rows, gl.SliceLayout(1, lay8))
        row = KV + r.to(gl.int64) * stride_kvr
        ok = r >= 0
        lo = _fp8_tile_codes(row, ok, col0, lay8)
        hi = _fp8_tile_codes(row, ok, col0 + FP8_TILE, lay8)
        _store_scaled(k_half.slice(0, FP8_TILE, dim=1), lo, row, ok, col0)
        _store_scaled(k_half.slice(FP8_TILE, FP8_TILE, dim=1), hi, row, ok, col0 + FP8_TILE)
        fence_async_shared()
        mbarrier.arrive(ready, count=128)  # after the partition's barrier: one thread for all 128

    @gluon.jit
    def _prefetch_rows_l2(KV, rows, stride_kvr):
        """Ask the L2 for the ``fp8_ds_mla`` row of each of ``rows`` (``cp.async.bulk.prefetch.L2`` of
        :data:`PREFETCH_BYTES` (672) from the row's start rounded down to 16, as the instruction needs: no
        registers held, nothing waits on it); rows < 0 skipped; of the 8 lanes of
        :func:`~shardattn.kernels.gluon.sparse_mla_partitions._gather_layout` that share a row, the first issues it."""
        ptr = KV + rows.to(gl.int64) * stride_kvr
        gl.inline_asm_elementwise(_PREFETCH_ASM, "=r,l,r", [ptr, rows], dtype=gl.int32, is_pure=False, pack=1)
