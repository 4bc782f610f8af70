"""The Runtime's prefill step: the plan of one step and its dispatch to the mode's parallel step.

:class:`PrefillPlan` is what :meth:`Runtime.plan_prefill <shardattn.runtime.runtime.Runtime.plan_prefill>`
returns (plan once per step, run it for every layer); :func:`run_prefill_step` runs one layer of
it: PCP (:func:`~shardattn.parallel.pcp.pcp_prefill`), head-TP (the kernel on this rank's heads,
nothing moves) or ShardQ (:func:`~shardattn.parallel.shardq.shardq_prefill`, its receive and
send buffers carved from the Runtime's workspace: :func:`shardq_buffers`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardattn.parallel.comm import Comm
from shardattn.parallel.pcp import pcp_prefill
from shardattn.parallel.shardq import shardq_prefill
from shardattn.plan.routing import Route
from shardattn.plan.spec import ModelSpec
from shardattn.plan.zigzag import ShardPlan

__all__ = ["PrefillPlan", "run_prefill_step", "shardq_buffers"]

#: ``shardq_prefill`` workspace key -> the Runtime's workspace item (``prefill.<item>``).
SHARDQ_BUFFERS = (
    ("q", "packed_q"),
    ("out", "out"),
    ("lse", "lse"),
    ("rows", "topk_rows"),
    ("union", "union"),
    ("lens", "union_offsets"),
)


@dataclass(frozen=True)
class PrefillPlan:
    """How one prefill step runs: the step, the planner's route and the token split.

    Attributes:
        step: ``"shardq"``, ``"headtp"`` (also ShardQ steps below the gate) or ``"pcp"``.
        route: the planner's :class:`~shardattn.plan.routing.Route` for this rank's kernel call.
        shard: the token split (:class:`~shardattn.plan.zigzag.ShardPlan`, or a
            :class:`~shardattn.plan.pcp.PCPPlan` under PCP); ``None`` for a head-TP mode.
        num_tokens: new tokens of the step.
    """

    step: str
    route: Route
    shard: Any
    num_tokens: int

    @property
    def token_plan(self) -> ShardPlan | None:
        """The zigzag split (under PCP: the PCP plan's), or ``None``."""
        return getattr(self.shard, "shard", self.shard)

    def tokens_of(self, rank: int) -> torch.Tensor:
        """``[n]`` int64 token ids (token order) whose queries ``rank``'s kernel runs."""
        plan = self.token_plan
        if plan is None or not plan.sharded:
            return torch.arange(self.num_tokens)
        return plan.token_ids(rank)


def shardq_buffers(workspace: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The ShardQ receive / send buffers, rank rows and union among a Runtime's workspace items
    (``{"q", "out", "lse", "rows", "union", "lens"}``)."""
    return {key: workspace[f"prefill.{item}"] for key, item in SHARDQ_BUFFERS if f"prefill.{item}" in workspace}


def run_prefill_step(
    plan: PrefillPlan,
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    *,
    comm: Comm,
    spec: ModelSpec,
    scale: float,
    attention: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    local_sinks: torch.Tensor | None,
    shardq_workspace: dict[str, torch.Tensor],
    chunks: int | None,
    taper: bool,
    one_union: bool,
    topk_length: torch.Tensor | None,
    sinks: torch.Tensor | None,
    kv_cache: torch.Tensor | None,
    block_table: torch.Tensor | None,
    check: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer of a planned prefill step (arguments as :meth:`Runtime.prefill
    <shardattn.runtime.runtime.Runtime.prefill>`; ``attention`` is the Runtime's kernel call on
    the plan's route, ``local_sinks`` the rank's heads of ``sinks``, ``chunks`` / ``taper`` /
    ``one_union`` the ShardQ pipeline's depth, chunk shape and union build). Returns ``(out, lse)``."""
    v = spec.v_dim
    if plan.step == "pcp":
        return pcp_prefill(
            q, kv, rows, plan.shard, comm, scale=scale, v_dim=v, kv_cache=kv_cache, block_table=block_table,
            block_size=spec.page_size if kv_cache is not None else None, topk_length=topk_length, sinks=sinks,
            attention=attention, check=check,
        )  # fmt: skip
    if plan.shard is None:  # a head-TP mode: nothing moves
        return attention(q, kv, rows, scale=scale, v_dim=v, topk_length=topk_length, sinks=local_sinks, return_lse=True)
    return shardq_prefill(
        q, kv, rows, plan.shard, comm, scale=scale, v_dim=v, topk_length=topk_length, sinks=sinks,
        attention=attention, check=check, chunks=chunks, taper=taper, align=plan.route.group_size,
        one_union=one_union, workspace=shardq_workspace,
    )  # fmt: skip
