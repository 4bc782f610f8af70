"""A GQA Runtime driven like an inference engine drives it: DCP decode steps of planned batches, graph
buckets (run eagerly on the CPU) and plain lengths, head-TP decode with drafts and sliding windows,
head-TP and PCP prefills in between, each step of another shape (batches of 0 to 5 requests in any
order, requests without queries or keys, drafts), every output and LSE compared with an fp64 oracle
written from the contracts (``tests/test_runtime_long_run.py`` holds the sparse-MLA runs).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from shardattn.parallel.gqa_head_tp import head_tp_kv_heads
from shardattn.plan.dcp_shard import shard_kv_cache
from shardattn.plan.spec import ModelSpec
from shardattn.runtime.graphs import DecodeGraphs
from shardattn.runtime.options import DecodeOptions
from shardattn.runtime.runtime import Runtime
from tests.test_runtime_long_run import REQUESTS, SCALE, _attend, _err

GQA = ModelSpec("gqa", 6, 2, 8, 8, 0, 4, has_sinks=True, dtype="float32", softmax_scale=0.5)


def _gqa_want(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    seq: list[int],
    qlens: list[int],
    sinks: np.ndarray,
    *,
    causal: bool = True,
    window: int = -1,
) -> tuple[np.ndarray, np.ndarray]:
    """Every query of every request (request order) over its request's keys ``k [B, L, Hkv, D]``:
    query ``j`` of request ``b`` (of ``qlens[b]``) sits at ``p = seq[b] - qlens[b] + j`` and sees keys
    ``[max(0, p - window), p]`` (``window`` -1: from 0; not causal: every key of the request); query
    head ``h`` reads KV head ``h // (Hq / Hkv)``; a request without keys is ``(0, -inf)``, sinks or not."""
    t, hq, d = q.shape
    group = hq // k.shape[2]
    out, lse = np.zeros((t, hq, d)), np.full((t, hq), -math.inf)
    row = 0
    for b, (n_keys, n_q) in enumerate(zip(seq, qlens)):
        for j in range(n_q):
            p = n_keys - n_q + j
            keys = list(range(max(0, p - window) if window >= 0 else 0, p + 1 if causal else n_keys))
            for h in range(hq if n_keys else 0):
                kv = np.concatenate([k[b, :, h // group], v[b, :, h // group]], axis=1)
                o, s = _attend(q[row, h : h + 1], kv, keys, d, SCALE, sinks[h : h + 1])
                out[row, h], lse[row, h] = o[0], s[0]
            row += 1
    return out, lse


def _gqa_prefill(rt: Runtime, gen: torch.Generator, k, v, kc, vc, table, sinks, rank: int, world: int) -> tuple:
    """One GQA prefill step of the mode (head-TP or PCP): its outputs and the oracle's, the rank's part."""
    cap = k.shape[1]
    n = int(torch.randint(1, REQUESTS + 1, (), generator=gen))
    batch = torch.randperm(REQUESTS, generator=gen)[:n].tolist()
    qlens = [int(x) for x in torch.randint(1, 6, (n,), generator=gen)]
    seq = [int(torch.randint(ql, cap + 1, (), generator=gen)) for ql in qlens]
    prefix = [s - ql for s, ql in zip(seq, qlens)]
    q = torch.randn(sum(qlens), GQA.num_heads, GQA.head_dim, generator=gen)
    idx = [(b, seq[j] - qlens[j] + x) for j, b in enumerate(batch) for x in range(qlens[j])]
    plan = rt.plan_prefill(qlens, prefix)
    want_out, want_lse = _gqa_want(
        q.double().numpy(), k[batch].double().numpy(), v[batch].double().numpy(), seq, qlens,
        sinks.double().numpy(),
    )  # fmt: skip
    if plan.step == "pcp":
        mine = plan.tokens_of(rank)
        kv_new = tuple(torch.stack([c[b, p] for b, p in idx])[mine] for c in (k, v))
        out, lse = rt.prefill(q[mine], (kc, vc), kv_new=kv_new, block_table=table[batch], plan=plan, sinks=sinks)
        return out, lse, want_out[mine.numpy()], want_lse[mine.numpy()]
    h = GQA.num_heads // world
    lo, hi = head_tp_kv_heads(GQA.num_heads, GQA.num_kv_heads, world, rank)
    out, lse = rt.prefill(
        q[:, rank * h : (rank + 1) * h].contiguous(), (kc[:, :, lo:hi].contiguous(), vc[:, :, lo:hi].contiguous()),
        block_table=table[batch], plan=plan, sinks=sinks,
    )  # fmt: skip
    return out, lse, want_out[:, rank * h : (rank + 1) * h], want_lse[:, rank * h : (rank + 1) * h]


def _gqa_body(group, mode: str, causal: bool, steps: int, seed: int) -> dict:
    """``steps`` steps of a DCP-decode GQA Runtime (its prefill every fourth, where the mode has one):
    decode through graph buckets, planned batches (two layers a plan) and lengths in turn."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    rt = Runtime(
        GQA, group, mode=mode, max_batched_tokens=32, max_decode_tokens=12, scale=SCALE,
        decode_options=DecodeOptions(dcp_interleave=2, causal=causal),
    )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    page, pages = GQA.page_size, 6
    cap = page * pages
    k = torch.randn(REQUESTS, cap, GQA.num_kv_heads, GQA.head_dim, generator=gen)
    v = torch.randn(REQUESTS, cap, GQA.num_kv_heads, GQA.head_dim, generator=gen)
    table = torch.randperm(REQUESTS * pages, generator=gen).to(torch.int32).view(REQUESTS, pages)
    kc = torch.zeros(REQUESTS * pages, page, GQA.num_kv_heads, GQA.head_dim)
    vc = torch.zeros_like(kc)
    kc[table.long()] = k.view(REQUESTS, pages, page, *k.shape[2:])
    vc[table.long()] = v.view(REQUESTS, pages, page, *v.shape[2:])
    full = torch.full((REQUESTS,), cap, dtype=torch.int32)
    (lk, lv), ltable = shard_kv_cache((kc, vc), table, full, rt.layout, rank)
    sinks = torch.randn(GQA.num_heads, generator=gen)
    graphs = DecodeGraphs(rt, (lk, lv), batch_sizes=[1, 2, 4], q_len=3, max_pages=ltable.shape[1], sinks=sinks,
                          capture=False)  # fmt: skip
    h = GQA.num_heads // world
    bad = []
    for i in range(steps):
        if mode != "dcp-decode" and i % 4 == 1:
            out, lse, want_out, want_lse = _gqa_prefill(rt, gen, k, v, kc, vc, table, sinks, rank, world)
            err = max(_err(out, want_out), 0.0 if lse is None else _err(lse, want_lse))
            if not err <= 2e-5:
                bad.append((err, "prefill", i))
            continue
        n = int(torch.randint(0, REQUESTS + 1, (), generator=gen))
        batch = torch.randperm(REQUESTS, generator=gen)[:n].tolist()
        drafts = [int(x) for x in torch.randint(1, 4, (n,), generator=gen)]
        seq = [int(torch.randint(d, cap + 1, (), generator=gen)) for d in drafts]
        if n and i % 5 == 0:
            seq[0], drafts[0] = 0, 0  # a request without keys or queries
        while sum(drafts) > rt.max_decode_tokens:
            drafts[drafts.index(max(drafts))] -= 1
        cu = np.cumsum([0, *drafts]).tolist()
        q = torch.randn(sum(drafts), GQA.num_heads, GQA.head_dim, generator=gen)
        mine = q[:, rank * h : (rank + 1) * h].contiguous()
        how = ("graphs", "planned", "lists")[i % 3]
        if how == "graphs":
            out, lse = graphs(mine, ltable[batch], seq, cu)
        elif how == "planned":
            plan = rt.decode_step.plan(seq, cu)
            for layer in range(2):  # the plan's metadata is reused by the later layer
                out, lse = rt.decode(mine, (lk, lv), ltable[batch], plan.seq_lens, batch=plan, sinks=sinks,
                                     check=layer == 0)  # fmt: skip
        else:
            out, lse = rt.decode(mine, (lk, lv), ltable[batch], seq, cu_q_lens=cu, sinks=sinks)
        assert lse is not None
        want_out, want_lse = _gqa_want(
            q.double().numpy(), k[batch].double().numpy(), v[batch].double().numpy(), seq, drafts,
            sinks.double().numpy(), causal=causal,
        )  # fmt: skip
        err = max(_err(out, want_out[:, rank * h : (rank + 1) * h]), _err(lse, want_lse[:, rank * h : (rank + 1) * h]))
        if not err <= 2e-5:
            bad.append((err, how, batch, seq, drafts))
    return {"bad": bad}


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("mode", "causal"), [("dcp-decode", True), ("dcp-decode", False), ("pcp", True), ("mixed", True)], ids=str
)
def test_long_gqa_dcp_run_matches_the_oracle_at_every_step(dist_pool, mode: str, causal: bool) -> None:
    for rank, res in enumerate(dist_pool.run(_gqa_body, mode, causal, 30, 5, world_size=2)):
        assert not res["bad"], (rank, res["bad"])


def _gqa_headtp_body(group, steps: int, seed: int) -> dict:
    """``steps`` steps of a head-TP GQA Runtime: prefills (new keys beside the cache or in it) and
    decodes of uniform and ragged drafts, each with its own sliding window."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    rt = Runtime(GQA, group, mode="headtp", max_batched_tokens=32, max_decode_tokens=16, scale=SCALE)
    gen = torch.Generator().manual_seed(seed)
    page, pages = GQA.page_size, 6
    cap = page * pages
    hkv = GQA.num_kv_heads
    k = torch.randn(REQUESTS, cap, hkv, GQA.head_dim, generator=gen)
    v = torch.randn(REQUESTS, cap, hkv, GQA.head_dim, generator=gen)
    table = torch.randperm(REQUESTS * pages, generator=gen).to(torch.int32).view(REQUESTS, pages)
    kc = torch.zeros(REQUESTS * pages, page, hkv, GQA.head_dim)
    vc = torch.zeros_like(kc)
    kc[table.long()] = k.view(REQUESTS, pages, page, hkv, -1)
    vc[table.long()] = v.view(REQUESTS, pages, page, hkv, -1)
    lo, hi = rt.decode_step.kv_heads
    mine_k, mine_v = kc[:, :, lo:hi].contiguous(), vc[:, :, lo:hi].contiguous()
    sinks = torch.randn(GQA.num_heads, generator=gen)
    h = GQA.num_heads // world
    bad = []
    for i in range(steps):
        n = int(torch.randint(1, REQUESTS + 1, (), generator=gen))
        batch = torch.randperm(REQUESTS, generator=gen)[:n].tolist()
        window = int(torch.randint(-1, 6, (), generator=gen))
        prefill = i % 3 == 0
        most = 6 if prefill else 3
        qlens = [int(x) for x in torch.randint(1, most + 1, (n,), generator=gen)]
        if not prefill and i % 2:
            qlens = [qlens[0]] * n  # uniform drafts: q_len_per_req
        seq = [int(torch.randint(ql, cap + 1, (), generator=gen)) for ql in qlens]
        cu = np.cumsum([0, *qlens]).tolist()
        q = torch.randn(sum(qlens), GQA.num_heads, GQA.head_dim, generator=gen)
        mine = q[:, rank * h : (rank + 1) * h].contiguous()
        if prefill:
            new = bool(i % 2)  # the new tokens' keys passed beside the cache, or written in it already
            kv_new = None
            if new:
                idx = [(b, seq[j] - qlens[j] + x) for j, b in enumerate(batch) for x in range(qlens[j])]
                kv_new = tuple(torch.stack([c[b, p, lo:hi] for b, p in idx]) for c in (k, v))
            prefix = [s - ql for s, ql in zip(seq, qlens)]
            out, lse = rt.prefill(
                mine, (mine_k, mine_v), kv_new=kv_new, block_table=table[batch], query_lens=qlens,
                prefix_lens=prefix, window_left=window, sinks=sinks,
            )  # fmt: skip
        elif i % 2:
            out, lse = rt.decode(
                mine, (mine_k, mine_v), table[batch], seq, q_len_per_req=qlens[0], window_left=window, sinks=sinks
            )
        else:
            out, lse = rt.decode(
                mine, (mine_k, mine_v), table[batch], seq, cu_q_lens=cu, max_q_len=max(qlens), window_left=window,
                sinks=sinks,
            )  # fmt: skip
        assert lse is not None
        want_out, want_lse = _gqa_want(
            q.double().numpy(), k[batch].double().numpy(), v[batch].double().numpy(), seq, qlens,
            sinks.double().numpy(), window=window,
        )  # fmt: skip
        err = max(_err(out, want_out[:, rank * h : (rank + 1) * h]), _err(lse, want_lse[:, rank * h : (rank + 1) * h]))
        if not err <= 2e-5:
            bad.append((err, i, prefill, batch, seq, qlens, window))
    return {"bad": bad}


@pytest.mark.distributed
def test_long_gqa_headtp_run_matches_the_oracle_at_every_step(dist_pool) -> None:
    for rank, res in enumerate(dist_pool.run(_gqa_headtp_body, 30, 9, world_size=2)):
        assert not res["bad"], (rank, res["bad"])


def _slot_table_body(group) -> dict:
    """A planned DCP GQA decode of drafts given one block-table row per query slot (the step accepts
    a table of the plan's request slots or of its query slots)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    rt = Runtime(GQA, group, mode="dcp-decode", max_batched_tokens=16, max_decode_tokens=12, scale=SCALE)
    gen = torch.Generator().manual_seed(3)
    page, pages, hkv = GQA.page_size, 4, GQA.num_kv_heads
    k, v = (torch.randn(3, page * pages, hkv, GQA.head_dim, generator=gen) for _ in range(2))
    table = torch.randperm(3 * pages, generator=gen).to(torch.int32).view(3, pages)
    kc, vc = (torch.zeros(3 * pages, page, hkv, GQA.head_dim) for _ in range(2))
    kc[table.long()], vc[table.long()] = k.view(3, pages, page, hkv, -1), v.view(3, pages, page, hkv, -1)
    sinks = torch.randn(GQA.num_heads, generator=gen)
    h = GQA.num_heads // world
    errors = {}
    for seq, drafts, padded in (
        ([9, 13], [2, 1], None),
        ([9, 13], [1, 2], 3),
        ([7, 5, 14], [1, 0, 3], 3),
        ([7, 5, 14], [1, 0, 1], None),
    ):
        (lk, lv), lt = shard_kv_cache((kc[: 3 * pages], vc[: 3 * pages]), table[: len(seq)], seq, rt.layout, rank)
        cu = np.cumsum([0, *drafts]).tolist()
        q = torch.randn(cu[-1], GQA.num_heads, GQA.head_dim, generator=gen)
        want_out, want_lse = _gqa_want(
            q.double().numpy(), k[: len(seq)].double().numpy(), v[: len(seq)].double().numpy(), seq, drafts,
            sinks.double().numpy(),
        )  # fmt: skip
        plan = rt.decode_step.plan(seq, cu, q_len=None if padded is None else max(drafts), padded_requests=padded)
        slot_req = plan.meta[1].long()  # the request of every query slot (padded slots: a padded request's)
        slot_table = torch.cat([lt, lt[:1].expand(plan.padded_requests - len(seq), -1)])[slot_req]
        assert slot_table.shape[0] == plan.num_slots != plan.padded_requests
        mine = q[:, rank * h : (rank + 1) * h].contiguous()
        mine = mine if plan.identity_rows else plan.pad_rows(mine)
        try:
            out, lse = rt.decode(mine, (lk, lv), slot_table, seq, batch=plan, sinks=sinks)
        except ValueError as e:
            errors[str(drafts)] = str(e)
            continue
        assert lse is not None
        out, lse = plan.real_rows(out), plan.real_rows(lse)
        errors[str(drafts)] = max(
            _err(out, want_out[:, rank * h : (rank + 1) * h]), _err(lse, want_lse[:, rank * h : (rank + 1) * h])
        )
    return errors


@pytest.mark.distributed
def test_planned_dcp_gqa_decode_reads_a_block_table_of_query_slots(dist_pool) -> None:
    """The planned step takes a table of one row per request slot or one per query slot; with drafts
    (more query slots than requests) a table of query slots raised, naming seq_lens."""
    for rank, res in enumerate(dist_pool.run(_slot_table_body, world_size=2)):
        assert all(isinstance(e, float) and e <= 2e-5 for e in res.values()), (rank, res)
