"""Graph buckets of a Runtime's DCP GQA decode step: pad, replay, or run eagerly above the buckets.

An engine captures once, at start-up, a graph per batch size of a list (like its own capture
sizes) at one draft length ``Q``; each step then::

    plan   = host plan of the batch in Q-query slots   (plan_decode_batch: metadata, padding)
    bucket = smallest captured size >= requests         (GraphRunner.route)
    load   = metadata (host, pinned: one copy) + q, block table (device: one fused copy)
    replay the bucket's graph; return the real queries' rows (padding never comes back)

A ragged batch (``1 <= n_b <= Q`` queries) is padded to ``Q`` per request: its padding queries
see no key (local length 0 in the metadata), so the step is a uniform batch and replays a
UNIFORM_BATCH graph. A batch with more requests than the largest bucket, or a request with more
than ``Q`` queries, runs the lean eager step (host-planned metadata, no padding) and
:attr:`DecodeGraphs.last_route` says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from shardattn._checks import check_int
from shardattn.runtime.cudagraph import GraphInput, GraphRunner

__all__ = ["DecodeGraphs"]


class DecodeGraphs:
    """Captured DCP GQA decode steps of one Runtime, one graph per batch size (a bucket).

    Args:
        runtime: a :class:`~shardattn.runtime.runtime.Runtime` of a GQA spec with DCP decode.
        kv_cache: ``(k_cache, v_cache)`` this rank's paged shard (fixed for the graphs' life).
        batch_sizes: request counts to capture. q_len: queries per request slot (drafts).
        max_pages: block-table width. sinks: ``[H]`` fp32 sink logits, optional (fixed).
        capture: capture now (needs CUDA); ``False`` keeps a runner that pads and runs eagerly
            (CPU tests of the host logic).
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
        self.rt, self.kv_cache, self.sinks = runtime, kv_cache, sinks
        self.q_len = check_int("q_len", q_len, minimum=1)
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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = self.rt.decode(
            q, self.kv_cache, block_table, seq_lens, meta=(kv_lens, kv_req), sinks=self.sinks, check=False
        )
        assert lse is not None  # DCP always returns the LSE
        return out, lse

    def __call__(
        self,
        q: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: Sequence[int] | np.ndarray | torch.Tensor,
        qo_indptr: Sequence[int] | np.ndarray | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step: ``q [T, H/W, D]`` (real queries, request order), ``block_table [B, max_pages]``
        int32 (this rank's), ``seq_lens [B]`` and ``qo_indptr [B+1]`` host lengths (``None``: one
        query per request). Returns ``(out [T, H/W, D], lse [T, H/W])`` of the real queries only.
        """
        step = self.rt.decode_step
        b = len(seq_lens) if not isinstance(seq_lens, torch.Tensor) else int(seq_lens.shape[0])
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
            out, lse = self.rt.decode(q, self.kv_cache, block_table, lens, batch=batch, sinks=self.sinks, check=False)
            assert lse is not None
            return out, lse
        self.last_route = (padded, why + (f"; {plan.padding_queries} padding queries" if plan.padding_queries else ""))
        q_slots = q if plan.identity_rows else plan.pad_rows(q)
        out, lse = self.runner.run(
            b, q=q_slots, block_table=block_table, seq_lens=plan.seq_lens, kv_lens=plan.meta[0], kv_req=plan.meta[1]
        ) if self.runner.graphs else self.runner.eager(
            b, q=q_slots, block_table=block_table, seq_lens=plan.seq_lens, kv_lens=plan.meta[0], kv_req=plan.meta[1]
        )  # fmt: skip
        return plan.real_rows(out), plan.real_rows(lse)

    def eager(
        self,
        q: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: Sequence[int] | np.ndarray | torch.Tensor,
        qo_indptr: Sequence[int] | np.ndarray | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same padded step run eagerly on the graphs' buffers (the replay's bitwise reference)."""
        graphs, self.runner.graphs = self.runner.graphs, {}
        try:
            return self(q, block_table, seq_lens, qo_indptr)
        finally:
            self.runner.graphs = graphs
