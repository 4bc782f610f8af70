"""Pipelined ShardQ (chunks, in-place exchanges) equals the unchunked step bit for bit; PCP overlap.

The oracle here is the step itself with ``chunks=1`` (and, for PCP, the step written the way it
was before the overlap: a blocking all-gather first): chunking and overlapping reorder work and
messages but must not change a single bit in fp32. tests/test_shardq.py and tests/test_pcp.py
compare the steps with independent references.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardattn.ops.dispatch import triton_available
from shardattn.ops.lse_merge import lse_merge
from shardattn.ops.sparse_mla import sparse_mla_attention
from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill
from shardattn.ops.topk import convert_topk
from shardattn.ops.union import build_union
from shardattn.parallel.comm import Comm
from shardattn.parallel.pcp import pcp_prefill
from shardattn.parallel.shardq import shardq_prefill
from shardattn.plan import pcp_plan, zigzag_split
from shardattn.plan.pipeline import (
    AUTO_MAX_CHUNKS,
    CHUNK_WORK,
    MAX_CHUNKS,
    choose_chunks,
    chunk_weights,
    pipeline_plan,
)
from shardattn.plan.spec import ModelSpec
from shardattn.runtime.options import PrefillOptions
from shardattn.runtime.runtime import Runtime
from tests.interpret import run_cases
from tests.parallel_helpers import junk_rows

D, DV = 48, 32
SETTINGS = settings(
    max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


# -- the planner -------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    lens=st.lists(st.integers(0, 40), min_size=1, max_size=5),
    world=st.integers(1, 4),
    chunks=st.integers(1, MAX_CHUNKS),
    align=st.sampled_from([1, 2, 4, 8]),
    taper=st.booleans(),
)
def test_pipeline_plan_cuts_every_share_into_aligned_runs(lens, world, chunks, align, taper) -> None:
    plan = zigzag_split(lens, world, align=align, min_tokens=0)
    if not plan.sharded:
        with pytest.raises(ValueError, match="sharded"):
            pipeline_plan(plan, chunks, align=align, taper=taper)
        return
    pp = pipeline_plan(plan, chunks, align=align, taper=taper)
    assert pp.taper is taper
    for r in range(world):
        ids = plan.token_ids(r).tolist()
        b = pp.bounds[r]
        assert b[0] == 0 and b[-1] == len(ids) and (np.diff(b) >= 0).all()
        assert all(x % align == 0 for x in b[1:-1])  # the kernel's groups are the unchunked step's
        for c in range(chunks):
            piece = ids[b[c] : b[c + 1]]
            expanded = [s + i for s, _, n in pp.runs(r, c) for i in range(n)]
            offsets = [o + i for _, o, n in pp.runs(r, c) for i in range(n)]
            assert expanded == piece and offsets == list(range(len(piece)))
            assert pp.count(r, c) == len(piece)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(n=st.integers(0, 300), chunks=st.integers(1, MAX_CHUNKS), align=st.sampled_from([1, 2, 4, 8]))
def test_tapered_chunks_follow_their_weights(n, chunks, align) -> None:
    plan = zigzag_split([2 * n + 1], 2, align=align, min_tokens=0)  # rank shares of about n tokens
    flat = pipeline_plan(plan, chunks, align=align)
    tapered = pipeline_plan(plan, chunks, align=align, taper=True)
    weights = chunk_weights(chunks, taper=True)
    assert len(weights) == chunks and sum(weights) == (2 * chunks - 2 if chunks >= 3 else chunks)
    for r in range(2):
        share = len(plan.token_ids(r))
        # untapered: the equal cut as before (chunk i ends at floor(n * i / C), aligned down)
        assert flat.bounds[r].tolist() == [0, *(share * i // chunks // align * align for i in range(1, chunks)), share]
        if chunks < 3:  # no middle chunk: equal weights, the same plan
            assert tapered.bounds[r].tolist() == flat.bounds[r].tolist()
            continue
        sizes = [tapered.count(r, c) for c in range(chunks)]
        ends = np.cumsum(weights)
        for c, size in enumerate(sizes):  # each chunk within an alignment step of its share of the weights
            ideal = share * weights[c] / ends[-1]
            assert abs(size - ideal) < 1 + align, (sizes, share)
        if align == 1 and share >= ends[-1]:  # the first and last chunks are the smallest
            assert max(sizes[0], sizes[-1]) <= min(sizes[1:-1]), sizes
    # the plans differ (for a share larger than the weights) and their fingerprints say so
    if chunks >= 3 and not np.array_equal(flat.bounds, tapered.bounds):
        assert flat.fingerprint() != tapered.fingerprint()
    assert flat.fingerprint()[3] is False and tapered.fingerprint()[3] is True


def test_chunk_weights_rejects_bad_arguments() -> None:
    assert chunk_weights(5, taper=True) == (1, 2, 2, 2, 1) and chunk_weights(1, taper=True) == (1,)
    with pytest.raises(ValueError, match="chunks"):
        chunk_weights(0)
    with pytest.raises(TypeError, match="taper"):
        chunk_weights(3, taper=1)
    with pytest.raises(TypeError, match="taper"):
        pipeline_plan(zigzag_split([8], 2, min_tokens=0), 3, taper="yes")


def test_choose_chunks_grows_with_the_step_and_stays_bounded() -> None:
    per_token = 64 * 2048
    got = [choose_chunks(n) for n in range(0, 20 * CHUNK_WORK // per_token, 97)]
    assert got == sorted(got) and got[0] == 1 and got[-1] == AUTO_MAX_CHUNKS
    # each chunk keeps at least CHUNK_WORK of work (the host issues a chunk faster than it runs)
    for n in (CHUNK_WORK // per_token, 3 * CHUNK_WORK // per_token):
        c = choose_chunks(n)
        assert n * per_token // c >= CHUNK_WORK
    assert choose_chunks(4096, heads=128) == 2 * choose_chunks(4096, heads=64)
    assert choose_chunks(10**6, max_chunks=MAX_CHUNKS) == MAX_CHUNKS
    with pytest.raises(ValueError, match="rank_tokens"):
        choose_chunks(-1)
    with pytest.raises(ValueError, match="heads"):
        choose_chunks(10, heads=0)


# -- ShardQ ------------------------------------------------------------------------------------
def _case(seed: int, lens: list[int], world: int, heads_per_rank: int, k: int, extras: bool) -> dict:
    g = torch.Generator().manual_seed(seed)
    t, h, r = sum(lens), heads_per_rank * world, 2 * k + 3
    rows = junk_rows(g, t, k, r, [-1, r, r + 50], 0.3, 5)
    return {
        "q": torch.randn(t, h, D, generator=g),
        "kv": torch.randn(r, D, generator=g),
        "rows": rows,
        "lens": lens,
        "sinks": torch.randn(h, generator=g) if extras else None,
        "topk_length": torch.randint(0, k + 1, (t,), generator=g, dtype=torch.int32) if extras else None,
    }


def _chunked_runs(
    group: dist.ProcessGroup,
    case: dict,
    chunk_counts: list[int],
    align: int,
    workspace: bool,
    grouped: bool = False,
    taper: bool = False,
    one_union: bool = False,
) -> list[tuple]:
    comm = Comm(group)
    w, rank = comm.world_size, comm.rank
    plan = zigzag_split(case["lens"], w, align=align, min_tokens=0)
    h = case["q"].shape[1] // w
    q = case["q"][:, rank * h : (rank + 1) * h]
    seen: list[int] = []
    readies: list[int] = []
    issued: list[tuple[int, int]] = []  # exchanges issued when a kernel call starts, and after its q_ready

    unions: list[bool] = []  # per kernel call with one_union: its slice equals the chunk's own build

    def attention(*args, **kwargs):  # the kernel, recording where it reads q and writes out
        seen.extend([args[0].data_ptr(), kwargs["out"].data_ptr(), kwargs["lse_out"].data_ptr()])
        if one_union:
            prepared = kwargs["prepared_union"]
            own = build_union(
                args[2], group_size=align, num_kv_rows=args[1].shape[0], topk_length=kwargs["topk_length"]
            )
            aligned = prepared.union.data_ptr() % 16 == 0 and prepared.lens.data_ptr() % 16 == 0  # as own builds
            used = torch.arange(own[0].shape[1], device=own[0].device)[None, :] < own[1][:, None].long()
            same = torch.equal(prepared.lens, own[1]) and torch.equal(prepared.union[used], own[0][used])
            unions.append(same and aligned)  # (entries past lens are unspecified on the Triton path)
        wait, calls = kwargs.pop("q_ready"), []
        entry = comm.counts.get("all_to_all", 0)

        def q_ready() -> None:  # the chunk's query exchange: the kernel must wait for it once
            calls.append(1)
            wait()
            issued.append((entry, comm.counts.get("all_to_all", 0)))

        if grouped:  # G = align queries per tile (the Triton grouped kernel on a GPU)
            res = sparse_mla_grouped_prefill(*args, group_size=align, q_ready=q_ready, **kwargs)
        else:
            res = sparse_mla_attention(*args, q_ready=q_ready, **kwargs)
        readies.append(len(calls))
        return res

    ws = None
    dev = q.device
    if workspace:
        n = int(plan.counts.max())
        pad = MAX_CHUNKS * 256
        ws = {
            "q": torch.empty(n * w * h * D * 4 + pad, dtype=torch.uint8, device=dev),
            "out": torch.empty(n * w * h * DV * 4 + pad, dtype=torch.uint8, device=dev),
            "lse": torch.empty(n * w * h * 4 + pad, dtype=torch.uint8, device=dev),
        }
    results = []
    for c in chunk_counts:
        comm.reset_counts()
        seen.clear()
        readies.clear()
        issued.clear()
        unions.clear()
        out, lse = shardq_prefill(
            q, case["kv"], case["rows"], plan, comm, scale=D**-0.5, v_dim=DV, topk_length=case["topk_length"],
            sinks=case["sinks"], attention=attention, chunks=c, align=align, taper=taper, workspace=ws, check=False,
            one_union=one_union,
        )  # fmt: skip
        inside = None
        if ws is not None:  # every buffer the kernel touched lies in the workspace
            spans = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in ws.values()]
            inside = all(any(lo <= p < hi for lo, hi in spans) for p in seen)
        launches = len(seen) // 3
        assert readies == [1] * launches, readies  # each kernel call waited for its queries once
        assert unions == ([True] * launches if one_union else []), unions
        # issue order: chunk k's kernel call starts after q_0..q_k and out_0..out_{k-1} (2k + 1 exchanges),
        # and its q_ready issues q_{k+1} (none after the last chunk), after the union build
        for entry, after in issued:
            assert entry % 2 == 1 and after == (entry + 1 if entry < 2 * c - 1 else entry), (c, issued)
        results.append((out, lse, dict(comm.counts), inside, launches))
    return results


@pytest.mark.distributed
@SETTINGS
@given(
    world=st.integers(1, 4),
    lens=st.lists(st.integers(0, 23), min_size=1, max_size=4).filter(lambda v: sum(v) > 0),
    align=st.sampled_from([1, 2, 4]),
    extras=st.booleans(),
    taper=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_chunked_shardq_equals_unchunked_bit_for_bit(dist_pool, world, lens, align, extras, taper, seed) -> None:
    case = _case(seed, lens, world, 2, 12, extras)
    counts = [1, 2, 3, 5, MAX_CHUNKS]  # more chunks than a rank has tokens: empty chunks
    # tapered or not, G-aligned chunks through the grouped entry (G = align)
    results = dist_pool.run(_chunked_runs, case, counts, align, False, align > 1, taper, world_size=world)
    for rank, per_rank in enumerate(results):
        out1, lse1, *_ = per_rank[0]
        assert torch.isfinite(out1).all(), rank
        for c, (out, lse, comm_counts, _, _) in zip(counts, per_rank):
            assert torch.equal(out, out1) and torch.equal(lse, lse1), (rank, c)
            assert comm_counts == {"all_to_all": 2 * c}, (rank, c, comm_counts)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4], ids=["world2", "world4"])
def test_tapered_shardq_equals_untapered_and_unchunked(dist_pool, world_size: int) -> None:
    """Tapered steps, and untapered ones with one union build, equal the unchunked step."""
    # one long request and short ones: some ranks hold no token of a (small, tapered) chunk
    case = _case(5, [41, 3, 0, 26], world_size, 2, 10, True)
    counts = [1, 3, 4, 7]
    for align in (1, 2):
        tapered = dist_pool.run(_chunked_runs, case, counts, align, True, align > 1, True, world_size=world_size)
        # untapered with the share's union built once (per-chunk slices checked inside)
        flat = dist_pool.run(_chunked_runs, case, counts, align, False, align > 1, False, True, world_size=world_size)
        for rank, (per_t, per_f) in enumerate(zip(tapered, flat)):
            out1, lse1 = per_f[0][:2]  # unchunked
            for c, a, b in zip(counts, per_t, per_f):
                assert torch.equal(a[0], out1) and torch.equal(a[1], lse1), (align, rank, c)
                assert torch.equal(b[0], out1) and torch.equal(b[1], lse1), (align, rank, c)
                assert a[3] is True and a[2] == {"all_to_all": 2 * c}, (align, rank, c)


def _disagree_on(group: dist.ProcessGroup, case: dict, option: str) -> str:
    comm = Comm(group)
    h = case["q"].shape[1] // comm.world_size
    q = case["q"][:, comm.rank * h : (comm.rank + 1) * h]
    plan = zigzag_split(case["lens"], comm.world_size, min_tokens=0)
    try:
        shardq_prefill(
            q, case["kv"], case["rows"], plan, comm, scale=0.1, v_dim=DV, chunks=3, **{option: comm.rank == 1}
        )
    except ValueError as e:
        return str(e)
    return "no error"


def _one_union_errors(group: dist.ProcessGroup) -> list[str]:
    comm = Comm(group)
    case = _case(3, [12, 9], comm.world_size, 2, 4, False)
    plan = zigzag_split(case["lens"], comm.world_size, min_tokens=0)
    huge = case["kv"][:1].expand(2**24, D)  # a stride-0 view: more rows than a 24-bit entry can name
    errors = []
    for kv, align in ((case["kv"], 3), (huge, 2)):
        try:
            shardq_prefill(
                case["q"], kv, case["rows"], plan, comm, scale=0.1, v_dim=DV, chunks=2, one_union=True, align=align
            )
        except ValueError as e:
            errors.append(str(e))
    return [*errors, str(dict(comm.counts))]


@pytest.mark.distributed
def test_one_union_rejects_a_union_it_cannot_build_before_any_message(dist_pool) -> None:
    (errors,) = dist_pool.run(_one_union_errors, world_size=1)
    assert "align must be one of (1, 2, 4, 8) with one_union" in errors[0], errors
    assert "one_union with align=2 needs kv with <= 16777215 rows" in errors[1], errors
    assert "all_to_all" not in errors[2], errors  # raised in the agreement, before any exchange


@pytest.mark.distributed
@pytest.mark.parametrize("option", ["taper", "one_union"])
def test_ranks_that_cut_chunks_differently_all_raise(dist_pool, option: str) -> None:
    case = _case(2, [30, 9], 2, 2, 8, False)
    for msg in dist_pool.run(_disagree_on, case, option, world_size=2):
        assert "ShardQ plan and inputs: rank(s) [1] disagree" in msg, msg


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 3], ids=["world1", "world3"])
@pytest.mark.parametrize("align", [1, 2, 4, 8], ids=lambda g: f"G{g}")
def test_one_union_build_equals_per_chunk_builds(dist_pool, world_size: int, align: int) -> None:
    # tokens with no valid key, topk_length, sinks, tails; the attention checks every slice it gets
    case = _case(17 + align, [29, 5, 14], world_size, 2, 9, True)
    counts = [1, 3, 5]
    one = dist_pool.run(_chunked_runs, case, counts, align, True, True, True, True, world_size=world_size)
    per_chunk = dist_pool.run(_chunked_runs, case, counts, align, True, True, True, False, world_size=world_size)
    for rank, (a, b) in enumerate(zip(one, per_chunk)):
        for c, x, y in zip(counts, a, b):
            assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[3] is True, (rank, c)
            assert torch.equal(x[0], b[0][0]) and torch.equal(x[1], b[0][1]), (rank, c)


@pytest.mark.distributed
def test_chunked_shardq_reads_and_writes_only_the_workspace(dist_pool) -> None:
    case = _case(3, [19, 6, 11], 3, 2, 10, True)
    results = dist_pool.run(_chunked_runs, case, [1, 4], 1, True, world_size=3)
    fresh = dist_pool.run(_chunked_runs, case, [4], 1, False, world_size=3)
    for rank, (per_rank, (ref,)) in enumerate(zip(results, fresh)):
        for out, lse, _, inside, launches in per_rank:
            assert inside is True and launches >= 1, rank
            assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1]), rank


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.parametrize("options", [False, True], ids=["plain", "taper-one-union"])
@pytest.mark.parametrize("grouped", [False, True], ids=["per-query", "grouped-G2"])
def test_chunked_shardq_on_nccl(dist_pool, grouped: bool, options: bool) -> None:
    from tests.test_nccl_steps import _on_gpu

    case = _case(21, [700, 333, 90], 2, 8, 64, True)
    counts = [1, 3, MAX_CHUNKS]
    align = 2 if grouped else 1
    args = (case, counts, align, True, grouped, options, options)  # options: tapered chunks, one union build
    results = dist_pool.run(_on_gpu, _chunked_runs, *args, world_size=2, backend="nccl")
    want = dist_pool.run(_chunked_runs, case, [1], align, False, world_size=2)  # gloo, the torch reference
    for rank, (per_rank, (ref,)) in enumerate(zip(results, want)):
        out1, lse1, *_ = per_rank[0]
        assert torch.isfinite(out1).all(), rank
        err = float((out1 - ref[0]).norm() / ref[0].norm())
        assert err < 1e-4, (rank, err)  # fp32 inputs: the Triton kernel's IEEE fp32 path
        for c, (out, lse, comm_counts, inside, _) in zip(counts, per_rank):
            assert inside is True and comm_counts == {"all_to_all": 2 * c}, (rank, c)
            assert torch.equal(out, out1) and torch.equal(lse, lse1), (rank, c)


def _runtime_steps(
    group: dist.ProcessGroup, case: dict, chunks: int | None, taper: bool = False, one_union: bool = False
) -> dict:
    spec = ModelSpec("sparse_mla", case["q"].shape[1], 1, D, DV, 12, 16, dtype="float32", softmax_scale=D**-0.5)
    options = PrefillOptions(min_shard_tokens=1, chunks=chunks, taper=taper, one_union=one_union)
    rt = Runtime(spec, group, max_batched_tokens=64, mode="shardq", prefill_options=options, warmup=False)
    h, rank = rt.heads_per_rank, rt.rank
    q = case["q"][:, rank * h : (rank + 1) * h]
    buffers = {k: (v.data_ptr(), v.numel()) for k, v in rt.workspace.items()}
    outs = []
    for _ in range(2):
        rt.comm.reset_counts()
        outs.append(rt.prefill(q, case["kv"], case["rows"], query_lens=case["lens"], check=False))
    same_buffers = buffers == {k: (v.data_ptr(), v.numel()) for k, v in rt.workspace.items()}
    return {
        "out": outs[-1],
        "same": same_buffers,
        "counts": dict(rt.comm.counts),
        "equal": torch.equal(*[o[0] for o in outs]),
    }


@pytest.mark.distributed
def test_runtime_pipelined_prefill_equals_unpipelined(dist_pool) -> None:
    case = _case(11, [30, 17], 2, 2, 12, False)
    piped = dist_pool.run(_runtime_steps, case, 3, world_size=2)
    tapered = dist_pool.run(_runtime_steps, case, 4, True, True, world_size=2)  # and one union build
    plain = dist_pool.run(_runtime_steps, case, 1, world_size=2)
    for rank, (a, t, b) in enumerate(zip(piped, tapered, plain)):
        assert a["same"] and a["equal"] and a["counts"] == {"all_to_all": 6}, (rank, a["counts"])
        assert t["same"] and t["equal"] and t["counts"] == {"all_to_all": 8}, (rank, t["counts"])
        assert b["counts"] == {"all_to_all": 2}, rank
        for x in (a, t):
            assert torch.equal(x["out"][0], b["out"][0]) and torch.equal(x["out"][1], b["out"][1]), rank


def test_runtime_rejects_a_pipeline_deeper_than_its_workspace() -> None:
    # checked when the options are built, before any Runtime or group
    with pytest.raises(ValueError, match=r"PrefillOptions\.chunks must be in \[1, 8\]"):
        PrefillOptions(chunks=MAX_CHUNKS + 1)
    with pytest.raises(TypeError, match=r"PrefillOptions\.taper must be a bool"):
        PrefillOptions(taper=1)
    with pytest.raises(TypeError, match=r"PrefillOptions\.one_union must be a bool"):
        PrefillOptions(one_union="yes")
    # options of the wrong type: a Runtime's TypeError on its rank (tests/test_runtime_construction_faults.py)


# -- PCP: the all-gather overlapped with the prefix attention equals the blocking order ---------
def _pcp_both(group: dist.ProcessGroup, seed: int, lens: list[int], prefix: list[int]) -> tuple:
    comm = Comm(group)
    w, rank = comm.world_size, comm.rank
    g = torch.Generator().manual_seed(seed)
    page, k, h = 4, 10, 3
    plan = pcp_plan(lens, w, prefix_lens=prefix)
    b = len(lens)
    pages = -(-max(prefix) // page) + 1
    table = torch.randperm(b * pages, generator=g).to(torch.int32).view(b, pages)
    cache = torch.randn(b * pages * page, D, generator=g)
    t = sum(lens)
    q_all, kv_all = torch.randn(t, h, D, generator=g), torch.randn(t, D, generator=g)
    pos_all = torch.randint(-2, max(p + n for p, n in zip(prefix, lens)) + 2, (t, k), generator=g, dtype=torch.int32)
    ids = plan.shard.token_ids(rank)
    q, kv, pos = q_all[ids], kv_all[ids], pos_all[ids]
    kw = dict(scale=D**-0.5, v_dim=DV)
    got = pcp_prefill(q, kv, pos, plan, comm, kv_cache=cache, block_table=table, block_size=page, check=False, **kw)
    # before the overlap: blocking all-gather, new-token attention, then the prefix, merged in that order
    p = plan.shard.padded_count
    padded = kv.new_zeros(p, D)
    padded[: len(ids)] = kv
    gathered = comm.all_gather(padded).view(w * p, D)
    req = plan.shard.request_ids(rank)
    rows = plan.gathered_rows_for(pos, req).to(torch.int32)
    out, lse = sparse_mla_attention(q, gathered, rows, **kw)
    prefix_rows, _ = convert_topk(
        pos, req.to(torch.int32), table, block_size=page, seq_lens=plan.shard.prefix_lens.to(torch.int32)
    )
    out_p, lse_p = sparse_mla_attention(q, cache, prefix_rows, **kw)
    want = lse_merge(torch.stack([out, out_p]), torch.stack([lse, lse_p]))
    return got, want


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2, 3], ids=["world1", "world2", "world3"])
def test_pcp_overlapped_all_gather_equals_blocking_order(dist_pool, world_size: int) -> None:
    results = dist_pool.run(_pcp_both, 7 + world_size, [9, 14, 2], [5, 0, 11], world_size=world_size)
    for rank, ((out, lse), (want_out, want_lse)) in enumerate(results):
        assert torch.isfinite(out).all() and torch.equal(out, want_out) and torch.equal(lse, want_lse), rank


# -- the kernel reads and writes head-blocked buffers in place ----------------------------------
def test_head_blocked_io_equals_plain_on_the_reference_path() -> None:
    g = torch.Generator().manual_seed(0)
    b, t, hb, k, r = 3, 7, 2, 9, 20
    q = torch.randn(b, t, hb, D, generator=g)
    kv = torch.randn(r, D, generator=g)
    rows = torch.randint(-1, r, (t, k), generator=g, dtype=torch.int32)
    plain = q.movedim(0, 1).reshape(t, b * hb, D)
    want_out, want_lse = sparse_mla_attention(plain, kv, rows, scale=0.2, v_dim=DV)
    out, lse = torch.full((b, t, hb, DV), float("nan")), torch.full((b, t, hb), float("nan"))
    got = sparse_mla_attention(q, kv, rows, scale=0.2, v_dim=DV, out=out, lse_out=lse)
    assert got[0] is out and got[1] is lse
    assert torch.equal(out.movedim(0, 1).reshape(t, b * hb, DV), want_out)
    assert torch.equal(lse.movedim(0, 1).reshape(t, b * hb), want_lse)


@pytest.mark.interpret
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_head_blocked_io_under_the_triton_interpreter() -> None:
    assert run_cases("head_blocked_cases")[-1] == "0 failures"


# -- Comm.exchange: the in-place all-to-all of contiguous pieces ---------------------------------
def _exchange(group: dist.ProcessGroup) -> dict:
    comm = Comm(group)
    w, rank = comm.world_size, comm.rank
    # rank a sends to rank b pieces of lengths (a + b) % 3 + k for k = 0, 1 (some empty), valued 100a + 10b + k
    sends, recvs, got = [], [], []
    for b in range(w):
        for k in range(2):
            n = (rank + b) % 3 + k - 1
            sends.append((b, torch.full((max(n, 0), 2), 100.0 * rank + 10 * b + k)))
    for a in range(w):
        for k in range(2):
            y = torch.full((max((a + rank) % 3 + k - 1, 0), 2), -1.0)
            recvs.append((a, y))
            got.append((a, k, y))
    comm.exchange(sends, recvs, tag=3).wait()
    ok = all(bool((y == 100.0 * a + 10 * rank + k).all()) for a, k, y in got)
    bad_peer = catch_error(lambda: comm.exchange([(w, torch.zeros(1))], []))
    lonely = catch_error(lambda: comm.exchange([(rank, torch.zeros(1))], []))
    return {"ok": ok, "counts": dict(comm.counts), "bad_peer": bad_peer, "lonely": lonely}


def catch_error(fn: Callable[[], object]) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 3], ids=["world1", "world3"])
def test_exchange_moves_every_piece_to_its_slot(dist_pool, world_size: int) -> None:
    for res in dist_pool.run(_exchange, world_size=world_size):
        assert res["ok"] and res["counts"] == {"all_to_all": 1}, res
        assert "is not a rank" in res["bad_peer"] and "this rank itself" in res["lonely"], res
