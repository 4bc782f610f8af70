"""Edges of the Runtime's GQA steps on 1-2 gloo ranks, against an fp64 oracle written here (a
softmax over the keys each query may see, with the given scale): queries in another dtype than
the spec's where FA4 is routed (a CPU stand-in of FA4)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from shardattn.runtime.runtime import Runtime
from tests.fake_fa4 import FakeFA4
from tests.test_gqa_prefill_parallel import make_step
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
