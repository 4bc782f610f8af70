"""Row slices of Gluon decode: each token's valid rows packed in order and cut into slices (Triton
kernel, torch reference). The path that runs them: :mod:`shardattn.ops.sparse_mla_decode_gluon`.

The Gluon kernel attends ``union[p, :lens[p]]`` and masks only past ``lens[p]``, so the valid rows
of each token (``0 <= row < R``, within ``topk_length``; invalid entries anywhere) are packed to
the front, in order, and cut into ``S`` slices of ``chunk`` rows: pseudo-query ``p = s * T + t``
holds slice ``s`` of token ``t`` (``union [S * T, chunk]``, ``lens [S * T]``). One program per token.
"""

from __future__ import annotations

import torch

from shardattn.kernels.backend import use_triton
from shardattn.kernels.gluon.sparse_mla_decode import MAX_SPLITS

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None

__all__ = ["split_rows", "split_rows_reference"]


def split_rows_reference(
    rows: torch.Tensor,
    *,
    num_kv_rows: int,
    num_splits: int,
    chunk: int,
    topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`split_rows` (entries past ``lens`` are ``-1`` here).

    Example:
        >>> rows = torch.tensor([[5, -1, 7, 9, 99]], dtype=torch.int32)
        >>> u, n = split_rows_reference(rows, num_kv_rows=10, num_splits=2, chunk=2)
        >>> u.tolist(), n.tolist()
        ([[5, 7], [9, -1]], [2, 1])
    """
    t, k = rows.shape
    r = rows.long()
    valid = (r >= 0) & (r < num_kv_rows)
    if topk_length is not None:
        valid &= torch.arange(k, device=rows.device)[None, :] < topk_length.long()[:, None]
    pos = valid.long().cumsum(1) - 1
    width = num_splits * chunk
    packed = torch.full((t, width + 1), -1, dtype=torch.int32, device=rows.device)
    packed.scatter_(1, torch.where(valid, pos, width), torch.where(valid, r, -1).int())
    union = packed[:, :width].view(t, num_splits, chunk).transpose(0, 1).reshape(num_splits * t, chunk)
    count = valid.sum(1)
    starts = torch.arange(num_splits, device=rows.device)[:, None] * chunk
    lens = (count[None, :] - starts).clamp(0, chunk).reshape(-1).int()
    return union.contiguous(), lens


def split_rows(
    rows: torch.Tensor,
    *,
    num_kv_rows: int,
    num_splits: int,
    chunk: int,
    topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's valid rows packed in order and cut into ``num_splits`` slices of ``chunk`` rows.

    Args:
        rows: ``[T, K]`` int32 KV rows; ``-1`` / out of ``[0, num_kv_rows)`` invalid, anywhere.
        num_kv_rows: ``R``. num_splits, chunk: ``S`` and rows per slice, ``S * chunk >= K``.
        topk_length: ``[T]`` int32 leading entries of each row to use, optional.
    Returns:
        ``(union [S * T, chunk] int32, lens [S * T] int32)``: pseudo-query ``p = s * T + t`` holds
        valid rows ``s * chunk ..`` of token ``t``, ``lens[p]`` of them (entries past it are
        unspecified on the Triton path). CUDA tensors (or the interpreter) run the Triton kernel.
    """
    t, k = rows.shape
    if num_splits * chunk < k:
        raise ValueError(f"num_splits * chunk must cover the row ({num_splits} * {chunk} < {k})")
    if triton is None or not use_triton(rows) or t == 0:
        return split_rows_reference(
            rows, num_kv_rows=num_kv_rows, num_splits=num_splits, chunk=chunk, topk_length=topk_length
        )
    union = torch.empty(num_splits * t, chunk, dtype=torch.int32, device=rows.device)
    lens = torch.empty(num_splits * t, dtype=torch.int32, device=rows.device)
    block = min(1024, max(16, triton.next_power_of_2(max(k, 1))))
    _split_rows_kernel[(t,)](
        rows, topk_length if topk_length is not None else rows, union, lens,
        t, k, num_kv_rows, rows.stride(0), rows.stride(1), chunk, num_splits,
        BLOCK=block, BLOCK_S=max(MAX_SPLITS, triton.next_power_of_2(num_splits)), HAS_LEN=topk_length is not None,
    )  # fmt: skip
    return union, lens


if triton is not None:

    @triton.jit(do_not_specialize=["T", "K", "R", "chunk", "S"])
    def _split_rows_kernel(
        ROWS, TOPK_LEN, UNION, LENS,
        T, K, R, stride_rt, stride_rk, chunk, S,
        BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, HAS_LEN: tl.constexpr,
    ):  # fmt: skip
        """One token: its valid rows, in order, to ``UNION[(pos // chunk) * T + t, pos % chunk]``."""
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
            dst = (pos // chunk).to(tl.int64) * T * chunk + t * chunk + pos % chunk
            tl.store(UNION + dst, row, mask=ok)
            base += tl.sum(flag, 0)
        s = tl.arange(0, BLOCK_S)
        n = tl.minimum(tl.maximum(base - s * chunk, 0), chunk)
        tl.store(LENS + s.to(tl.int64) * T + t, n, mask=s < S)
