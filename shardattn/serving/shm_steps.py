"""The driver's side of the shared-memory decode transport: :class:`ShmSteps` creates the region
(:mod:`shardattn.serving.shm`, whose docstring describes the protocol), writes each step's
inputs, rings the ranks' doorbells and waits for their done counters, and watches their serve
loops for liveness.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from shardattn.serving.doorbell import Doorbell, wait_any
from shardattn.serving.errors import RankStepError
from shardattn.serving.shm import (
    CMD,
    DECODE,
    FAILED,
    LSE,
    MARKS,
    NKV,
    NQ,
    NREQ,
    SEQ,
    STOP,
    T_PUBLISH,
    WIDTH,
    ShmLayout,
    ShmRegion,
    bell_paths,
)

__all__ = ["ShmSteps", "region_path"]


def region_path() -> str:
    """A fresh file name in ``/dev/shm`` (or the temp folder where there is none)."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(folder, f"shardattn-decode-{os.getpid()}-{uuid.uuid4().hex[:12]}")


def _unlink(*paths: str) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Bytes ``[lo, hi)`` of memory holding ``t``'s elements (empty for an empty tensor)."""
    lo = t.data_ptr()
    if t.numel() == 0:
        return lo, lo
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return lo, lo + (last + 1) * t.element_size()


def _in_place(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``src`` is the region's ``dst`` itself (packed in place: nothing to copy)."""
    return src.data_ptr() == dst.data_ptr() and src.stride() == dst.stride()


class ShmSteps:
    """The driver's side: the region, and the ranks' serve-loop calls (for liveness).

    Args:
        layout: :class:`ShmLayout`. spin_s: spin this long on the done counters before sleeping.
    """

    def __init__(self, layout: ShmLayout, spin_s: float = 0.0) -> None:
        self.region = ShmRegion(region_path(), layout, create=True)
        self.path, self.world_size, self.spin_s = self.region.path, layout.world_size, float(spin_s)
        paths = [bell_paths(self.path, r) for r in range(self.world_size)]
        files = [self.path, *(p for pair in paths for p in pair)]
        self._unlink = weakref.finalize(self, _unlink, *files)  # also when the pool is dropped
        self._go: list[Doorbell] = []
        self._done: list[Doorbell] = []
        try:  # one at a time, so that close() closes every one opened before a failure
            for go, done in paths:
                self._go.append(Doorbell(go, create=True))
                self._done.append(Doorbell(done, create=True))
        except OSError:
            self.close()
            raise
        self._seq = 0
        #: ranks rung for the last step that have not answered it (empty once it is done): a step
        #: the driver left while these ranks may still read and write its rows
        self.running: list[int] = []
        self._done_ns = 0
        self._loops: list[Any] = []
        t = self.region.tensors  # NumPy views of the host-int sections (cheap elementwise writes)
        self._host = {k: t[k].numpy() for k in ("starts", "counts", "q_counts", "seq_lens", "req_ids", "cu_q")}
        self._arange = np.arange(max(int(t["req_ids"].shape[0]), int(t["starts"].shape[0])), dtype=np.int64)
        self.pinned: list[bool] = []  #: whether each rank page-locked its mapping (GPU ranks)
        self._input_spans = [_span(v) for v in self.inputs().values()]

    def serving(self, loops: Sequence[Any]) -> None:
        """The ranks' serve-loop ``ObjectRef``s, rank order (ready only when a loop ended)."""
        self._loops = list(loops)

    def inputs(self) -> dict[str, torch.Tensor]:
        """The region's input tensors a step may be written into directly (``q [T, H, D]``,
        ``topk [T, K]``, ``kv0`` / ``kv1 [T, *row]``; sized for the largest step): a step whose
        tensors are their leading rows is not copied again."""
        return {k: v for k, v in self.region.tensors.items() if k in ("q", "topk") or k.startswith("kv")}

    def holds(self, t: torch.Tensor) -> bool:
        """Whether any of ``t``'s elements lies in the region's input tensors (:meth:`inputs`)."""
        lo, hi = _span(t)
        return any(lo < b and a < hi for a, b in self._input_spans)

    def _ended_loops(self) -> RankStepError | None:
        """A rank whose serve loop ended (its actor died, or the loop returned), or ``None``."""
        import ray

        from shardattn.serving.errors import describe_ray_error

        ready, _ = ray.wait(self._loops, num_returns=len(self._loops), timeout=0)
        for r, ref in enumerate(self._loops):
            if ref in ready:
                try:
                    how = ray.get(ref)
                except ray.exceptions.RayError as e:
                    return RankStepError(r, describe_ray_error(e))
                if how == "failed":
                    return RankStepError(r, self.region.read_error(r))
                return RankStepError(r, f"its serve loop ended ({how})")
        return None

    def run(self, step: dict[str, Any], timeout_s: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode step. ``step``: ``table [B, w]`` int32, ``starts`` / ``counts`` / ``q_lens``
        ``[B]`` int64 (NumPy), ``q [T, H, D]``, ``topk [T, K]`` or ``None``, ``kv`` list,
        ``return_lse``. A tensor that is its input's leading rows in the region (:meth:`inputs`)
        is not copied again; one elsewhere on the input rows (later rows, or another input's) is
        read whole before any input row is written. A tensor that requires grad is read as its
        values (the region stays a plain buffer).

        Returns ``(out [T, H, Dv], lse [T, H] or None)``: views of the region, valid until the
        next step. Raises :class:`RankStepError`: a rank failed, the timeout, or any failure once
        the ranks' doorbells were rung (they may run the step: the caller must not take it back).
        A ``BaseException`` that is no ``Exception`` (``KeyboardInterrupt``, ``SystemExit``)
        raised while waiting passes through as it is, and :attr:`running` names the ranks that
        had not answered (the caller must not start another step over them).
        """
        c, t = self.region.ctrl, self.region.tensors
        table, starts, counts, q_lens = step["table"], step["starts"], step["counts"], step["q_lens"]
        b, width = int(table.shape[0]), int(table.shape[1])
        n_q = int(q_lens.sum())
        n_kv = int(step["kv"][0].shape[0]) if step["kv"] else 0
        t["table"][: b * width].view(b, width).copy_(torch.from_numpy(np.ascontiguousarray(table)))
        host = self._host
        host["starts"][:b] = starts
        host["counts"][:b] = counts
        host["q_counts"][:b] = q_lens
        host["seq_lens"][:b] = starts + counts
        cu = host["cu_q"]
        cu[0] = 0
        np.cumsum(q_lens, out=cu[1 : b + 1])
        if n_q == b:  # one query per request: query i is request i's
            host["req_ids"][:n_q] = self._arange[:n_q]
        else:
            host["req_ids"][:n_q] = np.repeat(self._arange[:b], q_lens)
        puts = [(t["q"][:n_q], step["q"])]
        if step["topk"] is not None:
            puts.append((t["topk"][:n_q], step["topk"]))
        puts += [(t[f"kv{i}"][:n_kv], part) for i, part in enumerate(step["kv"])]
        # a source on the input rows, not packed in place: read whole before any input row is written
        puts = [(dst, src if _in_place(dst, src) or not self.holds(src) else src.detach().clone()) for dst, src in puts]
        for dst, src in puts:
            if not _in_place(dst, src):
                dst.copy_(src.detach())
        c[NREQ], c[NQ], c[NKV], c[WIDTH], c[LSE], c[CMD] = b, n_q, n_kv, width, int(step["return_lse"]), DECODE
        self._seq += 1
        c[T_PUBLISH] = time.monotonic_ns()
        c[SEQ] = self._seq
        pending = self.running = list(range(self.world_size))  # emptied by _wait as ranks answer
        try:
            for bell in self._go:  # after every store of the step: a rank reads them after its doorbell
                bell.ring(self._seq)
            self._wait(timeout_s, pending)
        except RankStepError:
            raise
        except Exception as e:  # a rank may be running the step: the driver's failure fails the step
            raise RankStepError(
                pending[0] if pending else 0,
                f"the driver failed after ringing the step ({type(e).__name__}: {e}); ranks {pending} had not answered",
            ) from None
        self._done_ns = time.monotonic_ns()
        return t["out"][:n_q], t["lse"][:n_q] if step["return_lse"] else None

    def timeline(self) -> dict[str, Any]:
        """The last step's times in ms from the driver's publishing it: each rank's ``seen``,
        ``inputs`` (its H2D copies queued), ``queued`` (the step and its D2H queued), ``synced``
        (outputs in the region), and ``done`` (the driver saw every done counter)."""
        c = self.region.ctrl
        t0 = int(c[T_PUBLISH])
        ranks = []
        for r in range(self.world_size):
            line = self.region.rank_line(r)
            ranks.append({k: (int(c[line + f]) - t0) / 1e6 for k, f in MARKS.items()})
        return {"ranks": ranks, "done": (self._done_ns - t0) / 1e6}

    def _wait(self, timeout_s: float, pending: list[int] | None = None) -> None:
        """Wait for every rank's doorbell of this step: spin on them for ``spin_s``, then sleep in
        ``poll(2)`` (woken by the next one rung; every 20 ms a check that no serve loop ended).
        ``pending``: the ranks to wait for (default every rank), emptied as they answer."""
        c, seq = self.region.ctrl, self._seq
        pending = list(range(self.world_size)) if pending is None else pending
        t0 = time.perf_counter()
        next_check = t0 + 0.02
        while True:
            for r in list(pending):
                token = self._done[r].poll()
                while token is not None and token != seq:  # an earlier step's (never expected): skip it
                    token = self._done[r].poll()
                if token is None:
                    continue
                pending.remove(r)
                if c[self.region.rank_line(r) + FAILED]:  # a rank that failed: at once, not when all are done
                    raise RankStepError(r, self.region.read_error(r))
            if not pending:
                return
            now = time.perf_counter()
            if now - t0 > timeout_s:
                raise RankStepError(
                    pending[0], f"ranks {pending} did not answer within {timeout_s:g} s (hung or dead)", pending
                )
            if now >= next_check and self._loops:  # a dead rank never rings
                next_check = now + 0.02
                ended = self._ended_loops()
                if ended is not None:
                    raise ended
            if now - t0 > self.spin_s:
                wait_any([self._done[r] for r in pending], min(next_check - now, t0 + timeout_s - now) + 1e-4)

    def stop(self, wait_s: float = 2.0) -> None:
        """Tell the serve loops to return, and wait for their actor calls (best effort)."""
        c = self.region.ctrl
        c[CMD] = STOP
        self._seq += 1
        c[SEQ] = self._seq
        for bell in self._go:
            try:
                bell.ring(self._seq)
            except (OSError, ValueError):  # closed already, or the pipe is full of a dead rank's tokens
                pass
        if not self._loops:
            return
        import ray

        try:
            ray.wait(self._loops, num_returns=len(self._loops), timeout=wait_s)
        except Exception:
            pass
        self._loops = []

    def close(self) -> None:
        """Unlink the region's file and the doorbells (the mappings go with their processes)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.region.close(unlink=True)
        for bell in [*self._go, *self._done]:
            bell.close(unlink=True)
        self._unlink()
