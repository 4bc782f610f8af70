"""The FP8 KV-row write (:func:`shardattn.ops.kv_fp8.write_kv`, the Triton kernel) timed against
storing the same rows as bf16 (``cache[slots] = rows``), on one GPU. Prints a table; ``--json``
writes records (``benchmarks/records.py``, benchmark ``kv-fp8-write``).

    python benchmarks/kv_fp8_write.py --json kv_fp8_write.json

Each case writes ``T`` new tokens' bf16 rows ``[T, 576]`` at random distinct slots of a paged cache
of ``--cache-rows`` rows (pages of 64): the FP8 write reads 1152 bytes a row and writes 656, the
bf16 store reads and writes 1152. Times are CUDA-graph replays with the L2 flushed
(``graph_timing.replay_us``); GB/s count the bytes read and written. The FP8 bytes are checked
against the torch reference on the same inputs first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_timing import replay_us  # beside this script
from records import add_json_argument, environment, print_table, record, write_json

from shardattn.ops.kv_fp8 import quantize_kv_reference, write_kv


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 4096, 32768])
    ap.add_argument("--cache-rows", type=int, default=1 << 20)
    add_json_argument(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cache_rows <= 0 or args.cache_rows % 64 or max(args.tokens) > args.cache_rows:
        print(f"--cache-rows must be a positive multiple of 64 (pages of 64 rows) and at least the largest "
              f"--tokens, got {args.cache_rows}", file=sys.stderr)  # fmt: skip
        return 2
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    env = environment()
    print(f"{env['gpu']}, torch {env['versions']['torch']}, Triton {env['versions']['triton']}", flush=True)
    page = 64
    cache = torch.zeros(args.cache_rows // page, page, 656, dtype=torch.uint8, device="cuda")
    cache_bf16 = torch.zeros(args.cache_rows, 576, dtype=torch.bfloat16, device="cuda")
    records = []
    for t in args.tokens:
        rows = torch.randn(t, 576, device="cuda").bfloat16()
        slots = torch.randperm(args.cache_rows, device="cuda")[:t]
        write_kv(cache, slots, rows)
        want, _ = quantize_kv_reference(rows)
        got = cache.reshape(-1, 656)[slots]
        if not torch.equal(got, want):
            raise RuntimeError(f"the FP8 write differs from the reference at {t} tokens")
        fp8_us = replay_us(lambda c=cache, s=slots, r=rows: write_kv(c, s, r))
        bf16_us = replay_us(lambda s=slots, r=rows: cache_bf16.index_copy_(0, s, r))
        fp8_gbs = t * (1152 + 656) / (fp8_us * 1e-6) / 1e9
        bf16_gbs = t * 2 * 1152 / (bf16_us * 1e-6) / 1e9
        print(f"{t} tokens: FP8 write {fp8_us:.1f} us ({fp8_gbs:.0f} GB/s), bf16 store {bf16_us:.1f} us "
              f"({bf16_gbs:.0f} GB/s)", flush=True)  # fmt: skip
        base = ("bf16 store of the same rows, same run", bf16_us)
        config = {"tokens": t, "cache_rows": args.cache_rows}
        records.append(record("kv-fp8-write", config, "write us", fp8_us, "us", "lower", base, env))
    print_table(records, "FP8 KV-row write")
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
