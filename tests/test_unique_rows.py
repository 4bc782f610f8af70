"""Decode's de-duplication: the hash kernel under the interpreter against an independent oracle
(tests/interpret/unique_rows_cases.py, in a subprocess), the torch reference against the same
oracle, and the route between it and the sorted union."""

from __future__ import annotations

import pytest
import torch

from shardattn.ops.dispatch import triton_available
from shardattn.ops.union import build_union
from shardattn.ops.unique_rows import decode_rows, unique_rows, unique_rows_reference
from shardattn.plan.crossovers import BITMAP_SCAN_RATIO, SMEM_SCAN_RATIO
from shardattn.plan.union_routing import MAX_UNIQUE_ENTRIES, route_decode_dedup
from tests.interpret import run_cases
from tests.interpret.union_cases import make_rows
from tests.interpret.unique_rows_cases import oracle


@pytest.mark.interpret
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_kernel_matches_the_oracle_under_interpreter():
    lines = run_cases("unique_rows_cases")
    names = [ln.split()[1] for ln in lines if ln.startswith("ok")]
    assert {"one_row_repeated", "all_invalid", "empty_length", "full_table", "op_cache_edge[R=1]"} <= set(names)
    assert sum(n.startswith("unique[") for n in names) >= 30
    assert any("int64=True" in n for n in names) and any("R=2147483647" in n for n in names)
    assert lines[-1].startswith("0 failures")


@pytest.mark.parametrize("seed", range(6))
def test_reference_matches_the_oracle(seed):
    gen = torch.Generator().manual_seed(seed)
    t, k, r = 7, int(torch.randint(1, 90, (1,), generator=gen)), int(torch.randint(1, 200, (1,), generator=gen))
    rows = make_rows(seed, t, k, r, sort=False)
    length = torch.randint(0, k + 2, (t,), generator=gen, dtype=torch.int32) if seed % 2 else None
    got = unique_rows_reference(rows, num_kv_rows=r, topk_length=length)
    want = oracle(rows, r, length)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(unique_rows(rows, num_kv_rows=r, topk_length=length)[0], want[0])


def test_empty_shapes():
    for shape in ((0, 5), (3, 0)):
        out, lens = unique_rows(torch.zeros(shape, dtype=torch.int32), num_kv_rows=4)
        assert out.shape == shape and lens.tolist() == [0] * shape[0]


def test_bad_input_names_the_argument():
    rows = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(TypeError, match="rows"):
        unique_rows(rows.float(), num_kv_rows=4)
    with pytest.raises(ValueError, match="num_kv_rows"):
        unique_rows(rows, num_kv_rows=-1)
    with pytest.raises(ValueError, match="topk_length"):
        unique_rows(rows, num_kv_rows=4, topk_length=torch.zeros(3, dtype=torch.int32))


def test_decode_rows_names_the_bad_argument_before_routing():
    rows = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^rows"):
        decode_rows(rows[0], num_kv_rows=4)
    with pytest.raises(TypeError, match=r"^rows"):
        decode_rows(rows.tolist(), num_kv_rows=4)
    with pytest.raises(TypeError, match=r"^num_kv_rows"):
        decode_rows(rows, num_kv_rows="4")


def test_route_keeps_the_bitmap_union_and_hashes_where_it_would_sort():
    k = 2048
    assert route_decode_dedup(k, 32 * SMEM_SCAN_RATIO * k, shared_memory=True) == "union"
    assert route_decode_dedup(k, 32 * SMEM_SCAN_RATIO * k + 32, shared_memory=True) == "unique"
    assert route_decode_dedup(k, 32 * BITMAP_SCAN_RATIO * k) == "union"
    assert route_decode_dedup(k, 40_000_000) == "unique"
    assert route_decode_dedup(MAX_UNIQUE_ENTRIES + 1, 40_000_000) == "union"  # past the kernel's row
    # the hash takes rows of up to 8,192 entries: the last one it takes is hashed
    assert MAX_UNIQUE_ENTRIES == 8192 and route_decode_dedup(8192, 40_000_000) == "unique"


@pytest.mark.parametrize("num_kv_rows", [50, 10_000_000])
def test_decode_rows_gives_each_tokens_unique_rows_on_either_route(num_kv_rows):
    rows = make_rows(4, 6, 40, min(num_kv_rows, 50), sort=False)
    rows[0, 7] = num_kv_rows - 1  # a valid row only the large cache holds
    length = torch.tensor([40, 3, 0, 17, 40, 39], dtype=torch.int32)
    got, lens = decode_rows(rows, num_kv_rows=num_kv_rows, topk_length=length)
    union, union_lens = build_union(rows, group_size=1, num_kv_rows=num_kv_rows, topk_length=length)
    assert torch.equal(lens, union_lens)
    for t, n in enumerate(lens.tolist()):
        assert torch.equal(got[t, :n].sort().values, union[t, :n])
