"""A Ray pool whose restart fails (a rank's build raises, or the driver's side of it): the pool stays
broken, and the restart that then succeeds still returns every request whose KV state was lost. One
Ray instance per module."""

from __future__ import annotations

import pytest

from tests import ray_pool_helpers as helpers

ray_instance = helpers.ray_instance  # the module's Ray (a fixture)


@helpers.needs_ray
def test_a_failed_restart_keeps_the_lost_requests_for_the_next_one(ray_instance) -> None:
    """The first restart forgot the requests before it rebuilt the ranks; when the rebuild failed,
    the restart that succeeded returned no request, though the callers' requests were all lost."""
    from shardattn.serving import RankFailedError
    from shardattn.testing.serving import ServingMirror

    with helpers.pool(2, helpers.MLA, max_requests=4, max_seq_len=48, num_pages=16) as pool:
        mirror = ServingMirror(helpers.MLA, seed=31)
        pool.prefill([mirror.prefill_request("a", 9, attend=False), mirror.prefill_request("b", 5, attend=False)])
        limit = pool._cache_spec["memory_limit_bytes"]
        pool._cache_spec["memory_limit_bytes"] = 1  # every rank's build refuses its cache
        with pytest.raises(RankFailedError, match="exceed memory_limit_bytes=1"):
            pool.restart()
        assert pool.health()["state"] == "broken"
        pool._cache_spec["memory_limit_bytes"] = limit
        assert pool.restart() == ["a", "b"]
        assert pool.health()["state"] == "healthy" and len(pool.book) == 0
        mirror = ServingMirror(helpers.MLA, seed=32)
        reqs = [mirror.prefill_request("a", 7)]
        helpers.check(pool.prefill(reqs, return_lse=True), reqs, mirror)
        reqs = [mirror.decode_request("a")]
        helpers.check(pool.decode(reqs, return_lse=True), reqs, mirror)


@helpers.needs_ray
def test_a_restart_that_fails_on_the_driver_breaks_the_pool(ray_instance, monkeypatch) -> None:
    """A restart whose driver side raises (here: the decode transport refuses to start) after the
    ranks were rebuilt: the pool is broken (no step runs on the half-made ranks), and the next
    restart still returns the lost requests."""
    from shardattn.serving import RankFailedError
    from shardattn.serving import pool as pool_module
    from shardattn.testing.serving import ServingMirror

    with helpers.pool(2, helpers.MLA, max_requests=4, max_seq_len=48, num_pages=16) as pool:
        mirror = ServingMirror(helpers.MLA, seed=33)
        pool.prefill([mirror.prefill_request("a", 9, attend=False)])
        start = pool_module.start_decode_transport

        def refuse(*args, **kwargs):
            raise OSError("no shared memory left")

        monkeypatch.setattr(pool_module, "start_decode_transport", refuse)
        with pytest.raises(OSError, match="no shared memory left"):
            pool.restart()
        health = pool.health()
        assert health["state"] == "broken" and "OSError: no shared memory left" in health["error"], health
        with pytest.raises(RankFailedError, match="the restart failed on the driver"):
            pool.decode([mirror.decode_request("a")])
        monkeypatch.setattr(pool_module, "start_decode_transport", start)
        assert pool.restart() == ["a"]
        mirror = ServingMirror(helpers.MLA, seed=34)
        reqs = [mirror.prefill_request("a", 7)]
        helpers.check(pool.prefill(reqs, return_lse=True), reqs, mirror)
