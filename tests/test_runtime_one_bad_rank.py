"""One rank of a Runtime prefill passes a bad tensor: it raises naming the argument, and under a
step with collectives its peers raise at once naming it (they do not wait out the group's timeout),
also where the bad tensor is one the step's planning reads. Two gloo ranks, CPU."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from shardattn.runtime.options import PrefillOptions
from shardattn.runtime.runtime import Runtime
from tests.test_runtime import MLA, MLA_SINKS, _err, _heads, _kv_lens, _mla_oracle, _prefill_step

BAD = {
    "kv_cache-1d": lambda s: {"kv_cache": s.kv.flatten()},  # read while planning (the rows it addresses)
    "rows-1d": lambda s: {"rows": s.rows[0]},
    "sinks-every-head-twice": lambda s: {"sinks": torch.zeros(2 * MLA_SINKS.num_heads)},
    "sinks-of-the-rank-only": lambda s: {"sinks": torch.zeros(MLA_SINKS.num_heads // 2)},
}
SINKS = torch.randn(MLA_SINKS.num_heads, generator=torch.Generator().manual_seed(7))  # the model's, on a good rank


def _body(group: dist.ProcessGroup, mode: str, bad: str) -> dict:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    rt = Runtime(
        MLA_SINKS, group, max_batched_tokens=128, mode=mode, prefill_options=PrefillOptions(min_shard_tokens=1)
    )
    step = _prefill_step()
    args = {"kv_cache": step.kv, "rows": step.rows, "sinks": SINKS}
    if rank == 1:
        args.update(BAD[bad](step))
    start = time.monotonic()
    try:
        out, _ = rt.prefill(
            _heads(step.q, rank, world).contiguous(), args["kv_cache"], args["rows"], sinks=args["sinks"],
            query_lens=step.query_lens, prefix_lens=step.prefix_lens,
        )  # fmt: skip
    except ValueError as e:
        return {"error": str(e), "s": time.monotonic() - start}
    ref, _ = _mla_oracle(step, 0.3, _kv_lens(step), sinks=SINKS)
    return {"error": None, "err": _err(out, _heads(ref, rank, world)), "s": time.monotonic() - start}


@pytest.mark.distributed
@pytest.mark.parametrize("bad", sorted(BAD))
def test_a_bad_tensor_on_one_rank_of_a_shardq_step_raises_on_both_at_once(dist_pool, bad) -> None:
    first, peer = dist_pool.run(_body, "shardq", bad, world_size=2)
    name = bad.split("-")[0]
    assert first["error"] is None or "rejected their inputs" in first["error"], first
    assert first["error"] is not None and "rank(s) [1] of 2 rejected their inputs" in first["error"], first
    assert peer["error"] is not None and peer["error"].startswith(f"{name} must "), peer
    assert first["s"] < 10, first  # named at the step's agreement, not at the group's timeout


@pytest.mark.distributed
def test_head_tp_prefill_checks_every_heads_sinks(dist_pool) -> None:
    """A head-TP step (no collective) takes ``[H]`` sinks and slices the rank's: a rank's own slice,
    or twice the heads, is refused on that rank (before: accepted, or a wrong shape on rank 1 only)."""
    for bad in ("sinks-every-head-twice", "sinks-of-the-rank-only"):
        first, peer = dist_pool.run(_body, "headtp", bad, world_size=2)
        assert first["error"] is None and first["err"] <= 1e-5, first
        assert peer["error"] is not None and peer["error"].startswith("sinks must have shape [8]"), peer


def _bad_lengths_body(group: dist.ProcessGroup) -> dict:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    rt = Runtime(MLA, group, max_batched_tokens=128, mode="shardq", prefill_options=PrefillOptions(min_shard_tokens=1))
    step = _prefill_step()
    lens = list(step.query_lens)
    if rank == 1:
        lens[1] = -lens[1]  # this rank cannot plan the step
    start = time.monotonic()
    try:
        rt.prefill(_heads(step.q, rank, world).contiguous(), step.kv, step.rows, query_lens=lens,
                   prefix_lens=step.prefix_lens)  # fmt: skip
    except ValueError as e:
        return {"error": str(e), "s": time.monotonic() - start}
    return {"error": None, "s": time.monotonic() - start}


@pytest.mark.distributed
def test_lengths_one_rank_cannot_plan_raise_on_every_rank_at_once(dist_pool) -> None:
    first, peer = dist_pool.run(_bad_lengths_body, world_size=2)
    assert peer["error"] is not None and peer["error"].startswith("query_lens[1] must be >= 0"), peer
    assert first["error"] is not None and "rank(s) [1] of 2 rejected their inputs" in first["error"], first
    assert first["s"] < 10, first


def _short_cache_body(group: dist.ProcessGroup) -> dict:
    """Rank 1 passes the step's cache without its last 64 rows: rows its ShardQ share reads are then
    missing there, which every rank's output of those tokens would take as invalid keys."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    rt = Runtime(MLA, group, max_batched_tokens=128, mode="shardq", prefill_options=PrefillOptions(min_shard_tokens=1))
    step = _prefill_step()
    kv = step.kv[:-64] if rank == 1 else step.kv
    start = time.monotonic()
    try:
        out, lse = rt.prefill(_heads(step.q, rank, world).contiguous(), kv, step.rows, query_lens=step.query_lens,
                              prefix_lens=step.prefix_lens)  # fmt: skip
    except ValueError as e:
        return {"error": str(e), "s": time.monotonic() - start}
    ref_out, ref_lse = _mla_oracle(step, 0.3, _kv_lens(step))
    err = max(_err(out, _heads(ref_out, rank, world)), _err(lse, _heads(ref_lse, rank, world)))
    return {"error": None, "err": err, "s": time.monotonic() - start}


@pytest.mark.distributed
def test_a_cache_of_other_rows_on_one_rank_of_a_shardq_step_is_named_on_every_rank(dist_pool) -> None:
    """ShardQ reads the replicated cache on the rank that runs a token, for every rank's heads: a rank
    whose cache holds other rows raised nothing, and every rank returned wrong outputs for its tokens."""
    for res in dist_pool.run(_short_cache_body, world_size=2):
        assert res["error"] is not None, res
        assert "rank(s) [1] disagree with rank(s) [0] on kv's rows" in res["error"], res
        assert res["s"] < 10, res
