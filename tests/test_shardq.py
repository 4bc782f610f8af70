"""ShardQ prefill on 1-4 ranks, and the head-TP step it runs below ``min_tokens``, equal
single-process sparse MLA over all heads and tokens (checked against the independent fp64 oracle of
tests/oracle.py), with and without sinks and ``topk_length``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardattn.ops.sparse_mla import sparse_mla_attention
from shardattn.parallel.comm import Comm
from shardattn.parallel.shardq import shardq_prefill
from shardattn.plan import zigzag_split
from tests.oracle import sparse_mla_oracle
from tests.parallel_helpers import (
    WORLD_IDS,
    WORLD_SIZES,
    assert_rank_errors,
    assert_within_reference_error,
    catch,
    fp8_rows,
    junk_rows,
    rank_1_rejected,
    short_timeout_group,
    topk_lengths,
)


def _case(
    seed: int,
    seq_lens: list[int],
    prefix_lens: list[int],
    world: int,
    heads_per_rank: int,
    k: int,
    *,
    d: int = 576,
    dv: int = 512,
    sinks: bool = False,
    topk_length: bool = False,
) -> dict:
    """A step's inputs: rows with invalid entries anywhere (-1, past the cache), empty rows; with
    ``topk_length``, cuts anywhere in a row, 0 and the whole row included (:func:`topk_lengths`)."""
    g = torch.Generator().manual_seed(seed)
    t, h = sum(seq_lens), heads_per_rank * world
    r = 2 * k + 3
    rows = junk_rows(g, t, k, r, [-1, r, r + 100, -7], 0.3, 5)
    return {
        "q": (torch.randn(t, h, d, generator=g) * 0.5).bfloat16(),
        "kv": torch.randn(r, d, generator=g).bfloat16(),
        "rows": rows,
        "seq_lens": seq_lens,
        "prefix_lens": prefix_lens,
        "scale": d**-0.5,
        "dv": dv,
        "sinks": torch.randn(h, generator=g) if sinks else None,
        "topk_length": topk_lengths(g, t, k) if topk_length else None,
    }


def _run(group: dist.ProcessGroup, case: dict, min_tokens: int, align: int, check: bool = True) -> tuple:
    comm = Comm(group)
    w, rank = comm.world_size, comm.rank
    plan = zigzag_split(case["seq_lens"], w, align=align, min_tokens=min_tokens, prefix_lens=case["prefix_lens"])
    h = case["q"].shape[1] // w
    out, lse = shardq_prefill(
        case["q"][:, rank * h : (rank + 1) * h],
        case["kv"],
        case["rows"],
        plan,
        comm,
        scale=case["scale"],
        v_dim=case["dv"],
        topk_length=case["topk_length"],
        sinks=case["sinks"],
        check=check,
    )
    return out, lse, dict(comm.counts), plan.sharded


def _check(results: list, case: dict, world: int, *, check: bool = True) -> None:
    q, kv, rows = case["q"], case["kv"], case["rows"]
    kw = dict(scale=case["scale"], v_dim=case["dv"], topk_length=case["topk_length"], sinks=case["sinks"])
    ref_out, ref_lse = sparse_mla_attention(q, kv, rows, **kw)
    out64, lse64 = sparse_mla_oracle(q, kv, rows, **kw)
    h = q.shape[1] // world
    for r, (out, lse, counts, sharded) in enumerate(results):
        heads = slice(r * h, (r + 1) * h)
        what = f"rank {r} of {world} (sharded={sharded})"
        assert out.shape == (q.shape[0], h, case["dv"]) and out.dtype == q.dtype, what
        assert lse.shape == (q.shape[0], h) and lse.dtype == torch.float32, what
        assert_within_reference_error(out, out64[:, heads], ref_out[:, heads], what=what + " out")
        assert_within_reference_error(lse, lse64[:, heads], ref_lse[:, heads], what=what + " lse")
        expect = {"all_to_all": 2} if sharded else {}
        if check:
            expect["agreement"] = 1
        assert counts == expect, what


#: ``min_tokens`` of the step's plan: 0 shards the tokens (ShardQ), 10,000 keeps head-TP.
PATHS = {"shardq": 0, "head-tp": 10_000}


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=WORLD_IDS)
@pytest.mark.parametrize(("sinks", "topk_length"), [(False, False), (True, True)], ids=["plain", "sinks+topk_length"])
@pytest.mark.parametrize("path", list(PATHS))
def test_shardq_equals_single_process(dist_pool, world_size: int, sinks: bool, topk_length: bool, path: str) -> None:
    """Each rank's heads of every token, sharded or head-TP: each rank's own sinks, each token's own
    ``topk_length`` wherever its queries run."""
    case = _case(world_size, [7, 13], [0, 4], world_size, 2, 24, sinks=sinks, topk_length=topk_length)
    results = dist_pool.run(_run, case, PATHS[path], 1, world_size=world_size)
    assert all(sharded == (path == "shardq") for *_, sharded in results)
    _check(results, case, world_size)


@pytest.mark.distributed
@pytest.mark.parametrize("min_tokens", [0, 10_000], ids=["shardq", "head-tp"])
def test_shardq_and_head_tp_read_a_local_fp8_cache(dist_pool, min_tokens: int) -> None:
    """The replicated cache in fp8_ds_mla rows: each rank's kernel reads it in place (ShardQ and
    head-TP), equal to the single process on the rows it dequantises to."""
    case = _case(31, [7, 13], [0, 4], 2, 2, 24, sinks=True, topk_length=True)
    fp8, case["kv"] = fp8_rows(case["kv"])
    results = dist_pool.run(_run, {**case, "kv": fp8}, min_tokens, 1, world_size=2)
    assert all(sharded == (min_tokens == 0) for *_, sharded in results)
    _check(results, case, 2)


@pytest.mark.distributed
def test_shardq_below_min_tokens_runs_head_tp_without_collectives(dist_pool) -> None:
    case = _case(5, [3, 6], [2, 0], 2, 2, 16, sinks=True)
    results = dist_pool.run(_run, case, 10_000, 1, False, world_size=2)
    assert not any(sharded for *_, sharded in results)
    _check(results, case, 2, check=False)  # no collective at all, not even the agreement


@pytest.mark.distributed
def test_shardq_without_check_issues_exactly_two_all_to_alls(dist_pool) -> None:
    case = _case(6, [9], [0], 3, 1, 8)
    results = dist_pool.run(_run, case, 0, 2, False, world_size=3)
    _check(results, case, 3, check=False)


@pytest.mark.distributed
@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    world=st.integers(1, 4),
    seq_lens=st.lists(st.integers(0, 13), min_size=1, max_size=4),
    prefix=st.lists(st.integers(0, 9), min_size=4, max_size=4),
    heads_per_rank=st.integers(1, 2),
    k=st.integers(1, 32),
    align=st.integers(1, 3),
    path=st.sampled_from(list(PATHS)),
    sinks=st.booleans(),
    topk_length=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_shardq_drawn_batches(
    dist_pool, nproc, world, seq_lens, prefix, heads_per_rank, k, align, path, sinks, topk_length, seed
) -> None:
    world = min(world, nproc)  # the draw stays in the pool's ranks
    case = _case(
        seed, seq_lens, prefix[: len(seq_lens)], world, heads_per_rank, k, d=96, dv=64, sinks=sinks,
        topk_length=topk_length,
    )  # fmt: skip
    results = dist_pool.run(_run, case, PATHS[path], align, world_size=world)
    assert all(sharded == (path == "shardq") for *_, sharded in results)
    _check(results, case, world)


def _bad(group: dist.ProcessGroup, problem: str) -> tuple[str, str]:
    rank, w = dist.get_rank(group), dist.get_world_size(group)
    case = _case(1, [5, 4], [0, 0], w, 2, 8, d=32, dv=16)
    plan = zigzag_split(case["seq_lens"], w, min_tokens=0)
    q, kv, rows = case["q"][:, rank * 2 : rank * 2 + 2], case["kv"], case["rows"]
    if problem == "kv-dtype-on-rank-1" and rank == 1:
        kv = kv.float()
    elif problem == "heads-on-rank-1" and rank == 1:
        q = case["q"][:, :3]
    elif problem == "plan-on-rank-2" and rank == 2:
        plan = zigzag_split([4, 5], w, min_tokens=0)  # same token count, different split
    elif problem == "plan-world-size":
        plan = zigzag_split(case["seq_lens"], w + 1, min_tokens=0)
    elif problem == "sinks-for-wrong-head-count":
        return catch(shardq_prefill, q, kv, rows, plan, group, scale=1.0, v_dim=16, sinks=torch.zeros(2 * w + 1))
    elif problem == "rows-int64":
        rows = rows.long()
    elif problem == "workspace-one-buffer-for-q-and-out":  # the kernel would write its outputs over its queries
        arena = torch.zeros(1 << 16, dtype=torch.uint8)
        return catch(
            shardq_prefill, q, kv, rows, plan, group, scale=1.0, v_dim=16, workspace={"q": arena, "out": arena}
        )
    elif problem.endswith("-on-rank-1") and problem.split("-")[0] in ("return", "scale", "out", "workspace"):
        kw: dict = {}  # an argument only rank 1 gets wrong, read before any exchange
        if rank == 1:
            kw = {
                "return-lse-on-rank-1": {"return_lse": False},  # it decides what the output exchange carries
                "scale-on-rank-1": {"scale": 0.5},
                "out-dtype-on-rank-1": {"out": torch.zeros(9, 2, 16, dtype=torch.float64)},
                "out-strided-on-rank-1": {"out": torch.zeros(9, 2, 32, dtype=q.dtype)[..., ::2]},
                "workspace-small-on-rank-1": {"workspace": {"q": torch.zeros(8, dtype=torch.uint8)}},
                "workspace-float-on-rank-1": {"workspace": {"out": torch.zeros(10**5)}},
            }[problem]
        return catch(shardq_prefill, q, kv, rows, plan, group, **{"scale": 1.0, "v_dim": 16, **kw})
    elif problem == "out-inside-the-workspace":  # the step would write its exchanges over its output
        ws = torch.zeros(1 << 16, dtype=torch.uint8)
        out = ws[: 9 * 2 * 16 * q.element_size()].view(q.dtype).view(9, 2, 16)
        return catch(shardq_prefill, q, kv, rows, plan, group, scale=1.0, v_dim=16, out=out, workspace={"q": ws})
    elif problem == "attention-none":
        return catch(shardq_prefill, q, kv, rows, plan, group, scale=1.0, v_dim=16, attention=None)
    elif problem == "one-union-align-2-default-attention":  # the default takes G = 1 prepared unions only
        plan = zigzag_split(case["seq_lens"], w, align=2, min_tokens=0)
        return catch(shardq_prefill, q, kv, rows, plan, group, scale=1.0, v_dim=16, align=2, one_union=True)
    elif problem.startswith("attention-returns-the-output-alone"):  # a custom kernel, sharded or head-TP
        plan = zigzag_split(case["seq_lens"], w, min_tokens=0 if problem.endswith("sharded") else 100)
        return catch(
            shardq_prefill, q, kv, rows, plan, group, scale=1.0, v_dim=16,
            attention=lambda *a, **kw: sparse_mla_attention(*a, **kw)[0],
        )  # fmt: skip
    return catch(shardq_prefill, q, kv, rows, plan, group, scale=1.0, v_dim=16)


REJECTED = "ValueError: ShardQ plan and inputs: rank(s) [1] of 3 rejected their inputs"
OUTPUT_ALONE = "TypeError: attention must return (out, lse) when asked for the LSE, got the output alone"


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("problem", "expect"),
    [
        ("kv-dtype-on-rank-1", [REJECTED, "TypeError: kv must have dtype in (bfloat16), got float32", REJECTED]),
        ("heads-on-rank-1", ["ValueError: ShardQ plan and inputs: rank(s) [1] disagree"] * 3),
        ("plan-on-rank-2", ["ValueError: ShardQ plan and inputs: rank(s) [2] disagree"] * 3),
        ("plan-world-size", ["ValueError: plan is for world_size=4, but the group has 3 ranks"] * 3),
        ("sinks-for-wrong-head-count", ["ValueError: sinks must have shape [6], got [7]"] * 3),
        ("rows-int64", ["TypeError: rows must have dtype in (int32), got int64"] * 3),
        ("return-lse-on-rank-1", ["ValueError: ShardQ plan and inputs: rank(s) [1] disagree"] * 3),
        ("scale-on-rank-1", ["ValueError: ShardQ plan and inputs: rank(s) [1] disagree"] * 3),
        ("out-dtype-on-rank-1", [REJECTED, "TypeError: out must have dtype in (bfloat16), got float64", REJECTED]),
        ("out-strided-on-rank-1", [REJECTED, "ValueError: out must be contiguous", REJECTED]),
        (
            "workspace-small-on-rank-1",
            [REJECTED, "ValueError: workspace['q'] holds 8 B, the step needs at least", REJECTED],
        ),
        (
            "workspace-float-on-rank-1",
            [REJECTED, "TypeError: workspace['out'] must have dtype in (uint8), got float32", REJECTED],
        ),
        ("workspace-one-buffer-for-q-and-out", ["ValueError: workspace['q'] and workspace['out'] share memory"] * 3),
        ("out-inside-the-workspace", ["ValueError: out and workspace['q'] share memory"] * 3),
        ("one-union-align-2-default-attention", ["ValueError: one_union with align=2 hands the kernel"] * 3),
        ("attention-none", ["TypeError: attention must be callable like sparse_mla_attention, got NoneType"] * 3),
        ("attention-returns-the-output-alone-sharded", [OUTPUT_ALONE] * 3),
        ("attention-returns-the-output-alone-head-tp", [OUTPUT_ALONE] * 3),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_shardq_bad_input_raises_on_every_rank(dist_pool, problem: str, expect: list) -> None:
    results = dist_pool.run(_bad, problem, world_size=3)
    assert_rank_errors(results, expect)


#: Arguments only rank 1 gets wrong, and its error (read where the ranks agree, not mid-exchange).
ONE_BAD_RANK = {
    "workspace-misaligned": (
        {"workspace": {"q": torch.zeros(1 << 16, dtype=torch.uint8)[1:]}},
        "ValueError: workspace['q'] must start on a 4-byte boundary (it is viewed as float32), got one 1 byte",
    ),
    "workspace-strided": (
        {"workspace": {"out": torch.zeros(1 << 16, dtype=torch.uint8)[::2]}},
        "ValueError: workspace['out'] must be contiguous (a flat buffer), got stride 2",
    ),
}


def _one_bad_rank(group: dist.ProcessGroup, problem: str) -> tuple[str, str]:
    w, rank = dist.get_world_size(group), dist.get_rank(group)
    case = _case(1, [5, 4], [0, 0], w, 2, 8, d=32, dv=16)
    q = case["q"][:, rank * 2 : rank * 2 + 2]
    plan = zigzag_split(case["seq_lens"], w, min_tokens=0)
    bad = ONE_BAD_RANK[problem][0] if rank == 1 else {}
    short = short_timeout_group(group)  # a peer left waiting in an exchange fails in seconds
    return catch(shardq_prefill, q, case["kv"], case["rows"], plan, short, scale=1.0, v_dim=16, **bad)


@pytest.mark.distributed
@pytest.mark.parametrize("problem", sorted(ONE_BAD_RANK))
def test_shardq_one_ranks_bad_argument_raises_on_every_rank_at_once(dist_pool, nproc: int, problem: str) -> None:
    if nproc < 2:
        pytest.skip("needs 2 ranks; run with --nproc 2 or more")
    expect = rank_1_rejected(nproc, "ShardQ plan and inputs", ONE_BAD_RANK[problem][1])
    assert_rank_errors(dist_pool.run(_one_bad_rank, problem), expect)


@pytest.mark.distributed
def test_shardq_empty_step_and_ranks_that_own_nothing(dist_pool) -> None:
    for seq_lens in ([0, 0], [1]):  # no token at all; one token, so all but one rank own nothing
        case = _case(9, seq_lens, [0] * len(seq_lens), 3, 1, 4, d=32, dv=16, sinks=True, topk_length=True)
        results = dist_pool.run(_run, case, 0, 1, world_size=3)
        _check(results, case, 3)


def _with_and_without_lse(group: dist.ProcessGroup, case: dict) -> tuple:
    comm = Comm(group)
    plan = zigzag_split(case["seq_lens"], comm.world_size, min_tokens=0)
    h = case["q"].shape[1] // comm.world_size
    args = (case["q"][:, comm.rank * h : (comm.rank + 1) * h], case["kv"], case["rows"], plan, comm)
    out, _ = shardq_prefill(*args, scale=case["scale"], v_dim=case["dv"])
    comm.reset_counts()
    only_out = shardq_prefill(*args, scale=case["scale"], v_dim=case["dv"], return_lse=False, check=False)
    return out, only_out, dict(comm.counts)


@pytest.mark.distributed
def test_shardq_return_lse_false_gives_the_same_output(dist_pool) -> None:
    case = _case(8, [10, 3], [0, 0], 2, 2, 8, d=32, dv=16)
    for out, only_out, counts in dist_pool.run(_with_and_without_lse, case, world_size=2):
        assert isinstance(only_out, torch.Tensor) and torch.equal(out, only_out)
        assert counts == {"all_to_all": 2}
