"""Decode on one GPU: sparse-MLA and GQA decode against their same-run baselines, the LSE merge
against the copy bandwidth, and a captured decode step against eager.

    python benchmarks/decode.py --json decode.json       # every section
    python benchmarks/decode.py --only sparse-small      # a subset (SECTIONS)
    python benchmarks/decode.py --only gqa --pool-gb 40  # GQA decode on a 40 GB pool of scattered pages
    python benchmarks/decode.py --warm-xqa               # JIT-compile FlashInfer XQA's variants only

Sections (each number a median of CUDA-graph replays under ``triton.testing.do_bench``, which
flushes the L2 between replays, so the KV rows come from HBM as in a serving step; every output
is checked against the fp32 reference before it is timed):

* ``sparse``: sparse-MLA decode at batch 64-256 (128 / 64 / 32 heads), top-k 2048 unique random
  rows of 262,144 (302 MB of bf16 KV; ``--cache-rows 40000000``: 46 GB, and the records name it),
  D 576 / Dv 512, ``rows_unique=True`` (an indexer's top-k lists a row once). Ours:
  :func:`~shardattn.ops.sparse_mla_decode.sparse_mla_decode` as routed (the Gluon kernel on
  sm_90); baseline: the Triton split-KV kernel and its merge (``backend="triton"``); microseconds
  per step (printed also as effective TFLOP/s, ``2 * batch * topk * heads * (576 + 512) / time``).
* ``sparse-small``: the same at batch 1-16 (16 and 8 heads; 128 heads at batch 1 and 8; the
  small-batch Gluon kernel is routed at <= 16 heads and <= 16 tokens on sm_90).
* ``gqa``: GQA paged decode, 64 q / 8 kv heads, head dim 64, page 32, bf16, batch 64 x 8,192
  context: one query per request, 4 uniform drafts, 1-4 ragged drafts. Ours: the Triton kernel;
  peer: FlashInfer XQA (when installed). The cache holds exactly the requests' 16,384 pages
  (1.07 GB of K and V, in shuffled order); ``--pool-gb 40``: the same pages at scattered page ids
  of a 40 GB pool (``kv_pool.place_pages``, built once for the three steps), and the records name
  ``pool_gb``.
* ``fp8``: sparse-MLA decode on an ``fp8_ds_mla`` cache (656-byte rows,
  :mod:`shardattn.ops.kv_fp8`) against the same routed decode on the bf16 rows it dequantises to
  (:func:`~shardattn.ops.kv_fp8.dequantize_kv`: the same values, 1,152-byte rows), same inputs
  and run: 16 heads x batch 1-8 (the small-batch kernel), 64 and 128 heads x batch 1-256; each output
  is checked against the reference, and the two are equal bit for bit where both take the same
  launch (all but 3-4 tokens at 16 heads, where FP8 rows take 64-entry splits). Records ``fp8-decode``: FP8 us,
  baseline the bf16 us (ratio > 1: FP8 faster); printed also as GB/s of KV rows read.
* ``cache-size``: the routed decode on a cache of ``--large-rows`` (default 40,000,000 rows: 46 GB
  of bf16 and 26 GB of fp8_ds_mla, the same values; each token's rows drawn over the whole cache,
  so every row lies on its own page) against the same decode on a 262,144-row cache, same run,
  bf16 and FP8 rows (``--kv-dtype``: one of them), 128 / 64 / 16 heads x 64 and 64 heads x 256.
  Records ``decode-cache-size``:
  large-cache us, baseline the small-cache us (target: a ratio of at least 1 / 1.15 = 0.87); and
  ``step us, rows sorted``: the large-cache decode on the same rows sorted per token (the sort not
  timed), what reading them in address order recovers.
* ``merge``: the LSE merge of 2 / 4 / 8 bf16 partials of 4,096 tokens x 16 heads x 512 in TB/s
  (bytes read + written) against a 2 GiB device-to-device copy in the same run.
* ``graph``: a small GQA and sparse-MLA decode step eager and as a CUDA-graph replay.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_inputs import (
    GQA_BATCH,
    GQA_CONTEXT,
    GQA_PAGE_SHAPE,
    ROW_BYTES,
    build_caches,
    distinct_rows,
    fp8_cache_and_values,
    gqa_cache,
    gqa_inputs,
    gqa_pool_pages,
    gqa_reference,
)
from graph_timing import replay_us
from kv_pool import add_pool_argument, pool_config
from records import add_json_argument, environment, print_table, record, write_json

from shardattn.kernels import flashinfer_xqa
from shardattn.ops.dispatch import sparse_decode_kernel
from shardattn.ops.gqa_decode import gqa_paged_decode
from shardattn.ops.lse_merge import lse_merge
from shardattn.ops.sparse_mla import sparse_mla_reference
from shardattn.ops.sparse_mla_decode import sparse_mla_decode
from shardattn.runtime.graph_capture import DecodeGraph

SECTIONS = ("sparse", "sparse-small", "fp8", "cache-size", "gqa", "merge", "graph")
LARGE = ((128, 64), (128, 128), (128, 256), (64, 64), (64, 128), (64, 256), (32, 256))
SMALL = (*((h, b) for h in (16, 8) for b in (1, 2, 4, 8, 16)), (128, 1), (128, 8))
FP8 = (*((16, b) for b in (1, 2, 4, 8)), *((h, b) for h in (64, 128) for b in (1, 8, 64, 128, 256)))
CACHE_SIZE = ((128, 64), (64, 64), (16, 64), (64, 256))
KV_ROWS = 1 << 18
SCALE = 576**-0.5


def bench_ms(fn, warmup: int = 30, rep: int = 200) -> float:
    """Median milliseconds of ``fn`` (``triton.testing.do_bench``: CUDA events, L2 flushed)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def graph_ms(fn) -> float:
    """Median milliseconds of ``fn``'s CUDA-graph replays (``graph_timing.replay_us``)."""
    return replay_us(fn) * 1e-3


def check(what: str, got: torch.Tensor, ref: torch.Tensor, tol: float = 2e-2) -> None:
    """``max |got - ref|`` within ``tol`` (bf16 outputs against an fp32 reference)."""
    err = (got.float() - ref.float()).abs().max().item()
    if not err <= tol:
        raise RuntimeError(f"{what}: max |out - reference| = {err:.3g} (tolerance {tol})")


def _config(heads: int, batch: int, topk: int, cache_rows: int) -> dict:
    """A record's configuration; the cache's rows named where they are not the default's."""
    config = {"heads": heads, "batch": batch, "topk": topk}
    return config if cache_rows == KV_ROWS else config | {"cache_rows": cache_rows}


def bench_sparse(env: dict, cases, topk: int, benchmark: str, cache_rows: int = KV_ROWS) -> list[dict]:
    """Routed sparse-MLA decode against the Triton split-KV path on the same inputs (module docstring)."""
    kv = build_caches(cache_rows, ["bf16"])["bf16"]
    g = torch.Generator(device="cuda").manual_seed(1)
    out = []
    for heads, batch in cases:
        q = torch.randn(batch, heads, 576, device="cuda").bfloat16()
        rows = distinct_rows(batch, topk, cache_rows, g)
        ref, _ = sparse_mla_reference(q.float(), kv, rows, scale=SCALE)
        o = torch.empty(batch, heads, 512, device="cuda", dtype=torch.bfloat16)
        s = torch.empty(batch, heads, device="cuda")
        ms = {}
        for name, backend in (("routed", None), ("triton", "triton")):

            def fn(q=q, rows=rows, o=o, s=s, backend=backend):
                return sparse_mla_decode(q, kv, rows, scale=SCALE, rows_unique=True, out=o, lse_out=s, backend=backend)

            o.fill_(float("nan"))
            fn()
            check(f"{heads} heads x {batch}, {name}", o, ref)
            ms[name] = graph_ms(fn)
        config = _config(heads, batch, topk, cache_rows)
        base = ("Triton split-KV, same run", ms["triton"] * 1e3)
        out.append(record(benchmark, config, "step us", ms["routed"] * 1e3, "us", "lower", base, env))
        flop = 2 * batch * topk * heads * (576 + 512)
        print(f"sparse decode {heads} heads x {batch}: routed {ms['routed'] * 1e3:.1f} us "
              f"({flop / ms['routed'] / 1e9:.0f} TF/s), Triton {ms['triton'] * 1e3:.1f} us", flush=True)  # fmt: skip
    return out


def _same_launch(q: torch.Tensor, kv: torch.Tensor, kv8: torch.Tensor, rows: torch.Tensor, topk: int) -> bool:
    """Whether routed decode launches the same kernel with the same tiles on the FP8 rows ``kv8`` as
    on their bf16 values ``kv`` (the routing's crossovers differ by format, D58 / D64; the
    small-batch kernel takes 64-entry splits at more tokens on FP8 rows, D59; the Gluon kernel
    may cut FP8 rows into more slices, D65)."""
    from shardattn.kernels.gluon.sparse_mla_decode import gluon_decode_plan
    from shardattn.plan.decode_routing import small_decode_tiles

    path = sparse_decode_kernel(q, kv, 512, rows)[0]
    if sparse_decode_kernel(q, kv8, 512, rows)[0] != path:
        return False
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch, heads = q.shape[0], q.shape[1]
    if path == "gluon":
        return gluon_decode_plan(batch, heads, topk, sms) == gluon_decode_plan(batch, heads, topk, sms, kv_fp8=True)
    if path != "gluon_small":
        return True
    return small_decode_tiles(batch, topk, sms) == small_decode_tiles(batch, topk, sms, kv_fp8=True)


def bench_fp8(env: dict, cases, topk: int, cache_rows: int = KV_ROWS) -> list[dict]:
    """Routed decode on fp8_ds_mla rows against the routed decode on their bf16 values (module docstring)."""
    kv8, kv = fp8_cache_and_values(cache_rows)  # kv: bf16, the same values
    g = torch.Generator(device="cuda").manual_seed(1)
    out = []
    for heads, batch in cases:
        q = torch.randn(batch, heads, 576, device="cuda").bfloat16()
        rows = distinct_rows(batch, topk, cache_rows, g)
        ref, _ = sparse_mla_reference(q.float(), kv8, rows, scale=SCALE)
        res, us = {}, {}
        for name, cache in (("fp8", kv8), ("bf16", kv)):
            o = torch.empty(batch, heads, 512, device="cuda", dtype=torch.bfloat16)
            s = torch.empty(batch, heads, device="cuda")

            def fn(q=q, rows=rows, o=o, s=s, cache=cache):
                return sparse_mla_decode(q, cache, rows, scale=SCALE, rows_unique=True, out=o, lse_out=s)

            o.fill_(float("nan"))
            fn()
            check(f"{heads} heads x {batch}, {name}", o, ref)
            res[name] = (o.clone(), s.clone())
            us[name] = graph_ms(fn) * 1e3
        same = torch.equal(res["fp8"][0], res["bf16"][0]) and torch.equal(res["fp8"][1], res["bf16"][1])
        if not same and _same_launch(q, kv, kv8, rows, topk):
            raise RuntimeError(f"{heads} heads x {batch}: FP8 decode differs from bf16 decode on the same values")
        config = _config(heads, batch, topk, cache_rows)
        base = ("routed bf16 decode on the dequantised rows, same run", us["bf16"])
        out.append(record("fp8-decode", config, "step us", us["fp8"], "us", "lower", base, env))
        row_bytes = {"fp8": ROW_BYTES["fp8_ds_mla"], "bf16": ROW_BYTES["bf16"]}
        gbs = {k: batch * topk * row_bytes[k] / (v * 1e-6) / 1e9 for k, v in us.items()}
        ratio = us["bf16"] / us["fp8"]
        print(f"fp8 decode {heads} heads x {batch}: FP8 {us['fp8']:.1f} us ({gbs['fp8']:.0f} GB/s of rows), "
              f"bf16 {us['bf16']:.1f} us ({gbs['bf16']:.0f} GB/s), {ratio:.2f}x", flush=True)  # fmt: skip
    return out


def bench_cache_size(
    env: dict, cases, topk: int, large_rows: int, formats: tuple[str, ...] = tuple(ROW_BYTES)
) -> list[dict]:
    """Routed decode on a cache of ``large_rows`` against the same decode on a :data:`KV_ROWS` cache,
    on rows of each of ``formats`` (bf16, fp8_ds_mla), same run (module docstring)."""
    sizes = {"small": KV_ROWS, "large": large_rows}
    caches = {name: build_caches(rows, list(formats)) for name, rows in sizes.items()}
    g = torch.Generator(device="cuda").manual_seed(1)
    out = []
    for fmt in formats:
        for heads, batch in cases:
            q = torch.randn(batch, heads, 576, device="cuda").bfloat16()
            o = torch.empty(batch, heads, 512, device="cuda", dtype=torch.bfloat16)
            s = torch.empty(batch, heads, device="cuda")
            us = {}
            for name, num_rows in sizes.items():
                kv, rows = caches[name][fmt], distinct_rows(batch, topk, num_rows, g)
                # the large cache's rows also sorted per token (the same keys, read in address order)
                for label, rows_in in (
                    (name, rows),
                    *((("large sorted", rows.sort(1).values),) if name == "large" else ()),
                ):

                    def fn(q=q, kv=kv, rows=rows_in, o=o, s=s):
                        return sparse_mla_decode(q, kv, rows, scale=SCALE, rows_unique=True, out=o, lse_out=s)

                    o.fill_(float("nan"))
                    fn()
                    check(f"{fmt} {heads} heads x {batch}, {num_rows:,} rows ({label})", o,
                          sparse_mla_reference(q.float(), kv, rows_in, scale=SCALE)[0])  # fmt: skip
                    us[label] = graph_ms(fn) * 1e3
            config = {"kv": fmt, "heads": heads, "batch": batch, "topk": topk, "cache_rows": large_rows}
            base = (f"the same decode on a {KV_ROWS:,}-row cache, same run", us["small"])
            out.append(record("decode-cache-size", config, "step us", us["large"], "us", "lower", base, env))
            out.append(record("decode-cache-size", config, "step us, rows sorted", us["large sorted"], "us", "lower",
                              base, env))  # fmt: skip
            print(f"decode {fmt} {heads} heads x {batch}: {large_rows:,} rows {us['large']:.1f} us "
                  f"(rows sorted {us['large sorted']:.1f}), {KV_ROWS:,} rows {us['small']:.1f} us "
                  f"(small / large {us['small'] / us['large']:.2f}x)", flush=True)  # fmt: skip
    return out


def bench_gqa(env: dict, pool_gb: float | None = None) -> list[dict]:
    """GQA paged decode, Triton against XQA, on one cache (``pool_gb``: scattered over a pool of that size)."""
    page, hkv, d = GQA_PAGE_SHAPE
    cache = gqa_cache(GQA_BATCH, GQA_CONTEXT, hkv, d, page, pool_gb=pool_gb)
    out = []
    for label, q_len, ragged in (("1", 1, False), ("4 uniform", 4, False), ("1-4 ragged", 4, True)):
        args, kw = gqa_inputs(GQA_BATCH, GQA_CONTEXT, q_len, hkv=hkv, d=d, page=page, ragged=ragged, cache=cache)
        ref = gqa_reference(args, kw)
        ms = {}
        for backend in ("triton", "flashinfer"):
            reason = flashinfer_xqa.unavailable_reason(args[0], args[1]) if backend == "flashinfer" else None
            if reason is not None:
                print(f"GQA decode, {label} queries per request: XQA skipped ({reason})", flush=True)
                continue
            got = gqa_paged_decode(*args, backend=backend, **kw)[: ref.shape[0]]
            check(f"GQA decode {label} on {backend}", got, ref)
            ms[backend] = graph_ms(lambda b=backend, a=args, k=kw: gqa_paged_decode(*a, backend=b, **k))
        base = ("FlashInfer XQA, same run", ms["flashinfer"] * 1e3) if "flashinfer" in ms else None
        config = {"batch": GQA_BATCH, "context": GQA_CONTEXT, "queries per request": label} | pool_config(pool_gb)
        out.append(record("gqa-decode", config, "step us", ms["triton"] * 1e3, "us", "lower", base, env))
    return out


def copy_bandwidth() -> float:
    """TB/s of a 2 GiB device-to-device copy, bytes read + written."""
    x = torch.randn(512 << 20, device="cuda", dtype=torch.float32)
    y = torch.empty_like(x)
    return 2 * x.numel() * 4 / (bench_ms(lambda: y.copy_(x)) * 1e-3) / 1e12


def bench_merge(env: dict) -> list[dict]:
    copy_tbs = copy_bandwidth()
    t, h, d = 4096, 16, 512
    out = []
    for p in (2, 4, 8):
        outs = torch.randn(p, t, h, d, device="cuda").bfloat16()
        lses = torch.randn(p, t, h, device="cuda")
        o = torch.empty(t, h, d, device="cuda", dtype=torch.bfloat16)
        s = torch.empty(t, h, device="cuda")
        nbytes = outs.numel() * 2 + lses.numel() * 4 + o.numel() * 2 + s.numel() * 4
        lse_merge(outs, lses, out=o, lse_out=s)  # checked before it is timed: softmax weights of the LSEs
        weights = torch.softmax(lses, dim=0)[..., None]
        check(f"lse_merge of {p} partials", o, (weights * outs.float()).sum(0))
        check(f"lse_merge of {p} partials, LSE", s, torch.logsumexp(lses, dim=0), tol=1e-4)
        del weights
        tbs = nbytes / (graph_ms(lambda a=outs, b=lses, c=o, e=s: lse_merge(a, b, out=c, lse_out=e)) * 1e-3) / 1e12
        config = {"partials": p, "tokens": t, "heads": h, "dim": d}
        out.append(record("lse-merge", config, "TB/s", tbs, "TB/s", "higher", ("device copy, same run", copy_tbs), env))
    return out


def bench_graph(env: dict) -> list[dict]:
    args, kw = gqa_inputs(8, 1024, 1)
    kv = torch.randn(1 << 16, 576, device="cuda").bfloat16()
    q = torch.randn(1, 16, 576, device="cuda").bfloat16()
    rows = torch.randperm(1 << 16, device="cuda")[:2048].int()[None]
    cases = (
        ("GQA, batch 8, context 1024", lambda: gqa_paged_decode(*args, backend="triton", return_lse=True, **kw)),
        ("sparse MLA, 16 heads, batch 1, rows de-duplicated", lambda: sparse_mla_decode(q, kv, rows, scale=0.04)),
    )
    sparse_ref, _ = sparse_mla_reference(q.float(), kv, rows, scale=0.04)
    gqa_ref = gqa_paged_decode(*args, backend="reference", return_lse=True, **kw)
    out = []
    for (name, fn), ref in zip(cases, (gqa_ref[0], sparse_ref), strict=True):
        eager = fn()
        check(f"decode-graph {name}, eager", eager[0], ref)
        replayed = DecodeGraph(fn, {}).replay()  # the library's capture, as the timing's graph_of
        torch.cuda.synchronize()
        if not all(torch.equal(a, b) for a, b in zip(replayed, eager, strict=True)):
            raise RuntimeError(f"decode-graph {name}: the graph's replay differs from the eager step")
        eager, replay = bench_ms(fn), graph_ms(fn)
        base = ("eager, same run", eager * 1e3)
        out.append(record("decode-graph", {"step": name}, "step us", replay * 1e3, "us", "lower", base, env))
    return out


def warm_xqa() -> None:
    """Compile the XQA variants the benchmark and the GPU tests use (JIT, once per machine)."""
    t0 = time.time()
    for q_len, ragged in ((1, False), (4, False), (4, True)):
        args, kw = gqa_inputs(2, 256, q_len, ragged=ragged)
        reason = flashinfer_xqa.unavailable_reason(args[0], args[1])
        if reason is not None:
            print("XQA unavailable:", reason)
            return
        gqa_paged_decode(*args, backend="flashinfer", **kw)
        torch.cuda.synchronize()
        print(f"XQA q_len={q_len} ragged={ragged} ready after {time.time() - t0:.0f} s", flush=True)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}")
    ap.add_argument("--topk", type=int, default=2048, help="top-k of the sparse-MLA sections")
    ap.add_argument("--cache-rows", type=int, default=KV_ROWS,
                    help="rows of the sparse-MLA sections' cache (40,000,000: 46 GB of bf16)")  # fmt: skip
    ap.add_argument("--large-rows", type=int, default=40_000_000,
                    help="rows of the cache-size section's large cache (bf16 46 GB + fp8_ds_mla 26 GB)")  # fmt: skip
    ap.add_argument("--kv-dtype", nargs="+", choices=tuple(ROW_BYTES), default=list(ROW_BYTES),
                    help="KV row formats of the cache-size section (default both)")  # fmt: skip
    add_pool_argument(ap, "the gqa section's pages")
    ap.add_argument("--warm-xqa", action="store_true", help="only JIT-compile FlashInfer XQA's variants")
    add_json_argument(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    only = args.only.split(",")
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        print(f"--only: unknown sections {unknown}; known: {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    if args.pool_gb is not None:
        try:
            gqa_pool_pages(args.pool_gb)
        except ValueError as e:
            print(e, file=sys.stderr)
            return 2
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU", file=sys.stderr)
        return 2
    if args.warm_xqa:
        warm_xqa()
        return 0
    torch.manual_seed(0)
    env = environment()
    print(f"{env['gpu']}, torch {env['versions']['torch']}, Triton {env['versions']['triton']}", flush=True)
    runs = {
        "sparse": lambda: bench_sparse(env, LARGE, args.topk, "sparse-decode", args.cache_rows),
        "sparse-small": lambda: bench_sparse(env, SMALL, args.topk, "small-batch-decode", args.cache_rows),
        "fp8": lambda: bench_fp8(env, FP8, args.topk, args.cache_rows),
        "cache-size": lambda: bench_cache_size(env, CACHE_SIZE, args.topk, args.large_rows, tuple(args.kv_dtype)),
        "gqa": lambda: bench_gqa(env, args.pool_gb),
        "merge": lambda: bench_merge(env),
        "graph": lambda: bench_graph(env),
    }
    records = []
    for name in SECTIONS:
        if name in only:
            records += runs[name]()
            write_json(args.json, records)  # a run cut short keeps what it measured
    print_table(records, "decode")
    return 0


if __name__ == "__main__":
    sys.exit(main())
