"""A servable Ray actor pool (Ray is optional: importing this package does not import it).

* :mod:`~shardattn.launch.ray.pool`       :class:`RayRankPool`: placement, group, faults, health.
* :mod:`~shardattn.launch.ray.steps`      its request API: prefill, decode (requests), decode_batch (tensors).
* :mod:`~shardattn.launch.ray.actor`      one rank: its Runtime, its KV-cache shard, its steps.
* :mod:`~shardattn.launch.ray.kv_cache`   a rank's paged KV pages: writes and prefix gathers.
* :mod:`~shardattn.launch.ray.requests`   :class:`PrefillRequest`, :class:`DecodeRequest`, validation (of tensors too).
* :mod:`~shardattn.launch.ray.transport`  how decode steps reach the ranks (shm, compiled graph, calls).
* :mod:`~shardattn.launch.ray.shm`        the shared-memory region of decode steps, its serve loop.
* :mod:`~shardattn.launch.ray.health`     the ranks' health reports.
* :mod:`~shardattn.launch.ray.placement`  the placement group (one bundle per rank).
* :mod:`~shardattn.launch.ray.errors`     :class:`RankFailedError`, the Ray check.

The pages each request holds are the planner's (:mod:`shardattn.plan.kv_pages`).
"""

from shardattn.launch.ray.errors import PlacementTimeoutError, RankFailedError, ray_unavailable_reason, require_ray
from shardattn.launch.ray.pool import RayRankPool
from shardattn.launch.ray.requests import DecodeRequest, PrefillRequest

__all__ = [
    "DecodeRequest",
    "PlacementTimeoutError",
    "PrefillRequest",
    "RankFailedError",
    "RayRankPool",
    "ray_unavailable_reason",
    "require_ray",
]
