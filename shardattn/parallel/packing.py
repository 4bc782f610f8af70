"""Mixed-dtype payloads as bytes: a bf16 output and its fp32 LSE travel in one collective.

:func:`pack_rows` lays the raw bytes of several tensors side by side, row by row, in one
``uint8`` buffer (each segment 16-byte aligned); :func:`unpack_rows` views them back;
:func:`packed_nbytes` is the bytes of one packed row; :func:`view_bytes` views a reserved ``uint8``
workspace buffer as a typed tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from shardattn._checks import check_tensor

__all__ = ["check_byte_buffers", "pack_rows", "packed_nbytes", "unpack_rows", "view_bytes"]

_ALIGN = 16  # bytes; every packed segment starts at a multiple of this


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def pack_rows(tensors: Sequence[torch.Tensor], *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Lay the raw bytes of several tensors side by side, row by row, in one ``uint8`` buffer.

    All tensors share their leading dim ``P`` (one row per destination rank, say); row ``p`` of
    the result holds the bytes of ``tensors[0][p]``, then of ``tensors[1][p]``, ... Each segment
    starts at a multiple of 16 bytes, so :func:`unpack_rows` views it back without a copy. This is
    how a bf16 output and its fp32 LSE travel in a single collective.

    Args:
        tensors: ``[P, ...]`` each, any dtypes, one device.
        out: optional contiguous ``[P, nbytes]`` uint8 destination (a reserved workspace buffer).
    Returns:
        ``[P, nbytes]`` uint8 with ``nbytes = packed_nbytes(...)`` of the per-row shapes
        (``out`` when given; the 16-byte padding between segments is left as it was).

    >>> buf = pack_rows([torch.ones(2, 3, dtype=torch.bfloat16), torch.zeros(2, 1)])
    >>> a, b = unpack_rows(buf, [((3,), torch.bfloat16), ((1,), torch.float32)])
    >>> tuple(buf.shape), a.dtype, a.tolist(), b.tolist()
    ((2, 32), torch.bfloat16, [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], [[0.0], [0.0]])
    """
    if not tensors:
        raise ValueError("pack_rows needs at least one tensor")
    p, device = tensors[0].shape[0], tensors[0].device
    for i, t in enumerate(tensors):
        if t.dim() == 0 or t.shape[0] != p or t.device != device:
            raise ValueError(
                f"pack_rows: tensor {i} must have leading dim {p} on {device}, got {list(t.shape)} on {t.device}"
            )
    sizes = [math.prod(t.shape[1:]) * t.element_size() for t in tensors]
    shape = (p, sum(_padded(s) for s in sizes))
    if out is None:
        buf = torch.empty(shape, dtype=torch.uint8, device=device)
    elif tuple(out.shape) != shape or out.dtype != torch.uint8 or out.device != device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {list(shape)} uint8 tensor on {device}, got {list(out.shape)}")
    else:
        buf = out
    off = 0
    for t, n in zip(tensors, sizes):
        if n and p:
            dst = buf[:, off : off + n]
            if t.dtype != torch.bool and n % t.element_size() == 0 and off % t.element_size() == 0:
                dst.view(t.dtype).view(t.shape).copy_(t)  # one strided copy, straight from t's layout
            else:
                dst.copy_(t.contiguous().view(p, -1).view(torch.uint8))
        off += _padded(n)
    return buf


def packed_nbytes(specs: Sequence[tuple[Sequence[int], torch.dtype]]) -> int:
    """Bytes per row :func:`pack_rows` uses for tensors whose rows have the given ``(shape, dtype)``."""
    return sum(_padded(math.prod(shape) * _itemsize(dtype)) for shape, dtype in specs)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def unpack_rows(buf: torch.Tensor, specs: Sequence[tuple[Sequence[int], torch.dtype]]) -> list[torch.Tensor]:
    """Inverse of :func:`pack_rows`: the tensors ``[P, *shape]`` of the given per-row specs.

    Args:
        buf: ``[P, nbytes]`` uint8, contiguous.
        specs: ``(shape, dtype)`` of one row of each packed tensor, in packing order.
    Returns:
        one ``[P, *shape]`` tensor per spec (views of ``buf`` where the layout allows).
    """
    need = packed_nbytes(specs)
    if buf.dtype != torch.uint8 or buf.dim() != 2 or buf.shape[1] != need:
        raise ValueError(f"buf must be a [P, {need}] uint8 tensor, got {buf.dtype} {list(buf.shape)}")
    buf = buf.contiguous()
    p = buf.shape[0]
    out = []
    off = 0
    for shape, dtype in specs:
        n = math.prod(shape) * _itemsize(dtype)
        piece = buf[:, off : off + n]
        if p and n:
            out.append(piece.view(dtype).reshape(p, *shape))
        else:
            out.append(torch.empty((p, *shape), dtype=dtype, device=buf.device))
        off += _padded(n)
    return out


def view_bytes(buf: torch.Tensor | None, shape: Sequence[int], dtype: torch.dtype, name: str) -> torch.Tensor | None:
    """The first bytes of the ``uint8`` buffer ``buf`` viewed as a contiguous ``shape`` tensor of ``dtype``.

    Args:
        buf: a flat ``uint8`` workspace buffer (its start aligned for ``dtype``), or ``None``.
        shape, dtype: the view. name: the buffer's name, for the error.
    Returns:
        the view, or ``None`` when ``buf`` is ``None`` (the caller then allocates).
    Raises:
        ValueError: ``buf`` holds fewer bytes than the view needs.

    >>> view_bytes(torch.zeros(64, dtype=torch.uint8), (2, 3), torch.float32, "x").shape
    torch.Size([2, 3])
    """
    if buf is None:
        return None
    n = math.prod(shape) * _itemsize(dtype)
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < n:
        got = f"{str(buf.dtype).replace('torch.', '')} {list(buf.shape)}"
        raise ValueError(f"workspace[{name!r}] must be a flat uint8 buffer of at least {n} B, got {got}")
    return buf[:n].view(dtype).view(tuple(shape))


def check_byte_buffers(
    buffers: object, need: dict[str, int], device: torch.device, what: str = "workspace"
) -> dict[str, torch.Tensor]:
    """A step's optional workspace: a dict of flat ``uint8`` buffers on ``device``, each of at least
    ``need[name]`` bytes (names not in ``need`` are not read). Checked where the ranks agree, so a
    bad buffer raises on every rank, not in the middle of an exchange. Returns the dict (``{}``
    for ``None``).

    >>> check_byte_buffers({"send": torch.zeros(8)}, {"send": 16}, torch.device("cpu"))
    Traceback (most recent call last):
    ...
    TypeError: workspace['send'] must have dtype in (uint8), got float32
    """
    if buffers is None:
        return {}
    if not isinstance(buffers, dict):
        raise TypeError(f"{what} must be a dict of flat uint8 buffers, got {type(buffers).__name__}")
    for name, buf in buffers.items():
        check_tensor(f"{what}[{name!r}]", buf, dtypes=(torch.uint8,), ndim=1, device=device)
        if buf.numel() < need.get(name, 0):
            raise ValueError(f"{what}[{name!r}] holds {buf.numel()} B, the step needs at least {need[name]} B")
    return buffers
