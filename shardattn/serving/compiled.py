"""Per-step calls through a Ray compiled graph (``ray.dag`` + ``experimental_compile``).

A compiled graph replaces each step's task submissions and object-store round trips by
shared-memory channels set up once: the driver writes the step's payload to one channel, every
rank actor reads it, runs :meth:`~shardattn.serving.actor.RankActor.step` and writes its
result to its own channel, which cut a payload's round trip against actor calls on a two-H200
host (docs/DECISIONS.md, D44). The pool can send decode steps this way (their size is bounded by
``max_decode_tokens``, which sizes the channels); prefill steps, of unbounded size, and every
other call stay ordinary actor calls, which the actors still serve while the graph is compiled.

Failures: an exception on any rank, or a dead rank, surfaces on the driver's reads (Ray
propagates it to every output); :class:`CompiledSteps` names the rank from the error's actor id
and raises :class:`~shardattn.serving.errors.RankStepError`. A rank that does not answer in
time is named by the first output still missing. :attr:`CompiledSteps.running` names the ranks
that had not answered when the driver left a step (a ``KeyboardInterrupt``): the pool then breaks.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

from shardattn.serving.errors import RankStepError, describe_ray_error

__all__ = ["CompiledSteps", "channel_bytes"]


def channel_bytes(shapes: Any, heads_per_rank: int, v_dim: int, cache: Any) -> int:
    """Room for the largest decode payload (every rank's queries, top-k, new KV rows, block table)
    or one rank's result, twice over, plus 1 MiB (``shapes``: a ``PoolShapes``; ``cache``: a ``KVCacheConfig``)."""
    import torch

    t = shapes.max_decode_tokens
    elem = torch.empty(0, dtype=shapes.dtype).element_size()
    rows = sum(int(torch.Size(r).numel()) * torch.empty(0, dtype=d).element_size() for r, d in shapes.kv_rows)
    table = cache.pages_per_request * 4
    payload = t * (shapes.heads * shapes.head_dim * elem + shapes.topk * 4 + rows + table + 64)
    result = t * heads_per_rank * (v_dim * elem + 4)
    return 2 * max(payload, result) + (1 << 20)


class CompiledSteps:
    """One compiled graph over ``actors`` (rank order): ``payload -> [result of rank r]``.

    Args:
        actors: the rank actors (their ``step(payload)`` method is the graph's node).
        pids: their process ids (an exception raised in a compiled graph names only its process).
        buffer_bytes: size of each shared-memory channel (the largest payload or result).
    """

    def __init__(self, actors: Sequence[Any], pids: Sequence[int], buffer_bytes: int) -> None:
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as inp:
            dag = MultiOutputNode([a.step.bind(inp) for a in actors])
        self._ranks = {a._actor_id.hex(): r for r, a in enumerate(actors)}
        self._pids = {int(p): r for r, p in enumerate(pids)}
        self._dag: Any = dag.experimental_compile(_buffer_size_bytes=int(buffer_bytes))
        #: ranks sent the last step that have not answered it (empty once it is done): a step the
        #: driver left (interrupted) while these ranks may still run it
        self.running: list[int] = []

    def _rank_of(self, exc: BaseException, default: int) -> int:
        """The rank an error comes from: by actor id (a dead actor) or process id (an exception)."""
        actor_id = getattr(exc, "actor_id", None)
        if isinstance(actor_id, bytes):
            actor_id = actor_id.hex()
        if isinstance(actor_id, str) and actor_id in self._ranks:
            return self._ranks[actor_id]
        pid = getattr(exc, "pid", None)
        if pid is None:
            found = re.search(r"pid=(\d+)", str(exc))
            pid = int(found.group(1)) if found else None
        return self._pids.get(int(pid), default) if pid is not None else default

    def run(self, payload: Any, timeout_s: float) -> list[Any]:
        """Execute once; the per-rank results, or :class:`RankStepError` (first failure or timeout)."""
        import ray

        deadline = time.monotonic() + timeout_s
        self.running = list(range(len(self._ranks)))  # the payload may reach the ranks from here on
        try:
            refs = self._dag.execute(payload)
        except ray.exceptions.RayError as e:
            raise RankStepError(self._rank_of(e, 0), describe_ray_error(e)) from None
        results = []
        for r, ref in enumerate(refs):
            try:
                results.append(ray.get(ref, timeout=max(1e-3, deadline - time.monotonic())))
            except (TimeoutError, ray.exceptions.GetTimeoutError):
                late = list(range(r, len(refs)))  # from the first unanswered (later ones may have answered)
                raise RankStepError(
                    r, f"ranks {late} did not answer within {timeout_s:g} s (hung or dead)", late
                ) from None
            except ray.exceptions.RayError as e:
                raise RankStepError(self._rank_of(e, r), describe_ray_error(e)) from None
            self.running = list(range(r + 1, len(refs)))
        return results

    def teardown(self) -> None:
        """Release the channels (best effort: after a failure the actors may be gone)."""
        dag, self._dag = self._dag, None
        if dag is not None:
            try:
                dag.teardown()
            except Exception:
                pass
