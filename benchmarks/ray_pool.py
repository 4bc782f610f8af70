"""The Ray pool on GPUs: checked against fp64 attention, and its decode step against torchrun's.

One run does, in order (each result is printed and appended to ``--out``/ray_pool.jsonl at once):

1. baseline: ``torchrun --nproc-per-node W -m shardattn.launch --preset P --mode dcp-decode``
   with ``--requests B --cached L`` (the same decode step, ranks started by torchrun);
2. for each of ``--transports`` (``shm``: decode steps through a shared-memory region,
   page-locked on the GPU ranks; ``compiled``: a Ray compiled graph; ``calls``: actor calls), a
   ``W``-rank NCCL pool (``mode="mixed"``): a ShardQ prefill of two requests checked against
   fp64 attention over the whole cache; ``B`` requests of ``L`` tokens
   written (KV only); one DCP decode step of the ``B`` requests checked the same way;
3. then that pool's decode step timed on the driver's clock, through both APIs: request objects
   in, outputs per request out (``pool.decode``), and whole-step tensors in, one output tensor
   out (``pool.decode_batch``; also with a reused ``out=``), with no new KV row (the torchrun
   step's work) and with each token's KV row written; each with the pool's split of the step
   (driver phases, and under ``shm`` each rank's timeline: when it saw the step, had its inputs
   queued, its step queued, its outputs in the region; the driver's seeing them done);
4. the per-step transport alone: plain actor calls against a compiled graph (``ray.dag``) with
   the same payload (CPU actors, no GPU work).

With ``--rounds N`` (one pool, the first of ``--transports``), steps 1 and 3 alternate instead:
N rounds of the baseline then the pool's ``decode_batch`` rows, and the median over rounds of
the per-round difference (``benchmarks/ray_pool_rounds.py``; the idle ranks' CPU use during the
baseline and the wake-up after idle are recorded too).

    python benchmarks/ray_pool.py --out results/      # needs Ray, W GPUs, torchrun
    python benchmarks/ray_pool.py --only torchrun,pool --transports shm --rounds 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from shardattn.plan.spec import ModelSpec, get_preset

sys.path.insert(0, str(Path(__file__).resolve().parent))  # ray_pool_rounds, imported where used

TOLERANCE = 3e-2  # bf16, the launcher's check
TINY = ModelSpec("sparse_mla", 8, 1, 48, 32, 16, 4, softmax_scale=0.3)


def emit(out: Path, record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)
    with open(out / "ray_pool.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def summarize(times: list[float]) -> dict[str, float]:
    ts = sorted(t * 1e3 for t in times)
    return {"median_ms": statistics.median(ts), "p10_ms": ts[len(ts) // 10], "p90_ms": ts[(len(ts) * 9) // 10]}


def model_spec(args: argparse.Namespace) -> ModelSpec:
    """The preset in bf16 (``tiny``: 8 heads of 48 dims, top-k 16, for CPU runs), top-k overridden by ``--topk``."""
    spec = TINY if args.preset == "tiny" else get_preset(args.preset)
    return dataclasses.replace(spec, dtype="bfloat16", topk=args.topk or spec.topk)


def torchrun_baseline(args: argparse.Namespace, out: Path, **extra: Any) -> dict[str, Any]:
    """One ``torchrun -m shardattn.launch`` run of the decode step; its record (``step_ms``: the
    slowest rank's median)."""
    report = out / "torchrun.json"
    report.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks),
        "-m", "shardattn.launch", "--preset", args.preset, "--mode", "dcp-decode",
        "--requests", str(args.requests), "--cached", str(args.context), "--iters", str(args.iters),
        "--warmup", "5", "--no-progress", "--no-check", "--json", str(report), "--device", args.device,
        "--topk", str(args.topk or get_preset(args.preset).topk), "--dtype", "bf16",
    ]  # fmt: skip
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.torchrun_timeout)
    except subprocess.TimeoutExpired:
        rec = {
            "part": "torchrun",
            **extra,
            "cmd": " ".join(cmd[1:]),
            "error": f"timed out after {args.torchrun_timeout} s",
        }
        emit(out, rec)
        return rec
    rec: dict[str, Any] = {"part": "torchrun", **extra, "cmd": " ".join(cmd[1:]), "rc": proc.returncode}
    rec["wall_s"] = time.perf_counter() - t0
    if proc.returncode != 0 or not report.exists():
        rec["stderr"] = proc.stderr[-2000:]
    else:
        rows = json.loads(report.read_text())["rows"]
        rec["ranks"] = [{k: r[k] for k in ("rank", "path", "time_ms", "time_p10_ms", "time_p90_ms")} for r in rows]
        rec["step_ms"] = max(r["time_ms"] for r in rows)  # a step ends when its slowest rank does
    emit(out, rec)
    return rec


def check(outs: list[Any], requests: list[Any], mirror: Any, device: str) -> tuple[float, float]:
    err_out = err_lse = 0.0
    for (out, lse), req in zip(outs, requests):
        ref_out, ref_lse = mirror.expected(req, device=device)
        if not torch.isfinite(out).all():
            return float("inf"), float("inf")
        err_out = max(err_out, float((out.double() - ref_out).abs().max()))
        fin = torch.isfinite(ref_lse)
        if not torch.equal(fin, torch.isfinite(lse)):
            return err_out, float("inf")
        rel = (lse.double()[fin] - ref_lse[fin]).abs() / ref_lse[fin].abs().clamp(min=1.0)
        err_lse = max(err_lse, float(rel.max()) if rel.numel() else 0.0)
    return err_out, err_lse


def pool_run(args: argparse.Namespace, out: Path) -> None:
    for transport in args.transports.split(","):
        try:
            pool_run_one(args, out, transport)
        except Exception as e:  # keep the other transports' results
            emit(out, {"part": "pool", "transport": transport, "error": f"{type(e).__name__}: {e}"[:3000]})


def pool_run_one(args: argparse.Namespace, out: Path, transport: str) -> None:
    pool, lens = pool_checked(args, out, transport)
    try:
        if args.rounds:
            from ray_pool_rounds import rounds

            rounds(args, out, pool, lens, torchrun_baseline, emit, summarize, step_phases)
        else:
            pool_variants(args, out, pool, lens, transport)
    finally:
        pool.shutdown()


def pool_checked(args: argparse.Namespace, out: Path, transport: str) -> tuple[Any, list[int]]:
    """A ``W``-rank pool, its prefill and decode checked against fp64 attention (both APIs),
    ``B`` requests of ``L`` tokens cached; returns the pool and the requests' lengths."""
    from shardattn.launch.ray_pool import RayRankPool
    from shardattn.testing.serving import ServingMirror

    spec = model_spec(args)
    dev = args.device
    t0 = time.perf_counter()
    pool = RayRankPool(
        args.ranks,
        spec,
        mode="mixed",
        max_requests=args.requests + 4,
        max_seq_len=args.context + 256,
        device=args.device,
        timeout_s=300,
        transport=transport,
        runtime_kwargs={"max_batched_tokens": 4096, "max_decode_tokens": args.requests, "warmup": False},
        init_ray=False,
    )
    emit(
        out,
        {
            "part": "pool_built",
            "transport": transport,
            "in_use": pool.transport,
            "pinned": getattr(getattr(pool._decoder, "steps", None), "pinned", None),
            "s": time.perf_counter() - t0,
            "built": pool.built,
            "backend": pool.backend,
        },
    )
    try:
        mirror = ServingMirror(spec, seed=0)
        # -- ShardQ prefill, checked
        reqs = [mirror.prefill_request(f"p{i}", n) for i, n in enumerate(args.prefill)]
        t0 = time.perf_counter()
        outs = pool.prefill(reqs, return_lse=True)
        first_s = time.perf_counter() - t0
        e_out, e_lse = check(outs, reqs, mirror, dev)
        passed = max(e_out, e_lse) <= TOLERANCE
        emit(out, {"part": "check_prefill", "tokens": sum(args.prefill), "err_out": e_out, "err_lse_rel": e_lse,
                   "tolerance": TOLERANCE, "passed": passed, "first_call_s": first_s})  # fmt: skip
        for i in range(len(args.prefill)):
            pool.free([f"p{i}"])
            mirror.free(f"p{i}")
        # -- B requests of L tokens (KV written, no attention)
        t0 = time.perf_counter()
        for b0 in range(0, args.requests, 8):
            pool.prefill(
                [mirror.prefill_request(i, args.context, attend=False) for i in range(b0, min(b0 + 8, args.requests))]
            )
        emit(out, {"part": "kv_written", "requests": args.requests, "tokens_each": args.context,
                   "s": time.perf_counter() - t0})  # fmt: skip
        # -- one DCP decode step, checked, through each API
        reqs = [mirror.decode_request(i) for i in range(args.requests)]
        outs = pool.decode(reqs, return_lse=True)
        e_out, e_lse = check(outs, reqs, mirror, dev)
        emit(out, {"part": "check_decode", "api": "decode", "requests": args.requests, "context": args.context + 1,
                   "err_out": e_out, "err_lse_rel": e_lse, "tolerance": TOLERANCE,
                   "passed": max(e_out, e_lse) <= TOLERANCE})  # fmt: skip
        reqs = [mirror.decode_request(i) for i in range(args.requests)]
        b_out, b_lse = pool.decode_batch(
            torch.arange(args.requests), torch.cat([r.q for r in reqs]), torch.cat([r.topk_pos for r in reqs]),
            kv=torch.cat([r.kv for r in reqs]), return_lse=True,
        )  # fmt: skip
        e_out, e_lse = check(list(zip(b_out.split(1), b_lse.split(1))), reqs, mirror, dev)
        emit(out, {"part": "check_decode", "api": "decode_batch", "requests": args.requests,
                   "context": args.context + 2, "err_out": e_out, "err_lse_rel": e_lse, "tolerance": TOLERANCE,
                   "passed": max(e_out, e_lse) <= TOLERANCE})  # fmt: skip
        reqs = [mirror.decode_request(i) for i in range(args.requests)]  # inputs in place, outputs as views
        slots = pool.step_inputs(args.requests)
        for name in ("q", "topk_pos", "kv"):
            torch.cat([getattr(r, name) for r in reqs], out=slots[name])
        b_out, b_lse = pool.decode_batch(torch.arange(args.requests), slots["q"], slots["topk_pos"], kv=slots["kv"],
                                         return_lse=True, view=True)  # fmt: skip
        e_out, e_lse = check(list(zip(b_out.split(1), b_lse.split(1))), reqs, mirror, dev)
        emit(out, {"part": "check_decode", "api": "decode_batch in place, view", "requests": args.requests,
                   "context": args.context + 3, "err_out": e_out, "err_lse_rel": e_lse, "tolerance": TOLERANCE,
                   "passed": max(e_out, e_lse) <= TOLERANCE})  # fmt: skip
        return pool, [mirror.requests[i].length for i in range(args.requests)]
    except BaseException:
        pool.shutdown()
        raise


def pool_variants(args: argparse.Namespace, out: Path, pool: Any, lens: list[int], transport: str) -> None:
    """The decode step timed through both APIs, with and without new KV rows (module docstring)."""
    from ray_pool_rounds import step_tensors

    from shardattn.launch.ray_pool import DecodeRequest

    spec = model_spec(args)
    x = step_tensors(args, spec, lens)
    ids, q_flat, topk, kv_flat = x["ids"], x["q"], x["topk"], x["kv"]
    q, kv = q_flat[:, None], kv_flat[:, None]
    reuse = torch.empty(args.requests, spec.num_heads, spec.v_dim, dtype=torch.bfloat16)
    same = "no KV write (the torchrun step)"
    variants = [  # API, what the step writes, iterations, the driver's torch threads during a step
        ("decode", same, False, args.iters, 1),
        ("decode_batch", same, False, args.iters, 1),
        ("decode_batch out=", same, False, args.iters, 1),
        ("decode_batch", same, False, args.iters, 4),
        ("decode", "KV row written", True, 20, 1),
        ("decode_batch", "KV row written", True, 20, 1),
    ]
    for api, label, with_kv, iters, threads in variants:
        times = []
        phases: dict[str, list[float]] = {}
        pool.host_threads = threads
        for it in range(5 + iters):
            if api == "decode":
                step = [
                    DecodeRequest(i, q=q[i], topk_pos=topk[i : i + 1], kv=kv[i] if with_kv else None)
                    for i in range(args.requests)
                ]
                t1 = time.perf_counter()
                pool.decode(step)
            else:
                t1 = time.perf_counter()
                pool.decode_batch(ids, q_flat, topk, kv=kv_flat if with_kv else None,
                                  out=reuse if api.endswith("out=") else None)  # fmt: skip
            if it >= 5:
                times.append(time.perf_counter() - t1)
                for k, v in step_phases(pool.last_step).items():
                    phases.setdefault(k, []).append(v)
        actor_ms = [r["last_step_s"] * 1e3 for r in pool.health()["ranks"]]
        emit(out, {"part": "pool_decode", "transport": transport, "api": api, "variant": label,
                   "driver_threads": threads,
                   "requests": args.requests, "context": lens[0], **summarize(times),
                   "actor_last_step_ms": actor_ms,
                   "phases_median_ms": {k: round(statistics.median(v), 4) for k, v in phases.items()}})  # fmt: skip


def step_phases(last: dict[str, Any]) -> dict[str, float]:
    """The pool's split of its last step (``RayRankPool.last_step``): the driver's phases, and
    under ``shm`` each rank's timeline in ms from the driver's publishing the step (``seen``:
    the rank saw it; ``inputs``: its H2D copies queued; ``queued``: its step and D2H queued;
    ``synced``: outputs in the region; ``own``: synced - seen, the rank's step), ``done``, and
    ``copies_in``: the driver's copies of the step's tensors into the region (``ranks_ms - done``)."""
    out = {k: v for k, v in last.items() if k.endswith("_ms")}
    tl = last.get("timeline")
    if tl is not None:
        for r, marks in enumerate(tl["ranks"]):
            for k, v in marks.items():
                out[f"rank{r}.{k}"] = v
            out[f"rank{r}.own"] = marks["synced"] - marks["seen"]
        out["done"] = tl["done"]
        out["done_after_last_rank"] = tl["done"] - max(m["synced"] for m in tl["ranks"])
        out["copies_in"] = last["ranks_ms"] - tl["done"]  # the driver's writes into the region, before publishing
    return out


def transport(args: argparse.Namespace, out: Path) -> None:
    """Plain actor calls against a compiled graph, same payload: per-rank q heads and shared top-k."""
    import ray
    from ray.dag import InputNode, MultiOutputNode

    @ray.remote(num_cpus=1)
    class Echo:
        def __init__(self, rank: int) -> None:
            self.rank = rank

        def step(self, shared: Any, q: Any = None) -> Any:
            qr = shared["q"][self.rank] if q is None else q
            return qr[:, :, :512].clone()

    actors = [Echo.remote(r) for r in range(args.ranks)]
    ray.get([a.__ray_ready__.remote() for a in actors])
    h = 64 // args.ranks
    for t in (1, args.requests):
        qs = [(torch.randn(t, h, 576)).to(torch.bfloat16) for _ in range(args.ranks)]
        shared = {"topk": torch.zeros(t, 2048, dtype=torch.int32), "q": qs}

        def plain(shared: dict[str, Any] = shared, qs: list[torch.Tensor] = qs) -> Any:
            ref = ray.put({"topk": shared["topk"]})
            return ray.get([a.step.remote(ref, qs[r]) for r, a in enumerate(actors)])

        with InputNode() as inp:
            dag = MultiOutputNode([a.step.bind(inp) for a in actors])
        cdag = dag.experimental_compile(_buffer_size_bytes=64 << 20)

        def compiled(cdag: Any = cdag, shared: dict[str, Any] = shared) -> Any:
            return ray.get(cdag.execute(shared))

        rec: dict[str, Any] = {"part": "transport", "tokens": t}
        for name, fn in (("plain", plain), ("compiled", compiled)):
            times = []
            for i in range(60):
                t1 = time.perf_counter()
                fn()
                if i >= 10:
                    times.append(time.perf_counter() - t1)
            rec[name] = summarize(times)
        cdag.teardown()
        emit(out, rec)


def service(args: argparse.Namespace, out: Path) -> None:
    """``examples/ray_service.py`` on the GPUs (NCCL), with the preset's shapes."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "examples" / "ray_service.py"
    spec = importlib.util.spec_from_file_location("ray_service", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    argv = ["--preset", args.preset, "--ranks", str(args.ranks), "--device", args.device, "--requests", "32"]
    argv += ["--prompt", "256", "1024", "--max-new-tokens", "16", "--arrival-ms", "5"]
    emit(out, {"part": "service", "argv": argv, **module.main(argv)})


def host_record() -> dict[str, Any]:
    """What the driver runs on: cores it may use, its cgroup CPU limit, torch threads, GIL switch interval."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            cpu_max = f.read().strip()
    except OSError:
        cpu_max = None
    return {
        "part": "host",
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "cgroup_cpu_max": cpu_max,
        "torch_threads": torch.get_num_threads(),
        "switch_interval_s": sys.getswitchinterval(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--preset", default="glm5", help="a model preset, or tiny (CPU runs; no torchrun baseline)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--prefill", type=int, nargs="+", default=[1024, 1536], help="prompt lengths of the checked prefill")
    p.add_argument("--topk", type=int, default=None, help="top-k (default: the preset's)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run on gloo")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--torchrun-timeout", type=float, default=150)
    p.add_argument("--transports", "--transport", default="shm,compiled,calls", help="pool transports to run, in order")
    p.add_argument("--only", default="torchrun,pool,transport,service")
    p.add_argument("--driver-threads", type=int, default=None, help="torch threads of the driver (default: torch's)")
    p.add_argument("--rounds", type=int, default=0,
                   help="N > 0: alternate the torchrun baseline and the pool's decode_batch N times "
                   "(one pool: the first of --transports)")  # fmt: skip
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.driver_threads is not None:
        torch.set_num_threads(args.driver_threads)
    emit(out, host_record())
    parts = args.only.split(",")
    if args.rounds:
        args.transports = args.transports.split(",")[0]  # each round runs the baseline: one pool
    elif "torchrun" in parts and args.preset != "tiny":
        torchrun_baseline(args, out)
    import ray

    gpus = args.ranks if args.device == "cuda" else 0
    ray.init(num_gpus=gpus, num_cpus=max(4, args.ranks + 2), include_dashboard=False, object_store_memory=4 << 30)
    try:
        for name, fn in (("pool", pool_run), ("transport", transport), ("service", service)):
            if name in parts:
                try:
                    fn(args, out)
                except Exception as e:  # keep the other parts' results
                    emit(out, {"part": name, "error": f"{type(e).__name__}: {e}"[:3000]})
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
