"""A Runtime step takes ``sinks`` exactly when its spec has ``has_sinks``: a model with sinks run
without them would give wrong attention silently, and sinks on a spec without them would run
kernels its warm-up did not build. Every step (prefill and decode, sparse MLA and GQA, head-TP and
the modes with collectives) and :class:`~shardattn.runtime.graphs.DecodeGraphs` refuse a mismatch
before any collective, naming ``sinks`` and ``has_sinks``; one rank's mismatch in a step with
collectives raises on every rank at once. Two gloo ranks, CPU, the small specs of
``tests/test_runtime.py``."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.distributed as dist

from shardattn.ops.topk import DcpShard
from shardattn.runtime.options import PrefillOptions
from shardattn.runtime.runtime import Runtime
from tests.test_gqa_prefill_parallel import make_step
from tests.test_runtime import GQA, MLA, _gqa_step, _heads, _prefill_step
from tests.test_runtime_args import _mla_decode_step
from tests.test_runtime_gqa_prefill import _rank_inputs, spec_of

MISSING = "sinks: the spec has has_sinks=True (one sink logit per head): pass the model's [{h}] fp32 sink logits"
UNEXPECTED = "sinks: the spec has has_sinks=False: build the Runtime with ModelSpec(..., has_sinks=True) to use sinks"


def _step(group: dist.ProcessGroup, kind: str, step: str, mode: str, has_sinks: bool, bad: tuple[int, ...]) -> dict:
    """One step of ``kind`` in ``mode`` on a spec with ``has_sinks``; the ranks in ``bad`` pass the
    other case of ``sinks`` (none where the spec has them, ``[H]`` zeros where it has none)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    gqa_prefill = make_step(5, [6, 5], [3, 0]) if (kind, step) == ("gqa", "prefill") else None
    base = {"mla": MLA, "gqa": GQA if gqa_prefill is None else spec_of(gqa_prefill)}[kind]
    spec = dataclasses.replace(base, has_sinks=has_sinks)
    rt = Runtime(spec, group, max_batched_tokens=128, mode=mode, prefill_options=PrefillOptions(min_shard_tokens=1))
    wants = has_sinks != (rank in bad)
    sinks = torch.zeros(spec.num_heads) if wants else None
    rt.comm.reset_counts()
    start = time.monotonic()
    try:
        if kind == "mla" and step == "prefill":
            s = _prefill_step()
            q = _heads(s.q, rank, world).contiguous()
            rt.prefill(q, s.kv, s.rows, query_lens=s.query_lens, prefix_lens=s.prefix_lens, sinks=sinks)
        elif kind == "gqa" and step == "prefill":
            plan = rt.plan_prefill(gqa_prefill["seq_lens"], gqa_prefill["prefix_lens"])
            q, kv_new, cache, table, _ = _rank_inputs(rt, plan, gqa_prefill, False)
            rt.prefill(q, cache, kv_new=kv_new, block_table=table, plan=plan, sinks=sinks)
        elif kind == "mla":
            s = _mla_decode_step(world, rank, rt.decode_is_dcp)
            q = _heads(s.q, rank, world).contiguous()
            rt.decode(q, s.local_kv, s.local_table, s.seq_lens, topk_pos=s.positions, req_ids=s.req_ids, sinks=sinks)
        else:
            shard = DcpShard(world, 1, rank) if rt.decode_is_dcp else DcpShard(1, 1, 0)
            g = _gqa_step((37, 0, 70), (1, 3, 2), 3, shard)
            k, v, table = g.local_k_cache, g.local_v_cache, g.local_block_table
            if not rt.decode_is_dcp:  # head-TP: the rank's KV heads of the whole cache
                hkv = spec.num_kv_heads // world
                k, v = (c[:, :, rank * hkv : (rank + 1) * hkv].contiguous() for c in (g.k_cache, g.v_cache))
                table = g.block_table
            q = _heads(g.q, rank, world).contiguous()
            rt.decode(q, (k, v), table, g.seq_lens, cu_q_lens=g.cu_q_lens, sinks=sinks)
    except ValueError as e:
        return {"error": str(e), "s": time.monotonic() - start, "counts": dict(rt.comm.counts)}
    return {"error": None, "s": time.monotonic() - start, "counts": dict(rt.comm.counts)}


# (kind, step, mode): every step, in a mode with collectives and in head-TP (a local call)
STEPS = [
    ("mla", "prefill", "shardq"),
    ("mla", "prefill", "headtp"),
    ("gqa", "prefill", "pcp"),
    ("gqa", "prefill", "headtp"),
    ("mla", "decode", "dcp-decode"),
    ("mla", "decode", "headtp"),
    ("gqa", "decode", "dcp-decode"),
    ("gqa", "decode", "headtp"),
]


def _ids(case: tuple) -> str:
    return "-".join(case)


@pytest.mark.distributed
@pytest.mark.parametrize("has_sinks", [True, False], ids=["missing", "unexpected"])
@pytest.mark.parametrize("case", STEPS, ids=_ids)
def test_a_step_refuses_sinks_that_do_not_match_the_spec(dist_pool, case: tuple, has_sinks: bool) -> None:
    """Before: a spec with sinks ran without them (silently wrong), a spec without ran them."""
    kind, step, mode = case
    results = dist_pool.run(_step, kind, step, mode, has_sinks, (0, 1), world_size=2)
    heads = 4 if (kind, step) == ("gqa", "prefill") else 8
    want = MISSING.format(h=heads) if has_sinks else UNEXPECTED
    for rank, res in enumerate(results):
        assert res["error"] == want, (rank, res)
        assert set(res["counts"]) <= {"agreement"}, (rank, res)  # no data collective ran


@pytest.mark.distributed
@pytest.mark.parametrize("has_sinks", [True, False], ids=["missing", "unexpected"])
@pytest.mark.parametrize("case", STEPS, ids=_ids)
def test_sinks_that_match_the_spec_run(dist_pool, case: tuple, has_sinks: bool) -> None:
    kind, step, mode = case
    for rank, res in enumerate(dist_pool.run(_step, kind, step, mode, has_sinks, (), world_size=2)):
        assert res["error"] is None, (rank, res)


@pytest.mark.distributed
@pytest.mark.parametrize("has_sinks", [True, False], ids=["missing", "unexpected"])
@pytest.mark.parametrize("case", [c for c in STEPS if c[2] != "headtp"], ids=_ids)
def test_one_ranks_sinks_mismatch_raises_on_every_rank_at_once(dist_pool, case: tuple, has_sinks: bool) -> None:
    kind, step, mode = case
    first, peer = dist_pool.run(_step, kind, step, mode, has_sinks, (1,), world_size=2)
    assert peer["error"] is not None and peer["error"].startswith(f"sinks: the spec has has_sinks={has_sinks}"), peer
    assert first["error"] is not None and "rank(s) [1] of 2 rejected their inputs" in first["error"], first
    assert first["s"] < 10 and peer["s"] < 10, (first, peer)  # at the step's agreement, not the group's timeout


@pytest.mark.distributed
@pytest.mark.parametrize("case", [c for c in STEPS if c[2] == "headtp"], ids=_ids)
def test_one_ranks_sinks_mismatch_in_a_head_tp_step_raises_there(dist_pool, case: tuple) -> None:
    """A head-TP step has no collective: the rank at fault raises, its peer's step runs."""
    kind, step, mode = case
    first, peer = dist_pool.run(_step, kind, step, mode, True, (1,), world_size=2)
    assert first["error"] is None, first
    assert peer["error"] is not None and peer["error"].startswith("sinks: the spec has has_sinks=True"), peer


def _graphs_body(group: dist.ProcessGroup, has_sinks: bool) -> str:
    from shardattn.runtime.graphs import DecodeGraphs

    spec = dataclasses.replace(GQA, has_sinks=has_sinks)
    rt = Runtime(spec, group, mode="dcp-decode", max_batched_tokens=64, max_decode_tokens=32, warmup=False)
    g = _gqa_step((37, 0, 70), (1, 3, 2), 3, DcpShard(1, 1, 0))
    try:
        DecodeGraphs(rt, (g.k_cache, g.v_cache), batch_sizes=[4], q_len=3, max_pages=5,
                     sinks=None if has_sinks else g.sinks, capture=False)  # fmt: skip
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.distributed
@pytest.mark.parametrize("has_sinks", [True, False], ids=["missing", "unexpected"])
def test_decode_graphs_refuse_sinks_that_do_not_match_the_spec(dist_pool, has_sinks: bool) -> None:
    """The sinks every captured step passes are checked when the graphs are built."""
    (error,) = dist_pool.run(_graphs_body, has_sinks, world_size=1)
    assert error == (MISSING.format(h=GQA.num_heads) if has_sinks else UNEXPECTED), error
