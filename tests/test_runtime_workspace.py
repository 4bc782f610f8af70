"""The Runtime's workspace arena: prefill and decode share its bytes, and no step depends on what
another left there.

Every step below runs on an arena first filled with random bytes (what a prefill, or another
layer's decode, leaves behind), and must equal the fp64 oracle; a decode step run again after a
prefill gives the same bits as before it. The reservation of GLM-5 at eight ranks with
16,384 batched and 1,024 decode tokens is checked from the planner alone.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging

import pytest
import torch
import torch.distributed as dist

from shardattn.errors import WorkspaceExceededError
from shardattn.launch.gqa_workloads import build_gqa_decode
from shardattn.launch.workloads import build_decode
from shardattn.ops.topk import DcpShard
from shardattn.plan.routing import Route
from shardattn.plan.spec import ModelSpec, get_preset
from shardattn.plan.workspace import workspace_bounds
from shardattn.plan.zigzag import zigzag_split
from shardattn.runtime.graphs import DecodeGraphs
from shardattn.runtime.options import PrefillOptions
from shardattn.runtime.runtime import PrefillPlan, Runtime
from shardattn.runtime.workspace import RuntimeWorkspace
from tests.test_runtime import GQA as GQA_FP32
from tests.test_runtime import (
    GQA_SCALE,
    MLA,
    MLA_SCALE,
    _err,
    _gqa_oracle,
    _gqa_step,
    _heads,
    _kv_lens,
    _mla_oracle,
    _prefill_step,
    _workspace_errors,
)

CPU = torch.device("cpu")
GQA = ModelSpec("gqa", 8, 2, 16, 16, 0, 16, dtype="float32")


@pytest.mark.parametrize("cost_routed", [False, True], ids=["gate-only", "cost-routed"])
def test_glm5_at_world_size_8_reserves_at_most_half_a_gigabyte(cost_routed: bool) -> None:
    # a cost-routed Runtime (a GPU with a calibration table) may run head-TP steps up to the whole
    # 16,384 tokens, whose union is the largest single item; the bytes come from the planner alone
    ws = RuntimeWorkspace(
        get_preset("glm5"), "mixed", 8, device=torch.device("meta"), max_batched_tokens=16384,
        max_decode_tokens=1024, min_shard_tokens=1024, topk=2048, headtp_tokens=16384 if cost_routed else None,
    )  # fmt: skip
    prefill, decode = ws.kind_bytes("prefill"), ws.kind_bytes("decode")
    assert ws.nbytes == max(prefill, decode) <= 0.5e9, (prefill, decode)
    assert ws.nbytes < prefill + decode  # shared, not summed
    dcp = workspace_bounds(get_preset("glm5"), max_batched_tokens=1024, world_size=8, mode="dcp-decode")
    assert {k: v for k, v in ws.bounds.items() if k.startswith("decode.")} == {
        f"decode.{k}": v for k, v in dcp.items.items() if v
    }
    shardq = workspace_bounds(get_preset("glm5"), max_batched_tokens=16384, world_size=8, mode="shardq")
    for item in ("packed_q", "out", "lse", "topk_rows"):
        assert ws.bounds[f"prefill.{item}"] == getattr(shardq, item)
    headtp = workspace_bounds(get_preset("glm5"), max_batched_tokens=16384, world_size=8, mode="headtp")
    assert ws.bounds["prefill.union"] == max(shardq.union, headtp.union if cost_routed else 0)


def _poison(rt: Runtime, seed: int) -> None:
    """Random bytes over the whole arena: NaNs, huge values and out-of-range rows alike."""
    arena = rt.ws.arena
    arena.copy_(torch.randint(0, 256, arena.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8))


def _overlaps(t: torch.Tensor, others: list[torch.Tensor]) -> bool:
    """``t`` shares bytes with one of ``others``."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel()
    return any(o.data_ptr() < hi and lo < o.data_ptr() + o.numel() for o in others)


def _spy_decode(rt: Runtime, q_all: torch.Tensor) -> dict:
    """Record, on the next decode step, where the kernel reads q and rows and writes its partial, and
    where the collector's all-to-all sends from and receives into (``True`` = inside the arena)."""
    import shardattn.ops.sparse_mla_decode as decode_op

    lo = rt.ws.arena.data_ptr()
    hi = lo + rt.ws.arena.numel()
    seen: dict = {}
    kernel, all_to_all = decode_op.run_sparse_mla_decode, rt.comm.all_to_all

    def in_arena(t: torch.Tensor) -> bool:
        return lo <= t.data_ptr() < hi

    def disjoint(*ts: torch.Tensor) -> bool:  # what one phase reads and writes never shares bytes
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in ts)
        return all(a[1] <= b[0] for a, b in itertools.pairwise(spans))

    def kernel_spy(q, kv, rows, **kw):
        decode_op.run_sparse_mla_decode = kernel
        seen["kernel"] = [in_arena(x) for x in (q, rows, kw["out"], kw["lse_out"])]
        seen["kernel_disjoint"] = disjoint(q, rows, kw["out"], kw["lse_out"])
        seen["partial"] = (kw["out"], kw["lse_out"])
        seen["q_gathered"] = torch.equal(q, q_all)  # every rank's heads, head-major
        return kernel(q, kv, rows, **kw)

    def all_to_all_spy(x, send, recv, *, out=None):
        del rt.comm.all_to_all
        seen["all_to_all"] = [in_arena(x), out is not None and in_arena(out)]
        # packing read the partial and wrote x; the exchange reads x and writes out
        seen["pack_disjoint"] = disjoint(x, *seen.pop("partial"))
        seen["exchange_disjoint"] = out is not None and disjoint(x, out)
        return all_to_all(x, send, recv, out=out)

    decode_op.run_sparse_mla_decode = kernel_spy
    rt.comm.all_to_all = all_to_all_spy
    return seen


def _arena_body(group) -> dict:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    rt = Runtime(
        MLA,
        group,
        max_batched_tokens=64,
        mode="mixed",
        prefill_options=PrefillOptions(min_shard_tokens=63),
        max_decode_tokens=8,
        warmup=False,
    )
    ws = rt.workspace
    res: dict = {
        "arena": (rt.workspace_bytes, rt.ws.kind_bytes("prefill"), rt.ws.kind_bytes("decode")),
        "overlap": _overlaps(ws["decode.packed_q"], [v for k, v in ws.items() if k.startswith("prefill.")]),
    }
    # decode: DCP over the rank's shard of the cache
    s = build_decode(
        heads=MLA.num_heads, head_dim=MLA.head_dim, requests=3, cached=(37, 0, 70), q_lens=(1, 2, 1), topk=MLA.topk,
        overlap="random", causal=True, dtype=torch.float32, device=CPU, seed=3, shard=DcpShard(world, 1, rank),
        block_size=MLA.page_size,
    )  # fmt: skip
    q_dec = _heads(s.q, rank, world).contiguous()

    def decode() -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = rt.decode(q_dec, s.local_kv, s.local_table, s.seq_lens, topk_pos=s.positions, req_ids=s.req_ids)
        assert lse is not None
        return out, lse

    ref = _mla_oracle(s, MLA_SCALE, s.seq_lens)
    _poison(rt, 1)
    seen = _spy_decode(rt, s.q)
    d1 = decode()
    packed_after_decode = ws["decode.packed_q"].clone()
    res["decode_in_arena"] = seen  # every buffer the kernel and the collector touched, and q gathered there
    res["decode_err"] = max(_err(d1[0], _heads(ref[0], rank, world)), _err(d1[1], _heads(ref[1], rank, world)))

    # prefill between the two decode steps: ShardQ and head-TP, both on the grouped route (the
    # union in the arena), as a GPU runs them; the CPU runs the grouped path's torch form
    step = _prefill_step()
    q_pre = _heads(step.q, rank, world).contiguous()
    ref_out, ref_lse = _mla_oracle(step, MLA_SCALE, _kv_lens(step))
    t_pre = sum(step.query_lens)
    split = zigzag_split(step.query_lens, world, align=2, min_tokens=0, prefix_lens=step.prefix_lens)
    plans = {
        "shardq": PrefillPlan("shardq", Route("grouped", 2, "as on a GPU"), split, t_pre),
        "headtp": PrefillPlan("headtp", Route("grouped", 2, "as on a GPU"), None, t_pre),
    }
    for seed, (name, plan) in enumerate(plans.items(), start=2):
        _poison(rt, seed)
        out, lse = rt.prefill(q_pre, step.kv, step.rows, plan=plan)
        res[f"{name}_err"] = max(_err(out, _heads(ref_out, rank, world)), _err(lse, _heads(ref_lse, rank, world)))
        if name == "shardq":  # the rank's rows were gathered into the arena
            mine = step.rows.index_select(0, split.token_ids(rank))
            carved = ws["prefill.topk_rows"][: mine.numel() * 4].view(torch.int32).view(mine.shape)
            res["rows_in_arena"] = torch.equal(carved, mine)
    res["prefill_overwrote_decode"] = not torch.equal(ws["decode.packed_q"], packed_after_decode)
    d2 = decode()
    res["decode_same_bits"] = torch.equal(d1[0], d2[0]) and torch.equal(d1[1], d2[1])

    errors = _workspace_errors(
        {
            "decode-topk": lambda: rt.check_workspace("decode", "dcp", tokens=8, topk=MLA.topk + 1),
            "decode-wide-rows": lambda: rt.decode(
                q_dec,
                s.local_kv,
                s.local_table,
                s.seq_lens,
                topk_pos=torch.cat([s.positions] * 3, 1),
                req_ids=s.req_ids,
            ),
        }
    )
    res["errors"] = errors
    return res


@pytest.mark.distributed
def test_prefill_and_decode_share_the_arena_and_need_nothing_left_in_it(dist_pool, nproc: int) -> None:
    if nproc < 2:
        pytest.skip("needs 2 ranks; run with --nproc 2 or more")
    for res in dist_pool.run(_arena_body, world_size=2):
        total, prefill, decode = res["arena"]
        assert total == max(prefill, decode) < prefill + decode and res["overlap"], res["arena"]
        seen = res["decode_in_arena"]
        assert seen == {
            "kernel": [True] * 4, "q_gathered": True, "all_to_all": [True, True],
            "kernel_disjoint": True, "pack_disjoint": True, "exchange_disjoint": True,
        }, seen  # fmt: skip
        assert res["rows_in_arena"], res
        for key in ("decode_err", "shardq_err", "headtp_err"):
            assert res[key] <= 1e-5, (key, res[key])
        assert res["prefill_overwrote_decode"]  # the prefill really used the decode's bytes...
        assert res["decode_same_bits"]  # ...and the decode after it is bit for bit the one before
        errors = res["errors"]
        assert errors["decode-topk"].startswith(f"a decode step's top-k width {MLA.topk + 1} exceeds topk="), errors
        assert errors["decode-wide-rows"].startswith(f"a decode step's top-k width {3 * MLA.topk} exceeds"), errors


def _graphs_body(group) -> dict:
    """The DCP GQA graph-bucket step (eager on the CPU, on the graphs' static buffers) with the
    arena scribbled over between two steps, as a prefill of another Runtime layer would."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    rt = Runtime(GQA, group, max_batched_tokens=1, mode="dcp-decode", max_decode_tokens=16, warmup=False)
    g = build_gqa_decode(
        q_heads=GQA.num_heads, kv_heads=GQA.num_kv_heads, head_dim=GQA.head_dim, sinks=False, requests=3,
        cached=(37, 0, 70), q_lens=(1, 2, 1), dtype=torch.float32, device=CPU, seed=5,
        shard=DcpShard(world, 1, rank), block_size=GQA.page_size,
    )  # fmt: skip
    graphs = DecodeGraphs(
        rt, (g.local_k_cache, g.local_v_cache), batch_sizes=[4], q_len=2,
        max_pages=g.local_block_table.shape[1], capture=False,
    )  # fmt: skip
    q = _heads(g.q, rank, world).contiguous()
    seq, cu = g.seq_lens.tolist(), g.cu_q_lens.tolist()
    outs = []
    for seed in (7, 8):
        _poison(rt, seed)
        outs.append(tuple(x.clone() for x in graphs(q, g.local_block_table, seq, cu)))
    plain = rt.decode(q, (g.local_k_cache, g.local_v_cache), g.local_block_table, g.seq_lens, cu_q_lens=g.cu_q_lens)
    return {
        "route": graphs.last_route[0],
        "same": all(torch.equal(a, b) for a, b in zip(*outs)),
        "err": max(_err(outs[0][0], plain[0]), _err(outs[0][1], plain[1])),
    }


@pytest.mark.distributed
def test_graph_bucket_step_needs_nothing_left_in_the_arena(dist_pool, nproc: int) -> None:
    if nproc < 2:
        pytest.skip("needs 2 ranks; run with --nproc 2 or more")
    for res in dist_pool.run(_graphs_body, world_size=2):
        assert res["route"] == 4 and res["same"], res
        assert res["err"] <= 1e-5, res


@pytest.mark.parametrize(
    ("mode", "world", "min_shard_tokens"),
    [("mixed", 1, 1024), ("shardq", 1, 1), ("shardq", 4, 16385)],
    ids=["one-rank-mixed", "one-rank-gate-1", "gate-above-every-step"],
)
def test_shardq_mode_that_never_shards_reserves_head_tp_alone(mode: str, world: int, min_shard_tokens: int) -> None:
    """``torchrun --nproc-per-node 1 -m shardattn.launch`` on a GPU: one rank never takes a ShardQ
    step (nothing to shard), so its arena holds the head-TP step's union (67 MB for GLM-5 at 8,192
    tokens), not ShardQ's query and output buffers (1.28 GB)."""
    spec = get_preset("glm5")
    ws = RuntimeWorkspace(
        spec, mode, world, device=torch.device("meta"), max_batched_tokens=16384 if world > 1 else 8192,
        max_decode_tokens=64, min_shard_tokens=min_shard_tokens, topk=2048, headtp_tokens=None,
    )  # fmt: skip
    assert not ws.shardq_possible
    assert [s for k, s in ws.step_bounds if k == "prefill"] == ["headtp"], list(ws.step_bounds)
    tokens = ws.max_batched_tokens
    headtp = workspace_bounds(spec, max_batched_tokens=tokens, world_size=world, mode="headtp", topk=2048)
    assert {k: v for k, v in ws.bounds.items() if k.startswith("prefill.")} == {
        "prefill.union": headtp.union,
        "prefill.union_offsets": headtp.union_offsets,
    }
    assert ws.kind_bytes("prefill") < headtp.union + headtp.union_offsets + 1024
    if world == 1:
        assert ws.nbytes < 0.07e9, ws.nbytes  # 8,192 x 2,048 x 4 B of union, plus its offsets


def test_pcp_reserves_only_the_union_it_carves() -> None:
    """The PCP step takes only its union from the arena (its KV gather and outputs are per step),
    so the arena holds no PCP send, receive or output bytes."""
    ws = RuntimeWorkspace(
        get_preset("glm5"), "pcp", 2, device=torch.device("meta"), max_batched_tokens=8192,
        max_decode_tokens=64, min_shard_tokens=1024, topk=2048,
    )  # fmt: skip
    assert sorted(k for k in ws.bounds if k.startswith("prefill.")) == ["prefill.union", "prefill.union_offsets"]
    ws.check("prefill", "pcp", tokens=8192)  # the largest step still fits what is reserved


def _one_rank_body(group) -> dict:
    assert dist.get_world_size(group) == 1  # the pool's one-rank group (a new group made by one rank
    # alone would put the ranks' group counters, and so later groups, out of step)
    options = PrefillOptions(min_shard_tokens=1)
    rt = Runtime(MLA, group, max_batched_tokens=128, mode="shardq", prefill_options=options, warmup=False)
    step = _prefill_step()
    plan = rt.plan_prefill(step.query_lens, step.prefix_lens, kv_rows=int(step.kv.shape[0]))
    out, lse = rt.prefill(step.q, step.kv, step.rows, plan=plan)
    ref_out, ref_lse = _mla_oracle(step, MLA_SCALE, _kv_lens(step))
    return {
        "step": plan.step,
        "steps": sorted(rt.ws.step_bounds),
        "err": max(_err(out, ref_out), _err(lse, ref_lse)),
    }


@pytest.mark.distributed
def test_one_rank_group_runs_shardq_mode_as_head_tp(dist_pool) -> None:
    for res in dist_pool.run(_one_rank_body, world_size=1):
        assert res["step"] == "headtp", res
        assert res["steps"] == [("decode", "headtp"), ("prefill", "headtp")], res
        assert res["err"] <= 1e-5, res


class _Records(logging.Handler):
    """The messages logged on the ``shardattn`` logger while it is attached."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((record.levelno, record.getMessage()))


def _bypass_body(group, kind: str) -> dict:
    """fp32 queries meet a bf16 spec: the first step (prefill or decode) says, once, that the steps
    allocate their buffers instead of using the workspace; both steps still run and are right."""
    spec = dataclasses.replace(GQA_FP32 if kind == "gqa" else MLA, dtype="bfloat16")
    logger = logging.getLogger("shardattn")
    records, level = _Records(), logger.level
    logger.addHandler(records)
    logger.setLevel(logging.DEBUG)
    try:
        res: dict = {}
        rt = Runtime(spec, group, max_batched_tokens=64, mode="headtp", warmup=False)
        if kind == "gqa":
            g = _gqa_step((20, 9), (1, 1), 7, DcpShard(1, 1, 0))
            for _ in range(2):
                out, _lse = rt.decode(g.q, (g.k_cache, g.v_cache), g.block_table, g.seq_lens, sinks=g.sinks)
            res["err"] = _err(out, _gqa_oracle(g, GQA_SCALE)[0])
        else:
            step = _prefill_step()
            plan = rt.plan_prefill(step.query_lens, step.prefix_lens, kv_rows=int(step.kv.shape[0]))
            out, _lse = rt.prefill(step.q, step.kv, step.rows, plan=plan)
            res["err"] = _err(out, _mla_oracle(step, MLA_SCALE, _kv_lens(step))[0])
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    res["said"] = [(lvl, msg) for lvl, msg in records.seen if "reserved workspace" in msg]
    return res


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["gqa", "mla"], ids=["decode", "prefill"])
def test_queries_in_another_dtype_log_the_workspace_bypass_on_decode_as_on_prefill(dist_pool, kind) -> None:
    """Regression: prefill logged that fp32 queries of a bf16 spec bypass the workspace; decode did
    so silently. Both log it once, at INFO on the CPU, on the ``shardattn`` logger."""
    for res in dist_pool.run(_bypass_body, kind, world_size=1):
        assert res["err"] <= 1e-5, res
        assert len(res["said"]) == 1, res["said"]
        level, message = res["said"][0]
        assert level == logging.INFO
        assert "queries in float32, not the spec's bfloat16" in message and "allocate their buffers" in message


def _bad_step_body(group) -> dict:
    rt = Runtime(MLA, group, max_batched_tokens=64, mode="mixed", max_decode_tokens=8, warmup=False)
    calls = {
        "kind": lambda: rt.check_workspace("prefil", "shardq", tokens=8),
        "step": lambda: rt.check_workspace("decode", "bogus", tokens=8),
        "tokens": lambda: rt.check_workspace("decode", "dcp", tokens=-5),
        "tokens-float": lambda: rt.workspace_needs("prefill", "pcp", 2.5, 16),
        "topk": lambda: rt.workspace_needs("prefill", "pcp", 4, -1),
    }
    got = {}
    for name, call in calls.items():
        try:
            call()
            got[name] = None
        except (TypeError, ValueError) as e:
            got[name] = f"{type(e).__name__}: {e}"
    return got


@pytest.mark.distributed
def test_workspace_questions_name_a_bad_kind_step_or_size(dist_pool) -> None:
    for res in dist_pool.run(_bad_step_body, world_size=1):
        assert res["kind"].startswith("ValueError: kind must be one of ('prefill', 'decode')"), res
        assert res["step"].startswith("ValueError: step must be one of ('headtp', 'dcp')"), res
        assert res["tokens"].startswith("ValueError: tokens must be >= 0"), res
        assert res["tokens-float"].startswith("TypeError: tokens"), res
        assert res["topk"].startswith("ValueError: topk must be >= 0"), res


def _wide_topk_body(group) -> dict:
    """A step whose top-k is wider than the Runtime's ``topk``, with so few tokens that its bytes fit
    the reserved rows: refused, naming the width and the limit, in prefill and decode alike."""
    rt = Runtime(MLA, group, max_batched_tokens=64, mode="headtp", max_decode_tokens=8, warmup=False)
    wide = 4 * rt.topk
    s = build_decode(
        heads=MLA.num_heads, head_dim=MLA.head_dim, requests=1, cached=(90,), q_lens=(1,), topk=wide,
        overlap="random", causal=True, dtype=torch.float32, device=CPU, seed=5, shard=DcpShard(1, 1, 0),
        block_size=MLA.page_size,
    )  # fmt: skip
    step = _prefill_step()
    rows = torch.cat([step.rows] * 4, dim=1)  # the same keys, listed four times: a wider top-k
    plan = rt.plan_prefill(step.query_lens, step.prefix_lens, kv_rows=int(step.kv.shape[0]))
    calls = {
        "decode": lambda: rt.decode(
            s.q, s.local_kv, s.local_table, s.seq_lens, topk_pos=s.positions, req_ids=s.req_ids
        ),
        "prefill": lambda: rt.prefill(step.q, step.kv, rows, plan=plan),
    }
    got = {"topk": rt.topk, "wide": wide}
    for name, call in calls.items():
        try:
            call()
            got[name] = None
        except WorkspaceExceededError as e:
            got[name] = str(e)
    return got


@pytest.mark.distributed
def test_a_step_wider_than_the_runtimes_topk_is_refused(dist_pool) -> None:
    for res in dist_pool.run(_wide_topk_body, world_size=1):
        for kind in ("decode", "prefill"):
            assert res[kind] is not None and res[kind].startswith(
                f"a {kind} step's top-k width {res['wide']} exceeds topk={res['topk']}"
            ), res
