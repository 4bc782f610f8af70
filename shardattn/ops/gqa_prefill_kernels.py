"""The kernels a GQA prefill's segments run on: the :class:`SegmentKernel` protocol, the torch
reference (:class:`TorchSegmentKernel`) and FA4 (:class:`FA4SegmentKernel`).

:func:`~shardattn.ops.gqa_prefill_segments.attend_segments` composes a call from two kernel
shapes, segments over contiguous key ranges and segments over a paged cache; both
implementations take the same arguments, so the CPU runs the composition the GPU runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from shardattn.kernels import fa4
from shardattn.kernels.fa4_launch import FA4Private
from shardattn.ops.gqa_prefill_reference import segment_attention_reference

if TYPE_CHECKING:
    from shardattn.ops.gqa_prefill_segments import Segments

__all__ = ["FA4SegmentKernel", "KernelResult", "SegmentKernel", "TorchSegmentKernel", "require_lse"]

Tensor = torch.Tensor
#: ``(out [T, H, D], lse [T, H] fp32)``; ``lse`` is ``None`` only for a call made with ``return_lse=False``.
KernelResult = tuple[torch.Tensor, torch.Tensor | None]


def require_lse(result: KernelResult) -> tuple[Tensor, Tensor]:
    """The ``(out, lse)`` of a call made with ``return_lse=True``, which always has its LSE."""
    out, lse = result
    if lse is None:
        raise RuntimeError("a segment kernel called with return_lse=True returned no LSE")
    return out, lse


class SegmentKernel(Protocol):
    """The two kernel shapes a GQA prefill needs; arguments as in
    :func:`~shardattn.ops.gqa_prefill_reference.segment_attention_reference` (keyword arguments:
    ``causal``, ``window_left``, ``sinks``, ``scale``, ``return_lse``, ``launches``: a plan's
    :class:`~shardattn.kernels.fa4_launch.FA4Launches` or ``None``, read by FA4 only); both return
    ``(out [T, H, D], lse [T, H] or None)``. ``k_len`` ``None``: segment ``s``'s keys are
    ``[cu_k[s], cu_k[s + 1])``. :meth:`table` turns a block table into the one a paged call reads."""

    name: str

    def contiguous(
        self, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, k_len: Tensor | None, **kw: Any
    ) -> KernelResult:
        """Segments over contiguous key ranges ``[cu_k[s], cu_k[s] + k_len[s])``."""

    def paged(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor, cu_q: Tensor, k_len: Tensor, **kw: Any
    ) -> KernelResult:
        """Segments over the first ``k_len`` positions of paged keys (``page_table`` from :meth:`table`)."""

    def table(self, block_table: Tensor, segments: Segments, num_pages: int) -> Tensor:
        """``[S, M]`` int32 pages of each segment's request, as the paged call reads them."""


class TorchSegmentKernel:
    """The fp32 torch reference (CPU, and GPUs where FA4 does not run)."""

    name = "reference"

    def contiguous(
        self, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, k_len: Tensor | None, **kw: Any
    ) -> KernelResult:
        return_lse = kw.pop("return_lse", True)
        kw.pop("launches", None)
        if k_len is None:
            k_len = cu_k[1:] - cu_k[:-1]
        with torch.no_grad():  # inference, as the kernels: no autograd history on any device
            out, lse = segment_attention_reference(q, k, v, cu_q, k_len, cu_k=cu_k, **kw)
        return out, (lse if return_lse else None)

    def paged(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor, cu_q: Tensor, k_len: Tensor, **kw: Any
    ) -> KernelResult:
        return_lse = kw.pop("return_lse", True)
        kw.pop("launches", None)
        with torch.no_grad():  # inference, as the kernels: no autograd history on any device
            out, lse = segment_attention_reference(q, k_cache, v_cache, cu_q, k_len, page_table=page_table, **kw)
        return out, (lse if return_lse else None)

    def table(self, block_table: Tensor, segments: Segments, num_pages: int) -> Tensor:
        return segments.of_segments(block_table)


class FA4SegmentKernel:
    """FA4 through :mod:`shardattn.kernels.fa4` (``fn``: the FA4 function, default the installed one;
    ``private``: :func:`~shardattn.kernels.fa4.fast_launch_support`'s pieces, which let calls given
    a plan's ``launches`` call the compiled kernel directly; ``None``: every call is public).

    Makes a call's page table from the block table at each call (:meth:`table`: one gather and
    clamp): an engine writes its block table in place between steps, by kernels that bump no
    version counter, and builds it under ``torch.inference_mode`` (no counter at all), so no
    cache keyed on the table could tell a changed table from the last one. The page table is
    written into one buffer per plan's segments, so that the layers of a step pass the same tensor
    (a fast launch's form keeps its fixed arguments).
    """

    name = "fa4"

    def __init__(self, fn: Callable | None = None, private: FA4Private | None = None) -> None:
        self.fn = fn
        self.private = private
        self._pages: tuple[Segments, Tensor] | None = None  # the segments and their page-table buffer

    def contiguous(
        self, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, k_len: Tensor | None, **kw: Any
    ) -> KernelResult:
        return fa4.fa4_varlen(q, k, v, cu_q, cu_k, k_len, fn=self.fn, private=self.private, **kw)

    def paged(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor, cu_q: Tensor, k_len: Tensor, **kw: Any
    ) -> KernelResult:
        return fa4.fa4_paged(q, k_cache, v_cache, page_table, cu_q, k_len, fn=self.fn, private=self.private, **kw)

    def table(self, block_table: Tensor, segments: Segments, num_pages: int) -> Tensor:
        pages = segments.of_segments(block_table)
        held = self._pages
        if held is None or held[0] is not segments or held[1].shape != pages.shape or held[1].device != pages.device:
            held = self._pages = (segments, torch.empty(pages.shape, dtype=torch.int32, device=pages.device))
        return fa4.page_table_for_fa4(pages, num_pages, out=held[1])
