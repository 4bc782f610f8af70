"""One captured decode step (:class:`DecodeGraph`) and the policy that allows a capture
(:func:`check_capture_allowed`, the planner's :class:`~shardattn.plan.cudagraph.CGSupport` levels).

:class:`~shardattn.runtime.cudagraph.GraphRunner` captures one :class:`DecodeGraph` per padded
batch size over its static buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

from shardattn._checks import check_int
from shardattn.plan.cudagraph import CGSupport

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE  # what torch.cuda.graph_pool_handle() returns

__all__ = ["DecodeGraph", "Outputs", "check_capture_allowed"]

Outputs = torch.Tensor | tuple[torch.Tensor, ...]


def check_capture_allowed(
    support: CGSupport, *, q_len_per_req: int, ragged: bool = False, padded: bool = False
) -> None:
    """Raise ``ValueError`` when the policy level forbids capturing this kind of decode step.

    Args:
        support: the planner's level for this configuration.
        q_len_per_req: queries per request in the captured batch (1 = plain decode).
        ragged: requests have different query lengths.
        padded: a ragged batch is padded to ``q_len_per_req`` queries per request (masked
            padding queries): it is then a uniform batch and needs UNIFORM_BATCH only.

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
    if ragged and padded:
        kind, need = f"a ragged batch padded to q_len_per_req={q_len_per_req}", CGSupport.UNIFORM_BATCH
    elif ragged:
        kind, need = "an unpadded ragged batch", CGSupport.ALWAYS
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
        pool: _POOL_HANDLE | None = None,
        warmup: int = 2,
    ) -> None:
        check_int("warmup", warmup, minimum=0)
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
