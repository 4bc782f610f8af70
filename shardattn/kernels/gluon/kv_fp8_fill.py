"""The warp-specialised Gluon kernel's producer on ``fp8_ds_mla`` rows: each half key block's raw
bytes copied by cp.async into the half's own bf16 operand buffer and dequantised there, and the L2
prefetch of the rows to come.

The 656-byte row (:mod:`shardattn.ops.kv_fp8`): 512 e4m3 latent codes, four fp32 scales (one per
128 codes, each a power of two), 64 bf16 rope values. A half block (64 rows x 256 latent columns:
two scale tiles) takes 16 KB of codes and 512 B of scales, and its bf16 buffer holds 32 KB:
:func:`_issue_fp8` copies the codes into the buffer's upper 16 KB and the scales into its first
1 KB, as one cp.async commit group; :func:`_convert_fp8`, once they land, reads them into
registers, syncs the producer's 128 threads and writes the bf16 values over them. The producer
partition (4 warps) of :mod:`shardattn.kernels.gluon.sparse_mla_kernel` runs the pair in the order
:func:`~shardattn.kernels.gluon.sparse_mla_partitions._fill_pair_fp8` gives: each half's copy is
issued before the previous half is converted, so its latency hides behind that conversion.
"""

from __future__ import annotations

from shardattn.kernels.gluon.compat import HAS_GLUON
from shardattn.kernels.triton.kv_fp8_read import ROPE_OFFSET, ROW_BYTES, SCALE_OFFSET, TILE

#: Bytes the L2 prefetch asks for from a row's start rounded down to 16 (the instruction's
#: alignment): the row and the up to 16 bytes before it, a multiple of 16.
PREFETCH_BYTES = -(-(ROW_BYTES + 16) // 16) * 16

if HAS_GLUON:
    from shardattn.kernels.gluon.compat import async_load as _async_load
    from shardattn.kernels.gluon.compat import (
        cp,
        cta_barrier,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        reinterpret_smem,
    )
    from shardattn.kernels.gluon.e4m3 import e4m3_times_bf16

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
    def _prefetch_rows_l2(KV, rows, stride_kvr):
        """Ask the L2 for the ``fp8_ds_mla`` row of each of ``rows`` (``cp.async.bulk.prefetch.L2`` of
        :data:`PREFETCH_BYTES` (672) from the row's start rounded down to 16, as the instruction needs: no
        registers held, nothing waits on it); rows < 0 skipped; of the 8 lanes of
        :func:`~shardattn.kernels.gluon.sparse_mla_partitions._gather_layout` that share a row, the first issues it."""
        ptr = KV + rows.to(gl.int64) * stride_kvr
        gl.inline_asm_elementwise(_PREFETCH_ASM, "=r,l,r", [ptr, rows], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.constexpr_function
    def _byte_layout():
        """A plain row-major shared layout (no swizzle) for the raw bytes a half block's buffer holds
        before it is dequantised."""
        return gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])

    @gluon.constexpr_function
    def _scale_copy_layout():
        """``[64]`` fp32 scales copied by 4 warps (two threads a scale)."""
        return gl.BlockedLayout([1], [32], [4], [0])

    @gluon.jit
    def _codes_view(k_half):
        """The ``[64, 256]`` e4m3 codes of a half block, staged in the upper 16 KB of its ``[64, 256]``
        bf16 buffer."""
        return reinterpret_smem(k_half, gl.float8e4nv, [128, 256], _byte_layout()).slice(64, 64, dim=0)

    @gluon.jit
    def _scales_view(k_half, j: gl.constexpr):
        """The ``[64]`` fp32 scales of scale tile ``j`` (0, 1) of a half block's rows, staged in the first
        1 KB of its bf16 buffer (row ``r``'s at float ``128 j + r``)."""
        flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        return reinterpret_smem(k_half, gl.float32, [8192], flat).slice(128 * j, 64)

    @gluon.jit
    def _issue_fp8(k_half, k_rope, KV, rows, stride_kvr, ready, free, ph, col0: gl.constexpr, ROPE: gl.constexpr,
                   lay: gl.constexpr):  # fmt: skip
        """Once ``free`` (phase ``ph``) says the half's buffers are free, cp.async its raw bytes into its
        own buffer (:func:`_codes_view`, :func:`_scales_view`: rows < 0 read 0) and, with ``ROPE``, the
        rope columns into ``k_rope`` (counted by ``ready`` as they land), as one commit group;
        :func:`_convert_fp8` dequantises them in place."""
        lay8: gl.constexpr = _fp8_layout()
        mbarrier.wait(free, ph)
        if ROPE:
            d = gl.arange(0, 64, layout=gl.SliceLayout(0, lay))
            rope_row = (KV + rows.to(gl.int64) * stride_kvr + FP8_ROPE_OFFSET).to(gl.pointer_type(k_rope.dtype))
            _async_load(k_rope, rope_row[:, None] + d[None, :], mask=(rows >= 0)[:, None])
            cp.mbarrier_arrive(ready, increment_count=True)
        r = gl.convert_layout(rows, gl.SliceLayout(1, lay8))
        row = KV + r.to(gl.int64) * stride_kvr
        c = gl.arange(0, 2 * FP8_TILE, layout=gl.SliceLayout(0, lay8))
        codes = (row[:, None] + col0 + c[None, :]).to(gl.pointer_type(gl.float8e4nv))
        _async_load(_codes_view(k_half), codes, mask=(r >= 0)[:, None])
        rs = gl.convert_layout(rows, _scale_copy_layout())
        srow = KV + rs.to(gl.int64) * stride_kvr + FP8_SCALE_OFFSET + 4 * (col0 // FP8_TILE)
        _async_load(_scales_view(k_half, 0), srow.to(gl.pointer_type(gl.float32)), mask=rs >= 0)
        _async_load(_scales_view(k_half, 1), (srow + 4).to(gl.pointer_type(gl.float32)), mask=rs >= 0)
        cp.commit_group()

    @gluon.jit
    def _convert_fp8(k_half, ready, PENDING: gl.constexpr):
        """Dequantise the half block :func:`_issue_fp8` staged in ``k_half`` in place, once its copies
        have landed (``PENDING``: commit groups issued after its own, still allowed in flight): every
        producer thread reads its codes and scales, the partition syncs, then stores each code (exact
        in bf16, :func:`~shardattn.kernels.gluon.e4m3.e4m3_times_bf16`) times its tile's power-of-two
        scale, a bf16 multiply (exact: the same value as the fp32 product rounded,
        :func:`shardattn.ops.kv_fp8.dequantize_kv`'s), fenced for the async
        proxy; ``ready`` (128 arrivals) completes once every thread has stored."""
        lay8: gl.constexpr = _fp8_layout()
        cp.wait_group(PENDING)
        cta_barrier()  # every thread's copies visible to all
        codes = _codes_view(k_half)
        lo = codes.slice(0, FP8_TILE, dim=1).load(lay8)
        hi = codes.slice(FP8_TILE, FP8_TILE, dim=1).load(lay8)
        s_lo = _scales_view(k_half, 0).load(gl.SliceLayout(1, lay8)).to(k_half.dtype)
        s_hi = _scales_view(k_half, 1).load(gl.SliceLayout(1, lay8)).to(k_half.dtype)
        cta_barrier()  # every read done before the buffer is overwritten
        k_half.slice(0, FP8_TILE, dim=1).store(e4m3_times_bf16(lo, s_lo[:, None]))
        k_half.slice(FP8_TILE, FP8_TILE, dim=1).store(e4m3_times_bf16(hi, s_hi[:, None]))
        fence_async_shared()
        mbarrier.arrive(ready, count=128)  # after the partition's barrier: one thread for all 128
