"""``benchmarks/ray_pool.py --rounds N``: the torchrun baseline and the pool's decode step, alternated.

One pool (the first of ``--transports``), built and checked once; then ``N`` rounds, each:

1. the baseline, ``torchrun -m shardattn.launch --mode dcp-decode`` (the same decode step, ranks
   started by torchrun, inputs already on the devices), while the pool sits idle: its ranks'
   serve loops back off to sleeps of at most 0.2 ms; their processes' CPU time over the baseline
   is recorded (``pool_ranks_cpu``: cores they used while the baseline ran);
2. the pool's first step after that idle time (``wake``: when each rank saw it, from the
   driver's publishing);
3. the pool's rows on the driver's clock, ``--iters`` steps after 5 warm-up each:
   ``decode_batch`` (whole-step tensors in, a fresh output tensor out: the default) and
   ``decode_batch in place, view`` (the inputs written into ``pool.step_inputs()`` once before
   the timed steps, as a model would write them, and the outputs taken as views of the region,
   ``view=True``).

Each round prints one line and a JSON record; after the rounds, the median over rounds of each
row's difference to its round's baseline, and the wake-up after idle gaps of 0 to 1 s (the
ranks' ``seen`` mark). Everything also goes to ``--out``/ray_pool_rounds.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shardattn.launch.workloads import request_topk
from shardattn.plan.spec import ModelSpec

ROWS = ("decode_batch", "decode_batch in place, view")
GAPS_S = (0.0, 0.002, 0.02, 0.2, 1.0)


def cpu_seconds(pids: list[int]) -> list[float]:
    """User + system CPU seconds of each process so far (``/proc/<pid>/stat``); -1 when unreadable."""
    tick = os.sysconf("SC_CLK_TCK")
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out.append((int(fields[11]) + int(fields[12])) / tick)
        except (OSError, IndexError, ValueError):
            out.append(-1.0)
    return out


def step_tensors(args: argparse.Namespace, spec: ModelSpec, lens: list[int]) -> dict[str, torch.Tensor]:
    """The timed step: ``ids [B]``, ``q [B, H, D]`` bf16, ``topk [B, K]`` int32 (DSA-like), and
    ``kv [B, D]`` bf16 for the rows that write each token's KV row."""
    b = args.requests
    topk = request_topk([n - 1 for n in lens], [1] * b, spec.topk, overlap="dsa", seed=1,
                        device=torch.device("cpu"), limits=lens).to(torch.int32)  # fmt: skip
    q = (torch.randn(b, spec.num_heads, spec.head_dim) * 0.5).to(torch.bfloat16)
    kv = (torch.randn(b, spec.head_dim) * 0.5).to(torch.bfloat16)
    return {"ids": torch.arange(b), "q": q, "topk": topk, "kv": kv}


def _time_row(pool: Any, row: str, x: dict[str, torch.Tensor], iters: int, phases_of: Callable) -> dict[str, Any]:
    if row == "decode_batch":
        q, topk, view = x["q"], x["topk"], False
    else:
        slots = pool.step_inputs(int(x["q"].shape[0]))
        slots["q"].copy_(x["q"])
        slots["topk_pos"].copy_(x["topk"])
        q, topk, view = slots["q"], slots["topk_pos"], True
    times: list[float] = []
    phases: dict[str, list[float]] = {}
    for it in range(5 + iters):
        t1 = time.perf_counter()
        pool.decode_batch(x["ids"], q, topk, view=view)
        if it >= 5:
            times.append(time.perf_counter() - t1)
            for k, v in phases_of(pool.last_step).items():
                phases.setdefault(k, []).append(v)
    return {"times": times, "phases_median_ms": {k: round(statistics.median(v), 4) for k, v in phases.items()}}


def _wake(pool: Any, x: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One step after the pool sat idle: its time and each rank's ``seen`` (ms from publishing)."""
    t1 = time.perf_counter()
    pool.decode_batch(x["ids"], x["q"], x["topk"])
    step_ms = (time.perf_counter() - t1) * 1e3
    tl = pool.last_step.get("timeline")
    seen = None if tl is None else [round(r["seen"], 4) for r in tl["ranks"]]
    return {"step_ms": round(step_ms, 4), "ranks_seen_ms": seen}


def rounds(
    args: argparse.Namespace,
    out: Path,
    pool: Any,
    lens: list[int],
    baseline: Callable[..., dict[str, Any]],
    emit: Callable[[Path, dict[str, Any]], None],
    summarize: Callable[[list[float]], dict[str, float]],
    phases_of: Callable[[dict[str, Any]], dict[str, float]],
) -> dict[str, Any]:
    """``args.rounds`` rounds (module docstring) on a built, checked pool; returns (and writes) the report."""
    x = step_tensors(args, pool.spec, lens)  # the pool's spec: bf16, top-k as asked
    pids = [int(b["pid"]) for b in pool.built]
    report: dict[str, Any] = {"transport": pool.transport, "host_threads": pool.host_threads, "rounds": []}
    for i in range(args.rounds):
        cpu0, t0 = cpu_seconds(pids), time.perf_counter()
        base = baseline(args, out, round=i)
        wall = time.perf_counter() - t0
        idle_cores = [round((b - a) / wall, 4) if a >= 0 and b >= 0 else None for a, b in zip(cpu0, cpu_seconds(pids))]
        rec: dict[str, Any] = {"part": "round", "round": i, "torchrun_ms": base.get("step_ms"),
                               "torchrun_wall_s": round(wall, 2), "pool_ranks_cpu_during_baseline": idle_cores,
                               "wake": _wake(pool, x)}  # fmt: skip
        line = [f"round {i}: torchrun {_ms(base.get('step_ms'))}"]
        for row in ROWS:
            r = _time_row(pool, row, x, args.iters, phases_of)
            stats = summarize(r.pop("times"))
            diff = None if base.get("step_ms") is None else stats["median_ms"] - base["step_ms"]
            rec[row] = {**stats, "vs_torchrun_ms": diff, **r}
            line.append(f"{row} {_ms(stats['median_ms'])} ({_diff(diff)})")
        emit(out, rec)
        print(" | ".join(line), flush=True)
        report["rounds"].append(rec)
    summary: dict[str, Any] = {"part": "rounds_summary", "rounds": args.rounds}
    for row in ROWS:
        diffs = [r[row]["vs_torchrun_ms"] for r in report["rounds"] if r[row]["vs_torchrun_ms"] is not None]
        summary[row] = {
            "vs_torchrun_ms_per_round": [round(d, 4) for d in diffs],
            "median_vs_torchrun_ms": statistics.median(diffs) if diffs else None,
            "median_ms_per_round": [round(r[row]["median_ms"], 4) for r in report["rounds"]],
        }
    base_ms = [r["torchrun_ms"] for r in report["rounds"] if r["torchrun_ms"] is not None]
    summary["torchrun_ms_per_round"] = base_ms
    wake = []
    for gap in GAPS_S:
        tries = []
        for _ in range(3):
            time.sleep(gap)
            tries.append(_wake(pool, x))
        seen = [max(t["ranks_seen_ms"]) for t in tries if t["ranks_seen_ms"]]
        wake.append({"idle_s": gap, "step_ms": [t["step_ms"] for t in tries], "last_rank_seen_ms": seen})
    summary["wake_after_idle"] = wake
    emit(out, summary)
    print(
        "median over rounds of the difference to torchrun: "
        + " | ".join(f"{row} {_diff(summary[row]['median_vs_torchrun_ms'])}" for row in ROWS),
        flush=True,
    )
    report["summary"] = summary
    (out / "ray_pool_rounds.json").write_text(json.dumps(report, indent=1))
    return report


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f} ms"


def _diff(v: float | None) -> str:
    return "n/a" if v is None else f"{v:+.3f} ms"
