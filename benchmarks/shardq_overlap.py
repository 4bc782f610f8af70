"""ShardQ step against its kernel alone and against head-TP: pipelined, unpipelined and the step before.

Run with one process per GPU::

    torchrun --nproc-per-node 2 benchmarks/shardq_overlap.py --presets glm5 deepseek-v32 --tokens 8192 32768

For every (preset, tokens) it builds the launcher's synthetic step (``--requests`` requests,
``--cached`` cached tokens each, DSA-like top-k of the preset) and times, on every rank, with
CUDA events around each call after a barrier (median of ``--iters``, then the max over ranks):

* ``kernel``: the rank's ShardQ kernel call alone (all heads of its tokens: union build + kernel),
  reading a contiguous q;
* ``shardq``: :meth:`Runtime.prefill` (``PrefillOptions(chunks=None)``, the default: the planner's chunks);
* ``shardq_c1``: the same step with ``PrefillOptions(chunks=1)`` (not pipelined), ``shardq_cN`` with N;
* ``--taper`` / ``--one-union``: the same steps (the planner's chunks and every ``--chunks`` N) with
  tapered chunks (``_taper``, N >= 3 only: fewer chunks have nothing to taper) and / or the
  share's union built once (``_1u``, N >= 2), as columns of the same run, and a second table of
  their ratios to the plain step at the same chunk count;
* ``shardq_normal_prio`` (``--normal-priority``): the default step over an NCCL group whose stream
  has normal priority (the launchers' groups, and this script's, use a high-priority stream);
* ``before``: the step as it was before the pipelining (two all-to-alls around index gathers,
  permute copies and byte packing), on the same kernel: the baseline;
* ``comm``: the pipelined step with a kernel that does nothing (messages and launches only);
* ``headtp``: the head-TP step (the rank's heads of every token).

It also checks, in the same run, that the pipelined, unpipelined and before steps give the same
bits, the error against head-TP, and that warmed steps reserve no new device memory.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import io
import json
import os
import pstats
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardattn.launch.process_group import nccl_options
from shardattn.launch.workloads import build_prefill
from shardattn.parallel.comm import Comm, pack_rows, packed_nbytes, unpack_rows
from shardattn.parallel.runtime import PrefillOptions, Runtime
from shardattn.plan.pipeline import choose_chunks
from shardattn.plan.spec import get_preset
from shardattn.plan.zigzag import ShardPlan


def shardq_before(
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    plan: ShardPlan,
    comm: Comm,
    attention: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    *,
    scale: float,
    v_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sharded ShardQ step before pipelining (copied from the previous shardq.py), for the baseline."""
    counts = [int(c) for c in plan.counts.tolist()]
    w, rank = comm.world_size, comm.rank
    h, d = q.shape[1], q.shape[2]
    mine, dev = counts[rank], q.device
    gather = plan.gather_index.to(dev, non_blocking=True)
    ids = plan.token_ids(rank).to(dev, non_blocking=True)
    q_recv = comm.all_to_all(q.index_select(0, gather), counts, [mine] * w)
    q_tok = q_recv.view(w, mine, h, d).permute(1, 0, 2, 3).reshape(mine, w * h, d)
    out, lse = attention(q_tok, kv, rows.index_select(0, ids), scale=scale, v_dim=v_dim, return_lse=True)
    parts = [out.reshape(mine, w, h, v_dim).permute(1, 0, 2, 3), lse.reshape(mine, w, h).permute(1, 0, 2)]

    def specs(n: int) -> list:
        return [((n, h, v_dim), out.dtype), ((n, h), torch.float32)]

    send = pack_rows(parts)
    recv_sizes = [packed_nbytes(specs(c)) for c in counts]
    recv = comm.all_to_all(send.view(-1), [int(send.shape[1])] * w, recv_sizes)
    pieces = [unpack_rows(chunk.view(1, -1), specs(c)) for chunk, c in zip(recv.split(recv_sizes), counts)]
    restore = plan.restore_index.to(dev, non_blocking=True)
    out_tok = torch.cat([p[0][0] for p in pieces]).index_select(0, restore)
    lse_tok = torch.cat([p[1][0] for p in pieces]).index_select(0, restore)
    return out_tok, lse_tok


def bench(fn: Callable[[], object], iters: int, warmup: int, device: torch.device) -> tuple[float, float]:
    """Median ms of ``fn`` over ``iters`` calls (each after a barrier), max over ranks; also the
    median host ms of the call (issue time; a step whose host time reaches its device time is host bound)."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    host: list[float] = []
    if device.type == "cpu":  # a dry run of the script (gloo): host clock
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    else:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(iters):
            torch.cuda.synchronize(device)
            dist.barrier()
            torch.cuda.synchronize(device)
            start.record()
            h0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - h0) * 1e3)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    t = torch.tensor([statistics.median(times), statistics.median(host) if host else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0]), float(t[1])


def kernel_overlap(
    fn: Callable[[], object], device: torch.device, trace: str | None = None, timeline: bool = False
) -> dict[str, float]:
    """Profile one call: device ms of NCCL kernels, of other kernels, and of NCCL time that overlaps them.

    With ``timeline`` (every rank must pass the same: the calls are collective), also profile three
    calls back to back with the host's side, saved as a Chrome trace to ``trace`` when given."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    if timeline:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as three_calls:
            for _ in range(3):
                fn()
            torch.cuda.synchronize(device)
        if trace:
            three_calls.export_chrome_trace(trace)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        text = Path(f.name).read_text()
    events = json.loads(text)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    nccl = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" in e["name"].lower()]
    other = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower()]

    def union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
        out: list[list[float]] = []
        for a, b in sorted(iv):
            if out and a <= out[-1][1]:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
        return [(a, b) for a, b in out]

    un, uo = union(nccl), union(other)
    both = sum(max(0.0, min(b, d) - max(a, c)) for a, b in un for c, d in uo)
    ends = [e["ts"] + e["dur"] for e in kernels]
    span = (max(ends) - min(e["ts"] for e in kernels)) if kernels else 0.0
    return {
        "nccl_ms": sum(b - a for a, b in un) / 1e3,
        "compute_ms": sum(b - a for a, b in uo) / 1e3,
        "overlap_ms": both / 1e3,
        "span_ms": span / 1e3,
    }


def host_profile(
    fns: dict[str, Callable[[], object]], out_dir: str, name: str, rank: int, device: torch.device
) -> None:
    """cProfile of the host side of five calls of each path on rank 0 (every rank runs them), written
    as ``host_<name>_<path>.txt`` (by own time, then by cumulative time) under ``out_dir``."""
    for k, fn in fns.items():
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        prof = cProfile.Profile() if rank == 0 else None
        if prof is not None:
            prof.enable()
        for _ in range(5):
            fn()
        if prof is not None:
            prof.disable()
            text = io.StringIO()
            stats = pstats.Stats(prof, stream=text)
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumulative").print_stats(40)
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            (Path(out_dir) / f"host_{name}_{k}.txt").write_text(text.getvalue())
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def one_union_fits(rt: Runtime, rank_tokens: int, group_size: int, topk: int) -> bool:
    """Whether the union of a rank's whole share fits ``rt``'s ``prefill.union`` buffer (int32 entries)."""
    groups = -(-rank_tokens // group_size)
    return groups * group_size * topk * 4 <= rt.workspace["prefill.union"].numel()


def run_config(
    preset: str,
    tokens: int,
    args: argparse.Namespace,
    group: dist.ProcessGroup,
    device: torch.device,
    np_group: dist.ProcessGroup | None = None,
) -> dict:
    spec = get_preset(preset)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.topk:
        spec = dataclasses.replace(spec, topk=args.topk)
    spec = dataclasses.replace(spec, dtype=str(dtype).removeprefix("torch."))
    step = build_prefill(
        heads=spec.num_heads, head_dim=spec.head_dim, tokens=tokens, requests=args.requests,
        cached=(args.cached,) * args.requests, topk=spec.topk, overlap="dsa", dtype=dtype, device=device,
        seed=args.seed, block_size=spec.page_size,
    )  # fmt: skip
    kv_rows = int(step.kv.shape[0])
    # cost_model=None: the ShardQ Runtimes take ShardQ whatever the router would predict
    base = PrefillOptions(max_kv_rows=kv_rows, cost_model=None)
    common = dict(max_batched_tokens=tokens, device=device, warmup=False)

    def options(**changes: Any) -> dict[str, PrefillOptions]:
        return {"prefill_options": dataclasses.replace(base, **changes)}

    rt = Runtime(spec, group, mode="shardq", **options(chunks=None), **common)  # the planner's chunks
    rt1 = Runtime(spec, group, mode="shardq", **options(chunks=1), **common)
    rth = Runtime(spec, group, mode="headtp", **options(), **common)
    by_chunks = {c: Runtime(spec, group, mode="shardq", **options(chunks=c), **common) for c in args.chunks if c != 1}
    # the same step over a group whose NCCL stream has normal priority (the launchers' is high)
    rt_np = None if np_group is None else Runtime(spec, np_group, mode="shardq", **options(chunks=None), **common)
    rank, w, h = rt.rank, rt.world_size, rt.heads_per_rank
    plan = rt.plan_prefill(step.query_lens, step.prefix_lens, kv_rows=kv_rows)
    plan_h = rth.plan_prefill(step.query_lens, step.prefix_lens, kv_rows=kv_rows)
    assert plan.step == "shardq", plan.step
    # --taper / --one-union: the same steps with tapered chunks and / or one union build (same run)
    # the planner's chunks, as shardq_prefill picks them for the default step
    auto_c = choose_chunks(int(plan.shard.counts.max()), heads=spec.num_heads, topk=max(1, int(step.rows.shape[1])))
    variants = {}  # column -> (chunks, the plain column at that depth, Runtime)
    for c in [None, *(c for c in args.chunks if c != 1)]:
        depth = auto_c if c is None else c
        plain = "shardq" if c is None else f"shardq_c{c}"
        for taper, one_union in ((True, False), (False, True), (True, True)):
            if (taper and not args.taper) or (one_union and not args.one_union) or (taper and depth < 3) or depth < 2:
                continue
            name = plain + ("_taper" if taper else "") + ("_1u" if one_union else "")
            opts = options(chunks=c, taper=taper, one_union=one_union)
            variants[name] = (depth, plain, Runtime(spec, group, mode="shardq", **opts, **common))
    q_local = step.q[:, rank * h : (rank + 1) * h].contiguous()
    mine = plan.tokens_of(rank).to(device)
    q_tok = step.q.index_select(0, mine).contiguous()
    rows_mine = step.rows.index_select(0, mine)
    kw = dict(scale=rt.scale, v_dim=spec.v_dim)

    def kernel() -> tuple[torch.Tensor, torch.Tensor]:
        return rt._attention(q_tok, step.kv, rows_mine, route=plan.route, step=plan.step, return_lse=True, **kw)

    def before() -> tuple[torch.Tensor, torch.Tensor]:
        attention = functools.partial(rt._attention, route=plan.route, step=plan.step)
        return shardq_before(q_local, step.kv, step.rows, plan.shard, rt.comm, attention, **kw)

    def comm_only() -> tuple[torch.Tensor, torch.Tensor]:
        from shardattn.parallel.shardq import shardq_prefill

        ws = {k: rt.workspace[f"prefill.{i}"] for k, i in (("q", "packed_q"), ("out", "out"), ("lse", "lse"))}
        return shardq_prefill(
            q_local, step.kv, step.rows, plan.shard, rt.comm, attention=lambda *a, **k: (k["out"], k["lse"]),
            workspace=ws, check=False, **kw,
        )  # fmt: skip

    fns = {
        "kernel": kernel,
        "shardq": lambda: rt.prefill(q_local, step.kv, step.rows, plan=plan, check=False),
        "shardq_c1": lambda: rt1.prefill(q_local, step.kv, step.rows, plan=plan, check=False),
        "before": before,
        "comm": comm_only,
        "headtp": lambda: rth.prefill(q_local, step.kv, step.rows, plan=plan_h, check=False),
    }
    for c, r in by_chunks.items():
        fns[f"shardq_c{c}"] = functools.partial(r.prefill, q_local, step.kv, step.rows, plan=plan, check=False)
    for name, (_, _, r) in variants.items():
        fns[name] = functools.partial(r.prefill, q_local, step.kv, step.rows, plan=plan, check=False)
    if rt_np is not None:
        fns["shardq_normal_prio"] = functools.partial(
            rt_np.prefill, q_local, step.kv, step.rows, plan=plan, check=False
        )
    # correctness in the same run: the same bits from every ShardQ variant; error vs head-TP
    outs = {k: fns[k]() for k in ("shardq", "shardq_c1", "before", "headtp")}
    for k in fns:
        if k.startswith("shardq_") and k not in outs:
            outs[k] = fns[k]()
    same = all(torch.equal(outs["shardq"][i], outs[k][i]) for k in outs if k != "headtp" for i in (0, 1))
    ref = outs["headtp"][0].float()
    rel = float((outs["shardq"][0].float() - ref).norm() / ref.norm())
    finite = bool(torch.isfinite(outs["shardq"][0]).all())
    # a warmed Runtime reserves no new device memory per step
    new_segments = -1
    if device.type == "cuda":
        fns["shardq"]()
        torch.cuda.synchronize(device)
        seg0 = torch.cuda.memory_stats(device)["segment.all.allocated"]
        for _ in range(3):
            fns["shardq"]()
        torch.cuda.synchronize(device)
        new_segments = torch.cuda.memory_stats(device)["segment.all.allocated"] - seg0
    both = {k: bench(f, args.iters, args.warmup, device) for k, f in fns.items()}
    times = {k: v[0] for k, v in both.items()}
    host_ms = {k: v[1] for k, v in both.items()}
    overlap = {}
    if device.type == "cuda" and args.profile:
        for k in fns:
            if k.startswith("shardq") or k == "comm":
                dist.barrier()
                trace = None
                if args.trace_dir and rank == 0:
                    trace = str(Path(args.trace_dir) / f"trace_{preset}_{tokens}_{k}.json")
                overlap[k] = kernel_overlap(fns[k], device, trace, timeline=bool(args.trace_dir))
    if args.host_profile:
        host_profile(fns, args.host_profile, f"{preset}_{tokens}", rank, device)
    counts = [int(c) for c in plan.shard.counts.tolist()]
    res = {
        "preset": preset,
        "tokens": tokens,
        "heads": spec.num_heads,
        "world": w,
        "rank_tokens": counts,
        "chunks": auto_c,
        # --taper / --one-union: each variant's ms over the plain step's at the same chunk count
        "variants": {k: {"chunks": c, "over_plain": times[k] / times[p]} for k, (c, p, _) in variants.items()},
        # whether a rank's whole union fits the Runtime's union buffer (else one_union builds per chunk)
        "one_union_fits": one_union_fits(rt, max(counts), plan.route.group_size, int(step.rows.shape[1])),
        "route": plan.route.path,
        "ms": times,
        "host_ms": host_ms,
        "step_over_kernel": times["shardq"] / times["kernel"],
        "before_over_kernel": times["before"] / times["kernel"],
        "headtp_over_shardq": times["headtp"] / times["shardq"],
        "bit_equal_c1_before": same,
        "rel_err_vs_headtp": rel,
        "finite": finite,
        "new_segments_3_steps": int(new_segments),
        "profile_rank0": overlap,
    }
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", nargs="+", default=["glm5", "deepseek-v32"])
    p.add_argument("--tokens", nargs="+", type=int, default=[8192, 32768])
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--cached", type=int, default=8192)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--topk", type=int, default=None, help="override the preset's top-k (CPU dry runs)")
    p.add_argument("--cpu", action="store_true", help="dry run on the CPU with gloo (tiny sizes)")
    p.add_argument("--chunks", nargs="*", type=int, default=[], help="also time the step at these chunk counts")
    p.add_argument("--taper", action="store_true", help="also time tapered chunks (planner's C and --chunks, C >= 3)")
    p.add_argument(
        "--one-union", action="store_true", help="also time one union build per step (planner's C and --chunks, C >= 2)"
    )
    p.add_argument(
        "--normal-priority", action="store_true", help="also time the step over an NCCL group of normal stream priority"
    )
    p.add_argument("--profile", action="store_true", help="profile one step: NCCL time overlapping kernels")
    p.add_argument("--trace-dir", default=None, help="with --profile: save rank 0's Chrome traces there")
    p.add_argument("--host-profile", default=None, help="write rank 0's cProfile of five calls of each path there")
    args = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, pg_options=nccl_options())  # as the launchers do
    group = dist.group.WORLD
    Comm(group)  # resolves once; fails early on a bad group
    np_group = None
    if args.normal_priority and not args.cpu:
        np_group = dist.new_group(list(range(dist.get_world_size())), backend="nccl")
    results = []
    for preset in args.presets:
        for tokens in args.tokens:
            r = run_config(preset, tokens, args, group, device, np_group)
            results.append(r)
            if dist.get_rank() == 0:
                print(json.dumps(r), flush=True)
    if dist.get_rank() == 0:
        cols = [k for k in results[0]["ms"] if k != "before"] + ["before"]
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(f"\nShardQ on {name} x {dist.get_world_size()} (ms, median, max over ranks)")
        print(
            "| preset | tokens | chunks | "
            + " | ".join(cols)
            + " | step/kernel | before/kernel | headtp/shardq | same bits | rel err vs headtp | new segments |"
        )
        print("|" + "---|" * (len(cols) + 9))
        for r in results:
            ms = " | ".join(f"{r['ms'][c]:.2f}" for c in cols)
            print(
                f"| {r['preset']} | {r['tokens']} | {r['chunks']} | {ms} | {r['step_over_kernel']:.3f} | "
                f"{r['before_over_kernel']:.3f} | {r['headtp_over_shardq']:.3f} | {r['bit_equal_c1_before']} | "
                f"{r['rel_err_vs_headtp']:.2e} | {r['new_segments_3_steps']} |"
            )
        if any(r["variants"] for r in results):  # --taper / --one-union: ratios to the plain step, same run
            print("\nTapered chunks (_taper) and one union build (_1u): ms over the plain step at the same chunk count")
            print("| preset | tokens | variant | chunks | ms | plain ms | variant / plain | union fits |")
            print("|---|---|---|---|---|---|---|---|")
            for r in results:
                for k, v in r["variants"].items():
                    plain = k.replace("_taper", "").replace("_1u", "")
                    print(
                        f"| {r['preset']} | {r['tokens']} | {k} | {v['chunks']} | {r['ms'][k]:.2f} | "
                        f"{r['ms'][plain]:.2f} | {v['over_plain']:.3f} | {r['one_union_fits']} |"
                    )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
