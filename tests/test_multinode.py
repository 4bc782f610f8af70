"""Groups across hosts: the node layout, the network in the cost model and its table, the Runtime's
host exchange, DCP decode across hosts, and the launcher on two torchrun agents.

Two agents on one machine count as two nodes through the host identity the launcher passes
(torchrun's ``GROUP_RANK``); the distributed tests pass ``host_id`` the same way.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardattn.launch.process_group import DistEnv
from shardattn.launch.workloads import build_decode
from shardattn.ops.topk import DcpShard
from shardattn.parallel.comm import Comm, PeerFailedError
from shardattn.parallel.hosts import exchange_node_layout
from shardattn.plan.cost import Calibration, CollectiveRate, CostModel, load_calibration, shipped_calibration
from shardattn.plan.cost_choice import choose_prefill
from shardattn.plan.links import LINKS, LinkRate, cross_node_rate, resolve_link
from shardattn.plan.nodes import NodeLayout
from shardattn.plan.spec import get_preset
from shardattn.plan.step_shape import StepShape
from shardattn.runtime.options import PrefillOptions
from shardattn.runtime.runtime import Runtime
from shardattn.testing.pool import free_port
from tests.parallel_helpers import assert_rank_errors, short_timeout_group
from tests.test_cost_model import RT_SHARDQ_WINS, SHARDQ_WINS
from tests.test_runtime import GQA, MLA, _err, _gqa_oracle, _gqa_step, _heads, _mla_oracle

ROOT = Path(__file__).resolve().parents[1]


# -- the node layout -------------------------------------------------------------------------------
def test_node_layout_numbers_hosts_by_their_first_rank() -> None:
    nodes = NodeLayout.from_host_ids(["b", "a", "b", "c", "a", "b"])
    assert nodes.node_of == (0, 1, 0, 2, 1, 0)
    assert (nodes.num_nodes, nodes.node_sizes, nodes.ranks_per_node) == (3, (3, 2, 1), 1)
    assert nodes.ranks_on(0) == (0, 2, 5) and nodes.multi_node and str(nodes) == "3 nodes of 3/2/1 ranks"
    assert NodeLayout.uniform(4, 8).ranks_per_node == 8 and NodeLayout.uniform(4, 8).ranks_on(3)[0] == 24
    assert NodeLayout.single(8) == NodeLayout.from_host_ids(["h"] * 8) and not NodeLayout.single(8).multi_node
    assert (str(NodeLayout.single(1)), str(NodeLayout.uniform(2, 4))) == ("1 node x 1 rank", "2 nodes x 4 ranks")
    with pytest.raises(ValueError, match=r"^node_of must number nodes 0, 1, \.\.\. in the order"):
        NodeLayout((1, 0))
    with pytest.raises(ValueError, match="at least one rank"):
        NodeLayout(())
    with pytest.raises(TypeError, match="node_of must hold ints"):
        NodeLayout((0, 1.0))  # type: ignore[arg-type]


def test_launcher_host_identity_is_torchruns_agent() -> None:
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_PORT": "1", "GROUP_RANK": "1"}
    assert DistEnv.from_env(env).host_id == "torchrun-node-1"
    assert DistEnv.from_env({k: v for k, v in env.items() if k != "GROUP_RANK"}).host_id is None


# -- links and the cost model ------------------------------------------------------------------------
NDR = LINKS["ib-ndr"]


@pytest.mark.parametrize(("world", "rpn"), [(16, 8), (32, 8), (4, 1), (8, 2)])
def test_cross_node_all_to_all_is_bounded_by_the_slower_share(world: int, rpn: int) -> None:
    """Time of 1 GB per rank, written out from the bytes: (R-1)/W of it over NVLink, (W-R)/W over the NIC."""
    nv_gbps, nbytes = 300.0, 1e9
    lat, gbps = cross_node_rate(
        "all_to_all", world, rpn, nvlink_latency_ms=0.045, nvlink_gbps=nv_gbps, link=NDR
    )  # fmt: skip
    ms = CollectiveRate("all_to_all", world, lat, gbps).ms(nbytes)
    nvlink_ms = nbytes * (rpn - 1) / world / (nv_gbps * 1e9) * 1e3
    network_ms = nbytes * (world - rpn) / world / (NDR.busbw_gbps * 1e9) * 1e3
    assert ms == pytest.approx(max(0.045 if rpn > 1 else 0.0, NDR.latency_ms) + max(nvlink_ms, network_ms))
    lat, gbps = cross_node_rate("all_gather", world, rpn, nvlink_latency_ms=0.045, nvlink_gbps=nv_gbps, link=NDR)
    assert gbps == NDR.busbw_gbps  # the ring's slowest hop


def test_cross_node_rate_refuses_one_host_and_unknown_ops() -> None:
    with pytest.raises(ValueError, match=r"^ranks_per_node must be in \[1, world_size=8\)"):
        cross_node_rate("all_to_all", 8, 8, nvlink_latency_ms=0.0, nvlink_gbps=1.0, link=NDR)
    with pytest.raises(ValueError, match=r"^op must be"):
        cross_node_rate("all_reduce", 8, 4, nvlink_latency_ms=0.0, nvlink_gbps=1.0, link=NDR)
    with pytest.raises(ValueError, match=r"^network must be a LinkRate or one of \['eth-100'"):
        resolve_link("infiniband")
    with pytest.raises(ValueError, match="bad network bandwidth"):
        resolve_link(LinkRate("x", 0.01, 0.0))
    assert resolve_link(None) is NDR and resolve_link(None, LinkRate("measured", 0.01, 40.0)).busbw_gbps == 40.0


def test_one_host_predictions_are_unchanged_by_the_node_layout() -> None:
    model = CostModel(SHARDQ_WINS)
    shape = StepShape(heads=8, world_size=4, tokens=4096, topk=1024, head_dim=48, v_dim=32, dtype_bytes=4)
    for rpn in (None, 4, 8):  # one host of 4 (or a larger host): the table's one-host rate
        p = model.predict_step(dataclasses.replace(shape, ranks_per_node=rpn), "shardq")
        assert p == model.predict_step(shape, "shardq")


def test_exchanges_across_hosts_cost_the_network_and_can_change_the_route() -> None:
    """glm5 at 32K tokens on 16 H200s (shipped table, all-to-all at its 2-rank NVLink rate): one host
    takes ShardQ, 2 hosts x 8 take head-TP: ShardQ's bytes off the host go through a 50 GB/s NIC."""
    cal = shipped_calibration("NVIDIA H200")
    if cal is None:
        pytest.skip("no H200 table shipped in this checkout")
    nvlink = next(c for c in cal.collectives if c.op == "all_to_all" and c.world_size == 2)
    model = CostModel(cal, collective_overrides={"all_to_all": nvlink})
    one = StepShape.of(get_preset("glm5"), 16, 32768)
    two = dataclasses.replace(one, ranks_per_node=8)
    sq_one, sq_two = model.predict_step(one, "shardq"), model.predict_step(two, "shardq")
    assert sq_two.kernel_ms == sq_one.kernel_ms and sq_two.comm_ms > 2 * sq_one.comm_ms
    assert choose_prefill(model, one).best.step == "shardq"
    choice = choose_prefill(model, two)
    assert choice.best.step == "headtp" and choice.rejected.step == "shardq"
    assert "ranks on several hosts, 8 on the smallest, network 50 GB/s (ib-ndr)" in choice.reason
    # a faster network (the same rates as NVLink) gives the one-host answer back
    fast = CostModel(cal, collective_overrides={"all_to_all": nvlink}, network=LinkRate("fast", 0.045, 1e4))
    assert choose_prefill(fast, two).best.step == "shardq"
    # PCP's all-gather across hosts runs at the network's rate
    pcp_one, pcp_two = model.predict_step(one, "pcp"), model.predict_step(two, "pcp")
    assert pcp_two.comm_ms > pcp_one.comm_ms


def test_a_rate_measured_across_hosts_is_taken_as_it_is() -> None:
    measured = CollectiveRate("all_to_all", 4, 0.2, 7.0, ranks_per_node=2)
    cal = dataclasses.replace(SHARDQ_WINS, collectives=(*SHARDQ_WINS.collectives, measured))
    model = CostModel(cal)
    assert model.collective("all_to_all", 4, 2) == measured
    assert model.collective("all_to_all", 4).busbw_gbps == 1000.0  # one host: the one-host entry
    composed = model.collective("all_to_all", 8, 4)  # not measured: one host of 4 and the default network
    lat, gbps = cross_node_rate("all_to_all", 8, 4, nvlink_latency_ms=0.01, nvlink_gbps=1000.0, link=NDR)
    assert (composed.latency_ms, composed.busbw_gbps, composed.ranks_per_node) == (lat, gbps, 4)


# -- the table's format --------------------------------------------------------------------------------
def test_format_2_tables_round_trip_with_hosts_and_the_network() -> None:
    cal = dataclasses.replace(
        SHARDQ_WINS,
        collectives=(*SHARDQ_WINS.collectives, CollectiveRate("all_gather", 16, 0.05, 60.0, ranks_per_node=8)),
        network=LinkRate("measured", 0.021, 46.5, "test"),
    )
    text = cal.to_json()
    assert json.loads(text)["format"] == 2
    assert Calibration.from_json(text) == cal


def test_format_1_tables_still_load(tmp_path: Path) -> None:
    d = json.loads(SHARDQ_WINS.to_json())
    d["format"] = 1
    for c in d["collectives"]:
        del c["ranks_per_node"]
    del d["network"]
    cal = Calibration.from_json(json.dumps(d))
    assert cal == SHARDQ_WINS and cal.network is None and all(c.one_host for c in cal.collectives)
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(d))
    assert load_calibration("Test GPU", path) == SHARDQ_WINS
    shipped = shipped_calibration("NVIDIA H200")  # format 1, as measured
    assert shipped is None or (shipped.network is None and CostModel(shipped).network is NDR)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda d: d.update(format=3), r"format 3, expected one of \(1, 2\)"),
        (lambda d: d["collectives"][0].update(ranks_per_node=3), "ranks_per_node must divide world_size"),
        (lambda d: d["collectives"][0].update(ranks_per_node=0), "ranks_per_node must divide world_size"),
        (lambda d: d.update(network={"name": "x", "latency_ms": 0.01, "busbw_gbps": -5.0}), "bad network bandwidth"),
        (lambda d: d.update(network={"name": "x", "latency_ms": -1.0, "busbw_gbps": 5.0}), "bad network latency"),
        (lambda d: d.update(network={"name": "x", "gbps": 5.0}), r"network: unknown field\(s\) \[.gbps.\]"),
    ],
    ids=["format-3", "rpn-not-dividing", "rpn-zero", "net-negative-bw", "net-negative-latency", "net-malformed"],
)
def test_bad_tables_are_refused_naming_the_field(change, match: str) -> None:
    d = json.loads(SHARDQ_WINS.to_json())
    change(d)
    with pytest.raises(ValueError, match=match):
        Calibration.from_json(json.dumps(d))


# -- the Runtime across hosts (gloo, host identity overridden) -------------------------------------------
def _hosts_body(group, split: bool) -> dict:
    """A Runtime whose ranks 0-1 and 2-3 are two hosts (``split``), or one host: the node layout,
    the cost-model route, and DCP decode (sparse MLA and GQA) against the fp64 oracle."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    host = f"host-{rank // 2}" if split else "host-0"
    slow_network = CostModel(RT_SHARDQ_WINS, network=LinkRate("slow", 1.0, 1e-3))
    options = PrefillOptions(min_shard_tokens=1, cost_model=slow_network)
    rt = Runtime(MLA, group, max_batched_tokens=64, mode="mixed", prefill_options=options, host_id=host)
    plan = rt.plan_prefill([40, 24], [8, 0], kv_rows=200)
    s = build_decode(
        heads=MLA.num_heads, head_dim=MLA.head_dim, requests=3, cached=(37, 0, 70), q_lens=(1, 2, 1), topk=MLA.topk,
        overlap="random", causal=True, dtype=torch.float32, device=torch.device("cpu"), seed=6,
        shard=DcpShard(world, 1, rank), block_size=MLA.page_size,
    )  # fmt: skip
    rt.comm.reset_counts()
    out, lse = rt.decode(
        _heads(s.q, rank, world).contiguous(), s.local_kv, s.local_table, s.seq_lens, topk_pos=s.positions,
        req_ids=s.req_ids,
    )  # fmt: skip
    ref_out, ref_lse = _mla_oracle(s, rt.scale, s.seq_lens)
    errs = [_err(out, _heads(ref_out, rank, world)), _err(lse, _heads(ref_lse, rank, world))]
    mla_counts = dict(rt.comm.counts)
    gqa = Runtime(GQA, group, max_batched_tokens=64, mode="dcp-decode", host_id=host)
    g = _gqa_step((30, 3, 17), (1, 3, 2), 6, DcpShard(world, 1, rank))
    out, lse = gqa.decode(
        _heads(g.q, rank, world).contiguous(), (g.local_k_cache, g.local_v_cache), g.local_block_table, g.seq_lens,
        cu_q_lens=g.cu_q_lens, sinks=g.sinks,
    )  # fmt: skip
    ref_out, ref_lse = _gqa_oracle(g, gqa.scale)
    errs += [_err(out, _heads(ref_out, rank, world)), _err(lse, _heads(ref_lse, rank, world))]
    return {
        "nodes": rt.nodes.node_of,
        "gqa_nodes": gqa.nodes.node_of,
        "step": plan.step,
        "reason": plan.route.reason,
        "err": max(errs),
        "mla_counts": mla_counts,
        "gqa_counts": dict(gqa.comm.counts),
    }


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("split", [True, False], ids=["2-hosts-x-2", "1-host-x-4"])
def test_runtime_learns_its_hosts_and_dcp_merges_across_them(dist_pool, split: bool) -> None:
    results = dist_pool.run(_hosts_body, split, world_size=4)
    want = (0, 0, 1, 1) if split else (0, 0, 0, 0)
    for r, res in enumerate(results):
        assert res["nodes"] == want and res["gqa_nodes"] == want, (r, res)
        assert res["err"] <= 1e-5, (r, res)
        # the same collector across hosts: one q all-gather, one all-to-all of packed partials
        assert res["mla_counts"] == {"all_gather": 1, "all_to_all": 1, "agreement": 1}, res["mla_counts"]
        assert res["gqa_counts"] == {"all_gather": 1, "all_to_all": 1, "agreement": 1}, res["gqa_counts"]
        # the network is slow: across two hosts ShardQ's exchanges cost more than it saves
        assert res["step"] == ("headtp" if split else "shardq"), res
        text = "ranks on several hosts, 2 on the smallest, network 0.001 GB/s (slow)"
        assert (text in res["reason"]) == split, res["reason"]


def _bad_host_id_on_rank_1(group: dist.ProcessGroup) -> tuple[str, str]:
    short = short_timeout_group(group)  # a peer left waiting in the gather fails in seconds
    try:  # the peers raise rank 1's failure, carried by the gather
        exchange_node_layout(short, 7 if dist.get_rank(group) == 1 else f"host-{dist.get_rank(group)}")
    except (TypeError, PeerFailedError) as e:
        return type(e).__name__, str(e)
    return "ok", ""


@pytest.mark.distributed
def test_a_bad_host_id_on_one_rank_raises_on_every_rank_at_once(dist_pool, nproc: int) -> None:
    if nproc < 2:
        pytest.skip("needs 2 ranks; run with --nproc 2 or more")
    own = "TypeError: host_id must be a str or None, got int"
    expect = [
        f"PeerFailedError: exchange_node_layout on rank {r} failed because rank 1 of {nproc} raised {own}"
        if r != 1
        else own
        for r in range(nproc)
    ]
    assert_rank_errors(dist_pool.run(_bad_host_id_on_rank_1), expect)


def _host_exchange_without_rank_1(group: dist.ProcessGroup) -> str | None:
    comm = Comm(short_timeout_group(group, 1.0), report_grace_s=0.25)
    if comm.rank == 1:
        return None  # never joins the exchange
    try:
        exchange_node_layout(comm)
    except PeerFailedError as e:
        return str(e)
    return "no error"


@pytest.mark.distributed
def test_the_host_exchange_waits_for_reports_as_long_as_the_callers_comm(dist_pool, nproc: int) -> None:
    if nproc < 2:
        pytest.skip("needs 2 ranks; run with --nproc 2 or more")
    for r, message in enumerate(dist_pool.run(_host_exchange_without_rank_1)):
        assert r == 1 or (message is not None and "did not report within 0.25 s" in message), (r, message)


def _measure_body(group) -> dict | None:
    from shardattn.calibrate.network import multi_node_rates
    from shardattn.launch.process_group import host_groups

    nodes = NodeLayout.uniform(2, 2)
    subgroups = host_groups(group, nodes)
    assert (subgroups.leaders is not None) == (dist.get_rank(group) in (0, 2))
    assert (subgroups.first_host is not None) == (dist.get_rank(group) in (0, 1))
    cpu = torch.device("cpu")
    colls, net = multi_node_rates(group, nodes, subgroups, device=cpu, sizes_mib=(0.0625, 0.25), reps=1)
    if dist.get_rank(group) != 0:
        return None
    cal = dataclasses.replace(SHARDQ_WINS, collectives=tuple(colls), network=net)
    cal = Calibration.from_json(cal.to_json())  # valid, and it survives the file
    model = CostModel(cal)
    return {
        "layouts": sorted((c.op, c.world_size, c.ranks_per_node) for c in cal.collectives),
        "network": (net.name, net.busbw_gbps > 0),
        "exact": model.collective("all_to_all", 4, 2) in cal.collectives,
        "model_network": model.network == net,
    }


@pytest.mark.distributed(world_size=4)
def test_calibrate_measures_the_network_and_the_rates_across_hosts(dist_pool) -> None:
    res = dist_pool.run(_measure_body, world_size=4)[0]
    assert res["layouts"] == [
        ("all_gather", 2, None), ("all_gather", 4, 2), ("all_to_all", 2, None), ("all_to_all", 4, 2)
    ]  # fmt: skip
    assert res["network"] == ("measured", True) and res["exact"] and res["model_network"]


# -- the launcher on two torchrun agents (loopback, gloo) ------------------------------------------------
LAUNCH = ["-m", "shardattn.launch", "--check", "--tokens", "64", "--requests", "2", "--cached", "32", "--topk", "16"]


def _agent(node: int, port: str, env: dict[str, str]) -> subprocess.Popen:
    rendezvous = ["--master-addr", "127.0.0.1", "--master-port", port]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node)]
    cmd += ["--nproc-per-node", "2", *rendezvous, *LAUNCH, "--iters", "1", "--warmup", "0"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_launcher_check_passes_on_two_agents_of_two_ranks() -> None:
    """``torchrun --nnodes 2 --node-rank 0|1 --nproc-per-node 2`` on loopback: both agents exit 0, the
    check passes, and the Runtime sees 2 nodes x 2 ranks (its host identity is the agent)."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, CUDA_VISIBLE_DEVICES="")  # gloo ranks anywhere
    port = str(free_port())
    agents = [_agent(n, port, env) for n in (0, 1)]
    outs = []
    try:
        for a in agents:
            outs.append(a.communicate(timeout=180)[0])
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert "hosts: 2 nodes x 2 ranks (node of each rank: [0, 0, 1, 1])" in outs[0], outs[0][-3000:]
    assert "check passed" in outs[0] and "world_size=4" in outs[0], outs[0][-3000:]
