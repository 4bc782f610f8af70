"""Where a pool's decode step may be written: :class:`StagingRows` (a base of the decode steps).

:meth:`~StagingRows.step_inputs` hands out ``q [T, H, D]``, ``topk_pos [T, K]`` int32 (sparse
MLA) and the KV rows of a step of ``T`` query tokens: under ``transport="shm"`` the leading rows
of the shared-memory region, which the step then does not copy (one staging area per pool), else
fresh tensors. A step given other tensors writes them over those rows, so the views a thread took
before are stale: the checks here refuse them, naming the argument, until the thread takes them
again.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from shardattn._checks import check_int
from shardattn.serving.pool_state import PoolState
from shardattn.serving.requests import DecodeRequest

__all__ = ["StagingRows"]


class StagingRows(PoolState):
    """A pool's staging rows for decode inputs (a base class; the pool holds the state used here)."""

    #: steps that wrote their inputs over the shared-memory staging rows, and the count each
    #: thread saw when it last took them from :meth:`step_inputs` (its views are stale after)
    _staging_writes: int
    _staging_seen: dict[int, int]

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
