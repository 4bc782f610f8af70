"""Plots of recorded ratios (``docs/performance/*.json``, filed by ``performance_page.py --add``).

    python benchmarks/plot_records.py read-floor --png docs/performance/decode-read-floor-2026-12-05.png
    python benchmarks/plot_records.py fp8-peer --png docs/performance/fp8-decode-peer-2026-12-05.png

* ``read-floor`` (``decode-read-floor.json``, from ``benchmarks/decode_floor.py``): one panel per
  (KV format, top-k), the routed decode's ratio to the read floor of its own rows (floor us / step
  us, 1.0 = as fast as reading the rows once) against the batch, a line per head count; dashed:
  the target (a step within 1.15x of the floor).
* ``fp8-peer`` (``fp8-decode-peer.json``, from ``benchmarks/decode_fp8_peer.py``): one panel per
  head count, FlashMLA's FP8 decode time over ours on the same rows (above 1.0: ours faster)
  against the batch, as called by default and with ``rows_unique=True``; dashed: parity.

Only the records of one GPU (``--gpu``) and one cache size (``--cache-rows``) are drawn, each the
latest of its configuration; a shape never measured is a gap. Needs matplotlib (not a dependency
of shardattn).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import read_json

RECORDS = Path(__file__).resolve().parents[1] / "docs" / "performance"

#: ``{panel: {line: {batch: ratio}}}``
Ratios = dict[tuple, dict[str, dict[int, float]]]


def _floor_key(r: dict) -> tuple[tuple, str, int]:
    c = r["config"]
    return (c["kv"], c["topk"]), f"{c['heads']} heads", c["batch"]


def _peer_key(r: dict) -> tuple[tuple, str, int]:
    c = r["config"]
    return (c["heads"],), r["metric"], c["tokens"]


@dataclass(frozen=True)
class Figure:
    """What one figure draws from one records file."""

    records: str  # file under docs/performance
    title: str
    cache_key: str  # the config key holding the cache's rows
    cache_rows: int  # the cache size drawn by default
    metrics: tuple[str, ...]  # records drawn
    key: Callable[[dict], tuple[tuple, str, int]]  # a record's (panel, line, batch)
    panel_title: Callable[[tuple], str]
    target: float  # the dashed line
    ylabel: str


FIGURES = {
    "read-floor": Figure(
        "decode-read-floor.json", "Sparse-MLA decode against its read floor", "cache_rows", 262144, ("step us",),
        _floor_key, lambda panel: f"{panel[0]}, top-k {panel[1]}", 1 / 1.15, "read floor / decode step",
    ),
    "fp8-peer": Figure(
        "fp8-decode-peer.json", "FP8 sparse decode beside FlashMLA's", "kv_rows", 65536,
        ("step us", "step us, rows_unique=True"), _peer_key, lambda panel: f"{panel[0]} heads", 1.0,
        "FlashMLA us / ours us",
    ),
}  # fmt: skip

#: how a line's key reads in the legend, where it is not its own
LABELS = {"step us": "as called (rows de-duplicated)", "step us, rows_unique=True": "rows_unique=True"}


def ratios(name: str, records: list[dict], gpu: str, cache_rows: int) -> tuple[Ratios, list[str]]:
    """``({panel: {line: {batch: ratio}}}, dates)`` of figure ``name``'s records of ``gpu`` and
    ``cache_rows``, the latest record where one configuration was measured twice, and the dates of
    the records drawn. read-floor: panel ``(kv, topk)``, line ``"H heads"``; fp8-peer: panel
    ``(heads,)``, line the metric."""
    fig = FIGURES[name]
    out: Ratios = {}
    dates: dict[tuple, str] = {}
    for r in sorted(records, key=lambda r: r["date"]):
        if r["metric"] not in fig.metrics or r["gpu"] != gpu or r["config"].get(fig.cache_key) != cache_rows:
            continue
        panel, line, batch = fig.key(r)
        out.setdefault(panel, {}).setdefault(line, {})[batch] = r["ratio"]
        dates[panel, line, batch] = r["date"]
    return out, sorted(set(dates.values()))


def plot(name: str, data: Ratios, title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = FIGURES[name]
    if all(len(p) == 2 for p in data):  # a grid: rows by the first part, columns by the second, largest first
        rows = sorted({p[0] for p in data})
        cols = sorted({p[1] for p in data}, reverse=True)
        grid = [[(first, second) for second in cols] for first in rows]
    else:  # one row
        grid = [sorted(data, reverse=True)]
    lines = sorted({line for by_line in data.values() for line in by_line}, key=lambda s: (len(s), s))
    color = {line: f"C{i}" for i, line in enumerate(lines)}  # one colour a line in every panel
    ncols = max(len(r) for r in grid)
    figure, axes = plt.subplots(len(grid), ncols, figsize=(3.4 * ncols, 2.9 * len(grid)), squeeze=False)
    top = max([1.2] + [v for by_line in data.values() for by_batch in by_line.values() for v in by_batch.values()])
    for i, row in enumerate(grid):
        for j, panel in enumerate(row):
            ax = axes[i][j]
            for line, by_batch in sorted(data.get(panel, {}).items(), key=lambda kv: lines.index(kv[0])):
                batches = sorted(by_batch)
                ax.plot(batches, [by_batch[b] for b in batches], "o-", color=color[line], label=LABELS.get(line, line))
            ax.axhline(fig.target, color="grey", linestyle="--", linewidth=1)
            ax.set_title(fig.panel_title(panel), fontsize=9)
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, 1.05 * top)
            ax.set_xlabel("batch (tokens)", fontsize=8)
            ax.set_ylabel(fig.ylabel, fontsize=8)
            if ax.lines[:-1]:
                ax.legend(fontsize=6, loc="best")
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("figure", choices=sorted(FIGURES))
    ap.add_argument("--records", type=Path, default=None, help="the records file (default: the figure's own)")
    ap.add_argument("--gpu", default="NVIDIA H200")
    ap.add_argument("--cache-rows", type=int, default=None, help="default: the figure's (262,144 / 65,536 rows)")
    ap.add_argument("--png", required=True)
    args = ap.parse_args(argv)
    fig = FIGURES[args.figure]
    path = args.records or RECORDS / fig.records
    cache_rows = args.cache_rows or fig.cache_rows
    data, dates = ratios(args.figure, read_json(path), args.gpu, cache_rows)
    if not data:
        print(f"no records of {args.gpu} at {cache_rows} cache rows in {path}", file=sys.stderr)
        return 2
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    plot(args.figure, data, f"{fig.title} ({args.gpu}, {cache_rows:,}-row cache, {when})", args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
