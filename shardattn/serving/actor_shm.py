"""Decode steps out of the pool's shared-memory region, on the actor's side (:mod:`~shardattn.serving.shm`).

:class:`ShmDecode` is a part of :class:`~shardattn.serving.actor.RankActor`: it maps the region,
allocates the step's device and staging buffers once, and runs the serve loop whose steps copy
their inputs in, run the rank's decode and copy this rank's heads of the outputs back. It uses the
actor's ``rank``, ``world_size``, ``device``, ``runtime`` and ``cache`` and its step bookkeeping
(``_begin`` / ``_maybe_fail`` / ``_end`` / ``_run_decode``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["ShmDecode"]


class ShmDecode:
    """The shared-memory decode path of a pool actor (module docstring)."""

    # the actor's own (:class:`~shardattn.serving.actor.RankActor`)
    rank: int
    world_size: int
    device: torch.device
    runtime: Any
    cache: Any
    _shm: Any
    _begin: Callable[[str], float]
    _maybe_fail: Callable[[str], None]
    _end: Callable[[float], None]
    _run_decode: Callable[..., tuple[torch.Tensor, torch.Tensor]]

    def attach_shm(self, path: str, layout: Any) -> dict[str, Any]:
        """Map the pool's shared-memory region (on a GPU, page-lock it) and allocate the step's
        device and staging buffers once (page-locked on a GPU). Returns ``{"pinned": bool}``."""
        from shardattn.serving.shm import INT32_SECTIONS, ShmRegion

        self._shm = region = ShmRegion(path, layout, create=False)
        pinned = region.pin() if self.device.type == "cuda" else False
        secs = layout.sections
        last = [secs[k] for k in INT32_SECTIONS if k in secs][-1]
        span = last.offset + 4 * int(torch.Size(last.shape).numel()) - secs[INT32_SECTIONS[0]].offset
        t, heads, _ = secs["q"].shape
        h, dv = heads // self.world_size, secs["out"].shape[2]
        dev, dt = self.device, secs["q"].dtype
        self._dev_ints = torch.empty(span, dtype=torch.uint8, device=dev)
        self._dev_q = torch.empty(secs["q"].shape, dtype=dt, device=dev)  # every head: one DMA, sliced on the device
        self._stage_out = torch.empty(t, h, dv, dtype=dt, pin_memory=pinned)  # this rank's heads, one DMA back
        self._stage_lse = torch.empty(t, h, dtype=torch.float32, pin_memory=pinned)
        return {"pinned": pinned}

    def serve_shm(self, spin_s: float) -> str:
        """The serve loop (its own concurrency group; runs until told to stop or a step raises)."""
        from shardattn.serving.shm import serve

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread
        return serve(self._shm, self.rank, self._shm_step, spin_s)

    def _shm_step(self, step: dict[str, Any]) -> None:
        """One decode step out of the region (:meth:`~shardattn.serving.shm.ShmRegion.step_views`).

        Two copies to the device, asynchronous from the page-locked region on a GPU (the int32
        span: lengths, block table, top-k; the queries, every head; this rank's heads are sliced
        on the device), the step unchecked, this rank's heads of the outputs back into its staging
        buffer (asynchronously), one sync, then a host copy into the region's token-major rows.
        A CPU rank runs the same path (its "device" buffers on the CPU). Marks the times of the
        inputs queued, the step queued and the outputs in place (the driver's timeline)."""
        from shardattn.serving.shm import T_INPUTS, T_QUEUED, T_SYNCED

        t0 = self._begin("decode")
        region = self._shm
        if len(step["kv"]):
            self.cache.write(step["table"], step["starts"].tolist(), step["counts"].tolist(), step["kv"])
        self._maybe_fail("decode")
        b, n_q, width = step["sizes"]
        lo, hi = region.int32_span(b, n_q, width)
        self._dev_ints[: hi - lo].copy_(region.bytes[lo:hi], non_blocking=True)
        ints = region.int32_views(self._dev_ints, lo, b, n_q, width)
        q_all = self._dev_q[:n_q]
        q_all.copy_(step["q"], non_blocking=True)
        q = q_all[:, step["heads"]].contiguous()
        if self.runtime.spec.kind == "sparse_mla":
            kw = {"topk": ints["topk"], "req_ids": ints["req_ids"]}
        else:
            kw = {"cu_q": ints["cu_q"]}
        region.mark(self.rank, T_INPUTS)
        out, lse = self._run_decode(q, ints["table"], ints["seq_lens"], **kw)
        out_h = self._stage_out[:n_q]
        out_h.copy_(out, non_blocking=True)
        lse_h = None
        if step["lse"] is not None:
            lse_h = self._stage_lse[:n_q]
            lse_h.copy_(lse, non_blocking=True)
        region.mark(self.rank, T_QUEUED)
        self._end(t0)  # synchronizes: the outputs are on the host before they go into the region
        step["out"].copy_(out_h)  # this rank's heads of the token-major rows
        if lse_h is not None:
            step["lse"].copy_(lse_h)
        region.mark(self.rank, T_SYNCED)
