"""Prefill paths side by side, measured and predicted: kernel alone, head-TP, ShardQ, the router's choice.

Usage (one rank per GPU)::

    torchrun --nproc-per-node 2 benchmarks/scaling.py --json scaling.json --png scaling.png
    python benchmarks/scaling.py --predict-only --simulate 4 8 --a2a-gbps 282   # no GPU needed
    python benchmarks/scaling.py --predict-only --gpu "NVIDIA H200" --simulate 16 32 --nodes 2 4   # 2 x 8, 4 x 8
    torchrun --nproc-per-node 2 benchmarks/scaling.py --tokens 512 --topk 16 --configs 0   # CPU dry run

For each configuration (model, heads, new tokens; 4 requests with 8,192 cached tokens each,
DSA-like top-k 2,048, bf16) every rank times, in one run (``shardattn.calibrate.steps``):
the kernel alone as ShardQ runs it (all heads, the rank's zigzag tokens), the head-TP step,
the ShardQ step (gate-only routing) and the step the cost-model router chooses; rank 0 prints
each path's median (the slowest rank's), the cost model's prediction and its error, and the
ratio to head-TP measured in the same run, and counts the configurations where the router's
step is within 5 % of the fastest measured path and every prediction within 15 %.

``--shardq-chunks N ...``, ``--taper`` and ``--one-union`` also time the ShardQ step with those
Runtime options (``PrefillOptions(chunks=, taper=, one_union=)``; the planner's chunks
when no count is given) beside the default ShardQ step of the same run, each first checked to give
the default step's bits.

``--simulate W ...`` adds the same table predicted for ``W`` ranks from the calibration, with the
all-to-all bus bandwidth ``--a2a-gbps`` (default: the calibration's two-rank rate) and latency
``--a2a-latency-us``: the calibration holds only the world sizes it was measured at.
``--nodes K ...`` (one per ``--simulate`` size, or one for all) spreads each simulated group over
``K`` hosts of ``W / K`` ranks: every ShardQ all-to-all then sends ``(W - W/K) / W`` of its bytes
over the network, at the calibration's measured rate between hosts or the default of ``--link``
(``shardattn.plan.links.LINKS``; ``--net-gbps`` / ``--net-latency-us`` override it), side by side
with the NVLink share, the slower bounding the exchange. The table prints the one-host and the
K-host predictions and the router's choice for each, and lists where the network changes the
choice. ``--gpu NAME`` takes the table shipped for that GPU on any machine.

Records (``--json``, ``benchmarks/records.py``): ``prefill-scaling`` (the ShardQ step against
head-TP, the router's step against the fastest measured path), ``cost-model`` (each predicted
step against the measured one) and, with ``--simulate``, ``prefill-scaling-predicted`` (on ``K``
hosts also ``hosts``, ``ranks per host`` and the network's GB/s in the configuration). The PNG
(matplotlib, imported only when asked) plots step time against tokens for each path, one panel
per model, predictions dashed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import add_json_argument, environment, print_table, record, write_json
from scaling_predict import simulate

from shardattn.calibrate.steps import PATHS, fail_together, measure_paths, with_heads
from shardattn.calibrate.timing import median_ms
from shardattn.launch.local import run_ranks
from shardattn.launch.process_group import DistEnv
from shardattn.launch.workloads import build_prefill
from shardattn.plan.cost import CostModel, load_calibration
from shardattn.plan.links import LINKS
from shardattn.plan.spec import ModelSpec, get_preset
from shardattn.runtime.options import PrefillOptions
from shardattn.runtime.runtime import Runtime

#: (label, preset, heads override, tokens): two presets and two head counts at 8K and 32K new tokens.
CONFIGS = (
    ("glm5", "glm5", None, 8192),
    ("deepseek-v32", "deepseek-v32", None, 8192),
    ("16 heads", "glm5", 16, 8192),
    ("32 heads", "glm5", 32, 8192),
    ("16 heads", "glm5", 16, 32768),
    ("glm5", "glm5", None, 32768),
    ("deepseek-v32", "deepseek-v32", None, 32768),
    ("32 heads", "glm5", 32, 32768),
)
ROUTER_SLACK, PREDICTION_TOLERANCE = 0.05, 0.15


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calibration", default=None, help="calibration table (default: the one shipped for the GPU)")
    p.add_argument("--configs", type=int, nargs="+", default=None, help="indices into CONFIGS (default all)")
    p.add_argument("--reps", type=int, default=7, help="timed steps per path (default 7)")
    p.add_argument("--cached", type=int, default=8192, help="cached tokens per request (default 8192)")
    p.add_argument("--tokens", type=int, default=None, help="override every configuration's tokens (smoke runs)")
    p.add_argument("--topk", type=int, default=None, help="override the presets' top-k (smoke runs)")
    add_json_argument(p)
    p.add_argument("--png", default=None, help="plot step time against tokens here (rank 0, matplotlib)")
    p.add_argument("--simulate", type=int, nargs="*", default=[], help="also predict for these world sizes")
    p.add_argument("--a2a-gbps", type=float, default=None, help="all-to-all bus GB/s for --simulate")
    p.add_argument("--a2a-latency-us", type=float, default=None, help="all-to-all latency for --simulate")
    p.add_argument("--predict-only", action="store_true", help="no measurement: predictions only (any machine)")
    p.add_argument(
        "--gpu", default=None, help='the shipped table of this GPU, e.g. "NVIDIA H200" (default: the visible GPU\'s)'
    )
    p.add_argument(
        "--nodes", type=int, nargs="+", default=None, help="hosts of each --simulate size (one value: every size)"
    )
    p.add_argument(
        "--link", default=None, choices=sorted(LINKS), help="network between hosts (default: measured, else ib-ndr)"
    )
    p.add_argument("--net-gbps", type=float, default=None, help="network GB/s per GPU for --nodes (overrides --link)")
    p.add_argument("--net-latency-us", type=float, default=None, help="network latency for --nodes (with --net-gbps)")
    p.add_argument("--shardq-chunks", type=int, nargs="+", default=[], help="also time ShardQ at these chunk counts")
    p.add_argument("--taper", action="store_true", help="... with tapered chunks (PrefillOptions(taper=True))")
    p.add_argument("--one-union", action="store_true", help="... with one union build per step")
    return p


def shardq_variants(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """``(label, PrefillOptions fields)`` of the extra ShardQ steps the options ask for."""
    counts = args.shardq_chunks or ([None] if args.taper or args.one_union else [])
    out = []
    for c in counts:
        label = ("the planner's chunks" if c is None else f"{c} chunks") + (", tapered" if args.taper else "")
        label += ", one union build" if args.one_union else ""
        out.append((label, {"chunks": c, "taper": args.taper, "one_union": args.one_union}))
    return out


def time_shardq_variants(
    group: dist.ProcessGroup, spec: ModelSpec, tokens: int, args: argparse.Namespace, device: torch.device
) -> dict[str, float]:
    """Median ms on this rank of each :func:`shardq_variants` step, on ``measure_paths``' synthetic
    step; raises when one does not give the default ShardQ step's bits."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    step = build_prefill(heads=spec.num_heads, head_dim=spec.head_dim, tokens=tokens, requests=4,
                         cached=(args.cached,) * 4, topk=spec.topk, overlap="dsa", dtype=getattr(torch, spec.dtype),
                         device=device, seed=0, block_size=spec.page_size)  # fmt: skip
    h = spec.num_heads // world
    q_local = step.q[:, rank * h : (rank + 1) * h].contiguous()
    common = {"max_batched_tokens": tokens, "device": device, "topk": spec.topk, "warmup": False}

    def runtime_step(kw: dict[str, Any]):
        options = PrefillOptions(min_shard_tokens=1024, min_group_tokens=1024, cost_model=None, **kw)
        rt = Runtime(spec, group, mode="shardq", prefill_options=options, **common)
        plan = rt.plan_prefill(step.query_lens, step.prefix_lens, kv_rows=int(step.kv.shape[0]))
        return rt, plan, rt.prefill(q_local, step.kv, step.rows, plan=plan, check=True)

    _, _, want = runtime_step({})
    ms = {}
    for label, kw in shardq_variants(args):
        rt, plan, got = runtime_step(kw)
        same = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        fail_together(None if same else f"ShardQ with {label} differs from the default ShardQ step (rank {rank})",
                      group, f"ShardQ with {label} differs from the default ShardQ step on another rank")  # fmt: skip
        ms[label] = median_ms(lambda rt=rt, plan=plan: rt.prefill(q_local, step.kv, step.rows, plan=plan, check=False),
                              device=device, reps=args.reps, warmup=2, group=group)  # fmt: skip
    return ms


def _configs(args: argparse.Namespace) -> list[tuple[str, str, int | None, int]]:
    picked = [CONFIGS[i] for i in args.configs] if args.configs else list(CONFIGS)
    return [(label, p, h, args.tokens or t) for label, p, h, t in picked]


def _spec(args: argparse.Namespace, preset: str, heads: int | None, device: torch.device) -> ModelSpec:
    spec = with_heads(get_preset(preset), heads)
    if args.topk is not None:
        spec = dataclasses.replace(spec, topk=args.topk)
    return spec if device.type == "cuda" else dataclasses.replace(spec, dtype="float32")


def _model(args: argparse.Namespace, device: torch.device | None = None) -> CostModel:
    """``--gpu``'s table, else the visible GPU's (``device``: the GPU's unless it is the CPU)."""
    on_gpu = torch.cuda.is_available() and (device is None or device.type == "cuda")
    gpu = args.gpu or (torch.cuda.get_device_name() if on_gpu else None)
    return CostModel(load_calibration(gpu, args.calibration))


def _simulate(args: argparse.Namespace, env: dict[str, Any]) -> list[dict[str, Any]]:
    """``--simulate``'s records (:func:`scaling_predict.simulate`) for the chosen configurations."""
    cuda = torch.device("cuda")
    configs = [(label, _spec(args, preset, heads, cuda), tokens) for label, preset, heads, tokens in _configs(args)]
    return simulate(args, _model(args), env, configs)


# -- measurement --------------------------------------------------------------------------------------
def _device(group: dist.ProcessGroup) -> torch.device:
    """The rank's GPU where the world runs on NCCL (one GPU a rank), else the CPU (gloo: also a
    world of more ranks than GPUs)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def measure(group: dist.ProcessGroup, args: argparse.Namespace) -> list[dict[str, Any]] | None:
    """Every configuration on every rank; rank 0 returns the rows (the slowest rank's times)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = _device(group)
    model = _model(args, device)
    rows = []
    for label, preset, heads, tokens in _configs(args):
        spec = _spec(args, preset, heads, device)
        res = measure_paths(
            group, spec, tokens=tokens, requests=4, cached=args.cached, device=device, model=model, reps=args.reps,
            host_id=DistEnv.from_env().host_id,
        )  # fmt: skip
        res["variants"] = time_shardq_variants(group, spec, tokens, args, device) if shardq_variants(args) else {}
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, res, group=group)
        if rank == 0:
            ms = {k: max(r["ms"][k] for r in gathered) for k in res["ms"]}
            rows.append(
                {
                    "label": label,
                    "preset": preset,
                    "heads": spec.num_heads,
                    "tokens": tokens,
                    "world_size": world,
                    "ms": ms,
                    "ms_per_rank": [r["ms"] for r in gathered],
                    "predicted_ms": res["predicted_ms"],
                    "path": res["path"],
                    "router_reason": res["reason"].get("router", ""),
                    "variants": {k: max(r["variants"][k] for r in gathered) for k in res["variants"]},
                }
            )
            print(_line(rows[-1]), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows if rank == 0 else None


def _line(row: dict[str, Any]) -> str:
    ms, pred = row["ms"], row["predicted_ms"]
    parts = [f"{k} {ms[k]:.2f} (pred {pred.get(k, float('nan')):.2f})" for k in PATHS if k in ms]
    return f"{row['label']} T={row['tokens']}: " + ", ".join(parts) + f" | router: {row['path'].get('router')}"


def verdicts(row: dict[str, Any]) -> dict[str, Any]:
    """Router within 5 % of the fastest measured step; each prediction's relative error."""
    ms, pred = row["ms"], row["predicted_ms"]
    steps = {k: ms[k] for k in ("headtp", "shardq", "router") if k in ms}
    fastest = min(steps.values())
    errors = {k: (pred[k] - ms[k]) / ms[k] for k in ms if k in pred}
    return {
        "router_over_fastest": ms["router"] / fastest if "router" in ms else None,
        "router_ok": "router" in ms and ms["router"] <= fastest * (1 + ROUTER_SLACK),
        "prediction_error": errors,
        "predictions_ok": all(abs(e) <= PREDICTION_TOLERANCE for e in errors.values()),
    }


PATH_NAMES = {"kernel": "ShardQ kernel alone", "kernel_headtp": "head-TP kernel alone", "headtp": "head-TP",
              "shardq": "ShardQ", "router": "router"}  # fmt: skip


def _config(row: dict[str, Any]) -> dict[str, Any]:
    return {"model": row["label"], "heads": row["heads"], "tokens": row["tokens"], "ranks": row["world_size"]}


def measured_records(rows: list[dict[str, Any]], env: dict[str, Any]) -> list[dict[str, Any]]:
    """``prefill-scaling`` and ``cost-model`` records of the measured rows (module docstring)."""
    out = []
    for row in rows:
        ms, pred, config = row["ms"], row["predicted_ms"], _config(row)
        out.append(record("prefill-scaling", config, "ShardQ step ms", ms["shardq"], "ms", "lower",
                          ("head-TP step, same run", ms["headtp"]), env))  # fmt: skip
        fastest = min(ms["headtp"], ms["shardq"])
        out.append(record("prefill-scaling", config, "router's step ms", ms["router"], "ms", "lower",
                          ("fastest measured path, same run", fastest), env))  # fmt: skip
        for label, v in row["variants"].items():
            out.append(record("prefill-scaling", config, f"ShardQ step ms, {label}", v, "ms", "lower",
                              ("ShardQ step, same run", ms["shardq"]), env))  # fmt: skip
        for k in PATH_NAMES:
            if k in pred and k in ms:
                out.append(record("cost-model", config | {"path": PATH_NAMES[k]}, "predicted step ms", pred[k], "ms",
                                  "none", ("measured, same run", ms[k]), env))  # fmt: skip
    return out


def summary(rows: list[dict[str, Any]]) -> None:
    """Routes and the two counts of the module docstring."""
    for row in rows:
        v = verdicts(row)
        errs = ", ".join(f"{PATH_NAMES[k]} {100 * e:+.1f} %" for k, e in v["prediction_error"].items())
        print(f"{row['label']} T={row['tokens']}: router {row['path']['router']} "
              f"({v['router_over_fastest']:.3f}x the fastest); prediction errors {errs}")  # fmt: skip
    ok_r = sum(verdicts(r)["router_ok"] for r in rows)
    ok_p = sum(verdicts(r)["predictions_ok"] for r in rows)
    print(f"router within {ROUTER_SLACK:.0%} of the fastest: {ok_r}/{len(rows)}; ", end="")
    print(f"every prediction within {PREDICTION_TOLERANCE:.0%}: {ok_p}/{len(rows)}", flush=True)


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Step time against tokens, one panel per model, one line per path (predictions dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["label"] for r in rows))
    fig, axes = plt.subplots(1, len(labels), figsize=(4.2 * len(labels), 3.6), squeeze=False)
    for ax, label in zip(axes[0], labels):
        mine = sorted((r for r in rows if r["label"] == label), key=lambda r: r["tokens"])
        xs = [r["tokens"] for r in mine]
        for k, color in zip(("kernel", "headtp", "shardq", "router"), ("grey", "C0", "C1", "C2")):
            ax.plot(xs, [r["ms"][k] for r in mine], "o-", color=color, label=f"{k} measured")
            ax.plot(xs, [r["predicted_ms"][k] for r in mine], "x--", color=color, alpha=0.6, label=f"{k} predicted")
        ax.set_title(f"{label} ({mine[0]['heads']} heads), W={mine[0]['world_size']}")
        ax.set_xlabel("new tokens")
        ax.set_ylabel("step ms")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


class _Entry:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def __call__(self, group: dist.ProcessGroup) -> None:
        rows = measure(group, self.args)
        if rows is None:
            return
        env = environment(dist.get_world_size(group), _device(group))
        summary(rows)
        records = measured_records(rows, env)
        records += _simulate(self.args, env) if self.args.simulate else []
        print_table(records, "prefill paths and the cost model")
        write_json(self.args.json, records)
        if self.args.png:
            plot(rows, self.args.png)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.predict_only:
        records = _simulate(args, environment())
        print_table(records, "the cost model's predictions")
        write_json(args.json, records)
        return 0
    if "RANK" not in os.environ:
        print("run under torchrun (one rank per GPU), or pass --predict-only", file=sys.stderr)
        return 2
    run_ranks(_Entry(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
