"""Triton kernels that stage the FP8 rows a prefill reads as dense rows, once each
(the plan, the rule and the torch reference: :mod:`shardattn.ops.kv_fp8_stage`).

Rows are staged in blocks of ``2**BLOCK_SHIFT`` consecutive cache rows (a block is a page of an
engine's paged cache when its page size is that, 64 for DSA models):

* :func:`launch_mark_blocks`: ``mark[row >> BLOCK_SHIFT] = 1`` for every entry a union uses
  (``k < lens[g]``); the row is the entry's low bits (``ROW_MASK``: all of them with ``G = 1``,
  the 24 row bits of a packed entry otherwise, :mod:`shardattn.kernels.union_layout`). An entry
  in the same block as the one before it stores nothing (the first of their run does), nor does
  one whose block already looks marked to its SM (a load its L1 serves): every entry storing made
  the kernel 2.8x slower at ``G = 1`` on a 4M-row cache (docs/DECISIONS.md, D61). A program reads
  whole groups, about :data:`MARK_ENTRIES_PER_PROGRAM` entries, so most blocks are marked by the
  time it reads them again (D62). :func:`launch_mark_topk_rows` marks a call's top-k rows the same
  way before its union is built (invalid rows anywhere, ``topk_length``), and counts them.
* :func:`launch_move_rows`: a call's valid top-k rows moved to their places among the marked
  blocks (``(placed[row >> BLOCK_SHIFT] - 1) << BLOCK_SHIFT | row % 2**BLOCK_SHIFT``), others ``-1``:
  the rows the union is then built over (:mod:`shardattn.ops.touched_blocks`).
* :func:`launch_list_blocks` (packed layout): from the marks' inclusive prefix sum ``placed``
  (each marked block's place in cache order is ``placed[b] - 1``), the list of marked blocks and
  their count.
* :func:`launch_stage_blocks`: every marked block's rows dequantised (the in-kernel rule,
  :mod:`shardattn.kernels.triton.kv_fp8_read`) into its place in a dense buffer: one program per
  listed block (packed), or per cache block with the marked ones writing block ``b`` of a buffer
  that mirrors the cache; rows past the cache's end are written as 0.
* :func:`launch_remap_union`: each used entry's row moved to its staged position
  ``(placed[row >> BLOCK_SHIFT] - 1) << BLOCK_SHIFT | row % 2**BLOCK_SHIFT``, its membership bits
  kept; unused entries become ``-1``. ``placed`` is increasing over marked blocks, so a sorted,
  unique union stays sorted and unique.

No host synchronisation, no allocation: the caller sizes the buffers.
"""

from __future__ import annotations

import torch

from shardattn.kernels.backend import COMPILE_OPTIONS, unit_stride

try:  # Triton is optional: without it the torch reference runs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None

from shardattn.kernels.triton.kv_fp8_read import LATENT, ROPE, TILE

#: Entries of a union one remapping program reads.
ENTRIES_PER_PROGRAM = 1024
#: Entries a marking program reads at once, and about how many it reads in all (whole groups, one
#: after the other): fewer, longer programs find more blocks already marked (docs/DECISIONS.md, D62).
MARK_CHUNK = 2048
MARK_ENTRIES_PER_PROGRAM = 1 << 15
MARK_WARPS = 8
#: Blocks one listing program reads.
_LIST_CHUNK = 1024


def _union_grid(union: torch.Tensor) -> tuple[int, int]:
    return union.shape[0], triton.cdiv(union.shape[1], ENTRIES_PER_PROGRAM)


def _mark_grid(groups: int, width: int) -> tuple[tuple[int], int]:
    """``((programs,), groups_per_program)``: about :data:`MARK_ENTRIES_PER_PROGRAM` entries a program."""
    per_program = max(1, MARK_ENTRIES_PER_PROGRAM // max(width, 1))
    return (triton.cdiv(groups, per_program),), per_program


def launch_mark_blocks(
    union: torch.Tensor, lens: torch.Tensor, mark: torch.Tensor, *, row_mask: int, block_shift: int
) -> None:
    """Set ``mark[row >> block_shift] = 1`` (int32) for every used entry of ``union [groups, width]``
    (row stride any, entries contiguous) with ``lens [groups]`` int32 used entries per group."""
    if union.numel() == 0:
        return
    grid, per_program = _mark_grid(*union.shape)
    _mark_blocks_kernel[grid](
        union, lens, mark, mark, union.shape[0], per_program, union.shape[1], union.stride(0), 0,
        ROW_MASK=row_mask, BLOCK_SHIFT=block_shift, BLOCK=MARK_CHUNK, TOPK_ROWS=False, HAS_LENS=True,
        num_warps=MARK_WARPS, **COMPILE_OPTIONS,
    )  # fmt: skip


def launch_mark_topk_rows(
    rows: torch.Tensor,
    topk_length: torch.Tensor | None,
    num_rows: int,
    mark: torch.Tensor,
    counts: torch.Tensor,
    *,
    block_shift: int,
) -> None:
    """Set ``mark[row >> block_shift] = 1`` (int32) for every valid row of ``rows [T, K]`` (int32,
    entries contiguous; ``-1`` / out of ``[0, num_rows)`` anywhere, or past ``topk_length [T]``,
    is none) and add their count to ``counts[1]`` (int64)."""
    topk_length = unit_stride(topk_length)
    if rows.numel() == 0:
        return
    grid, per_program = _mark_grid(*rows.shape)
    _mark_blocks_kernel[grid](
        rows, rows if topk_length is None else topk_length, mark, counts, rows.shape[0], per_program,
        rows.shape[1], rows.stride(0), num_rows,
        ROW_MASK=0x7FFFFFFF, BLOCK_SHIFT=block_shift, BLOCK=MARK_CHUNK, TOPK_ROWS=True,
        HAS_LENS=topk_length is not None, num_warps=MARK_WARPS, **COMPILE_OPTIONS,
    )  # fmt: skip


def launch_move_rows(
    rows: torch.Tensor,
    topk_length: torch.Tensor | None,
    placed: torch.Tensor,
    num_rows: int,
    out: torch.Tensor,
    *,
    block_shift: int,
) -> None:
    """``out [T, K]`` int32: every valid row of ``rows [T, K]`` (int32, contiguous; ``-1`` / out of
    ``[0, num_rows)`` anywhere, or past ``topk_length [T]``, is none) at ``(placed[row >> block_shift]
    - 1) << block_shift | row % 2**block_shift`` (``placed``: the marks' inclusive prefix sum); other
    entries ``-1``."""
    rows, topk_length = rows.contiguous(), unit_stride(topk_length)
    if rows.numel() == 0:
        return
    _move_rows_kernel[(rows.shape[0], triton.cdiv(rows.shape[1], ENTRIES_PER_PROGRAM))](
        rows, rows if topk_length is None else topk_length, placed, out, rows.shape[1], num_rows,
        BLOCK_SHIFT=block_shift, BLOCK=ENTRIES_PER_PROGRAM, HAS_LENS=topk_length is not None, **COMPILE_OPTIONS,
    )  # fmt: skip


def launch_list_blocks(
    mark: torch.Tensor, placed: torch.Tensor, lens: torch.Tensor, block_ids: torch.Tensor, counts: torch.Tensor
) -> None:
    """From ``mark [B]`` and its inclusive prefix sum ``placed [B]`` (int32): ``block_ids[placed[b] - 1]
    = b`` for every marked ``b`` (the marked blocks in order) and ``counts [2]`` int64 = (marked
    blocks, ``sum(lens)``); with no ``lens`` (0 groups) ``counts[1]`` is left as it is."""
    _list_blocks_kernel[(triton.cdiv(mark.shape[0], _LIST_CHUNK),)](
        mark, placed, lens, block_ids, counts, mark.shape[0], lens.shape[0], CHUNK=_LIST_CHUNK, **COMPILE_OPTIONS
    )


def launch_stage_blocks(
    kv: torch.Tensor, blocks: torch.Tensor, out: torch.Tensor, *, packed: bool, num_blocks: int, block_shift: int
) -> None:
    """Dequantise blocks of ``2**block_shift`` rows of ``kv [R, 656]`` uint8 into ``out [n * 2**block_shift,
    576]`` (fp16 / bf16 / fp32, rows contiguous): with ``packed``, block ``blocks[i]`` (int32 block ids)
    into block ``i`` for ``i < num_blocks``; otherwise every block ``b < num_blocks`` with
    ``blocks[b] != 0`` (the marks) into block ``b``."""
    if num_blocks == 0:
        return
    _stage_blocks_kernel[(num_blocks,)](
        kv, blocks, out, kv.shape[0], kv.stride(0), out.stride(0),
        BLOCK_ROWS=1 << block_shift, PACKED=packed, num_warps=4, **COMPILE_OPTIONS,
    )  # fmt: skip


def launch_remap_union(
    union: torch.Tensor,
    lens: torch.Tensor,
    placed: torch.Tensor,
    out: torch.Tensor,
    *,
    row_mask: int,
    block_shift: int,
) -> None:
    """Write ``union``'s entries with their rows at the staged positions (block ``placed[b] - 1``, the
    marks' inclusive prefix sum) into ``out [groups, width]`` (contiguous int32); entries past
    ``lens[g]`` become ``-1``."""
    if union.numel() == 0:
        return
    high_bits = ~row_mask & 0xFFFFFFFF
    _remap_union_kernel[_union_grid(union)](
        union, lens, placed, out, union.shape[1], union.stride(0),
        ROW_MASK=row_mask, HIGH_BITS=high_bits - (1 << 32) if high_bits >= 1 << 31 else high_bits,
        BLOCK_SHIFT=block_shift, BLOCK=ENTRIES_PER_PROGRAM, **COMPILE_OPTIONS,
    )  # fmt: skip


if triton is not None:
    from shardattn.kernels.triton.kv_fp8_read import load_fp8_rope, load_fp8_tile

    _LATENT = tl.constexpr(LATENT)
    _ROPE = tl.constexpr(ROPE)
    _TILE = tl.constexpr(TILE)

    @triton.jit
    def _used_entries(union_ptr, lens_ptr, width, stride_group, BLOCK: tl.constexpr):
        """``(entries [BLOCK], used [BLOCK], k [BLOCK])`` of this program's slice of its group."""
        g = tl.program_id(0)
        k = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        used = (k < tl.load(lens_ptr + g)) & (k < width)
        e = tl.load(union_ptr + g.to(tl.int64) * stride_group + k, mask=used, other=0)
        return e, used, k

    @triton.jit(do_not_specialize=["num_groups", "groups_per_program", "width", "stride_group", "num_rows"])
    def _mark_blocks_kernel(
        entries_ptr, lens_ptr, mark_ptr, counts_ptr, num_groups, groups_per_program, width, stride_group, num_rows,
        ROW_MASK: tl.constexpr, BLOCK_SHIFT: tl.constexpr, BLOCK: tl.constexpr, TOPK_ROWS: tl.constexpr,
        HAS_LENS: tl.constexpr,
    ):  # fmt: skip
        """``groups_per_program`` groups from ``program_id * groups_per_program`` on, each in chunks of
        ``BLOCK`` entries: a union's used entries (``TOPK_ROWS`` False), or a top-k list's valid rows
        (``-1`` / out of ``[0, num_rows)`` anywhere is none; ``lens``: ``topk_length``, where
        ``HAS_LENS``), whose count is added to ``counts[1]``."""
        first_group = tl.program_id(0) * groups_per_program
        valid = tl.zeros([BLOCK], dtype=tl.int32)
        for i in range(0, groups_per_program):
            g = first_group + i
            n = tl.where(g < num_groups, width, 0)
            if HAS_LENS:
                n = tl.minimum(n, tl.load(lens_ptr + g, mask=g < num_groups, other=0))
            row_ptr = entries_ptr + g.to(tl.int64) * stride_group
            for start in range(0, n, BLOCK):
                k = start + tl.arange(0, BLOCK)
                used = k < n
                e = tl.load(row_ptr + k, mask=used, other=0)
                prev = tl.load(row_ptr + k - 1, mask=used & (k > 0), other=0)
                block = (e & ROW_MASK) >> BLOCK_SHIFT
                prev_same = (k > 0) & (((prev & ROW_MASK) >> BLOCK_SHIFT) == block)
                if TOPK_ROWS:
                    used &= (e >= 0) & (e < num_rows)
                    prev_same &= (prev >= 0) & (prev < num_rows)
                    valid += used.to(tl.int32)
                # only the first entry of a run in one block stores, and only while the block looks
                # unmarked to this SM: the load is served by its L1 (a stale 0 costs one more store)
                first = used & ~prev_same
                seen = tl.load(mark_ptr + block, mask=first, other=1, cache_modifier=".ca")
                tl.store(mark_ptr + block, tl.full([BLOCK], 1, tl.int32), mask=first & (seen == 0))
        if TOPK_ROWS:
            tl.atomic_add(counts_ptr + 1, tl.sum(valid.to(tl.int64), 0), sem="relaxed")

    @triton.jit(do_not_specialize=["width", "num_rows"])
    def _move_rows_kernel(
        rows_ptr, lens_ptr, placed_ptr, out_ptr, width, num_rows,
        BLOCK_SHIFT: tl.constexpr, BLOCK: tl.constexpr, HAS_LENS: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0)
        k = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = k < width
        offs = t.to(tl.int64) * width + k
        row = tl.load(rows_ptr + offs, mask=inside, other=-1)
        valid = (row >= 0) & (row < num_rows)
        if HAS_LENS:
            valid &= k < tl.load(lens_ptr + t)
        place = tl.load(placed_ptr + (row >> BLOCK_SHIFT), mask=valid, other=1) - 1
        moved = (place << BLOCK_SHIFT) | (row & ((1 << BLOCK_SHIFT) - 1))
        tl.store(out_ptr + offs, tl.where(valid, moved, -1), mask=inside)

    @triton.jit(do_not_specialize=["num_blocks", "num_groups"])
    def _list_blocks_kernel(
        mark_ptr, placed_ptr, lens_ptr, block_ids_ptr, counts_ptr, num_blocks, num_groups, CHUNK: tl.constexpr
    ):
        p = tl.program_id(0)
        b = p * CHUNK + tl.arange(0, CHUNK)
        marked = tl.load(mark_ptr + b, mask=b < num_blocks, other=0) != 0
        place = tl.load(placed_ptr + b, mask=marked, other=1) - 1
        tl.store(block_ids_ptr + place, b, mask=marked)
        if p == 0:
            entries = tl.zeros([], dtype=tl.int64)
            for start in range(0, num_groups, CHUNK):
                g = start + tl.arange(0, CHUNK)
                entries += tl.sum(tl.load(lens_ptr + g, mask=g < num_groups, other=0).to(tl.int64), 0)
            tl.store(counts_ptr, tl.load(placed_ptr + num_blocks - 1).to(tl.int64))
            if num_groups > 0:  # else counts[1] is the marking's (launch_mark_topk_rows)
                tl.store(counts_ptr + 1, entries)

    @triton.jit(do_not_specialize=["num_rows"])
    def _stage_blocks_kernel(
        kv_ptr, blocks_ptr, out_ptr, num_rows, stride_kv, stride_out,
        BLOCK_ROWS: tl.constexpr, PACKED: tl.constexpr,
    ):  # fmt: skip
        p = tl.program_id(0)
        dtype = out_ptr.dtype.element_ty
        if PACKED:  # program p: block blocks[p], into block p
            b = tl.load(blocks_ptr + p)
            staged = True
        else:  # program p: block p where marked, into block p
            b = p
            staged = tl.load(blocks_ptr + p) != 0
        if staged:
            r = tl.arange(0, BLOCK_ROWS)
            src = b.to(tl.int64) * BLOCK_ROWS + r
            inside = src < num_rows
            row_ptr = kv_ptr + src * stride_kv
            out_rows = out_ptr + (p.to(tl.int64) * BLOCK_ROWS + r)[:, None] * stride_out
            cols = tl.arange(0, _TILE)
            for t in tl.static_range(_LATENT // _TILE):
                tl.store(out_rows + t * _TILE + cols[None, :], load_fp8_tile(row_ptr, inside, t, dtype))
            tl.store(out_rows + _LATENT + tl.arange(0, _ROPE)[None, :], load_fp8_rope(row_ptr, inside, dtype))

    @triton.jit(do_not_specialize=["width", "stride_group"])
    def _remap_union_kernel(
        union_ptr, lens_ptr, placed_ptr, out_ptr, width, stride_group,
        ROW_MASK: tl.constexpr, HIGH_BITS: tl.constexpr, BLOCK_SHIFT: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        e, used, k = _used_entries(union_ptr, lens_ptr, width, stride_group, BLOCK)
        row = e & ROW_MASK
        new_block = tl.load(placed_ptr + (row >> BLOCK_SHIFT), mask=used, other=1) - 1
        new_row = (new_block << BLOCK_SHIFT) | (row & ((1 << BLOCK_SHIFT) - 1))
        entry = tl.where(used, (e & HIGH_BITS) | new_row, -1)
        tl.store(out_ptr + tl.program_id(0).to(tl.int64) * width + k, entry, mask=k < width)


def stage_kernels() -> tuple:
    """The staging kernels (mark, list, stage, remap, move), for warm-up and compile counting."""
    return (_mark_blocks_kernel, _list_blocks_kernel, _stage_blocks_kernel, _remap_union_kernel, _move_rows_kernel)


__all__ = [
    "ENTRIES_PER_PROGRAM",
    "MARK_CHUNK",
    "MARK_ENTRIES_PER_PROGRAM",
    "launch_list_blocks",
    "launch_mark_blocks",
    "launch_mark_topk_rows",
    "launch_move_rows",
    "launch_remap_union",
    "launch_stage_blocks",
    "stage_kernels",
]
