"""What the Triton kernels can run on: Triton installed, the interpreter switch, the device.

A leaf module (it imports no kernel): a kernel module asks :func:`use_triton` with its input
tensors and gets ``True`` when its Triton kernel may run on them (CUDA tensors with Triton
installed, or any tensor while the Triton interpreter is switched on), else it runs its torch
reference; :func:`unsupported_reason` says why not. Which kernel runs a call is
:mod:`shardattn.ops.dispatch`'s (it re-exports these).

Example:
    >>> import torch
    >>> use_triton(torch.zeros(2))  # a CPU tensor without the interpreter
    False
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import overload

import torch

#: Compile options every kernel launch and ahead-of-time compile of the library passes: FMA
#: contraction on, the form in which every kernel was measured and its PTX digested. Triton up to
#: 3.9 contracts by default (3.9 warns that a later release will not); named, it does not depend on
#: the release or on ``TRITON_DEFAULT_FP_FUSION``.
COMPILE_OPTIONS: Mapping[str, bool] = MappingProxyType({"enable_fp_fusion": True})


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """``True`` when ``import triton`` works (cached)."""
    try:
        import triton
        import triton.language
    except Exception:
        return False
    return triton.language is not None


def interpreter_enabled() -> bool:
    """``True`` when ``TRITON_INTERPRET=1`` is set (a debugging/testing switch, read each call)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=16)
def device_capability(index: int) -> tuple[int, int]:
    """Compute capability of CUDA device ``index`` (cached)."""
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of CUDA ``device`` (cached); 132 (an H200's) for any other device,
    so host-side launch plans stay defined where the interpreter runs them."""
    if device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _major(device: torch.device) -> int:
    """Compute-capability major of ``device``; 0 for a non-CUDA device or without CUDA."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0
    return device_capability(device.index if device.index is not None else torch.cuda.current_device())[0]


def is_sm90(device: torch.device) -> bool:
    """``True`` for a Hopper (compute capability 9.x) CUDA device."""
    return _major(device) == 9


@functools.lru_cache(maxsize=1)
def _triton_has_gdc() -> bool:
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except Exception:
        return False
    return True


def pdl_supported(device: torch.device) -> bool:
    """``True`` where a kernel may be launched as a programmatic dependent launch (PDL): a CUDA
    device of compute capability 9.0 or newer (``griddepcontrol``), Triton with its grid-dependency
    calls, and not the interpreter.

    A PDL kernel starts while the kernel before it in the stream is still running and waits for
    it (``gdc_wait``: the earlier grid complete, its writes visible) before it reads anything;
    what it saves is its own launch latency (docs/DECISIONS.md, D24)."""
    if interpreter_enabled() or not triton_available() or not _triton_has_gdc():
        return False
    return _major(device) >= 9


def unsupported_reason(*tensors: torch.Tensor | None) -> str | None:
    """Why the Triton kernels cannot run on these tensors, or ``None`` when they can."""
    if not triton_available():
        return "triton is not installed"
    if interpreter_enabled():
        return None
    for t in tensors:
        if t is not None and t.device.type != "cuda":
            return f"tensor on {t.device} (Triton kernels need CUDA tensors or TRITON_INTERPRET=1)"
    return None


def use_triton(*tensors: torch.Tensor | None) -> bool:
    """``True`` when the Triton kernels may run on these tensors."""
    return unsupported_reason(*tensors) is None


@overload
def unit_stride(x: torch.Tensor) -> torch.Tensor: ...
@overload
def unit_stride(x: None) -> None: ...
@overload
def unit_stride(x: torch.Tensor | None) -> torch.Tensor | None: ...
def unit_stride(x: torch.Tensor | None) -> torch.Tensor | None:
    """``x`` with a unit last stride: the kernels read entry ``i`` of a small index, length or sink
    tensor (``topk_length``, ``sinks``, ``seq_lens``, ``req_ids``, a block table's row) at
    ``ptr + i``, so a strided view (a column of a metadata tensor) is copied once here; a tensor
    already so (the usual case) is returned as it is, and ``None`` stays ``None``.

    >>> meta = torch.arange(6).view(3, 2)
    >>> unit_stride(meta[:, 1]).stride(), unit_stride(meta[1]) is not None
    ((1,), True)
    """
    if x is None or x.dim() == 0 or x.shape[-1] <= 1 or x.stride(-1) == 1:
        return x
    return x.contiguous()


def kernel_destination(out: torch.Tensor | None) -> torch.Tensor | None:
    """A destination the kernels can write (they store a row's entries at ``ptr + i``; any other
    strides, head-blocked layouts too): ``out`` itself when its last dim has unit stride (or
    ``None``), else a new dense tensor of its shape, dtype and device, whose values
    :func:`written_back` copies into ``out`` after the launch."""
    if out is None or out.shape[-1] <= 1 or out.stride(-1) == 1:
        return out
    return torch.empty(out.shape, dtype=out.dtype, device=out.device)


def written_back(given: torch.Tensor | None, written: torch.Tensor) -> torch.Tensor:
    """``written``, copied into the caller's ``given`` where :func:`kernel_destination` replaced it."""
    if given is None or given is written:
        return written
    return given.copy_(written)
