"""Asking the pool's rank actors how they are, in their own concurrency group (so a rank answers
while a step runs, or is stuck in a collective)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shardattn.serving.errors import describe_ray_error

__all__ = ["HEALTH_GROUP", "holding_up", "rank_reports"]

#: the actors' concurrency group of :meth:`~shardattn.serving.actor.RankActor.health`
HEALTH_GROUP = "health"


def rank_reports(actors: Sequence[Any], wait_s: float) -> list[dict[str, Any]]:
    """Each rank's :meth:`~shardattn.serving.actor.RankActor.health` report, or
    ``{"rank", "state": "dead" | "unresponsive", "cause"}`` when its actor is gone or silent for ``wait_s``."""
    import ray

    refs = [a.health.options(concurrency_group=HEALTH_GROUP).remote() for a in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s) if refs else ([], [])
    reports: list[dict[str, Any]] = []
    for r, ref in enumerate(refs):
        if ref not in ready:
            reports.append({"rank": r, "state": "unresponsive", "cause": f"no answer within {wait_s:g} s"})
            continue
        try:
            reports.append(ray.get(ref))
        except ray.exceptions.RayError as e:
            reports.append({"rank": r, "state": "dead", "cause": describe_ray_error(e)})
    return reports


def holding_up(reports: Sequence[dict[str, Any]], late: Sequence[int]) -> tuple[int, str] | None:
    """Which of the ``late`` ranks (a step's call timed out waiting for them) the others wait for,
    and why, from their health ``reports``: among the late ranks that answered, the one that entered
    the fewest collectives (the others have queued more: a hung rank that stopped short of a
    collective leaves its peers waiting in it); where those counts are level, a late rank whose
    health check went unanswered too (a rank waiting in a collective still answers). ``None`` where
    nothing sets one apart (a hang inside a collective every rank entered, or collectives replayed
    in a CUDA graph, which the counts do not see).

    >>> reports = [{"rank": 0, "state": "decode", "collectives": 9}, {"rank": 1, "state": "decode", "collectives": 8}]
    >>> holding_up(reports, [0, 1])
    (1, 'entered 8 collectives, the fewest; ranks [0] entered [9] and wait in a collective for it')
    """
    by_rank = {h["rank"]: h for h in reports}
    counts = {r: int(by_rank[r]["collectives"]) for r in late if by_rank.get(r, {}).get("collectives") is not None}
    silent = [r for r in late if by_rank.get(r, {}).get("state") == "unresponsive"]
    if len(set(counts.values())) > 1:
        low = min(counts.values())
        fewest = [r for r in late if counts.get(r) == low]
        ahead = [r for r in late if counts.get(r, low) > low]
        tied = f" (as did ranks {fewest[1:]})" if len(fewest) > 1 else ""
        why = f"entered {low} collectives, the fewest{tied}; ranks {ahead} entered {[counts[r] for r in ahead]}"
        return fewest[0], f"{why} and wait in a collective for it"
    if silent and counts:
        return silent[0], f"did not answer its health check either (ranks {sorted(counts)} did)"
    return None
