"""Errors of the Ray pool (the public ones live in :mod:`shardattn.errors`), and the check that Ray is installed.

Ray is an optional dependency (``pip install 'shardattn[ray]'``): nothing here imports it at
module import time.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardattn.errors import PeerFailedError, PlacementTimeoutError, RankFailedError

__all__ = [
    "PlacementTimeoutError",
    "RankFailedError",
    "RankStepError",
    "blame",
    "describe_ray_error",
    "ray_unavailable_reason",
    "require_ray",
]


class RankStepError(Exception):
    """Internal: one rank's part of a call failed (the pool turns it into :class:`RankFailedError`).
    ``late``: the ranks that had not answered when the call timed out (empty: not a timeout)."""

    def __init__(self, rank: int, cause: str, late: Sequence[int] = ()) -> None:
        super().__init__(f"rank {rank}: {cause}")
        self.rank, self.cause, self.late = rank, cause, tuple(late)


def describe_ray_error(exc: BaseException) -> str:
    """One line for a Ray error: the actor's exception, or how the actor died."""
    import ray

    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = exc.cause if exc.cause is not None else exc
        text = str(cause).strip()
        return f"raised {type(cause).__name__}: {text.splitlines()[-1] if text else ''}"
    if isinstance(exc, ray.exceptions.RayActorError):
        lines = str(exc).strip().splitlines()
        return "actor died (" + (lines[0][:200] if lines else type(exc).__name__) + ")"
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def blame(rank: int, exc: BaseException) -> tuple[int, str]:
    """The rank a failed call names, and its cause, for ``rank``'s Ray error ``exc``: ``rank`` and
    its error, except where that error is a :class:`~shardattn.errors.PeerFailedError` naming peers
    that raised (``rank`` stopped because of them): then the first of those, with its error."""
    import ray

    cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else None
    if isinstance(cause, PeerFailedError) and cause.raised:
        first = min(cause.raised)
        return first, f"raised {cause.raised[first]} (rank {rank} stopped too: {type(cause).__name__})"
    return rank, describe_ray_error(exc)


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
