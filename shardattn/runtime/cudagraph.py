"""CUDA-graph capture and replay of a decode step, with padded batch sizes.

A decode step is a callable ``fn(**inputs) -> Tensor | tuple[Tensor, ...]`` whose per-step inputs
(queries, block table, sequence lengths, ...) have a leading dimension of requests or of tokens
(``requests * q_len_per_req``); anything else it needs (KV caches, weights, sinks) it closes
over, and those must not move between steps. :class:`GraphRunner` allocates one static buffer
per input, once, at the largest batch size; captures one :class:`DecodeGraph` per padded batch
size over the leading rows of those buffers (largest first, one shared memory pool); and on
each step copies the real rows in, fills the padding rows with each input's pad value, replays
the smallest graph that fits and returns the real rows of the outputs::

    captured sizes   1   2   4   8          step with 3 requests -> graph 4
    static q         [r0 r1 r2 pad | ...]   pad rows: q 0, seq_len 0, block_table 0
    output           [o0 o1 o2 0   ]        returned: rows [0, 3) (views, valid until next run)

Padded requests are masked, never dropped: with ``seq_lens = 0`` the decode kernels write
``out = 0, lse = -inf`` for them. Replay equals :meth:`GraphRunner.eager` (the same callable on
the same buffers, outside the graph) to the bit.

Policy (:class:`~shardattn.plan.cudagraph.CGSupport`, decided by the planner): ``NEVER`` forbids
capture; ``UNIFORM_SINGLE_TOKEN_DECODE`` (e.g. under DCP) allows ``q_len_per_req == 1`` only;
``UNIFORM_BATCH`` allows uniform drafts, and ragged drafts padded to the graph's
``q_len_per_req`` (:class:`~shardattn.plan.decode_batch.DecodeBatch` lays them out; padding
queries see no key); unpadded ragged batches need ``ALWAYS``.
:func:`~shardattn.runtime.graph_capture.check_capture_allowed` raises a ``ValueError`` naming
the level otherwise; :class:`~shardattn.runtime.graph_capture.DecodeGraph` is one captured size.

Inputs reach the static buffers in one copy: the buffers are views of one ``uint8`` arena;
device inputs and the padding rows (copied from a template arena holding the pad values) go
in one fused multi-tensor copy (``torch._foreach_copy_`` over byte views: one kernel), host
inputs are staged in a pinned twin of the arena and cross in one host-to-device copy. A batch
larger than the largest captured size runs eagerly on the caller's tensors, and
:attr:`GraphRunner.last_route` says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from shardattn._checks import check_bool, check_choice, check_int
from shardattn.plan.cudagraph import CGSupport
from shardattn.plan.decode_batch import bucket_for
from shardattn.runtime.graph_capture import DecodeGraph, Outputs, check_capture_allowed

__all__ = ["GraphInput", "GraphRunner"]


@dataclass(frozen=True)
class GraphInput:
    """One per-step input of a captured decode step.

    Attributes:
        name: keyword under which ``fn`` receives it.
        row_shape: shape after the leading dimension (e.g. ``(Hq, D)`` for q, ``()`` for seq_lens).
        dtype: its dtype.
        per: ``"request"`` (leading dim = requests) or ``"token"`` (= requests * q_len_per_req).
        pad_value: value of padding rows (0 for seq_lens marks a padded request).
    """

    name: str
    row_shape: tuple[int, ...]
    dtype: torch.dtype
    per: str = "request"
    pad_value: float = 0

    def __post_init__(self) -> None:
        where = f"GraphInput({self.name!r})"
        check_choice(f"{where}.per", self.per, ("request", "token"))
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"{where}.dtype must be a torch.dtype, got {self.dtype!r}")
        if not isinstance(self.row_shape, tuple):
            raise TypeError(f"{where}.row_shape must be a tuple of ints, got {self.row_shape!r}")
        for n in self.row_shape:
            check_int(f"{where}.row_shape[]", n, minimum=0)
        pad = self.pad_value
        if isinstance(pad, bool) or not isinstance(pad, int | float):
            raise TypeError(f"{where}.pad_value must be a number, got {pad!r}")
        if not (self.dtype.is_floating_point or self.dtype.is_complex):
            info = torch.iinfo(self.dtype) if self.dtype != torch.bool else None
            fits = info is not None and float(pad).is_integer() and info.min <= pad <= info.max
            if not fits:
                raise ValueError(f"{where}.pad_value must be an integer {self.dtype} holds, got {pad!r}")


_ALIGN = 64  # bytes: every input's region of the arena starts on a 64-byte boundary


class _LoadLayout:
    """The byte views one :meth:`GraphRunner.load` of a given batch size copies between:
    ``staged`` (per host input, its region in each pinned twin), ``device_dst`` (per device
    input, its region of the arena, or None when empty), the padding rows (``pad_dst`` from
    ``pad_src``) and ``span`` (the arena range every host input lies in, and its twins)."""

    __slots__ = ("device_dst", "pad_dst", "pad_src", "span", "staged")

    def __init__(self) -> None:
        self.staged: list[tuple[torch.Tensor, ...]] = []
        self.device_dst: list[torch.Tensor | None] = []
        self.pad_dst: list[torch.Tensor] = []
        self.pad_src: list[torch.Tensor] = []
        self.span: tuple[torch.Tensor, list[torch.Tensor]] | None = None


class GraphRunner:
    """Captures a decode step at several padded batch sizes and replays the one that fits.

    Args:
        fn: the decode step, ``fn(**inputs) -> Tensor | tuple[Tensor, ...]``; its outputs' leading
            dimension is tokens or requests.
        inputs: the per-step inputs (:class:`GraphInput`).
        support: the planner's CUDA-graph level for this configuration (checked here); ``None``:
            a runner that is never captured (it pads, validates and runs eagerly).
        batch_sizes: request counts to capture (each padded step uses the smallest that fits).
        q_len_per_req: uniform queries per request (1 = plain decode).
        ragged: steps may be ragged batches padded to ``q_len_per_req`` (UNIFORM_BATCH).
        device: device of the buffers (a CPU runner pads, validates and runs eagerly; only a
            CUDA runner captures).

    Example (on a GPU)::

        runner = GraphRunner(step, [GraphInput("q", (hq, d), torch.bfloat16, per="token"),
                                    GraphInput("block_table", (pages,), torch.int32),
                                    GraphInput("seq_lens", (), torch.int32)],
                             support=CGSupport.UNIFORM_BATCH, batch_sizes=[1, 2, 4, 8],
                             q_len_per_req=4, device=torch.device("cuda")).capture()
        out = runner.run(3, q=q, block_table=bt, seq_lens=lens)   # replays the graph of 4
        runner.last_route                                           # (4, "replay: 3 requests padded to 4")
    """

    def __init__(
        self,
        fn: Callable[..., Outputs],
        inputs: Sequence[GraphInput],
        *,
        support: CGSupport | None,
        batch_sizes: Sequence[int],
        q_len_per_req: int = 1,
        ragged: bool = False,
        device: torch.device | str = "cuda",
    ) -> None:
        check_int("q_len_per_req", q_len_per_req, minimum=1)
        check_bool("ragged", ragged)
        if support is not None:
            check_capture_allowed(support, q_len_per_req=q_len_per_req, ragged=ragged, padded=True)
        sizes = sorted({check_int("batch_sizes[]", b, minimum=1) for b in batch_sizes})
        if not sizes:
            raise ValueError("batch_sizes must name at least one batch size")
        names = [i.name for i in inputs]
        if len(set(names)) != len(names):
            raise ValueError(f"inputs must have distinct names, got {names}")
        self.device = torch.device(device)
        self.fn, self.inputs, self.support = fn, tuple(inputs), support
        self.batch_sizes, self.q_len_per_req, self.ragged = tuple(sizes), q_len_per_req, ragged
        top = sizes[-1]
        # one arena, one region per input (top-size rows), and a template holding the pad values
        self._offsets: dict[str, int] = {}
        self._row_bytes: dict[str, int] = {}
        off = 0
        for i in self.inputs:
            row = math.prod(i.row_shape) * torch.empty((), dtype=i.dtype).element_size()
            self._offsets[i.name], self._row_bytes[i.name] = off, row
            off += -(-self._rows(i, top) * row // _ALIGN) * _ALIGN
        self.arena = torch.empty(off, dtype=torch.uint8, device=self.device)
        self.buffers = {i.name: self._region(self.arena, i, top) for i in self.inputs}  # never reallocated
        for i in self.inputs:
            self.buffers[i.name].fill_(i.pad_value)
        self.pad_template = self.arena.clone()  # every row at its pad value
        pin = self.device.type == "cuda"
        # host inputs cross from a pinned twin of the arena; two of them, used in turn, so that a
        # step waits for the copy out of a twin only when it is two steps ahead of the device
        self._staging = [torch.empty(off, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self._staged = [torch.cuda.Event() if pin else None for _ in range(2)]  # the last copy out of each
        self._turn = 0
        self._layouts: dict[tuple[int, int, tuple[str, ...]], _LoadLayout] = {}  # views per batch, reused
        self.graphs: dict[int, DecodeGraph] = {}
        self.last_route: tuple[int | None, str] = (None, "no step yet")

    def _rows(self, spec: GraphInput, batch: int) -> int:
        return batch * self.q_len_per_req if spec.per == "token" else batch

    def _region(self, arena: torch.Tensor, spec: GraphInput, batch: int) -> torch.Tensor:
        off, n = self._offsets[spec.name], self._rows(spec, batch) * self._row_bytes[spec.name]
        return arena[off : off + n].view(spec.dtype).view(self._rows(spec, batch), *spec.row_shape)

    def _bytes(self, arena: torch.Tensor, spec: GraphInput, lo_rows: int, hi_rows: int) -> torch.Tensor:
        off, row = self._offsets[spec.name], self._row_bytes[spec.name]
        return arena[off + lo_rows * row : off + hi_rows * row]

    def views(self, batch: int) -> dict[str, torch.Tensor]:
        """The leading rows of the static buffers that a graph of ``batch`` requests sees."""
        return {i.name: self.buffers[i.name][: self._rows(i, batch)] for i in self.inputs}

    def capture(self, warmup: int = 2) -> GraphRunner:
        """Capture one graph per batch size, largest first, in one shared memory pool (``warmup``:
        eager runs of each before its capture)."""
        check_int("warmup", warmup, minimum=0)
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
        if self.support is None:
            raise ValueError("this runner was built without a CUDA-graph level (support=None): it runs eagerly only")
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.batch_sizes):
            self.arena.copy_(self.pad_template)
            self.graphs[b] = DecodeGraph(self.fn, self.views(b), pool=pool, warmup=warmup)
        return self

    def route(self, batch: int) -> tuple[int | None, str]:
        """``(padded size, reason)``: the smallest captured size ``>= batch``, or ``None`` (eager)
        with the reason when the batch is larger than every captured size. A runner never captured
        (``capture=False``) pads the same way and runs eagerly, and says so."""
        check_int("batch", batch, minimum=1)
        b = bucket_for(batch, self.batch_sizes)
        if b is not None and not self.graphs:
            return b, f"eager (not captured): {batch} requests padded to the batch of {b}"
        if b is not None:
            return b, f"replay: {batch} requests padded to the captured batch of {b}"
        return None, f"eager: {batch} requests exceed the largest captured batch ({self.batch_sizes[-1]})"

    def padded_size(self, batch: int) -> int:
        """The smallest captured batch size ``>= batch``."""
        padded, why = self.route(batch)
        if padded is None:
            raise ValueError(why)
        return padded

    def _check_inputs(self, batch: int, tensors: dict[str, torch.Tensor]) -> None:
        missing = {i.name for i in self.inputs} - set(tensors)
        extra = set(tensors) - {i.name for i in self.inputs}
        if missing or extra:
            raise ValueError(
                f"run() takes exactly the inputs {[i.name for i in self.inputs]}; "
                f"missing {sorted(missing)}, unexpected {sorted(extra)}"
            )
        for i in self.inputs:
            x = tensors[i.name]
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{i.name} must be a torch.Tensor, got {type(x).__name__}")
            want = (self._rows(i, batch), *i.row_shape)
            if tuple(x.shape) != want or x.dtype != i.dtype:
                raise ValueError(
                    f"{i.name} must have shape {list(want)} and dtype {i.dtype} (the runner's buffers), "
                    f"got {list(x.shape)} {x.dtype}"
                )
            same = x.device.type == self.device.type and self.device.index in (None, x.device.index)
            if x.device.type != "cpu" and not same:
                raise ValueError(f"{i.name} must be on the CPU or {self.device}, got {x.device}")

    def _layout(self, batch: int, padded: int, host: tuple[str, ...]) -> _LoadLayout:
        """The byte views a load of ``batch`` requests padded to ``padded`` copies between (the
        buffers never move, so they are made once per batch size and host/device split)."""
        key = (batch, padded, host)
        found = self._layouts.get(key)
        if found is not None:
            return found
        lay = _LoadLayout()
        for i in self.inputs:
            n, p = self._rows(i, batch), self._rows(i, padded)
            if i.name in host:
                lay.staged.append(tuple(self._bytes(t, i, 0, n) for t in self._staging))
            else:
                lay.device_dst.append(self._bytes(self.arena, i, 0, n) if n else None)
            if p > n:
                lay.pad_dst.append(self._bytes(self.arena, i, n, p))
                lay.pad_src.append(self._bytes(self.pad_template, i, n, p))
        if host:  # one host-to-device copy spanning every host input (device inputs are rewritten after)
            lo = min(self._offsets[name] for name in host)
            spec = {i.name: i for i in self.inputs}
            hi = max(self._offsets[name] + self._rows(spec[name], batch) * self._row_bytes[name] for name in host)
            lay.span = (self.arena[lo:hi], [t[lo:hi] for t in self._staging])
        if len(self._layouts) < 1024:
            self._layouts[key] = lay
        return lay

    def load(self, batch: int, **tensors: torch.Tensor) -> int:
        """Copy a step's inputs into the static buffers and pad; returns the padded batch size.

        Host inputs are staged in pinned memory and cross in one copy; device inputs and every
        padding row go in one fused copy (one kernel on a GPU). The views copied between are
        made once per batch size; the pinned staging buffer alternates between two, so the host
        waits for the device only when it runs two steps ahead.
        """
        check_int("batch", batch, minimum=1)
        padded = self.padded_size(batch)
        self._check_inputs(batch, tensors)
        on_device = self.device.type != "cpu"
        host = tuple(i.name for i in self.inputs if on_device and tensors[i.name].device.type == "cpu")
        lay = self._layout(batch, padded, host)
        turn = self._turn
        if host:
            self._turn = 1 - turn
            done = self._staged[turn]
            if done is not None and not done.query():
                done.synchronize()  # the copy out of this twin, two steps ago, is still reading it
        dsts, srcs = list(lay.pad_dst), list(lay.pad_src)
        staged, on_dev = iter(lay.staged), iter(lay.device_dst)
        for i in self.inputs:
            raw = tensors[i.name].contiguous().view(-1).view(torch.uint8)
            if i.name in host:
                next(staged)[turn].copy_(raw)
            else:
                dst = next(on_dev)
                if dst is not None:
                    dsts.append(dst)
                    srcs.append(raw)
        if lay.span is not None:
            dst, src = lay.span
            dst.copy_(src[turn], non_blocking=True)
            done = self._staged[turn]
            if done is not None:
                done.record()
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        return padded

    def _cut(self, outputs: Outputs, batch: int, padded: int) -> Outputs:
        def cut(t: torch.Tensor) -> torch.Tensor:
            if t.dim() and t.shape[0] == padded * self.q_len_per_req:
                return t[: batch * self.q_len_per_req]
            if t.dim() and t.shape[0] == padded:
                return t[:batch]
            return t

        return tuple(cut(t) for t in outputs) if isinstance(outputs, tuple) else cut(outputs)

    def run(self, batch: int, **tensors: torch.Tensor) -> Outputs:
        """Copy inputs in, pad, replay the fitting graph; returns the real rows of its outputs.

        A batch larger than every captured size runs ``fn`` eagerly on ``tensors`` (no padding);
        :attr:`last_route` holds ``(padded size or None, reason)``. The returned tensors of a
        replay are views of graph-owned memory, valid until the next :meth:`run`.
        """
        if not self.graphs:
            raise RuntimeError("GraphRunner.run() before capture()")
        padded, why = self.route(batch)
        self.last_route = (padded, why)
        if padded is None:
            self._check_inputs(batch, tensors)
            return self.fn(**tensors)
        self.load(batch, **tensors)
        return self._cut(self.graphs[padded].replay(), batch, padded)

    def eager(self, batch: int, **tensors: torch.Tensor) -> Outputs:
        """The same step run eagerly on the same padded buffers (the replay's bitwise reference);
        above the largest captured size, on the caller's tensors."""
        padded, why = self.route(batch)
        if padded is not None:
            why = f"eager: {batch} requests padded to the batch of {padded}"
        self.last_route = (padded, why)
        if padded is None:
            self._check_inputs(batch, tensors)
            return self.fn(**tensors)
        self.load(batch, **tensors)
        return self._cut(self.fn(**self.views(padded)), batch, padded)
