"""A Runtime's steps: :meth:`RuntimeSteps.prefill` and :meth:`RuntimeSteps.decode`, with their real
signatures, shapes and dtypes, on what its construction reserved and planned.

Prefill routes a planned step to the GQA steps (:mod:`~shardattn.runtime.gqa_prefill`) or the
sparse-MLA dispatch (:func:`~shardattn.runtime.prefill.run_prefill_step`: PCP, head-TP or
ShardQ, the kernel call over the workspace's union); decode runs the config's
:class:`~shardattn.runtime.decode.DecodeStep`. Queries in another dtype than the spec's allocate
their buffers per step instead of using the workspace (sized for the spec's dtype); the first such
step of a Runtime says so on the ``shardattn.runtime.steps`` logger.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch

from shardattn.ops.kv_fp8 import resolve_kv
from shardattn.plan.decode_batch import DecodeBatch
from shardattn.plan.routing import Route
from shardattn.runtime.args import check_step_flag
from shardattn.runtime.decode import DecodeStep
from shardattn.runtime.gqa_prefill import GQAInputs, run_gqa_prefill_step
from shardattn.runtime.prefill import PrefillPlan, run_prefill_step, shardq_buffers, workspace_prefill_attention
from shardattn.runtime.state import RuntimeState

__all__ = ["RuntimeSteps"]

log = logging.getLogger(__name__)

_EMPTY_WS = torch.empty(0, dtype=torch.uint8)  # a route without a union (reference path) reads no workspace


class RuntimeSteps(RuntimeState):
    """The steps of a Runtime (mixed into it; its state is the Runtime's, set at construction)."""

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
        topk_unique: bool = False,
        check: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run one prefill step (sparse MLA or GQA), routed by the planner.

        ShardQ and head-TP modes (``rt.prefill(q, kv_cache, rows, query_lens=...)``):

        Args:
            q: ``[T, H/W, D]`` fp16/bf16/fp32, this rank's heads of every new token.
            kv_cache: ``[R, D]`` the KV rows in q's dtype, or paged ``[pages, page_size, D]``
                (row ``page * page_size + i``); with ``kv_dtype="fp8_ds_mla"`` uint8 ``[R, 656]`` /
                ``[pages, page_size, 656]`` (replicated under TP; the step's new tokens' rows
                included); the value is ``kv_cache[:, :v_dim]``.
            rows: ``[T, K]`` int32 (int64 is converted) global rows of ``kv_cache`` of every
                token's top-k (``-1`` or out of range = invalid, anywhere in a row).
            topk_pos / kv_new / block_table: PCP's; ``None`` (the step reads none of them, so one
                given is refused, naming it).

        PCP (``rt.prefill(q, kv_cache, topk_pos=..., kv_new=..., block_table=..., plan=plan)``):

        Args:
            q: ``[T_r, H, D]``, every head of the rank's tokens (``plan.tokens_of(rank)``).
            kv_cache, block_table: the paged cache holding the cached prefixes (``[R, D]`` or
                ``[pages, page_size, D]``, in ``kv_new``'s format: ``fp8_ds_mla`` rows are 656
                bytes; ``[B, M]`` int32, pages of ``spec.page_size``); ``None`` without cached
                prefixes.
            topk_pos: ``[T_r, K]`` int32 positions inside each token's request (cached prefix
                included) of the rank's tokens' top-k.
            kv_new: ``[T_r, D]`` the KV rows of the rank's own new tokens (all-gathered by the step;
                uint8 ``[T_r, 656]`` with ``kv_dtype="fp8_ds_mla"``).

        GQA (``rt.prefill(q, (k_cache, v_cache), kv_new=(k, v), block_table=..., query_lens=...)``;
        :mod:`~shardattn.runtime.gqa_prefill`): head-TP in ``headtp`` / ``mixed``, PCP in ``pcp``.

        Args:
            q: head-TP ``[T, H/W, D]`` this rank's heads of every new token; PCP ``[T_r, H, D]``
                every head of the rank's tokens (``plan.tokens_of(rank)``).
            kv_cache: ``(k_cache, v_cache)``, each ``[pages, page_size, Hkv_r, D]`` in q's dtype
                (head-TP: the rank's KV heads, :func:`~shardattn.parallel.gqa_head_tp.head_tp_kv_heads`;
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
            topk_unique: sparse MLA: no row of ``rows`` (PCP: no position of ``topk_pos``) appears
                twice in a token's list (an indexer's top-k), so a per-query kernel call packs each
                token's valid rows instead of de-duplicating them first (grouped tiles and FP8 rows
                build their union as before; docs/DECISIONS.md, D107); a repeated one would then
                count twice there. The same promise as :meth:`decode`'s; ``True`` on a GQA spec is
                a ``ValueError`` (its steps read no top-k).
            sinks: ``[H]`` fp32 sink logits of all heads, given exactly when the spec has
                ``has_sinks`` (a ``ValueError`` naming ``sinks`` otherwise: a model with sinks run
                without them is wrong, and warm-up builds the sinks kernels only for such a spec).
            check: make the ranks agree on the plan and inputs first (one small all-gather and a
                host sync; turn off inside CUDA graphs or when the caller already agreed). Every
                rank passes the same value: a rank without the agreement pairs its first data
                collective with its peers' agreement (gloo aborts on the size mismatch, else the
                step fails at the group's timeout or hangs).
        Returns:
            ``(out, lse)``: ``out`` in q's dtype, ``[T, H/W, v_dim]`` in token order for this
            rank's heads (PCP: ``[T_r, H, v_dim]`` of the rank's tokens); ``lse`` fp32 ``[T, H/W]``
            (PCP ``[T_r, H]``), natural log; ``None`` with ``PrefillOptions(return_lse=False)``.
        Raises:
            ValueError / TypeError: naming the argument (on every rank of a step with collectives
                when ``check``); WorkspaceExceededError: the step is larger than the workspace.
        """
        check_step_flag(self.comm, check, collective=self._prefill_agrees)  # before any collective
        plan, given = self._prefill_inputs(
            q, kv_cache, rows, topk_pos=topk_pos, kv_new=kv_new, block_table=block_table, query_lens=query_lens,
            prefix_lens=prefix_lens, seq_lens=seq_lens, plan=plan, topk_length=topk_length, check=check,
            window_left=window_left, sinks=sinks, topk_unique=topk_unique,
        )  # fmt: skip
        options = self.prefill_options
        if isinstance(given, GQAInputs):
            return run_gqa_prefill_step(
                plan.shard, plan.gqa, q, given, comm=self.comm, kernel=self.gqa_kernel_for(q.dtype), scale=self.scale,
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
            attention=functools.partial(self._attention, route=plan.route, step=plan.step, rows_unique=topk_unique),
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
            kv_cache: sparse MLA: ``[R, D]`` or ``[pages, page_size, D]`` paged KV rows in q's
                dtype (uint8 ``[..., 656]`` with ``kv_dtype="fp8_ds_mla"``); GQA: ``(k_cache,
                v_cache)``, each ``[pages, page_size, Hkv, D]``. Under DCP this rank's shard (its
                tokens in local order: :func:`~shardattn.plan.dcp_shard.shard_kv_cache` builds
                it from a whole cache), under head-TP the whole cache (GQA: the rank's KV heads).
            block_table: ``[B, M]`` int32 page table of ``kv_cache`` (the rank's, under DCP).
            seq_lens: ``[B]`` int32 KV tokens per request, cached prefix and drafts included
                (global counts under DCP too; a list is fine). Sparse MLA: a position at or past
                it is no key. GQA: at least the request's queries (checked on a list or a CPU
                tensor, and by a DCP ``batch``'s planner).
            topk_pos: sparse MLA: ``[T, K]`` int32 top-k positions inside each token's request
                (``-1`` or out of range = invalid).
            req_ids: sparse MLA: ``[T]`` int32 request of each query token (one outside ``[0, B)``
                is padding: its entries are invalid, its row comes back as ``(0, -inf)``).
            topk_length: sparse MLA: ``[T]`` int32 leading entries of ``topk_pos`` to use, optional.
            topk_unique: sparse MLA: no position appears twice in a row of ``topk_pos`` (an
                indexer's top-k), so the kernels skip their de-duplication (most of a small step's
                time); a repeated position would then count twice. A promise about positions, which
                the step hands to the kernels as their ``rows_unique`` (distinct positions of a
                request are distinct rows of its pages). ``True`` on a GQA spec is a ``ValueError``.
            q_len_per_req / cu_q_lens: GQA: uniform queries per request, or ``[B + 1]`` int32
                offsets of ragged drafts (default: one query per request). Rows of ``q`` past
                ``cu_q_lens[-1]`` are padding (a graph bucket's): they come back as ``(0, -inf)``,
                sinks or not.
            max_q_len: GQA head-TP with ``cu_q_lens``: host bound on the drafts, at least the most
                queries of a request (checked where ``cu_q_lens`` is a list or a CPU tensor; needed
                under capture).
            window_left: GQA under head-TP: sliding window, the query at position ``p`` sees keys
                ``[p - window_left, p]`` (``-1``, the default: no window). DCP refuses a window
                (a global window is not a local one); sparse MLA takes none.
            sinks: ``[H]`` fp32 sink logits of all heads, given exactly when the spec has
                ``has_sinks`` (a ``ValueError`` naming ``sinks`` otherwise, as in :meth:`prefill`).
            batch: GQA under DCP: the host plan of this batch (:meth:`DecodeStep.plan
                <shardattn.runtime.decode.DecodeStep.plan>`): its metadata reaches the
                device in one copy per plan and replaces the step's index arithmetic, and its
                lengths replace ``seq_lens`` / ``cu_q_lens`` / ``q_len_per_req`` (with ``check``,
                those passed as host values must be the plan's); ``block_table`` then has a row per
                request slot of the plan, or per query slot (query slot ``i`` reads row ``i``).
            meta: GQA under DCP: that metadata already on the device (a graph's static input).
            check: under DCP, make the ranks agree on the inputs first (one small all-gather and a
                host sync). Pass ``False`` inside a CUDA graph and on an engine's later layers, on
                every rank alike (as :meth:`prefill`'s ``check``).
        Returns:
            ``(out [T, H/W, v_dim] in q's dtype, lse [T, H/W] fp32)``: the rank's heads, merged over
            every shard; ``lse`` is ``None`` when built with ``DecodeOptions(return_lse=False)``
            (every mode, both kinds of model).
        Raises:
            ValueError / TypeError: naming the argument (on every rank under DCP when ``check``).
        """
        check_step_flag(self.comm, check, collective=self.decode_is_dcp)  # before any collective
        return self.decode_step(
            q, kv_cache, block_table, seq_lens, topk_pos=topk_pos, req_ids=req_ids, topk_length=topk_length,
            topk_unique=topk_unique, q_len_per_req=q_len_per_req, cu_q_lens=cu_q_lens, max_q_len=max_q_len,
            window_left=window_left, sinks=sinks, batch=batch, meta=meta, check=check,
        )  # fmt: skip
