"""The bitmap union builder under the interpreter, on fresh random inputs, against the torch reference.

Run as ``TRITON_INTERPRET=1 python -m tests.interpret.union_bitmap_cases`` (tests/test_union_bitmap.py
does this in a subprocess). Each hypothesis example draws ``G``, ``T`` (tails included), ``K``, the
KV cache size (up to 70,000 rows: several count chunks of 1,024 words), invalid entries anywhere,
duplicates within a row, rows with no valid key, ``topk_length`` and the programs per SM (the
routed ``PROGRAMS_PER_SM``, or 1 for the launch: four persistent programs, each building several
groups on one bitmap that must come back zero). The builder must equal the torch reference exactly:
``lens`` and every entry below it. Prints one line per check and exits 1 on any mismatch.
"""

from __future__ import annotations

import sys

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardattn.kernels.triton import union_bitmap
from shardattn.kernels.triton.union_bitmap import bitmap_union
from shardattn.ops.union import build_union_reference, num_groups
from tests.interpret.union_cases import _equal, _report, make_rows, run_checks


def _bitmap(rows, length, num_kv_rows, group_size, per_sm):
    t, k = rows.shape
    union = torch.full((num_groups(t, group_size), group_size * k), -7, dtype=torch.int32)
    lens = torch.full((union.shape[0],), -7, dtype=torch.int32)
    routed = union_bitmap.PROGRAMS_PER_SM
    union_bitmap.PROGRAMS_PER_SM = per_sm  # 1: each program builds more groups on its bitmap
    try:
        bitmap_union(rows, length, num_kv_rows, group_size, union, lens)
    finally:
        union_bitmap.PROGRAMS_PER_SM = routed
    return union, lens


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(
    group_size=st.sampled_from([1, 2, 4, 8]),
    tokens=st.integers(1, 19),
    topk=st.integers(1, 40),
    num_kv_rows=st.sampled_from([1, 31, 32, 33, 60, 200, 70_000]),
    use_length=st.booleans(),
    per_sm=st.sampled_from([1, union_bitmap.PROGRAMS_PER_SM]),
    seed=st.integers(0, 10_000),
)
def bitmap_matches_reference(group_size, tokens, topk, num_kv_rows, use_length, per_sm, seed):
    rows = make_rows(seed, tokens, topk, num_kv_rows, sort=False)
    gen = torch.Generator().manual_seed(seed + 1)
    length = torch.randint(0, topk + 2, (tokens,), generator=gen, dtype=torch.int32) if use_length else None
    want = build_union_reference(rows, group_size=group_size, num_kv_rows=num_kv_rows, topk_length=length)
    got = _bitmap(rows, length, num_kv_rows, group_size, per_sm)
    name = f"G={group_size},T={tokens},K={topk},R={num_kv_rows},len={use_length},per_sm={per_sm},seed={seed}"
    _report(f"bitmap[{name}]", _equal(got, want))


def grid() -> None:
    """Every G, with and without ``topk_length``, one program building every group (the bitmap reused)."""
    for g in (1, 2, 4, 8):
        for use_length in (False, True):
            bitmap_matches_reference.hypothesis.inner_test(g, 13, 20, 70_000, use_length, 1, 10 * g + use_length)


def rows_at_word_edges() -> None:
    """Rows 31, 32, 63 and R - 1 (bit 31 of a word is the sign bit) shared by every query of a group."""
    for g in (1, 2, 4, 8):
        base = torch.tensor([31, 32, 63, 0, 95, 4095, 31, -1], dtype=torch.int32)
        rows = torch.stack([base.roll(j) for j in range(2 * g + 1)])  # a full group and a tail
        want = build_union_reference(rows, group_size=g, num_kv_rows=4096)
        _report(f"word_edges[G={g}]", _equal(_bitmap(rows, None, 4096, g, 1), want))


def empty_shapes() -> None:
    """A cache with no rows (every entry invalid) and rows with no entries."""
    for g in (1, 8):
        rows = make_rows(3, 11, 6, 1, sort=False)
        _report(
            f"no_kv_rows[G={g}]",
            _equal(_bitmap(rows, None, 0, g, 1), build_union_reference(rows, group_size=g, num_kv_rows=0)),
        )
        rows = torch.zeros(11, 0, dtype=torch.int32)
        _report(
            f"no_entries[G={g}]",
            _equal(_bitmap(rows, None, 9, g, 1), build_union_reference(rows, group_size=g, num_kv_rows=9)),
        )


def main() -> int:
    return run_checks(grid, rows_at_word_edges, empty_shapes, bitmap_matches_reference)


if __name__ == "__main__":
    sys.exit(main())
