"""Decode benchmarks (one GPU): GQA paged decode (Triton vs FlashInfer XQA), sparse-MLA decode,
LSE merge, and a CUDA-graph-captured decode step vs eager. Prints a table, writes JSON.

Baselines are measured in the same run: a device-to-device copy (bytes read + written) for the
memory-bound kernels, FlashInfer XQA (when importable) for GQA decode.

    python benchmarks/decode.py --json decode.json            # everything
    python benchmarks/decode.py --only gqa,merge               # a subset
    python benchmarks/decode.py --only gluon --sweep           # sparse-MLA decode, Triton vs Gluon
    python benchmarks/decode.py --warm-xqa                     # JIT-compile the XQA variants only
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
from graph_timing import graph_of, profile_graph  # beside this script

from shardattn.kernels import flashinfer_xqa
from shardattn.kernels.triton.lse_merge import launch_lse_merge
from shardattn.kernels.triton.sparse_mla_decode import sparse_mla_decode_config
from shardattn.ops.gqa_decode import gqa_paged_decode
from shardattn.ops.lse_merge import lse_merge
from shardattn.ops.sparse_mla_decode import run_sparse_mla_decode, sparse_mla_decode

RESULTS: list[dict] = []


def bench_ms(fn, warmup: int = 30, rep: int = 200) -> float:
    """Median milliseconds of ``fn`` over CUDA events (after ``warmup`` ms of warm-up)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def graph_ms(fn) -> float:
    """Median milliseconds of ``fn`` replayed from a CUDA graph (kernel time, no host overhead)."""
    return bench_ms(graph_of(fn).replay)


def record(section: str, name: str, ms: float, nbytes: float | None = None, **extra) -> dict:
    row = {"section": section, "name": name, "us": ms * 1e3, **extra}
    if nbytes is not None:
        row["bytes"] = nbytes
        row["TB/s"] = nbytes / (ms * 1e-3) / 1e12
    RESULTS.append(row)
    extras = " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items())
    tbs = f"{row['TB/s']:6.2f} TB/s" if nbytes is not None else " " * 11
    print(f"{section:8s} {name:44s} {row['us']:9.1f} us {tbs} {extras}", flush=True)
    return row


def copy_bandwidth() -> float:
    x = torch.randn(512 << 20, device="cuda", dtype=torch.float32)  # 2 GiB
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x))
    return record("copy", "device copy 2 GiB (read + write)", ms, 2 * x.numel() * 4)["TB/s"]


def gqa_inputs(batch, ctx, q_len, hq=64, hkv=8, d=64, page=32, ragged=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages_per = -(-ctx // page)
    num_pages = batch * pages_per
    k = torch.randn(num_pages, page, hkv, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(num_pages, page, hkv, d, device="cuda", generator=g).bfloat16()
    table = torch.randperm(num_pages, device="cuda", generator=g).view(batch, pages_per).int()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    kw = {}
    if ragged:
        q_lens = torch.randint(1, q_len + 1, (batch,), generator=torch.Generator().manual_seed(seed))
        cu = torch.zeros(batch + 1, dtype=torch.int32)
        cu[1:] = q_lens.cumsum(0)
        kw = {"cu_q_lens": cu.cuda(), "max_q_len": q_len}
        total = int(cu[-1])
    else:
        kw = {"q_len_per_req": q_len}
        total = batch * q_len
    q = torch.randn(total, hq, d, device="cuda", generator=g).bfloat16()
    nbytes = 2 * k.numel() * 2 + 2 * q.numel() * 2  # K and V once, q in, out back
    return (q, k, v, table, lens), kw, nbytes


def bench_gqa(copy_tbs: float, sweep: bool = False) -> None:
    for label, q_len, ragged in [
        ("single token", 1, False),
        ("uniform drafts 4", 4, False),
        ("ragged drafts 1-4", 4, True),
    ]:
        args, kw, nbytes = gqa_inputs(64, 8192, q_len, ragged=ragged)
        ref = None
        times = {}
        for backend in ("triton", "flashinfer"):
            reason = flashinfer_xqa.unavailable_reason(args[0], args[1]) if backend == "flashinfer" else None
            if reason is not None:
                print(f"gqa      {label} on XQA skipped: {reason}", flush=True)
                continue
            out = gqa_paged_decode(*args, backend=backend, **kw)
            if ref is None:
                ref = out
            else:
                err = (out.float() - ref.float()).abs().max().item()
                print(f"gqa      {label}: max |xqa - triton| = {err:.3g}", flush=True)
            ms = graph_ms(lambda b=backend, a=args, k=kw: gqa_paged_decode(*a, backend=b, **k))
            times[backend] = ms
            record(
                "gqa",
                f"B64 L8192 64q/8kv d64 p32 {label} {backend}",
                ms,
                nbytes,
                copy_frac=nbytes / (ms * 1e-3) / 1e12 / copy_tbs,
            )
        if len(times) == 2:
            RESULTS[-1]["triton_over_xqa_speed"] = times["flashinfer"] / times["triton"]
            print(f"gqa      {label}: Triton speed / XQA speed = {times['flashinfer'] / times['triton']:.3f}")


def bench_sparse(copy_tbs: float, sweep: bool = False) -> None:
    r = 1 << 18  # KV rows (256K x 576 bf16 = 302 MB)
    kv = torch.randn(r, 576, device="cuda").bfloat16()
    for heads in (128, 16):
        for batch in (1, 8, 32, 64, 128, 256):
            q = torch.randn(batch, heads, 576, device="cuda").bfloat16()
            rows = torch.stack([torch.randperm(r, device="cuda")[:2048] for _ in range(batch)]).int()
            nbytes = batch * 2048 * 576 * 2 + q.numel() * 2 + batch * heads * (512 * 2 + 4) + rows.numel() * 4
            for unique in (True, False):
                ms = graph_ms(
                    lambda q=q, rows=rows, u=unique: sparse_mla_decode(
                        q, kv, rows, scale=576**-0.5, rows_unique=u, backend="triton"
                    )
                )
                record(
                    "sparse",
                    f"H{heads} B{batch} topk2048 {'rows_unique' if unique else 'dedup'}",
                    ms,
                    nbytes,
                    copy_frac=nbytes / (ms * 1e-3) / 1e12 / copy_tbs,
                )

    if not sweep:
        return
    # calibration of the split heuristic and tile sizes: fixed choices at a few shapes
    for heads, batch in ((128, 8), (128, 64), (128, 256), (16, 8), (16, 64), (16, 256)):
        q = torch.randn(batch, heads, 576, device="cuda").bfloat16()
        rows = torch.stack([torch.randperm(r, device="cuda")[:2048] for _ in range(batch)]).int()
        nbytes = batch * 2048 * 576 * 2
        variants = [(s, bn, w) for s in (1, 2, 4, 8) for bn in (32, 64) for w in ((8,) if heads > 32 else (4, 8))]
        for splits, bn, warps in variants:
            if batch == 256 and splits > 1:
                continue
            ms = graph_ms(
                lambda q=q, rows=rows, c={"BLOCK_N": bn, "num_warps": warps}, s=splits: run_sparse_mla_decode(
                    q, kv, rows, scale=576**-0.5, rows_unique=True, num_splits=s, config=c, kernel="triton"
                )
            )
            record("sweep", f"H{heads} B{batch} splits={splits} BLOCK_N={bn} warps={warps}", ms, nbytes)


def bench_sparse_gluon(copy_tbs: float, sweep: bool = False) -> None:
    """Sparse-MLA decode, the Triton split-KV kernel against the Gluon kernel (sm_90) on the same
    inputs in the same run: heads 128 / 64 (batch 1-256) and 32 (the crossover), top-k 2048 unique random rows of
    262,144, D 576 / Dv 512, bf16, graph replays. Effective TFLOP/s = ``2 B K H (576 + 512)``
    over the time; the Gluon column is the whole Gluon path (row packing, kernel, merge). ``sweep``
    also times the Gluon kernel alone at 128 heads with and without
    adjacent head blocks (``heads_fastest``) on unsorted and sorted rows, and the Gluon path at
    fixed slice counts (calibration of :func:`gluon_decode_plan`)."""
    from dataclasses import replace

    from shardattn.kernels.gluon.sparse_mla import launch_gluon_attention
    from shardattn.kernels.gluon.sparse_mla_decode import gluon_decode_config, gluon_decode_plan
    from shardattn.kernels.triton.split_rows import split_rows
    from shardattn.ops.dispatch import sparse_decode_kernel
    from shardattn.ops.sparse_mla_decode_gluon import sparse_mla_decode_gluon

    kernels = ("gluon",)
    r, k = 1 << 18, 2048
    kv = torch.randn(r, 576, device="cuda").bfloat16()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    table = []
    cases = [(h, b, True) for h in (128, 64) for b in (1, 8, 16, 32, 64, 128, 256)]
    cases += [(32, b, True) for b in (8, 64, 256)] + [(128, b, False) for b in (1, 256)]
    for heads, batch, unique in cases:
        q = torch.randn(batch, heads, 576, device="cuda").bfloat16()
        rows = torch.argsort(torch.rand(batch, r, device="cuda"), dim=1)[:, :k].int()
        nbytes = batch * k * 576 * 2 + q.numel() * 2 + batch * heads * (512 * 2 + 4) + rows.numel() * 4
        flops = 2 * batch * k * heads * (576 + 512)
        routed = sparse_decode_kernel(q, kv, 512)[0]
        out = torch.empty(batch, heads, 512, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(batch, heads, device="cuda")
        times, outs = {}, {}
        for backend in ("triton", *kernels):

            def fn(q=q, rows=rows, b=backend, u=unique, o=out, s=lse):
                if b == "triton":
                    return sparse_mla_decode(q, kv, rows, scale=576**-0.5, rows_unique=u, backend=b)
                return sparse_mla_decode_gluon(
                    q, kv, rows, scale=576**-0.5, v_dim=512, out=o, lse_out=s, num_sms=sms, rows_unique=u
                )

            outs[backend] = fn()[0].float()
            ms = graph_ms(fn)
            times[backend] = ms
            record(
                "gluon",
                f"H{heads} B{batch} topk{k} {'rows_unique' if unique else 'dedup'} {backend}",
                ms,
                nbytes,
                tflops=flops / (ms * 1e-3) / 1e12,
                copy_frac=nbytes / (ms * 1e-3) / 1e12 / copy_tbs,
                rel_diff_vs_triton=((outs[backend] - outs["triton"]).norm() / outs["triton"].norm()).item(),
            )
        splits = gluon_decode_plan(batch, heads, k, sms)["num_splits"]
        RESULTS[-1].update(gluon_splits=splits, routed=routed)
        table.append((heads, batch, unique, times, flops, splits, routed, outs))
    print(f"\nsparse-MLA decode, Triton vs Gluon {', '.join(kernels)} (us; effective TFLOP/s; rel. diff vs Triton):")
    print("| heads | batch | rows | Triton us (TF/s) | " + " | ".join(f"{n} us (TF/s)" for n in kernels)
          + " | " + " | ".join(f"{n} / Triton" for n in kernels)
          + "".join(f" | {n} / {kernels[0]}" for n in kernels[1:]) + " | slices | routed | rel. diff |")  # fmt: skip
    print("|---" * (6 + 2 * len(kernels) + len(kernels) - 1) + "|")
    for h, b, u, times, fl, s, routed, outs in table:
        cells = [f"{times[n] * 1e3:.1f} ({fl / (times[n] * 1e-3) / 1e12:.0f})" for n in ("triton", *kernels)]
        cells += [f"{times['triton'] / times[n]:.2f}x" for n in kernels]
        cells += [f"{times[kernels[0]] / times[n]:.3f}x" for n in kernels[1:]]
        diff = max(((outs[n] - outs["triton"]).norm() / outs["triton"].norm()).item() for n in kernels)
        print(
            f"| {h} | {b} | {'unique' if u else 'dedup'} | " + " | ".join(cells) + f" | {s} | {routed} | {diff:.1e} |"
        )
    if not sweep:
        return
    for batch in (128, 256):  # the kernel alone (one slice), query's head blocks adjacent or not
        q = torch.randn(batch, 128, 576, device="cuda").bfloat16()
        rows = torch.argsort(torch.rand(batch, r, device="cuda"), dim=1)[:, :k].int()
        out = torch.empty(batch, 128, 512, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(batch, 128, device="cuda")
        flops = 2 * batch * k * 128 * (576 + 512)
        for order, rr in (("unsorted", rows), ("sorted", torch.sort(rows, dim=1).values)):
            union, lens = split_rows(rr, num_kv_rows=r, num_splits=1, chunk=k)
            for adjacent in (False, True):
                cfg = replace(gluon_decode_config(128), heads_fastest=adjacent)
                ms = graph_ms(
                    lambda q=q, u=union, n=lens, c=cfg, o=out, s=lse: launch_gluon_attention(
                        q, kv, u, n, scale=576**-0.5, v_dim=512, config=c, out=o, lse=s
                    )
                )
                label = f"gluon kernel H128 B{batch} {order} rows {cfg.label}"
                record("sweep", label, ms, tflops=flops / (ms * 1e-3) / 1e12)
    for heads, batch, slices in ((64, 64, (1, 2, 4)), (64, 16, (2, 4, 8)), (128, 16, (2, 4, 8)), (128, 1, (8, 16, 32))):
        q = torch.randn(batch, heads, 576, device="cuda").bfloat16()
        rows = torch.argsort(torch.rand(batch, r, device="cuda"), dim=1)[:, :k].int()
        flops = 2 * batch * k * heads * (576 + 512)
        for s in slices:
            ms = graph_ms(
                lambda q=q, rows=rows, s=s: run_sparse_mla_decode(
                    q, kv, rows, scale=576**-0.5, rows_unique=True, kernel="gluon", num_splits=s
                )
            )
            record("sweep", f"gluon H{heads} B{batch} slices={s}", ms, tflops=flops / (ms * 1e-3) / 1e12)


def _time_small(c: dict, label: str, kw: dict, section: str = "sparse1") -> tuple[float, object]:
    """Check one sparse-MLA decode variant of case ``c`` (from :func:`bench_sparse_small`) against
    the fp32 reference on NaN-poisoned outputs, then time its graph replays; returns (ms, step)."""
    args = dict(out=c["out"], lse_out=c["lse"], workspace=c["ws"], kernel="triton")
    args.update(kw)
    args["kernel"] = args.pop("backend", args["kernel"])  # the private runner: knobs, no routing

    def fn():
        return run_sparse_mla_decode(c["q"], c["kv"], c["rows"], scale=576**-0.5, **args)

    c["out"].fill_(float("nan"))
    fn()
    ref = c["out"].clone()
    err = (ref.float() - c["ref_out"]).abs().max().item()
    lerr = (c["lse"] - c["ref_lse"]).abs().max().item()
    if not (err < 2e-2 and lerr < 1e-3):
        raise AssertionError(f"{c['tag']} {label}: |out - ref| {err:.3g}, |lse - ref| {lerr:.3g}")
    ms = graph_ms(fn)
    same = torch.equal(c["out"], ref)  # replays agree
    frac = c["nbytes"] / (ms * 1e-3) / 1e12 / c["copy_tbs"]
    record(section, f"{c['tag']} {label}", ms, c["nbytes"], copy_frac=frac, replay_equal=same, max_abs_err=err)
    return ms, fn


def bench_sparse_small(copy_tbs: float, sweep: bool = False) -> None:
    """Small sparse-MLA decode batches (1-16 tokens, 16 / 128 heads): at 16 heads the small-batch
    Gluon kernel (routed there on sm_90) beside the Triton split kernel's routed configuration
    ("Triton" below); the Triton configuration against the
    same run's separate row merge (the baseline), without programmatic dependent
    launch (with and without de-duplication), the column merge on the cost model's split
    count (the previous routing) and the de-duplication sort. Graph replays, preallocated outputs
    and workspace; every variant is checked against the fp32 reference on NaN-poisoned outputs.
    ``sweep``: the floor (a graph of one 1-element kernel) and the device time of the routed
    step's kernels (torch profiler)."""
    from shardattn.kernels.triton.lse_merge import split_partials_numel
    from shardattn.ops.sparse_mla import sparse_mla_reference
    from shardattn.plan.routing import small_decode_heads, small_decode_tiles

    r = 1 << 18
    kv = torch.randn(r, 576, device="cuda").bfloat16()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    table = []
    if sweep:
        x = torch.zeros(1, device="cuda")
        record("sweep", "floor: graph of one 1-element kernel", graph_ms(lambda: x.add_(1)))
    for heads, batch in ((16, 1), (16, 2), (16, 4), (16, 8), (16, 16), (128, 1), (128, 8)):
        q = torch.randn(batch, heads, 576, device="cuda").bfloat16()
        rows = torch.stack([torch.randperm(r, device="cuda")[:2048] for _ in range(batch)]).int()
        ref_out, ref_lse = sparse_mla_reference(q.float(), kv.float(), rows, scale=576**-0.5)
        cfg = sparse_mla_decode_config(batch, heads, 2048, sms)
        cost = cfg["cost_model_splits"]  # the previous routing's split count (32 x 64 rows at 16 heads)
        c = dict(
            q=q, kv=kv, rows=rows, ref_out=ref_out, ref_lse=ref_lse, tag=f"H{heads} B{batch}", copy_tbs=copy_tbs,
            nbytes=batch * 2048 * 576 * 2 + q.numel() * 2 + batch * heads * (512 * 2 + 4) + rows.numel() * 4,
            out=torch.empty(batch, heads, 512, device="cuda", dtype=torch.bfloat16),
            lse=torch.empty(batch, heads, device="cuda"),
            ws=torch.empty(split_partials_numel(64, batch, heads, 512), device="cuda"),
        )  # fmt: skip
        s, bn = cfg["num_splits"], cfg["BLOCK_N"]
        variants = {
            "routed": (f"Triton ({cfg['merge']}, {s} x {cfg['chunk']} rows)", {}),
            "nopdl": ("routed, launched without PDL", dict(config={"pdl": False})),
            "fp32part": ("routed, fp32 partials", dict(config={"partials": "fp32"})),
            "halfpart": ("routed, bf16 partials", dict(config={"partials": "input"})),
            "steps64": ("routed split, 64-row steps of 4 warps", dict(config={"BLOCK_N": 64, "num_warps": 4})),
            "rows": (  # the baseline as it was: fp32 partials, plain launches
                f"row merge, {cost} splits (baseline)",
                dict(num_splits=cost, config={"merge": "rows", "partials": "fp32", "pdl": False}),
            ),
        }
        if heads > 16 or cfg["BLOCK_N"] == 32:  # the split count's own tile: nothing older to compare
            del variants["steps64"]
        if (s, bn) != (cost, 64):
            variants["columns"] = (f"column merge, {cost} splits", dict(num_splits=cost, config={"merge": "columns"}))
        if heads <= 16:  # the small-batch Gluon kernel, routed here on sm_90
            block, splits = small_decode_tiles(batch, 2048, sms)
            group = small_decode_heads(batch, splits, heads, sms)
            label = f"small-batch Gluon ({splits} x {block} rows, {group} heads a program)"
            variants["small"] = (label, dict(backend="gluon_small"))
            variants["small_dedup"] = (
                "small-batch Gluon, de-duplicated first",
                dict(backend="gluon_small", rows_unique=False),
            )
        variants["dedup"] = ("routed, de-duplicated first", dict(rows_unique=False))
        variants["dedup_nopdl"] = ("de-duplicated first, without PDL", dict(rows_unique=False, config={"pdl": False}))
        times = {}
        for key, (label, kw) in variants.items():
            times[key], fn = _time_small(c, label, {"rows_unique": True, **kw})
            if key == "routed" and sweep:
                prof = profile_graph(fn)
                kernels = " + ".join(f"{k[:24]} {u:.2f}" for k, u in zip(prof["kernels"], prof["kernel_us"]))
                record("sweep", f"{c['tag']} routed: device span of a replay", prof["span_us"] * 1e-3, kernels=kernels)
        tile = f"{cfg['BLOCK_N']}-row steps, {cfg['num_warps']} warps"
        table.append((heads, batch, f"{cfg['merge']}, {s} x {cfg['chunk']} ({tile})", times))
    print("\nsparse-MLA decode, small batches (us; Triton = the Triton kernel's routed configuration; speed-up = "
          "baseline / the fastest of Triton and small-batch Gluon; - = not run):")  # fmt: skip
    keys = ("small", "routed", "fp32part", "halfpart", "nopdl", "steps64", "rows", "columns", "small_dedup", "dedup",
            "dedup_nopdl")  # fmt: skip
    print("| heads | batch | Triton configuration | **small-batch Gluon** | **Triton** | Triton, fp32 partials "
          "| Triton, bf16 partials | Triton without PDL | Triton split, 64-row steps of 4 warps "
          "| baseline (row merge) "
          "| column merge, cost-model splits | small-batch Gluon, de-duplicated first "
          "| Triton, de-duplicated first | Triton de-duplicated first, without PDL "
          "| speed-up | small-batch Gluon / Triton | PDL gain (Triton) |")  # fmt: skip
    print("|---" * 17 + "|")
    for h, b, what, times in table:
        cells = " | ".join(f"{times[k] * 1e3:.1f}" if k in times else "-" for k in keys)
        gain = times["nopdl"] / times["routed"]
        best = min(times["routed"], times.get("small", float("inf")))
        small = f"{times['routed'] / times['small']:.2f}x" if "small" in times else "-"
        print(f"| {h} | {b} | {what} | {cells} | {times['rows'] / best:.2f}x | {small} | {gain:.2f}x |")


def bench_merge(copy_tbs: float, sweep: bool = False) -> None:
    t, h, d = 4096, 16, 512
    for p in (2, 4, 8):
        outs = torch.randn(p, t, h, d, device="cuda").bfloat16()
        lses = torch.randn(p, t, h, device="cuda")
        out = torch.empty(t, h, d, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(t, h, device="cuda")
        nbytes = outs.numel() * 2 + lses.numel() * 4 + out.numel() * 2 + lse.numel() * 4
        ms = graph_ms(lambda a=outs, b=lses, c=out, d=lse: lse_merge(a, b, out=c, lse_out=d))
        record("merge", f"P{p} T{t} H{h} D{d} bf16", ms, nbytes, copy_frac=nbytes / (ms * 1e-3) / 1e12 / copy_tbs)
        for elems, warps in ((2048, 4), (8192, 4), (8192, 8), (16384, 8)) if sweep else ():
            ms = graph_ms(
                lambda a=outs, b=lses, c=out, d=lse, e=elems, w=warps: launch_lse_merge(
                    a, b, c, d, block_elems=e, num_warps=w
                )
            )
            record(
                "sweep",
                f"merge P{p} block_elems={elems} warps={warps}",
                ms,
                nbytes,
                copy_frac=nbytes / (ms * 1e-3) / 1e12 / copy_tbs,
            )


def bench_graph() -> None:
    cases = []
    args, kw, _ = gqa_inputs(8, 1024, 1)
    cases.append(
        (
            "gqa B8 L1024 triton (split + merge)",
            lambda: gqa_paged_decode(*args, backend="triton", return_lse=True, **kw),
        )
    )
    kv = torch.randn(1 << 16, 576, device="cuda").bfloat16()
    q = torch.randn(1, 16, 576, device="cuda").bfloat16()
    rows = torch.randperm(1 << 16, device="cuda")[:2048].int()[None]
    cases.append(("sparse-MLA B1 H16 (dedup + kernel + merge)", lambda: sparse_mla_decode(q, kv, rows, scale=0.04)))
    for name, fn in cases:
        eager = bench_ms(fn)
        g = graph_of(fn)
        replay = bench_ms(g.replay)
        record("graph", name + " eager", eager)
        record("graph", name + " graph replay", replay, saving_us=(eager - replay) * 1e3)


def warm_xqa() -> None:
    """Compile the XQA variants the benchmark and the GPU tests use (JIT, once per machine)."""
    t0 = time.time()
    for q_len, ragged in ((1, False), (4, False), (4, True)):
        args, kw, _ = gqa_inputs(2, 256, q_len, ragged=ragged)
        reason = flashinfer_xqa.unavailable_reason(args[0], args[1])
        if reason is not None:
            print("XQA unavailable:", reason)
            return
        gqa_paged_decode(*args, backend="flashinfer", **kw)
        torch.cuda.synchronize()
        print(f"XQA q_len={q_len} ragged={ragged} ready after {time.time() - t0:.0f} s", flush=True)


def save(path: str, copy_tbs: float) -> None:
    with open(path, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "copy_TB/s": copy_tbs, "results": RESULTS}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="decode.json")
    parser.add_argument("--only", default="gqa,sparse,gluon,merge,graph")
    parser.add_argument("--warm-xqa", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="also time fixed tile/split variants")
    args = parser.parse_args()
    if args.warm_xqa:
        warm_xqa()
        return
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    copy_tbs = copy_bandwidth()
    only = set(args.only.split(","))
    for key, fn in (
        ("merge", bench_merge),
        ("sparse", bench_sparse),
        ("gluon", bench_sparse_gluon),
        ("sparse-small", bench_sparse_small),
        ("gqa", bench_gqa),
    ):
        if key in only:
            fn(copy_tbs, args.sweep)
            save(args.json, copy_tbs)
    if "graph" in only:
        bench_graph()
    save(args.json, copy_tbs)
    print("\nsummary (us, TB/s, fraction of copy bandwidth):")
    for row in RESULTS:
        frac = f"{row['copy_frac']:.2f}" if "copy_frac" in row else ""
        tbs = f"{row['TB/s']:.2f}" if "TB/s" in row else ""
        print(f"  {row['section']:7s} {row['name']:48s} {row['us']:9.1f} {tbs:>6s} {frac:>5s}")
    if not math.isfinite(copy_tbs):
        raise SystemExit("copy bandwidth is not finite")


if __name__ == "__main__":
    main()
