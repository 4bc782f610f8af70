"""CUDA-graph helpers shared by the decode benchmarks: capture a step into a graph, and profile
the kernels of its replays (device durations, gaps, span) with the torch profiler."""

from __future__ import annotations

import torch

from shardattn.runtime.cudagraph import DecodeGraph


def graph_of(fn):
    """Capture ``fn`` into a CUDA graph (the library's :class:`DecodeGraph`: two warm-up runs on a
    side stream, then the capture); returns the graph."""
    return DecodeGraph(fn, {}).graph


def replay_us(fn, rep: int = 25, rounds: int = 1, warm: tuple = ()) -> float:
    """Microseconds of ``fn`` captured in a CUDA graph and replayed: the median of
    ``triton.testing.do_bench`` (which flushes the L2 between replays), the least over ``rounds``.

    ``warm``: ``(dst, src)`` tensor pairs copied after each flush, outside the timed span, so
    ``dst`` is in the L2 when the replay starts, as the output of the kernel before it would be
    (a decode step's q and top-k rows); the timing is then the same events and median by hand."""
    import triton.testing

    g = graph_of(fn)
    if not warm:
        return min(
            1e3 * triton.testing.do_bench(g.replay, warmup=5, rep=rep, return_mode="median") for _ in range(rounds)
        )
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")  # as do_bench's
    best = float("inf")
    for _ in range(rounds):
        for _ in range(5):
            g.replay()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
        for start, end in zip(starts, ends, strict=True):
            flush.zero_()
            for dst, src in warm:
                dst.copy_(src)
            start.record()
            g.replay()
            end.record()
        torch.cuda.synchronize()
        times = sorted(start.elapsed_time(end) for start, end in zip(starts, ends, strict=True))
        best = min(best, 1e3 * times[len(times) // 2])
    return best


def gpu_banner() -> str:
    """``GPU: <name>  torch <version>  triton <version>``: the first line the decode probes print."""
    import triton

    return f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}"


def trivial_graph_us(rep: int = 40, rounds: int = 1) -> float:
    """:func:`replay_us` of a graph of one 1-element kernel: the floor every replay timing includes."""
    x = torch.zeros(1, device="cuda")
    return replay_us(lambda: x.add_(1), rep=rep, rounds=rounds)


def profile_graph(fn, replays: int = 30) -> dict:
    """Kernels of ``fn``'s graph over ``replays`` replays (L2 flushed before each): mean device
    duration per kernel, mean gap between consecutive kernels, mean span of a replay (us)."""
    from torch.profiler import ProfilerActivity, profile

    g = graph_of(fn)
    src = torch.empty(128 << 20, dtype=torch.int8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            dst.copy_(src)  # flushes the L2 (a memcpy, not a kernel: left out below)
            g.replay()
        torch.cuda.synchronize()
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type.name == "CUDA" and not e.name.startswith("Memcpy")
    )
    per = max(1, len(kernels) // replays)
    names, durs, gaps, spans = [], {}, [], []
    for i in range(0, per * replays, per):
        step = kernels[i : i + per]
        if not names:
            names = [k[2][:60] for k in step]
        for j, (a, b, _name) in enumerate(step):
            durs.setdefault(j, []).append(b - a)
            if j:
                gaps.append(a - step[j - 1][1])
        spans.append(step[-1][1] - step[0][0])

    def med(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2] if xs else float("nan")

    return {
        "kernels": names,
        "kernel_us": [med(durs[j]) for j in sorted(durs)],
        "gap_us": med(gaps),
        "span_us": med(spans),
        "kernels_per_replay": per,
    }
