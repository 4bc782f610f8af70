"""The planning side of a Runtime: its steps' routes and token splits, and a prefill's arguments
checked against its plan.

:class:`RuntimePlanning` is a part of :class:`~shardattn.runtime.runtime.Runtime` (it reads the
Runtime's spec, mode, group, sizes, options and workspace), as
:class:`~shardattn.runtime.graphs.RuntimeGraphs` and :class:`~shardattn.runtime.warmup.RuntimeWarmup`
are: :meth:`RuntimePlanning.plan_prefill` routes a prefill step (the planner's
:func:`~shardattn.plan.routing.route_prefill`, the cost model's
:func:`~shardattn.plan.cost_route.cost_route`) and splits its tokens;
:attr:`RuntimePlanning.decode_route` is the planner's route of every decode step. Both decisions
are logged at debug level on this module's logger (``shardattn.runtime.planning``, a child of
``shardattn``; the library configures no handler).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch

from shardattn._checks import check_int, check_sink_logits, check_tensor
from shardattn.kernels import fa4
from shardattn.ops.gqa_prefill import segment_kernel
from shardattn.ops.gqa_prefill_kernels import SegmentKernel, TorchSegmentKernel
from shardattn.parallel.agreement import Fingerprint
from shardattn.plan.cost_route import cost_route
from shardattn.plan.decode_routing import route_decode
from shardattn.plan.kv_format import KV_FP8_DS_MLA
from shardattn.plan.pcp import pcp_plan
from shardattn.plan.routing import MAX_GROUPED_KV_ROWS, Route, route_prefill
from shardattn.plan.zigzag import zigzag_split
from shardattn.runtime.args import check_sinks_declared, check_topk_unique, prefill_lengths, reject
from shardattn.runtime.gqa_prefill import GQAInputs, check_gqa_prefill_inputs, plan_gqa_step
from shardattn.runtime.modes import prefill_step_of
from shardattn.runtime.prefill import PCPInputs, PrefillPlan, RowInputs, check_prefill_inputs
from shardattn.runtime.state import RuntimeState

__all__ = ["RuntimePlanning"]

log = logging.getLogger(__name__)


class RuntimePlanning(RuntimeState):
    """Routing and planning of a Runtime's steps (mixed into it; no state but the cached decode route)."""

    def _route(self, heads: int, tokens: int, kv_rows: int) -> Route:
        route = route_prefill(
            heads,
            num_tokens=tokens,
            kv_rows=kv_rows,
            device_type=self.device,
            min_tokens=self.min_group_tokens,
            gluon=self.gluon,
        )
        return self._name_kv_format(route)

    def _name_kv_format(self, route: Route) -> Route:
        """``route`` with the KV format named in its reason when the cache holds ``fp8_ds_mla`` rows."""
        if self.kv_format != KV_FP8_DS_MLA:
            return route
        return Route(route.path, route.group_size, f"{route.reason}; {KV_FP8_DS_MLA} KV rows")

    def plan_prefill(
        self,
        query_lens: Sequence[int] | torch.Tensor,
        prefix_lens: Sequence[int] | torch.Tensor | None = None,
        *,
        seq_lens: Sequence[int] | torch.Tensor | None = None,
        kv_rows: int | None = None,
    ) -> PrefillPlan:
        """Route a prefill step and split its tokens (host-side; the same on every rank).

        Args:
            query_lens: ``[B]`` new tokens per request (a list, or a tensor read on the host).
            prefix_lens: ``[B]`` tokens of each request already cached (default 0), or
            seq_lens: ``[B]`` KV tokens per request including the cached prefix (vLLM's
                ``seq_lens``; ``prefix_lens = seq_lens - query_lens``). Pass one of the two.
            kv_rows: rows of the KV cache the step's top-k addresses (default ``max_kv_rows``).
        Raises:
            ValueError: the mode has no prefill, lengths that disagree;
            WorkspaceExceededError: the step is too large.
        """
        step = prefill_step_of(self.spec.kind, self.mode)
        if step is None:
            raise ValueError(f"mode {self.mode!r} with a {self.spec.kind} spec has no prefill step")
        lens, prefix = prefill_lengths(query_lens, prefix_lens, seq_lens)
        tokens = sum(lens)
        if self.spec.kind == "gqa":
            return self._plan_gqa(step, lens, prefix, tokens)
        rows = self.max_kv_rows if kv_rows is None else check_int("kv_rows", kv_rows, minimum=0)
        shard: Any = None
        route: Route | None = None
        gated = None  # why a ShardQ mode's step runs head-TP without asking the cost model
        if step == "shardq" and not self.ws.shardq_possible:  # one rank, or the gate above every step
            step, gated = "headtp", "one rank: head-TP"
            if self.world_size > 1:
                gated = f"min_tokens={self.min_shard_tokens} > max_batched_tokens={self.max_batched_tokens}: head-TP"
        if step == "shardq":
            gate = self.min_shard_tokens
            shard = zigzag_split(lens, self.world_size, min_tokens=gate, prefix_lens=prefix, topk=self.topk)
            if not shard.sharded:
                step, gated = "headtp", f"{tokens} new tokens < min_tokens={gate}: head-TP"
            elif self.cost_model is not None:  # the fastest predicted of ShardQ and head-TP
                step, route = cost_route(self, tokens=tokens, counts=shard.counts.tolist(), kv_rows=rows)
                route = self._name_kv_format(route)
                shard = shard if step == "shardq" else None
        elif step == "pcp":
            shard = pcp_plan(lens, self.world_size, prefix_lens=prefix, topk=self.topk)
        if route is None and step == "headtp":
            route = self._route(self.heads_per_rank, tokens, rows)
            route = route if gated is None else Route(route.path, route.group_size, f"{gated}; {route.reason}")
        elif route is None and step == "shardq":
            # every head over each rank's own tokens; the group size is also the chunk alignment
            # every rank cuts alike, so the route follows the smallest rank's count on every rank
            route = self._route(self.spec.num_heads, int(min(shard.counts)), rows)
        elif route is None:  # PCP: this rank's kernel runs every head over its own tokens
            plan = getattr(shard, "shard", shard)
            route = self._route(self.spec.num_heads, int(plan.counts[self.rank]), rows)
        self.ws.check("prefill", step, tokens=tokens)
        log.debug("prefill of %d tokens over %d requests: %s, %s G=%d: %s", tokens, len(lens), step, route.path,
                  route.group_size, route.reason)  # fmt: skip
        return PrefillPlan(step, route, shard, tokens, made_for=self._plan_config)

    @functools.cached_property
    def gqa_prefill_route(self) -> Route:
        """The route of this Runtime's GQA prefill kernel calls (``fa4`` where FA4 runs the spec's
        dtype and head dim on the device, else the torch reference), with the reason; fixed per config."""
        why = fa4.fa4_unsupported_reason(self.device, getattr(torch, self.spec.dtype), self.spec.head_dim)
        if why is None:
            launch = fa4.fast_launch_support()[1]
            route = Route("fa4", 1, f"FA4 (flash-attn-cute) on {self.device}, head_dim {self.spec.head_dim}; {launch}")
        else:
            route = Route("reference", 1, f"{why}: torch reference")
        log.debug("GQA prefill calls: %s: %s", route.path, route.reason)
        return route

    @functools.cached_property
    def gqa_kernel(self) -> SegmentKernel:
        """The kernel implementation of this Runtime's GQA prefill calls (one object: it keeps the
        page table it derived from the last block table); FA4 with the fast launch where its guard
        passes (:func:`~shardattn.kernels.fa4.fast_launch_support`, named in the route's reason)."""
        route = self.gqa_prefill_route
        return segment_kernel(route, private=fa4.fast_launch_support()[0] if route.path == "fa4" else None)

    def gqa_kernel_for(self, dtype: torch.dtype) -> SegmentKernel:
        """The kernel of a GQA prefill call whose queries are ``dtype``: :attr:`gqa_kernel`, or the
        torch reference where that is FA4 and FA4 does not run ``dtype`` (fp32: a step in another
        dtype than the spec's, as :func:`~shardattn.ops.gqa_prefill.gqa_prefill` routes it)."""
        if self.gqa_prefill_route.path == "fa4" and dtype not in fa4.FA4_DTYPES:
            return TorchSegmentKernel()
        return self.gqa_kernel

    def _plan_gqa(self, step: str, lens: list[int], prefix: list[int] | None, tokens: int) -> PrefillPlan:
        shard = pcp_plan(lens, self.world_size, prefix_lens=prefix) if step == "pcp" else None
        self.ws.check("prefill", step, tokens=tokens)
        gqa = plan_gqa_step(lens, prefix, self.device, shard=shard, rank=self.rank)
        route = self.gqa_prefill_route
        log.debug("GQA prefill of %d tokens over %d requests: %s, %s: %s", tokens, len(lens), step, route.path,
                  route.reason)  # fmt: skip
        return PrefillPlan(step, route, shard, tokens, gqa, made_for=self._plan_config)

    @functools.cached_property
    def _plan_config(self) -> str:
        """This Runtime's configuration as its prefill plans record it (:attr:`PrefillPlan.made_for`)."""
        spec, mode = self.spec, self.mode
        return f"a {spec.kind} model of {spec.num_heads} heads, mode {mode!r}, rank {self.rank} of {self.world_size}"

    def _prefill_inputs(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor | None,
        rows: torch.Tensor | None,
        *,
        topk_pos: torch.Tensor | None,
        kv_new: torch.Tensor | None,
        block_table: torch.Tensor | None,
        query_lens: Sequence[int] | torch.Tensor | None,
        prefix_lens: Sequence[int] | torch.Tensor | None,
        seq_lens: Sequence[int] | torch.Tensor | None,
        plan: PrefillPlan | None,
        topk_length: torch.Tensor | None,
        check: bool,
        window_left: object = -1,
        sinks: object = None,
        topk_unique: object = False,
    ) -> tuple[PrefillPlan, RowInputs | PCPInputs | GQAInputs]:
        """The plan of a :meth:`Runtime.prefill <shardattn.runtime.runtime.Runtime.prefill>` call
        (``plan``, or planned from the lengths) and its checked, converted tensors
        (:func:`~shardattn.runtime.prefill.check_prefill_inputs`). A bad tensor raises on every rank
        of a step with collectives when ``check`` (:func:`~shardattn.runtime.args.reject`)."""
        lens_given = query_lens is not None or prefix_lens is not None or seq_lens is not None
        # a bad plan argument, sinks or tensor raises through the step's agreement (reject): raised on
        # this rank alone, it left the peers waiting there, where this rank's next call paired with them
        bad: TypeError | ValueError | None = None
        if plan is None and query_lens is None:
            bad = ValueError("prefill needs query_lens (new tokens per request) or a plan from plan_prefill")
        elif plan is None and query_lens is not None:
            kv_rows = None
            if self.spec.kind == "sparse_mla":  # the rows the step addresses route it (G past 24-bit rows)
                try:
                    kv_rows = _addressed_rows(kv_cache, kv_new, self.world_size)
                except (TypeError, ValueError) as e:
                    bad, kv_rows = e, 0
            try:
                plan = self.plan_prefill(query_lens, prefix_lens, seq_lens=seq_lens, kv_rows=kv_rows)
            except (TypeError, ValueError) as e:  # lengths of this rank alone: every step of a mode that
                bad = e  # collects agrees first
        elif not isinstance(plan, PrefillPlan):
            bad = TypeError(f"plan must be a PrefillPlan from Runtime.plan_prefill, got {type(plan).__name__}")
        elif plan.made_for and plan.made_for != self._plan_config:
            bad = ValueError(
                f"plan was made by a Runtime for {plan.made_for}; this one runs "
                f"{self._plan_config}: plan the step with its plan_prefill"
            )
        elif lens_given:
            bad = ValueError("pass either plan or query_lens / prefix_lens / seq_lens, not both (a plan holds them)")
        if bad is None:  # sinks exactly when the model has them, named before the tensors are checked
            try:
                check_sinks_declared(sinks, has_sinks=self.spec.has_sinks, heads=self.spec.num_heads)
                check_topk_unique(topk_unique, kind=self.spec.kind)
            except (TypeError, ValueError) as e:
                bad = e
        if bad is not None:
            reject(self.comm, bad, collective=self._prefill_agrees, check=check)
        assert plan is not None  # planned above, or refused
        if plan.gqa is not None:
            tokens_from = "query_lens sums to" if lens_given else "the plan is for"
            try:
                gqa_given = check_gqa_prefill_inputs(
                    plan.step, self.spec, self.comm, q=q, kv_cache=kv_cache, kv_new=kv_new, block_table=block_table,
                    rows=rows, topk_pos=topk_pos, topk_length=topk_length, window_left=window_left, sinks=sinks,
                    gqa=plan.gqa, num_tokens=plan.num_tokens, rank_tokens=plan.count_of(self.rank),
                    heads_per_rank=self.heads_per_rank, tokens_from=tokens_from,
                )  # fmt: skip
            except (TypeError, ValueError) as e:
                reject(self.comm, e, collective=self._prefill_agrees, check=check)
            return plan, gqa_given
        if window_left != -1:
            why = f"window_left is GQA's sliding window; a sparse-MLA prefill takes none, got {window_left!r}"
            reject(self.comm, ValueError(why), collective=self._prefill_agrees, check=check)
        try:
            given = check_prefill_inputs(
                plan, self.spec, self.rank, self.heads_per_rank,
                q=q, kv_cache=kv_cache, rows=rows, topk_pos=topk_pos, kv_new=kv_new, block_table=block_table,
                topk_length=topk_length, tokens_from="query_lens sums to" if lens_given else "the plan is for",
                kv_format=self._kv_declared,
            )  # fmt: skip
            if isinstance(given, PCPInputs):
                top = check_tensor("topk_pos", given.topk_pos, ndim=2)
            else:
                top = check_tensor("rows", given.rows, ndim=2)
            if sinks is not None:  # every head's, before a head-TP step takes the rank's
                check_sink_logits(sinks, self.spec.num_heads, device=q.device)
            self.ws.check("prefill", plan.step, tokens=plan.num_tokens, topk=int(top.shape[1]))
            if plan.route.group_size > 1:  # a plan made for a smaller cache (kv_rows): its union can't pack
                addressed = _addressed_rows(kv_cache, kv_new, self.world_size)
                if addressed >= MAX_GROUPED_KV_ROWS:
                    raise ValueError(
                        f"plan routes the grouped kernel (G={plan.route.group_size}), which addresses fewer than "
                        f"{MAX_GROUPED_KV_ROWS} KV rows, but this step addresses {addressed}: plan it with "
                        f"kv_rows={addressed} (or without a plan)"
                    )
        except (TypeError, ValueError) as e:
            reject(self.comm, e, collective=self._prefill_agrees, check=check)
        if plan.shard is None and check and self._prefill_agrees:  # a head-TP step the cost model chose: its
            fingerprint = Fingerprint(  # its own agreement
                "prefill", {"the step": plan.step, "the tokens": plan.num_tokens, "the route": plan.route.path}
            )
            self.comm.check_agreement(fingerprint, "prefill plan")
        return plan, given

    @functools.cached_property
    def _prefill_agrees(self) -> bool:
        """Whether every prefill step of this config runs an agreement first with ``check`` (a mode whose
        steps may collect: ShardQ or PCP over several ranks; a head-TP step the cost model picks agrees
        on its own), so a rank's bad input, or lengths it cannot plan, reach every rank at once."""
        step = prefill_step_of(self.spec.kind, self.mode)
        return self.world_size > 1 and (step == "pcp" or (step == "shardq" and self.ws.shardq_possible))

    def _decode_route(self) -> Route:
        return route_decode(self.spec, device_type=self.device)

    @functools.cached_property
    def decode_route(self) -> Route:
        """The planner's route of this Runtime's decode steps (fixed per config)."""
        route = self._name_kv_format(self._decode_route())
        log.debug("decode steps (%s): %s: %s", "DCP" if self.decode_is_dcp else "head-TP", route.path, route.reason)
        return route


def _addressed_rows(kv_cache: object, kv_new: object, world_size: int) -> int:
    """KV rows a sparse-MLA prefill addresses: the cache's (a paged cache's pages x page), and under
    PCP every rank's new rows (``kv_new [T_r, D]`` each). Raises naming a tensor of another rank."""
    rows = 0
    for name, value in (("kv_cache", kv_cache), ("kv_new", kv_new)):
        if value is not None:  # a paged cache is 3-D: its rows count
            paged = name == "kv_cache" and check_tensor(name, value).dim() == 3
            t = check_tensor(name, value, ndim=3 if paged else 2)
            rows += int(t.shape[:-1].numel()) * (world_size if name == "kv_new" else 1)
    return rows
