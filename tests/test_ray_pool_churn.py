"""Churn: requests freed and new ones admitted into reused pages and slots, interleaved prefill
and decode of different requests, ids reused; outputs equal fp64 attention over each request's
own history (the serving mirror). One Ray instance per module."""

from __future__ import annotations

import random

import pytest
import torch

from shardattn.runtime.options import DecodeOptions
from tests import ray_pool_helpers as helpers

ray_instance = helpers.ray_instance  # the module's Ray (a fixture)


def _wide(mirror, req, rng):
    """Top-k positions spread past the request's length, over the rest of its pages and beyond."""
    if req.topk_pos is None:
        return req
    length = mirror.requests[req.id].length
    n, k = req.topk_pos.shape
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    pos = torch.stack([torch.randperm(length + 24, generator=gen)[:k] for _ in range(n)])
    pos[:, -3:] = pos[:, :3]  # a position listed twice is one key
    pos[:, -4] = -1
    req.topk_pos = pos.to(torch.int32)
    return req


def _poison(mirror, pool, rid, n):
    """A request of large rows, admitted and freed: its pages hold values no later request may read."""
    req = mirror.prefill_request(rid, n, attend=False)
    kv = tuple(x * 0 + 50.0 for x in req.kv) if isinstance(req.kv, tuple) else req.kv * 0 + 50.0
    pool.prefill([type(req)(rid, kv=kv)])
    pool.free([rid])
    mirror.free(rid)


@helpers.needs_ray
@pytest.mark.parametrize(
    "world,spec,mode,interleave,transport",
    [
        (2, helpers.MLA, "mixed", 1, "shm"),
        (2, helpers.MLA, "pcp", 2, "calls"),
        (2, helpers.GQA, "dcp-decode", 1, "shm"),
        (2, helpers.GQA, "headtp", 1, "compiled"),
    ],
    ids=["mla-mixed-shm", "mla-pcp-calls", "gqa-dcp-shm", "gqa-headtp-compiled"],
)
def test_churn_equals_fp64_attention(ray_instance, world, spec, mode, interleave, transport) -> None:
    from shardattn.testing.serving import ServingMirror

    runtime = {"decode_options": DecodeOptions(dcp_interleave=interleave)}
    kw = {"max_requests": 3, "max_seq_len": 40, "transport": transport, "runtime_kwargs": runtime}
    with helpers.pool(world, spec, mode=mode, **kw) as pool:
        mirror = ServingMirror(spec, seed=21)
        rng = random.Random(5)
        attend = pool.shapes.prefill_attention
        _poison(mirror, pool, "p0", 40)
        _poison(mirror, pool, "p1", 33)
        live: list = []
        next_id = 0
        stats = {"prefill": 0, "decode": 0, "free": 0}
        for _ in range(40):
            op = rng.random()
            if live and op < 0.2:
                rid = rng.choice(live)
                pool.free([rid])
                mirror.free(rid)
                live.remove(rid)
                stats["free"] += 1
                continue
            if len(live) < 3 and op < 0.5:
                rid = rng.choice([next_id, next_id, *[i for i in range(next_id) if i not in live]])  # ids reused
                next_id = max(next_id, rid + 1)
                reqs = [mirror.prefill_request(rid, rng.randint(1, 9), attend=attend)]
                more = [r for r in live if pool.book.seq_len(r) + 4 <= 40][:1]
                reqs += [mirror.prefill_request(r, rng.randint(1, 4), attend=attend) for r in more]
                reqs = [_wide(mirror, r, rng) for r in reqs]
                stats["prefill"] += 1
                outs = pool.prefill(reqs, return_lse=attend)
                if attend:
                    helpers.check(outs, reqs, mirror)
                live.append(rid)
                continue
            ids = [r for r in live if pool.book.seq_len(r) + 2 <= 40]
            rng.shuffle(ids)
            if not ids:
                continue
            append = rng.random() < 0.8  # a step writes KV for every request or for none
            reqs = [_wide(mirror, mirror.decode_request(r, rng.randint(1, 2), append=append), rng) for r in ids]
            stats["decode"] += 1
            if spec.kind == "gqa":  # more queries than keys is refused
                reqs = [r for r in reqs if r.kv is not None or pool.book.seq_len(r.id) >= r.q.shape[0]]
                if not reqs:
                    continue
            if rng.random() < 0.5:
                helpers.check(pool.decode(reqs, return_lse=True), reqs, mirror)
            else:
                lens = [int(r.q.shape[0]) for r in reqs]
                kv = None
                if all(r.kv is not None for r in reqs):
                    kv = (
                        torch.cat([r.kv for r in reqs])
                        if spec.kind == "sparse_mla"
                        else tuple(torch.cat([r.kv[c] for r in reqs]) for c in range(2))
                    )
                topk = torch.cat([r.topk_pos for r in reqs]) if spec.kind == "sparse_mla" else None
                out, lse = pool.decode_batch(
                    [r.id for r in reqs], torch.cat([r.q for r in reqs]), topk, query_lens=lens, kv=kv, return_lse=True
                )
                helpers.check(list(zip(out.split(lens), lse.split(lens))), reqs, mirror)
        assert pool.health()["state"] == "healthy"
        assert min(stats.values()) >= 3, stats
