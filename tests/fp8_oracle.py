"""Independent oracles for the FP8 KV-row format (``fp8_ds_mla``), written from its byte layout and
sharing no code with the library (no torch dtype conversion either: e4m3 and bf16 values are
decoded from their bit definitions and the nearest one is picked in fp64).

* :func:`fp8_rows_oracle`: ``[R, 576]`` fp64 values -> ``(bytes [R, 656] uint8, flags [R] bool)``.
  Per 128-value latent tile: ``scale = 2**k``, the least ``k >= -13`` with ``448 * 2**k >= amax``
  (``amax`` over finite values); code = e4m3 nearest to ``x / scale``, ties to the even code;
  NaN -> +0, +-inf -> +-448 (+-240 at ``k = 120``: 448 * 2**120 is past fp32).
  Rope: bf16 nearest, ties to even; NaN -> +0, +-inf -> +- the largest
  finite rope magnitude of the row; clamped to the bf16 range. ``flags``: the row held NaN / inf.
* :func:`fp8_rows_decode`: ``[R, 656]`` bytes -> ``[R, 576]`` fp64 values (the reader's side:
  code value from its sign, exponent and mantissa bits, times the tile's fp32 scale; rope from its
  bf16 bits), exact for any scale.
* :func:`make_rows`: test inputs (magnitudes across a dtype's range, all-zero tiles, -0.0, NaN / inf).
* :func:`flashmla_quantize`: FlashMLA's reference quantiser (``tests/quant.py``,
  ``quantize_k_cache``, ``V32_FP8Sparse``) re-implemented as it reads: per tile
  ``scale = 2 ** ceil(log2(max(amax.float() / 448, 1e-4)))``, ``(x.float() / scale)`` cast to
  float8_e4m3fn, rope bytes copied from the input.
"""

from __future__ import annotations

import math

import numpy as np
import torch

LATENT, ROPE, TILE, ROW_BYTES = 512, 64, 128, 656
BF16_MAX = (2 - 2**-7) * 2.0**127
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: log2 of the row magnitudes drawn per dtype: subnormal inputs at the low end, finite at the top
MAGNITUDES = {"bf16": (-136, 116), "fp16": (-20, 7), "fp32": (-136, 116)}


def _e4m3_table() -> np.ndarray:
    """Values of codes 0..126 (the non-negative finite e4m3 values, increasing with the code)."""
    vals = []
    for code in range(127):
        e, m = code >> 3, code & 7
        vals.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(vals, dtype=np.float64)


E4M3 = _e4m3_table()


def _nearest_even(table_lo: np.ndarray, table_hi: np.ndarray, code_lo: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Pick ``code_lo`` or ``code_lo + 1`` (values ``table_lo`` / ``table_hi``): nearest to ``y``, ties even."""
    d_lo, d_hi = y - table_lo, table_hi - y
    up = (d_hi < d_lo) | ((d_hi == d_lo) & (code_lo % 2 == 1))
    return code_lo + up


def e4m3_codes(y: np.ndarray) -> np.ndarray:
    """e4m3 codes of fp64 ``y`` (finite, ``|y| <= 448``): nearest value, ties to the even code."""
    mag = np.abs(y)
    hi = np.clip(np.searchsorted(E4M3, mag, side="left"), 1, 126)  # first value >= mag
    codes = _nearest_even(E4M3[hi - 1], E4M3[hi], hi - 1, mag)
    return (codes | np.where(np.signbit(y), 0x80, 0)).astype(np.uint8)


def bf16_bytes(v: np.ndarray) -> np.ndarray:
    """Little-endian bf16 bytes ``[..., 2]`` of fp64 ``v`` (fp32-representable, finite, within the
    bf16 range): the nearest of the two bf16 values around it, ties to the even one."""
    f32 = v.astype(np.float32)
    assert np.array_equal(f32.astype(np.float64), v, equal_nan=False), "rope values must be fp32-exact"
    bits = f32.view(np.uint32)
    lo = (bits >> 16).astype(np.int64)  # truncation: the bf16 value toward zero
    lo_val = np.abs((lo.astype(np.uint32) << 16).view(np.float32).astype(np.float64))
    hi_val = np.abs(((lo + 1).astype(np.uint32) << 16).view(np.float32).astype(np.float64))
    half = _nearest_even(lo_val, hi_val, lo, np.abs(v)).astype(np.uint16)
    return half.view(np.uint8).reshape(*v.shape, 2)


def tile_exponent(amax: float) -> int:
    """The least ``k >= -13`` with ``448 * 2**k >= amax`` (exact: ldexp is exact in fp64)."""
    if amax == 0:
        return -13
    k = math.ceil(math.log2(amax / 448))
    while math.ldexp(448.0, k - 1) >= amax:
        k -= 1
    while math.ldexp(448.0, k) < amax:
        k += 1
    return max(k, -13)


def fp8_rows_oracle(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[R, 576]`` fp64 (NaN / inf allowed) -> ``(bytes [R, 656] uint8, flags [R] bool)``."""
    r = x.shape[0]
    out = np.zeros((r, ROW_BYTES), dtype=np.uint8)
    flags = ~np.isfinite(x).all(axis=1)
    for i in range(r):
        for t in range(LATENT // TILE):
            tile = x[i, t * TILE : (t + 1) * TILE]
            finite = np.isfinite(tile)
            amax = float(np.abs(tile[finite]).max()) if finite.any() else 0.0
            k = tile_exponent(amax)
            y = np.where(finite, tile / 2.0**k, 0.0)
            y = np.where(np.isinf(tile), np.copysign(448.0 if k < 120 else 240.0, tile), y)
            out[i, t * TILE : (t + 1) * TILE] = e4m3_codes(y)
            out[i, LATENT + 4 * t : LATENT + 4 * t + 4] = np.frombuffer(np.float32(2.0**k).tobytes(), np.uint8)
        rope = x[i, LATENT:]
        finite = np.isfinite(rope)
        rmax = float(np.abs(rope[finite]).max()) if finite.any() else 0.0
        v = np.where(np.isnan(rope), 0.0, np.where(np.isinf(rope), np.where(rope > 0, rmax, -rmax), rope))
        v = np.clip(v, -BF16_MAX, BF16_MAX)
        out[i, LATENT + 16 :] = bf16_bytes(v).reshape(-1)
    return out, flags


def fp8_rows_decode(packed: np.ndarray) -> np.ndarray:
    """``[R, 656]`` uint8 rows -> ``[R, 576]`` fp64: latent ``value(code) * scale`` (code 0x7F /
    0xFF is NaN), rope from the bf16 bit patterns."""
    packed = np.ascontiguousarray(packed, dtype=np.uint8)
    codes = packed[:, :LATENT].astype(np.int64)
    mag = np.append(E4M3, np.nan)[codes & 0x7F]  # code 127: NaN (e4m3fn has no infinity)
    values = np.where(codes & 0x80, -mag, mag)
    scales = packed[:, LATENT : LATENT + 16].copy().view(np.float32).astype(np.float64)
    latent = values * np.repeat(scales, TILE, axis=1)
    bits = packed[:, LATENT + 16 :].copy().view(np.uint16).astype(np.uint32) << 16
    rope = bits.view(np.float32).astype(np.float64)
    return np.concatenate([latent, rope], axis=1)


def flashmla_quantize(x: torch.Tensor) -> torch.Tensor:
    """FlashMLA's ``quantize_k_cache`` (``V32_FP8Sparse``) on ``[R, 576]`` rows; ``[R, 512 + 16 + 64 *
    x.element_size()]`` uint8 (its rope bytes are the input's, in the input's dtype)."""
    r = x.shape[0]
    out = torch.empty(r, LATENT + 16 + ROPE * x.element_size(), dtype=torch.uint8, device=x.device)
    out[:, LATENT + 16 :] = x[:, LATENT:].contiguous().view(torch.uint8)
    for t in range(LATENT // TILE):
        tile = x[:, t * TILE : (t + 1) * TILE]
        scale = torch.abs(tile).max(dim=-1).values.float() / 448.0
        scale = torch.pow(2, torch.clamp_min(scale, 1e-4).log2().ceil()).to(torch.float32)
        out[:, LATENT + 4 * t : LATENT + 4 * t + 4] = scale[:, None].contiguous().view(torch.uint8)
        q = (tile.float() / scale[:, None]).to(torch.float8_e4m3fn)
        out[:, t * TILE : (t + 1) * TILE] = q.view(torch.uint8)
    return out


def make_rows(seed: int, n: int, dtype_name: str, specials: bool = True) -> torch.Tensor:
    """``[n, 576]`` rows in ``DTYPES[dtype_name]``: each row at its own magnitude over the dtype's
    range, values down to 2**-12 of it (subnormal codes), some all-zero latent tiles, some -0.0
    and (with ``specials``) NaN, +-inf and the dtype's largest finite value at random places of
    about half the rows."""
    g = np.random.default_rng(seed)
    lo, hi = MAGNITUDES[dtype_name]
    x = g.standard_normal((n, LATENT + ROPE)) * np.exp2(g.integers(lo, hi, size=(n, 1)))
    x *= np.exp2(g.integers(-12, 4, size=(n, LATENT + ROPE)))
    zero_tiles = g.random((n, LATENT // TILE)) < 0.2
    x[:, :LATENT][np.repeat(zero_tiles, TILE, axis=1)] = 0.0
    x[g.random(x.shape) < 0.02] = -0.0
    t = torch.from_numpy(x).to(DTYPES[dtype_name])
    if specials:
        big = torch.finfo(t.dtype).max
        vals = torch.tensor([math.nan, math.inf, -math.inf, big], dtype=torch.float64)
        pick = vals[torch.from_numpy(g.integers(0, 4, size=x.shape))].to(t.dtype)
        at = (g.random(x.shape) < 0.01) & (g.random((n, 1)) < 0.5)  # about half the rows
        t = torch.where(torch.from_numpy(at), pick, t)
    return t
