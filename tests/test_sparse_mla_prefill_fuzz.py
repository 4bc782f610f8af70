"""Sparse-MLA prefill as a user calls it, on fresh random steps, against a small fp64 oracle of its own.

Every query attends to its own top-k KV rows: an entry counts when it is a row of the cache (ShardQ /
head-TP: ``0 <= row < R``; PCP: a position inside its request's cached prefix and new tokens), lies
before ``topk_length``, and was not listed earlier by the same query; sinks add to the denominator.
The steps hold junk anywhere in a row, rows with no valid key, duplicates, ``topk_length`` of 0 and
past K, requests with no new token, token counts that are no multiple of the ranks, ranks owning no
token, sinks or none, non-contiguous queries, cached prefixes, and ``fp8_ds_mla`` caches (the oracle
then reads the rows as tests/fp8_oracle.py decodes them).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist

from shardattn.ops.kv_fp8 import quantize_kv
from shardattn.ops.sparse_mla import sparse_mla_attention
from shardattn.plan.routing import Route
from shardattn.plan.spec import ModelSpec
from shardattn.runtime.options import PrefillOptions
from shardattn.runtime.runtime import Runtime
from tests.fp8_oracle import fp8_rows_decode

SCALE = 0.37
SMALL = ModelSpec("sparse_mla", 12, 1, 48, 32, 9, 4, dtype="float32", softmax_scale=SCALE)
FP8 = ModelSpec("sparse_mla", 12, 1, 576, 512, 9, 4, dtype="float32", softmax_scale=SCALE)
# (query_lens, prefix_lens): requests with no new token, few tokens (a rank owning none), tails
STEPS = [
    ([3, 0, 4], [2, 5, 0]), ([1], [0]), ([0, 2], [3, 1]), ([5, 1, 0, 3], [0, 0, 9, 4]), ([2, 0], [6, 0]),
    ([2, 3], [0, 0]),
]  # fmt: skip


def oracle(q, kv, rows, *, v_dim, topk_length=None, sinks=None):
    """fp64 loops: ``(out [T, H, v_dim], lse [T, H])`` of each query over its own distinct valid rows."""
    q, kv = q.double(), kv.double()
    t_count, heads, _ = q.shape
    out = torch.zeros(t_count, heads, v_dim, dtype=torch.float64)
    lse = torch.full((t_count, heads), -math.inf, dtype=torch.float64)
    for t in range(t_count):
        keys: list[int] = []
        for k, r in enumerate(rows[t].tolist()):
            if topk_length is not None and k >= int(topk_length[t]):
                break
            if 0 <= r < kv.shape[0] and r not in keys:
                keys.append(r)
        for h in range(heads):
            logits = [float(q[t, h] @ kv[r]) * SCALE for r in keys]
            terms = logits + ([float(sinks[h])] if sinks is not None else [])
            if not terms:
                continue
            m = max(terms)
            z = sum(math.exp(x - m) for x in terms)
            lse[t, h] = m + math.log(z)
            for r, x in zip(keys, logits):
                out[t, h] += math.exp(x - m) / z * kv[r, :v_dim]
    return out, lse


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(fa, fb) or not torch.equal(a[~fa], b[~fb]):
        return math.inf
    return float((a[fa] - b[fa]).abs().max()) if bool(fa.any()) else 0.0


@pytest.mark.parametrize("seed", range(4))
def test_op_matches_the_oracle_on_junk(seed: int) -> None:
    """The op itself: junk of every kind, duplicates, ``topk_length`` negative, 0 and past K, empty
    caches and empty rows, sinks or none, split and non-contiguous queries."""
    g = torch.Generator().manual_seed(seed)
    for case in range(40):
        t, h, r, k = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((0, 6), (1, 4), (0, 9), (0, 7)))
        v = int(torch.randint(1, 13, (1,), generator=g))
        q = torch.randn(t, h, 15, generator=g)[..., 1:13]
        kv = torch.randn(r, 12, generator=g)
        rows = torch.randint(-3, r + 3, (t, k), generator=g, dtype=torch.int32)
        rows[rows == -3] = -(2**31)
        length = torch.randint(-2, k + 3, (t,), generator=g, dtype=torch.int32) if case % 2 else None
        sinks = torch.randn(h, generator=g) if case % 4 < 2 else None
        want_out, want_lse = oracle(q, kv, rows, v_dim=v, topk_length=length, sinks=sinks)
        for q_arg in (q, (q[..., :8], q[..., 8:])):
            out, lse = sparse_mla_attention(q_arg, kv, rows, scale=SCALE, v_dim=v, topk_length=length, sinks=sinks)
            assert max(_err(out, want_out), _err(lse, want_lse)) <= 1e-5, (seed, case)


def make_step(spec: ModelSpec, query_lens, prefix_lens, seed: int, fp8: bool):
    """A paged cache holding every request's prefix and new tokens, the new tokens' queries, their
    top-k positions (junk, duplicates, past the request) and the rows the positions name."""
    g = torch.Generator().manual_seed(seed)
    page, d = spec.page_size, spec.head_dim
    lens = [p + n for p, n in zip(prefix_lens, query_lens)]
    width = max(1, max(-(-n // page) for n in lens))
    pages = torch.randperm(len(lens) * width + 3, generator=g)[: len(lens) * width].view(len(lens), width)
    table = pages.to(torch.int32)
    r = (len(lens) * width + 3) * page
    kv = torch.randn(r, d, generator=g)
    if fp8:
        cache = quantize_kv(kv)
        kv = torch.from_numpy(fp8_rows_decode(cache.numpy())).double()
    else:
        cache = kv
    t = sum(query_lens)
    req = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(query_lens)).to(torch.int32)
    k = spec.topk
    pos = torch.randint(-2, max(lens, default=1) + 3, (t, k), generator=g, dtype=torch.int32)
    pos[:, 1] = pos[:, 0]  # a duplicate in every row
    if t:
        pos[0] = -1  # a query with no valid key
    rows = torch.full((t, k), -1, dtype=torch.int32)
    for i in range(t):
        b = int(req[i])
        for j, p in enumerate(pos[i].tolist()):
            if 0 <= p < lens[b]:
                rows[i, j] = int(table[b, p // page]) * page + p % page
            else:
                rows[i, j] = [-1, r, r + 7, -(2**31)][j % 4]  # junk of every kind
    length = torch.randint(0, k + 3, (t,), generator=g, dtype=torch.int32)
    if t > 1:
        length[1] = 0
    q = torch.randn(t, spec.num_heads, d + 2, generator=g)[..., 1:-1]  # non-contiguous
    sinks = torch.randn(spec.num_heads, generator=g)
    starts = torch.tensor([0, *query_lens]).cumsum(0)[:-1]
    new_pos = torch.tensor(prefix_lens)[req.long()] + torch.arange(t) - starts[req.long()]
    new_rows = table.long()[req.long(), new_pos // page] * page + new_pos % page
    return dict(q=q, cache=cache, kv=kv, rows=rows, pos=pos, table=table, length=length, sinks=sinks,
                new_rows=new_rows)  # fmt: skip


#: pipeline options and routes of a step: the planner's, a pipelined ShardQ step, a forced grouped route
VARIANTS = {
    "plain": ({}, None),
    "pipelined": ({"chunks": 3, "taper": True, "one_union": True}, None),
    "grouped4": ({"chunks": 2}, Route("grouped", 4, "forced, as on a GPU")),
    "per-query": ({}, Route("per-query", 1, "forced, as on a GPU")),
}


def _body(group, mode: str, fp8: bool, sinks_on: bool, with_length: bool, steps, variant: str = "plain") -> list[str]:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    spec = dataclasses.replace(FP8 if fp8 else SMALL, has_sinks=sinks_on)
    heads = spec.num_heads // world if mode != "pcp" else spec.num_heads
    options, route = VARIANTS[variant]
    rt = Runtime(
        spec, group, max_batched_tokens=64, mode=mode, prefill_options=PrefillOptions(min_shard_tokens=1, **options),
        kv_dtype="fp8_ds_mla" if fp8 else None, warmup=False,
    )  # fmt: skip
    bad = []
    for i, (ql, pl) in enumerate(steps):
        s = make_step(spec, ql, pl, seed=100 * i + world, fp8=fp8)
        length = s["length"] if with_length else None
        sinks = s["sinks"] if sinks_on else None
        want_out, want_lse = oracle(s["q"], s["kv"], s["rows"], v_dim=spec.v_dim, topk_length=length, sinks=sinks)
        paged = s["cache"].view(-1, spec.page_size, s["cache"].shape[-1])  # the same rows as pages
        cache_arg = paged if i % 2 else s["cache"]
        plan = rt.plan_prefill(ql, pl)
        if route is not None:
            plan = dataclasses.replace(plan, route=route)
        if plan.step == "pcp":
            mine = plan.tokens_of(rank)
            cache = s["cache"]
            no_prefix = not any(pl) and i % 2 == 1  # no cached prefix: no cache, no block table
            form = {"plan": plan} if i % 3 else {"query_lens": ql, "prefix_lens": pl}
            out, lse = rt.prefill(
                s["q"][mine], None if no_prefix else cache_arg, topk_pos=s["pos"][mine],
                kv_new=cache[s["new_rows"][mine]], block_table=None if no_prefix else s["table"],
                topk_length=None if length is None else length[mine], sinks=sinks, **form,
            )  # fmt: skip
            want_out, want_lse = want_out[mine], want_lse[mine]
        else:
            h0 = rank * heads
            q = s["q"][:, h0 : h0 + heads]
            forms = [dict(query_lens=ql, prefix_lens=pl), dict(query_lens=ql, seq_lens=[a + b for a, b in zip(ql, pl)])]
            form = forms[i % 2] if route is None else {"plan": plan}
            out, lse = rt.prefill(q, cache_arg, s["rows"], topk_length=length, sinks=sinks, **form)
            want_out, want_lse = want_out[:, h0 : h0 + heads], want_lse[:, h0 : h0 + heads]
        err = max(_err(out, want_out), _err(lse, want_lse))
        if not err <= 1e-4:
            bad.append(f"step {i} {ql} {pl} ({plan.step}): err {err}")
    return bad


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2, 3, 4], ids=lambda w: f"world{w}")
@pytest.mark.parametrize("mode", ["shardq", "headtp", "pcp", "mixed"])
@pytest.mark.parametrize(("sinks_on", "with_length"), [(False, False), (True, True), (False, True)])
def test_prefill_matches_the_oracle(dist_pool, world_size, mode, sinks_on, with_length) -> None:
    results = dist_pool.run(_body, mode, False, sinks_on, with_length, STEPS, world_size=world_size)
    assert results == [[]] * world_size


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3, 4], ids=lambda w: f"world{w}")
@pytest.mark.parametrize("mode", ["shardq", "pcp"])
@pytest.mark.parametrize("variant", ["pipelined", "grouped4", "per-query"])
def test_pipelined_and_routed_prefill_matches_the_oracle(dist_pool, world_size, mode, variant) -> None:
    results = dist_pool.run(_body, mode, False, True, True, STEPS, variant, world_size=world_size)
    assert results == [[]] * world_size


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 3, 4], ids=lambda w: f"world{w}")
@pytest.mark.parametrize("mode", ["shardq", "headtp", "pcp"])
def test_fp8_prefill_matches_the_oracle_on_the_decoded_rows(dist_pool, world_size, mode) -> None:
    results = dist_pool.run(_body, mode, True, True, True, STEPS[:3], world_size=world_size)
    assert results == [[]] * world_size


# -- bad input on one rank ------------------------------------------------------------------------
BAD_ROWS = {
    "rows-float": lambda s: {"rows": s["rows"].float()},
    "rows-short": lambda s: {"rows": s["rows"][:-1]},
    "topk_length-float": lambda s: {"topk_length": s["length"].float()},
    "topk_length-short": lambda s: {"topk_length": s["length"][:-1]},
    "topk_length-huge": lambda s: {"topk_length": s["length"].long() + 2**40},
    "rows-huge": lambda s: {"rows": s["rows"].long() + 2**40},
    "kv_cache-fp16": lambda s: {"kv_cache": s["cache"].half()},
    "kv_cache-narrow": lambda s: {"kv_cache": s["cache"][:, :-1]},
    "sinks-fp16": lambda s: {"sinks": s["sinks"].half()},
    "sinks-short": lambda s: {"sinks": s["sinks"][:-1]},
    "q-wide": lambda s: {"q": torch.cat([s["q"], s["q"][..., :1]], -1)},
}
BAD_PCP = {
    **{k: v for k, v in BAD_ROWS.items() if not k.startswith("rows")},
    "topk_pos-float": lambda s: {"topk_pos": s["pos"].float()},
    "topk_pos-short": lambda s: {"topk_pos": s["pos"][:-1]},
    "topk_pos-huge": lambda s: {"topk_pos": s["pos"].long() - 2**40},
    "kv_new-short": lambda s: {"kv_new": s["kv_new"][:-1]},
    "kv_new-fp16": lambda s: {"kv_new": s["kv_new"].half()},
    "block_table-float": lambda s: {"block_table": s["table"].float()},
    "block_table-past": lambda s: {"block_table": s["table"] + 1000},
}


def _bad_body(group, mode: str, fp8: bool, bad: str) -> tuple[str, str]:
    from tests.parallel_helpers import short_timeout_group

    group = short_timeout_group(group, 5.0)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    spec = dataclasses.replace(FP8 if fp8 else SMALL, has_sinks=True)
    rt = Runtime(
        spec, group, max_batched_tokens=64, mode=mode, prefill_options=PrefillOptions(min_shard_tokens=1),
        kv_dtype="fp8_ds_mla" if fp8 else None, warmup=False,
    )  # fmt: skip
    ql, pl = STEPS[0]
    s = make_step(spec, ql, pl, seed=3, fp8=fp8)
    plan = rt.plan_prefill(ql, pl)
    if mode == "pcp":
        mine = plan.tokens_of(rank)
        s = {**s, "q": s["q"][mine], "pos": s["pos"][mine], "length": s["length"][mine],
             "kv_new": s["cache"][s["new_rows"][mine]]}  # fmt: skip
        args = dict(q=s["q"], kv_cache=s["cache"], topk_pos=s["pos"], kv_new=s["kv_new"], block_table=s["table"],
                    topk_length=s["length"], sinks=s["sinks"])  # fmt: skip
        table = BAD_PCP
    else:
        h = spec.num_heads // world
        s = {**s, "q": s["q"][:, rank * h : (rank + 1) * h]}
        args = dict(q=s["q"], kv_cache=s["cache"], rows=s["rows"], topk_length=s["length"], sinks=s["sinks"])
        table = BAD_ROWS
    if rank == 1:
        args.update(table[bad](s))
    try:
        q = args.pop("q")
        rt.prefill(q, args.pop("kv_cache"), plan=plan, **args)
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)
    except Exception as e:
        return "unexpected", f"{type(e).__name__}: {e}"
    return "ok", ""


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("mode", "fp8", "bad"),
    [("shardq", False, b) for b in BAD_ROWS]
    + [("pcp", False, b) for b in BAD_PCP]
    + [("shardq", True, b) for b in ("kv_cache-fp16", "kv_cache-narrow", "rows-huge")]
    + [("pcp", True, b) for b in ("kv_new-fp16", "kv_new-short", "kv_cache-fp16", "block_table-past")],
)
def test_a_bad_argument_on_one_rank_is_named_on_every_rank(dist_pool, mode, fp8, bad) -> None:
    results = dist_pool.run(_bad_body, mode, fp8, bad, world_size=4)
    name = bad.split("-")[0]
    assert results[1][0] in ("TypeError", "ValueError") and name in results[1][1], results[1]
    for r in (0, 2, 3):
        assert results[r][0] == "ValueError" and "rank(s) [1] of 4 rejected their inputs" in results[r][1], results[r]
