"""Calls to a pool's rank actors, and what a failed one does to the pool.

:class:`RankCalls` is the base of a :class:`~shardattn.serving.pool.RayRankPool`: it waits for
one call per rank within the pool's ``timeout_s`` (:meth:`RankCalls._call`); the first rank that
dies, raises or does not answer breaks the pool (:meth:`RankCalls._fail`: one
:class:`~shardattn.serving.errors.RankFailedError` naming the rank that failed first, every actor
stopped, the decode transport torn down), and every later call raises that error until the pool
restarts. A rank whose error is a :class:`~shardattn.errors.PeerFailedError` naming a peer that
raised (it stopped because of that peer, as every rank does when one rank's Runtime construction
fails) is not the one named: the peer is, with its error (:func:`~shardattn.serving.errors.blame`).
It also answers health reports (which never raise for a dead rank), runs a function on every rank,
and arms the fault drills. The pool provides the state used here: its actors, its
timeout, its decode transport and its step lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from shardattn._checks import check_int
from shardattn.serving.actor import check_fault
from shardattn.serving.errors import RankFailedError, blame
from shardattn.serving.health import holding_up, rank_reports
from shardattn.serving.placement import kill_actors

__all__ = ["RankCalls"]


class RankCalls:
    """Calls to the pool's ranks, faults, health (the pool's base class; the pool holds the state used here)."""

    world_size: int
    #: limit of every call (and of the group's collectives)
    timeout_s: float
    #: the rank actors, rank ``r`` at ``r`` (empty once shut down)
    _actors: list[Any]
    #: the error that broke the pool (``None``: usable)
    _broken: RankFailedError | None
    #: the decode transport's runner (``None``: actor calls)
    _decoder: Any
    #: held for a whole step: a pool runs one step at a time (another thread's call waits)
    _step_lock: threading.Lock

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise self._broken
        if not self._actors:
            raise RuntimeError("the pool is shut down")

    def _fail(
        self, rank: int, cause: str, operation: str, late: Sequence[int] = (), *, probe: bool = True
    ) -> RankFailedError:
        """Break the pool: ``rank`` failed ``operation`` (or, if another rank died first, that one;
        ``late``: the ranks that had not answered when the call timed out, of which the one the
        others wait for is named, where their health reports tell: :func:`holding_up`).
        ``probe=False``: no health reports (the driver, not a rank, failed the step)."""
        if probe and not cause.startswith("actor died"):
            reports = rank_reports(self._actors, min(2.0, self.timeout_s))
            # a rank whose collective broke because a peer died reports that as its own error
            dead = [h["rank"] for h in reports if h["state"] == "dead"]
            held = holding_up(reports, late) if late and not dead else None
            if dead and rank not in dead:
                rank, cause = dead[0], f"actor died (then rank {rank}: {cause})"
            elif rank in dead:  # its channel or pipe said only that it closed
                cause = f"actor died ({cause})"
            elif held is not None:
                rank, why = held
                cause = f"{cause}; rank {rank} {why}"
        err = RankFailedError(rank, cause, operation)
        self._broken = err
        kill_actors(self._actors)  # survivors may wait in a collective for the dead rank: stop them too
        self._teardown_decoder()
        return err

    def _left_step(
        self, error: BaseException, running: Sequence[int], operation: str, undo: Callable[[], None]
    ) -> None:
        """The driver left a step with ``error`` (its caller re-raises it): while ``running`` ranks may
        still run the step (a ``KeyboardInterrupt`` after they were sent it) the pool breaks, since
        they may still read and write its rows and the next step would run beside them; before any
        rank was sent it, ``undo`` puts the ledger back. Nothing to do on a pool already broken."""
        if self._broken is not None:
            return
        if running:
            cause = (f"the driver was interrupted ({type(error).__name__}) while ranks {list(running)} ran the "
                     "step: they may still read and write its rows")  # fmt: skip
            self._fail(running[0], cause, operation, probe=False)
        else:
            undo()

    def _teardown_decoder(self) -> None:
        decoder, self._decoder = self._decoder, None
        if decoder is not None:
            decoder.teardown()

    def _call(self, operation: str, refs: Sequence[Any], *, ranks: Sequence[int] | None = None) -> list[Any]:
        """Wait for one call per rank; the first failure or the timeout raises :class:`RankFailedError`."""
        import ray

        ranks = list(range(len(refs))) if ranks is None else list(ranks)
        pending = dict(zip(refs, ranks))
        results: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout_s
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                missing = sorted(pending.values())
                cause = f"ranks {missing} did not answer within {self.timeout_s:g} s (hung or dead)"
                raise self._fail(missing[0], cause, operation, missing)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
                    raise self._fail(*blame(rank, e), operation) from None
        return [results[r] for r in ranks]

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def health(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """``{"state": "healthy" | "rank dead" | "rank unresponsive" | "broken" | "shut down", "error",
        "free_pages", "requests", "ranks": [...]}``; ``"rank dead"``: a rank's process is gone, so the
        next call raises :class:`~shardattn.serving.errors.RankFailedError` (and the pool is broken
        until :meth:`restart`); ``"rank unresponsive"``: a rank's actor did not answer within the wait
        (frozen, swapping, or its host unreachable): a step now would wait up to ``timeout_s`` for it,
        and break the pool if it still does not answer.

        Each rank reports ``state`` (``ready``; ``prefill`` / ``decode`` while a step runs, with
        ``step_running_s``; ``dead``, ``unresponsive``), ``rss_bytes``, ``cache_bytes``,
        ``workspace_bytes`` (CUDA: allocated / reserved bytes), ``steps``, ``last_step_s`` and
        ``collectives`` (entered so far: what names the rank a timed-out step waits for).
        Answers while a step runs (or is stuck); never raises for a dead rank.
        """
        wait = min(self.timeout_s, 10.0) if timeout_s is None else timeout_s
        ranks = rank_reports(self._actors, wait)
        book = getattr(self, "book", None)  # a pool formed without a spec keeps no ledger
        state = "broken" if self._broken is not None else "healthy" if self._actors else "shut down"
        if state == "healthy" and any(r.get("state") == "dead" for r in ranks):
            state = "rank dead"
        elif state == "healthy" and any(r.get("state") == "unresponsive" for r in ranks):
            state = "rank unresponsive"
        return {
            "state": state,
            "error": None if self._broken is None else str(self._broken),
            "free_pages": None if book is None else book.free_pages,
            "requests": None if book is None else len(book),
            "ranks": ranks,
        }

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``fn(group, *args, **kwargs)`` on every rank; the per-rank results, in rank order (between
        steps: its collectives would interleave with a step's)."""
        self._check_usable()
        with self._step_lock:
            return self._call("run", [a.run.remote(fn, args, kwargs) for a in self._actors])

    def arm_fault(self, rank: int, kind: str = "exit", operation: str = "decode") -> None:
        """Drill: make ``rank``'s next ``operation`` step (``"prefill"`` / ``"decode"``) fail (``kind``:
        ``"exit"``, ``"raise"`` or ``"hang"``). Raises ``ValueError`` / ``TypeError`` for a bad
        argument before any rank is called (the pool stays usable)."""
        self._check_usable()
        check_int("rank", rank, minimum=0, maximum=len(self._actors) - 1)
        check_fault(kind, operation)
        self._call("arm_fault", [self._actors[rank].arm_fault.remote(kind, operation)], ranks=[rank])
