"""The cache blocks a call's top-k rows touch: marked, listed and counted, and the rows moved to
their places among them.

A prefill's rows are those of its requests, a small part of a large cache. Two paths take only
the blocks of ``BLOCK_ROWS`` rows that those rows touch, in cache order: FP8 staging on a cache
past the mirror's rows (:mod:`shardattn.ops.kv_fp8_stage`, packed layout) dequantises them, and a
grouped prefill on a cache past 24-bit union rows (:mod:`shardattn.ops.kv_compact`) gathers them.
Both then build the call's union over the moved rows, as over a cache of only those blocks: on
sm_90 the shared-memory bitmap build, instead of the row sort a large cache takes
(docs/DECISIONS.md, D62).

* :func:`touched_blocks` marks block ``row // BLOCK_ROWS`` of every valid row, takes the marks'
  inclusive prefix sum ``placed`` (marked block ``b`` goes to place ``placed[b] - 1``), lists the
  marked blocks in order, and copies (blocks, valid rows) to the host without blocking: the host
  waits for the marking alone (:meth:`TouchedBlocks.read`), while the GPU goes on.
* :func:`moved_rows` maps each valid row to ``(placed[row // BLOCK_ROWS] - 1) * BLOCK_ROWS + row %
  BLOCK_ROWS`` and every other entry to ``-1``. The map is increasing, so it keeps the rows' order,
  their duplicates and their validity: the union of the moved rows is the union of the rows with
  each row moved, and the attention over the taken blocks is bit for bit the attention over the
  cache.

A row is valid when ``0 <= row < num_rows`` and ``k < topk_length[t]``
(:func:`~shardattn.ops.row_entries.valid_mask`). Triton kernels on the GPU
(:mod:`shardattn.kernels.triton.kv_fp8_stage`), torch elsewhere (the same results: tested under the
interpreter).

Example:
    >>> rows = torch.tensor([[130, 5, -1, 999], [7, 130, 2000, 6]], dtype=torch.int32)
    >>> touched = touched_blocks(rows, None, num_rows=1000)
    >>> touched.read(), touched.block_ids.tolist()  # blocks 0, 2 and 15 of 64 rows; 6 valid rows
    ((3, 6), [0, 2, 15])
    >>> moved_rows(rows, None, touched, num_rows=1000).tolist()
    [[66, 5, -1, 167], [7, 66, -1, 6]]

Its functions are building blocks of the sparse-MLA prefill ops (:func:`~shardattn.ops.sparse_mla.sparse_mla_attention`,
:func:`~shardattn.ops.sparse_mla_grouped.sparse_mla_grouped_prefill`): they take the arguments those ops
checked and check only what they need to run (the package does not export them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardattn.kernels.backend import use_triton
from shardattn.ops.row_entries import valid_mask

__all__ = ["BLOCK_ROWS", "TouchedBlocks", "list_blocks", "moved_rows", "touched_blocks"]

#: Cache rows taken together (a 64-token page of a DSA cache).
BLOCK_ROWS = 64
BLOCK_SHIFT = BLOCK_ROWS.bit_length() - 1


@dataclass(frozen=True)
class TouchedBlocks:
    """The blocks a call's top-k rows touch, and their count on its way to the host.

    Attributes:
        marks: int32 ``[ceil(R / BLOCK_ROWS)]``, 1 at every touched block.
        placed: int32, the marks' inclusive prefix sum; block_ids: int32, the touched blocks in order
            (entries past the count unspecified).
        counts: int64 ``[2]``: (touched blocks, valid rows), in pinned host memory on a GPU (copied
            without blocking), the device values elsewhere.
        ready: the CUDA event recorded after that copy (``None`` off CUDA).
    """

    marks: torch.Tensor
    placed: torch.Tensor
    block_ids: torch.Tensor
    counts: torch.Tensor
    ready: torch.cuda.Event | None

    def read(self) -> tuple[int, int]:
        """``(touched blocks, valid rows)``: waits for the marking only, not for work queued after it."""
        if self.ready is not None:
            self.ready.synchronize()
        blocks, valid = self.counts.tolist()
        return blocks, valid


def list_blocks(
    marks: torch.Tensor, lens: torch.Tensor, triton: bool, counts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(placed [B] int32, block_ids [B] int32, counts [2] int64)``: the marks' inclusive prefix sum
    (marked block ``b`` goes to place ``placed[b] - 1``), the marked blocks in order, and (marked
    blocks, ``sum(lens)``). On the GPU into ``counts`` when given, whose ``[1]`` stays as it is when
    ``lens`` is empty."""
    placed = torch.cumsum(marks, 0, dtype=torch.int32)
    if triton:
        from shardattn.kernels.triton.kv_fp8_stage import launch_list_blocks

        block_ids = torch.empty_like(marks)
        if counts is None:
            counts = torch.empty(2, dtype=torch.int64, device=marks.device)
        launch_list_blocks(marks, placed, lens, block_ids, counts)
        return placed, block_ids, counts
    block_ids = torch.nonzero(marks).flatten().to(torch.int32)
    return placed, block_ids, torch.stack([placed[-1].long(), lens.sum(dtype=torch.int64)])


def touched_blocks(rows: torch.Tensor, topk_length: torch.Tensor | None, *, num_rows: int) -> TouchedBlocks:
    """The blocks of a cache of ``num_rows`` rows that ``rows`` touch: marked, listed, counted.

    Args:
        rows: ``[T, K]`` int32 cache rows (``-1`` / out of ``[0, num_rows)`` anywhere: invalid).
        topk_length: ``[T]`` int32 leading entries to use, or ``None``.
        num_rows: the cache's rows ``R``.
    """
    marks = torch.zeros(max(1, -(-num_rows // BLOCK_ROWS)), dtype=torch.int32, device=rows.device)
    if use_triton(rows):
        from shardattn.kernels.triton.kv_fp8_stage import launch_mark_topk_rows

        counts = torch.zeros(2, dtype=torch.int64, device=rows.device)
        launch_mark_topk_rows(rows.contiguous(), topk_length, num_rows, marks, counts, block_shift=BLOCK_SHIFT)
        placed, block_ids, counts = list_blocks(marks, marks[:0], True, counts)
    else:
        valid = valid_mask(rows, num_rows, topk_length)
        marks[rows[valid].long() >> BLOCK_SHIFT] = 1
        placed, block_ids, counts = list_blocks(marks, valid.sum(dtype=torch.int32)[None], False)
    ready = None
    if rows.is_cuda:
        host = torch.empty(2, dtype=torch.int64, pin_memory=True)
        host.copy_(counts, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        counts = host
    return TouchedBlocks(marks, placed, block_ids, counts, ready)


def moved_rows(
    rows: torch.Tensor, topk_length: torch.Tensor | None, touched: TouchedBlocks, *, num_rows: int
) -> torch.Tensor:
    """``[T, K]`` int32: each valid row of ``rows`` at its place among ``touched``'s blocks (module
    docstring), every other entry ``-1``. Queued on the GPU without waiting for the count."""
    if use_triton(rows):
        from shardattn.kernels.triton.kv_fp8_stage import launch_move_rows

        out = torch.empty(rows.shape, dtype=torch.int32, device=rows.device)
        launch_move_rows(rows.contiguous(), topk_length, touched.placed, num_rows, out, block_shift=BLOCK_SHIFT)
        return out
    valid = valid_mask(rows, num_rows, topk_length)
    block = torch.where(valid, rows, 0).long() >> BLOCK_SHIFT
    moved = (touched.placed.long()[block] - 1) * BLOCK_ROWS + (rows.long() & (BLOCK_ROWS - 1))
    return torch.where(valid, moved, -1).to(torch.int32)
