"""Grouped prefill entry point on the CPU (against the oracle of tests/oracle.py), routing, duplicates,
warm-up key list."""

from __future__ import annotations

import pytest
import torch

from shardattn.kernels.gluon.union_smem import HAS_GLUON, WINDOWS
from shardattn.kernels.triton.sparse_mla import tile_config
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
