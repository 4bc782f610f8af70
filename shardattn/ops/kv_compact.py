"""Grouped prefill over a cache of more rows than a packed union entry can name: the blocks a
call's rows touch, gathered into a compact cache first.

A grouped tile's union entry packs a row into 24 bits (:mod:`shardattn.kernels.union_layout`), so
on a cache of ``2**24 - 1`` rows or more (19 GB of bf16 rows, 11 GB of ``fp8_ds_mla`` ones) the
grouped kernels cannot name every row, and a call there would run per query: at 8-32 heads a
tile of 64 rows then holds one query's 8-32 heads, a quarter to an eighth of it used. A prefill's
rows are those of its requests, a small part of such a cache, so :func:`compact_rows` gathers the
``COMPACT_BLOCK_ROWS``-row blocks the call's valid rows touch, in cache order, into a new cache
(bf16 rows, or ``fp8_ds_mla`` rows still quantised) and maps each row to its place there. The map
keeps the rows' order, their duplicates and their validity, so the attention over the compact
cache is the attention over the original one, bit for bit on every path.

The blocks are marked, counted and the rows moved by :mod:`shardattn.ops.touched_blocks` (Triton
kernels on the GPU, torch elsewhere); the rows are moved while the host waits for the count, which
costs one host synchronisation, so :func:`compact_rows` is never called during CUDA-graph capture
(the call then runs per query, as before).

Example:
    >>> kv = torch.randn(1000, 8)
    >>> rows = torch.tensor([[130, 5, -1, 999], [7, 130, 2000, 6]], dtype=torch.int32)
    >>> small_kv, small_rows = compact_rows(kv, rows, None, max_rows=1 << 24)
    >>> small_kv.shape[0], small_rows.tolist()  # blocks 0, 2 and 15 of 64 rows
    (192, [[66, 5, -1, 167], [7, 66, -1, 6]])
    >>> torch.equal(small_kv[167], kv[999])
    True

Its functions are building blocks of the sparse-MLA prefill ops (:func:`~shardattn.ops.sparse_mla.sparse_mla_attention`,
:func:`~shardattn.ops.sparse_mla_grouped.sparse_mla_grouped_prefill`): they take the arguments those ops
checked and check only what they need to run (the package does not export them).
"""

from __future__ import annotations

import torch

from shardattn.ops.touched_blocks import BLOCK_ROWS, moved_rows, touched_blocks

__all__ = ["COMPACT_BLOCK_ROWS", "compact_rows"]

#: Cache rows gathered together (a 64-token page of a DSA cache).
COMPACT_BLOCK_ROWS = BLOCK_ROWS


def compact_rows(
    kv: torch.Tensor, rows: torch.Tensor, topk_length: torch.Tensor | None, *, max_rows: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The cache blocks ``rows`` touch and ``rows`` mapped into them, or ``None`` when those
    blocks hold more than ``max_rows`` rows.

    Args:
        kv: ``[R, W]`` cache rows (any dtype: bf16 / fp16 / fp32 values, ``fp8_ds_mla`` bytes).
        rows: ``[T, K]`` int32; ``-1`` / out of range / past ``topk_length``: invalid.
        topk_length: ``[T]`` int32 or None.
        max_rows: the most rows the compact cache may have.
    Returns:
        ``(kv_compact [n * COMPACT_BLOCK_ROWS, W], rows_compact [T, K] int32)``: the touched blocks
        in cache order (rows past ``R`` in the last block repeat row ``R - 1``, and no entry names
        them) and each valid row's place among them; invalid entries ``-1``. One host sync.
    """
    num_rows = kv.shape[0]
    touched = touched_blocks(rows, topk_length, num_rows=num_rows)
    rows_compact = moved_rows(rows, topk_length, touched, num_rows=num_rows)  # queued before the count is read
    count, _ = touched.read()  # the host sync
    if count * COMPACT_BLOCK_ROWS > max_rows:
        return None
    offsets = torch.arange(COMPACT_BLOCK_ROWS, device=kv.device)
    blocks = touched.block_ids[:count].long()
    gathered = (blocks[:, None] * COMPACT_BLOCK_ROWS + offsets[None, :]).flatten().clamp_max(num_rows - 1)
    return kv[gathered], rows_compact
