"""Shared pieces of the Ray pool tests: the tiny model specs, the ``needs_ray`` marker, the
module-scoped ``ray_instance`` and ``pool2`` fixtures (a test module binds them by name to get one
Ray instance and one two-rank pool of its own), a CPU pool factory, and the checks of a pool's
outputs and LSE against fp64 attention (the serving mirror)."""

from __future__ import annotations

import os

import pytest
import torch

from shardattn.plan.spec import ModelSpec
from shardattn.runtime.options import PrefillOptions
from shardattn.serving.errors import ray_unavailable_reason

REASON = ray_unavailable_reason()
needs_ray = pytest.mark.skipif(REASON is not None, reason=f"optional dependency missing: {REASON}")

MLA = ModelSpec("sparse_mla", 8, 1, 48, 32, 16, 4, dtype="float32", softmax_scale=0.3)
GQA = ModelSpec("gqa", 8, 2, 16, 16, 0, 4, dtype="float32")
GQA_SINKS = ModelSpec("gqa", 8, 2, 16, 16, 0, 4, dtype="float32", has_sinks=True)  # gqa-64-8, tiny
MLA_SINKS = ModelSpec("sparse_mla", 8, 1, 48, 32, 16, 4, dtype="float32", has_sinks=True, softmax_scale=0.3)
NAN_SINKS = torch.tensor([0.0, 1.0, float("nan"), 0.0, 0.0, 0.0, 0.0, 0.0])
ATOL = 2e-5
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def ray_instance():
    """Local Ray on 8 CPUs for the test module that binds this fixture; shut down after its last test."""
    if REASON is not None:
        pytest.skip(REASON)
    import ray

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def pool(world: int, spec: ModelSpec, **kwargs):
    """A CPU ``RayRankPool`` of ``world`` ranks on the running Ray: small step limits, no warmup,
    ``mixed`` mode for sparse MLA and ``dcp-decode`` for GQA unless ``mode=`` says otherwise."""
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
    """A two-rank sparse-MLA pool (4 requests of up to 48 tokens, 16 pages) shared by a module's tests."""
    with pool(2, MLA, max_requests=4, max_seq_len=48, num_pages=16) as shared:
        yield shared


def check(outs, requests, mirror) -> None:
    """Each ``(out, lse)`` of ``outs`` equals the mirror's fp64 attention for its request."""
    assert len(outs) == len(requests)
    for (out, lse), req in zip(outs, requests):
        ref_out, ref_lse = mirror.expected(req)
        assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
        assert torch.isfinite(out).all()
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))  # rows with no valid key: lse = -inf
        assert torch.allclose(out.double(), ref_out, atol=ATOL, rtol=0), (out.double() - ref_out).abs().max()
        fin = torch.isfinite(ref_lse)
        assert torch.allclose(lse.double()[fin], ref_lse[fin], atol=ATOL, rtol=0)


def check_gqa_prefill_refusals(pool, spec: ModelSpec) -> None:
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


def serve_and_check(pool, mirror) -> None:
    """Prefill, chunked prefill, decode (drafts, with and without new KV), free and reuse of the pages."""
    reqs = [mirror.prefill_request("a", 13), mirror.prefill_request("b", 7), mirror.prefill_request("c", 5)]
    check(pool.prefill(reqs, return_lse=True), reqs, mirror)
    reqs = [mirror.prefill_request("c", 6)]  # the second chunk attends over the 5 cached tokens
    check(pool.prefill(reqs, return_lse=True), reqs, mirror)
    for step in range(3):
        reqs = [
            mirror.decode_request("a"),
            mirror.decode_request("b", 2 if step == 1 else 1),
            mirror.decode_request("c"),
        ]
        check(pool.decode(reqs, return_lse=True), reqs, mirror)
    reqs = [mirror.decode_request("a", append=False)]
    check(pool.decode(reqs, return_lse=True), reqs, mirror)
    pages = pool.book.free_pages
    assert pool.free(["b"]) > 0 and pool.book.free_pages > pages
    mirror.free("b")
    reqs = [mirror.prefill_request("d", 17)]  # takes b's pages
    check(pool.prefill(reqs, return_lse=True), reqs, mirror)
    reqs = [mirror.decode_request("a"), mirror.decode_request("d"), mirror.decode_request("c")]
    check(pool.decode(reqs, return_lse=True), reqs, mirror)
    outs = pool.decode([mirror.decode_request("d")])  # without return_lse: outputs only
    assert outs[0].shape == (1, mirror.spec.num_heads, mirror.spec.v_dim)


def in_place_step(pool, mirror, ids, q_lens) -> None:
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
    check(list(zip(out.split(list(q_lens)), lse.split(list(q_lens)))), reqs, mirror)


def sinks(seed: int) -> torch.Tensor:
    """Eight attention sinks drawn from ``seed`` (one per query head of the tiny specs)."""
    return torch.randn(8, generator=torch.Generator().manual_seed(seed)) * 2.0


def batch(reqs):
    """The whole-step tensors of request objects: ``q [T, H, D]``, ``topk_pos [T, K]``, ``kv`` (or None),
    ``query_lens``."""
    kv = None if reqs[0].kv is None else torch.cat([r.kv for r in reqs])
    return torch.cat([r.q for r in reqs]), torch.cat([r.topk_pos for r in reqs]), kv, [int(r.q.shape[0]) for r in reqs]


def region_paths() -> list[str]:
    """This process's shared-memory decode regions and doorbells in /dev/shm."""
    return [f for f in os.listdir("/dev/shm") if f.startswith(f"shardattn-decode-{os.getpid()}-")]
