"""Plot ``prefill_clocks.py`` JSON: effective TF/s of the routed prefill kernel against the SM clock
it ran at (needs matplotlib).

    python benchmarks/plot_prefill_clocks.py clocks.json --out prefill_clocks.png

One point per (pass, heads, T): filled = the first pass (the GPU cool at its start), hollow = the
pass after the sustained runs (the GPU at its power limit). The dotted lines are TF/s proportional
to the clock through the first and last points of 64 heads at T = 4K; the dashed line is issue
14's 600 TF/s target for 128 heads.
"""

from __future__ import annotations

import argparse
import json

STYLE = {(64, 4096): ("tab:blue", "o"), (128, 4096): ("tab:orange", "s"), (64, 16384): ("tab:green", "^"),
         (128, 16384): ("tab:red", "D")}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json")
    ap.add_argument("--out", default="prefill_clocks.png")
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.json) as f:
        data = json.load(f)
    cases = data["cases"]
    first = cases[0]["pass"]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for c in cases:
        color, marker = STYLE.get((c["heads"], c["tokens"]), ("gray", "x"))
        filled = c["pass"] == first
        label = f"{c['heads']} heads, T = {c['tokens'] // 1024}K" if filled else None
        ax.scatter(c["sm_mhz"], c["tflops"], color=color, marker=marker, s=70, label=label,
                   facecolors=color if filled else "none")  # fmt: skip
    ref = [c for c in cases if (c["heads"], c["tokens"]) == (64, 4096)]
    xs = [min(c["sm_mhz"] for c in cases) - 40, data["max_sm_mhz"] + 20]
    for c in (ref[0], ref[-1]):
        k = c["tflops"] / c["sm_mhz"]
        ax.plot(xs, [k * x for x in xs], ":", color="gray", lw=1)
    ax.axhline(600, ls="--", color="black", lw=1, label="issue 14 target, 128 heads (600)")
    ax.set_xlabel("mean SM clock while timed (MHz; max 1980)")
    ax.set_ylabel("effective TF/s (kernel only)")
    ax.set_title("Routed Gluon per-query prefill on one H200: filled = cool start, hollow = at the power limit",
                 fontsize=9)  # fmt: skip
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
