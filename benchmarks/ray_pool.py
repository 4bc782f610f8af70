"""The Ray pool's decode step against the same step under torchrun, in alternating rounds.

    python benchmarks/ray_pool.py --json ray_pool.json                 # W GPUs, Ray, torchrun
    python benchmarks/ray_pool.py --device cpu --preset tiny --requests 8 --context 32 --iters 5 --rounds 1

One ``W``-rank pool (:class:`~shardattn.serving.RayRankPool`, mode ``mixed``, NCCL on
GPUs, gloo on the CPU) is built and checked against fp64 attention computed from the definition
(:mod:`shardattn.testing.serving`): a ShardQ prefill of ``--prefill`` tokens, then ``B``
requests of ``L`` cached tokens written, and one DCP decode step of the ``B`` requests through
each API (``decode(requests)``, ``decode_batch``, and ``decode_batch`` with its inputs written in
place into ``pool.step_inputs()`` and its outputs taken as views, ``view=True``). Then
``--rounds`` rounds, each:

1. the baseline: ``torchrun --nproc-per-node W -m shardattn.launch --preset P --mode dcp-decode
   --requests B --cached L`` (the same decode step, ranks started by torchrun, inputs already on
   the devices; its slowest rank's median), while the pool sits idle;
2. the pool's decode step on the driver's clock through each API, ``--iters`` steps after 5
   warm-up steps (medians).

Records (``ray-pool``): per API the median over rounds of the pool's step, against the median
over rounds of the baseline, and the median over rounds of the per-round difference. On the CPU
(``--device cpu``, the ``tiny`` preset: 8 heads of 48 dims, top-k 16) there is no torchrun
baseline; the pool's step is recorded alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import add_json_argument, environment, print_table, record, write_json

from shardattn.launch.workloads import request_topk
from shardattn.plan.spec import ModelSpec, get_preset

BENCHMARK = "ray-pool"
TOLERANCE = 3e-2  # bf16, the launcher's check
TINY = ModelSpec("sparse_mla", 8, 1, 48, 32, 16, 4, softmax_scale=0.3)
APIS = ("decode_batch", "decode_batch, inputs in place, outputs as views", "decode(requests)")


def model_spec(args: argparse.Namespace) -> ModelSpec:
    """The preset in bf16 (``tiny`` for CPU runs), top-k overridden by ``--topk``."""
    spec = TINY if args.preset == "tiny" else get_preset(args.preset)
    return dataclasses.replace(spec, dtype="bfloat16", topk=args.topk or spec.topk)


def torchrun_step_ms(args: argparse.Namespace) -> float:
    """One ``torchrun -m shardattn.launch`` run of the decode step: its slowest rank's median (the
    launcher checks the step against the reference after timing it; a failed check fails the run)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "torchrun.json"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks),
            "-m", "shardattn.launch", "--preset", args.preset, "--mode", "dcp-decode",
            "--requests", str(args.requests), "--cached", str(args.context), "--iters", str(args.iters),
            "--warmup", "5", "--no-progress", "--check", "--json", str(report), "--device", args.device,
            "--topk", str(args.topk or get_preset(args.preset).topk), "--dtype", "bf16",
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.torchrun_timeout)
        if proc.returncode != 0 or not report.exists():
            raise RuntimeError(f"the torchrun baseline failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        return max(r["time_ms"] for r in json.loads(report.read_text())["rows"])


def errors(outs: list[Any], requests: list[Any], mirror: Any, device: str) -> float:
    """Largest error of the pool's ``(out, lse)`` per request against fp64 attention (out: absolute;
    LSE: relative, at least 1 as denominator); ``inf`` when a value is not finite where it should be."""
    worst = 0.0
    for (out, lse), req in zip(outs, requests, strict=True):
        ref_out, ref_lse = mirror.expected(req, device=device)
        fin = torch.isfinite(ref_lse)
        if not torch.isfinite(out).all() or not torch.equal(fin, torch.isfinite(lse)):
            return float("inf")
        worst = max(worst, float((out.double() - ref_out).abs().max()))
        if fin.any():
            rel = (lse.double()[fin] - ref_lse[fin]).abs() / ref_lse[fin].abs().clamp(min=1.0)
            worst = max(worst, float(rel.max()))
    return worst


def build_checked_pool(args: argparse.Namespace) -> tuple[Any, list[int]]:
    """The pool with ``B`` requests of ``L`` tokens cached, its prefill and each decode API checked
    against fp64 attention (a ``RuntimeError`` when one is off); returns it and the lengths."""
    from shardattn.serving import RayRankPool
    from shardattn.testing.serving import ServingMirror

    spec = model_spec(args)
    pool = RayRankPool(
        args.ranks, spec, mode="mixed", max_requests=args.requests + 4,
        max_seq_len=max(args.context, *args.prefill) + 256, device=args.device, timeout_s=300,
        transport=args.transport, init_ray=False,
        runtime_kwargs={"max_batched_tokens": 4096, "max_decode_tokens": args.requests, "warmup": False},
    )  # fmt: skip
    try:
        mirror, dev, b = ServingMirror(spec, seed=0), args.device, args.requests
        reqs = [mirror.prefill_request(f"p{i}", n) for i, n in enumerate(args.prefill)]
        checks = {"ShardQ prefill": errors(pool.prefill(reqs, return_lse=True), reqs, mirror, dev)}
        for i in range(len(args.prefill)):
            pool.free([f"p{i}"])
            mirror.free(f"p{i}")
        for b0 in range(0, b, 8):
            pool.prefill([mirror.prefill_request(i, args.context, attend=False) for i in range(b0, min(b0 + 8, b))])
        reqs = [mirror.decode_request(i) for i in range(b)]
        checks["decode(requests)"] = errors(pool.decode(reqs, return_lse=True), reqs, mirror, dev)
        reqs = [mirror.decode_request(i) for i in range(b)]
        q, pos = torch.cat([r.q for r in reqs]), torch.cat([r.topk_pos for r in reqs])
        out, lse = pool.decode_batch(torch.arange(b), q, pos, kv=torch.cat([r.kv for r in reqs]), return_lse=True)
        checks["decode_batch"] = errors(list(zip(out.split(1), lse.split(1))), reqs, mirror, dev)
        reqs = [mirror.decode_request(i) for i in range(b)]
        slots = pool.step_inputs(b)
        for name in ("q", "topk_pos", "kv"):
            torch.cat([getattr(r, name) for r in reqs], out=slots[name])
        out, lse = pool.decode_batch(torch.arange(b), slots["q"], slots["topk_pos"], kv=slots["kv"], return_lse=True,
                                     view=True)  # fmt: skip
        checks["decode_batch, in place, views"] = errors(list(zip(out.split(1), lse.split(1))), reqs, mirror, dev)
        reqs = [mirror.decode_request(i, append=False) for i in range(b)]  # the timed form: no new KV row
        q, pos = torch.cat([r.q for r in reqs]), torch.cat([r.topk_pos for r in reqs])
        out, lse = pool.decode_batch(torch.arange(b), q, pos, return_lse=True)
        checks["decode_batch, no new KV row"] = errors(list(zip(out.split(1), lse.split(1))), reqs, mirror, dev)
        print("checks against fp64 attention (largest error):", {k: f"{v:.2e}" for k, v in checks.items()})
        bad = [k for k, v in checks.items() if not v <= TOLERANCE]
        if bad:
            raise RuntimeError(f"off fp64 attention by more than {TOLERANCE}: {bad}")
        return pool, [mirror.requests[i].length for i in range(b)]
    except BaseException:
        pool.shutdown()
        raise


def step_tensors(args: argparse.Namespace, spec: ModelSpec, lens: list[int]) -> dict[str, torch.Tensor]:
    """The timed step (no new KV row, as the torchrun step): ``ids [B]``, ``q [B, H, D]`` bf16 and
    ``topk [B, K]`` int32 (DSA-like)."""
    b = args.requests
    topk = request_topk([n - 1 for n in lens], [1] * b, spec.topk, overlap="dsa", seed=1,
                        device=torch.device("cpu"), limits=lens).to(torch.int32)  # fmt: skip
    q = (torch.randn(b, spec.num_heads, spec.head_dim) * 0.5).to(torch.bfloat16)
    return {"ids": torch.arange(b), "q": q, "topk": topk}


def time_api(pool: Any, api: str, x: dict[str, torch.Tensor], iters: int) -> float:
    """Median milliseconds of ``iters`` decode steps through ``api`` (after 5 warm-up steps)."""
    from shardattn.serving import DecodeRequest

    q, topk, view = x["q"], x["topk"], False
    if api.startswith("decode_batch, inputs in place"):  # written once, as a model would write them
        slots = pool.step_inputs(int(q.shape[0]))
        slots["q"].copy_(q)
        slots["topk_pos"].copy_(topk)
        q, topk, view = slots["q"], slots["topk_pos"], True
    times = []
    for it in range(5 + iters):
        t0 = time.perf_counter()
        if api == "decode(requests)":
            pool.decode([DecodeRequest(int(i), q=q[i : i + 1], topk_pos=topk[i : i + 1]) for i in x["ids"]])
        else:
            pool.decode_batch(x["ids"], q, topk, view=view)
        if it >= 5:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rounds(args: argparse.Namespace, pool: Any, lens: list[int]) -> dict[str, list[float | None]]:
    """Each round's baseline (``None`` without one) and each API's median, in ms."""
    x = step_tensors(args, pool.spec, lens)
    baseline = args.device == "cuda" and args.preset != "tiny"
    out: dict[str, list[float | None]] = {"torchrun": [], **{api: [] for api in APIS}}
    for i in range(args.rounds):
        out["torchrun"].append(torchrun_step_ms(args) if baseline else None)
        line = [f"round {i}: torchrun " + ("-" if out["torchrun"][-1] is None else f"{out['torchrun'][-1]:.3f} ms")]
        for api in APIS:
            out[api].append(time_api(pool, api, x, args.iters))
            line.append(f"{api} {out[api][-1]:.3f} ms")
        print(" | ".join(line), flush=True)
    return out


def round_records(args: argparse.Namespace, times: dict[str, list[float | None]], env: dict) -> list[dict]:
    """The ``ray-pool`` records of :func:`rounds`' medians (module docstring)."""
    base = times["torchrun"]
    out = []
    for api in APIS:
        config = {"ranks": args.ranks, "requests": args.requests, "context": args.context, "api": api}
        pool_ms = statistics.median(times[api])
        if None in base:
            out.append(record(BENCHMARK, config, "step ms, median of rounds", pool_ms, "ms", "lower", None, env))
            continue
        torchrun = ("torchrun, same rounds", statistics.median(base))
        out.append(record(BENCHMARK, config, "step ms, median of rounds", pool_ms, "ms", "lower", torchrun, env))
        diff = statistics.median(p - t for p, t in zip(times[api], base, strict=True))
        out.append(record(BENCHMARK, config, "over torchrun, median of rounds", diff, "ms", "lower", None, env))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--preset", default="glm5", help="a model preset, or tiny (CPU runs; no torchrun baseline)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3, help="rounds of the baseline and the pool's steps")
    p.add_argument("--prefill", type=int, nargs="+", default=[1024, 1536], help="prompt lengths of the checked prefill")
    p.add_argument("--topk", type=int, default=None, help="top-k (default: the preset's)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run on gloo")
    p.add_argument("--transport", default="shm", help="the pool's decode transport (shm, compiled, calls)")
    p.add_argument("--torchrun-timeout", type=float, default=150)
    add_json_argument(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rounds < 1:
        print("--rounds must be at least 1", file=sys.stderr)
        return 2
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        print(f"--device cuda needs {args.ranks} GPUs (--ranks); pass --device cpu for a dry run", file=sys.stderr)
        return 2
    import ray

    gpus = args.ranks if args.device == "cuda" else 0
    ray.init(num_gpus=gpus, num_cpus=max(4, args.ranks + 2), include_dashboard=False, object_store_memory=4 << 30)
    try:
        pool, lens = build_checked_pool(args)
        try:
            times = rounds(args, pool, lens)
        finally:
            pool.shutdown()
    finally:
        ray.shutdown()
    records = round_records(args, times, environment(args.ranks, args.device))
    print_table(records, f"Ray pool decode step, {args.ranks} ranks")
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
