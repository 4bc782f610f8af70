"""Sparse-MLA decode's de-duplication on one GPU: the routed one (``decode_rows``: the bitmap union
while the cache is small, else the hash of ``unique_rows``) beside the sorted union of the same run.
Prints a table; ``--json`` writes records (``benchmarks/records.py``, benchmark ``decode-dedup``).

    python benchmarks/decode_dedup.py --json decode_dedup.json
    python benchmarks/decode_dedup.py --cache-rows 40000000 --kv-dtype fp8_ds_mla --json big.json
    python benchmarks/decode_dedup.py --device cpu --cache-rows 4096 --heads 4 --tokens 2 --topk 64   # dry run

Each case: ``T`` tokens of ``H`` heads, top-k ``K`` distinct random rows of a cache of ``R`` rows
(one repeated in every token, so each de-duplication has work), in random order as an indexer
leaves them. Timed, as CUDA-graph replays with the L2 flushed (``graph_timing.replay_us``):

* ``dedup us``: ``unique_rows`` (hash, repeats dropped in place) against ``build_union``
  (``group_size=1``, sorted: the bitmap, or the row sort past its ratio);
* ``step us``: the default decode (``rows_unique=False``: de-duplication, then the kernel) against
  the sorted union followed by the kernel on its rows (the default before the hash), and the
  kernel alone on the caller's rows (``rows_unique=True``; the floor of any de-duplication).

Outputs are checked against each other first (same keys, another order). ``--device cpu`` runs
the torch reference paths (a dry run of the script: host times, not looked at).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_inputs import build_caches, distinct_rows  # beside this script
from decode_packed import time_us
from records import add_device_argument, add_json_argument, environment, lacks_gpu, print_table, record, write_json

from shardattn.ops.sparse_mla_decode import sparse_mla_decode
from shardattn.ops.union import build_union
from shardattn.ops.unique_rows import unique_rows

SCALE = 576**-0.5


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache-rows", type=int, nargs="+", default=[262144, 4194304])
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--topk", type=int, nargs="+", default=[2048, 512])
    ap.add_argument("--kv-dtype", nargs="+", choices=("bf16", "fp8_ds_mla"), default=["bf16", "fp8_ds_mla"])
    add_device_argument(ap)
    add_json_argument(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if lacks_gpu(args.device):
        return 2
    if min(args.topk) < 2 or 2 * max(args.topk) > min(args.cache_rows):
        print("--topk must be >= 2 and at most half of every --cache-rows", file=sys.stderr)
        return 2
    dev = args.device
    env = environment(device=dev)
    print(f"{env['gpu']}, torch {env['versions']['torch']}, Triton {env['versions']['triton']}", flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    records = []
    for cache_rows in args.cache_rows:
        caches = build_caches(cache_rows, args.kv_dtype, device=dev)
        for fmt in args.kv_dtype:
            kv = caches[fmt] if fmt != "bf16" else caches[fmt].to(dtype)
            for heads in args.heads:
                for tokens in args.tokens:
                    for topk in args.topk:
                        q = torch.randn(tokens, heads, 576, device=dev, generator=g).to(dtype)
                        rows = distinct_rows(tokens, topk, cache_rows, g)
                        rows[:, 1] = rows[:, topk // 2]  # one row listed twice by every token
                        _, union_lens = build_union(rows, group_size=1, num_kv_rows=cache_rows)
                        hashed_lens = (unique_rows(rows, num_kv_rows=cache_rows) >= 0).sum(1, dtype=torch.int32)
                        if not torch.equal(hashed_lens, union_lens):
                            raise RuntimeError(f"unique_rows and build_union differ: {cache_rows} rows {tokens}x{topk}")

                        def default(q=q, kv=kv, rows=rows):
                            return sparse_mla_decode(q, kv, rows, scale=SCALE)

                        def sorted_union(q=q, kv=kv, rows=rows, cache_rows=cache_rows):
                            u, n = build_union(rows, group_size=1, num_kv_rows=cache_rows)
                            return sparse_mla_decode(q, kv, u, scale=SCALE, topk_length=n, rows_unique=True)

                        def kernel_only(q=q, kv=kv, rows=rows):
                            return sparse_mla_decode(q, kv, rows, scale=SCALE, rows_unique=True)

                        ref = sorted_union()[0].float()
                        err = ((default()[0].float() - ref).norm() / ref.norm().clamp(min=1e-30)).item()
                        if err > 1e-2:
                            raise RuntimeError(f"default decode differs from the sorted union's: {err:.2e}")
                        config = {"cache_rows": cache_rows, "kv": fmt, "heads": heads, "tokens": tokens, "topk": topk}
                        us = {
                            "hash": time_us(lambda r=rows, c=cache_rows: unique_rows(r, num_kv_rows=c), dev),
                            "union": time_us(
                                lambda r=rows, c=cache_rows: build_union(r, group_size=1, num_kv_rows=c), dev
                            ),
                            "default": time_us(default, dev),
                            "sorted": time_us(sorted_union, dev),
                            "kernel": time_us(kernel_only, dev),
                        }
                        base = ("sorted union (build_union, G = 1), same run", us["union"])
                        records.append(record("decode-dedup", config, "dedup us, hash", us["hash"], "us", "lower",
                                              base, env))  # fmt: skip
                        base = ("sorted union, then the kernel, same run", us["sorted"])
                        records.append(record("decode-dedup", config, "step us, default", us["default"], "us",
                                              "lower", base, env))  # fmt: skip
                        base = ("the kernel alone on the caller's rows (rows_unique=True), same run", us["kernel"])
                        records.append(record("decode-dedup", config, "step us, default vs kernel", us["default"],
                                              "us", "lower", base, env))  # fmt: skip
                        print(f"{cache_rows} {fmt} {heads}h x {tokens} k{topk}: hash {us['hash']:.1f} union "
                              f"{us['union']:.1f} | step default {us['default']:.1f} sorted union "
                              f"{us['sorted']:.1f} kernel {us['kernel']:.1f} us", flush=True)  # fmt: skip
        del caches
        if dev == "cuda":
            torch.cuda.empty_cache()
    print_table(records, "Sparse-MLA decode's de-duplication")
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
