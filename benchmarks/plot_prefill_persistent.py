"""Plot of ``prefill_persistent.py``'s burst sweep: time per 4K tokens against top-k, one-tile and
persistent kernel, 64 and 128 heads (a one-tile program's fixed cost is the intercept).

    python benchmarks/plot_prefill_persistent.py benchmarks/prefill_persistent_2026-12-01.json out.png
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(argv[0]) as f:
        data = json.load(f)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, heads in zip(axes, ("64", "128")):
        for name, style in (("one-tile", "o--"), ("persistent", "s-")):
            pts = data["burst_ms_t4k"][heads][name]
            ks = sorted(int(k) for k in pts)
            ax.plot(ks, [pts[str(k)] for k in ks], style, label=name)
        ax.set_xlabel("top-k (keys per query)")
        ax.set_ylabel("ms per 4,096 queries (L2 flushed)")
        ax.set_title(f"{heads} heads")
        ax.set_xlim(0, 2200)
        ax.set_ylim(0, None)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"Gluon sparse-MLA prefill, one tile per program vs persistent ({data['date']}, H200)")
    fig.tight_layout()
    fig.savefig(argv[1], dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
