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

Foreign kernels differ and are converted here, once, at the boundary:
FlashInfer returns base-2 LSEs (:func:`lse_from_base2`); FlashMLA returns ``+inf`` for
empty rows (:func:`lse_from_pos_inf_empty`).
"""

from __future__ import annotations

import math

import torch

from shardattn._checks import FLOAT_DTYPES, check_same_device, check_tensor

LN2 = math.log(2.0)


def lse_from_base2(lse2: torch.Tensor) -> torch.Tensor:
    """Convert a base-2 LSE (FlashInfer) to natural log. ``-inf`` stays ``-inf``.

    Args:
        lse2: ``[T, H]`` float, ``log2(sum exp2(s * log2 e))``.
    Returns:
        ``[T, H]`` fp32 natural-log LSE.
    """
    return lse2.float() * LN2


def lse_from_pos_inf_empty(lse: torch.Tensor) -> torch.Tensor:
    """Map ``+inf`` (and NaN) empty-row markers of foreign kernels (FlashMLA) to ``-inf``.

    Args:
        lse: ``[T, H]`` float natural-log LSE whose empty rows are ``+inf`` or NaN.
    Returns:
        ``[T, H]`` fp32 LSE in this library's convention.
    """
    lse = lse.float()
    return torch.where(torch.isposinf(lse) | torch.isnan(lse), torch.full_like(lse, -math.inf), lse)


def merge_weights(lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge's per-partial weights and merged LSE.

    Args:
        lses: ``[P, ...]`` fp32 LSEs.
    Returns:
        ``(weights [P, ...] fp32, lse [...] fp32)`` with ``weights = exp(lse_i - lse)``;
        all-``-inf`` positions give weights 0 and lse ``-inf``.
    """
    lses = lses.float()
    m = lses.amax(dim=0)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    scaled = torch.exp(lses - m_safe)
    total = scaled.sum(dim=0)
    lse = torch.where(total > 0, m_safe + torch.log(total), torch.full_like(m, -math.inf))
    weights = scaled / torch.where(total > 0, total, torch.ones_like(total))
    return weights, lse


def lse_merge_reference(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`lse_merge` (fp32 throughout).

    Args:
        outs: ``[P, T, H, D]`` partial outputs (any float dtype).
        lses: ``[P, T, H]`` fp32 natural-log LSEs, ``-inf`` for empty partial rows.
    Returns:
        ``(out [T, H, D] in outs.dtype, lse [T, H] fp32)``.
    """
    weights, lse = merge_weights(lses)
    out = (weights.unsqueeze(-1) * outs.float()).sum(dim=0)
    return out.to(outs.dtype), lse


def check_merge_inputs(outs: torch.Tensor, lses: torch.Tensor) -> None:
    """Validate :func:`lse_merge` arguments (shapes, dtypes, devices); no GPU sync."""
    check_tensor("outs", outs, dtypes=FLOAT_DTYPES, ndim=4)
    check_tensor("lses", lses, dtypes=(torch.float32,), shape=tuple(outs.shape[:3]))
    check_same_device(outs=outs, lses=lses)
    if outs.shape[0] < 1:
        raise ValueError(f"outs must hold at least one partial, got shape {list(outs.shape)}")


def lse_merge(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``P`` partial attention results by their LSEs.

    Args:
        outs: ``[P, T, H, D]`` partial outputs (fp16 / bf16 / fp32).
        lses: ``[P, T, H]`` fp32 natural-log LSEs; ``-inf`` marks an empty partial row.
            Convert foreign LSEs first (:func:`lse_from_base2`, :func:`lse_from_pos_inf_empty`).
    Returns:
        ``(out [T, H, D] in outs.dtype, lse [T, H] fp32)``; a row empty in every partial is
        ``(0, -inf)``.

    Example:
        >>> outs, lses = torch.ones(2, 3, 4, 8), torch.zeros(2, 3, 4)
        >>> out, lse = lse_merge(outs, lses)
        >>> tuple(out.shape), tuple(lse.shape), round(float(lse[0, 0]), 4)
        ((3, 4, 8), (3, 4), 0.6931)
    """
    check_merge_inputs(outs, lses)
    return lse_merge_reference(outs, lses)
