"""Plot ``decode_small_tiles.py`` JSON: small-batch sparse-MLA decode steps per tile (needs matplotlib).

    python benchmarks/plot_small_tiles.py small_tiles.json --out small_tiles.png

One line per tile (whole steps with the merge each tile routes; us against tokens), the routed
tile's points ringed, the issue's 12 us target and the graph floor (a graph of one 1-element
kernel, the same run) as horizontal lines.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json")
    ap.add_argument("--out", default="small_tiles.png")
    ap.add_argument("--target-us", type=float, default=12.0)
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    record = json.loads(Path(args.json).read_text())
    table = record["table_us"]
    routed = {int(b): name for b, name in record["routed"].items()}
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    steps = [name for name in table if "alone" not in name]
    # one line per tile and head group: the routed merge (measured first for each)
    tiles: dict[str, str] = {}
    for name in steps:
        tile = name.split(", merge")[0]
        tiles.setdefault(tile, name)
    for name in tiles.values():
        row = {int(b): us for b, us in table[name].items()}
        xs = sorted(row)
        ax.plot(xs, [row[x] for x in xs], marker="o", label=name)
    for batch, name in sorted(routed.items()):
        ax.scatter([batch], [table[name][str(batch)]], s=160, facecolors="none", edgecolors="black", zorder=3)
    ax.axhline(args.target_us, color="red", linestyle="--", label=f"target {args.target_us:g} us")
    ax.axhline(record["floor_us"], color="grey", linestyle=":", label="graph of one 1-element kernel")
    ax.set_xscale("log", base=2)
    batches = sorted(routed)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("tokens (16 heads, top-k 2,048)")
    ax.set_ylabel("us per step (graph replay, L2 flushed)")
    ax.set_title(f"Small-batch sparse-MLA decode by split tile ({record['gpu']}); ringed: routed")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
