"""Soak the Runtime: thousands of steps of random shapes, memory flat, nothing compiled after the warm-up.

Usage (one rank per GPU; on the CPU, gloo and a small model)::

    torchrun --nproc-per-node 1 benchmarks/soak_runtime.py --preset glm5 --minutes 10 --json soak_rt.json
    torchrun --nproc-per-node 2 benchmarks/soak_runtime.py --steps 10000 --details soak_rt_run.json   # CPU

Every rank builds one :class:`~shardattn.runtime.runtime.Runtime` (``mode="mixed"``: ShardQ or
head-TP prefill by the router, DCP decode) and runs ``--steps`` steps (or ``--minutes``), each
drawn from a seed every rank shares:

* a prefill of 1-4 requests, random new and cached lengths up to ``--max-tokens`` (its own KV
  cache and DSA-like top-k, built for the step);
* a decode of a random subset of ``--requests`` requests resident in one DCP-sharded KV cache
  built at start, random top-k positions (invalid ones included) per token; on a GPU through CUDA
  graph buckets (``Runtime.capture_decode``: batch 1, 2, 4, ... up to ``--max-batch``, padded), on
  the CPU through the same runner uncaptured.

The warm-up first runs one decode of every batch size (as a service warms what it serves: each
size's bucket and its load views), a checked prefill of ``--max-tokens`` and a checked decode of
``--max-batch`` (the checks' reference loads its torch kernels on first use), then
``--warmup-steps`` random steps. Every ``--check-every`` steps, ``--check-tokens`` tokens of the
step's output (its first and last among them) are compared with the library's single-process
torch reference (this rank's heads; at one shape, whatever the step's); every ``--sample-every``
steps the process's RSS (and on a GPU ``torch.cuda.memory_allocated``, ``memory_reserved`` and the
caching allocator's counts of segments taken from and given back to the driver, in ``--details``:
what moves the RSS of a GPU process beside the library's own host memory; and glibc's heap in use
and free but kept) is sampled between steps. After ``--warmup-steps``:

* memory growth: the median of the last three samples over the median of the first three after
  the warm-up, in % (RSS; CUDA allocated), and the live torch tensors of the process (counted
  after a collection), which must not grow at all;
* compiles: Triton kernel variants compiled by any ``shardattn.kernels`` kernel since the end of
  the warm-up (0 expected: the Runtime warms every variant its routes can take), and every prefill
  route's kernel variants checked against the Runtime's ``warmed_keys``.

Rank 0 prints a table of every rank's numbers (the verdict, table and records:
``benchmarks/soak_runtime_report.py``); ``--json`` writes ``runtime-soak`` records
(``benchmarks/records.py``), ``--details`` every number. Exit status 1 when a check fails, a step
compiles or leaves its route unwarmed after the warm-up, or (``--max-growth-pct``) memory grows more.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import add_json_argument, print_table, write_json
from soak_runtime_report import passed, render, soak_records
from soak_stats import LogHistogram, floor_growth, growth_pct, heap_bytes, live_tensors, rss_bytes

from shardattn.launch.local import run_ranks
from shardattn.launch.workloads import build_decode, build_prefill
from shardattn.ops.sparse_mla import sparse_mla_reference
from shardattn.ops.topk import DcpShard, convert_topk
from shardattn.plan.spec import ModelSpec, get_preset
from shardattn.runtime.cudagraph import GraphInput
from shardattn.runtime.options import PrefillOptions
from shardattn.runtime.runtime import Runtime
from shardattn.runtime.warmup import compiled_variants

TINY = ModelSpec("sparse_mla", 8, 1, 48, 32, 16, 16, dtype="float32", softmax_scale=0.3)  # CPU: 8 heads, top-k 16
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # the launcher's check


def compiled_kernels() -> int:
    """Triton / Gluon kernel variants compiled so far by every kernel of ``shardattn.kernels``."""
    total = 0
    for name, mod in list(sys.modules.items()):
        if not name.startswith("shardattn.kernels") or mod is None:
            continue
        for obj in vars(mod).values():
            if hasattr(obj, "device_caches") or (hasattr(obj, "cache") and hasattr(obj, "run")):
                try:
                    total += compiled_variants(obj)
                except (AttributeError, TypeError):
                    pass
    return total


def error(got: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor]) -> float:
    """Largest output error, and LSE error relative to ``max(1, |lse|)``; inf when -inf patterns differ.

    Computed where the step ran: only the numbers come to the host, not copies of the step's size.
    """
    out, lse = (t.detach().float() for t in got)
    rout, rlse = (t.detach().to(out.device).float() for t in ref)
    if out.shape != rout.shape or not torch.equal(torch.isfinite(lse), torch.isfinite(rlse)):
        return float("inf")
    err = float((out - rout).abs().max()) if out.numel() else 0.0
    fin = torch.isfinite(rlse)
    if bool(fin.any()):
        err = max(err, float(((lse[fin] - rlse[fin]).abs() / rlse[fin].abs().clamp(min=1.0)).max()))
    return err


class RuntimeSoak:
    """One rank's soak (module docstring)."""

    def __init__(self, group: dist.ProcessGroup, args: argparse.Namespace) -> None:
        self.args, self.group = args, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        spec = get_preset(args.preset) if cuda else TINY
        if args.topk is not None:
            spec = dataclasses.replace(spec, topk=args.topk)
        self.spec, self.dtype = spec, getattr(torch, spec.dtype)
        self.max_tokens = args.max_tokens or (8192 if cuda else 96)
        self.rt = Runtime(
            spec, group, max_batched_tokens=self.max_tokens, mode="mixed", device=self.device,
            max_decode_tokens=args.max_batch,
            prefill_options=PrefillOptions() if cuda else PrefillOptions(min_shard_tokens=1, min_group_tokens=1),
        )  # fmt: skip
        self.h = self.rt.heads_per_rank
        self.device_gen = torch.Generator(device=self.device)  # decode's draws, reseeded every step
        self._decode_world()
        self.stats: dict[str, Any] = {"prefill": LogHistogram(), "decode": LogHistogram(), "checks": 0}
        self.stats |= {"max_err": 0.0, "failed_checks": 0}
        self.stats |= {"unwarmed_routes": 0, "rss": [], "cuda": [], "reserved": [], "segments": [], "tensors": []}
        self.stats |= {"heap": []}
        self.stats |= {"steps": 0, "routes": {}, "kinds": {"prefill": 0, "decode": 0}}

    # -- the resident decode cache and its graph buckets -----------------------------------------
    def _decode_world(self) -> None:
        a, s = self.args, self.spec
        gen = torch.Generator().manual_seed(a.seed)
        cached = tuple(int(x) for x in torch.randint(1, a.context + 1, (a.requests,), generator=gen))
        self.base = build_decode(
            heads=s.num_heads, head_dim=s.head_dim, requests=a.requests, cached=cached, q_lens=(1,) * a.requests,
            topk=s.topk, overlap="random", causal=True, dtype=self.dtype, device=self.device, seed=a.seed,
            shard=DcpShard(self.world, 1, self.rank), block_size=s.page_size,
        )  # fmt: skip
        kv, d, k = self.base.local_kv, s.head_dim, s.topk
        m = int(self.base.local_table.shape[1])

        def step(q, topk_pos, req_ids, block_table, seq_lens):
            return self.rt.decode(q, kv, block_table, seq_lens, topk_pos=topk_pos, req_ids=req_ids, check=False)

        inputs = [
            GraphInput("q", (self.h, d), self.dtype, per="token"),
            GraphInput("topk_pos", (k,), torch.int32, per="token", pad_value=-1),
            GraphInput("req_ids", (), torch.int32, per="token"),
            GraphInput("block_table", (m,), torch.int32),
            GraphInput("seq_lens", (), torch.int32),
        ]
        sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < a.max_batch] + [a.max_batch]
        capture = self.device.type == "cuda" and not a.eager
        self.graphs = self.rt.capture_decode(step, inputs, batch_sizes=sizes, capture=capture)
        self.captured = capture

    # -- steps -----------------------------------------------------------------------------------
    def prefill(self, i: int, check: bool, tokens: int | None = None) -> None:
        g = torch.Generator().manual_seed(self.args.seed * 1_000_003 + i)  # the same on every rank
        reqs = int(torch.randint(1, 5, (1,), generator=g))
        drawn = int(torch.randint(reqs, self.max_tokens + 1, (1,), generator=g))
        tokens = drawn if tokens is None else tokens
        cached = tuple(int(x) for x in torch.randint(0, self.args.context + 1, (reqs,), generator=g))
        step = build_prefill(
            heads=self.spec.num_heads, head_dim=self.spec.head_dim, tokens=tokens, requests=reqs, cached=cached,
            topk=self.spec.topk, overlap="dsa", dtype=self.dtype, device=self.device, seed=i,
            block_size=self.spec.page_size,
        )  # fmt: skip
        plan = self.rt.plan_prefill(step.query_lens, step.prefix_lens, kv_rows=int(step.kv.shape[0]))
        heads = self.spec.num_heads if plan.step in ("shardq", "pcp") else self.h
        route = f"{plan.step}/{plan.route.path}" + (f" G={plan.route.group_size}" if plan.route.group_size > 1 else "")
        self.stats["routes"][route] = self.stats["routes"].get(route, 0) + 1
        if i >= self.args.warmup_steps and not self.rt.route_keys(plan.route, heads) <= self.rt.warmed_keys:
            self.stats["unwarmed_routes"] += 1
        q = step.q[:, self.rank * self.h : (self.rank + 1) * self.h].contiguous()
        t0 = time.perf_counter()
        out = self.rt.prefill(q, step.kv, step.rows, plan=plan, check=False)
        self._sync()
        self._timed("prefill", i, time.perf_counter() - t0)
        if check:
            t = self._checked(tokens, g)
            ref = sparse_mla_reference(step.q[t], step.kv, step.rows[t], scale=self.rt.scale, v_dim=self.spec.v_dim)
            self._judge((out[0][t], out[1][t]), ref)

    def decode(self, i: int, check: bool, batch: int | None = None) -> None:
        a, base = self.args, self.base
        g = torch.Generator().manual_seed(self.args.seed * 2_000_003 + i)
        b = int(torch.randint(1, a.max_batch + 1, (1,), generator=g)) if batch is None else batch
        idx = torch.randperm(a.requests, generator=g)[:b]
        dev_idx = idx.to(self.device)
        # q and the top-k made where an engine's would be (on the device), so that the process's
        # memory is the library's: CPU tensors of a random size each step would move glibc's
        # heap by megabytes between samples
        gd = self.device_gen.manual_seed(self.args.seed * 2_000_003 + i)
        lens = base.seq_lens.index_select(0, dev_idx)
        pos = (torch.rand(b, self.spec.topk, generator=gd, device=self.device) * (lens[:, None] + 2)).long() - 1
        pos = pos.to(torch.int32)  # -1 .. len
        q = torch.randn(b, self.spec.num_heads, self.spec.head_dim, generator=gd, device=self.device)
        q = (q * 0.5).to(self.dtype)
        feed = {
            "q": q[:, self.rank * self.h : (self.rank + 1) * self.h].contiguous(),
            "topk_pos": pos,
            "req_ids": torch.arange(b, dtype=torch.int32, device=self.device),
            "block_table": base.local_table.index_select(0, dev_idx),
            "seq_lens": base.seq_lens.index_select(0, dev_idx),
        }
        t0 = time.perf_counter()
        # a replay of the smallest bucket that fits; uncaptured (the CPU), the same padded buffers eagerly
        out = self.graphs.run(b, **feed) if self.captured else self.graphs.eager(b, **feed)
        self._sync()
        self._timed("decode", i, time.perf_counter() - t0)
        if check:
            table = base.block_table.index_select(0, dev_idx)
            rows, _ = convert_topk(
                pos, feed["req_ids"], table, block_size=self.spec.page_size, seq_lens=feed["seq_lens"]
            )
            t = self._checked(b, g)
            ref = sparse_mla_reference(q[t], base.kv, rows[t], scale=self.rt.scale, v_dim=self.spec.v_dim)
            self._judge((out[0][t], out[1][t]), ref)

    def _timed(self, kind: str, i: int, seconds: float) -> None:
        """Count step ``i`` (negative: a warm-up call before the loop) and time it after the warm-up."""
        if i >= 0:
            self.stats["kinds"][kind] += 1
        if i >= self.args.warmup_steps:
            self.stats[kind].add(seconds)

    def _checked(self, tokens: int, g: torch.Generator) -> torch.Tensor | slice:
        """The tokens a check compares: ``--check-tokens`` of them (the first, the last, the rest
        drawn with replacement), so that the reference runs at one shape whatever the step's size and
        the torch kernels it calls keep no per-shape state that a memory sample would count; every
        token with ``--check-tokens 0``."""
        n = self.args.check_tokens
        if n <= 0:
            return slice(None)
        picks = torch.randint(0, tokens, (n,), generator=g)
        picks[0], picks[-1] = 0, tokens - 1
        return picks.to(self.device)

    def _judge(self, got: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor]) -> None:
        heads = slice(self.rank * self.h, (self.rank + 1) * self.h)
        err = error(got, (ref[0][:, heads], ref[1][:, heads]))
        self.stats["checks"] += 1
        self.stats["max_err"] = max(self.stats["max_err"], err)
        if not err <= TOLERANCE[self.dtype]:
            self.stats["failed_checks"] += 1

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def sample(self) -> None:
        self.stats["rss"].append(rss_bytes())  # before the tensor count, whose object list is megabytes
        self.stats["heap"].append(heap_bytes())  # glibc: in use, free but kept
        self.stats["tensors"].append(live_tensors())  # collects first
        if self.device.type == "cuda":
            self.stats["cuda"].append(torch.cuda.memory_allocated(self.device))
            self.stats["reserved"].append(torch.cuda.memory_reserved(self.device))
            ms = torch.cuda.memory_stats(self.device)  # segments taken from and given back to the driver
            self.stats["segments"].append([ms.get(k, -1) for k in ("num_device_alloc", "num_device_free")])

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        a = self.args
        deadline = time.monotonic() + a.minutes * 60 if a.minutes else float("inf")
        compiled_at_warm = None
        for b in range(1, a.max_batch + 1):  # a service warms every batch size it serves (graph buckets, views)
            self.decode(-b, False, batch=b)
        # the checks' own first runs at the largest shapes (the reference's torch kernels load on first use)
        self.prefill(-1, a.check_every > 0, tokens=self.max_tokens)
        self.decode(-a.max_batch - 1, a.check_every > 0, batch=a.max_batch)
        i = 0
        while not a.steps or i < a.steps:  # --minutes: the broadcast below ends the loop
            if i == a.warmup_steps:
                compiled_at_warm = compiled_kernels()
            check = a.check_every > 0 and i % a.check_every == 0
            pick = torch.Generator().manual_seed(a.seed + 3 * i)  # the step kind, the same on every rank
            if float(torch.rand(1, generator=pick)) < a.prefill_share:
                self.prefill(i, check)
            else:
                self.decode(i, check)
            if i >= a.warmup_steps and (i - a.warmup_steps) % a.sample_every == 0:
                self.sample()
            i += 1
            if a.minutes and i % 50 == 0:  # every rank stops at the same step: rank 0's clock decides, every 50
                flag = torch.tensor([int(time.monotonic() >= deadline)], device=self.rt.comm.device)
                dist.broadcast(flag, 0, group=self.group)
                if int(flag):
                    break
        self.sample()
        self.stats["steps"] = i
        compiled_end = compiled_kernels()
        if compiled_at_warm is None:  # the run ended inside the warm-up: nothing after it to judge
            return self.summary(None)
        return self.summary(compiled_end - compiled_at_warm)

    def summary(self, compiles_after_warmup: int | None) -> dict[str, Any]:
        """Every number of the run; ``compiles_after_warmup`` None when the run ended inside the warm-up."""
        s = self.stats

        return {
            "rank": self.rank,
            "device": str(self.device),
            "steps": s["steps"],
            "prefill_steps": s["kinds"]["prefill"],
            "decode_steps": s["kinds"]["decode"],
            "decode_graphs": sorted(self.graphs.graphs) if self.captured else [],
            "routes": s["routes"],
            "checks": s["checks"],
            "failed_checks": s["failed_checks"],
            "max_err": s["max_err"],
            "unwarmed_routes": s["unwarmed_routes"],
            "compiles_after_warmup": compiles_after_warmup,
            "live_tensors": s["tensors"],
            "live_tensor_growth": floor_growth(s["tensors"]),
            "rss_mb": [v / 2**20 for v in s["rss"]],
            "rss_growth_pct": growth_pct(s["rss"]),
            "heap_in_use_free_mb": [None if h is None else [v / 2**20 for v in h] for h in s["heap"]],
            "cuda_allocated_mb": [v / 2**20 for v in s["cuda"]],
            "cuda_growth_pct": growth_pct(s["cuda"]),
            "cuda_reserved_mb": [v / 2**20 for v in s["reserved"]],
            "cuda_segments_allocated_freed": s["segments"],
            "prefill_ms": {"p50": s["prefill"].quantile(0.5) * 1e3, "p99": s["prefill"].quantile(0.99) * 1e3},
            "decode_ms": {"p50": s["decode"].quantile(0.5) * 1e3, "p99": s["decode"].quantile(0.99) * 1e3},
        }


class _Entry:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def __call__(self, group: dist.ProcessGroup) -> None:
        soak = RuntimeSoak(group, self.args)
        mine = soak.run() | {"preset": self.args.preset if soak.device.type == "cuda" else "tiny (8 heads, CPU)"}
        ranks: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(ranks, mine, group=group)
        ok = passed(ranks, self.args.max_growth_pct)
        if dist.get_rank(group) == 0:
            render(ranks, ok)
            records = soak_records(ranks, self.args, len(ranks))
            print_table(records, "Runtime soak")
            write_json(self.args.json, records)
            if self.args.details:
                with open(self.args.details, "w") as f:
                    json.dump({"passed": ok, "ranks": ranks, "args": vars(self.args)}, f, indent=1)
        if not ok:
            raise SystemExit(1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="glm5", help="model on a GPU (the CPU runs a small 8-head model)")
    p.add_argument("--steps", type=int, default=None, help="steps (default 10,000; with --minutes: no limit)")
    p.add_argument("--minutes", type=float, default=0.0, help="stop after this long (0: --steps only)")
    p.add_argument("--warmup-steps", type=int, default=500, help="memory and compiles count from this step on")
    p.add_argument("--check-every", type=int, default=50, help="compare a step with the reference every N steps")
    p.add_argument("--check-tokens", type=int, default=16, help="tokens a check compares, first and last among them "
                   "(0: all)")  # fmt: skip
    p.add_argument("--sample-every", type=int, default=100, help="sample memory every N steps after the warm-up")
    p.add_argument("--prefill-share", type=float, default=0.3, help="share of prefill steps (the rest decode)")
    p.add_argument("--max-tokens", type=int, default=None, help="largest prefill step (default 8192 GPU, 96 CPU)")
    p.add_argument("--max-batch", type=int, default=64, help="largest decode batch (requests of one token)")
    p.add_argument("--requests", type=int, default=128, help="requests resident in the decode cache")
    p.add_argument("--context", type=int, default=None, help="longest cached context (default 8192 GPU, 64 CPU)")
    p.add_argument("--topk", type=int, default=None, help="top-k (default: the model's)")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs on a GPU")
    p.add_argument("--max-growth-pct", type=float, default=None, help="fail when memory grows more after warm-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--details", default=None, metavar="PATH", help="write every rank's numbers here (JSON)")
    add_json_argument(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.steps is None:
        args.steps = 0 if args.minutes else 10000
    if args.context is None:
        args.context = 8192 if torch.cuda.is_available() else 64
    if args.steps and args.steps <= args.warmup_steps:
        print(f"--steps {args.steps} must exceed --warmup-steps {args.warmup_steps}: memory, compiles and step "
              "times count after the warm-up", file=sys.stderr)  # fmt: skip
        return 2
    if args.requests < args.max_batch:
        print(f"--requests {args.requests} must be at least --max-batch {args.max_batch}", file=sys.stderr)
        return 2
    if "RANK" not in os.environ:
        print("run under torchrun (one rank per GPU; gloo ranks on the CPU)", file=sys.stderr)
        return 2
    run_ranks(_Entry(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
