"""A pool built with ``topk_unique=True`` (an indexer's top-k: no position twice) passes the promise
to every sparse-MLA step its ranks run (ShardQ / head-TP / PCP prefill, DCP / head-TP decode), its
outputs still equal fp64 attention, and the promise is refused where it means nothing (a GQA spec,
no spec) or is not a bool, before Ray starts."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests import ray_pool_helpers as helpers
from tests.ray_pool_helpers import GQA, MLA, needs_ray

ray_instance = helpers.ray_instance  # the module's Ray (a fixture)


class _RecordingRuntime:
    """A Runtime stand-in: records each step's keyword arguments and returns zeros of the step's shape."""

    def __init__(self, mode: str) -> None:
        self.mode, self.spec, self.decode_is_dcp = mode, SimpleNamespace(kind="sparse_mla", v_dim=32), True
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def plan_prefill(self, counts: list[int], starts: list[int]) -> Any:
        return SimpleNamespace(tokens_of=lambda rank: torch.arange(sum(counts)))

    def _step(self, name: str, q: torch.Tensor, kw: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append((name, kw))
        return q.new_zeros(*q.shape[:2], self.spec.v_dim), q.new_zeros(q.shape[:2])

    def prefill(self, q: torch.Tensor, *args: Any, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self._step("prefill", q, kw)

    def decode(self, q: torch.Tensor, *args: Any, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self._step("decode", q, kw)


class _Cache:
    """The parts of a rank's KV-cache shard the steps touch, over one flat ``[R, 48]`` tensor."""

    def __init__(self) -> None:
        self.rows = torch.zeros(64, 48)

    def write(self, *args: Any) -> None:
        pass

    def as_stored(self, kv: torch.Tensor) -> torch.Tensor:
        return kv

    def flat(self, component: int) -> torch.Tensor:
        return self.rows


@pytest.mark.parametrize("mode", ["shardq", "pcp"])
@pytest.mark.parametrize("unique", [False, True])
def test_an_actor_passes_the_pools_promise_to_every_sparse_step(mode: str, unique: bool) -> None:
    """The actor's prefill (ShardQ / head-TP or PCP) and decode call the Runtime with the
    ``topk_unique`` its pool was built with (on a CPU the kernels' answer is the same either way,
    so the call itself is what is checked)."""
    from shardattn.serving.actor import RankActor

    actor = RankActor(0, 1, "cpu")
    actor.runtime, actor.cache, actor.topk_unique = _RecordingRuntime(mode), _Cache(), unique
    n, k = 5, 4
    topk = torch.randint(0, n, (n, k), dtype=torch.int32)
    shared = {"table": torch.zeros(1, 2, dtype=torch.int32), "starts": [0], "counts": [n], "q_counts": [n],
              "kv": [torch.randn(n, 48)], "topk": topk, "return_lse": True}  # fmt: skip
    actor.prefill(shared, torch.randn(n, 8, 48))
    actor.decode(shared, torch.randn(n, 8, 48))
    assert [(name, kw["topk_unique"]) for name, kw in actor.runtime.calls] == [("prefill", unique), ("decode", unique)]


@needs_ray
def test_bad_topk_unique_is_refused_before_ray_starts() -> None:
    from shardattn.serving import RayRankPool

    small = {"max_batched_tokens": 8}
    for kwargs, match in (
        ({"spec": GQA, "mode": "dcp-decode"}, r"^topk_unique=True promises a sparse-MLA top-k, but the pool has a gqa"),
        ({"spec": None}, r"^topk_unique=True promises a sparse-MLA top-k, but the pool has no spec"),
    ):
        with pytest.raises(ValueError, match=match):
            RayRankPool(2, runtime_kwargs=small, topk_unique=True, init_ray=False, **kwargs)
    with pytest.raises(TypeError, match=r"^topk_unique must be a bool"):
        RayRankPool(2, MLA, runtime_kwargs=small, topk_unique=1, init_ray=False)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^spec must be a ModelSpec"):  # the spec named, not the promise
        RayRankPool(2, 5, runtime_kwargs=small, topk_unique=True, init_ray=False)  # type: ignore[arg-type]


@needs_ray
@pytest.mark.parametrize("mode", ["mixed", "pcp", "shardq"])
def test_a_pool_promised_unique_topk_equals_fp64_attention(ray_instance, mode: str) -> None:
    """ShardQ + DCP decode (``mixed``), PCP + DCP decode, ShardQ + head-TP decode: prefill, chunked
    prefill, decode with drafts, free and reuse, all under the promise (the mirror's top-k lists a
    position once)."""
    from shardattn.testing.serving import ServingMirror

    with helpers.pool(2, MLA, mode=mode, max_requests=4, max_seq_len=48, num_pages=16, topk_unique=True) as pool:
        assert pool.topk_unique
        helpers.serve_and_check(pool, ServingMirror(MLA, seed=5))
