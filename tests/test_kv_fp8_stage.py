"""Staging the FP8 rows a prefill reads (:mod:`shardattn.ops.kv_fp8_stage`).

* CPU: on unions of every ``G`` (invalid rows anywhere, rows listed twice, a partial last block,
  groups with no rows, packed entries with bit 31 set), in both layouts, every used entry's staged
  row holds the value the independent decoder (tests/fp8_oracle.py) reads at its old row, in the
  dtype, with its membership bits, the union stays sorted, unused entries become -1 (packed); the
  rule stages only where it pays, and the mirror layout decides without a host synchronisation;
  the Triton kernels under the interpreter equal the torch path bit for bit, and the prefill kernel
  on the staged rows equals it on the dequantised cache bit for bit
  (tests/interpret/kv_fp8_stage_cases.py).
* CPU: the blocks counted from the top-k lists before the union (``touched_blocks``) are the
  union's, counted with the lists' valid rows; the union built over the rows moved into them
  (``stage_touched``) is the staged union of the original rows, bit for bit; the rule then reads
  valid rows over ``G``.
* sm_90 GPU: tests/test_sparse_mla_fp8_gpu.py runs every prefill path mirrored, packed (its blocks
  counted after the union build, or before it) and in the kernel; tests/test_sparse_mla_gpu.py
  checks that the warm-up compiles them all.
"""

from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardattn.kernels.backend import triton_available
from shardattn.kernels.union_layout import unpack_entries
from shardattn.ops import kv_fp8_stage
from shardattn.ops.kv_fp8 import dequantize_kv, quantize_kv
from shardattn.ops.kv_fp8_stage import LAYOUTS, STAGE_BLOCK_ROWS, StagedRows, stage_fp8_union
from shardattn.ops.row_entries import valid_mask
from shardattn.ops.touched_blocks import moved_rows, touched_blocks
from shardattn.ops.union import build_union
from tests.fp8_oracle import fp8_rows_decode
from tests.interpret import run_cases


def _rows_and_bits(union: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    if group_size == 1:
        return union.long(), torch.zeros_like(union, dtype=torch.long)
    return unpack_entries(union)


def check_staged(
    staged: StagedRows, cache: torch.Tensor, union: torch.Tensor, lens: torch.Tensor, group_size: int
) -> str | None:
    """What is wrong with ``staged`` as the staging of ``union`` over ``cache`` (either layout), or ``None``."""
    decoded = torch.from_numpy(fp8_rows_decode(cache.numpy())).to(staged.kv.dtype)
    old_rows, old_bits = _rows_and_bits(union, group_size)
    new_rows, new_bits = _rows_and_bits(staged.union, group_size)
    used = torch.arange(union.shape[1])[None, :] < lens[:, None].long()
    touched = torch.unique(old_rows[used] // STAGE_BLOCK_ROWS)
    mirror = staged.union is union
    blocks = -(-cache.shape[0] // STAGE_BLOCK_ROWS) if mirror else touched.numel()
    if staged.kv.shape[0] != blocks * STAGE_BLOCK_ROWS:
        return f"{staged.kv.shape[0]} staged rows for {blocks} blocks ({'mirror' if mirror else 'packed'})"
    for g in range(union.shape[0]):
        n = int(lens[g])
        if not mirror and not torch.equal(staged.union[g, n:], torch.full_like(staged.union[g, n:], -1)):
            return f"group {g}: unused entries are not -1"
        if not torch.equal(new_bits[g, :n], old_bits[g, :n]):
            return f"group {g}: membership bits changed"
        if n > 1 and not bool((new_rows[g, 1:n] > new_rows[g, : n - 1]).all()):
            return f"group {g}: staged rows not strictly increasing"
        if not torch.equal(staged.kv[new_rows[g, :n]], decoded[old_rows[g, :n]]):
            return f"group {g}: a staged row differs from its cache row"
    return None


def stage_on_torch(cache, union, lens, group_size, dtype, layout) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path's staging in ``layout`` (no rule)."""
    with mock.patch.object(kv_fp8_stage, "use_triton", lambda *tensors: False):
        staged = stage_fp8_union(cache, union, lens, group_size=group_size, dtype=dtype, layout=layout)
    return staged.kv, staged.union


def _case(seed: int, tokens: int, k: int, r: int, group_size: int, span: int):
    """A cache of ``r`` rows and the union of ``tokens`` queries whose rows fall in ``span`` rows
    from a random start (invalid entries anywhere, one query listing rows twice, one with none)."""
    g = torch.Generator().manual_seed(seed)
    cache = quantize_kv(torch.randn(r, 576, generator=g) * torch.exp2(torch.randint(-8, 8, (r, 1), generator=g)))
    start = int(torch.randint(0, max(1, r - span), (1,), generator=g))
    rows = start + torch.randint(0, span, (tokens, k), generator=g, dtype=torch.int32)
    rows[torch.rand(tokens, k, generator=g) < 0.2] = -1
    rows[0, ::3] = r + 9
    rows[tokens // 2] = -1
    rows[-1, : k // 2] = rows[-1, k // 2 : 2 * (k // 2)]
    union, lens = build_union(rows, group_size=group_size, num_kv_rows=r)
    return cache, union, lens


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**20),
    group_size=st.sampled_from([1, 2, 4, 8]),
    tokens=st.integers(1, 20),
    k=st.integers(1, 40),
    r=st.integers(1, 400),
    span=st.integers(1, 400),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    layout=st.sampled_from(LAYOUTS),
)
def test_staged_rows_hold_the_cache_rows_the_union_reads(seed, group_size, tokens, k, r, span, dtype, layout):
    cache, union, lens = _case(seed, tokens, k, r, group_size, span)
    staged = stage_fp8_union(cache, union, lens, group_size=group_size, dtype=dtype, layout=layout)
    assert staged.kv.dtype == dtype and staged.union.dtype == torch.int32
    assert (staged.union is union) == (layout == "mirror")
    assert check_staged(staged, cache, union, lens, group_size) is None


def test_entries_with_bit_31_keep_it():
    """Query 7 of a group of 8 sets bit 31: the packed entry is negative and stays so, moved."""
    cache = quantize_kv(torch.randn(300, 576))
    rows = torch.full((8, 4), -1, dtype=torch.int32)
    rows[7] = torch.tensor([290, 291, 150, 151])
    union, lens = build_union(rows, group_size=8, num_kv_rows=300)
    assert bool((union[0, : int(lens[0])] < 0).all())
    staged = stage_fp8_union(cache, union, lens, group_size=8, dtype=torch.float32, layout="packed")
    assert check_staged(staged, cache, union, lens, 8) is None
    assert unpack_entries(staged.union[0, :4])[0].tolist() == [22, 23, 98, 99]  # blocks 2, 4 -> 0, 1


def test_rule_mirrors_small_caches_without_a_device_value():
    """A cache within ``max_rows``: staged in the mirror layout when the union buffer holds two
    entries per cache row, whatever the entries hold (no host synchronisation), else not at all."""
    cache, union, lens = _case(3, 64, 512, 2_000, 1, 300)  # a buffer of 64 x ~400 entries, 2,048 cache rows
    staged = stage_fp8_union(cache, union, lens, group_size=1, dtype=torch.bfloat16, min_entries=0)
    assert staged is not None and staged.union is union and staged.kv.shape[0] == 2_048
    with mock.patch.object(torch.Tensor, "tolist", side_effect=AssertionError("host sync")):
        stage_fp8_union(cache, union, lens, group_size=1, dtype=torch.bfloat16, min_entries=0)
    assert stage_fp8_union(cache, union, lens, group_size=1, dtype=torch.bfloat16) is None  # under 65,536 entries
    few, lens_few = union[:4], lens[:4]  # 4 x ~400 entries for 2,048 rows
    assert stage_fp8_union(cache, few, lens_few, group_size=1, dtype=torch.bfloat16, min_entries=0) is None


def test_rule_packs_large_caches_where_rows_are_reused():
    """A cache beyond ``max_rows``: the touched blocks counted, packed where each staged row is read
    twice or more and they fit ``max_rows``."""
    cache, union, lens = _case(3, 64, 512, 20_000, 1, 1_000)  # 64 queries x ~400 rows within 1,000
    small = {"dtype": torch.bfloat16, "group_size": 1, "min_entries": 0, "max_rows": 8_192}
    staged = stage_fp8_union(cache, union, lens, **small)
    assert staged is not None and staged.union is not union and 2 * staged.kv.shape[0] <= int(lens.sum())
    cap = {**small, "max_rows": staged.kv.shape[0] - STAGE_BLOCK_ROWS}
    assert stage_fp8_union(cache, union, lens, **cap) is None
    spread, u2, l2 = _case(4, 4, 512, 20_000, 1, 20_000)  # 4 queries' rows all over the cache: read once
    assert stage_fp8_union(spread, u2, l2, **{**small, "max_rows": 19_968}) is None
    assert stage_fp8_union(cache, union, torch.zeros_like(lens), **small) is None  # nothing used
    with pytest.raises(ValueError, match="layout must be one of"):
        stage_fp8_union(cache, union, lens, group_size=1, dtype=torch.bfloat16, layout="dense")


def test_kernel_rows_passes_dense_caches_through():
    kv = torch.randn(100, 576)
    union = torch.arange(100, dtype=torch.int32)[None].repeat(1000, 1)
    lens = torch.full((1000,), 100, dtype=torch.int32)
    got_kv, got_union = kv_fp8_stage.kernel_rows(kv, union, lens, group_size=1, dtype=torch.float32)
    assert got_kv is kv and got_union is union
    staged_kv, staged_union = kv_fp8_stage.kernel_rows(
        quantize_kv(kv), union, lens, group_size=1, dtype=torch.float32
    )  # 100,000 entries over 128 rows: mirrored
    assert staged_kv.shape == (128, 576) and staged_union is union


@pytest.mark.parametrize("layout", LAYOUTS)
def test_marks_from_the_union_build_stage_the_same_rows(layout):
    """``stage_marks`` is zeros only where the rule may stage (FP8 rows, enough entries); the union
    build fills them (``block_marks``) and staging with them gives what staging that marks its own
    gives, in both layouts."""
    cache, union, lens = _case(5, 64, 512, 2_000, 4, 300)
    kw = {"group_size": 4, "dtype": torch.bfloat16, "min_entries": 0, "layout": layout}
    assert kv_fp8_stage.stage_marks(torch.randn(2_000, 576), *union.shape) is None  # no FP8 rows
    assert kv_fp8_stage.stage_marks(cache, 4, 100) is None  # a decode-sized union buffer
    marks = kv_fp8_stage.stage_marks(cache, 100, 20_000)
    assert marks is not None and marks.dtype == torch.int32 and marks.shape == (-(-2_000 // STAGE_BLOCK_ROWS),)
    assert not marks.any()
    kv_fp8_stage.mark_touched_blocks(union, lens, marks, group_size=4)
    with_marks = stage_fp8_union(cache, union, lens, marks=marks, **kw)
    own = stage_fp8_union(cache, union, lens, **kw)
    assert torch.equal(with_marks.union, own.union)
    used = torch.zeros(with_marks.kv.shape[0], dtype=torch.bool)
    rows, _ = _rows_and_bits(own.union[torch.arange(own.union.shape[1])[None, :] < lens[:, None]], 4)
    used[rows] = True
    assert torch.equal(with_marks.kv[used], own.kv[used])


def _topk_case(seed: int, tokens: int, k: int, r: int, span: int):
    """A cache of ``r`` rows and ``tokens`` top-k lists within ``span`` rows: invalid rows anywhere
    (-1 and past the cache), a list with none, rows listed twice, and ``topk_length`` cutting some."""
    g = torch.Generator().manual_seed(seed)
    cache = quantize_kv(torch.randn(r, 576, generator=g))
    rows = int(torch.randint(0, max(1, r - span), (1,), generator=g)) + torch.randint(
        0, span, (tokens, k), generator=g, dtype=torch.int32
    )
    rows[torch.rand(tokens, k, generator=g) < 0.2] = -1
    rows[0, ::3] = r + 9
    rows[tokens // 2] = -1
    rows[-1, : k // 2] = rows[-1, k // 2 : 2 * (k // 2)]
    length = torch.randint(0, k + 3, (tokens,), generator=g, dtype=torch.int32)
    return cache, rows, length


def _used(union: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    return torch.arange(union.shape[1])[None, :] < lens[:, None].long()


@pytest.mark.parametrize("group_size", [1, 4])
@pytest.mark.parametrize("with_length", [False, True])
def test_union_over_the_moved_rows_is_the_staged_union(group_size, with_length):
    """``touched_blocks`` marks from the top-k lists the blocks the union of the same lists marks and
    counts them and the valid rows; ``moved_rows`` puts each valid row at its block's place (others
    -1); and ``stage_touched``, which builds the union over the moved rows, gives the staged rows,
    union and lens of packed staging on the union of the original rows, bit for bit. The rule's
    size test and the format decide where it stages at all."""
    cache, rows, length = _topk_case(6, 48, 96, 3_000, 900)
    length = length if with_length else None
    union, lens = build_union(rows, group_size=group_size, num_kv_rows=3_000, topk_length=length)
    touched = touched_blocks(rows, length, num_rows=3_000)
    want = torch.zeros_like(touched.marks)
    kv_fp8_stage.mark_touched_blocks(union, lens, want, group_size=group_size)
    assert torch.equal(touched.marks, want) and touched.ready is None
    valid = valid_mask(rows, 3_000, length)
    assert touched.read() == (int(want.sum()), int(valid.sum()))
    assert torch.equal(touched.block_ids, torch.nonzero(want).flatten().int())
    moved = moved_rows(rows, length, touched, num_rows=3_000)
    place = torch.cumsum(want, 0)[rows.clamp(0, 2_999).long() // STAGE_BLOCK_ROWS] - 1
    assert torch.equal(moved, torch.where(valid, place * STAGE_BLOCK_ROWS + rows % STAGE_BLOCK_ROWS, -1).int())

    build = functools.partial(build_union, group_size=group_size, topk_length=length)
    kw = {"group_size": group_size, "dtype": torch.float32}
    kv, new_union, new_lens = kv_fp8_stage.stage_touched(cache, rows, length, build=build, min_reuse=0, **kw)
    late = stage_fp8_union(cache, union, lens, layout="packed", **kw)
    assert check_staged(late, cache, union, lens, group_size) is None
    assert torch.equal(kv, late.kv) and torch.equal(new_lens, lens)
    used = _used(union, lens)
    assert torch.equal(new_union[used], late.union[used])
    assert not kv_fp8_stage.stages_packed(dequantize_kv(cache), 1 << 20)  # bf16 rows
    assert not kv_fp8_stage.stages_packed(cache, 1 << 20)  # a cache the mirror holds
    big = cache[:1].expand(kv_fp8_stage.STAGE_MAX_ROWS + 1, -1)  # shapes only
    assert kv_fp8_stage.stages_packed(big, 1 << 16) and not kv_fp8_stage.stages_packed(big, (1 << 16) - 1)
    rule = {**kw, "build": build, "min_reuse": 0}
    assert kv_fp8_stage.stage_touched(cache, rows, length, **rule, max_rows=1_024) is not None
    assert kv_fp8_stage.stage_touched(cache, rows, length, **rule, max_rows=128) is None  # too many rows


def test_rule_on_blocks_counted_before_the_union_takes_valid_rows_over_g():
    """With the blocks counted from the top-k lists, the rule's used entries are the lists' valid
    rows over ``G`` (the union's are not known yet): 8 queries reading the same 256 rows (4
    blocks) stage at ``G = 1`` (2,048 reads of 256 rows), not at ``G = 8`` (256 over 8 < 2 x 256)."""
    cache = quantize_kv(torch.randn(20_000, 576))
    rows = torch.arange(1_024, 1_280, dtype=torch.int32)[None].repeat(8, 1)
    rule = {"dtype": torch.float32, "max_rows": 8_192}
    for g, staged in ((1, True), (8, False)):
        build = functools.partial(build_union, group_size=g)
        got = kv_fp8_stage.stage_touched(cache, rows, None, group_size=g, build=build, **rule)
        assert (got is not None) == staged
        if staged:
            kv, moved_union, _ = got
            union, lens = build_union(rows, group_size=g, num_kv_rows=20_000)
            want = stage_fp8_union(cache, union, lens, group_size=g, min_entries=0, **rule)
            assert kv.shape[0] == 256 and torch.equal(kv, want.kv) and torch.equal(moved_union, want.union)


@pytest.mark.interpret
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_triton_staging_equals_torch_and_feeds_the_kernel_exactly():
    lines = run_cases("kv_fp8_stage_cases", SHARDATTN_SEED="0")
    assert lines[-1] == "0 failures: []"
    assert sum(ln.startswith("ok") for ln in lines) == 34
