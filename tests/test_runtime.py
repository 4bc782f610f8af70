"""The Runtime: routed prefill and decode against the independent fp64 oracle (tests/oracle.py), the
multi-pass union loop, workspace, warm-up, graph policy.

Distributed tests run on the ``dist_pool`` ranks (gloo, CPU); small model specs keep them fast.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from shardattn.launch.gqa_workloads import build_gqa_decode
from shardattn.launch.workloads import build_decode, build_prefill
from shardattn.ops.topk import DcpShard
from shardattn.plan.cudagraph import CGSupport
from shardattn.plan.routing import Route, route_prefill
from shardattn.plan.spec import ModelSpec
from shardattn.plan.workspace import workspace_bounds
from shardattn.plan.zigzag import zigzag_split
from shardattn.runtime.options import DecodeOptions, PrefillOptions
from shardattn.runtime.runtime import PrefillPlan, Runtime, WorkspaceExceededError
from tests.oracle import gqa_oracle, sparse_mla_oracle, topk_rows_oracle

# softmax scales other than head_dim ** -0.5 (0.144 and 0.25), as real models have: the oracles take
# these literals, never the Runtime's own value, so a Runtime that ignored them would fail
MLA_SCALE, GQA_SCALE = 0.3, 0.4
# 48 = 32 latent + 16 rope
MLA = ModelSpec("sparse_mla", 8, 1, 48, 32, 16, 16, dtype="float32", softmax_scale=MLA_SCALE)
GQA = ModelSpec("gqa", 8, 2, 16, 16, 0, 16, has_sinks=True, dtype="float32", softmax_scale=GQA_SCALE)
MLA_SINKS = dataclasses.replace(MLA, has_sinks=True)  # steps of a model with sinks pass them, others none
CPU = torch.device("cpu")
SEQ, CACHED = [23, 9, 30], (5, 0, 40)  # a step of three requests, one without a cached prefix


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(fa, fb):
        return math.inf
    return float((a[fa] - b[fa]).abs().max()) if bool(fa.any()) else 0.0


def _prefill_step(seed: int = 0):
    return build_prefill(
        heads=MLA.num_heads,
        head_dim=MLA.head_dim,
        tokens=sum(SEQ),
        requests=len(SEQ),
        cached=CACHED,
        topk=MLA.topk,
        overlap="dsa",
        dtype=torch.float32,
        device=CPU,
        seed=seed,
        block_size=MLA.page_size,
    )


def _gqa_step(cached: tuple[int, ...], q_lens: tuple[int, ...], seed: int, shard: DcpShard):
    """A GQA decode step of the test spec (sinks, fp32, CPU): one request per ``q_lens`` entry."""
    return build_gqa_decode(
        q_heads=GQA.num_heads,
        kv_heads=GQA.num_kv_heads,
        head_dim=GQA.head_dim,
        sinks=True,
        requests=len(q_lens),
        cached=cached,
        q_lens=q_lens,
        dtype=torch.float32,
        device=CPU,
        seed=seed,
        shard=shard,
        block_size=GQA.page_size,
    )


def _workspace_errors(calls: dict[str, Callable[[], object]]) -> dict[str, str | None]:
    """Runs each call: its :class:`WorkspaceExceededError` message by name, or None if it ran."""
    errors: dict[str, str | None] = {}
    for name, fn in calls.items():
        try:
            fn()
            errors[name] = None
        except WorkspaceExceededError as e:
            errors[name] = str(e)
    return errors


def _mla_oracle(step, scale: float, kv_lens: list[int] | torch.Tensor, topk_length=None, sinks=None):
    """The oracle on the step's rows, themselves converted from its top-k positions by the oracle."""
    lens = torch.as_tensor(kv_lens, dtype=torch.int32)
    rows = topk_rows_oracle(
        step.positions, step.req_ids, step.block_table, block_size=MLA.page_size, seq_lens=lens, topk_length=topk_length
    )
    return sparse_mla_oracle(
        step.q, step.kv, rows, scale=scale, v_dim=MLA.v_dim, topk_length=topk_length, sinks=sinks
    )  # fmt: skip


def _gqa_oracle(g, scale: float, causal: bool = True):
    return gqa_oracle(
        g.q, g.k_cache, g.v_cache, g.block_table, g.seq_lens, g.cu_q_lens.tolist(), sinks=g.sinks, scale=scale,
        causal=causal,
    )  # fmt: skip


def _heads(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    h = x.shape[1] // world
    return x[:, rank * h : (rank + 1) * h]


# -- prefill ----------------------------------------------------------------------------------------
def _prefill_body(group, mode: str, min_shard_tokens: int, scale: float | None = None) -> dict:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    options = PrefillOptions(min_shard_tokens=min_shard_tokens)
    rt = Runtime(MLA, group, max_batched_tokens=128, mode=mode, prefill_options=options, scale=scale)
    want = MLA_SCALE if scale is None else scale
    step = _prefill_step()
    plan = rt.plan_prefill(step.query_lens, step.prefix_lens, kv_rows=int(step.kv.shape[0]))
    rt.comm.reset_counts()
    if plan.step == "pcp":
        mine = plan.tokens_of(rank)
        own = _token_rows(step).index_select(0, mine)
        out, lse = rt.prefill(
            step.q[mine], step.kv, topk_pos=step.positions[mine], kv_new=step.kv[own], block_table=step.block_table,
            plan=plan,
        )  # fmt: skip
        ref_out, ref_lse = _mla_oracle(step, want, _kv_lens(step))
        ref_out, ref_lse = ref_out[mine], ref_lse[mine]
    else:
        out, lse = rt.prefill(
            _heads(step.q, rank, world).contiguous(),
            step.kv,
            step.rows,
            query_lens=step.query_lens,
            prefix_lens=step.prefix_lens,
        )
        ref_out, ref_lse = _mla_oracle(step, want, _kv_lens(step))
        ref_out, ref_lse = _heads(ref_out, rank, world), _heads(ref_lse, rank, world)
    return {
        "step": plan.step,
        "route": plan.route.path,
        "counts": dict(rt.comm.counts),
        "err": max(_err(out, ref_out), _err(lse, ref_lse)),
        "tokens": int(plan.tokens_of(rank).numel()),
    }


def _kv_lens(step) -> list[int]:
    return [c + n for c, n in zip(step.prefix_lens, step.query_lens)]


def _token_rows(step) -> torch.Tensor:
    """``[T]`` KV-cache row of every new token (the key and value it computed)."""
    starts = torch.tensor([0, *step.query_lens]).cumsum(0)[:-1]
    req = step.req_ids.long()
    pos = torch.tensor(step.prefix_lens)[req] + torch.arange(len(req)) - starts[req]
    return step.block_table.long()[req, pos // MLA.page_size] * MLA.page_size + pos % MLA.page_size


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda w: f"world{w}")
@pytest.mark.parametrize(
    ("mode", "gate", "step", "collectives"),
    [
        ("shardq", 1, "shardq", {"all_to_all": 2, "agreement": 1}),
        ("mixed", 1, "shardq", {"all_to_all": 2, "agreement": 1}),
        ("shardq", 100, "headtp", {"agreement": 1}),  # below the gate: head-TP, no data moves
        ("shardq", 1024, "headtp", {}),  # a gate above max_batched_tokens: never shards, no collective
        ("headtp", 1, "headtp", {}),
        ("pcp", 1, "pcp", {"all_gather": 1, "agreement": 1}),
    ],
    ids=["shardq", "mixed", "shardq-below-gate", "shardq-gate-above-max", "headtp", "pcp"],
)
def test_prefill_matches_single_process_reference(dist_pool, world_size, mode, gate, step, collectives) -> None:
    results = dist_pool.run(_prefill_body, mode, gate, world_size=world_size)
    for r, res in enumerate(results):
        assert res["err"] <= 1e-5, (r, res)
        assert res["step"] == step and res["route"] == "reference"
        assert {k: v for k, v in res["counts"].items() if v} == collectives, res["counts"]
    covered = sum(res["tokens"] for res in results)
    assert covered == (sum(SEQ) if step in ("shardq", "pcp") else sum(SEQ) * world_size)


# -- decode -----------------------------------------------------------------------------------------
def _decode_body(
    group,
    mode: str,
    kind: str,
    q_lens: tuple[int, ...],
    interleave: int,
    non_causal: bool = False,
    scale: float | None = None,
) -> dict:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    spec = MLA if kind == "mla" else GQA
    options = DecodeOptions(dcp_interleave=interleave, causal=not non_causal)
    rt = Runtime(spec, group, max_batched_tokens=64, mode=mode, decode_options=options, scale=scale)
    want = (MLA_SCALE if kind == "mla" else GQA_SCALE) if scale is None else scale
    dcp = mode in ("mixed", "dcp-decode")
    shard = DcpShard(world, interleave, rank) if dcp else DcpShard(1, 1, 0)
    cached = (37, 0, 70)[: len(q_lens)]
    if kind == "mla":
        s = build_decode(
            heads=spec.num_heads,
            head_dim=spec.head_dim,
            requests=len(q_lens),
            cached=cached,
            q_lens=q_lens,
            topk=spec.topk,
            overlap="random",
            causal=not non_causal,
            dtype=torch.float32,
            device=CPU,
            seed=3,
            shard=shard,
            block_size=spec.page_size,
        )
        out, lse = rt.decode(
            _heads(s.q, rank, world).contiguous(),
            s.local_kv,
            s.local_table,
            s.seq_lens,
            topk_pos=s.positions,
            req_ids=s.req_ids,
        )
        # an indexer's top-k has no repeated position: topk_unique skips the de-duplication, same answer
        assert all(len(set(r)) == len(r) for r in (row[row >= 0].tolist() for row in s.positions))
        out_u, lse_u = rt.decode(
            _heads(s.q, rank, world).contiguous(), s.local_kv, s.local_table, s.seq_lens,
            topk_pos=s.positions, req_ids=s.req_ids, topk_unique=True,
        )  # fmt: skip
        torch.testing.assert_close(out_u, out, atol=1e-6, rtol=0)
        torch.testing.assert_close(lse_u, lse, atol=1e-6, rtol=0)
        # holes anywhere in a row: the unique rows are packed before the kernel, its count their length
        holes = s.positions.masked_fill(
            torch.rand(s.positions.shape, generator=torch.Generator().manual_seed(11)) < 0.3, -1
        )
        got = [
            rt.decode(_heads(s.q, rank, world).contiguous(), s.local_kv, s.local_table, s.seq_lens,
                      topk_pos=holes, req_ids=s.req_ids, topk_unique=unique)
            for unique in (True, False)
        ]  # fmt: skip
        torch.testing.assert_close(got[0], got[1], atol=1e-6, rtol=0)
        ref = _mla_oracle(s, want, s.seq_lens)
        other = ref  # sparse MLA: causality lives in the top-k positions
    else:
        g = _gqa_step(cached, q_lens, 3, shard)
        k, v, table = g.local_k_cache, g.local_v_cache, g.local_block_table
        if not dcp:  # head-TP: each rank holds its KV heads of the whole cache
            hkv = spec.num_kv_heads // world
            k, v = (c[:, :, rank * hkv : (rank + 1) * hkv].contiguous() for c in (g.k_cache, g.v_cache))
            table = g.block_table
        out, lse = rt.decode(
            _heads(g.q, rank, world).contiguous(), (k, v), table, g.seq_lens, cu_q_lens=g.cu_q_lens, sinks=g.sinks
        )
        ref = _gqa_oracle(g, want, causal=not non_causal)
        other = _gqa_oracle(g, want, causal=non_causal)
    return {
        "err": max(_err(out, _heads(ref[0], rank, world)), _err(lse, _heads(ref[1], rank, world))),
        "err_other_mask": _err(out, _heads(other[0], rank, world)),
    }


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("mode", "kind", "q_lens", "interleave", "non_causal"),
    [
        ("mixed", "mla", (1, 1, 1), 1, False),
        ("dcp-decode", "mla", (2, 1, 3), 16, False),  # speculative drafts, interleave of one page
        ("shardq", "mla", (1, 1), 1, False),  # head-TP decode over the whole cache
        ("dcp-decode", "mla", (2, 1, 3), 2, True),  # non-causal drafts: any of the request's keys
        ("dcp-decode", "gqa", (1, 3, 2), 1, False),  # ragged drafts with sinks
        ("dcp-decode", "gqa", (2, 2, 2), 4, False),
        ("headtp", "gqa", (1, 3, 2), 1, False),
        ("dcp-decode", "gqa", (1, 3, 2), 2, True),
        ("headtp", "gqa", (2, 2, 2), 1, True),
    ],
    ids=[
        "mla-dcp",
        "mla-dcp-drafts",
        "mla-headtp",
        "mla-dcp-noncausal",
        "gqa-dcp-ragged",
        "gqa-dcp-uniform",
        "gqa-headtp",
        "gqa-dcp-noncausal",
        "gqa-headtp-noncausal",
    ],
)
def test_decode_matches_single_process_reference(dist_pool, mode, kind, q_lens, interleave, non_causal) -> None:
    results = dist_pool.run(_decode_body, mode, kind, q_lens, interleave, non_causal, world_size=2)
    assert max(res["err"] for res in results) <= 1e-5, results
    if kind == "gqa" and max(q_lens) > 1:  # drafts: the other mask gives another answer
        assert min(res["err_other_mask"] for res in results) > 1e-3, results


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("step", "mode", "kind"),
    [
        ("prefill", "shardq", "mla"),
        ("prefill", "headtp", "mla"),
        ("prefill", "pcp", "mla"),
        ("decode", "mixed", "mla"),
        ("decode", "shardq", "mla"),
        ("decode", "dcp-decode", "gqa"),
        ("decode", "headtp", "gqa"),
    ],
    ids=lambda v: str(v),
)
def test_runtime_scale_overrides_the_spec_in_every_step(dist_pool, step, mode, kind) -> None:
    """``Runtime(scale=...)`` reaches every step's kernels: checked against the oracle at 0.7."""
    if step == "prefill":
        results = dist_pool.run(_prefill_body, mode, 1, 0.7, world_size=2)
    else:
        results = dist_pool.run(_decode_body, mode, kind, (1, 2), 1, False, 0.7, world_size=2)
    assert max(res["err"] for res in results) <= 1e-5, results


# -- the multi-pass loop over the union workspace ------------------------------------------------------
MULTIPASS_SEQ = [119, 9]  # with G = 8 over 2 ranks, zigzag puts 71 tokens on rank 0: N = 64 plus the slack


def _multipass_body(group) -> dict:
    """A ShardQ step whose zigzag slack leaves rank 0 more tokens than the union buffer covers.

    The Runtime reserves the union of ``N = ceil(ceil(M / W) / G) * G`` tokens (``M = 128``,
    ``W = 2``, ``G = 8``: 64); aligning the split to ``G`` puts ``64 + 7`` tokens on rank 0, which
    then runs in two passes over the same buffer. On the CPU the planner routes to the torch
    reference (which needs no union), so the step is given the grouped route a GPU would take.
    """
    import shardattn.runtime.prefill as runtime_module

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    rt = Runtime(
        MLA_SINKS,
        group,
        max_batched_tokens=128,
        mode="shardq",
        prefill_options=PrefillOptions(min_shard_tokens=1),
        warmup=False,
    )
    g, k, t = 8, MLA.topk, sum(MULTIPASS_SEQ)
    split = zigzag_split(MULTIPASS_SEQ, world, align=g, min_tokens=0)
    plan = PrefillPlan("shardq", Route("grouped", g, "as on a GPU"), split, t)
    gen = torch.Generator().manual_seed(11)
    q, kv = torch.randn(t, MLA.num_heads, MLA.head_dim, generator=gen), torch.randn(300, MLA.head_dim, generator=gen)
    rows = torch.randint(-2, 310, (t, k), generator=gen, dtype=torch.int32)
    length = torch.randint(0, k + 1, (t,), generator=gen, dtype=torch.int32)
    sinks = torch.randn(MLA.num_heads, generator=gen)
    union_ptr = rt.workspace["prefill.union"].data_ptr()
    passes = []
    real = runtime_module.sparse_mla_grouped_prefill

    def spy(q, **kw):  # q: [T, H, D], or head-blocked [W, T, H/W, D] (the in-place ShardQ buffer)
        union = kw["union"][0]
        passes.append((int(q.shape[-3]), union.data_ptr() == union_ptr, tuple(union.shape), kw["group_size"]))
        return real(q, **kw)

    runtime_module.sparse_mla_grouped_prefill = spy
    try:
        out, lse = rt.prefill(_heads(q, rank, world).contiguous(), kv, rows, plan=plan, topk_length=length, sinks=sinks)
    finally:
        runtime_module.sparse_mla_grouped_prefill = real
    ref_out, ref_lse = sparse_mla_oracle(q, kv, rows, scale=MLA_SCALE, v_dim=MLA.v_dim, topk_length=length, sinks=sinks)
    return {
        "passes": passes,
        "err": max(_err(out, _heads(ref_out, rank, world)), _err(lse, _heads(ref_lse, rank, world))),
        "union_bytes": int(rt.workspace["prefill.union"].numel()),
        "counts": split.counts.tolist(),
    }


@pytest.mark.distributed
def test_prefill_runs_in_passes_when_a_rank_holds_more_than_the_union_buffer(dist_pool) -> None:
    results = dist_pool.run(_multipass_body, world_size=2)
    k = MLA.topk
    assert results[0]["counts"] == [71, 57] and results[0]["union_bytes"] == 64 * k * 4
    for rank, (res, want) in enumerate(zip(results, ([64, 7], [57]))):
        assert [n for n, *_ in res["passes"]] == want, (rank, res["passes"])
        assert all(same for _, same, _, _ in res["passes"]), "every pass reuses the reserved buffer"
        assert all(shape == (-(-n // 8), 8 * k) and g == 8 for n, _, shape, g in res["passes"]), res["passes"]
        assert res["err"] <= 1e-5, (rank, res["err"])


# -- two Runtimes, two groups, one process ------------------------------------------------------------
def _two_runtimes_body(group) -> dict | None:
    # the largest power of two of the pool's ranks, so the 8 heads split evenly; two groups over
    # those ranks, made by every rank of the world (a group made by some ranks only would leave the
    # ranks' group counters, and so later groups' names, out of step)
    world = 1 << (dist.get_world_size(group).bit_length() - 1)
    first = dist.new_group(list(range(world)))
    other = dist.new_group(list(range(world)))
    if dist.get_rank(group) >= world:
        return None
    rank = dist.get_rank(first)
    a = Runtime(MLA, first, max_batched_tokens=128, mode="shardq", prefill_options=PrefillOptions(min_shard_tokens=1))
    b = Runtime(GQA, other, max_batched_tokens=64, mode="dcp-decode")
    assert a.group is first and b.group is other
    step = _prefill_step(seed=5)
    g = _gqa_step((30, 3), (1, 2), 5, DcpShard(world, 1, rank))
    errs = []
    ref_a = _mla_oracle(step, MLA_SCALE, _kv_lens(step))
    ref_b = _gqa_oracle(g, GQA_SCALE)
    for _ in range(2):  # interleaved steps on the two groups
        out_a, _ = a.prefill(
            _heads(step.q, rank, world).contiguous(),
            step.kv,
            step.rows,
            query_lens=step.query_lens,
            prefix_lens=step.prefix_lens,
        )
        out_b, _ = b.decode(
            _heads(g.q, rank, world).contiguous(),
            (g.local_k_cache, g.local_v_cache),
            g.local_block_table,
            g.seq_lens,
            cu_q_lens=g.cu_q_lens,
            sinks=g.sinks,
        )
        errs.append(_err(out_a, _heads(ref_a[0], rank, world)))
        errs.append(_err(out_b, _heads(ref_b[0], rank, world)))
    return {"err": max(errs), "a": dict(a.comm.counts), "b": dict(b.comm.counts)}


@pytest.mark.distributed
def test_two_runtimes_on_two_groups_in_one_process(dist_pool, nproc: int) -> None:
    if nproc < 2:
        pytest.skip("needs 2 ranks; run with --nproc 2 or more")
    results = dist_pool.run(_two_runtimes_body)  # the whole pool: every rank joins the new groups
    assert sum(res is not None for res in results) == 1 << (nproc.bit_length() - 1)
    for res in filter(None, results):
        assert res["err"] <= 1e-5, res
        # each Runtime counts only its own collectives: 2 ShardQ steps / 2 DCP steps
        assert res["a"] == {"all_to_all": 4, "agreement": 2}, res["a"]
        assert res["b"]["agreement"] == 2 and res["b"]["all_gather"] >= 2 and "all_to_all" in res["b"], res["b"]


# -- workspace ----------------------------------------------------------------------------------------
def _workspace_body(group) -> dict:
    world = dist.get_world_size(group)
    rt = Runtime(MLA, group, max_batched_tokens=100, mode="headtp", max_decode_tokens=8, warmup=False)
    reserved = {k: int(t.numel()) for k, t in rt.workspace.items()}
    want_prefill = workspace_bounds(MLA, max_batched_tokens=100, world_size=world, mode="headtp", topk=MLA.topk)
    want_decode = workspace_bounds(MLA, max_batched_tokens=8, world_size=world, mode="headtp-decode", topk=MLA.topk)
    dcp = Runtime(MLA, group, max_batched_tokens=100, mode="dcp-decode", max_decode_tokens=8, warmup=False)
    want_dcp = workspace_bounds(
        MLA, max_batched_tokens=8, world_size=world, mode="dcp-decode", tp_size=world, topk=MLA.topk
    )
    glm5 = Runtime("glm5", group, max_batched_tokens=16, mode="shardq", warmup=False)
    step = _prefill_step()
    q = _heads(step.q, dist.get_rank(group), world).contiguous()
    errors = _workspace_errors(
        {
            "too-many-tokens": lambda: rt.prefill(q, step.kv, step.rows, query_lens=[101], prefix_lens=[0]),
            "wider-topk": lambda: rt.prefill(
                q,
                step.kv,
                torch.cat([step.rows, step.rows], 1),
                query_lens=step.query_lens,
                prefix_lens=step.prefix_lens,
            ),
            "decode-tokens": lambda: rt.check_workspace("decode", "headtp", tokens=9),
        }
    )
    out, _ = rt.prefill(q, step.kv, step.rows, query_lens=step.query_lens, prefix_lens=step.prefix_lens)  # still fine
    return {
        "reserved": reserved,
        "arena": (rt.workspace_bytes, rt.ws.kind_bytes("prefill"), rt.ws.kind_bytes("decode")),
        "dcp_arena": (dcp.workspace_bytes, dcp.ws.kind_bytes("decode")),
        "prefill": {f"prefill.{k}": v for k, v in want_prefill.items.items() if v},
        "decode": {f"decode.{k}": v for k, v in want_decode.items.items() if v},
        "dcp": {k: int(t.numel()) for k, t in dcp.workspace.items() if k.startswith("decode.")},
        "want_dcp": {f"decode.{k}": v for k, v in want_dcp.items.items() if v},
        "contract": glm5.workspace_needs("prefill", "shardq", 65536, 2048)["prefill.union"] if world == 4 else None,
        "errors": errors,
        "out": tuple(out.shape),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda w: f"world{w}")
def test_workspace_is_the_planners_bound_and_is_enforced(dist_pool, world_size: int) -> None:
    res = dist_pool.run(_workspace_body, world_size=world_size)[0]
    assert res["reserved"] == {**res["prefill"], **res["decode"]}, "reserved exactly the planner's items"
    total, prefill, decode = res["arena"]  # one arena: prefill and decode items share bytes
    assert total == max(prefill, decode) and prefill >= sum(res["prefill"].values()) and decode > 0
    # the DCP decode step's items share bytes where they are never live together (queries / send buffer)
    assert res["dcp_arena"][0] == res["dcp_arena"][1] < sum(res["want_dcp"].values())
    assert res["dcp"] == res["want_dcp"]
    if world_size == 4:  # the contract's example: 65,536 tokens, TP4, G = 2, top-k 2048
        assert res["contract"] == 134_217_728
    errors = res["errors"]
    assert "101 tokens exceeds max_batched_tokens=100" in errors["too-many-tokens"]
    assert errors["wider-topk"].startswith("a prefill step's top-k width 32 exceeds topk=16"), errors
    assert "9 tokens exceeds max_decode_tokens=8" in errors["decode-tokens"]
    assert res["out"] == (sum(SEQ), MLA.num_heads // world_size, MLA.v_dim)


# -- warm-up ------------------------------------------------------------------------------------------
def _warmup_body(group, mode: str) -> dict:
    rt = Runtime("glm5", group, max_batched_tokens=8192, mode=mode, topk=64, warmup=True)
    world = dist.get_world_size(group)
    missing = []
    # every route a step of this Runtime can take on a GPU: both sides of the grouping gate and of
    # the 24-bit row limit, the ShardQ (all heads) and head-TP (H / W) kernels, with and without topk_length
    for heads in sorted({64, 64 // world}):
        for tokens in (1, 1023, 1024, 50_000):
            for rows in (4096, 2**24 - 2, 2**24 - 1, 2**26):
                route = route_prefill(heads, num_tokens=tokens, kv_rows=rows, device_type="cuda")
                for with_len in (False, True):
                    missing += [k for k in rt.route_keys(route, heads, topk_length=with_len) if k not in rt.warmed_keys]
    return {"missing": [(k.kernel, k.params) for k in missing], "launches": rt.warmup_launches}


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["shardq", "mixed", "pcp"])
def test_warmup_covers_every_key_the_routes_can_produce(dist_pool, mode: str) -> None:
    res = dist_pool.run(_warmup_body, mode, world_size=2)[0]
    assert res["missing"] == []
    assert res["launches"] > 0


@pytest.mark.distributed
def test_warmup_coverage_check_can_fail(dist_pool) -> None:
    """A head-TP Runtime never warms the all-heads (ShardQ) kernels: the coverage check sees the gap."""
    res = dist_pool.run(_warmup_body, "headtp", world_size=2)[0]
    assert any(kernel == "attention" for kernel, _ in res["missing"])


# -- CUDA-graph policy ---------------------------------------------------------------------------------
def _policy_body(group) -> dict:
    out: dict[str, str | None] = {}

    def attempt(name: str, rt: Runtime, **kw) -> None:
        try:
            rt.check_capture(**kw)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)

    dcp = Runtime(MLA, group, max_batched_tokens=32, mode="dcp-decode", warmup=False)
    attempt("cpu-reference", dcp, q_len_per_req=1)
    triton = Route("triton", 1, "as on a GPU")
    dcp.__dict__["decode_route"] = triton  # the policy of the route a GPU would take
    attempt("dcp-single-token", dcp, q_len_per_req=1)
    attempt("dcp-drafts", dcp, q_len_per_req=2)
    tp = Runtime(GQA, group, max_batched_tokens=32, mode="headtp", warmup=False)
    tp.__dict__["decode_route"] = triton
    attempt("headtp-drafts", tp, q_len_per_req=3)
    attempt("headtp-ragged", tp, q_len_per_req=2, ragged=True)
    shardq = Runtime(MLA, group, max_batched_tokens=32, mode="shardq", warmup=False)
    attempt("shardq-prefill", shardq, step="prefill")
    out["levels"] = f"{dcp.cudagraph_support().name} {tp.cudagraph_support().name}"
    return out


@pytest.mark.distributed
def test_cudagraph_policy_refuses_forbidden_captures(dist_pool) -> None:
    res = dist_pool.run(_policy_body, world_size=2)[0]
    assert "NEVER" in res["cpu-reference"] and "torch reference" in res["cpu-reference"]
    assert res["dcp-single-token"] is None
    assert "q_len_per_req=2" in res["dcp-drafts"] and "UNIFORM_SINGLE_TOKEN_DECODE" in res["dcp-drafts"]
    assert "dcp_size=2" in res["dcp-drafts"], "the message says why"
    assert res["headtp-drafts"] is None
    assert "ragged" in res["headtp-ragged"] and "ALWAYS is needed" in res["headtp-ragged"]
    assert "prefill" in res["shardq-prefill"] and "NEVER" in res["shardq-prefill"]
    assert res["levels"] == f"{CGSupport.UNIFORM_SINGLE_TOKEN_DECODE.name} {CGSupport.UNIFORM_BATCH.name}"


# -- construction errors ---------------------------------------------------------------------------------
def _bad_body(group) -> dict:
    out = {}
    cases = {
        "heads": lambda: Runtime(dataclasses.replace(MLA, num_heads=6), group, max_batched_tokens=8, mode="shardq"),
        "gqa-prefill": lambda: Runtime(GQA, group, max_batched_tokens=8, mode="shardq"),
        "mode": lambda: Runtime(MLA, group, max_batched_tokens=8, mode="ring"),
        "tokens": lambda: Runtime(MLA, group, max_batched_tokens=0, mode="shardq"),
        "spec": lambda: Runtime(42, group, max_batched_tokens=8, mode="shardq"),
        "no-prefill": lambda: Runtime(MLA, group, max_batched_tokens=8, mode="dcp-decode").plan_prefill([3]),
    }
    for name, fn in cases.items():
        try:
            fn()
            out[name] = "no error"
        except (TypeError, ValueError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.distributed
def test_bad_construction_raises_clear_errors(dist_pool) -> None:
    res = dist_pool.run(_bad_body, world_size=4)[0]
    assert "the spec's num_heads (6) must be divisible by the group's size (4)" in res["heads"]
    assert "spec is a GQA model" in res["gqa-prefill"]
    assert res["mode"].startswith("ValueError: mode must be one of") and "'ring'" in res["mode"]
    assert "max_batched_tokens must be >= 1" in res["tokens"]
    assert res["spec"].startswith("TypeError: spec must be a ModelSpec or a preset name")
    assert "has no prefill step" in res["no-prefill"]


def _no_lse_body(group, mode: str, kind: str) -> dict:
    """A decode step of a Runtime built with ``DecodeOptions(return_lse=False)``: ``(out, None)``,
    ``out`` the oracle's."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    spec = MLA if kind == "mla" else GQA
    options = DecodeOptions(return_lse=False)
    rt = Runtime(spec, group, max_batched_tokens=32, mode=mode, decode_options=options, warmup=False)
    shard = DcpShard(world, 1, rank) if rt.decode_is_dcp else DcpShard(1, 1, 0)
    q_lens = (1, 2)
    if kind == "mla":
        s = build_decode(
            heads=spec.num_heads, head_dim=spec.head_dim, requests=2, cached=(20, 9), q_lens=q_lens, topk=spec.topk,
            overlap="random", causal=True, dtype=torch.float32, device=CPU, seed=7, shard=shard,
            block_size=spec.page_size,
        )  # fmt: skip
        q = _heads(s.q, rank, world).contiguous()
        out, lse = rt.decode(q, s.local_kv, s.local_table, s.seq_lens, topk_pos=s.positions, req_ids=s.req_ids)
        ref = _mla_oracle(s, MLA_SCALE, s.seq_lens)[0]
    else:
        g = _gqa_step((20, 9), q_lens, 7, shard)
        k, v, table = g.local_k_cache, g.local_v_cache, g.local_block_table
        if not rt.decode_is_dcp:  # head-TP: the rank's KV heads of the whole cache
            hkv = spec.num_kv_heads // world
            k, v = (c[:, :, rank * hkv : (rank + 1) * hkv].contiguous() for c in (g.k_cache, g.v_cache))
            table = g.block_table
        q = _heads(g.q, rank, world).contiguous()
        out, lse = rt.decode(q, (k, v), table, g.seq_lens, cu_q_lens=g.cu_q_lens, sinks=g.sinks)
        ref = _gqa_oracle(g, GQA_SCALE)[0]
    return {"lse": lse, "err": _err(out, _heads(ref, rank, world))}


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("mode", "kind"),
    [
        ("headtp", "gqa"),
        ("dcp-decode", "gqa"),
        ("headtp", "mla"),
        ("shardq", "mla"),
        ("mixed", "mla"),
        ("dcp-decode", "mla"),
    ],
)
def test_decode_without_lse_returns_none_in_every_mode(dist_pool, mode: str, kind: str) -> None:
    for res in dist_pool.run(_no_lse_body, mode, kind, world_size=2):
        assert res["lse"] is None and res["err"] <= 1e-5, res


# -- fp8_ds_mla KV rows ------------------------------------------------------------------------------
# DSA dims (the format's: 512 latent + 64 rope), a bf16 model; the queries fp32 on the CPU
MLA_DSA = ModelSpec("sparse_mla", 4, 1, 576, 512, 16, 16, dtype="bfloat16", softmax_scale=MLA_SCALE)


def _fp8_body(group, mode: str) -> dict:
    """One prefill and one decode step of a Runtime with ``kv_dtype="fp8_ds_mla"`` on FP8 caches,
    and of a Runtime of rows in q's dtype on the rows those caches dequantise to (exact): the same bits."""
    from shardattn.ops.kv_fp8 import dequantize_kv, quantize_kv

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    options = PrefillOptions(min_shard_tokens=1)
    rt8 = Runtime(MLA_DSA, group, max_batched_tokens=64, mode=mode, prefill_options=options, kv_dtype="fp8_ds_mla")
    rt = Runtime(MLA_DSA, group, max_batched_tokens=64, mode=mode, prefill_options=options)
    res = {"workspace": (rt8.workspace_bytes, rt.workspace_bytes), "reason": rt8.decode_route.reason}
    step = build_prefill(
        heads=4, head_dim=576, tokens=20, requests=2, cached=(6, 0), topk=16, overlap="dsa", dtype=torch.float32,
        device=CPU, seed=4, block_size=16,
    )  # fmt: skip
    kv8 = quantize_kv(step.kv)
    kv = dequantize_kv(kv8, torch.float32)
    plan = rt.plan_prefill(step.query_lens, step.prefix_lens, kv_rows=int(kv.shape[0]))
    if plan.step == "pcp":
        mine = plan.tokens_of(rank)
        own = _token_rows(step).index_select(0, mine)  # MLA_DSA's pages are MLA's 16 tokens
        q = step.q[mine]
        call8 = {"kv_cache": kv8.view(-1, 16, 656), "topk_pos": step.positions[mine], "kv_new": kv8[own]}
        call = {"kv_cache": kv, "topk_pos": step.positions[mine], "kv_new": kv[own]}
        for c in (call8, call):
            c["block_table"] = step.block_table
    else:
        q = _heads(step.q, rank, world).contiguous()
        call8, call = {"kv_cache": kv8, "rows": step.rows}, {"kv_cache": kv, "rows": step.rows}
    lens = {"query_lens": step.query_lens, "prefix_lens": step.prefix_lens}
    out8 = rt8.prefill(q, **call8, **lens)
    out = rt.prefill(q, **call, **lens)
    res["prefill"] = all(torch.equal(a, b) for a, b in zip(out8, out))
    dcp = mode in ("mixed", "dcp-decode")
    s = build_decode(
        heads=4, head_dim=576, requests=2, cached=(37, 20), q_lens=(1, 2), topk=16, overlap="random", causal=True,
        dtype=torch.float32, device=CPU, seed=3, shard=DcpShard(world, 1, rank) if dcp else DcpShard(1, 1, 0),
        block_size=16,
    )  # fmt: skip
    local8 = quantize_kv(s.local_kv).view(-1, 16, 656)  # the rank's shard, paged
    local = dequantize_kv(local8, torch.float32).flatten(0, 1)
    qd = _heads(s.q, rank, world).contiguous()
    meta = {"topk_pos": s.positions, "req_ids": s.req_ids}
    dec8 = rt8.decode(qd, local8, s.local_table, s.seq_lens, **meta)
    dec = rt.decode(qd, local, s.local_table, s.seq_lens, **meta)
    res["decode"] = all(torch.equal(a, b) for a, b in zip(dec8, dec))
    bad_calls = {
        "prefill-float-cache": lambda: rt8.prefill(q, **call, **lens),
        "decode-float-cache": lambda: rt8.decode(qd, local, s.local_table, s.seq_lens, **meta),
        # pages of 8 rows where the block table's (the model's) hold 16: read as such, they are other rows
        "decode-other-pages": lambda: rt8.decode(qd, local8.view(-1, 8, 656), s.local_table, s.seq_lens, **meta),
    }
    if plan.step == "pcp":
        bad_calls["prefill-other-pages"] = lambda: rt8.prefill(q, **{**call8, "kv_cache": kv8.view(-1, 8, 656)}, **lens)
    for name, bad in bad_calls.items():
        try:
            bad()
            res[name] = None
        except ValueError as e:
            res[name] = str(e)
    return res


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["mixed", "pcp", "headtp"])
def test_fp8_kv_runtime_equals_the_bf16_runtime_on_the_dequantised_rows(dist_pool, mode: str) -> None:
    """kv_dtype="fp8_ds_mla": ShardQ / PCP / head-TP prefill and DCP / head-TP decode read FP8 caches
    (a rank's paged shard included) and give the bits of a Runtime of dense rows on the rows they
    dequantise to; a cache in another format, or paged in other pages than the model's (which its block
    table follows), is refused, naming it; the routes say so."""
    for res in dist_pool.run(_fp8_body, mode, world_size=2):
        assert res["prefill"] and res["decode"], res
        assert "fp8_ds_mla" in res["prefill-float-cache"] and "fp8_ds_mla" in res["decode-float-cache"], res
        assert res["reason"].endswith("; fp8_ds_mla KV rows"), res
        for name in ("decode-other-pages", "prefill-other-pages")[: 2 if mode == "pcp" else 1]:
            assert res[name].startswith("kv_cache must hold pages of 16 tokens (the model's page_size"), res


def test_fp8_kv_dtype_sizes_the_workspace_and_is_refused_where_it_does_not_apply() -> None:
    assert Runtime.__init__.__kwdefaults__["kv_dtype"] is None  # rows in q's dtype unless declared
    pcp = {fmt: workspace_bounds(MLA_DSA, max_batched_tokens=64, world_size=2, mode="pcp", kv_dtype=fmt) for fmt in
           ("bfloat16", "fp8_ds_mla")}  # fmt: skip
    assert pcp["bfloat16"].items["recv"] // (576 * 2) == pcp["fp8_ds_mla"].items["recv"] // 656
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        workspace_bounds(MLA_DSA, max_batched_tokens=64, world_size=2, mode="pcp", kv_dtype="int8")
    with pytest.raises(ValueError, match="fp8_ds_mla rows hold 576 values"):
        workspace_bounds(MLA, max_batched_tokens=64, world_size=2, mode="pcp", kv_dtype="fp8_ds_mla")


# -- ShardQ routing agrees across ranks --------------------------------------------------------------
def _shardq_route_body(group) -> dict:
    import shardattn.runtime.planning as planning

    world = dist.get_world_size(group)
    real = planning.route_prefill
    # route as on a GPU, where the grouped kernel's gate applies (the CPU always runs the reference)
    planning.route_prefill = lambda heads, **kw: real(heads, **{**kw, "device_type": "cuda"})
    try:
        options = PrefillOptions(min_shard_tokens=16, min_group_tokens=64)
        rt = Runtime(MLA, group, max_batched_tokens=4096, mode="shardq", prefill_options=options, warmup=False)
        plan = rt.plan_prefill([64 * world - 1], kv_rows=1 << 16)
    finally:
        planning.route_prefill = real
    return {"counts": plan.shard.counts.tolist(), "route": (plan.route.path, plan.route.group_size)}


@pytest.mark.distributed
def test_shardq_ranks_take_one_group_size_when_their_counts_straddle_the_gate(dist_pool, nproc: int) -> None:
    """The kernel's group size is also the chunk alignment every ShardQ rank cuts alike: ranks whose
    token counts fall on both sides of the grouped path's gate take one route (the smallest rank's)."""
    if nproc < 2 or MLA.num_heads % nproc:
        pytest.skip(f"needs 2 or more ranks that divide the spec's {MLA.num_heads} heads")
    results = dist_pool.run(_shardq_route_body)
    counts = results[0]["counts"]
    assert min(counts) < 64 <= max(counts), counts  # the ranks straddle the gate
    assert all(res["route"] == ("per-query", 1) for res in results), results
