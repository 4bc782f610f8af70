"""Measure whole prefill steps of every path in one run: kernel alone, head-TP, ShardQ, the router's.

:func:`measure_paths` builds the launcher's synthetic step (the same on every rank, from one
seed), then times on every rank, in this order and with the ranks starting each call together:

* the kernel alone, as ShardQ runs it (all heads, this rank's zigzag tokens) and as head-TP runs
  it (this rank's heads, every token);
* the head-TP step (a ``headtp`` Runtime), the ShardQ step (a ``shardq`` Runtime routed by the
  gate only) and the router's step (a ``mixed`` Runtime routed by the cost model);

and returns the times with the cost model's prediction of each path. Each path's first output is
checked against the fp32 reference (:func:`check_output`) before it is timed. The calibration fits step
overheads from these; ``benchmarks/scaling.py`` reports them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch
import torch.distributed as dist

from shardattn.calibrate.timing import median_ms
from shardattn.launch.workloads import build_prefill
from shardattn.ops.sparse_mla import sparse_mla_reference
from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill
from shardattn.parallel.comm import Comm
from shardattn.plan.cost import CostModel
from shardattn.plan.spec import ModelSpec
from shardattn.plan.step_shape import StepShape
from shardattn.runtime.options import PrefillOptions
from shardattn.runtime.runtime import PrefillPlan, Runtime

__all__ = ["MIN_SHARD_TOKENS", "PATHS", "check_output", "fail_together", "measure_paths", "path_name"]

PATHS = ("kernel", "kernel_headtp", "headtp", "shardq", "router")
MIN_SHARD_TOKENS = 1024
"""The ShardQ gate of the measured Runtimes (``min_shard_tokens``): a step of fewer tokens runs head-TP."""
CHECK_TOKENS = 16
"""Tokens of each path's first output compared with the fp32 reference before the path is timed."""
CHECK_TOLERANCE = 2e-2
"""Largest relative error (Frobenius) of a measured path against the fp32 reference (bf16: ~2e-3)."""


def path_name(plan: PrefillPlan) -> str:
    """``"<step>/<kernel>[ G=g]"`` of a plan (the cost model's names)."""
    r = plan.route
    return f"{plan.step}/{r.path}" + (f" G={r.group_size}" if r.group_size > 1 else "")


def measure_paths(
    group: dist.ProcessGroup,
    spec: ModelSpec,
    *,
    tokens: int,
    requests: int,
    cached: int,
    device: torch.device,
    model: CostModel,
    reps: int,
    warmup: int = 2,
    paths: tuple[str, ...] = PATHS,
    min_shard_tokens: int = MIN_SHARD_TOKENS,
    min_group_tokens: int = 1024,
    seed: int = 0,
    host_id: str | None = None,
) -> dict[str, Any]:
    """Time the ``paths`` of one configuration on this rank (module docstring).

    Returns:
        ``{"ms": {path: median ms}, "predicted_ms": {path: ms}, "path": {path: name},
        "reason": {path: route reason}, "rank_tokens": int}``; collective steps are timed on
        every rank together, so each rank's numbers are that rank's view of the same steps.
        ``host_id``: this rank's host identity for the Runtimes (a launcher's node rank), so the
        predictions price exchanges between hosts as the router does.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dtype = getattr(torch, spec.dtype)
    step = build_prefill(
        heads=spec.num_heads,
        head_dim=spec.head_dim,
        tokens=tokens,
        requests=requests,
        cached=(cached,) * requests,
        topk=spec.topk,
        overlap="dsa",
        dtype=dtype,
        device=device,
        seed=seed,
        block_size=spec.page_size,
    )
    h = spec.num_heads // world
    q_local = step.q[:, rank * h : (rank + 1) * h].contiguous()
    kv_rows = int(step.kv.shape[0])
    gates = PrefillOptions(min_shard_tokens=min_shard_tokens, min_group_tokens=min_group_tokens)

    def runtime(mode: str, options: PrefillOptions) -> Runtime:
        return Runtime(
            spec, group, mode=mode, max_batched_tokens=tokens, device=device, topk=spec.topk, prefill_options=options,
            warmup=False, host_id=host_id,
        )  # fmt: skip

    runtimes = {
        "headtp": lambda: runtime("headtp", gates),
        "shardq": lambda: runtime("shardq", dataclasses.replace(gates, cost_model=None)),
        "router": lambda: runtime("mixed", dataclasses.replace(gates, cost_model=model)),
    }
    res: dict[str, Any] = {"ms": {}, "predicted_ms": {}, "path": {}, "reason": {}, "ranks_per_node": world}
    plans: dict[str, PrefillPlan] = {}
    for name in ("shardq", "headtp", "router"):
        if name == "router" and name not in paths:
            continue
        rt = runtimes[name]()
        plan = rt.plan_prefill(step.query_lens, step.prefix_lens, kv_rows=kv_rows)
        plans[name] = plan
        res["ranks_per_node"] = rt.nodes.ranks_per_node
        if name in paths:
            first = rt.prefill(q_local, step.kv, step.rows, plan=plan, check=True)  # ranks agree on the plan once
            check_output(f"the {path_name(plan)} step", first[0], q_local, step.kv, step.rows, spec, group)

            def call(rt: Runtime = rt, plan: PrefillPlan = plan) -> None:
                rt.prefill(q_local, step.kv, step.rows, plan=plan, check=False)

            res["ms"][name] = median_ms(call, device=device, reps=reps, warmup=warmup, group=group)
            res["path"][name] = path_name(plan)
            res["reason"][name] = plan.route.reason
        del rt
    sq = plans["shardq"]
    ids = sq.tokens_of(rank).to(device)
    res["rank_tokens"] = int(sq.token_plan.counts.max()) if sq.token_plan is not None else tokens
    kernels = {
        "kernel": (step.q[ids].contiguous() if sq.step == "shardq" else q_local, step.rows[ids], sq),
        "kernel_headtp": (q_local, step.rows, plans["headtp"]),
    }
    for name, (q, rows, plan) in kernels.items():
        if name not in paths:
            continue

        def kcall(
            q: torch.Tensor = q, rows: torch.Tensor = rows, g: int = plan.route.group_size
        ) -> tuple[torch.Tensor, torch.Tensor]:
            scale = cast(float, spec.softmax_scale)
            return sparse_mla_grouped_prefill(q, step.kv, rows, scale=scale, v_dim=spec.v_dim, group_size=g)

        check_output(f"the kernel alone ({path_name(plan)})", kcall()[0], q, step.kv, rows, spec, group)
        res["ms"][name] = median_ms(kcall, device=device, reps=reps, warmup=warmup)
        res["path"][name] = f"kernel ({path_name(plan)})"
    shape = StepShape.of(spec, world, tokens, rank_tokens=res["rank_tokens"], ranks_per_node=res["ranks_per_node"])
    for name, plan in (*plans.items(), ("kernel", sq), ("kernel_headtp", plans["headtp"])):
        if name not in paths:
            continue
        p = model.predict_step(shape, plan.step, plan.route.group_size)
        res["predicted_ms"][name] = p.kernel_ms if name.startswith("kernel") else p.ms
    return res


def check_output(
    what: str,
    out: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    spec: ModelSpec,
    group: dist.ProcessGroup,
) -> None:
    """Compare :data:`CHECK_TOKENS` sampled tokens of a path's first output with the fp32 reference
    before it is timed; every rank raises ``RuntimeError`` when one rank's relative error is not
    below :data:`CHECK_TOLERANCE` or its check raised (:func:`fail_together`: none is left waiting
    in a collective).

    Args:
        out: ``[T, h, v_dim]`` the path's output for ``q [T, h, D]`` over ``rows [T, K]`` of ``kv [R, D]``.
    """
    failure = None
    try:
        t = q.shape[0]
        err = 0.0
        if t:
            sample = torch.randperm(t, generator=torch.Generator().manual_seed(t))[:CHECK_TOKENS].to(q.device)
            ref, _ = sparse_mla_reference(q[sample].float(), kv, rows[sample], scale=cast(float, spec.softmax_scale),
                                          v_dim=spec.v_dim)  # fmt: skip
            diff, norm = (out[sample].float() - ref).norm(), ref.norm()
            err = float(diff / norm) if float(norm) > 0 else float(diff)
        if not err < CHECK_TOLERANCE:  # NaN too
            failure = f"relative error {err:.3g} against the fp32 reference (tolerance {CHECK_TOLERANCE})"
    except Exception as exc:  # this rank alone: the others learn of it below instead of waiting
        failure = f"the check against the fp32 reference raised {type(exc).__name__}: {exc}"
    elsewhere = f"{what}: another rank's output failed its check against the fp32 reference; nothing timed"
    fail_together(f"{what}: {failure}; nothing timed" if failure else None, group, elsewhere)


def fail_together(message: str | None, group: dist.ProcessGroup, elsewhere: str) -> None:
    """Every rank of ``group`` raises ``RuntimeError`` when any rank's ``message`` is not ``None``
    (its own message, or ``elsewhere`` on the ranks whose check passed); one all-reduce, which
    every rank must reach."""
    flag = torch.tensor([0 if message is None else 1], dtype=torch.int32, device=Comm(group).device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if int(flag):
        raise RuntimeError(message or elsewhere)


def with_heads(spec: ModelSpec, heads: int | None) -> ModelSpec:
    """``spec`` with ``heads`` query heads (``None``: unchanged)."""
    return spec if heads is None else dataclasses.replace(spec, num_heads=heads)
