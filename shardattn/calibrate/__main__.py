"""``python -m shardattn.calibrate --out FILE``: measure a calibration table (see the package docstring).

It measures GPU kernels and collectives, one rank per GPU (``torchrun --nproc-per-node N -m
shardattn.calibrate``); on a machine without CUDA it refuses (exit status 2) unless ``--cpu``
asks to time the CPU reference anyway (a table no Runtime routes by: a CPU Runtime routes by
the ShardQ gate alone; for testing the tool at small ``--heads`` / ``--tokens``). ``--cpu``
measures on the CPU, over gloo, on a machine with GPUs too. Rank 0 shows
its progress with the time left, as a bar on a terminal and as lines elsewhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import logging
import os
import sys
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from shardattn._paths import unwritable_reason, write_text
from shardattn.calibrate.fit import degenerate_fit, fit_step_overhead
from shardattn.calibrate.kernels import collective_rates, kernel_jobs, measure_kernel_points, median_points
from shardattn.calibrate.merge import measure_device, merge_kernel_points, this_gpu
from shardattn.calibrate.network import multi_node_rates
from shardattn.calibrate.steps import MIN_SHARD_TOKENS, measure_paths, with_heads
from shardattn.calibrate.timing import copy_gbps
from shardattn.launch.logs import LOG_LEVELS, configure_logging
from shardattn.launch.one_line import report_once
from shardattn.launch.process_group import DistEnv, host_groups
from shardattn.launch.progress import RunProgress, format_seconds
from shardattn.parallel.hosts import exchange_node_layout
from shardattn.plan.calibration import same_gpu
from shardattn.plan.cost import CONSERVATIVE, GROUPS, Calibration, CollectiveRate, CostModel, StepOverhead
from shardattn.plan.links import LinkRate
from shardattn.plan.nodes import NodeLayout
from shardattn.plan.spec import get_preset
from shardattn.plan.step_shape import StepShape

log = logging.getLogger(__name__)

#: Configurations whose whole steps fit the step overheads: (preset, heads); tokens: ``--step-tokens``.
STEP_CONFIGS = (("glm5", None), ("glm5", 16), ("deepseek-v32", None), ("glm5", 32))


def step_configs(world: int) -> list[tuple[str, int | None]]:
    """The :data:`STEP_CONFIGS` whose heads divide over ``world`` ranks (head-TP splits them)."""
    return [(p, h) for p, h in STEP_CONFIGS if with_heads(get_preset(p), h).num_heads % world == 0]


class BadOption(ValueError):
    """A bad command line: its one-line message, printed once (``launch.one_line``), exit status 2."""


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors raise :class:`BadOption` (one line) instead of printing usage."""

    def error(self, message: str) -> NoReturn:
        raise BadOption(f"shardattn.calibrate: error: {message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m shardattn.calibrate",
        description=(
            "Measure the cost model's calibration table on this machine's GPUs (one rank per GPU under torchrun; "
            "a few minutes on an H200). Without CUDA it refuses unless --cpu."
        ),
    )
    p.add_argument("--out", required=True, help="where to write the table (JSON)")
    p.add_argument("--heads", type=int, nargs="+", default=[8, 16, 32, 64, 128], help="kernel head counts")
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384], help="kernel token counts")
    p.add_argument("--all-groups", action="store_true", help="every group size that fits a tile, not just the largest")
    p.add_argument("--topk", type=int, default=2048, help="top-k of the kernel points (default 2048)")
    p.add_argument("--cached", type=int, default=8192, help="cached tokens per request (default 8192)")
    p.add_argument(
        "--step-tokens",
        type=int,
        nargs="+",
        default=None,
        help="tokens of the whole steps (default 8192 32768: a small step, and one the planner pipelines; "
        "only where steps are timed: two or more ranks, without --no-steps or --merge-into)",
    )
    p.add_argument("--reps", type=int, default=5, help="timed calls per point (default 5)")
    p.add_argument(
        "--kv-dtype",
        nargs="+",
        choices=("bf16", "fp8_ds_mla"),
        default=["bf16"],
        help="KV row formats of the kernel points (default bf16; fp8_ds_mla: the FP8 kernels' own points)",
    )
    p.add_argument(
        "--passes",
        type=int,
        default=3,
        help="passes over all kernel points; each point keeps the median of its passes (default 3)",
    )
    p.add_argument("--no-steps", dest="steps", action="store_false", help="skip the whole-step overhead fit")
    p.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress (a bar with the time left on a terminal, else a line per phase and every 15 s)",
    )
    p.add_argument(
        "--cpu",
        action="store_true",
        help="measure on the CPU, also where there is a GPU (the torch reference: slow, and by default a CPU "
        "Runtime routes by the ShardQ gate alone; for testing the tool at small --heads / --tokens)",
    )
    p.add_argument("--log-level", choices=LOG_LEVELS, default="warning", help="log messages shown (default warning)")
    p.add_argument(
        "--merge-into",
        default=None,
        metavar="TABLE",
        help="re-measure the kernel points only and keep TABLE's collectives and step overheads (after a kernel "
        "change, on one GPU of the machine TABLE was measured on)",
    )
    return p


def calibrate(args: argparse.Namespace, group: dist.ProcessGroup | None) -> Calibration | None:
    """Measure on this rank; returns the table on rank 0 (``None`` elsewhere)."""
    rank = dist.get_rank(group) if group is not None else 0
    world = dist.get_world_size(group) if group is not None else 1
    device = measure_device(args.cpu)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    jobs = kernel_jobs(args.heads, args.tokens, all_groups=args.all_groups)
    mine = jobs[rank::world]
    n_steps = len(step_configs(world)) * len(args.step_tokens) if args.steps and world > 1 else 0
    total = len(mine) * args.passes + (8 if world > 1 else 0) + n_steps + 1
    progress = RunProgress("shardattn.calibrate", enabled=args.progress and rank == 0, quiet_s=0.0, every_s=15.0)
    if rank == 0 and args.progress:
        print(
            f"shardattn.calibrate: {len(mine)} kernel point(s) x {args.passes} pass(es) on each of {world} rank(s), "
            f"{'8 collective sizes, ' if world > 1 else ''}{n_steps} whole step(s) on {device.type}; the time left "
            "follows from the pace of the first points",
            file=sys.stderr,
            flush=True,
        )
    progress.phase("calibrating", total=total)
    advance = progress.advance
    try:
        passes = []
        for i in range(args.passes):
            progress.relabel(f"kernel points, pass {i + 1} of {args.passes}")
            passes.append(
                measure_kernel_points(
                    mine,
                    topk=args.topk,
                    device=device,
                    dtype=dtype,
                    reps=args.reps,
                    cached=args.cached,
                    advance=advance,
                    kv_formats=tuple("bfloat16" if f == "bf16" else f for f in args.kv_dtype),
                )
            )
        points = median_points(passes)
        progress.relabel("device copy rate")
        copy = copy_gbps(device, nbytes=(1 << 30) if device.type == "cuda" else (1 << 24))
        advance()
        if world > 1:
            progress.relabel("collective rates")
        host_id = getattr(args, "host_id", None)
        nodes = exchange_node_layout(group, host_id) if group is not None else NodeLayout.single(1)
        network: LinkRate | None = None
        colls: list[CollectiveRate] = []  # one rank (no group): no collectives
        if group is not None and nodes.multi_node:  # the network between hosts, NVLink on one, the whole group
            subgroups = host_groups(group, nodes)
            colls, network = multi_node_rates(group, nodes, subgroups, device=device, advance=advance)
        elif group is not None and world > 1:
            colls = collective_rates(group, device=device, advance=advance)
        if group is not None:
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, points, group=group)
            points = [p for part in gathered for p in part]
        ratios: dict[int, list[float]] = {}
        for p in points:
            if p.group_size > 1:
                ratios.setdefault(p.group_size, []).append(p.union_ratio)
        cal = Calibration(
            gpu=this_gpu(device),
            kernels=tuple(sorted(points, key=lambda p: (p.group_size, p.heads, p.tokens))),
            collectives=tuple(colls) or CONSERVATIVE.collectives,
            copy_gbps=round(copy, 1),
            union_ratio={g: round(sum(v) / len(v), 4) for g, v in ratios.items()} or dict(CONSERVATIVE.union_ratio),
            steps={},
            network=network,
            source=(
                f"python -m shardattn.calibrate, {world} rank(s) on {nodes}, {datetime.date.today().isoformat()}, "
                f"torch {torch.__version__}, kernel points the median of {args.passes} pass(es)"
                + ("" if colls else "; collectives: the conservative default")
            ),
        )
        if n_steps and group is not None:  # whole steps run on a group of several ranks (n_steps is 0 on one)
            progress.relabel("whole steps (step overheads)")
            cal = _fit_steps(cal, group, device, args, advance, host_id)
    finally:
        progress.close()
    if rank == 0 and args.progress:
        print(f"shardattn.calibrate: measured in {format_seconds(progress.elapsed)}", file=sys.stderr, flush=True)
    return cal if rank == 0 else None


def _fit_steps(
    cal: Calibration,
    group: dist.ProcessGroup,
    device: torch.device,
    args: argparse.Namespace,
    advance: Any,
    host_id: str | None = None,
) -> Calibration:
    """Time whole steps of :data:`STEP_CONFIGS` and fit each step's overhead beyond kernel and collectives."""
    world = dist.get_world_size(group)
    base = CostModel(cal)  # no step overheads yet: fixed 0 / factor 1 of the default
    raw = CostModel(_with_steps(cal, {"headtp": StepOverhead(0.0, 1.0), "shardq": StepOverhead(0.0, 1.0)}))
    sq, tp = [], []
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    for (preset, heads), tokens in itertools.product(step_configs(world), args.step_tokens):
        spec = dataclasses.replace(with_heads(get_preset(preset), heads), topk=args.topk, dtype=dtype)
        res = measure_paths(
            group,
            spec,
            tokens=tokens,
            requests=4,
            cached=args.cached,
            device=device,
            model=base,
            reps=args.reps,
            paths=("kernel", "kernel_headtp", "headtp", "shardq"),
            host_id=host_id,
        )
        if not res["path"]["shardq"].startswith("shardq/"):  # never fit ShardQ's overhead from another step
            raise RuntimeError(f"the ShardQ step of {tokens} tokens ran {res['path']['shardq']!r}: {res['reason']}")
        allres: list[Any] = [None] * world
        dist.all_gather_object(allres, res, group=group)
        ms = {k: max(r["ms"][k] for r in allres) for k in res["ms"]}  # the slowest rank bounds a step
        shape = StepShape.of(spec, world, tokens, rank_tokens=res["rank_tokens"], ranks_per_node=res["ranks_per_node"])
        p = raw.predict_step(shape, "shardq", 1)
        sq.append((p.comm_ms + p.other_ms, ms["kernel"], ms["shardq"] - ms["kernel"]))
        tp.append(ms["headtp"] - ms["kernel_headtp"])
        advance()
    shardq = fit_step_overhead(sq)
    why = degenerate_fit("shardq", shardq, sq)
    if why is not None:  # never a silent zero model: say so, and keep the conservative overhead
        shardq = CONSERVATIVE.steps["shardq"]
        log.warning("%s; the table keeps the conservative default %s instead", why, shardq)
    steps = {"shardq": shardq, "headtp": StepOverhead(round(max(0.0, sorted(tp)[len(tp) // 2]), 6), 1.0)}
    steps["pcp"] = steps["shardq"]
    return _with_steps(cal, steps)


def _with_steps(cal: Calibration, steps: dict[str, StepOverhead]) -> Calibration:
    return dataclasses.replace(cal, steps=steps)


#: ``--step-tokens``' default: a small step, and one the planner pipelines.
DEFAULT_STEP_TOKENS = (8192, 32768)


def check_options(args: argparse.Namespace) -> None:
    """Raise :class:`BadOption` for a count out of range, an ``--out`` that cannot be written or a
    ``--merge-into`` table that cannot be read, before anything is measured."""
    # --tokens: at least one full group of the largest G, whose union ratio the points record
    # --step-tokens: a ShardQ step (below its gate the step runs head-TP, and ShardQ's overhead
    # would be fitted from head-TP steps)
    step_tokens_given = args.step_tokens is not None
    if not step_tokens_given:
        args.step_tokens = list(DEFAULT_STEP_TOKENS)
    for name, minimum in (("heads", 1), ("tokens", max(GROUPS)), ("step_tokens", MIN_SHARD_TOKENS), ("topk", 1),
                          ("cached", 0), ("reps", 1), ("passes", 1)):  # fmt: skip
        value = getattr(args, name)
        for v in value if isinstance(value, list) else [value]:
            if v < minimum:
                option = "--" + name.replace("_", "-")
                raise BadOption(f"shardattn.calibrate: error: {option} must be >= {minimum}, got {v}")
    try:  # torchrun's variables (none: one rank)
        world = DistEnv.from_env().world_size
    except ValueError as e:
        raise BadOption(f"shardattn.calibrate: error: {e}") from None
    if step_tokens_given and (not args.steps or args.merge_into is not None or world == 1):
        skipper = "--no-steps" if not args.steps else "--merge-into" if args.merge_into is not None else "one rank"
        raise BadOption(f"shardattn.calibrate: error: --step-tokens sizes the whole steps, and {skipper} times none")
    if args.steps and args.merge_into is None and world > 1 and not step_configs(world):
        raise BadOption(
            f"shardattn.calibrate: error: no whole-step configuration's heads divide over {world} ranks "
            f"({', '.join(p if h is None else f'{p} at {h} heads' for p, h in STEP_CONFIGS)}); pass --no-steps"
        )
    # on rank 0, which writes the table (another host may lack the path, and does not need it)
    if os.environ.get("RANK", "0") == "0" and (why := unwritable_reason(args.out)) is not None:
        raise BadOption(f"shardattn.calibrate: error: --out {args.out}: cannot write the table there ({why})")
    if args.merge_into is None:
        if "bf16" not in args.kv_dtype:  # a table needs bf16 per-query points (FP8 calls fall back to them)
            raise BadOption(
                "shardattn.calibrate: error: --kv-dtype must include bf16 (a table needs its points), or add the "
                "other formats' points to a table with --merge-into TABLE"
            )
        return
    try:
        with open(args.merge_into) as f:
            table = Calibration.from_json(f.read())
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise BadOption(
            f"shardattn.calibrate: error: --merge-into {args.merge_into}: no table readable there ({e})"
        ) from None
    if not same_gpu(table.gpu, here := this_gpu(measure_device(args.cpu))):
        raise BadOption(
            f"shardattn.calibrate: error: --merge-into {args.merge_into}: the table is for {table.gpu!r}, this GPU "
            f"is {here!r} (merge on the machine the table was measured on)"
        )


def _main(group: dist.ProcessGroup | None, args: argparse.Namespace) -> int:
    """Measure (and merge), write the table on rank 0 and say what it holds: the exit status."""
    table = None
    if args.merge_into is not None:  # read it first: a bad path fails before minutes of measuring
        with open(args.merge_into) as f:
            table = Calibration.from_json(f.read())
        args.steps = False
    cal = calibrate(args, group)
    if cal is None:
        return 0
    if table is not None:
        cal = merge_kernel_points(table, cal)
    if (refused := write_text(args.out, cal.to_json() + "\n")) is not None:  # minutes measured: kept elsewhere
        print(f"shardattn.calibrate: error: --out {args.out}: could not write the table ({refused})", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {cal.gpu}, {len(cal.kernels)} kernel points, copy {cal.copy_gbps:g} GB/s", flush=True)
    for c in cal.collectives:
        rpn = c.ranks_per_node
        where = "" if c.one_host or rpn is None else f", {c.world_size // rpn} hosts"
        print(
            f"  {c.op} W={c.world_size}{where}: {c.latency_ms * 1e3:.1f} us + bytes / {c.busbw_gbps:g} GB/s", flush=True
        )
    if cal.network is not None:
        n = cal.network
        print(
            f"  network between hosts: {n.latency_ms * 1e3:.1f} us + bytes / {n.busbw_gbps:g} GB/s per GPU", flush=True
        )
    for name, s in cal.steps.items():
        print(
            f"  {name} step: {s.fixed_ms:.3f} ms + {s.factor:.3f} x (collectives + copies, "
            f"{s.hidden:.0%} of min(them, kernel) hidden)",
            flush=True,
        )
    return 0


#: What a CPU run without ``--cpu`` says (one line).
NO_GPU = (
    "shardattn.calibrate: error: no CUDA GPU here; it measures GPU kernels and collectives (one rank per GPU "
    "under torchrun, a few minutes on an H200). On the CPU it would time the torch reference for hours, and "
    "by default a CPU Runtime routes by the ShardQ gate alone; pass --cpu to measure it anyway"
)


def main(argv: list[str] | None = None) -> int:
    try:  # every rank reaches the same verdict on a bad option: one of them says it, in one line
        args = build_parser().parse_args(argv)
        check_options(args)
    except BadOption as e:
        return report_once(str(e), 2)
    if not torch.cuda.is_available() and not args.cpu:
        return report_once(NO_GPU, 2)
    env = DistEnv.from_env()  # checked by check_options
    configure_logging(args.log_level, env.rank)
    if "RANK" in os.environ:  # under torchrun: one rank per GPU
        from shardattn.launch.local import run_ranks

        args.host_id = env.host_id  # torchrun's agent: one node each

        entry = _Entry(args)
        run_ranks(entry, cpu=args.cpu)  # in this process: the entry keeps the rank's status
        return entry.status
    return _main(None, args)


class _Entry:
    """A picklable ``main(group)`` for :func:`~shardattn.launch.local.run_ranks`."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.status = 0

    def __call__(self, group: dist.ProcessGroup) -> None:
        self.status = _main(group, self.args)


if __name__ == "__main__":
    sys.exit(main())
