"""Reading FP8 KV rows (``fp8_ds_mla``, :mod:`shardattn.ops.kv_fp8`) inside Triton kernels.

A row is ``ROW_BYTES = 656`` bytes: ``LATENT = 512`` e4m3 codes in ``LATENT / TILE = 4`` tiles,
one fp32 scale per tile at byte ``SCALE_OFFSET = 512``, ``ROPE = 64`` bf16 values at byte
``ROPE_OFFSET = 528``. The attention kernels that read such rows (``KV_FP8``) dequantise them in
registers to the dtype of their matrix multiplies before the multiplies, as FlashMLA's FP8 decode
does: ``value = dtype(fp32(code) * scale)``, which is exact in bf16 and fp32 for power-of-two
scales (the writer's), so an FP8 kernel multiplies the very values the bf16 kernel would read
from :func:`~shardattn.ops.kv_fp8.dequantize_kv`'s rows (a non-power-of-two scale rounds once,
in fp32 then to ``dtype``, as ``dequantize_kv`` does). Entries that are no key (``mask`` false)
read as 0.

The helpers take row pointers as ``uint8`` pointers (``KV + row * stride``, ``stride`` in
bytes) and are inlined into the kernels that call them (a scale tile at a time:
:mod:`~shardattn.kernels.triton.sparse_mla_fp8`); constants are the layout's (fixed here: the
kernels that take ``KV_FP8`` assert ``D_V == LATENT`` and ``D_R == ROPE``; the Gluon kernels
take the byte offsets from here).
"""

from __future__ import annotations

try:  # Triton is optional: without it the torch references run
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None

#: The ``fp8_ds_mla`` row layout (:data:`shardattn.ops.kv_fp8.FP8_DS_MLA`, tested equal).
LATENT, ROPE, TILE, SCALE_OFFSET, ROPE_OFFSET, ROW_BYTES = 512, 64, 128, 512, 528, 656

if triton is not None:
    _ROPE = tl.constexpr(ROPE)
    _TILE = tl.constexpr(TILE)
    _SCALE_OFFSET = tl.constexpr(SCALE_OFFSET)
    _ROPE_OFFSET = tl.constexpr(ROPE_OFFSET)

    @triton.jit
    def load_fp8_codes(row_ptr, mask, TILE_INDEX: tl.constexpr):
        """``(codes [N, TILE] e4m3, scale [N] fp32)`` of scale tile ``TILE_INDEX`` of the ``N`` rows at
        byte pointers ``row_ptr [N]``, as stored; rows where ``mask [N]`` is false read 0. The codes
        load 16 bytes a thread."""
        cols = tl.arange(0, _TILE)
        codes_ptr = (row_ptr + TILE_INDEX * _TILE).to(tl.pointer_type(tl.float8e4nv))
        codes = tl.load(codes_ptr[:, None] + cols[None, :], mask=mask[:, None], other=0.0)
        scale = tl.load((row_ptr + _SCALE_OFFSET + 4 * TILE_INDEX).to(tl.pointer_type(tl.float32)), mask=mask,
                        other=0.0)  # fmt: skip
        return codes, scale

    @triton.jit
    def dequant_fp8(codes, scale, dtype: tl.constexpr):
        """``codes [N, TILE]`` times their rows' ``scale [N]`` (``fp32(code) * scale``, then ``dtype``)."""
        return (codes.to(tl.float32) * scale[:, None]).to(dtype)

    @triton.jit
    def load_fp8_tile(row_ptr, mask, TILE_INDEX: tl.constexpr, dtype: tl.constexpr):
        """``[N, TILE]`` latent values of scale tile ``TILE_INDEX`` of the ``N`` rows at byte pointers
        ``row_ptr [N]``, dequantised (:func:`load_fp8_codes`, then :func:`dequant_fp8`); rows where
        ``mask [N]`` is false read 0."""
        codes, scale = load_fp8_codes(row_ptr, mask, TILE_INDEX)
        return dequant_fp8(codes, scale, dtype)

    @triton.jit
    def load_fp8_rope(row_ptr, mask, dtype: tl.constexpr):
        """``[N, ROPE]`` rope values (stored bf16) of the rows at ``row_ptr [N]`` in ``dtype``;
        rows where ``mask`` is false read 0."""
        rope_ptr = (row_ptr + _ROPE_OFFSET).to(tl.pointer_type(tl.bfloat16))
        rope = tl.load(rope_ptr[:, None] + tl.arange(0, _ROPE)[None, :], mask=mask[:, None], other=0.0)
        return rope.to(dtype)


__all__ = [
    "LATENT",
    "ROPE",
    "ROPE_OFFSET",
    "ROW_BYTES",
    "SCALE_OFFSET",
    "TILE",
    "dequant_fp8",
    "load_fp8_codes",
    "load_fp8_rope",
    "load_fp8_tile",
]
