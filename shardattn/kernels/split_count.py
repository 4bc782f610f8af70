"""The split count of a split-KV decode launch: the cheapest count whose partials fit, or the one
asked for, halved until they fit (the Gluon decode kernels' planners share this skeleton; each
brings its own slicing, cost and limit).

    >>> shape = lambda s: (min(s, 8), -(-8 // min(s, 8)))  # 8 blocks: (splits, blocks a split)
    >>> pick_splits(shape, lambda s: s <= 4, lambda s: 8 / s + s, asked=None, limit=8, max_splits=16)
    2
    >>> pick_splits(shape, lambda s: s <= 4, lambda s: 0.0, asked=8, limit=8, max_splits=16)
    4
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["pick_splits"]


def pick_splits(
    shape: Callable[[int], tuple[int, int]],
    fits: Callable[[int], bool],
    cost: Callable[[int], float],
    *,
    asked: int | None,
    limit: int,
    max_splits: int,
) -> int:
    """A split count ``S`` (``shape(S)[0] == S``: ``shape(s)`` is ``(splits, rows or blocks a split)``
    of ``s`` asked-for slices, rounded as the kernel slices).

    Without ``asked``: the cheapest by ``cost`` among the powers of two up to ``max_splits`` (as
    ``shape`` rounds them) whose partials ``fits``; else ``asked`` (at most ``limit``) halved until it
    fits. 1 where nothing larger fits (one split writes no partial)."""
    if asked is None:
        candidates = sorted({shape(1 << i)[0] for i in range(max_splits.bit_length()) if (1 << i) <= max_splits})
        s = min((c for c in candidates if fits(c)), key=cost, default=1)
    else:
        s = shape(max(1, min(int(asked), limit)))[0]
        while s > 1 and not fits(s):
            s = shape(s // 2)[0]
    return s if s == 1 or fits(s) else 1
