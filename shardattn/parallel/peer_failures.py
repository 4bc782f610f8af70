"""How a rank learns which peer made its collective fail: one-line reports in the group's store.

A rank whose step raised posts ``"ExceptionType: message"`` under its key (:func:`report_failure`);
a rank whose collective failed posts that it is alive, waits up to :data:`REPORT_GRACE_S` for its
peers' reports and names the ranks that raised or, failing that, the silent ones
(:func:`name_failed_peers`). :class:`~shardattn.parallel.comm.Comm` calls both.

Where the failure travels in a collective that completes instead (a flag in an all-gather that
ends a phase every rank runs, :func:`~shardattn.parallel.agreement.settle`), the failed rank
posts its report before it enters the collective, and its peers, which learn from the flag who
raised, read the report (:func:`name_raised_peers`): the same error, :class:`PeerFailedError`,
naming the rank and its exception, at once rather than at the group's timeout.

Every report is kept under a key of its rank, Comm and step, and a rank reads only its peers'
reports of its own Comm and step, so a report left in the store earlier is never blamed for a later
failure (a rank that has not reached the step, as one that hangs before it, counts as silent), and
a rank that goes on to its next step while its peers still wait for the last one (it retries, or
serves the next batch) does not overwrite the report they are about to read.

* The step: each rank's :class:`~shardattn.parallel.comm.Comm` counts the steps it begins
  (:meth:`~shardattn.parallel.comm.Comm.begin_step`, at every step's agreement,
  :func:`~shardattn.parallel.agreement.agree_on`), so a report of an earlier step of the same Comm
  (one whose ranks all raised before any collective, say) is not this step's.
* The Comm: every Comm counts its steps from zero, and a group outlives its Comms (several
  Runtimes on one group, one Runtime after another's failed construction). A numbered Comm
  (``Comm(group)``) takes a generation when it is made (:func:`comm_generation`): the count of
  numbered Comms its rank has made on the group, kept in the group's store (one ``store.add`` on
  a key of the rank's own). The ranks of a group make their Comms on it in the same order (their
  collectives would not match otherwise), so the n-th of every rank has generation n, and a
  report of an earlier Comm is not this one's. The Comm a parallel step makes for a raw group
  (``Comm.wrap``, one a call) is unnumbered (generation 0, no round trip): such calls may read
  each other's reports.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import time
from typing import TYPE_CHECKING, Literal

import torch.distributed as dist

from shardattn.errors import PeerFailedError

if TYPE_CHECKING:
    from shardattn.parallel.comm import Comm

__all__ = [
    "REPORT_GRACE_S",
    "PeerFailedError",
    "ReportingFailures",
    "check_grace",
    "comm_generation",
    "looks_like_peer_failure",
    "name_failed_peers",
    "name_raised_peers",
    "report_failure",
]

#: Seconds a rank whose collective failed waits for its peers' failure reports before naming the
#: silent ranks (a rank that raised has reported before its peers' collective even failed).
REPORT_GRACE_S = 1.0
_REPORT_KEY = "shardattn/failure/rank{}/{}.{}"  # rank, Comm generation, step
_GENERATION_KEY = "shardattn/comms/rank{}"
_ALIVE = "alive"


def check_grace(value: object) -> float:
    """A failure-report grace: a finite number of seconds >= 0 (an infinite one would leave a rank
    whose collective failed waiting for ever on a peer that never reports)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"report_grace_s must be a number of seconds, got {type(value).__name__} ({value!r})")
    seconds = float(value)
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"report_grace_s must be a finite number >= 0, got {value!r}")
    return seconds


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


def comm_generation(group: dist.ProcessGroup, rank: int, world_size: int) -> int:
    """The generation of a Comm ``rank`` makes on ``group``: how many Comms it has made on the group,
    this one included (1, 2, ...), counted in the group's store; ``0`` without peers or a store.

    Equal on every rank for the n-th Comm each makes on the group (they make them in the same
    order); failure reports name it (module docstring). One store round trip."""
    store = _group_store(group) if world_size > 1 else None
    if store is None:
        return 0
    try:
        return int(store.add(_GENERATION_KEY.format(rank), 1))
    except Exception:  # best effort, as the reports: a store that fails here fails them too
        return 0


def _report_key(rank: int, generation: int, step: int) -> str:
    """Where ``rank`` posts its report of step ``step`` of its Comm of generation ``generation``: a key
    of its own for each step, so a later step's report (or ``"alive"``) never overwrites an earlier
    one that peers of that step have yet to read."""
    return _REPORT_KEY.format(rank, generation, step)


def report_failure(
    group: dist.ProcessGroup, rank: int, error: BaseException, *, step: int = 0, generation: int = 0
) -> None:
    """Post ``rank``'s failure (``"ExceptionType: first line"``) in step ``step`` of its Comm of
    generation ``generation`` to the group's store; best effort."""
    store = _group_store(group)
    first = (str(error).strip().splitlines() or [""])[0][:300]
    with contextlib.suppress(Exception):
        if store is not None:
            store.set(_report_key(rank, generation, step), f"{type(error).__name__}: {first}")


def _read_reports(
    store: dist.Store | None, ranks: list[int], generation: int, step: int, grace_s: float
) -> dict[int, str]:
    """``{rank: report}`` of those of ``ranks`` that posted one in step ``step`` of the Comm of
    generation ``generation`` within ``grace_s`` seconds (``"ExceptionType: message"``, or
    ``"alive"``); a report of another Comm, or of an earlier step, is not this one's."""
    reports: dict[int, str] = {}
    if store is None:
        return reports
    deadline = time.monotonic() + grace_s
    while True:
        for r in ranks:
            if r not in reports:
                with contextlib.suppress(Exception):
                    key = _report_key(r, generation, step)
                    if store.check([key]):
                        reports[r] = store.get(key).decode(errors="replace")
        if len(reports) == len(ranks) or time.monotonic() >= deadline:
            return reports
        time.sleep(0.02)


def _global(group: dist.ProcessGroup, ranks: list[int]) -> str:
    """`` (global rank(s) ...)`` where the group numbers its ``ranks`` otherwise than the world (a
    sub-group, a mesh dim), else ``""``: logs of several groups then name one process alike."""
    try:
        numbers = [dist.get_global_rank(group, r) for r in ranks]
    except (RuntimeError, ValueError):  # a group torch does not know
        return ""
    if numbers == ranks:
        return ""
    return f" (global rank {numbers[0]})" if len(numbers) == 1 else f" (global ranks {numbers})"


def name_failed_peers(
    group: dist.ProcessGroup,
    rank: int,
    world_size: int,
    kind: str,
    error: BaseException,
    *,
    grace_s: float,
    step: int = 0,
    generation: int = 0,
) -> PeerFailedError:
    """The error for a ``kind`` collective on ``rank`` that failed with ``error`` in step ``step`` of
    its Comm of generation ``generation``: names the peers that reported raising in that step of
    that Comm, else those that did not report within ``grace_s`` seconds."""
    cause = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    store = _group_store(group)
    peers = [r for r in range(world_size) if r != rank]
    if store is not None:
        with contextlib.suppress(Exception):
            store.set(_report_key(rank, generation, step), _ALIVE)
    reports = _read_reports(store, peers, generation, step, grace_s)
    raised = {r: v for r, v in sorted(reports.items()) if v != _ALIVE}
    silent = [r for r in peers if r not in reports] if store is not None else []
    if raised:
        who = "; ".join(f"rank {r} of {world_size}{_global(group, [r])} raised {v}" for r, v in raised.items())
    elif silent:
        who = (
            f"rank(s) {silent} of {world_size}{_global(group, silent)} did not report within {grace_s:g} s "
            "(exited or hung, or still blocked in a collective)"
        )
    else:
        who = f"a peer of the {world_size} ranks failed (no report available)"
    return PeerFailedError(
        f"{kind} on rank {rank} failed because {who}; the collective said: {cause}", raised=raised, silent=silent
    )


def name_raised_peers(
    group: dist.ProcessGroup,
    rank: int,
    world_size: int,
    what: str,
    failed: list[int],
    *,
    grace_s: float,
    step: int = 0,
    generation: int = 0,
) -> PeerFailedError:
    """The error for ``rank`` when a collective that completed said that the ranks ``failed`` raised
    in ``what`` (step ``step`` of the Comm of generation ``generation``; they reported before it,
    :func:`report_failure`): names each with its report, waiting at most ``grace_s`` seconds for
    one that has not reached the store."""
    reports = _read_reports(_group_store(group), failed, generation, step, grace_s)
    unknown = "an exception (its report did not reach the group's store)"
    raised = {r: reports[r] if reports.get(r, _ALIVE) != _ALIVE else unknown for r in failed}
    who = "; ".join(f"rank {r} of {world_size}{_global(group, [r])} raised {v}" for r, v in raised.items())
    return PeerFailedError(
        f"{what} on rank {rank} failed because {who}; rank {rank} stops too instead of waiting for it",
        raised=raised,
        silent=[],
    )


class ReportingFailures:
    """:meth:`~shardattn.parallel.comm.Comm.reporting_failures`: reports an exception (other than a
    peer's failure; a ``KeyboardInterrupt`` or ``SystemExit`` too) to the peers on the way out
    (``comm.report_failure``, one store write), then lets it propagate."""

    __slots__ = ("_comm",)

    def __init__(self, comm: Comm) -> None:
        self._comm = comm

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> Literal[False]:
        if error is not None and not isinstance(error, (PeerFailedError, GeneratorExit)):
            self._comm.report_failure(error)
        return False  # re-raise
