"""Grouped Gluon sparse-MLA prefill on one GPU: check the warp-specialised kernel's grouped tiles, then time them.

Run through ``gluon_check.py --grouped`` (one device call)::

    python benchmarks/gluon_check.py --grouped --heads 8 16 32 64 --out benchmarks/out/gluon_grouped.json

* checks: at 8 / 16 / 32 heads (``G`` = 8 / 4 / 2) and 12 heads (padded, ``G = 4``), with and
  without sinks, the grouped Gluon kernel (:data:`GROUPED_VARIANTS`) against the fp32 reference on
  NaN-poisoned outputs with invalid entries anywhere, an empty row, a row listed twice, out-of-range
  rows, ``topk_length``, a whole group with no key and a tail group; head-blocked ``[B, T, H/B,
  ...]`` q / out / lse through both public entries (no copies) at 64 / 128 / 16 heads and through
  the grouped Gluon launcher at 16 (``G = 4``) and 8 heads (``G = 8``, one head per block); the
  routed public entry at every head count;
* times (T = 4K by default, KV 64K rows (128K from 16K tokens), top-k 2048, DSA-like top-k, L2
  flushed, medians), per head count with ``G`` from the routing
  (:func:`~shardattn.plan.routing.gluon_grouped_group_size`): the per-query row sort and the union
  build at ``G`` (unsorted rows, and the sorted-input fast path on the same rows sorted); Triton
  per-query, Gluon per-query, Triton grouped and each grouped Gluon kernel; each step with its sort
  / union build; the routed entry
  (:func:`~shardattn.ops.sparse_mla_grouped.sparse_mla_grouped_prefill`, ``group_size=None``).
"""

from __future__ import annotations

import json
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gluon_common import check_inputs, compare, kernel_report
from prefill_inputs import (
    D_R,
    D_V,
    attention_buffers,
    keep_kernels,
    keep_time,
    make_case,
    random_qkv,
    rel_err,
    timed,
    union_buffers,
)

from shardattn.kernels.gluon.sparse_mla import GROUPED_CONFIG, launch_gluon_attention
from shardattn.kernels.triton.sparse_mla import launch_attention, tile_config
from shardattn.ops.dispatch import prefill_path
from shardattn.ops.sparse_mla import flops, sparse_mla_attention
from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill
from shardattn.ops.union import build_union
from shardattn.plan.routing import gluon_grouped_group_size, tile_group_size

#: The grouped Gluon kernels checked and timed, by the column name of their timings.
GROUPED_VARIANTS = {"gluon_grp": GROUPED_CONFIG}


def check_grouped(heads_g, kv_rows, topk, seed=0) -> list[dict]:
    """Grouped Gluon kernel vs the fp32 reference (edge rows, a keyless group, a tail group)."""
    dev = torch.device("cuda")
    t = 259
    scale = (D_V + D_R) ** -0.5
    rows, length, gen, kv = check_inputs(t, kv_rows, topk, seed, seed + 2)
    rows[16:24] = -1  # a whole group (G <= 8) with no key
    results = []
    for heads, g in heads_g:
        q = torch.randn(t, heads, D_V + D_R, device=dev, generator=gen).to(torch.bfloat16)
        sinks = torch.randn(heads, device=dev, generator=gen) * 2
        u, ln = build_union(rows, group_size=g, num_kv_rows=kv_rows, topk_length=length)
        for (name, cfg), s in ((v, s) for v in GROUPED_VARIANTS.items() for s in (None, sinks)):
            out = torch.full((t, heads, D_V), float("nan"), dtype=q.dtype, device=dev)
            lse = torch.full((t, heads), float("nan"), dtype=torch.float32, device=dev)
            try:
                launch_gluon_attention(
                    q, kv, u, ln, scale=scale, v_dim=D_V, sinks=s, out=out, lse=lse, group_size=g, config=cfg
                )
                torch.cuda.synchronize()
                r = compare(out, lse, q, kv, rows, length, s, scale)
                r["keyless_group_zero"] = bool((out[16:24] == 0).all())
                r["ok"] = r["ok"] and r["keyless_group_zero"]
            except Exception as exc:
                r = {"ok": False, "error": repr(exc)[:400]}
            r.update(heads=heads, cfg=f"{name}_{cfg.label}_G{g}", sinks=s is not None)
            results.append(r)
            print("   check:", json.dumps(r), flush=True)
        # the public entries as routed (default G), with topk_length and sinks
        path = prefill_path(q, kv, v_dim=D_V)
        o, ls = sparse_mla_grouped_prefill(q, kv, rows, scale=scale, v_dim=D_V, topk_length=length, sinks=sinks)
        r = compare(o, ls, q, kv, rows, length, sinks, scale)
        r.update(heads=heads, cfg=f"routed_{path.backend}_G{path.group_size}", sinks=True)
        results.append(r)
        print("   check:", json.dumps(r), flush=True)
    return results


def check_head_blocked(kv_rows, topk, seed=0) -> list[dict]:
    """q / out / lse as head-blocked ``[B, T, H/B, ...]`` buffers through the public entries."""
    dev = torch.device("cuda")
    t = 131
    scale = (D_V + D_R) ** -0.5
    rows, length, gen, kv = check_inputs(t, kv_rows, topk, seed, seed + 3)
    results = []
    cases = ((64, 4, "attention"), (128, 8, "grouped"), (16, 2, "grouped"), (16, 2, "G4"), (8, 8, "G8"))
    for heads, blocks, entry in cases:
        q = torch.randn(t, heads, D_V + D_R, device=dev, generator=gen).to(torch.bfloat16)
        sinks = torch.randn(heads, device=dev, generator=gen)
        hb = heads // blocks
        q_blk = q.unflatten(1, (blocks, hb)).movedim(1, 0).contiguous()
        out = torch.full((blocks, t, hb, D_V), float("nan"), dtype=q.dtype, device=dev)
        lse = torch.full((blocks, t, hb), float("nan"), dtype=torch.float32, device=dev)
        if entry.startswith("G"):  # the grouped Gluon launcher itself
            g = int(entry[1:])
            u, ln = build_union(rows, group_size=g, num_kv_rows=kv_rows, topk_length=length)
            o, ls = launch_gluon_attention(
                q_blk, kv, u, ln, scale=scale, v_dim=D_V, sinks=sinks, out=out, lse=lse, group_size=g
            )
            name = f"head_blocked_B{blocks}_gluon_G{g}"
        else:
            fn = sparse_mla_attention if entry == "attention" else sparse_mla_grouped_prefill
            path = prefill_path(q, kv, v_dim=D_V)
            o, ls = fn(q_blk, kv, rows, scale=scale, v_dim=D_V, topk_length=length, sinks=sinks, out=out, lse_out=lse)
            name = f"head_blocked_B{blocks}_{entry}_{path.backend}_G{path.group_size}"
        torch.cuda.synchronize()
        r = compare(out.movedim(0, 1).flatten(1, 2), lse.movedim(0, 1).flatten(1, 2), q, kv, rows, length, sinks, scale)
        r["in_place"] = o is out and ls is lse
        r["ok"] = r["ok"] and r["in_place"]
        r.update(heads=heads, cfg=name, sinks=True)
        results.append(r)
        print("   check:", json.dumps(r), flush=True)
    return results


def time_grouped(heads, tokens, kv_rows, topk, reps, flush, seed=0) -> dict:
    """Per-query and grouped, Triton and Gluon, at ``G`` from the routing (same inputs, same run)."""
    dev = torch.device("cuda")
    scale = (D_V + D_R) ** -0.5
    _, _, _, _, rows, counts = make_case(tokens, kv_rows, topk, "dsa", seed)
    q, kv = random_qkv(tokens, heads, kv_rows, seed, dev)
    fl = flops(int(counts.sum()), heads)
    g = gluon_grouped_group_size(heads) or tile_group_size(heads)
    u1, l1 = union_buffers(tokens, topk, 1, dev)
    build_union(rows, group_size=1, num_kv_rows=kv_rows, out=(u1, l1))
    out, lse = attention_buffers(q)
    ms = {"sort": timed(lambda: build_union(rows, group_size=1, num_kv_rows=kv_rows, out=(u1, l1)), flush, reps)}
    cfg1 = tile_config(heads, 1)
    ms["triton_pq"] = timed(
        lambda: launch_attention(q, kv, u1, l1, scale=scale, v_dim=D_V, config=cfg1, out=out, lse=lse), flush, reps
    )
    ref = out.clone()
    errs = {}
    ms["gluon_pq"] = timed(lambda: launch_gluon_attention(q, kv, u1, l1, scale=scale, v_dim=D_V, out=out, lse=lse),
                           flush, reps)  # fmt: skip
    errs["gluon_pq"] = rel_err(out, ref)
    res = {"heads": heads, "tokens": tokens, "kv_rows": kv_rows, "topk": topk, "G": g, "valid_keys": int(counts.sum())}
    if g > 1:
        ug, lg = union_buffers(tokens, topk, g, dev)
        build_union(rows, group_size=g, num_kv_rows=kv_rows, out=(ug, lg))
        res["union_ratio"] = round(int(lg.sum()) * g / max(1, int(l1.sum())), 3)
        ms["union"] = timed(lambda: build_union(rows, group_size=g, num_kv_rows=kv_rows, out=(ug, lg)), flush, reps)
        rows_sorted = torch.sort(rows, dim=1).values  # the indexer's top-k as it would arrive sorted
        ms["union_sorted"] = timed(
            lambda: build_union(rows_sorted, group_size=g, num_kv_rows=kv_rows, out=(ug, lg), rows_sorted=True),
            flush, reps,
        )  # fmt: skip
        build_union(rows, group_size=g, num_kv_rows=kv_rows, out=(ug, lg))
        cfg_g = tile_config(heads, g)
        ms["triton_grp"] = timed(
            lambda: launch_attention(q, kv, ug, lg, scale=scale, v_dim=D_V, config=cfg_g, out=out, lse=lse),
            flush, reps,
        )  # fmt: skip
        errs["triton_grp"] = rel_err(out, ref)
        for name, cfg in GROUPED_VARIANTS.items():
            ms[name] = timed(
                lambda c=cfg: launch_gluon_attention(
                    q, kv, ug, lg, scale=scale, v_dim=D_V, out=out, lse=lse, group_size=g, config=c
                ),
                flush, reps,
            )  # fmt: skip
            errs[name] = rel_err(out, ref)
    path = prefill_path(q, kv, v_dim=D_V)
    res["routed"] = f"{path.backend} G={path.group_size}"
    res["routed_reason"] = path.reason
    ms["routed"] = timed(lambda: sparse_mla_grouped_prefill(q, kv, rows, scale=scale, v_dim=D_V), flush, reps)
    steps = {"triton_pq": ms["sort"] + ms["triton_pq"], "gluon_pq": ms["sort"] + ms["gluon_pq"]}
    if g > 1:
        steps["triton_grp"] = ms["union"] + ms["triton_grp"]
        for name in GROUPED_VARIANTS:
            steps[name] = ms["union"] + ms[name]
            steps[f"{name}_sorted"] = ms["union_sorted"] + ms[name]
        res["union_share_of_gluon_grp"] = round(ms["union"] / steps["gluon_grp"], 3)
        res["sorted_union_share_of_gluon_grp"] = round(ms["union_sorted"] / steps["gluon_grp_sorted"], 3)
    steps["routed"] = ms["routed"]
    res["ms"] = {k: round(v, 4) for k, v in ms.items()}
    res["step_ms"] = {k: round(v, 4) for k, v in steps.items()}
    res["kernel_tflops"] = {
        k: round(fl / (v * 1e-3) / 1e12, 1) for k, v in ms.items() if k not in ("sort", "union", "union_sorted")
    }
    res["step_tflops"] = {k: round(fl / (v * 1e-3) / 1e12, 1) for k, v in steps.items()}
    res["rel_err_vs_triton_pq"] = {k: round(v, 5) for k, v in errs.items()}
    best_triton = min(v for k, v in steps.items() if k.startswith("triton"))
    res["routed_x_best_triton_step"] = round(best_triton / steps["routed"], 2)
    if g > 1:
        res["gluon_grp_x_triton_grp_step"] = round(steps["triton_grp"] / steps["gluon_grp"], 2)
        res["gluon_grp_x_best_other_step"] = round(
            min(v for k, v in steps.items() if not k.startswith("gluon") and k != "routed") / steps["gluon_grp"], 2
        )
    return res


def grouped_main(args) -> int:
    start = time.time()
    heads_g = [(8, 8), (16, 4), (32, 2), (12, 4)]
    kv_rows = 65536
    results = {"checks": check_grouped(heads_g, kv_rows, args.topk) + check_head_blocked(kv_rows, args.topk)}
    n_ok = sum(r["ok"] for r in results["checks"])
    print(f"checks: {n_ok}/{len(results['checks'])} ok ({time.time() - start:.0f}s)", flush=True)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    results["times"] = []
    for tokens in args.tokens:
        for heads in args.heads:
            r = time_grouped(heads, tokens, kv_rows if tokens < 16384 else 2 * kv_rows, args.topk, args.reps, flush)
            keep_time(results, r, args.out)
    keep_kernels(results, kernel_report(), args.out)
    cols = ("triton_pq", "gluon_pq", "triton_grp", "gluon_grp", "gluon_grp_sorted", "routed")
    print("\nms (effective TF/s) per step: per-query = row sort + kernel, grouped = union build + kernel")
    print(f"{'H':>4} {'T':>5} {'G':>2} {'ratio':>5} | {'sort':>6} {'union':>6} | "
          + " | ".join(c.rjust(14) for c in cols) + " | grp G / grp T | routed / best T | routed")  # fmt: skip
    for r in results["times"]:
        ms, st, tf = r["ms"], r["step_ms"], r["step_tflops"]
        cells = [f"{st[c]:>7.3f} ({tf[c]:>4.0f})" if c in st else f"{'-':>14}" for c in cols]
        print(f"{r['heads']:>4} {r['tokens']:>5} {r['G']:>2} {r.get('union_ratio', 1.0):>5.2f} | {ms['sort']:>6.3f} "
              f"{ms.get('union', 0):>6.3f} | " + " | ".join(cells)
              + f" | {r.get('gluon_grp_x_triton_grp_step', 0):>13.2f} | {r['routed_x_best_triton_step']:>15.2f} | "
              f"{r['routed']}")  # fmt: skip
    print("kernel only (TF/s):")
    for r in results["times"]:
        print(f"{r['heads']:>4} " + " ".join(f"{k}={v}" for k, v in r["kernel_tflops"].items()))
    ok = n_ok == len(results["checks"])
    print("ALL CHECKS OK" if ok else "SOME CHECKS FAILED", flush=True)
    return 0 if ok else 1
