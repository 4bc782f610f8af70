"""GQA prefill through the Runtime (head-TP in ``headtp`` / ``mixed``, PCP in ``pcp``) on 1-4 gloo
ranks against the independent fp64 oracle of tests/oracle.py: sinks, windows, ragged and empty
requests, cached prefixes, new keys given or already in the paged cache, ranks that own nothing, a
plan reused across layers; the FA4 path through the Runtime on a CPU stand-in of FA4
(tests/fake_fa4.py): a warmed Runtime compiles nothing; FA4 itself on a GPU."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from shardattn.kernels import fa4, fa4_warmup
from shardattn.kernels.fa4_launch import FAST_LAUNCH_VERSION, check_fast_launch
from shardattn.parallel.gqa_head_tp import head_tp_kv_heads
from shardattn.plan.cudagraph import CGSupport
from shardattn.plan.spec import ModelSpec
from shardattn.runtime.options import PrefillOptions
from shardattn.runtime.runtime import Runtime
from tests.fake_fa4 import FakeFA4
from tests.test_gqa_prefill_parallel import make_step, oracle

WORLDS = [1, 2, 3, 4]


def spec_of(case: dict, dtype: str = "float32") -> ModelSpec:
    hq, hkv, d = case["q"].shape[1], case["k"].shape[1], case["q"].shape[2]
    page = case["k_cache"].shape[1]
    sinks = case["sinks"] is not None  # the model has sinks exactly when the step passes them
    return ModelSpec("gqa", hq, hkv, d, d, 0, page, has_sinks=sinks, dtype=dtype, softmax_scale=case["scale"])


def keys_in_cache(case: dict, seed: int = 3) -> dict:
    """``case`` with a new paged cache (fresh shuffled pages, junk elsewhere) holding each request's
    prefix and then its new keys, as an engine's cache write leaves it before attention (built on
    the CPU, returned on ``case``'s device)."""
    device, given = case["q"].device, case
    case = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in case.items()}
    g = torch.Generator().manual_seed(seed)
    page = case["k_cache"].shape[1]
    hkv, d = case["k"].shape[1:]
    seq = [p + n for p, n in zip(case["prefix_lens"], case["seq_lens"])]
    need = [-(-n // page) for n in seq]
    pages = sum(need) + 1
    order = torch.randperm(pages, generator=g).tolist()
    table = torch.full((len(need), max([*need, 0]) + 1), -1, dtype=torch.int32)
    kc = torch.randn(pages, page, hkv, d, generator=g).to(case["q"].dtype)
    vc = torch.randn(pages, page, hkv, d, generator=g).to(case["q"].dtype)
    start = 0
    for b, n in enumerate(need):
        for j in range(n):
            table[b, j] = order.pop()
        p = case["prefix_lens"][b]
        for t in range(seq[b]):
            dst = (table[b, t // page], t % page)
            if t < p:
                src = (case["block_table"][b, t // page], t % page)
                kc[dst], vc[dst] = case["k_cache"][src], case["v_cache"][src]
            else:
                kc[dst], vc[dst] = case["k"][start + t - p], case["v"][start + t - p]
        start += case["seq_lens"][b]
    return given | {"k_cache": kc.to(device), "v_cache": vc.to(device), "block_table": table.to(device)}


def _rank_inputs(rt: Runtime, plan, case: dict, in_cache: bool) -> tuple:
    """This rank's q, kv_new and kv_cache under the plan's step, and the rows / heads it returns."""
    src = keys_in_cache(case) if in_cache else case
    if plan.step == "pcp":
        ids = plan.tokens_of(rt.rank)
        q, k, v = case["q"][ids], case["k"][ids], case["v"][ids]
        cache = (src["k_cache"], src["v_cache"])
        return q, None if in_cache else (k, v), cache, src["block_table"], (ids, slice(None))
    hl = rt.heads_per_rank
    lo, hi = head_tp_kv_heads(rt.spec.num_heads, rt.spec.num_kv_heads, rt.world_size, rt.rank)
    q = case["q"][:, rt.rank * hl : (rt.rank + 1) * hl]
    kv_new = None if in_cache else (case["k"][:, lo:hi], case["v"][:, lo:hi])
    cache = (src["k_cache"][:, :, lo:hi], src["v_cache"][:, :, lo:hi])
    return q, kv_new, cache, src["block_table"], (slice(None), slice(rt.rank * hl, (rt.rank + 1) * hl))


def _step_body(group: dist.ProcessGroup, case: dict, mode: str, in_cache: bool, return_lse: bool) -> tuple:
    rt = Runtime(
        spec_of(case), group, mode=mode, max_batched_tokens=64, prefill_options=PrefillOptions(return_lse=return_lse)
    )
    plan = rt.plan_prefill(case["seq_lens"], case["prefix_lens"])
    q, kv_new, cache, table, where = _rank_inputs(rt, plan, case, in_cache)
    kw = dict(kv_new=kv_new, block_table=table, sinks=case["sinks"], window_left=case["window_left"])
    rt.comm.reset_counts()
    first = rt.prefill(q, cache, plan=plan, **kw)
    again = rt.prefill(q, cache, plan=plan, **kw, check=False)  # the next layer: the same plan
    lens = rt.prefill(q, cache, query_lens=case["seq_lens"], prefix_lens=case["prefix_lens"], **kw)
    assert torch.equal(first[0], again[0]) and torch.equal(first[0], lens[0])
    return first, where, plan.step, plan.route.path, dict(rt.comm.counts)


def _check(results: list, case: dict, return_lse: bool, step: str) -> None:
    out64, lse64 = oracle(case)
    for r, ((out, lse), (rows, heads), got_step, path, counts) in enumerate(results):
        what = f"rank {r} of {len(results)}"
        assert got_step == step and path == "reference", (what, got_step, path)
        want_out, want_lse = out64[rows][:, heads], lse64[rows][:, heads]
        assert out.shape == want_out.shape and bool(torch.isfinite(out).all()), what
        torch.testing.assert_close(out.double(), want_out, atol=3e-5, rtol=0, msg=what)
        if return_lse:
            torch.testing.assert_close(lse.double(), want_lse, atol=3e-5, rtol=0, msg=what)
        else:
            assert lse is None, what
        if step == "headtp":
            assert counts == {}, f"{what}: a head-TP step is a local call, it issued {counts}"


CASES = {  # name: (new tokens, cached tokens, window)
    "ragged-empty-requests": ([7, 0, 5, 1], [0, 0, 0, 0], -1),
    "prefix": ([6, 3, 9], [5, 0, 8], -1),
    "prefix-window": ([9, 4, 13], [5, 0, 8], 3),
    "window-no-prefix": ([12, 2], [0, 0], 4),
}


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2, 4], ids=lambda w: f"world{w}")
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("in_cache", [False, True], ids=["kv-new", "kv-in-cache"])
def test_head_tp_through_the_runtime_equals_oracle(dist_pool, world: int, name: str, in_cache: bool) -> None:
    lens, prefix, window = CASES[name]
    case = make_step(world, lens, prefix, hq=8, hkv=2, window_left=window)
    mode = "mixed" if world == 2 else "headtp"  # mixed prefills by head-TP too
    results = dist_pool.run(_step_body, case, mode, in_cache, world != 4, world_size=world)
    _check(results, case, world != 4, "headtp")


def _inference_mode_body(group: dist.ProcessGroup, case: dict, mode: str) -> tuple:
    with torch.inference_mode():  # as an engine runs: inference tensors carry no version counter
        case = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
        return _step_body(group, case, mode, True, True)


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "mode"), [(1, "headtp"), (2, "pcp")])
def test_a_prefill_under_inference_mode_equals_oracle(dist_pool, world: int, mode: str) -> None:
    """A cache and block table made under ``torch.inference_mode`` (the Runtime's check memo read
    the table's version counter, which inference tensors lack: a RuntimeError at every call)."""
    case = make_step(3 + world, [6, 3, 9], [5, 0, 8], hq=8, hkv=2, window_left=-1)
    _check(dist_pool.run(_inference_mode_body, case, mode, world_size=world), case, True, mode)


@pytest.mark.distributed
@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"world{w}")
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("in_cache", [False, True], ids=["kv-new", "kv-in-cache"])
def test_pcp_through_the_runtime_equals_oracle(dist_pool, world: int, name: str, in_cache: bool) -> None:
    lens, prefix, window = CASES[name]
    case = make_step(10 + world, lens, prefix, hq=12, hkv=2, window_left=window)
    results = dist_pool.run(_step_body, case, "pcp", in_cache, True, world_size=world)
    _check(results, case, True, "pcp")
    for r, (*_, counts) in enumerate(results):  # with kv_new=None nothing is gathered
        assert counts == {"agreement": 2, **({} if in_cache else {"all_gather": 3})}, (r, counts)  # one unchecked


@pytest.mark.distributed
def test_pcp_ranks_that_own_nothing(dist_pool) -> None:
    case = make_step(21, [1, 0, 2], [4, 3, 0], hq=12, hkv=2)
    for in_cache in (False, True):
        results = dist_pool.run(_step_body, case, "pcp", in_cache, True, world_size=4)
        assert any(len(rows) == 0 for _, (rows, _), *_ in results), "a rank should own nothing"
        _check(results, case, True, "pcp")


def _bad_body(group: dist.ProcessGroup, case: dict) -> dict:
    rt = Runtime(spec_of(case), group, mode="pcp", max_batched_tokens=64)
    plan = rt.plan_prefill(case["seq_lens"], case["prefix_lens"])
    ids = plan.tokens_of(rt.rank)
    q, k, v = case["q"][ids], case["k"][ids], case["v"][ids]
    if rt.rank == 1:
        k = k[:, :1]  # one rank passes the wrong KV heads
    try:
        rt.prefill(
            q, (case["k_cache"], case["v_cache"]), kv_new=(k, v), block_table=case["block_table"], plan=plan,
            sinks=case["sinks"],
        )  # fmt: skip
    except ValueError as e:
        return {"error": str(e)}
    return {"error": None}


@pytest.mark.distributed
def test_pcp_bad_input_raises_on_every_rank(dist_pool) -> None:
    case = make_step(5, [6, 5], [3, 0])
    results = dist_pool.run(_bad_body, case, world_size=2)
    assert results[1]["error"].startswith("kv_new[0] must have shape [")
    assert "rank(s) [1] of 2 rejected their inputs" in results[0]["error"], results[0]


def test_graph_policy_and_workspace_of_gqa_prefill(one_rank_group: dist.ProcessGroup) -> None:
    """GQA prefill steps are never captured; they carve nothing of the arena (its size is the decode step's)."""
    case = make_step(1, [3], [0])
    for mode in ("headtp", "pcp", "mixed"):
        rt = Runtime(spec_of(case), dist.group.WORLD, mode=mode, max_batched_tokens=4096)
        level, why = rt.explain_cudagraph_support("prefill")
        assert level == CGSupport.NEVER and "reference" in why, (mode, why)
        step = "pcp" if mode == "pcp" else "headtp"
        assert rt.ws.step_bounds[("prefill", step)] == {}, mode
        assert rt.workspace_bytes == rt.ws.kind_bytes("decode"), mode


# -- the FA4 path on a CPU stand-in ----------------------------------------------------------------


@contextlib.contextmanager
def fa4_stand_in(fake: FakeFA4, version: str = FAST_LAUNCH_VERSION) -> Iterator[None]:
    """Route the Runtime's GQA prefill to FA4 on the CPU, FA4 being ``fake`` of ``version`` (the
    fast launch's guard reads ``fake.interface``)."""
    from unittest import mock

    with (
        mock.patch.object(fa4, "fa4_unsupported_reason", lambda *a: None),
        mock.patch.object(fa4, "get_fa4", lambda: fake),
        mock.patch.object(fa4, "fast_launch_support", lambda: check_fast_launch(version, fake.interface)),
    ):
        yield


def _fa4_body(group: dist.ProcessGroup, case: dict, mode: str, return_lse: bool) -> tuple:
    fake = FakeFA4()
    with fa4_stand_in(fake):
        rt = Runtime(
            spec_of(case, "bfloat16"), group, mode=mode, max_batched_tokens=64,
            prefill_options=PrefillOptions(return_lse=return_lse),
        )  # fmt: skip
        warmed, calls = set(fake.compiled), len(fake.calls)
        plan = rt.plan_prefill(case["seq_lens"], case["prefix_lens"])
        outs = []
        for in_cache in (False, True):
            for window in (-1, case["window_left"]):
                q, kv_new, cache, table, where = _rank_inputs(rt, plan, case, in_cache)
                kw = dict(kv_new=kv_new, block_table=table, sinks=case["sinks"], window_left=window)
                first = rt.prefill(q, cache, plan=plan, **kw)
                again = rt.prefill(q, cache, plan=plan, **kw, check=False)  # the next layer: a direct launch
                assert torch.equal(first[0], again[0])
                outs.append((first, where, window))
    assert plan.route.path == "fa4", plan.route
    direct = sum(f.fast_calls for f in plan.gqa.launches.forms)
    return outs, warmed, set(fake.compiled), calls, len(rt.gqa_prefill_variants()), direct


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["headtp", "pcp"])
def test_fa4_path_through_the_runtime_compiles_nothing_after_warm_up(dist_pool, mode: str) -> None:
    """The Runtime's warm-up runs every FA4 variant of its config; every step form after it (new
    keys given or in the cache, with and without a window, a prefix) compiles nothing new, the
    results match the oracle within bf16's error, and a form's second call (the next layer)
    launches FA4's kernel directly, with the first call's bits."""
    case = make_step(3, [5, 0, 7], [4, 2, 0], window_left=3, dtype=torch.bfloat16)
    world = 2
    for return_lse in (False, True):
        results = dist_pool.run(_fa4_body, case, mode, return_lse, world_size=world)
        for r, (outs, warmed, compiled, calls, variants, direct) in enumerate(results):
            assert calls == variants > 0, (r, calls, variants)
            assert direct > 0, r  # the second call of a form launched FA4's kernel directly
            assert len(warmed) == variants and compiled == warmed, (r, compiled - warmed)
            for (out, lse), (rows, heads), window in outs:
                out64 = oracle(case | {"window_left": window})[0]
                torch.testing.assert_close(out.double(), out64[rows][:, heads], atol=3e-2, rtol=0)
                assert (lse is None) != return_lse


# -- GPU: the Runtime's FA4 path ---------------------------------------------------------------------


@pytest.mark.gpu
def test_runtime_fa4_path_on_gpu_equals_oracle_and_compiles_nothing_after_warm_up(
    one_rank_group: dist.ProcessGroup,
) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    why = fa4.fa4_unsupported_reason("cuda", torch.bfloat16, 64)
    if why is not None:
        pytest.skip(why)
    case = make_step(7, [130, 0, 257, 64], [70, 128, 0, 5], hq=8, hkv=2, d=64, page=64, dtype=torch.bfloat16)
    case = case | {"window_left": 20}
    dev = {n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in case.items()}
    for mode in ("headtp", "pcp"):
        for return_lse in (False, True):
            rt = Runtime(
                spec_of(case, "bfloat16"), dist.group.WORLD, mode=mode, max_batched_tokens=1024, device="cuda",
                prefill_options=PrefillOptions(return_lse=return_lse),
            )  # fmt: skip
            before = fa4_warmup.compiled_count()
            plan = rt.plan_prefill(case["seq_lens"], case["prefix_lens"])
            assert plan.route.path == "fa4", plan.route.reason
            for in_cache in (False, True):
                for window in (-1, 20):
                    q, kv_new, cache, table, (rows, heads) = _rank_inputs(rt, plan, dev, in_cache)
                    out, lse = rt.prefill(
                        q, cache, plan=plan, kv_new=kv_new, block_table=table, sinks=dev["sinks"], window_left=window
                    )
                    out64 = oracle(case | {"window_left": window})[0]
                    err = float((out.cpu().double() - out64[rows][:, heads]).abs().max())
                    assert err < 2e-2, (mode, in_cache, window, err)
                    assert (lse is None) != return_lse
            torch.cuda.synchronize()
            assert before is not None and fa4_warmup.compiled_count() == before, (mode, return_lse)
