"""Asking the pool's rank actors how they are, in their own concurrency group (so a rank answers
while a step runs, or is stuck in a collective)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shardattn.serving.errors import describe_ray_error

__all__ = ["HEALTH_GROUP", "rank_reports"]

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
