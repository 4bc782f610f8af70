"""One union build for a whole share, sliced per kernel call (ShardQ's ``one_union``).

The oracle is the per-call build itself: a ``G``-aligned slice of the whole share's union must be
exactly what :func:`build_union` gives for the slice's rows (entries, padding and lengths), for
any ``G``, invalid rows anywhere, rows with no valid key, ``topk_length`` and tail groups. The
Triton builders and kernels consuming the slices are checked under the interpreter
(tests/interpret/head_blocked_cases.py, run by tests/test_shardq_chunked.py).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardattn.ops.prepared_union import PreparedUnion, check_prepared_union, prepare_union
from shardattn.ops.sparse_mla import sparse_mla_attention
from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill
from shardattn.ops.union import build_union
from shardattn.plan.pipeline import pipeline_plan
from shardattn.plan.routing import Route
from shardattn.plan.zigzag import zigzag_split
from shardattn.runtime.prefill import workspace_prefill_attention
from tests.parallel_helpers import junk_rows


def _rows(seed: int, t: int, k: int, r: int, with_length: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    rows = junk_rows(g, t, k, r, [-1, -7, r, r + 9], 0.3, 4)  # invalid entries anywhere, empty rows
    if t:
        rows[0, -1] = rows[0, 0]  # a duplicate within a row
    length = torch.randint(0, k + 1, (t,), generator=g, dtype=torch.int32) if with_length else None
    return rows, length


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    t=st.integers(0, 40),
    k=st.integers(1, 12),
    g=st.sampled_from([1, 2, 4, 8]),
    with_length=st.booleans(),
    cuts=st.lists(st.integers(0, 40), max_size=4),
    seed=st.integers(0, 2**16),
)
def test_slices_of_the_whole_union_equal_per_chunk_builds(t, k, g, with_length, cuts, seed) -> None:
    r = 3 * k + 5
    rows, length = _rows(seed, t, k, r, with_length)
    whole = prepare_union(rows, group_size=g, num_kv_rows=r, topk_length=length)
    bounds = sorted({0, t, *(min(t, c // g * g) for c in cuts)})  # aligned cuts; the last is the share's end
    for b0, b1 in itertools.pairwise(bounds):
        part = whole.tokens(b0, b1)
        want = build_union(
            rows[b0:b1], group_size=g, num_kv_rows=r, topk_length=None if length is None else length[b0:b1]
        )
        assert part.num_tokens == b1 - b0 and part.group_size == g
        assert torch.equal(part.union, want[0]) and torch.equal(part.lens, want[1]), (b0, b1)


@pytest.mark.parametrize("taper", [False, True], ids=["equal", "tapered"])
@pytest.mark.parametrize("g", [1, 2, 4, 8], ids=lambda g: f"G{g}")
def test_pipeline_chunks_of_a_share_slice_the_union_exactly(g: int, taper: bool) -> None:
    plan = zigzag_split([53, 7, 30], 2, align=g, min_tokens=0)
    for rank in range(2):
        n = len(plan.token_ids(rank))
        rows, length = _rows(rank + g, n, 9, 40, True)
        whole = prepare_union(rows, group_size=g, num_kv_rows=40, topk_length=length)
        pipe = pipeline_plan(plan, 5, align=g, taper=taper)
        for c in range(5):
            b0, b1 = int(pipe.bounds[rank, c]), int(pipe.bounds[rank, c + 1])
            want = build_union(rows[b0:b1], group_size=g, num_kv_rows=40, topk_length=length[b0:b1])
            part = whole.tokens(b0, b1)
            assert torch.equal(part.union, want[0]) and torch.equal(part.lens, want[1]), (rank, c)


def test_prepare_union_builds_into_the_workspace_or_declines() -> None:
    rows, length = _rows(1, 10, 6, 30, True)
    union_ws = torch.empty(3 * 2 * 6 * 4 + 4, dtype=torch.uint8)  # 5 groups of G = 2 need 5 * 12 * 4 B
    lens_ws = torch.empty(64, dtype=torch.uint8)
    assert prepare_union(rows, group_size=2, num_kv_rows=30, topk_length=length, workspace=(union_ws, lens_ws)) is None
    union_ws = torch.empty(5 * 2 * 6 * 4, dtype=torch.uint8)
    got = prepare_union(rows, group_size=2, num_kv_rows=30, topk_length=length, workspace=(union_ws, lens_ws))
    assert got is not None and got.union.data_ptr() == union_ws.data_ptr() and got.lens.data_ptr() == lens_ws.data_ptr()
    want = build_union(rows, group_size=2, num_kv_rows=30, topk_length=length)
    assert torch.equal(got.union, want[0]) and torch.equal(got.lens, want[1])
    # no workspace (or a partial one): allocated
    assert prepare_union(rows, group_size=2, num_kv_rows=30, workspace=(None, lens_ws)) is not None


@pytest.mark.parametrize(
    ("make", "kind", "match"),
    [
        (lambda ws: (ws, ws), ValueError, r"workspace\[0\] and workspace\[1\] share memory"),
        (lambda ws: (ws.view(torch.int32), None), TypeError, r"workspace\[0\] must have dtype"),
        (lambda ws: (ws.view(8, -1), None), ValueError, r"workspace\[0\] must have 1 dim"),
        (lambda ws: (ws[1:], None), ValueError, r"workspace\[0\] must be a contiguous buffer starting on a 4-byte"),
        (lambda ws: (ws[::2], None), ValueError, r"workspace\[0\] must be a contiguous buffer"),
        (lambda ws: [ws], TypeError, r"workspace must be a \(union_bytes, lens_bytes\) pair"),
        (lambda ws: (ws.tolist(), None), TypeError, r"workspace\[0\] must be a torch.Tensor"),
    ],
    ids=["shared", "int32", "2-d", "misaligned", "strided", "one-buffer", "a-list"],
)
def test_prepare_union_checks_its_workspace(make, kind, match) -> None:
    rows, _ = _rows(1, 10, 6, 30, True)
    with pytest.raises(kind, match=match):
        prepare_union(rows, group_size=2, num_kv_rows=30, workspace=make(torch.zeros(512, dtype=torch.uint8)))


def test_bad_slices_and_mismatched_unions_raise_naming_the_argument() -> None:
    rows, _ = _rows(2, 9, 4, 20, False)
    whole = prepare_union(rows, group_size=4, num_kv_rows=20)
    with pytest.raises(ValueError, match="multiples of the group size 4"):
        whole.tokens(2, 8)
    with pytest.raises(ValueError, match="multiples of the group size 4"):
        whole.tokens(0, 6)
    assert whole.tokens(8, 9).num_tokens == 1  # the tail group may end at the last token
    with pytest.raises(ValueError, match="stop must be <="):
        whole.tokens(0, 12)
    with pytest.raises(ValueError, match="stop must be >= 4"):
        whole.tokens(4, 0)
    with pytest.raises(ValueError, match="group_size must be one of"):
        prepare_union(rows, group_size=3, num_kv_rows=20)
    parts = whole.split([0, 4, 4, 9])  # one split per tensor: the same views as tokens()
    assert [p.num_tokens for p in parts] == [4, 0, 5]
    assert all(torch.equal(p.union, whole.tokens(a, b).union) for p, (a, b) in zip(parts, [(0, 4), (4, 4), (4, 9)]))
    with pytest.raises(ValueError, match="multiples of the group size 4"):
        whole.split([0, 6, 9])
    with pytest.raises(ValueError, match="rise from 0 to the prepared union's 9 tokens"):
        whole.split([0, 8])
    with pytest.raises(TypeError, match="prepared_union must be a PreparedUnion"):
        check_prepared_union((whole.union, whole.lens), rows)
    with pytest.raises(ValueError, match="prepared_union holds 4 tokens, rows has 9"):
        check_prepared_union(whole.tokens(0, 4), rows)
    with pytest.raises(ValueError, match="built for group size 4, but this call's kernel path uses G = 1"):
        check_prepared_union(whole, rows, group_size=1)
    bad = PreparedUnion(whole.union[:, :-1], whole.lens, 4, 9)
    with pytest.raises(ValueError, match=r"prepared_union.union must have shape \[3, 16\]"):
        check_prepared_union(bad, rows)


def test_entries_take_a_prepared_union_and_check_it() -> None:
    g = torch.Generator().manual_seed(4)
    rows, length = _rows(4, 7, 5, 16, True)
    q, kv = torch.randn(7, 2, 24, generator=g), torch.randn(16, 24, generator=g)
    kw = dict(scale=0.2, v_dim=16, topk_length=length)
    per_query = prepare_union(rows, group_size=1, num_kv_rows=16, topk_length=length)
    grouped = prepare_union(rows, group_size=2, num_kv_rows=16, topk_length=length)
    want = sparse_mla_attention(q, kv, rows, **kw)
    no_ws = torch.empty(0, dtype=torch.uint8)
    route = Route("reference", 2, "test")
    for got in (
        sparse_mla_attention(q, kv, rows, prepared_union=per_query, **kw),
        sparse_mla_grouped_prefill(q, kv, rows, group_size=2, prepared_union=grouped, **kw),
        workspace_prefill_attention(
            q, kv, rows, route=route, union_ws=no_ws, lens_ws=no_ws, prepared_union=grouped, **kw
        ),
    ):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="built for group size 2"):
        sparse_mla_attention(q, kv, rows, prepared_union=grouped, **kw)  # the per-query entry is G = 1
    with pytest.raises(ValueError, match="holds 4 tokens"):
        sparse_mla_grouped_prefill(q, kv, rows, group_size=2, prepared_union=grouped.tokens(0, 4), **kw)
    with pytest.raises(ValueError, match="not both"):
        sparse_mla_grouped_prefill(
            q, kv, rows, group_size=2, prepared_union=grouped, union=(grouped.union, grouped.lens), **kw
        )
