"""Soak the Ray pool: a service's traffic for minutes, ranks killed at random, every output checked.

Usage (Ray; CPU ranks on gloo, or one GPU per rank)::

    python benchmarks/soak_pool.py --minutes 30 --json soak.json --details soak_run.json   # kills every ~90 s
    python benchmarks/soak_pool.py --steps 80 --kill-steps 20 --fault-steps 50 --kill-every 0 --details ci.json

A ``--ranks``-rank pool (``mode="mixed"``: ShardQ prefill, DCP decode over a paged KV cache) of a
small sparse-MLA model serves requests that arrive at random (prompt 4-64 tokens, 1-24 generated),
are prefilled in random chunks, decoded in random batches (some with two draft tokens; through
``pool.decode`` and ``pool.decode_batch``), and freed when done. Requests are admitted while their
final lengths fit ``--overcommit`` times the KV pages, so the cache runs near capacity; a step that
would not fit first preempts the newest request the pool holds (freed, served again later). Every
output is compared with fp64 attention over the request's whole cache
(``shardattn.testing.serving.ServingMirror``).

Faults: a thread kills a random rank's process (SIGKILL) at random moments (``--kill-every`` s on
average), mid-step or between steps; ``--kill-steps`` / ``--fault-steps`` do it at given steps
(between steps, and inside a step through ``pool.arm_fault``). The next call raises
``RankFailedError``; ``pool.restart()`` returns the requests whose KV state was lost, which must be
exactly the requests the pool held, and they are served again as new requests. Every
``--refuse-every`` steps a request that cannot fit (longer than ``max_seq_len``: the error names the
request; more pages than are free: "out of KV pages") must raise a ``ValueError`` and leave the
pool healthy and its ledger unchanged.

Recorded: step times (p50 / p99 per kind), the driver's and every rank's RSS (and, on GPUs, CUDA
allocated memory) over the run, live torch tensors on the driver and on every rank, KV pages in use
against the pages the served requests need (a leak shows as a difference), and at the end, with
every request freed, the free pages and the driver's live tensors against the start. Memory growth
is the median of the last samples over the median of the first samples after the warm-up
(``--warmup-s``; a rank's per process, restarts start a new one). Prints a table; ``--json`` writes
the ``pool-soak`` records (``benchmarks/records.py``), ``--details`` every number of the run. Exit
status 1 when an output is wrong, a request is lost unreported, a page or a tensor leaks, a refusal
is unclear, or (with ``--max-growth-pct``) memory grows more than that.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import add_json_argument, print_table, write_json
from soak_pool_report import render, soak_records, summarize
from soak_pool_traffic import Traffic
from soak_stats import LogHistogram, live_tensors, rss_bytes

from shardattn.plan.spec import ModelSpec, get_preset
from shardattn.runtime.options import PrefillOptions

ATOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def pool_spec(args: argparse.Namespace) -> ModelSpec:
    """The served model: ``tiny`` (8 heads of 48 dims, top-k 16, pages of 4, fp32; the CPU's), or a
    preset in bf16 with ``--topk`` (the GPU kernels' head dims)."""
    if args.preset == "tiny":
        dtype = "float32" if args.device == "cpu" else "bfloat16"
        return ModelSpec("sparse_mla", 8, 1, 48, 32, 16, 4, dtype=dtype, softmax_scale=0.3)
    spec = get_preset(args.preset)
    return dataclasses.replace(spec, topk=args.topk or spec.topk, dtype="bfloat16")


def rank_live_tensors(group: Any) -> int:
    """Live torch tensors in a rank's process (run on every rank through ``pool.run``)."""
    return live_tensors()


class Soak:
    """The traffic, the checks and the records of one run (module docstring)."""

    def __init__(self, args: argparse.Namespace) -> None:
        from shardattn.serving import RayRankPool
        from shardattn.testing.serving import ServingMirror

        self.args = args
        self.rng = random.Random(args.seed)
        self.spec = pool_spec(args)
        self.atol = ATOL[getattr(torch, self.spec.dtype)]
        self.mirror = ServingMirror(self.spec, seed=args.seed)
        if args.num_pages is None:  # a third of what max_requests requests of the mean length hold
            from shardattn.plan.context import DCPLayout
            from shardattn.plan.kv_cache_config import KVCacheConfig

            mean = KVCacheConfig(self.spec.page_size, DCPLayout(args.ranks), args.max_requests, args.max_seq_len)
            args.num_pages = max(4, args.max_requests * mean.pages_for(47) // 3)
        runtime = {
            "max_batched_tokens": 128,
            "max_decode_tokens": 32,
            "prefill_options": PrefillOptions(min_shard_tokens=1),
        }
        self.pool = RayRankPool(
            args.ranks, self.spec, mode="mixed", max_requests=args.max_requests, max_seq_len=args.max_seq_len,
            num_pages=args.num_pages, runtime_kwargs=runtime, device=args.device, timeout_s=60.0,
        )  # fmt: skip
        self.cfg = self.pool.cache_config
        self.start_free = self.pool.book.free_pages
        self.t0 = time.monotonic()
        self.times = {k: LogHistogram() for k in ("prefill", "decode", "decode_batch")}
        self.counts = {"arrived": 0, "completed": 0, "outputs_checked": 0, "wrong_outputs": 0, "steps": 0}
        self.counts |= {"failures": 0, "lost_reported": 0, "lost_unreported": 0, "reported_unknown": 0}
        self.counts |= {"refused": 0, "refusals_unclear": 0, "page_mismatches": 0, "requeued": 0, "preempted": 0}
        self.max_err = 0.0
        self.errors: list[str] = []
        self.refusals: dict[str, int] = {}
        self.usage = {"n": 0, "sum": 0.0, "max": 0.0}
        # (t, value) of the driver; (t, generation, rank, value) of the ranks
        self.mem: dict[str, Any] = {"driver": [], "tensors": [], "ranks": [], "rank_tensors": [], "rank_cuda": []}
        self.generation = 0
        self.gen_start = 0.0
        self.serving = threading.Event()
        self.kills: list[dict[str, Any]] = []
        self.kill_steps, self.fault_steps = set(args.kill_steps), set(args.fault_steps)
        self.traffic = Traffic(self.rng, self.cfg, args.max_seq_len, args.overcommit, self.counts)
        gc.collect()
        self.tensors_start = live_tensors()  # before any request (the pool built)

    def note(self, error: str) -> None:
        """Keep the first 50 error messages (counts keep counting)."""
        if len(self.errors) < 50:
            self.errors.append(error)

    # -- the traffic ---------------------------------------------------------------------------
    def evict(self, request_id: int) -> None:
        """Free a preempted request on the pool and in the mirror."""
        self.pool.free([request_id])
        self.mirror.free(request_id)

    def make_room(self, step: list[tuple[Any, int]]) -> list[tuple[Any, int]]:
        return self.traffic.make_room(step, lambda: self.pool.book.free_pages, self.evict)

    def check(self, outs: list[Any], reqs: list[Any]) -> None:
        """Count each request's ``(out, lse)`` against the mirror's fp64 attention: wrong where the
        shape, the pattern of finite LSEs or a non-finite output differs, or an error (absolute;
        NaN included) is not within ``atol``; a request the pool returned nothing for is wrong."""
        if len(outs) != len(reqs):
            self.counts["wrong_outputs"] += abs(len(reqs) - len(outs))
            self.note(f"{len(outs)} outputs for {len(reqs)} requests")
        for (out, lse), req in zip(outs, reqs):
            ref_out, ref_lse = self.mirror.expected(req)
            fin = torch.isfinite(ref_lse)
            ok = out.shape == ref_out.shape and torch.equal(torch.isfinite(lse), fin)
            ok = ok and bool(torch.isfinite(out).all())
            err = float((out.double() - ref_out).abs().max()) if ok and out.numel() else 0.0
            if ok and bool(fin.any()):
                err = max(err, float((lse.double()[fin] - ref_lse[fin]).abs().max()))
            self.max_err = max(self.max_err, err)
            self.counts["outputs_checked"] += 1
            if not (ok and err <= self.atol):  # a NaN error fails here
                self.counts["wrong_outputs"] += 1
                self.note(f"request {req.id}: error {err:.3g} (shape and finite values ok: {ok})")

    def prefill_step(self) -> bool:
        chunks = self.make_room(self.traffic.prefill_chunks())
        if not chunks:
            return False
        reqs = [self.mirror.prefill_request(r.id, n) for r, n in chunks]
        for r, n in chunks:  # the pool commits its ledger before the ranks run: held from here on
            r.prefilled += n
        t = time.perf_counter()
        outs = self.pool.prefill(reqs, return_lse=True)
        self.times["prefill"].add(time.perf_counter() - t)
        self.check(outs, reqs)
        return True

    def decode_step(self) -> bool:
        batch = self.make_room(self.traffic.decode_batch())
        if not batch:
            return False
        reqs = [self.mirror.decode_request(r.id, q) for r, q in batch]
        for r, q in batch:
            r.generated += q
        due = [s for s in self.fault_steps if s <= self.counts["steps"]]  # the first decode step from there
        if due:
            self.fault_steps.discard(min(due))
            self.pool.arm_fault(self.rng.randrange(self.args.ranks), "exit", "decode")  # dies inside the step
            self.kills.append(
                {"t": time.monotonic() - self.t0, "how": "inside a decode step", "step": self.counts["steps"]}
            )
        t = time.perf_counter()
        if self.rng.random() < 0.5:
            kind, outs = "decode", self.pool.decode(reqs, return_lse=True)
        else:
            ids = torch.tensor([r.id for r in reqs], dtype=torch.int64)
            q_lens = [int(r.q.shape[0]) for r in reqs]
            out, lse = self.pool.decode_batch(
                ids, torch.cat([r.q for r in reqs]), torch.cat([r.topk_pos for r in reqs]), query_lens=q_lens,
                kv=torch.cat([r.kv for r in reqs]), return_lse=True,
            )  # fmt: skip
            kind, outs = "decode_batch", list(zip(out.split(q_lens), lse.split(q_lens)))
        self.times[kind].add(time.perf_counter() - t)
        self.check(outs, reqs)
        return True

    def finish(self) -> None:
        done = self.traffic.take_done()
        if done:
            self.pool.free(done)
            for i in done:
                self.mirror.free(i)

    def refuse(self) -> None:
        """A request that cannot fit: a clear ValueError naming it, and nothing changes."""
        free, held = self.pool.book.free_pages, len(self.pool.book)
        n = self.args.max_seq_len + 1
        if free < self.cfg.pages_per_request and len(self.traffic.active) < self.cfg.max_requests:
            n = self.args.max_seq_len  # fits max_seq_len, but not the pages left
        g = torch.Generator().manual_seed(self.counts["steps"])
        d = self.spec.head_dim
        from shardattn.serving.requests import PrefillRequest

        bad = PrefillRequest(-1, kv=torch.randn(n, d, generator=g).to(self.mirror.dtype))
        try:
            self.pool.prefill([bad])
            self.counts["refusals_unclear"] += 1
            self.note(f"a request of {n} tokens was not refused")
        except ValueError as e:
            msg = str(e)
            clear = {"max_seq_len": "request -1: " in msg and "exceed max_seq_len" in msg,
                     "pages": msg.startswith("out of KV pages: the step needs")}  # fmt: skip
            kind = next((k for k, ok in clear.items() if ok), "unclear")
            self.refusals[kind] = self.refusals.get(kind, 0) + 1
            self.counts["refused"] += 1
            unchanged = self.pool.book.free_pages == free and len(self.pool.book) == held
            healthy = self.pool.health()["state"] == "healthy"
            if kind == "unclear" or not unchanged or not healthy:
                self.counts["refusals_unclear"] += 1
                self.note(f"refusal: {msg!r} (ledger unchanged {unchanged}, healthy {healthy})")

    # -- faults ---------------------------------------------------------------------------------
    def kill_rank(self, why: str) -> None:
        r = self.rng.randrange(self.args.ranks)
        pid = int(self.pool.built[r]["pid"])
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.kills.append({"t": time.monotonic() - self.t0, "rank": r, "how": why, "step": self.counts["steps"]})

    def killer(self, stop: threading.Event) -> None:
        krng = random.Random(self.args.seed + 1)
        while not stop.wait(krng.expovariate(1.0 / self.args.kill_every)):
            if self.serving.is_set():
                self.kill_rank("random moment")

    def recover(self, err: Exception) -> None:
        """After a RankFailedError: restart, compare the lost requests with those the pool held, and
        queue them again as new requests."""
        self.serving.clear()
        self.counts["failures"] += 1
        held = self.traffic.held()
        for attempt in range(3):
            try:
                lost = set(self.pool.restart())
                break
            except Exception as e:  # a kill that landed during the restart: once more
                if attempt == 2:
                    raise
                self.note(f"restart attempt {attempt}: {type(e).__name__}: {str(e)[:200]}")
        self.counts["lost_reported"] += len(lost)
        self.counts["lost_unreported"] += len(held - lost)
        self.counts["reported_unknown"] += len(lost - held)
        if held != lost:
            self.note(f"after {str(err)[:120]}: held {sorted(held)}, restart() reported {sorted(lost)}")
        for i in held:  # the others were admitted but never reached the ranks: they wait on
            self.mirror.free(i)
            self.traffic.requeue(self.traffic.active.pop(i))  # served again, as a new request
            self.counts["requeued"] += 1
        self.generation += 1
        self.gen_start = time.monotonic() - self.t0
        self.serving.set()

    # -- records ----------------------------------------------------------------------------------
    def check_pages(self) -> None:
        in_use = int(self.cfg.num_pages) - self.pool.book.free_pages
        need = sum(self.cfg.pages_for(r.length) for r in self.traffic.active.values() if r.length > 0)
        frac = in_use / int(self.cfg.num_pages)
        self.usage = {"n": self.usage["n"] + 1, "sum": self.usage["sum"] + frac, "max": max(self.usage["max"], frac)}
        if in_use != need:
            self.counts["page_mismatches"] += 1
            self.note(f"step {self.counts['steps']}: {in_use} pages in use, the requests need {need}")

    def sample_memory(self) -> None:
        t = time.monotonic() - self.t0
        self.mem["driver"].append((t, rss_bytes()))
        self.mem["tensors"].append((t, live_tensors()))
        for rank in self.pool.health(timeout_s=10.0)["ranks"]:
            if rank.get("rss_bytes", -1) > 0:
                self.mem["ranks"].append((t, self.generation, rank["rank"], rank["rss_bytes"]))
            if "cuda_allocated_bytes" in rank:
                self.mem["rank_cuda"].append((t, self.generation, rank["rank"], rank["cuda_allocated_bytes"]))
        for r, n in enumerate(self.pool.run(rank_live_tensors)):
            self.mem["rank_tensors"].append((t, self.generation, r, n))

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        from shardattn.serving import RankFailedError

        a = self.args
        stop = threading.Event()
        thread = threading.Thread(target=self.killer, args=(stop,), daemon=True) if a.kill_every > 0 else None
        self.serving.set()
        if thread is not None:
            thread.start()
        deadline = self.t0 + a.minutes * 60 if a.minutes else float("inf")
        next_sample = 0.0
        try:
            while time.monotonic() < deadline and (not a.steps or self.counts["steps"] < a.steps):
                if not a.requests or self.counts["arrived"] < a.requests:
                    self.traffic.arrive()
                self.traffic.admit()
                step = self.counts["steps"]
                try:
                    if step in self.kill_steps:
                        self.kill_steps.discard(step)
                        self.kill_rank("between steps")
                    if a.refuse_every and step % a.refuse_every == a.refuse_every - 1:
                        self.refuse()
                    ran = self.prefill_step() if self.rng.random() < 0.35 else False
                    ran = self.decode_step() or ran
                    self.finish()
                    self.counts["steps"] += 1
                    self.check_pages()
                    now = time.monotonic() - self.t0
                    if now >= next_sample or (a.sample_steps and step % a.sample_steps == 0):
                        self.sample_memory()
                        next_sample = now + a.sample_s
                except RankFailedError as e:
                    self.recover(e)
                    continue
                if not ran and not self.traffic.waiting and not self.traffic.active and a.requests:
                    break
        finally:
            stop.set()
            self.serving.clear()
        # the end: every request freed, every page back
        try:
            self.sample_memory()
        except RankFailedError as e:  # a kill just before the end
            self.recover(e)
        if self.traffic.active:
            held = list(self.traffic.held())
            if held:
                self.pool.free(held)
            for i in held:
                self.mirror.free(i)
            self.traffic.active.clear()
        self.traffic.waiting.clear()
        gc.collect()
        self.tensors_end = live_tensors()
        return summarize(self)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=0.0, help="stop after this long (0: --steps / --requests)")
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: no limit)")
    p.add_argument("--requests", type=int, default=0, help="arrivals in all, then drain (0: no limit)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto")
    p.add_argument("--max-requests", type=int, default=32)
    p.add_argument("--max-seq-len", type=int, default=96)
    p.add_argument("--num-pages", type=int, default=None,
                   help="KV pages per rank (default: what a third of --max-requests requests hold)")  # fmt: skip
    p.add_argument("--preset", default=None, help="the model: tiny (default on the CPU) or a preset (GPU: glm5)")
    p.add_argument("--topk", type=int, default=None, help="top-k of a preset (default 256)")
    p.add_argument("--overcommit", type=float, default=1.5, help="admit final lengths up to this x the pages")
    p.add_argument("--kill-every", type=float, default=90.0, help="mean seconds between random kills (0: none)")
    p.add_argument("--kill-steps", type=int, nargs="*", default=[], help="kill a rank before these steps")
    p.add_argument("--fault-steps", type=int, nargs="*", default=[], help="a rank exits inside these decode steps")
    p.add_argument("--refuse-every", type=int, default=50, help="try a request that cannot fit every N steps")
    p.add_argument("--warmup-s", type=float, default=60.0, help="memory growth counts from this long after a start")
    p.add_argument("--sample-s", type=float, default=10.0, help="seconds between memory samples")
    p.add_argument("--sample-steps", type=int, default=0, help="also sample every N steps (short runs)")
    p.add_argument("--max-growth-pct", type=float, default=None, help="fail when RSS grows more (after warm-up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--details", default=None, metavar="PATH", help="write every number of the run here (JSON)")
    add_json_argument(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not (args.minutes or args.steps or args.requests):
        args.minutes = 10.0
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= args.ranks else "cpu"
    if args.preset is None:
        args.preset = "tiny" if args.device == "cpu" else "glm5"
    if args.preset != "tiny" and args.topk is None:
        args.topk = 256
    import ray

    ray.init(include_dashboard=False, log_to_driver=False, num_cpus=max(4, args.ranks + 2),
             num_gpus=args.ranks if args.device == "cuda" else 0)  # fmt: skip
    soak = None
    try:
        soak = Soak(args)
        res = soak.run()
    finally:
        if soak is not None:
            soak.pool.shutdown()
        ray.shutdown()
    render(res)
    records = soak_records(res, args)
    print_table(records, "Ray pool soak")
    write_json(args.json, records)
    if args.details:
        with open(args.details, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
