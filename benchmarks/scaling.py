"""Prefill paths side by side, measured and predicted: kernel alone, head-TP, ShardQ, the router's choice.

Usage (one rank per GPU)::

    torchrun --nproc-per-node 2 benchmarks/scaling.py --json scaling.json --png scaling.png
    python benchmarks/scaling.py --predict-only --simulate 4 8 --a2a-gbps 282   # no GPU needed
    python benchmarks/scaling.py --predict-only --gpu "NVIDIA H200" --simulate 16 32 --nodes 2 4   # 2 x 8, 4 x 8

For each configuration (model, heads, new tokens; 4 requests with 8,192 cached tokens each,
DSA-like top-k 2,048, bf16) every rank times, in one run (``shardattn.calibrate.steps``):
the kernel alone as ShardQ runs it (all heads, the rank's zigzag tokens), the head-TP step,
the ShardQ step (gate-only routing) and the step the cost-model router chooses; rank 0 prints
each path's median (the slowest rank's), the cost model's prediction and its error, and the
ratio to head-TP measured in the same run, and checks the targets: the router's path within 5 %
of the fastest measured path, every prediction within 15 %.

``--simulate W ...`` adds the same table predicted for ``W`` ranks from the calibration, with the
all-to-all bus bandwidth ``--a2a-gbps`` (default: the calibration's two-rank rate) and latency
``--a2a-latency-us``: the calibration holds only the world sizes it was measured at.
``--nodes K ...`` (one per ``--simulate`` size, or one for all) spreads each simulated group over
``K`` hosts of ``W / K`` ranks: every ShardQ all-to-all then sends ``(W - W/K) / W`` of its bytes
over the network, at the calibration's measured rate between hosts or the default of ``--link``
(``plan.links.LINKS``; ``--net-gbps`` / ``--net-latency-us`` override it), side by side with the
NVLink share, the slower bounding the exchange (``plan.links``). The table prints the one-host
and the K-host predictions and the router's choice for each, and lists where the network changes
the choice.

The JSON holds every number; the PNG (matplotlib, imported only when asked) plots step time
against tokens for each path, one panel per model, predictions dashed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from shardattn.calibrate.steps import PATHS, measure_paths, with_heads
from shardattn.launch.local import run_ranks
from shardattn.launch.process_group import DistEnv
from shardattn.plan.cost import CollectiveRate, CostModel, StepShape, choose_prefill, load_calibration
from shardattn.plan.links import LINKS, LinkRate, resolve_link
from shardattn.plan.spec import ModelSpec, get_preset

#: (label, preset, heads override, tokens): the configurations of issue 15's table and more.
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
    p.add_argument(
        "--gpu", default=None, help='the shipped table of this GPU, e.g. "NVIDIA H200" (default: the visible GPU\'s)'
    )
    p.add_argument("--configs", type=int, nargs="+", default=None, help="indices into CONFIGS (default all)")
    p.add_argument("--reps", type=int, default=7, help="timed steps per path (default 7)")
    p.add_argument("--cached", type=int, default=8192, help="cached tokens per request (default 8192)")
    p.add_argument("--tokens", type=int, default=None, help="override every configuration's tokens (smoke runs)")
    p.add_argument("--topk", type=int, default=None, help="override the presets' top-k (smoke runs)")
    p.add_argument("--json", default=None, help="write every number here (rank 0)")
    p.add_argument("--png", default=None, help="plot step time against tokens here (rank 0, matplotlib)")
    p.add_argument("--simulate", type=int, nargs="*", default=[], help="also predict for these world sizes")
    p.add_argument("--a2a-gbps", type=float, default=None, help="all-to-all bus GB/s for --simulate")
    p.add_argument("--a2a-latency-us", type=float, default=None, help="all-to-all latency for --simulate")
    p.add_argument("--predict-only", action="store_true", help="no measurement: predictions only (any machine)")
    p.add_argument(
        "--nodes", type=int, nargs="+", default=None, help="hosts of each --simulate size (one value: every size)"
    )
    p.add_argument(
        "--link", default=None, choices=sorted(LINKS), help="network between hosts (default: measured, else ib-ndr)"
    )
    p.add_argument("--net-gbps", type=float, default=None, help="network GB/s per GPU for --nodes (overrides --link)")
    p.add_argument("--net-latency-us", type=float, default=None, help="network latency for --nodes (with --net-gbps)")
    return p


def _configs(args: argparse.Namespace) -> list[tuple[str, str, int | None, int]]:
    picked = [CONFIGS[i] for i in args.configs] if args.configs else list(CONFIGS)
    return [(label, p, h, args.tokens or t) for label, p, h, t in picked]


def _spec(args: argparse.Namespace, preset: str, heads: int | None, device: torch.device) -> ModelSpec:
    spec = with_heads(get_preset(preset), heads)
    if args.topk is not None:
        spec = dataclasses.replace(spec, topk=args.topk)
    return spec if device.type == "cuda" else dataclasses.replace(spec, dtype="float32")


def _model(args: argparse.Namespace) -> CostModel:
    gpu = args.gpu or (torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    return CostModel(load_calibration(gpu, args.calibration))


# -- measurement --------------------------------------------------------------------------------------
def measure(group: dist.ProcessGroup, args: argparse.Namespace) -> list[dict[str, Any]] | None:
    """Every configuration on every rank; rank 0 returns the rows (the slowest rank's times)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model = _model(args)
    rows = []
    for label, preset, heads, tokens in _configs(args):
        spec = _spec(args, preset, heads, device)
        res = measure_paths(
            group, spec, tokens=tokens, requests=4, cached=args.cached, device=device, model=model, reps=args.reps,
            host_id=DistEnv.from_env().host_id,
        )  # fmt: skip
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


def render(rows: list[dict[str, Any]]) -> None:
    """The measured table (markdown, ready for RESULTS.md)."""
    print(
        "\n| model | T | kernel alone ms | head-TP ms | ShardQ ms (x head-TP) | ShardQ / kernel | router path "
        "| router ms (x head-TP) | router / fastest | predicted ms (err %): kernel, head-TP, ShardQ, router |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        ms, pred, v = row["ms"], row["predicted_ms"], verdicts(row)
        tp = ms["headtp"]
        errs = ", ".join(
            f"{pred[k]:.2f} ({100 * v['prediction_error'][k]:+.0f})"
            for k in ("kernel", "headtp", "shardq", "router")
            if k in pred
        )
        print(
            f"| {row['label']} ({row['heads']} heads) | {row['tokens']} | {ms['kernel']:.2f} | {tp:.2f} "
            f"| {ms['shardq']:.2f} ({tp / ms['shardq']:.2f}x) | {ms['shardq'] / ms['kernel']:.2f} "
            f"| {row['path']['router']} | {ms['router']:.2f} ({tp / ms['router']:.2f}x) "
            f"| {v['router_over_fastest']:.3f} | {errs} |"
        )
    ok_r = sum(verdicts(r)["router_ok"] for r in rows)
    ok_p = sum(verdicts(r)["predictions_ok"] for r in rows)
    print(f"\nrouter within {ROUTER_SLACK:.0%} of the fastest: {ok_r}/{len(rows)}; ", end="")
    print(f"every prediction within {PREDICTION_TOLERANCE:.0%}: {ok_p}/{len(rows)}", flush=True)


# -- prediction for other world sizes -------------------------------------------------------------------
def _network(args: argparse.Namespace, model: CostModel) -> LinkRate:
    if args.net_gbps is not None:
        lat = 0.0 if args.net_latency_us is None else args.net_latency_us / 1e3
        return LinkRate("--net-gbps", lat, args.net_gbps, "given on the command line")
    return resolve_link(args.link, model.calibration.network)


def _hosts(args: argparse.Namespace) -> list[int]:
    """Hosts of each ``--simulate`` size (1: one host)."""
    nodes = args.nodes or [1]
    if len(nodes) == 1:
        nodes = nodes * len(args.simulate)
    if len(nodes) != len(args.simulate):
        raise SystemExit(f"--nodes takes one value, or one per --simulate size ({len(args.simulate)})")
    for w, k in zip(args.simulate, nodes):
        if k < 1 or w % k:
            raise SystemExit(f"--nodes {k}: {w} ranks do not split evenly over {k} hosts")
    return nodes


def simulate(args: argparse.Namespace, model: CostModel) -> list[dict[str, Any]]:
    """The cost model's table at each ``--simulate`` world size, on one host and on ``--nodes`` hosts
    (module docstring)."""
    base = model.collective("all_to_all", 2)
    gbps = args.a2a_gbps if args.a2a_gbps is not None else base.busbw_gbps
    lat = args.a2a_latency_us / 1e3 if args.a2a_latency_us is not None else base.latency_ms
    cal = model.calibration.gpu
    source = "--a2a-gbps" if args.a2a_gbps is not None else f"the calibration's 2-rank all-to-all ({cal})"
    hosts = _hosts(args)
    net = _network(args, model)
    out, changed = [], []
    print(
        f"\nsimulated: all-to-all on one host {gbps:g} GB/s bus bandwidth, {lat * 1e3:.0f} us latency (from {source})"
    )
    if any(k > 1 for k in hosts):
        print(
            f"between hosts: {net.name}, {net.busbw_gbps:g} GB/s per GPU, {net.latency_ms * 1e3:.0f} us ({net.source})"
        )
    print(
        "| W | hosts x ranks | model | T | head-TP ms | ShardQ ms, 1 host | ShardQ ms, K hosts (a2a GB/s) "
        "| router's path, 1 host | ms | router's path, K hosts | ms | x head-TP (K hosts) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for w, k in zip(args.simulate, hosts):
        rate = CollectiveRate("all_to_all", w, lat, gbps)
        sim = CostModel(model.calibration, collective_overrides={"all_to_all": rate}, network=net)
        rpn = w // k
        for label, preset, heads, tokens in _configs(args):
            spec = _spec(args, preset, heads, torch.device("cuda"))
            if spec.num_heads % w:
                continue
            one = StepShape(heads=spec.num_heads, world_size=w, tokens=tokens, topk=spec.topk)
            spread = dataclasses.replace(one, ranks_per_node=rpn if k > 1 else None)
            choice_one, choice_k = choose_prefill(sim, one), choose_prefill(sim, spread)
            tp = min(p.ms for p in sim.predict(one, steps=("headtp",)))
            sq_one = min(p.ms for p in sim.predict(one, steps=("shardq",)))
            sq_k = min(p.ms for p in sim.predict(spread, steps=("shardq",)))
            a2a = sim.collective("all_to_all", w, rpn if k > 1 else None).busbw_gbps
            row = {"world_size": w, "nodes": k, "ranks_per_node": rpn, "label": label, "heads": spec.num_heads}
            row |= {"tokens": tokens, "headtp_ms": tp, "shardq_ms": sq_one, "shardq_nodes_ms": sq_k, "a2a_gbps": gbps}
            row |= {"router_path": choice_one.best.name, "router_ms": choice_one.best.ms}
            row |= {"router_nodes_path": choice_k.best.name, "router_nodes_ms": choice_k.best.ms}
            row |= {"a2a_nodes_gbps": a2a, "network": dataclasses.asdict(net) if k > 1 else None}
            out.append(row)
            if choice_one.best.step != choice_k.best.step:
                changed.append(row)
            print(
                f"| {w} | {k} x {rpn} | {label} ({spec.num_heads} heads, {spec.num_heads // w}/rank) | {tokens} "
                f"| {tp:.2f} | {sq_one:.2f} | {sq_k:.2f} ({a2a:.0f}) | {choice_one.best.name} "
                f"| {choice_one.best.ms:.2f} | {choice_k.best.name} | {choice_k.best.ms:.2f} "
                f"| {tp / choice_k.best.ms:.2f} |"
            )
    if any(k > 1 for k in hosts):
        print(f"\nthe network changes the router's choice in {len(changed)} of {len(out)} rows:")
        for r in changed:
            print(
                f"  {r['label']} T={r['tokens']} W={r['world_size']}: one host {r['router_path']} "
                f"{r['router_ms']:.2f} ms (ShardQ {r['shardq_ms']:.2f}, head-TP {r['headtp_ms']:.2f}); "
                f"{r['nodes']} x {r['ranks_per_node']} {r['router_nodes_path']} {r['router_nodes_ms']:.2f} ms "
                f"(ShardQ there {r['shardq_nodes_ms']:.2f})"
            )
    return out


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
        render(rows)
        sims = simulate(self.args, _model(self.args)) if self.args.simulate else []
        if self.args.json:
            with open(self.args.json, "w") as f:
                json.dump({"rows": [r | {"verdict": verdicts(r)} for r in rows], "simulated": sims}, f, indent=1)
        if self.args.png:
            plot(rows, self.args.png)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.predict_only:
        sims = simulate(args, _model(args))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": [], "simulated": sims}, f, indent=1)
        return 0
    if "RANK" not in os.environ:
        print("run under torchrun (one rank per GPU), or pass --predict-only", file=sys.stderr)
        return 2
    run_ranks(_Entry(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
