"""Measure prefill kernel calls and collectives for a calibration table.

Kernel points: one call of the sparse-MLA prefill as the steps make it (row sort or union build
plus the kernel, :func:`~shardattn.ops.sparse_mla_grouped.sparse_mla_grouped_prefill`) on
the launcher's synthetic step (``requests`` requests with ``cached`` tokens each, DSA-like
top-k), for each head count, each group size that fits the 64-row tile, and each token count.
Several passes over all points (``--passes``) give each point the median of its passes
(:func:`median_points`): one pass's short points move by up to a third between passes on an H200.

Collective rates: ``all_to_all`` and ``all_gather`` over a few sizes on the group, fitted to
``latency + moved / bus bandwidth`` (``moved = bytes * (W - 1) / W``, NCCL's bus-bandwidth convention).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from shardattn.calibrate.timing import median_ms
from shardattn.launch.workloads import build_prefill
from shardattn.ops.kv_fp8 import quantize_kv
from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill
from shardattn.parallel.comm import Comm
from shardattn.plan.cost import CollectiveRate, KernelPoint, candidate_group_sizes
from shardattn.plan.kv_format import KV_FP8_DS_MLA
from shardattn.plan.routing import TILE_ROWS
from shardattn.workload import union_ratio

__all__ = ["collective_rates", "fit_latency_bandwidth", "kernel_jobs", "measure_kernel_points", "median_points"]

HEAD_DIM, V_DIM = 576, 512


def kernel_jobs(heads: Sequence[int], tokens: Sequence[int], *, all_groups: bool = False) -> list[tuple[int, int, int]]:
    """``(heads, G, tokens)`` of every kernel point: per-query and the ``G`` that fills a tile at each
    head count (``all_groups``: every ``G`` that fits; the model scales the others from per-query).

    >>> kernel_jobs([8, 64], [4096])
    [(8, 1, 4096), (8, 8, 4096), (64, 1, 4096)]
    >>> kernel_jobs([8], [4096], all_groups=True)
    [(8, 1, 4096), (8, 2, 4096), (8, 4, 4096), (8, 8, 4096)]
    >>> kernel_jobs([8, 8], [4096, 4096]) == kernel_jobs([8], [4096])  # each point once
    True
    """
    jobs = []
    for t in dict.fromkeys(tokens):
        for h in dict.fromkeys(heads):
            sizes = candidate_group_sizes(h)
            jobs += [(h, g, t) for g in (sizes if all_groups else sorted({1, max(sizes)}))]
    return jobs


def measure_kernel_points(
    jobs: Sequence[tuple[int, int, int]],
    *,
    topk: int,
    device: torch.device,
    dtype: torch.dtype,
    reps: int,
    requests: int = 4,
    cached: int = 8192,
    seed: int = 0,
    advance: Callable[[], None] = lambda: None,
    kv_formats: Sequence[str] = ("bfloat16",),
) -> list[KernelPoint]:
    """Time each ``(heads, G, tokens)`` job (one synthetic step per token count, q per head count)
    on each KV format of ``kv_formats`` (``"bfloat16"``: rows in ``dtype``; ``"fp8_ds_mla"``: the
    same rows quantised, :func:`~shardattn.ops.kv_fp8.quantize_kv`), one point per format (a format
    listed twice is timed once, as a head or token count listed twice is one job)."""
    points = []
    steps: dict[int, tuple[torch.Tensor, torch.Tensor, dict[int, float]]] = {}
    for heads, g, tokens in jobs:
        if tokens not in steps:
            steps.clear()  # one token count's step at a time (memory)
            step = build_prefill(
                heads=1,
                head_dim=HEAD_DIM,
                tokens=tokens,
                requests=requests,
                cached=(cached,) * requests,
                topk=topk,
                overlap="dsa",
                dtype=dtype,
                device=device,
                seed=seed,
            )
            steps[tokens] = (step.kv, step.rows, {})
        kv, rows, ratios = steps[tokens]
        if g > 1 and g not in ratios:  # on a sample of rows (the ratio is a property of the top-k)
            ratios[g] = union_ratio(rows[: min(len(rows), 2048)], g)
        q = torch.randn(tokens, heads, HEAD_DIM, device=device, dtype=torch.float32).mul_(0.5).to(dtype)
        keys = int((rows >= 0).sum()) // max(1, tokens)

        for fmt in dict.fromkeys(kv_formats):
            kv_rows = quantize_kv(kv) if fmt == KV_FP8_DS_MLA else kv

            def call(q: torch.Tensor = q, kv: torch.Tensor = kv_rows, rows: torch.Tensor = rows, g: int = g) -> None:
                sparse_mla_grouped_prefill(q, kv, rows, scale=HEAD_DIM**-0.5, v_dim=V_DIM, group_size=g)

            ms = median_ms(call, device=device, reps=reps, warmup=2)
            points.append(KernelPoint(heads, TILE_ROWS, g, ratios.get(g, 1.0), tokens, keys, ms, kv_format=fmt))
        del q
        advance()
    return points


def median_points(passes: Sequence[Sequence[KernelPoint]]) -> list[KernelPoint]:
    """Per ``(heads, group_size, tokens, kv_format)``, the point whose time is the median of the passes (the
    lower one of an even count: always a measured point), in the first pass's order.

    Args:
        passes: each pass's points, every pass timing the same jobs.
    Raises:
        ValueError: no pass, a job timed twice in a pass, or passes that timed different jobs.

    >>> a, b, c = (KernelPoint(8, 64, 1, 1.0, 4096, 2048, ms) for ms in (2.0, 3.0, 1.0))
    >>> median_points([[a], [b], [c]])[0].ms
    2.0
    """
    if not passes:
        raise ValueError("passes must hold at least one pass")
    keys = [(p.heads, p.group_size, p.tokens, p.kv_format) for p in passes[0]]
    if len(set(keys)) < len(keys):
        raise ValueError("each pass must time each job once (pass 0 timed one twice)")
    by_key: dict[tuple[int, int, int, str], list[KernelPoint]] = {k: [] for k in keys}
    for i, points in enumerate(passes):
        if sorted((p.heads, p.group_size, p.tokens, p.kv_format) for p in points) != sorted(keys):
            raise ValueError(f"pass {i} timed other jobs than pass 0")
        for p in points:
            by_key[(p.heads, p.group_size, p.tokens, p.kv_format)].append(p)
    return [sorted(by_key[k], key=lambda p: p.ms)[(len(passes) - 1) // 2] for k in keys]


def fit_latency_bandwidth(samples: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(latency_ms, GB/s)`` of ``ms = latency + moved_bytes / rate`` by least squares over
    ``(moved_bytes, ms)`` samples (latency clamped at 0).

    >>> fit_latency_bandwidth([(1e9, 10.02), (2e9, 20.02)])
    (0.02, 100.0)
    """
    n = len(samples)
    xs, ys = [s[0] for s in samples], [s[1] for s in samples]
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else my / mx
    lat = my - slope * mx
    if lat < 0 or slope <= 0:
        lat, slope = 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return round(lat, 6), round(1.0 / slope / 1e6, 3)


def collective_rates(
    group: dist.ProcessGroup,
    *,
    device: torch.device,
    sizes_mib: Sequence[float] = (4, 32, 128, 512),
    reps: int = 5,
    advance: Callable[[], None] = lambda: None,
) -> list[CollectiveRate]:
    """Fitted ``all_to_all`` and ``all_gather`` rates of ``group`` (``bytes`` = one rank's buffer)."""
    w = dist.get_world_size(group)
    comm = Comm(group)  # the library's all-gather (torch's current name for it; the old one warns)
    out = []
    for op in ("all_to_all", "all_gather"):
        samples = []
        for mib in sizes_mib:
            n = int(mib * (1 << 20))
            n -= n % w
            src = torch.empty(n if op == "all_to_all" else n // w, dtype=torch.uint8, device=device).random_(0, 255)
            dst = torch.empty(n, dtype=torch.uint8, device=device)
            if op == "all_to_all":

                def call(dst: torch.Tensor = dst, src: torch.Tensor = src) -> None:
                    dist.all_to_all_single(dst, src, group=group)

            else:

                def call(dst: torch.Tensor = dst, src: torch.Tensor = src) -> None:
                    comm.all_gather(src, out=dst.view(w, -1))

            ms = median_ms(call, device=device, reps=reps, warmup=2, group=group)
            samples.append((n * (w - 1) / w, ms))
            advance()
        lat, gbps = fit_latency_bandwidth(samples)
        out.append(CollectiveRate(op, w, lat, gbps))
    return out
