"""How a rank learns which peer made its collective fail: one-line reports in the group's store.

A rank whose step raised posts ``"ExceptionType: message"`` under its key (:func:`report_failure`);
a rank whose collective failed posts that it is alive, waits up to :data:`REPORT_GRACE_S` for its
peers' reports and names the ranks that raised or, failing that, the silent ones
(:func:`name_failed_peers`). :class:`~shardattn.parallel.comm.Comm` calls both.

Every report names the step it was made in: each rank counts the steps it begins on a group
(:func:`begin_step`, at every step's agreement, :func:`~shardattn.parallel.agreement.agree_on`),
and reads only its peers' reports of the step it is in, so a report left in the store by an
earlier step (one whose ranks all raised before any collective, say) is never blamed for a later
failure: a rank that has not reached the step (it hangs before it) counts as silent.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from typing import TYPE_CHECKING, Literal

import torch.distributed as dist

from shardattn.errors import PeerFailedError

if TYPE_CHECKING:
    from shardattn.parallel.comm import Comm

__all__ = [
    "REPORT_GRACE_S",
    "PeerFailedError",
    "ReportingFailures",
    "begin_step",
    "catch_up",
    "current_step",
    "looks_like_peer_failure",
    "name_failed_peers",
    "report_failure",
]

#: Seconds a rank whose collective failed waits for its peers' failure reports before naming the
#: silent ranks (a rank that raised has reported before its peers' collective even failed).
REPORT_GRACE_S = 1.0
_REPORT_KEY = "shardattn/failure/rank{}"
_ALIVE = "alive"
#: Steps this process began on each group (:func:`begin_step`); a group that cannot be weakly
#: referenced counts none (its reports are then all of step 0).
_STEPS: weakref.WeakKeyDictionary[dist.ProcessGroup, int] = weakref.WeakKeyDictionary()


def begin_step(group: dist.ProcessGroup) -> None:
    """Count a step this process begins on ``group`` (every rank of a group counts the same steps)."""
    with contextlib.suppress(TypeError):
        _STEPS[group] = _STEPS.get(group, 0) + 1


def current_step(group: dist.ProcessGroup) -> int:
    """The steps this process began on ``group``: the step its reports name and read."""
    with contextlib.suppress(TypeError):
        return _STEPS.get(group, 0)
    return 0


def catch_up(group: dist.ProcessGroup, step: int) -> None:
    """Count ``step`` steps on ``group`` where this process counted fewer (the most any rank of the
    group counted, which an agreement learns: a rank that raised before its step's agreement
    began no step there)."""
    if step > current_step(group):
        with contextlib.suppress(TypeError):
            _STEPS[group] = step


def _group_store(group: dist.ProcessGroup) -> dist.Store | None:
    """The store the group was built on (private torch API; ``None`` where unavailable)."""
    try:
        from torch.distributed.distributed_c10d import _get_process_group_store

        return _get_process_group_store(group)
    except Exception:
        return None


_PEER_FAILURE_WORDS = ("timed out", "timeout", "connection", "closed", "reset by peer", "broken pipe", "abort")


def looks_like_peer_failure(error: BaseException) -> bool:
    """A collective's error that a peer causes (it died, hung or left), rather than a local misuse."""
    kinds = tuple(k for k in (getattr(dist, "DistError", None),) if k is not None)
    if kinds and isinstance(error, kinds):
        return True
    text = str(error).lower()
    return any(w in text for w in _PEER_FAILURE_WORDS)


def report_failure(group: dist.ProcessGroup, rank: int, error: BaseException) -> None:
    """Post ``rank``'s failure (``"ExceptionType: first line"``) in its current step to the group's
    store; best effort."""
    store = _group_store(group)
    first = (str(error).strip().splitlines() or [""])[0][:300]
    with contextlib.suppress(Exception):
        if store is not None:
            store.set(_REPORT_KEY.format(rank), f"{current_step(group)} {type(error).__name__}: {first}")


def name_failed_peers(
    group: dist.ProcessGroup, rank: int, world_size: int, kind: str, error: BaseException, *, grace_s: float
) -> PeerFailedError:
    """The error for a ``kind`` collective on ``rank`` that failed with ``error``: names the peers
    that reported raising in this step, else those that did not report within ``grace_s`` seconds."""
    cause = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    store = _group_store(group)
    peers = [r for r in range(world_size) if r != rank]
    reports: dict[int, str] = {}
    step = f"{current_step(group)} "
    if store is not None:
        with contextlib.suppress(Exception):
            store.set(_REPORT_KEY.format(rank), step + _ALIVE)
        deadline = time.monotonic() + grace_s
        while True:
            for r in peers:
                if r not in reports:
                    with contextlib.suppress(Exception):
                        if store.check([_REPORT_KEY.format(r)]):
                            posted = store.get(_REPORT_KEY.format(r)).decode(errors="replace")
                            if posted.startswith(step):  # a report of an earlier step is not this one's
                                reports[r] = posted[len(step) :]
            if len(reports) == len(peers) or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
    raised = {r: v for r, v in sorted(reports.items()) if v != _ALIVE}
    silent = [r for r in peers if r not in reports] if store is not None else []
    if raised:
        who = "; ".join(f"rank {r} of {world_size} raised {v}" for r, v in raised.items())
    elif silent:
        who = (
            f"rank(s) {silent} of {world_size} did not report within {grace_s:g} s (exited or hung, "
            "or still blocked in a collective)"
        )
    else:
        who = f"a peer of the {world_size} ranks failed (no report available)"
    return PeerFailedError(
        f"{kind} on rank {rank} failed because {who}; the collective said: {cause}", raised=raised, silent=silent
    )


class ReportingFailures:
    """:meth:`~shardattn.parallel.comm.Comm.reporting_failures`: reports an exception (other than a
    peer's failure) to the peers on the way out (``comm.report_failure``), then lets it propagate."""

    __slots__ = ("_comm",)

    def __init__(self, comm: Comm) -> None:
        self._comm = comm

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> Literal[False]:
        if error is not None and isinstance(error, Exception) and not isinstance(error, PeerFailedError):
            self._comm.report_failure(error)
        return False  # re-raise
