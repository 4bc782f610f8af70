"""DCP GQA decode step on N GPUs: the lean eager step and graph buckets against the eager step.

    torchrun --nproc-per-node 2 benchmarks/decode_dcp.py --json dcp.json

gqa-64-8 (64 q / 8 kv heads, d 64, page 32, sinks), 64 requests of 8,192 tokens, KV split over
the ranks (DCP). Whole steps on each rank, host clock around the call with the device
synchronised (as the launcher times them), median of ``--iters`` calls; a step ends when its
slowest rank does, so each record is the slowest rank's median. Rows:

* ``eager, device-side indexing``: :meth:`Runtime.decode` given device tensors only (its index
  arithmetic on the device every step): the same-run baseline.
* ``eager, planned each step``: the host plan (``DecodeStep.plan``) and the step with its
  metadata; ``eager, plan reused``: the step alone on a plan made once (an engine plans once per
  step for all layers).
* graph buckets (``DecodeGraphs``, sizes 16 / 32 / 64): single token; a batch padded into a
  smaller bucket; uniform 4 drafts; ragged 1-4 drafts padded to 4 (whole call: plan, one-copy
  load, replay, real rows). Each replay is checked bitwise against the same padded step run
  eagerly, and the single-token and ragged replays against the baseline step.
* a batch above the largest bucket: runs eager, the route's reason is printed.
* the kernel launches and copies of one eager step planned each step (torch profiler).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import add_json_argument, environment, print_table, record, write_json

from shardattn.runtime.graphs import DecodeGraphs
from shardattn.runtime.runtime import Runtime

BENCHMARK = "dcp-decode"
BASELINE = "eager, device-side indexing"


def _times(fn, iters: int, warmup: int = 5) -> float:
    """Median host milliseconds of ``fn`` on this rank (ranks start each call together)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=50)
    add_json_argument(ap)
    return ap


def measure(args: argparse.Namespace, rank: int) -> tuple[dict[str, float], dict[str, object]]:
    """Every row's median on this rank, and the checks (bitwise equalities, routes, launch count)."""
    b, ctx = args.requests, args.context
    rt = Runtime("gqa-64-8", dist.group.WORLD, max_batched_tokens=1, mode="dcp-decode", max_decode_tokens=8 * b)
    spec, h, d, page = rt.spec, rt.heads_per_rank, rt.spec.head_dim, rt.spec.page_size
    g = torch.Generator(device="cuda").manual_seed(1 + rank)
    pages_per = -(-rt.layout.local_len(ctx, 0) // page)
    k = torch.randn(b * pages_per, page, spec.num_kv_heads, d, device="cuda", generator=g).bfloat16()
    v = torch.randn_like(k)
    table = torch.randperm(b * pages_per, device="cuda", generator=g).view(b, pages_per).int()
    sinks = torch.randn(spec.num_heads, device="cuda", generator=g)
    ms: dict[str, float] = {}
    checks: dict[str, object] = {}

    # -- single token: the baseline, the lean step, graph buckets --------------------------------
    seq = [ctx] * b
    seq_dev = torch.tensor(seq, dtype=torch.int32, device="cuda")
    q1 = torch.randn(b, h, d, device="cuda", generator=g).bfloat16()

    def baseline():
        return rt.decode(q1, (k, v), table, seq_dev, q_len_per_req=1, sinks=sinks, check=False)

    def planned():
        return rt.decode(q1, (k, v), table, seq_dev, batch=rt.decode_step.plan(seq), sinks=sinks, check=False)

    plan1 = rt.decode_step.plan(seq)

    def reused():
        return rt.decode(q1, (k, v), table, seq_dev, batch=plan1, sinks=sinks, check=False)

    checks["lean step equals the baseline"] = _equal(baseline(), reused())
    ms[BASELINE] = _times(baseline, args.iters)
    ms["eager, planned each step"] = _times(planned, args.iters)
    ms["eager, plan reused"] = _times(reused, args.iters)

    buckets = [b // 4, b // 2, b]
    graphs1 = DecodeGraphs(rt, (k, v), batch_sizes=buckets, q_len=1, max_pages=pages_per, sinks=sinks)
    rep = tuple(t.clone() for t in graphs1(q1, table, seq))
    checks[f"graph bucket {b} equals eager"] = _equal(rep, graphs1.eager(q1, table, seq))
    checks[f"graph bucket {b} equals the baseline"] = _equal(rep, baseline())
    ms[f"graph bucket {b}, single token"] = _times(lambda: graphs1(q1, table, seq), args.iters)
    bb = b // 2 - 3  # a batch inside a smaller bucket (padded requests), checked the same way
    rep = tuple(t.clone() for t in graphs1(q1[:bb], table[:bb], seq[:bb]))
    checks[f"graph bucket {b // 2}, {bb} requests equals eager"] = _equal(rep, graphs1.eager(q1[:bb], table[:bb],
                                                                                               seq[:bb]))  # fmt: skip
    checks[f"graph bucket {b // 2}, rows returned"] = int(rep[0].shape[0])
    ms[f"graph bucket {b // 2}, {bb} requests"] = _times(lambda: graphs1(q1[:bb], table[:bb], seq[:bb]), args.iters)

    # -- drafts: uniform 4 and ragged 1-4, padded to 4 ------------------------------------------
    graphs4 = DecodeGraphs(rt, (k, v), batch_sizes=buckets, q_len=4, max_pages=pages_per, sinks=sinks)
    q4 = torch.randn(4 * b, h, d, device="cuda", generator=g).bfloat16()
    cu4 = [4 * i for i in range(b + 1)]
    rep = tuple(t.clone() for t in graphs4(q4, table, seq, cu4))
    checks[f"graph bucket {b}, uniform 4 drafts equals eager"] = _equal(rep, graphs4.eager(q4, table, seq, cu4))
    ms[f"graph bucket {b}, uniform 4 drafts"] = _times(lambda: graphs4(q4, table, seq, cu4), args.iters)
    n = torch.randint(1, 5, (b,), generator=torch.Generator().manual_seed(0)).tolist()
    cur = [0]
    for x in n:
        cur.append(cur[-1] + x)
    qr = q4[: cur[-1]]
    rep = tuple(t.clone() for t in graphs4(qr, table, seq, cur))
    cu_dev = torch.tensor(cur, dtype=torch.int32, device="cuda")
    checks[f"graph bucket {b}, ragged 1-4 drafts equals eager"] = _equal(rep, graphs4.eager(qr, table, seq, cur))
    checks[f"graph bucket {b}, ragged 1-4 drafts equals the baseline"] = _equal(
        rep, rt.decode(qr, (k, v), table, seq_dev, cu_q_lens=cu_dev, sinks=sinks, check=False)
    )
    ms[f"graph bucket {b}, ragged 1-4 drafts"] = _times(lambda: graphs4(qr, table, seq, cur), args.iters)

    # -- above the largest bucket: eager, and the route says so ----------------------------------
    big = b + 8
    qb = torch.randn(big, h, d, device="cuda", generator=g).bfloat16()
    tb = torch.cat([table, table[:8]])
    graphs1(qb, tb, [ctx] * big)
    checks[f"route of {big} requests"] = graphs1.last_route[1]

    # -- kernel launches and copies of one eager step planned each step (profiler) ---------------
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        planned()
        torch.cuda.synchronize()
    names = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaMemcpyAsync")
    checks["launches"] = sum(e.count for e in prof.key_averages() if e.key in names)
    return ms, checks


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if "RANK" not in os.environ or not torch.cuda.is_available():
        print("run under torchrun with one GPU per rank", file=sys.stderr)
        return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    ms, checks = measure(args, rank)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (ms, checks))
    if rank == 0:
        env = environment(world)
        slowest = {name: max(r[0][name] for r in gathered) for name in ms}
        base = (f"{BASELINE}, same run", slowest[BASELINE])
        uniform = f"graph bucket {args.requests}, uniform 4 drafts"
        ragged = f"graph bucket {args.requests}, ragged 1-4 drafts"
        records = []
        for name, value in slowest.items():
            if name == BASELINE:
                continue
            row_base = base if name.startswith("eager") or name.endswith("single token") else None
            if name == ragged:
                row_base = (f"{uniform}, same run", slowest[uniform])
            config = {"requests": args.requests, "context": args.context, "step": name}
            records.append(record(BENCHMARK, config, "step ms", value, "ms", "lower", row_base, env))
        config = {"requests": args.requests, "context": args.context, "step": "eager, planned each step"}
        launches = max(r[1]["launches"] for r in gathered)
        records.append(record(BENCHMARK, config, "launches per step", launches, "launches", "lower", None, env))
        for r, (_, chk) in enumerate(gathered):
            print(f"rank {r} checks: {chk}", flush=True)
        print_table(records, f"DCP GQA decode, {world} ranks")
        write_json(args.json, records)
    failed = sorted({k for _, chk in gathered for k, v in chk.items() if v is False})
    if failed and rank == 0:
        print(f"checks failed: {failed}", file=sys.stderr)
    dist.barrier()
    os._exit(1 if failed else 0)  # skips the process-group teardown, which can outlive a launcher's timeout


if __name__ == "__main__":
    sys.exit(main())
