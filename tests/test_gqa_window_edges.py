"""GQA prefill at the edges of its masks, through the op, the head-TP and PCP steps and the
Runtime, against an fp64 oracle written here from the contract (plain softmax attention: token
``j`` of request ``b`` at position ``P_b + j`` sees positions ``[max(0, p - window_left), p]`` of
its prefix and new tokens, query head ``h`` reads KV head ``h // (H / Hkv)``, the sink in the
denominator only): window 0, a window that leaves out every cached key, a window wider than the
sequence, requests with no new or no cached token, MQA and MHA."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from shardattn.ops.gqa_prefill import gqa_prefill
from shardattn.parallel.comm import Comm
from shardattn.parallel.gqa_prefill import gqa_prefill_pcp
from shardattn.plan import pcp_plan
from shardattn.runtime.runtime import Runtime
from tests.test_gqa_prefill_parallel import make_step
from tests.test_runtime_gqa_prefill import _rank_inputs, keys_in_cache, spec_of


def masked_fp64(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H, D], lse [T, H])`` fp64 in loops over tokens, heads and visible keys."""
    q, k, v = (case[n].double() for n in ("q", "k", "v"))
    kc, vc, table = case["k_cache"].double(), case["v_cache"].double(), case["block_table"]
    page, (t, h, d), hkv, w = kc.shape[1], q.shape, k.shape[1], case["window_left"]
    out, lse = torch.zeros(t, h, d, dtype=torch.float64), torch.full((t, h), -math.inf, dtype=torch.float64)
    start = 0
    for b, (n, p) in enumerate(zip(case["seq_lens"], case["prefix_lens"])):
        keys = [kc[int(table[b, i // page]), i % page] for i in range(p)] + [k[start + j] for j in range(n)]
        vals = [vc[int(table[b, i // page]), i % page] for i in range(p)] + [v[start + j] for j in range(n)]
        for j in range(n):
            pos = p + j
            seen = range(max(0, pos - w) if w >= 0 else 0, pos + 1)
            for head in range(h):
                g = head // (h // hkv)
                logits = [case["scale"] * float(q[start + j, head] @ keys[i][g]) for i in seen]
                terms = logits + ([float(case["sinks"][head])] if case["sinks"] is not None else [])
                m = max(terms)
                lse[start + j, head] = m + math.log(sum(math.exp(x - m) for x in terms))
                for x, i in zip(logits, seen):
                    out[start + j, head] += math.exp(x - lse[start + j, head].item()) * vals[i][g]
        start += n
    return out, lse


CASES = {  # name: (new tokens, cached tokens, window_left, q heads, KV heads)
    "window-0": ([5, 3, 0], [4, 0, 6], 0, 4, 2),
    "window-leaves-out-the-prefix": ([7, 2], [9, 5], 2, 4, 2),
    "window-wider-than-the-sequence": ([5, 3], [2, 0], 50, 4, 2),
    "window-equals-the-prefix": ([4, 4], [3, 6], 3, 4, 2),
    "no-new-tokens-with-prefixes": ([0, 3, 0], [5, 0, 2], 2, 4, 2),
    "mqa-window": ([6, 5], [3, 7], 1, 4, 1),
    "mha-window": ([6, 5], [3, 7], 4, 4, 4),
    "mqa-no-window": ([6, 5], [3, 7], -1, 4, 1),
}


def _case(name: str, seed: int, dtype: torch.dtype = torch.float32) -> dict:
    lens, prefix, window, hq, hkv = CASES[name]
    return make_step(seed, lens, prefix, hq=hq, hkv=hkv, window_left=window, dtype=dtype)


def _close(out: torch.Tensor, lse: torch.Tensor, out64: torch.Tensor, lse64: torch.Tensor, what: str) -> None:
    assert out.shape == out64.shape and lse.shape == lse64.shape, what
    torch.testing.assert_close(out.double(), out64, atol=3e-5, rtol=0, msg=what)
    torch.testing.assert_close(lse.double(), lse64, atol=3e-5, rtol=0, msg=what)


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("in_cache", [False, True], ids=["kv-given", "kv-in-cache"])
def test_op_equals_fp64(name: str, in_cache: bool) -> None:
    case = _case(name, 1)
    src = keys_in_cache(case) if in_cache else case
    kv = (None, None) if in_cache else (case["k"], case["v"])
    out, lse = gqa_prefill(
        case["q"], *kv, _cu(case["seq_lens"]), k_cache=src["k_cache"], v_cache=src["v_cache"],
        block_table=src["block_table"], prefix_lens=torch.tensor(case["prefix_lens"], dtype=torch.int32),
        sinks=case["sinks"], window_left=case["window_left"], scale=case["scale"], return_lse=True,
    )  # fmt: skip
    _close(out, lse, *masked_fp64(case), name)


def _pcp_body(group: dist.ProcessGroup, case: dict, in_cache: bool) -> tuple:
    comm = Comm(group)
    plan = pcp_plan(case["seq_lens"], comm.world_size, prefix_lens=case["prefix_lens"])
    ids = plan.shard.token_ids(comm.rank)
    src = keys_in_cache(case) if in_cache else case
    kv = (None, None) if in_cache else (case["k"][ids], case["v"][ids])
    out, lse = gqa_prefill_pcp(
        case["q"][ids], *kv, plan, comm, k_cache=src["k_cache"], v_cache=src["v_cache"],
        block_table=src["block_table"], sinks=case["sinks"], window_left=case["window_left"], scale=case["scale"],
    )  # fmt: skip
    return out, lse, ids


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4], ids=lambda w: f"world{w}")
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("in_cache", [False, True], ids=["kv-given", "kv-in-cache"])
def test_pcp_step_equals_fp64(dist_pool, nproc: int, world: int, name: str, in_cache: bool) -> None:
    if world > nproc:
        pytest.skip(f"needs {world} ranks; run with --nproc {world}")
    case = _case(name, 2 + world)
    out64, lse64 = masked_fp64(case)
    for r, (out, lse, ids) in enumerate(dist_pool.run(_pcp_body, case, in_cache, world_size=world)):
        _close(out, lse, out64[ids], lse64[ids], f"{name}: rank {r} of {world}")


def _runtime_body(group: dist.ProcessGroup, case: dict, mode: str, in_cache: bool) -> tuple:
    rt = Runtime(spec_of(case), group, mode=mode, max_batched_tokens=64)
    plan = rt.plan_prefill(case["seq_lens"], case["prefix_lens"])
    q, kv_new, cache, table, where = _rank_inputs(rt, plan, case, in_cache)
    out, lse = rt.prefill(
        q, cache, plan=plan, kv_new=kv_new, block_table=table, sinks=case["sinks"], window_left=case["window_left"]
    )
    return out, lse, where


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "mode"), [(1, "headtp"), (2, "headtp"), (2, "pcp"), (4, "pcp")])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("in_cache", [False, True], ids=["kv-new", "kv-in-cache"])
def test_runtime_prefill_equals_fp64(dist_pool, nproc: int, world: int, mode: str, name: str, in_cache: bool) -> None:
    if world > nproc:
        pytest.skip(f"needs {world} ranks; run with --nproc {world}")
    hkv = CASES[name][4]
    if mode == "headtp" and hkv < world and world % hkv:
        pytest.skip("KV heads neither split nor replicated over these ranks")
    case = _case(name, 7 + world)
    out64, lse64 = masked_fp64(case)
    for r, (out, lse, (rows, heads)) in enumerate(dist_pool.run(_runtime_body, case, mode, in_cache, world_size=world)):
        _close(out, lse, out64[rows][:, heads], lse64[rows][:, heads], f"{name}: {mode} rank {r} of {world}")
