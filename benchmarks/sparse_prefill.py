"""Sparse-MLA prefill on one GPU: grouped Triton path vs per-query Triton vs torch gather+bmm.

One command prints a table and writes JSON::

    python benchmarks/sparse_prefill.py --out benchmarks/out/sparse_prefill.json
    python benchmarks/sparse_prefill.py --check    # also verify every path at real shapes first

Per case (heads per rank, tokens T, KV rows R, top-k K, workload): request-local top-k from
:func:`shardattn.workload.synthetic_topk` (``dsa``: calibrated neighbour overlap; ``random``:
the worst case), converted to global rows through a shuffled block table (block 64). Times are
CUDA-event medians over ``--reps`` runs with the L2 flushed (a 256 MiB write) before each run.
Columns: union ratio at the grouped G, union build time and its share of the grouped step,
grouped step (union + kernel), per-query path (row sort/dedupe + kernel), torch gather+bmm
baseline, effective TFLOP/s ``2 * sum(valid topk) * heads * 1088 / time`` and speedups. On an
sm_90 GPU with Gluon, a ``gluon`` line under each row times the Gluon per-query path (same row
sort + :mod:`shardattn.kernels.gluon.sparse_mla`) in the same run.

``--check`` poisons outputs with NaN, runs each path on edge-case rows (invalid entries, an
empty row, duplicates, a tail group) and compares with the fp32 reference on sampled tokens,
the union and top-k conversion kernels exactly with their torch references, and prints the
compiled kernels' registers, spills and whether their PTX holds wgmma.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from shardattn.kernels.gluon.sparse_mla import gluon_config, gluon_unsupported_reason, launch_gluon_attention
from shardattn.kernels.triton.sparse_mla import attention_kernel, launch_attention, tile_config
from shardattn.ops.dispatch import default_group_size
from shardattn.ops.sparse_mla import flops, sparse_mla_reference
from shardattn.ops.topk import convert_topk_reference
from shardattn.ops.union import build_union, build_union_reference
from shardattn.plan.routing import tile_group_size
from shardattn.workload import union_ratio

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from prefill_inputs import (
    BLOCK,
    D_R,
    D_V,
    attention_buffers,
    baseline_gather_bmm,
    make_case,
    random_qkv,
    rel_err,
    save_json,
    timed,
    union_buffers,
)


def check_case(q, kv, rows, g, scale, seed) -> dict:
    """Edge-case rows at real shape: NaN-poisoned outputs, fp32 reference on sampled tokens."""
    t = q.shape[0] - 3  # odd count: a tail group
    q = q[:t]
    rows = rows[:t].clone()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    drop = torch.rand(rows.shape, generator=gen) < 0.05
    rows[drop.to(rows.device)] = -1
    rows[5] = -1  # empty row
    rows[7, :300] = rows[7, 300:600]  # duplicates within a row
    rows[9, -10:] = kv.shape[0] + 5  # out of range
    topk_length = torch.full((t,), rows.shape[1], dtype=torch.int32, device=rows.device)
    topk_length[11] = 100
    res = {}
    ref_u, ref_l = build_union_reference(rows, group_size=g, num_kv_rows=kv.shape[0], topk_length=topk_length)
    u, lens = build_union(rows, group_size=g, num_kv_rows=kv.shape[0], topk_length=topk_length)
    prefix = torch.arange(u.shape[1], device=u.device)[None, :] < ref_l[:, None]  # past lens: unspecified
    res["union_exact"] = bool(torch.equal(lens, ref_l) and torch.equal(u[prefix], ref_u[prefix]))
    sample = torch.cat([torch.tensor([0, 5, 7, 9, 11, t - 1]), torch.randint(0, t, (58,), generator=gen)]).to(q.device)
    ref_o, ref_lse = sparse_mla_reference(
        q[sample], kv, rows[sample], scale=scale, v_dim=D_V, topk_length=topk_length[sample]
    )
    paths = (("grouped", g), ("per_query", 1)) + (
        (("gluon", 1),) if gluon_unsupported_reason(q, kv, D_V) is None else ()
    )
    for name, group in paths:
        uu, ll = build_union(rows, group_size=group, num_kv_rows=kv.shape[0], topk_length=topk_length)
        out = torch.full((t, q.shape[1], D_V), float("nan"), dtype=q.dtype, device=q.device)
        lse = torch.full((t, q.shape[1]), float("nan"), dtype=torch.float32, device=q.device)
        if name == "gluon":
            launch_gluon_attention(q, kv, uu, ll, scale=scale, v_dim=D_V, out=out, lse=lse)
        else:
            cfg = tile_config(q.shape[1], group)
            launch_attention(q, kv, uu, ll, scale=scale, v_dim=D_V, config=cfg, out=out, lse=lse)
        torch.cuda.synchronize()
        written = bool(torch.isfinite(out).all()) and not bool(lse.isnan().any())
        empty_ok = bool((out[5] == 0).all()) and bool(lse[5].isneginf().all())
        fin = torch.isfinite(ref_lse)
        res[name] = {
            "all_written": written,
            "empty_row_ok": empty_ok,
            "out_rel_err": rel_err(out[sample], ref_o),
            "lse_max_abs_err": (lse[sample][fin] - ref_lse[fin]).abs().max().item(),
        }
    return res


def kernel_report(dump: str | None = None) -> list[dict]:
    """Registers, spills, shared memory and wgmma presence of every compiled attention variant.

    ``dump``: a file to write each variant's ttgir dot/alloc lines and PTX mma lines to.
    """
    rep = []
    lines = []
    for entry in attention_kernel().device_caches.values():
        for kern in entry[0].values():
            ptx = kern.asm.get("ptx", "")
            md = kern.metadata
            rep.append(
                {
                    "name": getattr(md, "name", "?"),
                    "num_warps": getattr(md, "num_warps", None),
                    "num_stages": getattr(md, "num_stages", None),
                    "shared": getattr(md, "shared", None),
                    "n_regs": getattr(kern, "n_regs", None),
                    "n_spills": getattr(kern, "n_spills", None),
                    "wgmma_in_ptx": ptx.count("wgmma.mma_async"),
                    "mma_sync_in_ptx": ptx.count("mma.sync"),
                }
            )
            ttgir = kern.asm.get("ttgir", "")
            lines.append(f"=== {rep[-1]}")
            lines += [ln.strip()[:300] for ln in ttgir.splitlines() if "dot" in ln or "local_alloc" in ln]
            lines += [ln.strip() for ln in ptx.splitlines() if "wgmma.mma_async" in ln][:8]
    if dump:
        with open(dump, "w") as f:
            f.write("\n".join(lines))
    return rep


def run_case(heads, tokens, kv_rows, topk, workload, reps, flush, check, seed=0) -> dict:
    dev = torch.device("cuda")
    scale = (D_V + D_R) ** -0.5
    t0 = time.time()
    pos, req, table, seq, rows, counts = make_case(tokens, kv_rows, topk, workload, seed)
    q, kv = random_qkv(tokens, heads, kv_rows, seed, dev)
    g = tile_group_size(heads)  # the grouped column; routing picks default_group_size
    res = {
        "heads": heads,
        "tokens": tokens,
        "kv_rows": kv_rows,
        "topk": topk,
        "workload": workload,
        "G": g,
        "routed_G": default_group_size(heads),
    }
    res["union_ratio"] = union_ratio(rows, g) if g > 1 else 1.0
    res["union_ratio_g2_g4_g8"] = [round(union_ratio(rows, x), 3) for x in (2, 4, 8)]
    if check:
        ref_rows, ref_counts = convert_topk_reference(pos, req, table, block_size=BLOCK, seq_lens=seq)
        res["convert_exact"] = bool(torch.equal(rows, ref_rows) and torch.equal(counts, ref_counts))
        res["check"] = check_case(q, kv, rows, g, scale, seed)
    valid_keys = int(counts.sum())
    fl = flops(valid_keys, heads)
    union, lens = union_buffers(tokens, topk, g, dev)
    u1, l1 = union_buffers(tokens, topk, 1, dev)
    out, lse = attention_buffers(q)
    cfg_g, cfg_1 = tile_config(heads, g), tile_config(heads, 1)

    def union_fn():
        build_union(rows, group_size=g, num_kv_rows=kv_rows, out=(union, lens))

    def kernel_fn():
        launch_attention(q, kv, union, lens, scale=scale, v_dim=D_V, config=cfg_g, out=out, lse=lse)

    def grouped_fn():
        union_fn()
        kernel_fn()

    def sort1_fn():
        build_union(rows, group_size=1, num_kv_rows=kv_rows, out=(u1, l1))

    def perq_kernel_fn():
        launch_attention(q, kv, u1, l1, scale=scale, v_dim=D_V, config=cfg_1, out=out, lse=lse)

    def perq_fn():
        sort1_fn()
        perq_kernel_fn()

    ms = {}
    ms["union"] = timed(union_fn, flush, reps)
    ms["grouped_kernel"] = timed(kernel_fn, flush, reps)
    ms["grouped"] = timed(grouped_fn, flush, reps)
    ms["perq_sort"] = timed(sort1_fn, flush, reps)
    ms["perq_kernel"] = timed(perq_kernel_fn, flush, reps)
    ms["per_query"] = timed(perq_fn, flush, reps)
    if gluon_unsupported_reason(q, kv, D_V) is None:  # the Gluon per-query path (sm_90): same row lists, same run
        cfg_gl = gluon_config(heads)

        def gluon_kernel_fn():
            launch_gluon_attention(q, kv, u1, l1, scale=scale, v_dim=D_V, config=cfg_gl, out=out, lse=lse)

        def gluon_fn():
            sort1_fn()
            gluon_kernel_fn()

        ms["gluon_kernel"] = timed(gluon_kernel_fn, flush, reps)
        ms["gluon"] = timed(gluon_fn, flush, reps)
        res["gluon_config"] = cfg_gl.label
    ms["torch"] = timed(lambda: baseline_gather_bmm(q, kv, rows, scale), flush, max(3, reps // 5))
    res["ms"] = {k: round(v, 4) for k, v in ms.items()}
    res["valid_keys"] = valid_keys
    res["tflops"] = {k: round(fl / (v * 1e-3) / 1e12, 1) for k, v in ms.items() if k not in ("union", "perq_sort")}
    res["union_share"] = round(ms["union"] / ms["grouped"], 3)
    res["speedup_grouped_vs_per_query"] = round(ms["per_query"] / ms["grouped"], 2)
    res["speedup_grouped_vs_torch"] = round(ms["torch"] / ms["grouped"], 2)
    if "gluon" in ms:
        res["speedup_gluon_vs_per_query"] = round(ms["per_query"] / ms["gluon"], 2)
        res["speedup_gluon_vs_torch"] = round(ms["torch"] / ms["gluon"], 2)
    # bytes the grouped kernel gathers (every head block reads its group's union once)
    gathered = float(lens.sum()) * (D_V + D_R) * 2 * math.ceil(heads / cfg_g.block_h)
    res["grouped_gather_TBps"] = round(gathered / (ms["grouped_kernel"] * 1e-3) / 1e12, 2)
    res["wall_s"] = round(time.time() - t0, 1)
    return res


SWEEP = [(64, 8, 2), (32, 8, 2), (64, 4, 2), (32, 4, 2), (32, 8, 3), (16, 4, 3), (32, 4, 3)]


def sweep(heads_list, tokens, kv_rows, topk, reps, flush) -> list[dict]:
    """Kernel-only time of tile variants (BLOCK_N, warps, stages) for the grouped and per-query G."""
    from shardattn.kernels.triton.sparse_mla import TileConfig

    out_rows = []
    for heads in heads_list:
        _, _, _, _, rows, counts = make_case(tokens, kv_rows, topk, "dsa", 0)
        dev = torch.device("cuda")
        q = torch.randn(tokens, heads, D_V + D_R, device=dev).to(torch.bfloat16)
        kv = torch.randn(kv_rows, D_V + D_R, device=dev).to(torch.bfloat16)
        fl = flops(int(counts.sum()), heads)
        for g in sorted({tile_group_size(heads), 1}):
            union, lens = build_union(rows, group_size=g, num_kv_rows=kv_rows)
            base = tile_config(heads, g)
            for bn, warps, stages in SWEEP:
                cfg = TileConfig(g, base.block_h, bn, warps, stages)
                try:
                    t = timed(
                        lambda a=(q, kv, union, lens), cfg=cfg: launch_attention(*a, scale=0.04, v_dim=D_V, config=cfg),
                        flush,
                        reps,
                    )
                except Exception as exc:  # out of shared memory etc.: report, keep sweeping
                    print(f"   sweep H={heads} G={g} {cfg}: failed {type(exc).__name__}", flush=True)
                    continue
                row = {"heads": heads, "G": g, "block_n": bn, "warps": warps, "stages": stages, "ms": round(t, 4)}
                row["tflops"] = round(fl / (t * 1e-3) / 1e12, 1)
                out_rows.append(row)
                print("   sweep:", json.dumps(row), flush=True)
    return out_rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--kv-rows", type=int, default=None, help="default: 65536 for T <= 4096, else 131072")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--workloads", nargs="+", default=["dsa", "random"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--check", action="store_true", help="verify every path at real shapes first")
    ap.add_argument("--out", default=None, help="JSON output path")
    ap.add_argument("--dump", default=None, help="write compiled kernels' ttgir/ptx excerpts here")
    ap.add_argument("--sweep", type=int, nargs="*", default=None, help="heads to sweep tile variants for")
    ap.add_argument("--time-budget", type=float, default=1e9, help="skip remaining cases after this many seconds")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU", file=sys.stderr)
        return 2
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    results = []
    header = (
        f"{'H':>4} {'T':>6} {'R':>7} {'wl':>7} {'G':>2} {'ratio':>5} | {'union':>7} {'share':>5} | "
        f"{'grouped':>8} {'TF/s':>5} | {'perq':>8} {'TF/s':>5} | {'torch':>8} {'TF/s':>5} | "
        f"{'x perq':>6} {'x torch':>7}"
    )
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}", flush=True)
    print(header, flush=True)
    start = time.time()
    if args.sweep:
        results.append({"sweep": sweep(args.sweep, args.tokens[0], 65536, args.topk, args.reps, flush)})
    for tokens in args.tokens:
        kv_rows = args.kv_rows or (65536 if tokens <= 4096 else 131072)
        for workload in args.workloads:
            for heads in args.heads:
                if time.time() - start > args.time_budget:
                    print(f"   skipped H={heads} T={tokens} {workload}: time budget", flush=True)
                    continue
                r = run_case(heads, tokens, kv_rows, args.topk, workload, args.reps, flush, args.check)
                results.append(r)
                ms, tf = r["ms"], r["tflops"]
                print(
                    f"{heads:>4} {tokens:>6} {kv_rows:>7} {workload:>7} {r['G']:>2} {r['union_ratio']:>5.2f} | "
                    f"{ms['union']:>7.3f} {r['union_share']:>5.2f} | "
                    f"{ms['grouped']:>8.3f} {tf['grouped']:>5.0f} | "
                    f"{ms['per_query']:>8.3f} {tf['per_query']:>5.0f} | {ms['torch']:>8.3f} {tf['torch']:>5.0f} | "
                    f"{r['speedup_grouped_vs_per_query']:>6.2f} {r['speedup_grouped_vs_torch']:>7.2f}",
                    flush=True,
                )
                if "gluon" in ms:
                    print(
                        f"   gluon ({r['gluon_config']}): {ms['gluon']:.3f} ms ({tf['gluon']:.0f} TF/s), kernel "
                        f"{ms['gluon_kernel']:.3f} ms ({tf['gluon_kernel']:.0f}); x perq "
                        f"{r['speedup_gluon_vs_per_query']:.2f}, x torch {r['speedup_gluon_vs_torch']:.2f}",
                        flush=True,
                    )
                if args.check:
                    print("   check:", json.dumps({"convert_exact": r["convert_exact"], **r["check"]}), flush=True)
                save_json(args.out, {"device": torch.cuda.get_device_name(), "results": results})
    report = kernel_report(args.dump)
    for k in report:
        print("   kernel:", json.dumps(k), flush=True)
    save_json(args.out, {"device": torch.cuda.get_device_name(), "results": results, "kernels": report})
    return 0


if __name__ == "__main__":
    sys.exit(main())
