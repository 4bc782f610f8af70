"""The request API of a :class:`~shardattn.serving.pool.RayRankPool`: prefill and decode steps.

:class:`RequestSteps` is the pool's base: :meth:`~RequestSteps.prefill` (request objects, actor
calls; :class:`~shardattn.serving.prefill_steps.PrefillSteps`), :meth:`~RequestSteps.decode`
(request objects, checked one by one) and :meth:`~RequestSteps.decode_batch` (a whole step's
tensors, checked with array operations; both :class:`~shardattn.serving.decode_steps.DecodeSteps`),
and :meth:`~RequestSteps.step_inputs`, where a decode step's inputs may be written
(:class:`~shardattn.serving.staging_rows.StagingRows`). Their common base,
:class:`~shardattn.serving.rank_calls.RankCalls`, makes the fault-checked calls to the ranks; the
pool provides the state they use (:class:`~shardattn.serving.pool_state.PoolState`): its ledger
(``book``), ``shapes``, actors and transport.

One step runs at a time (the pool's lock: a step called from another thread waits), and a step
that fails on the driver after its checks, before any rank runs, takes its tokens back out of the
ledger, so no later step reads a token that was never written.
"""

from __future__ import annotations

from shardattn.serving.decode_steps import DecodeSteps
from shardattn.serving.prefill_steps import PrefillSteps

__all__ = ["RequestSteps"]


class RequestSteps(PrefillSteps, DecodeSteps):
    """Prefill and decode steps of a pool (its base class; the pool holds the state used here)."""
