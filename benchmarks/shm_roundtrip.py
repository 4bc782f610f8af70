"""The Ray pool's shared-memory decode transport alone: one step's round trip, driver to ranks and back.

Usage (any Linux host; no Ray, no GPU)::

    python benchmarks/shm_roundtrip.py --ranks 2 --steps 5000 --json shm.json
    python benchmarks/shm_roundtrip.py --ranks 2 --steps 5000 --spin-us 5000   # ranks spin 5 ms, as GPU pools do

The driver and ``--ranks`` rank processes map one region (``shardattn.serving.shm``) as a pool
does; each step the driver writes ``--tokens`` query tokens of a tiny model and publishes the
step, every rank's serve loop copies its heads of the queries into the outputs (no attention:
the transport is what is timed) and reports done, and the driver checks every output row and LSE
(records are written only when all are right).
Prints the median / p90 / p99 / mean round trip in microseconds, and the driver's and ranks' CPU
time per step; ``--json`` writes the ``shm-transport`` records (``benchmarks/records.py``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import add_json_argument, environment, print_table, record, write_json

from shardattn.serving.shm import ShmRegion, decode_layout, serve
from shardattn.serving.shm_steps import ShmSteps

HEADS_PER_RANK, D, DV, TOPK = 2, 48, 32, 16


def _copy_heads(step: dict[str, Any]) -> None:
    """The rank's "step": its heads of the queries' first ``DV`` dims into the outputs; lse = token index."""
    n_q = step["sizes"][1]
    step["out"].copy_(step["q"][:n_q, step["heads"], :DV])
    if step["lse"] is not None:
        step["lse"].copy_(torch.arange(n_q, dtype=torch.float32)[:, None].expand_as(step["lse"]))


def _rank_main(path: str, layout: Any, rank: int, spin_s: float, cpu: Any, ready: Any) -> None:
    torch.set_num_threads(1)
    region = ShmRegion(path, layout, create=False)
    ready.release()
    t0 = time.process_time()
    serve(region, rank, _copy_heads, spin_s)
    cpu[rank] = time.process_time() - t0


def run(ranks: int, steps: int, tokens: int, spin_s: float, warmup: int = 200) -> dict[str, Any]:
    layout = decode_layout(
        ranks, max_tokens=tokens, max_requests=tokens, table_width=1, heads_per_rank=HEADS_PER_RANK, head_dim=D,
        v_dim=DV, dtype=torch.float32, topk=TOPK, kv_rows=[((D,), torch.float32)],
    )  # fmt: skip
    shm = ShmSteps(layout, spin_s=spin_s)
    ctx = mp.get_context("spawn")
    cpu, ready = ctx.Array("d", ranks), ctx.Semaphore(0)
    procs = [ctx.Process(target=_rank_main, args=(shm.path, layout, r, spin_s, cpu, ready)) for r in range(ranks)]
    for p in procs:
        p.start()
    for _ in procs:  # every rank mapped the region; then a moment for its serve loop to start
        ready.acquire(timeout=60)
    time.sleep(0.5)
    gen = torch.Generator().manual_seed(0)
    one = np.ones(tokens, dtype=np.int64)
    base = {"table": np.zeros((tokens, 1), dtype=np.int32), "starts": one * 0, "counts": one * 0, "q_lens": one}
    times, bad = [], 0
    want_lse = torch.arange(tokens, dtype=torch.float32)[:, None].expand(tokens, ranks * HEADS_PER_RANK)
    t_cpu = time.process_time()
    try:
        for i in range(warmup + steps):
            q = torch.randn(tokens, ranks * HEADS_PER_RANK, D, generator=gen)
            step = dict(base, q=q, topk=torch.zeros(tokens, TOPK, dtype=torch.int32), kv=[], return_lse=True)
            t0 = time.perf_counter()
            out, lse = shm.run(step, timeout_s=30.0)
            t1 = time.perf_counter()
            bad += int(not (torch.equal(out, q[..., :DV]) and torch.equal(lse, want_lse)))
            if i == warmup - 1:
                t_cpu = time.process_time()
            if i >= warmup:
                times.append(t1 - t0)
        driver_cpu = time.process_time() - t_cpu
    finally:
        shm.stop()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        shm.close()
    us = sorted(t * 1e6 for t in times)
    return {
        "ranks": ranks,
        "steps": steps,
        "tokens": tokens,
        "spin_us": spin_s * 1e6,
        "median_us": statistics.median(us),
        "p90_us": us[int(0.9 * (len(us) - 1))],
        "p99_us": us[int(0.99 * (len(us) - 1))],
        "mean_us": statistics.fmean(us),
        "driver_cpu_us_per_step": driver_cpu / steps * 1e6,
        "rank_cpu_us_per_step": [c / (warmup + steps) * 1e6 for c in cpu],
        "wrong_outputs": bad,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--tokens", type=int, default=64, help="query tokens of each step (default 64)")
    p.add_argument("--spin-us", type=float, default=0.0, help="spin this long before sleeping (default 0: CPU pools)")
    add_json_argument(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    res = run(args.ranks, args.steps, args.tokens, args.spin_us / 1e6)
    print(
        "| ranks | tokens | spin us | median us | p90 us | p99 us | mean us | driver CPU us/step "
        "| rank CPU us/step |\n|---|---|---|---|---|---|---|---|---|\n"
        f"| {res['ranks']} | {res['tokens']} | {res['spin_us']:g} | {res['median_us']:.1f} | {res['p90_us']:.1f} "
        f"| {res['p99_us']:.1f} | {res['mean_us']:.1f} | {res['driver_cpu_us_per_step']:.1f} "
        f"| {', '.join(f'{c:.1f}' for c in res['rank_cpu_us_per_step'])} |"
    )
    env = environment()
    config = {"ranks": args.ranks, "tokens": args.tokens, "spin us": args.spin_us, "steps": args.steps}
    records = [record("shm-transport", config, f"round trip {q}", res[f"{q}_us"], "us", "lower", None, env)
               for q in ("median", "p99")]  # fmt: skip
    print_table(records, "the shared-memory transport alone")
    if res["wrong_outputs"]:  # no records of a transport that returned wrong rows
        print(f"{res['wrong_outputs']} steps returned wrong outputs or LSEs; no records written", file=sys.stderr)
        return 1
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
