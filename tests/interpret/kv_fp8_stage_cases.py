"""The FP8 staging kernels under the interpreter, at tiny shapes.

Run as ``TRITON_INTERPRET=1 python -m tests.interpret.kv_fp8_stage_cases`` (tests/test_kv_fp8_stage.py
does this in a subprocess). For unions of ``G = 1, 2, 4, 8`` (invalid rows anywhere, rows listed
twice, a cache whose last block is partial), in both layouts, each case checks the staged rows and union
(:func:`~shardattn.ops.kv_fp8_stage.stage_fp8_union` on the Triton kernels) against the rule they
must meet (:func:`tests.test_kv_fp8_stage.check_staged`), against the torch path bit for bit, and
runs the prefill kernel on the staged rows: bit for bit the kernel on the dequantised cache. Prints
one line per case and exits 1 on any failure.
"""

from __future__ import annotations

import itertools
import os
import sys
from unittest import mock

import torch

from shardattn.kernels.triton.sparse_mla import launch_attention, tile_config
from shardattn.ops import kv_fp8_stage
from shardattn.ops.kv_fp8 import dequantize_kv
from shardattn.ops.kv_fp8_stage import LAYOUTS
from shardattn.ops.union import build_union
from tests.interpret.sparse_mla_fp8_cases import SCALE, V_DIM, edge_rows, fp8_cache
from tests.test_kv_fp8_stage import check_staged, stage_on_torch

FAILURES: list[str] = []


def _report(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILURES.append(name)


def stage_cases(gen: torch.Generator, dtype: torch.dtype, name: str) -> None:
    t, k, r = 12, 24, 200  # rows 0..199: blocks 0-2 whole, block 3 partial
    cache = fp8_cache(gen, r)
    deq = dequantize_kv(cache, dtype)
    for (heads, g), layout in itertools.product(((16, 1), (8, 2), (16, 4), (8, 8)), LAYOUTS):
        rows = edge_rows(gen, t, k, r)
        rows[rows.clamp_min(0) % 64 < 20] = -1  # rows of blocks the union does not touch whole
        rows[(rows >= 64) & (rows < 128)] = -1  # a block it does not touch at all
        union, lens = build_union(rows, group_size=g, num_kv_rows=r)
        staged = kv_fp8_stage.stage_fp8_union(cache, union, lens, group_size=g, dtype=dtype, layout=layout)
        problem = check_staged(staged, cache, union, lens, g)
        torch_kv, torch_union = stage_on_torch(cache, union, lens, g, dtype, layout)
        used = staged.union[torch.arange(staged.union.shape[1])[None, :] < lens[:, None]].long()
        read = used & 0xFFFFFF if g > 1 else used  # the rows the kernel reads: the rest may differ (mirror)
        same = torch.equal(staged.kv[read], torch_kv[read]) and torch.equal(staged.union, torch_union)
        q = (torch.randn(t, heads, 576, generator=gen) * 0.5).to(dtype)
        cfg = tile_config(heads, g, interpret=True)
        want = launch_attention(q, deq, union, lens, scale=SCALE, v_dim=V_DIM, config=cfg)
        got = launch_attention(q, staged.kv, staged.union, lens, scale=SCALE, v_dim=V_DIM, config=cfg)
        equal = torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
        detail = f"rows={staged.kv.shape[0]} {problem or ''} torch_equal={same} attention_equal={equal}"
        _report(f"stage[{name},{layout},H={heads},G={g}]", problem is None and same and equal, detail)


def capacity_cases(gen: torch.Generator) -> None:
    """The packed layout by the rule (a cache beyond ``max_rows``): touched blocks that fit the
    buffer are staged as when forced; one block more and nothing is staged (``None``)."""
    r = 200
    cache = fp8_cache(gen, r)
    rows = edge_rows(gen, 12, 24, r)
    rows[(rows >= 64) & (rows < 128)] = -1  # blocks 0, 2, 3 touched
    union, lens = build_union(rows, group_size=1, num_kv_rows=r)
    rule = {"group_size": 1, "dtype": torch.float32, "min_entries": 0, "min_reuse": 0}
    fits = kv_fp8_stage.stage_fp8_union(cache, union, lens, max_rows=192, **rule)
    forced = kv_fp8_stage.stage_fp8_union(cache, union, lens, group_size=1, dtype=torch.float32, layout="packed")
    same = fits is not None and torch.equal(fits.kv, forced.kv) and torch.equal(fits.union, forced.union)
    _report("capacity[3 blocks in 3]", same, f"rows={None if fits is None else fits.kv.shape[0]}")
    tight = kv_fp8_stage.stage_fp8_union(cache, union, lens, max_rows=128, **rule)
    _report("capacity[3 blocks in 2]", tight is None)


def _programs(width: int) -> tuple[int, int]:
    """Entries a marking program reads in all: the default (every group of these tiny lists in one
    program), and three groups a program (the last program's groups partly past the list's end)."""
    from shardattn.kernels.triton.kv_fp8_stage import MARK_ENTRIES_PER_PROGRAM

    return MARK_ENTRIES_PER_PROGRAM, 3 * width


def mark_cases(gen: torch.Generator) -> None:
    """The mark kernel on unions wider than one chunk of entries (a block's run across a chunk's
    boundary), sorted and shuffled, plain and packed (bit 31 set), lengths 0 to the full width, some
    blocks untouched and one used only past a group's length, groups in one program or three a
    program: its marks equal the torch path's."""
    from shardattn.kernels.triton import kv_fp8_stage as kernels

    chunk = kernels.MARK_CHUNK
    width, blocks = chunk * 2 + 52, 12
    for g, shuffled, per_program in itertools.product((1, 8), (False, True), _programs(chunk * 2 + 52)):
        picked = torch.tensor([0, 3, 4, 10])  # blocks the used entries may touch (some, not all)
        block = picked[torch.randint(0, 4, (4, width), generator=gen)]
        rows = (block * 64 + torch.randint(0, 64, (4, width), generator=gen)).sort(1).values
        rows[2, chunk - 8 :] = 7 * 64 + 5  # one block's run across the chunk boundary
        rows[3, 17:] = 9 * 64  # block 9 only past group 3's length: unmarked
        if shuffled:
            rows = rows.gather(1, torch.rand(rows.shape, generator=gen).argsort(1))
        entries = rows | (0x80 << 24) if g > 1 else rows  # packed entries with bit 31 set
        union = torch.where(entries >= 1 << 31, entries - (1 << 32), entries).to(torch.int32)
        lens = torch.tensor([0, width, chunk + 3, 17], dtype=torch.int32)
        row_mask = kv_fp8_stage._row_mask(g)
        got = torch.zeros(blocks, dtype=torch.int32)
        with mock.patch.object(kernels, "MARK_ENTRIES_PER_PROGRAM", per_program):
            kernels.launch_mark_blocks(union, lens, got, row_mask=row_mask, block_shift=6)
        want = torch.zeros(blocks, dtype=torch.int32)
        kv_fp8_stage._mark_torch(union, lens, want, row_mask)
        name = f"mark[G={g},{'shuffled' if shuffled else 'sorted'},{per_program} a program]"
        _report(name, torch.equal(got, want), f"marked={int(got.sum())}/{int(want.sum())}")


def touched_cases(gen: torch.Generator) -> None:
    """Blocks counted from top-k lists before their union (``touched_blocks`` on the Triton kernels)
    and the rows moved into them (``moved_rows``): lists wider than one chunk of entries, sorted
    and shuffled, invalid rows anywhere, with and without ``topk_length``, rows in one program or
    three a program: marks, listed blocks, counts and moved rows equal the torch path's."""
    from shardattn.kernels.triton import kv_fp8_stage as kernels
    from shardattn.ops import touched_blocks as touched_ops

    chunk = kernels.MARK_CHUNK
    r, width = 700, chunk + 40
    for shuffled, with_length, per_program in itertools.product((False, True), (False, True), _programs(width)):
        rows = edge_rows(gen, 7, width, r)
        picked = torch.tensor([0, 3, 4, 10], dtype=torch.int32)  # the blocks valid rows fall in (of 11)
        rows = torch.where((rows >= 0) & (rows < r), picked[rows % 4] * 64 + rows // 4 % 64, rows).sort(1).values
        rows[3, chunk - 4 : chunk + 4] = 650  # a block's run across the chunk boundary
        rows[1, 5] = 699  # the last, partial block, once
        if shuffled:
            rows = rows.gather(1, torch.rand(rows.shape, generator=gen).argsort(1)).contiguous()
        length = torch.tensor([width, 0, width + 9, chunk + 2, 7, 300, 1], dtype=torch.int32)
        length = length if with_length else None
        with mock.patch.object(kernels, "MARK_ENTRIES_PER_PROGRAM", per_program):
            got = touched_ops.touched_blocks(rows, length, num_rows=r)
        got_moved = touched_ops.moved_rows(rows, length, got, num_rows=r)
        with mock.patch.object(touched_ops, "use_triton", lambda *tensors: False):
            want = touched_ops.touched_blocks(rows, length, num_rows=r)
            want_moved = touched_ops.moved_rows(rows, length, want, num_rows=r)
        listed = got.block_ids[: int(want.marks.sum())]
        same = torch.equal(got.marks, want.marks) and torch.equal(got.placed, want.placed)
        same = same and torch.equal(listed, want.block_ids) and got.read() == want.read()
        same = same and torch.equal(got_moved, want_moved)
        name = (
            f"touched[{'shuffled' if shuffled else 'sorted'},{'length' if with_length else 'no length'},"
            f"{per_program} a program]"
        )
        _report(name, same, f"counts={got.read()}/{want.read()}")


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1 before running this module", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(int(os.environ.get("SHARDATTN_SEED", "0")))
    for dtype, name in ((torch.float16, "fp16"), (torch.float32, "fp32")):
        stage_cases(gen, dtype, name)
    capacity_cases(gen)
    mark_cases(gen)
    touched_cases(gen)
    print(f"{len(FAILURES)} failures: {FAILURES}", flush=True)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
