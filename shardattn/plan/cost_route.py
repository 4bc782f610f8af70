"""The Runtime's cost-model router: head-TP or ShardQ, and which kernel group size, per prefill step.

In the ``shardq`` and ``mixed`` modes a step above the ShardQ gate can still run head-TP (every
rank holds every token's q for its heads already). :func:`cost_route` asks the
:class:`~shardattn.plan.cost.CostModel` which is faster for the step's sizes and returns the step
and this rank's kernel :class:`~shardattn.plan.routing.Route`, whose reason names the predicted
ms of the chosen and of the best rejected path. The choice depends only on values every rank
shares (total tokens, the largest rank share, the config, the hosts the ranks run on:
``rt.nodes``), so every rank takes the same step. A group spread over several hosts prices
ShardQ's all-to-alls at the network's rate for the bytes that leave a host.

Kernel group sizes are limited to the variants the Runtime warms up (per-query, and the grouped
``G`` of :func:`~shardattn.plan.routing.prefill_group_size` where there is one), so a routed step
never compiles.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from shardattn.plan.cost import CostModel, load_calibration
from shardattn.plan.cost_choice import choose_prefill
from shardattn.plan.routing import MAX_GROUPED_KV_ROWS, Route, prefill_group_size
from shardattn.plan.spec import ModelSpec
from shardattn.plan.step_shape import StepShape

__all__ = ["cost_route", "resolve_cost_model"]


def resolve_cost_model(cost_model: CostModel | str | Path | None, device: torch.device) -> CostModel | None:
    """The Runtime's ``cost_model`` argument as a model (or ``None``: gate-only routing).

    ``"auto"``: on a CUDA device, the table shipped for the GPU (else the conservative default,
    with a :class:`~shardattn.plan.cost.CalibrationWarning`); on the CPU, ``None`` (the torch
    reference has no calibrated rates; pass a :class:`CostModel` to route CPU steps by one).
    A path: that calibration file (a bad or foreign file warns and falls back, never raises).
    """
    if cost_model is None or isinstance(cost_model, CostModel):
        return cost_model
    if not isinstance(cost_model, (str, Path)):
        raise TypeError(f"cost_model must be a CostModel, 'auto', a calibration file or None, got {cost_model!r}")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    if cost_model == "auto":
        return CostModel(load_calibration(gpu)) if gpu is not None else None
    return CostModel(load_calibration(gpu, cost_model))


def _groups(
    heads: int, tokens: int, kv_rows: int, device: torch.device, min_group_tokens: int, gluon: bool = False
) -> tuple[int, ...]:
    """Group sizes a kernel call may take: 1, and the warmed grouped ``G`` when grouping is possible
    (``gluon``: the grouped Gluon kernel's ``G``, sm_90)."""
    g = prefill_group_size(heads, gluon=gluon)
    ok = device.type == "cuda" and kv_rows < MAX_GROUPED_KV_ROWS and tokens >= min_group_tokens
    return (1, g) if g is not None and ok else (1,)


def cost_route(rt: Any, *, tokens: int, counts: Any, kv_rows: int) -> tuple[str, Route]:
    """``(step, route)`` of a prefill step that the ShardQ gate let through.

    Args:
        rt: the :class:`~shardattn.runtime.runtime.Runtime` (its cost model, spec, group size,
            rank, device, top-k and gates are read). tokens: new tokens of the step.
        counts: ``[W]`` tokens per rank under ShardQ (the zigzag plan's).
        kv_rows: rows the top-k addresses (the grouped path needs ``< 2^24 - 1``).
    """
    model: CostModel = rt.cost_model
    spec: ModelSpec = rt.spec
    device: torch.device = rt.device
    counts = [int(c) for c in counts]
    h_tp = spec.num_heads // rt.world_size
    shape = StepShape.of(
        spec,
        rt.world_size,
        tokens,
        topk=rt.topk,
        rank_tokens=max(counts),
        ranks_per_node=rt.nodes.ranks_per_node,
        kv_format=rt.kv_format,
    )
    gate = rt.min_group_tokens
    allowed = {
        "headtp": _groups(h_tp, tokens, kv_rows, device, gate, rt.gluon),
        "shardq": _groups(spec.num_heads, max(counts), kv_rows, device, gate, rt.gluon),
    }
    choice = choose_prefill(model, shape, min_shard_tokens=rt.min_shard_tokens, allowed_groups=allowed)
    best = choice.best
    if device.type != "cuda":
        return best.step, Route("reference", 1, f"{choice.reason}; no GPU: torch reference kernel")
    # ShardQ's group size is also the chunk alignment every rank cuts alike: the smallest rank's
    # count decides it on every rank
    mine = tokens if best.step == "headtp" else min(counts)
    heads = h_tp if best.step == "headtp" else spec.num_heads
    g = best.group_size
    if g > 1 and g not in _groups(heads, mine, kv_rows, device, gate, rt.gluon):
        where = "tokens" if best.step == "headtp" else "tokens on the smallest rank"
        return best.step, Route("per-query", 1, f"{choice.reason}; {mine} {where}: per-query")
    return best.step, Route("grouped" if g > 1 else "per-query", g, choice.reason)
