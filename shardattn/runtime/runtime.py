"""The Runtime: one model config on one process group, with its workspace, warm-up, routing and graph policy.

An inference engine builds one :class:`Runtime` per attention shape and process group, once, at
start-up, then calls it every step::

    rt = Runtime("glm5", tp_group, max_batched_tokens=16384, mode="mixed", device="cuda:0")
    out, lse = rt.prefill(q_local, kv, rows, seq_lens=new_tokens, prefix_lens=cached)        # ShardQ
    out, lse = rt.decode(q_local, kv_shard, table_shard, seq_lens, topk_pos=pos, req_ids=req)  # DCP

Construction does everything that must not happen mid-serving:

* **workspace**: reserves, once, one arena that every step's items (as
  :func:`~shardattn.plan.workspace.workspace_bounds` lists them) are laid over: steps never run
  at the same time, so it is as large as the largest step (:attr:`Runtime.workspace` views each
  item; :mod:`~shardattn.runtime.workspace` says what is shared and why). Every step
  recomputes its needs with the same function and raises :class:`WorkspaceExceededError`,
  naming the item, when one does not fit, before any kernel runs;
* **warm-up** (:mod:`~shardattn.runtime.warmup`): launches every kernel variant the planner's
  routes can produce for this config (:attr:`Runtime.warmed_keys`), so that no step compiles;
* **graph policy**: :meth:`Runtime.cudagraph_support` is the planner's level for each step;
  :meth:`Runtime.capture_decode` captures graph buckets and refuses a capture the level forbids
  with a ``ValueError`` (:mod:`~shardattn.runtime.graphs`).

Steps are routed by the planner (:mod:`shardattn.plan.routing`: path, group size, reason) and
run by the mode's parallel step (:mod:`shardattn.runtime.modes`). A Runtime keeps no global
state, so several (different groups, different models) work side by side in one process.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from shardattn._checks import check_choice, check_int, check_scale, check_tensor
from shardattn.kernels.flashinfer_xqa import get_xqa
from shardattn.ops.dispatch import device_capability, gluon_runs_on
from shardattn.parallel.comm import Comm
from shardattn.parallel.groups import GroupLike
from shardattn.parallel.hosts import exchange_node_layout
from shardattn.plan.context import DCPLayout
from shardattn.plan.cost import CostModel
from shardattn.plan.cost_route import cost_route, resolve_cost_model
from shardattn.plan.pcp import pcp_plan
from shardattn.plan.pipeline import MAX_CHUNKS
from shardattn.plan.routing import Route, route_decode, route_prefill
from shardattn.plan.spec import ModelSpec, get_preset
from shardattn.plan.zigzag import DEFAULT_MIN_TOKENS, zigzag_split
from shardattn.runtime.decode import DecodeStep
from shardattn.runtime.graphs import RuntimeGraphs
from shardattn.runtime.modes import DECODE_STEP, MODES, PREFILL_STEP
from shardattn.runtime.prefill import PrefillPlan, run_prefill_step, shardq_buffers, workspace_prefill_attention
from shardattn.runtime.warmup import CompileKey, RuntimeWarmup
from shardattn.runtime.workspace import RuntimeWorkspace, WorkspaceExceededError

__all__ = ["DECODE_STEP", "MODES", "PREFILL_STEP", "PrefillPlan", "Runtime", "WorkspaceExceededError"]

_EMPTY_WS = torch.empty(0, dtype=torch.uint8)  # a route without a union (reference path) reads no workspace


class Runtime(RuntimeGraphs, RuntimeWarmup):
    """Sharded attention for one model spec on one process group (see the module docstring).

    Args:
        spec: a :class:`~shardattn.plan.spec.ModelSpec` or a preset name (``"glm5"``,
            ``"deepseek-v32"``, ``"gqa-64-8"``).
        group: the process group of the steps (the tensor-parallel group: NCCL with one GPU per
            rank, or gloo on the CPU): a ``ProcessGroup``, a 1-D ``DeviceMesh`` or ``(mesh, dim
            name)`` of an N-D mesh (:mod:`~shardattn.parallel.groups`).
        max_batched_tokens: the most new tokens of one prefill step (all requests together).
        mode: one of :data:`MODES`.
        device: where the tensors live (default: the current CUDA device for NCCL, else CPU).
        scale: the softmax scale of every step (default: the spec's ``softmax_scale``, the model's
            own; :func:`~shardattn.plan.spec.mla_softmax_scale` computes an MLA model's from its config).
        topk: top-k entries per query (default: the spec's).
        max_kv_rows: the most KV-cache rows a prefill addresses (default ``max_batched_tokens * 16``);
            routes and warm-up cover both sides of the grouped path's ``2**24 - 1`` row limit anyway.
        max_decode_tokens: the most query tokens of one decode step (drafts included).
        dcp_interleave: DCP interleave size (KV tokens per rank block).
        min_shard_tokens: the ShardQ gate (default: the planner's, 1024 new tokens).
        min_group_tokens: the grouped path's gate (default: the planner's, 1024 tokens per kernel call).
        non_causal: speculative drafts attend non-causally (decode routing and graph policy).
        decode_lse: :meth:`decode` returns the LSE (default). ``False`` lets a head-TP GQA decode
            take a kernel without one (FlashInfer XQA, when the planner routes there); its
            :meth:`decode` then returns ``(out, None)``. DCP always needs the LSE.
        warmup: launch every kernel variant now (default True).
        cost_model: how ``shardq`` / ``mixed`` steps above the ShardQ gate choose between ShardQ
            and head-TP (:mod:`~shardattn.plan.cost_route`): a
            :class:`~shardattn.plan.cost.CostModel`, a calibration file, ``"auto"`` (default: the
            table shipped for the GPU; none on the CPU) or ``None`` (ShardQ whenever the gate passes).
        prefill_chunks: pipeline depth of ShardQ steps: ``None`` (default) = the planner's
            :func:`~shardattn.plan.pipeline.choose_chunks` of each step (1 for small steps, up to
            ``AUTO_MAX_CHUNKS`` for large ones); an int in ``[1, MAX_CHUNKS]`` forces it (1 = not
            pipelined). Every value gives the same bits.
        prefill_taper: cut pipelined ShardQ steps into tapered chunks (first and last half the
            middle ones; :func:`~shardattn.plan.pipeline.chunk_weights`). Opt-in; same bits.
        prefill_one_union: ShardQ steps build the union of the rank's whole share once, not one
            per chunk (:func:`~shardattn.parallel.shardq.shardq_prefill`'s ``one_union``). Opt-in.
        host_id: this rank's host identity (default: host name and boot id,
            :func:`~shardattn.parallel.hosts.host_identity`); ranks with equal ids share a host.
            Construction exchanges them once (:attr:`nodes`), and the cost model prices ShardQ /
            PCP exchanges that cross hosts at the network's rate. A launcher passes its node rank.

    Attributes:
        nodes: the :class:`~shardattn.plan.nodes.NodeLayout` of the group (which ranks share a host).

    Raises:
        ValueError / TypeError: heads not divisible by the world size, a mode without a step for
            the spec (prefill for a GQA model), bad sizes.
    """

    def __init__(
        self,
        spec: ModelSpec | str,
        group: GroupLike,
        *,
        max_batched_tokens: int,
        mode: str,
        device: torch.device | str | None = None,
        scale: float | None = None,
        topk: int | None = None,
        max_kv_rows: int | None = None,
        max_decode_tokens: int = 256,
        dcp_interleave: int = 1,
        min_shard_tokens: int | None = None,
        min_group_tokens: int | None = None,
        non_causal: bool = False,
        decode_lse: bool = True,
        warmup: bool = True,
        cost_model: CostModel | str | None = "auto",
        prefill_chunks: int | None = None,
        prefill_taper: bool = False,
        prefill_one_union: bool = False,
        host_id: str | None = None,
    ) -> None:
        self.spec = get_preset(spec) if isinstance(spec, str) else spec
        if not isinstance(self.spec, ModelSpec):
            raise TypeError(f"spec must be a ModelSpec or a preset name, got {type(spec).__name__}")
        check_choice("mode", mode, MODES)
        self.mode = mode
        self.max_batched_tokens = check_int("max_batched_tokens", max_batched_tokens, minimum=1)
        self.max_decode_tokens = check_int("max_decode_tokens", max_decode_tokens, minimum=1)
        interleave = check_int("dcp_interleave", dcp_interleave, minimum=1)
        self.min_shard_tokens = DEFAULT_MIN_TOKENS if min_shard_tokens is None else min_shard_tokens
        self.min_group_tokens = DEFAULT_MIN_TOKENS if min_group_tokens is None else min_group_tokens
        check_int("min_shard_tokens", self.min_shard_tokens, minimum=0)
        check_int("min_group_tokens", self.min_group_tokens, minimum=0)
        if not isinstance(non_causal, bool):
            raise TypeError(f"non_causal must be a bool, got {type(non_causal).__name__}")
        self.non_causal = non_causal
        if not isinstance(decode_lse, bool):
            raise TypeError(f"decode_lse must be a bool, got {type(decode_lse).__name__}")
        self.decode_lse = decode_lse
        if prefill_chunks is not None:
            if not 1 <= check_int("prefill_chunks", prefill_chunks, minimum=1) <= MAX_CHUNKS:
                raise ValueError(f"prefill_chunks must be in [1, {MAX_CHUNKS}], got {prefill_chunks}")
        self.prefill_chunks = prefill_chunks
        if not isinstance(prefill_taper, bool):
            raise TypeError(f"prefill_taper must be a bool, got {type(prefill_taper).__name__}")
        self.prefill_taper = prefill_taper
        if not isinstance(prefill_one_union, bool):
            raise TypeError(f"prefill_one_union must be a bool, got {type(prefill_one_union).__name__}")
        self.prefill_one_union = prefill_one_union
        if self.spec.kind == "gqa" and PREFILL_STEP[mode] not in (None, "headtp"):
            raise ValueError(
                f"mode {mode!r} runs a sparse-MLA prefill, but the spec is a GQA model; "
                "use mode 'dcp-decode' or 'headtp' (decode)"
            )

        self.comm = Comm(group)  # resolves rank, size and backend once; counts this Runtime's collectives
        self.group = self.comm.group  # the ProcessGroup (of a DeviceMesh's dimension)
        self.nodes = exchange_node_layout(self.comm, host_id)  # one small all-gather, not counted
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.heads_per_rank = self.spec.heads_per_rank(self.world_size)  # raises when heads do not divide
        self.layout = DCPLayout(self.world_size, interleave)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if self.comm.backend == "nccl" else "cpu"
        self.device = torch.device(device)
        self.gluon = gluon_runs_on(self.device)  # grouped steps take the grouped Gluon kernel's G
        if self.comm.backend == "nccl" and self.device.type != "cuda":
            raise ValueError(f"device must be a CUDA device for an nccl group, got {self.device}")
        self.dtype: torch.dtype = getattr(torch, self.spec.dtype)
        self.topk = self.spec.topk if topk is None else check_int("topk", topk, minimum=1)
        rows = self.max_batched_tokens * 16 if max_kv_rows is None else max_kv_rows
        self.max_kv_rows = check_int("max_kv_rows", rows, minimum=1)
        self.scale = self.spec.softmax_scale if scale is None else check_scale("scale", scale)

        self.cost_model = resolve_cost_model(cost_model, self.device) if PREFILL_STEP[mode] == "shardq" else None
        self.ws = RuntimeWorkspace(
            self.spec,
            mode,
            self.world_size,
            device=self.device,
            max_batched_tokens=self.max_batched_tokens,
            max_decode_tokens=self.max_decode_tokens,
            min_shard_tokens=self.min_shard_tokens,
            topk=self.topk,
            headtp_tokens=self.max_batched_tokens if self.cost_model is not None else None,
        )
        self.bounds = self.ws.bounds
        self.workspace = self.ws.buffers  # reserved once, never reallocated: {"prefill.union": ..., ...}
        self.warmed_keys: frozenset[CompileKey] = frozenset()
        self.warmup_launches = 0
        if warmup:
            self.warmup()

    # -- description ---------------------------------------------------------------------------
    @property
    def decode_is_dcp(self) -> bool:
        """Decode steps split the KV cache over the group (DCP) rather than the heads (head-TP)."""
        return DECODE_STEP[self.mode] == "dcp"

    @property
    def workspace_bytes(self) -> int:
        """Bytes reserved for the workspace, all items together."""
        return self.ws.nbytes

    def __repr__(self) -> str:
        return (
            f"Runtime({self.spec.kind}, {self.spec.num_heads} heads, mode={self.mode!r}, rank {self.rank} of "
            f"{self.world_size}, {self.comm.backend}, {self.device}, workspace {self.workspace_bytes} B)"
        )

    # -- workspace -----------------------------------------------------------------------------
    def workspace_needs(self, kind: str, step: str, tokens: int, topk: int) -> dict[str, int]:
        """``{"<kind>.<item>": bytes}`` the planner bounds for one step (:meth:`RuntimeWorkspace.needs`)."""
        return self.ws.needs(kind, step, tokens, topk)

    def check_workspace(self, kind: str, step: str, *, tokens: int, topk: int | None = None) -> None:
        """Raise :class:`WorkspaceExceededError` when a step needs more of an item than was reserved
        (:meth:`RuntimeWorkspace.check`)."""
        self.ws.check(kind, step, tokens=tokens, topk=topk)

    # -- routing -------------------------------------------------------------------------------
    def _route(self, heads: int, tokens: int, kv_rows: int) -> Route:
        return route_prefill(
            heads,
            num_tokens=tokens,
            kv_rows=kv_rows,
            device_type=self.device,
            min_tokens=self.min_group_tokens,
            gluon=self.gluon,
        )

    def plan_prefill(
        self,
        seq_lens: Sequence[int] | torch.Tensor,
        prefix_lens: Sequence[int] | torch.Tensor | None = None,
        *,
        kv_rows: int | None = None,
    ) -> PrefillPlan:
        """Route a prefill step and split its tokens (host-side; the same on every rank).

        Args:
            seq_lens: ``[B]`` new tokens per request. prefix_lens: ``[B]`` cached tokens (default 0).
            kv_rows: rows of the KV cache the step's top-k addresses (default ``max_kv_rows``).
        Raises:
            ValueError: the mode has no prefill; WorkspaceExceededError: the step is too large.
        """
        step = PREFILL_STEP[self.mode]
        if step is None or self.spec.kind != "sparse_mla":
            raise ValueError(f"mode {self.mode!r} with a {self.spec.kind} spec has no prefill step")
        lens = [int(n) for n in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)]
        tokens = sum(lens)
        rows = self.max_kv_rows if kv_rows is None else check_int("kv_rows", kv_rows, minimum=0)
        shard: Any = None
        route: Route | None = None
        if step == "shardq":
            shard = zigzag_split(
                lens, self.world_size, min_tokens=self.min_shard_tokens, prefix_lens=prefix_lens, topk=self.topk
            )
            if not shard.sharded:
                step = "headtp"
            elif self.cost_model is not None:  # the fastest predicted of ShardQ and head-TP
                step, route = cost_route(self, tokens=tokens, counts=shard.counts.tolist(), kv_rows=rows)
                shard = shard if step == "shardq" else None
        elif step == "pcp":
            shard = pcp_plan(lens, self.world_size, prefix_lens=prefix_lens, topk=self.topk)
        if route is None and step == "headtp":
            route = self._route(self.heads_per_rank, tokens, rows)
        elif route is None:  # ShardQ / PCP: this rank's kernel runs every head over its own tokens
            plan = getattr(shard, "shard", shard)
            route = self._route(self.spec.num_heads, int(plan.counts[self.rank]), rows)
        self.check_workspace("prefill", step, tokens=tokens)
        return PrefillPlan(step, route, shard, tokens)

    def _decode_route(self) -> Route:
        sm = None
        if self.device.type == "cuda":
            major, minor = device_capability(self.device.index or 0)
            sm = major * 10 + minor
        dcp = self.world_size if self.decode_is_dcp else 1
        return route_decode(
            self.spec,
            device_type=self.device,
            sm=sm,
            dcp_size=dcp,
            xqa_installed=self.device.type == "cuda" and get_xqa() is not None,
            need_lse=self.decode_lse or dcp > 1 or self.decode_is_dcp,
            non_causal=self.non_causal,
        )

    @functools.cached_property
    def decode_route(self) -> Route:
        """The planner's route of this Runtime's decode steps (fixed per config)."""
        return self._decode_route()

    # -- steps ---------------------------------------------------------------------------------
    def _attention(
        self, q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, *, route: Route, step: str, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's prefill kernel call on ``route``, its union in the workspace reserved for ``step``
        (:func:`~shardattn.runtime.prefill.workspace_prefill_attention`)."""
        views = self.ws.step_buffers("prefill", step)
        return workspace_prefill_attention(
            q,
            kv,
            rows,
            route=route,
            union_ws=views.get("prefill.union", _EMPTY_WS),
            lens_ws=views.get("prefill.union_offsets", _EMPTY_WS),
            **kwargs,
        )

    def _local_heads(self, x: torch.Tensor) -> torch.Tensor:
        h = self.heads_per_rank
        return x[self.rank * h : (self.rank + 1) * h]

    def prefill(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        rows: torch.Tensor,
        *,
        seq_lens: Sequence[int] | torch.Tensor | None = None,
        prefix_lens: Sequence[int] | torch.Tensor | None = None,
        plan: PrefillPlan | None = None,
        topk_length: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
        kv_cache: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None,
        check: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run one sparse-MLA prefill step, routed by the planner.

        Args:
            q: ``[T, H/W, D]`` this rank's heads of every new token (ShardQ and head-TP modes);
                PCP: ``[T_r, H, D]``, every head of the rank's tokens (``plan.tokens_of(rank)``).
            kv: ``[R, D]`` the KV rows (replicated under TP); the value is ``kv[:, :v_dim]``.
                PCP: ``[T_r, D]``, the KV rows of the rank's own new tokens.
            rows: ``[T, K]`` int32 global KV rows of every token's top-k (``-1`` invalid, anywhere).
                PCP: ``[T_r, K]`` int32 request positions (cached prefix included) of the rank's tokens.
            kv_cache, block_table: PCP only: the paged cache holding the cached prefixes
                (``[R, D]``, ``[B, M]`` int32, pages of ``spec.page_size``), when there are any.
            seq_lens, prefix_lens: ``[B]`` new and cached tokens per request (unless ``plan``).
            plan: a :meth:`plan_prefill` result (plan once per step, run it for every layer).
            topk_length: ``[T]`` int32 leading ``rows`` entries to use, optional.
            sinks: ``[H]`` fp32 sink logits of all heads, optional.
            check: make the ranks agree on the plan and inputs first (one small all-gather and a
                host sync; turn off inside CUDA graphs or when the caller already agreed).
        Returns:
            ``(out [T, H/W, v_dim] in q's dtype, lse [T, H/W] fp32)``, token order, this rank's heads.
        Raises:
            WorkspaceExceededError: the step is larger than the Runtime's workspace.
        """
        given = {"q": q, "kv": kv, "rows": rows, **({} if kv_cache is None else {"kv_cache": kv_cache})}
        for name, value in given.items():
            check_tensor(name, value)  # a tensor at all (shapes and dtypes: the step's own checks)
        if plan is None:
            if seq_lens is None:
                raise ValueError("prefill needs seq_lens (new tokens per request) or a plan from plan_prefill")
            rows_in_cache = int(kv.shape[0] if kv_cache is None else kv_cache.shape[0] + kv.shape[0] * self.world_size)
            plan = self.plan_prefill(seq_lens, prefix_lens, kv_rows=rows_in_cache)
        elif not isinstance(plan, PrefillPlan):
            raise TypeError(f"plan must be a PrefillPlan from Runtime.plan_prefill, got {type(plan).__name__}")
        self.check_workspace("prefill", plan.step, tokens=plan.num_tokens, topk=int(rows.shape[1]))
        return run_prefill_step(
            plan,
            q,
            kv,
            rows,
            comm=self.comm,
            spec=self.spec,
            scale=self.scale,
            attention=functools.partial(self._attention, route=plan.route, step=plan.step),
            local_sinks=None if sinks is None else self._local_heads(sinks),
            # the buffers are sized for the spec's dtype; other dtypes (fp32 on a CPU) allocate per step
            shardq_workspace=shardq_buffers(self.ws.step_buffers("prefill", plan.step))
            if q.dtype == self.dtype
            else {},
            chunks=self.prefill_chunks,
            taper=self.prefill_taper,
            one_union=self.prefill_one_union,
            topk_length=topk_length,
            sinks=sinks,
            kv_cache=kv_cache,
            block_table=block_table,
            check=check,
        )

    @functools.cached_property
    def decode_step(self) -> DecodeStep:
        """The decode step of this config (:class:`~shardattn.runtime.decode.DecodeStep`)."""
        return DecodeStep(
            spec=self.spec,
            comm=self.comm,
            layout=self.layout,
            ws=self.ws,
            dcp=self.decode_is_dcp,
            route_path=self.decode_route.path,
            heads_per_rank=self.heads_per_rank,
            scale=self.scale,
            decode_lse=self.decode_lse,
            non_causal=self.non_causal,
        )

    def decode(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run one decode step (DCP or head-TP, by mode), routed by the planner.

        Arguments, shapes and return value: :meth:`DecodeStep.__call__
        <shardattn.runtime.decode.DecodeStep.__call__>` (``q [T, H/W, D]``, the KV cache
        or this rank's DCP shard, ``block_table``, ``seq_lens``; sparse MLA: ``topk_pos``,
        ``req_ids``; GQA: ``q_len_per_req`` / ``cu_q_lens``). Returns ``(out [T, H/W, v_dim],
        lse [T, H/W] fp32 or None)``.
        """
        return self.decode_step(*args, **kwargs)
