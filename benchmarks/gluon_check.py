"""Gluon sparse-MLA prefill on one GPU: check every variant, then time it beside Triton and torch.

One command checks and times everything (one device call)::

    python benchmarks/gluon_check.py --out benchmarks/out/gluon_check.json

1. **Check** (every Gluon tile variant, several head counts): NaN-poisoned outputs, rows with
   invalid entries anywhere, an empty row, duplicates, out-of-range rows, ``topk_length``, sinks,
   a tail (T not a multiple of anything), compared with the fp32 reference; also through the
   public entry point :func:`shardattn.ops.sparse_mla.sparse_mla_attention` (which routes to
   Gluon on sm_90) with and without sinks.
2. **Time** (T = 4K, KV 64K rows, top-k 2048, DSA-like top-k from :mod:`shardattn.workload`, L2
   flushed before each run, CUDA-event medians): per head count, each Gluon variant's kernel,
   the Triton per-query kernel on the same row lists, the row sort they share, the full
   per-query paths (sort + kernel) and the torch gather+bmm baseline; effective TFLOP/s
   ``2 * sum(valid topk) * heads * 1088 / time``.
3. **Report**: registers, spills and shared memory of every compiled Gluon variant.

``--grouped`` checks and times the grouped Gluon kernel instead (one device call)::

    python benchmarks/gluon_check.py --grouped --heads 8 16 32 64 --out benchmarks/out/gluon_grouped.json

* checks: at 8 / 16 / 32 heads (``G`` = 8 / 4 / 2) and 12 heads (padded, ``G = 4``), with and
  without sinks, the grouped Gluon kernel against the fp32 reference on NaN-poisoned outputs
  with the edge rows above plus a whole group with no key and a tail group; head-blocked
  ``[B, T, H/B, ...]`` q / out / lse through both public entries (no copies) at 64 / 128 / 16
  heads and through the grouped Gluon launcher at 16 (``G = 4``) and 8 heads (``G = 8``, one
  head per block); the routed public entry at every head count;
* times (T = 4K, KV 64K rows, top-k 2048, DSA-like top-k, L2 flushed, medians), per head count
  with ``G`` from the routing (:func:`~shardattn.plan.routing.gluon_grouped_group_size`): the
  per-query row sort and the union build at ``G``; Triton per-query, Gluon per-query, Triton
  grouped and Gluon grouped kernels; each step with its sort / union build; the routed entry
  (:func:`~shardattn.ops.sparse_mla_grouped.sparse_mla_grouped_prefill`, ``group_size=None``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gluon_common import check_inputs, kernel_report
from prefill_inputs import (
    D_R,
    D_V,
    attention_buffers,
    baseline_gather_bmm,
    keep_kernels,
    keep_time,
    make_case,
    random_qkv,
    rel_err,
    timed,
    union_buffers,
)

from shardattn.kernels.gluon.sparse_mla import GluonConfig, launch_gluon_attention
from shardattn.kernels.triton.sparse_mla import launch_attention, tile_config
from shardattn.ops.sparse_mla import flops, sparse_mla_attention, sparse_mla_reference
from shardattn.ops.union import build_union

#: The options of the 64-key kernel, one tile a program first (the baseline of every ratio).
VARIANTS = [
    GluonConfig(),
    GluonConfig(heads_fastest=True),
    GluonConfig(early_kv=True),
    GluonConfig(heads_fastest=True, early_kv=True),
    GluonConfig(persistent=True),
    GluonConfig(heads_fastest=True, early_kv=True, persistent=True),
]


def check_variant(heads, cfg, q, kv, rows, length, sinks, scale) -> dict:
    t = q.shape[0]
    u, ln = build_union(rows, group_size=1, num_kv_rows=kv.shape[0], topk_length=length)
    out = torch.full((t, heads, D_V), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((t, heads), float("nan"), dtype=torch.float32, device=q.device)
    launch_gluon_attention(q, kv, u, ln, scale=scale, v_dim=D_V, config=cfg, sinks=sinks, out=out, lse=lse)
    torch.cuda.synchronize()
    ref_o, ref_l = sparse_mla_reference(q, kv, rows, scale=scale, v_dim=D_V, topk_length=length, sinks=sinks)
    fin = torch.isfinite(ref_l)
    empty = ~torch.isfinite(ref_l[:, 0])
    res = {
        "heads": heads,
        "cfg": cfg.label,
        "sinks": sinks is not None,
        "all_written": bool(torch.isfinite(out).all()) and not bool(lse.isnan().any()),
        "out_rel_err": rel_err(out, ref_o),
        "lse_max_abs_err": (lse[fin] - ref_l[fin]).abs().max().item(),
        "lse_inf_match": bool(torch.equal(torch.isneginf(lse), torch.isneginf(ref_l))),
        "empty_rows_zero": bool((out[empty] == 0).all()) if sinks is None else True,
    }
    res["ok"] = (
        res["all_written"] and res["out_rel_err"] < 1e-2 and res["lse_max_abs_err"] < 1e-2 and res["lse_inf_match"]
    ) and res["empty_rows_zero"]
    return res


def check_all(heads_list, kv_rows, topk, seed=0) -> list[dict]:
    dev = torch.device("cuda")
    t = 259
    scale = (D_V + D_R) ** -0.5
    rows, length, gen, kv = check_inputs(t, kv_rows, topk, seed, seed + 1)
    results = []
    for heads in heads_list:
        q = torch.randn(t, heads, D_V + D_R, device=dev, generator=gen).to(torch.bfloat16)
        sinks = torch.randn(heads, device=dev, generator=gen) * 2
        for i, cfg in enumerate(VARIANTS):
            for s in (None, sinks) if i == 0 or cfg.variant == "ws64" else (None,):
                try:
                    r = check_variant(heads, cfg, q, kv, rows, length, s, scale)
                except Exception as exc:  # report and keep checking the others
                    r = {"heads": heads, "cfg": cfg.label, "ok": False, "error": repr(exc)[:400]}
                results.append(r)
                print("   check:", json.dumps(r), flush=True)
        # the public entry point (routes to Gluon on sm_90), with topk_length and sinks
        for s in (None, sinks):
            out, lse = sparse_mla_attention(q, kv, rows, scale=scale, v_dim=D_V, topk_length=length, sinks=s)
            ref_o, ref_l = sparse_mla_reference(q, kv, rows, scale=scale, v_dim=D_V, topk_length=length, sinks=s)
            fin = torch.isfinite(ref_l)
            r = {"heads": heads, "cfg": "public", "sinks": s is not None, "out_rel_err": rel_err(out, ref_o),
                 "lse_max_abs_err": (lse[fin] - ref_l[fin]).abs().max().item()}  # fmt: skip
            r["ok"] = r["out_rel_err"] < 1e-2 and r["lse_max_abs_err"] < 1e-2
            results.append(r)
            print("   check:", json.dumps(r), flush=True)
    return results


def smoke() -> list[dict]:
    """Tiny inputs (5 tokens, 100 keys, 64 heads) through every variant: a hang or crash shows fast."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(3)
    kv = torch.randn(500, D_V + D_R, device=dev, generator=gen).to(torch.bfloat16)
    q = torch.randn(5, 64, D_V + D_R, device=dev, generator=gen).to(torch.bfloat16)
    rows = torch.randint(-1, 500, (5, 100), device=dev, generator=gen, dtype=torch.int32)
    rows[2] = -1
    length = torch.tensor([100, 33, 100, 64, 1], dtype=torch.int32, device=dev)
    out = []
    for cfg in VARIANTS:
        r = check_variant(64, cfg, q, kv, rows, length, None, (D_V + D_R) ** -0.5)
        out.append(r)
        print("   smoke:", json.dumps(r), flush=True)
    return out


def time_case(heads, tokens, kv_rows, topk, reps, flush, variants, seed=0) -> dict:
    dev = torch.device("cuda")
    scale = (D_V + D_R) ** -0.5
    _, _, _, _, rows, counts = make_case(tokens, kv_rows, topk, "dsa", seed)
    q, kv = random_qkv(tokens, heads, kv_rows, seed, dev)
    fl = flops(int(counts.sum()), heads)
    u1, l1 = union_buffers(tokens, topk, 1, dev)
    build_union(rows, group_size=1, num_kv_rows=kv_rows, out=(u1, l1))
    out, lse = attention_buffers(q)
    cfg_t = tile_config(heads, 1)
    ms = {}
    ms["sort"] = timed(lambda: build_union(rows, group_size=1, num_kv_rows=kv_rows, out=(u1, l1)), flush, reps)
    ms["triton_kernel"] = timed(
        lambda: launch_attention(q, kv, u1, l1, scale=scale, v_dim=D_V, config=cfg_t, out=out, lse=lse), flush, reps
    )
    ref_out = out.clone()
    errs = {}
    for cfg in variants:
        name = f"gluon_{cfg.label}"
        try:
            ms[name] = timed(
                lambda cfg=cfg: launch_gluon_attention(
                    q, kv, u1, l1, scale=scale, v_dim=D_V, config=cfg, out=out, lse=lse
                ),
                flush,
                reps,
            )
            errs[name] = round(rel_err(out, ref_out), 5)  # vs the Triton kernel, same inputs
        except Exception as exc:
            print(f"   {name} H={heads}: failed {exc!r}"[:400], flush=True)
    best = min((k for k in ms if k.startswith("gluon")), key=lambda k: ms[k], default=None)
    base = f"gluon_{variants[0].label}"
    x_first = {k: round(ms[base] / v, 3) for k, v in ms.items() if k.startswith("gluon")} if base in ms else {}
    ms["torch"] = timed(lambda: baseline_gather_bmm(q, kv, rows, scale), flush, max(3, reps // 5))
    res = {"heads": heads, "tokens": tokens, "kv_rows": kv_rows, "topk": topk, "valid_keys": int(counts.sum())}
    res["ms"] = {k: round(v, 4) for k, v in ms.items()}
    res["tflops"] = {k: round(fl / (v * 1e-3) / 1e12, 1) for k, v in ms.items() if k != "sort"}
    res["best_gluon"] = best
    res["x_first_variant"] = x_first  # same-run speed-up over the first (baseline) variant
    res["gluon_vs_triton_rel_err"] = errs
    if best:
        res["x_triton_kernel"] = round(ms["triton_kernel"] / ms[best], 2)
        res["x_triton_path"] = round((ms["sort"] + ms["triton_kernel"]) / (ms["sort"] + ms[best]), 2)
        res["x_torch"] = round(ms["torch"] / (ms["sort"] + ms[best]), 2)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, nargs="+", default=[8, 16, 64, 128])
    ap.add_argument("--check-heads", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096])
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variants", default="all", help="'all' or 'best' (first variant only)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--time-budget", type=float, default=1e9)
    ap.add_argument("--smoke", action="store_true", help="tiny check of every variant, then exit (0 = all ok)")
    ap.add_argument("--skip", nargs="*", default=[], help="variant labels to leave out")
    ap.add_argument("--smoke-log", default=None, help="keep only the variants this --smoke log shows ok")
    ap.add_argument("--grouped", action="store_true", help="check and time the grouped Gluon kernel (module doc)")
    args = ap.parse_args(argv)
    VARIANTS[:] = [v for v in VARIANTS if v.label not in args.skip]
    if args.smoke_log:
        ok = set()
        with open(args.smoke_log) as f:
            for line in f:
                if line.strip().startswith("smoke:"):
                    r = json.loads(line.split("smoke:", 1)[1])
                    if r["ok"]:
                        ok.add(r["cfg"])
        print("variants that passed the smoke test:", sorted(ok), flush=True)
        VARIANTS[:] = [v for v in VARIANTS if v.label in ok]
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU", file=sys.stderr)
        return 2
    import triton

    print(torch.cuda.get_device_name(), f"torch {torch.__version__} triton {triton.__version__}", flush=True)
    if args.grouped:
        from gluon_grouped import grouped_main

        return grouped_main(args)
    start = time.time()
    if args.smoke:
        res = smoke()
        return 0 if all(r["ok"] for r in res) else 1
    results = {"checks": check_all(args.check_heads, 65536, args.topk)}
    print(f"checks: {sum(r['ok'] for r in results['checks'])}/{len(results['checks'])} ok "
          f"({time.time() - start:.0f}s)", flush=True)  # fmt: skip
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    variants = VARIANTS if args.variants == "all" else VARIANTS[:1]
    results["times"] = []
    for tokens in args.tokens:
        kv_rows = 65536 if tokens <= 4096 else 131072
        for heads in args.heads:
            if time.time() - start > args.time_budget:
                print(f"   skipped H={heads} T={tokens}: time budget", flush=True)
                continue
            r = time_case(heads, tokens, kv_rows, args.topk, args.reps, flush, variants)
            keep_time(results, r, args.out)
    keep_kernels(results, kernel_report(), args.out)
    print(f"\n{'H':>4} {'T':>6} | {'sort':>6} | {'triton':>7} {'TF/s':>5} | "
          + " ".join(v.label.rjust(13) for v in variants)
          + f" | {'torch':>7} {'TF/s':>5} | {'x trit':>6} {'x torch':>7}")  # fmt: skip
    for r in results["times"]:
        ms, tf = r["ms"], r["tflops"]
        cells = []
        for v in variants:
            k = f"gluon_{v.label}"
            cells.append(f"{ms[k]:>7.3f} {tf[k]:>5.0f}" if k in ms else f"{'-':>13}")
        print(f"{r['heads']:>4} {r['tokens']:>6} | {ms['sort']:>6.3f} | {ms['triton_kernel']:>7.3f} "
              f"{tf['triton_kernel']:>5.0f} | " + " ".join(cells)
              + f" | {ms['torch']:>7.3f} {tf['torch']:>5.0f} | {r.get('x_triton_kernel', 0):>6.2f} "
              f"{r.get('x_torch', 0):>7.2f}")  # fmt: skip
    print(f"speed-up over {variants[0].label}, same run:")
    for r in results["times"]:
        print(
            f"{r['heads']:>4} {r['tokens']:>6} | "
            + " ".join(f"{k[6:]}={v:.3f}" for k, v in r["x_first_variant"].items())
        )
    ok = all(r["ok"] for r in results["checks"])
    print("ALL CHECKS OK" if ok else "SOME CHECKS FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
