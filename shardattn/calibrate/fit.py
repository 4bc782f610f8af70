"""Fit step overheads from measured steps (pure arithmetic, tested on the CPU)."""

from __future__ import annotations

from collections.abc import Sequence

from shardattn.plan.cost import StepOverhead

__all__ = ["fit_step_overhead"]


def fit_step_overhead(samples: Sequence[tuple[float, float]]) -> StepOverhead:
    """``fixed_ms + factor * x`` through ``(x, y)`` samples by least squares, both terms ``>= 0``.

    ``x`` is a step's predicted collectives plus copies (ms), ``y`` its measured time beyond the
    kernel alone (ms). One sample (or equal ``x``): ``factor = y / x``, no fixed part.

    >>> fit_step_overhead([(1.0, 2.5), (2.0, 4.5)])
    StepOverhead(fixed_ms=0.5, factor=2.0)
    >>> fit_step_overhead([(1.0, 2.0)])
    StepOverhead(fixed_ms=0.0, factor=2.0)
    >>> fit_step_overhead([(1.0, -0.5), (2.0, -0.2)])  # the step hides more than it adds
    StepOverhead(fixed_ms=0.0, factor=0.0)
    """
    if not samples:
        raise ValueError("samples must not be empty")
    xs, ys = [s[0] for s in samples], [s[1] for s in samples]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    if var > 0:
        factor = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
        fixed = my - factor * mx
    else:
        factor, fixed = -1.0, -1.0
    if fixed < 0 or factor < 0:  # through the origin, else a constant
        sxx = sum(x * x for x in xs)
        factor, fixed = (max(0.0, sum(x * y for x, y in zip(xs, ys)) / sxx) if sxx > 0 else 0.0), 0.0
        if factor == 0.0:
            fixed = max(0.0, my)
    return StepOverhead(round(fixed, 6), round(factor, 6))
