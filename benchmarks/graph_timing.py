"""CUDA-graph timing shared by the decode benchmarks: a step captured once, its replays timed."""

from __future__ import annotations

from shardattn.runtime.graph_capture import DecodeGraph


def graph_of(fn):
    """``fn`` captured in a CUDA graph (the library's :class:`DecodeGraph`: two warm-up runs on a
    side stream, then the capture); returns the graph."""
    return DecodeGraph(fn, {}).graph


def replay_us(fn, rep: int = 200, warmup: int = 30) -> float:
    """Median microseconds of ``fn``'s graph replays under ``triton.testing.do_bench``, which
    flushes the L2 between replays: GPU time with the inputs in HBM, no host launch overhead."""
    import triton.testing

    g = graph_of(fn)
    return 1e3 * triton.testing.do_bench(g.replay, warmup=warmup, rep=rep, return_mode="median")
