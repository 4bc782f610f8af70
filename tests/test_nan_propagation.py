"""A NaN in a query, or in a key row a query reads, reaches that (token, head)'s output and LSE as
NaN, on every sparse-MLA path (the CPU reference, the Triton prefill and decode kernels under the
interpreter, the Gluon kernels on a GPU) and through every merge of split or sharded partials; an
empty row stays ``(0, -inf)`` and every other row keeps the fp64 oracle's value. A NaN LSE is not the
empty marker: a merge that weighed it as empty would drop a broken partial and return finite, wrong
rows."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from shardattn.ops.sparse_mla import sparse_mla_attention
from shardattn.ops.sparse_mla_decode import run_sparse_mla_decode, sparse_mla_decode
from shardattn.parallel.collector import collect_partials
from shardattn.testing.interpret import run_interpreted
from tests.oracle import sparse_mla_oracle

T, K, R = 8, 12, 40


def poisoned(heads: int, d: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> tuple:
    """``(q, kv, rows, nan)``: token 3's head 0 has a NaN query value, token 5 reads the one NaN
    key row (no other token does), token 2's row is empty; ``nan [T, H]`` marks the rows the NaN reaches."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(T, heads, d, generator=g)
    kv = torch.randn(R, d, generator=g)
    rows = torch.stack([torch.randperm(R - 1, generator=g)[:K] for _ in range(T)]).int()  # never row R - 1
    rows[2] = -1
    rows[5, 4] = R - 1
    q[3, 0, 5] = math.nan
    kv[R - 1, 7] = math.nan
    nan = torch.zeros(T, heads, dtype=torch.bool)
    nan[3, 0] = True
    nan[5] = True
    return q.to(dtype).to(device), kv.to(dtype).to(device), rows.to(device), nan.to(device)


def assert_poisoned(
    out: torch.Tensor,
    lse: torch.Tensor,
    q,
    kv,
    rows,
    nan,
    v_dim: int,
    atol: float,
    *,
    heads: slice = slice(None),
    group_size: int = 1,
    lse_atol: float = 1e-4,
) -> None:
    """``out`` / ``lse`` hold ``heads`` of every token. A grouped tile (``group_size`` > 1) multiplies
    its union's value rows by zero weights for the queries that did not pick them, so a NaN key row
    also reaches the outputs (not the LSEs) of its group's other queries: those are left out."""
    out, lse, nan = out.float().cpu(), lse.float().cpu(), nan.cpu()[:, heads]
    assert bool(out[nan].isnan().all()) and bool(lse[nan].isnan().all()), "a NaN row came out finite or empty"
    assert bool((out[2] == 0).all()) and bool(lse[2].isneginf().all()), "the empty row is not (0, -inf)"
    clean_q = torch.where(q.isnan(), 0, q).cpu().double()
    clean_kv = torch.where(kv.isnan(), 0, kv).cpu().double()
    ref_out, ref_lse = sparse_mla_oracle(clean_q, clean_kv, rows.cpu(), scale=0.2, v_dim=v_dim)
    ref_out, ref_lse = ref_out[:, heads], ref_lse[:, heads]
    keep = ~nan
    keep[2] = False
    torch.testing.assert_close(lse[keep].double(), ref_lse[keep], atol=lse_atol, rtol=0)
    group = slice(5 // group_size * group_size, (5 // group_size + 1) * group_size)
    keep[group] = False
    torch.testing.assert_close(out[keep].double(), ref_out[keep], atol=atol, rtol=0)


def test_the_cpu_paths_turn_a_nan_input_into_a_nan_row() -> None:
    q, kv, rows, nan = poisoned(4, 48)
    assert_poisoned(*sparse_mla_attention(q, kv, rows, scale=0.2, v_dim=32), q, kv, rows, nan, 32, 1e-5)
    assert_poisoned(*sparse_mla_decode(q, kv, rows, scale=0.2, v_dim=32), q, kv, rows, nan, 32, 1e-5)


def interpreted_cases() -> None:
    """The Triton prefill kernels (per-query, grouped) and the split-KV decode with both merges, fp16."""
    from shardattn.ops.sparse_mla import sparse_mla_per_query
    from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill

    q, kv, rows, nan = poisoned(16, 48, torch.float16)
    out, lse = sparse_mla_per_query(q, kv, rows, scale=0.2, v_dim=32)
    assert_poisoned(out, lse, q, kv, rows, nan, 32, 2e-3)
    print("ok per-query")
    for g in (1, 4):
        out, lse = sparse_mla_grouped_prefill(q, kv, rows, scale=0.2, v_dim=32, group_size=g)
        assert_poisoned(out, lse, q, kv, rows, nan, 32, 2e-3, group_size=g)
        print("ok grouped", g)
    for merge in ("rows", "columns"):
        out, lse = run_sparse_mla_decode(
            q, kv, rows, scale=0.2, v_dim=32, num_splits=3, config={"merge": merge}, kernel="triton"
        )
        assert_poisoned(out, lse, q, kv, rows, nan, 32, 2e-3)
        print("ok decode", merge)


@pytest.mark.interpret
def test_the_triton_kernels_turn_a_nan_input_into_a_nan_row_under_interpreter() -> None:
    pytest.importorskip("triton", reason="the Triton kernels need triton")
    assert run_interpreted(__name__, "interpreted_cases").count("ok ") == 5


def _sharded(group: dist.ProcessGroup, strategy: str) -> tuple:
    """Each rank attends over its half of the keys (rank 1's half holds the NaN key row), then the
    collector merges the partials."""
    rank = dist.get_rank(group)
    q, kv, rows, _ = poisoned(4, 48)
    mine = torch.where((rows >= 0) & (rows % 2 == rank), rows, -1)  # rows of this rank's share
    out, lse = sparse_mla_attention(q, kv, mine, scale=0.2, v_dim=32)
    return collect_partials(out, lse, group, scatter_heads=strategy == "all_to_all", strategy=strategy)


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["all_to_all", "all_gather", "reduce_scatter"])
def test_a_shards_nan_row_survives_the_collector(dist_pool, strategy: str) -> None:
    q, kv, rows, nan = poisoned(4, 48)
    if int(rows[5, 4]) % 2 != 1:
        pytest.fail("the NaN key row must fall in rank 1's share")
    for rank, (out, lse) in enumerate(dist_pool.run(_sharded, strategy, world_size=2)):
        heads = slice(2 * rank, 2 * rank + 2) if strategy == "all_to_all" else slice(None)  # scattered heads
        assert_poisoned(out, lse, q, kv, rows, nan, 32, 1e-5, heads=heads)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 64, 128])
def test_the_gpu_kernels_turn_a_nan_input_into_a_nan_row(heads: int) -> None:
    """The routed GPU kernels (the Gluon prefill and decode kernels where they run, bf16, D 576)."""
    q, kv, rows, nan = poisoned(heads, 576, torch.bfloat16, "cuda")
    for op in (sparse_mla_attention, sparse_mla_decode):
        out, lse = op(q, kv, rows, scale=0.2, v_dim=512)
        assert_poisoned(out, lse, q, kv, rows, nan, 512, 3e-2, lse_atol=2e-3)
