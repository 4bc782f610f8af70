"""The report of ``benchmarks/soak_pool.py``: every number of a run, its table and its records.

:func:`summarize` turns a finished :class:`soak_pool.Soak` into one dict (what ``--details``
writes) and the run's verdict; :func:`render` prints the table; :func:`soak_records` gives the
``pool-soak`` records (``benchmarks/records.py``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from records import command_line, environment, record
from soak_stats import growth_pct

__all__ = ["render", "soak_records", "summarize"]


def summarize(soak: Any) -> dict[str, Any]:
    """Every number of a finished run (:class:`soak_pool.Soak`), and its verdict (``passed``)."""
    a = soak.args
    book = soak.pool.book
    elapsed = time.monotonic() - soak.t0
    warm = a.warmup_s
    ranks: dict[tuple[int, int], list[tuple[float, int]]] = {}
    for t, g, r, v in soak.mem["ranks"]:
        ranks.setdefault((g, r), []).append((t, v))
    rank_tensors: dict[str, int] = {}
    by_gen: dict[tuple[int, int], list[tuple[float, int]]] = {}
    for t, g, r, v in soak.mem["rank_tensors"]:
        by_gen.setdefault((g, r), []).append((t, v))
    for (g, r), samples in by_gen.items():
        after = [v for t, v in samples if t >= samples[0][0] + warm]
        if len(after) >= 2:
            rank_tensors[f"gen{g} rank{r}"] = after[-1] - after[0]
    rank_growth, cuda_growth = {}, {}
    for (g, r), samples in ranks.items():
        start = samples[0][0] + warm  # the warm-up of each rank process
        got = growth_pct([v for t, v in samples if t >= start])
        if got is not None:
            rank_growth[f"gen{g} rank{r}"] = got
    cuda: dict[tuple[int, int], list[tuple[float, int]]] = {}
    for t, g, r, v in soak.mem["rank_cuda"]:
        cuda.setdefault((g, r), []).append((t, v))
    for (g, r), samples in cuda.items():
        got = growth_pct([v for t, v in samples if t >= samples[0][0] + warm])
        if got is not None:
            cuda_growth[f"gen{g} rank{r}"] = got
    res = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": command_line([str(Path(__file__).with_name("soak_pool.py")), *sys.argv[1:]]),  # also imported
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, device {a.device}",
        "elapsed_s": elapsed,
        **soak.counts,
        "max_err": soak.max_err,
        "atol": soak.atol,
        "kills": soak.kills,
        "refusals": soak.refusals,
        "pages_leaked": soak.start_free - book.free_pages,
        "requests_left_in_ledger": len(book),
        "pages_in_use_mean": soak.usage["sum"] / max(1, soak.usage["n"]),
        "pages_in_use_max": soak.usage["max"],
        "step_ms": {
            k: {"n": h.n, "p50": h.quantile(0.5) * 1e3, "p99": h.quantile(0.99) * 1e3} for k, h in soak.times.items()
        },
        "driver_rss_mb": [v / 2**20 for _, v in soak.mem["driver"]],
        "driver_rss_growth_pct": growth_pct([v for t, v in soak.mem["driver"] if t >= warm]),
        "driver_live_tensors": [v for _, v in soak.mem["tensors"]],
        "driver_tensors_leaked": soak.tensors_end - soak.tensors_start,
        "rank_rss_growth_pct": rank_growth,
        "rank_live_tensor_growth": rank_tensors,
        "rank_cuda_allocated_growth_pct": cuda_growth,
        "rank_rss_mb": {f"gen{g} rank{r}": [v / 2**20 for _, v in s] for (g, r), s in ranks.items()},
        "errors": soak.errors[:20],
    }
    growths = [g for g in [res["driver_rss_growth_pct"], *rank_growth.values(), *cuda_growth.values()] if g is not None]
    res["max_rss_growth_pct"] = max(growths, default=None)
    res["passed"] = (
        res["wrong_outputs"] == 0 and res["lost_unreported"] == 0 and res["reported_unknown"] == 0
        and res["pages_leaked"] == 0 and res["page_mismatches"] == 0 and res["refusals_unclear"] == 0
        and res["requests_left_in_ledger"] == 0 and res["driver_tensors_leaked"] == 0
        and all(v == 0 for v in res["rank_live_tensor_growth"].values())
        and (a.max_growth_pct is None or (res["max_rss_growth_pct"] or 0.0) <= a.max_growth_pct)
    )  # fmt: skip
    return res


def render(res: dict[str, Any]) -> None:
    print(f"\nsoak of the Ray pool, {res['date']}, {res['machine']}: {res['command']}")
    print("| what | value |\n|---|---|")
    rows = [
        ("run", f"{res['elapsed_s'] / 60:.1f} min, {res['steps']} steps"),
        ("requests", f"{res['arrived']} arrived, {res['completed']} completed, {res['requeued']} served again "
         f"after a failure, {res['preempted']} preempted for pages"),
        ("outputs checked against fp64", f"{res['outputs_checked']}, {res['wrong_outputs']} wrong "
         f"(max error {res['max_err']:.2e}, tolerance {res['atol']:g})"),
        ("ranks killed / failures / restarts", f"{len(res['kills'])} / {res['failures']} / {res['failures']}"),
        ("requests lost", f"{res['lost_reported']} reported by restart(), {res['lost_unreported']} unreported, "
         f"{res['reported_unknown']} reported but not held"),
        ("KV pages", f"in use {100 * res['pages_in_use_mean']:.0f} % on average, {100 * res['pages_in_use_max']:.0f} % "
         f"at most; leaked {res['pages_leaked']}; ledger mismatches {res['page_mismatches']}"),
        ("requests that do not fit",
         f"{res['refused']} refused ({res['refusals']}), {res['refusals_unclear']} unclear"),
    ]  # fmt: skip
    for kind, s in res["step_ms"].items():
        if s["n"]:
            rows.append((f"{kind} step", f"p50 {s['p50']:.2f} ms, p99 {s['p99']:.2f} ms ({s['n']} steps)"))
    d = res["driver_rss_mb"]
    if d:
        growth = res["driver_rss_growth_pct"]
        rows.append(("driver RSS", f"{d[0]:.0f} -> {d[-1]:.0f} MB, growth after warm-up "
                     f"{'n/a' if growth is None else f'{growth:+.2f} %'}"))  # fmt: skip
    if res["rank_rss_growth_pct"]:
        g = res["rank_rss_growth_pct"]
        worst = max(g, key=lambda k: abs(g[k]))
        rows.append(("rank RSS growth after warm-up", f"{len(g)} processes, largest {g[worst]:+.2f} % ({worst})"))
    t = res["driver_live_tensors"]
    if t:
        rows.append(("driver live tensors", f"{t[0]} -> {t[-1]} during the run; with no request left "
                     f"{res['driver_tensors_leaked']:+d} against the start"))  # fmt: skip
    if res["rank_cuda_allocated_growth_pct"]:
        g = res["rank_cuda_allocated_growth_pct"]
        rows.append(("rank CUDA allocated growth after warm-up", f"largest {max(g.values(), key=abs):+.2f} %"))
    if res["rank_live_tensor_growth"]:
        g = res["rank_live_tensor_growth"]
        rows.append(("rank live tensors after warm-up", f"{len(g)} processes, growth {sorted(set(g.values()))}"))
    rows.append(("passed", str(res["passed"])))
    for k, v in rows:
        print(f"| {k} | {v} |")
    for e in res["errors"]:
        print(f"  {e}")


def soak_records(res: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The ``pool-soak`` records of a run: its invariants, step times and memory growth."""
    env = environment(args.ranks) | {"command": res["command"]}
    config = {"ranks": args.ranks, "device": args.device, "minutes": round(res["elapsed_s"] / 60, 1),
              "kills": len(res["kills"])}  # fmt: skip
    out = [
        record("pool-soak", config, "outputs checked against fp64", res["outputs_checked"], "outputs", "higher", None,
               env),
        record("pool-soak", config, "wrong outputs", res["wrong_outputs"], "outputs", "lower", None, env),
        record("pool-soak", config, "requests lost, not reported by restart()", res["lost_unreported"], "requests",
               "lower", None, env),
        record("pool-soak", config, "KV pages leaked", res["pages_leaked"], "pages", "lower", None, env),
    ]  # fmt: skip
    for kind, st in res["step_ms"].items():
        if st["n"]:
            out += [record("pool-soak", config, f"{kind} step {q} ms", st[q], "ms", "lower", None, env)
                    for q in ("p50", "p99")]  # fmt: skip
    for name, value in (("driver RSS growth after warm-up", res["driver_rss_growth_pct"]),
                        ("largest RSS growth after warm-up", res["max_rss_growth_pct"])):  # fmt: skip
        if value is not None:
            out.append(record("pool-soak", config, name, value, "%", "lower", None, env))
    return out
