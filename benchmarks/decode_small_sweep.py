"""Where small sparse-MLA decode batches spend their time (one GPU): a breakdown and a sweep.

Shapes: top-k 2048 unique random rows of 262,144, bf16, D 576 / Dv 512, 16 heads (and 128),
batch 1 / 2 / 4 / 8. Every time is a CUDA-graph replay under ``triton.testing.do_bench`` (the L2
is flushed between replays, so the KV rows come from HBM, as in a serving step). Prints:

* the floor: a graph of one and of two one-element kernels, and a graph of one kernel that only
  reads the step's KV rows (each token's top-k rows gathered once by ``splits`` programs, summed,
  one float out per program; the fastest of several grids): no design that reads the rows in
  one launch can be faster, and the same kernel, and ``torch.sum``, on as many consecutive rows
  (``--floors-only`` prints just these);
* the kernels of today's graph (torch profiler over replays: kernel device durations, the gap
  between them and the span of a replay);
* the split kernel alone, for split counts 4-64 and ``BLOCK_N`` / ``num_warps`` / ``num_stages``;
* the merge alone (today's row merge and the column merge) for each split count;
* whole steps (split kernel + merge) for every variant; the fastest per batch.

Every variant's output is checked against the fp32 reference before it is timed.

    python benchmarks/decode_small_sweep.py --json small_sweep.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl
import triton.runtime.errors
from graph_timing import profile_graph, replay_us  # beside this script

from shardattn.kernels.triton.lse_merge import (
    launch_lse_merge,
    launch_lse_merge_columns,
    split_partials,
    split_partials_numel,
)
from shardattn.kernels.triton.sparse_mla_decode import launch_split_kernel, sparse_mla_decode_config
from shardattn.ops.lse_merge import lse_merge_reference
from shardattn.ops.sparse_mla import sparse_mla_reference
from shardattn.ops.sparse_mla_decode import run_sparse_mla_decode

ROWS, TOPK, SCALE = 1 << 18, 2048, 576**-0.5
RESULTS: list[dict] = []


def record(kind: str, name: str, us: float, **extra) -> None:
    RESULTS.append({"kind": kind, "name": name, "us": us, **extra})
    tail = " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items())
    print(f"{kind:7s} {name:58s} {us:8.2f} us {tail}", flush=True)


def check(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor, what: str) -> float:
    err = (out.float() - ref_out).abs().max().item()
    lerr = (lse - ref_lse).abs().max().item()
    if not (err < 2e-2 and lerr < 1e-3):
        raise AssertionError(f"{what}: max |out - ref| = {err:.3g}, max |lse - ref| = {lerr:.3g}")
    return err


def floor() -> None:
    x = torch.zeros(1, device="cuda")
    record("floor", "graph of one 1-element kernel", replay_us(lambda: x.add_(1)))
    record("floor", "graph of two dependent 1-element kernels", replay_us(lambda: (x.add_(1), x.mul_(2))))


@triton.jit
def _read_rows_kernel(KV, Rows, Out, stride_kv, K, chunk, BLOCK_N: tl.constexpr):
    """Program (token, split): sum of ``kv[rows[token, split * chunk : ...], :576]`` (bf16 rows)."""
    tok = tl.program_id(0)
    split = tl.program_id(1)
    acc = tl.zeros([BLOCK_N, 512], tl.float32)
    acc_r = tl.zeros([BLOCK_N, 64], tl.float32)
    for n0 in range(split * chunk, split * chunk + chunk, BLOCK_N):
        r = tl.load(Rows + tok * K + n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
        base = KV + r[:, None] * stride_kv
        acc += tl.load(base + tl.arange(0, 512)[None, :]).to(tl.float32)
        acc_r += tl.load(base + 512 + tl.arange(0, 64)[None, :]).to(tl.float32)
    tl.store(Out + tok * tl.num_programs(1) + split, tl.sum(acc) + tl.sum(acc_r))


def read_floor(kv: torch.Tensor, batch: int, consecutive: bool = False) -> None:
    """The fastest graph-replayed launch that only gathers a ``batch``-token step's rows (random
    rows as the decode steps read; ``consecutive``: the same number of rows one after another in
    the cache, the best case a row gather can meet)."""
    if consecutive:
        rows = torch.arange(batch * TOPK, device="cuda", dtype=torch.int32).view(batch, TOPK)
    else:
        rows = torch.stack([torch.randperm(ROWS, device="cuda")[:TOPK] for _ in range(batch)]).int()
    want = kv[rows.long()].float().sum(dim=(1, 2))
    best = None
    for splits in (8, 16, 32, 64, 128):
        for bn, warps in ((16, 4), (32, 4), (64, 4), (64, 8)):
            chunk = TOPK // splits
            if bn > chunk:
                continue
            out = torch.empty(batch, splits, device="cuda")

            def fn(out=out, splits=splits, bn=bn, warps=warps, chunk=chunk):
                _read_rows_kernel[(batch, splits)](kv, rows, out, kv.stride(0), TOPK, chunk, BLOCK_N=bn,
                                                   num_warps=warps)  # fmt: skip

            fn()
            torch.testing.assert_close(out.sum(1), want, rtol=1e-3, atol=1.0)
            us = replay_us(fn)
            if best is None or us < best[0]:
                best = (us, f"{splits} programs per token x {chunk} rows, {bn}-row steps, {warps} warps")
    nbytes = batch * TOPK * 576 * 2
    what = "the same number of consecutive rows" if consecutive else "the step's KV rows"
    record("floor", f"B{batch}: one kernel reading {what} ({best[1]})", best[0],
           tbs=nbytes / (best[0] * 1e-6) / 1e12)  # fmt: skip
    if consecutive:  # torch's own reduction over the same bytes: the library's kernel is not the floor's limit
        block, total = kv[: batch * TOPK], torch.empty((), device="cuda")
        torch.testing.assert_close(block.sum(dtype=torch.float32), want.sum(), rtol=1e-3, atol=4.0)
        us = replay_us(lambda: torch.sum(block, dim=(0, 1), dtype=torch.float32, out=total))
        record("floor", f"B{batch}: torch.sum over the same consecutive rows", us, tbs=nbytes / (us * 1e-6) / 1e12)


def split_variants() -> list[dict]:
    out = [{"BLOCK_N": bn, "num_warps": w, "num_stages": 2} for bn in (32, 64, 128) for w in (4, 8)]
    out += [{"BLOCK_N": bn, "num_warps": 4, "num_stages": st} for bn in (64, 128) for st in (1, 3)]
    return out


def sweep_shape(
    kv: torch.Tensor, kv32: torch.Tensor, heads: int, batch: int, sms: int, full: bool, merges: bool
) -> None:
    q = torch.randn(batch, heads, 576, device="cuda").bfloat16()
    rows = torch.argsort(torch.rand(batch, ROWS, device="cuda"), dim=1)[:, :TOPK].int()
    ref_out, ref_lse = sparse_mla_reference(q.float(), kv32, rows, scale=SCALE)
    out = torch.empty(batch, heads, 512, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(batch, heads, device="cuda")
    ws = torch.empty(split_partials_numel(64, batch, heads, 512), device="cuda")
    tag = f"H{heads} B{batch}"
    default = sparse_mla_decode_config(batch, heads, TOPK, sms)

    def step(**kw):
        return lambda: run_sparse_mla_decode(
            q, kv, rows, scale=SCALE, out=out, lse_out=lse, workspace=ws, kernel="triton", **kw
        )

    # today's step and its kernels
    for label, kw in (
        ("baseline: separate row merge, rows_unique", dict(rows_unique=True, config={"merge": "rows"})),
        ("baseline: dedup sort + kernel + row merge", dict(rows_unique=False, config={"merge": "rows"})),
        ("column merge, rows_unique", dict(rows_unique=True, config={"merge": "columns"})),
    ):
        fn = step(**kw)
        fn()
        err = check(out, lse, ref_out, ref_lse, f"{tag} {label}")
        us = replay_us(fn, rep=50)
        prof = profile_graph(fn)
        record("step", f"{tag} splits={default['num_splits']} {label}", us, max_err=err, **prof)
    if not full:
        return
    seen = set()
    for splits in (4, 8, 16, 32, 64):
        for var in split_variants():
            cfg = sparse_mla_decode_config(batch, heads, TOPK, sms, splits)
            cfg.update(var)
            per_split = -(-TOPK // splits)
            cfg["chunk"] = -(-per_split // cfg["BLOCK_N"]) * cfg["BLOCK_N"]
            cfg["num_splits"] = max(1, -(-TOPK // cfg["chunk"]))
            key = (cfg["num_splits"], var["BLOCK_N"], var["num_warps"], var["num_stages"])
            if key in seen:
                continue
            seen.add(key)
            s = cfg["num_splits"]
            if s > 1:
                po, pl = split_partials(ws, s, batch, heads, 512, q.device)
            else:
                po, pl = out, lse
            name = f"{tag} splits={s} BLOCK_N={var['BLOCK_N']} warps={var['num_warps']} stages={var['num_stages']}"

            def split_only(po=po, pl=pl, cfg=cfg):
                launch_split_kernel(q, kv, rows, None, None, po, pl, out, lse, cfg, SCALE)

            try:
                split_only()
            except triton.runtime.errors.OutOfResources as e:  # e.g. shared memory of deep pipelines
                print(f"skip    {name}: {e}", flush=True)
                continue
            if s > 1:
                m_out, m_lse = lse_merge_reference(po, pl)
            else:
                m_out, m_lse = out, lse
            err = check(m_out, m_lse, ref_out, ref_lse, name)
            record("split", name, replay_us(split_only), max_err=err, num_splits=s, **var)
            for merge in ("columns",):
                fn = step(rows_unique=True, num_splits=s, config={**var, "merge": merge})
                fn()
                err = check(out, lse, ref_out, ref_lse, f"{name} {merge}")
                record("whole", f"{name} merge={merge}", replay_us(fn), max_err=err, num_splits=s, merge=merge, **var)
                if s == 1:
                    break
    # the merge alone, for each split count
    for s in (2, 4, 8, 16, 32) if merges else ():
        po, pl = split_partials(ws, s, batch, heads, 512, q.device)
        po.copy_(torch.randn_like(po))
        pl.copy_(torch.randn_like(pl))
        pl[0, 0] = float("-inf")
        m_out, m_lse = lse_merge_reference(po, pl)
        cases = [("rows block_elems=4096 (today)", lambda po=po, pl=pl: launch_lse_merge(po, pl, out, lse))]
        cases += [
            (
                f"columns block_d={bd} warps={w}",
                lambda bd=bd, w=w, po=po, pl=pl: launch_lse_merge_columns(po, pl, out, lse, block_d=bd, num_warps=w),
            )
            for bd in (64, 128)
            for w in (2, 4)
        ]
        for label, fn in cases:
            fn()
            err = check(out, lse, m_out.float(), m_lse, f"{tag} merge P{s} {label}")
            record("merge", f"{tag} P={s} {label}", replay_us(fn), max_err=err, num_splits=s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="small_sweep.json")
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--floors-only", action="store_true", help="only the floors (no kernel sweep)")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kv = torch.randn(ROWS, 576, device="cuda").bfloat16()
    kv32 = kv.float()
    floor()
    for batch in map(int, args.batches.split(",")):
        read_floor(kv, batch)
        read_floor(kv, batch, consecutive=True)
    if args.floors_only:
        return
    for batch in map(int, args.batches.split(",")):
        sweep_shape(kv, kv32, 16, batch, sms, full=True, merges=batch in (1, 8))
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "results": RESULTS}, f, indent=1)
    for batch in (1, 8):
        sweep_shape(kv, kv32, 128, batch, sms, full=False, merges=False)
    with open(args.json, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "results": RESULTS}, f, indent=1)
    print("\nfastest whole step per shape (us):")
    print("| shape | baseline (row merge) | fastest variant | us | speed-up |")
    print("|---|---|---|---|---|")
    for batch in map(int, args.batches.split(",")):
        tag = f"H16 B{batch} "
        today = next(
            r
            for r in RESULTS
            if r["kind"] == "step" and r["name"].startswith(tag) and "baseline: separate" in r["name"]
        )
        whole = [r for r in RESULTS if r["kind"] == "whole" and r["name"].startswith(tag)]
        best = min(whole, key=lambda r: r["us"])
        name, us = best["name"][len(tag) :], best["us"]
        print(f"| {tag} | {today['us']:.1f} | {name} | {us:.1f} | {today['us'] / us:.2f}x |")


if __name__ == "__main__":
    main()
