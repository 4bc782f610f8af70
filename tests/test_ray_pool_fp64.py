"""The Ray pool's outputs and LSE equal fp64 attention over the whole cache (the serving mirror) on
local Ray (gloo) across prefill, chunked prefill, decode (drafts included), free and reuse of the
pages: in every mode (DCP and PCP, head-TP, ShardQ) and transport, with sinks, with a resident FP8
cache, and with Runtimes that skip the LSE (which then refuse to return one). A two-rank pool forms
its group in a placement group, the example service serves a checked stream, and the mirror counts a
top-k position listed twice once. One Ray instance per module."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardattn.plan.spec import ModelSpec
from shardattn.runtime.options import DecodeOptions, PrefillOptions
from tests import ray_pool_helpers as helpers
from tests.ray_pool_helpers import ATOL, GQA, GQA_SINKS, MLA, MLA_SINKS, NAN_SINKS, needs_ray

ray_instance = helpers.ray_instance  # the module's Ray (a fixture)
pool2 = helpers.pool2  # the module's two-rank pool (a fixture)


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

    helpers.serve_and_check(pool2, ServingMirror(MLA, seed=1))
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
    with helpers.pool(
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
            helpers.serve_and_check(pool, mirror)
            helpers.in_place_step(pool, mirror, ["a", "d"], (2, 1))
            return
        attend = pool.shapes.prefill_attention  # head-TP GQA prefill; none under dcp-decode
        assert attend == (mode == "headtp")
        helpers.check_gqa_prefill_refusals(pool, spec)
        for chunks in ([(0, 9), (1, 3), (2, 14)], [(1, 4)]):  # then a chunk over request 1's 3 cached tokens
            reqs = [mirror.prefill_request(i, n, attend=attend) for i, n in chunks]
            outs = pool.prefill(reqs, return_lse=attend)
            if attend:
                helpers.check(outs, reqs, mirror)
            else:
                assert outs == [None] * len(reqs)
        for q_lens in ((1, 1, 1), (2, 1, 3)):  # plain decode, then ragged drafts
            reqs = [mirror.decode_request(i, q) for i, q in enumerate(q_lens)]
            helpers.check(pool.decode(reqs, return_lse=True), reqs, mirror)
        helpers.in_place_step(pool, mirror, [2, 0], (3, 1))


@needs_ray
@pytest.mark.parametrize(("spec", "mode"), [(GQA, "headtp"), (MLA, "mixed")], ids=["gqa-headtp", "mla-dcp"])
def test_a_pool_without_lse_refuses_to_return_one_and_shuts_down_clearly(ray_instance, spec, mode) -> None:
    """A pool whose Runtimes skip the LSE (of prefill and decode; head-TP GQA, and sparse MLA with
    DCP decode) serves outputs (equal to fp64 attention); asked for the LSE it says why on the
    driver and stays usable; after shutdown it says so."""
    from shardattn.testing.serving import ServingMirror

    runtime = {"decode_options": DecodeOptions(return_lse=False), "prefill_options": PrefillOptions(return_lse=False)}
    with helpers.pool(2, spec, mode=mode, max_requests=2, max_seq_len=32, runtime_kwargs=runtime) as pool:
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


MLA_DSA = ModelSpec("sparse_mla", 4, 1, 576, 512, 4, 4, dtype="float32", softmax_scale=0.1)


@needs_ray
@pytest.mark.parametrize("mode", ["mixed", "pcp"])
def test_pool_keeps_its_resident_cache_in_fp8_when_asked(ray_instance, mode) -> None:
    """runtime_kwargs={"kv_dtype": "fp8_ds_mla"}: the ranks' resident pages are 656-byte rows (new
    rows quantised as they are stored), every step reads them, and the outputs equal fp64 attention
    over the rows as stored."""
    from shardattn.testing.serving import ServingMirror

    kwargs = {"max_requests": 4, "max_seq_len": 48, "num_pages": 16, "runtime_kwargs": {"kv_dtype": "fp8_ds_mla"}}
    with helpers.pool(2, MLA_DSA, mode=mode, **kwargs) as pool:
        assert all(r["cache_bytes"] == 16 * 4 * 656 for r in pool.health()["ranks"])
        mirror = ServingMirror(MLA_DSA, seed=3, kv_dtype="fp8_ds_mla")
        reqs = [mirror.prefill_request("a", 13), mirror.prefill_request("b", 7)]
        helpers.check(pool.prefill(reqs, return_lse=True), reqs, mirror)
        reqs = [mirror.prefill_request("b", 6)]  # the second chunk attends over the cached (FP8) prefix
        helpers.check(pool.prefill(reqs, return_lse=True), reqs, mirror)
        for q_len in (1, 2):
            reqs = [mirror.decode_request("a", q_len), mirror.decode_request("b")]
            helpers.check(pool.decode(reqs, return_lse=True), reqs, mirror)


@needs_ray
def test_gqa_pool_with_sinks_equals_fp64_attention(ray_instance) -> None:
    """gqa-64-8's shape (GQA, sinks) at tiny dims under ``mixed`` (head-TP prefill, DCP decode over
    interleaved shards): prefill and chunked prefill (the cached prefix gathered from the shards),
    decode, free, new sinks; bad sinks raise on the driver and leave the pool serving."""
    from shardattn.testing.serving import ServingMirror

    sinks = helpers.sinks(6)
    runtime = {"decode_options": DecodeOptions(dcp_interleave=2)}
    with helpers.pool(
        2, GQA_SINKS, mode="mixed", max_requests=4, max_seq_len=48, sinks=sinks, runtime_kwargs=runtime
    ) as pool:
        assert pool.cache_config.layout.world_size == 2
        mirror = ServingMirror(GQA_SINKS, seed=6, sinks=sinks)
        for chunks in ([(0, 9), (1, 3), (2, 14)], [(1, 4), (0, 5)]):  # then chunks over 3 and 9 cached tokens
            reqs = [mirror.prefill_request(i, n) for i, n in chunks]
            helpers.check(pool.prefill(reqs, return_lse=True), reqs, mirror)
        for q_lens in ((1, 1, 1), (2, 1, 3)):
            reqs = [mirror.decode_request(i, q) for i, q in enumerate(q_lens)]
            helpers.check(pool.decode(reqs, return_lse=True), reqs, mirror)
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
        helpers.check(pool.decode(reqs, return_lse=True), reqs, mirror)
        assert pool.free([1]) > 0
        mirror.free(1)
        mirror.sinks = helpers.sinks(7)
        pool.set_sinks(mirror.sinks)
        reqs = [mirror.prefill_request(3, 20), mirror.prefill_request(2, 2)]  # takes request 1's pages; a chunk
        helpers.check(pool.prefill(reqs, return_lse=True), reqs, mirror)
        reqs = [mirror.decode_request(i, q) for i, q in ((0, 1), (2, 2), (3, 1))]
        helpers.check(pool.decode(reqs, return_lse=True), reqs, mirror)
        reqs = [mirror.decode_request(i, q) for i, q in ((3, 2), (0, 1), (2, 3))]  # whole-step tensors, GQA
        kv = tuple(torch.cat([r.kv[c] for r in reqs]) for c in range(2))
        with pytest.raises(ValueError, match="topk_pos must be None for a GQA pool"):
            pool.decode_batch(
                [3, 0, 2], torch.cat([r.q for r in reqs]), torch.zeros(6, 4, dtype=torch.int32), query_lens=[2, 1, 3]
            )
        out, lse = pool.decode_batch(
            torch.tensor([3, 0, 2]), torch.cat([r.q for r in reqs]), query_lens=[2, 1, 3], kv=kv, return_lse=True
        )
        helpers.check(list(zip(out.split([2, 1, 3]), lse.split([2, 1, 3]))), reqs, mirror)


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

    sinks = helpers.sinks(8)
    kwargs = {"max_requests": 4, "max_seq_len": 48, "transport": "calls", "sinks": sinks}
    with helpers.pool(
        world,
        MLA_SINKS,
        mode=mode,
        runtime_kwargs={"decode_options": DecodeOptions(dcp_interleave=interleave)},
        **kwargs,
    ) as pool:
        assert pool.cache_config.layout.world_size == world
        mirror = ServingMirror(MLA_SINKS, seed=8, sinks=sinks)
        helpers.serve_and_check(pool, mirror)
        reqs = [mirror.prefill_request("d", 2)]  # a chunk of 2 tokens over a cached prefix: ranks without tokens
        helpers.check(pool.prefill(reqs, return_lse=True), reqs, mirror)
        reqs = [mirror.decode_request("d")]
        helpers.check(pool.decode(reqs, return_lse=True), reqs, mirror)


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
