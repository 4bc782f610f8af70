"""Integer helpers shared by the planner and the kernels' launch configurations (no torch)."""

from __future__ import annotations

__all__ = ["next_pow2"]


def next_pow2(n: int) -> int:
    """The smallest power of two at or above ``n`` (1 for ``n <= 1``).

    >>> [next_pow2(n) for n in (0, 1, 2, 3, 64, 65)]
    [1, 1, 2, 4, 64, 128]
    """
    return 1 << max(0, n - 1).bit_length()
