"""Union build against the grouped Gluon kernel: old builder, fused builder on unsorted and sorted rows.

One command checks and times everything (one device call)::

    python benchmarks/union_build.py --heads 8 16 32 --tokens 4096 16384 --out benchmarks/out/union_build.json

Per ``T`` (KV 65,536 rows at 4K tokens, 131,072 above; top-k 2048, DSA-like top-k from
:mod:`shardattn.workload` through a shuffled block table, as ``sparse_prefill.py``) and per head
count (``G`` = 8 / 4 / 2 at 8 / 16 / 32 heads, the grouped Gluon kernel's routing):

* **checks** (exact: ``lens`` and every entry below it): the fused builder on unsorted rows and
  on the same rows sorted (``rows_sorted=True``) against the torch reference on edge rows (5 %
  invalid entries anywhere, an empty row, a row listed twice, out-of-range rows, ``topk_length``
  100 / 0 / 1 / 65, a tail group) and on rows up to ``2**24 - 2``; at every timed case, every
  fused build (and sweep config) against the old builder on the benchmark rows;
* **times** (CUDA-event medians, L2 flushed before each run): the sorting builder (``"sort"``), the
  fused builder on unsorted rows (row sort + one launch) and on sorted rows (one launch), the row
  sort alone (keys kernel + ``torch.sort``), the sorted lists alone (the fused kernel at ``G =
  1``) and the grouped Gluon kernel alone; the union share of the step ``union / (union +
  kernel)`` for each builder; the bitmap build on the shared-memory Gluon kernel (``bitmap``, what
  ``auto`` runs on sm_90) and on the Triton kernel (``bitmap_triton``), at ``G`` and at ``G = 1``.
  ``--sweep`` also times fused-kernel launch configs on sorted rows (first ``T`` only),
  ``--bitmap-per-sm`` / ``--bitmap-configs`` the Triton bitmap kernel's, ``--smem-configs`` the
  shared-memory kernel's.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gluon_common import edge_rows
from prefill_inputs import (
    D_R,
    D_V,
    attention_buffers,
    keep_kernels,
    keep_time,
    make_case,
    random_qkv,
    timed,
    union_buffers,
)

from shardattn.kernels.gluon.sparse_mla import launch_gluon_attention
from shardattn.kernels.gluon.union_smem import smem_kernels
from shardattn.kernels.triton.union import sorted_row_keys
from shardattn.kernels.triton.union_bitmap import bitmap_kernels, bitmap_union
from shardattn.kernels.triton.union_fused import fused_kernel, fused_union
from shardattn.kernels.union_layout import MAX_PLAIN_ROW
from shardattn.ops.union import build_union, build_union_reference

#: The ``auto`` builder per G before the fused builder (benchmarks/RESULTS.md, run 4).
OLD_METHOD = {2: "sort", 4: "sort", 8: "sort"}
#: Shared-memory kernel configs timed by ``--smem-configs`` beside the default (2,048 entries a
#: step, 1,024 words counted at once, 8 warps, programs per SM from shared memory and registers),
#: at the case's ``G`` and at ``G = 1``.
SMEM_SWEEP = (
    {"num_warps": 16, "STEP": 4096, "CW": 2048},
    {"num_warps": 16, "STEP": 8192, "CW": 2048},
    {"per_sm": 2},
    {"per_sm": 3},
    {"WW": 2048, "per_sm": 2},
    {"WW": 2048, "per_sm": 3},
    {"WW": 2048, "num_warps": 16, "STEP": 4096, "CW": 2048},
    {"num_warps": 4, "STEP": 1024, "CW": 512, "per_sm": 4},
    {"num_warps": 4, "STEP": 1024, "CW": 1024, "per_sm": 3},
)
#: Launch configs timed by ``--sweep`` beside the default (256 lanes, 4 warps, binary search,
#: serial steps, compaction chunk 2048). Compiled for sm_90a with Triton 3.9, the default takes
#: 141 registers (3 programs of 4 warps per SM), a 1024-key compaction chunk 72, with the
#: windowed merge and 9-ary search 80 (0 spills): the occupancy the latency-bound merge lacks.
SWEEP = (
    {"CCHUNK": 1024},
    {"CCHUNK": 1024, "WAYS": 9, "WINDOW": True},
    {"CCHUNK": 512, "CHUNK": 512, "WAYS": 9, "WINDOW": True},
    {"WAYS": 9, "WINDOW": True},
    {"WAYS": 2, "WINDOW": True},
    {"LANES": 512, "num_warps": 8, "CCHUNK": 1024},
)


def exact(got, want) -> bool:
    (u, n), (ru, rn) = got, want
    prefix = torch.arange(u.shape[1], device=u.device)[None, :] < rn[:, None]
    return bool(torch.equal(n, rn) and torch.equal(u[prefix], ru[prefix]))


def sort_valid(rows: torch.Tensor, seed: int) -> torch.Tensor:
    """Each row ascending, then 5 % of the entries set to -1: valid entries ascending, invalid anywhere."""
    out = torch.sort(rows, dim=1).values
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out[(torch.rand(out.shape, generator=gen) < 0.05).to(out.device)] = -1
    return out


def checks(rows: torch.Tensor, kv_rows: int, topk: int) -> list[dict]:
    res = []
    edge, length = edge_rows(rows[:259], kv_rows, 1)
    sorted_edge = sort_valid(edge, 2)
    gen = torch.Generator(device="cpu").manual_seed(3)
    top = torch.randint(2**24 - 6000, 2**24 + 2, (61, topk), generator=gen, dtype=torch.int32).to(rows.device)
    top[:, ::7] = 2**24 - 2
    for g in (1, 2, 4, 8):
        for name, r, ln, srt in (
            ("edge", edge, length, False),
            ("edge_sorted", sorted_edge, length, True),
            ("top_rows", top, None, False),
            ("top_rows_sorted", torch.sort(top, dim=1).values, None, True),
        ):
            n_kv = 2**24 - 1 if name.startswith("top") else kv_rows
            want = build_union_reference(r, group_size=g, num_kv_rows=n_kv, topk_length=ln)
            for rs in {False, srt}:
                got = build_union(r, group_size=g, num_kv_rows=n_kv, topk_length=ln, method="fused", rows_sorted=rs)
                res.append({"G": g, "rows": name, "rows_sorted": rs, "exact": exact(got, want)})
            for kernel in ("gluon", "triton"):
                got = union_buffers(r.shape[0], r.shape[1], g, r.device)
                bitmap_union(r, ln, n_kv, g, *got, kernel=kernel)
                res.append({"G": g, "rows": name, "method": f"bitmap_{kernel}", "exact": exact(got, want)})
    return res


def time_case(
    heads,
    tokens,
    kv_rows,
    topk,
    reps,
    flush,
    sweep,
    bitmap_sweep=(),
    pool_rows=None,
    bitmap_configs=False,
    smem_sweep=(),
) -> dict:
    g = {8: 8, 16: 4, 32: 2}[heads]
    _, _, _, _, rows, _ = make_case(tokens, kv_rows, topk, "dsa", 0, pool_rows)
    context_rows, kv_rows = kv_rows, pool_rows or kv_rows
    dev = rows.device
    srows = torch.sort(rows, dim=1).values  # invalid (-1) first: allowed anywhere
    q, kv = random_qkv(tokens, heads, kv_rows, 0, dev)
    u, ln = union_buffers(tokens, topk, g, dev)
    u1, l1 = union_buffers(tokens, topk, 1, dev)
    want = build_union(rows, group_size=g, num_kv_rows=kv_rows, method=OLD_METHOD[g])
    single = int(build_union(rows, group_size=1, num_kv_rows=kv_rows)[1].sum())
    builds = {
        "old": lambda: build_union(rows, group_size=g, num_kv_rows=kv_rows, out=(u, ln), method=OLD_METHOD[g]),
        "fused_unsorted": lambda: build_union(rows, group_size=g, num_kv_rows=kv_rows, out=(u, ln), method="fused"),
        "fused_sorted": lambda: build_union(
            srows, group_size=g, num_kv_rows=kv_rows, out=(u, ln), rows_sorted=True, method="fused"
        ),
        "bitmap": lambda: build_union(rows, group_size=g, num_kv_rows=kv_rows, out=(u, ln), method="bitmap"),
        "bitmap_triton": lambda: bitmap_union(rows, None, kv_rows, g, u, ln, kernel="triton"),
    }
    ms, same = {}, {}
    for name, fn in builds.items():
        fn()
        same[name] = exact((u, ln), want)
        ms[name] = timed(fn, flush, reps)
        print(f"   build H={heads} T={tokens} {name}: {ms[name]:.4f} ms exact={same[name]}", flush=True)
    max_row = min(kv_rows - 1, MAX_PLAIN_ROW)
    ms["row_sort"] = timed(lambda: sorted_row_keys(rows, None, kv_rows), flush, reps)
    ms["lists_only"] = timed(lambda: fused_union(srows, None, max_row, 1, u1, l1), flush, reps)
    want1 = build_union(rows, group_size=1, num_kv_rows=kv_rows)
    build_union(rows, group_size=1, num_kv_rows=kv_rows, out=(u1, l1), method="bitmap")
    same["bitmap_g1"] = exact((u1, l1), want1)
    ms["bitmap_g1"] = timed(
        lambda: build_union(rows, group_size=1, num_kv_rows=kv_rows, out=(u1, l1), method="bitmap"), flush, reps
    )
    bitmap_union(rows, None, kv_rows, 1, u1, l1, kernel="triton")
    same["bitmap_g1_triton"] = exact((u1, l1), want1)
    ms["bitmap_g1_triton"] = timed(lambda: bitmap_union(rows, None, kv_rows, 1, u1, l1, kernel="triton"), flush, reps)
    ms["sort_g1"] = timed(
        lambda: build_union(rows, group_size=1, num_kv_rows=kv_rows, out=(u1, l1), method="sort"), flush, reps
    )
    big = 1 << 30  # the sweep lifts the scratch cap: programs per SM as asked
    triton_kw = {"kernel": "triton", "scratch_bytes": big}
    variants = {f"bitmap_{p}per_sm": {"per_sm": p, **triton_kw} for p in bitmap_sweep}
    for p in bitmap_sweep:  # the place phase's packed loads through L2 only (the first version)
        variants[f"bitmap_{p}per_sm_cg"] = {"per_sm": p, **triton_kw, "config": {"PLACE_CG": True}}
    for cfg in smem_sweep:  # the shared-memory kernel's launch configs
        kw = {"kernel": "gluon", "config": cfg}
        variants["smem_" + "_".join(f"{k}{v}" for k, v in cfg.items())] = kw
    if bitmap_configs:
        for cfg in ({"num_warps": 8}, {"BLOCK": 2048}, {"BLOCK": 2048, "num_warps": 8}, {"WCHUNK": 512}):
            variants["bitmap_" + "_".join(f"{k}{v}" for k, v in cfg.items())] = {"config": cfg, "kernel": "triton"}
    runs = [(key, kw, g, u, ln, want) for key, kw in variants.items()]
    runs += [(f"{key}_g1", kw, 1, u1, l1, want1) for key, kw in variants.items() if key.startswith("smem_")]
    for key, kw, gs, ub, lb, wb in runs:
        bitmap_union(rows, None, kv_rows, gs, ub, lb, **kw)
        same[key] = exact((ub, lb), wb)
        ms[key] = timed(
            lambda kw=kw, gs=gs, ub=ub, lb=lb: bitmap_union(rows, None, kv_rows, gs, ub, lb, **kw), flush, reps
        )
        print(f"   sweep H={heads} T={tokens} {key}: {ms[key]:.4f} ms exact={same[key]}", flush=True)
    builds["old"]()
    scale = (D_V + D_R) ** -0.5
    out, lse = attention_buffers(q)
    ms["gluon_grp"] = timed(
        lambda: launch_gluon_attention(q, kv, u, ln, scale=scale, v_dim=D_V, out=out, lse=lse, group_size=g),
        flush, reps,
    )  # fmt: skip
    for cfg in sweep:
        key = "sorted_" + "_".join(f"{k}{int(v)}" for k, v in cfg.items())
        fused_union(srows, None, max_row, g, u, ln, config=cfg)
        same[key] = exact((u, ln), want)
        ms[key] = timed(lambda cfg=cfg: fused_union(srows, None, max_row, g, u, ln, config=cfg), flush, reps)
        print(f"   sweep H={heads} T={tokens} {key}: {ms[key]:.4f} ms exact={same[key]}", flush=True)
    share = {k: round(ms[k] / (ms[k] + ms["gluon_grp"]), 3) for k in builds}
    return {
        "heads": heads, "tokens": tokens, "context": context_rows, "kv_rows": kv_rows, "G": g, "union_ratio":
        round(float(want[1].sum()) * g / max(1, single), 3),
        "ms": {k: round(v, 4) for k, v in ms.items()}, "share": share, "same_as_old": same,
        "x_old": {k: round(ms["old"] / ms[k], 2) for k in builds},
    }  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="also time fused launch configs (sorted rows)")
    ap.add_argument("--check-tokens", type=int, default=4096, help="tokens of the check rows (KV 65,536)")
    ap.add_argument(
        "--bitmap-per-sm", type=int, nargs="*", default=[], help="also time the bitmap builder at these programs per SM"
    )
    ap.add_argument("--pool-rows", type=int, default=None, help="KV cache rows the request's blocks come from")
    ap.add_argument("--no-checks", action="store_true", help="skip the edge-row checks (timed builds still checked)")
    ap.add_argument("--bitmap-configs", action="store_true", help="also time bitmap launch configs (warps, block)")
    ap.add_argument("--smem-configs", action="store_true", help="also time the shared-memory kernel's launch configs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU", file=sys.stderr)
        return 2
    import triton

    print(torch.cuda.get_device_name(), f"torch {torch.__version__} triton {triton.__version__}", flush=True)
    start = time.time()
    _, _, _, _, rows, _ = make_case(args.check_tokens, 65536, args.topk, "dsa", 0)
    results = {"checks": [] if args.no_checks else checks(rows, 65536, args.topk)}
    bad = [c for c in results["checks"] if not c["exact"]]
    print(f"checks: {len(results['checks']) - len(bad)}/{len(results['checks'])} exact "
          f"({time.time() - start:.0f}s)", bad[:8], flush=True)  # fmt: skip
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=rows.device)
    results["times"] = []
    for tokens in args.tokens:
        kv_rows = 65536 if tokens <= 4096 else 131072
        for heads in args.heads:
            sweep = SWEEP if args.sweep and tokens == args.tokens[0] else ()
            r = time_case(
                heads,
                tokens,
                kv_rows,
                args.topk,
                args.reps,
                flush,
                sweep,
                args.bitmap_per_sm,
                args.pool_rows,
                args.bitmap_configs,
                SMEM_SWEEP if args.smem_configs else (),
            )
            keep_time(results, r, args.out)
            bad += [k for k, v in r["same_as_old"].items() if not v]
    kernels = [
        {"n_regs": getattr(k, "n_regs", None), "n_spills": getattr(k, "n_spills", None), "shared": k.metadata.shared,
         "constants": str({n: v for n, v in k.src.constants.items()} if hasattr(k, "src") else "")[:300]}
        for kern in (fused_kernel(), *bitmap_kernels(), *smem_kernels())
        for entry in kern.device_caches.values() for k in entry[0].values()
    ]  # fmt: skip
    keep_kernels(results, kernels, args.out)
    print(f"\n{'H':>3} {'T':>6} {'G':>2} | {'old':>6} {'fused':>6} {'sorted':>6} | {'rowsort':>7} {'lists':>6} | "
          f"{'kernel':>6} | share old / fused / sorted | x old fused / sorted | "
          "bitmap share x fused | triton bitmap | G=1 sort / bitmap / triton bitmap")  # fmt: skip
    for r in results["times"]:
        ms, sh, x = r["ms"], r["share"], r["x_old"]
        print(f"{r['heads']:>3} {r['tokens']:>6} {r['G']:>2} | {ms['old']:>6.3f} {ms['fused_unsorted']:>6.3f} "
              f"{ms['fused_sorted']:>6.3f} | {ms['row_sort']:>7.3f} {ms['lists_only']:>6.3f} | "
              f"{ms['gluon_grp']:>6.3f} | "
              f"{sh['old']:>5.1%} / {sh['fused_unsorted']:>5.1%} / {sh['fused_sorted']:>5.1%} | "
              f"{x['fused_unsorted']:>5.2f} / {x['fused_sorted']:>5.2f} | {ms['bitmap']:>6.3f} {sh['bitmap']:>5.1%} "
              f"{ms['fused_unsorted'] / ms['bitmap']:>5.2f} | {ms['bitmap_triton']:>6.3f} | "
              f"{ms['sort_g1']:.3f} / {ms['bitmap_g1']:.3f} / {ms['bitmap_g1_triton']:.3f}")  # fmt: skip
    print("ALL EXACT" if not bad else f"NOT EXACT: {bad[:8]}", flush=True)
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
