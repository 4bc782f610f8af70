"""A parallel step's destination laid over one of its inputs is refused on every rank, where it gave a
wrong result with no error.

Each case runs a step on two gloo ranks with a destination (ShardQ's ``out``, a DCP ``workspace``
buffer, the collector's ``buffers["send"]``) over the bytes of an input it still reads after
writing the destination: every rank raises the ``ValueError`` naming both, in the step's
agreement; with the check taken out, the same call returns a result unlike the one on separate
buffers. The other overlaps refused are rows of the bad-input table
(tests/bad_input/parallel_alias_rows.py); the aliases the Runtime's arena uses (a buffer written
once the inputs are read) still give the same result.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardattn.parallel import collector as collector_mod
from shardattn.parallel import dcp as dcp_mod
from shardattn.parallel import shardq as shardq_mod
from shardattn.parallel.collector import collect_partials
from shardattn.parallel.comm import Comm
from shardattn.parallel.dcp import dcp_sparse_mla_decode
from shardattn.parallel.dcp_gqa import dcp_gqa_decode
from shardattn.parallel.shardq import shardq_prefill
from shardattn.plan import zigzag_split
from tests.parallel_helpers import assert_rank_errors, catch, rank_1_rejected
from tests.test_dcp import _gqa_case, _mla_case
from tests.test_shardq import _case as _shardq_case

_WS_BYTES = 1 << 16


def _into(buf: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t``'s values copied to the first bytes of ``buf`` (flat ``uint8``), as a tensor over them."""
    n = t.numel() * t.element_size()
    buf[:n].copy_(t.contiguous().view(-1).view(torch.uint8))
    return buf[:n].view(t.dtype).view(t.shape)


@contextlib.contextmanager
def _check_taken_out() -> Iterator[None]:
    """The steps' destination-over-input check replaced by one that lets everything through."""
    mods = (shardq_mod, dcp_mod, collector_mod)
    saved = [m.check_not_inputs for m in mods]
    for m in mods:
        m.check_not_inputs = lambda *a, **k: None  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for m, fn in zip(mods, saved):
            m.check_not_inputs = fn  # type: ignore[attr-defined]


def _fp32(case: dict) -> dict:
    return {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in case.items()}


def _shardq(comm: Comm, problem: str, aliased: bool) -> Any:
    """ShardQ in three chunks on 16 tokens; ``aliased``: with ``problem``'s destination over its input."""
    w, rank = comm.world_size, comm.rank
    case = _fp32(_shardq_case(3, [9, 7], [0, 0], w, 2, 8, d=32, dv=16))
    q, kv, rows = case["q"][:, rank * 2 : rank * 2 + 2].clone(), case["kv"].clone(), case["rows"].clone()
    kw: dict[str, Any] = {}
    if aliased:
        buf = torch.zeros(_WS_BYTES, dtype=torch.uint8)
        if problem == "shardq-out-over-q":
            # out from q's row 9 on: the zigzag chunks are [0, 1], [2, 7, 8], [9, 10, 15] on rank 0 and
            # [3, 4], [5, 6, 11], [12, 13, 14] on rank 1, so the outputs of chunk 0 (copied in place as
            # the output exchange is issued) land on the queries of tokens 9 and 10, which the query
            # exchange of chunk 2 reads after
            q = _into(buf, q)
            row = q[0].numel() * 4
            kw["out"] = buf[9 * row : 9 * row + q.shape[0] * row // 2].view(torch.float32).view(q.shape[0], 2, 16)
        elif problem == "shardq-out-over-kv":  # later chunks' kernels read kv after outputs landed
            kv = _into(buf, kv)
            kw["out"] = buf[: q.shape[0] * 2 * 16 * 4].view(torch.float32).view(q.shape[0], 2, 16)
        else:  # "shardq-workspace-q-over-rows": the queries received before the rank's rows are read
            rows = _into(buf, rows)
            kw["workspace"] = {"q": buf}
    plan = zigzag_split(case["seq_lens"], w, min_tokens=0)
    return shardq_prefill(q, kv, rows, plan, comm, scale=0.2, v_dim=16, chunks=3, **kw)


def _dcp_mla(comm: Comm, problem: str, aliased: bool) -> Any:
    rank = comm.rank
    case = _mla_case(2, [9, 5, 12], [1, 2, 1], comm.world_size, 1, d=32, dv=16)
    h = case["q"].shape[1] // comm.world_size
    mine = case["local"][rank]
    q = case["q"][:, rank * h : (rank + 1) * h].float().contiguous()
    kv, pos = mine["cache"].float().clone(), case["pos"].clone()
    kw: dict[str, Any] = {}
    if aliased:
        buf = torch.zeros(_WS_BYTES, dtype=torch.uint8)
        if problem == "dcp-workspace-q-over-topk-pos":  # gathered queries written before the top-k is converted
            pos = _into(buf, pos)
            kw["workspace"] = {"q": buf}
        else:  # "dcp-workspace-rows-over-kv-cache": converted rows written before the kernel reads the cache
            kv = _into(buf, kv)
            kw["workspace"] = {"rows": buf}
    return dcp_sparse_mla_decode(
        q, kv, pos, case["req_ids"], mine["table"], case["layout"], comm, block_size=case["block_size"],
        scale=case["scale"], v_dim=16, seq_lens=case["seq_lens"], **kw,
    )  # fmt: skip


def _dcp_gqa(comm: Comm, problem: str, aliased: bool) -> Any:
    rank = comm.rank
    case = _gqa_case(5, [9, 5, 12], [1, 1, 1], comm.world_size, 1, ragged=False)
    h = case["q"].shape[1] // comm.world_size
    mine = case["local"][rank]
    q = case["q"][:, rank * h : (rank + 1) * h].float().contiguous()
    k, v = mine["k"].float().clone(), mine["v"].float().clone()
    kw: dict[str, Any] = {}
    if aliased:  # "dcp-gqa-workspace-q-over-k-cache": gathered queries written before the kernel reads keys
        buf = torch.zeros(_WS_BYTES, dtype=torch.uint8)
        k = _into(buf, k)
        kw["workspace"] = {"q": buf}
    return dcp_gqa_decode(q, k, v, mine["table"], case["seq_lens"], case["layout"], comm, q_len_per_req=1, **kw)


def _collect(comm: Comm, problem: str, aliased: bool) -> Any:
    g = torch.Generator().manual_seed(comm.rank)
    out, lse = torch.randn(3, 4, 8, generator=g), torch.randn(3, 4, generator=g)
    kw: dict[str, Any] = {"strategy": "all_to_all"}
    if aliased:  # "collect-send-over-out": the partial packed into the send buffer as it is read
        buf = torch.zeros(_WS_BYTES, dtype=torch.uint8)
        out = _into(buf, out)
        kw["buffers"] = {"send": buf, "recv": torch.zeros(_WS_BYTES, dtype=torch.uint8)}
    return collect_partials(out, lse, comm, **kw)


_STEPS = {"shardq": _shardq, "dcp": _dcp_mla, "dcp-gqa": _dcp_gqa, "collect": _collect}


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference, equal values (infinities included) counting 0 and NaN counting as infinite."""
    d = (a - b).abs()
    d[a == b] = 0
    return float(d.nan_to_num(float("inf")).max())


def _aliased(group: dist.ProcessGroup, problem: str) -> tuple[tuple[str, str], float]:
    """``(the aliased call's catch(), the largest error of the same call with the check taken out)``."""
    comm = Comm(group)
    run = _STEPS[next(k for k in ("dcp-gqa", "dcp", "shardq", "collect") if problem.startswith(k))]
    refused = catch(run, comm, problem, True)
    want = run(comm, problem, False)
    with _check_taken_out():
        got = run(comm, problem, True)
    return refused, max(_err(a, b) for a, b in zip(want, got, strict=True))


CASES = [
    ("shardq-out-over-q", "out shares memory with q_heads_local: the step reads q_heads_local after writing out"),
    ("shardq-out-over-kv", "out shares memory with kv"),
    ("shardq-workspace-q-over-rows", "workspace['q'] shares memory with rows"),
    ("dcp-workspace-q-over-topk-pos", "workspace['q'] shares memory with topk_pos"),
    ("dcp-workspace-rows-over-kv-cache", "workspace['rows'] shares memory with kv_cache"),
    ("dcp-gqa-workspace-q-over-k-cache", "workspace['q'] shares memory with k_cache"),
    ("collect-send-over-out", "buffers['send'] shares memory with out: the collector reads out after writing"),
]


@pytest.mark.distributed
@pytest.mark.parametrize(("problem", "message"), CASES, ids=[c[0] for c in CASES])
def test_destination_over_input_is_refused_instead_of_a_wrong_result(dist_pool, problem: str, message: str) -> None:
    results = dist_pool.run(_aliased, problem, world_size=2)
    assert_rank_errors([refused for refused, _ in results], [f"ValueError: {message}"] * 2)
    errors = [err for _, err in results]
    assert max(errors) > 0.1, f"the check taken out, the aliased step still gave the right result: {errors}"


def _one_rank_aliases(group: dist.ProcessGroup) -> tuple[str, str]:
    comm = Comm(group)
    return catch(_shardq, comm, "shardq-out-over-q", comm.rank == 1)


@pytest.mark.distributed
def test_one_ranks_destination_over_its_input_stops_every_rank(dist_pool) -> None:
    """Rank 1 alone lays ``out`` over its queries: it raises, and rank 0 raises in the agreement at once."""
    results = dist_pool.run(_one_rank_aliases, world_size=2)
    error = "ValueError: out shares memory with q_heads_local"
    assert_rank_errors(results, rank_1_rejected(2, "ShardQ plan and inputs", error))


def _arena_aliases(group: dist.ProcessGroup) -> list[bool]:
    """Buffers written once the inputs are read may hold them: the collector's receive buffer over
    its partial, a DCP step's send / receive buffers over its queries and top-k."""
    comm = Comm(group)
    same = []
    want = _collect(comm, "", False)
    g = torch.Generator().manual_seed(comm.rank)
    out, lse = torch.randn(3, 4, 8, generator=g), torch.randn(3, 4, generator=g)
    buf = torch.zeros(_WS_BYTES, dtype=torch.uint8)
    out = _into(buf, out)
    got = collect_partials(out, lse, comm, strategy="all_to_all", buffers={"send": torch.zeros_like(buf), "recv": buf})
    same.append(all(torch.equal(a, b) for a, b in zip(want, got)))
    case = _mla_case(2, [9, 5, 12], [1, 2, 1], comm.world_size, 1, d=32, dv=16)
    h = case["q"].shape[1] // comm.world_size
    mine = case["local"][comm.rank]
    q = case["q"][:, comm.rank * h : (comm.rank + 1) * h].float().contiguous()
    args = (mine["cache"].float(), case["pos"], case["req_ids"], mine["table"], case["layout"], comm)
    kw = dict(block_size=case["block_size"], scale=case["scale"], v_dim=16, seq_lens=case["seq_lens"])
    want = dcp_sparse_mla_decode(q, *args, **kw, strategy="all_to_all")
    send, recv = torch.zeros(_WS_BYTES, dtype=torch.uint8), torch.zeros(_WS_BYTES, dtype=torch.uint8)
    q_in_send = _into(send, q)
    pos_in_recv = _into(recv, case["pos"])
    args = (mine["cache"].float(), pos_in_recv, *args[2:])
    got = dcp_sparse_mla_decode(q_in_send, *args, **kw, strategy="all_to_all", workspace={"send": send, "recv": recv})
    same.append(all(torch.equal(a, b) for a, b in zip(want, got)))
    return same


@pytest.mark.distributed
def test_buffers_written_after_the_inputs_are_read_may_hold_them(dist_pool) -> None:
    for same in dist_pool.run(_arena_aliases, world_size=2):
        assert same == [True, True]
