"""Warp-stall sampling of kernels side by side, from an Nsight Compute source-page export.

Profile (e.g. the routed kernel and FlashMLA, one launch each) and export the SASS source page::

    cd benchmarks
    ncu --clock-control none --section WarpStateStats --section SourceCounters -k regex:"ws64_fwd|sparse_attn_fwd" \\
        -c 4 -o prof python prefill_clocks.py --peer-lib libpeer.so --heads 64 --tokens 4096 --once
    ncu --import prof.ncu-rep --page source --csv --print-source sass > source.csv
    python ncu_stalls.py source.csv

For each profiled launch: the stall samples by reason, the instruction count by opcode and the
instructions with the most samples (the reason of each). Samples count warps, not time: a warp
that waits while others issue costs nothing, so read the table for where a kernel's warps wait.
"""

from __future__ import annotations

import argparse
import collections
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def launches(path: str) -> list[tuple[str, list[dict[str, str]]]]:
    """``(kernel name, rows)`` per profiled launch of the export."""
    out: list[tuple[str, list[dict[str, str]]]] = []
    lines: list[str] = []
    name = None
    with open(path) as f:
        for line in [*f.read().splitlines(), '"Kernel Name",""']:
            if line.startswith('"Kernel Name"'):
                if name is not None and lines:
                    out.append((name, [r for r in csv.DictReader(lines) if r.get("Address")]))
                name, lines = next(csv.reader([line]))[1], []
            else:
                lines.append(line)
    return out


def report(name: str, rows: list[dict[str, str]], top: int) -> None:
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    by_reason = collections.Counter({k[6:]: sum(int(r[k] or 0) for r in rows) for k in reasons})
    total = sum(by_reason.values()) or 1
    opcodes: collections.Counter[str] = collections.Counter()
    for r in rows:
        words = r["Source"].split()
        op = words[1] if words[0].startswith("@") else words[0]
        opcodes[op.split(".")[0]] += int(r[EXECUTED] or 0)
    print(f"\n== {name[:100]}: {total} samples, {sum(opcodes.values()) / 1e6:.1f} M instructions executed")
    print("   " + ", ".join(f"{k} {100 * v / total:.1f} %" for k, v in by_reason.most_common(10)))
    print("   opcodes (M executed): " + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in opcodes.most_common(14)))
    for r in sorted(rows, key=lambda r: -int(r[SAMPLES] or 0))[:top]:
        why = max(reasons, key=lambda k: int(r[k] or 0))[6:]
        print(f"   {int(r[SAMPLES] or 0):7d}  {why:14s} x{int(r[EXECUTED] or 0):>10d}  {r['Source'].strip()[:70]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source_csv")
    ap.add_argument("--top", type=int, default=12, help="instructions listed per launch")
    args = ap.parse_args(argv)
    for name, rows in launches(args.source_csv):
        report(name, rows, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
