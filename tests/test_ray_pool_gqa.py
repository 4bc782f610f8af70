"""A GQA Ray pool under ``pcp`` on local Ray (gloo): PCP prefill (the driver splits the query
tokens by the plan's zigzag; each rank passes its tokens' K/V of every KV head), chunked prefill
over a prefix held in the DCP-interleaved cache (gathered from the shards for the step), DCP
decode; outputs and LSE equal fp64 attention (the serving mirror), with and without sinks, and
where ranks own no token of a short step. One Ray instance per module."""

from __future__ import annotations

import pytest
import torch

from shardattn.runtime.options import DecodeOptions
from shardattn.serving.split import pcp_token_ids
from tests import ray_pool_helpers as helpers

ray_instance = helpers.ray_instance  # the module's Ray (a fixture)


def _owners(pool, reqs: list) -> list[int]:
    """Tokens each rank's PCP share of the prefill ``reqs`` holds (the driver's split)."""
    starts = [pool.book.seq_len(r.id) if r.id in pool.book else 0 for r in reqs]
    counts = [int(r.kv[0].shape[0]) for r in reqs]
    return [int(ids.numel()) for ids in pcp_token_ids(counts, starts, pool.world_size)]


def _prefill(pool, mirror, chunks: list[tuple[int, int]]) -> list[int]:
    """One prefill step of ``(request, new tokens)`` chunks, checked; returns each rank's token count."""
    reqs = [mirror.prefill_request(i, n) for i, n in chunks]
    owners = _owners(pool, reqs)
    helpers.check(pool.prefill(reqs, return_lse=True), reqs, mirror)
    return owners


@helpers.needs_ray
@pytest.mark.parametrize(
    "world,spec,interleave",
    [(2, helpers.GQA_SINKS, 2), (4, helpers.GQA, 1)],
    ids=["2-sinks-I2", "4-no-sinks"],
)
def test_gqa_pcp_pool_equals_fp64_attention(ray_instance, world: int, spec, interleave: int) -> None:
    from shardattn.testing.serving import ServingMirror

    sinks = helpers.sinks(9) if spec.has_sinks else None
    runtime = {"decode_options": DecodeOptions(dcp_interleave=interleave)}
    kwargs = {"max_requests": 4, "max_seq_len": 48, "sinks": sinks, "runtime_kwargs": runtime}
    with helpers.pool(world, spec, mode="pcp", **kwargs) as pool:
        assert pool.shapes.prefill_attention and pool.cache_config.layout.world_size == world
        row_bytes = 2 * spec.num_kv_heads * spec.head_dim * 4  # K and V of every KV head: DCP keeps whole rows
        assert all(r["cache_bytes"] == pool.cache_config.num_pages * spec.page_size * row_bytes
                   for r in pool.health()["ranks"])  # fmt: skip
        helpers.check_gqa_prefill_refusals(pool, spec)  # a causal prefill takes no top-k
        mirror = ServingMirror(spec, seed=10 + world, sinks=sinks)
        owners = _prefill(pool, mirror, [(0, 9), (1, 3), (2, 14)])
        assert sum(owners) == 26 and min(owners) > 0, owners
        _prefill(pool, mirror, [(1, 4), (0, 5)])  # chunks over 3 and 9 cached tokens
        for q_lens in ((1, 1, 1), (2, 1, 3)):  # plain decode, then ragged drafts
            reqs = [mirror.decode_request(i, q) for i, q in enumerate(q_lens)]
            helpers.check(pool.decode(reqs, return_lse=True), reqs, mirror)
        owners = _prefill(pool, mirror, [(2, 2)])  # a 2-token chunk over 17 cached tokens
        assert (min(owners) == 0) == (world > 2), owners  # 4 ranks: some own no token of it
        helpers.in_place_step(pool, mirror, [2, 0], (3, 1))
        assert pool.free([1]) > 0
        mirror.free(1)
        _prefill(pool, mirror, [(3, 20), (2, 1)])  # takes request 1's pages; a 1-token chunk
        reqs = [mirror.decode_request(i, q) for i, q in ((3, 2), (0, 1), (2, 1))]
        out, lse = pool.decode_batch(
            torch.tensor([3, 0, 2]), torch.cat([r.q for r in reqs]), query_lens=[2, 1, 1],
            kv=tuple(torch.cat([r.kv[c] for r in reqs]) for c in range(2)), return_lse=True,
        )  # fmt: skip
        helpers.check(list(zip(out.split([2, 1, 1]), lse.split([2, 1, 1]))), reqs, mirror)
        assert pool.health()["state"] == "healthy"
