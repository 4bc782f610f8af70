"""GQA prefill on one GPU: the library's op and its head-TP step against FA4 called directly.

Every row times, on the same tensors, graph-free (CUDA events around each of ``--iters``
back-to-back calls, the median, after ``--warmup`` calls that include FA4's compilation):

* ``fa4``: ``flash_attn.cute.interface.flash_attn_varlen_func`` as a caller would use it (no LSE;
  a cached prefix read through ``page_table`` from a cache that also holds the new keys);
* ``op``: :func:`shardattn.ops.gqa_prefill.gqa_prefill` (LSE returned; the prefix read from the
  paged cache, the new keys contiguous);
* ``step``: :func:`shardattn.parallel.gqa_head_tp.gqa_prefill_head_tp` on a one-rank group, given
  the heads one rank of a TP group holds (``--tp``: 64 / 8 heads at TP 1, 8 / 1 at TP 8; every rank
  of a head-TP step runs this same local call);
* ``runtime``: ``Runtime.prefill`` of a one-rank ``headtp`` Runtime with the same rank shapes, as an
  engine calls it: planned once (the plan reused by every call, as by an engine's layers), no LSE
  (``PrefillOptions(return_lse=False)``), the new keys already in the paged cache when there is a
  prefix (``kv_new=None``: one paged call, FA4 direct's form), else given. After the plan's first
  call its FA4 calls launch FA4's compiled kernel directly where the fast launch's guard passes
  (``shardattn.kernels.fa4_launch``; the printed route says whether it does, and each row how many
  of its calls did).

Each row also reports the host time of one call (``host ms``: wall time of issuing the timed calls,
divided by their number): a row whose host time reaches its GPU time is host-bound. The target
of the Runtime's step: ``runtime/fa4 <= 1.05`` at 4x8K and 16x2K, TP 1 and TP 8.

Before timing, each row checks the op against the torch reference (bf16 within 2e-2); it also
reports the op's largest difference from FA4 called directly, and checks the step against the op
(bit for bit) and the Runtime against the op. Records (``--json``, ``benchmarks/records.py``,
benchmark ``gqa-prefill``): the op and the step, each against FA4 called directly in the same run.

The cases with a cached prefix read it from a paged cache of exactly the requests' pages (in
shuffled order); ``--pool-gb G`` places those pages at scattered page ids of a pool of ``G`` GB of
the rank's K and V pages (``kv_pool.place_pages``: one pool for each TP size, its pages that rank's
shape), and those cases' records name ``pool_gb``.

    python benchmarks/gqa_prefill.py --json gqa_prefill.json
    python benchmarks/gqa_prefill.py --pool-gb 40 --json gqa_prefill_pool40.json   # a 40 GB pool
    python benchmarks/gqa_prefill.py --device cpu --iters 1   # dry run on tiny shapes (no FA4, no GPU)
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_pool import add_pool_argument, place_pages, pool_config, pool_pages
from records import add_device_argument, add_json_argument, environment, lacks_gpu, print_table, record, write_json

from shardattn.kernels import fa4
from shardattn.ops.gqa_prefill import gqa_prefill, gqa_prefill_route
from shardattn.parallel.gqa_head_tp import gqa_prefill_head_tp
from shardattn.plan.spec import ModelSpec
from shardattn.runtime.options import PrefillOptions
from shardattn.runtime.runtime import Runtime


@dataclass(frozen=True)
class Case:
    name: str
    requests: int
    new: int
    cached: int = 0
    window_left: int = -1


GPU_CASES = [
    Case("4x8K", 4, 8192),
    Case("16x2K", 16, 2048),
    Case("4x8K window 128", 4, 8192, window_left=128),
    Case("4x(4K new on 4K cached)", 4, 4096, cached=4096),
]
CPU_CASES = [Case("2x48", 2, 48), Case("2x48 window 5", 2, 48, window_left=5), Case("2x(24 on 40)", 2, 24, 40)]


def median_ms(fn: Callable[[], object], warmup: int, iters: int, cuda: bool) -> tuple[float, float]:
    """``(median ms, host ms)`` of ``fn``: on a GPU, CUDA events around each of ``iters`` back-to-back
    calls (no synchronisation between them, so host work overlaps the device as in a forward pass),
    and the wall time of issuing them divided by ``iters``; on the CPU, wall time of each call (both)."""
    for _ in range(warmup):
        fn()
    if not cuda:
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times), statistics.median(times)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    t0 = time.perf_counter()
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    host = (time.perf_counter() - t0) * 1e3 / iters
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)), host


def make_inputs(
    case: Case, heads: int, kv_heads: int, dim: int, page: int, device: str, dtype: torch.dtype,
    pool_gb: float | None = None,
) -> dict:  # fmt: skip
    """New tokens' q / k / v, and a paged cache holding every request's cached and new keys (with
    ``pool_gb``: its pages at scattered ids of a pool of that many GB, the same values)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    b, n, c = case.requests, case.new, case.cached
    total = b * n

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    x = {"q": rand(total, heads, dim), "k": rand(total, kv_heads, dim), "v": rand(total, kv_heads, dim)}
    x["cu"] = torch.arange(b + 1, dtype=torch.int32, device=device) * n
    x["sinks"] = torch.randn(heads, generator=g).to(device)
    pages = -(-(c + n) // page)
    x["table"] = torch.randperm(b * pages, generator=g).view(b, pages).to(device=device, dtype=torch.int32)
    if c:
        shape = (b * pages, page, kv_heads, dim)
        (x["k_cache"], x["v_cache"]), x["table"] = place_pages((rand(*shape), rand(*shape)), x["table"], pool_gb)
        for name, new in (("k_cache", x["k"]), ("v_cache", x["v"])):  # the cache also holds the new keys
            flat = x[name].view(-1, kv_heads, dim)
            pos = torch.arange(c, c + n, device=device)
            for r in range(b):
                rows = x["table"][r, pos // page].long() * page + pos % page
                flat[rows] = new[r * n : (r + 1) * n]
        x["prefix_lens"] = torch.full((b,), c, dtype=torch.int32, device=device)
    return x


def fa4_direct(x: dict, case: Case, scale: float) -> Callable[[], torch.Tensor]:
    fn = fa4.get_fa4()
    window = (case.window_left if case.window_left >= 0 else None, None)
    if case.cached:
        seqused = torch.full((case.requests,), case.cached + case.new, dtype=torch.int32, device=x["q"].device)
        return lambda: fn(
            x["q"], x["k_cache"], x["v_cache"], cu_seqlens_q=x["cu"], seqused_k=seqused, page_table=x["table"],
            max_seqlen_q=case.new, softmax_scale=scale, causal=True, window_size=window, learnable_sink=x["sinks"],
        )[0]  # fmt: skip
    return lambda: fn(
        x["q"], x["k"], x["v"], cu_seqlens_q=x["cu"], cu_seqlens_k=x["cu"], max_seqlen_q=case.new,
        max_seqlen_k=case.new, softmax_scale=scale, causal=True, window_size=window, learnable_sink=x["sinks"],
    )[0]  # fmt: skip


def flops(case: Case, heads: int, dim: int) -> float:
    """``4 * D * H`` per visible (query, key) pair (Q K^T and P V)."""
    pairs = 0
    for j in range(case.new):
        p = case.cached + j
        lo = max(0, p - case.window_left) if case.window_left >= 0 else 0
        pairs += p + 1 - lo
    return 4.0 * dim * heads * pairs * case.requests


def run_case(case: Case, args: argparse.Namespace, group: dist.ProcessGroup, tp: int) -> dict:
    heads, kv_heads = args.heads // tp, max(1, args.kv_heads // tp)
    device = args.device
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x = make_inputs(case, heads, kv_heads, args.dim, args.page, device, dtype, args.pool_gb)
    scale = args.dim**-0.5
    prefix = {}
    if case.cached:
        prefix = {n: x[n] for n in ("k_cache", "v_cache", "prefix_lens")} | {"block_table": x["table"]}
    common = dict(sinks=x["sinks"], window_left=case.window_left, scale=scale, **prefix)

    def op() -> torch.Tensor:
        return gqa_prefill(x["q"], x["k"], x["v"], x["cu"], return_lse=True, **common)[0]

    def step() -> torch.Tensor:  # one rank's shapes of a TP group, on a one-rank group
        return gqa_prefill_head_tp(x["q"], x["k"], x["v"], x["cu"], group, num_kv_heads=kv_heads, **common)

    spec = ModelSpec("gqa", heads, kv_heads, args.dim, args.dim, 0, args.page, has_sinks=True,
                     dtype=str(dtype).replace("torch.", ""), softmax_scale=scale)  # fmt: skip
    rt = Runtime(spec, group, mode="headtp", max_batched_tokens=x["q"].shape[0], device=device,
                 prefill_options=PrefillOptions(return_lse=False))  # fmt: skip
    lens = [case.new] * case.requests
    plan = rt.plan_prefill(lens, [case.cached] * case.requests)
    if case.cached:  # the engine's form: the new keys are in the cache already
        rt_args = dict(kv_new=None, block_table=x["table"])
        rt_cache = (x["k_cache"], x["v_cache"])
    else:
        rt_args, rt_cache = dict(kv_new=(x["k"], x["v"])), None

    def runtime() -> torch.Tensor:
        return rt.prefill(x["q"], rt_cache, plan=plan, sinks=x["sinks"], window_left=case.window_left,
                          check=False, **rt_args)[0]  # fmt: skip

    cuda = device == "cuda"
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    # checked before anything is timed: the routed op (FA4 on a GPU) against the torch reference
    want = gqa_prefill(x["q"], x["k"], x["v"], x["cu"], return_lse=True, backend="reference", **common)[0]
    err = float((op().float() - want.float()).abs().max())
    if not err <= tol:
        raise RuntimeError(f"{case.name} at TP {tp}: the op differs from the torch reference by {err:.2e}")
    route = gqa_prefill_route(x["q"], x["k"])
    row = {
        "case": case.name, "tp": tp, "heads": heads, "kv_heads": kv_heads, "head_dim": args.dim, "page": args.page,
        "route": route.path, "route_reason": route.reason, "pool_gb": args.pool_gb if case.cached else None,
    }  # fmt: skip
    row["op_ms"], row["op_host_ms"] = median_ms(op, args.warmup, args.iters, cuda)
    row["step_ms"], row["step_host_ms"] = median_ms(step, args.warmup, args.iters, cuda)
    row["runtime_ms"], row["runtime_host_ms"] = median_ms(runtime, args.warmup, args.iters, cuda)
    row["runtime_route"] = rt.gqa_prefill_route.reason
    row["runtime_direct_launches"] = sum(f.fast_calls for f in plan.gqa.launches.forms)
    row["runtime_calls"] = args.warmup + args.iters
    ok, why = fa4.fa4_supports(x["q"], x["k"])
    if ok:
        direct = fa4_direct(x, case, scale)
        row["fa4_ms"], row["fa4_host_ms"] = median_ms(direct, args.warmup, args.iters, cuda)
        row["op_vs_fa4_max_abs"] = float((op().float() - direct().float()).abs().max())
        row["runtime_vs_fa4_max_abs"] = float((runtime().float() - direct().float()).abs().max())
        row["op/fa4"] = row["op_ms"] / row["fa4_ms"]
        row["step/fa4"] = row["step_ms"] / row["fa4_ms"]
        row["runtime/fa4"] = row["runtime_ms"] / row["fa4_ms"]
        row["fa4_tflops"] = flops(case, heads, args.dim) / row["fa4_ms"] / 1e9
    else:
        row["fa4_missing"] = why
    if not torch.equal(step(), op()):
        raise RuntimeError(f"{case.name} at TP {tp}: the head-TP step's output is not the op's")
    err = float((runtime().float() - op().float()).abs().max())
    if err > tol:  # the paged form and the split form round differently; the op was checked above
        raise RuntimeError(f"{case.name} at TP {tp}: the Runtime's output differs from the op's by {err:.2e}")
    return row


def records_of(rows: list[dict], env: dict) -> list[dict]:
    """The ``gqa-prefill`` records of :func:`run_case`'s rows: the op and the step against FA4."""
    out = []
    for r in rows:
        config = {"case": r["case"], "tp": r["tp"], "heads": r["heads"], "kv_heads": r["kv_heads"],
                  "head_dim": r["head_dim"]} | pool_config(r.get("pool_gb"))  # fmt: skip
        base = ("FA4 called directly, same run", r["fa4_ms"]) if "fa4_ms" in r else None
        out.append(record("gqa-prefill", config, "op ms", r["op_ms"], "ms", "lower", base, env))
        out.append(record("gqa-prefill", config, "head-TP step ms", r["step_ms"], "ms", "lower", base, env))
        out.append(record("gqa-prefill", config, "Runtime.prefill ms", r["runtime_ms"], "ms", "lower", base, env))
        for what in ("op", "step", "runtime", "fa4"):
            if f"{what}_host_ms" in r:
                host = f"{what} host ms per call"
                out.append(record("gqa-prefill", config, host, r[f"{what}_host_ms"], "ms", "lower", None, env))
    return out


def check_pool(args: argparse.Namespace, cases: list[Case]) -> None:
    """``ValueError`` naming ``--pool-gb`` when its pool holds fewer pages than a cached-prefix case
    needs at one of ``args.tp``'s rank shapes."""
    if args.pool_gb is None:
        return
    size = 4 if args.device == "cpu" else 2  # fp32 / bf16
    for tp in args.tp:
        kv_heads = max(1, args.kv_heads // tp)
        for c in cases:
            if c.cached:
                pages = c.requests * -(-(c.cached + c.new) // args.page)
                pool_pages(args.pool_gb, 2 * size * args.page * kv_heads * args.dim, pages)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 8], help="head-TP sizes whose rank shapes are timed")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    add_device_argument(ap, help="cpu: a dry run on tiny shapes (torch reference, no FA4)")
    add_pool_argument(ap, "the cached-prefix cases' pages")
    add_json_argument(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.device == "cpu":
        args.heads, args.kv_heads, args.dim, args.page = 8, 2, 16, 16
        args.tp = [t for t in args.tp if args.heads % t == 0 and (args.kv_heads % t == 0 or t % args.kv_heads == 0)]
    cases = CPU_CASES if args.device == "cpu" else GPU_CASES
    try:
        check_pool(args, cases)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if lacks_gpu(args.device):
        return 2
    env = environment(device=args.device)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        rows = []
        for tp in args.tp:
            for c in cases:
                rows.append(run_case(c, args, dist.group.WORLD, tp))
                gc.collect()  # a pool of tens of GB goes before the next case's is allocated
    finally:
        dist.destroy_process_group()
    for why in sorted({r["fa4_missing"] for r in rows if "fa4_missing" in r}):
        print(f"FA4 not timed: {why}")
    for r in rows:
        if "op_vs_fa4_max_abs" in r:
            print(f"{r['case']} TP {r['tp']}: max |op - FA4| {r['op_vs_fa4_max_abs']:.2e}, "
                  f"FA4 {r['fa4_tflops']:.0f} TFLOP/s")  # fmt: skip
    print(f"routes: {sorted({(r['route'], r['route_reason']) for r in rows})}")
    for why in sorted({r["runtime_route"] for r in rows}):
        print(f"Runtime route: {why}")
    for r in rows:
        timed = [w for w in ("fa4", "op", "step", "runtime") if f"{w}_host_ms" in r]
        host = ", ".join(f"{w} {r[f'{w}_host_ms']:.3f}" for w in timed)
        print(f"{r['case']} TP {r['tp']}: host ms per call: {host}; Runtime calls launched directly: "
              f"{r['runtime_direct_launches']} of {r['runtime_calls']}")  # fmt: skip
    records = records_of(rows, env)
    print_table(records, "GQA prefill")
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
