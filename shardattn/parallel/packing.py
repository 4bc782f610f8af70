"""Mixed-dtype payloads as bytes: a bf16 output and its fp32 LSE travel in one collective.

:func:`pack_rows` lays the raw bytes of several tensors side by side, row by row, in one
``uint8`` buffer (each segment 16-byte aligned); :func:`unpack_rows` views them back;
:func:`packed_nbytes` is the bytes of one packed row; :func:`view_bytes` views a reserved ``uint8``
workspace buffer as a typed tensor; :func:`check_byte_buffers` checks a step's buffers before
it views them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from shardattn._checks import check_tensor

__all__ = ["check_byte_buffers", "check_flat", "pack_rows", "packed_nbytes", "unpack_rows", "view_bytes"]

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


def view_bytes(
    buf: torch.Tensor | None, shape: Sequence[int], dtype: torch.dtype, name: str, what: str = "workspace"
) -> torch.Tensor | None:
    """The first bytes of the ``uint8`` buffer ``buf`` viewed as a contiguous ``shape`` tensor of ``dtype``.

    Args:
        buf: a flat contiguous ``uint8`` workspace buffer whose start is aligned for ``dtype``, or ``None``.
        shape, dtype: the view. name: the buffer's name, ``what``: its dict's (``"buffers"``), for the error.
    Returns:
        the view, or ``None`` when ``buf`` is ``None`` (the caller then allocates).
    Raises:
        ValueError: ``buf`` holds fewer bytes than the view needs, is not contiguous, or does not
            start on a multiple of ``dtype``'s size.

    >>> view_bytes(torch.zeros(64, dtype=torch.uint8), (2, 3), torch.float32, "x").shape
    torch.Size([2, 3])
    >>> view_bytes(torch.zeros(64, dtype=torch.uint8)[1:], (2, 3), torch.float32, "x")
    Traceback (most recent call last):
    ...
    ValueError: workspace['x'] must start on a 4-byte boundary (it is viewed as float32), got one 1 byte past it
    """
    if buf is None:
        return None
    n = math.prod(shape) * _itemsize(dtype)
    label = f"{what}[{name!r}]"
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < n:
        got = f"{str(buf.dtype).replace('torch.', '')} {list(buf.shape)}"
        raise ValueError(f"{label} must be a flat uint8 buffer of at least {n} B, got {got}")
    check_flat(label, buf, dtype)
    return buf[:n].view(dtype).view(tuple(shape))


def check_flat(label: str, buf: torch.Tensor, dtype: torch.dtype = torch.uint8) -> None:
    """A flat ``uint8`` buffer ``buf`` is contiguous and starts on a multiple of ``dtype``'s size (the
    widest element a step views it as: a view needs it). Raises ``ValueError`` naming ``label``."""
    if buf.numel() > 1 and buf.stride(0) != 1:
        raise ValueError(f"{label} must be contiguous (a flat buffer), got stride {buf.stride(0)}")
    size = _itemsize(dtype)
    off = buf.storage_offset() % size or buf.data_ptr() % size
    if off:
        raise ValueError(
            f"{label} must start on a {size}-byte boundary (it is viewed as {str(dtype).replace('torch.', '')}), "
            f"got one {off} byte{'s' if off > 1 else ''} past it"
        )


def check_byte_buffers(
    buffers: object,
    need: dict[str, int],
    device: torch.device,
    what: str = "workspace",
    *,
    dtypes: dict[str, torch.dtype] | None = None,
    live: dict[str, tuple[int, int]] | None = None,
) -> dict[str, torch.Tensor]:
    """A step's optional workspace: a dict of flat ``uint8`` buffers on ``device``. Checked where the
    ranks agree, so a bad buffer raises on every rank, not in the middle of an exchange. Returns
    the dict (``{}`` for ``None``).

    Every buffer the step reads (a name in ``need``) must hold at least ``need[name]`` bytes, be
    contiguous, start on a multiple of the size of ``dtypes[name]`` (the widest element the step
    views it as; default ``uint8``: any byte) and share no memory with another buffer the step
    reads while both are in use (``live[name]``: the first and last phase of the step in which the
    buffer is written or read, inclusive; default the whole step). Names not in ``need`` are not
    read: they are only checked to be flat ``uint8`` tensors on ``device``.

    >>> check_byte_buffers({"send": torch.zeros(8)}, {"send": 16}, torch.device("cpu"))
    Traceback (most recent call last):
    ...
    TypeError: workspace['send'] must have dtype in (uint8), got float32
    >>> arena = torch.zeros(64, dtype=torch.uint8)
    >>> check_byte_buffers({"q": arena, "out": arena[32:]}, {"q": 16, "out": 16}, torch.device("cpu"))
    Traceback (most recent call last):
    ...
    ValueError: workspace['q'] and workspace['out'] share memory: the step's writes to one would overwrite the other
    """
    if buffers is None:
        return {}
    if not isinstance(buffers, dict):
        raise TypeError(f"{what} must be a dict of flat uint8 buffers, got {type(buffers).__name__}")
    spans: list[tuple[int, int, str]] = []  # the buffers the step reads: first and last byte, name
    views = dtypes or {}
    for name, buf in buffers.items():
        label = f"{what}[{name!r}]"
        check_tensor(label, buf, dtypes=(torch.uint8,), ndim=1, device=device)
        if name not in need:
            continue
        n, ptr = buf.numel(), buf.data_ptr()
        if n < need[name]:
            raise ValueError(f"{label} holds {n} B, the step needs at least {need[name]} B")
        size = views[name].itemsize if name in views else 1  # a power of two: (a | b) % size is 0 when both are
        if not buf.is_contiguous() or (size > 1 and (ptr | buf.storage_offset()) % size):
            check_flat(label, buf, views.get(name, torch.uint8))  # raises, saying which
        if n:
            spans.append((ptr, ptr + n, name))
    spans.sort()  # by first byte: a buffer can only overlap those that start before it ends
    for i, (_, end, a) in enumerate(spans if device.type != "meta" else ()):
        for start, _, b in spans[i + 1 :]:
            if start >= end:
                break
            if live is None or _meet(live.get(a), live.get(b)):
                first, second = sorted((a, b), key=list(buffers).index)  # named in the order given
                raise ValueError(
                    f"{what}[{first!r}] and {what}[{second!r}] share memory: the step's writes to one would "
                    "overwrite the other"
                )
    return buffers


def _meet(a: tuple[int, int] | None, b: tuple[int, int] | None) -> bool:
    """Whether two ``(first, last)`` phase spans (``None``: the whole step) have a phase in common."""
    return a is None or b is None or (a[0] <= b[1] and b[0] <= a[1])
