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

Construction succeeds on every rank of the group or raises on every rank. It runs in two phases,
each ended on every rank by a small all-gather that carries whether the phase raised on that rank
(:func:`~shardattn.parallel.agreement.settle`): the checks of the arguments (then the host
exchange, which also compares the ranks' specs and modes), and the workspace and warm-up. A rank
whose phase raised (a bad argument, a workspace it cannot allocate, a warm-up that fails) raises
its own error; every other rank raises :class:`~shardattn.errors.PeerFailedError` naming it and
its exception at once, rather than wait for it in a later collective until the group's timeout.

The steps (:meth:`Runtime.prefill`, :meth:`Runtime.decode`) are :mod:`~shardattn.runtime.steps`'s.
Steps are routed by the planner (:mod:`shardattn.plan.routing`: path, group size, reason;
:mod:`~shardattn.runtime.planning` asks it and logs each decision at debug level) and run by the
mode's parallel step (:mod:`shardattn.runtime.modes`). A Runtime keeps no global state, so
several (different groups, different models) work side by side in one process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import cast

import torch

from shardattn._checks import check_bool, check_choice, check_int, check_scale
from shardattn.ops.dispatch import gluon_runs_on
from shardattn.parallel.agreement import settle
from shardattn.parallel.comm import Comm
from shardattn.parallel.gqa_head_tp import head_tp_kv_heads
from shardattn.parallel.groups import GroupLike
from shardattn.parallel.hosts import exchange_node_layout
from shardattn.plan.context import DCPLayout
from shardattn.plan.cost_route import resolve_cost_model
from shardattn.plan.kv_format import KV_FP8_DS_MLA, kv_format_name, kv_row_bytes
from shardattn.plan.spec import ModelSpec, get_preset
from shardattn.runtime.graphs import RuntimeGraphs
from shardattn.runtime.modes import DECODE_STEP, MODES, PREFILL_STEP, prefill_step_of
from shardattn.runtime.options import DecodeOptions, PrefillOptions, given_options
from shardattn.runtime.planning import RuntimePlanning
from shardattn.runtime.prefill import PrefillPlan
from shardattn.runtime.steps import RuntimeSteps
from shardattn.runtime.warmup import CompileKey, RuntimeWarmup
from shardattn.runtime.workspace import RuntimeWorkspace, WorkspaceExceededError, check_step

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

#: What a peer's error names when one rank's construction raised.
_CONSTRUCTION = "Runtime construction"


def _raised(work: Callable[..., None], *args: object) -> Exception | None:
    """The exception ``work(*args)`` raised, or ``None``: a phase of the construction runs to its end
    on every rank, and its all-gather carries the failure to the peers before it is re-raised."""
    try:
        work(*args)
    except Exception as e:
        return e
    return None


class Runtime(RuntimeSteps, RuntimePlanning, RuntimeGraphs, RuntimeWarmup):
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
            ``[pages, spec.page_size, 656]``), the workspace is sized for them and the warm-up compiles
            the FP8 kernel variants. A step's cache in another format is a ``ValueError`` naming
            it and the format. A property of the cache, so of both prefill and decode steps.
        host_id: this rank's host identity (default: host name and boot id,
            :func:`~shardattn.parallel.hosts.host_identity`); ranks with equal ids share a host.
            Construction exchanges them once (:attr:`nodes`), and the cost model prices ShardQ /
            PCP exchanges that cross hosts at the network's rate. A launcher passes its node rank.
            The same all-gather compares every rank's spec and mode.

    Attributes:
        nodes: the :class:`~shardattn.plan.nodes.NodeLayout` of the group (which ranks share a host).

    Raises:
        ValueError / TypeError: heads not divisible by the world size, a mode the spec cannot run
            (``shardq`` for a GQA model), bad sizes, options that are not the dataclasses.
            ValueError on every rank: the ranks were given different specs or modes (names the
            ranks that differ from the majority).
        MemoryError: the workspace cannot be allocated.
        PeerFailedError: another rank's construction raised (names it and its exception), this
            rank's did not.
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
        self.comm = Comm(group)  # resolves rank, size and backend once; counts this Runtime's collectives
        self.group = self.comm.group  # the ProcessGroup (of a DeviceMesh's dimension)
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        # the construction's own collectives (two small all-gathers), not counted with the steps'
        build = Comm(self.group, device=self.comm.device, report_grace_s=self.comm.report_grace_s)
        # every phase runs on every rank and ends in an all-gather that carries whether it raised
        # on this rank: a rank that failed raises its error, its peers a PeerFailedError naming it,
        # at once (parallel.agreement.settle), rather than wait for it in a later collective
        args = (spec, mode, max_batched_tokens, max_decode_tokens, device, scale, topk, prefill_options, decode_options)
        # a KeyboardInterrupt is not carried by the gathers (the rank leaves at once): it is reported
        # to the group's store, and the peers name it when their gather times out
        with build.reporting_failures():
            error = _raised(self._configure, *args, warmup, kv_dtype)
            # the first: the hosts, and the spec and mode every rank must share (ranks given different
            # ones all raise here, before any step)
            agree = (("Runtime spec", None if error else self.spec), ("Runtime mode", None if error else self.mode))
            self.nodes = exchange_node_layout(build, host_id, agree=agree, error=error, what=_CONSTRUCTION)
            # the second: the workspace is reserved and the kernels warmed up on every rank, or it raises on every rank
            settle(build, _CONSTRUCTION, error=_raised(self._reserve, warmup))
        log.debug("%r: steps %s", self, sorted(self.ws.step_bounds))

    def _configure(
        self,
        spec: ModelSpec | str,
        mode: str,
        max_batched_tokens: int,
        max_decode_tokens: int,
        device: torch.device | str | None,
        scale: float | None,
        topk: int | None,
        prefill_options: PrefillOptions | None,
        decode_options: DecodeOptions | None,
        warmup: bool,
        kv_dtype: str | None,
    ) -> None:
        """Check the arguments and settle the config, on this rank alone (no collective)."""
        self.spec = get_preset(spec) if isinstance(spec, str) else spec
        if not isinstance(self.spec, ModelSpec):
            raise TypeError(f"spec must be a ModelSpec or a preset name, got {type(spec).__name__}")
        check_choice("mode", mode, MODES)
        self.mode = mode
        self.max_batched_tokens = check_int("max_batched_tokens", max_batched_tokens, minimum=1)
        self.max_decode_tokens = check_int("max_decode_tokens", max_decode_tokens, minimum=1)
        # the options: PrefillOptions / DecodeOptions (shardattn.runtime.options), the defaults for None
        self.prefill_options, self.decode_options = given_options(prefill_options, decode_options)
        check_bool("warmup", warmup)
        if self.spec.kind == "gqa" and mode == "shardq":
            raise ValueError(
                "mode 'shardq' runs a sparse-MLA prefill (ShardQ), but the spec is a GQA model; use mode 'headtp' "
                "(head-TP prefill and decode), 'mixed' (head-TP prefill, DCP decode), 'pcp' or 'dcp-decode'"
            )
        # raises when the heads do not divide, naming the group's size (the Runtime takes no tp_size)
        self.heads_per_rank = self.spec.heads_per_rank(self.world_size, ranks="the group's size")
        if self.spec.kind == "gqa" and "headtp" in (prefill_step_of("gqa", mode), DECODE_STEP[mode]):
            # a head-TP step's KV heads (split, or replicated), refused here rather than at the first step
            head_tp_kv_heads(self.spec.num_heads, self.spec.num_kv_heads, self.world_size, self.rank)
        self.layout = DCPLayout(self.world_size, self.decode_options.dcp_interleave)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if self.comm.backend == "nccl" else "cpu"
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device must be a torch.device or a device string ('cuda:0'), got {device!r}") from e
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device} asked for, but no CUDA GPU is visible")
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
        spec_scale = cast(float, self.spec.softmax_scale)  # set and checked once a ModelSpec is built
        self.scale = spec_scale if scale is None else check_scale("scale", scale)
        cost_model = self.prefill_options.cost_model
        self.cost_model = (
            resolve_cost_model(cost_model, self.device) if prefill_step_of(self.spec.kind, mode) == "shardq" else None
        )

    def _reserve(self, warmup: bool) -> None:
        """Reserve the workspace and (with ``warmup``) launch every kernel variant, on this rank."""
        self.ws = RuntimeWorkspace(
            self.spec,
            self.mode,
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
        check_step(kind, step, tokens, topk)
        return self.ws.needs(kind, step, tokens, topk)

    def check_workspace(self, kind: str, step: str, *, tokens: int, topk: int | None = None) -> None:
        """Raise :class:`WorkspaceExceededError` when a step needs more of an item than was reserved
        (:meth:`RuntimeWorkspace.check`)."""
        check_step(kind, step, tokens, self.ws.topk if topk is None else topk)
        self.ws.check(kind, step, tokens=tokens, topk=topk)
