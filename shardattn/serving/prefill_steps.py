"""A pool's prefill steps: :class:`PrefillSteps` (a base of :class:`~shardattn.serving.steps.RequestSteps`).

:meth:`~PrefillSteps.prefill` takes :class:`~shardattn.serving.requests.PrefillRequest` objects
(``q [n, H, D]``, the new KV rows, sparse MLA's ``topk_pos [n, K]``), grows the ledger, and runs
the step through actor calls: the block table, lengths, KV rows and top-k once for every rank
(one ``ray.put``), each rank's heads of the queries (PCP: its tokens' queries, every head). A
step that fails on the driver before any rank runs takes its tokens back out of the ledger; a
``KeyboardInterrupt`` (or another exception) on the driver while ranks run the step breaks the
pool, as a failed step does (the ranks may still write its rows, and a decode step would run
beside it), and is raised as it is.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal, overload

import numpy as np
import torch

from shardattn._checks import check_bool
from shardattn.serving.pool_state import PoolState
from shardattn.serving.requests import PackedStep, PrefillRequest, one_host_thread, pack_step
from shardattn.serving.split import assemble, pcp_token_ids, query_parts

__all__ = ["PrefillSteps"]


class PrefillSteps(PoolState):
    """Prefill steps of a pool (a base class; the pool holds the state used here)."""

    def _run_prefill(self, packed: PackedStep, return_lse: bool, t_start: float) -> list[Any]:
        """A checked prefill step through actor calls (decode steps: :meth:`_decode_step`)."""
        import ray

        from shardattn.serving.wire import from_wire, to_wire  # NumPy: a Ray dependency

        t_packed = time.perf_counter()
        kind = "prefill"
        admitted = [rid for rid in packed.ids if rid not in self.book]  # new requests, released on undo
        refs: list[Any] = []  # the ranks' calls sent and not yet answered
        self.book.grow(list(zip(packed.ids, packed.counts)), new_ok=True)
        try:
            table = torch.from_numpy(np.array(self.book.table(packed.ids), dtype=np.int32))  # faster than from lists
            step = {
                "table": table,
                "starts": packed.starts,
                "counts": packed.counts,
                "q_counts": packed.q_counts,
                "kv": packed.kv,
                "topk": packed.topk,
                "return_lse": return_lse,
            }
            h = self.heads_per_rank
            q = packed.q
            token_ids = None
            if self.mode == "pcp" and q is not None:  # PCP (sparse MLA and GQA): every head of the rank's tokens
                token_ids = pcp_token_ids(packed.counts, packed.starts, self.world_size)
            qs: list[Any] = [None] * self.world_size if q is None else query_parts(q, self.world_size, h, token_ids)
            t_sent = time.perf_counter()
            shared_ref = ray.put(to_wire(step))  # once for every rank
            for r, a in enumerate(self._actors):
                refs.append(a.prefill.remote(shared_ref, to_wire(qs[r])))
            answered = self._call(kind, refs)
            refs = []  # every rank answered: none runs the step any more
            results = from_wire(answered)
        except BaseException as e:  # a KeyboardInterrupt while ranks run the step, or a failure before
            self._left_step(e, range(len(refs)), kind, lambda: self._undo_prefill(packed, admitted))
            raise
        t_back = time.perf_counter()
        if q is None:
            outputs: list[Any] = [None] * len(packed.ids)
        else:
            out, lse = assemble(results, token_ids, int(q.shape[0]), return_lse)
            outs = out.split(packed.q_counts)
            outputs = list(outs) if lse is None else list(zip(outs, lse.split(packed.q_counts)))
        t_end = time.perf_counter()
        self.last_step = {
            "kind": kind,
            "check_ms": (t_packed - t_start) * 1e3,  # validating and concatenating the requests
            "prepare_ms": (t_sent - t_packed) * 1e3,  # pages, block table, per-rank query views
            "ranks_ms": (t_back - t_sent) * 1e3,  # copies into the transport, both ways, and the ranks' step
            "assemble_ms": (t_end - t_back) * 1e3,  # outputs per request
        }
        return outputs

    def _undo_prefill(self, packed: PackedStep, admitted: list[Any]) -> None:
        """Take a prefill step's tokens back out of the ledger: the requests it admitted released,
        the others' lengths (and the pages they took) back."""
        self.book.release(admitted)
        new = set(admitted)
        kept = [(rid, n) for rid, n in zip(packed.ids, packed.counts) if rid not in new]
        if kept:
            ids, counts = zip(*kept)
            self.book.undo_growth(self.book.slots(list(ids)), np.array(counts, dtype=np.int64))

    @overload
    def prefill(
        self, requests: Sequence[PrefillRequest], *, return_lse: Literal[False] = ...
    ) -> list[torch.Tensor | None]: ...
    @overload
    def prefill(
        self, requests: Sequence[PrefillRequest], *, return_lse: Literal[True]
    ) -> list[tuple[torch.Tensor, torch.Tensor] | None]: ...
    @overload
    def prefill(
        self, requests: Sequence[PrefillRequest], *, return_lse: bool = ...
    ) -> list[torch.Tensor | None] | list[tuple[torch.Tensor, torch.Tensor] | None]: ...
    def prefill(self, requests: Sequence[PrefillRequest], *, return_lse: bool = False) -> list[Any]:
        """Write the requests' new KV rows into the ranks' caches and, with queries, attend.

        Args:
            requests: :class:`~shardattn.serving.requests.PrefillRequest` each (new ids admit
                requests; known ids continue a chunked prefill).
            return_lse: also return each request's LSE.
        Returns:
            one entry per request: ``out [n, H, Dv]`` (q's dtype), or ``(out, lse [n, H] fp32)``,
            or ``None`` for a request without queries. Sparse MLA attends over each token's
            top-k; GQA causally (position ``p`` over the request's positions ``<= p``).
        Raises:
            ValueError / TypeError: a bad request, or ``return_lse=True`` on a pool whose
                Runtimes skip the prefill LSE (before any rank runs; the pool stays usable).
            RankFailedError: a rank failed; the pool is broken until :meth:`restart`.
        """
        check_bool("return_lse", return_lse)
        with self._step_lock:
            self._check_usable()
            self._need_spec()
            if return_lse and not self.shapes.prefill_lse:
                raise ValueError(
                    "return_lse=True, but this pool's Runtimes skip the LSE of their prefill "
                    "(runtime_kwargs' PrefillOptions(return_lse=False))"
                )
            t0 = time.perf_counter()
            with one_host_thread(self.host_threads):
                packed = pack_step("prefill", requests, self.shapes, self.book)
                return self._run_prefill(packed, return_lse, t0)
