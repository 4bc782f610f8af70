"""The online-softmax update and finish shared by every Triton attention kernel (base 2).

State per query row: running max ``m_i`` (of logits already multiplied by ``log2(e)``), running
denominator ``l_i`` and the unnormalised accumulator ``acc``. A block of logits ``s`` (``-inf``
where masked) updates it as::

    m_new = max(m_i, max_j s_j)                (-inf stays -inf: rows with no key yet)
    alpha = 2^(m_i - m_new),  p_j = 2^(s_j - m_new)
    l_i   = alpha * l_i + sum_j p_j,  acc = alpha * acc + p @ V

and the row finishes as ``out = acc / l_i``, ``lse = ln 2 * (m_i + log2 l_i)``, with ``(0, -inf)``
for a row that saw no key (``l_i = 0``): the merge identity of :mod:`shardattn.ops.lse_merge`.
Sinks enter as one more logit: kernels start a row at ``(m_i, l_i) = (sink, 1)`` or fold it in
after the loop; either is this same update.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_step(s, m_i, l_i):
    """One block: ``s [M, N]`` fp32 base-2 logits; returns ``(p [M, N], alpha [M], m_new [M], l_new [M])``."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new


@triton.jit
def online_softmax_finish(acc, m_i, l_i):
    """Normalise: returns ``(out [M, D] fp32, lse [M] fp32 natural log)``, ``(0, -inf)`` for empty rows
    (a NaN sum, from a NaN logit, is not empty: it gives NaN)."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    return out, lse
