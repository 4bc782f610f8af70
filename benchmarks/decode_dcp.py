"""DCP GQA decode step on N GPUs: the lean eager step and graph buckets against the eager step.

    torchrun --nproc-per-node 2 benchmarks/decode_dcp.py --json dcp.json
    torchrun --nproc-per-node 2 benchmarks/decode_dcp.py --pool-gb 40 --json dcp_pool40.json

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

The whole cache is drawn from one seed on every rank, which keeps its DCP shard
(``shard_kv_cache``): exactly the shard's pages, in order. ``--pool-gb G``: each rank places its
shard's pages at scattered page ids of a pool of ``G`` GB of K and V pages on its GPU
(``kv_pool.place_pages``; the records name ``pool_gb``). The baseline's output is checked against
the fp32 reference of the rank's heads over the whole cache before anything is timed. No records
are written when a check fails.
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
from kv_pool import add_pool_argument, page_bytes, place_pages, pool_config, pool_pages
from records import add_json_argument, environment, print_table, record, write_json

from shardattn.ops.gqa_decode_reference import gqa_paged_decode_reference
from shardattn.plan.dcp_shard import shard_kv_cache
from shardattn.runtime.graphs import DecodeGraphs
from shardattn.runtime.runtime import Runtime

BENCHMARK = "dcp-decode"
BASELINE = "eager, device-side indexing"
LAUNCHES = "kernel launches and copies per step"
#: Largest ``|out - ref|`` of a bf16 step against the fp32 reference.
TOL = 2e-2


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
    add_pool_argument(ap, "each rank's shard of the cache")
    add_json_argument(ap)
    return ap


def measure(args: argparse.Namespace, rank: int) -> tuple[dict[str, float], dict[str, object]]:
    """Every row's median on this rank, and the checks (bitwise equalities, routes, launch count)."""
    b, ctx = args.requests, args.context
    rt = Runtime("gqa-64-8", dist.group.WORLD, max_batched_tokens=1, mode="dcp-decode", max_decode_tokens=8 * b)
    spec, h, d = rt.spec, rt.heads_per_rank, rt.spec.head_dim
    seq = [ctx] * b
    whole, (k, v), table = rank_cache(rt, b, ctx, rank, args.pool_gb)
    pages_per = table.shape[1]
    g = torch.Generator(device="cuda").manual_seed(1 + rank)
    sinks = torch.randn(spec.num_heads, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    ms: dict[str, float] = {}
    checks: dict[str, bool] = {}

    # -- single token: the baseline, the lean step, graph buckets --------------------------------
    seq_dev = torch.tensor(seq, dtype=torch.int32, device="cuda")
    q1 = torch.randn(b, h, d, device="cuda", generator=g).bfloat16()

    def baseline():
        return rt.decode(q1, (k, v), table, seq_dev, q_len_per_req=1, sinks=sinks, check=False)

    err = reference_error(baseline()[0], q1, whole, seq_dev, sinks, rank, rt.scale)
    checks[f"the baseline is the fp32 reference's attention over the whole cache (max error {err:.2g})"] = err <= TOL
    del whole  # the reference's copy of the cache: not kept beside a pool while timing

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
    checks[f"graph bucket {b // 2}, {bb} rows returned"] = int(rep[0].shape[0]) == bb
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
    print(f"rank {rank}: {big} requests ran {graphs1.last_route[1]}", flush=True)
    checks[f"{big} requests run eagerly (above the largest bucket)"] = graphs1.last_route[0] is None

    # -- kernel launches and copies of one eager step planned each step (profiler) ---------------
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        planned()
        torch.cuda.synchronize()
    names = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaMemcpyAsync")
    ms[LAUNCHES] = sum(e.count for e in prof.key_averages() if e.key in names)
    return ms, checks


def whole_cache(b: int, ctx: int, spec, seed: int, device: str = "cuda") -> tuple[torch.Tensor, ...]:
    """``(k, v, table)``: the whole paged GQA cache of ``b`` requests of ``ctx`` tokens (``[pages,
    page, Hkv, D]`` bf16 each, pages in random order; ``table [b, pages a request]`` int32), drawn
    from ``seed`` so that every rank holds the same one."""
    g = torch.Generator(device=device).manual_seed(seed)
    per = -(-ctx // spec.page_size)
    k = torch.randn(b * per, spec.page_size, spec.num_kv_heads, spec.head_dim, device=device, generator=g)
    v = torch.randn(k.shape, device=device, generator=g)
    table = torch.randperm(b * per, device=device, generator=g).view(b, per).int()
    return k.bfloat16(), v.bfloat16(), table


def rank_cache(rt: Runtime, b: int, ctx: int, rank: int, pool_gb: float | None, device: str = "cuda"):
    """``(whole, (k, v), table)``: :func:`whole_cache` (seed 1) and this rank's DCP shard of it, its
    pages at scattered ids of a pool of ``pool_gb`` GB when given (seeded by the rank). Every rank
    learns the largest shard, so a pool too small for any rank's is refused on all of them at once
    (``ValueError`` naming ``--pool-gb``)."""
    whole = whole_cache(b, ctx, rt.spec, seed=1, device=device)  # the same on every rank; each keeps its shard
    (k, v), table = shard_kv_cache(whole[:2], whole[2], [ctx] * b, rt.layout, rank)
    if pool_gb is not None:
        need = torch.tensor([k.shape[0]], device=device)
        dist.all_reduce(need, op=dist.ReduceOp.MAX, group=rt.group)
        pool_pages(pool_gb, page_bytes((k, v)), int(need))
        (k, v), table = place_pages((k, v), table, pool_gb, seed=rank)
    return whole, (k, v), table


def reference_error(out: torch.Tensor, q: torch.Tensor, whole: tuple, seq_lens: torch.Tensor, sinks: torch.Tensor,
                    rank: int, scale: float, requests: int = 4) -> float:  # fmt: skip
    """Largest ``|out - ref|`` of the first ``requests`` single-token requests: ``ref`` the fp32
    reference of this rank's ``h`` query heads (and the KV heads they read) over the whole cache."""
    k, v, table = whole
    h, group = q.shape[1], sinks.numel() // k.shape[2]
    if h % group and group % h:  # a rank's heads cover whole KV-head groups, or lie inside one
        raise ValueError(f"{h} query heads a rank do not split GQA groups of {group}: no per-rank reference")
    heads = slice(rank * h, (rank + 1) * h)
    kv_heads = slice(rank * h // group, ((rank + 1) * h - 1) // group + 1)
    cu = torch.arange(requests + 1, dtype=torch.int32, device=q.device)
    ref, _ = gqa_paged_decode_reference(q[:requests], k[:, :, kv_heads], v[:, :, kv_heads], table[:requests],
                                        seq_lens[:requests], cu, sinks=sinks[heads], scale=scale)  # fmt: skip
    return float((out[:requests].float() - ref.float()).abs().max())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if "RANK" not in os.environ or not torch.cuda.is_available():
        print("run under torchrun with one GPU per rank", file=sys.stderr)
        return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        ms, checks = measure(args, rank)
    except ValueError as e:  # --pool-gb too small: raised on every rank at once (rank_cache)
        if "--pool-gb" not in str(e):
            raise
        if rank == 0:
            print(e, file=sys.stderr, flush=True)
        os._exit(2)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (ms, checks))
    failed = sorted({k for _, chk in gathered for k, v in chk.items() if not v})
    if rank == 0:
        for r, (_, chk) in enumerate(gathered):
            print(f"rank {r} checks: {chk}", flush=True)
    if failed:  # no records of a step that is not right
        if rank == 0:
            print(f"checks failed: {failed}; no records written", file=sys.stderr)
    elif rank == 0:
        env = environment(world)
        slowest = {name: max(r[0][name] for r in gathered) for name in ms if name != LAUNCHES}
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
            config = {"requests": args.requests, "context": args.context, "step": name} | pool_config(args.pool_gb)
            records.append(record(BENCHMARK, config, "step ms", value, "ms", "lower", row_base, env))
        config = {"requests": args.requests, "context": args.context, "step": "eager, planned each step"}
        config |= pool_config(args.pool_gb)
        launches = max(r[0][LAUNCHES] for r in gathered)
        records.append(record(BENCHMARK, config, LAUNCHES, launches, "launches", "lower", None, env))
        print_table(records, f"DCP GQA decode, {world} ranks")
        write_json(args.json, records)
    dist.barrier()
    os._exit(1 if failed else 0)  # skips the process-group teardown, which can outlive a launcher's timeout


if __name__ == "__main__":
    sys.exit(main())
