"""The Runtime: one model config on one process group, with its workspace, warm-up, routing and graph policy.

An inference engine builds one :class:`Runtime` per attention shape and process group, once, at
start-up, then calls it every step::

    rt = Runtime("glm5", tp_group, mode="mixed", max_batched_tokens=16384, device="cuda:0")
    out, lse = rt.prefill(q_local, kv_cache, rows, query_lens=new_tokens, prefix_lens=cached)       # ShardQ
    out, lse = rt.decode(q_local, kv_shard, table_shard, seq_lens, topk_pos=pos, req_ids=req)  # DCP

Options beyond the model, group and sizes are two frozen dataclasses
(:class:`~shardattn.runtime.options.PrefillOptions`,
:class:`~shardattn.runtime.options.DecodeOptions`); argument names keep one meaning in
every mode and step (:mod:`~shardattn.runtime.args`: ``query_lens`` new tokens,
``prefix_lens`` cached tokens, ``seq_lens`` both, ``rows`` global KV rows, ``topk_pos`` request
positions).

Construction does everything that must not happen mid-serving:

* **workspace**: reserves, once, one arena that every step's items (as
  :func:`~shardattn.plan.workspace.workspace_bounds` lists them) are laid over: steps never run
  at the same time, so it is as large as the largest step (:attr:`Runtime.workspace` views each
  item; :mod:`~shardattn.runtime.workspace` says what is shared and why). Every step
  recomputes its needs with the same function and raises :class:`WorkspaceExceededError`,
  naming the item, when one does not fit, before any kernel runs;
* **warm-up** (:mod:`~shardattn.runtime.warmup`): launches every kernel variant the planner's
  routes can produce for this config (:attr:`Runtime.warmed_keys`), and one tiny decode, so that
  no step compiles;
* **graph policy**: :meth:`Runtime.cudagraph_support` is the planner's level for each step;
  :meth:`Runtime.capture_decode` captures graph buckets and refuses a capture the level forbids
  with a ``ValueError`` (:mod:`~shardattn.runtime.graphs`).

Steps are routed by the planner (:mod:`shardattn.plan.routing`: path, group size, reason;
:mod:`~shardattn.runtime.planning` asks it and logs each decision at debug level) and run by the
mode's parallel step (:mod:`shardattn.runtime.modes`). A Runtime keeps no global state, so
several (different groups, different models) work side by side in one process.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch

from shardattn._checks import check_choice, check_int, check_scale
from shardattn.ops.dispatch import gluon_runs_on
from shardattn.ops.kv_fp8 import resolve_kv
from shardattn.parallel.comm import Comm
from shardattn.parallel.groups import GroupLike
from shardattn.parallel.hosts import exchange_node_layout
from shardattn.plan.context import DCPLayout
from shardattn.plan.cost_route import resolve_cost_model
from shardattn.plan.decode_batch import DecodeBatch
from shardattn.plan.kv_format import KV_FP8_DS_MLA, kv_format_name, kv_row_bytes
from shardattn.plan.routing import Route
from shardattn.plan.spec import ModelSpec, get_preset
from shardattn.runtime.decode import DecodeStep
from shardattn.runtime.gqa_prefill import run_gqa_prefill_step
from shardattn.runtime.graphs import RuntimeGraphs
from shardattn.runtime.modes import DECODE_STEP, MODES, PREFILL_STEP, prefill_step_of
from shardattn.runtime.options import DecodeOptions, PrefillOptions, given_options
from shardattn.runtime.planning import RuntimePlanning
from shardattn.runtime.prefill import PrefillPlan, run_prefill_step, shardq_buffers, workspace_prefill_attention
from shardattn.runtime.warmup import CompileKey, RuntimeWarmup
from shardattn.runtime.workspace import RuntimeWorkspace, WorkspaceExceededError

__all__ = [
    "DECODE_STEP",
    "MODES",
    "PREFILL_STEP",
    "DecodeOptions",
    "PrefillOptions",
    "PrefillPlan",
    "Runtime",
    "WorkspaceExceededError",
]

log = logging.getLogger(__name__)

_EMPTY_WS = torch.empty(0, dtype=torch.uint8)  # a route without a union (reference path) reads no workspace


class Runtime(RuntimePlanning, RuntimeGraphs, RuntimeWarmup):
    """Sharded attention for one model spec on one process group (see the module docstring).

    Args:
        spec: a :class:`~shardattn.plan.spec.ModelSpec` or a preset name (``"glm5"``,
            ``"deepseek-v32"``, ``"gqa-64-8"``).
        group: the process group of the steps (the tensor-parallel group: NCCL with one GPU per
            rank, or gloo on the CPU): a ``ProcessGroup``, a 1-D ``DeviceMesh`` or ``(mesh, dim
            name)`` of an N-D mesh (:mod:`~shardattn.parallel.groups`).
        mode: one of :data:`MODES` (the table of steps: :mod:`shardattn.runtime.modes`).
        max_batched_tokens: the most new tokens of one prefill step (all requests together).
        max_decode_tokens: the most query tokens of one decode step (drafts included).
        device: where the tensors live (default: the current CUDA device for NCCL, else CPU).
        scale: the softmax scale of every step (default: the spec's ``softmax_scale``, the model's
            own; :func:`~shardattn.plan.spec.mla_softmax_scale` computes an MLA model's from its config).
        topk: top-k entries per query (default: the spec's).
        prefill_options: how prefill steps are routed, gated and pipelined
            (:class:`~shardattn.runtime.options.PrefillOptions`; default: the planner's).
        decode_options: DCP interleave, draft causality, whether decode returns the LSE
            (:class:`~shardattn.runtime.options.DecodeOptions`).
        warmup: launch every kernel variant now (default True).
        kv_dtype: the KV cache's row format (:data:`~shardattn.plan.kv_format.KV_FORMATS`):
            ``None`` (default) = rows in q's dtype (the workspace sized for the spec's);
            ``"fp8_ds_mla"`` (sparse-MLA DSA models; the Gluon kernels need bf16 queries): every
            step reads 656-byte FP8 rows (:mod:`shardattn.ops.kv_fp8`; DCP shards, PCP's gathered
            rows and prefix cache, ShardQ's and head-TP's cache all in that format, flat or paged
            ``[pages, page_size, 656]``), the workspace is sized for them and the warm-up compiles
            the FP8 kernel variants. A step's cache in another format is a ``ValueError`` naming
            it and the format. A property of the cache, so of both prefill and decode steps.
        host_id: this rank's host identity (default: host name and boot id,
            :func:`~shardattn.parallel.hosts.host_identity`); ranks with equal ids share a host.
            Construction exchanges them once (:attr:`nodes`), and the cost model prices ShardQ /
            PCP exchanges that cross hosts at the network's rate. A launcher passes its node rank.

    Attributes:
        nodes: the :class:`~shardattn.plan.nodes.NodeLayout` of the group (which ranks share a host).

    Raises:
        ValueError / TypeError: heads not divisible by the world size, a mode without a step for
            the spec (prefill for a GQA model), bad sizes, options that are not the dataclasses.
    """

    def __init__(
        self,
        spec: ModelSpec | str,
        group: GroupLike,
        *,
        mode: str,
        max_batched_tokens: int,
        max_decode_tokens: int = 256,
        device: torch.device | str | None = None,
        scale: float | None = None,
        topk: int | None = None,
        prefill_options: PrefillOptions | None = None,
        decode_options: DecodeOptions | None = None,
        warmup: bool = True,
        kv_dtype: str | None = None,
        host_id: str | None = None,
    ) -> None:
        self.spec = get_preset(spec) if isinstance(spec, str) else spec
        if not isinstance(self.spec, ModelSpec):
            raise TypeError(f"spec must be a ModelSpec or a preset name, got {type(spec).__name__}")
        check_choice("mode", mode, MODES)
        self.mode = mode
        self.max_batched_tokens = check_int("max_batched_tokens", max_batched_tokens, minimum=1)
        self.max_decode_tokens = check_int("max_decode_tokens", max_decode_tokens, minimum=1)
        # the options: PrefillOptions / DecodeOptions (shardattn.runtime.options), the defaults for None
        self.prefill_options, self.decode_options = given_options(prefill_options, decode_options)
        if not isinstance(warmup, bool):
            raise TypeError(f"warmup must be a bool, got {type(warmup).__name__}")
        if self.spec.kind == "gqa" and mode == "shardq":
            raise ValueError(
                "mode 'shardq' runs a sparse-MLA prefill (ShardQ), but the spec is a GQA model; use mode 'headtp' "
                "(head-TP prefill and decode), 'mixed' (head-TP prefill, DCP decode), 'pcp' or 'dcp-decode'"
            )

        self.comm = Comm(group)  # resolves rank, size and backend once; counts this Runtime's collectives
        self.group = self.comm.group  # the ProcessGroup (of a DeviceMesh's dimension)
        self.nodes = exchange_node_layout(self.comm, host_id)  # one small all-gather, not counted
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.heads_per_rank = self.spec.heads_per_rank(self.world_size)  # raises when heads do not divide
        self.layout = DCPLayout(self.world_size, self.decode_options.dcp_interleave)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if self.comm.backend == "nccl" else "cpu"
        self.device = torch.device(device)
        self.gluon = gluon_runs_on(self.device)  # grouped steps take the grouped Gluon kernel's G
        if self.comm.backend == "nccl" and self.device.type != "cuda":
            raise ValueError(f"device must be a CUDA device for an nccl group, got {self.device}")
        self.dtype: torch.dtype = getattr(torch, self.spec.dtype)
        self.kv_format = kv_format_name("kv_dtype", self.spec.dtype if kv_dtype is None else kv_dtype)
        self._kv_declared = None if kv_dtype is None else self.kv_format  # None: rows in any float dtype, q's
        if self.kv_format == KV_FP8_DS_MLA and self.spec.kind != "sparse_mla":
            raise ValueError(f"kv_dtype={KV_FP8_DS_MLA!r} holds sparse-MLA rows; the spec is a {self.spec.kind} model")
        if self.spec.kind == "sparse_mla":
            kv_row_bytes(self.kv_format, self.spec.head_dim, self.spec.v_dim)  # fp8_ds_mla: DSA dims only
        self.topk = self.spec.topk if topk is None else check_int("topk", topk, minimum=1)
        rows = self.prefill_options.max_kv_rows
        self.max_kv_rows = self.max_batched_tokens * 16 if rows is None else rows
        self.scale = self.spec.softmax_scale if scale is None else check_scale("scale", scale)

        cost_model = self.prefill_options.cost_model
        self.cost_model = (
            resolve_cost_model(cost_model, self.device) if prefill_step_of(self.spec.kind, mode) == "shardq" else None
        )
        self.ws = RuntimeWorkspace(
            self.spec,
            mode,
            self.world_size,
            device=self.device,
            max_batched_tokens=self.max_batched_tokens,
            max_decode_tokens=self.max_decode_tokens,
            min_shard_tokens=self.prefill_options.min_shard_tokens,
            topk=self.topk,
            headtp_tokens=self.max_batched_tokens if self.cost_model is not None else None,
            kv_dtype=self.kv_format,
        )
        self.bounds = self.ws.bounds
        self.workspace = self.ws.buffers  # reserved once, never reallocated: {"prefill.union": ..., ...}
        self.warmed_keys: frozenset[CompileKey] = frozenset()
        self.warmup_launches = 0
        self._warned_dtype = False
        if warmup:
            self.warmup()
        log.debug("%r: steps %s", self, sorted(self.ws.step_bounds))

    # -- options the parts read ----------------------------------------------------------------
    @property
    def min_shard_tokens(self) -> int:
        """The ShardQ gate (:attr:`PrefillOptions.min_shard_tokens`)."""
        return self.prefill_options.min_shard_tokens

    @property
    def min_group_tokens(self) -> int:
        """The grouped path's gate (:attr:`PrefillOptions.min_group_tokens`)."""
        return self.prefill_options.min_group_tokens

    @property
    def causal(self) -> bool:
        """Speculative drafts attend causally (:attr:`DecodeOptions.causal`)."""
        return self.decode_options.causal

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
        if self.world_size == 1:
            return x
        h = self.heads_per_rank
        return x[self.rank * h : (self.rank + 1) * h]

    def prefill(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None,
        rows: torch.Tensor | None = None,
        *,
        topk_pos: torch.Tensor | None = None,
        kv_new: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        block_table: torch.Tensor | None = None,
        query_lens: Sequence[int] | torch.Tensor | None = None,
        prefix_lens: Sequence[int] | torch.Tensor | None = None,
        seq_lens: Sequence[int] | torch.Tensor | None = None,
        plan: PrefillPlan | None = None,
        topk_length: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
        window_left: int = -1,
        check: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run one prefill step (sparse MLA or GQA), routed by the planner.

        ShardQ and head-TP modes (``rt.prefill(q, kv_cache, rows, query_lens=...)``):

        Args:
            q: ``[T, H/W, D]`` fp16/bf16/fp32, this rank's heads of every new token.
            kv_cache: ``[R, D]`` the KV rows in q's dtype (replicated under TP; the step's new
                tokens' rows included); the value is ``kv_cache[:, :v_dim]``.
            rows: ``[T, K]`` int32 (int64 is converted) global rows of ``kv_cache`` of every
                token's top-k (``-1`` or out of range = invalid, anywhere in a row).

        PCP (``rt.prefill(q, kv_cache, topk_pos=..., kv_new=..., block_table=..., plan=plan)``):

        Args:
            q: ``[T_r, H, D]``, every head of the rank's tokens (``plan.tokens_of(rank)``).
            kv_cache, block_table: the paged cache holding the cached prefixes (``[R, D]``,
                ``[B, M]`` int32, pages of ``spec.page_size``); ``None`` without cached prefixes.
            topk_pos: ``[T_r, K]`` int32 positions inside each token's request (cached prefix
                included) of the rank's tokens' top-k.
            kv_new: ``[T_r, D]`` the KV rows of the rank's own new tokens (all-gathered by the step).

        GQA (``rt.prefill(q, (k_cache, v_cache), kv_new=(k, v), block_table=..., query_lens=...)``;
        :mod:`~shardattn.runtime.gqa_prefill`): head-TP in ``headtp`` / ``mixed``, PCP in ``pcp``.

        Args:
            q: head-TP ``[T, H/W, D]`` this rank's heads of every new token; PCP ``[T_r, H, D]``
                every head of the rank's tokens (``plan.tokens_of(rank)``).
            kv_cache: ``(k_cache, v_cache)``, each ``[pages, page_size, Hkv_r, D]`` in q's dtype
                (head-TP: the rank's KV heads, :func:`~shardattn.parallel.gqa_prefill.head_tp_kv_heads`;
                PCP: all), with ``block_table [B, M]`` int32; it holds the cached prefixes, and with
                ``kv_new=None`` the step's new tokens after them. ``None``: no prefix, ``kv_new`` given.
            kv_new: ``(k, v)``, each ``[T, Hkv_r, D]`` (PCP ``[T_r, Hkv, D]``), the new tokens' keys
                and values; ``None``: they are in ``kv_cache`` already (written by the engine's
                cache write before attention): one paged call per step, the fastest form.
            window_left: sliding window, the query at position ``p`` sees ``[p - window_left, p]``
                (``-1``, the default: none).
            rows / topk_pos / topk_length: sparse MLA's; ``None``.

        Every mode:

        Args:
            query_lens: ``[B]`` new tokens per request (unless ``plan``; a list is fine).
            prefix_lens / seq_lens: ``[B]`` cached tokens per request, or KV tokens per request
                including the cached prefix (one of them; default: no cached prefix).
            plan: a :meth:`plan_prefill` result instead of the lengths (plan once per step, run
                it for every layer).
            topk_length: ``[T]`` (PCP ``[T_r]``) int32 leading top-k entries to use, optional.
            sinks: ``[H]`` fp32 sink logits of all heads, optional.
            check: make the ranks agree on the plan and inputs first (one small all-gather and a
                host sync; turn off inside CUDA graphs or when the caller already agreed).
        Returns:
            ``(out, lse)``: ``out`` in q's dtype, ``[T, H/W, v_dim]`` in token order for this
            rank's heads (PCP: ``[T_r, H, v_dim]`` of the rank's tokens); ``lse`` fp32 ``[T, H/W]``
            (PCP ``[T_r, H]``), natural log; ``None`` with ``PrefillOptions(return_lse=False)``.
        Raises:
            ValueError / TypeError: naming the argument (on every rank of a step with collectives
                when ``check``); WorkspaceExceededError: the step is larger than the workspace.
        """
        plan, given = self._prefill_inputs(
            q, kv_cache, rows, topk_pos=topk_pos, kv_new=kv_new, block_table=block_table, query_lens=query_lens,
            prefix_lens=prefix_lens, seq_lens=seq_lens, plan=plan, topk_length=topk_length, check=check,
            window_left=window_left, sinks=sinks,
        )  # fmt: skip
        options = self.prefill_options
        if plan.gqa is not None:
            return run_gqa_prefill_step(
                plan.step, plan.shard, plan.gqa, q, given, comm=self.comm, kernel=self.gqa_kernel, scale=self.scale,
                sinks=sinks, local_sinks=None if sinks is None else self._local_heads(sinks),
                window_left=window_left, return_lse=options.return_lse, check=check,
            )  # fmt: skip
        workspace = shardq_buffers(self.ws.step_buffers("prefill", plan.step))
        if q.dtype != self.dtype:  # the buffers are sized for the spec's dtype (fp32 on a CPU allocates per step)
            workspace = {}
            self._warn_dtype(q.dtype)
        out, lse = run_prefill_step(
            plan,
            q,
            given,
            comm=self.comm,
            spec=self.spec,
            scale=self.scale,
            attention=functools.partial(self._attention, route=plan.route, step=plan.step),
            local_sinks=None if sinks is None else self._local_heads(sinks),
            shardq_workspace=workspace,
            chunks=options.chunks,
            taper=options.taper,
            one_union=options.one_union,
            sinks=sinks,
            check=check,
        )
        return out, (lse if options.return_lse else None)

    def _warn_dtype(self, dtype: torch.dtype) -> None:
        """Say once that steps in another dtype than the spec's bypass the workspace (a warning on a
        GPU, where it costs allocations mid-serving; information on the CPU, where fp32 is usual)."""
        if not self._warned_dtype:
            self._warned_dtype = True
            log.log(
                logging.WARNING if self.device.type == "cuda" else logging.INFO,
                "%r: queries in %s, not the spec's %s: steps allocate their buffers per step instead of using the "
                "reserved workspace (build the spec with dtype=%r to use it)",
                self, str(dtype).replace("torch.", ""), self.spec.dtype, str(dtype).replace("torch.", ""),
            )  # fmt: skip

    def kv_rows(self, name: str, kv: torch.Tensor) -> torch.Tensor:
        """``kv`` checked against this Runtime's KV format (``kv_dtype``; without one, rows of any
        float dtype or ``fp8_ds_mla`` rows by their dtype), as ``[R, row]`` rows (a paged FP8 cache as
        a flat view).

        Raises:
            ValueError / TypeError: naming ``name`` and the format.
        """
        rows, _ = resolve_kv(name, kv, head_dim=self.spec.head_dim, v_dim=self.spec.v_dim, kv_format=self._kv_declared)
        return rows

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
            return_lse=self.decode_options.return_lse,
            causal=self.causal,
            kv_rows=self.kv_rows if self.spec.kind == "sparse_mla" else None,
            bypass=self._warn_dtype,
        )

    def decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        block_table: torch.Tensor,
        seq_lens: torch.Tensor | Sequence[int],
        *,
        topk_pos: torch.Tensor | None = None,
        req_ids: torch.Tensor | Sequence[int] | None = None,
        topk_length: torch.Tensor | None = None,
        topk_unique: bool = False,
        q_len_per_req: int | None = None,
        cu_q_lens: torch.Tensor | Sequence[int] | None = None,
        max_q_len: int | None = None,
        window_left: int = -1,
        sinks: torch.Tensor | None = None,
        batch: DecodeBatch | None = None,
        meta: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        check: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run one decode step (DCP or head-TP, by mode), routed by the planner.

        Index and length tensors are int32; int64 tensors and host lists are converted (see
        :mod:`~shardattn.runtime.args`).

        Args:
            q: ``[T, H/W, D]`` fp16/bf16/fp32, this rank's heads of the step's query tokens
                (drafts included), requests in order.
            kv_cache: sparse MLA: ``[R, D]`` paged KV rows in q's dtype; GQA: ``(k_cache,
                v_cache)``, each ``[pages, page_size, Hkv, D]``. Under DCP this rank's shard (its
                tokens in local order: :func:`~shardattn.plan.dcp_shard.shard_kv_cache` builds
                it from a whole cache), under head-TP the whole cache (GQA: the rank's KV heads).
            block_table: ``[B, M]`` int32 page table of ``kv_cache`` (the rank's, under DCP).
            seq_lens: ``[B]`` int32 KV tokens per request, cached prefix and drafts included
                (global counts under DCP too; a list is fine).
            topk_pos: sparse MLA: ``[T, K]`` int32 top-k positions inside each token's request
                (``-1`` or out of range = invalid).
            req_ids: sparse MLA: ``[T]`` int32 request of each query token.
            topk_length: sparse MLA: ``[T]`` int32 leading entries of ``topk_pos`` to use, optional.
            topk_unique: sparse MLA: no position appears twice in a row of ``topk_pos`` (an
                indexer's top-k), so the kernels skip their de-duplication (most of a small step's
                time); a repeated position would then count twice. A promise about positions, which
                the step hands to the kernels as their ``rows_unique`` (distinct positions of a
                request are distinct rows of its pages).
            q_len_per_req / cu_q_lens: GQA: uniform queries per request, or ``[B + 1]`` int32
                offsets of ragged drafts (default: one query per request).
            max_q_len: GQA head-TP with ``cu_q_lens``: host bound on the drafts (needed under capture).
            window_left: GQA under head-TP: sliding window, the query at position ``p`` sees keys
                ``[p - window_left, p]`` (``-1``, the default: no window). DCP refuses a window
                (a global window is not a local one); sparse MLA takes none.
            sinks: ``[H]`` fp32 sink logits of all heads, optional.
            batch: GQA under DCP: the host plan of this batch (:meth:`DecodeStep.plan
                <shardattn.runtime.decode.DecodeStep.plan>`): its metadata reaches the
                device in one copy per plan and replaces the step's index arithmetic.
            meta: GQA under DCP: that metadata already on the device (a graph's static input).
            check: under DCP, make the ranks agree on the inputs first (one small all-gather and a
                host sync). Pass ``False`` inside a CUDA graph and on an engine's later layers.
        Returns:
            ``(out [T, H/W, v_dim] in q's dtype, lse [T, H/W] fp32)``: the rank's heads, merged over
            every shard; ``lse`` is ``None`` when built with ``DecodeOptions(return_lse=False)``
            on a head-TP GQA step.
        Raises:
            ValueError / TypeError: naming the argument (on every rank under DCP when ``check``).
        """
        return self.decode_step(
            q, kv_cache, block_table, seq_lens, topk_pos=topk_pos, req_ids=req_ids, topk_length=topk_length,
            topk_unique=topk_unique, q_len_per_req=q_len_per_req, cu_q_lens=cu_q_lens, max_q_len=max_q_len,
            window_left=window_left, sinks=sinks, batch=batch, meta=meta, check=check,
        )  # fmt: skip
