"""The softmax of the torch references: logits with masked keys and an optional sink, to
normalised weights and the log-sum-exp.

One implementation for every reference (sparse MLA prefill and decode, GQA prefill and decode):
a masked key is a ``-inf`` logit; a sink is a logit with no value that joins the denominator; a
row with no key and no sink gives weights 0 and LSE ``-inf`` (so ``out`` 0); a NaN logit gives NaN
weights and LSE (it propagates, never silently dropped).

    >>> p, lse = softmax_rows(torch.tensor([[0.0, -math.inf], [-math.inf, -math.inf]]), None)
    >>> p.tolist(), lse.tolist()
    ([[1.0, 0.0], [0.0, 0.0]], [0.0, -inf])
    >>> p, lse = softmax_rows(torch.tensor([[0.0, 0.0]]), torch.tensor([0.0]))
    >>> [round(x, 4) for x in p[0].tolist()], round(lse.item(), 4)
    ([0.3333, 0.3333], 1.0986)
"""

from __future__ import annotations

import math

import torch

__all__ = ["softmax_rows"]


def softmax_rows(logits: torch.Tensor, sink: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [..., n], lse [...])`` of ``logits [..., n]`` (``-inf``: a masked key), in the
    logits' dtype; ``sink`` (or ``None``) broadcasts to ``logits.shape[:-1]``: one logit a row that
    joins the denominator and has no value (the weights then sum to less than 1)."""
    m = logits.amax(dim=-1) if logits.shape[-1] else logits.new_full(logits.shape[:-1], -math.inf)  # no key
    if sink is not None:
        m = torch.maximum(m, sink)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(logits - m_safe[..., None])
    denom = p.sum(dim=-1)
    if sink is not None:
        denom = denom + torch.exp(sink - m_safe)
    empty = denom == 0  # no key (a NaN logit gives a NaN sum, which propagates to p and lse)
    p = p / torch.where(empty, torch.ones_like(denom), denom)[..., None]
    lse = torch.where(empty, torch.full_like(m, -math.inf), m_safe + torch.log(denom))
    return p, lse
