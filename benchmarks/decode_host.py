"""Host time of one eager DCP GQA decode step, split by phase (CPU and gloo, or GPUs and NCCL).

    torchrun --nproc-per-node 2 benchmarks/decode_host.py                 # CPU, gloo
    torchrun --nproc-per-node 2 benchmarks/decode_host.py --device cuda   # GPUs, NCCL

gqa-64-8 (64 q / 8 kv heads, d 64, page 32, sinks; ``--tiny``: 4 / 2 heads of 16 dims, so that
the CPU's copies cost nothing), ``--requests`` requests of ``--context`` tokens, the step on a
reused host plan (``DecodeStep.plan`` once, the step ``--iters`` times, ``check=False``: how an
engine runs every layer of one step), with a plan made every step, and with ``check=True``.
Min and median per step of the wall time and of this thread's CPU time (what the host spends,
whoever else shares the cores), the CPU time split into

* ``kernels``: inside the local attention and merge kernels. On the CPU the torch references are
  replaced by stand-ins that only allocate their outputs (``--real-kernels`` keeps them): a GPU
  runs them asynchronously; on a GPU, the Triton launches' host time;
* ``collectives``: inside the torch.distributed calls (blocking data movement under gloo; on
  NCCL, the host side of an asynchronous call);
* ``host``: the rest, the library's own Python and torch-op work, by phase (the wrapped
  functions of ``_PHASES``; ``value checks`` run for CPU tensors only).

Also printed, per reused-plan step: the aten ops dispatched outside CPU-only code (what a GPU
step sends through torch's dispatcher), Python function calls, and the tensor methods called by
library code that would synchronise a GPU stream (``item``, ``tolist``, ``bool()``, ``int()``,
``numpy``, ``cpu``, ``nonzero``), by call site; then a cProfile of the reused-plan step.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from shardattn.plan.spec import ModelSpec, get_preset
from shardattn.runtime.runtime import Runtime

# (module, attribute, phase): the wrapped calls whose time is charged to a phase (innermost
# wins: a phase's time excludes the wrapped calls inside it). Names of several versions of the
# code are listed; those missing are skipped.
_PHASES = [
    ("shardattn.runtime.decode", "dcp_gqa_decode", "DCP step (checks, indices)"),
    ("shardattn.parallel.dcp", "_gather_heads", "all-gather of q (and its reshape)"),
    ("shardattn.parallel.dcp", "_check_host_values", "value checks (CPU tensors only)"),
    ("shardattn.parallel.dcp", "gqa_paged_decode", "local kernel call"),
    ("shardattn.parallel.dcp", "run_gqa_paged_decode", "local kernel call"),
    ("shardattn.parallel.dcp", "_merge", "collector (pack, unpack, merge call)"),
    ("shardattn.parallel.dcp", "collect_checked", "collector (pack, unpack, merge call)"),
    ("shardattn.ops.gqa_decode", "gqa_paged_decode_reference", "kernels"),
    ("shardattn.ops.gqa_decode", "run_triton", "kernels"),
    ("shardattn.ops.lse_merge", "lse_merge_reference", "kernels"),
    ("shardattn.ops.lse_merge", "launch_lse_merge", "kernels"),
    ("shardattn.parallel.comm", "_ALL_GATHER_TENSOR", "collectives"),
    ("torch.distributed", "all_to_all_single", "collectives"),
]
_NOT_HOST = ("kernels", "collectives")
_ENTRY = "step entry (Runtime, plan, metadata)"  # the rest of the host time
_SYNCING = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "nonzero"}


class _Timers:
    """This thread's CPU time inside wrapped calls, by phase, exclusive of the wrapped calls they
    make (CPU time: what the host spends, whoever else shares the cores)."""

    def __init__(self) -> None:
        self.cpu: Counter[str] = Counter()
        self._inner: list[int] = []  # CPU time of wrapped calls inside the current one

    def wrap(self, phase: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            self._inner.append(0)
            c0 = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.thread_time_ns() - c0
                self.cpu[phase] += spent - self._inner.pop()
                if self._inner:
                    self._inner[-1] += spent

        timed.__wrapped__ = fn
        return timed

    def install(self) -> list[tuple[object, str, Callable]]:
        undo = []
        for mod_name, attr, phase in _PHASES:
            owner: object | None = sys.modules.get(mod_name)
            *outer, name = attr.split(".")
            for part in outer:
                owner = getattr(owner, part, None)
            fn = getattr(owner, name, None)
            if owner is not None and callable(fn):
                undo.append((owner, name, fn))
                setattr(owner, name, self.wrap(phase, fn))
        return undo


def _stub_reference_kernels() -> None:
    """Replace the CPU reference kernels by stand-ins that only allocate their outputs (``out`` 0,
    ``lse`` -inf): on a GPU the kernels are asynchronous launches, so their compute is no host work."""
    from shardattn.ops import gqa_decode, lse_merge

    def gqa_stub(q, k_cache, v_cache, block_table, seq_lens, cu_q_lens, **kwargs):
        return torch.zeros_like(q), torch.full(q.shape[:2], float("-inf"), device=q.device)

    def merge_stub(outs, lses):
        return torch.zeros(outs.shape[1:], dtype=outs.dtype, device=outs.device), torch.full(
            lses.shape[1:], float("-inf"), device=lses.device
        )

    gqa_decode.gqa_paged_decode_reference = gqa_stub
    lse_merge.lse_merge_reference = merge_stub


class _SyncCounter(TorchFunctionMode):
    """Counts tensor methods that would synchronise a GPU stream, called from shardattn code, by
    call site (value checks of CPU tensors among them: a GPU step skips those)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.torch_calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.torch_calls += 1
        name = getattr(func, "__name__", "")
        if name in _SYNCING:
            caller = sys._getframe(1).f_code.co_filename
            if f"{os.sep}shardattn{os.sep}" in caller:
                self.calls[f"{name} ({os.path.basename(caller)}:{sys._getframe(1).f_lineno})"] += 1
        return func(*args, **(kwargs or {}))


# Functions whose torch work runs only for CPU tensors: argument checks whose value checks read
# CPU tensors (on a GPU they check shapes only), the CPU reference kernels and their stand-ins.
_CPU_ONLY = {
    "validate",
    "_check_inputs",
    "_check_host_values",
    "gqa_paged_decode_reference",
    "lse_merge_reference",
    "gqa_stub",
    "merge_stub",
}


class _AtenOps(TorchDispatchMode):
    """The aten ops a step dispatches (allocations, views, copies, collectives, kernels' torch
    calls), outside :data:`_CPU_ONLY` code: what a GPU step runs through torch's dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_name not in _CPU_ONLY:
            frame = frame.f_back
        if frame is None:
            self.ops[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _phases(fn: Callable, iters: int, device: torch.device) -> dict[str, tuple[float, float]]:
    """``{phase: (min, median)}`` over ``iters`` calls of ``fn``, in microseconds: ``wall`` (host
    clock around the call), ``cpu`` (this thread's CPU time), ``host`` (``cpu`` less kernels and
    collectives) and every phase of :data:`_PHASES` (CPU time)."""
    timers = _Timers()
    undo = timers.install()
    per: dict[str, list[float]] = {}
    try:
        for _ in range(iters):
            dist.barrier()
            _sync(device)
            timers.cpu.clear()
            t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            fn()
            c1, t1 = time.thread_time_ns(), time.perf_counter_ns()
            row = {"wall": t1 - t0, "cpu": c1 - c0, **timers.cpu}
            row["host"] = row["cpu"] - sum(timers.cpu[p] for p in _NOT_HOST)
            row[_ENTRY] = row["host"] - sum(v for p, v in timers.cpu.items() if p not in _NOT_HOST)
            for k, v in row.items():
                per.setdefault(k, []).append(v / 1e3)
    finally:
        for owner, name, orig in undo:
            setattr(owner, name, orig)
    return {k: (min(v), statistics.median(v + [0.0] * (iters - len(v)))) for k, v in per.items()}


def _counts(fn: Callable, iters: int) -> dict[str, float]:
    """Per call of ``fn``: Python function calls (interpreted and built-in), calls into torch
    (functions and tensor methods), and the calls that would synchronise a GPU stream."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn()
    prof.disable()
    calls = sum(row[1] for row in pstats.Stats(prof).stats.values())  # primitive calls
    counter = _SyncCounter()
    with counter:
        for _ in range(iters):
            fn()
    aten = _AtenOps()
    with aten:
        fn()
    return {
        "aten_ops": sum(aten.ops.values()),
        "aten_names": dict(aten.ops),
        "python_calls": calls / iters,
        "torch_calls": counter.torch_calls / iters,
        "syncs": sum(counter.calls.values()) / iters,
        "sync_sites": {k: v / iters for k, v in counter.calls.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--context", type=int, default=256, help="KV tokens per request (small: the CPU computes them)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="4 q / 2 kv heads of 16 dims instead of gqa-64-8: the CPU's copies cost nothing, what is left is overhead",
    )
    ap.add_argument("--profile-top", type=int, default=18)
    ap.add_argument(
        "--real-kernels", action="store_true", help="CPU: run the reference kernels (default: output-only stand-ins)"
    )
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if device.type == "cpu" and not args.real_kernels:
        _stub_reference_kernels()
    b, ctx = args.requests, args.context
    spec = get_preset("gqa-64-8")
    if args.tiny:
        spec = ModelSpec("gqa", 4, 2, 16, 16, 0, spec.page_size, has_sinks=True)
    rt = Runtime(spec, dist.group.WORLD, max_batched_tokens=1, mode="dcp-decode", max_decode_tokens=8 * b)
    spec, h, d, page = rt.spec, rt.heads_per_rank, rt.spec.head_dim, rt.spec.page_size
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(1 + rank)
    pages_per = -(-rt.layout.local_len(ctx, 0) // page)
    k = torch.randn(b * pages_per, page, spec.num_kv_heads, d, device=device, generator=g).to(dtype)
    v = torch.randn_like(k)
    table = torch.randperm(b * pages_per, device=device, generator=g).view(b, pages_per).int()
    sinks = torch.randn(spec.num_heads, device=device, generator=g)
    seq = [ctx] * b
    seq_dev = torch.tensor(seq, dtype=torch.int32, device=device)
    q = torch.randn(b, h, d, device=device, generator=g).to(dtype)
    plan = rt.decode_step.plan(seq)

    def reused() -> None:
        rt.decode(q, (k, v), table, seq_dev, batch=plan, sinks=sinks, check=False)

    def planned() -> None:
        rt.decode(q, (k, v), table, seq_dev, batch=rt.decode_step.plan(seq), sinks=sinks, check=False)

    def checked() -> None:
        rt.decode(q, (k, v), table, seq_dev, batch=plan, sinks=sinks)

    for fn in (reused, planned, checked):
        for _ in range(5):
            fn()
    _sync(device)
    rows = {
        "step, plan reused": _phases(reused, args.iters, device),
        "plan + step": _phases(planned, args.iters, device),
        "step, plan reused, check=True": _phases(checked, max(10, args.iters // 4), device),
    }
    c0 = time.thread_time_ns()
    for _ in range(args.iters):
        rt.decode_step.plan(seq)
    plan_us = (time.thread_time_ns() - c0) / args.iters / 1e3
    counts = _counts(reused, 20)
    counts_checked = _counts(checked, 5)
    _sync(device)

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.iters):
        reused()
    _sync(device)
    prof.disable()
    if rank == 0:
        stubbed = device.type == "cpu" and not args.real_kernels
        print(
            f"device {device}, torch {torch.__version__}, {'tiny spec' if args.tiny else 'gqa-64-8'}, world size "
            f"{dist.get_world_size()}, {b} requests of {ctx} tokens, {args.iters} steps"
            + (", reference kernels replaced by output-only stand-ins" if stubbed else "")
        )
        print("per step, us, min / median: wall = host clock around the call; the rest = this thread's CPU time")
        names = list(rows)
        print(f"{'':38s}" + "".join(f"{n:>32s}" for n in names))
        keys = ["wall", "cpu", "kernels", "collectives", "host"]
        keys += sorted({k for r in rows.values() for k in r} - set(keys), key=lambda k: (k != _ENTRY, k))
        for key in keys:
            cells = "".join(
                f"{rows[n][key][0]:15.1f} / {rows[n][key][1]:12.1f}" if key in rows[n] else f"{'-':>32s}" for n in names
            )
            print(f"{('  ' if key not in ('wall', 'cpu', 'host') else '') + key:38s}{cells}")
        print(f"host plan alone (DecodeStep.plan), CPU time: {plan_us:.1f} us")
        print(f"per reused-plan step, outside CPU-only code: {counts['aten_ops']} aten ops {counts['aten_names']}")
        print(
            f"per reused-plan step: {counts['python_calls']:.0f} Python function calls, "
            f"{counts['torch_calls']:.0f} calls into torch, {counts['syncs']:g} calls that would sync a GPU "
            f"stream {counts['sync_sites']}"
        )
        print(
            f"per check=True step: {counts_checked['syncs']:g} calls that would sync a GPU stream "
            f"{counts_checked['sync_sites']}"
        )
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(args.profile_top)
        print(f"cProfile of {args.iters} reused-plan steps (self time, largest first):")
        print(buf.getvalue()[buf.getvalue().find("   ncalls") :], flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
