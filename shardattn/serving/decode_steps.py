"""A pool's decode steps: :class:`DecodeSteps` (a base of :class:`~shardattn.serving.steps.RequestSteps`).

:meth:`~DecodeSteps.decode` takes request objects (each checked, errors naming the request) and
:meth:`~DecodeSteps.decode_batch` a whole step's tensors (``q [T, H, D]``, ``topk_pos [T, K]``,
``query_lens [B]``; checked with array operations); both run the same step
(:meth:`~DecodeSteps._decode_step`) through the pool's decode transport
(:func:`~shardattn.serving.transport.decode_on_ranks`) and return ``out [T, H, Dv]`` (and
``lse [T, H]`` fp32). A step that fails on the driver after its checks, before any rank runs,
takes its tokens back out of the ledger. A ``KeyboardInterrupt`` (or another ``BaseException``)
on the driver while ranks run a shared-memory or compiled-graph step breaks the pool, as a failed
step does (the ranks may still read and write the step's rows, and a prefill, an actor call, would
run beside it), and is raised as it is.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal, overload

import numpy as np
import torch

from shardattn._checks import check_bool, check_tensor
from shardattn.serving.errors import RankStepError
from shardattn.serving.requests import BatchStep, DecodeRequest, check_decode_batch, one_host_thread, pack_step
from shardattn.serving.split import assemble
from shardattn.serving.staging_rows import StagingRows
from shardattn.serving.transport import decode_on_ranks

__all__ = ["DecodeSteps"]


class DecodeSteps(StagingRows):
    """Decode steps of a pool (a base class; the pool holds the state used here)."""

    #: whether a decode step can return the LSE (not a head-TP GQA pool whose Runtimes skip it)
    _decode_lse: bool

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
            request_ids: ``[B]`` integer tensor (int8, int16, int32, int64 or uint8, the dtypes
                :meth:`free` takes) or NumPy array of distinct prefilled request ids (the pool's
                ids being ints; looked up vectorised), or a sequence of any ids.
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

    def _check_decode_lse(self, return_lse: object) -> None:
        check_bool("return_lse", return_lse)
        if return_lse and not self._decode_lse:
            raise ValueError(
                "return_lse=True, but this pool's Runtimes skip the LSE of their decode "
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
        except BaseException as e:  # a KeyboardInterrupt while ranks run the step, or a failure before
            running = self._decoder.running() if hasattr(self._decoder, "running") else []
            self._left_step(e, running, "decode", lambda: self.book.undo_growth(batch.slots, batch.counts))
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
