"""The collector: merged partials equal single-process attention, for every strategy and world size."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardattn.ops.lse_merge import lse_merge
from shardattn.ops.sparse_mla import sparse_mla_attention
from shardattn.parallel import collector
from shardattn.parallel.collector import collect_partials, resolve_strategy
from shardattn.parallel.comm import Comm
from tests.oracle import sparse_mla_oracle
from tests.parallel_helpers import (
    WORLD_IDS,
    WORLD_SIZES,
    assert_rank_errors,
    assert_within_reference_error,
    catch,
    rank_1_rejected,
    short_timeout_group,
)

STRATS = ["all_to_all", "all_gather", "reduce_scatter", "auto"]
D, DV = 64, 48


def _case(seed: int, world: int, t: int, heads_per_rank: int, k: int, dtype: torch.dtype) -> dict:
    """q, kv, rows with invalid entries anywhere, and the owner rank of every KV row.

    Token 0 has no valid key at all; token 1 (when present) has all its keys on the last rank,
    so the other ranks own nothing for it. (A row is owned by one rank, as under DCP: a row
    listed twice by one token is one key, on one rank.)
    """
    g = torch.Generator().manual_seed(seed)
    h = heads_per_rank * world
    r = 3 * k + 5
    q = torch.randn(t, h, D, generator=g)
    kv = torch.randn(r, D, generator=g)
    rows = torch.randint(0, r, (t, k), generator=g, dtype=torch.int32)
    bad = torch.rand(t, k, generator=g) < 0.25
    junk = torch.tensor([-1, r, r + 7, -100], dtype=torch.int32)[torch.randint(0, 4, (t, k), generator=g)]
    rows = torch.where(bad, junk, rows)
    rows[0] = -1
    row_owner = torch.randint(0, world, (r,), generator=g)
    if t > 1:
        last = torch.nonzero(row_owner == world - 1).flatten().to(torch.int32)
        if last.numel():
            rows[1] = torch.where(bad[1], junk[1], last[torch.randint(0, last.numel(), (k,), generator=g)])
    owner = row_owner[rows.long().clamp(0, r - 1)]
    return {"q": q.to(dtype), "kv": kv.to(dtype), "rows": rows, "owner": owner, "scale": D**-0.5}


def _collect_all_strategies(group: dist.ProcessGroup, case: dict) -> dict:
    comm = Comm(group)
    mine = torch.where(case["owner"] == comm.rank, case["rows"], torch.full_like(case["rows"], -1))
    out, lse = sparse_mla_attention(case["q"], case["kv"], mine, scale=case["scale"], v_dim=DV)
    res = {"partial": (out, lse)}
    for strategy in STRATS:
        for scatter in (True, False):
            if strategy == "all_to_all" and not scatter:
                continue
            comm.reset_counts()
            res[strategy, scatter] = (*collect_partials(out, lse, comm, scatter_heads=scatter, strategy=strategy),)
            res[strategy, scatter, "counts"] = dict(comm.counts)
    return res


EXPECTED_COUNTS = {
    "all_to_all": {"all_to_all": 1},
    "all_gather": {"all_gather": 1},
    "reduce_scatter": {"all_gather": 1, "reduce_scatter": 1},
}


def _check_world(results: list, case: dict, world: int) -> None:
    q, kv, rows = case["q"], case["kv"], case["rows"]
    ref_out, ref_lse = sparse_mla_attention(q, kv, rows, scale=case["scale"], v_dim=DV)
    out64, lse64 = sparse_mla_oracle(q, kv, rows, scale=case["scale"], v_dim=DV)
    outs = torch.stack([res["partial"][0] for res in results])
    lses = torch.stack([res["partial"][1] for res in results])
    h = q.shape[1]
    hs = h // world
    vmax = float(kv[:, :DV].float().abs().max())
    for r, res in enumerate(results):
        for strategy in STRATS:
            for scatter in (True, False):
                if strategy == "all_to_all" and not scatter:
                    continue
                heads = slice(r * hs, (r + 1) * hs) if scatter else slice(0, h)
                out, lse = res[strategy, scatter]
                what = f"rank {r} {strategy} scatter_heads={scatter}"
                assert out.shape == (q.shape[0], heads.stop - heads.start, DV), what
                assert out.dtype == q.dtype and lse.dtype == torch.float32, what
                assert bool(lse[0].isneginf().all()) and float(out[0].abs().sum()) == 0.0, what
                assert_within_reference_error(
                    out, out64[:, heads], ref_out[:, heads], what=what + " out", partial_max=vmax
                )
                assert_within_reference_error(lse, lse64[:, heads], ref_lse[:, heads], what=what + " lse")
                if strategy != "reduce_scatter":  # the same merge on the same numbers: identical bits
                    # (merged over the rank's heads alone, as the collector merges them: torch's CPU
                    # reductions may round a slice of a larger merge otherwise, e.g. 2 of 16 heads)
                    same_out, same_lse = lse_merge(outs[:, :, heads].contiguous(), lses[:, :, heads].contiguous())
                    assert torch.equal(out, same_out), what
                    assert torch.equal(lse, same_lse), what
                used = resolve_strategy(strategy, "gloo", scatter_heads=scatter)
                kinds = EXPECTED_COUNTS[used]
                if used == "reduce_scatter" and not scatter:
                    kinds = {"all_gather": 1, "all_reduce": 1}
                expect = {**kinds, "agreement": 1} if world > 1 else {"agreement": 1}
                assert res[strategy, scatter, "counts"] == expect, what


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=WORLD_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_collector_equals_single_process_attention(dist_pool, world_size: int, dtype: torch.dtype) -> None:
    case = _case(seed=world_size, world=world_size, t=6, heads_per_rank=2, k=12, dtype=dtype)
    results = dist_pool.run(_collect_all_strategies, case, world_size=world_size)
    _check_world(results, case, world_size)


@pytest.mark.distributed
@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    world=st.integers(2, 4),
    t=st.integers(1, 9),
    heads_per_rank=st.integers(1, 3),
    k=st.integers(1, 20),
    seed=st.integers(0, 2**16),
)
def test_collector_drawn_shapes(dist_pool, nproc, world: int, t: int, heads_per_rank: int, k: int, seed: int) -> None:
    world = min(world, nproc)  # the draw stays in the pool's ranks
    case = _case(seed, world, t, heads_per_rank, k, torch.bfloat16)
    results = dist_pool.run(_collect_all_strategies, case, world_size=world)
    _check_world(results, case, world)


def _empty_everywhere(group: dist.ProcessGroup) -> list:
    w = dist.get_world_size(group)
    out, lse = torch.zeros(3, 2 * w, 8), torch.full((3, 2 * w), -math.inf)
    return [collect_partials(out, lse, group, strategy=s) for s in ("all_to_all", "all_gather", "reduce_scatter")]


@pytest.mark.distributed
def test_rows_empty_on_every_rank_merge_to_zero_and_neg_inf(dist_pool) -> None:
    for per_rank in dist_pool.run(_empty_everywhere, world_size=3):
        for out, lse in per_rank:
            assert not bool(out.isnan().any())
            assert bool((out == 0).all()) and bool(lse.isneginf().all())


def _junk_in_empty_rows(group: dist.ProcessGroup) -> list:
    """Each strategy's merge with rank 1's empty rows holding NaN, and with them holding 0."""
    w, r = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(r)
    out, lse = torch.randn(3, 2 * w, 8, generator=g), torch.randn(3, 2 * w, generator=g)
    if r == 1:
        lse[0] = -math.inf
    junk = out.clone()
    junk[torch.isneginf(lse)] = math.nan
    strategies = ("all_to_all", "all_gather", "reduce_scatter")
    return [(collect_partials(junk, lse, group, strategy=s), collect_partials(out * 1, lse, group, strategy=s))
            for s in strategies]  # fmt: skip


def _one_partial(group: dist.ProcessGroup) -> tuple:
    out, lse = torch.full((2, 3, 4), 5.0), torch.tensor([[math.inf, 0.5, -math.inf], [1.0, 2.0, 3.0]])
    return collect_partials(out, lse, group, scatter_heads=False)


@pytest.mark.distributed
def test_a_group_of_one_applies_the_empty_row_rule(dist_pool) -> None:
    """One partial, lse +inf (FlashMLA's empty row) or -inf: (0, -inf), as the merge of several
    gives; the +inf row came back unchanged."""
    ((got_out, got_lse),) = dist_pool.run(_one_partial, world_size=1)
    assert torch.equal(got_lse, torch.tensor([[-math.inf, 0.5, -math.inf], [1.0, 2.0, 3.0]]))
    assert (got_out[0, 0] == 0).all() and (got_out[0, 2] == 0).all() and (got_out[0, 1] == 5).all()


def _one_broken_partial(group: dist.ProcessGroup) -> list:
    """A group of one: row (0, 1) of the partial has a NaN LSE under finite values, row (1, 0)
    FlashMLA's empty marker; every strategy and layout."""
    out, lse = torch.randn(2, 2, 4, generator=torch.Generator().manual_seed(1)), torch.randn(2, 2)
    lse[0, 1], lse[1, 0] = math.nan, math.inf
    layouts = [("all_to_all", True), ("all_gather", True), ("all_gather", False), ("reduce_scatter", True),
               ("reduce_scatter", False), ("auto", True)]  # fmt: skip
    merge, collector.run_lse_merge = collector.run_lse_merge, _no_merge_kernel
    try:
        return [(out, lse, collect_partials(out, lse, group, strategy=s, scatter_heads=sc)) for s, sc in layouts]
    finally:
        collector.run_lse_merge = merge


def _no_merge_kernel(*args: object, **kwargs: object) -> None:
    """In place of the merge in a group of one: one partial needs no merge kernel, which a GPU
    Runtime's warm-up (whose steps on one rank never merge) would not have compiled."""
    raise AssertionError("a group of one launched the merge")


@pytest.mark.distributed
def test_a_group_of_one_keeps_a_nan_lse_row_broken(dist_pool) -> None:
    """One partial with a NaN LSE comes back as a NaN row (output and LSE), as the merge of several
    partials gives: the group of one returned the row's finite values beside the NaN LSE."""
    for out, lse, (got_out, got_lse) in dist_pool.run(_one_broken_partial, world_size=1)[0]:
        assert bool(got_out[0, 1].isnan().all()) and math.isnan(float(got_lse[0, 1]))
        assert bool((got_out[1, 0] == 0).all()) and float(got_lse[1, 0]) == -math.inf
        keep = torch.tensor([[True, False], [False, True]])
        assert torch.equal(got_out[keep], out[keep]) and torch.equal(got_lse[keep], lse[keep])


@pytest.mark.distributed
def test_empty_rows_contribute_nothing_whatever_they_hold(dist_pool) -> None:
    for per_rank in dist_pool.run(_junk_in_empty_rows, world_size=3):
        for (out, lse), (ref_out, ref_lse) in per_rank:
            assert not bool(out.isnan().any())
            assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def _partials_that_require_grad(group: dist.ProcessGroup) -> list:
    """Every strategy and layout on a partial whose out and lse require grad, beside the same values plain."""
    w, r = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(r)
    out, lse = torch.randn(3, 2 * w, 8, generator=g), torch.randn(3, 2 * w, generator=g)
    layouts = [("all_to_all", True), ("all_gather", True), ("all_gather", False), ("reduce_scatter", True),
               ("reduce_scatter", False)]  # fmt: skip
    got = []
    for s, scatter in layouts:
        tracked = collect_partials(out.clone().requires_grad_(), lse.clone().requires_grad_(), group, strategy=s,
                                   scatter_heads=scatter)  # fmt: skip
        got.append((s, scatter, tracked, collect_partials(out, lse, group, strategy=s, scatter_heads=scatter)))
    return got


@pytest.mark.distributed
def test_partials_that_require_grad_are_read_as_values_by_every_strategy(dist_pool) -> None:
    """The collector is an inference step, as the ops are: out / lse that require grad merge to the
    plain inputs' bits with no autograd history (the reduce-scatter raised on its in-place
    collective, or returned a tracked output for all heads)."""
    for per_rank in dist_pool.run(_partials_that_require_grad, world_size=2):
        for strategy, scatter, (out, lse), (want_out, want_lse) in per_rank:
            what = f"{strategy} scatter_heads={scatter}"
            assert not out.requires_grad and not lse.requires_grad, what
            assert torch.equal(out, want_out) and torch.equal(lse, want_lse), what


def _lse_only(group: dist.ProcessGroup) -> list:
    """Every strategy's merge of partials with no value dims (``out [T, H, 0]``): their LSEs still merge."""
    w, r = dist.get_world_size(group), dist.get_rank(group)
    lses = torch.randn(w, 3, 2 * w, generator=torch.Generator().manual_seed(7))
    lses[:, 0, 0] = -math.inf  # a row with no key anywhere
    out = torch.zeros(3, 2 * w, 0)
    layouts = [("all_to_all", True), ("all_gather", True), ("all_gather", False), ("reduce_scatter", False)]
    want = torch.logsumexp(lses, 0)
    return [(scatter, collect_partials(out, lses[r], group, strategy=s, scatter_heads=scatter)[1], want)
            for s, scatter in layouts]  # fmt: skip


@pytest.mark.distributed
def test_partials_without_value_dims_merge_their_lses(dist_pool) -> None:
    """Every rank gets the merged LSEs of its heads (it got its own partial's back, unmerged, with no error)."""
    for r, per_rank in enumerate(dist_pool.run(_lse_only, world_size=2)):
        for scatter, got, want in per_rank:
            want = want[:, 2 * r : 2 * r + 2] if scatter else want
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def _bad_inputs(group: dist.ProcessGroup, case: str) -> tuple[str, str]:
    rank, w = dist.get_rank(group), dist.get_world_size(group)
    t, h = 4, 2 * w
    out, lse = torch.zeros(t, h, 8), torch.zeros(t, h)
    if case == "heads-not-divisible":
        out, lse = torch.zeros(t, h + 1, 8), torch.zeros(t, h + 1)
    elif case == "lse-dtype-on-rank-1" and rank == 1:
        lse = lse.half()
    elif case == "tokens-differ-on-rank-2" and rank == 2:
        out, lse = torch.zeros(t + 1, h, 8), torch.zeros(t + 1, h)
    elif case == "all-to-all-without-scatter":
        return catch(collect_partials, out, lse, group, scatter_heads=False, strategy="all_to_all")
    elif case == "send-and-recv-one-buffer":  # the exchange would read what it writes
        buf = torch.zeros(1 << 12, dtype=torch.uint8)
        return catch(collect_partials, out, lse, group, strategy="all_to_all", buffers={"send": buf, "recv": buf})
    elif case == "recv-buffer-small-on-rank-1":  # refused where the ranks agree, not in the exchange
        small = {"recv": torch.zeros(16, dtype=torch.uint8)} if rank == 1 else None
        return catch(collect_partials, out, lse, group, strategy="all_to_all", buffers=small)
    return catch(collect_partials, out, lse, group)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("case", "expect"),
    [
        ("heads-not-divisible", ["ValueError: out has 7 heads, not divisible by world_size=3"] * 3),
        (
            "lse-dtype-on-rank-1",
            [
                "ValueError: collector input (out shape and dtype, scatter_heads, strategy): rank(s) [1] of 3 rejected",
                "TypeError: lse must have dtype in (float32), got float16",
                "ValueError: collector input (out shape and dtype, scatter_heads, strategy): rank(s) [1] of 3 rejected",
            ],
        ),
        ("tokens-differ-on-rank-2", ["ValueError: collector input"] * 3),
        ("all-to-all-without-scatter", ["ValueError: strategy='all_to_all' leaves each rank"] * 3),
        ("send-and-recv-one-buffer", ["ValueError: buffers['send'] and buffers['recv'] share memory"] * 3),
        (
            "recv-buffer-small-on-rank-1",
            [
                "ValueError: collector input (out shape and dtype, scatter_heads, strategy): rank(s) [1] of 3 rejected",
                "ValueError: buffers['recv'] holds 16 B, the step needs at least",
                "ValueError: collector input (out shape and dtype, scatter_heads, strategy): rank(s) [1] of 3 rejected",
            ],
        ),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_bad_input_raises_on_every_rank(dist_pool, case: str, expect: list) -> None:
    results = dist_pool.run(_bad_inputs, case, world_size=3)
    assert_rank_errors(results, expect)
    if case == "tokens-differ-on-rank-2":
        assert all("rank(s) [2] disagree with rank(s) [0, 1]" in msg for _, msg in results)


COLLECTOR = "collector input (out shape and dtype, scatter_heads, strategy)"
#: Arguments only rank 1 gets wrong, and its error (read where the ranks agree, not mid-exchange).
ONE_BAD_RANK = {
    "send-buffer-strided": (
        {"buffers": {"send": torch.zeros(1 << 13, dtype=torch.uint8)[::2]}},
        "ValueError: buffers['send'] must be contiguous (a flat buffer), got stride 2",
    ),
    "recv-buffer-misaligned": (
        {"buffers": {"recv": torch.zeros(1 << 13, dtype=torch.uint8)[2:]}},
        "ValueError: buffers['recv'] must start on a 4-byte boundary (it is viewed as float32), got one 2 bytes",
    ),
    "check-not-a-bool": ({"check": 1}, "TypeError: check must be a bool, got int (1)"),
}


def _one_bad_rank(group: dist.ProcessGroup, case: str) -> tuple[str, str]:
    w, rank = dist.get_world_size(group), dist.get_rank(group)
    out, lse = torch.zeros(4, 2 * w, 8), torch.zeros(4, 2 * w)
    bad = ONE_BAD_RANK[case][0] if rank == 1 else {}
    short = short_timeout_group(group)  # a peer left waiting in a collective fails in seconds
    return catch(collect_partials, out, lse, short, strategy="all_to_all", **bad)


@pytest.mark.distributed
@pytest.mark.parametrize("case", sorted(ONE_BAD_RANK))
def test_one_ranks_bad_argument_raises_on_every_rank_at_once(dist_pool, nproc: int, case: str) -> None:
    if nproc < 2:
        pytest.skip("needs 2 ranks; run with --nproc 2 or more")
    assert_rank_errors(dist_pool.run(_one_bad_rank, case), rank_1_rejected(nproc, COLLECTOR, ONE_BAD_RANK[case][1]))


def test_resolve_strategy_picks_by_layout_and_backend() -> None:
    assert resolve_strategy("auto", "nccl", scatter_heads=True) == "all_to_all"
    assert resolve_strategy("auto", "gloo", scatter_heads=False) == "all_gather"
    assert resolve_strategy("auto", "mpi", scatter_heads=True) == "all_gather"
    assert resolve_strategy("reduce_scatter", "gloo", scatter_heads=False) == "reduce_scatter"
    with pytest.raises(ValueError, match="strategy must be one of"):
        resolve_strategy("ring", "nccl", scatter_heads=True)
