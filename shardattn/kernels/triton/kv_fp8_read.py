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
bytes) and are inlined into the kernels that call them; constants are the layout's (fixed here:
the kernels that take ``KV_FP8`` assert ``D_V == LATENT`` and ``D_R == ROPE``).
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
    _LATENT = tl.constexpr(LATENT)
    _ROPE = tl.constexpr(ROPE)
    _TILE = tl.constexpr(TILE)
    _SCALE_OFFSET = tl.constexpr(SCALE_OFFSET)
    _ROPE_OFFSET = tl.constexpr(ROPE_OFFSET)

    @triton.jit
    def load_fp8_latent(row_ptr, mask, dtype: tl.constexpr):
        """``[N, LATENT]`` latent values of the ``N`` rows at byte pointers ``row_ptr [N]``,
        dequantised (``fp32(code) * scale``, then ``dtype``); rows where ``mask [N]`` is false read 0.

        The codes are loaded as ``[N, tiles, TILE]`` (16 bytes a thread) and each tile's scale is
        broadcast along its ``TILE`` codes; the reshape to ``[N, LATENT]`` keeps every thread's
        elements (no data movement)."""
        NT: tl.constexpr = _LATENT // _TILE
        tiles = tl.arange(0, NT)
        cols = tl.arange(0, _TILE)
        code_ptr = row_ptr.to(tl.pointer_type(tl.float8e4nv))
        codes = tl.load(
            code_ptr[:, None, None] + tiles[None, :, None] * _TILE + cols[None, None, :],
            mask=mask[:, None, None],
            other=0.0,
        )
        scale_ptr = (row_ptr + _SCALE_OFFSET).to(tl.pointer_type(tl.float32))
        scales = tl.load(scale_ptr[:, None] + tiles[None, :], mask=mask[:, None], other=0.0)
        values = (codes.to(tl.float32) * scales[:, :, None]).to(dtype)
        return tl.reshape(values, [row_ptr.shape[0], _LATENT])

    @triton.jit
    def load_fp8_rope(row_ptr, mask, dtype: tl.constexpr):
        """``[N, ROPE]`` rope values (stored bf16) of the rows at ``row_ptr [N]`` in ``dtype``;
        rows where ``mask`` is false read 0."""
        rope_ptr = (row_ptr + _ROPE_OFFSET).to(tl.pointer_type(tl.bfloat16))
        rope = tl.load(rope_ptr[:, None] + tl.arange(0, _ROPE)[None, :], mask=mask[:, None], other=0.0)
        return rope.to(dtype)


__all__ = ["LATENT", "ROPE", "ROPE_OFFSET", "ROW_BYTES", "SCALE_OFFSET", "TILE", "load_fp8_latent", "load_fp8_rope"]
