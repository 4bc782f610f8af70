"""Dispatch: which kernel runs an operation's call on these tensors, and why.

The decisions are :mod:`shardattn.plan.routing`'s (shapes and measured crossovers, no tensors);
this module asks them with a call's tensors: what the device is, whether Triton and Gluon run
there, whether a kernel supports the shapes, dtypes and strides. :func:`prefill_path` (a sparse
prefill: kernel, ``G``, tile), :func:`sparse_prefill_kernel` and :func:`sparse_decode_kernel`
(which kernel, with the reason), :func:`decode_path` (a decode call, ``backend=`` included).
Whether Triton runs at all (:func:`use_triton`, the interpreter switch) is the leaf
:mod:`shardattn.kernels.backend`'s; nothing here imports Triton at module import time.

Example:
    >>> import torch
    >>> use_triton(torch.zeros(2))  # a CPU tensor without the interpreter
    False
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shardattn.kernels.backend import (
    device_capability,
    interpreter_enabled,
    is_sm90,
    pdl_supported,
    sm_count,
    triton_available,
    unsupported_reason,
    use_triton,
)
from shardattn.kernels.union_layout import MAX_PACKED_ROWS
from shardattn.plan.crossovers import COMPACT_MIN_GROUP
from shardattn.plan.routing import gluon_grouped_group_size, grouped_group_size

if TYPE_CHECKING:
    from shardattn.kernels.triton.sparse_mla import TileConfig

#: The decode backends that run Gluon kernels (sm_90): the per-query kernel, the small-batch one and
#: the streaming one.
GLUON_BACKENDS = ("gluon", "gluon_small", "gluon_stream")

__all__ = [
    "PrefillPath",
    "decode_path",
    "default_group_size",
    "device_capability",
    "gluon_runs_on",
    "interpreter_enabled",
    "is_sm90",
    "kv_reason",
    "pdl_supported",
    "prefill_path",
    "sm_count",
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

    return gluon_available()


#: How each kind of route reads ``fp8_ds_mla`` rows, for its reason.
FP8_READS = {
    "decode": "dequantised in the kernel",
    "prefill": "the blocks the union reads staged once where it reuses them, else dequantised in the kernel",
    "reference": "the gathered rows dequantised by the torch reference",
}


def kv_reason(kv: torch.Tensor, route: str = "decode") -> str:
    """What a route's reason adds for ``kv``'s row format: nothing for rows in q's dtype; for
    ``fp8_ds_mla`` rows, how ``route`` (a key of :data:`FP8_READS`) reads them (prefill kernels:
    :mod:`shardattn.ops.kv_fp8_stage`) and that the crossover between the op's kernels was measured
    on bf16 rows (the cost model's table, :mod:`shardattn.plan.calibration`, keys its kernel points
    by format apart from these)."""
    if kv.dtype != torch.uint8:
        return ""
    return f"; fp8_ds_mla KV rows, {FP8_READS[route]} (crossover measured on bf16 rows)"


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
        from shardattn.kernels.triton.sparse_mla import kernel_unsupported_reason

        why = kernel_unsupported_reason(q, kv, v_dim)
    if why is not None:
        return "reference", why + kv_reason(kv, "reference")
    if interpreter_enabled():
        return "triton", "TRITON_INTERPRET=1: Triton kernel under the interpreter" + kv_reason(kv, "prefill")
    from shardattn.kernels.gluon.sparse_mla import gluon_unsupported_reason

    sm = device_capability(q.device.index if q.device.index is not None else torch.cuda.current_device())
    route = route_prefill_kernel(
        q.shape[1],
        device_type=q.device,
        sm=sm,
        gluon_missing=gluon_unsupported_reason(q, kv, v_dim),
        group_size=group_size,
    )
    return route.path, route.reason + kv_reason(kv, "prefill")


def sparse_decode_kernel(
    q: torch.Tensor, kv: torch.Tensor, v_dim: int, rows: torch.Tensor | None = None
) -> tuple[str, str]:
    """``(name, reason)`` of the kernel that runs a sparse-MLA decode call on these tensors.

    On sm_90 when Triton ships Gluon and the shape suits it: ``"gluon_small"`` (with ``rows``
    given, up to :data:`shardattn.plan.decode_routing.SMALL_DECODE_MAX_HEADS` heads and
    :data:`~shardattn.plan.decode_routing.SMALL_DECODE_MAX_TOKENS` tokens), ``"gluon_stream"`` (with
    ``rows`` given, up to as many heads, from
    :data:`~shardattn.plan.crossovers.STREAM_DECODE_MIN_BLOCKS_PER_SM` blocks per SM, ``..._FP8_...`` on
    ``fp8_ds_mla`` rows) or ``"gluon"`` where the
    routing's measured crossovers (:data:`~shardattn.plan.decode_routing.GLUON_DECODE_MIN_HEADS` heads
    and :data:`~shardattn.plan.decode_routing.GLUON_DECODE_MIN_QUERY_ROWS` query rows, on ``fp8_ds_mla``
    rows :data:`~shardattn.plan.decode_routing.GLUON_DECODE_FP8_MIN_QUERY_ROWS`) say it pays; else
    ``"triton"`` (the split-KV kernel) when Triton runs these tensors; else ``"reference"`` (the
    fp32 torch path).
    """
    from shardattn.plan.decode_routing import route_sparse_decode_kernel

    why = unsupported_reason(q, kv, None)
    if why is not None:
        return "reference", why + kv_reason(kv, "reference")
    if interpreter_enabled():
        return "triton", "TRITON_INTERPRET=1: Triton kernel under the interpreter" + kv_reason(kv)
    from shardattn.kernels.gluon.sparse_mla import gluon_unsupported_reason

    sm = device_capability(q.device.index if q.device.index is not None else torch.cuda.current_device())
    missing = gluon_unsupported_reason(q, kv, v_dim)
    small_missing: str | None = "rows not given"
    stream_missing: str | None = "rows not given"
    if rows is not None:
        from shardattn.kernels.gluon.sparse_mla_decode_small import small_decode_limits
        from shardattn.kernels.gluon.sparse_mla_decode_stream import stream_decode_limits

        small_missing = missing or small_decode_limits(q, rows)
        stream_missing = missing or stream_decode_limits(q, rows)
    route = route_sparse_decode_kernel(
        q.shape[1], num_tokens=q.shape[0], device_type=q.device, sm=sm, gluon_missing=missing,
        small_missing=small_missing, stream_missing=stream_missing,
        topk=None if rows is None else rows.shape[1], num_sms=sm_count(q.device), kv_fp8=kv.dtype == torch.uint8,
    )  # fmt: skip
    return route.path, route.reason + kv_reason(kv)


@dataclass(frozen=True)
class PrefillPath:
    """Which implementation a sparse prefill takes, and why."""

    backend: str  # "gluon", "triton" or "reference"
    group_size: int
    tile: TileConfig | None  # the Triton kernel's tile; None off the Triton kernel
    reason: str


def default_group_size(heads: int) -> int:
    """``G`` the default routing uses: the planner's :func:`~shardattn.plan.routing.grouped_group_size`, else 1.

    >>> [default_group_size(h) for h in (4, 8, 16, 32, 64, 128)]
    [8, 8, 1, 1, 1, 1]
    """
    return grouped_group_size(heads) or 1


def prefill_path(
    q: torch.Tensor,
    kv: torch.Tensor,
    *,
    v_dim: int,
    group_size: int | None = None,
) -> PrefillPath:
    """Decide the implementation for these inputs (no GPU synchronisation).

    ``backend``: ``"gluon"`` where :func:`~shardattn.ops.dispatch.sparse_prefill_kernel` sends
    ``(heads, G)`` (sm_90 with Gluon, the measured crossovers of :mod:`shardattn.plan.routing`),
    else ``"triton"``, else ``"reference"``. With ``group_size=None`` on such a GPU, ``G`` follows
    the grouped Gluon kernel's crossover (:func:`~shardattn.plan.routing.gluon_grouped_group_size`)
    where that kernel runs, else :func:`default_group_size`.
    """
    from shardattn.kernels.triton.sparse_mla import kernel_unsupported_reason, tile_config

    heads = q.shape[1]
    if not use_triton(q, kv):
        no_triton = "no Triton for these tensors (CPU or not installed)"
        return PrefillPath("reference", 1, None, no_triton + kv_reason(kv, "reference"))
    why = kernel_unsupported_reason(q, kv, v_dim)
    if why is not None:
        return PrefillPath("reference", 1, None, why + kv_reason(kv, "reference"))
    g = default_group_size(heads) if group_size is None else group_size
    reason = f"G = {g} for {heads} heads"
    if group_size is None and kv.shape[0] <= MAX_PACKED_ROWS:
        g_gluon = gluon_grouped_group_size(heads)
        if g_gluon is not None and sparse_prefill_kernel(q, kv, v_dim, g_gluon)[0] == "gluon":
            g, reason = g_gluon, f"G = {g_gluon} for {heads} heads (grouped Gluon crossover)"
    if g > 1 and kv.shape[0] > MAX_PACKED_ROWS:
        why_big = f"KV cache of {kv.shape[0]} rows exceeds the 24-bit packed limit"
        if g >= COMPACT_MIN_GROUP:  # sparse_mla_grouped_prefill gathers the touched blocks, then runs G
            why_big += f" (a grouped prefill first gathers the blocks its rows touch, then runs G = {g})"
        g, reason = 1, why_big
    kernel, why = sparse_prefill_kernel(q, kv, v_dim, g)
    if kernel == "gluon":
        return PrefillPath("gluon", g, None, f"{reason}; {why}")
    return PrefillPath("triton", g, tile_config(heads, g, interpret=interpreter_enabled()), f"{reason}; {why}")


def decode_path(
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    v_dim: int,
    *,
    backend: str | None = None,
    workspace: torch.Tensor | None = None,
    num_sms: int = 132,
) -> tuple[str, str]:
    """``(kernel, reason)`` of a sparse-MLA decode call: ``"reference"``, ``"triton"``, ``"gluon"``,
    ``"gluon_small"`` or ``"gluon_stream"``. ``backend`` forces one kernel wherever it runs (a ``ValueError`` where it
    cannot: CPU tensors without the Triton interpreter, for the Triton kernel too); routed,
    :func:`sparse_decode_kernel` decides, and a ``workspace`` too small for the small-batch kernel's
    splits sends its call to Triton (forced, it raises). A call with no key (``kv`` without rows or
    ``rows`` without entries) is ``"reference"``, forced or not: every kernel returns its empty
    result. Inputs validated."""
    from shardattn.kernels.gluon.sparse_mla import gluon_unsupported_reason
    from shardattn.kernels.gluon.sparse_mla_decode_small import small_decode_limits
    from shardattn.kernels.triton.lse_merge import HAVE_TRITON, split_partials_numel
    from shardattn.plan.decode_routing import small_decode_tiles

    t, h, _ = q.shape
    no_keys = "kv has no rows" if kv.shape[0] == 0 else "rows has no entries" if rows.shape[1] == 0 else None
    if no_keys is not None:  # every row is empty: every kernel returns the empty result, forced or not
        return "reference", no_keys + kv_reason(kv, "reference")
    if not HAVE_TRITON or not use_triton(q):
        if backend is not None:
            raise ValueError(f"backend={backend!r} cannot run here: no CUDA tensors or no Triton")
        return "reference", "no Triton for these tensors" + kv_reason(kv, "reference")
    if backend == "triton":
        return "triton", "backend='triton'" + kv_reason(kv)
    if backend in GLUON_BACKENDS:  # forced: wherever it runs, whatever the crossover says
        missing = gluon_unsupported_reason(q, kv, v_dim)
        if backend == "gluon_small":
            missing = missing or small_decode_limits(q, rows)
        elif backend == "gluon_stream":
            from shardattn.kernels.gluon.sparse_mla_decode_stream import stream_decode_limits

            missing = missing or stream_decode_limits(q, rows)
        if missing is not None:
            raise ValueError(f"backend={backend!r} cannot run here: {missing}")
        kernel, why = backend, f"backend={backend!r}" + kv_reason(kv)
    else:
        kernel, why = sparse_decode_kernel(q, kv, v_dim, rows) if h > 0 else ("triton", "no heads")
    if kernel == "gluon_small" and workspace is not None:
        splits = small_decode_tiles(t, rows.shape[1], num_sms, kv_fp8=kv.dtype == torch.uint8)[1]
        need = split_partials_numel(splits, t, h, v_dim)
        if workspace.numel() < need:
            if backend == "gluon_small":
                raise ValueError(
                    f"workspace must hold >= {need} fp32 elements for the small-batch kernel's {splits} splits"
                )
            return "triton", f"the workspace holds fewer than the small-batch kernel's {need} fp32 elements"
    return kernel, why
