"""Prefill over an ``fp8_ds_mla`` cache: the rows its union reads, dequantised once, before the kernel.

A prefill kernel that dequantises FP8 rows in the kernel does it once per tile that reads a row:
once per query (per query group on grouped tiles) and key, the same row again for every query that
picked it. A prefill's queries pick mostly the same rows (those of their requests), so
:func:`stage_fp8_union` instead dequantises each block of ``STAGE_BLOCK_ROWS`` cache rows that the
union touches once, into a dense buffer in q's dtype, and the dense kernel runs on that buffer.
Each staged value is the in-kernel one (``dtype(fp32(code) * scale)``,
:mod:`shardattn.kernels.triton.kv_fp8_read`) and the union keeps its order, so the result is bit
for bit the in-kernel dequantisation's (tested on the GPU). Two layouts of the buffer:

* **mirror** (a cache of at most ``max_rows`` rows): the buffer has the cache's rows, the touched
  blocks written at their own place, the union used as it is. The decision needs no device value
  (stage when the union buffer holds at least ``min_reuse`` entries per cache row): no host
  synchronisation, and it runs inside CUDA-graph capture.
* **packed** (a larger cache): the touched blocks in cache order and the union's rows moved to
  them. Their count costs one host synchronisation (so never inside capture); stage when the
  union has at least ``min_reuse`` used entries per staged row and the rows fit ``max_rows``.
  Where the prefill builds its union, :func:`stage_touched` counts the blocks from the top-k rows
  first and builds the union over the rows moved into them (:mod:`shardattn.ops.touched_blocks`:
  a union over a cache of only the staged rows, the shared-memory build on sm_90, instead of the
  row sort a large cache takes); with a union built beforehand, :func:`stage_fp8_union` marks,
  counts and moves the union's rows.

Otherwise (rows picked all over a large cache, or decode-sized calls of under
:data:`~shardattn.plan.crossovers.STAGE_MIN_ENTRIES` entries) it returns ``None`` and the kernel dequantises in place.
The touched blocks are marked by the union build where the prefill builds its union
(:func:`stage_marks`, :func:`~shardattn.ops.union.build_union`'s ``block_marks``: the shared-memory
build marks them from its bitmap as it counts it), else here from the union
(:func:`mark_touched_blocks`).
Triton kernels on the GPU (:mod:`shardattn.kernels.triton.kv_fp8_stage`), torch elsewhere (the
same results: tested under the interpreter).

Example:
    >>> from shardattn.ops.kv_fp8 import dequantize_kv, quantize_kv
    >>> kv8 = quantize_kv(torch.randn(400, 576))
    >>> union = torch.arange(64, 192, dtype=torch.int32).repeat(4, 1)  # four queries read rows 64..191
    >>> lens = torch.tensor([128, 128, 128, 100], dtype=torch.int32)
    >>> staged = stage_fp8_union(kv8, union, lens, group_size=1, dtype=torch.float32, min_entries=0, max_rows=256)
    >>> staged.kv.shape[0], staged.union[0, :3].tolist(), staged.union[3, 99:101].tolist()  # packed: blocks 1, 2
    (128, [0, 1, 2], [99, -1])
    >>> torch.equal(staged.kv[5], dequantize_kv(kv8, torch.float32)[69])
    True
    >>> union8, lens8 = union.repeat(2, 1), lens.repeat(2)
    >>> mirror = stage_fp8_union(kv8, union8, lens8, group_size=1, dtype=torch.float32, min_entries=0)
    >>> mirror.kv.shape[0], mirror.union is union8, torch.equal(mirror.kv[69], dequantize_kv(kv8, torch.float32)[69])
    (448, True, True)
    >>> stage_fp8_union(kv8, union, lens, group_size=1, dtype=torch.float32, min_entries=0) is None  # 512 < 2 x 448
    True

Its functions are building blocks of the sparse-MLA prefill ops (:func:`~shardattn.ops.sparse_mla.sparse_mla_attention`,
:func:`~shardattn.ops.sparse_mla_grouped.sparse_mla_grouped_prefill`): they take the arguments those ops
checked and check only what they need to run (the package does not export them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardattn.kernels.backend import use_triton
from shardattn.kernels.union_layout import MAX_PACKED_ROWS
from shardattn.ops.kv_fp8 import dequantize_kv
from shardattn.ops.kv_fp8_layout import FP8_DS_MLA
from shardattn.ops.touched_blocks import BLOCK_ROWS, BLOCK_SHIFT, list_blocks, moved_rows, touched_blocks
from shardattn.plan.crossovers import STAGE_MIN_ENTRIES, STAGE_MIN_REUSE

__all__ = [
    "LAYOUTS",
    "STAGE_BLOCK_ROWS",
    "STAGE_MAX_ROWS",
    "StagedRows",
    "kernel_rows",
    "mark_touched_blocks",
    "stage_fp8_union",
    "stage_marks",
    "stage_touched",
    "stages_packed",
]

#: Cache rows staged together (a 64-token page of a DSA cache).
STAGE_BLOCK_ROWS = BLOCK_ROWS
_BLOCK_SHIFT = BLOCK_SHIFT
#: The most rows one call stages (in bf16, 576 MiB of buffer): four requests of 128K tokens.
STAGE_MAX_ROWS = 1 << 19
#: The staged buffer's layouts (module docstring).
LAYOUTS = ("mirror", "packed")


@dataclass(frozen=True)
class StagedRows:
    """The dense rows a prefill reads and its union over them.

    Attributes:
        kv: ``[n * STAGE_BLOCK_ROWS, 576]`` in q's dtype: the touched blocks' rows, dequantised
            (rows past the cache's end: 0), at their cache rows (mirror: ``n`` covers the cache,
            other rows unspecified) or packed in cache order.
        union: ``[groups, width]`` int32: the union itself (mirror), or the union with its rows
            moved into ``kv`` (packed; membership bits kept, entries past ``lens[g]``: ``-1``).
    """

    kv: torch.Tensor
    union: torch.Tensor


def _row_mask(group_size: int) -> int:
    return 0x7FFFFFFF if group_size == 1 else MAX_PACKED_ROWS


def _used(union: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    return torch.arange(union.shape[1], device=union.device)[None, :] < lens[:, None].long()


def _mark_torch(union: torch.Tensor, lens: torch.Tensor, mark: torch.Tensor, row_mask: int) -> None:
    rows = union.long()[_used(union, lens)] & row_mask
    mark[rows >> _BLOCK_SHIFT] = 1


def mark_touched_blocks(union: torch.Tensor, lens: torch.Tensor, marks: torch.Tensor, *, group_size: int) -> None:
    """``marks[row // STAGE_BLOCK_ROWS] = 1`` (int32 ``[ceil(R / STAGE_BLOCK_ROWS)]``) for every row a
    used entry of ``union [groups, width]`` (``lens [groups]``, the union's ``G``) names; a Triton
    kernel on the GPU, torch elsewhere. Other entries of ``marks`` are left as they are."""
    row_mask = _row_mask(group_size)
    if use_triton(union, lens, marks):
        from shardattn.kernels.triton.kv_fp8_stage import launch_mark_blocks

        launch_mark_blocks(union, lens, marks, row_mask=row_mask, block_shift=_BLOCK_SHIFT)
    else:
        _mark_torch(union, lens, marks, row_mask)


def stage_marks(kv: torch.Tensor, groups: int, width: int) -> torch.Tensor | None:
    """Zeroed marks ``[ceil(R / STAGE_BLOCK_ROWS)]`` int32 for a union of ``[groups, width]`` over the
    ``fp8_ds_mla`` rows ``kv``, when :func:`stage_fp8_union`'s rule may stage it in the mirror layout
    (known from shapes alone), so the union build can mark the touched blocks as it runs
    (:func:`~shardattn.ops.union.build_union`'s ``block_marks``); else ``None`` (the packed layout
    counts them before the build: :func:`stage_touched`)."""
    if kv.dtype != torch.uint8 or _layout(kv, groups * width) != "mirror":
        return None
    return torch.zeros(-(-kv.shape[0] // STAGE_BLOCK_ROWS), dtype=torch.int32, device=kv.device)


def _stage_torch(kv: torch.Tensor, mark: torch.Tensor, placed: torch.Tensor | None, out: torch.Tensor) -> None:
    blocks = torch.nonzero(mark).flatten()
    offsets = torch.arange(STAGE_BLOCK_ROWS, device=kv.device)
    src = (blocks[:, None] * STAGE_BLOCK_ROWS + offsets).flatten()
    dst_blocks = blocks if placed is None else placed.long()[blocks] - 1
    dst = (dst_blocks[:, None] * STAGE_BLOCK_ROWS + offsets).flatten()
    inside = src < kv.shape[0]
    out[dst] = 0
    out[dst[inside]] = dequantize_kv(kv[src[inside]], out.dtype)


def _remap_torch(
    union: torch.Tensor, lens: torch.Tensor, placed: torch.Tensor, out: torch.Tensor, row_mask: int
) -> None:
    e = union.long()
    row = e & row_mask
    new_row = placed.long()[row.clamp(0, (placed.shape[0] << _BLOCK_SHIFT) - 1) >> _BLOCK_SHIFT] - 1
    new_row = (new_row << _BLOCK_SHIFT) | (row & (STAGE_BLOCK_ROWS - 1))
    entry = ((e & ~row_mask) | new_row) & 0xFFFFFFFF
    entry = torch.where(entry >= 1 << 31, entry - (1 << 32), entry)
    out.copy_(torch.where(_used(union, lens), entry, -1).to(torch.int32))


def _layout(
    kv: torch.Tensor,
    entries: int,
    max_rows: int = STAGE_MAX_ROWS,
    min_entries: int = STAGE_MIN_ENTRIES,
    min_reuse: float = STAGE_MIN_REUSE,
) -> str | None:
    """The rule's layout for a union buffer of ``entries`` before any device value is known
    (``None``: do not stage)."""
    cache_rows = -(-kv.shape[0] // STAGE_BLOCK_ROWS) * STAGE_BLOCK_ROWS
    if entries < min_entries:
        return None
    if cache_rows <= max_rows:
        return "mirror" if entries >= min_reuse * cache_rows else None
    if kv.is_cuda and torch.cuda.is_current_stream_capturing():
        return None  # counting the touched blocks synchronises with the host
    return "packed"


def stages_packed(kv: torch.Tensor, entries: int) -> bool:
    """Whether a call over ``kv`` with a union buffer of ``entries`` entries stages in the packed
    layout (known from shapes alone: ``fp8_ds_mla`` rows, a cache past ``STAGE_MAX_ROWS`` rows, not
    under CUDA-graph capture): its prefill then counts the blocks before its union build
    (:func:`stage_touched`)."""
    return kv.dtype == torch.uint8 and _layout(kv, entries) == "packed"


def stage_touched(
    kv: torch.Tensor,
    rows: torch.Tensor,
    topk_length: torch.Tensor | None,
    *,
    group_size: int,
    dtype: torch.dtype,
    build: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    max_rows: int = STAGE_MAX_ROWS,
    min_reuse: float = STAGE_MIN_REUSE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A prefill call's ``(kv, union, lens)`` in the packed layout, its union built over the staged
    rows, or ``None`` where the rule declines (the caller builds the union of ``rows`` and the
    kernel dequantises in place).

    The blocks the call's top-k ``rows`` touch are marked and counted first
    (:func:`~shardattn.ops.touched_blocks.touched_blocks`), and the rows moved to their places among
    them (:func:`~shardattn.ops.touched_blocks.moved_rows`) while the host waits for the count; then
    the blocks are staged, and ``build(moved, num_kv_rows=staged rows)`` builds the union over a
    cache of only those rows: on sm_90 the shared-memory bitmap build, whatever the cache's size
    (docs/DECISIONS.md, D62). That union is the union of ``rows`` with its rows moved, so the result
    is bit for bit the unstaged one's. The rule takes the rows' valid entries over ``group_size``
    for the union's used entries (at most that many tiles read a row).

    Args:
        kv: ``[R, 656]`` uint8 ``fp8_ds_mla`` rows (shape checked by the caller; another dtype is a
            ``ValueError``).
        rows: ``[T, K]`` int32 global rows (``-1`` / out of range invalid, anywhere);
            topk_length: ``[T]`` int32 leading entries to use, or ``None``.
        group_size: the union's ``G``. dtype: the staged rows' dtype (q's).
        build: ``build(rows, num_kv_rows=...)`` returns the union and lens of ``rows`` (the call's
            :func:`~shardattn.ops.union.build_union` with its ``G``, ``topk_length`` and buffers bound).
        max_rows / min_reuse: as :func:`stage_fp8_union` (``min_reuse=0``: stage whatever the reuse).
    """
    if kv.dtype != torch.uint8:
        raise ValueError(f"kv must hold fp8_ds_mla rows (uint8) to be staged, got {kv.dtype}")
    touched = touched_blocks(rows, topk_length, num_rows=kv.shape[0])
    moved = moved_rows(rows, topk_length, touched, num_rows=kv.shape[0])
    staged_blocks, valid = touched.read()
    staged_rows = staged_blocks * STAGE_BLOCK_ROWS
    if staged_blocks == 0 or staged_rows > max_rows or min_reuse * staged_rows > valid // group_size:
        return None
    out = _stage_blocks(kv, touched.marks, staged_blocks, dtype, packed=(touched.placed, touched.block_ids))
    union, lens = build(moved, num_kv_rows=staged_rows)
    return out, union, lens


def stage_fp8_union(
    kv: torch.Tensor,
    union: torch.Tensor,
    lens: torch.Tensor,
    *,
    group_size: int,
    dtype: torch.dtype,
    layout: str | None = None,
    max_rows: int = STAGE_MAX_ROWS,
    min_entries: int = STAGE_MIN_ENTRIES,
    min_reuse: float = STAGE_MIN_REUSE,
    marks: torch.Tensor | None = None,
) -> StagedRows | None:
    """The rows of ``kv`` that ``union`` reads, dequantised once, when that pays (module docstring).

    Args:
        kv: ``[R, 656]`` uint8 ``fp8_ds_mla`` rows (checked by the caller).
        union: ``[groups, width]`` int32 union entries (:mod:`shardattn.ops.union`: plain rows with
            ``group_size`` 1, else packed with membership bits); lens: ``[groups]`` int32 used entries.
        group_size: the union's ``G``. dtype: the staged rows' dtype (q's).
        layout: ``"mirror"`` or ``"packed"`` stages in that layout whatever the rule says (the
            warm-up, tests); ``None`` follows the rule.
        max_rows / min_entries / min_reuse: the rule's limits: a buffer of at most ``max_rows``
            rows, nothing staged for a union buffer under ``min_entries`` entries, and only where
            the union has at least ``min_reuse`` entries per staged row (module docstring).
        marks: the touched blocks already marked (:func:`stage_marks`, filled by the union build);
            ``None``: marked here (:func:`mark_touched_blocks`).
    Returns:
        :class:`StagedRows`, or ``None`` where the kernel should dequantise in place.
    """
    forced = layout is not None
    if forced and layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS} or None, got {layout!r}")
    layout = layout or _layout(kv, union.numel(), max_rows, min_entries, min_reuse)
    if layout is None:
        return None
    groups, width = union.shape
    row_mask = _row_mask(group_size)
    triton = use_triton(kv, union, lens)
    mark = marks
    if mark is None:
        mark = torch.zeros(-(-kv.shape[0] // STAGE_BLOCK_ROWS), dtype=torch.int32, device=kv.device)
        mark_touched_blocks(union, lens, mark, group_size=group_size)
    if layout == "mirror":  # touched blocks at their own rows, the union as it is
        out = _stage_blocks(kv, mark, mark.shape[0], dtype)
        return StagedRows(out, union)
    # touched blocks packed in cache order, the union's rows moved (queued before the count is read)
    placed, block_ids, counts = list_blocks(mark, lens, triton)
    new_union = torch.empty(groups, width, dtype=torch.int32, device=kv.device)
    _remap(union, lens, placed, new_union, row_mask, triton)
    staged_blocks, entries = counts.tolist()
    rows = staged_blocks * STAGE_BLOCK_ROWS
    if not forced and (staged_blocks == 0 or min_reuse * rows > entries or rows > max_rows):
        return None
    return StagedRows(_stage_blocks(kv, mark, staged_blocks, dtype, packed=(placed, block_ids)), new_union)


def _stage_blocks(
    kv: torch.Tensor,
    mark: torch.Tensor,
    num_blocks: int,
    dtype: torch.dtype,
    *,
    packed: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``[num_blocks * STAGE_BLOCK_ROWS, 576]`` in ``dtype``: the marked blocks of ``kv`` dequantised,
    at their own place (mirror, ``packed=None``: ``num_blocks`` covers the cache) or, with ``packed =
    (placed, block_ids)``, block ``b`` at ``placed[b] - 1`` (``block_ids`` listing them)."""
    out = torch.empty(num_blocks * STAGE_BLOCK_ROWS, FP8_DS_MLA.dim, dtype=dtype, device=kv.device)
    if use_triton(kv, mark):
        from shardattn.kernels.triton.kv_fp8_stage import launch_stage_blocks

        blocks = mark if packed is None else packed[1]
        launch_stage_blocks(kv, blocks, out, packed=packed is not None, num_blocks=num_blocks, block_shift=_BLOCK_SHIFT)
    else:
        _stage_torch(kv, mark, None if packed is None else packed[0], out)
    return out


def _remap(
    union: torch.Tensor, lens: torch.Tensor, placed: torch.Tensor, out: torch.Tensor, row_mask: int, triton: bool
) -> None:
    """``union``'s used entries with their rows moved to the packed buffer's (``placed``: the marks'
    inclusive prefix sum) into ``out``; unused entries ``-1``."""
    if triton:
        from shardattn.kernels.triton.kv_fp8_stage import launch_remap_union

        launch_remap_union(union, lens, placed, out, row_mask=row_mask, block_shift=_BLOCK_SHIFT)
    else:
        _remap_torch(union, lens, placed, out, row_mask)


def kernel_rows(
    kv: torch.Tensor,
    union: torch.Tensor,
    lens: torch.Tensor,
    *,
    group_size: int,
    dtype: torch.dtype,
    marks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kv, union)`` for a prefill kernel call: the staged rows and union where ``kv`` holds
    ``fp8_ds_mla`` rows and staging pays (:func:`stage_fp8_union`, with the union build's ``marks``
    when the call made them), else ``kv`` and ``union`` as given."""
    if kv.dtype != torch.uint8:
        return kv, union
    staged = stage_fp8_union(kv, union, lens, group_size=group_size, dtype=dtype, marks=marks)
    return (kv, union) if staged is None else (staged.kv, staged.union)
