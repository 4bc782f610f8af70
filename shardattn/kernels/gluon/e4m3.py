"""e4m3 codes to bf16 in the sm_90 Gluon kernels, with half the conversion-unit work of
``codes.to(float32).to(bfloat16)``.

That cast costs two conversion instructions for every two codes (``cvt.rn.f16x2.e4m3x2``, then
``cvt.rn.bf16x2.f32`` after the two fp16 values are widened), and the conversion unit runs at a
quarter of the integer and FMA units' rate, so it bounds an FP8 producer. Every e4m3 value has at
most 4 significant bits, so it is exact in fp16, fp32 and bf16 alike, and the bf16 value is the
upper half of the fp32 one: :func:`e4m3_times_bf16` converts two codes to fp16 with one
``cvt.rn.f16x2.e4m3x2``, widens the halves (``cvt.f32.f16``, FMA unit), packs their upper halves
with one ``prmt`` (integer unit), the cast's values bit for bit, and multiplies the pair by its
scales with one ``mul.rn.bf16x2``.
"""

from __future__ import annotations

from shardattn.kernels.gluon.compat import HAS_GLUON

__all__: list[str] = []

if HAS_GLUON:
    from shardattn.kernels.gluon.compat import gl, gluon

    # four codes in (one 32-bit register, code i in byte i) and their four bf16 scales (two
    # registers, scale i in half i of register i // 2); four bf16 products out, as the scales
    _E4M3X4_TIMES_BF16X4 = gl.constexpr(
        "{ .reg .b16 c<2>, h<4>; .reg .b32 p<2>, f<4>; "
        "mov.b32 {c0, c1}, $2; "
        "cvt.rn.f16x2.e4m3x2 p0, c0; cvt.rn.f16x2.e4m3x2 p1, c1; "
        "mov.b32 {h0, h1}, p0; mov.b32 {h2, h3}, p1; "
        "cvt.f32.f16 f0, h0; cvt.f32.f16 f1, h1; cvt.f32.f16 f2, h2; cvt.f32.f16 f3, h3; "
        "prmt.b32 p0, f0, f1, 0x7632; prmt.b32 p1, f2, f3, 0x7632; "
        "mul.rn.bf16x2 $0, p0, $3; mul.rn.bf16x2 $1, p1, $4; }"
    )

    @gluon.jit
    def e4m3_times_bf16(codes, scale):
        """``bf16(codes) * scale`` rounded to bf16: ``codes`` ``float8e4nv`` (a thread's codes in runs of
        4), ``scale`` bf16 of the same shape and layout (a broadcast row scale). ``bf16(code)`` is exact,
        so with power-of-two scales the product is the fp32 product rounded to bf16 (the value
        :func:`shardattn.ops.kv_fp8.dequantize_kv` gives)."""
        return gl.inline_asm_elementwise(
            _E4M3X4_TIMES_BF16X4, "=r,=r,r,r,r", [codes, scale], dtype=gl.bfloat16, is_pure=True, pack=4
        )
