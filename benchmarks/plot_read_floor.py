"""Plots the recorded decode-against-read-floor ratios (``docs/performance/decode-read-floor.json``,
written by ``benchmarks/decode_floor.py --json`` and filed by ``performance_page.py --add``).

    python benchmarks/plot_read_floor.py --png docs/performance/decode-read-floor-2026-12-05.png

One panel per (KV format, top-k): the routed decode's ratio to the read floor of its own rows
(floor us / step us, 1.0 = as fast as reading the rows once) against the batch, one line per head
count; the dashed line is the target (a step within 1.15x of the floor). Only the records of one
GPU (``--gpu``) and one cache size (``--cache-rows``) are drawn, each the latest of its
configuration; a shape never measured is a gap. Needs matplotlib (not a dependency of shardattn).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import read_json

RECORDS = Path(__file__).resolve().parents[1] / "docs" / "performance" / "decode-read-floor.json"
TARGET = 1 / 1.15


Ratios = dict[tuple[str, int], dict[int, dict[int, float]]]


def ratios(records: list[dict], gpu: str, cache_rows: int) -> tuple[Ratios, list[str]]:
    """``({(kv, topk): {heads: {batch: floor / step}}}, dates)`` of the ``step us`` records of
    ``gpu`` and ``cache_rows``, the latest record where one configuration was measured twice, and
    the dates of the records drawn."""
    out: Ratios = {}
    dates: dict[tuple, str] = {}
    for r in sorted(records, key=lambda r: r["date"]):
        c = r["config"]
        if r["metric"] != "step us" or r["gpu"] != gpu or c.get("cache_rows") != cache_rows:
            continue
        out.setdefault((c["kv"], c["topk"]), {}).setdefault(c["heads"], {})[c["batch"]] = r["ratio"]
        dates[c["kv"], c["topk"], c["heads"], c["batch"]] = r["date"]
    return out, sorted(set(dates.values()))


def plot(data: Ratios, title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kvs = sorted({kv for kv, _ in data})
    topks = sorted({topk for _, topk in data}, reverse=True)
    heads_all = sorted({h for by_heads in data.values() for h in by_heads})
    color = {h: f"C{i}" for i, h in enumerate(heads_all)}  # one colour a head count in every panel
    fig, axes = plt.subplots(len(kvs), len(topks), figsize=(3.4 * len(topks), 2.9 * len(kvs)), squeeze=False)
    for (i, kv), (j, topk) in ((a, b) for a in enumerate(kvs) for b in enumerate(topks)):
        ax = axes[i][j]
        for heads, by_batch in sorted(data.get((kv, topk), {}).items()):
            batches = sorted(by_batch)
            ax.plot(batches, [by_batch[b] for b in batches], "o-", color=color[heads], label=f"{heads} heads")
        ax.axhline(TARGET, color="grey", linestyle="--", linewidth=1)
        ax.set_title(f"{kv}, top-k {topk}", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.2)
        ax.set_xlabel("batch (tokens)", fontsize=8)
        ax.set_ylabel("read floor / decode step", fontsize=8)
        if ax.lines[:-1]:
            ax.legend(fontsize=6, loc="best")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=Path, default=RECORDS)
    ap.add_argument("--gpu", default="NVIDIA H200")
    ap.add_argument("--cache-rows", type=int, default=262144)
    ap.add_argument("--png", required=True)
    args = ap.parse_args(argv)
    data, dates = ratios(read_json(args.records), args.gpu, args.cache_rows)
    if not data:
        print(f"no 'step us' records of {args.gpu} at {args.cache_rows} cache rows in {args.records}", file=sys.stderr)
        return 2
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    title = f"Sparse-MLA decode against its read floor ({args.gpu}, {args.cache_rows:,}-row cache, {when})"
    plot(data, title, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
