"""Plot ``union_build.py`` JSON: union build per builder against the grouped kernel (needs matplotlib).

    python benchmarks/plot_union_build.py union_build.json --sorted-from older.json --out union.png

Bars per (T, G): the builders' medians (ms, log scale); a marker at the build time that would be
15 % of the step (``0.15 / 0.85 x`` the grouped kernel of the same run). ``--sorted-from`` takes
the fused build of sorted rows from another run of the same inputs (runs before the shared-memory
build timed it under ``fused_sorted`` as ``auto`` on sorted rows).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

BUILDS = (
    ("fused_unsorted", "row sort + fused"),
    ("fused_sorted", "fused, sorted rows"),
    ("bitmap_triton", "bitmap, Triton (global atomics)"),
    ("bitmap", "bitmap, shared memory (Gluon)"),
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json")
    ap.add_argument("--sorted-from", default=None)
    ap.add_argument("--out", default="union_build.png")
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = json.loads(Path(args.json).read_text())["times"]
    if args.sorted_from:
        older_times = json.loads(Path(args.sorted_from).read_text())["times"]
        older = {(r["heads"], r["tokens"]): r["ms"]["fused_sorted"] for r in older_times}
        for r in times:
            r["ms"]["fused_sorted"] = older[(r["heads"], r["tokens"])]
    tokens = sorted({r["tokens"] for r in times})
    fig, axes = plt.subplots(1, len(tokens), figsize=(6 * len(tokens), 4.6), squeeze=False)
    for ax, t in zip(axes[0], tokens):
        rows = sorted((r for r in times if r["tokens"] == t), key=lambda r: -r["G"])
        width = 0.8 / len(BUILDS)
        for i, (key, label) in enumerate(BUILDS):
            xs = [j + (i - (len(BUILDS) - 1) / 2) * width for j in range(len(rows))]
            ax.bar(xs, [r["ms"][key] for r in rows], width, label=label)
        target = [r["ms"]["gluon_grp"] * 0.15 / 0.85 for r in rows]
        ax.scatter(range(len(rows)), target, marker="_", s=900, color="black", zorder=3, label="15 % of the step")
        ax.set_xticks(range(len(rows)), [f"G={r['G']} ({r['heads']} heads)" for r in rows])
        ax.set_yscale("log")
        ax.set_ylabel("union build, ms (median, L2 flushed)")
        ax.set_title(f"T = {t}, K = 2048, DSA-like rows, {rows[0]['kv_rows']} KV rows")
        ax.grid(axis="y", which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(args.out, dpi=120)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
