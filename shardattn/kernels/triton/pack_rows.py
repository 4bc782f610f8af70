"""Valid rows of Gluon decode packed to the front of each token's list (Triton kernel, torch
reference). The path that runs them: :mod:`shardattn.ops.sparse_mla_decode_gluon`.

The Gluon kernel's row slices (``q_slices``, :func:`~shardattn.kernels.gluon.sparse_mla.launch_gluon_attention`)
attend entries ``[s * W, (s + 1) * W)`` of a token's list, up to its length, and mask only past
that length. A union from :func:`~shardattn.ops.union.build_union` is already packed that way, and
raw rows of width ``S * W`` are read in place (each entry masked); rows of another width, dtype or
layout are packed here first: each token's valid rows (``0 <= row < R``, within ``topk_length``;
invalid entries anywhere) to the front of a ``[T, width]`` list, in order, with their count.
One program per token.
"""

from __future__ import annotations

import torch

from shardattn._ints import next_pow2
from shardattn.kernels.backend import COMPILE_OPTIONS, unit_stride, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None

__all__ = ["pack_rows", "pack_rows_block", "pack_rows_reference"]


def pack_rows_reference(
    rows: torch.Tensor, *, num_kv_rows: int, width: int, topk_length: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`pack_rows` (entries past ``lens`` are ``-1`` here).

    Example:
        >>> rows = torch.tensor([[5, -1, 7, 9, 99]], dtype=torch.int32)
        >>> u, n = pack_rows_reference(rows, num_kv_rows=10, width=6)
        >>> u.tolist(), n.tolist()
        ([[5, 7, 9, -1, -1, -1]], [3])
    """
    t, k = rows.shape
    r = rows.long()
    valid = (r >= 0) & (r < num_kv_rows)
    if topk_length is not None:
        valid &= torch.arange(k, device=rows.device)[None, :] < topk_length.long()[:, None]
    pos = valid.long().cumsum(1) - 1
    packed = torch.full((t, width + 1), -1, dtype=torch.int32, device=rows.device)
    packed.scatter_(1, torch.where(valid, pos, width), torch.where(valid, r, -1).int())
    return packed[:, :width].contiguous(), valid.sum(1).int()


def pack_rows_block(topk: int) -> int:
    """The kernel's ``BLOCK`` (its compile key) for lists of ``topk`` entries.

    >>> pack_rows_block(2048), pack_rows_block(100), pack_rows_block(1)
    (1024, 128, 16)
    """
    return min(1024, max(16, next_pow2(max(topk, 1))))


def pack_rows(
    rows: torch.Tensor,
    *,
    num_kv_rows: int,
    width: int,
    topk_length: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's valid rows packed in order to the front of a list of ``width`` entries.

    Args:
        rows: ``[T, K]`` int32 KV rows; ``-1`` / out of ``[0, num_kv_rows)`` invalid, anywhere.
        num_kv_rows: ``R``. width: entries per packed list, ``width >= K``.
        topk_length: ``[T]`` int32 leading entries of each row to use, optional.
        out: optional ``(union, lens)`` destinations of those shapes and dtypes, contiguous (a
            prefill's union workspace), sharing no memory with the inputs (checked by the caller).
    Returns:
        ``(union [T, width] int32, lens [T] int32)``: token ``t``'s valid rows in
        ``union[t, :lens[t]]`` (entries past it are unspecified on the Triton path). CUDA tensors
        (or the interpreter) run the Triton kernel.
    """
    topk_length = unit_stride(topk_length)
    t, k = rows.shape
    if width < k:
        raise ValueError(f"width must cover the row ({width} < {k})")
    if triton is None or not use_triton(rows) or t == 0:
        packed = pack_rows_reference(rows, num_kv_rows=num_kv_rows, width=width, topk_length=topk_length)
        if out is None:
            return packed
        out[0].copy_(packed[0])
        out[1].copy_(packed[1])
        return out
    if out is None:
        out = (
            torch.empty(t, width, dtype=torch.int32, device=rows.device),
            torch.empty(t, dtype=torch.int32, device=rows.device),
        )
    union, lens = out
    block = pack_rows_block(k)
    _pack_rows_kernel[(t,)](
        rows, topk_length if topk_length is not None else rows, union, lens,
        k, num_kv_rows, rows.stride(0), rows.stride(1), width,
        BLOCK=block, HAS_LEN=topk_length is not None, **COMPILE_OPTIONS,
    )  # fmt: skip
    return union, lens


if triton is not None:

    @triton.jit(do_not_specialize=["K", "R", "width"])
    def _pack_rows_kernel(
        ROWS, TOPK_LEN, UNION, LENS,
        K, R, stride_rt, stride_rk, width,
        BLOCK: tl.constexpr, HAS_LEN: tl.constexpr,
    ):  # fmt: skip
        """One token: its valid rows, in order, to ``UNION[t, :count]``, and the count to ``LENS[t]``."""
        t = tl.program_id(0).to(tl.int64)
        k_end = K
        if HAS_LEN:
            k_end = tl.minimum(k_end, tl.load(TOPK_LEN + t))
        base = 0
        for c0 in range(0, K, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            ok = c < k_end
            row = tl.load(ROWS + t * stride_rt + c * stride_rk, mask=ok, other=-1)
            ok = ok & (row >= 0) & (row < R)
            flag = ok.to(tl.int32)
            pos = base + tl.cumsum(flag, 0) - 1
            tl.store(UNION + t * width + pos, row, mask=ok)
            base += tl.sum(flag, 0)
        tl.store(LENS + t, base)
