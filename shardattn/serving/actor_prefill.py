"""Prefill steps on a pool actor: the new KV rows written, then the Runtime's prefill over them.

:class:`PrefillSteps` is a part of :class:`~shardattn.serving.actor.RankActor`. Which step a rank
runs is its Runtime's (:data:`~shardattn.runtime.modes.PREFILL_STEP` /
:data:`~shardattn.runtime.modes.GQA_PREFILL_STEP`):

* **PCP** (``pcp`` mode, sparse MLA and GQA): every head of this rank's zigzag tokens
  (``plan.tokens_of(rank)``); their new KV rows, every KV head, go to the step as ``kv_new``,
  which all-gathers them. The resident cache is the DCP interleave that decode reads, while PCP
  reads a cached prefix from a paged cache the same on every rank: a chunked prefill gathers the
  requests' prefixes from the shards into a step-local paged copy (sparse MLA: flat ``[R, D]``
  rows; GQA: ``[R / page_size, page_size, Hkv, D]`` K and V), freed after the step.
* **head-TP GQA** (``headtp`` / ``mixed``): this rank's heads of every token, causal. Under
  head-TP decode the cache holds this rank's KV heads of every token, the new ones just written:
  one paged call over it. Under DCP decode the new tokens' K/V (the rank's KV heads) go as
  ``kv_new`` and the cached prefixes are gathered as under PCP, the rank's KV heads only.
* **ShardQ / head-TP sparse MLA** (``shardq`` / ``headtp`` / ``mixed``): this rank's heads of
  every token over the requests' whole KV (a chunked prefill's prefix gathered from the shards),
  each token's top-k turned into rows of it.

Every step returns ``(out, lse or None)`` of the rows and heads it was given, token order, on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardattn.parallel.gqa_head_tp import head_tp_kv_heads
from shardattn.serving.wire import from_wire

__all__ = ["PrefillSteps"]


class PrefillSteps:
    """The prefill steps of a pool actor (module docstring)."""

    # the actor's own (:class:`~shardattn.serving.actor.RankActor`)
    rank: int
    world_size: int
    device: torch.device
    runtime: Any
    cache: Any
    comm: Any
    sinks: torch.Tensor | None
    topk_unique: bool
    _begin: Callable[[str], float]
    _maybe_fail: Callable[[str], None]
    _end: Callable[[float], None]
    _result: Callable[[torch.Tensor, torch.Tensor | None, bool], tuple[Any, Any]]

    def prefill(self, shared: dict[str, Any], q_local: Any) -> tuple[Any, Any] | None:
        """Write the step's KV rows; with queries, run the Runtime's prefill over the requests' whole KV.

        ``q_local``: ``[T, H/W, D]`` this rank's heads (``None``: only write); under ``pcp``
        ``[T_r, H, D]`` every head of this rank's zigzag tokens. Returns ``(out, lse or None)``
        of the same rows and heads (``[T, H/W, Dv]`` / ``[T_r, H, Dv]``), token order.
        """
        t0 = self._begin("prefill")
        shared, q_local = from_wire(shared), from_wire(q_local)
        table, starts, counts = shared["table"], shared["starts"], shared["counts"]
        self.cache.write(table, starts, counts, shared["kv"])
        self._maybe_fail("prefill")
        if q_local is None:
            self._end(t0)
            return None
        if self.runtime.mode == "pcp":
            step = self._prefill_pcp
        else:
            step = self._prefill_gqa if self.runtime.spec.kind == "gqa" else self._prefill_sparse
        out, lse = step(shared, table, starts, counts, q_local.to(self.device))
        result = self._result(out, lse, shared["return_lse"])
        self._end(t0)
        return result

    def _prefill_sparse(
        self, shared: dict[str, Any], table: torch.Tensor, starts: list[int], counts: list[int], q: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sparse MLA by ShardQ or head-TP (``q [T, H/W, D]``: this rank's heads of every new token)
        over each token's top-k rows of the requests' whole KV, laid end to end."""
        lens = [s + n for s, n in zip(starts, counts)]
        if any(starts):  # chunked prefill: the cached prefix lives on every rank's shard
            kv_full = torch.cat(self.cache.gather_full(table, lens, self.comm))
        else:
            kv_full = self.cache.as_stored(shared["kv"][0].to(self.device))
        lens_t = torch.tensor(lens, dtype=torch.int64)
        first = torch.cumsum(lens_t, 0) - lens_t
        req = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(counts))
        pos = shared["topk"].to(torch.int64)
        valid = (pos >= 0) & (pos < lens_t[req][:, None])
        rows = torch.where(valid, first[req][:, None] + pos, -1).to(torch.int32)
        return self.runtime.prefill(
            q, kv_full, rows.to(self.device), query_lens=counts, prefix_lens=starts, sinks=self.sinks,
            topk_unique=self.topk_unique, check=False,
        )  # fmt: skip

    def _prefill_pcp(
        self, shared: dict[str, Any], table: torch.Tensor, starts: list[int], counts: list[int], q: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """PCP (``q [T_r, H, D]``: every head of this rank's zigzag tokens): the tokens' new KV rows
        as ``kv_new`` (all-gathered by the step), cached prefixes from a step-local paged copy
        gathered from the interleaved shards. Sparse MLA over each token's top-k, GQA causal.
        Returns ``(out [T_r, H, Dv], lse [T_r, H] fp32 or None)``."""
        rt, dev = self.runtime, self.device
        plan = rt.plan_prefill(counts, starts)
        ids = plan.tokens_of(self.rank)
        kv_new = [part.index_select(0, ids).to(dev) for part in shared["kv"]]
        cached = any(starts)
        if rt.spec.kind == "gqa":  # every KV head: PCP splits tokens, not heads
            heads = [(0, rt.spec.num_kv_heads)] * self.world_size
            kv_cache, block_table = self._prefix_pages(table, starts, (0, 1), heads) if cached else (None, None)
            return rt.prefill(
                q, kv_cache, kv_new=(kv_new[0], kv_new[1]), block_table=block_table, plan=plan, sinks=self.sinks,
                check=False,
            )  # fmt: skip
        topk = shared["topk"].index_select(0, ids).to(dev)
        kv_cache, block_table = self._prefix_pages(table, starts) if cached else (None, None)
        return rt.prefill(
            q, None if kv_cache is None else kv_cache[0], topk_pos=topk, kv_new=self.cache.as_stored(kv_new[0]),
            block_table=block_table, plan=plan, sinks=self.sinks, topk_unique=self.topk_unique, check=False,
        )  # fmt: skip

    def _prefill_gqa(
        self, shared: dict[str, Any], table: torch.Tensor, starts: list[int], counts: list[int], q: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """GQA by head-TP (``q [T, H/W, D]``: this rank's heads of every new token), causal over each
        request's cached prefix and new tokens (module docstring: the cache under each decode).
        Returns ``(out [T, H/W, Dv], lse [T, H/W] fp32 or None)``."""
        dev, rt = self.device, self.runtime
        kv_cache: tuple[torch.Tensor, ...] | None
        block_table: torch.Tensor | None
        kv_new: tuple[torch.Tensor, ...] | None = None
        if rt.decode_is_dcp:
            heads = [head_tp_kv_heads(rt.spec.num_heads, rt.spec.num_kv_heads, self.world_size, r)
                     for r in range(self.world_size)]  # fmt: skip
            lo, hi = heads[self.rank]
            kv_new = tuple(part[:, lo:hi].to(dev).contiguous() for part in shared["kv"])
            kv_cache, block_table = self._prefix_pages(table, starts, (0, 1), heads) if any(starts) else (None, None)
        else:  # the cache holds this rank's KV heads of every token, the new ones included
            kv_cache, block_table = (self.cache.pages[0], self.cache.pages[1]), table.to(dev)
        return rt.prefill(
            q, kv_cache, kv_new=kv_new, block_table=block_table, query_lens=counts, prefix_lens=starts,
            sinks=self.sinks, check=False,
        )  # fmt: skip

    def _prefix_pages(
        self,
        table: torch.Tensor,
        starts: list[int],
        components: tuple[int, ...] = (0,),
        heads: Sequence[tuple[int, int]] | None = None,
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """The cached prefixes as a step-local paged copy gathered from the interleaved shards, with
        its ``[B, M]`` int32 block table. Per component of ``components``: flat ``[R, D]`` rows (sparse
        MLA, as PCP reads them; an all-gather), or with ``heads`` (per rank, ``[start, stop)`` of a
        GQA row's KV heads that rank keeps: an all-to-all of just those where they differ between
        ranks, else an all-gather) paged ``[R / page_size, page_size, stop - start, D]`` of this
        rank's heads."""
        p = self.cache.page_size
        pages = [-(-n // p) for n in starts]
        block_table = torch.zeros(len(starts), max(1, max(pages)), dtype=torch.int32)
        first = 0
        for b, k in enumerate(pages):
            block_table[b, :k] = torch.arange(first, first + k, dtype=torch.int32)
            first += k
        copies = []
        for i in components:
            prefixes = self.cache.gather_full(table, starts, self.comm, i, rank_heads=heads)
            row = self.cache.row_specs[i][0]
            if heads is not None:
                lo, hi = heads[self.rank]
                row = (hi - lo, *row[1:])
            rows = self.cache.flat(i).new_zeros(max(1, sum(pages)) * p, *row)
            for b, n in enumerate(starts):
                row0 = int(block_table[b, 0]) * p  # a request's pages are consecutive
                rows[row0 : row0 + n] = prefixes[b]
            copies.append(rows if heads is None else rows.view(-1, p, *row))
        return tuple(copies), block_table.to(self.device)
