"""The exceptions (and the warning) shardattn raises beyond ``ValueError`` / ``TypeError``, in one place.

Bad arguments raise ``ValueError`` / ``TypeError`` naming the argument, before any kernel runs;
these classes say what else can go wrong (docs/ARCHITECTURE.md, "Errors", has the table):

* :class:`WorkspaceExceededError` (a ``ValueError``): a Runtime step needs more of a workspace
  item than the Runtime reserved; names the item.
* :class:`PeerFailedError` (a ``RuntimeError``): a collective failed because another rank raised,
  exited or hung; names the rank(s).
* :class:`CalibrationWarning`: a cost-model calibration table could not be used; the model falls
  back to the conservative default.
* :class:`LaunchError`: ``python -m shardattn.launch`` was given a bad option or an impossible
  configuration; ``str(err)`` is the one line shown, ``status`` the exit status.
* :class:`RankFailedError` (a ``RuntimeError``), :class:`PlacementTimeoutError` (a
  ``TimeoutError``): the Ray pool (:mod:`shardattn.serving`) lost a rank, or could not place its
  ranks in time.

A leaf module: it imports nothing of the library, so every layer may raise these.
"""

from __future__ import annotations

__all__ = [
    "CalibrationWarning",
    "LaunchError",
    "PeerFailedError",
    "PlacementTimeoutError",
    "RankFailedError",
    "WorkspaceExceededError",
]


class WorkspaceExceededError(ValueError):
    """A step needs more of a workspace item than the Runtime reserved for its config."""


class PeerFailedError(RuntimeError):
    """A collective failed because another rank raised, exited or hung; the message names the rank(s).

    Attributes:
        raised: ``{rank: "ExceptionType: message"}`` of the peers whose step raised.
        silent: peers that did not report within the grace (``parallel.peer_failures.REPORT_GRACE_S``
            by default): they exited or hang, or, alive, were still blocked in a collective of their
            own that had not failed yet (a peer waiting on a rank that itself gave up learns of it
            only at the group's timeout). Always includes a rank that exited.
    """

    def __init__(self, message: str, *, raised: dict[int, str], silent: list[int]) -> None:
        super().__init__(message)
        self.raised = raised
        self.silent = silent

    def __reduce__(self) -> tuple:
        """Pickled whole (a rank's error travels to a Ray driver): message, ``raised`` and ``silent``."""
        return (_peer_failed, (str(self), self.raised, self.silent))


def _peer_failed(message: str, raised: dict[int, str], silent: list[int]) -> PeerFailedError:
    return PeerFailedError(message, raised=raised, silent=silent)


class CalibrationWarning(UserWarning):
    """A calibration table could not be used (missing, corrupt, another GPU); the model falls back."""


class LaunchError(Exception):
    """A bad option or impossible configuration of the launcher: ``str(err)`` is the one line shown to
    the user, ``status`` the exit status (2: a usage error)."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


class RankFailedError(RuntimeError):
    """A rank of the Ray pool died, raised or did not answer in time during a call.

    The pool is broken afterwards: every later call raises this same error until
    :meth:`~shardattn.serving.pool.RayRankPool.restart`.

    Attributes:
        rank: the failed rank (the first one seen). cause: what happened, in words.
        operation: the pool call that failed (``"decode"``, ``"prefill"``, ...).
    """

    def __init__(self, rank: int, cause: str, operation: str) -> None:
        super().__init__(f"rank {rank} failed during {operation}: {cause} (the pool is broken; call restart())")
        self.rank, self.cause, self.operation = rank, cause, operation

    def __reduce__(self) -> tuple:
        """Pickled whole: the rank, the cause and the operation."""
        return (type(self), (self.rank, self.cause, self.operation))


class PlacementTimeoutError(TimeoutError):
    """The Ray pool's placement group's bundles were not all reserved within the timeout."""
