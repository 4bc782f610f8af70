"""Ranks of a Runtime given bad or different arguments, as an engine meets them: a bad plan argument
on one rank (with and without ``check``), a ``check`` flag that is no bool, lengths that differ
between ranks. Every rank raises, in time, naming the rank and its error or the argument that
differs; after a failure the step's agreement caught, the group stays in step. Two to four gloo
ranks on fresh groups whose collectives time out after ``TIMEOUT_S`` (the fault tests' helpers:
``tests/test_runtime_rank_faults.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.parallel_helpers import short_timeout_group
from tests.test_runtime import _prefill_step
from tests.test_runtime_rank_faults import (
    FAST_S,
    TIMEOUT_S,
    _assert_named,
    _done,
    _needs_ranks,
    _outcome,
    _runtime,
    _step,
)

# -- a bad plan argument on one rank ----------------------------------------------------------------
BAD_PLANS = {
    "plan-and-lens": ("ValueError: pass either plan or query_lens", lambda step, plan: {
        "plan": plan, "query_lens": step.query_lens}),
    "not-a-plan": ("TypeError: plan must be a PrefillPlan", lambda step, plan: {"plan": {"step": plan.step}}),
    "no-lengths": ("ValueError: prefill needs query_lens", lambda step, plan: {"plan": None}),
}  # fmt: skip


def _bad_plan(group: dist.ProcessGroup, bad: str, check: bool) -> dict:
    short = short_timeout_group(group, TIMEOUT_S)
    rt = _runtime(short, "shardq")
    step = _prefill_step()
    plan = rt.plan_prefill(step.query_lens, step.prefix_lens)
    before = _step(rt, "shardq", plan=plan)()
    args = BAD_PLANS[bad][1](step, plan) if rt.rank == 1 else {"plan": plan}
    seen = {"bad": _outcome(_step(rt, "shardq", check=check, **args))}
    if check:  # every rank raised at the agreement: the next step runs in step on every rank
        seen["next"] = _outcome(_step(rt, "shardq", plan=plan))
        seen["next"]["same"] = seen["next"]["result"] is not None and torch.equal(seen["next"]["result"], before)
    return _done(group, short, seen)


@pytest.mark.distributed
@pytest.mark.parametrize("bad", sorted(BAD_PLANS))
def test_a_bad_plan_argument_on_one_rank_raises_on_every_rank_at_once(dist_pool, nproc: int, bad: str) -> None:
    """Before: rank 1 raised alone; its peers waited in the agreement, and rank 1's next call paired
    with their step (the peers returned from a step rank 1 had refused, one call out of step)."""
    _needs_ranks(nproc)
    results = dist_pool.run(_bad_plan, bad, True)
    own = BAD_PLANS[bad][0]
    for rank, seen in enumerate(results):
        where = (rank, seen)
        first = seen["bad"]
        if rank == 1:
            assert f"{first['kind']}: {first['msg']}".startswith(own), where
        else:
            assert first["kind"] == "ValueError", where
            assert first["msg"].startswith(f"ShardQ plan and inputs: rank(s) [1] of {nproc} rejected"), where
            assert first["s"] < FAST_S, where
        assert seen["next"]["kind"] == "ok" and seen["next"]["same"], where


@pytest.mark.distributed
def test_a_bad_plan_argument_without_check_is_named_by_the_waiting_peers(dist_pool, nproc: int) -> None:
    """``check=False``: rank 1 raises at once and reports it; its peers wait in the step's first
    collective until the timeout and name it with its error (before: named as silent, no error)."""
    _needs_ranks(nproc)
    results = dist_pool.run(_bad_plan, "plan-and-lens", False)
    for rank, seen in enumerate(results):
        first = seen["bad"]
        if rank == 1:
            assert first["kind"] == "ValueError" and first["s"] < FAST_S, (rank, seen)
        else:
            _assert_named(first, "ValueError: pass either plan or query_lens", (rank, seen))


def _bad_check_flag(group: dist.ProcessGroup, mode: str) -> dict:
    """Rank 1 passes ``check="yes"`` (not a bool); its peers run the step with the default check."""
    short = short_timeout_group(group, TIMEOUT_S)
    rt = _runtime(short, mode)
    extra = {"check": "yes"} if rt.rank == 1 else {}
    return _done(group, short, {"step": _outcome(_step(rt, mode, **extra))})


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["shardq", "dcp-decode"])
def test_a_check_flag_that_is_no_bool_on_one_rank_is_named_by_its_peers(dist_pool, nproc: int, mode: str) -> None:
    """The flag decides whether the agreement runs, so it cannot carry the error: rank 1 raises at
    once and reports it; its peers name it with its error when their collective times out (before:
    named as silent, no error)."""
    _needs_ranks(nproc)
    for rank, seen in enumerate(dist_pool.run(_bad_check_flag, mode)):
        step = seen["step"]
        if rank == 1:
            assert step["kind"] == "TypeError" and step["s"] < FAST_S, (rank, seen)
            assert step["msg"].startswith("check must be a bool"), (rank, seen)
        else:
            _assert_named(step, "TypeError: check must be a bool", (rank, seen))


def _lengths_differ(group: dist.ProcessGroup) -> dict:
    """Rank 1 passes the step's query lengths in another order (the same tokens in all)."""
    short = short_timeout_group(group, TIMEOUT_S)
    rt = _runtime(short, "shardq")
    lens = list(_prefill_step().query_lens)
    extra = {"query_lens": lens[::-1]} if rt.rank == 1 else {}
    return _done(group, short, {"step": _outcome(_step(rt, "shardq", **extra))})


@pytest.mark.distributed
def test_ranks_given_other_lengths_are_told_which_argument_differs(dist_pool, nproc: int) -> None:
    """Every rank raises at the agreement, naming the dissenting rank and the part that differs
    (before: two fingerprints, no argument)."""
    _needs_ranks(nproc)
    for rank, seen in enumerate(dist_pool.run(_lengths_differ)):
        step = seen["step"]
        assert step["kind"] == "ValueError" and step["s"] < FAST_S, (rank, seen)
        assert "rank(s) [1] disagree with rank(s)" in step["msg"], (rank, seen)
        assert " on the plan (query_lens, prefix_lens) (fingerprints" in step["msg"], (rank, seen)


# -- one rank in another step ---------------------------------------------------------------------------
def _decode_on_rank_1(group: dist.ProcessGroup) -> dict:
    short = short_timeout_group(group, TIMEOUT_S)
    rt = _runtime(short, "mixed")
    return _done(group, short, {"step": _outcome(_step(rt, "dcp-decode" if rt.rank == 1 else "shardq"))})


@pytest.mark.distributed
def test_a_rank_in_a_decode_step_while_its_peers_prefill_is_told_so(dist_pool, nproc: int) -> None:
    """An engine whose ranks' schedules diverge: rank 1 runs a DCP decode step while the others run a
    ShardQ prefill. Every rank raises at once (before: naming every part of its own step's inputs as
    differing, from q's shape to return_lse), saying the ranks run different steps."""
    _needs_ranks(nproc)
    for rank, seen in enumerate(dist_pool.run(_decode_on_rank_1)):
        step = seen["step"]
        assert step["kind"] == "ValueError" and step["s"] < FAST_S, (rank, seen)
        assert "rank(s) [1] run another step than rank(s) [0" in step["msg"], (rank, seen)
        assert "q's shape" not in step["msg"], (rank, seen)
