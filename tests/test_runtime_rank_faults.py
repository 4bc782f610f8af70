"""Ranks of a Runtime that fail, as an engine meets them: every rank raises, in time, naming the rank.

Every rank of the pool builds its Runtime on a fresh gloo group whose collectives time out after
``TIMEOUT_S`` and rank 1 misbehaves: a bad query without ``check``, a kernel that raises mid-step
(after the step's agreement) or a ``KeyboardInterrupt`` there, a rank that never arrives, at a
step or at construction. The others must raise: at once where the step's agreement carries the
failure, else within the group's timeout plus the failure-report grace, naming rank 1 and its
exception. After a failure mid-step the group is unusable, and a step retried on it raises on
every rank in time rather than hang. Bad or different arguments that the agreement catches:
``tests/test_runtime_rank_arguments.py``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from shardattn.errors import PeerFailedError
from shardattn.launch.workloads import build_decode
from shardattn.ops.topk import DcpShard
from shardattn.parallel.peer_failures import REPORT_GRACE_S
from shardattn.runtime.options import PrefillOptions
from shardattn.runtime.runtime import Runtime
from tests.parallel_helpers import short_timeout_group
from tests.test_runtime import CPU, MLA, _heads, _prefill_step, _token_rows

#: The fault group's collective timeout (seconds): how long a peer left waiting blocks.
TIMEOUT_S = 2.0
#: What a peer may take where the agreement carries the failure (no timeout involved).
FAST_S = 1.0
#: What a peer may take where it must wait for the timeout: the timeout, the report grace, host noise.
LATE_S = TIMEOUT_S + REPORT_GRACE_S + 2.0


def _outcome(run: Callable[[], object]) -> dict:
    """What ``run()`` did: ``kind`` ("ok" or the exception's type), ``msg``, ``raised`` / ``silent`` of a
    PeerFailedError, the result, and ``s`` (seconds)."""
    start = time.monotonic()
    seen: dict = {"kind": "ok", "msg": "", "result": None}
    try:
        seen["result"] = run()
    except BaseException as e:  # a KeyboardInterrupt of a rank is an outcome here
        seen.update(kind=type(e).__name__, msg=str(e))
        if isinstance(e, PeerFailedError):
            seen.update(raised=e.raised, silent=e.silent)
    seen["s"] = time.monotonic() - start
    return seen


def _runtime(group: dist.ProcessGroup, mode: str, **kwargs) -> Runtime:
    options = PrefillOptions(min_shard_tokens=1)  # every step sharded (ShardQ)
    return Runtime(MLA, group, mode=mode, max_batched_tokens=128, prefill_options=options, **kwargs)


def _step(rt: Runtime, mode: str, *, q_dtype: torch.dtype = torch.float32, **extra) -> Callable[[], object]:
    """One step of ``mode`` on ``rt`` (ShardQ or PCP prefill, DCP decode), its ``out`` returned."""
    rank, world = rt.rank, rt.world_size
    if mode == "dcp-decode":
        s = build_decode(
            heads=MLA.num_heads, head_dim=MLA.head_dim, requests=2, cached=(37, 5), q_lens=(1, 1), topk=MLA.topk,
            overlap="random", causal=True, dtype=torch.float32, device=CPU, seed=3, shard=DcpShard(world, 1, rank),
            block_size=MLA.page_size,
        )  # fmt: skip
        q = _heads(s.q, rank, world).contiguous().to(q_dtype)
        return lambda: rt.decode(
            q, s.local_kv, s.local_table, s.seq_lens, topk_pos=s.positions, req_ids=s.req_ids, **extra
        )[0]
    step = _prefill_step()
    if mode == "pcp":
        plan = rt.plan_prefill(step.query_lens, step.prefix_lens, kv_rows=int(step.kv.shape[0]))
        mine = plan.tokens_of(rank)
        own = _token_rows(step).index_select(0, mine)
        return lambda: rt.prefill(
            step.q[mine].to(q_dtype), step.kv, topk_pos=step.positions[mine], kv_new=step.kv[own],
            block_table=step.block_table, plan=plan, **extra,
        )[0]  # fmt: skip
    q = _heads(step.q, rank, world).contiguous().to(q_dtype)
    lens = {"query_lens": step.query_lens, "prefix_lens": step.prefix_lens}
    return lambda: rt.prefill(q, step.kv, step.rows, **(extra if "plan" in extra else {**lens, **extra}))[0]


def _failing_kernel(mode: str, error: BaseException):
    """The step's kernel call (after its agreement) raising ``error`` on this rank."""

    def fail(*args, **kwargs):
        raise error

    if mode == "dcp-decode":  # the rank's rows of its shard, converted after the query all-gather
        return mock.patch("shardattn.parallel.dcp.convert_topk", fail)
    return mock.patch("shardattn.runtime.steps.workspace_prefill_attention", fail)


def _done(group: dist.ProcessGroup, short: dist.ProcessGroup, result: dict) -> dict:
    """Keep every rank's end of ``short`` open until all are done (a peer waiting on a rank must
    not learn of its failure from a closed connection), then return ``result``."""
    dist.barrier(group=group)
    dist.destroy_process_group(short)
    result.pop("result", None)
    for seen in result.values():
        if isinstance(seen, dict):
            seen.pop("result", None)
    return result


def _needs_ranks(nproc: int) -> None:
    if nproc < 2 or MLA.num_heads % nproc:
        pytest.skip(f"needs 2 or more ranks that divide the spec's {MLA.num_heads} heads")


def _assert_named(seen: dict, raised: str, where: object) -> None:
    """``seen`` is a PeerFailedError, within ``LATE_S``, that names rank 1 as raising ``raised``."""
    assert seen["kind"] == PeerFailedError.__name__, where
    assert list(seen["raised"]) == [1] and seen["raised"][1].startswith(raised), where
    assert seen["s"] < LATE_S, where


# -- a kernel that raises on one rank mid-step ------------------------------------------------------
def _mid_step(group: dist.ProcessGroup, mode: str, then: str) -> dict:
    """Rank 1's kernel raises after the step's agreement; then rank 1 goes on at once: it retries the
    step (``"retry"``, every rank does once it raised), or runs its next step with a bad query and
    ``check=False`` (``"next-unchecked"``, reported at once)."""
    short = short_timeout_group(group, TIMEOUT_S)
    rt = _runtime(short, mode)
    seen = {}
    with contextlib.ExitStack() as stack:
        if rt.rank == 1:
            stack.enter_context(_failing_kernel(mode, RuntimeError(f"injected kernel failure in a {mode} step")))
        seen["step"] = _outcome(_step(rt, mode))
    if then == "retry":
        seen["retry"] = _outcome(_step(rt, mode))
    elif rt.rank == 1:
        seen["next"] = _outcome(_step(rt, mode, q_dtype=torch.float64, check=False))
    return _done(group, short, seen)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("mode", "then"), [("shardq", "retry"), ("shardq", "next-unchecked"), ("dcp-decode", "next-unchecked")]
)
def test_a_kernel_failing_mid_step_is_named_by_every_peer(dist_pool, nproc: int, mode: str, then: str) -> None:
    """Rank 1 moving on before its peers time out must not hide its report from them (before: its
    next step's report, or its retry's "alive", overwrote it, and they named rank 1 silent)."""
    _needs_ranks(nproc)
    results = dist_pool.run(_mid_step, mode, then)
    assert results[1]["step"]["kind"] == "RuntimeError", results[1]
    for rank, seen in enumerate(results):
        if rank != 1:
            _assert_named(seen["step"], "RuntimeError: injected kernel failure", (rank, seen))
    if then == "retry":  # the group is out of step: every rank's retry raises, in time (none hangs)
        for rank, seen in enumerate(results):
            assert seen["retry"]["kind"] == PeerFailedError.__name__ and seen["retry"]["s"] < LATE_S, (rank, seen)
    else:
        assert results[1]["next"]["kind"] == "TypeError", results[1]


def _pcp_kernel_fails(group: dist.ProcessGroup) -> dict:
    short = short_timeout_group(group, TIMEOUT_S)
    rt = _runtime(short, "pcp")
    before = _step(rt, "pcp")()
    with contextlib.ExitStack() as stack:
        if rt.rank == 1:
            stack.enter_context(_failing_kernel("pcp", RuntimeError("injected kernel failure")))
        seen = {"step": _outcome(_step(rt, "pcp"))}
    seen["next"] = _outcome(_step(rt, "pcp"))
    seen["next"]["same"] = seen["next"]["result"] is not None and torch.equal(seen["next"]["result"], before)
    return _done(group, short, seen)


@pytest.mark.distributed
def test_a_pcp_kernel_failing_after_the_gather_leaves_the_peers_done(dist_pool, nproc: int) -> None:
    """A PCP step (its outputs not gathered) has no collective after the kernel: nobody waits for
    rank 1, and the group stays in step (the next step gives the same bits on every rank)."""
    _needs_ranks(nproc)
    results = dist_pool.run(_pcp_kernel_fails)
    for rank, seen in enumerate(results):
        want = "RuntimeError" if rank == 1 else "ok"
        assert seen["step"]["kind"] == want and seen["step"]["s"] < FAST_S, (rank, seen)
        assert seen["next"]["kind"] == "ok" and seen["next"]["same"], (rank, seen)


def _unchecked_bad_query(group: dist.ProcessGroup, mode: str) -> dict:
    short = short_timeout_group(group, TIMEOUT_S)
    rt = _runtime(short, mode)
    run = _step(rt, mode, q_dtype=torch.float64 if rt.rank == 1 else torch.float32, check=False)
    return _done(group, short, {"step": _outcome(run)})


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["shardq", "dcp-decode"])
def test_a_bad_argument_without_check_is_named_by_the_waiting_peers(dist_pool, nproc: int, mode: str) -> None:
    """``check=False`` (documented): the bad rank raises at once and reports it; the peers wait in the
    step's first collective until the timeout, then name it with its error."""
    _needs_ranks(nproc)
    results = dist_pool.run(_unchecked_bad_query, mode)
    assert results[1]["step"]["kind"] == "TypeError" and results[1]["step"]["s"] < FAST_S, results[1]
    for rank, seen in enumerate(results):
        if rank != 1:
            _assert_named(seen["step"], "TypeError: q", (rank, seen))


def _interrupted(group: dist.ProcessGroup) -> dict:
    short = short_timeout_group(group, TIMEOUT_S)
    rt = _runtime(short, "shardq")
    with contextlib.ExitStack() as stack:
        if rt.rank == 1:
            stack.enter_context(_failing_kernel("shardq", KeyboardInterrupt("injected")))
        seen = {"step": _outcome(_step(rt, "shardq"))}
    return _done(group, short, seen)


@pytest.mark.distributed
def test_a_keyboard_interrupt_mid_step_makes_the_peers_raise_in_time(dist_pool, nproc: int) -> None:
    """A ``KeyboardInterrupt`` leaves its rank at once, reported to the group's store on the way
    (as at construction): the peers name rank 1 and the interrupt once their collective timed out."""
    _needs_ranks(nproc)
    results = dist_pool.run(_interrupted)
    assert results[1]["step"]["kind"] == "KeyboardInterrupt", results[1]
    for rank, seen in enumerate(results):
        if rank != 1:
            step = seen["step"]
            assert step["kind"] == PeerFailedError.__name__, (rank, seen)
            assert step["raised"] == {1: "KeyboardInterrupt: injected"} and step["s"] < LATE_S, (rank, seen)
            assert f"rank 1 of {nproc} raised KeyboardInterrupt: injected" in step["msg"], (rank, seen)


# -- a rank that never arrives ----------------------------------------------------------------------
def _absent(group: dist.ProcessGroup, where: str) -> dict:
    """Rank 1 stalls past its peers' timeout and grace before the step (or the construction)."""
    short = short_timeout_group(group, TIMEOUT_S)
    stall = TIMEOUT_S + REPORT_GRACE_S + 1.0
    if where == "construction":
        if dist.get_rank(short) == 1:
            time.sleep(stall)
            return _done(group, short, {})
        return _done(group, short, {"seen": _outcome(lambda: _runtime(short, "shardq", warmup=False))})
    rt = _runtime(short, "shardq")
    run = _step(rt, "shardq")
    if rt.rank == 1:
        time.sleep(stall)
        return _done(group, short, {})
    return _done(group, short, {"seen": _outcome(run)})


@pytest.mark.distributed
@pytest.mark.parametrize("where", ["step", "construction"])
def test_a_rank_that_never_arrives_is_named_at_the_timeout(dist_pool, nproc: int, where: str) -> None:
    _needs_ranks(nproc)
    for rank, seen in enumerate(dist_pool.run(_absent, where)):
        if rank != 1:
            got = seen["seen"]
            assert got["kind"] == PeerFailedError.__name__, (rank, seen)
            assert got["raised"] == {} and 1 in got["silent"] and got["s"] < LATE_S, (rank, seen)


# -- construction -----------------------------------------------------------------------------------
def _construction(group: dist.ProcessGroup, fault: str) -> dict:
    """Rank 1's construction fails (``host_id`` of the wrong type, in the host exchange; or a
    KeyboardInterrupt in its warm-up); after the first, a second Runtime on the group runs a step."""
    short = short_timeout_group(group, TIMEOUT_S)
    rank = dist.get_rank(short)
    kwargs: dict = {"warmup": False}
    with contextlib.ExitStack() as stack:
        if rank == 1 and fault == "host-id":
            kwargs["host_id"] = 7
        elif rank == 1:
            kwargs["warmup"] = True
            stack.enter_context(mock.patch.object(Runtime, "warmup", side_effect=KeyboardInterrupt("injected")))
        seen = {"build": _outcome(lambda: _runtime(short, "shardq", **kwargs))}
    if fault == "host-id":
        rt = _runtime(short, "shardq", warmup=False)
        seen["step"] = _outcome(_step(rt, "shardq"))
    return _done(group, short, seen)


@pytest.mark.distributed
@pytest.mark.parametrize("fault", ["host-id", "interrupt"])
def test_a_failed_construction_on_one_rank(dist_pool, nproc: int, fault: str) -> None:
    _needs_ranks(nproc)
    results = dist_pool.run(_construction, fault)
    own = "TypeError" if fault == "host-id" else "KeyboardInterrupt"
    assert results[1]["build"]["kind"] == own, results[1]
    for rank, seen in enumerate(results):
        if rank == 1:
            continue
        build = seen["build"]
        assert build["kind"] == PeerFailedError.__name__, (rank, seen)
        if fault == "host-id":  # carried by the host exchange's gather: at once, with the error
            want = f"Runtime construction on rank {rank} failed because rank 1 of {nproc} raised TypeError: host_id"
            assert build["msg"].startswith(want) and build["s"] < FAST_S, (rank, seen)
        else:  # not carried by the gather (rank 1 left at once): named from its report at the timeout
            assert build["raised"] == {1: "KeyboardInterrupt: injected"} and build["s"] < LATE_S, (rank, seen)
    if fault == "host-id":  # every rank left the failed construction in step: the next Runtime works
        assert all(seen["step"]["kind"] == "ok" for seen in results), results


# -- two Runtimes on one group ----------------------------------------------------------------------
def _two_runtimes(group: dist.ProcessGroup) -> dict:
    """Runtimes A and B of one config on one group: A's step fails its agreement (rank 1's bad
    query), then B's and A's steps run, equal bit for bit."""
    short = short_timeout_group(group, TIMEOUT_S)
    a, b = _runtime(short, "shardq"), _runtime(short, "shardq", warmup=False)
    bad = _step(a, "shardq", q_dtype=torch.float64 if a.rank == 1 else torch.float32)
    seen = {"a-bad": _outcome(bad), "b": _outcome(_step(b, "shardq")), "a": _outcome(_step(a, "shardq"))}
    seen["same"] = seen["a"]["result"] is not None and torch.equal(seen["a"]["result"], seen["b"]["result"])
    return _done(group, short, seen)


@pytest.mark.distributed
def test_two_runtimes_on_one_group_stay_in_step_after_one_fails_its_agreement(dist_pool, nproc: int) -> None:
    _needs_ranks(nproc)
    for rank, seen in enumerate(dist_pool.run(_two_runtimes)):
        assert seen["a-bad"]["kind"] == ("TypeError" if rank == 1 else "ValueError"), (rank, seen)
        assert seen["b"]["kind"] == "ok" and seen["a"]["kind"] == "ok" and seen["same"], (rank, seen)
