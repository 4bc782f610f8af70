"""The byte layout of an FP8 KV row (:class:`KVRowLayout`; DSA models' :data:`FP8_DS_MLA`, 656
bytes: the format :mod:`shardattn.ops.kv_fp8` describes, quantises, dequantises and writes) and
the checks of a KV argument: :func:`check_fp8_kv` (a cache of such rows), :func:`resolve_kv` (the
KV rows of an attention call against its declared or inferred ``kv_format``, flattened to rows).

Example:
    >>> resolve_kv("kv", torch.zeros(2, 8, 656, dtype=torch.uint8), head_dim=576, v_dim=512)[0].shape
    torch.Size([16, 656])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardattn._checks import FLOAT_DTYPES, has_internal_overlap
from shardattn.kernels.triton.kv_fp8 import E4M3_MAX
from shardattn.plan.kv_format import DENSE_KV_FORMATS, KV_FP8_DS_MLA, kv_format_name

__all__ = ["FP8_DS_MLA", "KVRowLayout", "check_fp8_kv", "resolve_kv"]


@dataclass(frozen=True)
class KVRowLayout:
    """Byte layout of one FP8 KV row: ``latent_dim`` e4m3 values in tiles of ``tile_size``, one fp32
    scale per tile (powers of two ``>= 2 ** min_scale_exp`` as :mod:`shardattn.ops.kv_fp8` writes
    them), then ``rope_dim`` bf16 values.

    >>> FP8_DS_MLA.row_bytes, FP8_DS_MLA.scale_offset, FP8_DS_MLA.rope_offset, FP8_DS_MLA.dim
    (656, 512, 528, 576)
    """

    name: str
    latent_dim: int = 512
    rope_dim: int = 64
    tile_size: int = 128
    fp8_max: float = E4M3_MAX
    min_scale_exp: int = -13

    @property
    def num_tiles(self) -> int:
        return self.latent_dim // self.tile_size

    @property
    def dim(self) -> int:
        """Values of a row (latent + rope): the width of the bf16 rows it stands for."""
        return self.latent_dim + self.rope_dim

    @property
    def scale_offset(self) -> int:
        return self.latent_dim

    @property
    def rope_offset(self) -> int:
        return self.scale_offset + 4 * self.num_tiles

    @property
    def row_bytes(self) -> int:
        return self.rope_offset + 2 * self.rope_dim


#: DeepSeek-V3.2 / GLM-5 rows: 512 latent (4 tiles of 128) + 64 rope, 656 bytes.
FP8_DS_MLA = KVRowLayout(KV_FP8_DS_MLA)


def check_fp8_kv(name: str, kv: object, layout: KVRowLayout = FP8_DS_MLA) -> torch.Tensor:
    """``kv`` is a cache of ``layout`` rows: uint8 ``[R, row_bytes]`` or ``[num_pages, page_size,
    row_bytes]``, bytes of a row contiguous, rows not overlapping (a cache of no row: any strides).
    Raises ``TypeError`` (not a tensor) or ``ValueError`` naming ``name`` and the format; returns ``kv``.
    """
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of {layout.name} rows, got {type(kv).__name__}")
    want = f"uint8 [rows, {layout.row_bytes}] or [pages, page_size, {layout.row_bytes}] ({layout.name} rows)"
    got = f"{str(kv.dtype).replace('torch.', '')} {list(kv.shape)}"
    if kv.dtype != torch.uint8 or kv.dim() not in (2, 3) or kv.shape[-1] != layout.row_bytes:
        fp8_view = kv.dtype == torch.float8_e4m3fn and kv.dim() in (2, 3) and kv.shape[-1] == layout.row_bytes
        hint = " (an fp8-typed view: pass .view(torch.uint8))" if fp8_view else ""
        raise ValueError(f"{name} must be {want}, got {got}{hint}")
    if kv.numel() == 0:  # no byte is read: its strides mean nothing (torch calls any such tensor contiguous)
        return kv
    if kv.stride(-1) != 1 or (kv.shape[-2] > 1 and kv.stride(-2) < layout.row_bytes):
        raise ValueError(f"{name} must have contiguous, non-overlapping {layout.name} rows, got strides {kv.stride()}")
    if kv.dim() == 3 and has_internal_overlap(kv):  # pages sharing rows (an expand, a page stride below the page)
        raise ValueError(f"{name} must have non-overlapping pages, got shape {list(kv.shape)} strides {kv.stride()}")
    # the fp32 scales sit 512 bytes into a row: every row must start 4-byte aligned (a misaligned
    # scale load is a CUDA fault, not a wrong value)
    if kv.storage_offset() % 4 or any(kv.stride(d) % 4 for d in range(kv.dim() - 1) if kv.shape[d] > 1):
        raise ValueError(
            f"{name}'s {layout.name} rows must start at multiples of 4 bytes (fp32 scales inside), got storage "
            f"offset {kv.storage_offset()} and strides {kv.stride()}"
        )
    return kv


def resolve_kv(
    name: str, kv: object, *, head_dim: int, v_dim: int, kv_format: str | None = None
) -> tuple[torch.Tensor, str]:
    """The KV rows of an attention call as the kernels read them, and their format.

    Args:
        name: the argument's name, for errors.
        kv: rows in the query's dtype ``[R, head_dim]`` (a dense format), or :data:`FP8_DS_MLA`
            rows, uint8 ``[R, 656]``; either paged, ``[num_pages, page_size, row]`` (row
            ``p * page_size + i``) with pages that follow one another (padded pages are refused:
            the kernels address rows as ``row * stride``).
        head_dim, v_dim: the query's row width and the value width.
        kv_format: a format of :data:`shardattn.plan.kv_format.KV_FORMATS`, or ``None`` to take
            it from ``kv`` (uint8: ``fp8_ds_mla``; a float dtype: that dense format).
    Returns:
        ``(rows [R, row], format)``: ``kv`` itself, or a flat view of a paged cache.
    Raises:
        TypeError / ValueError: naming ``name`` and the format, when ``kv`` is not a tensor of
            that format (dtype, width, strides), or the dims are not the FP8 format's 576 / 512.
    """
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(kv).__name__}")
    if kv_format is not None:
        fmt = kv_format_name("kv_format", kv_format)
    elif kv.dtype in (torch.uint8, torch.float8_e4m3fn):
        fmt = KV_FP8_DS_MLA
    elif kv.dtype in FLOAT_DTYPES:
        fmt = str(kv.dtype).replace("torch.", "")
    else:
        raise ValueError(
            f"{name} must hold KV rows in float16, bfloat16 or float32, or {KV_FP8_DS_MLA} rows (uint8), got {kv.dtype}"
        )
    if fmt in DENSE_KV_FORMATS:
        want = getattr(torch, fmt)
        if kv_format is not None and (kv.dtype != want or kv.dim() not in (2, 3)):  # else: the caller's dtype checks
            got = f"{str(kv.dtype).replace('torch.', '')} {list(kv.shape)}"
            raise ValueError(f"{name} must be {fmt} [rows, {head_dim}] ({fmt} KV rows), got {got}")
        return (_page_rows(name, kv) if kv.dim() == 3 else kv), fmt
    check_fp8_kv(name, kv)
    lay = FP8_DS_MLA
    if (head_dim, v_dim) != (lay.dim, lay.latent_dim):
        raise ValueError(
            f"{name} holds {lay.name} rows ({lay.latent_dim} latent + {lay.rope_dim} rope): the query must have "
            f"{lay.dim} dims and v_dim {lay.latent_dim}, got {head_dim} and {v_dim}"
        )
    return (_page_rows(name, kv) if kv.dim() == 3 else kv), fmt


def _page_rows(name: str, kv: torch.Tensor) -> torch.Tensor:
    """A paged cache ``[P, page, row]`` as its rows ``[P * page, row]`` (row ``p * page + i``), a
    view: its pages must follow one another (the kernels address rows as ``row * stride``)."""
    if kv.shape[0] > 1 and kv.shape[1] > 1 and kv.stride(0) != kv.shape[1] * kv.stride(1):
        raise ValueError(
            f"{name}'s pages must follow one another (rows are read as row * stride): page stride "
            f"{kv.stride(0)} != page_size {kv.shape[1]} x row stride {kv.stride(1)}"
        )
    return kv.flatten(0, 1)
