"""Decode steps through POSIX shared memory: one region that the driver and every rank actor map.

Ray's transports copy a step's tensors through its object store or channels (milliseconds for a
64-token GLM-5 decode step on a two-H200 host, docs/DECISIONS.md, D44). When every rank
actor runs on the driver's node, the pool instead maps one file in ``/dev/shm`` into all the
processes at build time, sized by :func:`decode_layout` from ``max_decode_tokens``,
``max_requests``, the block table's width and the heads per rank. GPU actors page-lock their
mapping (``cudaHostRegister``), so their H2D copy of the queries and D2H copy of the outputs are
asynchronous DMA from and to the region itself.

The region opens with control lines of 8 int64 each (64 bytes): line 0 is the driver's (the step
sequence number, the command, the step's sizes, the time it published the step), line ``1 + r``
is rank ``r``'s (its done counter, an error flag, the error text's length, and the times it saw
the step, had its inputs on the way to the device, had the step queued, and had its outputs in
the region); then one error-text slot per rank, then the step's tensors: the block table, the
lengths (int64 for the host, int32 ``seq_lens`` / ``req_ids`` / ``cu_q`` the device reads as they
are), top-k, new KV rows, and the queries and outputs *token-major*, as the caller holds them (``q
[T, H, D]``, ``out [T, H, Dv]``, ``lse [T, H]``): the caller may write a step's inputs straight
into the region (:meth:`ShmSteps.inputs <shardattn.serving.shm_steps.ShmSteps.inputs>`) and read
its outputs there (no copy on the driver). The int32 sections lie in one contiguous span
(:meth:`ShmRegion.int32_span`), so a rank moves them to its device in one copy, the queries (every
head) in a second, and slices its heads there; it writes its heads of the outputs into the region's
token-major rows (one copy into a staging buffer of its own, page-locked on a GPU, then a host copy
into the strided rows, the ranks in parallel).

A step (:meth:`ShmSteps.run <shardattn.serving.shm_steps.ShmSteps.run>`, driver side in
:mod:`shardattn.serving.shm_steps`): the driver writes the inputs, then the sizes and the sequence
number, then rings each rank's doorbell with the number
(:class:`~shardattn.serving.doorbell.Doorbell`, a named pipe next to the region:
``<region>.go<r>``). Each rank's serve loop (:func:`serve`, one long-running actor call) waits on
its doorbell (spinning on it for ``spin_s`` after a step, then asleep in ``poll(2)`` until it is
rung), runs the step, writes its outputs, its done counter, and rings the driver's doorbell of that
rank (``<region>.done<r>``). The driver waits on those (spinning for ``spin_s``, then asleep in
``poll(2)``).

Ordering: the doorbell, not the stores to the region, publishes a step. A ``write`` and a
``read`` on one pipe synchronise through the pipe's lock in the kernel, so the reader sees every
store the writer made before writing: the payload before the rank reads it, the outputs before
the driver reads them, on any CPU. An aligned 8-byte store of a sequence number, which this
transport once relied on, is ordered after the payload on x86 only (Arm CPUs, such as Grace
Hopper's, may make it visible first). ``tests/test_shm_ordering.py`` stresses the protocol
between processes with checksummed payloads.

Faults: a rank whose step raises writes the error text and its flag before its done counter and
doorbell and ends its loop; a rank that dies ends its loop's call, which the driver polls with
``ray.wait`` while it waits; a rank that does not answer within the timeout is named as missing.
Each surfaces as one :class:`~shardattn.serving.errors.RankStepError` naming the rank.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shardattn.serving.doorbell import Doorbell

__all__ = ["INT32_SECTIONS", "MARKS", "ShmLayout", "ShmRegion", "bell_paths", "decode_layout", "serve"]

LINE = 8  # int64 per control line (64 bytes: one cache line each)
SEQ, CMD, NREQ, NQ, NKV, WIDTH, LSE, T_PUBLISH = range(8)  # the driver's line
DONE, FAILED, ERRLEN, T_SEEN, T_INPUTS, T_QUEUED, T_SYNCED = range(7)  # a rank's line
#: a rank's times of its last step (``time.monotonic_ns``, comparable across the host's processes)
MARKS = {"seen": T_SEEN, "inputs": T_INPUTS, "queued": T_QUEUED, "synced": T_SYNCED}
#: the int32 sections a device reads, in region order (one contiguous span: :meth:`ShmRegion.int32_span`)
INT32_SECTIONS = ("seq_lens", "req_ids", "cu_q", "table", "topk")
DECODE, STOP = 1, 2
ERR_BYTES = 4096
_ALIGN = 64


@dataclass(frozen=True)
class Section:
    """A tensor in the region: byte offset, shape (the largest step's) and dtype."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class ShmLayout:
    """Where everything lives in the region (the same on the driver and every rank)."""

    world_size: int
    sections: dict[str, Section]
    size: int

    @property
    def errors_offset(self) -> int:
        return (self.world_size + 1) * LINE * 8


def decode_layout(
    world_size: int,
    *,
    max_tokens: int,
    max_requests: int,
    table_width: int,
    heads_per_rank: int,
    head_dim: int,
    v_dim: int,
    dtype: torch.dtype,
    topk: int,
    kv_rows: Sequence[tuple[tuple[int, ...], torch.dtype]],
) -> ShmLayout:
    """The region of a pool's decode steps: ``max_tokens`` query (and new KV) tokens of at most
    ``min(max_requests, max_tokens)`` requests; ``topk`` 0 for GQA; ``kv_rows`` each KV
    component's row shape and dtype (sparse MLA ``[D]``; GQA ``[Hkv, D]``, ``[Hkv, Dv]``).

    >>> lay = decode_layout(2, max_tokens=4, max_requests=8, table_width=3, heads_per_rank=2,
    ...                     head_dim=8, v_dim=8, dtype=torch.float32, topk=5, kv_rows=[((8,), torch.float32)])
    >>> lay.sections["q"].shape, lay.sections["out"].shape, lay.sections["table"].shape, lay.size % mmap.PAGESIZE
    ((4, 4, 8), (4, 4, 8), (12,), 0)
    """
    t, b, h = int(max_tokens), min(int(max_requests), int(max_tokens)), int(heads_per_rank)
    sections: dict[str, Section] = {}
    offset = (world_size + 1) * LINE * 8 + world_size * ERR_BYTES

    def add(name: str, shape: tuple[int, ...], dt: torch.dtype) -> None:
        nonlocal offset
        offset = -(-offset // _ALIGN) * _ALIGN
        sections[name] = Section(offset, shape, dt)
        offset += int(np.prod(shape)) * torch.empty(0, dtype=dt).element_size()

    for name in ("starts", "counts", "q_counts"):  # host ints (the KV write's index math)
        add(name, (b,), torch.int64)
    add("seq_lens", (b,), torch.int32)  # what the device reads, as it reads it
    add("req_ids", (t,), torch.int32)
    add("cu_q", (b + 1,), torch.int32)
    add("table", (b * int(table_width),), torch.int32)  # [B, width] of the step, contiguous
    if topk:
        add("topk", (t, int(topk)), torch.int32)
    for i, (row, dt) in enumerate(kv_rows):
        add(f"kv{i}", (t, *row), dt)
    heads = int(world_size) * h
    add("q", (t, heads, int(head_dim)), dtype)  # token-major, as the caller holds them
    add("out", (t, heads, int(v_dim)), dtype)
    add("lse", (t, heads), torch.float32)
    size = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
    return ShmLayout(world_size, sections, size)


class ShmRegion:
    """The region mapped into this process: ``ctrl`` (int64 control lines) and ``tensors``.

    Args:
        path: the file (``/dev/shm/...``). layout: :class:`ShmLayout`.
        create: make the file (the driver; it fails if it exists) or open it (a rank). The file's
            pages are allocated here (``posix_fallocate``), so a ``/dev/shm`` without room for
            the region raises ``OSError`` (``ENOSPC``) now rather than killing a process with
            ``SIGBUS`` when a step first touches a page past the room (a sparse file, as
            ``ftruncate`` alone makes); a file this call created is removed when it fails.
    """

    def __init__(self, path: str, layout: ShmLayout, *, create: bool) -> None:
        self.path, self.layout = path, layout
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            try:
                if create:
                    _allocate(fd, layout.size, path)
                self._map = mmap.mmap(fd, layout.size)
            finally:
                os.close(fd)
        except BaseException:
            if create:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            raise
        self.ctrl = np.frombuffer(self._map, dtype=np.int64, count=(layout.world_size + 1) * LINE)
        self.tensors = {
            name: torch.frombuffer(self._map, dtype=s.dtype, count=int(np.prod(s.shape)), offset=s.offset).view(s.shape)
            for name, s in layout.sections.items()
        }
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)  # the whole region
        self._pinned_ptr: int | None = None

    def pin(self) -> bool:
        """Page-lock the mapping for CUDA (``cudaHostRegister``); False when the driver refuses."""
        base = torch.frombuffer(self._map, dtype=torch.uint8, count=1).data_ptr()
        try:
            if int(torch.cuda.cudart().cudaHostRegister(base, self.layout.size, 0)) != 0:
                return False
        except (AttributeError, RuntimeError, TypeError):  # no cudart binding: copies stay pageable
            return False
        self._pinned_ptr = base
        return True

    def rank_line(self, rank: int) -> int:
        return (rank + 1) * LINE

    def write_error(self, rank: int, text: str) -> None:
        data = text.encode("utf-8", "replace")[:ERR_BYTES]
        start = self.layout.errors_offset + rank * ERR_BYTES
        self._map[start : start + len(data)] = data
        self.ctrl[self.rank_line(rank) + ERRLEN] = len(data)

    def read_error(self, rank: int) -> str:
        start = self.layout.errors_offset + rank * ERR_BYTES
        n = int(self.ctrl[self.rank_line(rank) + ERRLEN])
        return bytes(self._map[start : start + n]).decode("utf-8", "replace")

    def int32_span(self, b: int, n_q: int, width: int) -> tuple[int, int]:
        """Bytes ``[lo, hi)`` of the region holding a step of ``b`` requests and ``n_q`` query
        tokens' int32 sections (``seq_lens``, ``req_ids``, ``cu_q``, ``table``, ``topk``): one copy."""
        secs = self.layout.sections
        used = {"seq_lens": b, "req_ids": n_q, "cu_q": b + 1, "table": b * width}
        if "topk" in secs:
            used["topk"] = n_q * int(secs["topk"].shape[1])
        lo = secs[INT32_SECTIONS[0]].offset
        return lo, max(secs[k].offset + 4 * n for k, n in used.items())

    def int32_views(self, base: torch.Tensor, lo: int, b: int, n_q: int, width: int) -> dict[str, torch.Tensor]:
        """The step's int32 sections as views of ``base`` (uint8, on any device) holding the
        region's bytes from offset ``lo`` on (:meth:`int32_span`): ``seq_lens [B]``, ``req_ids
        [T]``, ``cu_q [B + 1]``, ``table [B, width]``, ``topk [T, K]`` (sparse MLA)."""
        secs = self.layout.sections

        def view(name: str, n: int) -> torch.Tensor:
            start = secs[name].offset - lo
            return base[start : start + 4 * n].view(torch.int32)

        out = {"seq_lens": view("seq_lens", b), "req_ids": view("req_ids", n_q), "cu_q": view("cu_q", b + 1)}
        out["table"] = view("table", b * width).view(b, width)
        if "topk" in secs:
            k = int(secs["topk"].shape[1])
            out["topk"] = view("topk", n_q * k).view(n_q, k)
        return out

    def step_views(self, rank: int) -> dict[str, Any]:
        """The current step as rank ``rank`` reads it: its inputs and where its outputs go
        (``out`` / ``lse``: its heads of the token-major rows, strided views)."""
        c, t = self.ctrl, self.tensors
        b, n_q, n_kv, width = int(c[NREQ]), int(c[NQ]), int(c[NKV]), int(c[WIDTH])
        kv = [t[f"kv{i}"][:n_kv] for i in range(sum(1 for k in t if k.startswith("kv")))] if n_kv else []
        return_lse = bool(c[LSE])
        h = int(t["q"].shape[1]) // self.layout.world_size
        heads = slice(rank * h, (rank + 1) * h)
        step = {
            "starts": t["starts"][:b],  # [B] int64 (host): cached tokens before the step
            "counts": t["counts"][:b],  # [B] int64: KV rows the step writes
            "q_counts": t["q_counts"][:b],
            "kv": kv,
            "return_lse": return_lse,
            "sizes": (b, n_q, width),
            "heads": heads,  # this rank's query heads
            "q": t["q"][:n_q],  # [T, H, D]: every head
            "out": t["out"][:n_q, heads],  # [T, H/W, Dv] strided: this rank's heads
            "lse": t["lse"][:n_q, heads] if return_lse else None,
        }
        step.update(self.int32_views(self.bytes, 0, b, n_q, width))  # table, seq_lens, req_ids, cu_q, topk
        return step

    def mark(self, rank: int, field: int) -> None:
        """Rank ``rank`` records the time (``time.monotonic_ns``) of a point of its step (:data:`MARKS`)."""
        self.ctrl[self.rank_line(rank) + field] = time.monotonic_ns()

    def close(self, *, unlink: bool = False) -> None:
        """Unlink the file (the driver); the mapping goes with the last tensor viewing it."""
        if self._pinned_ptr is not None:
            torch.cuda.cudart().cudaHostUnregister(self._pinned_ptr)
            self._pinned_ptr = None
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def _allocate(fd: int, size: int, path: str) -> None:
    """Size the region's file to ``size`` bytes, every page allocated (``OSError`` naming ``path``
    when the file system has no room for them); a sparse file where the OS has no ``posix_fallocate``."""
    if not hasattr(os, "posix_fallocate"):  # macOS
        os.ftruncate(fd, size)
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        raise OSError(e.errno, f"{e.strerror} (allocating the {size}-byte region)", path) from None


def bell_paths(region_path: str, rank: int) -> tuple[str, str]:
    """The doorbells of rank ``rank`` next to the region's file: driver -> rank, rank -> driver."""
    return f"{region_path}.go{rank}", f"{region_path}.done{rank}"


def serve(region: ShmRegion, rank: int, step: Callable[[dict[str, Any]], None], spin_s: float) -> str:
    """Rank ``rank``'s loop: wait for its doorbell, run ``step(region.step_views(rank))``, write the
    done counter and ring the driver's doorbell. Spins on the doorbell for ``spin_s`` after a step,
    then sleeps in ``poll(2)`` until it rings. Returns when told to stop, or after writing a step's
    exception (the error text, then the flag, then the doorbell). Records when it saw each step
    (``MARKS["seen"]``)."""
    ctrl, line = region.ctrl, region.rank_line(rank)
    go_path, done_path = bell_paths(region.path, rank)
    go, done = Doorbell(go_path, create=False), Doorbell(done_path, create=False)
    last = time.perf_counter()
    try:
        while True:
            seq = go.poll()
            if seq is None:
                if time.perf_counter() - last > spin_s:
                    seq = go.wait(1.0)
                if seq is None:
                    continue
            ctrl[line + T_SEEN] = time.monotonic_ns()  # the doorbell's read ordered every load below
            if int(ctrl[CMD]) == STOP:
                ctrl[line + DONE] = seq
                done.ring(seq)
                return "stopped"
            try:
                step(region.step_views(rank))
            except BaseException as e:  # the driver names this rank and the cause
                text = str(e).strip()
                region.write_error(rank, f"raised {type(e).__name__}: {text.splitlines()[-1] if text else ''}")
                ctrl[line + FAILED] = 1
                ctrl[line + DONE] = seq
                done.ring(seq)
                return "failed"
            ctrl[line + DONE] = seq
            done.ring(seq)  # after the outputs: the driver's read of it orders its loads after them
            last = time.perf_counter()
    finally:
        go.close()
        done.close()
