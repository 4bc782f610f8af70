"""Host memory each call of a serving step's operations leaves behind: what a soak's RSS is made of.

    python benchmarks/host_growth.py --repeats 20000 --json host_growth.json

A soak (``benchmarks/soak_runtime.py``) sees a GPU process's RSS move where a CPU run of the same
code holds flat. This times nothing: it calls each operation a step makes (or a soak's harness
makes around it) ``--repeats`` times after 200 warm-up calls and reports glibc's heap in use
(``mallinfo2``) and RSS per call. A leak of one allocation a call shows as tens to hundreds of
bytes a call; a bounded cache as a number that falls with ``--repeats``.

Operations: a CUDA (or CPU) generator made and seeded, one generator reseeded, a Triton op
(``convert_topk``, the torch reference on the CPU), a CUDA-graph replay (GPU), a device-to-host
scalar, a one-element broadcast on a one-rank group (NCCL on a GPU, gloo on the CPU), and a
matrix product at one shape against one at a new random shape each call (a BLAS library may
keep state for each shape it has seen).

Records ``host-growth``: bytes of glibc heap in use per call (lower is better; 0 is flat).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import add_json_argument, environment, print_table, record, write_json
from soak_stats import heap_bytes, rss_bytes

from shardattn.ops.topk import convert_topk


def per_call(fn: Callable[[], None], calls: int, sync: Callable[[], None]) -> tuple[float, float]:
    """``(heap bytes in use, RSS bytes)`` added per call of ``fn`` over ``calls`` calls, after 200
    (heap: glibc's ``mallinfo2``, which :func:`main` checks is readable first)."""
    for _ in range(200):
        fn()
    sync()
    h0, r0 = heap_bytes(), rss_bytes()
    for _ in range(calls):
        fn()
    sync()
    h1, r1 = heap_bytes(), rss_bytes()
    assert h0 is not None and h1 is not None
    return (h1[0] - h0[0]) / calls, (r1 - r0) / calls


def _ignore(_: object) -> None:
    """A call's result dropped (the operations are called for what they leave behind)."""


def operations(dev: torch.device, group: dist.ProcessGroup) -> dict[str, Callable[[], None]]:
    """The operations by name, each a closure over its inputs."""
    seed = iter(range(1 << 62))
    reused = torch.Generator(device=dev)
    pos = torch.randint(-1, 500, (64, 2048), dtype=torch.int32, device=dev)
    req = torch.arange(64, dtype=torch.int32, device=dev)
    table = torch.randint(0, 1000, (64, 8), dtype=torch.int32, device=dev)
    lens = torch.full((64,), 500, dtype=torch.int32, device=dev)
    flag = torch.zeros(1, device=dev)
    a, b = torch.randn(64, 576, device=dev), torch.randn(576, 2048, device=dev)
    shapes = torch.Generator().manual_seed(0)

    def random_shape_matmul() -> None:
        m, n = (int(x) for x in torch.randint(1, 4096, (2,), generator=shapes))
        torch.randn(m, 64, device=dev) @ torch.randn(64, n, device=dev)

    def new_generator() -> None:
        torch.rand(4, generator=torch.Generator(device=dev).manual_seed(next(seed)), device=dev)

    ops: dict[str, Callable[[], None]] = {
        "generator made and seeded": new_generator,
        "one generator reseeded": lambda: torch.rand(4, generator=reused.manual_seed(next(seed)), device=dev),
        "convert_topk 64 x 2048": lambda: _ignore(convert_topk(pos, req, table, block_size=64, seq_lens=lens)),
        "device-to-host scalar": lambda: _ignore(float(flag.sum())),
        "broadcast, one-rank group": lambda: _ignore(dist.broadcast(flag, 0, group=group)),
        "matmul, one shape": lambda: _ignore(a @ b),
        "matmul, a new random shape": random_shape_matmul,
    }  # fmt: skip
    if dev.type == "cuda":
        x = torch.zeros(1024, device=dev)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            x.add_(1)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            x.add_(1)
        ops["CUDA-graph replay"] = graph.replay
    return ops


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=20000, help="calls of each operation, after 200 warm-up calls")
    p.add_argument("--only", nargs="+", default=None, help="operations whose name contains one of these words")
    add_json_argument(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if heap_bytes() is None:  # a record of 0 B would read as flat
        print("glibc's mallinfo2 is not available here (glibc 2.33 or later): the heap cannot be read", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    store = dist.HashStore()  # one rank in this process: no address, no port
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1,
                            device_id=dev if cuda else None)  # fmt: skip
    try:
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        env, records = environment(1, dev), []
        for name, fn in operations(dev, dist.group.WORLD).items():
            if args.only and not any(w in name for w in args.only):
                continue
            heap, rss = per_call(fn, args.repeats, sync)
            config = {"device": dev.type, "repeats": args.repeats, "operation": name}
            print(f"{name:28s} heap in use {heap:8.1f} B/call, RSS {rss:8.1f} B/call", flush=True)
            records.append(record("host-growth", config, "heap in use per call", heap, "B", "lower", None, env))
        print_table(records, "Host memory left per call")
        write_json(args.json, records)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
