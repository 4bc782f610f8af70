"""Prefill steps predicted for world sizes and host counts that were not measured: the cost model
with the all-to-all rate of the calibration (or given) and, across hosts, a network link
(``benchmarks/scaling.py --simulate W ... [--nodes K ...]``; its docstring says what is printed).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import record

from shardattn.plan.cost import CollectiveRate, CostModel
from shardattn.plan.cost_choice import choose_prefill
from shardattn.plan.links import LinkRate, resolve_link
from shardattn.plan.spec import ModelSpec
from shardattn.plan.step_shape import StepShape

__all__ = ["simulate"]


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


def simulate(
    args: argparse.Namespace, model: CostModel, env: dict[str, Any], configs: list[tuple[str, ModelSpec, int]]
) -> list[dict[str, Any]]:
    """The cost model's predictions at each ``--simulate`` world size for each ``(label, spec,
    tokens)`` of ``configs``, on one host and, with ``--nodes``, on that many hosts (``scaling.py``'s
    docstring), as ``prefill-scaling-predicted`` records."""
    base = model.collective("all_to_all", 2)
    gbps = args.a2a_gbps if args.a2a_gbps is not None else base.busbw_gbps
    lat = args.a2a_latency_us / 1e3 if args.a2a_latency_us is not None else base.latency_ms
    cal = model.calibration.gpu
    source = "--a2a-gbps" if args.a2a_gbps is not None else f"the calibration's 2-rank all-to-all ({cal})"
    hosts, net = _hosts(args), _network(args, model)
    out, rows = [], []
    print(f"\nsimulated: all-to-all on one host {gbps:g} GB/s bus bandwidth, {lat * 1e3:.0f} us (from {source})")
    if any(k > 1 for k in hosts):
        print(
            f"between hosts: {net.name}, {net.busbw_gbps:g} GB/s per GPU, {net.latency_ms * 1e3:.0f} us ({net.source})"
        )
    for w, k in zip(args.simulate, hosts):
        rate = CollectiveRate("all_to_all", w, lat, gbps)
        sim = CostModel(model.calibration, collective_overrides={"all_to_all": rate}, network=net)
        rpn = w // k
        on = env | {"gpu": f"{w} x {cal}"}  # the GPUs predicted (from their calibration), not this machine's
        for label, spec, tokens in configs:
            if spec.num_heads % w:
                continue
            one = StepShape(heads=spec.num_heads, world_size=w, tokens=tokens, topk=spec.topk)
            tp = min(p.ms for p in sim.predict(one, steps=("headtp",)))
            config = {"model": label, "heads": spec.num_heads, "tokens": tokens, "ranks": w, "all-to-all GB/s": gbps,
                      "calibration": cal}  # fmt: skip
            row = {"label": label, "heads": spec.num_heads, "tokens": tokens, "ranks": w, "hosts": k, "headtp": tp}
            for where, shape in (("one host", one), (f"{k} hosts", dataclasses.replace(one, ranks_per_node=rpn))):
                if where != "one host" and k == 1:
                    continue
                choice = choose_prefill(sim, shape)
                sq = min(p.ms for p in sim.predict(shape, steps=("shardq",)))
                cfg = config if where == "one host" else config | {"hosts": k, "ranks per host": rpn,
                                                                    "network GB/s": net.busbw_gbps}  # fmt: skip
                headtp = ("predicted head-TP step", tp)
                out.append(record("prefill-scaling-predicted", cfg, "predicted ShardQ step ms", sq, "ms", "lower",
                                  headtp, on))  # fmt: skip
                out.append(record("prefill-scaling-predicted", cfg, "predicted router's step ms", choice.best.ms, "ms",
                                  "lower", headtp, on))  # fmt: skip
                row[where] = {"shardq": sq, "path": choice.best.name, "ms": choice.best.ms, "step": choice.best.step}
            rows.append(row)
    _print_simulated(rows)
    return out


def _print_simulated(rows: list[dict[str, Any]]) -> None:
    """The predictions side by side: one host and K hosts, and where the network changes the route."""
    print("| ranks | hosts | model | T | head-TP ms | ShardQ ms, 1 host | router, 1 host | ShardQ ms, K hosts "
          "| router, K hosts |\n|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    changed = []
    for r in rows:
        one, many = r["one host"], r.get(f"{r['hosts']} hosts")
        k_cols = "- | -" if many is None else f"{many['shardq']:.2f} | {many['path']} {many['ms']:.2f}"
        print(f"| {r['ranks']} | {r['hosts']} x {r['ranks'] // r['hosts']} | {r['label']} ({r['heads']} heads) "
              f"| {r['tokens']} | {r['headtp']:.2f} | {one['shardq']:.2f} | {one['path']} {one['ms']:.2f} "
              f"| {k_cols} |")  # fmt: skip
        if many is not None and many["step"] != one["step"]:
            changed.append((r, one, many))
    if any(r["hosts"] > 1 for r in rows):
        print(f"\nthe network changes the router's choice in {len(changed)} of {len(rows)} configurations:")
    for r, one, many in changed:
        print(f"  {r['label']} T={r['tokens']} on {r['ranks']} ranks: one host {one['path']} {one['ms']:.2f} ms "
              f"(head-TP {r['headtp']:.2f}); {r['hosts']} x {r['ranks'] // r['hosts']} {many['path']} "
              f"{many['ms']:.2f} ms (ShardQ there {many['shardq']:.2f})")  # fmt: skip
