"""A placement group with one bundle per rank, reserved within a timeout that names what is missing,
and released; the pool's actors stopped.

``STRICT_PACK`` (the default) puts every bundle on one node, so NCCL ranks share a host and its
NVLink; ``PACK``, ``SPREAD`` and ``STRICT_SPREAD`` are Ray's other strategies. Rank ``r`` runs in
bundle ``r`` (:func:`bundle_options`).
"""

from __future__ import annotations

import math
from typing import Any

from shardattn._checks import check_choice, check_positive
from shardattn.serving.errors import PlacementTimeoutError

__all__ = ["STRATEGIES", "bundle_options", "check_placement", "kill_actors", "release_bundles", "reserve_bundles"]

STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")


def _describe_missing(bundle: dict[str, float], count: int, strategy: str) -> str:
    import ray

    total, free = ray.cluster_resources(), ray.available_resources()
    parts = []
    for name, amount in bundle.items():
        need = amount * count
        have, avail = total.get(name, 0.0), free.get(name, 0.0)
        if avail < need:
            parts.append(f"{name}: need {need:g}, {avail:g} free of {have:g} in the cluster")
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if strategy == "STRICT_PACK" and not parts:
        best: dict[str, float] = max(
            (n.get("Resources", {}) for n in nodes), key=lambda r: r.get("GPU", 0) + r.get("CPU", 0), default={}
        )
        parts.append(f"no single node holds {count} x {bundle} (STRICT_PACK); largest node has {best}")
    return "; ".join(parts) or f"{len(nodes)} alive nodes, resources {free}"


def check_placement(strategy: object, timeout_s: object, placement_timeout_s: object, num_cpus: object) -> None:
    """A pool's placement arguments, before Ray starts: a strategy of :data:`STRATEGIES`, finite
    timeouts > 0 (``placement_timeout_s`` may be ``None``) and CPUs per bundle >= 0 (0: a GPU
    pool's bundles reserve none; a CPU pool's need some, checked once its device is known)."""
    check_choice("placement_strategy", strategy, STRATEGIES)
    check_positive("timeout_s", timeout_s)
    if placement_timeout_s is not None:
        check_positive("placement_timeout_s", placement_timeout_s)
    if isinstance(num_cpus, bool) or not isinstance(num_cpus, int | float):
        raise TypeError(f"num_cpus must be a number, got {type(num_cpus).__name__}")
    if not (math.isfinite(num_cpus) and num_cpus >= 0):
        raise ValueError(f"num_cpus must be a finite number >= 0, got {num_cpus!r}")


def reserve_bundles(count: int, bundle: dict[str, float], *, strategy: str, timeout_s: float) -> Any:
    """Create a placement group of ``count`` copies of ``bundle`` and wait until it is ready.

    Raises:
        ValueError: unknown strategy. PlacementTimeoutError: not ready within ``timeout_s``;
        the message says which resources are short (the group is removed).
    """
    from ray.util.placement_group import placement_group, remove_placement_group

    if strategy not in STRATEGIES:
        raise ValueError(f"placement strategy must be one of {STRATEGIES}, got {strategy!r}")
    pg = placement_group([dict(bundle) for _ in range(count)], strategy=strategy)
    if not pg.wait(timeout_seconds=timeout_s):
        missing = _describe_missing(bundle, count, strategy)
        remove_placement_group(pg)
        raise PlacementTimeoutError(
            f"placement group of {count} bundles {bundle} ({strategy}) not ready after {timeout_s:g} s: {missing}"
        )
    return pg


def bundle_options(pg: Any, rank: int) -> dict[str, Any]:
    """``actor.options(**bundle_options(pg, r))`` pins rank ``r`` to bundle ``r``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=rank, placement_group_capture_child_tasks=False
        )
    }


def release_bundles(pg: Any) -> None:
    """Free a placement group's bundles (an error from Ray, e.g. a group already gone, is ignored)."""
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(pg)
    except Exception:
        pass


def kill_actors(actors: list[Any]) -> None:
    """Stop actors at once, never to restart (those already dead are skipped quietly)."""
    import ray

    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:
            pass
