"""DCP decode on 1-4 ranks equals the single-process kernel over the whole cache (sparse MLA, with and
without sinks, ``topk_length`` and unique rows; GQA), checked against the independent fp64 oracles of
tests/oracle.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardattn.ops.gqa_decode import gqa_paged_decode
from shardattn.parallel.comm import Comm
from shardattn.parallel.dcp import dcp_sparse_mla_decode
from shardattn.parallel.dcp_gqa import dcp_gqa_decode
from shardattn.plan import DCPLayout
from tests.oracle import gqa_oracle
from tests.parallel_helpers import (
    WORLD_IDS,
    WORLD_SIZES,
    assert_rank_errors,
    assert_within_reference_error,
    catch,
    fp8_rows,
    junk_rows,
    paged,
    paged_mla_references,
    rank_1_rejected,
    short_timeout_group,
    topk_lengths,
)

# ---------------------------------------------------------------------------------------- sparse MLA


def _mla_case(
    seed: int,
    seq_lens: list[int],
    q_per_req: list[int],
    world: int,
    interleave: int,
    *,
    heads_per_rank: int = 2,
    k: int = 16,
    d: int = 576,
    dv: int = 512,
    block_size: int = 4,
    sinks: bool = False,
    topk_length: bool = False,
) -> dict:
    """Global and per-rank paged caches of the same requests, and top-k positions with junk anywhere;
    with ``topk_length``, cuts anywhere in a row, 0 and the whole row included (:func:`topk_lengths`)."""
    g = torch.Generator().manual_seed(seed)
    layout = DCPLayout(world, interleave)
    req_ids = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(q_per_req)).to(torch.int32)
    t, h = req_ids.numel(), heads_per_rank * world
    kv_req = [torch.randn(n, d, generator=g).bfloat16() for n in seq_lens]
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    hi = max(1, max(seq_lens, default=1))
    pos = junk_rows(g, t, k, hi, [-1, -9, hi, hi + 50], 0.25, 4)  # also positions >= seq_lens[req]
    cache, table = paged(kv_req, block_size, g)
    local = []
    for r in range(world):
        owned = [x[layout.owned_positions(x.shape[0], r)] for x in kv_req]
        c, tb = paged(owned, block_size, g)
        local.append({"cache": c.flatten(0, 1), "table": tb})
    return {
        "q": (torch.randn(t, h, d, generator=g) * 0.5).bfloat16(),
        "pos": pos,
        "req_ids": req_ids,
        "seq_lens": lens,
        "cache": cache.flatten(0, 1),
        "table": table,
        "local": local,
        "layout": layout,
        "block_size": block_size,
        "scale": d**-0.5,
        "dv": dv,
        "sinks": torch.randn(h, generator=g) if sinks else None,
        "topk_length": topk_lengths(g, t, k) if topk_length else None,
    }


def _unique_positions(pos: torch.Tensor) -> torch.Tensor:
    """``pos`` as an indexer's top-k: no position twice in a row (later copies ``-1``, junk kept)."""
    out = pos.clone()
    for row in out:
        seen: set[int] = set()
        for j, p in enumerate(row.tolist()):
            if p >= 0 and p in seen:
                row[j] = -1
            seen.add(p)
    return out


def _run_mla(group: dist.ProcessGroup, case: dict, scatter_heads: bool = True, rows_unique: bool = False) -> tuple:
    comm = Comm(group)
    h = case["q"].shape[1] // comm.world_size
    mine = case["local"][comm.rank]
    out, lse = dcp_sparse_mla_decode(
        case["q"][:, comm.rank * h : (comm.rank + 1) * h],
        mine["cache"],
        case["pos"],
        case["req_ids"],
        mine["table"],
        case["layout"],
        comm,
        block_size=case["block_size"],
        scale=case["scale"],
        v_dim=case["dv"],
        seq_lens=case["seq_lens"],
        topk_length=case["topk_length"],
        sinks=case["sinks"],
        scatter_heads=scatter_heads,
        rows_unique=rows_unique,
    )
    return out, lse, dict(comm.counts)


def _check_mla(results: list, case: dict, world: int, scatter_heads: bool = True) -> None:
    ref_out, ref_lse, out64, lse64, vmax = paged_mla_references(case, case["seq_lens"])
    q = case["q"]
    h = q.shape[1] // world if scatter_heads else q.shape[1]
    for r, (out, lse, counts) in enumerate(results):
        heads = slice(r * h, (r + 1) * h) if scatter_heads else slice(None)
        what = f"rank {r} of {world}"
        assert out.shape == (q.shape[0], h, case["dv"]) and out.dtype == q.dtype, what
        assert_within_reference_error(
            out, out64[:, heads], ref_out[:, heads], what=what + " out", partial_max=vmax if world > 1 else 0.0
        )
        assert_within_reference_error(lse, lse64[:, heads], ref_lse[:, heads], what=what + " lse")
        merged = world > 1 and q.shape[0] > 0  # the collector moves nothing for one rank or no query
        collector = ({"all_to_all": 1} if scatter_heads else {"all_gather": 1}) if merged else {}
        gathers = collector.get("all_gather", 0) + 1
        assert counts == {**collector, "all_gather": gathers, "agreement": 1}, what


#: The sparse-MLA sweep's options beside sinks (always given): ``(topk_length, rows_unique)``.
MLA_OPTIONS = {"sinks": (False, False), "sinks+topk_length": (True, False), "sinks+topk_length+unique": (True, True)}


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=WORLD_IDS)
@pytest.mark.parametrize("interleave", [1, 3], ids=["interleave1", "interleave3"])
@pytest.mark.parametrize("options", list(MLA_OPTIONS))
def test_dcp_sparse_mla_equals_whole_cache(dist_pool, world_size: int, interleave: int, options: str) -> None:
    """Sinks counted once over the ranks; each query's ``topk_length`` cut before its positions are
    split over the ranks (with unique rows, each rank's rows packed at the front and counted)."""
    topk_length, unique = MLA_OPTIONS[options]
    case = _mla_case(
        world_size * 10 + interleave, [9, 0, 23, 2], [1, 1, 2, 1], world_size, interleave, sinks=True,
        topk_length=topk_length,
    )  # fmt: skip
    if unique:
        case["pos"] = _unique_positions(case["pos"])
    results = dist_pool.run(_run_mla, case, True, unique, world_size=world_size)
    _check_mla(results, case, world_size)


@pytest.mark.distributed
def test_dcp_sparse_mla_on_fp8_shards(dist_pool) -> None:
    """Every rank's shard in fp8_ds_mla rows (paged [pages, block_size, 656]): the step equals the
    whole-cache result on the rows the shards dequantise to (the quantisation is row by row, so
    the whole cache's rows are the shards' rows)."""
    case = _mla_case(11, [9, 0, 23, 2], [1, 1, 2, 1], 2, 1, sinks=True, topk_length=True)
    case["cache"] = fp8_rows(case["cache"])[1]
    for mine in case["local"]:
        mine["cache"] = fp8_rows(mine["cache"], case["block_size"])[0]
    results = dist_pool.run(_run_mla, case, world_size=2)
    _check_mla(results, case, 2)


def _run_mla_recording_the_local_op(group: dist.ProcessGroup, case: dict) -> tuple:
    """``_run_mla`` with the decode op's runner recorded: which local op the default attention runs."""
    import shardattn.ops.sparse_mla_decode as decode_op

    calls = []
    runner = decode_op.run_sparse_mla_decode

    def recording(*args, **kwargs):
        calls.append({k: kwargs[k] for k in ("kernel", "rows_unique")})
        return runner(*args, **kwargs)

    decode_op.run_sparse_mla_decode = recording
    try:
        out, lse, counts = _run_mla(group, case)
    finally:
        decode_op.run_sparse_mla_decode = runner
    return out, lse, counts, calls


@pytest.mark.distributed
def test_dcp_sparse_mla_decode_runs_the_decode_op_by_default(dist_pool) -> None:
    """Regression: ``dcp_sparse_mla_decode`` without ``attention=`` ran the prefill op
    (``sparse_mla_attention``) for its local step; it runs the decode op
    (:func:`shardattn.ops.sparse_mla_decode.sparse_mla_decode`), once per rank, with the rows'
    uniqueness passed on, and still equals the whole-cache result."""
    case = _mla_case(7, [9, 4], [1, 2], 2, 1, sinks=True)
    results = dist_pool.run(_run_mla_recording_the_local_op, case, world_size=2)
    _check_mla([r[:3] for r in results], case, 2)
    for rank, (*_, calls) in enumerate(results):
        assert calls == [{"kernel": "reference", "rows_unique": False}], (rank, calls)


@pytest.mark.distributed
def test_dcp_sparse_mla_all_heads_and_topk_length(dist_pool) -> None:
    case = _mla_case(3, [17, 5], [2, 1], 3, 2, d=64, dv=48, topk_length=True)
    results = dist_pool.run(_run_mla, case, False, world_size=3)
    _check_mla(results, case, 3, scatter_heads=False)


@pytest.mark.distributed
def test_dcp_sparse_mla_rows_unique_with_topk_length(dist_pool) -> None:
    """rows_unique: each rank reads its rows packed at the front (no de-duplication); junk, other
    ranks' positions and entries past ``topk_length`` anywhere in a row."""
    case = _mla_case(5, [17, 5], [2, 1], 3, 2, d=64, dv=48, topk_length=True, sinks=True)
    case["pos"] = _unique_positions(case["pos"])
    results = dist_pool.run(_run_mla, case, True, True, world_size=3)
    _check_mla(results, case, 3)


@pytest.mark.distributed
@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    world=st.integers(2, 4),
    interleave=st.integers(1, 4),
    reqs=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 2)), min_size=1, max_size=4),
    k=st.integers(1, 24),
    block_size=st.sampled_from([1, 4, 16]),
    sinks=st.booleans(),
    topk_length=st.booleans(),
    unique=st.booleans(),  # rows_unique: each rank's rows packed at the front, read as given
    seed=st.integers(0, 2**16),
)
def test_dcp_sparse_mla_drawn(
    dist_pool, nproc, world, interleave, reqs, k, block_size, sinks, topk_length, unique, seed
) -> None:
    world = min(world, nproc)  # the draw stays in the pool's ranks
    lens, q_per = [n for n, _ in reqs], [q for _, q in reqs]
    case = _mla_case(
        seed, lens, q_per, world, interleave, k=k, d=64, dv=48, block_size=block_size, sinks=sinks,
        topk_length=topk_length,
    )  # fmt: skip
    if unique:
        case["pos"] = _unique_positions(case["pos"])
    results = dist_pool.run(_run_mla, case, True, unique, world_size=world)
    _check_mla(results, case, world)


# ---------------------------------------------------------------------------------------- GQA


def _gqa_case(
    seed: int,
    seq_lens: list[int],
    q_lens: list[int],
    world: int,
    interleave: int,
    *,
    ragged: bool,
    causal: bool = True,
    sinks: bool = False,
    pad_rows: int = 0,
    hq_per_rank: int = 2,
    hkv: int = 2,
    d: int = 32,
    page: int = 4,
) -> dict:
    """Requests with ``seq_lens`` keys (drafts included) and ``q_lens`` queries, global and per-rank caches."""
    g = torch.Generator().manual_seed(seed)
    layout = DCPLayout(world, interleave)
    kv_req = [torch.randn(n, 2, hkv, d, generator=g).bfloat16() for n in seq_lens]  # [L, k|v, Hkv, D]
    cache, table = paged(kv_req, page, g)
    local = []
    for r in range(world):
        owned = [x[layout.owned_positions(x.shape[0], r)] for x in kv_req]
        c, tb = paged(owned, page, g)
        local.append({"k": c[:, :, 0].contiguous(), "v": c[:, :, 1].contiguous(), "table": tb})
    total_q = sum(q_lens) + pad_rows
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return {
        "q": (torch.randn(total_q, hq_per_rank * world, d, generator=g)).bfloat16(),
        "k": cache[:, :, 0].contiguous(),
        "v": cache[:, :, 1].contiguous(),
        "table": table,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "cu": cu,
        "q_len": None if ragged else q_lens[0],
        "ragged": ragged,
        "causal": causal,
        "local": local,
        "layout": layout,
        "sinks": torch.randn(hq_per_rank * world, generator=g) if sinks else None,
        "scale": d**-0.5,
    }


def _run_gqa(group: dist.ProcessGroup, case: dict) -> tuple:
    comm = Comm(group)
    h = case["q"].shape[1] // comm.world_size
    mine = case["local"][comm.rank]
    out, lse = dcp_gqa_decode(
        case["q"][:, comm.rank * h : (comm.rank + 1) * h],
        mine["k"],
        mine["v"],
        mine["table"],
        case["seq_lens"],
        case["layout"],
        comm,
        q_len_per_req=case["q_len"],
        cu_q_lens=case["cu"] if case["ragged"] else None,
        causal=case["causal"],
        sinks=case["sinks"],
        scale=case["scale"],
    )
    return out, lse, dict(comm.counts)


def _check_gqa(results: list, case: dict, world: int) -> None:
    q, k, v, table, lens, cu = case["q"], case["k"], case["v"], case["table"], case["seq_lens"], case["cu"]
    kw = dict(causal=case["causal"], sinks=case["sinks"], scale=case["scale"])
    if case["ragged"]:
        ref_out, ref_lse = gqa_paged_decode(
            q, k, v, table, lens, cu_q_lens=cu, return_lse=True, backend="reference", **kw
        )
    else:
        ref_out, ref_lse = gqa_paged_decode(
            q, k, v, table, lens, q_len_per_req=case["q_len"], return_lse=True, backend="reference", **kw
        )
    out64, lse64 = gqa_oracle(q, k, v, table, lens, cu.tolist(), **kw)
    h = q.shape[1] // world
    vmax = float(v.float().abs().max()) if v.numel() else 0.0
    for r, (out, lse, counts) in enumerate(results):
        heads = slice(r * h, (r + 1) * h)
        what = f"rank {r} of {world}"
        assert out.shape == (q.shape[0], h, q.shape[2]) and out.dtype == q.dtype, what
        assert_within_reference_error(
            out, out64[:, heads], ref_out[:, heads], what=what + " out", partial_max=vmax if world > 1 else 0.0
        )
        assert_within_reference_error(lse, lse64[:, heads], ref_lse[:, heads], what=what + " lse")
        merged = world > 1 and q.shape[0] > 0  # the collector moves nothing for one rank or no query
        expect = {"all_gather": 1, "all_to_all": 1, "agreement": 1} if merged else {"all_gather": 1, "agreement": 1}
        assert counts == expect, what


GQA_CASES = {
    "decode": dict(seq_lens=[13, 1, 30], q_lens=[1, 1, 1], ragged=False),
    "uniform-drafts": dict(seq_lens=[13, 3, 30], q_lens=[3, 3, 3], ragged=False, sinks=True),
    "uniform-drafts-noncausal": dict(seq_lens=[9, 26], q_lens=[2, 2], ragged=False, causal=False),
    "ragged-drafts": dict(seq_lens=[0, 14, 2, 27], q_lens=[0, 2, 1, 4], ragged=True, pad_rows=2, sinks=True),
}


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=WORLD_IDS)
@pytest.mark.parametrize("name", list(GQA_CASES))
def test_dcp_gqa_equals_whole_cache(dist_pool, world_size: int, name: str) -> None:
    case = _gqa_case(world_size, world=world_size, interleave=2, **GQA_CASES[name])
    results = dist_pool.run(_run_gqa, case, world_size=world_size)
    _check_gqa(results, case, world_size)


@pytest.mark.distributed
@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    world=st.integers(2, 4),
    interleave=st.integers(1, 5),
    reqs=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 4)), min_size=1, max_size=4),
    ragged=st.booleans(),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_dcp_gqa_drawn(dist_pool, nproc, world, interleave, reqs, ragged, causal, seed) -> None:
    world = min(world, nproc)  # the draw stays in the pool's ranks
    if ragged:
        q_lens = [min(q, n) for n, q in reqs]  # drafts are counted in seq_lens
        seq_lens = [n for n, _ in reqs]
    else:
        q = max(1, reqs[0][1])
        q_lens = [q] * len(reqs)
        seq_lens = [max(n, q) for n, _ in reqs]
    case = _gqa_case(
        seed, seq_lens, q_lens, world, interleave, ragged=ragged, causal=causal, sinks=seed % 2 == 0,
        pad_rows=seed % 3 if ragged else 0, hkv=1 + seed % 2,
    )  # fmt: skip
    results = dist_pool.run(_run_gqa, case, world_size=world)
    _check_gqa(results, case, world)


# ---------------------------------------------------------------------------------------- bad input


def _flag_of(problem: str) -> str:
    """``"gqa-scatter-heads-1-on-rank-1"`` -> ``"scatter_heads"``."""
    return problem[4:].removesuffix("-1-on-rank-1").replace("-", "_")


def _bad(group: dist.ProcessGroup, problem: str) -> tuple[str, str]:
    rank, w = dist.get_rank(group), dist.get_world_size(group)
    if problem.startswith("mla"):
        case = _mla_case(1, [9, 4], [1, 1], w, 1, d=32, dv=16)
        h = case["q"].shape[1] // w
        q, mine, layout, lens = case["q"][:, rank * h : (rank + 1) * h], case["local"][rank], case["layout"], None
        cache, table = mine["cache"], mine["table"]
        lens = case["seq_lens"]
        if problem == "mla-cache-dtype-on-rank-1" and rank == 1:
            cache = cache.float()
        elif problem == "mla-seq-lens-past-the-cache":
            lens = lens + 100
        elif problem == "mla-block-table-past-the-cache" and rank == 2:
            table = table.clone()
            table[0, 0] = 1000
        elif problem == "mla-layout-world-size":
            layout = DCPLayout(w + 1)
        elif problem == "mla-seq-lens-on-rank-2" and rank == 2:
            lens = lens.clone()
            lens[0] -= 1
        kw: dict = {}  # rank 1's own mistakes, read where the ranks agree (not mid-exchange)
        if rank == 1 and problem == "mla-send-buffer-float-on-rank-1":
            kw = {"strategy": "all_to_all", "workspace": {"send": torch.zeros(10**4)}}
        elif rank == 1 and problem == "mla-rows-buffer-small-on-rank-1":
            kw = {"workspace": {"rows": torch.zeros(4, dtype=torch.uint8)}}
        elif rank == 1 and problem == "mla-scale-on-rank-1":
            kw = {"scale": 0.5}
        elif rank == 1 and problem == "mla-no-topk-length-on-rank-1":
            kw = {"topk_length": None}
        elif problem == "mla-no-topk-length-on-rank-1":
            kw = {"topk_length": torch.full((q.shape[0],), 3, dtype=torch.int32)}
        elif rank == 1 and problem.endswith("-1-on-rank-1"):  # a flag as a truthy int: read as True before
            kw = {_flag_of(problem): 1}
        return catch(
            dcp_sparse_mla_decode, q, cache, case["pos"], case["req_ids"], table, layout, group,
            **{"block_size": case["block_size"], "scale": 1.0, "v_dim": 16, "seq_lens": lens, **kw},
        )  # fmt: skip
    case = _gqa_case(2, [9, 5], [2, 2], w, 1, ragged=False)
    h = case["q"].shape[1] // w
    q, mine, lens, q_len = case["q"][:, rank * h : (rank + 1) * h], case["local"][rank], case["seq_lens"], 2
    if problem == "gqa-seq-lens-past-the-cache" and rank == 0:
        lens = lens * 10
    elif problem == "gqa-heads-on-rank-1" and rank == 1:
        q = case["q"][:, :4]  # valid on its own (12 query heads over 2 KV heads), not with the others
    elif problem == "gqa-q-len":
        q_len = 3
    ws = None
    if problem == "gqa-out-and-send-one-buffer":  # packing the partial would overwrite it
        arena = torch.zeros(1 << 12, dtype=torch.uint8)
        ws = {"out": arena, "send": arena}
    flags: dict = {}
    if rank == 1 and problem.endswith("-1-on-rank-1"):  # a flag as a truthy int: read as True before
        flags = {_flag_of(problem): 1}
    return catch(
        dcp_gqa_decode, q, mine["k"], mine["v"], mine["table"], lens, case["layout"], group, q_len_per_req=q_len,
        strategy="all_to_all", workspace=ws, **flags,
    )  # fmt: skip


def _rejected(what: str, ranks: str) -> str:
    return f"ValueError: {what}: rank(s) {ranks} of 3 rejected their inputs"


MLA = "DCP sparse MLA decode inputs"
GQA = "DCP GQA decode inputs"


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("problem", "expect"),
    [
        (
            "mla-cache-dtype-on-rank-1",
            [
                _rejected(MLA, "[1]"),
                "TypeError: kv_cache must have dtype in (bfloat16), got float32",
                _rejected(MLA, "[1]"),
            ],
        ),
        ("mla-seq-lens-past-the-cache", ["ValueError: seq_lens[0]=109 puts"] * 3),
        (
            "mla-block-table-past-the-cache",
            [_rejected(MLA, "[2]")] * 2 + ["ValueError: block_table points past kv_cache"],
        ),
        ("mla-layout-world-size", ["ValueError: layout is for world_size=4, but the group has 3 ranks"] * 3),
        ("mla-seq-lens-on-rank-2", [f"ValueError: {MLA}: rank(s) [2] disagree"] * 3),
        (
            "mla-send-buffer-float-on-rank-1",
            [
                _rejected(MLA, "[1]"),
                "TypeError: workspace['send'] must have dtype in (uint8), got float32",
                _rejected(MLA, "[1]"),
            ],
        ),
        (
            "mla-rows-buffer-small-on-rank-1",
            [
                _rejected(MLA, "[1]"),
                "ValueError: workspace['rows'] holds 4 B, the step needs at least",
                _rejected(MLA, "[1]"),
            ],
        ),
        ("mla-scale-on-rank-1", [f"ValueError: {MLA}: rank(s) [1] disagree"] * 3),
        ("mla-no-topk-length-on-rank-1", [f"ValueError: {MLA}: rank(s) [1] disagree"] * 3),
        ("gqa-seq-lens-past-the-cache", ["ValueError: seq_lens[0]=90 puts", *[_rejected(GQA, "[0]")] * 2]),
        ("gqa-heads-on-rank-1", [f"ValueError: {GQA}: rank(s) [1] disagree"] * 3),
        ("gqa-q-len", ["ValueError: q_heads_local must have B * q_len_per_req = 6 rows, got 4"] * 3),
        *[
            (
                f"{kind}-{flag.replace('_', '-')}-1-on-rank-1",
                [_rejected(what, "[1]"), f"TypeError: {flag} must be a bool, got int (1)", _rejected(what, "[1]")],
            )
            for kind, what, flag in [
                ("mla", MLA, "scatter_heads"),
                ("mla", MLA, "check"),
                ("gqa", GQA, "causal"),
                ("gqa", GQA, "scatter_heads"),
                ("gqa", GQA, "check"),
            ]
        ],
        ("gqa-out-and-send-one-buffer", ["ValueError: workspace['out'] and workspace['send'] share memory"] * 3),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_dcp_bad_input_raises_on_every_rank(dist_pool, problem: str, expect: list) -> None:
    results = dist_pool.run(_bad, problem, world_size=3)
    assert_rank_errors(results, expect)


#: Arguments only rank 1 gets wrong, and its error (read where the ranks agree, not mid-step).
ONE_BAD_RANK = {
    "mla-rows-buffer-misaligned": (
        {"workspace": {"rows": torch.zeros(1 << 16, dtype=torch.uint8)[2:]}},
        "ValueError: workspace['rows'] must start on a 4-byte boundary (it is viewed as int32), got one 2 bytes",
    ),
    "gqa-q-buffer-misaligned": (
        {"workspace": {"q": torch.zeros(1 << 16, dtype=torch.uint8)[1:]}},
        "ValueError: workspace['q'] must start on a 2-byte boundary (it is viewed as bfloat16), got one 1 byte",
    ),
    "mla-block-size-past-int32": (  # (rank 1 holds no block: it raised in the step, its peers waited)
        {"block_size": 2**31},
        "ValueError: block_size must be <= 2,147,483,647, got 2,147,483,648",
    ),
    "gqa-meta-with-cu-q-lens-a-list": (  # (an AttributeError in the checks, which no agreement heard of)
        {"cu_q_lens": [0, 2, 4]},
        "TypeError: cu_q_lens must be a torch.Tensor, got list",
    ),
}


def _one_bad_rank(group: dist.ProcessGroup, problem: str) -> tuple[str, str]:
    w, rank = dist.get_world_size(group), dist.get_rank(group)
    bad = ONE_BAD_RANK[problem][0] if rank == 1 else {}
    short = short_timeout_group(group)  # a peer left waiting in a collective fails in seconds
    if problem.startswith("mla"):
        case = _mla_case(1, [9, 4], [1, 1], w, 1, d=32, dv=16)
        h, mine = case["q"].shape[1] // w, case["local"][rank]
        table = mine["table"][:, :0] if bad and problem == "mla-block-size-past-int32" else mine["table"]
        return catch(
            dcp_sparse_mla_decode, case["q"][:, rank * h : (rank + 1) * h], mine["cache"], case["pos"],
            case["req_ids"], table, case["layout"], short,
            **{"block_size": case["block_size"], "scale": 1.0, "v_dim": 16, "seq_lens": case["seq_lens"], **bad},
        )  # fmt: skip
    case = _gqa_case(2, [9, 5], [2, 2], w, 1, ragged=False)
    h, mine, t = case["q"].shape[1] // w, case["local"][rank], case["q"].shape[0]
    drafts: dict = {"q_len_per_req": 2}
    if "meta" in problem:  # the planned path: each query's local length and request row
        lens = case["layout"].causal_local_lens(case["seq_lens"], case["cu"], t, rank, causal=True)
        drafts = {"meta": torch.stack([lens.to(torch.int32), torch.arange(t, dtype=torch.int32) // 2])}
    return catch(
        dcp_gqa_decode, case["q"][:, rank * h : (rank + 1) * h], mine["k"], mine["v"], mine["table"],
        case["seq_lens"], case["layout"], short, **drafts, **bad,
    )  # fmt: skip


@pytest.mark.distributed
@pytest.mark.parametrize("problem", sorted(ONE_BAD_RANK))
def test_dcp_one_ranks_bad_argument_raises_on_every_rank_at_once(dist_pool, nproc: int, problem: str) -> None:
    if nproc < 2:
        pytest.skip("needs 2 ranks; run with --nproc 2 or more")
    what = MLA if problem.startswith("mla") else GQA
    assert_rank_errors(dist_pool.run(_one_bad_rank, problem), rank_1_rejected(nproc, what, ONE_BAD_RANK[problem][1]))


def _with_shared_workspace(group: dist.ProcessGroup, case: dict) -> tuple:
    """The GQA step without a workspace, and with one whose buffers never in use at the same time share
    bytes (the Runtime's arena lays them out so): the queries' with the send buffer's, the partial's
    with the receive buffer's."""
    comm = Comm(group)
    h = case["q"].shape[1] // comm.world_size
    mine = case["local"][comm.rank]
    args = (case["q"][:, comm.rank * h : (comm.rank + 1) * h], mine["k"], mine["v"], mine["table"], case["seq_lens"])
    kw = dict(q_len_per_req=case["q_len"], strategy="all_to_all")
    ref = dcp_gqa_decode(*args, case["layout"], comm, **kw)
    first, second = torch.zeros(1 << 14, dtype=torch.uint8), torch.zeros(1 << 14, dtype=torch.uint8)
    ws = {"q": first, "send": first, "out": second[: 1 << 13], "lse": second[1 << 13 :], "recv": second}
    return ref, dcp_gqa_decode(*args, case["layout"], comm, **kw, workspace=ws)


@pytest.mark.distributed
def test_dcp_workspace_buffers_in_use_apart_may_share_bytes(dist_pool) -> None:
    case = _gqa_case(5, [9, 5, 12], [1, 1, 1], 2, 1, ragged=False)
    for (ref_out, ref_lse), (out, lse) in dist_pool.run(_with_shared_workspace, case, world_size=2):
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@pytest.mark.distributed
def test_dcp_empty_steps(dist_pool) -> None:
    case = _gqa_case(4, [0, 0], [0, 0], 3, 1, ragged=True, pad_rows=2, sinks=True)  # only padding rows
    _check_gqa(dist_pool.run(_run_gqa, case, world_size=3), case, 3)
    case = _gqa_case(4, [3], [0], 3, 1, ragged=True)  # no query row at all
    _check_gqa(dist_pool.run(_run_gqa, case, world_size=3), case, 3)
    case = _mla_case(4, [0, 5], [0, 0], 3, 1, d=32, dv=16, sinks=True, topk_length=True)  # no query
    _check_mla(dist_pool.run(_run_mla, case, world_size=3), case, 3)
