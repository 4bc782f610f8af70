"""Fit step overheads from measured steps (pure arithmetic, tested on the CPU)."""

from __future__ import annotations

from collections.abc import Sequence

from shardattn.plan.cost import StepOverhead

__all__ = ["degenerate_fit", "fit_step_overhead"]


def _fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """``(fixed, factor, squared error)`` of ``y = fixed + factor * x``, both terms ``>= 0``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    factor, fixed = -1.0, -1.0
    if var > 0:
        factor = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
        fixed = my - factor * mx
    if fixed < 0 or factor < 0:  # through the origin, else a constant
        sxx = sum(x * x for x in xs)
        factor, fixed = (max(0.0, sum(x * y for x, y in zip(xs, ys)) / sxx) if sxx > 0 else 0.0), 0.0
        if factor == 0.0:
            fixed = max(0.0, my)
    err = sum((fixed + factor * x - y) ** 2 for x, y in zip(xs, ys))
    return fixed, factor, err


def fit_step_overhead(samples: Sequence[tuple[float, float, float]]) -> StepOverhead:
    """Fit :class:`StepOverhead` to ``(exposed, kernel_ms, beyond_kernel_ms)`` samples.

    ``exposed`` is a step's predicted collectives plus copies (ms), ``kernel_ms`` its kernel
    alone, ``beyond_kernel_ms`` its measured time minus the kernel alone. ``hidden`` is searched
    on a grid of 0.05 (the share of ``min(exposed, kernel)`` the step overlaps), ``fixed_ms`` and
    ``factor`` by least squares for each, both ``>= 0``; a fit whose ``factor * hidden`` exceeds 1
    (more hidden than the kernel lasts, so a larger step would be predicted faster) is not taken.

    >>> fit_step_overhead([(1.0, 5.0, 2.5), (2.0, 5.0, 4.5)])
    StepOverhead(fixed_ms=0.5, factor=2.0, hidden=0.0)
    >>> fit_step_overhead([(1.0, 5.0, -0.5), (2.0, 5.0, -0.2)])  # the step hides more than it adds
    StepOverhead(fixed_ms=0.0, factor=0.0, hidden=0.0)
    >>> fit_step_overhead([(2.0, 4.0, 0.6), (4.0, 4.0, 1.1), (6.0, 4.0, 3.1), (1.0, 8.0, 0.35)])
    StepOverhead(fixed_ms=0.1, factor=1.0, hidden=0.75)
    """
    if not samples:
        raise ValueError("samples must not be empty")
    best: tuple[float, float, float, float] | None = None
    for step in range(21):
        hidden = step / 20
        xs = [x - hidden * min(x, k) for x, k, _ in samples]
        fixed, factor, err = _fit_line(xs, [y for _, _, y in samples])
        if factor * hidden > 1:  # it would hide more than the kernel lasts (Calibration.validate refuses it)
            continue
        if best is None or err < best[0] - 1e-12:
            best = (err, fixed, factor, hidden)
    assert best is not None
    _, fixed, factor, hidden = best
    return StepOverhead(round(fixed, 6), round(factor, 6), hidden if factor > 0 else 0.0)


def degenerate_fit(name: str, fitted: StepOverhead, samples: Sequence[tuple[float, float, float]]) -> str | None:
    """Why ``fitted`` must not be used, or ``None``: a fit of ``factor = 0`` prices ``name``'s
    step's collectives and copies at nothing, whatever they cost (across hosts too), and
    ``fixed_ms = 0`` as well its step at its kernel alone (what a CPU run, or steps timed in
    noise, fits). The message names the samples.

    >>> why = degenerate_fit("shardq", StepOverhead(0.0, 0.0), [(1.0, 5.0, -0.5)])
    >>> why.startswith("the shardq step overhead fitted to 0.000 ms + 0.000 x"), "kernel -0.500 ms" in why
    (True, True)
    >>> degenerate_fit("shardq", StepOverhead(0.1, 1.0), [(1.0, 5.0, 1.1)]) is None
    True
    >>> degenerate_fit("shardq", StepOverhead(1.2, 0.0), [(1.0, 5.0, 1.2)]) is None  # a fixed cost alone
    False
    """
    if fitted.factor > 0:
        return None
    points = ", ".join(f"(exposed {x:.3f} ms, kernel {k:.3f} ms, beyond the kernel {y:.3f} ms)" for x, k, y in samples)
    return (
        f"the {name} step overhead fitted to {fitted.fixed_ms:.3f} ms + {fitted.factor:.3f} x (collectives and copies "
        f"free) from {len(samples)} step(s): {points}"
    )
