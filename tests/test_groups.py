"""A DeviceMesh wherever a group is taken: 1-D meshes and (mesh, dim) of 2-D meshes on gloo.

Each step runs through ``resolve_group`` at its boundary; the steps here are judged by the same
fp64-oracle checks as their own tests (their run helpers, called with a mesh instead of a
``ProcessGroup``), and a step handed the mesh directly gives the bits it gives on the dimension's
``ProcessGroup``. A 2-D ``("dp", "tp")`` mesh of 4 ranks runs two independent ``tp`` groups of 2
(ranks 0-1 and 2-3), each the whole step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from shardattn.launch.workloads import build_decode
from shardattn.ops.topk import DcpShard
from shardattn.parallel import (
    Comm,
    collect_partials,
    dcp_gqa_decode,
    dcp_sparse_mla_decode,
    pcp_prefill,
    shardq_prefill,
)
from shardattn.parallel.comm import PeerFailedError
from shardattn.parallel.gqa_head_tp import gqa_prefill_head_tp
from shardattn.parallel.gqa_prefill import gqa_prefill_pcp
from shardattn.parallel.groups import resolve_group
from shardattn.plan.zigzag import zigzag_split
from shardattn.runtime.options import PrefillOptions
from shardattn.runtime.runtime import Runtime
from tests import test_collector, test_dcp, test_gqa_prefill_parallel, test_pcp, test_shardq
from tests.test_runtime import MLA, _err, _heads, _kv_lens, _mla_oracle, _prefill_step

BAD_GROUP = r"^group must be a torch.distributed ProcessGroup, a 1-D DeviceMesh or \(DeviceMesh, dim name\), got"


def _group_like(how: str) -> Any:
    """``"1d"``: a 1-D mesh of every rank; of a ``("dp", "tp")`` 2 x 2 mesh: ``"tp"`` ``(mesh, "tp")``,
    ``"tp-index"`` ``(mesh, 1)``, ``"tp-submesh"`` ``mesh["tp"]``."""
    if how == "1d":
        return init_device_mesh("cpu", (dist.get_world_size(),))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return {"tp": (mesh, "tp"), "tp-index": (mesh, 1), "tp-submesh": mesh["tp"]}[how]


# -- the resolver ------------------------------------------------------------------------------------
@pytest.mark.distributed(world_size=4)
def test_resolve_group_takes_meshes_and_names_what_is_wrong(group) -> None:
    rank = dist.get_rank()
    assert resolve_group(group) is group
    one = init_device_mesh("cpu", (4,))
    assert dist.get_world_size(resolve_group(one)) == 4 and dist.get_rank(resolve_group(one)) == rank
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = resolve_group((mesh, "tp"))
    assert dist.get_world_size(tp) == 2 and dist.get_rank(tp) == rank % 2
    assert resolve_group((mesh, 1)) is tp and resolve_group(mesh["tp"]) is tp
    assert dist.get_rank(resolve_group((mesh, "dp"))) == rank // 2
    assert Comm((mesh, "dp")).world_size == 2 and Comm(mesh["dp"]).rank == rank // 2
    with pytest.raises(ValueError, match=r"^group is a 2-D DeviceMesh \(dims \('dp', 'tp'\)\): pass \(group, dim"):
        resolve_group(mesh)
    with pytest.raises(ValueError, match=r"^mesh is a 2-D DeviceMesh"):
        resolve_group(mesh, name="mesh")
    with pytest.raises(ValueError, match=r"^group: the DeviceMesh has no dim 'pp' \(dims \('dp', 'tp'\)\)"):
        resolve_group((mesh, "pp"))
    with pytest.raises(ValueError, match=r"^group: dim 2 is not a dimension of the 2-D DeviceMesh"):
        resolve_group((mesh, 2))
    with pytest.raises(TypeError, match=r"^group: the dim of \(DeviceMesh, dim\) must be a dim name or index"):
        resolve_group((mesh, 1.0))
    unnamed = init_device_mesh("cpu", (2, 2))
    with pytest.raises(ValueError, match=r"2 unnamed dims\): pass \(group, dim name or index\), e.g. \(mesh, 1\)"):
        Comm(unnamed)  # an index it has, not a name it lacks
    with pytest.raises(ValueError, match=r"^group: the DeviceMesh has no dim 'tp' \(2 unnamed dims\)"):
        Comm((unnamed, "tp"))
    assert Comm((unnamed, 0)).rank == rank // 2
    pair = dist.new_group([0, 1])  # every rank creates it; ranks 2 and 3 get the non-member placeholder
    if rank >= 2:
        with pytest.raises(ValueError, match=rf"^group: this process \(global rank {rank}\) is not a member"):
            Comm(pair)
    else:
        assert Comm(pair).world_size == 2


@pytest.mark.distributed(world_size=4)
def test_a_mesh_without_this_process_is_named(group) -> None:
    """A mesh of global ranks 0 and 2 (every process makes it): ranks 1 and 3 are told they are not
    in it (torch's ``get_group`` there raised a bare ``IndexError``), ranks 0 and 2 run on it."""
    from torch.distributed.device_mesh import DeviceMesh

    rank = dist.get_rank()
    one = DeviceMesh("cpu", [0, 2])
    two = DeviceMesh("cpu", [[0, 2]], mesh_dim_names=("dp", "tp"))
    if rank in (0, 2):
        assert Comm(one).rank == rank // 2 and Comm((two, "tp")).rank == rank // 2
        assert dist.get_world_size(resolve_group((two, "dp"))) == 1
        return
    outside = rf"^group: this process \(global rank {rank}\) is not in the DeviceMesh \(global ranks \[0, 2\]\)"
    for target in (one, (two, "tp"), (two, 0)):
        with pytest.raises(ValueError, match=outside):
            Comm(target)
    with pytest.raises(ValueError, match=outside):
        Runtime("glm5", one, max_batched_tokens=8, mode="mixed", warmup=False)


@pytest.mark.distributed(world_size=4)
def test_a_failure_on_a_sub_group_names_the_rank_and_its_global_rank(group) -> None:
    """On the group of global ranks [1, 3], global rank 3 (the group's rank 1) raises mid-step; its
    peer names it by both numbers, so logs of several groups name one process alike (it said
    ``rank 1 of 2``, which is global rank 1's number in the world); so is a peer that does not report."""
    import datetime

    rank = dist.get_rank()
    pair = dist.new_group([1, 3], backend="gloo", timeout=datetime.timedelta(seconds=2.0))
    if rank not in (1, 3):
        return
    comm = Comm(pair, report_grace_s=1.0)
    out, lse = torch.zeros(2, 4, 8), torch.zeros(2, 4)
    if rank == 3:  # the step the peer's collector begins, failing before its first collective
        comm.begin_step()
        with pytest.raises(RuntimeError, match="injected"), comm.reporting_failures():
            raise RuntimeError("injected")
        return
    with pytest.raises(PeerFailedError, match=r"rank 1 of 2 \(global rank 3\) raised RuntimeError: injected"):
        collect_partials(out, lse, comm, check=False)
    silent = r"rank\(s\) \[1\] of 2 \(global rank 3\) did not report"  # global rank 3 has left the test
    with pytest.raises(PeerFailedError, match=silent):
        collect_partials(out, lse, Comm(pair, report_grace_s=0.5), check=False)


def _dummy_args(n: int) -> tuple:
    return (None,) * n


#: entry point -> a call with the group in its place (inputs never read: the group is resolved first)
ENTRY_POINTS = {
    "Comm": lambda g: Comm(g),
    "Comm.wrap": lambda g: Comm.wrap(g),
    "Runtime": lambda g: Runtime("glm5", g, max_batched_tokens=8, mode="mixed", warmup=False),
    "shardq_prefill": lambda g: shardq_prefill(*_dummy_args(4), g, scale=1.0, v_dim=1),
    "dcp_sparse_mla_decode": lambda g: dcp_sparse_mla_decode(*_dummy_args(6), g, block_size=1, scale=1.0, v_dim=1),
    "dcp_gqa_decode": lambda g: dcp_gqa_decode(*_dummy_args(6), g),
    "pcp_prefill": lambda g: pcp_prefill(*_dummy_args(4), g, scale=1.0, v_dim=1),
    "collect_partials": lambda g: collect_partials(None, None, g),
    "gqa_prefill_head_tp": lambda g: gqa_prefill_head_tp(*_dummy_args(4), g, num_kv_heads=1),
    "gqa_prefill_pcp": lambda g: gqa_prefill_pcp(*_dummy_args(4), g),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ("tp", BAD_GROUP + " str"),
        ([0, 1], BAD_GROUP + " list"),
        (None, BAD_GROUP + " NoneType"),
        (("mesh", "tp"), r"^group: \(mesh, dim\) needs a DeviceMesh first, got str"),
    ],
    ids=["str", "list", "none", "tuple-without-mesh"],
)
def test_every_entry_point_names_a_bad_group(entry: str, bad: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        ENTRY_POINTS[entry](bad)


# -- the steps on meshes --------------------------------------------------------------------------------
RUNNERS = {
    "shardq": test_shardq._run,
    "dcp-mla": test_dcp._run_mla,
    "dcp-gqa": test_dcp._run_gqa,
    "pcp": test_pcp._run,
    "collector": test_collector._collect_all_strategies,
    "gqa-prefill-head-tp": test_gqa_prefill_parallel._run_head_tp,
    "gqa-prefill-pcp": test_gqa_prefill_parallel._run_pcp,
}


def _run_on_mesh(group, how: str, runner: str, *args: Any) -> Any:
    return RUNNERS[runner](_group_like(how), *args)


def _cases(world: int) -> dict[str, tuple[tuple, Any]]:
    """runner -> (its extra arguments, the check of every rank's results)."""
    sq = test_shardq._case(world, [7, 12, 0, 5], [0, 3, 0, 9], world, 2, 16, sinks=True, topk_length=True)
    mla = test_dcp._mla_case(world, [9, 0, 23, 2], [1, 1, 2, 1], world, 2, sinks=True)
    gqa = test_dcp._gqa_case(world, world=world, interleave=2, **test_dcp.GQA_CASES["ragged-drafts"])
    pcp = test_pcp._case(world, [11, 2, 17], [5, 0, 9], sinks=True)
    col = test_collector._case(world, world, 5, 2, 8, torch.float32)
    hkv = 2 if world % 2 == 0 else world  # KV heads that the world splits or replicates
    gqa_tp = test_gqa_prefill_parallel.make_step(world + 8, [7, 0, 5], [4, 6, 0], hq=2 * world, hkv=hkv)
    gqa_pcp = test_gqa_prefill_parallel.make_step(world, [9, 4, 13], [5, 0, 8], window_left=3)
    return {
        "shardq": ((sq, 1, 2), lambda res: test_shardq._check(res, sq, world)),
        "dcp-mla": ((mla,), lambda res: test_dcp._check_mla(res, mla, world)),
        "dcp-gqa": ((gqa,), lambda res: test_dcp._check_gqa(res, gqa, world)),
        "pcp": ((pcp,), lambda res: test_pcp._check(res, pcp, world)),
        "collector": ((col,), lambda res: test_collector._check_world(res, col, world)),
        "gqa-prefill-head-tp": ((gqa_tp,), lambda res: _check_gqa_head_tp(res, gqa_tp, world)),
        "gqa-prefill-pcp": ((gqa_pcp, False), lambda res: test_gqa_prefill_parallel._check_pcp(res, gqa_pcp, False)),
    }


def _check_gqa_head_tp(results: list, case: dict, world: int) -> None:
    """As tests/test_gqa_prefill_parallel.py checks the head-TP step: each rank's heads against the oracle."""
    out64, lse64 = test_gqa_prefill_parallel.oracle(case)
    hl = case["q"].shape[1] // world
    for r, (out, lse, counts) in enumerate(results):
        heads = slice(r * hl, (r + 1) * hl)
        test_gqa_prefill_parallel.assert_close(out, lse, out64[:, heads], lse64[:, heads], f"rank {r} of {world}")
        assert counts == {}, counts


@pytest.mark.distributed
@pytest.mark.parametrize("runner", list(RUNNERS))
def test_steps_on_a_1d_mesh_equal_the_oracle(dist_pool, nproc: int, runner: str) -> None:
    args, check = _cases(nproc)[runner]
    check(dist_pool.run(_run_on_mesh, "1d", runner, *args))


@pytest.mark.distributed
@pytest.mark.parametrize("how", ["tp", "tp-index", "tp-submesh"])
@pytest.mark.parametrize("runner", list(RUNNERS))
def test_steps_on_a_2d_mesh_dim_equal_the_oracle(dist_pool, runner: str, how: str) -> None:
    args, check = _cases(2)[runner]
    results = dist_pool.run(_run_on_mesh, how, runner, *args, world_size=4)
    check(results[:2])  # tp group of ranks 0, 1
    check(results[2:])  # tp group of ranks 2, 3


def _direct_body(group) -> dict:
    """shardq_prefill and collect_partials handed (mesh, "tp") itself: the bits of the tp ProcessGroup."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh.get_group("tp")
    rank = dist.get_rank(tp)
    case = test_shardq._case(3, [7, 12, 5], [0, 3, 9], 2, 2, 16)
    plan = zigzag_split(case["seq_lens"], 2, min_tokens=1, prefix_lens=case["prefix_lens"])
    q = case["q"][:, rank * 2 : (rank + 1) * 2]
    kw = {"scale": case["scale"], "v_dim": case["dv"]}
    by_mesh = shardq_prefill(q, case["kv"], case["rows"], plan, (mesh, "tp"), **kw)
    by_group = shardq_prefill(q, case["kv"], case["rows"], plan, tp, **kw)
    part = torch.randn(5, 4, 8, generator=torch.Generator().manual_seed(rank)), torch.randn(5, 4)
    merged_mesh = collect_partials(*part, mesh["tp"])
    merged_group = collect_partials(*part, tp)
    return {
        "shardq": all(torch.equal(a, b) for a, b in zip(by_mesh, by_group)),
        "collector": all(torch.equal(a, b) for a, b in zip(merged_mesh, merged_group)),
        "shape": tuple(by_mesh[0].shape),
    }


@pytest.mark.distributed
def test_a_step_handed_a_mesh_gives_the_bits_of_its_group(dist_pool) -> None:
    for res in dist_pool.run(_direct_body, world_size=4):
        assert res == {"shardq": True, "collector": True, "shape": (24, 2, 512)}, res


# -- the Runtime on meshes ---------------------------------------------------------------------------
def _runtime_body(group, how: str) -> dict:
    """A Runtime on a mesh: a ShardQ prefill and a DCP decode (mode mixed) against the fp64 oracle."""
    target = _group_like(how)
    rt = Runtime(MLA, target, max_batched_tokens=128, mode="mixed", prefill_options=PrefillOptions(min_shard_tokens=1))
    rank, world = rt.rank, rt.world_size
    step = _prefill_step(seed=2)
    out, lse = rt.prefill(
        _heads(step.q, rank, world).contiguous(),
        step.kv,
        step.rows,
        query_lens=step.query_lens,
        prefix_lens=step.prefix_lens,
    )
    ref_out, ref_lse = _mla_oracle(step, rt.scale, _kv_lens(step))
    errs = [_err(out, _heads(ref_out, rank, world)), _err(lse, _heads(ref_lse, rank, world))]
    s = build_decode(
        heads=MLA.num_heads, head_dim=MLA.head_dim, requests=3, cached=(37, 0, 70), q_lens=(1, 2, 1), topk=MLA.topk,
        overlap="random", causal=True, dtype=torch.float32, device=torch.device("cpu"), seed=4,
        shard=DcpShard(world, 1, rank), block_size=MLA.page_size,
    )  # fmt: skip
    out, lse = rt.decode(
        _heads(s.q, rank, world).contiguous(), s.local_kv, s.local_table, s.seq_lens, topk_pos=s.positions,
        req_ids=s.req_ids,
    )  # fmt: skip
    ref_out, ref_lse = _mla_oracle(s, rt.scale, s.seq_lens)
    errs += [_err(out, _heads(ref_out, rank, world)), _err(lse, _heads(ref_lse, rank, world))]
    return {
        "err": max(errs),
        "world": world,
        "rank": rank,
        "group_is_pg": isinstance(rt.group, dist.ProcessGroup),
        "counts": dict(rt.comm.counts),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("how", ["1d", "tp"])
def test_runtime_on_a_mesh_equals_the_oracle(dist_pool, nproc: int, how: str) -> None:
    if how == "1d" and MLA.num_heads % nproc:
        pytest.skip(f"the spec's {MLA.num_heads} heads do not split over {nproc} ranks")
    world = nproc if how == "1d" else 4
    results = dist_pool.run(_runtime_body, how, world_size=world)
    tp = world if how == "1d" else 2
    for r, res in enumerate(results):
        assert res["err"] <= 1e-5, (r, res)
        assert res["world"] == tp and res["rank"] == r % tp and res["group_is_pg"], res
        # one ShardQ prefill (2 all-to-alls) and one DCP decode (q all-gather, collector all-to-all)
        assert res["counts"] == {"all_to_all": 3, "all_gather": 1, "agreement": 2}, res["counts"]


# -- NCCL ------------------------------------------------------------------------------------------
def _on_gpu_mesh(group, runner: str, case: dict, *args: Any) -> Any:
    """The step's run helper on a 1-D CUDA mesh built from the NCCL group (DeviceMesh.from_group)."""
    from torch.distributed.device_mesh import DeviceMesh

    from tests.test_nccl_steps import _move

    device = torch.device("cuda", torch.cuda.current_device())
    mesh = DeviceMesh.from_group(group, "cuda", mesh_dim_names=("tp",))
    result = RUNNERS[runner](mesh, _move(case, device), *args)
    torch.cuda.synchronize(device)
    return _move(result, torch.device("cpu"))


def _nccl_case(runner: str) -> tuple:
    if runner == "shardq":  # the NCCL tests' cases (tests/test_nccl_steps.py)
        return test_shardq._case(11, [700, 333], [0, 64], 2, 8, 128, sinks=True), 0, 8
    return (test_dcp._mla_case(12, [90, 0, 230, 20], [1, 1, 2, 1], 2, 2, heads_per_rank=8, k=64, block_size=16),)


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.parametrize("runner", ["shardq", "dcp-mla"])
def test_steps_on_a_cuda_mesh_over_nccl(dist_pool, runner: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests import parallel_helpers

    monkeypatch.setattr(parallel_helpers, "REFERENCE_ERROR_FACTOR", 4.0)  # as tests/test_nccl_steps.py
    monkeypatch.setattr(parallel_helpers, "REFERENCE_ULPS", 8.0)
    args = _nccl_case(runner)
    results = dist_pool.run(_on_gpu_mesh, runner, *args, world_size=2, backend="nccl")
    if runner == "shardq":
        test_shardq._check(results, args[0], 2)
    else:
        test_dcp._check_mla(results, args[0], 2)
