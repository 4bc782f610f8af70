"""Merging partial attention results by their log-sum-exp (LSE).

Contract (docs/ARCHITECTURE.md, "LSE"): an LSE is fp32, natural log, shape ``[tokens, heads]``;
a row with no valid key is ``(out = 0, lse = -inf)``, the identity of the merge.

Merge of P partials (the one implementation of this math; every other path calls it or is
tested against it)::

    m   = max_i lse_i
    lse = m + log(sum_i exp(lse_i - m))
    out = sum_i exp(lse_i - lse) * out_i          (fp32 accumulation)

All ``-inf`` gives ``(0, -inf)``, never NaN. Derivation: each partial is
``out_i = sum_j p_ij v_j / Z_i`` with ``Z_i = exp(lse_i)``; the full softmax has
``Z = sum_i Z_i`` and ``out = sum_i (Z_i / Z) out_i``.

Empty partials: ``-inf`` is this library's marker; ``+inf`` (FlashMLA's value for a row with no
valid key) is read as empty too, by the reference and the Triton kernel alike, so a partial from
such a kernel merges as the identity instead of turning the row into NaN. A NaN LSE is not a
marker and propagates. Base-2 LSEs (FlashInfer's merge API) must be multiplied by ``ln 2`` by
whoever brings them; no adapter here returns one (the XQA decode adapter returns no LSE).

On CUDA tensors (or under ``TRITON_INTERPRET=1``) :func:`lse_merge` runs the Triton kernel
(:mod:`shardattn.kernels.triton.lse_merge`: one program per block of ``(t, h)`` rows, two passes
over the ``P`` LSEs, one over the partial outputs); it is tested against
:func:`lse_merge_reference`. The kernel is capture-safe: no host synchronisation, and no
allocation when ``out=`` / ``lse_out=`` are given. The same module holds the column merge (few
rows, many partials: every partial of a column block loaded at once) that split-KV decode takes
where :func:`~shardattn.plan.decode_routing.route_decode_merge` says so.
"""

from __future__ import annotations

import math

import torch

from shardattn._checks import FLOAT_DTYPES, check_disjoint, check_not_inputs, check_same_device, check_tensor
from shardattn.kernels.backend import use_triton
from shardattn.kernels.triton.lse_merge import HAVE_TRITON, launch_lse_merge


def empty_as_neg_inf(lses: torch.Tensor) -> torch.Tensor:
    """fp32 ``lses`` with ``+inf`` (FlashMLA's empty row) mapped to ``-inf`` (this library's).

    >>> empty_as_neg_inf(torch.tensor([1.0, float("inf"), float("-inf")])).tolist()
    [1.0, -inf, -inf]
    """
    lses = lses.float()
    return torch.where(torch.isposinf(lses), torch.full_like(lses, -math.inf), lses)


def merge_weights(lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge's per-partial weights and merged LSE.

    Args:
        lses: ``[P, ...]`` fp32 LSEs; ``-inf`` or ``+inf`` marks an empty partial (weight 0).
    Returns:
        ``(weights [P, ...] fp32, lse [...] fp32)`` with ``weights = exp(lse_i - lse)``;
        positions empty in every partial give weights 0 and lse ``-inf``. A NaN LSE is not an
        empty marker: it propagates (NaN weights and lse), so a broken partial is seen.
    """
    lses = empty_as_neg_inf(lses)
    m = lses.amax(dim=0)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    scaled = torch.exp(lses - m_safe)
    total = scaled.sum(dim=0)
    empty = total == 0  # every partial empty (a NaN LSE gives a NaN total, which propagates)
    lse = torch.where(empty, torch.full_like(m, -math.inf), m_safe + torch.log(total))
    weights = scaled / torch.where(empty, torch.ones_like(total), total)
    return weights, lse


def weighted(weights: torch.Tensor, outs: torch.Tensor) -> torch.Tensor:
    """``weights[..., None] * outs`` in fp32, exactly 0 where a weight is 0: an empty partial
    contributes nothing whatever its output holds (NaN or inf included), as in the merge kernels.

    >>> weighted(torch.tensor([1.0, 0.0]), torch.tensor([[2.0], [float("nan")]])).tolist()
    [[2.0], [0.0]]
    """
    w = weights.unsqueeze(-1)
    return torch.where(w == 0, torch.zeros((), dtype=torch.float32, device=outs.device), w * outs.float())


def lse_merge_reference(
    outs: torch.Tensor, lses: torch.Tensor, *, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`lse_merge` (fp32 throughout).

    Args:
        outs: ``[P, T, H, D]`` partial outputs (any float dtype).
        lses: ``[P, T, H]`` fp32 natural-log LSEs, ``-inf`` or ``+inf`` for empty partial rows.
        out_dtype: the merged output's dtype (default ``outs.dtype``); the fp32 merge is rounded
            to it once, as the kernels store their accumulator in their destination's dtype.
    Returns:
        ``(out [T, H, D] in out_dtype, lse [T, H] fp32)``.
    """
    weights, lse = merge_weights(lses)
    out = weighted(weights, outs).sum(dim=0)
    return out.to(outs.dtype if out_dtype is None else out_dtype), lse


def check_merge_inputs(outs: torch.Tensor, lses: torch.Tensor) -> None:
    """Validate :func:`lse_merge` arguments (shapes, dtypes, devices); no GPU sync."""
    check_tensor("outs", outs, dtypes=FLOAT_DTYPES, ndim=4)
    check_tensor("lses", lses, dtypes=(torch.float32,), shape=tuple(outs.shape[:3]))
    check_same_device(outs=outs, lses=lses)
    if outs.shape[0] < 1:
        raise ValueError(f"outs must hold at least one partial, got shape {list(outs.shape)}")


def lse_merge(
    outs: torch.Tensor,
    lses: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``P`` partial attention results by their LSEs.

    Args:
        outs: ``[P, T, H, D]`` partial outputs (fp16 / bf16 / fp32).
        lses: ``[P, T, H]`` fp32 natural-log LSEs; ``-inf`` (or ``+inf``, FlashMLA's marker)
            is an empty partial row, which contributes nothing whatever its ``outs`` hold.
        out: optional ``[T, H, D]`` destination (any float dtype; a CUDA graph passes its own).
        lse_out: optional ``[T, H]`` fp32 destination, not sharing bytes with ``out``. Neither
            shares memory with ``outs`` or ``lses`` (the kernel's programs write rows of ``out``
            while others still read the partials).
    Returns:
        ``(out [T, H, D] in outs.dtype (or out's dtype), lse [T, H] fp32)``; a row empty in every
        partial is ``(0, -inf)``. On CUDA tensors the Triton kernel runs, else the reference.

    Example:
        >>> outs, lses = torch.ones(2, 3, 4, 8), torch.zeros(2, 3, 4)
        >>> out, lse = lse_merge(outs, lses)
        >>> tuple(out.shape), tuple(lse.shape), round(float(lse[0, 0]), 4)
        ((3, 4, 8), (3, 4), 0.6931)
    """
    check_merge_inputs(outs, lses)
    _, t, h, d = outs.shape
    if out is not None:
        check_tensor("out", out, dtypes=FLOAT_DTYPES, shape=(t, h, d))
    if lse_out is not None:
        check_tensor("lse_out", lse_out, dtypes=(torch.float32,), shape=(t, h))
    check_same_device(outs=outs, out=out, lse_out=lse_out)
    check_disjoint(out=out, lse_out=lse_out)
    check_not_inputs({"out": out, "lse_out": lse_out}, {"outs": outs, "lses": lses})
    return run_lse_merge(outs, lses, out=out, lse_out=lse_out)


def run_lse_merge(
    outs: torch.Tensor,
    lses: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`lse_merge` on arguments already checked (by it, or by a step whose partials came
    from this library's own kernels): the Triton kernel on CUDA tensors, else the reference; no
    argument checks. Shapes and return value: :func:`lse_merge`."""
    _, t, h, d = outs.shape
    if not HAVE_TRITON or not use_triton(outs) or d == 0:  # no values to merge: the LSEs alone
        with torch.no_grad():  # inference, as the kernels: no autograd history on any device
            ref_out, ref_lse = lse_merge_reference(outs, lses, out_dtype=None if out is None else out.dtype)
        if out is None and lse_out is None:
            return ref_out, ref_lse
        out = ref_out if out is None else out.copy_(ref_out)
        lse_out = ref_lse if lse_out is None else lse_out.copy_(ref_lse)
        return out, lse_out
    out = torch.empty(t, h, d, dtype=outs.dtype, device=outs.device) if out is None else out
    lse_out = torch.empty(t, h, dtype=torch.float32, device=outs.device) if lse_out is None else lse_out
    launch_lse_merge(outs, lses, out, lse_out)
    return out, lse_out
