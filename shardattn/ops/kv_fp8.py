"""The FP8 KV-row format of DSA models: DeepSeek's "FP8 with scale" (FlashMLA's ``V32_FP8Sparse``,
vLLM's cache dtype ``fp8_ds_mla``), named :data:`KV_FP8_DS_MLA` here.

One row per token, 656 bytes (:data:`FP8_DS_MLA`)::

    bytes [  0, 512)  512 float8_e4m3fn latent values, 4 tiles of 128
    bytes [512, 528)  4 fp32 scales, one per tile
    bytes [528, 656)  64 bf16 rope values, not quantised

A latent value is its fp8 value times its tile's scale; the rope values are the bf16 stored. As
with bf16 rows, ``q . k`` uses all 576 dims and the value (for ``P.V``) is the first 512. The
layout itself (:class:`KVRowLayout`, :data:`FP8_DS_MLA`) and the checks of a KV argument
(:func:`check_fp8_kv`, :func:`resolve_kv`) are :mod:`shardattn.ops.kv_fp8_layout`'s, importable here too.
Readers take any fp32 scale (vLLM's writer stores ``amax / 448`` itself); this module writes:

* **Scale**: ``2 ** k`` for the least ``k >= -13`` with ``448 * 2 ** k >= amax``, ``amax`` the
  tile's largest finite magnitude; the fp8 value is ``x / scale`` (exact), rounded to nearest
  e4m3, ties to even. ``-13`` is FlashMLA's floor (its reference quantiser clamps ``amax / 448``
  at ``1e-4`` before ``2 ** ceil(log2(.))``), so an all-zero tile is ``scale = 2 ** -13`` and
  zero codes (-0.0 stays -0.0: code 0x80).
* **Rope**: the input's values as bf16 (bf16 input unchanged; fp16 / fp32 rounded to nearest
  even, fp32 beyond the bf16 range saturated at +-3.39e38).
* **Non-finite values** never reach the cache as NaN or inf: NaN is stored as +0; +-inf as
  +-448 x the tile's scale in the latent (+-240 x ``2 ** 120`` where the scale is ``2 ** 120``:
  448 x ``2 ** 120`` is past fp32) and as +- the row's largest finite rope magnitude (0 if none)
  in the rope; scales come from the finite values. Each row written can report it
  (``status``: :data:`WRITE_SATURATED`) in a device tensor, so the write needs no host
  synchronisation and stays capturable in a CUDA graph; :func:`check_write_status` is the
  explicit (synchronising) check. An error raised from inside the write would need a host
  round trip per call; saturation plus a flag keeps a serving step's cache finite and tells
  the caller which tokens were bad, when the caller chooses to look.

Bit-identical to FlashMLA's reference (``tests/quant.py``, ``quantize_k_cache``) on finite bf16
rows (tested over every bf16 magnitude); on fp16 rows in the latent codes and scales (FlashMLA
keeps an fp16 row's rope bytes in fp16, this format stores bf16). On fp32 rows the scale here is the exact
ceiling; FlashMLA's float ``log2`` can land one power of two lower when ``amax`` is within a few
fp32 ulps above ``448 * 2 ** k`` (both then store in range). Limit of the format: a finite value
at or above ``248 * 2 ** 120`` (about 3.30e38) has scale ``2 ** 120`` and rounds to the code of
256, which dequantises to ``2 ** 128``, an fp32 infinity (so does FlashMLA's).

Writing (:func:`write_kv`, an engine's "concat and cache"): CUDA tensors run the Triton kernel
(:mod:`shardattn.kernels.triton.kv_fp8`), others the torch reference; same bytes (tested).
``slots[i]`` is the cache row of input row ``i``: ``page * page_size + offset`` for a paged cache
``[num_pages, page_size, 656]``, the row for a flat ``[R, 656]`` one. A slot outside
``[0, cache rows)`` (``-1``, vLLM's padding, included) is skipped, on every device. Slots must be
distinct among the rows stored: on CPU tensors a repeat is a ``ValueError``; on a GPU it cannot
be checked without a synchronisation and the bytes stored at a repeated slot are unspecified.

Example:
    >>> rows = torch.zeros(2, 576, dtype=torch.bfloat16)
    >>> rows[0, :4] = torch.tensor([1.0, -2.0, 448.0, 0.5])
    >>> packed = quantize_kv(rows)
    >>> packed.shape, packed.dtype
    (torch.Size([2, 656]), torch.uint8)
    >>> packed[0, 512:528].view(torch.float32).tolist()  # scales: 448 / 448 -> 1, empty tiles 2**-13
    [1.0, 0.0001220703125, 0.0001220703125, 0.0001220703125]
    >>> dequantize_kv(packed)[0, :4].tolist()
    [1.0, -2.0, 448.0, 0.5]
    >>> cache = torch.zeros(3, 4, 656, dtype=torch.uint8)  # 3 pages of 4 rows
    >>> status = torch.empty(2, dtype=torch.int32)
    >>> write_kv(cache, torch.tensor([5, -1]), rows, status=status)
    >>> bool((cache[1, 1] == packed[0]).all()), status.tolist()  # slot 5 = page 1, row 1
    (True, [0, 2])
"""

from __future__ import annotations

import torch

from shardattn._checks import FLOAT_DTYPES, check_disjoint, check_not_inputs, check_same_device, check_tensor
from shardattn.kernels.backend import use_triton
from shardattn.kernels.triton.kv_fp8 import BF16_MAX, TOP_SCALE_EXP, TOP_SCALE_SAT, launch_write_fp8_rows
from shardattn.ops.kv_fp8_layout import (
    FP8_DS_MLA,
    KVRowLayout,
    check_fp8_kv,
    resolve_kv,  # noqa: F401 (public here too)
)
from shardattn.plan.kv_format import KV_FP8_DS_MLA

#: ``status`` values of :func:`write_kv` / :func:`quantize_kv`, one per input row.
WRITE_STORED = 0  #: stored as given
WRITE_SATURATED = 1  #: stored, with NaN / inf values replaced (module docstring)
WRITE_SKIPPED = 2  #: not stored: the slot is outside the cache (``-1`` included)


def _split_rows(name: str, rows: object, layout: KVRowLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` (``[R, dim]``, or ``(latent [R, latent_dim], rope [R, rope_dim])`` of one dtype) as
    ``(latent, rope)`` views with contiguous last dims."""
    want = f"fp16/bf16/fp32 [R, {layout.dim}] (or latent [R, {layout.latent_dim}], rope [R, {layout.rope_dim}])"
    if isinstance(rows, tuple) and len(rows) == 2:
        latent, rope = rows
        for part, width in ((latent, layout.latent_dim), (rope, layout.rope_dim)):
            if not isinstance(part, torch.Tensor):
                raise TypeError(f"{name} must hold tensors, got {type(part).__name__}")
            if part.dtype not in FLOAT_DTYPES or part.dim() != 2 or part.shape[1] != width:
                got = f"{str(part.dtype).replace('torch.', '')} {list(part.shape)}"
                raise ValueError(f"{name} must be {want} to write as {layout.name} rows, got {got}")
        if latent.dtype != rope.dtype or latent.shape[0] != rope.shape[0] or latent.device != rope.device:
            raise ValueError(f"{name}'s latent and rope must share dtype, rows and device")
    elif isinstance(rows, torch.Tensor):
        if rows.dtype not in FLOAT_DTYPES or rows.dim() != 2 or rows.shape[1] != layout.dim:
            got = f"{str(rows.dtype).replace('torch.', '')} {list(rows.shape)}"
            raise ValueError(f"{name} must be {want} to write as {layout.name} rows, got {got}")
        latent, rope = rows[:, : layout.latent_dim], rows[:, layout.latent_dim :]
    else:
        raise TypeError(f"{name} must be a torch.Tensor or a (latent, rope) tuple, got {type(rows).__name__}")
    return (
        latent if latent.stride(-1) == 1 else latent.contiguous(),
        rope if rope.stride(-1) == 1 else rope.contiguous(),
    )


def _row_inputs(rows: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """The caller's checked ``rows`` (a tensor or its ``(latent, rope)`` parts) by name, for
    :func:`~shardattn._checks.check_not_inputs`."""
    return {"rows": rows} if isinstance(rows, torch.Tensor) else {"rows[0]": rows[0], "rows[1]": rows[1]}


def quantize_kv_reference(rows: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of the quantisation (module docstring: the rules), on any device.

    Args:
        rows: ``[R, 576]`` fp16/bf16/fp32, or ``(latent [R, 512], rope [R, 64])``.
    Returns:
        ``(packed [R, 656] uint8, status [R] int32)``: :data:`WRITE_SATURATED` for rows that held
        NaN or inf, else :data:`WRITE_STORED`.
    """
    layout = FP8_DS_MLA  # e4m3 with 448 = 1.75 * 2**8: the exponent rule below is written for it
    latent, rope = _split_rows("rows", rows, layout)
    n = latent.shape[0]
    x = latent.float().reshape(n, layout.num_tiles, layout.tile_size)
    x_nan, x_inf = x.isnan(), x.isinf()
    amax = torch.where(x_nan | x_inf, 0.0, x.abs()).amax(dim=-1)
    bits = amax.contiguous().view(torch.int32)
    # the least k with 448 * 2**k >= amax (448 = 1.75 * 2**8: compare the mantissa with 0.75)
    k = ((bits >> 23) - 135 + ((bits & 0x7FFFFF) > 0x600000).int()).clamp_min(layout.min_scale_exp)
    scale = ((k + 127) << 23).view(torch.float32)
    y = x * ((127 - k) << 23).view(torch.float32)[..., None]  # exact: a power of two
    sat = torch.where(k >= TOP_SCALE_EXP, TOP_SCALE_SAT, layout.fp8_max)[..., None]  # finite once dequantised
    y = torch.where(x_nan, 0.0, torch.where(x_inf, torch.where(x > 0, sat, -sat), y))
    codes = y.to(torch.float8_e4m3fn).view(torch.uint8)

    v = rope.float()
    v_nan, v_inf = v.isnan(), v.isinf()
    v_max = torch.where(v_nan | v_inf, 0.0, v.abs()).amax(dim=-1, keepdim=True)
    v = torch.where(v_nan, 0.0, torch.where(v_inf, torch.where(v > 0, v_max, -v_max), v))
    rope_bf16 = v.clamp(-BF16_MAX, BF16_MAX).to(torch.bfloat16)

    packed = torch.empty(n, layout.row_bytes, dtype=torch.uint8, device=latent.device)
    packed[:, : layout.latent_dim] = codes.reshape(n, layout.latent_dim)
    packed[:, layout.scale_offset : layout.rope_offset] = scale.contiguous().view(torch.uint8)
    packed[:, layout.rope_offset :] = rope_bf16.contiguous().view(torch.uint8)
    bad = (x_nan | x_inf).flatten(1).any(dim=1) | (v_nan | v_inf).any(dim=1)
    return packed, bad.int() * WRITE_SATURATED


def _check_status(status: torch.Tensor | None, n: int) -> None:
    if status is not None:
        check_tensor("status", status, dtypes=(torch.int32,), shape=(n,))
        if n > 1 and status.stride(0) != 1:
            raise ValueError(f"status must be contiguous, got stride {status.stride()}")


def quantize_kv(
    rows: torch.Tensor | tuple[torch.Tensor, torch.Tensor], *, status: torch.Tensor | None = None
) -> torch.Tensor:
    """KV rows as :data:`FP8_DS_MLA` rows (the rules: module docstring).

    Args:
        rows: ``[R, 576]`` fp16/bf16/fp32, or ``(latent [R, 512], rope [R, 64])`` of one dtype.
        status: optional ``[R]`` int32, written per row (:data:`WRITE_STORED` or
            :data:`WRITE_SATURATED`) without a host synchronisation; it shares no memory with ``rows``.
    Returns:
        ``[R, 656]`` uint8. CUDA tensors run the Triton kernel, others the torch reference.
    """
    latent, rope = _split_rows("rows", rows, FP8_DS_MLA)
    _check_status(status, latent.shape[0])
    check_same_device(rows=latent, status=status)
    check_not_inputs({"status": status}, _row_inputs(rows))
    if not use_triton(latent):
        packed, flags = quantize_kv_reference((latent, rope))
        if status is not None:
            status.copy_(flags)
        return packed
    n = latent.shape[0]
    packed = torch.empty(n, FP8_DS_MLA.row_bytes, dtype=torch.uint8, device=latent.device)
    _launch(latent, rope, packed, None, status, capacity=n, page_size=1, stride_page=FP8_DS_MLA.row_bytes)
    return packed


def dequantize_kv(packed: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """:data:`FP8_DS_MLA` rows back to KV rows: ``fp8 value * scale`` (computed in fp32, in fp64 for
    an fp64 output), rope as stored.

    Args:
        packed: ``[R, 656]`` or ``[num_pages, page_size, 656]`` uint8 (any scales, any device).
        dtype: output dtype. bf16 and fp32 hold every value exactly when the scales are powers of
            two (as written here); vLLM's non-power-of-two scales round once in fp32 (a 4-bit code
            times a 24-bit scale) and again in bf16; fp64 holds every product exactly; fp16 rounds
            the rope and overflows beyond 65504.
    Returns:
        ``[..., 576]`` in ``dtype``.
    """
    check_fp8_kv("packed", packed)
    if dtype not in (*FLOAT_DTYPES, torch.float64):
        raise TypeError(f"dtype must be one of float16, bfloat16, float32, float64, got {dtype}")
    lay = FP8_DS_MLA
    wide = torch.float64 if dtype == torch.float64 else torch.float32  # the product's dtype
    codes = packed[..., : lay.latent_dim].view(torch.float8_e4m3fn).to(wide)
    # fresh copies (.contiguous() keeps a one-row view's odd stride, which .view refuses)
    scales = packed[..., lay.scale_offset : lay.rope_offset].clone(memory_format=torch.contiguous_format)
    scales = scales.view(torch.float32).to(wide)
    latent = (codes.unflatten(-1, (lay.num_tiles, lay.tile_size)) * scales[..., None]).flatten(-2)
    rope = packed[..., lay.rope_offset :].clone(memory_format=torch.contiguous_format).view(torch.bfloat16)
    return torch.cat([latent.to(dtype), rope.to(dtype)], dim=-1)


def _cache_rows(cache: torch.Tensor) -> tuple[int, int, int, int]:
    """``(rows, page_size, stride_page, stride_slot)`` of a checked cache (strides in bytes)."""
    if cache.dim() == 3:
        return cache.shape[0] * cache.shape[1], cache.shape[1], cache.stride(0), cache.stride(1)
    return cache.shape[0], 1, cache.stride(0), 0


def _launch(latent, rope, cache, slots, status, *, capacity, page_size, stride_page, stride_slot=0) -> None:
    lay = FP8_DS_MLA
    launch_write_fp8_rows(
        latent, rope, cache, slots, status,
        capacity=capacity, page_size=page_size, stride_page=stride_page, stride_slot=stride_slot,
        tile=lay.tile_size, scale_offset=lay.scale_offset, rope_offset=lay.rope_offset,
        min_scale_exp=lay.min_scale_exp,
    )  # fmt: skip


def write_kv(
    cache: torch.Tensor,
    slots: torch.Tensor,
    rows: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    *,
    status: torch.Tensor | None = None,
) -> None:
    """Quantise new tokens' KV rows into an :data:`FP8_DS_MLA` cache at ``slots``, in place.

    Args:
        cache: ``[num_pages, page_size, 656]`` or ``[R_cache, 656]`` uint8, written in place (a
            page's rows need not be contiguous with the next page's: FlashMLA pads its pages).
        slots: ``[R]`` int32/int64 cache rows (``page * page_size + offset``); outside
            ``[0, cache rows)``, ``-1`` included, the row is skipped. Distinct among the rows
            stored (module docstring).
        rows: ``[R, 576]`` fp16/bf16/fp32, or ``(latent [R, 512], rope [R, 64])`` of one dtype
            (the "concat" of concat-and-cache, without a copy).
        status: optional ``[R]`` int32, written per row: :data:`WRITE_STORED`,
            :data:`WRITE_SATURATED` (NaN / inf replaced), :data:`WRITE_SKIPPED`.

    ``cache`` and ``status`` share no memory with each other, ``rows`` or ``slots`` (the kernel's
    programs write rows of the cache while others still read theirs).

    CUDA tensors run the Triton kernel (one launch; no host synchronisation, no allocation:
    capturable in a CUDA graph); others the torch reference. Raises before any write: a cache or
    rows that do not match the format (``ValueError`` naming the argument and the format),
    slots of the wrong dtype / length, tensors on different devices, repeated slots among the
    rows stored (CPU slots only).
    """
    check_fp8_kv("cache", cache)
    latent, rope = _split_rows("rows", rows, FP8_DS_MLA)
    n = latent.shape[0]
    check_tensor("slots", slots, dtypes=(torch.int32, torch.int64), shape=(n,))
    _check_status(status, n)
    check_same_device(cache=cache, slots=slots, rows=latent, status=status)
    check_disjoint(cache=cache, status=status)
    check_not_inputs({"cache": cache, "status": status}, {**_row_inputs(rows), "slots": slots})
    capacity, page_size, stride_page, stride_slot = _cache_rows(cache)
    if slots.device.type == "cpu":  # a value check only where it costs no device synchronisation
        stored = slots[(slots >= 0) & (slots < capacity)]
        values, counts = stored.unique(return_counts=True)
        if bool((counts > 1).any()):
            repeated = values[counts > 1][:8].tolist()
            raise ValueError(f"slots must be distinct among the rows stored; repeated: {repeated}")
    if use_triton(cache, slots, latent):
        slots = slots if slots.stride(0) == 1 or n < 2 else slots.contiguous()
        _launch(latent, rope, cache, slots, status, capacity=capacity, page_size=page_size,
                stride_page=stride_page, stride_slot=stride_slot)  # fmt: skip
        return
    # the torch reference (a CUDA cache without Triton synchronises here: boolean indexing)
    packed, flags = quantize_kv_reference((latent, rope))
    s = slots.long()
    keep = (s >= 0) & (s < capacity)
    if status is not None:
        status.copy_(torch.where(keep, flags, WRITE_SKIPPED))
    targets = s[keep]
    if cache.dim() == 3:
        cache[targets // page_size, targets % page_size] = packed[keep]
    else:
        cache[targets] = packed[keep]


def check_write_status(status: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the rows whose NaN / inf values :func:`write_kv` saturated.

    Synchronises with the device when ``status`` is a CUDA tensor (it reads its values): call it
    outside graph capture, where a step may afford the wait (a debugging or validation switch
    of the caller).
    """
    check_tensor("status", status, dtypes=(torch.int32,), ndim=1)
    bad = (status == WRITE_SATURATED).nonzero().flatten()
    if bad.numel():
        raise ValueError(
            f"{bad.numel()} KV rows held NaN or inf (stored saturated as {KV_FP8_DS_MLA}): rows {bad[:16].tolist()}"
        )
