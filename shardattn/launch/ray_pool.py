"""The Ray actor pool (kept importable here; the code lives in :mod:`shardattn.launch.ray`).

Ray is optional (``pip install 'shardattn[ray]'``): importing this module does not import it;
constructing :class:`RayRankPool` without Ray raises ``ImportError`` naming the ``ray`` extra.
"""

from shardattn.launch.ray import (
    DecodeRequest,
    PlacementTimeoutError,
    PrefillRequest,
    RankFailedError,
    RayRankPool,
    ray_unavailable_reason,
)

__all__ = [
    "DecodeRequest",
    "PlacementTimeoutError",
    "PrefillRequest",
    "RankFailedError",
    "RayRankPool",
    "ray_unavailable_reason",
]
