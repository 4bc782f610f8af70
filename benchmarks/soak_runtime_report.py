"""The report of ``benchmarks/soak_runtime.py``: its verdict, its table and its records.

:func:`passed` judges every rank's summary (:meth:`soak_runtime.RuntimeSoak.summary`),
:func:`render` prints the table, :func:`soak_records` gives the ``runtime-soak`` records
(``benchmarks/records.py``).
"""

from __future__ import annotations

import argparse
from typing import Any

from records import environment, record

__all__ = ["passed", "render", "soak_records"]


def passed(ranks: list[dict[str, Any]], max_growth: float | None) -> bool:
    for r in ranks:
        if r["compiles_after_warmup"] is None:  # the run ended inside the warm-up
            return False
        if r["failed_checks"] or r["unwarmed_routes"] or r["compiles_after_warmup"] or not r["checks"]:
            return False
        if r["live_tensor_growth"]:  # a tensor kept per step (or per shape) after the warm-up
            return False
        growths = [g for g in (r["rss_growth_pct"], r["cuda_growth_pct"]) if g is not None]
        if max_growth is not None and (not growths or max(growths) > max_growth):
            return False
    return True


def render(ranks: list[dict[str, Any]], ok: bool) -> None:
    print("| rank | steps (prefill / decode) | checks (failed, max err) | compiles after warm-up | unwarmed routes "
          "| live tensors (growth) | RSS MB (growth) | CUDA allocated MB (growth) | prefill p50 / p99 ms "
          "| decode p50 / p99 ms |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")

    def mem(xs: list[float], g: float | None) -> str:
        return "-" if not xs else f"{xs[0]:.0f} -> {xs[-1]:.0f} ({'n/a' if g is None else f'{g:+.2f} %'})"

    for r in ranks:
        print(f"| {r['rank']} | {r['steps']} ({r['prefill_steps']} / {r['decode_steps']}) | {r['checks']} "
              f"({r['failed_checks']}, {r['max_err']:.2e}) | {r['compiles_after_warmup']} | {r['unwarmed_routes']} "
              f"| {r['live_tensors'][-1] if r['live_tensors'] else '-'} ({r['live_tensor_growth']}) "
              f"| {mem(r['rss_mb'], r['rss_growth_pct'])} | {mem(r['cuda_allocated_mb'], r['cuda_growth_pct'])} "
              f"| {r['prefill_ms']['p50']:.2f} / {r['prefill_ms']['p99']:.2f} "
              f"| {r['decode_ms']['p50']:.2f} / {r['decode_ms']['p99']:.2f} |")  # fmt: skip
    r0 = ranks[0]
    print(f"routes taken (rank 0): {r0['routes']}; decode graph buckets: {r0['decode_graphs'] or 'none (eager)'}")
    print(f"passed: {ok}", flush=True)


def soak_records(ranks: list[dict[str, Any]], args: argparse.Namespace, world: int) -> list[dict[str, Any]]:
    env = environment(world)
    config = {"preset": ranks[0].get("preset", args.preset), "ranks": world, "steps": ranks[0]["steps"],
              "graphs": bool(ranks[0]["decode_graphs"])}  # fmt: skip
    worst = {
        "largest RSS growth after warm-up": max((r["rss_growth_pct"] for r in ranks if r["rss_growth_pct"] is not None),
                                                default=None),
        "largest CUDA allocated growth after warm-up": max(
            (r["cuda_growth_pct"] for r in ranks if r["cuda_growth_pct"] is not None), default=None),
    }  # fmt: skip
    out = [
        record("runtime-soak", config, name, v, "%", "lower", None, env) for name, v in worst.items() if v is not None
    ]
    if all(r["compiles_after_warmup"] is not None for r in ranks):  # else the run ended inside the warm-up
        out.append(record("runtime-soak", config, "kernel compiles after warm-up", sum(r["compiles_after_warmup"]
                          for r in ranks), "compiles", "lower", None, env))  # fmt: skip
        out.append(record("runtime-soak", config, "live tensors added after warm-up", max(r["live_tensor_growth"]
                          or 0 for r in ranks), "tensors", "lower", None, env))  # fmt: skip
    out.append(record("runtime-soak", config, "failed checks", sum(r["failed_checks"] for r in ranks), "checks",
                      "lower", None, env))  # fmt: skip
    for kind in ("prefill", "decode"):
        for p in ("p50", "p99"):
            value = max(r[f"{kind}_ms"][p] for r in ranks)
            if value == value and value > 0:
                out.append(record("runtime-soak", config, f"{kind} step {p} ms", value, "ms", "lower", None, env))
    return out
