"""A small asyncio attention service on the Ray pool: a stream of requests, batched per step.

Requests arrive at random times with random prompt lengths; each is prefilled (ShardQ over the
pool's ranks), then decodes one token per step (DCP over the ranks' KV shards) until it has its
new tokens, and is freed. A scheduler batches what is waiting into one pool step: prefills first
(up to the pool's prefill token budget), then up to ``--max-batch`` waiting decodes (a decode
step goes to the pool as whole-step tensors,
``pool.decode_batch``: one concatenation per tensor in, one split per request out). Prints the
latency percentiles (time to first output, time per decode step, step time) and tokens per
second; ``--check`` also compares every output with fp64 attention over the request's whole
cache and fails past the dtype's tolerance (1e-4 in fp32, 3e-2 in 16 bits).

    python examples/ray_service.py                       # 2 CPU ranks (gloo), tiny model dims
    python examples/ray_service.py --preset glm5 --ranks 2 --device cuda --requests 32 \\
        --prompt 256 1024 --max-new-tokens 16             # GPUs (NCCL), GLM-5 attention shapes
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import random
import time
from collections.abc import Sequence
from typing import Any

import torch

from shardattn import ModelSpec, PrefillOptions, get_preset
from shardattn.serving import RayRankPool
from shardattn.testing.serving import ServingMirror


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="cpu",
        help="auto: cuda when this machine has a GPU per rank, else cpu (default cpu)",
    )
    p.add_argument(
        "--preset",
        choices=("glm5", "deepseek-v32"),
        default=None,
        help="sparse-MLA model preset (default: tiny sparse-MLA dims below)",
    )
    p.add_argument("--heads", type=int, default=None, help="query heads (default 8, or the preset's)")
    p.add_argument("--head-dim", type=int, default=None, help="without --preset: q/k dims (default 48)")
    p.add_argument("--v-dim", type=int, default=None, help="without --preset: value dims (default 32)")
    p.add_argument("--topk", type=int, default=None, help="top-k (default: 16, or the preset's)")
    p.add_argument("--page", type=int, default=None, help="without --preset: tokens per KV page (default 4)")
    p.add_argument("--softmax-scale", type=float, default=None, help="softmax scale (default: the preset's, else 0.3)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="default: fp32 CPU, bf16 GPU")
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--prompt", type=int, nargs=2, default=(8, 40), metavar=("MIN", "MAX"))
    p.add_argument("--max-new-tokens", type=int, default=6)
    p.add_argument("--arrival-ms", type=float, default=2.0, help="mean gap between arrivals")
    p.add_argument("--max-batch", type=int, default=64, help="decode requests per step")
    p.add_argument("--transport", choices=("shm", "compiled", "calls"), default="shm", help="how decode steps travel")
    p.add_argument("--check", action="store_true", help="compare every output with fp64 attention")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("ranks", "heads", "head_dim", "v_dim", "topk", "page", "requests", "max_new_tokens", "max_batch"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not 1 <= args.prompt[0] <= args.prompt[1]:
        p.error(f"--prompt MIN MAX must have 1 <= MIN <= MAX, got {args.prompt[0]} {args.prompt[1]}")
    if not args.arrival_ms >= 0:
        p.error(f"--arrival-ms must be >= 0, got {args.arrival_ms}")
    if args.softmax_scale is not None and not (math.isfinite(args.softmax_scale) and args.softmax_scale > 0):
        p.error(f"--softmax-scale must be a finite number > 0, got {args.softmax_scale}")
    if args.preset is not None:
        for name in ("head_dim", "v_dim", "page"):
            if getattr(args, name) is not None:
                flag = f"--{name.replace('_', '-')}"
                p.error(f"{flag} sets the model dims without --preset; {args.preset} has its own: drop it")
    elif (args.head_dim or 48) < (args.v_dim or 32):
        p.error(f"--v-dim ({args.v_dim or 32}) must be <= --head-dim ({args.head_dim or 48})")
    if args.device == "auto":  # the pool's rule on this machine, so that the dtype follows the device
        args.device = "cuda" if torch.cuda.device_count() >= args.ranks else "cpu"
    try:
        spec = model(args)
    except ValueError as e:
        p.error(str(e))
    if spec.num_heads % args.ranks:
        p.error(f"--ranks {args.ranks} must divide the model's {spec.num_heads} heads")
    return args


def model(args: argparse.Namespace) -> ModelSpec:
    """The model of the flags: the preset's (``--heads`` and ``--topk`` over its own), else tiny dims."""
    if args.preset is not None:
        spec = get_preset(args.preset)
        spec = dataclasses.replace(spec, num_heads=args.heads or spec.num_heads, topk=args.topk or spec.topk)
    else:
        spec = ModelSpec(
            "sparse_mla",
            args.heads or 8,
            1,
            args.head_dim or 48,
            args.v_dim or 32,
            args.topk or 16,
            args.page or 4,
            softmax_scale=0.3,
        )
    if args.softmax_scale is not None:
        spec = dataclasses.replace(spec, softmax_scale=args.softmax_scale)
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    return dataclasses.replace(spec, dtype=dtype)


@dataclasses.dataclass
class _Job:
    kind: str
    request: Any
    done: asyncio.Future


class Service:
    """Batches waiting prefills, else waiting decodes, into pool steps (one step at a time)."""

    def __init__(self, pool: RayRankPool, max_batch: int, max_prefill_tokens: int) -> None:
        self.pool, self.max_batch, self.max_prefill_tokens = pool, max_batch, max_prefill_tokens
        self.waiting: list[_Job] = []
        self.to_free: list[Any] = []
        self.wake = asyncio.Event()
        self.step_s: list[float] = []
        self.closed = False

    async def submit(self, kind: str, request: Any) -> Any:
        job = _Job(kind, request, asyncio.get_running_loop().create_future())
        self.waiting.append(job)
        self.wake.set()
        return await job.done

    def free(self, request_id: Any) -> None:
        self.to_free.append(request_id)
        self.wake.set()

    def _next_batch(self) -> list[_Job]:
        prefills = [j for j in self.waiting if j.kind == "prefill"]
        batch: list[_Job] = []
        if prefills:
            tokens = 0
            for j in prefills:
                n = int(j.request.q.shape[0])
                if batch and tokens + n > self.max_prefill_tokens:
                    break
                batch.append(j)
                tokens += n
        else:
            batch = self.waiting[: self.max_batch]
        for j in batch:
            self.waiting.remove(j)
        return batch

    def _prefill(self, requests: list[Any]) -> list[Any]:
        return self.pool.prefill(requests, return_lse=True)

    def _decode(self, requests: list[Any]) -> list[Any]:
        """One decode step through ``pool.decode_batch``: the requests' tensors concatenated once
        each (ids, ``q [T, H, D]``, ``topk_pos [T, K]``, new KV rows), the outputs split per request."""
        lens = [int(r.q.shape[0]) for r in requests]
        topk_pos = None if requests[0].topk_pos is None else torch.cat([r.topk_pos for r in requests])
        kv = None if requests[0].kv is None else torch.cat([r.kv for r in requests])
        q = torch.cat([r.q for r in requests])
        ids = [r.id for r in requests]
        out, lse = self.pool.decode_batch(ids, q, topk_pos, query_lens=lens, kv=kv, return_lse=True)
        return list(zip(out.split(lens), lse.split(lens)))

    async def run(self) -> None:
        while not (self.closed and not self.waiting):
            if self.to_free:  # between steps: the ledger never changes under a running step
                self.pool.free(self.to_free)
                self.to_free = []
            if not self.waiting:
                self.wake.clear()
                await self.wake.wait()
                continue
            batch = self._next_batch()
            kind = batch[0].kind
            t0 = time.perf_counter()
            method = self._prefill if kind == "prefill" else self._decode
            try:
                outs = await asyncio.to_thread(method, [j.request for j in batch])
            except Exception as e:
                for j in batch:
                    j.done.set_exception(e)
                continue
            self.step_s.append(time.perf_counter() - t0)
            for j, out in zip(batch, outs):
                j.done.set_result(out)
        if self.to_free:
            self.pool.free(self.to_free)


def _pct(values: list[float], q: float) -> float:
    return float(torch.tensor(values).quantile(q)) * 1e3 if values else float("nan")


async def serve(args: argparse.Namespace, pool: RayRankPool, spec: ModelSpec) -> dict[str, Any]:
    rng = random.Random(args.seed)
    mirror = ServingMirror(spec, topk=pool.shapes.topk, seed=args.seed)
    service = Service(pool, args.max_batch, pool.shapes.max_prefill_tokens)
    ttft: list[float] = []
    itl: list[float] = []
    errors: list[float] = [0.0]
    counts = {"prefill_tokens": 0, "decode_tokens": 0}

    def check(request: Any, result: tuple[torch.Tensor, torch.Tensor]) -> None:
        if args.check:
            ref, _ = mirror.expected(request)
            errors.append(float((result[0].double() - ref).abs().max()))

    async def client(i: int, delay: float) -> None:
        await asyncio.sleep(delay)
        n = rng.randint(*args.prompt)
        t0 = time.perf_counter()
        prefill = mirror.prefill_request(i, n)
        check(prefill, await service.submit("prefill", prefill))
        ttft.append(time.perf_counter() - t0)
        counts["prefill_tokens"] += n
        for _ in range(args.max_new_tokens):
            t1 = time.perf_counter()
            decode = mirror.decode_request(i)
            check(decode, await service.submit("decode", decode))
            itl.append(time.perf_counter() - t1)
            counts["decode_tokens"] += 1
        service.free(i)
        mirror.free(i)

    delays = []
    t = 0.0
    for _ in range(args.requests):
        t += rng.expovariate(1.0 / max(args.arrival_ms, 1e-6)) * 1e-3
        delays.append(t)
    runner = asyncio.create_task(service.run())
    t_start = time.perf_counter()
    await asyncio.gather(*(client(i, d) for i, d in enumerate(delays)))
    wall = time.perf_counter() - t_start
    service.closed = True
    service.wake.set()
    await runner
    return {
        "requests": args.requests,
        "prefill_tokens": counts["prefill_tokens"],
        "decode_tokens": counts["decode_tokens"],
        "wall_s": wall,
        "decode_tokens_per_s": counts["decode_tokens"] / wall,
        "tokens_per_s": (counts["prefill_tokens"] + counts["decode_tokens"]) / wall,
        "ttft_ms": {q: _pct(ttft, q / 100) for q in (50, 90, 99)},
        "decode_token_ms": {q: _pct(itl, q / 100) for q in (50, 90, 99)},
        "step_ms": {q: _pct(service.step_s, q / 100) for q in (50, 90, 99)},
        "steps": len(service.step_s),
        "max_error": float(torch.tensor(errors).max()) if args.check else None,  # NaN kept
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the service once; prints a summary and returns it."""
    args = parse(argv)
    spec = model(args)
    max_seq = args.prompt[1] + args.max_new_tokens
    prefill_tokens = max(args.prompt[1], 4 * (args.prompt[0] + args.prompt[1]) // 2)
    pool = RayRankPool(
        args.ranks,
        spec,
        mode="mixed",
        max_requests=args.requests,
        max_seq_len=max_seq,
        device=args.device,
        transport=args.transport,
        topk_unique=spec.kind == "sparse_mla",  # the requests' top-k lists a position once, as an indexer's does
        runtime_kwargs={
            "max_batched_tokens": prefill_tokens,
            "max_decode_tokens": args.max_batch,
            "topk": spec.topk,
            "prefill_options": PrefillOptions(min_shard_tokens=1),
        },
    )
    try:
        stats = asyncio.run(serve(args, pool, spec))
    finally:
        pool.shutdown()
    pct = "ms (p50 / p90 / p99)"
    head = f"{stats['requests']} requests on {args.ranks} ranks ({pool.backend})"
    print(f"{head}, {stats['steps']} steps, {stats['wall_s']:.2f} s")
    for key in ("ttft_ms", "decode_token_ms", "step_ms"):
        print(f"  {key[:-3]:<13} " + " / ".join(f"{v:8.2f}" for v in stats[key].values()) + f" {pct}")
    print(f"  tokens/s      {stats['tokens_per_s']:.1f} (decode {stats['decode_tokens_per_s']:.1f})")
    if stats["max_error"] is not None:
        error, tol = stats["max_error"], 1e-4 if spec.dtype == "float32" else 3e-2
        print(f"  max |out - fp64 reference| {error:.2e}")
        if not error <= tol:  # NaN fails too
            raise SystemExit(f"max |out - fp64 reference| {error:.2e} > {tol:.0e} ({spec.dtype})")
    return stats


if __name__ == "__main__":
    main()
