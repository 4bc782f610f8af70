"""One rank's Runtime construction fails: its peers raise within the failure-report grace, naming it.

Every rank of the pool (2 or more) on a fresh group whose collectives time out after ``TIMEOUT_S`` (the bound of a
peer that waits for the failed rank instead; gloo's default would be 30 minutes). Rank 1 fails
before the construction's host all-gather (a bad mode, options of the wrong type) or after it
(a workspace it cannot allocate, a warm-up that raises); rank 1 raises its own error, and every
other rank must raise :class:`~shardattn.errors.PeerFailedError` naming rank 1 and its exception well before
the group's timeout.
"""

from __future__ import annotations

import contextlib
import time
from unittest import mock

import pytest
import torch.distributed as dist

from shardattn.errors import PeerFailedError
from shardattn.runtime.runtime import Runtime
from tests.parallel_helpers import short_timeout_group
from tests.test_runtime import MLA

#: The fault group's collective timeout (seconds): how long a peer left waiting would block.
TIMEOUT_S = 10.0
#: What a peer may take to raise: the failure-report grace (1 s) plus scheduling noise on a busy host.
FAST_S = 4.0

#: rank 1's fault -> (its Runtime arguments, the start of its own error)
FAULTS = {
    "bad-mode": ({"mode": "no-such-mode"}, "ValueError: mode must be one of"),
    "options-dict": ({"prefill_options": {"min_shard_tokens": 1}}, "TypeError: prefill_options must be"),
    "workspace": ({"max_batched_tokens": 1 << 50}, "MemoryError: the Runtime's workspace needs"),
    "warmup": ({"warmup": True}, "RuntimeError: injected warm-up failure"),
}


def _failing_warmup(self: Runtime) -> int:
    raise RuntimeError(f"injected warm-up failure on rank {self.rank}")


def _build(group: dist.ProcessGroup, fault: str) -> dict:
    """Build a Runtime on a short-timeout group, rank 1 with ``fault``; what each rank raised and when.

    Rank 1 stays alive (as a serving process that catches the error does) until rank 0 is done:
    a peer waiting for it learns nothing from a closed connection. A peer whose construction
    returned goes on to a step's first collective, as an engine would, and records how that ends."""
    short = short_timeout_group(group, TIMEOUT_S)
    rank = dist.get_rank(short)
    kwargs: dict = {"mode": "headtp", "max_batched_tokens": 8, "warmup": False}
    result: dict = {"type": None, "error": None}
    with contextlib.ExitStack() as stack:
        if rank == 1:
            kwargs.update(FAULTS[fault][0])
            if fault == "warmup":
                stack.enter_context(mock.patch.object(Runtime, "warmup", _failing_warmup))
        start = time.monotonic()
        try:
            rt = Runtime(MLA, short, **kwargs)
        except Exception as e:
            result = {"type": type(e).__name__, "error": str(e)}
        result["s"] = time.monotonic() - start
    if result["type"] is None:  # built: the next step's agreement waits for rank 1 (until the timeout)
        try:
            rt.comm.check_agreement(0, "first step")
            result["first_step"] = "ok"
        except Exception as e:
            result["first_step"] = f"{type(e).__name__}: {str(e)[:120]}"
        result["first_step_s"] = time.monotonic() - start
    dist.barrier(group=group)  # on the pool's group: rank 1 keeps its end of ``short`` open until here
    dist.destroy_process_group(short)
    return result


@pytest.mark.distributed
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_one_ranks_construction_failure_reaches_its_peer_at_once(dist_pool, nproc: int, fault: str) -> None:
    if nproc < 2 or MLA.num_heads % nproc:
        pytest.skip(f"needs 2 or more ranks that divide the spec's {MLA.num_heads} heads")
    results = dist_pool.run(_build, fault)  # every rank of the pool: the short group spans the world
    failed, peers = results[1], [res for r, res in enumerate(results) if r != 1]
    own = FAULTS[fault][1]
    assert failed["error"] is not None and f"{failed['type']}: {failed['error']}".startswith(own), failed
    for rank, peer in zip((r for r in range(nproc) if r != 1), peers):
        assert peer["type"] == PeerFailedError.__name__, peer
        want = f"Runtime construction on rank {rank} failed because rank 1 of {nproc} raised {own}"
        assert peer["error"].startswith(want), peer
        assert peer["s"] < FAST_S, peer  # within the report grace, not at the group's timeout (TIMEOUT_S)


def test_the_failure_errors_travel_whole_between_processes() -> None:
    """A peer's error pickles with what it names (a Ray driver reads it from an actor's result)."""
    import pickle

    from shardattn.errors import RankFailedError

    err = pickle.loads(pickle.dumps(PeerFailedError("m", raised={1: "ValueError: x"}, silent=[2])))
    assert (str(err), err.raised, err.silent) == ("m", {1: "ValueError: x"}, [2])
    pool_err = pickle.loads(pickle.dumps(RankFailedError(1, "raised ValueError: x", "build")))
    assert (pool_err.rank, pool_err.cause, pool_err.operation) == (1, "raised ValueError: x", "build")


class _WarmUpFailsOnRank1:
    """A pool rank (:class:`~shardattn.serving.actor.RankActor`) whose Runtime warm-up raises on rank 1."""

    @staticmethod
    def make():
        from shardattn.serving.actor import RankActor

        class Actor(RankActor):
            def build(self, spec, runtime_kwargs, cache, sinks=None, topk_unique=False):
                if self.rank == 1:
                    Runtime.warmup = _failing_warmup  # this actor's process only
                    runtime_kwargs = {**runtime_kwargs, "warmup": True}
                return super().build(spec, runtime_kwargs, cache, sinks, topk_unique)

        return Actor


def test_a_ray_pool_names_the_rank_whose_construction_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank raises (rank 0 a PeerFailedError naming rank 1): the pool's one error names rank 1."""
    from shardattn.serving.errors import ray_unavailable_reason

    if ray_unavailable_reason() is not None:
        pytest.skip(str(ray_unavailable_reason()))
    import ray

    from shardattn.errors import RankFailedError
    from shardattn.serving import pool as pool_module
    from shardattn.serving.health import HEALTH_GROUP
    from shardattn.serving.transport import SERVE_GROUP

    def actor_class(num_cpus: float, num_gpus: float):
        groups = {HEALTH_GROUP: 1, SERVE_GROUP: 1}
        remote = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0, concurrency_groups=groups)
        return remote(_WarmUpFailsOnRank1.make())

    monkeypatch.setattr(pool_module, "_actor_class", actor_class)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for _ in range(2):  # whichever rank's error the driver reads first
            with pytest.raises(RankFailedError) as info:
                pool_module.RayRankPool(
                    2, MLA, mode="headtp", device="cpu", transport="calls", timeout_s=60, init_ray=False,
                    runtime_kwargs={"max_batched_tokens": 8, "warmup": False},
                )  # fmt: skip
            assert info.value.rank == 1 and info.value.operation == "build", info.value
            assert info.value.cause.startswith("raised RuntimeError: injected warm-up failure on rank 1"), info.value
    finally:
        ray.shutdown()
