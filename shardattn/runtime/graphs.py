"""The CUDA-graph side of a Runtime: the planner's level for its steps, and decode capture.

:class:`RuntimeGraphs` is a part of :class:`~shardattn.runtime.runtime.Runtime` (it reads the
Runtime's spec, mode, group size and routes); it keeps the capture logic out of the Runtime's
own module. :class:`DecodeGraphs` builds on :meth:`RuntimeGraphs.capture_decode` for the DCP GQA
step: graph buckets of one draft length ``Q``, each step padded to the smallest captured size
(ragged drafts padded to ``Q`` queries a request, the padding seeing no key), replayed, the real
queries' rows returned; above the largest bucket the lean eager step runs and
:attr:`DecodeGraphs.last_route` says why.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from shardattn._checks import check_choice, check_int
from shardattn.plan.cudagraph import CGSupport, explain_cudagraph_support
from shardattn.runtime.args import check_sinks_declared, reject
from shardattn.runtime.cudagraph import GraphInput, GraphRunner
from shardattn.runtime.graph_capture import check_capture_allowed
from shardattn.runtime.modes import prefill_step_of
from shardattn.runtime.state import RuntimeState

__all__ = ["DecodeGraphs", "RuntimeGraphs"]


class RuntimeGraphs(RuntimeState):
    """CUDA-graph policy and decode capture of a Runtime (mixed into it; no state of its own)."""

    def explain_cudagraph_support(self, step: str = "decode") -> tuple[CGSupport, str]:
        """The planner's CUDA-graph level for this Runtime's ``"decode"`` or ``"prefill"`` steps, with why."""
        check_choice("step", step, ("decode", "prefill"))
        if step == "decode":
            kernel = self.decode_route.path
            dcp = self.world_size if self.decode_is_dcp else 1
            return explain_cudagraph_support(
                "decode", kernel, head_dim=self.spec.head_dim, dcp_size=dcp, non_causal=not self.causal,
                host_meta=self.spec.kind == "gqa",  # the DCP GQA step takes host-planned metadata
            )  # fmt: skip
        prefill = prefill_step_of(self.spec.kind, self.mode)
        if prefill is None:
            return CGSupport.NEVER, f"mode {self.mode!r} has no prefill step"
        if self.spec.kind == "gqa":  # head-TP or PCP over FA4 (or the reference): never captured
            cg_mode = "pcp" if prefill == "pcp" else "prefill"
            return explain_cudagraph_support(cg_mode, self.gqa_prefill_route.path, head_dim=self.spec.head_dim)
        route = self._route(self.heads_per_rank, self.max_batched_tokens, self.max_kv_rows)
        kernel = "reference" if route.path == "reference" else "triton"
        cg_mode = {"shardq": "shardq", "pcp": "pcp", "headtp": "prefill"}[prefill]
        return explain_cudagraph_support(cg_mode, kernel, head_dim=self.spec.head_dim)

    def cudagraph_support(self, step: str = "decode") -> CGSupport:
        """The planner's CUDA-graph level for this Runtime's ``"decode"`` or ``"prefill"`` steps."""
        return self.explain_cudagraph_support(step)[0]

    def check_capture(
        self, step: str = "decode", *, q_len_per_req: int = 1, ragged: bool = False, padded: bool = False
    ) -> None:
        """Raise ``ValueError`` when the policy forbids capturing such a step (the message names the level)."""
        level, why = self.explain_cudagraph_support(step)
        try:
            check_capture_allowed(level, q_len_per_req=q_len_per_req, ragged=ragged, padded=padded)
        except ValueError as e:
            raise ValueError(f"Runtime(mode={self.mode!r}) {step}: {e} [{why}]") from None

    def capture_decode(
        self,
        fn: Callable[..., Any],
        inputs: Sequence[GraphInput],
        *,
        batch_sizes: Sequence[int],
        q_len_per_req: int = 1,
        ragged: bool = False,
        capture: bool = True,
    ) -> GraphRunner:
        """Capture a decode step at several padded batch sizes (buckets), when the policy allows it.

        ``fn(**inputs)`` is typically a closure over this Runtime's :meth:`decode`;
        :class:`~shardattn.runtime.graphs.DecodeGraphs` is the ready-made one for DCP GQA
        (host-planned metadata, ragged drafts padded to ``q_len_per_req``).

        Args:
            ragged: steps may be ragged batches padded to ``q_len_per_req`` queries per request.
            capture: capture now (default); ``False`` returns a runner that is never captured
                (no policy check: it pads, validates and runs eagerly; on the CPU too).
        Raises:
            ValueError: the mode's CUDA-graph level forbids the capture (names the level and why).
        """
        if capture:
            self.check_capture("decode", q_len_per_req=q_len_per_req, ragged=ragged, padded=True)
        runner = GraphRunner(
            fn,
            inputs,
            support=self.cudagraph_support("decode") if capture else None,
            batch_sizes=batch_sizes,
            q_len_per_req=q_len_per_req,
            ragged=ragged,
            device=self.device,
        )
        return runner.capture() if capture else runner


class DecodeGraphs:
    """Captured DCP GQA decode steps of one Runtime, one graph per batch size (a bucket).

    Args:
        runtime: a :class:`~shardattn.runtime.runtime.Runtime` of a GQA spec with DCP decode.
        kv_cache: ``(k_cache, v_cache)`` this rank's paged shard (fixed for the graphs' life).
        batch_sizes: request counts to capture (the largest times ``q_len`` at most the Runtime's
            ``max_decode_tokens``: a bucket's step runs every slot, else a ``ValueError`` naming both).
            q_len: queries per request slot (drafts).
        max_pages: block-table width. sinks: ``[H]`` fp32 sink logits (fixed), given exactly when
            the spec has ``has_sinks`` (else a ``ValueError`` naming ``sinks``).
        capture: capture now (needs CUDA); ``False`` keeps a runner that pads and runs eagerly
            (CPU tests of the host logic).

    Steps take ``q`` in the Runtime's dtype (the spec's ``dtype``; the graphs' buffers hold it): on
    the CPU, a spec built with ``dtype=torch.float32`` for fp32 queries.
    """

    def __init__(
        self,
        runtime: Any,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        *,
        batch_sizes: list[int] | tuple[int, ...],
        q_len: int = 1,
        max_pages: int,
        sinks: torch.Tensor | None = None,
        capture: bool = True,
    ) -> None:
        if runtime.spec.kind != "gqa" or not runtime.decode_is_dcp:
            raise ValueError("DecodeGraphs captures the DCP GQA decode step (a GQA spec in mode 'dcp-decode')")
        try:  # what every captured step passes: refused now, not in a warm-up run before a capture
            check_sinks_declared(sinks, has_sinks=runtime.spec.has_sinks, heads=runtime.spec.num_heads)
        except ValueError as e:  # the peers' first step names this rank when its collective fails
            reject(runtime.comm, e, collective=True, check=False)
        self.rt, self.kv_cache, self.sinks = runtime, kv_cache, sinks
        self.q_len = check_int("q_len", q_len, minimum=1)
        # a bucket's step runs every slot of it (padding included): the largest must fit the
        # Runtime's decode workspace, or its first step fails however few real queries it holds
        largest = max((check_int("batch_sizes[]", b, minimum=1) for b in batch_sizes), default=0)
        if largest * self.q_len > runtime.max_decode_tokens:
            why = ValueError(
                f"batch_sizes: the largest bucket, {largest} requests of q_len={self.q_len} queries, steps "
                f"{largest * self.q_len} query rows (its padding included), past the Runtime's max_decode_tokens="
                f"{runtime.max_decode_tokens}; capture smaller buckets or build the Runtime with max_decode_tokens >= "
                f"{largest * self.q_len}"
            )
            reject(runtime.comm, why, collective=True, check=False)
        self.max_pages = check_int("max_pages", max_pages, minimum=1)
        h, d = runtime.heads_per_rank, runtime.spec.head_dim
        inputs = [
            GraphInput("q", (h, d), runtime.dtype, per="token"),
            GraphInput("block_table", (self.max_pages,), torch.int32),
            GraphInput("seq_lens", (), torch.int32),
            GraphInput("kv_lens", (), torch.int32, per="token"),  # metadata row 0: 0 = padding
            GraphInput("kv_req", (), torch.int32, per="token"),  # metadata row 1
        ]
        self.runner: GraphRunner = runtime.capture_decode(
            self._step, inputs, batch_sizes=batch_sizes, q_len_per_req=self.q_len, ragged=True, capture=capture
        )
        self.last_route: tuple[int | None, str] = (None, "no step yet")

    def _step(
        self,
        q: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        kv_lens: torch.Tensor,
        kv_req: torch.Tensor,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        out, lse = self.rt.decode(
            q, self.kv_cache, block_table, seq_lens, meta=(kv_lens, kv_req), sinks=self.sinks, check=False
        )
        return out if lse is None else (out, lse)  # a graph's outputs are tensors: out alone without the LSE

    def __call__(
        self,
        q: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: Sequence[int] | np.ndarray | torch.Tensor,
        qo_indptr: Sequence[int] | np.ndarray | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One step: ``q [T, H/W, D]`` (real queries, request order), ``block_table [B, max_pages]``
        int32 (this rank's), ``seq_lens [B]`` and ``qo_indptr [B+1]`` host lengths (``None``: one
        query per request). Returns ``(out [T, H/W, D], lse [T, H/W])`` of the real queries only
        (``lse`` ``None`` when the Runtime was built with ``DecodeOptions(return_lse=False)``).
        """
        step = self.rt.decode_step
        b = len(seq_lens) if not isinstance(seq_lens, torch.Tensor) else int(seq_lens.shape[0])
        if qo_indptr is None and self.q_len > 1:  # one query each, in the graphs' slots too (a plan's None is q_len)
            qo_indptr = np.arange(b + 1)
        padded, why = self.runner.route(b) if b else (None, "eager: an empty batch")
        longest = int(np.diff(np.asarray(qo_indptr)).max()) if qo_indptr is not None and b else 1
        if padded is not None and longest > self.q_len:
            padded, why = None, f"eager: a request has {longest} queries, more than q_len={self.q_len} the graphs hold"
        plan = None if padded is None else step.plan(seq_lens, qo_indptr, q_len=self.q_len, padded_requests=b)
        if plan is None:
            self.last_route = (None, why)
            batch = step.plan(seq_lens, qo_indptr)
            # an asynchronous copy (a blocking one waits for the stream): the plan's lengths leave
            # pageable memory before the call returns
            lens = batch.seq_lens.to(q.device, non_blocking=True)
            return self.rt.decode(q, self.kv_cache, block_table, lens, batch=batch, sinks=self.sinks, check=False)
        self.last_route = (padded, why + (f"; {plan.padding_queries} padding queries" if plan.padding_queries else ""))
        q_slots = q if plan.identity_rows else plan.pad_rows(q, name="q")
        outputs = self.runner.run(
            b, q=q_slots, block_table=block_table, seq_lens=plan.seq_lens, kv_lens=plan.meta[0], kv_req=plan.meta[1]
        ) if self.runner.graphs else self.runner.eager(
            b, q=q_slots, block_table=block_table, seq_lens=plan.seq_lens, kv_lens=plan.meta[0], kv_req=plan.meta[1]
        )  # fmt: skip
        out, lse = (outputs[0], outputs[1]) if isinstance(outputs, tuple) else (outputs, None)
        return plan.real_rows(out), None if lse is None else plan.real_rows(lse)

    def eager(
        self,
        q: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: Sequence[int] | np.ndarray | torch.Tensor,
        qo_indptr: Sequence[int] | np.ndarray | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The same padded step run eagerly on the graphs' buffers (the replay's bitwise reference)."""
        graphs, self.runner.graphs = self.runner.graphs, {}
        try:
            return self(q, block_table, seq_lens, qo_indptr)
        finally:
            self.runner.graphs = graphs
