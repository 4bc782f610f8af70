"""The Ray pool on one GPU: a one-rank GQA pool (bf16, head dim 64, sinks, pages of 16) prefills,
prefills in chunks over a cached prefix, and decodes (drafts included) under every mode a GQA pool
attends in, on the kernels its Runtime routes to on the GPU; outputs and LSE equal fp64 attention
(the serving mirror) to bf16's rounding. Skips without a CUDA GPU or Ray."""

from __future__ import annotations

import pytest
import torch

from shardattn.plan.spec import ModelSpec
from tests import ray_pool_helpers as helpers

GQA_BF16 = ModelSpec("gqa", 8, 2, 64, 64, 0, 16, has_sinks=True, dtype="bfloat16")
ATOL = 3e-2  # bf16 inputs and outputs against fp64 over the same inputs


@pytest.fixture(scope="module")
def ray_gpu():
    if helpers.REASON is not None:
        pytest.skip(helpers.REASON)
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import ray

    ray.init(num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _close(outs: list, requests: list, mirror) -> None:
    assert len(outs) == len(requests)
    for (out, lse), req in zip(outs, requests):
        ref_out, ref_lse = mirror.expected(req)
        assert out.shape == ref_out.shape and lse.shape == ref_lse.shape and torch.isfinite(out).all()
        err = (out.double() - ref_out).abs().max().item()
        assert err <= ATOL, err
        assert (lse.double() - ref_lse).abs().max().item() <= ATOL


@helpers.needs_ray
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["headtp", "mixed", "pcp"])
def test_a_one_rank_gqa_pool_on_the_gpu_equals_fp64_attention(ray_gpu, mode: str) -> None:
    from shardattn.serving import RayRankPool
    from shardattn.testing.serving import ServingMirror

    sinks = torch.randn(8, generator=torch.Generator().manual_seed(1)) * 2.0
    runtime = {"max_batched_tokens": 64, "max_decode_tokens": 16}
    with RayRankPool(
        1, GQA_BF16, mode=mode, device="cuda", max_requests=4, max_seq_len=96, sinks=sinks, timeout_s=300.0,
        runtime_kwargs=runtime, init_ray=False,
    ) as pool:  # fmt: skip
        assert pool.device == "cuda"
        mirror = ServingMirror(GQA_BF16, seed=3, sinks=sinks)
        for chunks in ([(0, 33), (1, 7), (2, 20)], [(1, 12), (0, 5)]):  # then chunks over cached prefixes
            reqs = [mirror.prefill_request(i, n) for i, n in chunks]
            _close(pool.prefill(reqs, return_lse=True), reqs, mirror)
        for q_lens in ((1, 1, 1), (2, 1, 3)):  # plain decode, then ragged drafts
            reqs = [mirror.decode_request(i, q) for i, q in enumerate(q_lens)]
            _close(pool.decode(reqs, return_lse=True), reqs, mirror)
        assert pool.health()["state"] == "healthy"
