"""The servable Ray pool on local Ray (gloo): outputs equal fp64 attention over the whole cache
across prefill, chunked prefill, decode and free; bad requests leave it healthy; a killed or
raising rank gives one RankFailedError and restart() recovers. One Ray instance per module."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import importlib.util
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from shardattn.plan.spec import ModelSpec
from shardattn.runtime.options import DecodeOptions, PrefillOptions
from shardattn.serving.errors import ray_unavailable_reason, require_ray

REASON = ray_unavailable_reason()
needs_ray = pytest.mark.skipif(REASON is not None, reason=f"optional dependency missing: {REASON}")

MLA = ModelSpec("sparse_mla", 8, 1, 48, 32, 16, 4, dtype="float32", softmax_scale=0.3)
GQA = ModelSpec("gqa", 8, 2, 16, 16, 0, 4, dtype="float32")
GQA_SINKS = ModelSpec("gqa", 8, 2, 16, 16, 0, 4, dtype="float32", has_sinks=True)  # gqa-64-8, tiny
MLA_SINKS = ModelSpec("sparse_mla", 8, 1, 48, 32, 16, 4, dtype="float32", has_sinks=True, softmax_scale=0.3)
NAN_SINKS = torch.tensor([0.0, 1.0, float("nan"), 0.0, 0.0, 0.0, 0.0, 0.0])
ATOL = 2e-5
TIMEOUT_S = 60.0


def test_without_ray_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # "import ray" raises ImportError
    with pytest.raises(ImportError, match=r"shardattn\[ray\]"):
        require_ray()
    from shardattn.serving import RayRankPool

    with pytest.raises(ImportError, match="'ray' extra"):
        RayRankPool(2)


@needs_ray
def test_bad_pool_configs_raise_before_any_actor_starts() -> None:
    from shardattn.serving import RayRankPool

    small = {"max_batched_tokens": 8}
    cases = [
        ({"spec": "gqa-64-8", "mode": "dcp-decode", "runtime_kwargs": small}, r"sinks must be given \(\[64\] fp32\)"),
        ({"spec": MLA, "runtime_kwargs": small, "sinks": torch.zeros(8)}, "sinks must be None"),
        ({"spec": GQA_SINKS, "mode": "dcp-decode", "runtime_kwargs": small, "sinks": torch.zeros(4)}, "sinks must"),
        ({"spec": GQA_SINKS, "mode": "dcp-decode", "runtime_kwargs": small, "sinks": NAN_SINKS}, "sinks must be fin"),
        ({"spec": MLA, "runtime_kwargs": small, "memory_limit_bytes": 1000}, "over memory_limit_bytes=1000"),
        ({"spec": MLA, "mode": "pcp-decode", "runtime_kwargs": small}, "mode must be one of"),
        ({"spec": MLA}, "runtime_kwargs must give max_batched_tokens"),
        ({"spec": MLA, "runtime_kwargs": small, "transport": "grpc"}, "transport must be one of"),
        ({"spec": MLA, "runtime_kwargs": small, "device": "tpu"}, "device must be"),
        ({"spec": MLA, "runtime_kwargs": small, "timeout_s": math.nan}, r"^timeout_s must be a finite number > 0"),
        ({"spec": MLA, "runtime_kwargs": small, "timeout_s": 0}, r"^timeout_s must be a finite number > 0"),
        ({"spec": MLA, "runtime_kwargs": small, "placement_timeout_s": -5}, r"^placement_timeout_s must be a finite"),
        ({"spec": MLA, "runtime_kwargs": small, "num_cpus": -1}, r"^num_cpus must be a finite number >= 0"),
        ({"spec": MLA, "runtime_kwargs": small, "placement_strategy": "BOGUS"}, r"^placement_strategy must be one of"),
        ({"spec": MLA, "runtime_kwargs": {"max_batched_tokens": -1}}, r"max_batched_tokens'\] must be >= 1"),
        ({"spec": MLA, "runtime_kwargs": {**small, "topk": 0}}, r"runtime_kwargs\['topk'\] must be >= 1"),
        ({"spec": MLA, "runtime_kwargs": {**small, "scale": -1.0}}, r"runtime_kwargs\['scale'\] must be a finite"),
        ({"spec": MLA, "runtime_kwargs": {**small, "scale": math.nan}}, r"runtime_kwargs\['scale'\] must be a fin"),
        ({"spec": MLA, "runtime_kwargs": {**small, "devcie": "cpu"}}, r"runtime_kwargs holds \['devcie'\]"),
        ({"spec": MLA, "runtime_kwargs": {**small, "mode": "pcp"}}, r"runtime_kwargs must not give mode"),
        ({"spec": GQA, "mode": "shardq", "runtime_kwargs": small}, r"mode 'shardq' serves sparse MLA only"),
        (
            {"spec": GQA, "mode": "dcp-decode", "runtime_kwargs": {**small, "kv_dtype": "fp8_ds_mla"}},
            r"kv_dtype'\]='fp8_ds_mla' holds DSA sparse-MLA rows",
        ),
        # a pool's queries and resident rows are the spec's dtype: every step was refused on the ranks
        (
            {"spec": MLA, "runtime_kwargs": {**small, "kv_dtype": "bf16"}},
            r"^runtime_kwargs\['kv_dtype'\]='bfloat16': a pool's KV rows are its spec's float32 \(or fp8_ds_mla\)",
        ),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            RayRankPool(2, init_ray=False, **kwargs)
    with pytest.raises(TypeError, match="sinks must have dtype"):
        RayRankPool(2, GQA_SINKS, mode="dcp-decode", runtime_kwargs=small, sinks=torch.zeros(8).double())
    for kwargs, match in (
        ({"runtime_kwargs": {"max_batched_tokens": 2.7}}, r"max_batched_tokens'\] must be an int"),
        ({"runtime_kwargs": small, "memory_limit_bytes": "big"}, r"^memory_limit_bytes must be an int"),
        ({"runtime_kwargs": small, "timeout_s": "60"}, r"^timeout_s must be a float"),
        ({"runtime_kwargs": {**small, "warmup": "yes"}}, r"^runtime_kwargs\['warmup'\] must be a bool"),
        ({"runtime_kwargs": {**small, "host_id": 5}}, r"^runtime_kwargs\['host_id'\] must be a str or None"),
    ):
        with pytest.raises(TypeError, match=match):
            RayRankPool(2, MLA, init_ray=False, **kwargs)


@needs_ray
def test_a_cpu_pool_of_no_cpus_is_refused_before_ray_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """``device="cpu", num_cpus=0`` was refused after the pool started Ray, which kept running: it
    is refused first; ``device="auto"`` (known to be a CPU pool once Ray runs) stops the Ray it started."""
    import ray

    from shardattn.serving import RayRankPool

    calls: list[str] = []

    def start(**kwargs) -> None:
        calls.append("init")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", start)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0})
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    small = {"max_batched_tokens": 8, "warmup": False}
    with pytest.raises(ValueError, match=r"^num_cpus must be > 0 for a CPU pool"):
        RayRankPool(2, MLA, device="cpu", num_cpus=0, runtime_kwargs=small)
    assert calls == []
    with pytest.raises(ValueError, match=r"^num_cpus must be > 0 for a CPU pool"):
        RayRankPool(2, MLA, device="auto", num_cpus=0, runtime_kwargs=small)
    assert calls == ["init", "shutdown"]


def test_the_pool_names_every_runtime_argument_it_does_not_set_itself() -> None:
    """``runtime_kwargs`` may give exactly the Runtime's arguments but the spec, group and device."""
    import inspect

    from shardattn.runtime.runtime import Runtime
    from shardattn.serving.pool_shapes import RUNTIME_KWARGS

    assert set(inspect.signature(Runtime.__init__).parameters) - {"self", "spec", "group", "device"} == RUNTIME_KWARGS


@pytest.fixture(scope="module")
def ray_instance():
    if REASON is not None:
        pytest.skip(REASON)
    import ray

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _pool(world: int, spec: ModelSpec, **kwargs):
    from shardattn.serving import RayRankPool

    mode = kwargs.pop("mode", "mixed" if spec.kind == "sparse_mla" else "dcp-decode")
    runtime = {
        "max_batched_tokens": 64,
        "max_decode_tokens": 16,
        "prefill_options": PrefillOptions(min_shard_tokens=1),
        "warmup": False,
    }
    runtime.update(kwargs.pop("runtime_kwargs", {}))
    return RayRankPool(
        world, spec, mode=mode, device="cpu", timeout_s=TIMEOUT_S, runtime_kwargs=runtime, init_ray=False, **kwargs
    )


@pytest.fixture(scope="module")
def pool2(ray_instance):
    with _pool(2, MLA, max_requests=4, max_seq_len=48, num_pages=16) as pool:
        yield pool


def _check(outs, requests, mirror) -> None:
    assert len(outs) == len(requests)
    for (out, lse), req in zip(outs, requests):
        ref_out, ref_lse = mirror.expected(req)
        assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
        assert torch.isfinite(out).all()
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))  # rows with no valid key: lse = -inf
        assert torch.allclose(out.double(), ref_out, atol=ATOL, rtol=0), (out.double() - ref_out).abs().max()
        fin = torch.isfinite(ref_lse)
        assert torch.allclose(lse.double()[fin], ref_lse[fin], atol=ATOL, rtol=0)


def _check_gqa_prefill_refusals(pool, spec: ModelSpec) -> None:
    """On the driver, a GQA pool refuses a prefill's queries when its mode has no prefill attention,
    and top-k positions with them when it has (its prefill is causal); nothing is admitted."""
    from shardattn.serving import PrefillRequest

    n, hkv = 3, spec.num_kv_heads
    kv = (torch.zeros(n, hkv, spec.head_dim), torch.zeros(n, hkv, spec.v_dim))
    q = torch.zeros(n, spec.num_heads, spec.head_dim)
    if pool.shapes.prefill_attention:
        req = PrefillRequest("refused", kv=kv, q=q, topk_pos=torch.zeros(n, 1, dtype=torch.int32))
        match = "request 'refused': topk_pos must be None for a GQA pool"
    else:
        req, match = PrefillRequest("refused", kv=kv, q=q), "q must be None: this pool's mode has no prefill attention"
    with pytest.raises(ValueError, match=match):
        pool.prefill([req])
    assert "refused" not in pool.book


def _serve_and_check(pool, mirror) -> None:
    """Prefill, chunked prefill, decode (drafts, with and without new KV), free and reuse of the pages."""
    reqs = [mirror.prefill_request("a", 13), mirror.prefill_request("b", 7), mirror.prefill_request("c", 5)]
    _check(pool.prefill(reqs, return_lse=True), reqs, mirror)
    reqs = [mirror.prefill_request("c", 6)]  # the second chunk attends over the 5 cached tokens
    _check(pool.prefill(reqs, return_lse=True), reqs, mirror)
    for step in range(3):
        reqs = [
            mirror.decode_request("a"),
            mirror.decode_request("b", 2 if step == 1 else 1),
            mirror.decode_request("c"),
        ]
        _check(pool.decode(reqs, return_lse=True), reqs, mirror)
    reqs = [mirror.decode_request("a", append=False)]
    _check(pool.decode(reqs, return_lse=True), reqs, mirror)
    pages = pool.book.free_pages
    assert pool.free(["b"]) > 0 and pool.book.free_pages > pages
    mirror.free("b")
    reqs = [mirror.prefill_request("d", 17)]  # takes b's pages
    _check(pool.prefill(reqs, return_lse=True), reqs, mirror)
    reqs = [mirror.decode_request("a"), mirror.decode_request("d"), mirror.decode_request("c")]
    _check(pool.decode(reqs, return_lse=True), reqs, mirror)
    outs = pool.decode([mirror.decode_request("d")])  # without return_lse: outputs only
    assert outs[0].shape == (1, mirror.spec.num_heads, mirror.spec.v_dim)


@needs_ray
def test_pool_forms_a_group_in_a_placement_group(pool2) -> None:
    assert pool2.backend == "gloo" and pool2.transport == "shm"  # decode steps through shared memory
    assert os.path.exists(pool2._decoder.steps.path) and pool2._decoder.steps.pinned == [False, False]
    assert pool2.run(dist.get_rank) == [0, 1]
    health = pool2.health()
    assert health["state"] == "healthy" and [r["state"] for r in health["ranks"]] == ["ready", "ready"]
    assert all(r["cache_bytes"] == 16 * 4 * 48 * 4 and r["rss_bytes"] > 0 for r in health["ranks"])


@needs_ray
def test_two_rank_pool_equals_fp64_attention(pool2) -> None:
    from shardattn.testing.serving import ServingMirror

    _serve_and_check(pool2, ServingMirror(MLA, seed=1))
    pool2.free(list(pool2.book.request_ids))
    assert all(r["last_step_s"] > 0 for r in pool2.health()["ranks"])


@needs_ray
@pytest.mark.parametrize(
    "world,spec,mode,interleave,transport",
    [
        (4, MLA, "mixed", 2, "compiled"),
        (4, GQA, "dcp-decode", 1, "shm"),
        (2, MLA, "shardq", 1, "calls"),  # head-TP decode over a replicated cache
        (2, GQA, "headtp", 1, "shm"),  # each rank holds its KV heads of every token
    ],
    ids=["4-mla-mixed-I2-compiled", "4-gqa-dcp-shm", "2-mla-headtp-calls", "2-gqa-headtp-shm"],
)
def test_pool_modes_equal_fp64_attention(ray_instance, world, spec, mode, interleave, transport) -> None:
    from shardattn.testing.serving import ServingMirror

    kwargs = {"max_requests": 4, "max_seq_len": 48, "transport": transport}
    with _pool(
        world, spec, mode=mode, runtime_kwargs={"decode_options": DecodeOptions(dcp_interleave=interleave)}, **kwargs
    ) as pool:
        dcp = mode in ("mixed", "dcp-decode")
        assert pool.transport == transport and pool.cache_config.layout.world_size == (world if dcp else 1)
        if spec.kind == "gqa" and not dcp:  # the rank's one KV head of GQA's two: half of every row
            row_bytes = 2 * spec.head_dim * 4
            assert all(r["cache_bytes"] == pool.cache_config.num_pages * spec.page_size * row_bytes
                       for r in pool.health()["ranks"])  # fmt: skip
        mirror = ServingMirror(spec, seed=2)
        if spec.kind == "sparse_mla":
            _serve_and_check(pool, mirror)
            _in_place_step(pool, mirror, ["a", "d"], (2, 1))
            return
        attend = pool.shapes.prefill_attention  # head-TP GQA prefill; none under dcp-decode
        assert attend == (mode == "headtp")
        _check_gqa_prefill_refusals(pool, spec)
        for chunks in ([(0, 9), (1, 3), (2, 14)], [(1, 4)]):  # then a chunk over request 1's 3 cached tokens
            reqs = [mirror.prefill_request(i, n, attend=attend) for i, n in chunks]
            outs = pool.prefill(reqs, return_lse=attend)
            if attend:
                _check(outs, reqs, mirror)
            else:
                assert outs == [None] * len(reqs)
        for q_lens in ((1, 1, 1), (2, 1, 3)):  # plain decode, then ragged drafts
            reqs = [mirror.decode_request(i, q) for i, q in enumerate(q_lens)]
            _check(pool.decode(reqs, return_lse=True), reqs, mirror)
        _in_place_step(pool, mirror, [2, 0], (3, 1))


@needs_ray
@pytest.mark.parametrize(("spec", "mode"), [(GQA, "headtp"), (MLA, "mixed")], ids=["gqa-headtp", "mla-dcp"])
def test_a_pool_without_lse_refuses_to_return_one_and_shuts_down_clearly(ray_instance, spec, mode) -> None:
    """A pool whose Runtimes skip the LSE (of prefill and decode; head-TP GQA, and sparse MLA with
    DCP decode) serves outputs (equal to fp64 attention); asked for the LSE it says why on the
    driver and stays usable; after shutdown it says so."""
    from shardattn.testing.serving import ServingMirror

    runtime = {"decode_options": DecodeOptions(return_lse=False), "prefill_options": PrefillOptions(return_lse=False)}
    with _pool(2, spec, mode=mode, max_requests=2, max_seq_len=32, runtime_kwargs=runtime) as pool:
        mirror = ServingMirror(spec, seed=5)
        req = mirror.prefill_request(0, 7)
        with pytest.raises(ValueError, match=r"Runtimes skip the LSE of their prefill"):
            pool.prefill([req], return_lse=True)
        (out,) = pool.prefill([req])
        ref_out, _ = mirror.expected(req)
        assert torch.allclose(out.double(), ref_out, atol=ATOL, rtol=0), (out.double() - ref_out).abs().max()
        with pytest.raises(ValueError, match=r"return_lse=True, but this pool's Runtimes skip the LSE"):
            pool.decode([mirror.decode_request(0, append=False)], return_lse=True)
        req = mirror.decode_request(0, 2)
        (out,) = pool.decode([req])
        ref_out, _ = mirror.expected(req)
        assert torch.allclose(out.double(), ref_out, atol=ATOL, rtol=0), (out.double() - ref_out).abs().max()
        assert pool.health()["state"] == "healthy"
    assert pool.health()["state"] == "shut down"
    with pytest.raises(RuntimeError, match="the pool is shut down"):
        pool.restart()


@pytest.mark.parametrize("mode", ["shardq", "headtp", "pcp", "dcp-decode", "mixed"])
@pytest.mark.parametrize("spec", [MLA, GQA], ids=["mla", "gqa"])
def test_a_pool_whose_runtimes_drop_the_decode_lse_knows_it_in_every_mode(mode: str, spec: ModelSpec) -> None:
    """Its Runtimes return ``(out, None)`` from every decode step with ``DecodeOptions(return_lse=False)``,
    DCP's and sparse MLA's too: the pool refuses ``return_lse=True`` rather than failing on a rank."""
    from shardattn.serving.pool_shapes import plan_pool

    if mode == "shardq" and spec.kind == "gqa":
        pytest.skip("a GQA model has no ShardQ mode")
    kwargs = {"max_batched_tokens": 16, "decode_options": DecodeOptions(return_lse=False)}
    assert plan_pool(spec, mode, kwargs, 2, None, 2, 32, None, None).decode_lse is False
    assert plan_pool(spec, mode, {"max_batched_tokens": 16}, 2, None, 2, 32, None, None).decode_lse is True


MLA_DSA = ModelSpec("sparse_mla", 4, 1, 576, 512, 4, 4, dtype="float32", softmax_scale=0.1)


@needs_ray
@pytest.mark.parametrize("mode", ["mixed", "pcp"])
def test_pool_keeps_its_resident_cache_in_fp8_when_asked(ray_instance, mode) -> None:
    """runtime_kwargs={"kv_dtype": "fp8_ds_mla"}: the ranks' resident pages are 656-byte rows (new
    rows quantised as they are stored), every step reads them, and the outputs equal fp64 attention
    over the rows as stored."""
    from shardattn.testing.serving import ServingMirror

    kwargs = {"max_requests": 4, "max_seq_len": 48, "num_pages": 16, "runtime_kwargs": {"kv_dtype": "fp8_ds_mla"}}
    with _pool(2, MLA_DSA, mode=mode, **kwargs) as pool:
        assert all(r["cache_bytes"] == 16 * 4 * 656 for r in pool.health()["ranks"])
        mirror = ServingMirror(MLA_DSA, seed=3, kv_dtype="fp8_ds_mla")
        reqs = [mirror.prefill_request("a", 13), mirror.prefill_request("b", 7)]
        _check(pool.prefill(reqs, return_lse=True), reqs, mirror)
        reqs = [mirror.prefill_request("b", 6)]  # the second chunk attends over the cached (FP8) prefix
        _check(pool.prefill(reqs, return_lse=True), reqs, mirror)
        for q_len in (1, 2):
            reqs = [mirror.decode_request("a", q_len), mirror.decode_request("b")]
            _check(pool.decode(reqs, return_lse=True), reqs, mirror)


def test_stale_staging_rows_and_a_prefill_failed_on_the_driver_leave_nothing_wrong(pool2) -> None:
    """``step_inputs()`` rows written over by another step (another thread's, or ``decode``'s
    requests) were attended silently (an error of 0.65): such views are refused until taken again.
    A prefill that failed on the driver after the ledger grew kept its tokens (the next decode read
    rows no rank wrote, an error of 0.27): the ledger is as it was."""
    from unittest import mock

    from shardattn.serving import DecodeRequest, PrefillRequest
    from shardattn.testing.serving import ServingMirror

    mirror = ServingMirror(MLA, seed=12)
    pool2.prefill([mirror.prefill_request("a", 9, attend=False), mirror.prefill_request("b", 6, attend=False)])
    ra, rb = mirror.decode_request("a", append=False), mirror.decode_request("b", append=False)
    for other_step in (lambda: pool2.decode_batch(["b"], rb.q, rb.topk_pos), lambda: pool2.decode([rb])):
        staged = pool2.step_inputs(1)
        staged["q"].copy_(ra.q)
        staged["topk_pos"].copy_(ra.topk_pos)
        other_step()
        with pytest.raises(ValueError, match=r"^q is the pool's staging rows \(step_inputs\(\)\), but a step"):
            pool2.decode_batch(["a"], staged["q"], staged["topk_pos"])
    staged = pool2.step_inputs(1)  # taken again: the step runs
    staged["q"].copy_(ra.q)
    staged["topk_pos"].copy_(ra.topk_pos)
    _check([pool2.decode_batch(["a"], staged["q"], staged["topk_pos"], return_lse=True)], [ra], mirror)
    on_rows = DecodeRequest("a", q=staged["q"], topk_pos=staged["topk_pos"])  # a request built on those rows
    _check(pool2.decode([on_rows], return_lse=True), [ra], mirror)  # raised torch's aliasing error

    pages, lens = pool2.book.free_pages, (pool2.book.seq_len("a"), pool2.book.seq_len("b"))
    chunk = [PrefillRequest("a", kv=torch.zeros(4, MLA.head_dim)), PrefillRequest("c", kv=torch.zeros(3, MLA.head_dim))]
    with mock.patch("ray.put", side_effect=RuntimeError("object store full")), pytest.raises(RuntimeError):
        pool2.prefill(chunk)
    assert not pool2.broken and "c" not in pool2.book and pool2.book.free_pages == pages
    assert (pool2.book.seq_len("a"), pool2.book.seq_len("b")) == lens
    ra = mirror.decode_request("a")
    _check(pool2.decode([ra], return_lse=True), [ra], mirror)
    pool2.free(["a", "b"])


@needs_ray
def test_stale_top_k_and_kv_staging_views_are_refused_naming_them(pool2) -> None:
    """Fresh queries with top-k positions or KV rows from ``step_inputs()`` that another step wrote
    over: the step attended the other request's positions (an error of 0.79), or wrote its KV row
    into the cache for good. Every staged input is checked: refused, naming it (decode()'s request
    objects too); nothing changes."""
    from shardattn.serving import DecodeRequest
    from shardattn.testing.serving import ServingMirror

    mirror = ServingMirror(MLA, seed=12)
    pool2.prefill([mirror.prefill_request("a", 9, attend=False), mirror.prefill_request("b", 6, attend=False)])
    ra = mirror.decode_request("a", append=False)
    staged = pool2.step_inputs(1)
    staged["topk_pos"].copy_(ra.topk_pos)
    staged["kv"].copy_(torch.randn(1, MLA.head_dim))
    rb = mirror.decode_request("b")  # its query, top-k and KV row go over the staging rows
    _check(pool2.decode([rb], return_lse=True), [rb], mirror)
    stale = r" is the pool's staging rows \(step_inputs\(\)\), but a step has written other inputs over them"
    with pytest.raises(ValueError, match="^topk_pos" + stale):
        pool2.decode_batch(["a"], ra.q.clone(), staged["topk_pos"])
    with pytest.raises(ValueError, match="^kv" + stale):
        pool2.decode_batch(["a"], ra.q.clone(), ra.topk_pos.clone(), kv=staged["kv"])
    stale_request = DecodeRequest("a", ra.q.clone(), staged["topk_pos"])  # as decode()'s request objects
    with pytest.raises(ValueError, match=r"^requests\[0\]\.topk_pos" + stale):
        pool2.decode([stale_request])
    assert pool2.book.seq_len("a") == 9 and not pool2.broken
    _check([pool2.decode_batch(["a"], ra.q, ra.topk_pos, return_lse=True)], [ra], mirror)  # a's cache as it was
    pool2.free(["a", "b"])


@needs_ray
def test_decode_batch_takes_later_rows_of_the_staging_area(pool2) -> None:
    """Rows 1..3 of a staged batch of three (a sub-batch, KV rows included) raised torch's aliasing
    error: they are read before the step's inputs are written over the leading rows."""
    from shardattn.testing.serving import ServingMirror

    mirror = ServingMirror(MLA, seed=7)
    pool2.prefill([mirror.prefill_request(i, n, attend=False) for i, n in ((20, 5), (21, 6), (22, 7))])
    reqs = [mirror.decode_request(20, append=False), mirror.decode_request(21), mirror.decode_request(22)]
    staged = pool2.step_inputs(3)
    torch.cat([r.q for r in reqs], out=staged["q"])
    torch.cat([r.topk_pos for r in reqs], out=staged["topk_pos"])
    staged["kv"][0].normal_()
    torch.cat([r.kv for r in reqs[1:]], out=staged["kv"][1:])
    out, lse = pool2.decode_batch([21, 22], staged["q"][1:], staged["topk_pos"][1:], kv=staged["kv"][1:],
                                  return_lse=True)  # fmt: skip
    _check(list(zip(out.split(1), lse.split(1))), reqs[1:], mirror)
    assert [pool2.book.seq_len(i) for i in (20, 21, 22)] == [5, 7, 8]
    pool2.free([20, 21, 22])


@needs_ray
def test_a_refused_out_leaves_the_staging_views_valid(pool2) -> None:
    """A step refused for its ``out`` writes nothing, but counted as a step written over the staging
    rows: this thread's valid ``step_inputs()`` views were then refused."""
    from shardattn.testing.serving import ServingMirror

    mirror = ServingMirror(MLA, seed=9)
    pool2.prefill([mirror.prefill_request("a", 9, attend=False)])
    ra = mirror.decode_request("a", append=False)
    staged = pool2.step_inputs(1)
    staged["q"].copy_(ra.q)
    staged["topk_pos"].copy_(ra.topk_pos)
    with pytest.raises(ValueError, match=r"^out must have shape \[1, 8, 32\]"):
        pool2.decode_batch(["a"], ra.q.clone(), ra.topk_pos, out=torch.empty(1, 8, 999))
    _check([pool2.decode_batch(["a"], staged["q"], staged["topk_pos"], return_lse=True)], [ra], mirror)
    pool2.free(["a"])


def _in_place_step(pool, mirror, ids, q_lens) -> None:
    """One decode_batch step written into pool.step_inputs() (KV rows included), outputs as views: the reference."""
    reqs = [mirror.decode_request(i, n) for i, n in zip(ids, q_lens)]
    slots = pool.step_inputs(sum(q_lens))
    torch.cat([r.q for r in reqs], out=slots["q"])
    if "topk_pos" in slots:
        torch.cat([r.topk_pos for r in reqs], out=slots["topk_pos"])
    kv = slots["kv"] if isinstance(slots["kv"], tuple) else (slots["kv"],)
    for c, dst in enumerate(kv):
        torch.cat([r.kv[c] if isinstance(r.kv, tuple) else r.kv for r in reqs], out=dst)
    out, lse = pool.decode_batch(ids, slots["q"], slots.get("topk_pos"), query_lens=list(q_lens), kv=slots["kv"],
                                 return_lse=True, view=True)  # fmt: skip
    _check(list(zip(out.split(list(q_lens)), lse.split(list(q_lens)))), reqs, mirror)


def _sinks(seed: int) -> torch.Tensor:
    return torch.randn(8, generator=torch.Generator().manual_seed(seed)) * 2.0


@needs_ray
def test_gqa_pool_with_sinks_equals_fp64_attention(ray_instance) -> None:
    """gqa-64-8's shape (GQA, sinks) at tiny dims under ``mixed`` (head-TP prefill, DCP decode over
    interleaved shards): prefill and chunked prefill (the cached prefix gathered from the shards),
    decode, free, new sinks; bad sinks raise on the driver and leave the pool serving."""
    from shardattn.testing.serving import ServingMirror

    sinks = _sinks(6)
    runtime = {"decode_options": DecodeOptions(dcp_interleave=2)}
    with _pool(2, GQA_SINKS, mode="mixed", max_requests=4, max_seq_len=48, sinks=sinks, runtime_kwargs=runtime) as pool:
        assert pool.cache_config.layout.world_size == 2
        mirror = ServingMirror(GQA_SINKS, seed=6, sinks=sinks)
        for chunks in ([(0, 9), (1, 3), (2, 14)], [(1, 4), (0, 5)]):  # then chunks over 3 and 9 cached tokens
            reqs = [mirror.prefill_request(i, n) for i, n in chunks]
            _check(pool.prefill(reqs, return_lse=True), reqs, mirror)
        for q_lens in ((1, 1, 1), (2, 1, 3)):
            reqs = [mirror.decode_request(i, q) for i, q in enumerate(q_lens)]
            _check(pool.decode(reqs, return_lse=True), reqs, mirror)
        steps = [r["steps"] for r in pool.health()["ranks"]]
        bad = [
            (torch.zeros(4), ValueError, r"sinks must have shape \[8\]"),
            (torch.zeros(8, dtype=torch.float16), TypeError, "sinks must have dtype"),
            (NAN_SINKS, ValueError, r"sinks must be finite, got sinks\[2\]=nan"),
            (torch.full((8,), float("inf")), ValueError, "sinks must be finite"),
            (None, ValueError, "sinks must be given"),
            ([0.0] * 8, TypeError, "sinks must be a torch.Tensor"),
        ]
        for value, exc, match in bad:
            with pytest.raises(exc, match=match):
                pool.set_sinks(value)
        # more queries than keys (no KV written): the ranks failed the step and the pool broke
        from shardattn.serving import DecodeRequest

        lens = [pool.book.seq_len(i) for i in range(3)]
        q = torch.zeros(lens[1] + 1, 8, 16)
        with pytest.raises(ValueError, match=r"^request_ids\[0\] has \d+ queries but \d+ keys after the step"):
            pool.decode_batch([1], q, query_lens=[q.shape[0]])
        with pytest.raises(ValueError, match=r"^requests \[1\] have more queries than keys after the step"):
            pool.decode([DecodeRequest(1, q=q)])
        assert [pool.book.seq_len(i) for i in range(3)] == lens
        health = pool.health()
        assert health["state"] == "healthy" and [r["steps"] for r in health["ranks"]] == steps
        reqs = [mirror.decode_request(i) for i in range(3)]  # the old sinks still hold
        _check(pool.decode(reqs, return_lse=True), reqs, mirror)
        assert pool.free([1]) > 0
        mirror.free(1)
        mirror.sinks = _sinks(7)
        pool.set_sinks(mirror.sinks)
        reqs = [mirror.prefill_request(3, 20), mirror.prefill_request(2, 2)]  # takes request 1's pages; a chunk
        _check(pool.prefill(reqs, return_lse=True), reqs, mirror)
        reqs = [mirror.decode_request(i, q) for i, q in ((0, 1), (2, 2), (3, 1))]
        _check(pool.decode(reqs, return_lse=True), reqs, mirror)
        reqs = [mirror.decode_request(i, q) for i, q in ((3, 2), (0, 1), (2, 3))]  # whole-step tensors, GQA
        kv = tuple(torch.cat([r.kv[c] for r in reqs]) for c in range(2))
        with pytest.raises(ValueError, match="topk_pos must be None for a GQA pool"):
            pool.decode_batch(
                [3, 0, 2], torch.cat([r.q for r in reqs]), torch.zeros(6, 4, dtype=torch.int32), query_lens=[2, 1, 3]
            )
        out, lse = pool.decode_batch(
            torch.tensor([3, 0, 2]), torch.cat([r.q for r in reqs]), query_lens=[2, 1, 3], kv=kv, return_lse=True
        )
        _check(list(zip(out.split([2, 1, 3]), lse.split([2, 1, 3]))), reqs, mirror)


@needs_ray
@pytest.mark.parametrize(
    "world,mode,interleave",
    [(4, "pcp", 2), (2, "mixed", 1)],
    ids=["4-pcp-I2", "2-mixed"],
)
def test_mla_pool_with_sinks_equals_fp64_attention(ray_instance, world, mode, interleave) -> None:
    """PCP prefill (zigzag tokens, the cached prefix gathered from the interleaved shards), chunked
    prefill, DCP decode and free with sinks; and ShardQ prefill with sinks."""
    from shardattn.testing.serving import ServingMirror

    sinks = _sinks(8)
    kwargs = {"max_requests": 4, "max_seq_len": 48, "transport": "calls", "sinks": sinks}
    with _pool(
        world,
        MLA_SINKS,
        mode=mode,
        runtime_kwargs={"decode_options": DecodeOptions(dcp_interleave=interleave)},
        **kwargs,
    ) as pool:
        assert pool.cache_config.layout.world_size == world
        mirror = ServingMirror(MLA_SINKS, seed=8, sinks=sinks)
        _serve_and_check(pool, mirror)
        reqs = [mirror.prefill_request("d", 2)]  # a chunk of 2 tokens over a cached prefix: ranks without tokens
        _check(pool.prefill(reqs, return_lse=True), reqs, mirror)
        reqs = [mirror.decode_request("d")]
        _check(pool.decode(reqs, return_lse=True), reqs, mirror)


@needs_ray
def test_bad_requests_raise_before_any_rank_runs(pool2, monkeypatch) -> None:
    from shardattn.serving import DecodeRequest, PrefillRequest
    from shardattn.testing.serving import ServingMirror

    mirror = ServingMirror(MLA, seed=3)
    good = mirror.prefill_request("x", 9)
    _check(pool2.prefill([good], return_lse=True), [good], mirror)
    steps_before = [r["steps"] for r in pool2.health()["ranks"]]
    free_before = pool2.book.free_pages
    q1 = mirror.decode_request("x", append=False).q
    topk1 = torch.zeros(1, 16, dtype=torch.int32)
    kv1 = torch.zeros(1, 48)
    cases = [
        (lambda: pool2.decode([DecodeRequest("nope", q=q1, topk_pos=topk1)]), ValueError, "unknown request id 'nope'"),
        (lambda: pool2.prefill([PrefillRequest("x", kv=torch.zeros(40, 48))]), ValueError, "exceed max_seq_len=48"),
        (
            lambda: pool2.prefill([PrefillRequest(i, kv=torch.zeros(40, 48)) for i in "pqr"]),
            ValueError,
            "out of KV pages",
        ),
        (
            lambda: pool2.prefill([PrefillRequest(i, kv=torch.zeros(1, 48)) for i in "pqrs"]),
            ValueError,
            "over max_requests=4",
        ),
        (lambda: pool2.decode([DecodeRequest("x", q=q1.double(), topk_pos=topk1)]), TypeError, "q must have dtype"),
        (
            lambda: pool2.decode([DecodeRequest("x", q=q1[:, :4], topk_pos=topk1)]),
            ValueError,
            r"q must have shape \[\*, 8, 48\]",
        ),
        (
            lambda: pool2.decode([DecodeRequest("x", q=q1, topk_pos=topk1.float())]),
            TypeError,
            "topk_pos must have dtype",
        ),
        (
            lambda: pool2.decode([DecodeRequest("x", q=q1, topk_pos=topk1[:, :8])]),
            ValueError,
            r"topk_pos must have shape",
        ),
        (lambda: pool2.decode([DecodeRequest("x", q=q1, topk_pos=None)]), ValueError, "needs topk_pos"),
        (
            lambda: pool2.decode([DecodeRequest("x", q=q1, topk_pos=topk1, kv=kv1[:, :8])]),
            ValueError,
            "kv must have shape",
        ),
        (
            lambda: pool2.decode([DecodeRequest("x", q=q1, topk_pos=topk1), DecodeRequest("x", q=q1, topk_pos=topk1)]),
            ValueError,
            "appears twice",
        ),
        (lambda: pool2.decode(DecodeRequest("x", q=q1, topk_pos=topk1)), TypeError, "takes a list of DecodeRequest"),
        (lambda: pool2.free(["x", "nope"]), ValueError, "unknown request id 'nope'"),
        (lambda: pool2.free("x"), TypeError, "request_ids must be a sequence of ids, got str 'x'"),
        (lambda: pool2.free(7), TypeError, "^request_ids must be a sequence of ids, got int 7"),
        (lambda: pool2.free(torch.tensor([7])), ValueError, r"^unknown request id 7 \(never prefilled"),
        (
            lambda: pool2.decode_batch(np.array([2**64 - 1], dtype=np.uint64), q1, topk1),
            ValueError,
            r"^request_ids must be below 2\*\*63",  # it wrapped onto request -1
        ),
        (lambda: pool2.free(["x" * 10**6]), ValueError, r"^unknown request id 'x{10,}\.\.\.x+' \(never prefilled"),
        (lambda: pool2.decode([DecodeRequest("x", q=q1, topk_pos=topk1)], return_lse="no"), TypeError, "return_lse"),
        (
            lambda: pool2.decode_batch(["x"], q1, topk1, kv=kv1, return_lse=None),
            TypeError,
            "^return_lse must be a bool",
        ),
        (lambda: pool2.prefill([good], return_lse=1), TypeError, "^return_lse must be a bool"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
    assert pool2.book.free_pages == free_before and list(pool2.book.request_ids) == ["x"]
    # a step that fails on the driver after its checks, before any rank runs (say, its inputs overlap
    # the shared-memory rows they are copied to): the ledger is as before, no token was added
    import shardattn.serving.decode_steps as steps_mod

    def fails_on_the_driver(*args, **kwargs):
        raise RuntimeError("unsupported operation: some elements of the input tensor overlap")

    length = pool2.book.seq_len("x")
    monkeypatch.setattr(steps_mod, "decode_on_ranks", fails_on_the_driver)
    with pytest.raises(RuntimeError, match="overlap"):
        pool2.decode_batch(["x"], q1, topk1, kv=kv1)
    monkeypatch.undo()
    assert pool2.book.seq_len("x") == length and pool2.book.free_pages == free_before and not pool2.broken
    health = pool2.health()
    assert health["state"] == "healthy" and [r["steps"] for r in health["ranks"]] == steps_before
    reqs = [mirror.decode_request("x")]  # still serving, with the request's KV intact
    _check(pool2.decode(reqs, return_lse=True), reqs, mirror)
    pool2.free(["x"])


@needs_ray
def test_steps_from_two_threads_run_one_at_a_time(pool2) -> None:
    """A service's threads may share a pool: one step runs at a time (the other thread's call waits),
    each equal to fp64 attention, and the ledger counts every token once."""
    import threading

    from shardattn.testing.serving import ServingMirror

    mirror = ServingMirror(MLA, seed=7)
    reqs = [mirror.prefill_request("t1", 6), mirror.prefill_request("t2", 5)]
    _check(pool2.prefill(reqs, return_lse=True), reqs, mirror)
    plans = {rid: [] for rid in ("t1", "t2")}  # each thread's steps, their references taken as made
    for _ in range(4):
        for rid in plans:
            req = mirror.decode_request(rid)
            plans[rid].append((req, mirror.expected(req)))
    results: dict[str, list] = {rid: [] for rid in plans}

    def serve(rid: str) -> None:
        for req, _ in plans[rid]:
            q, topk, kv, _lens = _batch([req])
            results[rid].append(pool2.decode_batch([rid], q, topk, kv=kv, return_lse=True))

    threads = [threading.Thread(target=serve, args=(rid,)) for rid in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for rid in plans:
        assert len(results[rid]) == 4, rid
        for (out, lse), (_req, (ref_out, ref_lse)) in zip(results[rid], plans[rid]):
            assert torch.allclose(out.double(), ref_out, atol=ATOL, rtol=0), (out.double() - ref_out).abs().max()
            fin = torch.isfinite(ref_lse)
            assert torch.allclose(lse.double()[fin], ref_lse[fin], atol=ATOL, rtol=0)
    assert pool2.book.seq_len("t1") == 10 and pool2.book.seq_len("t2") == 9 and not pool2.broken
    pool2.free(["t1", "t2"])


def _batch(reqs):
    """The whole-step tensors of request objects: ``q [T, H, D]``, ``topk_pos [T, K]``, ``kv`` (or None),
    ``query_lens``."""
    kv = None if reqs[0].kv is None else torch.cat([r.kv for r in reqs])
    return torch.cat([r.q for r in reqs]), torch.cat([r.topk_pos for r in reqs]), kv, [int(r.q.shape[0]) for r in reqs]


@needs_ray
def test_decode_batch_equals_decode_and_fp64_attention(pool2) -> None:
    """Whole-step tensors in, one output tensor out: the reference across prefill, decode (drafts,
    with and without new KV rows), free and reuse of the pages; the same step through
    decode(requests) gives the same outputs bit for bit; ids as an int64 tensor or a list."""
    from shardattn.testing.serving import ServingMirror

    mirror = ServingMirror(MLA, seed=12)
    reqs = [mirror.prefill_request(i, n) for i, n in enumerate((13, 7, 5))]
    _check(pool2.prefill(reqs, return_lse=True), reqs, mirror)
    for q_lens in ((1, 1, 1), (1, 2, 1), (3, 1, 2)):
        reqs = [mirror.decode_request(i, n) for i, n in enumerate(q_lens)]
        q, topk, kv, lens = _batch(reqs)
        out, lse = pool2.decode_batch(torch.tensor([0, 1, 2]), q, topk, query_lens=torch.tensor(lens), kv=kv,
                                      return_lse=True)  # fmt: skip
        assert out.shape == (sum(lens), 8, 32) and lse.shape == (sum(lens), 8)
        _check(list(zip(out.split(lens), lse.split(lens))), reqs, mirror)
    reqs = [mirror.decode_request(i, n, append=False) for i, n in ((2, 1), (0, 2))]  # no new KV: repeatable
    q, topk, _, lens = _batch(reqs)
    out, lse = pool2.decode_batch([2, 0], q, topk, query_lens=lens, return_lse=True)  # ids as a list
    _check(list(zip(out.split(lens), lse.split(lens))), reqs, mirror)
    again = pool2.decode(reqs, return_lse=True)
    strided = q.transpose(0, 1).contiguous().transpose(0, 1)  # the same values, not contiguous
    assert torch.equal(pool2.decode_batch(torch.tensor([2, 0]), strided, topk, query_lens=torch.tensor(lens))[0], out)
    # a q that requires grad (a model run without no_grad) is read as its values, in both entries
    graded = q.clone().requires_grad_(True)
    assert torch.equal(pool2.decode_batch([2, 0], graded, topk, query_lens=lens)[0], out)
    graded_reqs = [dataclasses.replace(r, q=r.q.clone().requires_grad_(True)) for r in reqs]
    assert all(torch.equal(a, b) for a, b in zip(pool2.decode(graded_reqs), out.split(lens)))
    assert all(torch.equal(a, b) and torch.equal(c, d) for (a, c), b, d in zip(again, out.split(lens), lse.split(lens)))
    assert pool2.free([1]) > 0
    mirror.free(1)
    reqs = [mirror.prefill_request(3, 17)]  # takes request 1's pages
    _check(pool2.prefill(reqs, return_lse=True), reqs, mirror)
    reqs = [mirror.decode_request(i) for i in (3, 0, 2)]
    q, topk, kv, _ = _batch(reqs)
    dest = torch.full((3, 8, 32), float("nan"))
    out, lse = pool2.decode_batch(torch.tensor([3, 0, 2]), q, topk, kv=kv, out=dest)
    assert out.data_ptr() == dest.data_ptr() and lse is None
    ref = [mirror.expected(r)[0] for r in reqs]
    assert torch.allclose(out.double(), torch.cat(ref), atol=ATOL, rtol=0)
    assert pool2.last_step["kind"] == "decode" and len(pool2.last_step["timeline"]["ranks"]) == 2
    pool2.free([0, 2, 3])


@needs_ray
def test_decode_batch_in_place_inputs_and_view_outputs_equal_fp64_attention(pool2) -> None:
    """Inputs written into step_inputs() (the region's own rows under shm) and outputs taken as
    views of the region: the reference, drafts and KV rows included; the view is the region's
    (the next step overwrites it, a copy does not change); the same step with copies agrees bit
    for bit."""
    from shardattn.testing.serving import ServingMirror

    assert pool2.transport == "shm"
    mirror = ServingMirror(MLA, seed=21)
    reqs = [mirror.prefill_request(i, n) for i, n in ((10, 11), (11, 4), (12, 30))]
    _check(pool2.prefill(reqs, return_lse=True), reqs, mirror)
    ids = torch.tensor([12, 10, 11])
    views = []
    for q_lens, with_kv in (((1, 1, 1), True), ((2, 1, 3), True), ((1, 3, 1), False)):
        reqs = [mirror.decode_request(int(i), n, append=with_kv) for i, n in zip(ids, q_lens)]
        q, topk, kv, lens = _batch(reqs)
        slots = pool2.step_inputs(sum(lens))
        slots["q"].copy_(q)
        slots["topk_pos"].copy_(topk)
        if with_kv:
            slots["kv"].copy_(kv)
        out, lse = pool2.decode_batch(ids, slots["q"], slots["topk_pos"], query_lens=torch.tensor(lens),
                                      kv=slots["kv"] if with_kv else None, return_lse=True, view=True)  # fmt: skip
        assert out.shape == (sum(lens), 8, 32) and lse.shape == (sum(lens), 8)
        _check(list(zip(out.split(lens), lse.split(lens))), reqs, mirror)
        views.append((out, out.clone()))
    assert views[0][0].data_ptr() == views[1][0].data_ptr()  # the region's rows: one buffer
    again, _ = pool2.decode_batch(ids, q, topk, query_lens=torch.tensor(lens))  # no new KV: repeatable
    assert torch.equal(again, views[-1][1]) and not torch.equal(views[0][0][:3], views[0][1])  # overwritten
    assert again.data_ptr() != views[-1][0].data_ptr()  # a copy by default
    pool2.free([10, 11, 12])


def test_int32_span_holds_every_int32_section_in_one_copy(tmp_path: Path) -> None:
    """A rank's one DMA of the int32 span gives the same lengths, block table and top-k as the region."""
    from shardattn.serving.shm import ShmRegion, decode_layout

    lay = decode_layout(2, max_tokens=6, max_requests=4, table_width=3, heads_per_rank=2, head_dim=8, v_dim=4,
                        dtype=torch.float32, topk=5, kv_rows=[((8,), torch.float32)])  # fmt: skip
    region = ShmRegion(str(tmp_path / "region"), lay, create=True)
    b, n_q, width = 3, 5, 2
    host = region.int32_views(region.bytes, 0, b, n_q, width)
    gen = torch.Generator().manual_seed(0)
    for v in host.values():
        v.copy_(torch.randint(-5, 1000, v.shape, generator=gen, dtype=torch.int32))
    lo, hi = region.int32_span(b, n_q, width)
    copied = region.bytes[lo:hi].clone()  # what the device receives
    got = region.int32_views(copied, lo, b, n_q, width)
    assert set(got) == {"seq_lens", "req_ids", "cu_q", "table", "topk"}
    for k in got:
        assert got[k].shape == host[k].shape and torch.equal(got[k], host[k]), k
    assert got["table"].shape == (3, 2) and got["topk"].shape == (5, 5)
    region.close(unlink=True)


@needs_ray
def test_bad_decode_batch_raises_naming_the_argument(pool2) -> None:
    """Bad whole-step tensors raise before any rank runs, naming the argument; the pool stays healthy."""
    from shardattn.testing.serving import ServingMirror

    mirror = ServingMirror(MLA, seed=13)
    pool2.prefill([mirror.prefill_request(i, n, attend=False) for i, n in ((5, 9), (6, 47))])
    steps_before = [r["steps"] for r in pool2.health()["ranks"]]
    free_before, lens_before = pool2.book.free_pages, (pool2.book.seq_len(5), pool2.book.seq_len(6))
    reqs = [mirror.decode_request(i, append=False) for i in (5, 6)]
    q, topk, _, _ = _batch(reqs)
    ids = torch.tensor([5, 6])
    kv2 = torch.zeros(2, 48)
    cases = [
        (lambda: pool2.decode_batch(ids, q.double(), topk), TypeError, "q must have dtype"),
        (lambda: pool2.decode_batch(ids, q[:, :4], topk), ValueError, r"q must have shape \[\*, 8, 48\]"),
        (lambda: pool2.decode_batch(ids, q[:1], topk[:1]), ValueError, r"q must have one row per request \(2\)"),
        (lambda: pool2.decode_batch(ids, q, topk.float()), TypeError, "topk_pos must have dtype"),
        (lambda: pool2.decode_batch(ids, q, topk[:, :8]), ValueError, "topk_pos must have shape"),
        (lambda: pool2.decode_batch(ids, q, None), ValueError, "topk_pos must be given"),
        (lambda: pool2.decode_batch(ids, q, topk, kv=kv2[:, :8]), ValueError, "kv must have shape"),
        (lambda: pool2.decode_batch(ids.float(), q, topk), TypeError, "request_ids must have dtype"),
        (lambda: pool2.decode_batch(ids[None], q, topk), ValueError, "request_ids must be 1-D"),
        (lambda: pool2.decode_batch(ids[:0], q[:0], topk[:0]), ValueError, "request_ids must name at least one"),
        (
            lambda: pool2.decode_batch(torch.tensor([5, 99]), q, topk),
            ValueError,
            r"request_ids\[1\]: unknown request id 99",
        ),
        (lambda: pool2.decode_batch(["x", 5], q, topk), ValueError, r"request_ids\[0\]: unknown request id 'x'"),
        (
            lambda: pool2.decode_batch(torch.tensor([5, 5]), q, topk),
            ValueError,
            r"request_ids\[1\]: request 5 appears twice",
        ),
        (
            lambda: pool2.decode_batch(
                torch.tensor([6, 5]), q.repeat(2, 1, 1), topk.repeat(2, 1), query_lens=[2, 2], kv=torch.zeros(4, 48)
            ),
            ValueError,
            r"request_ids\[0\]: request 6: 49 tokens would exceed max_seq_len=48",
        ),
        (
            lambda: pool2.decode_batch(ids, q, topk, query_lens=torch.tensor([1, 0])),
            ValueError,
            "query_lens must be >= 1",
        ),
        (lambda: pool2.decode_batch(ids, q, topk, query_lens=[1.0, 1.0]), TypeError, "query_lens must hold integers"),
        (
            lambda: pool2.decode_batch(ids, q, topk, query_lens=torch.tensor([1, 2])),
            ValueError,
            r"q must have sum\(query_lens\)=3 rows, got 2",
        ),
        (
            lambda: pool2.decode_batch(ids, q, topk, query_lens=torch.tensor([2])),
            ValueError,
            r"query_lens must have shape \[2\]",
        ),
        (
            lambda: pool2.decode_batch(ids, q.repeat(9, 1, 1), topk.repeat(9, 1), query_lens=[9, 9]),
            ValueError,
            "over the pool's max_decode_tokens=16",
        ),
        (lambda: pool2.decode_batch(ids, q, topk, out=torch.empty(2, 8, 16)), ValueError, "out must have shape"),
        (lambda: pool2.decode_batch("ab", q, topk), TypeError, "request_ids must be"),
        (lambda: pool2.decode_batch(ids, q, topk, view=1), TypeError, "view must be a bool"),
        (lambda: pool2.decode_batch(ids, q, topk, view=True, out=torch.empty(2, 8, 32)), ValueError, "takes no out"),
        (lambda: pool2.step_inputs(0), ValueError, "num_tokens must be"),
        (lambda: pool2.step_inputs(17), ValueError, "num_tokens=17 is over the pool's max_decode_tokens=16"),
        # a fault drill's bad arguments: refused on the driver (a rank's ValueError broke the pool)
        (lambda: pool2.arm_fault(1, "bogus"), ValueError, "kind must be one of"),
        (lambda: pool2.arm_fault(1, "raise", "free"), ValueError, "operation must be one of"),
        (lambda: pool2.arm_fault(5), ValueError, "rank must be <= 1, got 5"),
        (lambda: pool2.arm_fault(True), TypeError, "rank must be an int"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
    assert pool2.book.free_pages == free_before and (pool2.book.seq_len(5), pool2.book.seq_len(6)) == lens_before
    health = pool2.health()
    assert health["state"] == "healthy" and [r["steps"] for r in health["ranks"]] == steps_before
    out, lse = pool2.decode_batch(ids, q, topk, return_lse=True)  # still serving, the KV intact
    _check(list(zip(out.split(1), lse.split(1))), reqs, mirror)
    # int64 positions (torch.arange's) are converted on the driver: the same step, bit for bit
    assert torch.equal(pool2.decode_batch(ids, q, topk.long())[0], out)
    pool2.free([5, 6])


def test_query_lens_whose_sum_wraps_are_refused_naming_them() -> None:
    """Lengths whose int64 sum wraps to q's row count passed every check (the transport then failed,
    or crashed the driver): a length over q's rows is refused before the sum."""
    from shardattn.plan.context import DCPLayout
    from shardattn.plan.kv_cache_config import KVCacheConfig
    from shardattn.plan.kv_pages import PagedKVBook
    from shardattn.serving.pool_shapes import pool_shapes
    from shardattn.serving.requests import check_decode_batch

    shapes = pool_shapes(MLA, "mixed", {"max_batched_tokens": 64, "max_decode_tokens": 16})
    book = PagedKVBook(KVCacheConfig(4, DCPLayout(2), 8, 48))
    book.grow([(i, 5) for i in range(4)])
    lens = np.array([2**62, 2**62, 2**62, 2**62 + 1], dtype=np.int64)  # their int64 sum: 1
    q, topk = torch.zeros(1, 8, 48), torch.zeros(1, 16, dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"^query_lens\[3\]={2**62 + 1} is more than q's 1 rows"):
        check_decode_batch(shapes, book, torch.arange(4), q, topk, query_lens=lens)
    assert book.lens[:4].tolist() == [5, 5, 5, 5]


def test_decode_batch_takes_the_id_dtypes_the_ledger_and_free_take() -> None:
    """One rule for integer id tensors: decode_batch's check takes every dtype the ledger (and so
    the pool's free) looks ids up in, and refuses the others naming request_ids."""
    from shardattn.plan.context import DCPLayout
    from shardattn.plan.kv_cache_config import KVCacheConfig
    from shardattn.plan.kv_pages import ID_DTYPES, PagedKVBook
    from shardattn.serving.pool_shapes import pool_shapes
    from shardattn.serving.requests import check_decode_batch

    shapes = pool_shapes(MLA, "mixed", {"max_batched_tokens": 64, "max_decode_tokens": 16})
    book = PagedKVBook(KVCacheConfig(4, DCPLayout(2), 8, 48))
    book.grow([(i, 5) for i in range(4)])
    q, topk = torch.zeros(2, 8, 48), torch.zeros(2, 16, dtype=torch.int32)
    for dtype in ID_DTYPES:
        ids = torch.tensor([2, 1], dtype=dtype)
        assert book.ids_of(ids) == [2, 1]
        batch = check_decode_batch(shapes, book, ids, q, topk)
        assert batch.slots.tolist() == book.slots(ids).tolist()
    for dtype in (torch.float32, torch.bool, torch.uint16):
        with pytest.raises(TypeError, match=r"^request_ids must have dtype in \(int8, int16, int32, int64, uint8\)"):
            check_decode_batch(shapes, book, torch.tensor([2, 1]).to(dtype), q, topk)
        with pytest.raises(TypeError, match=r"^request_ids must have dtype in \(int8, int16, int32, int64, uint8\)"):
            book.ids_of(torch.tensor([2, 1]).to(dtype))


@needs_ray
def test_placement_timeout_names_what_is_missing(ray_instance) -> None:
    from shardattn.serving import PlacementTimeoutError
    from shardattn.serving.placement import reserve_bundles

    with pytest.raises(PlacementTimeoutError, match=r"GPU: need 2, 0 free of 0"):
        reserve_bundles(2, {"CPU": 1.0, "GPU": 1.0}, strategy="STRICT_PACK", timeout_s=1.0)
    with pytest.raises(ValueError, match="placement strategy must be one of"):
        reserve_bundles(2, {"CPU": 1.0}, strategy="TIGHT", timeout_s=1.0)


@needs_ray
def test_ray_service_example_serves_a_stream(ray_instance) -> None:
    path = Path(__file__).resolve().parent.parent / "examples" / "ray_service.py"
    spec = importlib.util.spec_from_file_location("ray_service", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    stats = module.main(["--requests", "6", "--max-new-tokens", "4", "--check"])
    assert stats["requests"] == 6 and stats["decode_tokens"] > 0 and stats["max_error"] <= 1e-4


def _region_paths() -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f.startswith(f"shardattn-decode-{os.getpid()}-")]


def test_a_region_not_mapped_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A region made whose mapping then failed left its file behind (in /dev/shm: memory): removed."""
    import mmap

    from shardattn.serving.shm import ShmRegion, decode_layout

    lay = decode_layout(2, max_tokens=4, max_requests=2, table_width=1, heads_per_rank=2, head_dim=8, v_dim=4,
                        dtype=torch.float32, topk=0, kv_rows=[((8,), torch.float32)])  # fmt: skip

    def refused(*args: object) -> None:
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(mmap, "mmap", refused)
    with pytest.raises(OSError, match="Cannot allocate memory"):
        ShmRegion(str(tmp_path / "region"), lay, create=True)
    assert os.listdir(tmp_path) == []


@needs_ray
@pytest.mark.skipif(not hasattr(os, "posix_fallocate"), reason="no posix_fallocate: the region is a sparse file")
def test_a_dev_shm_without_room_for_the_region_makes_the_transport_unavailable(
    ray_instance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The region was a sparse file: a /dev/shm smaller than it killed the driver with SIGBUS at the
    first step that touched a page past the room. Its pages are allocated when it is made: no room
    raises there, the transport is unavailable (the pool falls back) and no file is left behind."""
    from shardattn.serving import transport
    from shardattn.serving.shm import decode_layout

    lay = decode_layout(2, max_tokens=4, max_requests=2, table_width=1, heads_per_rank=2, head_dim=8, v_dim=4,
                        dtype=torch.float32, topk=0, kv_rows=[((8,), torch.float32)])  # fmt: skip
    sizes: list[int] = []

    def no_room(fd: int, offset: int, size: int) -> None:
        sizes.append(size)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    before = _region_paths()
    with pytest.raises(transport.TransportUnavailable, match=r"region \(\[Errno 28\] No space left on device"):
        transport._start_shm([], [], lay, lambda operation, refs: [], 0.0)
    assert sizes == [lay.size] and _region_paths() == before


@needs_ray
def test_shutdown_waits_for_the_step_in_flight() -> None:
    """shutdown() from another thread closed the doorbells under a running step, which raised
    ValueError ("doorbell ... is closed", a bad input's error): it waits for the step to end."""
    import threading

    from shardattn.serving import RayRankPool

    torn: list[bool] = []

    class Decoder:
        def teardown(self) -> None:
            torn.append(True)

    pool = RayRankPool.__new__(RayRankPool)  # the state shutdown() reads, without Ray
    pool._step_lock, pool._decoder, pool._actors = threading.Lock(), Decoder(), []
    pool._broken, pool._pg, pool._owns_ray = None, None, False
    with pool._step_lock:  # a step runs
        closing = threading.Thread(target=pool.shutdown)
        closing.start()
        closing.join(0.2)
        assert closing.is_alive() and torn == []
    closing.join(10)
    assert not closing.is_alive() and torn == [True]
    with pytest.raises(RuntimeError, match="the pool is shut down"):
        pool.restart()


@needs_ray
def test_shm_falls_back_to_the_compiled_graph_off_host(ray_instance, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank on another node than the driver: the pool warns, decodes through the compiled graph,
    and leaves no region behind."""
    from shardattn.serving import transport
    from shardattn.testing.serving import ServingMirror

    before = _region_paths()
    real = transport.check_local
    monkeypatch.setattr(transport, "check_local", lambda built, node: real(built, "elsewhere"))
    with pytest.warns(RuntimeWarning, match=r"ranks \[0, 1\] run on another node than the driver"):
        pool = _pool(2, MLA, max_requests=2, max_seq_len=32)
    with pool:
        assert pool.transport == "compiled" and _region_paths() == before
        mirror = ServingMirror(MLA, seed=9)
        pool.prefill([mirror.prefill_request("a", 7, attend=False)])
        reqs = [mirror.decode_request("a", 2)]
        _check(pool.decode(reqs, return_lse=True), reqs, mirror)


@needs_ray
@pytest.mark.parametrize(
    "kind,failed,cause",
    [
        ("exit", "rank 1", "actor died"),
        ("raise", "rank 1", "RuntimeError: injected fault in decode on rank 1"),
        # the hung rank holds its peer in a collective: the one that entered fewer collectives is named
        ("hang", "rank 1", "ranks [0, 1] did not answer within 5 s (hung or dead); rank 1 entered"),
    ],
    ids=["exit", "raise", "hang"],
)
def test_failed_rank_breaks_the_pool_until_restart(pool2, kind: str, failed: str, cause: str) -> None:
    """Runs last on pool2: a rank dies, raises or hangs mid-decode; later calls raise the same; restart recovers."""
    from shardattn.serving import RankFailedError
    from shardattn.testing.serving import ServingMirror

    mirror = ServingMirror(MLA, seed=4)
    pool2.prefill([mirror.prefill_request("y", 11), mirror.prefill_request("z", 6)])
    pool2.arm_fault(1, kind, "decode")
    reqs = [mirror.decode_request("y"), mirror.decode_request("z")]
    timeout = pool2.timeout_s
    if kind == "hang":
        pool2.timeout_s = 5.0
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        pending = ex.submit(pool2.decode, reqs)
        if kind == "hang":  # health answers while a step is stuck
            for _ in range(15):  # until both ranks are inside the step (a slow runner takes a moment)
                ranks = pool2.health(timeout_s=1.0)["ranks"]
                if [r["state"] for r in ranks] == ["decode", "decode"]:
                    break
                time.sleep(0.2)
            assert [r["state"] for r in ranks] == ["decode", "decode"] and not pending.done()
            assert all(r["step_running_s"] > 0 for r in ranks)
        with pytest.raises(RankFailedError, match=f"{failed} failed during decode") as info:
            pending.result()
    elapsed = time.monotonic() - t0
    assert elapsed < (pool2.timeout_s + 5 if kind == "hang" else 15)  # a dead or raising rank: well before it
    pool2.timeout_s = timeout
    assert info.value.rank == int(failed[-1]) and cause in info.value.cause
    for call in (lambda: pool2.decode(reqs), lambda: pool2.free(["y"]), lambda: pool2.run(dist.get_rank)):
        with pytest.raises(RankFailedError) as again:
            call()
        assert again.value is info.value
    assert pool2.health()["state"] == "broken"
    assert pool2._decoder is None and _region_paths() == []  # the failure unlinked the region and its doorbells
    assert pool2.restart() == ["y", "z"]
    fresh = _region_paths()  # a fresh region and its doorbells (one pipe each way per rank)
    assert pool2.transport == "shm" and len(fresh) == 1 + 2 * 2 and sum("." not in f for f in fresh) == 1
    assert pool2.health()["state"] == "healthy" and len(pool2.book) == 0
    mirror = ServingMirror(MLA, seed=5)
    reqs = [mirror.prefill_request("y", 11)]
    _check(pool2.prefill(reqs, return_lse=True), reqs, mirror)
    reqs = [mirror.decode_request("y")]
    _check(pool2.decode(reqs, return_lse=True), reqs, mirror)
    pool2.free(["y"])


def test_the_driver_side_of_a_step_runs_on_one_torch_thread_and_restores_the_count() -> None:
    from shardattn.serving.requests import one_host_thread

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with one_host_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with one_host_thread(3):  # a GPU pool's host_threads
            assert torch.get_num_threads() == 3
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError, match="inside"), one_host_thread():
            raise RuntimeError("inside")
        assert torch.get_num_threads() == 2  # restored on the error path too
    finally:
        torch.set_num_threads(before)


def test_the_mirror_counts_a_position_listed_twice_once() -> None:
    """The pool treats a top-k row as a set (a row listed twice by a token is one key); the fp64
    mirror counted duplicates (outputs off by up to 0.4, LSEs by log 2)."""
    from shardattn.serving import DecodeRequest
    from shardattn.testing.serving import ServingMirror

    mirror = ServingMirror(MLA, seed=4)
    mirror.prefill_request("a", 9, attend=False)
    q = torch.randn(1, MLA.num_heads, MLA.head_dim)
    twice = DecodeRequest("a", q=q, topk_pos=torch.tensor([[3, 5, 3, 3, 7, -1, 5, 0] + [-1] * 8], dtype=torch.int32))
    once = DecodeRequest("a", q=q, topk_pos=torch.tensor([[3, 5, -1, -1, 7, -1, -1, 0] + [-1] * 8], dtype=torch.int32))
    for a, b in zip(mirror.expected(twice), mirror.expected(once), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@needs_ray
def test_health_says_a_rank_is_dead_before_the_next_call_fails(ray_instance) -> None:
    """A rank killed between steps: ``health()`` said "healthy" (only the rank's own entry said
    dead) until a call failed; it says "rank dead", the next call raises, and a restart serves."""
    import ray

    from shardattn.serving import RankFailedError
    from shardattn.testing.serving import ServingMirror

    with _pool(2, MLA, max_requests=4, max_seq_len=48) as pool:
        mirror = ServingMirror(MLA, seed=8)
        pool.prefill([mirror.prefill_request("a", 5)])
        ray.kill(pool._actors[1], no_restart=True)
        for _ in range(50):  # the kill lands asynchronously
            health = pool.health(timeout_s=1.0)
            if health["state"] != "healthy":
                break
            time.sleep(0.1)
        assert health["state"] == "rank dead" and health["ranks"][1]["state"] == "dead", health
        with pytest.raises(RankFailedError):
            pool.decode([mirror.decode_request("a")])
        assert pool.health()["state"] == "broken"
        assert pool.restart() == ["a"]
        mirror.free("a")
        reqs = [mirror.prefill_request("b", 6)]
        _check(pool.prefill(reqs, return_lse=True), reqs, mirror)
