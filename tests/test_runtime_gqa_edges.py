"""Edges of the Runtime's GQA steps on 1-2 gloo ranks, against an fp64 oracle written here (a
softmax over the keys each query may see, with the given scale): queries in another dtype than
the spec's where FA4 is routed (a CPU stand-in of FA4); a model of one-token pages (the head-TP
decode warm-up's drafts fit them), its head-TP drafts and prefill against tests/oracle.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from shardattn.plan.spec import ModelSpec
from shardattn.runtime.runtime import Runtime
from tests.fake_fa4 import FakeFA4
from tests.oracle import gqa_oracle
from tests.test_gqa_prefill_parallel import make_step
from tests.test_gqa_prefill_parallel import oracle as prefill_oracle
from tests.test_runtime_gqa_prefill import _rank_inputs, fa4_stand_in, spec_of


def prefill_fp64(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H, D], lse [T, H])`` fp64: token ``j`` of request ``b`` at position ``P_b + j`` sees
    the request's positions ``<= P_b + j`` (the prefix in the paged cache, then the new keys), query
    head ``h`` reading KV head ``h // (H / Hkv)``, the sink in the denominator."""
    q, k, v = (case[n].double() for n in ("q", "k", "v"))
    kc, vc, table = case["k_cache"].double(), case["v_cache"].double(), case["block_table"]
    page, (t, h, d), hkv = kc.shape[1], q.shape, k.shape[1]
    out, lse = torch.zeros(t, h, d, dtype=torch.float64), torch.zeros(t, h, dtype=torch.float64)
    start = 0
    for b, (n, p) in enumerate(zip(case["seq_lens"], case["prefix_lens"])):
        keys = [kc[int(table[b, i // page]), i % page] for i in range(p)] + [k[start + j] for j in range(n)]
        vals = [vc[int(table[b, i // page]), i % page] for i in range(p)] + [v[start + j] for j in range(n)]
        for j in range(n):
            for head in range(h):
                g = head // (h // hkv)
                logits = [case["scale"] * float(q[start + j, head] @ key[g]) for key in keys[: p + j + 1]]
                sink = float(case["sinks"][head]) if case["sinks"] is not None else -math.inf
                m = max([*logits, sink])
                denom = sum(math.exp(x - m) for x in logits) + math.exp(sink - m)
                lse[start + j, head] = m + math.log(denom)
                for x, val in zip(logits, vals):
                    out[start + j, head] += math.exp(x - m) / denom * val[g]
        start += n
    return out, lse


def _fp32_queries_body(group: dist.ProcessGroup, case: dict, mode: str) -> tuple:
    fake = FakeFA4()
    with fa4_stand_in(fake):
        rt = Runtime(spec_of(case, "bfloat16"), group, mode=mode, max_batched_tokens=64)
        plan = rt.plan_prefill(case["seq_lens"], case["prefix_lens"])
        q, kv_new, cache, table, where = _rank_inputs(rt, plan, case, False)
        out, lse = rt.prefill(q, cache, plan=plan, kv_new=kv_new, block_table=table, sinks=case["sinks"])
    return out, lse, where, plan.route.path


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["headtp", "pcp"])
def test_fp32_queries_on_a_bf16_spec_where_fa4_is_routed_equal_fp64(dist_pool, mode: str) -> None:
    """FA4 runs fp16 / bf16 only: a step whose queries (and keys) are fp32 runs the torch reference,
    as ``gqa_prefill`` does, and is exact, not an assertion inside FA4."""
    case = make_step(5, [5, 0, 7], [4, 2, 0], hq=4, hkv=2, dtype=torch.float32)
    out64, lse64 = prefill_fp64(case)
    for out, lse, (rows, heads), path in dist_pool.run(_fp32_queries_body, case, mode, world_size=2):
        assert path == "fa4" and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), out64[rows][:, heads], atol=3e-5, rtol=0)
        torch.testing.assert_close(lse.double(), lse64[rows][:, heads], atol=3e-5, rtol=0)


def _one_token_pages_body(group: dist.ProcessGroup, case: dict, cu: list[int], seq: list[int]) -> tuple:
    rt = Runtime(spec_of(case), group, mode="headtp", max_batched_tokens=64, max_decode_tokens=16)
    plan = rt.plan_prefill(case["seq_lens"], case["prefix_lens"])
    q, kv_new, cache, table, where = _rank_inputs(rt, plan, case, False)
    pre = rt.prefill(q, cache, plan=plan, kv_new=kv_new, block_table=table, sinks=case["sinks"])
    dq = case["dq"][:, where[1]]
    dec = rt.decode(dq, cache, table, seq, cu_q_lens=cu, max_q_len=2, sinks=case["sinks"])
    return pre, dec, where


@pytest.mark.distributed
def test_one_token_pages_warm_up_and_equal_fp64(dist_pool) -> None:
    """``page_size=1`` (a cache of one token per page): the Runtime's head-TP decode warm-up ran its
    two-query drafts over one key of a one-page table, and the construction raised 'requests [0]
    have more queries than keys'."""
    case = make_step(9, [3, 0, 2], [4, 2, 1], hq=4, hkv=2, page=1)
    assert ModelSpec("gqa", 4, 2, 16, 16, 0, 1).page_size == spec_of(case).page_size == 1
    cu, seq = [0, 2, 3, 4], [4, 2, 1]  # drafts over the cached prefixes
    case["dq"] = torch.randn(4, 4, 16, generator=torch.Generator().manual_seed(2))
    out64, lse64 = prefill_oracle(case)
    dec64 = gqa_oracle(
        case["dq"], case["k_cache"], case["v_cache"], case["block_table"], torch.tensor(seq), cu,
        scale=case["scale"], sinks=case["sinks"],
    )  # fmt: skip
    for (out, lse), (dout, dlse), (rows, heads) in dist_pool.run(
        _one_token_pages_body, case, cu, seq, world_size=2
    ):  # fmt: skip
        torch.testing.assert_close(out.double(), out64[rows][:, heads], atol=3e-5, rtol=0)
        torch.testing.assert_close(lse.double(), lse64[rows][:, heads], atol=3e-5, rtol=0)
        torch.testing.assert_close(dout.double(), dec64[0][:, heads], atol=3e-5, rtol=0)
        torch.testing.assert_close(dlse.double(), dec64[1][:, heads], atol=3e-5, rtol=0)
