"""Triton kernel writing KV rows quantised to the FP8 row format into a cache (FlashMLA's
``V32_FP8Sparse``, vLLM's ``fp8_ds_mla``; the format, its rules and the torch reference:
:mod:`shardattn.ops.kv_fp8`).

One program quantises one input row and stores its bytes at its slot: the latent values as
``TILE``-wide tiles of e4m3 codes, one fp32 power-of-two scale per tile, the rope values as bf16.
The float-to-e4m3 and float-to-bf16 roundings are written with integer operations (round to
nearest, ties to even), not as casts: Triton's interpreter rounds fp8 casts differently from the
hardware (ties away from even, no subnormals; seen with Triton 3.9), and this way the kernel the
interpreter tests is bit for bit the kernel the GPU runs. No division, no ``log2``: the scale's
exponent comes from the bits of the tile's largest finite magnitude.

Non-finite inputs (the rule is the reference's): NaN is stored as +0; +-inf as +-448 x the tile's
scale in the latent and as +- the largest finite rope magnitude of the row in the rope; a
scale comes from the finite values only. Capture-safe: no host synchronisation, no allocation.
"""

from __future__ import annotations

import torch

from shardattn.kernels.backend import COMPILE_OPTIONS

try:  # Triton is optional: without it the torch reference runs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None

#: The largest finite float8_e4m3fn magnitude.
E4M3_MAX = 448.0
#: The largest finite bfloat16 magnitude (exactly representable in fp32).
BF16_MAX = 3.3895313892515355e38
#: The largest scale exponent the writer picks (``2 ** 120``), and the e4m3 value an infinity
#: saturates to at that scale: 240 x ``2 ** 120`` is the largest finite product there (448 x
#: ``2 ** 120`` is past fp32); below it an infinity saturates to 448.
TOP_SCALE_EXP = 120
TOP_SCALE_SAT = 240.0


def launch_write_fp8_rows(
    latent: torch.Tensor,
    rope: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor | None,
    status: torch.Tensor | None,
    *,
    capacity: int,
    page_size: int,
    stride_page: int,
    stride_slot: int,
    tile: int,
    scale_offset: int,
    rope_offset: int,
    min_scale_exp: int,
    num_warps: int = 2,
) -> None:
    """Launch the write kernel on validated tensors (no checks, no allocation, no sync).

    Args:
        latent: ``[R, L]`` fp16/bf16/fp32 latent values (last dim contiguous; ``L`` a multiple
            of ``tile``, ``L / tile`` and ``tile`` powers of two).
        rope: ``[R, P]`` rope values in ``latent``'s dtype (last dim contiguous, ``P`` a power
            of two); may be a view into the same tensor as ``latent``.
        cache: uint8 rows (any shape), written in place; row ``s`` starts at byte
            ``(s // page_size) * stride_page + (s % page_size) * stride_slot``.
        slots: ``[R]`` int32/int64 destination rows, or ``None`` for ``slots[i] = i``; a slot
            outside ``[0, capacity)`` (``-1`` included) is not written.
        status: ``[R]`` int32 written per row (0 stored, 1 stored with non-finite values
            replaced, 2 not stored), or ``None``.
        capacity: rows the cache holds. page_size, stride_page, stride_slot: its addressing (bytes).
        tile: latent values per scale. scale_offset, rope_offset: byte offsets within a row.
        min_scale_exp: the smallest scale exponent (scales are ``2 ** k``, ``k >= min_scale_exp``).
        num_warps: warps of one program.
    """
    rows = latent.shape[0]
    if rows == 0:
        return
    width = latent.shape[1]
    _write_fp8_rows_kernel[(rows,)](
        latent,
        rope,
        slots if slots is not None else latent,  # not read without HAS_SLOTS
        cache,
        status if status is not None else latent,  # not written without HAS_STATUS
        capacity,
        page_size,
        latent.stride(0),
        rope.stride(0),
        stride_page,
        stride_slot,
        NUM_TILES=width // tile,
        TILE=tile,
        ROPE=rope.shape[1],
        SCALE_OFFSET=scale_offset,
        ROPE_OFFSET=rope_offset,
        MIN_SCALE_EXP=min_scale_exp,
        TOP_EXP=TOP_SCALE_EXP,
        TOP_SAT=TOP_SCALE_SAT,
        HAS_SLOTS=slots is not None,
        HAS_STATUS=status is not None,
        num_warps=num_warps,
        **COMPILE_OPTIONS,
    )


if triton is not None:

    @triton.jit
    def _e4m3_code(y):
        """float8_e4m3fn code (int32 in [0, 255]) of fp32 ``y``, finite and ``|y| <= 448``, rounded
        to nearest, ties to even; -0.0 gives 0x80.

        Normal results (``|y| >= 2**-6``): rebias the exponent (127 -> 7) and round the 23-bit
        mantissa to 3 bits by adding ``0x7FFFF`` plus the kept mantissa's lowest bit, then shift.
        Subnormal results: ``|y| + 2**14`` rounds ``|y|`` to a multiple of ``2**-9`` (the fp32
        spacing at ``2**14``, the e4m3 subnormal step) by IEEE addition; the rounded value's bits
        minus those of ``2**14`` count the steps (0..8; 8 is ``2**-6``, the first normal code).
        """
        bits = y.to(tl.int32, bitcast=True)
        mag = bits & 0x7FFFFFFF
        normal = (mag - (120 << 23) + 0x7FFFF + ((mag >> 20) & 1)) >> 20
        subnormal = (tl.abs(y) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
        code = tl.where(mag < (121 << 23), subnormal, normal)
        return code | tl.where(bits < 0, 0x80, 0)

    @triton.jit
    def _bf16_bits(v):
        """bfloat16 bits (int32 in [0, 65535]) of fp32 ``v``, finite and ``|v| <= BF16_MAX``, rounded
        to nearest, ties to even (the sign kept, -0.0 included)."""
        bits = v.to(tl.int32, bitcast=True)
        mag = bits & 0x7FFFFFFF
        rounded = (mag + 0x7FFF + ((mag >> 16) & 1)) >> 16
        return rounded | tl.where(bits < 0, 0x8000, 0)

    @triton.jit
    def _stored(slot, offsets, capacity):
        """``offsets``-shaped mask: ``slot`` is in ``[0, capacity)``. Built per element: the
        interpreter rejects a scalar condition broadcast into a store mask (Triton 3.9)."""
        s = offsets.to(tl.int64) * 0 + slot
        return (s >= 0) & (s < capacity)

    @triton.jit
    def _write_fp8_rows_kernel(
        Latent,
        Rope,
        Slots,
        Cache,
        Status,
        capacity,
        page_size,
        stride_latent_r,
        stride_rope_r,
        stride_cache_page,
        stride_cache_slot,
        NUM_TILES: tl.constexpr,
        TILE: tl.constexpr,
        ROPE: tl.constexpr,
        SCALE_OFFSET: tl.constexpr,
        ROPE_OFFSET: tl.constexpr,
        MIN_SCALE_EXP: tl.constexpr,
        TOP_EXP: tl.constexpr,
        TOP_SAT: tl.constexpr,
        HAS_SLOTS: tl.constexpr,
        HAS_STATUS: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64)
        if HAS_SLOTS:
            slot = tl.load(Slots + r).to(tl.int64)
        else:
            slot = r
        stored = (slot >= 0) & (slot < capacity)
        safe = tl.where(stored, slot, 0)
        row = Cache + (safe // page_size) * stride_cache_page + (safe % page_size) * stride_cache_slot

        # latent: NUM_TILES x TILE values, one power-of-two scale per tile
        tiles = tl.arange(0, NUM_TILES)
        cols = tiles[:, None] * TILE + tl.arange(0, TILE)[None, :]
        x = tl.load(Latent + r * stride_latent_r + cols).to(tl.float32)
        x_mag = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        x_nan = x_mag > 0x7F800000
        x_inf = x_mag == 0x7F800000
        amax = tl.max(tl.where(x_nan | x_inf, 0.0, tl.abs(x)), axis=1)
        # scale = 2**k, the least k with 448 * 2**k >= amax (448 = 1.75 * 2**8), k >= MIN_SCALE_EXP
        a_bits = amax.to(tl.int32, bitcast=True)
        k = (a_bits >> 23) - 135 + ((a_bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        k = tl.maximum(k, MIN_SCALE_EXP)
        scale = ((k + 127) << 23).to(tl.float32, bitcast=True)
        inv_scale = ((127 - k) << 23).to(tl.float32, bitcast=True)
        y = x * inv_scale[:, None]  # exact: a power of two
        y = tl.where(x_nan, 0.0, y)
        sat = tl.where(k >= TOP_EXP, TOP_SAT, 448.0)[:, None]  # finite once dequantised
        y = tl.where(x_inf, tl.where(x > 0, sat, -sat), y)
        tl.store(row + cols, _e4m3_code(y).to(tl.uint8), mask=_stored(slot, cols, capacity))
        scale_ptrs = (row + SCALE_OFFSET).to(tl.pointer_type(tl.float32)) + tiles
        tl.store(scale_ptrs, scale, mask=_stored(slot, tiles, capacity))

        # rope: bf16, not quantised
        d = tl.arange(0, ROPE)
        v = tl.load(Rope + r * stride_rope_r + d).to(tl.float32)
        v_mag = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        v_nan = v_mag > 0x7F800000
        v_inf = v_mag == 0x7F800000
        v_max = tl.max(tl.where(v_nan | v_inf, 0.0, tl.abs(v)), axis=0)
        v = tl.where(v_nan, 0.0, tl.where(v_inf, tl.where(v > 0, v_max, -v_max), v))
        v = tl.minimum(tl.maximum(v, -3.3895313892515355e38), 3.3895313892515355e38)
        rope_ptrs = (row + ROPE_OFFSET).to(tl.pointer_type(tl.int16)) + d
        tl.store(rope_ptrs, _bf16_bits(v).to(tl.int16), mask=_stored(slot, d, capacity))

        if HAS_STATUS:
            bad_latent = tl.max(tl.max((x_nan | x_inf).to(tl.int32), axis=1), axis=0)
            bad_rope = tl.max((v_nan | v_inf).to(tl.int32), axis=0)
            tl.store(Status + r, tl.where(stored, tl.maximum(bad_latent, bad_rope), 2))
