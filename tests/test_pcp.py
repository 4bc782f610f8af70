"""PCP prefill on 1-4 ranks equals single-process sparse MLA over each request's whole KV, with and
without sinks and ``topk_length`` (checked against the independent fp64 oracle of tests/oracle.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardattn.parallel.comm import Comm
from shardattn.parallel.pcp import pcp_prefill
from shardattn.plan import pcp_plan
from tests.parallel_helpers import (
    WORLD_IDS,
    WORLD_SIZES,
    assert_rank_errors,
    assert_within_reference_error,
    catch,
    fp8_rows,
    junk_rows,
    paged,
    paged_mla_references,
    topk_lengths,
)


def _case(
    seed: int,
    seq_lens: list[int],
    prefix_lens: list[int],
    *,
    heads: int = 4,
    k: int = 16,
    d: int = 576,
    dv: int = 512,
    block_size: int = 4,
    sinks: bool = False,
    topk_length: bool = False,
) -> dict:
    """A prefill step: every request's KV (prefix + new), top-k positions with junk anywhere; with
    ``topk_length``, cuts anywhere in a row, 0 and the whole row included (:func:`topk_lengths`).

    ``cache``/``table``: the whole KV of every request (the reference's view); ``prefix_cache`` /
    ``prefix_table``: only the cached prefixes (what every rank holds); ``kv_new``: new tokens' KV
    in token order.
    """
    g = torch.Generator().manual_seed(seed)
    kv_req = [torch.randn(p + n, d, generator=g).bfloat16() for p, n in zip(prefix_lens, seq_lens)]
    req_ids = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens)).to(torch.int32)
    t = req_ids.numel()
    full = torch.tensor([p + n for p, n in zip(prefix_lens, seq_lens)], dtype=torch.int32)
    hi = max(1, int(full.max()) if full.numel() else 1)
    pos = junk_rows(g, t, k, hi, [-1, -3, hi, hi + 9], 0.25, 5)
    cache, table = paged(kv_req, block_size, g)
    prefix_cache, prefix_table = paged([x[:p] for x, p in zip(kv_req, prefix_lens)], block_size, g)
    new = [x[p:] for x, p in zip(kv_req, prefix_lens)]
    return {
        "q": (torch.randn(t, heads, d, generator=g) * 0.5).bfloat16(),
        "kv_new": torch.cat(new) if new else torch.zeros(0, d).bfloat16(),
        "pos": pos,
        "req_ids": req_ids,
        "full_lens": full,
        "seq_lens": seq_lens,
        "prefix_lens": prefix_lens,
        "cache": cache.flatten(0, 1),
        "table": table,
        "prefix_cache": prefix_cache.flatten(0, 1),
        "prefix_table": prefix_table,
        "block_size": block_size,
        "scale": d**-0.5,
        "dv": dv,
        "sinks": torch.randn(heads, generator=g) if sinks else None,
        "topk_length": topk_lengths(g, t, k) if topk_length else None,
    }


def _run(group: dist.ProcessGroup, case: dict, gather_output: bool = False, with_cache: bool = True) -> tuple:
    comm = Comm(group)
    plan = pcp_plan(case["seq_lens"], comm.world_size, prefix_lens=case["prefix_lens"])
    ids = plan.shard.token_ids(comm.rank)
    tl = case["topk_length"]
    out, lse = pcp_prefill(
        case["q"][ids],
        case["kv_new"][ids],
        case["pos"][ids],
        plan,
        comm,
        scale=case["scale"],
        v_dim=case["dv"],
        kv_cache=case["prefix_cache"] if with_cache else None,
        block_table=case["prefix_table"] if with_cache else None,
        block_size=case["block_size"] if with_cache else None,
        topk_length=None if tl is None else tl[ids],
        sinks=case["sinks"],
        gather_output=gather_output,
    )
    return out, lse, ids, dict(comm.counts)


def _check(results: list, case: dict, world: int, gather_output: bool = False) -> None:
    # prefix and new keys are two partials merged in one process: one extra bf16 rounding (vmax)
    ref_out, ref_lse, out64, lse64, vmax = paged_mla_references(case, case["full_lens"])
    q = case["q"]
    split = any(p > 0 for p in case["prefix_lens"])
    for r, (out, lse, ids, counts) in enumerate(results):
        sel = slice(None) if gather_output else ids
        what = f"rank {r} of {world}"
        assert out.shape == (ref_out[sel].shape) and out.dtype == q.dtype, what
        assert_within_reference_error(
            out, out64[sel], ref_out[sel], what=what + " out", partial_max=vmax if split else 0.0
        )
        assert_within_reference_error(lse, lse64[sel], ref_lse[sel], what=what + " lse")
        assert counts == {"all_gather": 2 if gather_output else 1, "agreement": 1}, what


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=WORLD_IDS)
@pytest.mark.parametrize("gather_output", [False, True], ids=["own-tokens", "token-order"])
@pytest.mark.parametrize("topk_length", [False, True], ids=["sinks", "sinks+topk_length"])
def test_pcp_equals_single_process(dist_pool, world_size: int, gather_output: bool, topk_length: bool) -> None:
    """Sinks counted once (the prefix and new keys are two partials); ``topk_length`` cuts a row
    before its positions are split into prefix and new keys."""
    case = _case(world_size, [11, 2, 17], [5, 0, 9], sinks=True, topk_length=topk_length)
    results = dist_pool.run(_run, case, gather_output, world_size=world_size)
    _check(results, case, world_size, gather_output)


@pytest.mark.distributed
def test_pcp_on_fp8_rows(dist_pool) -> None:
    """New rows and the cached prefixes in fp8_ds_mla (the all-gather moves 656-byte rows; the
    prefix cache paged [pages, block_size, 656]): equal to the single process on the rows they
    dequantise to."""
    case = _case(21, [11, 2, 17], [5, 0, 9], sinks=True, topk_length=True)
    case["cache"] = fp8_rows(case["cache"])[1]
    case["kv_new"] = fp8_rows(case["kv_new"])[0]
    case["prefix_cache"] = fp8_rows(case["prefix_cache"], case["block_size"])[0]
    results = dist_pool.run(_run, case, world_size=2)
    _check(results, case, 2)


@pytest.mark.distributed
def test_pcp_without_prefix_needs_no_cache(dist_pool) -> None:
    case = _case(7, [9, 6], [0, 0], d=64, dv=48)
    results = dist_pool.run(_run, case, False, False, world_size=3)
    _check(results, case, 3)


@pytest.mark.distributed
@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    world=st.integers(1, 4),
    reqs=st.lists(st.tuples(st.integers(0, 14), st.integers(0, 10)), min_size=1, max_size=4),
    k=st.integers(1, 24),
    block_size=st.sampled_from([1, 3, 8]),
    sinks=st.booleans(),
    topk_length=st.booleans(),
    gather_output=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_pcp_drawn_batches(
    dist_pool, nproc, world, reqs, k, block_size, sinks, topk_length, gather_output, seed
) -> None:
    world = min(world, nproc)  # the draw stays in the pool's ranks
    case = _case(
        seed, [n for n, _ in reqs], [p for _, p in reqs], k=k, d=64, dv=48, block_size=block_size,
        sinks=sinks, topk_length=topk_length,
    )  # fmt: skip
    results = dist_pool.run(_run, case, gather_output, world_size=world)
    _check(results, case, world, gather_output)


def _bad(group: dist.ProcessGroup, problem: str) -> tuple[str, str]:
    rank, w = dist.get_rank(group), dist.get_world_size(group)
    case = _case(1, [7, 5], [3, 0], d=32, dv=16)
    plan = pcp_plan(case["seq_lens"], w, prefix_lens=case["prefix_lens"])
    ids = plan.shard.token_ids(rank)
    q, kv_new, pos = case["q"][ids], case["kv_new"][ids], case["pos"][ids]
    cache = dict(kv_cache=case["prefix_cache"], block_table=case["prefix_table"], block_size=case["block_size"])
    if problem == "kv-dtype-on-rank-1" and rank == 1:
        kv_new = kv_new.float()
    elif problem == "plan-on-rank-2" and rank == 2:
        plan = pcp_plan([5, 7], w, prefix_lens=[3, 0])
        ids = plan.shard.token_ids(rank)
        q, kv_new, pos = case["q"][ids], case["kv_new"][ids], case["pos"][ids]
    elif problem == "prefix-without-cache":
        cache = {}
    elif problem == "prefix-past-the-block-table":
        cache["block_table"] = cache["block_table"][:, :0]
    elif problem == "topk-int64":
        pos = pos.long()
    elif problem == "block-size-past-int32":  # the prefix's rows are int32 (refused mid-step before)
        cache["block_size"] = 2**31
    elif problem == "pages-of-another-size":  # pages of 2 x block_size rows: read as blocks, wrong rows
        rows = cache["kv_cache"]
        cache["kv_cache"] = rows[: rows.shape[0] // 8 * 8].view(-1, 2 * case["block_size"], rows.shape[-1])
    flags = {"gather_output": 1} if problem == "gather-output-1-on-rank-1" else {"check": 1}
    if problem.endswith("-1-on-rank-1") and rank == 1:  # a truthy int on one rank: read as True before
        cache |= flags
    return catch(pcp_prefill, q, kv_new, pos, plan, group, scale=1.0, v_dim=16, **cache)


REJECTED = "ValueError: PCP plan and inputs: rank(s) [1] of 3 rejected their inputs"


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("problem", "expect"),
    [
        ("kv-dtype-on-rank-1", [REJECTED, "TypeError: kv_new must have dtype in (bfloat16), got float32", REJECTED]),
        ("plan-on-rank-2", ["ValueError: PCP plan and inputs: rank(s) [2] disagree"] * 3),
        ("prefix-without-cache", ["ValueError: the plan has cached prefixes (prefix_lens=[3, 0])"] * 3),
        ("prefix-past-the-block-table", ["ValueError: prefix_lens[0]=3 is past block_table's 0 blocks"] * 3),
        ("topk-int64", ["TypeError: topk_pos must have dtype in (int32), got int64"] * 3),
        ("gather-output-1-on-rank-1", [REJECTED, "TypeError: gather_output must be a bool, got int (1)", REJECTED]),
        ("check-1-on-rank-1", [REJECTED, "TypeError: check must be a bool, got int (1)", REJECTED]),
        ("block-size-past-int32", ["ValueError: block_size must be <= 2,147,483,647, got 2,147,483,648"] * 3),
        ("pages-of-another-size", ["ValueError: kv_cache's pages hold 8 rows, but block_size is 4"] * 3),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_pcp_bad_input_raises_on_every_rank(dist_pool, problem: str, expect: list) -> None:
    results = dist_pool.run(_bad, problem, world_size=3)
    assert_rank_errors(results, expect)


@pytest.mark.distributed
def test_pcp_empty_step_and_ranks_that_own_nothing(dist_pool) -> None:
    for seq_lens, prefix in (([0], [4]), ([2, 0], [0, 3])):
        case = _case(4, seq_lens, prefix, d=32, dv=16, sinks=True, topk_length=True)
        for gather_output in (False, True):
            results = dist_pool.run(_run, case, gather_output, world_size=3)
            _check(results, case, 3, gather_output)
