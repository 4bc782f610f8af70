"""What a pool holds for its request steps, declared once for the parts mixed into it (:class:`PoolState`).

:class:`~shardattn.serving.pool.RayRankPool` sets these at construction and restart; its request
steps (:class:`~shardattn.serving.prefill_steps.PrefillSteps`,
:class:`~shardattn.serving.staging_rows.StagingRows`,
:class:`~shardattn.serving.decode_steps.DecodeSteps`) read them. Annotations, and the check that
the pool has a model.
"""

from __future__ import annotations

from typing import Any

from shardattn.plan.kv_pages import PagedKVBook
from shardattn.plan.spec import ModelSpec
from shardattn.serving.pool_shapes import PoolShapes
from shardattn.serving.rank_calls import RankCalls

__all__ = ["PoolState"]


class PoolState(RankCalls):
    """The attributes of a pool its request steps read (set by the pool)."""

    #: the driver's page ledger of every rank's KV cache
    book: PagedKVBook
    shapes: PoolShapes
    #: the model (``None``: a pool formed for :meth:`run` only, which serves no request)
    spec: ModelSpec | None
    mode: str
    heads_per_rank: int
    transport: str
    host_threads: int
    last_step: dict[str, Any]

    def _need_spec(self) -> ModelSpec:
        """The pool's model; ``RuntimeError`` on a pool formed without one."""
        if self.spec is None:
            raise RuntimeError("this pool was formed without a spec; pass spec= to serve requests")
        return self.spec
