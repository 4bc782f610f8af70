"""The host plan of a decode batch (padding, metadata) and the lean DCP GQA step that uses it."""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import shardattn.parallel.collector as collector_mod
import shardattn.parallel.dcp_gqa as dcp_gqa_mod
from shardattn.parallel.comm import Comm
from shardattn.parallel.dcp_gqa import dcp_gqa_decode
from shardattn.plan import DCPLayout
from shardattn.plan.decode_batch import bucket_for, plan_decode_batch
from tests.test_dcp import GQA_CASES, _gqa_case


def _device_meta(seq_lens, q_lens, layout, rank, causal):
    """The step's own device-side computation (what the plan replaces)."""
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int64)
    t = int(cu[-1])
    lens = layout.causal_local_lens(torch.tensor(seq_lens), cu, t, rank, causal=causal)
    req = torch.searchsorted(cu[1:], torch.arange(t), right=True).clamp(max=len(seq_lens) - 1)
    return lens, req


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("world,interleave", [(1, 1), (2, 1), (3, 2), (4, 5)])
def test_packed_plan_equals_the_device_computation(world, interleave, causal):
    g = torch.Generator().manual_seed(world * 10 + interleave)
    for _ in range(5):
        b = int(torch.randint(1, 7, (1,), generator=g))
        q_lens = torch.randint(1, 5, (b,), generator=g).tolist()
        seq_lens = [q + int(torch.randint(0, 40, (1,), generator=g)) for q in q_lens]
        layout = DCPLayout(world, interleave)
        cu = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
        for rank in range(world):
            p = plan_decode_batch(seq_lens, cu, layout=layout, rank=rank, causal=causal, packed=True)
            lens, req = _device_meta(seq_lens, q_lens, layout, rank, causal)
            assert p.meta.dtype == torch.int32 and p.meta.shape == (2, sum(q_lens))
            assert p.meta[0].tolist() == lens.tolist() and p.meta[1].tolist() == req.tolist()
            assert p.token_rows.tolist() == list(range(sum(q_lens))) and p.identity_rows
            assert p.padding_queries == 0


def test_graph_layout_pads_ragged_requests_and_requests():
    layout = DCPLayout(2, 1)
    seq_lens, q_lens = [9, 5, 7], [1, 3, 2]
    cu = [0, 1, 4, 6]
    p = plan_decode_batch(seq_lens, cu, layout=layout, rank=1, q_len=4, padded_requests=5)
    assert (p.padded_requests, p.q_len, p.num_slots, p.num_tokens) == (5, 4, 20, 6)
    assert p.token_rows.tolist() == [0, 4, 5, 6, 8, 9]
    assert p.padding_queries == 14 and not p.identity_rows
    # the planner's analysis: ragged, two padded requests of length 0
    assert not p.query_lens.uniform and p.query_lens.num_padded == 2 and p.query_lens.max_q_len == 3
    assert p.meta[1].tolist() == [s // 4 for s in range(20)]
    lens, _ = _device_meta(seq_lens, q_lens, layout, 1, True)
    assert p.meta[0][p.token_rows].tolist() == lens.tolist()
    pad = torch.ones(20, dtype=torch.bool)
    pad[p.token_rows] = False
    assert p.meta[0][pad].eq(0).all()  # padding sees no key
    assert p.seq_lens.tolist() == [9, 5, 7, 0, 0]
    # pad_rows / real_rows round trip; padding never comes back
    x = torch.randn(6, 3)
    y = p.pad_rows(x)
    assert y.shape == (20, 3) and torch.equal(y[pad], torch.zeros(14, 3))
    assert torch.equal(p.real_rows(y), x)


def test_uniform_bucket_is_a_slice():
    p = plan_decode_batch([5, 6], None, q_len=2, padded_requests=4)
    assert p.identity_rows and p.token_rows.tolist() == [0, 1, 2, 3]
    assert p.query_lens.num_padded == 2
    y = torch.arange(8.0)
    assert p.real_rows(y).data_ptr() == y.data_ptr()  # a view: no gather


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(seq_lens=[5, 5], qo_indptr=[0, 1, 6], q_len=4), "more than q_len"),
        (dict(seq_lens=[5, 2], qo_indptr=[0, 1, 4]), "more queries than KV tokens"),
        (dict(seq_lens=[5, 5], padded_requests=1), "smaller than the batch"),
        (dict(seq_lens=[5, 5], qo_indptr=[0, 2, 1]), "non-decreasing"),
        # offsets of q's rows, as the ops' cu_q_lens: a first offset of 2 was read as rows 0 and 1
        (dict(seq_lens=[5, 5], qo_indptr=[2, 3, 4]), r"qo_indptr must start at 0"),
        (dict(seq_lens=[5, -1]), "seq_lens"),
        # past int64: the fast path cast them and named the wrapped value (-1, -2**63)
        (dict(seq_lens=np.array([2**64 - 1], dtype=np.uint64)), r"seq_lens\[0\] must be < 2\*\*63"),
        (dict(seq_lens=[2**63]), r"seq_lens\[0\] must be < 2\*\*63"),
    ],
)
def test_plan_rejects_bad_lengths(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_decode_batch(**kwargs)


def test_bucket_for():
    assert [bucket_for(n, (1, 2, 4, 8)) for n in (0, 1, 3, 8, 9)] == [1, 1, 4, 8, None]


# -------------------------------------------------------------------- the lean DCP GQA step
def _run_lean(group: dist.ProcessGroup, case: dict, q_len: int | None, slots: int | None) -> tuple:
    comm = Comm(group)
    h = case["q"].shape[1] // comm.world_size
    mine = case["local"][comm.rank]
    q = case["q"][: int(case["cu"][-1]), comm.rank * h : (comm.rank + 1) * h]
    graph = q_len is not None
    plan = plan_decode_batch(
        case["seq_lens"], case["cu"], layout=case["layout"], rank=comm.rank, causal=case["causal"],
        q_len=q_len, padded_requests=slots, packed=not graph,
    )  # fmt: skip
    table = mine["table"]
    if graph and slots > table.shape[0]:
        table = torch.cat([table, table.new_zeros(slots - table.shape[0], table.shape[1])])
    kw = dict(causal=case["causal"], sinks=case["sinks"], scale=case["scale"], check=False)
    out, lse = dcp_gqa_decode(
        plan.pad_rows(q) if graph else q, mine["k"], mine["v"], table, plan.seq_lens, case["layout"], comm,
        meta=plan.to("cpu"), **kw,
    )  # fmt: skip
    old = dcp_gqa_decode(
        q, mine["k"], mine["v"], mine["table"], case["seq_lens"], case["layout"], comm,
        cu_q_lens=case["cu"], **kw,
    )  # fmt: skip
    pad = torch.ones(out.shape[0], dtype=torch.bool)
    pad[plan.token_rows] = False
    return plan.real_rows(out), plan.real_rows(lse), old, out[pad], lse[pad]


@pytest.mark.distributed
@pytest.mark.parametrize("layout_kind", ["packed", "graph"])
@pytest.mark.parametrize("name", list(GQA_CASES))
def test_lean_step_equals_the_device_indexed_step(dist_pool, nproc, name, layout_kind):
    world = min(nproc, 2)
    case = _gqa_case(7, world=world, interleave=2, **GQA_CASES[name])
    q_lens = (case["cu"][1:] - case["cu"][:-1]).tolist()
    q_len, slots = (None, None) if layout_kind == "packed" else (max(4, max(q_lens)), len(q_lens) + 2)
    for out, lse, (old_out, old_lse), pad_out, pad_lse in dist_pool.run(
        _run_lean, case, q_len, slots, world_size=world
    ):
        assert torch.equal(out, old_out) and torch.equal(lse, old_lse)
        assert pad_out.eq(0).all() and pad_lse.eq(-math.inf).all()  # padding: the merge identity


class _OpCounter(TorchDispatchMode):
    """Counts aten ops that compute or move data (views, allocations and metadata excluded)."""

    FREE: ClassVar[set[str]] = {"view", "_unsafe_view", "permute", "reshape", "slice", "select", "expand", "alias", "t",
            "as_strided", "empty", "new_empty", "empty_strided", "detach", "unsqueeze", "squeeze",
            "transpose", "split", "unbind", "lift_fresh", "_to_copy_noop"}  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if not self.paused and name not in self.FREE:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _count_launches(group: dist.ProcessGroup, case: dict) -> list[str]:
    comm = Comm(group)
    h = case["q"].shape[1] // comm.world_size
    mine = case["local"][comm.rank]
    t = int(case["cu"][-1])
    plan = plan_decode_batch(
        case["seq_lens"],
        case["cu"],
        layout=case["layout"],
        rank=comm.rank,
        causal=case["causal"],
        packed=True,
    )
    meta = plan.to("cpu")
    counter = _OpCounter()

    def as_one_launch(name, fn):  # a kernel (its CPU reference runs many ops) counts as one launch
        def wrapped(*a, **k):
            counter.ops.append(name)
            counter.paused += 1
            try:
                return fn(*a, **k)
            finally:
                counter.paused -= 1

        return wrapped

    real_kernel, real_merge = dcp_gqa_mod.run_gqa_paged_decode, collector_mod.run_lse_merge
    dcp_gqa_mod.run_gqa_paged_decode = as_one_launch("KERNEL gqa_decode", real_kernel)
    collector_mod.run_lse_merge = as_one_launch("KERNEL lse_merge", real_merge)
    # input validation reads CPU tensors' values (ops that never run for CUDA inputs): not counted
    real_agree = comm.agree_on
    comm.agree_on = lambda what, validate, check=True: as_one_launch("", real_agree)(what, validate, check=check)
    try:
        with counter:
            dcp_gqa_decode(
                case["q"][:t, comm.rank * h : (comm.rank + 1) * h], mine["k"], mine["v"], mine["table"],
                case["seq_lens"], case["layout"], comm, causal=case["causal"], scale=case["scale"], meta=meta,
                check=False,
            )  # fmt: skip
    finally:
        dcp_gqa_mod.run_gqa_paged_decode, collector_mod.run_lse_merge = real_kernel, real_merge
    return [op for op in counter.ops if op]


@pytest.mark.distributed
def test_lean_step_issues_at_most_ten_launches(dist_pool, nproc):
    world = min(nproc, 2)
    case = _gqa_case(3, world=world, interleave=1, **GQA_CASES["ragged-drafts"])
    for ops in dist_pool.run(_count_launches, case, world_size=world):
        # all-gather of q, head-major copy, block-table rows, kernel, two packing copies,
        # all-to-all, merge (the metadata's host-to-device copy is the caller's one transfer)
        assert len(ops) <= 10, " ".join(ops)
        assert ops.count("copy_") <= 2 and "searchsorted" not in ops and "arange" not in ops
        assert ops.count("KERNEL gqa_decode") == 1 and ops.count("KERNEL lse_merge") == (1 if world > 1 else 0)


# --------------------------------------------------------------------------- decode workspace
def test_decode_workspace_is_what_the_step_exchanges():
    from shardattn.plan.spec import get_preset
    from shardattn.plan.workspace import workspace_bounds

    spec = get_preset("glm5")  # 64 heads, D 576, Dv 512, bf16
    wb = workspace_bounds(spec, max_batched_tokens=1024, world_size=8, mode="dcp-decode")
    m, h, hl = 1024, 64, 8  # the DCP group is the TP group by default: a rank holds 64 / 8 heads
    assert wb.out == m * h * 512 * 2  # bf16 partials over the shard, not fp32
    part = m * hl * 512 * 2 + m * hl * 4  # one rank's heads of a partial (out + LSE)
    # only the heads it returns, both ways; the merged result is the caller's tensor, not a workspace item
    assert wb.send == wb.recv == 8 * part
    assert wb.total <= 0.5e9, wb.total  # was 1.85 GB: fp32 partials of 8 x 64 heads
    assert wb.items == workspace_bounds(spec, max_batched_tokens=1024, world_size=8, mode="dcp-decode", tp_size=8).items


@pytest.mark.parametrize("padded", [None, 5], ids=["eager", "bucket"])
def test_one_query_per_request_plan_is_the_same_causal_or_not(padded):
    # one query a request (given by offsets, a request without queries among them): a query sees
    # all L_b tokens either way, so both causalities make one plan, equal fingerprints and no
    # causality a step could refuse it for
    seq_lens, indptr = [7, 3, 0, 12], [0, 1, 2, 2, 3]
    plans = [plan_decode_batch(seq_lens, indptr, padded_requests=padded, causal=c) for c in (True, False)]
    slots = 4 if padded is None else padded
    for plan in plans:
        assert plan.causal is None
        assert plan.token_rows.tolist() == [0, 1, 3]  # slot b's one row is b; the empty request's is padding
        assert plan.meta[0].tolist() == [7, 3, 0, 12] + [0] * (slots - 4)
    assert plans[0].fingerprint == plans[1].fingerprint
