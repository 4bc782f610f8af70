"""Failures of the Ray pool and its health: a placement that cannot be met names what is missing; a
rank that exits, raises or hangs mid-decode gives one ``RankFailedError`` that every later call
raises, its shared-memory region is removed, and ``restart()`` recovers; a rank killed between steps
shows in ``health()`` before the next call fails. One Ray instance per module."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import torch.distributed as dist

from tests import ray_pool_helpers as helpers
from tests.ray_pool_helpers import MLA, needs_ray

ray_instance = helpers.ray_instance  # the module's Ray (a fixture)
pool2 = helpers.pool2  # the module's two-rank pool (a fixture)


@needs_ray
def test_placement_timeout_names_what_is_missing(ray_instance) -> None:
    from shardattn.serving import PlacementTimeoutError
    from shardattn.serving.placement import reserve_bundles

    with pytest.raises(PlacementTimeoutError, match=r"GPU: need 2, 0 free of 0"):
        reserve_bundles(2, {"CPU": 1.0, "GPU": 1.0}, strategy="STRICT_PACK", timeout_s=1.0)
    with pytest.raises(ValueError, match="placement strategy must be one of"):
        reserve_bundles(2, {"CPU": 1.0}, strategy="TIGHT", timeout_s=1.0)


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
    assert pool2._decoder is None and helpers.region_paths() == []  # the failure unlinked the region and its doorbells
    assert pool2.restart() == ["y", "z"]
    fresh = helpers.region_paths()  # a fresh region and its doorbells (one pipe each way per rank)
    assert pool2.transport == "shm" and len(fresh) == 1 + 2 * 2 and sum("." not in f for f in fresh) == 1
    assert pool2.health()["state"] == "healthy" and len(pool2.book) == 0
    mirror = ServingMirror(MLA, seed=5)
    reqs = [mirror.prefill_request("y", 11)]
    helpers.check(pool2.prefill(reqs, return_lse=True), reqs, mirror)
    reqs = [mirror.decode_request("y")]
    helpers.check(pool2.decode(reqs, return_lse=True), reqs, mirror)
    pool2.free(["y"])


@needs_ray
def test_health_says_a_rank_is_dead_before_the_next_call_fails(ray_instance) -> None:
    """A rank killed between steps: ``health()`` said "healthy" (only the rank's own entry said
    dead) until a call failed; it says "rank dead", the next call raises, and a restart serves."""
    import ray

    from shardattn.serving import RankFailedError
    from shardattn.testing.serving import ServingMirror

    with helpers.pool(2, MLA, max_requests=4, max_seq_len=48) as pool:
        mirror = ServingMirror(MLA, seed=8)
        pool.prefill([mirror.prefill_request("a", 5)])
        ray.kill(pool._actors[1], no_restart=True)
        for _ in range(50):  # the kill lands asynchronously (the rank may first be unresponsive)
            health = pool.health(timeout_s=1.0)
            if health["state"] not in ("healthy", "rank unresponsive"):
                break
            time.sleep(0.1)
        assert health["state"] == "rank dead" and health["ranks"][1]["state"] == "dead", health
        with pytest.raises(RankFailedError):
            pool.decode([mirror.decode_request("a")])
        assert pool.health()["state"] == "broken"
        assert pool.restart() == ["a"]
        mirror.free("a")
        reqs = [mirror.prefill_request("b", 6)]
        helpers.check(pool.prefill(reqs, return_lse=True), reqs, mirror)


@needs_ray
def test_health_says_a_frozen_rank_is_unresponsive_and_healthy_again_once_it_runs(ray_instance) -> None:
    """A rank whose process is stopped (SIGSTOP) answers no health probe: ``health()`` says "rank
    unresponsive" (it said "healthy", and the next step waited ``timeout_s`` and broke the pool);
    resumed, the pool is healthy and serves."""
    import os
    import signal

    from shardattn.testing.serving import ServingMirror

    with helpers.pool(2, MLA, max_requests=4, max_seq_len=48) as pool:
        mirror = ServingMirror(MLA, seed=9)
        pool.prefill([mirror.prefill_request("a", 5, attend=False)])
        pid = pool.health()["ranks"][1]["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            health = pool.health(timeout_s=1.0)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert health["state"] == "rank unresponsive" and health["ranks"][1]["state"] == "unresponsive", health
        assert health["ranks"][0]["state"] == "ready", health
        assert pool.health(timeout_s=10.0)["state"] == "healthy"
        reqs = [mirror.decode_request("a")]
        helpers.check(pool.decode(reqs, return_lse=True), reqs, mirror)


@needs_ray
def test_a_rank_that_dies_in_a_compiled_graph_step_is_named_dead(ray_instance) -> None:
    """Under the compiled-graph transport a rank killed between steps (SIGKILL) shows to the driver
    as a closed channel: the error says the actor died (it gave the channel's error alone)."""
    import os
    import signal

    from shardattn.serving import RankFailedError
    from shardattn.testing.serving import ServingMirror

    with helpers.pool(2, MLA, max_requests=4, max_seq_len=48, transport="compiled") as pool:
        assert pool.transport == "compiled"
        mirror = ServingMirror(MLA, seed=10)
        pool.prefill([mirror.prefill_request("a", 5, attend=False)])
        pool.decode([mirror.decode_request("a")])  # the graph has run
        os.kill(pool.health()["ranks"][0]["pid"], signal.SIGKILL)
        time.sleep(1.0)  # Ray has seen the process go: the driver's channel to it is closed
        with pytest.raises(RankFailedError, match="rank 0 failed during decode") as info:
            pool.decode([mirror.decode_request("a")])
        assert info.value.rank == 0 and info.value.cause.startswith("actor died"), info.value.cause
