"""Errors of the Ray pool, and the check that Ray is installed.

Ray is an optional dependency (``pip install 'shardattn[ray]'``): nothing here imports it at
module import time.
"""

from __future__ import annotations

__all__ = ["PlacementTimeoutError", "RankFailedError", "ray_unavailable_reason", "require_ray"]


class RankFailedError(RuntimeError):
    """A rank of the pool died, raised or did not answer in time during a call.

    The pool is broken afterwards: every later call raises this same error until
    :meth:`~shardattn.launch.ray.pool.RayRankPool.restart`.

    Attributes:
        rank: the failed rank (the first one seen). cause: what happened, in words.
        operation: the pool call that failed (``"decode"``, ``"prefill"``, ...).
    """

    def __init__(self, rank: int, cause: str, operation: str) -> None:
        super().__init__(f"rank {rank} failed during {operation}: {cause} (the pool is broken; call restart())")
        self.rank, self.cause, self.operation = rank, cause, operation


class PlacementTimeoutError(TimeoutError):
    """The placement group's bundles were not all reserved within the timeout."""


def ray_unavailable_reason() -> str | None:
    """Why the pool cannot run here (``None`` when Ray imports)."""
    try:
        import ray  # noqa: F401
    except ImportError as e:
        return f"ray is not installed ({e}); install the 'ray' extra: pip install 'shardattn[ray]'"
    return None


def require_ray() -> None:
    """Raise ``ImportError`` naming the ``ray`` extra when Ray is missing."""
    reason = ray_unavailable_reason()
    if reason is not None:
        raise ImportError(reason)
