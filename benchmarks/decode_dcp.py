"""DCP GQA decode step on N GPUs: today's eager step vs the lean eager step vs graph buckets.

    torchrun --nproc-per-node 2 benchmarks/decode_dcp.py --json dcp.json

gqa-64-8 (64 q / 8 kv heads, d 64, page 32, sinks), 64 requests of 8,192 tokens, KV split over
the ranks (DCP). Whole steps on each rank, host clock around the call with the device
synchronised (as the launcher times them), median and p10-p90 of ``--iters`` calls. Rows:

* ``eager (device-indexed)``: the step as it was (per-step index arithmetic on the device);
  the same-run baseline.
* ``eager lean``: the host plan (``DecodeStep.plan``) and the step with its metadata; also
  the step alone on a reused plan (an engine plans once per step for all layers).
* graph buckets (``DecodeGraphs``, sizes 16/32/64): single token; uniform 4 drafts; ragged 1-4
  drafts padded to 4 (whole call: plan, one-copy load, replay, real rows). Each replay is
  checked bitwise against the same padded step run eagerly; padding rows never come back.
* a batch above the largest bucket: runs eager, the route's reason is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from shardattn.runtime.graphs import DecodeGraphs
from shardattn.runtime.runtime import Runtime


def _times(fn, iters: int, warmup: int = 5) -> tuple[float, float, float]:
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
    ts.sort()
    return statistics.median(ts), ts[len(ts) // 10], ts[(len(ts) * 9) // 10]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default="decode_dcp.json")
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    group = dist.group.WORLD
    b, ctx = args.requests, args.context
    rt = Runtime("gqa-64-8", group, max_batched_tokens=1, mode="dcp-decode", max_decode_tokens=8 * b)
    spec, h, d, page = rt.spec, rt.heads_per_rank, rt.spec.head_dim, rt.spec.page_size
    g = torch.Generator(device="cuda").manual_seed(1 + rank)
    local = rt.layout.local_len(ctx, 0)
    pages_per = -(-local // page)
    k = torch.randn(b * pages_per, page, spec.num_kv_heads, d, device="cuda", generator=g).bfloat16()
    v = torch.randn_like(k)
    table = torch.randperm(b * pages_per, device="cuda", generator=g).view(b, pages_per).int()
    sinks = torch.randn(spec.num_heads, device="cuda", generator=g)
    rows: list[dict] = []

    def record(name: str, t: tuple[float, float, float], **extra) -> None:
        rows.append({"rank": rank, "name": name, "ms": t[0], "p10": t[1], "p90": t[2], **extra})
        if rank == 0:  # as it goes, so a run cut short still reports what it measured
            print(f"rank 0 {name:52s} {t[0]:8.3f} ms ({t[1]:.3f}-{t[2]:.3f}) {extra}", flush=True)

    # -- single token: today's step, the lean step, graph buckets --------------------------------
    seq = [ctx] * b
    seq_dev = torch.tensor(seq, dtype=torch.int32, device="cuda")
    q1 = torch.randn(b, h, d, device="cuda", generator=g).bfloat16()

    def old():
        return rt.decode(q1, (k, v), table, seq_dev, q_len_per_req=1, sinks=sinks, check=False)

    def lean_with_plan():
        plan = rt.decode_step.plan(seq)
        return rt.decode(q1, (k, v), table, seq_dev, batch=plan, sinks=sinks, check=False)

    plan1 = rt.decode_step.plan(seq)

    def lean():
        return rt.decode(q1, (k, v), table, seq_dev, batch=plan1, sinks=sinks, check=False)

    same = all(torch.equal(a, c) for a, c in zip(old(), lean()))
    record("eager (device-indexed), today's step", _times(old, args.iters))
    record("eager lean (plan + step)", _times(lean_with_plan, args.iters), bitwise_equal_to_today=same)
    record("eager lean (step, plan reused)", _times(lean, args.iters))

    buckets = [b // 4, b // 2, b]
    graphs1 = DecodeGraphs(rt, (k, v), batch_sizes=buckets, q_len=1, max_pages=pages_per, sinks=sinks)
    rep = tuple(t.clone() for t in graphs1(q1, table, seq))
    eag = graphs1.eager(q1, table, seq)
    record(
        f"graph bucket {b}, single token",
        _times(lambda: graphs1(q1, table, seq), args.iters),
        bitwise_equal_to_eager=all(torch.equal(x, y) for x, y in zip(rep, eag)),
        equal_to_today=all(torch.equal(x, y) for x, y in zip(rep, old())),
    )
    # a batch inside a smaller bucket (padded requests), checked the same way
    bb = b // 2 - 3
    rep = tuple(t.clone() for t in graphs1(q1[:bb], table[:bb], seq[:bb]))
    eag = graphs1.eager(q1[:bb], table[:bb], seq[:bb])
    record(
        f"graph bucket {b // 2}, {bb} requests",
        _times(lambda: graphs1(q1[:bb], table[:bb], seq[:bb]), args.iters),
        bitwise_equal_to_eager=all(torch.equal(x, y) for x, y in zip(rep, eag)),
        rows_returned=int(rep[0].shape[0]),
        route=graphs1.last_route[1],
    )

    # -- drafts: uniform 4 and ragged 1-4, padded to 4 ------------------------------------------
    graphs4 = DecodeGraphs(rt, (k, v), batch_sizes=buckets, q_len=4, max_pages=pages_per, sinks=sinks)
    q4 = torch.randn(4 * b, h, d, device="cuda", generator=g).bfloat16()
    cu4 = [4 * i for i in range(b + 1)]
    rep = tuple(t.clone() for t in graphs4(q4, table, seq, cu4))
    eag = graphs4.eager(q4, table, seq, cu4)
    uni = _times(lambda: graphs4(q4, table, seq, cu4), args.iters)
    record(
        "graph bucket 64, uniform 4 drafts",
        uni,
        bitwise_equal_to_eager=all(torch.equal(x, y) for x, y in zip(rep, eag)),
    )
    n = torch.randint(1, 5, (b,), generator=torch.Generator().manual_seed(0)).tolist()
    cur = [0]
    for x in n:
        cur.append(cur[-1] + x)
    qr = q4[: cur[-1]]
    rep = tuple(t.clone() for t in graphs4(qr, table, seq, cur))
    route = graphs4.last_route[1]
    eag = graphs4.eager(qr, table, seq, cur)
    rag = _times(lambda: graphs4(qr, table, seq, cur), args.iters)
    old_rag = rt.decode(
        qr, (k, v), table, seq_dev, cu_q_lens=torch.tensor(cur, dtype=torch.int32, device="cuda"), sinks=sinks,
        check=False,
    )  # fmt: skip
    record(
        f"graph bucket 64, ragged 1-4 drafts ({cur[-1]} queries)",
        rag,
        bitwise_equal_to_eager=all(torch.equal(x, y) for x, y in zip(rep, eag)),
        equal_to_today=all(torch.equal(x, y) for x, y in zip(rep, old_rag)),
        rows_returned=int(rep[0].shape[0]),
        over_uniform=rag[0] / uni[0],
        route=route,
    )
    cu_dev = torch.tensor(cur, dtype=torch.int32, device="cuda")
    record(
        "eager (device-indexed) ragged 1-4, today's step",
        _times(lambda: rt.decode(qr, (k, v), table, seq_dev, cu_q_lens=cu_dev, sinks=sinks, check=False), args.iters),
    )
    # -- above the largest bucket: eager, and the route says so ----------------------------------
    big = b + 8
    qb = torch.randn(big, h, d, device="cuda", generator=g).bfloat16()
    tb = torch.cat([table, table[:8]])
    graphs1(qb, tb, [ctx] * big)
    record(f"{big} requests (above the buckets)", _times(lambda: graphs1(qb, tb, [ctx] * big), 10),
           route=graphs1.last_route[1])  # fmt: skip

    # -- kernel launches of one lean eager step (profiler) ---------------------------------------
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        lean_with_plan()
        torch.cuda.synchronize()
    launches = sum(
        e.count for e in prof.key_averages() if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                           "cudaLaunchKernelExC", "cudaMemcpyAsync")
    )  # fmt: skip
    record("launches of one lean eager step (kernels + copies)", (float(launches), 0.0, 0.0))

    # -- where the lean eager step's host time goes (cProfile of 20 steps; every rank runs them,
    # the steps are collectives; rank 0 prints) ---------------------------------------------------
    import cProfile
    import io
    import pstats

    prof_host = cProfile.Profile()
    prof_host.enable()
    for _ in range(20):
        lean()
    torch.cuda.synchronize()
    prof_host.disable()
    if rank == 0:
        buf = io.StringIO()
        pstats.Stats(prof_host, stream=buf).sort_stats("tottime").print_stats(14)
        print(buf.getvalue()[-3500:], flush=True)
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        print(f"GPU: {torch.cuda.get_device_name()} x{world}  torch {torch.__version__}")
        for rs in gathered:
            for r in rs:
                extra = {k2: v2 for k2, v2 in r.items() if k2 not in ("rank", "name", "ms", "p10", "p90")}
                print(f"rank {r['rank']} {r['name']:52s} {r['ms']:8.3f} ms ({r['p10']:.3f}-{r['p90']:.3f}) {extra}")
        with open(args.json, "w") as f:
            json.dump(gathered, f, indent=1)
    dist.barrier()
    os._exit(0)  # skip the process-group teardown (it outlived the timeout on the first run)


if __name__ == "__main__":
    main()
