"""Property tests of the GQA ops against an fp64 oracle written here from their contracts.

Hypothesis draws varlen batches (zero-length requests, cached prefixes, speculative drafts),
paged caches with pages of 1..64 tokens and block tables whose unused entries are ``-1``,
sliding windows, sinks, a custom scale and fp32 / fp16 / bf16 inputs; each case runs the op on
the CPU and compares its output and natural-log LSE with the oracle: the softmax over exactly the
keys a query may see, ``(0, -inf)`` for a query that sees none (``(0, sink)`` with sinks).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardattn.ops.gqa_decode import gqa_paged_decode
from shardattn.ops.gqa_prefill import gqa_prefill
from shardattn.parallel.comm import Comm
from shardattn.parallel.dcp_gqa import dcp_gqa_decode
from shardattn.parallel.gqa_head_tp import gqa_prefill_head_tp, head_tp_kv_heads
from shardattn.parallel.gqa_prefill import gqa_prefill_pcp
from shardattn.plan import pcp_plan
from shardattn.plan.context import DCPLayout
from shardattn.plan.decode_batch import plan_decode_batch
from shardattn.plan.spec import ModelSpec
from shardattn.runtime.runtime import Runtime

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ATOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def oracle_row(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, sink: float | None):
    """fp64 ``(out [D], lse)`` of one query head over its visible ``keys``, ``values [n, D]``."""
    logits = (keys.double() @ q.double()) * scale
    if sink is not None:
        logits = torch.cat([logits, torch.tensor([sink], dtype=torch.float64)])
    if logits.numel() == 0:
        return torch.zeros(values.shape[-1], dtype=torch.float64), -math.inf
    lse = torch.logsumexp(logits, 0)
    p = torch.exp(logits - lse)[: keys.shape[0]]
    return p @ values.double(), float(lse)


def oracle(q, key_of, value_of, visible, hkv: int, scale: float, sinks):
    """``(out [T, H, D], lse [T, H])`` fp64: query row ``i`` sees positions ``visible(i)``, whose
    keys / values of KV head ``g`` are ``key_of(i, pos, g)`` / ``value_of(i, pos, g)``."""
    t, h, d = q.shape
    group = h // hkv
    out = torch.zeros(t, h, d, dtype=torch.float64)
    lse = torch.full((t, h), -math.inf, dtype=torch.float64)
    for i in range(t):
        pos = visible(i)
        if pos is None:
            continue  # a row of no request: (0, -inf) whatever the sinks
        for hh in range(h):
            g = hh // group
            keys, values = key_of(i, pos, g), value_of(i, pos, g)
            sink = None if sinks is None else float(sinks[hh])
            out[i, hh], lse[i, hh] = oracle_row(q[i, hh], keys, values, scale, sink)
    return out, lse


def assert_matches(out, lse, ref_out, ref_lse, dtype):
    assert out.shape == ref_out.shape and out.dtype == dtype
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), (lse, ref_lse)
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin].double(), ref_lse[fin], atol=ATOL[dtype] * 10, rtol=0)
    torch.testing.assert_close(out.double(), ref_out, atol=ATOL[dtype] * 4, rtol=ATOL[dtype] * 4)


def paged_cache(draw, lens: list[int], page: int, hkv: int, d: int, dtype: torch.dtype, gen: torch.Generator):
    """A shuffled paged cache and block table holding ``lens[b]`` positions of request ``b``;
    entries past them are ``-1``. Returns ``(k_cache, v_cache, table, pos_rows)`` where
    ``pos_rows(b, pos)`` gives the flat cache rows of positions ``pos``."""
    need = [-(-n // page) for n in lens]
    width = max(need, default=0) + draw(st.integers(0, 2))
    num_pages = sum(need) + draw(st.integers(0, 2))
    perm = torch.randperm(max(num_pages, 1), generator=gen)
    table = torch.full((len(lens), max(width, 1)), -1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at : at + n].int()
        at += n
    shape = (max(num_pages, 1), page, hkv, d)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)

    def rows(b: int, pos: torch.Tensor) -> torch.Tensor:
        return table[b, pos // page].long() * page + pos % page

    return k_cache, v_cache, table, rows


@st.composite
def heads(draw):
    hkv = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 2, 4]))
    return hkv * group, hkv, draw(st.sampled_from([4, 8, 16]))


@FUZZ
@given(data=st.data())
def test_decode_equals_fp64_oracle(data) -> None:
    draw = data.draw
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    h, hkv, d = draw(heads())
    page = draw(st.sampled_from([1, 2, 3, 7, 16, 64]))
    batch = draw(st.integers(0, 4))
    q_lens = [draw(st.integers(0, 4)) for _ in range(batch)]
    lens = [draw(st.integers(0, 70)) for _ in range(batch)]
    lens = [0 if n == 0 else max(n, ql) for n, ql in zip(lens, q_lens)]
    ragged = draw(st.booleans())
    if not ragged:  # uniform drafts: every request the same queries
        ql = draw(st.integers(1, 4))
        q_lens = [ql] * batch
        lens = [0 if n == 0 else max(n, ql) for n in lens]
    causal = draw(st.booleans())
    window = draw(st.sampled_from([-1, -1, 0, 1, 2, 5, 17, 100]))
    extra = draw(st.integers(0, 2)) if ragged else 0
    scale = draw(st.sampled_from([None, 0.05, 0.7, 2.0]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    k_cache, v_cache, table, rows = paged_cache(draw, lens, page, hkv, d, dtype, gen)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    total = cu[-1] + extra
    q = torch.randn(total, h, d, generator=gen).to(dtype)
    sinks = torch.randn(h, generator=gen) * 3 if draw(st.booleans()) else None
    used = d**-0.5 if scale is None else scale

    owner = {}
    for b in range(batch):
        for j in range(cu[b], cu[b + 1]):
            owner[j] = (b, j - cu[b])

    def visible(i: int):
        if i not in owner:
            return None
        b, j = owner[i]
        if lens[b] == 0:
            return None  # a padded request: (0, -inf) even with sinks
        p = lens[b] - q_lens[b] + j
        hi = p + 1 if causal else lens[b]
        lo = max(0, p - window) if window >= 0 else 0
        return b, torch.arange(lo, hi)

    kf, vf = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    ref_out, ref_lse = oracle(
        q, lambda i, bp, g: kf[rows(*bp), g], lambda i, bp, g: vf[rows(*bp), g], visible, hkv, used, sinks
    )
    uniform = q_lens[0] if batch else 1
    kw = dict(cu_q_lens=torch.tensor(cu, dtype=torch.int32)) if ragged else dict(q_len_per_req=uniform)
    out, lse = gqa_paged_decode(
        q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32), causal=causal, window_left=window,
        sinks=sinks, scale=scale, return_lse=True, **kw,
    )  # fmt: skip
    assert_matches(out, lse, ref_out, ref_lse, dtype)


def _prefill_case(draw, n_new, prefix, with_prefix, in_cache, page, h, hkv, d, dtype, gen) -> dict:
    """A varlen prefill's inputs: requests of ``n_new`` new tokens (``cu`` their offsets), ``q``
    ``[T, h, d]``, new ``k`` / ``v`` ``[T, hkv, d]``, sinks or None, and with a prefix the paged
    cache's keyword arguments (``cache_kw``; ``in_cache``: the new keys written after each prefix
    too) and its ``rows(b, positions)`` lookup."""
    cu = [0]
    for n in n_new:
        cu.append(cu[-1] + n)
    t = cu[-1]
    q = torch.randn(t, h, d, generator=gen).to(dtype)
    k = torch.randn(t, hkv, d, generator=gen).to(dtype)
    v = torch.randn(t, hkv, d, generator=gen).to(dtype)
    sinks = torch.randn(h, generator=gen) * 3 if draw(st.booleans()) else None
    cache_kw: dict = {}
    rows = None
    if with_prefix:
        held = [p + n for p, n in zip(prefix, n_new)] if in_cache else prefix
        k_cache, v_cache, table, rows = paged_cache(draw, held, page, hkv, d, dtype, gen)
        if in_cache:  # the new keys written after each prefix
            for b in range(len(n_new)):
                r = rows(b, torch.arange(prefix[b], held[b]))
                k_cache.flatten(0, 1)[r] = k[cu[b] : cu[b + 1]]
                v_cache.flatten(0, 1)[r] = v[cu[b] : cu[b + 1]]
        cache_kw = dict(
            k_cache=k_cache, v_cache=v_cache, block_table=table, prefix_lens=torch.tensor(prefix, dtype=torch.int32)
        )
    return dict(cu=cu, q=q, k=k, v=v, sinks=sinks, cache_kw=cache_kw, rows=rows, prefix=prefix)


def _prefill_oracle(c: dict, window: int, scale: float | None, hkv: int):
    """The fp64 oracle of :func:`_prefill_case`'s prefill: query ``i`` of request ``b`` at position
    ``prefix[b] + j`` sees the keys up to itself, the last ``window`` before it with a window."""
    cu, prefix, rows, cache_kw = c["cu"], c["prefix"], c["rows"], c["cache_kw"]
    req = {i: b for b in range(len(cu) - 1) for i in range(cu[b], cu[b + 1])}

    def visible(i: int):
        b = req[i]
        p = prefix[b] + i - cu[b]
        return b, torch.arange(max(0, p - window) if window >= 0 else 0, p + 1)

    def pick(new: torch.Tensor, name: str):
        def f(i, bp, g):
            b, pos = bp
            cached, fresh = pos[pos < prefix[b]], pos[pos >= prefix[b]] - prefix[b] + cu[b]
            old = cache_kw[name].flatten(0, 1)[rows(b, cached), g] if cached.numel() else new[:0, g]
            return torch.cat([old, new[fresh, g]])

        return f

    used = c["q"].shape[2] ** -0.5 if scale is None else scale
    return oracle(c["q"], pick(c["k"], "k_cache"), pick(c["v"], "v_cache"), visible, hkv, used, c["sinks"])


@FUZZ
@given(data=st.data())
def test_prefill_equals_fp64_oracle(data) -> None:
    draw = data.draw
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    h, hkv, d = draw(heads())
    page = draw(st.sampled_from([1, 2, 5, 16, 64]))
    batch = draw(st.integers(0, 4))
    n_new = [draw(st.integers(0, 9)) for _ in range(batch)]
    with_prefix = draw(st.booleans())
    in_cache = with_prefix and draw(st.booleans())
    prefix = [draw(st.integers(0, 40)) if with_prefix else 0 for _ in range(batch)]
    window = draw(st.sampled_from([-1, -1, 0, 1, 3, 8, 50]))
    scale = draw(st.sampled_from([None, 0.1, 1.5]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    c = _prefill_case(draw, n_new, prefix, with_prefix, in_cache, page, h, hkv, d, dtype, gen)
    ref_out, ref_lse = _prefill_oracle(c, window, scale, hkv)
    out, lse = gqa_prefill(
        c["q"], None if in_cache else c["k"], None if in_cache else c["v"], torch.tensor(c["cu"], dtype=torch.int32),
        sinks=c["sinks"], window_left=window, scale=scale, return_lse=True, **c["cache_kw"],
    )  # fmt: skip
    assert_matches(out, lse, ref_out, ref_lse, dtype)


# ------------------------------------------------------------------ the parallel steps, 2 ranks
def _dcp_worker(group, case: dict) -> list:
    comm = Comm(group)
    h = case["q"].shape[1] // comm.world_size
    q = case["q"][:, comm.rank * h : (comm.rank + 1) * h]
    k, v, table = case["local"][comm.rank]
    lens = torch.tensor(case["lens"], dtype=torch.int32)
    kw = dict(causal=case["causal"], sinks=case["sinks"], scale=case["scale"])
    results = [dcp_gqa_decode(q, k, v, table, lens, case["layout"], comm, cu_q_lens=case["cu"], **kw)]
    plan = plan_decode_batch(case["lens"], case["cu"].tolist(), layout=case["layout"], rank=comm.rank,
                             causal=case["causal"], packed=True)  # fmt: skip
    results.append(dcp_gqa_decode(q, k, v, table, plan.seq_lens, case["layout"], comm, meta=plan.to("cpu"), **kw))
    slots = len(case["lens"]) + 1
    q_len = max(case["q_lens"] + [1]) + 1  # every request slot ends in padding queries
    padded = plan_decode_batch(case["lens"], case["cu"].tolist(), layout=case["layout"], rank=comm.rank,
                               causal=case["causal"], q_len=q_len, padded_requests=slots)  # fmt: skip
    table_p = torch.cat([table, table.new_full((slots - table.shape[0], table.shape[1]), -1)])
    out, lse = dcp_gqa_decode(
        padded.pad_rows(q), k, v, table_p, padded.seq_lens, case["layout"], comm, meta=padded.to("cpu"), **kw
    )
    results.append((padded.real_rows(out), padded.real_rows(lse)))
    return results


def _rank_caches(draw, k_all, v_all, layout, world, page, dtype, gen, heads=None) -> list:
    """Each rank's ``(k_cache, v_cache, block_table)`` (``paged_cache``'s scattered pages): the
    positions of every request's ``[n, Hkv, d]`` keys / values that ``layout`` gives the rank (a
    one-rank layout: all of them), of its ``heads[rank]`` KV head range (default all)."""
    local = []
    for r in range(world):
        owned = [layout.owned_positions(k.shape[0], r if layout.world_size > 1 else 0) for k in k_all]
        lo, hi = (0, k_all[0].shape[1]) if heads is None else heads[r]
        k_c, v_c, table, rows = paged_cache(draw, [len(o) for o in owned], page, hi - lo, k_all[0].shape[2], dtype, gen)
        for b, o in enumerate(owned):
            k_c.flatten(0, 1)[rows(b, torch.arange(len(o)))] = k_all[b][o][:, lo:hi]
            v_c.flatten(0, 1)[rows(b, torch.arange(len(o)))] = v_all[b][o][:, lo:hi]
        local.append((k_c, v_c, table))
    return local


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
@pytest.mark.distributed
def test_dcp_decode_equals_fp64_oracle(dist_pool, data) -> None:
    draw = data.draw
    world = 2
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    hkv = draw(st.sampled_from([1, 2]))
    h = hkv * draw(st.sampled_from([2, 4]))
    d = 8
    page = draw(st.sampled_from([1, 3, 16]))
    layout = DCPLayout(world, draw(st.sampled_from([1, 2, 5])))
    batch = draw(st.integers(1, 4))
    q_lens = [draw(st.integers(0, 3)) for _ in range(batch)]
    lens = [draw(st.integers(0, 40)) for _ in range(batch)]
    lens = [0 if n == 0 else max(n, ql) for n, ql in zip(lens, q_lens)]
    causal = draw(st.booleans())
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    k_all = [torch.randn(n, hkv, d, generator=gen).to(dtype) for n in lens]
    v_all = [torch.randn(n, hkv, d, generator=gen).to(dtype) for n in lens]
    local = _rank_caches(draw, k_all, v_all, layout, world, page, dtype, gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), h, d, generator=gen).to(dtype)
    sinks = torch.randn(h, generator=gen) * 3 if draw(st.booleans()) else None
    scale = draw(st.sampled_from([None, 0.3]))
    case = dict(q=q, local=local, lens=lens, cu=cu, q_lens=q_lens, layout=layout, causal=causal, sinks=sinks,
                scale=scale)  # fmt: skip
    owner = {i: (b, i - int(cu[b])) for b in range(batch) for i in range(int(cu[b]), int(cu[b + 1]))}

    def visible(i: int):
        b, j = owner[i]
        if lens[b] == 0:
            return None
        p = lens[b] - q_lens[b] + j
        return b, torch.arange(p + 1 if causal else lens[b])

    used = d**-0.5 if scale is None else scale
    ref_out, ref_lse = oracle(
        q, lambda i, bp, g: k_all[bp[0]][bp[1], g], lambda i, bp, g: v_all[bp[0]][bp[1], g], visible, hkv, used, sinks
    )
    hl = h // world
    for rank, results in enumerate(dist_pool.run(_dcp_worker, case, world_size=world)):
        for out, lse in results:
            heads = slice(rank * hl, (rank + 1) * hl)
            assert_matches(out, lse, ref_out[:, heads], ref_lse[:, heads], dtype)


def _prefill_worker(group, case: dict) -> list:
    comm = Comm(group)
    q, k, v, cu, kw = case["q"], case["k"], case["v"], case["cu"], dict(case["kw"])
    in_cache = case["in_cache"]
    ids = case["plan"].shard.token_ids(comm.rank)
    pcp = gqa_prefill_pcp(
        q[ids], None if in_cache else k[ids], None if in_cache else v[ids], case["plan"], comm, gather_output=True,
        **{n: kw[n] for n in ("k_cache", "v_cache", "block_table") if n in kw},
        sinks=case["sinks"], window_left=case["window"], scale=case["scale"],
    )  # fmt: skip
    h, hkv = q.shape[1], k.shape[1]
    hl = h // comm.world_size
    lo, hi = head_tp_kv_heads(h, hkv, comm.world_size, comm.rank)
    cache = {n: kw[n][:, :, lo:hi] for n in ("k_cache", "v_cache") if n in kw}
    rest = {n: kw[n] for n in ("block_table", "prefix_lens") if n in kw}
    k_tp, v_tp = (None, None) if in_cache else (k[:, lo:hi], v[:, lo:hi])
    tp = gqa_prefill_head_tp(
        q[:, comm.rank * hl : (comm.rank + 1) * hl], k_tp, v_tp, cu, comm, num_kv_heads=hkv, sinks=case["sinks"],
        window_left=case["window"], scale=case["scale"], return_lse=True, **cache, **rest,
    )  # fmt: skip
    return [pcp, tp]


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
@pytest.mark.distributed
def test_pcp_and_head_tp_prefill_equal_fp64_oracle(dist_pool, data) -> None:
    draw = data.draw
    world = 2
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    hkv = draw(st.sampled_from([1, 2, 4]))  # 1: the KV head replicated over both head-TP ranks
    h = max(hkv, 2) * draw(st.sampled_from([1, 2]))
    d = 8
    page = draw(st.sampled_from([1, 4, 16]))
    batch = draw(st.integers(1, 3))
    n_new = [draw(st.integers(0, 9)) for _ in range(batch)]
    if sum(n_new) == 0:
        n_new[0] = 1
    with_prefix = draw(st.booleans())
    in_cache = with_prefix and draw(st.booleans())
    prefix = [draw(st.integers(0, 20)) if with_prefix else 0 for _ in range(batch)]
    window = draw(st.sampled_from([-1, 0, 1, 4, 30]))
    scale = draw(st.sampled_from([None, 0.4]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    c = _prefill_case(draw, n_new, prefix, with_prefix, in_cache, page, h, hkv, d, dtype, gen)
    ref_out, ref_lse = _prefill_oracle(c, window, scale, hkv)
    q, k, v, cu, kw, sinks = c["q"], c["k"], c["v"], c["cu"], c["cache_kw"], c["sinks"]
    plan = pcp_plan(n_new, world, prefix_lens=prefix)
    case = dict(q=q, k=k, v=v, cu=torch.tensor(cu, dtype=torch.int32), kw=kw, in_cache=in_cache, plan=plan,
                sinks=sinks, window=window, scale=scale)  # fmt: skip
    hl = h // world
    for rank, (pcp, tp) in enumerate(dist_pool.run(_prefill_worker, case, world_size=world)):
        assert_matches(*pcp, ref_out, ref_lse, dtype)
        heads = slice(rank * hl, (rank + 1) * hl)
        assert_matches(*tp, ref_out[:, heads], ref_lse[:, heads], dtype)


# ------------------------------------------------------------------ regressions found by the fuzzing
def _empty_pages(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """A paged cache of pages that hold no token (``[3, 0, 2, 8]``)."""
    return torch.zeros(3, 0, 2, 8, dtype=dtype), torch.zeros(3, 0, 2, 8, dtype=dtype)


def test_pages_of_no_token_are_refused_naming_k_cache(one_rank_group) -> None:
    """A cache whose pages hold 0 tokens was divided by (a ZeroDivisionError from the page checks on
    the CPU; on a GPU the kernels would index with it) instead of refused naming ``k_cache``."""
    k_cache, v_cache = _empty_pages()
    table = torch.zeros(2, 1, dtype=torch.int32)
    lens = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="k_cache must have pages of at least one token"):
        gqa_paged_decode(torch.randn(2, 4, 8), k_cache, v_cache, table, lens)
    q, k = torch.randn(3, 4, 8), torch.randn(3, 2, 8)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    for new in (k, None):
        with pytest.raises(ValueError, match="k_cache must have pages of at least one token"):
            gqa_prefill(q, new, new, cu, k_cache=k_cache, v_cache=v_cache, block_table=table, prefix_lens=lens)
    with pytest.raises(ValueError, match="k_cache must have pages of at least one token"):
        dcp_gqa_decode(torch.randn(2, 4, 8), k_cache, v_cache, table, lens, DCPLayout(1), one_rank_group)


def test_dcp_decode_refuses_negative_planned_lengths(one_rank_group) -> None:
    """``meta[0]`` (a plan's local KV lengths) was checked against the block table's width but not
    for negative values, which the step ran as padding: a silent ``(0, -inf)`` row."""
    k_cache, v_cache = torch.randn(2, 4, 2, 8), torch.randn(2, 4, 2, 8)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    meta = torch.tensor([[-3], [0]], dtype=torch.int32)
    with pytest.raises(ValueError, match="meta\\[0\\] holds negative local lengths"):
        dcp_gqa_decode(
            torch.randn(1, 4, 8), k_cache, v_cache, table, torch.tensor([5], dtype=torch.int32), DCPLayout(1),
            one_rank_group, meta=meta,
        )  # fmt: skip


def test_dcp_decode_refuses_planned_lengths_past_a_request_s_pages(one_rank_group) -> None:
    """``meta[0]`` (a plan's local KV lengths) longer than the pages a query slot's block-table row
    holds: the pages were checked against ``seq_lens`` only, so the slot read a ``-1`` entry (the
    last page, on the CPU) instead of being refused."""
    k_cache, v_cache = torch.randn(2, 4, 2, 8), torch.randn(2, 4, 2, 8)
    table = torch.tensor([[0, -1]], dtype=torch.int32)
    seq = torch.tensor([3], dtype=torch.int32)
    lens = torch.tensor([6], dtype=torch.int32)
    for meta in ((lens, None), torch.stack([lens, torch.zeros_like(lens)])):  # row 0: as slot 0, or meta[1]
        with pytest.raises(ValueError, match=r"block_table holds pages outside \[0, 2\) for meta\[0\]'s query slots"):
            dcp_gqa_decode(torch.randn(1, 4, 8), k_cache, v_cache, table, seq, DCPLayout(1), one_rank_group, meta=meta)


# ------------------------------------------------------------------ the Runtime's GQA decode steps
def _runtime_decode_worker(group, case: dict) -> list:
    comm = Comm(group)
    rt = Runtime(case["spec"], group, mode=case["mode"], max_batched_tokens=1, max_decode_tokens=64, warmup=False)
    h = case["q"].shape[1] // comm.world_size
    q = case["q"][:, comm.rank * h : (comm.rank + 1) * h]
    k, v, table = case["local"][comm.rank]
    seq, cu, sinks = case["lens"], case["cu"], case["sinks"]
    if case["mode"] == "headtp":
        return [rt.decode(q, (k, v), table, seq, cu_q_lens=cu, window_left=case["window"], sinks=sinks)]
    results = [rt.decode(q, (k, v), table, seq, cu_q_lens=cu, sinks=sinks)]
    plan = rt.decode_step.plan(seq, cu)  # packed: the real queries back to back
    results.append(rt.decode(q, (k, v), table, seq, batch=plan, sinks=sinks))
    per_query = table.index_select(0, plan.meta[1].long())  # a block-table row per query slot
    results.append(rt.decode(q, (k, v), per_query, seq, batch=plan, sinks=sinks))
    padded = rt.decode_step.plan(seq, cu, q_len=max(case["q_lens"]) + 1, padded_requests=len(seq) + 2)
    table_p = torch.cat([table, table.new_full((2, table.shape[1]), -1)])
    out, lse = rt.decode(padded.pad_rows(q), (k, v), table_p, seq, batch=padded, sinks=sinks)
    results.append((padded.real_rows(out), padded.real_rows(lse)))
    return results


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
@pytest.mark.distributed
def test_runtime_decode_steps_equal_fp64_oracle(dist_pool, data) -> None:
    draw = data.draw
    world = 2
    mode = draw(st.sampled_from(["dcp-decode", "headtp"]))
    hkv = draw(st.sampled_from([1, 2, 4]))  # headtp with 1: the KV head replicated on both ranks
    h = max(hkv, 2) * draw(st.sampled_from([1, 2]))
    d, page = 8, draw(st.sampled_from([1, 2, 5]))
    causal = True
    batch = draw(st.integers(1, 4))
    q_lens = [draw(st.integers(1, 3)) for _ in range(batch)]
    lens = [ql + draw(st.integers(0, 30)) for ql in q_lens]
    window = draw(st.sampled_from([-1, 0, 2, 9])) if mode == "headtp" else -1
    has_sinks = draw(st.booleans())
    scale = draw(st.sampled_from([0.35, 1.1]))
    spec = ModelSpec("gqa", h, hkv, d, d, 0, page, has_sinks=has_sinks, dtype="float32", softmax_scale=scale)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    k_all = [torch.randn(n, hkv, d, generator=gen) for n in lens]
    v_all = [torch.randn(n, hkv, d, generator=gen) for n in lens]
    layout = DCPLayout(world) if mode == "dcp-decode" else DCPLayout(1)
    if mode == "dcp-decode":
        local = _rank_caches(draw, k_all, v_all, layout, world, page, torch.float32, gen)
    else:  # every rank holds every position, of its KV heads
        heads = [head_tp_kv_heads(h, hkv, world, r) for r in range(world)]
        local = _rank_caches(draw, k_all, v_all, layout, world, page, torch.float32, gen, heads=heads)
    cu = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    q = torch.randn(cu[-1], h, d, generator=gen)
    sinks = torch.randn(h, generator=gen) * 3 if has_sinks else None
    case = dict(spec=spec, mode=mode, q=q, local=local, lens=lens, cu=cu, q_lens=q_lens, sinks=sinks, window=window)
    owner = {i: (b, i - cu[b]) for b in range(batch) for i in range(cu[b], cu[b + 1])}

    def visible(i: int):
        b, j = owner[i]
        p = lens[b] - q_lens[b] + j
        return b, torch.arange(max(0, p - window) if window >= 0 else 0, p + 1 if causal else lens[b])

    ref_out, ref_lse = oracle(
        q, lambda i, bp, g: k_all[bp[0]][bp[1], g], lambda i, bp, g: v_all[bp[0]][bp[1], g], visible, hkv, scale, sinks
    )
    hl = h // world
    for rank, results in enumerate(dist_pool.run(_runtime_decode_worker, case, world_size=world)):
        heads = slice(rank * hl, (rank + 1) * hl)
        for out, lse in results:
            assert_matches(out, lse, ref_out[:, heads], ref_lse[:, heads], torch.float32)
