"""The Runtime's arguments: one meaning per name in every mode, the heads a rank holds, host lists and
int64 indices, the head-TP GQA sliding window.

Distributed bodies run on the ``dist_pool`` ranks (gloo, CPU) with the small specs of
``tests/test_runtime.py``; results are compared with the fp64 oracle (``tests/oracle.py``) or, for
converted arguments, bit for bit with the same step on int32 tensors.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardattn.launch.workloads import build_decode
from shardattn.ops.topk import DcpShard
from shardattn.runtime.options import DecodeOptions, PrefillOptions
from shardattn.runtime.runtime import Runtime
from tests.oracle import gqa_oracle
from tests.test_runtime import GQA, GQA_SCALE, MLA, _err, _gqa_step, _heads, _prefill_step, _token_rows

CPU = torch.device("cpu")


def _mla_decode_step(world: int, rank: int, dcp: bool):
    return build_decode(
        heads=MLA.num_heads, head_dim=MLA.head_dim, requests=3, cached=(37, 5, 20), q_lens=(1, 2, 1), topk=MLA.topk,
        overlap="random", causal=True, dtype=torch.float32, device=CPU, seed=4,
        shard=DcpShard(world, 1, rank) if dcp else DcpShard(1, 1, 0), block_size=MLA.page_size,
    )  # fmt: skip


# -- every head where H / W are expected ------------------------------------------------------------------
def _error(fn) -> str:
    try:
        fn()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _every_head_body(group) -> dict:
    """Each step given the wrong heads (every head where the rank holds ``H / W``, and ``H / W``
    where PCP takes every head of the rank's tokens) must raise on every rank, naming ``q``."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    step = _prefill_step()
    gate = PrefillOptions(min_shard_tokens=1)
    out: dict[str, str] = {}
    for mode, options in (("headtp", gate), ("shardq", gate), ("shardq", PrefillOptions(min_shard_tokens=100))):
        rt = Runtime(MLA, group, max_batched_tokens=128, mode=mode, prefill_options=options, warmup=False)
        name = f"prefill-{mode}-gate{options.min_shard_tokens}"
        out[name] = _error(
            lambda rt=rt: rt.prefill(
                step.q, step.kv, step.rows, query_lens=step.query_lens, prefix_lens=step.prefix_lens
            )
        )
    pcp = Runtime(MLA, group, max_batched_tokens=128, mode="pcp", warmup=False)
    plan = pcp.plan_prefill(step.query_lens, step.prefix_lens)
    mine = plan.tokens_of(rank)
    own = _token_rows(step).index_select(0, mine)
    out["prefill-pcp"] = _error(
        lambda: pcp.prefill(
            _heads(step.q[mine], rank, world).contiguous(),
            step.kv,
            topk_pos=step.positions[mine],
            kv_new=step.kv[own],
            block_table=step.block_table,
            plan=plan,
        )
    )
    for mode in ("headtp", "mixed"):
        rt = Runtime(MLA, group, max_batched_tokens=128, mode=mode, warmup=False)
        s = _mla_decode_step(world, rank, dcp=mode == "mixed")
        out[f"decode-{mode}"] = _error(
            lambda rt=rt, s=s: rt.decode(
                s.q, s.local_kv, s.local_table, s.seq_lens, topk_pos=s.positions, req_ids=s.req_ids
            )
        )
    gqa = Runtime(GQA, group, max_batched_tokens=1, mode="dcp-decode", warmup=False)
    g = _gqa_step((30, 3), (1, 2), 5, DcpShard(world, 1, rank))
    out["decode-gqa-dcp"] = _error(
        lambda: gqa.decode(
            g.q, (g.local_k_cache, g.local_v_cache), g.local_block_table, g.seq_lens, cu_q_lens=g.cu_q_lens
        )
    )
    return out


@pytest.mark.distributed
def test_every_head_on_a_multi_rank_group_is_refused(dist_pool) -> None:
    """Before, a head-TP Runtime on 2 ranks given all heads returned ``[T, H, v_dim]`` without error."""
    for rank, res in enumerate(dist_pool.run(_every_head_body, world_size=2)):
        assert set(res) == {
            "prefill-headtp-gate1", "prefill-shardq-gate1", "prefill-shardq-gate100", "prefill-pcp",
            "decode-headtp", "decode-mixed", "decode-gqa-dcp",
        }  # fmt: skip
        for name, message in res.items():
            if name == "prefill-pcp":
                assert message.startswith("ValueError: q must hold every one of the model's 8 heads under PCP"), (
                    rank,
                    message,
                )
            else:
                assert message.startswith("ValueError: q must hold this rank's 4 heads (H/W: 8 heads over 2"), (
                    rank,
                    name,
                    message,
                )


# -- lists, int64, and the lengths' names ----------------------------------------------------------------
def _conversions_body(group) -> dict:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    res: dict = {}
    step = _prefill_step(seed=3)
    rt = Runtime(MLA, group, max_batched_tokens=128, mode="shardq", prefill_options=PrefillOptions(min_shard_tokens=1))
    q = _heads(step.q, rank, world).contiguous()
    base = rt.prefill(q, step.kv, step.rows, query_lens=step.query_lens, prefix_lens=step.prefix_lens)
    seq_lens = [p + n for p, n in zip(step.prefix_lens, step.query_lens)]
    by_seq = rt.plan_prefill(step.query_lens, seq_lens=seq_lens)
    by_prefix = rt.plan_prefill(torch.tensor(step.query_lens), torch.tensor(step.prefix_lens))
    res["plans_equal"] = by_seq.shard.fingerprint() == by_prefix.shard.fingerprint()
    longs = rt.prefill(q, step.kv, step.rows.long(), query_lens=step.query_lens, seq_lens=seq_lens)
    res["prefill_int64"] = all(torch.equal(a, b) for a, b in zip(base, longs))

    dcp = Runtime(MLA, group, max_batched_tokens=128, mode="mixed", warmup=False)
    s = _mla_decode_step(world, rank, dcp=True)
    qd = _heads(s.q, rank, world).contiguous()
    base = dcp.decode(qd, s.local_kv, s.local_table, s.seq_lens, topk_pos=s.positions, req_ids=s.req_ids)
    converted = dcp.decode(
        qd, s.local_kv, s.local_table.long(), s.seq_lens.tolist(), topk_pos=s.positions.long(),
        req_ids=s.req_ids.tolist(),
    )  # fmt: skip
    res["decode_lists_int64"] = all(torch.equal(a, b) for a, b in zip(base, converted))
    as_numpy = dcp.decode(  # NumPy lengths and indices, as prefill's query_lens may be (they were refused)
        qd, s.local_kv, s.local_table.numpy(), s.seq_lens.numpy(), topk_pos=s.positions.numpy(),
        req_ids=s.req_ids.numpy().astype("int64"),
    )  # fmt: skip
    res["decode_numpy"] = all(torch.equal(a, b) for a, b in zip(base, as_numpy))

    gqa = Runtime(GQA, group, max_batched_tokens=1, mode="dcp-decode", warmup=False)
    g = _gqa_step((30, 3, 17), (1, 2, 1), 5, DcpShard(world, 1, rank))
    qg, kv = _heads(g.q, rank, world).contiguous(), (g.local_k_cache, g.local_v_cache)
    base = gqa.decode(qg, kv, g.local_block_table, g.seq_lens, cu_q_lens=g.cu_q_lens, sinks=g.sinks)
    converted = gqa.decode(
        qg, kv, g.local_block_table, g.seq_lens.tolist(), cu_q_lens=g.cu_q_lens.tolist(), sinks=g.sinks
    )
    res["gqa_lists"] = all(torch.equal(a, b) for a, b in zip(base, converted))
    return res


@pytest.mark.distributed
def test_host_lists_and_int64_give_the_int32_result(dist_pool) -> None:
    """``torch.arange``'s int64, host lists and NumPy arrays are converted once (values checked on the
    CPU), bit for bit the step on int32 tensors; ``seq_lens`` (prefix included) plans like ``prefix_lens``."""
    for rank, res in enumerate(dist_pool.run(_conversions_body, world_size=2)):
        want = {"plans_equal": True, "prefill_int64": True, "decode_lists_int64": True, "gqa_lists": True}
        assert res == {**want, "decode_numpy": True}, (rank, res)


# -- the head-TP GQA sliding window ------------------------------------------------------------------------
def _window_body(group, window: int) -> dict:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    rt = Runtime(GQA, group, max_batched_tokens=1, mode="headtp", decode_options=DecodeOptions(), warmup=False)
    g = _gqa_step((40, 9, 23), (1, 3, 2), 11, DcpShard(1, 1, 0))
    hkv = GQA.num_kv_heads // world
    k, v = (c[:, :, rank * hkv : (rank + 1) * hkv].contiguous() for c in (g.k_cache, g.v_cache))
    q = _heads(g.q, rank, world).contiguous()
    out, lse = rt.decode(q, (k, v), g.block_table, g.seq_lens, cu_q_lens=g.cu_q_lens, sinks=g.sinks, window_left=window)
    cu = g.cu_q_lens.tolist()
    ref = gqa_oracle(g.q, g.k_cache, g.v_cache, g.block_table, g.seq_lens, cu, sinks=g.sinks, scale=GQA_SCALE,
                     window_left=window)  # fmt: skip
    full = gqa_oracle(g.q, g.k_cache, g.v_cache, g.block_table, g.seq_lens, cu, sinks=g.sinks, scale=GQA_SCALE)
    return {
        "err": max(_err(out, _heads(ref[0], rank, world)), _err(lse, _heads(ref[1], rank, world))),
        "differs_from_no_window": _err(out, _heads(full[0], rank, world)) > 1e-3,
    }


@pytest.mark.distributed
@pytest.mark.parametrize("window", [0, 5])
def test_headtp_gqa_decode_takes_a_sliding_window(dist_pool, window: int) -> None:
    for rank, res in enumerate(dist_pool.run(_window_body, window, world_size=2)):
        assert res["err"] <= 1e-5, (rank, res)
        assert res["differs_from_no_window"], "the window must change what a query sees"


# -- host arguments as NumPy arrays; a head-TP block table past the cache ---------------------------------
def test_int32_numpy_moves_to_the_device_as_every_other_integer_dtype() -> None:
    import numpy as np

    from shardattn.runtime.args import as_index

    meta = torch.device("meta")  # a stand-in for q's device
    for dt in (np.int64, np.int32, np.int16):
        got = as_index("seq_lens", np.array([5, 7, 9], dtype=dt), meta)
        assert (got.device, got.dtype) == (meta, torch.int32), dt


def test_numpy_lengths_are_read_on_the_host_like_lists() -> None:
    import numpy as np

    from shardattn.runtime.args import check_drafts_on_host

    for seq in ([4, 1], np.array([4, 1], dtype=np.int32), np.array([4, 1])):
        with pytest.raises(ValueError, match="seq_lens"):  # 2 drafts do not fit a request of 1 token
            check_drafts_on_host(seq, None, q_len_per_req=2, max_q_len=None, tokens=4, requests=2)


def _table_past_cache_body(group) -> dict:
    rt = Runtime(MLA, group, mode="headtp", max_batched_tokens=64, max_decode_tokens=16, warmup=False)
    s = build_decode(
        heads=MLA.num_heads, head_dim=MLA.head_dim, requests=3, cached=(37, 0, 70), q_lens=(1, 2, 1), topk=MLA.topk,
        overlap="random", causal=True, dtype=torch.float32, device=torch.device("cpu"), seed=3,
        shard=DcpShard(1, 1, 0), block_size=MLA.page_size,
    )  # fmt: skip
    table = s.block_table.clone()
    table[0, 0] = s.kv.shape[0] // MLA.page_size  # the first page past the cache
    try:
        rt.decode(s.q, s.kv, table, s.seq_lens, topk_pos=s.positions, req_ids=s.req_ids)
    except ValueError as e:
        return {"error": str(e)}
    return {"error": None}


@pytest.mark.distributed
def test_headtp_sparse_decode_refuses_a_block_table_past_the_cache(dist_pool) -> None:
    """As the DCP step does: a page past the cache would drop that page's keys with no error."""
    for res in dist_pool.run(_table_past_cache_body, world_size=1):
        assert res["error"] is not None and "block_table points past kv_cache" in res["error"], res


def _padded_plan_body(group) -> dict:
    from shardattn.runtime.graphs import DecodeGraphs

    rt = Runtime(GQA, group, mode="dcp-decode", max_batched_tokens=64, max_decode_tokens=32, warmup=False)
    g = _gqa_step((37, 0, 70), (1, 3, 2), 3, DcpShard(1, 1, 0))
    kv = (g.k_cache, g.v_cache)
    errors = {}
    plan = rt.decode_step.plan(g.seq_lens.tolist(), g.cu_q_lens.tolist(), q_len=3, padded_requests=4)
    try:  # the caller's unpadded table beside a plan padded to 4 requests
        rt.decode(plan.pad_rows(g.q), kv, g.block_table, g.seq_lens, batch=plan, sinks=g.sinks)
    except ValueError as e:
        errors["table"] = str(e)
    graphs = DecodeGraphs(rt, kv, batch_sizes=[4], q_len=3, max_pages=5, sinks=g.sinks, capture=False)
    try:  # q of 6 rows, one query per request planned
        graphs(g.q, g.block_table, g.seq_lens.tolist())
    except ValueError as e:
        errors["graphs"] = str(e)
    return errors


@pytest.mark.distributed
def test_errors_of_a_planned_decode_name_the_argument_at_fault(dist_pool) -> None:
    for res in dist_pool.run(_padded_plan_body, world_size=1):
        assert res["table"].startswith("block_table must have a row per request slot of the plan (4"), res
        assert res["graphs"].startswith("q must have the plan's num_tokens=3 rows"), res


def _grouped_plan_big_cache_body(group) -> dict:
    from shardattn.plan.routing import MAX_GROUPED_KV_ROWS, Route
    from shardattn.runtime.runtime import PrefillPlan

    rt = Runtime(MLA, group, mode="headtp", max_batched_tokens=64, max_decode_tokens=8, warmup=False)
    step = _prefill_step(seed=1)
    plan = PrefillPlan("headtp", Route("grouped", 8, "forced"), None, int(step.q.shape[0]))
    pages = -(-MAX_GROUPED_KV_ROWS // MLA.page_size)
    big = step.kv[:1, None, :].expand(pages, MLA.page_size, MLA.head_dim)  # one row's storage, 2^24 rows
    try:
        rt.prefill(step.q, big, step.rows, plan=plan)
    except ValueError as e:
        return {"error": str(e)}
    return {"error": None}


@pytest.mark.distributed
def test_a_grouped_plan_on_a_cache_past_the_packed_rows_is_refused_before_the_step(dist_pool) -> None:
    for res in dist_pool.run(_grouped_plan_big_cache_body, world_size=1):
        assert res["error"] is not None and "plan routes the grouped kernel (G=8)" in res["error"], res


# -- topk_unique in prefill, as in decode ----------------------------------------------------------------
def _prefill_unique_body(group) -> dict:
    """``rt.prefill(..., topk_unique=True)`` reaches every sparse-MLA kernel call of head-TP, ShardQ
    and PCP steps as ``rows_unique`` (and ``False`` by default), gives the same result on unique
    rows, and a non-bool is a ``TypeError`` naming it on every rank."""
    from unittest import mock

    from shardattn.ops.unique_rows import unique_rows_reference
    from shardattn.runtime import prefill as runtime_prefill

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    step = _prefill_step()
    rows = unique_rows_reference(step.rows, num_kv_rows=int(step.kv.shape[0]))
    gate = PrefillOptions(min_shard_tokens=1)
    seen: list[bool] = []
    real = runtime_prefill.sparse_mla_grouped_prefill

    def spy(*args, **kwargs):
        seen.append(kwargs["rows_unique"])
        return real(*args, **kwargs)

    res: dict = {}
    for mode in ("headtp", "shardq", "pcp"):
        rt = Runtime(MLA, group, max_batched_tokens=128, mode=mode, prefill_options=gate, warmup=False)
        plan = rt.plan_prefill(step.query_lens, step.prefix_lens, kv_rows=int(step.kv.shape[0]))
        if plan.step == "pcp":
            mine = plan.tokens_of(rank)
            own = _token_rows(step).index_select(0, mine)
            call = {"q": step.q[mine], "kv_cache": step.kv, "topk_pos": step.positions[mine],
                    "kv_new": step.kv[own], "block_table": step.block_table, "plan": plan}  # fmt: skip
        else:
            call = {"q": _heads(step.q, rank, world).contiguous(), "kv_cache": step.kv, "rows": rows, "plan": plan}
        outs = {}
        for unique in (False, True):
            seen.clear()
            with mock.patch.object(runtime_prefill, "sparse_mla_grouped_prefill", spy):
                outs[unique] = rt.prefill(**call, topk_unique=unique)
            res[f"{mode}-{unique}"] = sorted(set(seen))
        res[f"{mode}-same"] = all(torch.equal(a, b) for a, b in zip(outs[False], outs[True], strict=True))
        res[f"{mode}-step"] = plan.step
    res["bad"] = _error(lambda: rt.prefill(**call, topk_unique=1))
    # given on one rank only (PCP's step agrees first): every rank fails, none waits for the others
    res["bad_on_rank0"] = _error(lambda: rt.prefill(**call, topk_unique="yes" if rank == 0 else True))
    return res


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2], ids=lambda w: f"world{w}")
def test_prefill_topk_unique_reaches_every_kernel_call(dist_pool, world_size: int) -> None:
    for rank, res in enumerate(dist_pool.run(_prefill_unique_body, world_size=world_size)):
        for mode in ("headtp", "shardq", "pcp"):
            assert res[f"{mode}-False"] == [False] and res[f"{mode}-True"] == [True], res
            assert res[f"{mode}-same"], mode
        assert res["shardq-step"] == ("shardq" if world_size > 1 else "headtp")
        assert res["pcp-step"] == "pcp"
        assert res["bad"].startswith("TypeError") and "topk_unique" in res["bad"], res["bad"]
        want = "topk_unique" if rank == 0 else "rank(s) [0] of 2 rejected their inputs"
        assert want in res["bad_on_rank0"], res["bad_on_rank0"]
