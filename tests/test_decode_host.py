"""Host work of the eager DCP GQA decode step on a reused plan: no host-device synchronisation,
the plan's device metadata reused, the block table read as it is for one query per request."""

from __future__ import annotations

import re
import sys
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from shardattn.plan import DCPLayout
from shardattn.plan import spec as P
from shardattn.plan.decode_batch import plan_decode_batch
from shardattn.runtime.runtime import Runtime

SPEC = P.ModelSpec("gqa", 8, 2, 16, 16, 0, 4, has_sinks=True, dtype="float32")

# Tensor methods that make the host wait for the stream when the tensor lives on a GPU.
SYNCING = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "nonzero"}
# Code that runs only on the CPU: value checks of CPU tensors (a GPU step skips them) and the
# torch reference kernels (a GPU step launches Triton kernels instead).
CPU_ONLY = {
    "_check_host_values",
    "_host_ints",
    "check_sink_logits",
    "gqa_paged_decode_reference",
    "lse_merge_reference",
    "merge_weights",
}


class HostReads(TorchFunctionMode):
    """Records, by call site, the tensor methods of :data:`SYNCING` that shardattn code calls
    outside :data:`CPU_ONLY` code on tensors other than ``host`` (a plan's own tensors, which
    live on the host by construction), and every torch function called (by name)."""

    def __init__(self, host: tuple[torch.Tensor, ...] = ()) -> None:
        super().__init__()
        self.reads: Counter[str] = Counter()
        self.called: Counter[str] = Counter()
        self.host = host

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        self.called[name] += 1
        if name in SYNCING and not (args and any(args[0] is t for t in self.host)):
            frame = sys._getframe(1)
            site = f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno} {name}"
            shardattn_code, cpu_only = "/shardattn/" in frame.f_code.co_filename, False
            while frame is not None:
                cpu_only |= frame.f_code.co_name in CPU_ONLY
                frame = frame.f_back
            if shardattn_code and not cpu_only:
                self.reads[site] += 1
        return func(*args, **(kwargs or {}))


def _inputs(rt: Runtime, q_lens: list[int], context: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    b, t = len(q_lens), sum(q_lens)
    seq = [context + n for n in q_lens]
    pages = -(-rt.layout.local_len(max(seq), 0) // SPEC.page_size)
    k = torch.randn(b * pages, SPEC.page_size, SPEC.num_kv_heads, SPEC.head_dim, generator=g)
    q = torch.randn(t, rt.heads_per_rank, SPEC.head_dim, generator=g)
    return _step_inputs(g, q, k, pages, seq, q_lens)


def _step_inputs(
    g: torch.Generator, q: torch.Tensor, k: torch.Tensor, pages: int, seq: list[int], q_lens: list[int]
) -> dict[str, Any]:
    """A DCP GQA step's inputs around this rank's ``q`` and K cache: V cache, shuffled
    ``[B, pages]`` block table and sinks drawn from ``g`` (in that order), host and int32 lengths."""
    b = len(q_lens)
    return {
        "q": q,
        "kv": (k, torch.randn(k.shape, generator=g)),
        "table": torch.randperm(b * pages, generator=g).view(b, pages).int(),
        "seq": seq,
        "seq_t": torch.tensor(seq, dtype=torch.int32),
        "cu": torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        "sinks": torch.randn(SPEC.num_heads, generator=g),
    }


def _reused_plan_steps(group: dist.ProcessGroup, q_lens: list[int]) -> dict[str, Any]:
    rt = Runtime(SPEC, group, max_batched_tokens=1, mode="dcp-decode", max_decode_tokens=64)
    x = _inputs(rt, q_lens, context=37, seed=5)
    plan = rt.decode_step.plan(x["seq"], x["cu"].tolist())
    args = (x["q"], x["kv"], x["table"], x["seq_t"])

    def step(check: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        return rt.decode(*args, batch=plan, sinks=x["sinks"], check=check)

    first = step()  # moves the plan's metadata to the device (once per plan)
    cached = plan.on_device[x["q"].device]
    host = (plan.meta, plan.seq_lens, plan.token_rows)
    with HostReads(host) as steps:
        again = [step() for _ in range(3)]
    with HostReads(host) as checked:  # the control: check=True agrees through the host
        step(check=True)
    today = rt.decode(*args, cu_q_lens=x["cu"], sinks=x["sinks"], check=False)  # device-indexed step
    return {
        "reads": dict(steps.reads),
        "gathers": steps.called["index_select"],
        "checked_reads": dict(checked.reads),
        "same_metadata": plan.on_device[x["q"].device] is cached and len(plan.on_device) == 1,
        "equal": all(torch.equal(a, b) for o in again for a, b in zip(o, first)),
        "equal_to_today": all(torch.equal(a, b) for a, b in zip(first, today)),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("q_lens", [[1] * 5, [1, 3, 2, 4]], ids=["one-query-each", "ragged-drafts"])
def test_reused_plan_step_issues_no_host_sync(dist_pool, nproc, q_lens):
    """No tensor is read back on the host (each read would be a device sync on a GPU) in a step
    on a reused plan, apart from CPU-only value checks and reference kernels; the control with
    ``check=True`` (an agreement through the host: its one read) is caught by the same counter."""
    world = min(nproc, 2)
    for res in dist_pool.run(_reused_plan_steps, q_lens, world_size=world):
        assert res["reads"] == {}, res["reads"]
        # the counter sees a real host read: check=True's agreement (one all-gather read on the host),
        # and only that: the plan's host fingerprint stands for the lengths (none read back)
        assert res["checked_reads"] and all(s.startswith("comm.py") for s in res["checked_reads"]), res
        assert sum(res["checked_reads"].values()) == 1, res["checked_reads"]
        assert res["same_metadata"] and res["equal"] and res["equal_to_today"]
        # one query per request: the block table is read as it is, no gather of its rows
        assert res["gathers"] == (0 if max(q_lens) == 1 else 3)


def test_plan_knows_when_rows_are_requests():
    assert plan_decode_batch([5, 6, 7], packed=True).rows_are_requests
    assert plan_decode_batch([5, 6, 7], padded_requests=4).rows_are_requests  # q_len 1 slots
    assert not plan_decode_batch([5, 6, 7], [0, 1, 3, 4], packed=True).rows_are_requests
    assert not plan_decode_batch([5, 6], None, q_len=2, padded_requests=4).rows_are_requests
    p = plan_decode_batch([9, 33, 2], [0, 1, 3, 4], layout=DCPLayout(2, 1), rank=1, packed=True)
    assert p.max_kv_len == int(p.meta[0].max()) == 16
    assert plan_decode_batch([], packed=True).max_kv_len == 0


def _bad_plan(group: dist.ProcessGroup, what: str) -> str:
    rt = Runtime(SPEC, group, max_batched_tokens=1, mode="dcp-decode", max_decode_tokens=64)
    x = _inputs(rt, [1, 1, 1], context=20, seed=3)
    seq = x["seq"] + [20] if what == "rows" else [s + 400 for s in x["seq"]]
    plan = rt.decode_step.plan(seq)
    try:  # the lengths passed are the plan's (else that is what raises: test_bad_input's rows)
        rt.decode(x["q"], x["kv"], x["table"], torch.tensor(seq, dtype=torch.int32), batch=plan, sinks=x["sinks"])
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.distributed
@pytest.mark.parametrize(
    "what,match",
    [("rows", r"^q must have the plan's 4 query rows"), ("lengths", r"^batch puts up to \d+ KV tokens")],
)
def test_plan_that_does_not_fit_the_inputs_raises_on_every_rank(dist_pool, nproc, what, match):
    for msg in dist_pool.run(_bad_plan, what, world_size=min(nproc, 2)):
        assert re.search(match, msg), msg


def _foreign_plan(group: dist.ProcessGroup, what: str) -> str:
    """A plan made for another shard or causality, used with a block table wider than the shard
    (an engine's fixed width, so no width check catches it): it gave wrong rows silently."""
    rt = Runtime(SPEC, group, max_batched_tokens=1, mode="dcp-decode", max_decode_tokens=64)
    x = _inputs(rt, [2, 3, 1], context=20, seed=4)
    seq, cu = x["seq"], x["cu"].tolist()
    kw = {
        "rank 0's plan": dict(layout=rt.layout, rank=0),
        "no layout": {},
        "other interleave": dict(layout=DCPLayout(rt.world_size, 2), rank=rt.rank),
        "other causality": dict(layout=rt.layout, rank=rt.rank, causal=False),
    }[what]
    plan = plan_decode_batch(seq, cu, packed=True, **kw)
    table = torch.cat([x["table"], torch.full((3, 8), -1, dtype=torch.int32)], 1)
    try:
        rt.decode(x["q"], x["kv"], table, seq, cu_q_lens=cu, batch=plan, sinks=x["sinks"])
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.distributed
@pytest.mark.parametrize("what", ["rank 0's plan", "no layout", "other interleave", "other causality"])
def test_a_plan_of_another_shard_or_causality_raises_on_every_rank(dist_pool, what):
    for rank, msg in enumerate(dist_pool.run(_foreign_plan, what, world_size=2)):
        if what == "rank 0's plan" and rank == 0:  # its own plan: it stops because rank 1 refused
            assert "rank(s) [1] of 2 rejected their inputs" in msg, msg
        else:
            assert re.search(r"^batch was planned for shard \(world_size, interleave, rank\)", msg), msg


def _padded_plan_and_bounds(group: dist.ProcessGroup) -> dict[str, Any]:
    """A padded plan (a graph bucket's layout) given with the requests' own ``seq_lens`` runs (its
    lengths replace them) and equals the unpadded step; ``max_q_len`` is checked under DCP too."""
    rt = Runtime(SPEC, group, max_batched_tokens=1, mode="dcp-decode", max_decode_tokens=64)
    x = _inputs(rt, [2, 3, 1], context=20, seed=5)
    seq, cu = x["seq"], x["cu"].tolist()
    want = rt.decode(x["q"], x["kv"], x["table"], seq, cu_q_lens=cu, sinks=x["sinks"])
    plan = rt.decode_step.plan(seq, cu, q_len=4, padded_requests=5)
    table = torch.cat([x["table"], torch.zeros(2, x["table"].shape[1], dtype=torch.int32)])
    out, lse = rt.decode(plan.pad_rows(x["q"]), x["kv"], table, seq, cu_q_lens=cu, batch=plan, sinks=x["sinks"])
    errors = {}
    for bound in (True, 2):  # not an int; fewer than the longest request's 3 queries
        try:
            rt.decode(x["q"], x["kv"], x["table"], seq, cu_q_lens=cu, max_q_len=bound, sinks=x["sinks"])
        except (TypeError, ValueError) as e:
            errors[str(bound)] = f"{type(e).__name__}: {e}"
    return {"same": torch.equal(plan.real_rows(out), want[0]) and torch.equal(plan.real_rows(lse), want[1]),
            "errors": errors}  # fmt: skip


@pytest.mark.distributed
def test_a_padded_plan_replaces_the_lengths_and_max_q_len_is_checked_under_dcp(dist_pool):
    for res in dist_pool.run(_padded_plan_and_bounds, world_size=2):
        assert res["same"], res
        assert res["errors"]["True"].startswith("TypeError: max_q_len must be an int"), res
        assert res["errors"]["2"].startswith("ValueError: max_q_len"), res


def _plans_differ(group: dist.ProcessGroup) -> str:
    rt = Runtime(SPEC, group, max_batched_tokens=1, mode="dcp-decode", max_decode_tokens=64)
    x = _inputs(rt, [1, 1, 1], context=20, seed=3)
    seq = [s + rt.rank for s in x["seq"]]  # same shapes, other lengths on rank 1 (each rank's own plan's)
    try:
        rt.decode(x["q"], x["kv"], x["table"], seq, batch=rt.decode_step.plan(seq), sinks=x["sinks"])
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.distributed
def test_check_agrees_on_the_plans_lengths(dist_pool, nproc):
    """With ``check=True`` the ranks agree on the plan's host fingerprint of the lengths: plans of
    other lengths (same shapes) raise on every rank, before any data collective."""
    if nproc < 2:
        pytest.skip("needs 2 ranks")
    for msg in dist_pool.run(_plans_differ, world_size=2):
        assert ": rank(s) [1] disagree with rank(s) [0] on seq_lens / cu_q_lens (" in msg, msg


@pytest.mark.parametrize("world,interleave", [(1, 1), (2, 1), (3, 4)])
def test_one_query_per_request_plan_equals_the_general_plan(world, interleave):
    """Plain decode (no ``qo_indptr``) takes a shorter path; it must give the general path's plan."""
    g = torch.Generator().manual_seed(world + interleave)
    layout = DCPLayout(world, interleave)
    for _ in range(6):
        b = int(torch.randint(1, 9, (1,), generator=g))
        seq = torch.randint(0, 70, (b,), generator=g).tolist()  # 0: a padded request
        for rank in range(world):
            for packed, slots, causal in ((True, None, True), (False, b + 3, True), (False, None, False)):
                kw = dict(layout=layout, rank=rank, padded_requests=slots, packed=packed, causal=causal)
                fast = plan_decode_batch(seq, **kw)
                general = plan_decode_batch(seq, list(range(b + 1)), **kw)
                for f in ("num_requests", "padded_requests", "q_len", "packed", "max_kv_len"):
                    assert getattr(fast, f) == getattr(general, f), f
                for f in ("token_rows", "meta", "seq_lens"):
                    a, c = getattr(fast, f), getattr(general, f)
                    assert a.dtype == c.dtype and torch.equal(a, c), f
                assert fast.slot_q_lens.tolist() == general.slot_q_lens.tolist() and fast.rows_are_requests


def test_graph_load_stages_host_inputs_through_two_pinned_twins():
    """The load of a graph bucket stages host inputs in a pinned twin of the arena (two, used in
    turn) and copies them in one span, then pads. On the CPU the runner has no host inputs, so
    the runner is told its device is elsewhere: every input then takes the staged path."""
    from shardattn.plan.cudagraph import CGSupport
    from shardattn.runtime.cudagraph import GraphInput, GraphRunner

    inputs = [
        GraphInput("q", (3,), torch.float32, per="token"),
        GraphInput("block_table", (2,), torch.int32, pad_value=-1),
        GraphInput("seq_lens", (), torch.int32),
    ]
    runner = GraphRunner(
        lambda **k: k, inputs, support=CGSupport.UNIFORM_BATCH, batch_sizes=[2, 4], q_len_per_req=2, device="cpu"
    )
    runner.device = torch.device("meta")  # inputs on the CPU are host inputs now
    g = torch.Generator().manual_seed(0)
    for batch in (4, 3, 1, 3, 2, 1):  # larger, then smaller batches: padding rows must be restored
        x = {
            "q": torch.randn(2 * batch, 3, generator=g),
            "block_table": torch.randint(0, 9, (batch, 2), generator=g, dtype=torch.int32),
            "seq_lens": torch.randint(1, 9, (batch,), generator=g, dtype=torch.int32),
        }
        padded = runner.load(batch, **x)
        got = runner.views(padded)
        assert torch.equal(got["q"][: 2 * batch], x["q"]) and got["q"][2 * batch :].eq(0).all()
        assert torch.equal(got["block_table"][:batch], x["block_table"]) and got["block_table"][batch:].eq(-1).all()
        assert torch.equal(got["seq_lens"][:batch], x["seq_lens"]) and got["seq_lens"][batch:].eq(0).all()
    assert len(runner._layouts) == 4  # the views of each (batch, bucket) were made once
    assert all(host == ("q", "block_table", "seq_lens") for _, _, host in runner._layouts)  # all staged


def _no_sync_on_gpu(group: dist.ProcessGroup, q_lens: list[int]) -> bool:
    device = torch.device("cuda", torch.cuda.current_device())
    rt = Runtime(SPEC, group, max_batched_tokens=1, mode="dcp-decode", max_decode_tokens=64, device=device)
    x = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in _inputs(rt, q_lens, 37, 5).items()}
    x["kv"] = tuple(t.to(device) for t in x["kv"])
    plan = rt.decode_step.plan(x["seq"], x["cu"].tolist())

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        return rt.decode(x["q"], x["kv"], x["table"], x["seq_t"], batch=plan, sinks=x["sinks"], check=False)

    first = step()  # the plan's one copy to the device
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising torch call raises
    try:
        again = [step() for _ in range(3)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return all(torch.equal(a, b) for o in again for a, b in zip(o, first))


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.parametrize("q_lens", [[1] * 5, [1, 3, 2, 4]], ids=["one-query-each", "ragged-drafts"])
def test_reused_plan_step_issues_no_sync_on_nccl(dist_pool, q_lens):
    """On GPUs: torch's sync debug mode raises on any synchronising call inside the steps."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    assert all(dist_pool.run(_no_sync_on_gpu, q_lens, world_size=2, backend="nccl"))


def _interpreted_rank(rank: int, init: str) -> None:
    """One of two gloo ranks under the Triton interpreter: the DCP GQA step on the Triton kernels
    (local attention and merge) with a plan's metadata, as a GPU runs it, against the reference."""
    from shardattn.ops.dispatch import use_triton
    from shardattn.parallel.comm import Comm
    from shardattn.parallel.dcp_gqa import dcp_gqa_decode

    assert use_triton(torch.zeros(1)), "the Triton interpreter is off"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        comm, layout = Comm(dist.group.WORLD), DCPLayout(2, 1)
        for q_lens in ([1] * 5, [1, 3, 2, 4]):
            x = _inputs_for(layout, rank, q_lens)
            plan = plan_decode_batch(x["seq"], x["cu"].tolist(), layout=layout, rank=rank, packed=True)
            args = (x["q"], *x["kv"], x["table"], x["seq_t"], layout, comm)
            kw = dict(sinks=x["sinks"], scale=0.25, check=False)
            lens, req = plan.meta[0], plan.meta[1]
            got = dcp_gqa_decode(*args, meta=(lens, None if plan.rows_are_requests else req), backend="triton", **kw)
            full = dcp_gqa_decode(*args, meta=plan.meta, backend="triton", **kw)
            ref = dcp_gqa_decode(*args, cu_q_lens=x["cu"], backend="reference", **kw)
            assert all(torch.equal(a, b) for a, b in zip(got, full)), q_lens
            torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(got[1], ref[1], atol=1e-5, rtol=0)
    finally:
        dist.destroy_process_group()


def _inputs_for(layout: DCPLayout, rank: int, q_lens: list[int]) -> dict[str, Any]:
    """Inputs of one rank of a two-rank DCP step (the same global lengths and q on every rank)."""
    g = torch.Generator().manual_seed(11)
    b, t, page = len(q_lens), sum(q_lens), SPEC.page_size
    seq = [29 + 7 * i + n for i, n in enumerate(q_lens)]
    pages = -(-layout.local_len(max(seq), rank) // page)
    k = torch.randn(b * pages + 1, page, SPEC.num_kv_heads, SPEC.head_dim, generator=g)
    q = torch.randn(t, SPEC.num_heads, SPEC.head_dim, generator=g)
    h = SPEC.num_heads // 2
    return _step_inputs(g, q[:, rank * h : (rank + 1) * h].contiguous(), k, pages, seq, q_lens)


def interpreted_dcp_step() -> None:
    """Run in a subprocess with TRITON_INTERPRET=1: two spawned gloo ranks (:func:`_interpreted_rank`)."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_interpreted_rank, args=(f"file://{d}/store",), nprocs=2, join=True)


@pytest.mark.interpret
def test_lean_step_on_triton_kernels_under_interpreter():
    """The GPU's code path of the step on a plan (Triton attention and merge, block table read as
    it is for one query per request) on two CPU ranks, under the Triton interpreter."""
    pytest.importorskip("triton", reason="the Triton kernels need triton")
    from shardattn.testing.interpret import run_interpreted

    run_interpreted(__name__, "interpreted_dcp_step")
