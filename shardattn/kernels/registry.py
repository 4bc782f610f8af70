"""Backend selection: which implementation of a kernel runs for given tensors.

Backends load lazily behind cached getters; nothing here imports Triton at module import time.
A kernel module asks :func:`use_triton` with its input tensors and gets ``True`` when its Triton
kernel may run on them (CUDA tensors with Triton installed, or any tensor while the Triton
interpreter is switched on), else it runs its torch reference. :func:`unsupported_reason` says
why a capability is missing, so tests and routing can report it.

Example:
    >>> import torch
    >>> use_triton(torch.zeros(2))  # a CPU tensor without the interpreter
    False
"""

from __future__ import annotations

import functools
import os

import torch


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


def is_sm90(device: torch.device) -> bool:
    """``True`` for a Hopper (compute capability 9.x) CUDA device."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return device_capability(device.index if device.index is not None else torch.cuda.current_device())[0] == 9


def gluon_runs_on(device: torch.device) -> bool:
    """``True`` when the Gluon kernels run on ``device``: an sm_90 GPU and a Triton with Gluon."""
    if not is_sm90(device) or not triton_available():
        return False
    from shardattn.kernels.sparse_mla_gluon import gluon_available

    return gluon_available() is None


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


def sparse_prefill_kernel(q: torch.Tensor, kv: torch.Tensor, v_dim: int, group_size: int = 1) -> tuple[str, str]:
    """``(name, reason)`` of the kernel that runs a sparse-MLA prefill of ``group_size`` queries
    per tile (``1``: per-query) on these tensors.

    ``"gluon"`` on sm_90 when Triton ships Gluon and the shape suits it (and the routing's
    measured crossovers say it pays: :func:`shardattn.plan.routing.route_prefill_kernel`), else
    ``"triton"`` when the Triton kernel runs these tensors, else ``"reference"`` (the fp32 torch path).
    """
    from shardattn.plan.routing import route_prefill_kernel

    why = unsupported_reason(q, kv, None)
    if why is None:
        from shardattn.kernels.sparse_mla_triton import kernel_supports

        why = kernel_supports(q, kv, v_dim)
    if why is not None:
        return "reference", why
    if interpreter_enabled():
        return "triton", "TRITON_INTERPRET=1: Triton kernel under the interpreter"
    from shardattn.kernels.sparse_mla_gluon import gluon_supports

    sm = device_capability(q.device.index if q.device.index is not None else torch.cuda.current_device())
    route = route_prefill_kernel(
        q.shape[1], device_type=q.device, sm=sm, gluon_missing=gluon_supports(q, kv, v_dim), group_size=group_size
    )
    return route.path, route.reason


def sparse_decode_kernel(q: torch.Tensor, kv: torch.Tensor, v_dim: int) -> tuple[str, str]:
    """``(name, reason)`` of the kernel that runs a sparse-MLA decode call on these tensors.

    ``"gluon"`` on sm_90 when Triton ships Gluon, the shape suits the kernel and the routing's
    measured crossovers (:data:`shardattn.plan.routing.GLUON_DECODE_MIN_HEADS` heads and
    :data:`~shardattn.plan.routing.GLUON_DECODE_MIN_PROGRAMS` programs) say it pays; else
    ``"triton"`` (the split-KV kernel) when Triton runs these tensors; else ``"reference"`` (the
    fp32 torch path).
    """
    from shardattn.plan.routing import route_sparse_decode_kernel

    why = unsupported_reason(q, kv, None)
    if why is not None:
        return "reference", why
    if interpreter_enabled():
        return "triton", "TRITON_INTERPRET=1: Triton kernel under the interpreter"
    from shardattn.kernels.sparse_mla_gluon import gluon_supports

    sm = device_capability(q.device.index if q.device.index is not None else torch.cuda.current_device())
    missing = gluon_supports(q, kv, v_dim)
    route = route_sparse_decode_kernel(
        q.shape[1], num_tokens=q.shape[0], device_type=q.device, sm=sm, gluon_missing=missing
    )
    return route.path, route.reason
