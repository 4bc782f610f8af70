"""What the soaks measure about a process over a run, in memory that does not grow with the run.

``benchmarks/soak_pool.py`` and ``benchmarks/soak_runtime.py`` share these: the process's RSS, its
live torch tensors (after a collection), memory growth between the start and the end of a run
after its warm-up, and step times in a fixed histogram (a soak must not grow by its own records).

>>> h = LogHistogram()
>>> for ms in (1.0, 2.0, 3.0, 100.0):
...     h.add(ms / 1e3)
>>> round(h.quantile(0.5) * 1e3, 1), h.n
(2.0, 4)
>>> growth_pct([100, 100, 100, 101, 101, 101])
1.0
"""

from __future__ import annotations

import ctypes
import gc
import os
import statistics
import warnings

import numpy as np
import torch

__all__ = ["LogHistogram", "floor_growth", "growth_pct", "heap_bytes", "live_tensors", "rss_bytes"]


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process (``/proc/<pid>/statm``), in bytes."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]  # fmt: skip


def heap_bytes() -> tuple[int, int] | None:
    """glibc's heap: ``(bytes in use, bytes free but kept)`` by ``malloc`` (``mallinfo2``, glibc
    2.33+), or ``None`` elsewhere. Free bytes kept are RSS that is no leak: glibc keeps freed
    chunks below its trim threshold, which rises (to 64 MB) after large blocks are freed."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):
        return None
    fn.restype = _Mallinfo2
    m = fn()
    return int(m.uordblks + m.hblkhd), int(m.fordblks)


def live_tensors() -> int:
    """Live torch tensors in this process, after a collection."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on every object touches deprecated torch attributes
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def floor_growth(values: list[int], window: int = 3) -> int | None:
    """Growth of the least of the last ``window`` samples over the least of the first ``window``.

    A leak (a tensor kept per step or per shape) raises every later sample, so it raises the
    floor; a tensor alive only while a step's asynchronous work (a collective, a peer watch) is in
    flight at one sample does not. ``None`` without samples.

    >>> floor_growth([10, 10, 10, 13, 10, 10]), floor_growth([10, 10, 10, 11, 12, 13])
    (0, 1)
    """
    if not values:
        return None
    w = max(1, min(window, len(values) // 2))
    return min(values[-w:]) - min(values[:w])


def growth_pct(values: list[float], window: int = 3) -> float | None:
    """Growth (%) of the median of the last ``window`` samples over the median of the first
    ``window`` (``None`` with fewer than ``2 * window`` samples)."""
    if len(values) < 2 * window:
        return None
    first, last = statistics.median(values[:window]), statistics.median(values[-window:])
    return 100.0 * (last - first) / first if first else None


class LogHistogram:
    """Durations in constant memory: 100 bins a decade from 10 us to 1000 s; quantiles to within
    2.3 % (the upper edge of the quantile's bin)."""

    LO, PER_DECADE, DECADES = 1e-5, 100, 8

    def __init__(self) -> None:
        self.bins = np.zeros(self.PER_DECADE * self.DECADES + 1, dtype=np.int64)
        self.n = 0

    def add(self, seconds: float) -> None:
        i = int(np.log10(max(seconds, self.LO) / self.LO) * self.PER_DECADE)
        self.bins[min(i, self.bins.size - 1)] += 1
        self.n += 1

    def quantile(self, q: float) -> float:
        """The ``q`` quantile in seconds (NaN when empty)."""
        if not self.n:
            return float("nan")
        i = int(np.searchsorted(np.cumsum(self.bins), q * self.n))
        return self.LO * 10 ** ((i + 1) / self.PER_DECADE)
