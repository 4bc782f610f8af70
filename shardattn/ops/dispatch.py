"""Backend selection: which implementation of a kernel runs for given tensors.

Backends load lazily behind cached getters; nothing here imports Triton at module import time.
Whether Triton runs at all (:func:`use_triton`, :func:`unsupported_reason`, the interpreter
switch) lives in the leaf module :mod:`shardattn.kernels.backend`, which kernel modules import;
this module picks among the kernels (:func:`sparse_prefill_kernel`, :func:`sparse_decode_kernel`)
and re-exports the backend checks.

Example:
    >>> import torch
    >>> use_triton(torch.zeros(2))  # a CPU tensor without the interpreter
    False
"""

from __future__ import annotations

import torch

from shardattn.kernels.backend import (
    device_capability,
    interpreter_enabled,
    is_sm90,
    pdl_supported,
    triton_available,
    unsupported_reason,
    use_triton,
)

__all__ = [
    "device_capability",
    "gluon_runs_on",
    "interpreter_enabled",
    "is_sm90",
    "pdl_supported",
    "sparse_decode_kernel",
    "sparse_prefill_kernel",
    "triton_available",
    "unsupported_reason",
    "use_triton",
]


def gluon_runs_on(device: torch.device) -> bool:
    """``True`` when the Gluon kernels run on ``device``: an sm_90 GPU and a Triton with Gluon."""
    if not is_sm90(device) or not triton_available():
        return False
    from shardattn.kernels.gluon.sparse_mla import gluon_available

    return gluon_available() is None


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
        from shardattn.kernels.triton.sparse_mla import kernel_supports

        why = kernel_supports(q, kv, v_dim)
    if why is not None:
        return "reference", why
    if interpreter_enabled():
        return "triton", "TRITON_INTERPRET=1: Triton kernel under the interpreter"
    from shardattn.kernels.gluon.sparse_mla import gluon_supports

    sm = device_capability(q.device.index if q.device.index is not None else torch.cuda.current_device())
    route = route_prefill_kernel(
        q.shape[1], device_type=q.device, sm=sm, gluon_missing=gluon_supports(q, kv, v_dim), group_size=group_size
    )
    return route.path, route.reason


def sparse_decode_kernel(
    q: torch.Tensor, kv: torch.Tensor, v_dim: int, rows: torch.Tensor | None = None
) -> tuple[str, str]:
    """``(name, reason)`` of the kernel that runs a sparse-MLA decode call on these tensors.

    On sm_90 when Triton ships Gluon and the shape suits it: ``"gluon_small"`` (with ``rows``
    given, up to :data:`shardattn.plan.routing.SMALL_DECODE_MAX_HEADS` heads and
    :data:`~shardattn.plan.routing.SMALL_DECODE_MAX_TOKENS` tokens) or ``"gluon"`` where the
    routing's measured crossovers (:data:`~shardattn.plan.routing.GLUON_DECODE_MIN_HEADS` heads
    and :data:`~shardattn.plan.routing.GLUON_DECODE_MIN_PROGRAMS` programs) say it pays; else
    ``"triton"`` (the split-KV kernel) when Triton runs these tensors; else ``"reference"`` (the
    fp32 torch path).
    """
    from shardattn.plan.routing import route_sparse_decode_kernel

    why = unsupported_reason(q, kv, None)
    if why is not None:
        return "reference", why
    if interpreter_enabled():
        return "triton", "TRITON_INTERPRET=1: Triton kernel under the interpreter"
    from shardattn.kernels.gluon.sparse_mla import gluon_supports

    sm = device_capability(q.device.index if q.device.index is not None else torch.cuda.current_device())
    missing = gluon_supports(q, kv, v_dim)
    small_missing = "rows not given"
    if rows is not None:
        from shardattn.kernels.gluon.sparse_mla_decode_small import small_decode_limits

        small_missing = missing or small_decode_limits(q, rows)
    route = route_sparse_decode_kernel(
        q.shape[1], num_tokens=q.shape[0], device_type=q.device, sm=sm, gluon_missing=missing,
        small_missing=small_missing,
    )  # fmt: skip
    return route.path, route.reason
