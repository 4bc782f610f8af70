"""A servable Ray actor pool (Ray is optional: importing this package does not import it).

* :mod:`~shardattn.serving.pool`       :class:`RayRankPool`: placement, group, building, restart, shutdown.
* :mod:`~shardattn.serving.steps`      its request API: prefill, decode (requests), decode_batch (tensors),
  put together from :mod:`~shardattn.serving.prefill_steps`, :mod:`~shardattn.serving.decode_steps` and
  :mod:`~shardattn.serving.staging_rows` (where a decode step's inputs may be written), over the state
  of :mod:`~shardattn.serving.pool_state`.
* :mod:`~shardattn.serving.rank_calls` its calls to the ranks: timeouts, faults (a broken pool), health, run.
* :mod:`~shardattn.serving.actor`      one rank: its Runtime, its KV-cache shard, its decode step.
* :mod:`~shardattn.serving.actor_prefill` a rank's prefill steps (PCP, head-TP GQA, ShardQ / head-TP sparse MLA).
* :mod:`~shardattn.serving.actor_shm`  a rank's decode steps out of the shared-memory region.
* :mod:`~shardattn.serving.kv_cache`   a rank's paged KV pages: writes and prefix gathers.
* :mod:`~shardattn.serving.requests`   :class:`PrefillRequest`, :class:`DecodeRequest`, validation (of tensors too).
* :mod:`~shardattn.serving.pool_shapes` what a pool's steps accept, and the tensor checks they go through.
* :mod:`~shardattn.serving.transport`  how decode steps reach the ranks (shm, compiled graph, calls).
* :mod:`~shardattn.serving.shm`        the shared-memory region of decode steps, its serve loop.
* :mod:`~shardattn.serving.shm_steps`  the driver's side of it: writes a step, rings, waits, watches the loops.
* :mod:`~shardattn.serving.doorbell`   a named pipe that wakes a process and orders the memory it reads
  after the writer's stores, on any CPU (the shared-memory steps' publication).
* :mod:`~shardattn.serving.health`     the ranks' health reports.
* :mod:`~shardattn.serving.placement`  the placement group (one bundle per rank).
* :mod:`~shardattn.serving.errors`     :class:`RankFailedError`, the Ray check.

The pages each request holds are the planner's (:mod:`shardattn.plan.kv_pages`).
"""

from shardattn.serving.errors import PlacementTimeoutError, RankFailedError, ray_unavailable_reason, require_ray
from shardattn.serving.pool import RayRankPool
from shardattn.serving.requests import DecodeRequest, PrefillRequest

__all__ = [
    "DecodeRequest",
    "PlacementTimeoutError",
    "PrefillRequest",
    "RankFailedError",
    "RayRankPool",
    "ray_unavailable_reason",
    "require_ray",
]
