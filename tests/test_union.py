"""Union builder reference against a plain-Python definition (the Triton kernels are compared with the
reference in test_sparse_mla_interpret and, at real shapes, on the GPU)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardattn.ops.union import (
    GROUP_SIZES,
    MAX_PACKED_ROWS,
    METHODS,
    UNION_METHOD,
    build_union,
    build_union_reference,
    pack_entries,
    unpack_entries,
)


def _python_union(rows, group_size, num_kv_rows, topk_length=None):
    """{group: {row: bits}} straight from the definition."""
    out = {}
    for t, row in enumerate(rows.tolist()):
        limit = len(row) if topk_length is None else int(topk_length[t])
        members = out.setdefault(t // group_size, {})
        for k, r in enumerate(row):
            if k < limit and 0 <= r < num_kv_rows:
                members[r] = members.get(r, 0) | (1 << (t % group_size))
    return out


def _decode(union, lens, group_size):
    out = {}
    for g, n in enumerate(lens.tolist()):
        entries = union[g, :n]
        rows, bits = unpack_entries(entries) if group_size > 1 else (entries.long(), torch.ones_like(entries))
        out[g] = dict(zip(rows.tolist(), bits.tolist()))
        assert rows.tolist() == sorted(set(rows.tolist())), "entries must be sorted and unique"
        assert (union[g, n:] == -1).all(), "the reference pads with -1"
    return out


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    group_size=st.sampled_from([1, 2, 4, 8]),
    tokens=st.integers(1, 19),
    topk=st.integers(1, 12),
    num_kv_rows=st.integers(1, 30),
    use_length=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_reference_matches_definition(group_size, tokens, topk, num_kv_rows, use_length, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(-2, num_kv_rows + 3, (tokens, topk), generator=gen, dtype=torch.int32)
    length = torch.randint(0, topk + 2, (tokens,), generator=gen, dtype=torch.int32) if use_length else None
    union, lens = build_union_reference(rows, group_size=group_size, num_kv_rows=num_kv_rows, topk_length=length)
    assert union.shape == (-(-tokens // group_size), group_size * topk)
    want = _python_union(rows, group_size, num_kv_rows, length)
    got = _decode(union, lens, group_size)
    assert got == {g: (want[g] if group_size > 1 else dict.fromkeys(want[g], 1)) for g in got}


def test_duplicates_in_one_query_are_one_member():
    rows = torch.tensor([[4, 4, 4, 2], [4, -1, 9, 9]], dtype=torch.int32)
    union, lens = build_union(rows, group_size=2, num_kv_rows=10)
    assert lens.tolist() == [3]
    assert _decode(union, lens, 2)[0] == {2: 0b01, 4: 0b11, 9: 0b10}


def test_disjoint_and_identical_lists():
    same = torch.tensor([[1, 2, 3]] * 4, dtype=torch.int32)
    union, lens = build_union(same, group_size=4, num_kv_rows=10)
    assert lens.tolist() == [3] and set(_decode(union, lens, 4)[0].values()) == {0b1111}
    disjoint = torch.arange(12, dtype=torch.int32).view(4, 3)
    union, lens = build_union(disjoint, group_size=4, num_kv_rows=12)
    assert lens.tolist() == [12]
    assert _decode(union, lens, 4)[0] == {r: 1 << (r // 3) for r in range(12)}


def test_tail_group_has_no_phantom_members():
    rows = torch.tensor([[1], [2], [3]], dtype=torch.int32)
    union, lens = build_union(rows, group_size=8, num_kv_rows=5)
    assert lens.tolist() == [3] and max(_decode(union, lens, 8)[0].values()) < 0b1000


def test_query_seven_sets_the_sign_bit_and_round_trips():
    rows = torch.full((8, 1), MAX_PACKED_ROWS - 1, dtype=torch.int32)
    union, lens = build_union(rows, group_size=8, num_kv_rows=MAX_PACKED_ROWS)
    assert lens.tolist() == [1]
    assert union[0, 0].item() < 0 and union[0, 0].item() != -1
    r, b = unpack_entries(union[0, :1])
    assert (r.item(), b.item()) == (MAX_PACKED_ROWS - 1, 0xFF)
    assert torch.equal(pack_entries(r, b), union[0, :1])


def test_rows_past_24_bits_raise_for_groups_and_pass_for_one_query():
    rows = torch.tensor([[5, 2**24 + 3]], dtype=torch.int32)
    with pytest.raises(ValueError, match="num_kv_rows must be <= 16777215 for group_size > 1"):
        build_union(rows, group_size=2, num_kv_rows=2**25)
    union, lens = build_union(rows, group_size=1, num_kv_rows=2**25)
    assert union[0, : lens[0]].tolist() == [5, 2**24 + 3]


@pytest.mark.parametrize("num_kv_rows", [2**31 - 1, 2**59, 2**63, 2**80])
def test_a_cache_past_int32_rows_reads_every_int32_row(num_kv_rows):
    """Rows are int32 (``2**31 - 1`` is never a row), so a cache of more rows takes every other
    non-negative one: the same union as at ``2**31 - 1`` rows, whatever the size (no key arithmetic
    overflow)."""
    rows = torch.tensor([[3, 1, -1], [1, 2**31 - 1, 2], [5, 5, 2**31 - 2]], dtype=torch.int32)
    union, lens = build_union(rows, group_size=1, num_kv_rows=num_kv_rows)
    assert _decode(union, lens, 1) == _python_union(rows, 1, 2**31 - 1)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"group_size": 3}, ValueError, "group_size must be one of"),
        ({"rows": torch.zeros(2, 2)}, TypeError, "rows must have dtype"),
        ({"topk_length": torch.zeros(3, dtype=torch.int32)}, ValueError, "topk_length must have shape"),
        ({"out": (torch.zeros(1, 3, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))}, ValueError, "out"),
        ({"method": "bitonic"}, ValueError, "method must be one of"),
    ],
    ids=["group-size", "float-rows", "length-shape", "out-shape", "method"],
)
def test_bad_inputs_raise(kwargs, error, match):
    args = {"rows": torch.zeros(2, 2, dtype=torch.int32), "group_size": 2, "num_kv_rows": 4}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        build_union(args.pop("rows"), **args)


@pytest.mark.parametrize("method", ["auto", "sort", "fused", "bitmap"])
def test_every_builder_choice_matches_the_definition(method):
    # the Triton builders are compared with the reference under the interpreter
    # (tests/interpret/prefill_cases.py) and on the GPU; on CPU every choice must give the definition
    gen = torch.Generator().manual_seed(3)
    rows = torch.randint(-2, 40, (13, 9), generator=gen, dtype=torch.int32)
    length = torch.randint(0, 11, (13,), generator=gen, dtype=torch.int32)
    for g in GROUP_SIZES:
        for topk_length in (None, length):
            union, lens = build_union(rows, group_size=g, num_kv_rows=37, topk_length=topk_length, method=method)
            assert union.shape == (-(-13 // g), g * 9)
            want = _python_union(rows, g, 37, topk_length)
            assert _decode(union, lens, g) == {q: (m if g > 1 else dict.fromkeys(m, 1)) for q, m in want.items()}


def test_auto_method_table_covers_every_group_size():
    assert set(UNION_METHOD) == set(GROUP_SIZES)
    assert set(UNION_METHOD.values()) <= set(METHODS) - {"auto"}
