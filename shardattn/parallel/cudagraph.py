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
``UNIFORM_BATCH`` allows uniform drafts; ragged batches need ``ALWAYS`` and are not captured by
this runner. :func:`check_capture_allowed` raises a ``ValueError`` naming the level otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from shardattn._checks import check_choice, check_int
from shardattn.plan.cudagraph import CGSupport

__all__ = ["DecodeGraph", "GraphInput", "GraphRunner", "check_capture_allowed"]

Outputs = torch.Tensor | tuple[torch.Tensor, ...]


def check_capture_allowed(support: CGSupport, *, q_len_per_req: int, ragged: bool = False) -> None:
    """Raise ``ValueError`` when the policy level forbids capturing this kind of decode step.

    Args:
        support: the planner's level for this configuration.
        q_len_per_req: queries per request in the captured batch (1 = plain decode).
        ragged: requests have different query lengths.

    Example:
        >>> check_capture_allowed(CGSupport.UNIFORM_BATCH, q_len_per_req=4)
        >>> check_capture_allowed(CGSupport.UNIFORM_SINGLE_TOKEN_DECODE, q_len_per_req=4)
        ... # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: cannot capture a uniform batch with q_len_per_req=4: ... UNIFORM_BATCH is needed
    """
    if not isinstance(support, CGSupport):
        raise TypeError(f"support must be a CGSupport, got {type(support).__name__}")
    check_int("q_len_per_req", q_len_per_req, minimum=1)
    if ragged:
        kind, need = "a ragged batch", CGSupport.ALWAYS
    elif q_len_per_req > 1:
        kind, need = f"a uniform batch with q_len_per_req={q_len_per_req}", CGSupport.UNIFORM_BATCH
    else:
        kind, need = "single-token decode", CGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    if support < need:
        why = {
            CGSupport.NEVER: "capture is never allowed for this configuration",
            CGSupport.UNIFORM_SINGLE_TOKEN_DECODE: "single-token decode only, e.g. under DCP",
            CGSupport.UNIFORM_BATCH: "uniform batches only",
        }.get(support, "")
        raise ValueError(f"cannot capture {kind}: CUDA-graph support is {support.name} ({why}); {need.name} is needed")


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
        check_choice(f"GraphInput({self.name!r}).per", self.per, ("request", "token"))


class DecodeGraph:
    """One decode step captured over fixed buffers; :meth:`replay` re-runs it.

    Args:
        fn: the step, ``fn(**buffers) -> Tensor | tuple[Tensor, ...]``.
        buffers: its inputs (views of the runner's static buffers); never reallocated.
        pool: memory pool shared with other graphs of the same runner (or None).
        warmup: eager runs on a side stream before capture (compiles kernels, fills caches).
    """

    def __init__(
        self,
        fn: Callable[..., Outputs],
        buffers: Mapping[str, torch.Tensor],
        *,
        pool: object | None = None,
        warmup: int = 2,
    ) -> None:
        self.fn = fn
        self.buffers = dict(buffers)
        self.graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn(**self.buffers)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = fn(**self.buffers)

    def replay(self) -> Outputs:
        """Re-run the captured step; returns the static outputs (overwritten by the next replay)."""
        self.graph.replay()
        return self.outputs


class GraphRunner:
    """Captures a decode step at several padded batch sizes and replays the one that fits.

    Args:
        fn: the decode step, ``fn(**inputs) -> Tensor | tuple[Tensor, ...]``; its outputs' leading
            dimension is tokens or requests.
        inputs: the per-step inputs (:class:`GraphInput`).
        support: the planner's CUDA-graph level for this configuration (checked here).
        batch_sizes: request counts to capture (each padded step uses the smallest that fits).
        q_len_per_req: uniform queries per request (1 = plain decode).
        device: CUDA device of the buffers.

    Example (on a GPU)::

        runner = GraphRunner(step, [GraphInput("q", (hq, d), torch.bfloat16, per="token"),
                                    GraphInput("block_table", (pages,), torch.int32),
                                    GraphInput("seq_lens", (), torch.int32)],
                             support=CGSupport.UNIFORM_BATCH, batch_sizes=[1, 2, 4, 8],
                             q_len_per_req=4, device=torch.device("cuda")).capture()
        out = runner.run(3, q=q, block_table=bt, seq_lens=lens)   # replays the graph of 4
    """

    def __init__(
        self,
        fn: Callable[..., Outputs],
        inputs: Sequence[GraphInput],
        *,
        support: CGSupport,
        batch_sizes: Sequence[int],
        q_len_per_req: int = 1,
        device: torch.device | str = "cuda",
    ) -> None:
        check_capture_allowed(support, q_len_per_req=q_len_per_req)
        sizes = sorted({check_int("batch_sizes[]", int(b), minimum=1) for b in batch_sizes})
        if not sizes:
            raise ValueError("batch_sizes must name at least one batch size")
        names = [i.name for i in inputs]
        if len(set(names)) != len(names):
            raise ValueError(f"inputs must have distinct names, got {names}")
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
        self.fn, self.inputs, self.support = fn, tuple(inputs), support
        self.batch_sizes, self.q_len_per_req = tuple(sizes), q_len_per_req
        top = sizes[-1]
        self.buffers = {
            i.name: torch.full((self._rows(i, top), *i.row_shape), i.pad_value, dtype=i.dtype, device=self.device)
            for i in self.inputs
        }  # allocated once; every graph sees views of these
        self.graphs: dict[int, DecodeGraph] = {}

    def _rows(self, spec: GraphInput, batch: int) -> int:
        return batch * self.q_len_per_req if spec.per == "token" else batch

    def views(self, batch: int) -> dict[str, torch.Tensor]:
        """The leading rows of the static buffers that a graph of ``batch`` requests sees."""
        return {i.name: self.buffers[i.name][: self._rows(i, batch)] for i in self.inputs}

    def capture(self, warmup: int = 2) -> GraphRunner:
        """Capture one graph per batch size, largest first, in one shared memory pool."""
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.batch_sizes):
            self._pad_from(0, b)
            self.graphs[b] = DecodeGraph(self.fn, self.views(b), pool=pool, warmup=warmup)
        return self

    def padded_size(self, batch: int) -> int:
        """The smallest captured batch size ``>= batch``."""
        for b in self.batch_sizes:
            if b >= batch:
                return b
        raise ValueError(f"batch {batch} exceeds the largest captured batch size {self.batch_sizes[-1]}")

    def _pad_from(self, batch: int, padded: int) -> None:
        for i in self.inputs:
            self.buffers[i.name][self._rows(i, batch) : self._rows(i, padded)].fill_(i.pad_value)

    def load(self, batch: int, **tensors: torch.Tensor) -> int:
        """Copy a step's inputs into the static buffers and pad; returns the padded batch size."""
        check_int("batch", batch, minimum=1)
        missing = {i.name for i in self.inputs} - set(tensors)
        extra = set(tensors) - {i.name for i in self.inputs}
        if missing or extra:
            raise ValueError(
                f"run() takes exactly the inputs {[i.name for i in self.inputs]}; "
                f"missing {sorted(missing)}, unexpected {sorted(extra)}"
            )
        padded = self.padded_size(batch)
        for i in self.inputs:
            x = tensors[i.name]
            want = (self._rows(i, batch), *i.row_shape)
            if tuple(x.shape) != want or x.dtype != i.dtype:
                raise ValueError(
                    f"{i.name} must have shape {list(want)} and dtype {i.dtype}, got {list(x.shape)} {x.dtype}"
                )
            self.buffers[i.name][: want[0]].copy_(x, non_blocking=True)
        self._pad_from(batch, padded)
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

        The returned tensors are views of graph-owned memory, valid until the next :meth:`run`.
        """
        if not self.graphs:
            raise RuntimeError("GraphRunner.run() before capture()")
        padded = self.load(batch, **tensors)
        return self._cut(self.graphs[padded].replay(), batch, padded)

    def eager(self, batch: int, **tensors: torch.Tensor) -> Outputs:
        """The same step run eagerly on the same padded buffers (the replay's bitwise reference)."""
        padded = self.load(batch, **tensors)
        return self._cut(self.fn(**self.views(padded)), batch, padded)
