"""Sparse-MLA decode against its read floor, on small caches and caches of real size.

    python benchmarks/decode_floor.py --json decode_floor.json
    python benchmarks/decode_floor.py --cache-rows 40000000 --json decode_floor_40m.json   # 46 GB of bf16 rows

For each KV format (``bf16``: 1,152-byte rows; ``fp8_ds_mla``: 656-byte rows holding the same
values quantised), heads, batch and top-k: the routed :func:`~shardattn.ops.sparse_mla_decode.sparse_mla_decode`
(one token per request, ``rows_unique=True``) against the read floor (``benchmarks/read_floor.py``:
a kernel that only reads the same picked rows once, the fastest of its configurations), same
rows, same cache, same run. Both are timed as CUDA-graph replays with the L2 flushed before each
(``graph_timing.replay_us``), so the rows come from HBM as in a serving step. Each token picks
``topk`` distinct rows at random over the whole cache, in random order: on a cache of tens of GB
the picks land on pages spread as an engine's allocator leaves them, and the cost of address
translation shows. ``--topk 512 256``: a DCP rank's share of 2,048 at 4 and 8 ranks.

Records ``decode-read-floor``: decode us, baseline the floor us (ratio = floor / decode; the
target is a decode step within 1.15x of the floor, ratio >= 0.87). Printed also as GB/s of rows.
Every decode output is checked against the fp32 reference before it is timed.

``--no-reads``: also the same routed step with every entry made invalid (-1), so that no row is read
and the output is zeros: what the step costs without its reads (records ``step us, no rows read``
against the step that reads them, same run; ratio = with reads / without). Where the two are
close, the step is bound by its own instructions, not by HBM.

``--triton``: also the Triton split-KV kernel at its default launch (what the routing took below
the streaming kernel's crossover before D58), timed beside the routed step (records ``step us,
against Triton split-KV``: the routed step, baseline the Triton step; ratio = Triton / routed).

``--peer-lib LIB`` (a FlashMLA FP8 decode built by ``benchmarks/peer/build_flashmla_peer.sh ...
fp8_decode``): on ``fp8_ds_mla`` rows, also FlashMLA's FP8 sparse decode on the same rows and
cache (scheduler metadata once, as in ``decode_fp8_peer.py``), checked against the same reference
and timed against the same floor (records ``FlashMLA FP8 decode us``: the peer's step, baseline
the floor; ratio = floor / FlashMLA): whether the floor is within reach of a dequantising kernel.

``--sweep``: below :data:`~shardattn.plan.crossovers.GLUON_DECODE_MIN_HEADS` heads, also the Triton
split-KV kernel under each of :data:`SWEEP`'s launch configurations times 1, 2 and 4 times its
split count, the small-batch Gluon kernel forced and the streaming Gluon kernel at its planned
and at 1, 2, 4, 8 and 16 slices of at least 64 entries (each where it takes the shape); at more
heads, the Gluon kernel at 1, 2, 4, 8, 16 and 32 slices of each row, slices of 64 rows or more
(the slice count its wave model picks is printed); printed per configuration, with a record
``best swept us`` of the fastest (its configuration named) against the same floor.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_inputs import ROW_BYTES, build_caches, distinct_rows
from graph_timing import replay_us
from read_floor import CONFIGS, read_rows, read_rows_reference, row_words
from records import add_json_argument, environment, print_table, record, write_json

from shardattn.kernels.gluon.sparse_mla_decode import gluon_decode_plan
from shardattn.kernels.triton.sparse_mla_decode import run_split_decode
from shardattn.kernels.triton.sparse_mla_decode_config import decode_launch, sparse_mla_decode_config
from shardattn.ops.sparse_mla import sparse_mla_reference
from shardattn.ops.sparse_mla_decode import run_sparse_mla_decode, sparse_mla_decode
from shardattn.ops.sparse_mla_decode_gluon import sparse_mla_decode_gluon
from shardattn.plan.crossovers import GLUON_DECODE_MIN_HEADS

SCALE = 576**-0.5
#: Launch configurations of the Triton split-KV kernel that ``--sweep`` times.
SWEEP = tuple({"BLOCK_N": n, "num_warps": w, "num_stages": st} for n in (32, 64) for w in (4, 8) for st in (2, 3))


def floor_us(words: torch.Tensor, rows: torch.Tensor) -> float:
    """The fastest configuration of the read floor on these rows, in us (graph replays, L2 flushed)."""
    best = float("inf")
    for cfg in CONFIGS:
        out = read_rows(words, rows, cfg)
        few = rows[:4]  # checked on a few tokens: the reference holds [T, K, W] int64
        if not torch.equal(out[: few.shape[0]], read_rows_reference(words, few, cfg[0])):
            raise RuntimeError(f"the read floor's kernel in configuration {cfg} is not its reference's sums")
        best = min(best, replay_us(lambda cfg=cfg, out=out: read_rows(words, rows, cfg, out=out)))
    return best


def bench(args: argparse.Namespace, env: dict) -> list[dict]:
    caches = build_caches(args.cache_rows, args.kv_dtype)
    peer = None
    if args.peer_lib is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parent / "peer"))
        from flashmla_fp8_decode import FlashMLAFp8Decode  # beside its .cu in peer/

        peer = FlashMLAFp8Decode(args.peer_lib)
    g = torch.Generator(device="cuda").manual_seed(1)
    out = []
    for fmt, cache in caches.items():
        words = row_words(cache)
        for heads in args.heads:
            for batch in args.batch:
                for topk in args.topk:
                    rows = distinct_rows(batch, topk, args.cache_rows, g)
                    q = torch.randn(batch, heads, 576, device="cuda", generator=g).bfloat16()
                    o = torch.empty(batch, heads, 512, device="cuda", dtype=torch.bfloat16)
                    s = torch.empty(batch, heads, device="cuda")

                    def step(q=q, rows=rows, o=o, s=s, cache=cache):
                        sparse_mla_decode(q, cache, rows, scale=SCALE, rows_unique=True, out=o, lse_out=s)

                    o.fill_(float("nan"))
                    step()
                    ref, _ = sparse_mla_reference(q.float(), cache, rows, scale=SCALE)
                    err = float((o.float() - ref).abs().max())
                    if not err <= 2e-2:
                        raise RuntimeError(f"{fmt} {heads} heads x {batch}, top-k {topk}: max |out - ref| = {err:.3g}")
                    dec, flo = replay_us(step), floor_us(words, rows)
                    config = {"kv": fmt, "heads": heads, "batch": batch, "topk": topk, "cache_rows": args.cache_rows}
                    base = ("read floor (the same rows read once), same run", flo)
                    out.append(record("decode-read-floor", config, "step us", dec, "us", "lower", base, env))
                    gb = batch * topk * ROW_BYTES[fmt] / 1e3  # the case's line first, its indented lines below
                    print(f"{fmt} {heads} heads x {batch}, top-k {topk}: decode {dec:.1f} us ({gb / dec:.0f} GB/s), "
                          f"floor {flo:.1f} us ({gb / flo:.0f} GB/s), decode / floor {dec / flo:.2f}",
                          flush=True)  # fmt: skip
                    if args.no_reads:
                        bare = no_reads_us(q, cache, rows, o, s)
                        print(f"  no rows read: {bare:.1f} us ({bare / dec:.2f} of the step)", flush=True)
                        with_reads = ("the same step reading its rows, same run", dec)
                        out.append(record("decode-read-floor", config, "step us, no rows read", bare, "us", "lower",
                                          with_reads, env))  # fmt: skip
                    if args.triton:
                        tri = triton_us(q, cache, rows, ref, o, s)
                        print(f"  Triton split-KV: {tri:.1f} us ({tri / dec:.2f}x the routed step)", flush=True)
                        vs = ("Triton split-KV step, same run", tri)
                        out.append(record("decode-read-floor", config, "step us, against Triton split-KV", dec, "us",
                                          "lower", vs, env))  # fmt: skip
                    if peer is not None and fmt == "fp8_ds_mla":
                        call = peer.prepare(q, cache, rows, SCALE)
                        call.run()
                        p_out, _ = call.result()
                        p_err = float((p_out.float() - ref).abs().max())
                        if not p_err <= 2e-2:
                            raise RuntimeError(f"FlashMLA {heads} heads x {batch}: max |out - ref| = {p_err:.3g}")
                        p_us = replay_us(call.run)
                        print(f"  FlashMLA FP8 decode: {p_us:.1f} us ({p_us / flo:.2f}x the floor)", flush=True)
                        out.append(record("decode-read-floor", config, "FlashMLA FP8 decode us", p_us, "us", "lower",
                                          base, env))  # fmt: skip
                    if args.sweep:
                        name, us = sweep(q, cache, rows, ref, o, s)
                        print(f"  best swept: {name} {us:.1f} us, {us / flo:.2f}x the floor", flush=True)
                        best = {**config, "best": name}
                        out.append(record("decode-read-floor", best, "best swept us", us, "us", "lower", base, env))
    return out


def triton_us(
    q: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor, ref: torch.Tensor, o: torch.Tensor, s: torch.Tensor
) -> float:
    """The Triton split-KV kernel at its default launch on the same call, in us; its output is
    checked against ``ref`` first."""

    def step() -> None:
        run_sparse_mla_decode(q, cache, rows, scale=SCALE, rows_unique=True, out=o, lse_out=s, kernel="triton")

    o.fill_(float("nan"))
    step()
    err = float((o.float() - ref).abs().max())
    if not err <= 2e-2:
        raise RuntimeError(f"Triton split-KV: max |out - ref| = {err:.3g}")
    return replay_us(step)


def no_reads_us(q: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor, o: torch.Tensor, s: torch.Tensor) -> float:
    """The routed step (as :func:`bench` times it) with every entry of ``rows`` made -1, in us; its
    output is checked to be the empty row's ``(0, -inf)`` first."""
    none = torch.full_like(rows, -1)

    def step() -> None:
        sparse_mla_decode(q, cache, none, scale=SCALE, rows_unique=True, out=o, lse_out=s)

    o.fill_(float("nan"))
    step()
    if not (bool((o == 0).all()) and bool((s == float("-inf")).all())):
        raise RuntimeError("a step with no valid entry did not give (0, -inf)")
    return replay_us(step)


def sweep(
    q: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor, ref: torch.Tensor, o: torch.Tensor, s: torch.Tensor
) -> tuple[str, float]:
    """``(name, us)`` of the fastest launch of the module docstring's ``--sweep``, each checked first."""
    t, h, _ = q.shape
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    runs = {}
    if h >= GLUON_DECODE_MIN_HEADS:
        planned = gluon_decode_plan(t, h, rows.shape[1], sms, kv_fp8=cache.dtype == torch.uint8)["num_splits"]
        print(f"  the slice plan picks {planned} slices", flush=True)
        for slices in (n for n in (1, 2, 4, 8, 16, 32) if n == 1 or n * 64 <= rows.shape[1]):
            runs[f"gluon {slices} slices"] = lambda slices=slices: sparse_mla_decode_gluon(
                q, cache, rows, scale=SCALE, v_dim=512, out=o, lse_out=s, num_sms=sms, num_splits=slices,
                rows_unique=True,
            )  # fmt: skip
        return _fastest(runs, ref, o)
    fp8 = cache.dtype == torch.uint8
    base = sparse_mla_decode_config(t, h, rows.shape[1], sms, kv_fp8=fp8)["num_splits"]
    for cfg in SWEEP:
        for mult in (1, 2, 4):
            name = f"triton N{cfg['BLOCK_N']} w{cfg['num_warps']} st{cfg['num_stages']} splits x{mult}"
            launch = decode_launch(t, h, rows.shape[1], sms, min(64, base * mult), cfg, kv_fp8=fp8)
            runs[name] = lambda launch=launch: run_split_decode(
                q, cache, rows, scale=SCALE, topk_length=None, sinks=None, out=o, lse_out=s, launch=launch
            )
    runs["gluon_small (forced)"] = lambda: sparse_mla_decode(
        q, cache, rows, scale=SCALE, rows_unique=True, out=o, lse_out=s, backend="gluon_small"
    )
    stream_slices = [n for n in (None, 1, 2, 4, 8, 16) if n is None or n * 64 <= max(64, rows.shape[1])]
    for slices in stream_slices if h <= 16 else ():
        runs[f"gluon_stream {slices or 'planned'} slices"] = lambda slices=slices: run_sparse_mla_decode(
            q, cache, rows, scale=SCALE, rows_unique=True, out=o, lse_out=s, kernel="gluon_stream", num_splits=slices
        )
    return _fastest(runs, ref, o)


def _fastest(runs: dict, ref: torch.Tensor, o: torch.Tensor) -> tuple[str, float]:
    """``(name, us)`` of the fastest of ``runs`` (name -> a launch writing ``o``), each checked against
    ``ref`` first; a launch that cannot take the shape (``ValueError``) is skipped, saying why."""
    best = ("none", float("inf"))
    for name, fn in runs.items():
        o.fill_(float("nan"))
        try:
            fn()
        except ValueError as e:  # a kernel that cannot take the shape says so
            print(f"  {name}: {e}")
            continue
        err = float((o.float() - ref).abs().max())
        if not err <= 2e-2:
            raise RuntimeError(f"{name}: max |out - ref| = {err:.3g}")
        us = replay_us(fn)
        print(f"  {name}: {us:.1f} us", flush=True)
        best = min(best, (name, us), key=lambda x: x[1])
    return best


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kv-dtype", nargs="+", choices=tuple(ROW_BYTES), default=list(ROW_BYTES))
    p.add_argument("--heads", nargs="+", type=int, default=[8, 16, 64])
    p.add_argument("--batch", nargs="+", type=int, default=[64, 256])
    p.add_argument("--topk", nargs="+", type=int, default=[2048, 512, 256])
    p.add_argument("--cache-rows", type=int, default=1 << 18, help="rows of the cache (40,000,000: 46 GB of bf16)")
    p.add_argument("--no-reads", action="store_true", help="also the step with every entry invalid (docstring)")
    p.add_argument("--triton", action="store_true", help="also the Triton split-KV kernel (docstring)")
    p.add_argument("--sweep", action="store_true", help="also the Triton kernel's launch configurations (docstring)")
    p.add_argument("--peer-lib", default=None, help="FlashMLA FP8 decode library, on fp8_ds_mla rows (docstring)")
    add_json_argument(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_floor.py needs a CUDA GPU (the read floor is a GPU kernel)", file=sys.stderr)
        return 2
    env = environment()
    records = bench(args, env)
    print_table(records, "sparse-MLA decode against its read floor")
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
