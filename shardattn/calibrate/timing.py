"""Timing helpers shared by the calibration and the benchmarks: medians of synchronised calls.

Every time here is a host clock around one call with the device synchronised before and after
(so launch overhead counts, as it does for a serving step), median of ``reps`` calls after
``warmup`` untimed ones (the first of which compiles). With a process group, the ranks start
each call together (one barrier), so a collective step is not timed waiting for a late peer.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["copy_gbps", "median_ms", "sync"]


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(
    fn: Callable[[], Any],
    *,
    device: torch.device,
    reps: int,
    warmup: int = 1,
    group: dist.ProcessGroup | None = None,
) -> float:
    """Median milliseconds of ``reps`` calls of ``fn`` after ``warmup`` untimed ones.

    Args:
        fn: the call (its result is dropped). device: where it runs (synchronised around each call).
        reps / warmup: timed and untimed calls. group: when given, a barrier before every call.
    """
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if group is not None:
            dist.barrier(group=group)
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def copy_gbps(device: torch.device, nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Device-to-device copy rate in GB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device=device, reps=reps, warmup=1)
    return 2 * nbytes / (ms * 1e-3) / 1e9
