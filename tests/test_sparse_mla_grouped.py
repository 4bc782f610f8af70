"""Grouped prefill entry point on the CPU (against the oracle of tests/oracle.py), routing, duplicates,
warm-up key list."""

from __future__ import annotations

import pytest
import torch

from shardattn.kernels.gluon.union_smem import HAS_GLUON, WINDOWS
from shardattn.kernels.triton.sparse_mla import tile_config
from shardattn.ops import prepared_union
from shardattn.ops.dispatch import default_group_size, prefill_path
from shardattn.ops.row_entries import first_occurrences
from shardattn.ops.sparse_mla import sparse_mla_reference
from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill
from shardattn.ops.union import UNION_METHOD
from shardattn.plan.routing import tile_group_size
from shardattn.runtime.warmup import PrefillSpec, compile_keys, spec_group_sizes
from tests.oracle import sparse_mla_oracle


def test_duplicate_rows_count_once_in_the_reference():
    gen = torch.Generator().manual_seed(0)
    q, kv = torch.randn(2, 3, 24, generator=gen), torch.randn(9, 24, generator=gen)
    rows = torch.tensor([[1, 4, 1, 1, -1], [7, 7, 2, 9, 3]], dtype=torch.int32)
    deduped = torch.tensor([[1, 4, -1, -1, -1], [7, -1, 2, -1, 3]], dtype=torch.int32)  # 9: out of range
    a = sparse_mla_reference(q, kv, rows, scale=0.3, v_dim=16)
    b = sparse_mla_oracle(q, kv, deduped, scale=0.3, v_dim=16)  # the oracle on hand-deduplicated rows
    torch.testing.assert_close(a[0].double(), b[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(a[1].double(), b[1], atol=1e-5, rtol=0)
    first = first_occurrences(rows, rows >= 0).tolist()
    assert first == [[True, True, False, False, False], [True, False, True, True, True]]


def test_cpu_grouped_entry_matches_the_oracle():
    gen = torch.Generator().manual_seed(1)
    q, kv = torch.randn(7, 8, 48, generator=gen), torch.randn(30, 48, generator=gen)
    rows = torch.randint(-1, 33, (7, 10), generator=gen, dtype=torch.int32)
    rows[2] = -1
    sinks = torch.randn(8, generator=gen)
    length = torch.tensor([10, 3, 10, 0, 7, 10, 1], dtype=torch.int32)
    for g in (None, 1, 2, 4, 8):
        a = sparse_mla_grouped_prefill(q, kv, rows, scale=0.2, v_dim=32, sinks=sinks, topk_length=length, group_size=g)
        b = sparse_mla_oracle(q, kv, rows, scale=0.2, v_dim=32, sinks=sinks, topk_length=length)
        torch.testing.assert_close(a[0].double(), b[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(a[1].double(), b[1], atol=1e-5, rtol=0)
    assert float(a[0][2].abs().sum()) == 0.0 and torch.equal(a[1][2], sinks)  # empty row with sinks: (0, sink)
    out = sparse_mla_grouped_prefill(q, kv, rows, scale=0.2, v_dim=32, return_lse=False)
    assert out.shape == (7, 8, 32)


def test_group_sizes_and_routing_on_cpu():
    assert [tile_group_size(h) for h in (1, 8, 16, 32, 64, 128)] == [8, 8, 4, 2, 1, 1]
    assert [default_group_size(h) for h in (8, 16, 128)] == [8, 1, 1]
    q, kv = torch.zeros(4, 8, 576), torch.zeros(10, 576)
    path = prefill_path(q, kv, v_dim=512)
    assert path.backend == "reference" and "CPU" in path.reason


def test_tiles_hold_at_most_64_rows_and_at_least_16():
    for heads in (1, 2, 8, 16, 20, 32, 64, 128):
        for g in (1, 2, 4, 8):
            cfg = tile_config(heads, g)
            assert 16 <= cfg.block_m <= 64 and cfg.block_h * -(-heads // cfg.block_h) >= heads


def test_bad_group_size_raises():
    q, kv, rows = torch.zeros(2, 8, 48), torch.zeros(4, 48), torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="group_size must be one of"):
        sparse_mla_grouped_prefill(q, kv, rows, scale=1.0, v_dim=32, group_size=3)


@pytest.mark.parametrize("heads", [8, 16, 64, 128], ids=lambda h: f"h{h}")
def test_warmup_keys_cover_both_sides_of_the_routing_threshold(heads):
    """The key list holds the grouped tile (G > 1, caches below 2**24 - 1 rows) and the per-query one."""
    spec = PrefillSpec(heads=heads, topk=2048, sinks=True)
    keys = compile_keys(spec)
    attention = {(k.params["G"], k.params["BLOCK_H"], k.params["BLOCK_N"]) for k in keys if k.kernel == "attention"}
    for g in {default_group_size(heads), 1}:
        cfg = tile_config(heads, g)
        assert (g, cfg.block_h, cfg.block_n) in attention
    groups = spec_group_sizes(spec)  # 1, the default G and, where Gluon is routed, its grouped G
    assert {1, default_group_size(heads)} <= set(groups)
    sorted_groups = {g for g in groups if UNION_METHOD[g] == "sort"}
    assert {k.params["G"] for k in keys if k.kernel == "union_keys"} == sorted_groups
    fused = {k.params["G"] for k in keys if k.kernel == "union_fused"}
    assert fused == {g for g in groups if UNION_METHOD[g] == "fused"}
    # the bitmap builder serves caches small enough for its count, the sorting builders the others
    assert {k.params["G"] for k in keys if k.kernel == "union_bitmap"} == set(groups)
    if HAS_GLUON:  # on sm_90 the bitmap runs in shared memory: both windows of every G
        smem = {(k.params["G"], k.params["WW"]) for k in keys if k.kernel == "union_smem"}
        assert smem == {(g, w) for g in groups for w in WINDOWS}
        assert not any(k.params.get("HAS_MARKS") for k in keys)
        fp8 = PrefillSpec(heads=heads, topk=spec.topk, sinks=spec.sinks, kv_fp8=True)  # and the marking build
        marking = {(k.params["G"], k.params["WW"]) for k in compile_keys(fp8) if k.params.get("HAS_MARKS")}
        assert marking == {(g, w) for g in spec_group_sizes(fp8) for w in WINDOWS}
    assert all(k.params["HAS_SINK"] for k in keys if k.kernel == "attention")


@pytest.mark.parametrize("group_size", [1, 2])
def test_q_ready_runs_once_before_the_kernel_reads_q(group_size: int) -> None:
    """``q_ready`` is the hook a sharded step passes so the union build overlaps q's exchange: it
    runs exactly once, and q may be filled inside it (the kernel reads q only afterwards)."""
    g = torch.Generator().manual_seed(5)
    q, kv = torch.randn(6, 2, 48, generator=g), torch.randn(30, 48, generator=g)
    rows = torch.randint(-1, 30, (6, 8), generator=g, dtype=torch.int32)
    want = sparse_mla_grouped_prefill(q, kv, rows, scale=0.2, v_dim=32, group_size=group_size)
    late, calls = torch.full_like(q, float("nan")), []

    def q_ready() -> None:
        calls.append(1)
        late.copy_(q)  # q arrives only now

    got = sparse_mla_grouped_prefill(late, kv, rows, scale=0.2, v_dim=32, group_size=group_size, q_ready=q_ready)
    assert calls == [1]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _kernel_stand_in(monkeypatch, launches: list, builds: list) -> None:
    """Route the grouped entry to a stand-in of the Gluon kernel on the CPU: it records the union
    it was given (each query's keys at the front, ``lens`` of them) and attends it with the oracle;
    every union build is recorded too."""
    from shardattn.ops import dispatch, prepared_union
    from shardattn.ops import sparse_mla_grouped as grouped

    def path(q, kv, *, v_dim, group_size=None):
        return dispatch.PrefillPath("gluon", group_size or 1, None, "stand-in")

    def launch(q, kv, union, lens, *, scale, v_dim, sinks=None, out=None, lse=None, group_size=1):
        assert group_size == 1
        launches.append((union.clone(), lens.clone()))
        o, l_ = sparse_mla_oracle(q, kv, union, scale=scale, v_dim=v_dim, topk_length=lens, sinks=sinks)
        out = o.to(q.dtype) if out is None else out.copy_(o.to(out.dtype))
        return out, l_.float() if lse is None else lse.copy_(l_.float())

    build = prepared_union.build_union

    def spy_build(*args, **kwargs):
        builds.append(kwargs.get("group_size"))
        return build(*args, **kwargs)

    monkeypatch.setattr(grouped, "prefill_path", path)
    monkeypatch.setattr(grouped, "gluon_unsupported_reason", lambda q, kv, v_dim: None)
    monkeypatch.setattr(grouped, "launch_gluon_attention", launch)
    monkeypatch.setattr(prepared_union, "build_union", spy_build)


def _unique_case(seed: int):
    """Rows with no repeat in a token (an indexer's top-k), invalid entries anywhere, an empty
    token and a ``topk_length``."""
    g = torch.Generator().manual_seed(seed)
    q, kv = torch.randn(7, 2, 48, generator=g), torch.randn(40, 48, generator=g)
    rows = torch.stack([torch.randperm(40, generator=g)[:9] for _ in range(7)]).to(torch.int32)
    rows[torch.rand(rows.shape, generator=g) < 0.2] = -1  # invalid anywhere
    rows[2] = -1  # no key at all
    rows[4, 3] = 40 + 5  # out of range
    length = torch.tensor([9, 9, 9, 4, 9, 0, 1], dtype=torch.int32)
    return q, kv, rows, length


def test_rows_unique_packs_the_callers_rows_for_the_per_query_kernel(monkeypatch) -> None:
    """``rows_unique=True`` on the per-query path builds no union: the kernel gets each query's
    valid rows in the caller's order at the front of its list, their count as ``lens``, and the
    result is the oracle's. Without it the union is built (sorted)."""
    q, kv, rows, length = _unique_case(3)
    want_o, want_l = sparse_mla_oracle(q, kv, rows, scale=0.2, v_dim=32, topk_length=length)
    launches: list = []
    builds: list = []
    _kernel_stand_in(monkeypatch, launches, builds)
    out, lse = sparse_mla_grouped_prefill(q, kv, rows, scale=0.2, v_dim=32, topk_length=length, rows_unique=True)
    assert builds == [] and len(launches) == 1
    union, lens = launches[0]
    for t in range(rows.shape[0]):
        r = rows[t, : int(length[t])]
        keep = r[(r >= 0) & (r < kv.shape[0])]
        assert int(lens[t]) == keep.numel() and torch.equal(union[t, : keep.numel()], keep)
    torch.testing.assert_close(out.double(), want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_l, atol=1e-5, rtol=1e-5)
    launches.clear()
    out, _ = sparse_mla_grouped_prefill(q, kv, rows, scale=0.2, v_dim=32, topk_length=length)
    assert builds == [1] and len(launches) == 1
    torch.testing.assert_close(out.double(), want_o, atol=1e-5, rtol=1e-5)


def _first_occurrences(rows: torch.Tensor, num_kv_rows: int, length: torch.Tensor | None) -> list[list[int]]:
    """Each token's valid rows (under its length), a repeat dropped, in the order they first appear."""
    kept = []
    for t in range(rows.shape[0]):
        seen: list[int] = []
        for r in rows[t, : rows.shape[1] if length is None else int(length[t])].tolist():
            if 0 <= r < num_kv_rows and r not in seen:
                seen.append(r)
        kept.append(seen)
    return kept


@pytest.mark.parametrize("with_length", [False, True])
def test_a_per_query_call_hashes_its_rows_where_the_union_build_would_sort(monkeypatch, with_length) -> None:
    """At ``G = 1`` on rows in q's dtype, a cache past the bitmap's count (where the union build
    would sort: ``route_row_dedup``) gives the kernel each query's valid rows with every repeat
    dropped, in the order they first appear, packed to the front (``unique_rows`` then
    ``pack_rows``), and builds no union, at any token count; a small cache, and FP8 rows
    anywhere, still build it. Repeats and invalid entries anywhere, an empty token."""
    from shardattn.ops.kv_fp8 import quantize_kv

    g = torch.Generator().manual_seed(12)
    launches: list = []
    builds: list = []
    _kernel_stand_in(monkeypatch, launches, builds)
    for tokens, kv_rows, hashed in ((12, 1000, True), (5, 1000, True), (5, 40, False), (12, 40, False)):
        q, kv = torch.randn(tokens, 2, 48, generator=g), torch.randn(kv_rows, 48, generator=g)
        rows = torch.randint(-2, kv_rows + 3, (tokens, 9), generator=g, dtype=torch.int32)
        rows[:, 5:8] = rows[:, 0:3]  # repeats a token lists
        rows[1, ::2] = rows[1, 1]  # one row five times
        rows[3] = -1  # no key at all
        length = torch.randint(0, 10, (tokens,), generator=g, dtype=torch.int32) if with_length else None
        want_o, want_l = sparse_mla_oracle(q, kv, rows, scale=0.2, v_dim=32, topk_length=length)
        launches.clear()
        builds.clear()
        out, lse = sparse_mla_grouped_prefill(q, kv, rows, scale=0.2, v_dim=32, topk_length=length)
        assert len(launches) == 1 and builds == ([] if hashed else [1]), (tokens, kv_rows, builds)
        union, lens = launches[0]
        kept = _first_occurrences(rows, kv_rows, length)
        if hashed:
            assert [union[t, : int(lens[t])].tolist() for t in range(tokens)] == kept
        else:  # the build's union: sorted
            assert [union[t, : int(lens[t])].tolist() for t in range(tokens)] == [sorted(k) for k in kept]
        torch.testing.assert_close(out.double(), want_o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse.double(), want_l, atol=1e-5, rtol=1e-5)
    # FP8 rows: the union build stages what it reads, on a large cache too
    kv8 = quantize_kv(torch.randn(1000, 576, generator=g))
    builds.clear()
    monkeypatch.setattr(prepared_union, "unique_rows", _must_not_run)
    rows = torch.randint(-2, 1003, (12, 9), generator=g, dtype=torch.int32)
    prepared_union.union_for_call(None, rows, kv8, group_size=1, dtype=torch.bfloat16)
    assert builds == [1]


def _must_not_run(*args, **kwargs):
    raise AssertionError("unique_rows ran")


def test_rows_unique_packs_into_the_union_workspace(monkeypatch) -> None:
    """A ``union`` workspace given to the call is where the packed rows go (nothing allocated for them)."""
    q, kv, rows, length = _unique_case(6)
    launches: list = []
    _kernel_stand_in(monkeypatch, launches, [])
    ws = (torch.full((7, 9), -7, dtype=torch.int32), torch.full((7,), -7, dtype=torch.int32))
    sparse_mla_grouped_prefill(q, kv, rows, scale=0.2, v_dim=32, topk_length=length, rows_unique=True, union=ws)
    assert torch.equal(ws[0], launches[0][0]) and torch.equal(ws[1], launches[0][1])
    assert int(ws[1][2]) == 0 and int(ws[1][5]) == 0  # the empty token and the zero length


def test_rows_unique_keeps_the_union_for_grouped_tiles_and_fp8_rows() -> None:
    """At ``G > 1`` the tile needs its queries' union whatever the promise, and FP8 rows stage
    what their union reads: ``rows_unique`` changes nothing there (bit for bit on the CPU)."""
    from shardattn.ops.kv_fp8 import quantize_kv

    q, kv, rows, length = _unique_case(4)
    for kw in ({"group_size": 2}, {"group_size": 1}):
        want = sparse_mla_grouped_prefill(q, kv, rows, scale=0.2, v_dim=32, topk_length=length, **kw)
        got = sparse_mla_grouped_prefill(q, kv, rows, scale=0.2, v_dim=32, topk_length=length, rows_unique=True, **kw)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    g = torch.Generator().manual_seed(9)
    q8, kv8 = torch.randn(7, 2, 576, generator=g).bfloat16(), quantize_kv(torch.randn(40, 576, generator=g))
    want = sparse_mla_grouped_prefill(q8, kv8, rows, scale=0.1, topk_length=length)
    got = sparse_mla_grouped_prefill(q8, kv8, rows, scale=0.1, topk_length=length, rows_unique=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_rows_unique_must_be_a_bool() -> None:
    from shardattn.ops.sparse_mla import sparse_mla_attention

    q, kv, rows, _ = _unique_case(5)
    for fn in (sparse_mla_grouped_prefill, sparse_mla_attention):
        with pytest.raises(TypeError, match="rows_unique"):
            fn(q, kv, rows, scale=0.2, v_dim=32, rows_unique=1)
