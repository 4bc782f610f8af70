"""Top-k conversion: request-local token positions -> global KV rows, in one pass.

An indexer gives every query token ``t`` up to ``K`` request-local token positions
``topk_pos[t, k]``. The paged KV cache maps position ``p`` of request ``req`` to the global row::

    row = block_table[req, p // block_size] * block_stride + p % block_size

An entry is invalid (-> ``-1``) when ``p < 0``, ``k >= topk_length[t]``, ``p >= seq_lens[req]``,
``req_ids[t]`` is outside ``[0, B)``, ``p // block_size`` is past the block table's width, the
block-table entry is negative (unallocated), or the row does not fit int32.

Decode context parallelism (``dcp = DcpShard(world N, interleave I, rank r)``): token ``p``
lives on rank ``(p // I) % N`` at local position ``(p // (N * I)) * I + p % I``. Only the
positions rank ``r`` owns are kept, converted through the rank's *local* block table (whose
blocks hold local positions); the others are ``-1``. ``seq_lens`` are request lengths in global
positions.

The Triton kernel (one program per query token) and the torch reference return identical
results (tested exactly).

Example:
    >>> pos = torch.tensor([[0, 5, -1, 9], [3, 4, 8, 2]], dtype=torch.int32)
    >>> req = torch.tensor([0, 1], dtype=torch.int32)
    >>> table = torch.tensor([[2, 0, 1], [1, 3, -1]], dtype=torch.int32)
    >>> rows, counts = convert_topk(pos, req, table, block_size=4)
    >>> rows.tolist(), counts.tolist()
    ([[8, 1, -1, 5], [7, 12, -1, 6]], [3, 3])
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from shardattn._checks import (
    INDEX_DTYPES,
    check_bool,
    check_disjoint,
    check_int,
    check_not_inputs,
    check_same_device,
    check_tensor,
)
from shardattn.kernels.backend import kernel_destination, use_triton, written_back
from shardattn.kernels.triton.topk import launch_convert_topk
from shardattn.plan.context import dcp_local_index, dcp_owner

INT32_MAX = 2**31 - 1


class DcpShard(NamedTuple):
    """One rank's view of an interleaved DCP KV layout (``docs``: "DCP layout")."""

    world: int
    interleave: int
    rank: int


def _check_inputs(topk_pos, req_ids, block_table, block_size, block_stride, seq_lens, topk_length, dcp):
    check_tensor("topk_pos", topk_pos, dtypes=INDEX_DTYPES, ndim=2)
    t = topk_pos.shape[0]
    check_tensor("req_ids", req_ids, dtypes=INDEX_DTYPES, shape=(t,))
    check_tensor("block_table", block_table, dtypes=INDEX_DTYPES, ndim=2)
    # rows are int32: a block or a stride past INT32_MAX rows addresses no row (and would overflow
    # the int64 row arithmetic)
    check_int("block_size", block_size, minimum=1, maximum=INT32_MAX)
    check_int("block_stride", block_stride, minimum=1, maximum=INT32_MAX)
    if block_stride < block_size:  # block b's rows [b*stride, b*stride + block_size) would hold block b+1's first
        raise ValueError(
            f"block_stride must be >= block_size ({block_size}): blocks {block_stride} rows apart would share "
            f"rows, got {block_stride}"
        )
    if seq_lens is not None:
        check_tensor("seq_lens", seq_lens, dtypes=INDEX_DTYPES, shape=(block_table.shape[0],))
        if seq_lens.device.type == "cpu" and bool((seq_lens < 0).any()):  # where the check costs no device sync
            raise ValueError(f"seq_lens must be >= 0, got {seq_lens.min().item()} (request {int(seq_lens.argmin())})")
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtypes=INDEX_DTYPES, shape=(t,))
    if dcp is not None:
        if not isinstance(dcp, tuple) or len(dcp) != 3:
            raise TypeError(f"dcp must be DcpShard(world, interleave, rank), got {dcp!r}")
        world, interleave, rank = (check_int(f"dcp.{n}", v) for n, v in zip(DcpShard._fields, dcp))
        if not (1 <= world <= INT32_MAX and 1 <= interleave <= INT32_MAX and 0 <= rank < world):
            raise ValueError(
                f"dcp must have 1 <= world, interleave <= {INT32_MAX} and 0 <= rank < world, got {tuple(dcp)}"
            )
        if world * interleave > INT32_MAX:  # one round of blocks: the kernel's int32 position arithmetic
            raise ValueError(f"dcp must have world * interleave <= {INT32_MAX} (positions are int32), got {tuple(dcp)}")
    check_same_device(
        topk_pos=topk_pos, req_ids=req_ids, block_table=block_table, seq_lens=seq_lens, topk_length=topk_length
    )


def convert_topk_reference(
    topk_pos: torch.Tensor,
    req_ids: torch.Tensor,
    block_table: torch.Tensor,
    *,
    block_size: int,
    block_stride: int | None = None,
    seq_lens: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    dcp: DcpShard | None = None,
    packed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`convert_topk` (int64 arithmetic, same outputs)."""
    stride = block_size if block_stride is None else block_stride
    t, k = topk_pos.shape
    b, m = block_table.shape
    pos = topk_pos.long()
    req = req_ids.long()[:, None].expand(t, k)
    valid = (pos >= 0) & (req >= 0) & (req < b)
    if topk_length is not None:
        valid &= torch.arange(k, device=pos.device)[None, :] < topk_length.long()[:, None]
    req_safe = torch.where(valid, req, torch.zeros_like(req))
    if seq_lens is not None:
        valid &= pos < seq_lens.long()[req_safe] if b > 0 else torch.zeros_like(valid)
    local = pos
    if dcp is not None:
        world, inter, rank = dcp
        valid &= dcp_owner(pos, world, inter) == rank
        local = dcp_local_index(pos, world, inter)
    blk = local // block_size
    valid &= blk < m
    if b == 0 or m == 0:
        valid &= False
        entry = torch.zeros_like(pos)
    else:
        entry = block_table.long()[req_safe, torch.where(valid, blk, torch.zeros_like(blk))]
    valid &= entry >= 0
    row = entry * stride + local % block_size
    valid &= row <= INT32_MAX
    rows = torch.where(valid, row, torch.full_like(row, -1)).to(torch.int32)
    counts = valid.sum(dim=1, dtype=torch.int32)
    if packed:  # valid entries first (a stable sort keeps their order), then the -1 ones
        rows = rows.gather(1, (~valid).to(torch.int8).argsort(dim=1, stable=True))
    return rows, counts


def convert_topk(
    topk_pos: torch.Tensor,
    req_ids: torch.Tensor,
    block_table: torch.Tensor,
    *,
    block_size: int,
    block_stride: int | None = None,
    seq_lens: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    dcp: DcpShard | None = None,
    packed: bool = False,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Convert request-local top-k positions to global KV rows and count the valid ones.

    Args:
        topk_pos: ``[T, K]`` int32 request-local positions; ``-1`` (or any invalid value) anywhere.
        req_ids: ``[T]`` int32 request of each query token.
        block_table: ``[B, M]`` int32 block ids per request (the rank-local table under DCP).
        block_size: tokens per block. block_stride: rows between blocks (default ``block_size``;
            at least ``block_size``: a smaller stride would make blocks share rows).
        seq_lens: ``[B]`` int32 request lengths (global positions; >= 0, checked on CPU tensors), optional.
        topk_length: ``[T]`` int32 per-row count of leading entries to use, optional.
        dcp: :class:`DcpShard` to keep only this rank's positions, optional (``world * interleave``,
            one round of blocks, at most ``2**31 - 1``: positions are int32).
        packed: each token's valid rows in their order at the front of its row, ``-1`` after
            them: a decode kernel given ``counts`` as its ``topk_length`` then reads no invalid
            entry (a DCP rank's share of a top-k is about ``K / W`` rows; a request shorter than
            the top-k has fewer).
        out: optional ``[T, K]`` int32 destination of ``rows`` (a reserved workspace buffer),
            sharing no memory with an input (the kernel's programs write rows while others still
            read positions and the block table).
    Returns:
        ``(rows [T, K] int32, counts [T] int32)``: global rows, ``-1`` where invalid (with
        ``packed``: rows ``counts[t]`` onward), and the number of valid entries per token
        (``rows`` is ``out`` when given).
    """
    stride = block_size if block_stride is None else block_stride
    _check_inputs(topk_pos, req_ids, block_table, block_size, stride, seq_lens, topk_length, dcp)
    check_bool("packed", packed)
    t, k = topk_pos.shape
    if out is not None:
        check_tensor("out", out, dtypes=(torch.int32,), shape=(t, k), device=topk_pos.device)
        check_disjoint(out=out)  # its own elements included
        check_not_inputs(
            {"out": out},
            {"topk_pos": topk_pos, "req_ids": req_ids, "block_table": block_table, "seq_lens": seq_lens,
             "topk_length": topk_length},
        )  # fmt: skip
    if not use_triton(topk_pos, req_ids, block_table, seq_lens, topk_length):
        rows, counts = convert_topk_reference(
            topk_pos, req_ids, block_table, block_size=block_size, block_stride=stride,
            seq_lens=seq_lens, topk_length=topk_length, dcp=dcp, packed=packed,
        )  # fmt: skip
        return (rows, counts) if out is None else (out.copy_(rows), counts)
    # the kernel writes rows with a unit last stride: another destination is filled from a copy
    dest = kernel_destination(out)
    rows = torch.empty(t, k, dtype=torch.int32, device=topk_pos.device) if dest is None else dest
    counts = torch.empty(t, dtype=torch.int32, device=topk_pos.device)
    if t == 0:
        return (rows if out is None else out), counts
    topk_pos = topk_pos if k == 0 or topk_pos.stride(1) == 1 else topk_pos.contiguous()
    block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    launch_convert_topk(
        topk_pos, req_ids, block_table, seq_lens, topk_length, rows, counts, block_size=block_size, block_stride=stride,
        dcp=dcp, packed=packed,
    )  # fmt: skip
    return written_back(out, rows), counts
