"""A one-chunk ShardQ step stages what it moves in the Runtime's workspace, whatever the dims.

The one-message step gathers the queries it sends to its peers (``(W-1)/W`` of its share's query
bytes) into its output send buffer (``Dv``-wide), and the peers' outputs and LSEs into its query
receive buffer. With ``(W-1)/W * D > Dv`` (``D = 48``, ``Dv = 16`` at two and three ranks; the DSA
dims at ten ranks or more) the queries do not fit the send buffer's own bytes: the planner's bound
of the ``out`` item and the step's workspace check must count them, and the step must stage them
in the reserved buffer, not in new tensors of every step.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from shardattn.launch.workloads import build_prefill
from shardattn.parallel.shardq import shardq_prefill
from shardattn.parallel.shardq_pipeline import check_pipeline_workspace
from shardattn.plan.pipeline import CHUNK_ALIGN, MAX_CHUNKS, pipeline_plan
from shardattn.plan.spec import ModelSpec, get_preset
from shardattn.plan.workspace import workspace_bounds
from shardattn.plan.zigzag import zigzag_split
from shardattn.runtime.options import PrefillOptions
from shardattn.runtime.runtime import Runtime
from tests.oracle import sparse_mla_oracle

CPU = torch.device("cpu")
SCALE = 0.25
#: queries wider than three times the values: (W-1)/W * D > Dv from two ranks on
WIDE_Q = ModelSpec("sparse_mla", 6, 1, 48, 16, 16, 16, dtype="float32", softmax_scale=SCALE)
SEQ, CACHED = (29, 11, 24), (5, 0, 40)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    fa = torch.isfinite(a)
    if not torch.equal(fa, torch.isfinite(b)):
        return math.inf
    return float((a[fa] - b[fa]).abs().max()) if bool(fa.any()) else 0.0


def _step(seed: int):
    return build_prefill(
        heads=WIDE_Q.num_heads, head_dim=WIDE_Q.head_dim, tokens=sum(SEQ), requests=len(SEQ), cached=CACHED,
        topk=WIDE_Q.topk, overlap="dsa", dtype=torch.float32, device=CPU, seed=seed, block_size=WIDE_Q.page_size,
    )  # fmt: skip


def _staging_body(group) -> dict:
    """One ShardQ step of a Runtime at one chunk (staged) and at two (token runs moved in place,
    nothing staged): where every message of the one-chunk step sends from and lands in, its error
    against the fp64 oracle, and whether both give the same bits."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    step = _step(seed=11)
    h = WIDE_Q.num_heads // world
    mine = slice(rank * h, (rank + 1) * h)
    results, messages = {}, []
    for chunks in (1, 2):
        options = PrefillOptions(min_shard_tokens=1, chunks=chunks, cost_model=None)
        rt = Runtime(WIDE_Q, group, max_batched_tokens=128, mode="shardq", prefill_options=options, warmup=False)
        plan = rt.plan_prefill(list(SEQ), list(CACHED), kv_rows=int(step.kv.shape[0]))
        assert plan.step == "shardq", plan
        if chunks == 1:
            lo, hi, exchange = rt.ws.arena.data_ptr(), rt.ws.arena.data_ptr() + rt.ws.arena.numel(), rt.comm.exchange

            def spy(sends, recvs, *, tag=0, exchange=exchange, lo=lo, hi=hi):
                for _, t in [*sends, *recvs]:  # the bytes a message sends from or lands in
                    messages.append(lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi)
                return exchange(sends, recvs, tag=tag)

            rt.comm.exchange = spy
        results[chunks] = rt.prefill(q=step.q[:, mine].contiguous(), kv_cache=step.kv, rows=step.rows, plan=plan)
    ref_out, ref_lse = sparse_mla_oracle(step.q, step.kv, step.rows, scale=SCALE, v_dim=WIDE_Q.v_dim)
    (out, lse), (out2, lse2) = results[1], results[2]
    return {
        "messages": messages,
        "err": max(_err(out, ref_out[:, mine]), _err(lse, ref_lse[:, mine])),
        "same_bits": torch.equal(out, out2) and torch.equal(lse, lse2),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3], ids=lambda w: f"world{w}")
def test_one_chunk_step_stages_queries_wider_than_its_send_buffer_in_the_workspace(dist_pool, world_size) -> None:
    for res in dist_pool.run(_staging_body, world_size=world_size):
        # one message per peer and tensor: queries out and in, then outputs and LSEs out and in;
        # every one sends from and lands in the Runtime's arena (a staging outside it is a new tensor)
        assert res["messages"] == [True] * 6 * (world_size - 1), res["messages"]
        assert res["err"] <= 1e-5, res["err"]
        assert res["same_bits"]  # staging moves bytes, never changes them


@pytest.mark.parametrize(
    ("spec", "world", "tokens"),
    [(WIDE_Q, 2, 100), (WIDE_Q, 3, 77), (get_preset("glm5"), 16, 32768), (get_preset("deepseek-v32"), 16, 5000)],
    ids=["48-16-world2", "48-16-world3", "glm5-world16", "dsv32-world16"],
)
def test_shardq_send_buffer_bound_counts_the_staged_queries(spec: ModelSpec, world: int, tokens: int) -> None:
    # every rank of the largest step (and a step one token short, whose shares differ) must pass the
    # step's own check on buffers of the planner's bytes, and its staged queries fit the out item
    wb = workspace_bounds(spec, max_batched_tokens=tokens, world_size=world, mode="shardq")
    dt = getattr(torch, spec.dtype)
    h = spec.num_heads // world
    for total in (tokens, tokens - 1):
        split = zigzag_split([total], world, align=wb.group_size, min_tokens=0)
        pipe = pipeline_plan(split, 1, align=wb.group_size)
        q = torch.empty(total, h, spec.head_dim, dtype=dt, device="meta")
        buffers = {
            "q": torch.empty(wb.packed_q, dtype=torch.uint8, device="meta"),
            "out": torch.empty(wb.out, dtype=torch.uint8, device="meta"),
            "lse": torch.empty(wb.lse, dtype=torch.uint8, device="meta"),
        }
        for rank in range(world):
            staged = sum(pipe.count(j, 0) for j in range(world) if j != rank) * h * spec.head_dim * dt.itemsize
            assert staged <= wb.out, (rank, staged, wb.out)
            check_pipeline_workspace(buffers, pipe, rank, q, spec.v_dim, spec.topk, False)


def _short_out_body(group) -> str:
    """A caller's workspace whose ``out`` holds the outputs but not the staged queries is refused."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    step = _step(seed=3)
    h = WIDE_Q.num_heads // world
    split = zigzag_split(list(SEQ), world, min_tokens=0, prefix_lens=list(CACHED))
    n = int(split.counts.max())
    ws = {
        "q": torch.empty(world * n * h * WIDE_Q.head_dim * 4 + 4096, dtype=torch.uint8),
        "out": torch.empty(world * n * h * WIDE_Q.v_dim * 4, dtype=torch.uint8),
        "lse": torch.empty(world * n * h * 4, dtype=torch.uint8),
    }
    try:
        shardq_prefill(
            step.q[:, rank * h : (rank + 1) * h].contiguous(), step.kv, step.rows, split, group, scale=SCALE,
            v_dim=WIDE_Q.v_dim, workspace=ws,
        )  # fmt: skip
    except ValueError as e:
        return str(e)
    return "accepted"


@pytest.mark.distributed
def test_a_workspace_out_too_small_for_the_staged_queries_is_refused(dist_pool, nproc: int) -> None:
    if nproc < 2:
        pytest.skip("needs 2 ranks; run with --nproc 2 or more")
    for msg in dist_pool.run(_short_out_body, world_size=2):
        assert "workspace['out']" in msg and "needs at least" in msg, msg


def _least_accepted(key: str, pipe, rank: int, q: torch.Tensor, v_dim: int, topk: int) -> int:
    """The fewest bytes of ``workspace[key]`` the step's own check accepts on ``rank`` (the other
    buffers ample): what the step really carves from it, found by bisection."""
    big = 1 << 40

    def accepted(nbytes: int) -> bool:
        ws = {
            k: torch.empty(nbytes if k == key else big, dtype=torch.uint8, device="meta") for k in ("q", "out", "lse")
        }
        try:
            check_pipeline_workspace(ws, pipe, rank, q, v_dim, topk, False)
        except ValueError:
            return False
        return True

    lo, hi = 0, big
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if accepted(mid) else (mid + 1, hi)
    return lo


@pytest.mark.parametrize(
    ("spec", "world", "tokens"),
    [(WIDE_Q, 2, 100), (WIDE_Q, 3, 77), (get_preset("glm5"), 16, 32768), (get_preset("deepseek-v32"), 16, 5000)],
    ids=["48-16-world2", "48-16-world3", "glm5-world16", "dsv32-world16"],
)
def test_shardq_send_and_receive_bounds_are_what_the_largest_step_carves(spec: ModelSpec, world: int, tokens: int):
    # one query per group (G = 1: no rounding of a rank's share), so the planner's out and packed_q
    # items exceed the most any rank of the largest step carves only by the alignment of the pieces
    # (a chunk's buffers, or a peer's staged piece, start on a 256-byte boundary) and one token of
    # each peer (the bound takes every peer's share at the largest, ceil(M / W))
    wb = workspace_bounds(spec, max_batched_tokens=tokens, world_size=world, mode="shardq", group_size=1)
    dt = getattr(torch, spec.dtype)
    h = spec.num_heads // world
    split = zigzag_split([tokens], world, min_tokens=0)
    pipe = pipeline_plan(split, 1)
    q = torch.empty(tokens, h, spec.head_dim, dtype=dt, device="meta")
    row = h * max(spec.head_dim * dt.itemsize, spec.v_dim * dt.itemsize + 4)
    slack = (MAX_CHUNKS + 2 * world) * CHUNK_ALIGN + (world - 1) * row
    for key, item in (("out", wb.out), ("q", wb.packed_q)):
        need = max(_least_accepted(key, pipe, r, q, spec.v_dim, spec.topk) for r in range(world))
        assert need <= item <= need + slack, (key, need, item)
