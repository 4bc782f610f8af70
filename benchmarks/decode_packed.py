"""Sparse-MLA decode as the Runtime's steps run it: the top-k conversion, then the routed decode,
with each token's valid rows packed at the front (``convert_topk(packed=True)``, their count the
decode's ``topk_length``) against the rows converted in place (``-1`` where invalid), on one GPU.
Prints a table; ``--json`` writes records (``benchmarks/records.py``, benchmark ``decode-packed``).

    python benchmarks/decode_packed.py --json decode_packed.json

Each case: ``T`` decode tokens of ``H`` heads, one request each, over a paged cache of
``--cache-rows`` rows (pages of 64; every request's block table a random order of all pages),
top-k 2,048 distinct positions per token. Shares: ``all`` (every position valid), ``dcp4`` (a DCP
rank of 4: the positions the rank holds, about a quarter) and ``short`` (a request of 700 tokens:
the rest of the top-k is ``-1``). Both calls are timed with ``rows_unique`` False (the
de-duplicating union) and True (the rows read as given), as CUDA-graph replays with the L2 flushed
(``graph_timing.replay_us``); the outputs are checked against each other first (same keys, another
order: within bf16 rounding). Ratio = in-place time / packed time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_inputs import build_caches  # beside this script
from graph_timing import replay_us
from records import add_json_argument, environment, print_table, record, write_json

from shardattn.ops.sparse_mla_decode import sparse_mla_decode
from shardattn.ops.topk import DcpShard, convert_topk

PAGE, TOPK, SCALE = 64, 2048, 576**-0.5
#: name -> (DCP world of the rank, request length)
SHARES = {"all": (1, 200_000), "dcp4": (4, 200_000), "short": (1, 700)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--kv-dtype", nargs="+", choices=("bf16", "fp8_ds_mla"), default=["bf16", "fp8_ds_mla"])
    ap.add_argument("--cache-rows", type=int, default=262144)
    add_json_argument(ap)
    return ap


def make_case(tokens: int, world: int, length: int, pages: int, g: torch.Generator):
    """``(positions [T, K], request ids, block table [T, pages], seq_lens, DCP shard or None)``."""
    table = torch.rand(tokens, pages, device="cuda", generator=g).argsort(1).int()
    seq = min(length, pages * PAGE * world)
    step = max(seq // (4 * TOPK), 1)
    pos = torch.rand(tokens, 4 * TOPK, device="cuda", generator=g).argsort(1)[:, :TOPK] * step
    pos = torch.where(pos < seq, pos, -1).int()
    seq_lens = torch.full((tokens,), seq, dtype=torch.int32, device="cuda")
    req = torch.arange(tokens, dtype=torch.int32, device="cuda")
    return pos, req, table, seq_lens, DcpShard(world, 1, 1) if world > 1 else None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cache_rows <= 0 or args.cache_rows % PAGE:
        print(f"--cache-rows must be a positive multiple of {PAGE}, got {args.cache_rows}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    env = environment()
    print(f"{env['gpu']}, torch {env['versions']['torch']}, Triton {env['versions']['triton']}", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    caches = build_caches(args.cache_rows, args.kv_dtype)
    records = []
    for fmt in args.kv_dtype:
        kv = caches[fmt]
        for heads in args.heads:
            for tokens in args.tokens:
                for share, (world, length) in SHARES.items():
                    q = torch.randn(tokens, heads, 576, device="cuda", generator=g).bfloat16()
                    pos, req, table, seq_lens, dcp = make_case(tokens, world, length, args.cache_rows // PAGE, g)

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
                                  .float().mean()) / TOPK  # fmt: skip
                    config = {"heads": heads, "tokens": tokens, "topk": TOPK, "share": share, "kv": fmt}
                    for unique in (False, True):
                        plain = replay_us(lambda u=unique: step(False, u))
                        packed = replay_us(lambda u=unique: step(True, u))
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
