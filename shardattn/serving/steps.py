"""The request API of a :class:`~shardattn.serving.pool.RayRankPool`: prefill and decode steps.

:class:`RequestSteps` is the pool's base: :meth:`~RequestSteps.prefill` (request objects, actor
calls), :meth:`~RequestSteps.decode` (request objects, checked one by one) and
:meth:`~RequestSteps.decode_batch` (a whole step's tensors, checked with array operations); both
decode APIs run the same step (:meth:`~RequestSteps._decode_step`) through the pool's decode
transport (:func:`~shardattn.serving.transport.decode_on_ranks`). Its own base,
:class:`~shardattn.serving.rank_calls.RankCalls`, makes the fault-checked calls to the ranks; the
pool provides the state they use: its ledger (``book``), ``shapes``, actors and transport.

One step runs at a time (the pool's lock: a step called from another thread waits), and a step
that fails on the driver after its checks, before any rank runs, takes its tokens back out of the
ledger, so no later step reads a token that was never written.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any, Literal, overload

import numpy as np
import torch

from shardattn._checks import check_bool, check_int, check_tensor
from shardattn.plan.kv_pages import PagedKVBook
from shardattn.plan.spec import ModelSpec
from shardattn.serving.errors import RankStepError
from shardattn.serving.pool_shapes import PoolShapes
from shardattn.serving.rank_calls import RankCalls
from shardattn.serving.requests import (
    BatchStep,
    DecodeRequest,
    PackedStep,
    PrefillRequest,
    check_decode_batch,
    one_host_thread,
    pack_step,
)
from shardattn.serving.split import assemble, pcp_token_ids, query_parts
from shardattn.serving.transport import decode_on_ranks

__all__ = ["RequestSteps"]


class RequestSteps(RankCalls):
    """Prefill and decode steps of a pool (its base class; the pool holds the state used here)."""

    book: PagedKVBook
    shapes: PoolShapes
    #: the model (``None``: a pool formed for :meth:`run` only, which serves no request)
    spec: ModelSpec | None
    mode: str
    heads_per_rank: int
    transport: str
    host_threads: int
    last_step: dict[str, Any]
    #: whether a decode step can return the LSE (not a head-TP GQA pool whose Runtimes skip it)
    _decode_lse: bool
    #: steps that wrote their inputs over the shared-memory staging rows, and the count each
    #: thread saw when it last took them from :meth:`step_inputs` (its views are stale after)
    _staging_writes: int
    _staging_seen: dict[int, int]

    def _need_spec(self) -> ModelSpec:
        """The pool's model; ``RuntimeError`` on a pool formed without one."""
        if self.spec is None:
            raise RuntimeError("this pool was formed without a spec; pass spec= to serve requests")
        return self.spec

    def _run_prefill(self, packed: PackedStep, return_lse: bool, t_start: float) -> list[Any]:
        """A checked prefill step through actor calls (decode steps: :meth:`_decode_step`)."""
        import ray

        from shardattn.serving.wire import from_wire, to_wire  # NumPy: a Ray dependency

        t_packed = time.perf_counter()
        kind = "prefill"
        admitted = [rid for rid in packed.ids if rid not in self.book]  # new requests, released on undo
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
            refs = [a.prefill.remote(shared_ref, to_wire(qs[r])) for r, a in enumerate(self._actors)]
            results = from_wire(self._call(kind, refs))
        except Exception:  # the ranks did not run the step (else the pool is broken): the ledger as it was
            if self._broken is None:
                self._undo_prefill(packed, admitted)
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

    @overload
    def decode(self, requests: Sequence[DecodeRequest], *, return_lse: Literal[False] = ...) -> list[torch.Tensor]: ...
    @overload
    def decode(
        self, requests: Sequence[DecodeRequest], *, return_lse: Literal[True]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]: ...
    @overload
    def decode(
        self, requests: Sequence[DecodeRequest], *, return_lse: bool = ...
    ) -> list[torch.Tensor] | list[tuple[torch.Tensor, torch.Tensor]]: ...
    def decode(self, requests: Sequence[DecodeRequest], *, return_lse: bool = False) -> list[Any]:
        """One decode step of prefilled requests (DCP under ``mixed`` / ``dcp-decode``), as request
        objects: each is checked (errors name the request), then the step runs as :meth:`decode_batch`.

        Returns one ``out [Q, H, Dv]`` (or ``(out, lse [Q, H])``) per request; raises as :meth:`prefill`.
        """
        self._check_decode_lse(return_lse)
        with self._step_lock:
            self._check_usable()
            self._need_spec()
            t0 = time.perf_counter()
            self._check_stale_requests(requests)
            into = self._decoder.inputs() if self.transport == "shm" and self._decoder is not None else None
            with one_host_thread(self.host_threads):
                packed = pack_step("decode", requests, self.shapes, self.book, into=into)  # shm: into the region
                self._staging_writes += into is not None  # over step_inputs() views: to be taken again
                q = packed.queries()
                i64 = np.int64
                batch = BatchStep(
                    self.book.slots(packed.ids), np.array(packed.starts, dtype=i64), np.array(packed.counts, dtype=i64),
                    np.array(packed.q_counts, dtype=i64), q, packed.topk, packed.kv,
                )  # fmt: skip
                out, lse = self._decode_step(batch, return_lse, t0, None, False)
                t_split = time.perf_counter()
                outs = out.split(packed.q_counts)
                result = list(zip(outs, lse.split(packed.q_counts))) if lse is not None else list(outs)
                self.last_step["assemble_ms"] += (time.perf_counter() - t_split) * 1e3
                return result

    @overload
    def decode_batch(
        self, request_ids: Any, q: torch.Tensor, topk_pos: torch.Tensor | None = ..., *, query_lens: Any = ...,
        kv: Any = ..., return_lse: Literal[False] = ..., out: torch.Tensor | None = ..., view: bool = ...,
    ) -> tuple[torch.Tensor, None]: ...  # fmt: skip
    @overload
    def decode_batch(
        self, request_ids: Any, q: torch.Tensor, topk_pos: torch.Tensor | None = ..., *, query_lens: Any = ...,
        kv: Any = ..., return_lse: Literal[True], out: torch.Tensor | None = ..., view: bool = ...,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip
    @overload
    def decode_batch(
        self, request_ids: Any, q: torch.Tensor, topk_pos: torch.Tensor | None = ..., *, query_lens: Any = ...,
        kv: Any = ..., return_lse: bool = ..., out: torch.Tensor | None = ..., view: bool = ...,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...  # fmt: skip
    def decode_batch(
        self,
        request_ids: Any,
        q: torch.Tensor,
        topk_pos: torch.Tensor | None = None,
        *,
        query_lens: Any = None,
        kv: Any = None,
        return_lse: bool = False,
        out: torch.Tensor | None = None,
        view: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode step given as whole-step tensors (CPU): no Python work per request.

        The fewest copies on the driver: write the step's inputs into :meth:`step_inputs` (under
        ``transport="shm"``, the leading rows of the shared-memory region, which the step then
        does not copy again) and take the outputs with ``view=True``.

        Args:
            request_ids: ``[B]`` int64 tensor of distinct prefilled request ids (the pool's ids
                being ints; looked up vectorised), or a sequence of any ids.
            q: ``[T, H, D]`` the step's queries (the model's dtype), request-major.
            topk_pos: ``[T, K]`` int32 (int64 is converted) top-k positions inside each token's
                request (sparse MLA; ``-1`` / out of range invalid); ``None`` for GQA.
            query_lens: ``[B]`` int64 query tokens per request (default: one each, ``T == B``).
            kv: the ``T`` tokens' KV rows (sparse MLA ``[T, D]``; GQA ``(k [T, Hkv, D], v [T,
                Hkv, Dv])``), appended before the step attends; ``None``: attend over the cache.
            return_lse: also return the LSE.
            out: optional ``[T, H, Dv]`` destination (q's dtype, CPU, contiguous), reused across steps.
            view: return the outputs where the transport left them, without a copy: under
                ``shm`` views of the region, **valid only until the next step** (which overwrites
                them); the other transports return fresh tensors either way. Not with ``out``.
        Returns:
            ``(out [T, H, Dv], lse [T, H] fp32 or None)``, token order; request ``b``'s rows are
            ``out.split(query_lens.tolist())[b]``.
        Raises:
            ValueError / TypeError: naming the argument (``request_ids[i]`` for an unknown or
                repeated request, or one past ``max_seq_len``), before any rank runs; the pool
                stays usable. RankFailedError: a rank failed; the pool is broken until :meth:`restart`.
        """
        self._check_decode_lse(return_lse)
        check_bool("view", view)
        if view and out is not None:
            raise ValueError("view=True returns the transport's own buffers; it takes no out")
        with self._step_lock:
            self._check_usable()
            spec = self._need_spec()
            overwrites = self._check_staging(q, topk_pos, kv)
            t0 = time.perf_counter()
            with one_host_thread(self.host_threads):
                batch = check_decode_batch(
                    self.shapes, self.book, request_ids, q, topk_pos, query_lens=query_lens, kv=kv
                )
                if out is not None:
                    check_tensor("out", out, dtypes=(self.shapes.dtype,), device=torch.device("cpu"),
                                 shape=(batch.num_tokens, self.shapes.heads, spec.v_dim))  # fmt: skip
                    if not out.is_contiguous():
                        raise ValueError("out must be contiguous")
                self._staging_writes += overwrites  # checked: its inputs go over the staging rows
                return self._decode_step(batch, return_lse, t0, out, view)

    def step_inputs(self, num_tokens: int) -> dict[str, Any]:
        """Where a decode step of ``num_tokens`` query tokens may be written before
        :meth:`decode_batch`: ``{"q": [T, H, D], "topk_pos": [T, K] int32 (sparse MLA), "kv": [T, D]
        (GQA: (k, v))}``. Under ``transport="shm"`` these are the shared-memory region's leading
        rows, which :meth:`decode_batch` then does not copy: one staging area per pool, so one
        thread at a time may fill it. A step given other tensors (or :meth:`decode`'s requests)
        writes them over those rows: :meth:`decode_batch` then refuses this thread's views until
        it takes them again here. Elsewhere, fresh tensors.

        Raises ValueError: ``num_tokens`` outside ``1 .. max_decode_tokens``.
        """
        self._check_usable()
        self._need_spec()
        check_int("num_tokens", num_tokens, minimum=1)
        shapes = self.shapes
        if num_tokens > shapes.max_decode_tokens:
            raise ValueError(f"num_tokens={num_tokens} is over the pool's max_decode_tokens={shapes.max_decode_tokens}")
        if self.transport == "shm" and self._decoder is not None:
            region = self._decoder.inputs()
            with self._step_lock:
                self._staging_seen[threading.get_ident()] = self._staging_writes
        else:
            t = num_tokens
            region = {"q": torch.empty(t, shapes.heads, shapes.head_dim, dtype=shapes.dtype)}
            if shapes.kind == "sparse_mla":
                region["topk"] = torch.empty(t, shapes.topk, dtype=torch.int32)
            for i, (row, dt) in enumerate(shapes.kv_rows):
                region[f"kv{i}"] = torch.empty(t, *row, dtype=dt)
        kv = [region[f"kv{i}"][:num_tokens] for i in range(len(shapes.kv_rows))]
        views: dict[str, Any] = {"q": region["q"][:num_tokens], "kv": kv[0] if len(kv) == 1 else tuple(kv)}
        if "topk" in region:
            views["topk_pos"] = region["topk"][:num_tokens]
        return views

    def _check_staging(self, q: object, topk_pos: object, kv: object) -> bool:
        """Under ``transport="shm"``, whether the step will copy any of its inputs over the staging
        rows (one that is not its own leading rows there). An input on those rows (``q``,
        ``topk_pos``, ``kv``; ``kv[i]`` of a ``(k, v)`` pair) must be this thread's views from
        :meth:`step_inputs` with no step written over them since (``ValueError`` naming it)."""
        if self.transport != "shm" or self._decoder is None:
            return False
        rows = self._decoder.inputs()
        given: list[tuple[str, object, str]] = [("q", q, "q"), ("topk_pos", topk_pos, "topk")]
        if isinstance(kv, tuple | list):
            given += [(f"kv[{i}]", part, f"kv{i}") for i, part in enumerate(kv)]
        elif kv is not None:
            given.append(("kv", kv, "kv0"))
        copies = False
        for name, t, key in given:
            if not isinstance(t, torch.Tensor):
                continue
            self._refuse_stale(name, t)
            own = rows.get(key)
            copies |= own is None or t.data_ptr() != own.data_ptr() or t.stride() != own.stride()
        return copies

    def _refuse_stale(self, name: str, t: torch.Tensor) -> None:
        """``ValueError`` naming ``name`` when ``t`` lies on the staging rows (shm) and a step has
        written other inputs over them since this thread took them with :meth:`step_inputs`."""
        fresh = self._staging_seen.get(threading.get_ident()) == self._staging_writes
        if not fresh and self._decoder is not None and self._decoder.holds(t):
            raise ValueError(
                f"{name} is the pool's staging rows (step_inputs()), but a step has written other inputs over "
                "them since this thread took them: take them again with step_inputs() and write the step's values"
            )

    def _check_stale_requests(self, requests: Sequence[DecodeRequest]) -> None:
        """:meth:`_refuse_stale` on every tensor of :meth:`decode`'s requests (shm only)."""
        if self.transport != "shm" or self._decoder is None or not isinstance(requests, Sequence):
            return
        for i, req in enumerate(requests):
            kv = getattr(req, "kv", None)
            parts = [("kv", kv)] if isinstance(kv, torch.Tensor) else [(f"kv[{j}]", p) for j, p in enumerate(kv or ())]
            for name, t in [("q", getattr(req, "q", None)), ("topk_pos", getattr(req, "topk_pos", None)), *parts]:
                if isinstance(t, torch.Tensor):
                    self._refuse_stale(f"requests[{i}].{name}", t)

    def _check_decode_lse(self, return_lse: object) -> None:
        check_bool("return_lse", return_lse)
        if return_lse and not self._decode_lse:
            raise ValueError(
                "return_lse=True, but this pool's Runtimes skip the LSE of their head-TP GQA decode "
                "(runtime_kwargs' DecodeOptions(return_lse=False))"
            )

    def _decode_step(
        self, batch: BatchStep, return_lse: bool, t_start: float, out: torch.Tensor | None, view: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Commit the checked step to the ledger, run it on the ranks, put the heads together."""
        t_checked = time.perf_counter()
        self.book.grow_slots(batch.slots, batch.counts)
        table = self.book.table_rows(batch.slots)
        t_sent = time.perf_counter()
        try:
            results, timeline = decode_on_ranks(
                self._decoder, self._actors, self._call, batch, table, return_lse, self.heads_per_rank, self.timeout_s
            )
        except RankStepError as e:
            raise self._fail(e.rank, e.cause, "decode", e.late) from None
        except Exception:  # on the driver, before the ranks were told to run (after: RankStepError): no step
            if self._broken is None:
                self.book.undo_growth(batch.slots, batch.counts)
            raise
        t_back = time.perf_counter()
        if timeline is None:  # each rank's heads
            full, lse = assemble(results, None, batch.num_tokens, return_lse, out=out)
        else:  # every head, token-major, in the region
            full, lse = results[0]
            if not view:
                full = full.clone() if out is None else out.copy_(full)
                lse = None if lse is None else lse.clone()
        t_end = time.perf_counter()
        self.last_step = {
            "kind": "decode",
            "check_ms": (t_checked - t_start) * 1e3,  # validating (and packing) the step
            "prepare_ms": (t_sent - t_checked) * 1e3,  # pages, block table
            "ranks_ms": (t_back - t_sent) * 1e3,  # copies into the transport, both ways, and the ranks' step
            "assemble_ms": (t_end - t_back) * 1e3,  # outputs copied out (and split per request)
        }
        if timeline is not None:
            self.last_step["timeline"] = timeline
        return full, lse
