"""The head-blocked layout of a per-(token, head) tensor, beside the plain ``[T, H, ...]``.

A head-blocked tensor ``[B, T, H/B, ...]`` holds head ``b * H/B + i`` of token ``t`` at
``[b, t, i]`` (an all-to-all buffer read or written in place, see
:func:`~shardattn.kernels.triton.sparse_mla.launch_attention`). The sparse-MLA prefill ops take
``q``, ``out`` and ``lse_out`` in either layout: validation and dispatch look at a zero-copy
``[T, H, D]`` stand-in (:func:`shape_stand_in`), the kernels read and write the tensors through
their strides, and the torch paths read a merged ``q`` (:func:`q_heads_view`) and write their
results back (:func:`store_result`).

Example:
    >>> q = torch.arange(24.0).view(2, 3, 2, 2)  # B = 2 blocks of 2 heads, 3 tokens, D = 2
    >>> tuple(q_heads_view(q).shape), q_heads_view(q)[1, 2].tolist()  # token 1, head 2 = block 1, head 0
    ((3, 4, 2), [16.0, 17.0])
    >>> tuple(shape_stand_in(q).shape)
    (3, 4, 2)
"""

from __future__ import annotations

import torch

from shardattn._checks import check_tensor

__all__ = ["check_destination", "q_heads_view", "shape_stand_in", "store_heads", "store_result"]


def q_heads_view(q: torch.Tensor) -> torch.Tensor:
    """``q`` as ``[T, H, D]``: itself, or a head-blocked ``[B, T, H/B, D]`` merged (a copy unless ``B == 1``)."""
    return q.movedim(0, 1).flatten(1, 2) if q.dim() == 4 else q


def shape_stand_in(q: torch.Tensor) -> torch.Tensor:
    """A zero-copy ``[T, H, D]`` stand-in of a head-blocked ``q`` with its dtype, device and shape
    (for validation and dispatch only: it does not hold q's values); ``q`` itself when 3-D."""
    if q.dim() != 4:
        return q
    b, t, hb, d = q.shape
    return q.as_strided((t, b * hb, d), (0, 0, q.stride(-1)))  # q's last-dim stride: dispatch reads it


def store_heads(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Copy ``src [T, H, ...]`` into ``dst``, plain ``[T, H, ...]`` or head-blocked ``[B, T, H/B, ...]``."""
    if dst.dim() == src.dim() + 1:
        b = dst.shape[0]
        dst.copy_(src.unflatten(1, (b, src.shape[1] // b)).movedim(1, 0))
    else:
        dst.copy_(src)
    return dst


def store_result(
    result: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor | None, lse_out: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A torch path's ``(out [T, H, Dv], lse [T, H])`` written into the destinations given (plain or
    head-blocked: :func:`store_heads`); returns the destinations, or the result's tensors where
    none is given."""
    o, lse = result
    return (o if out is None else store_heads(out, o)), (lse if lse_out is None else store_heads(lse_out, lse))


def check_destination(name: str, dst: object, q: torch.Tensor, tail: tuple[int, ...], dtype: torch.dtype) -> None:
    """``dst`` as a destination of per-(token, head) results of ``q [T, H, D]``: ``[T, H, *tail]``, or
    head-blocked ``[B, T, H/B, *tail]``, in ``dtype`` on q's device; raises naming ``name``."""
    t, h, _ = q.shape
    dst = check_tensor(name, dst, dtypes=(dtype,), device=q.device)
    shape = tuple(dst.shape)
    blocked = len(shape) == 3 + len(tail) and shape[1] == t and shape[0] >= 1 and shape[0] * shape[2] == h
    if shape != (t, h, *tail) and not (blocked and shape[3:] == tail):
        want = ", ".join(str(n) for n in (t, h, *tail))
        raise ValueError(f"{name} must have shape [{want}] (or head-blocked [B, {t}, {h}/B, ...]), got {list(shape)}")
