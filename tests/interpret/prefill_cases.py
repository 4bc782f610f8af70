"""Sparse-prefill Triton kernels under the interpreter at tiny shapes, against the torch references.

Run as ``TRITON_INTERPRET=1 python -m tests.interpret.prefill_cases`` (tests/test_sparse_mla_interpret.py
does this in a subprocess). Prints one line per case and exits 1 on the first mismatch. fp16 (the
interpreter mishandles bf16 dots) and one fp32 case; head dims ``D = 32 + 16``, ``Dv = 32``.
"""

from __future__ import annotations

import os
import sys

import torch

D_V, D = 32, 48
FAILURES: list[str] = []


def _report(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILURES.append(name)


def _union_equal(a, b) -> bool:
    (ua, la), (ub, lb) = a, b
    return torch.equal(la, lb) and all(torch.equal(ua[i, :n], ub[i, :n]) for i, n in enumerate(lb.tolist()))


def topk_cases(gen: torch.Generator) -> None:
    from shardattn.ops.topk import DcpShard, convert_topk, convert_topk_reference

    t, k, b, m, bs = 21, 37, 3, 9, 4
    pos = torch.randint(-3, 40, (t, k), generator=gen, dtype=torch.int32)
    req = torch.randint(-1, 4, (t,), generator=gen, dtype=torch.int32)  # -1 and 3: bad request ids
    table = torch.randint(-1, 20, (b, m), generator=gen, dtype=torch.int32)
    seq = torch.randint(0, 40, (b,), generator=gen, dtype=torch.int32)
    length = torch.randint(0, k + 3, (t,), generator=gen, dtype=torch.int32)
    variants = {
        "plain": {},
        "seq_lens": {"seq_lens": seq},
        "topk_length+stride": {"topk_length": length, "block_stride": 7},
        "dcp": {"seq_lens": seq, "topk_length": length, "dcp": DcpShard(3, 2, 1)},
        "dcp_rank0_interleave1": {"dcp": DcpShard(2, 1, 0)},
        "packed": {"seq_lens": seq, "packed": True},
        "dcp+packed": {"seq_lens": seq, "topk_length": length, "dcp": DcpShard(3, 2, 1), "packed": True},
    }
    for name, kw in variants.items():
        got = convert_topk(pos, req, table, block_size=bs, **kw)
        want = convert_topk_reference(pos, req, table, block_size=bs, **kw)
        _report(f"topk[{name}]", torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]))


UNION_METHODS = ("sort", "fused")


def _union_special_rows(gen: torch.Generator, k: int, r: int) -> torch.Tensor:
    """17 queries: an empty group (queries 0-7 at G <= 8), identical and disjoint lists, dupes, tail."""
    rows = torch.randint(-3, r + 3, (17, k), generator=gen, dtype=torch.int32)
    rows[:8] = -1  # every group of queries 0..7 is empty
    rows[8] = rows[9] = rows[10] = rows[11]  # identical lists
    rows[12] = torch.arange(k, dtype=torch.int32) % r  # disjoint-ish from query 13
    rows[13] = (torch.arange(k, dtype=torch.int32) + k) % r
    rows[14, : k // 2] = rows[14, k // 2 : 2 * (k // 2)]  # duplicates within a row
    return rows


def union_cases(gen: torch.Generator) -> None:
    from shardattn.ops.union import MAX_PACKED_ROWS, build_union, build_union_reference

    def check(name, rows, g, r, length=None):
        want = build_union_reference(rows, group_size=g, num_kv_rows=r, topk_length=length)
        for method in UNION_METHODS:
            if g == 1 and method == "fused":
                continue  # G = 1 on unsorted rows is the row sort whatever the method
            got = build_union(rows, group_size=g, num_kv_rows=r, topk_length=length, method=method)
            _report(f"union[G={g},{name},{method}]", _union_equal(got, want))

    for g in (1, 2, 4, 8):
        for t, k, r in [(13, 20, 30), (5, 33, 7)]:
            rows = torch.randint(-3, r + 3, (t, k), generator=gen, dtype=torch.int32)
            length = torch.randint(0, k + 3, (t,), generator=gen, dtype=torch.int32)
            check(f"T={t},K={k}", rows, g, r, length)
        check("special", _union_special_rows(gen, 24, 60), g, 60)
        # rows up to 2**24 - 2 (query 7's bit is the sign bit)
        top = torch.randint(MAX_PACKED_ROWS - 40, MAX_PACKED_ROWS + 3, (11, 16), generator=gen, dtype=torch.int32)
        top[:, 0] = MAX_PACKED_ROWS - 1
        check("top_rows", top, g, MAX_PACKED_ROWS)
    # several compaction chunks (width > 2048), long duplicate runs across chunk edges
    rows = torch.randint(-3, 40, (16, 300), generator=gen, dtype=torch.int32)
    for g in (1, 8):
        want = build_union_reference(rows, group_size=g, num_kv_rows=40)
        _report(f"union[G={g},chunks]", _union_equal(build_union(rows, group_size=g, num_kv_rows=40), want))
    # several key blocks per list (K > 1024), a tail group, half the entries shared by neighbours
    rows = torch.randint(-1, 3000, (9, 1030), generator=gen, dtype=torch.int32)
    rows[1::2, :500] = rows[0:-1:2, :500]
    for g in (2, 8):
        want = build_union_reference(rows, group_size=g, num_kv_rows=3000)
        got = build_union(rows, group_size=g, num_kv_rows=3000, method="sort")
        _report(f"union[G={g},key_blocks]", _union_equal(got, want))


def _rows_with_edge_cases(gen: torch.Generator, t: int, k: int, r: int) -> torch.Tensor:
    rows = torch.randint(0, r, (t, k), generator=gen, dtype=torch.int32)
    rows[torch.rand(t, k, generator=gen) < 0.2] = -1  # invalid anywhere
    rows[0, ::3] = r + 2  # out of range
    rows[2] = -1  # empty row
    rows[4, : k // 2] = rows[4, k // 2 : 2 * (k // 2)]  # duplicates within a row
    rows[5] = rows[6]  # identical neighbours
    rows[7] = torch.arange(k, dtype=torch.int32) % r  # (mostly) disjoint from its group
    return rows


def attention_cases(gen: torch.Generator) -> None:
    from shardattn.ops.sparse_mla import sparse_mla_per_query, sparse_mla_reference
    from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill

    combos = [(8, 8), (8, 1), (16, 4), (16, 2), (32, 2), (32, 8), (64, 1), (64, 2), (128, 1), (128, 4)]
    t, k, r = 11, 24, 40  # 11 tokens: every G > 1 leaves a tail group
    for heads, g in combos:
        q = torch.randn(t, heads, D, generator=gen).half()
        kv = torch.randn(r, D, generator=gen).half()
        rows = _rows_with_edge_cases(gen, t, k, r)
        sinks = torch.randn(heads, generator=gen) if heads == 16 else None
        length = torch.randint(0, k + 1, (t,), generator=gen, dtype=torch.int32) if heads == 32 else None
        out, lse = sparse_mla_grouped_prefill(
            q, kv, rows, scale=0.2, v_dim=D_V, group_size=g, sinks=sinks, topk_length=length
        )
        ref_o, ref_l = sparse_mla_reference(
            q.float(), kv.float(), rows, scale=0.2, v_dim=D_V, sinks=sinks, topk_length=length
        )
        err = ((out.float() - ref_o).norm() / ref_o.norm()).item()
        fin = torch.isfinite(ref_l)
        ok = err < 2e-3 and torch.equal(fin, torch.isfinite(lse)) and (lse[fin] - ref_l[fin]).abs().max() < 1e-3
        if sinks is None:
            ok = ok and bool((out[2] == 0).all()) and bool(lse[2].isneginf().all())
        _report(f"attention[H={heads},G={g}]", bool(ok), f"rel_err={err:.1e}")
    # fp32 per-query path, and a group spanning two requests (rows from different requests)
    q, kv = torch.randn(8, 8, D, generator=gen), torch.randn(r, D, generator=gen)
    rows = _rows_with_edge_cases(gen, 8, k, r)
    out, lse = sparse_mla_per_query(q, kv, rows, scale=0.2, v_dim=D_V)
    ref_o, ref_l = sparse_mla_reference(q, kv, rows, scale=0.2, v_dim=D_V)
    err = ((out - ref_o).norm() / ref_o.norm()).item()
    _report("attention[fp32,per_query]", err < 1e-4, f"rel_err={err:.1e}")


def _per_query_entry_points(label: str, q, kv, rows, length, **call) -> None:
    """Both per-query entry points (``sparse_mla_grouped_prefill`` with ``group_size=1``,
    ``sparse_mla_attention``) against the fp32 reference; token 2 has no key. ``label``: the case's
    name with ``{}`` for the entry point's."""
    from shardattn.ops.sparse_mla import sparse_mla_attention, sparse_mla_reference
    from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill

    ref_o, ref_l = sparse_mla_reference(q.float(), kv.float(), rows, scale=0.2, v_dim=D_V, topk_length=length)
    for name, fn, kw in (
        ("grouped", sparse_mla_grouped_prefill, {"group_size": 1}),
        ("attention", sparse_mla_attention, {}),
    ):
        out, lse = fn(q, kv, rows, scale=0.2, v_dim=D_V, topk_length=length, **call, **kw)
        err = ((out.float() - ref_o).norm() / ref_o.norm()).item()
        fin = torch.isfinite(ref_l)
        ok = err < 2e-3 and torch.equal(fin, torch.isfinite(lse)) and (lse[fin] - ref_l[fin]).abs().max() < 1e-3
        ok = ok and bool((out[2] == 0).all()) and bool(lse[2].isneginf().all())
        _report(label.format(name), bool(ok), f"rel_err={err:.1e}")


def rows_unique_cases(gen: torch.Generator) -> None:
    """``rows_unique=True``: each query's valid rows packed in the caller's (unsorted) order for
    the per-query Triton kernel, no union; both entry points, with and without ``topk_length``."""
    t, k, r = 9, 24, 40
    for heads, with_len in ((64, False), (16, True)):
        q = torch.randn(t, heads, D, generator=gen).half()
        kv = torch.randn(r, D, generator=gen).half()
        rows = torch.stack([torch.randperm(r, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
        rows[torch.rand(t, k, generator=gen) < 0.2] = -1  # invalid anywhere
        rows[0, ::5] = r + 2  # out of range
        rows[2] = -1  # empty row
        length = torch.randint(0, k + 1, (t,), generator=gen, dtype=torch.int32) if with_len else None
        _per_query_entry_points(f"rows_unique[{{}},H={heads},len={with_len}]", q, kv, rows, length, rows_unique=True)


def hashed_dedup_cases(gen: torch.Generator) -> None:
    """A per-query call on a cache too large for the bitmap's count: each query's rows
    de-duplicated by hash (``unique_rows``) and packed, not sorted into a union; both entry
    points (``sparse_mla_attention`` runs its reference off a GPU), repeats and invalid entries
    anywhere, an empty row, with and without ``topk_length``."""
    from shardattn.kernels.gluon.union_smem import smem_unsupported_reason
    from shardattn.plan.union_routing import route_row_dedup

    t, k, r = 10, 8, 600
    shared_memory = smem_unsupported_reason(torch.zeros(t, k, dtype=torch.int32), 1) is None
    _report("hashed[route]", route_row_dedup(k, r, shared_memory=shared_memory) == "unique")
    for heads, with_len in ((64, False), (16, True)):
        q = torch.randn(t, heads, D, generator=gen).half()
        kv = torch.randn(r, D, generator=gen).half()
        rows = _rows_with_edge_cases(gen, t, k, r)
        rows[8, 1::2] = rows[8, 0::2]  # every row of token 8 twice
        length = torch.randint(0, k + 1, (t,), generator=gen, dtype=torch.int32) if with_len else None
        _per_query_entry_points(f"hashed[{{}},H={heads},len={with_len}]", q, kv, rows, length)


def spanning_requests_case(gen: torch.Generator) -> None:
    from shardattn.ops.sparse_mla import sparse_mla_reference
    from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill
    from shardattn.ops.topk import convert_topk

    # two requests of 5 and 4 tokens, 16-token block tables; groups of 4 straddle the boundary
    pos = torch.randint(-1, 16, (9, 12), generator=gen, dtype=torch.int32)
    req = torch.tensor([0] * 5 + [1] * 4, dtype=torch.int32)
    table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
    rows, _ = convert_topk(pos, req, table, block_size=4)
    q, kv = torch.randn(9, 16, D, generator=gen).half(), torch.randn(32, D, generator=gen).half()
    out, lse = sparse_mla_grouped_prefill(q, kv, rows, scale=0.2, v_dim=D_V, group_size=4)
    ref_o, ref_l = sparse_mla_reference(q.float(), kv.float(), rows, scale=0.2, v_dim=D_V)
    err = ((out.float() - ref_o).norm() / ref_o.norm()).item()
    fin = torch.isfinite(ref_l)
    ok = err < 2e-3 and torch.equal(fin, torch.isfinite(lse)) and (lse[fin] - ref_l[fin]).abs().max() < 1e-3
    _report("attention[groups spanning requests]", bool(ok), f"rel_err={err:.1e}")


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1 before running this module", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(int(os.environ.get("SHARDATTN_SEED", "0")))
    topk_cases(gen)
    union_cases(gen)
    attention_cases(gen)
    rows_unique_cases(gen)
    hashed_dedup_cases(gen)
    spanning_requests_case(gen)
    print(f"{len(FAILURES)} failures: {FAILURES}", flush=True)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
