"""The persistent per-query Gluon prefill kernel against the one-tile kernel it replaced, on one GPU.

Two measurements, each kernel on the same inputs (DSA-like top-k, KV 64K / 128K rows at T = 4K /
16K, as ``gluon_check.py`` and ``prefill_clocks.py``):

1. **burst** (L2 flushed before each run, CUDA-event medians, best of two passes of 20 runs): per
   head count, top-k 256 / 512 / 1024 / 2048 at T = 4K and 2048 at 16K. A one-tile program's time
   is ``fixed + per-key x top-k``; the fit over top-k 512 -> 2048 gives the fixed part (prologue,
   first gathers, epilogue), what a persistent program overlaps with its previous tile;
2. **sustained** (``--sustain`` seconds back to back per kernel, in turn, A B then B A, with
   ``nvidia-smi`` sampling clock and power as ``prefill_clocks.py`` does): TF/s and joules per
   TFLOP at the power limit.

    python benchmarks/prefill_persistent.py [--heads 64 128] [--sustain 3] [--only burst|sustained]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from prefill_clocks import Sampler, setup, sustained, window
from prefill_inputs import timed

from shardattn.kernels.gluon.sparse_mla import gluon_config


def kernels(heads: int) -> dict:
    """The routed (persistent) configuration and the same kernel one tile per program."""
    routed = gluon_config(heads)
    return {"one-tile": replace(routed, persistent=False), "routed": routed}


def burst(heads: int, flush: torch.Tensor, sms: int) -> None:
    for name, cfg in kernels(heads).items():
        cells, per_cta = [], {}
        for topk, tokens in ((256, 4096), (512, 4096), (1024, 4096), (2048, 4096), (2048, 16384)):
            run, fl, label = setup(heads, tokens, topk, cfg)
            run()
            torch.cuda.synchronize()
            ms = min(timed(run, flush, 20) for _ in range(2))
            cells.append(f"k{topk}/T{tokens // 1024}K {ms:.3f} ms {fl / ms / 1e9:.0f} TF/s")
            if tokens == 4096:  # us per program-wave: programs of one-tile launches over the SMs
                per_cta[topk] = ms * 1e3 / (tokens * -(-heads // 64) / sms)
        slope = (per_cta[2048] - per_cta[512]) / (2048 - 512)
        fixed = per_cta[2048] - slope * 2048
        print(f"{heads} heads {name:8s} {label}: " + " | ".join(cells), flush=True)
        fit = f"{fixed:.2f} us fixed + {slope * 2048:.2f} us per 2048 keys"
        print(f"    fit (one-tile timing model): {fit}", flush=True)


def sustained_ab(heads: int, tokens: int, seconds: float) -> None:
    runs = {name: setup(heads, tokens, 2048, cfg) for name, cfg in kernels(heads).items()}
    for run, _, _ in runs.values():
        run()
    torch.cuda.synchronize()
    sampler = Sampler()
    marks = []
    for order in (("routed", "one-tile"), ("one-tile", "routed")):
        for name in order:
            run, fl, label = runs[name]
            n, secs, start, end = sustained(run, seconds)
            marks.append((label, fl * n / secs / 1e12, start, end))
    samples = sampler.stop()
    for label, tf, start, end in marks:
        w = window(samples, start + (end - start) / 4, end)  # the first quarter settles
        mhz, watts = w.get("sm_mhz", float("nan")), w.get("watts", float("nan"))
        print(
            f"sustained {heads} x {tokens}: {label:16s} {tf:6.1f} TF/s @ {mhz:.0f} MHz {watts:.0f} W "
            f"{watts / tf:.3f} J/TFLOP",
            flush=True,
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--sustain", type=float, default=3.0)
    ap.add_argument("--only", choices=("burst", "sustained"), default=None)
    args = ap.parse_args(argv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if args.only != "sustained":
        flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
        for heads in args.heads:
            burst(heads, flush, sms)
    if args.only != "burst":
        for heads in args.heads:
            sustained_ab(heads, 16384, args.sustain)
    return 0


if __name__ == "__main__":
    sys.exit(main())
