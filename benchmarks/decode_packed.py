"""Sparse-MLA decode as the Runtime's steps run it: the top-k conversion, then the routed decode,
with each token's valid rows packed at the front (``convert_topk(packed=True)``, their count the
decode's ``topk_length``) against the rows converted in place (``-1`` where invalid), on one GPU.
Prints a table; ``--json`` writes records (``benchmarks/records.py``, benchmark ``decode-packed``).

    python benchmarks/decode_packed.py --json decode_packed.json
    python benchmarks/decode_packed.py --device cpu --heads 4 --tokens 2 --topk 64 --cache-rows 4096   # dry run

Each case: ``T`` decode tokens of ``H`` heads, one request each, over a paged cache of
``--cache-rows`` rows (pages of 64; every request's block table a random order of all pages),
top-k ``--topk`` (2,048) distinct positions per token. Shares: ``all`` (every position valid), ``dcp4`` (a DCP
rank of 4: the positions the rank holds, about a quarter) and ``short`` (a request of 700 tokens:
the rest of the top-k is ``-1``). Both calls are timed with ``rows_unique`` False (the
de-duplicating union) and True (the rows read as given), as CUDA-graph replays with the L2 flushed
(``graph_timing.replay_us``); the outputs are checked against each other first (same keys, another
order: within bf16 rounding). Ratio = in-place time / packed time. ``--device cpu`` runs the torch
reference paths (a dry run of the script: host times, not looked at).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_inputs import build_caches  # beside this script
from graph_timing import replay_us
from records import add_device_argument, add_json_argument, environment, lacks_gpu, print_table, record, write_json

from shardattn.ops.sparse_mla_decode import sparse_mla_decode
from shardattn.ops.topk import DcpShard, convert_topk

PAGE, SCALE = 64, 576**-0.5
#: name -> (DCP world of the rank, request length)
SHARES = {"all": (1, 200_000), "dcp4": (4, 200_000), "short": (1, 700)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--kv-dtype", nargs="+", choices=("bf16", "fp8_ds_mla"), default=["bf16", "fp8_ds_mla"])
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--cache-rows", type=int, default=262144)
    add_device_argument(ap)
    add_json_argument(ap)
    return ap


def make_case(tokens: int, topk: int, world: int, length: int, pages: int, g: torch.Generator):
    """``(positions [T, K], request ids, block table [T, pages], seq_lens, DCP shard or None)``."""
    dev = g.device
    table = torch.rand(tokens, pages, device=dev, generator=g).argsort(1).int()
    seq = min(length, pages * PAGE * world)
    step = max(seq // (4 * topk), 1)
    pos = torch.rand(tokens, 4 * topk, device=dev, generator=g).argsort(1)[:, :topk] * step
    pos = torch.where(pos < seq, pos, -1).int()
    seq_lens = torch.full((tokens,), seq, dtype=torch.int32, device=dev)
    req = torch.arange(tokens, dtype=torch.int32, device=dev)
    return pos, req, table, seq_lens, DcpShard(world, 1, 1) if world > 1 else None


def time_us(fn, device: str) -> float:
    """Graph replays with the L2 flushed on a GPU; on the CPU the median of three host-timed calls."""
    if device == "cuda":
        return replay_us(fn)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(1e6 * (time.perf_counter() - start))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cache_rows <= 0 or args.cache_rows % PAGE:
        print(f"--cache-rows must be a positive multiple of {PAGE}, got {args.cache_rows}", file=sys.stderr)
        return 2
    if lacks_gpu(args.device):
        return 2
    if args.topk <= 0 or 4 * args.topk > (args.cache_rows // PAGE) * PAGE:
        print(f"--topk must be positive and at most a quarter of --cache-rows, got {args.topk}", file=sys.stderr)
        return 2
    dev, topk = args.device, args.topk
    env = environment(device=dev)
    print(f"{env['gpu']}, torch {env['versions']['torch']}, Triton {env['versions']['triton']}", flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    caches = build_caches(args.cache_rows, args.kv_dtype, device=dev)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    records = []
    for fmt in args.kv_dtype:
        kv = caches[fmt] if fmt != "bf16" else caches[fmt].to(dtype)
        for heads in args.heads:
            for tokens in args.tokens:
                for share, (world, length) in SHARES.items():
                    q = torch.randn(tokens, heads, 576, device=dev, generator=g).to(dtype)
                    pos, req, table, seq_lens, dcp = make_case(tokens, topk, world, length, args.cache_rows // PAGE, g)

                    def step(packed: bool, unique: bool, pos=pos, req=req, table=table, seq_lens=seq_lens, dcp=dcp,
                             q=q, kv=kv):  # fmt: skip
                        rows, counts = convert_topk(
                            pos, req, table, block_size=PAGE, seq_lens=seq_lens, dcp=dcp, packed=packed
                        )
                        lens = counts if packed else None
                        return sparse_mla_decode(q, kv, rows, scale=SCALE, topk_length=lens, rows_unique=unique)

                    ref, ref_lse = step(False, False)
                    for unique in (False, True):
                        out, lse = step(True, unique)
                        err = ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()
                        if err > 1e-2 or not torch.allclose(lse, ref_lse, atol=1e-3, rtol=1e-3, equal_nan=True):
                            raise RuntimeError(f"packed rows differ: {fmt} {heads} heads {tokens} tokens {share}")
                    valid = float((convert_topk(pos, req, table, block_size=PAGE, seq_lens=seq_lens, dcp=dcp)[1])
                                  .float().mean()) / topk  # fmt: skip
                    config = {"heads": heads, "tokens": tokens, "topk": topk, "share": share, "kv": fmt}
                    for unique in (False, True):
                        plain = time_us(lambda u=unique: step(False, u), dev)
                        packed = time_us(lambda u=unique: step(True, u), dev)
                        metric = f"step us, rows_unique={unique}"
                        base = ("rows converted in place, same run", plain)
                        records.append(record("decode-packed", config, metric, packed, "us", "lower", base, env))
                        print(f"{fmt} {heads}h x {tokens} {share} ({valid:.0%} valid) unique={unique}: packed "
                              f"{packed:.1f} us, in place {plain:.1f} us", flush=True)  # fmt: skip
    print_table(records, "Sparse-MLA decode on packed rows")
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
