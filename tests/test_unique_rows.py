"""Decode's de-duplication: the hash kernel under the interpreter against an independent oracle
(tests/interpret/unique_rows_cases.py, in a subprocess), the torch reference against the same
oracle, and the route between it and the sorted union."""

from __future__ import annotations

import pytest
import torch

from shardattn.kernels.triton.unique_rows import launch_unique_rows, unique_rows_parts
from shardattn.ops.dispatch import triton_available
from shardattn.ops.union import build_union
from shardattn.ops.unique_rows import decode_rows, unique_rows, unique_rows_reference
from shardattn.plan.crossovers import BITMAP_SCAN_RATIO, DEDUP_HASH_MAX_TOKENS, SMEM_SCAN_RATIO
from shardattn.plan.union_routing import MAX_UNIQUE_ENTRIES, route_row_dedup
from tests.interpret import run_cases
from tests.interpret.union_cases import make_rows
from tests.interpret.unique_rows_cases import oracle


@pytest.mark.interpret
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_kernel_matches_the_oracle_under_interpreter():
    lines = run_cases("unique_rows_cases")
    names = [ln.split()[1] for ln in lines if ln.startswith("ok")]
    assert {"one_row_repeated", "all_invalid", "empty_length", "op_cache_edge[R=1]"} <= set(names)
    assert {"full_table[parts=1]", "full_table[parts=4]", "full_table[parts=512]"} <= set(names)
    assert sum(n.startswith("unique[") for n in names) >= 30
    for parts in ("None", "1", "2", "8"):  # the default, one program a token, and tokens spread
        assert any(f"parts={parts}," in n for n in names), parts
    assert any("int64=True" in n for n in names) and any("R=2147483647" in n for n in names)
    assert lines[-1].startswith("0 failures")


@pytest.mark.parametrize("seed", range(6))
def test_reference_matches_the_oracle(seed):
    gen = torch.Generator().manual_seed(seed)
    t, k, r = 7, int(torch.randint(1, 90, (1,), generator=gen)), int(torch.randint(1, 200, (1,), generator=gen))
    rows = make_rows(seed, t, k, r, sort=False)
    length = torch.randint(0, k + 2, (t,), generator=gen, dtype=torch.int32) if seed % 2 else None
    want = oracle(rows, r, length)
    assert torch.equal(unique_rows_reference(rows, num_kv_rows=r, topk_length=length), want)
    assert torch.equal(unique_rows(rows, num_kv_rows=r, topk_length=length), want)


def test_empty_shapes():
    for shape in ((0, 5), (3, 0)):
        out = unique_rows(torch.zeros(shape, dtype=torch.int32), num_kv_rows=4)
        assert out.shape == shape and out.dtype == torch.int32


def test_bad_input_names_the_argument():
    rows = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(TypeError, match="rows"):
        unique_rows(rows.float(), num_kv_rows=4)
    with pytest.raises(ValueError, match="num_kv_rows"):
        unique_rows(rows, num_kv_rows=-1)
    with pytest.raises(ValueError, match="topk_length"):
        unique_rows(rows, num_kv_rows=4, topk_length=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="pdl"):
        unique_rows(rows, num_kv_rows=4, pdl=1)


def test_parts_spread_few_tokens_over_the_sms():
    assert [unique_rows_parts(t, 2048, 132) for t in (1, 8, 9, 33, 66, 67, 256)] == [16, 16, 8, 4, 2, 1, 1]
    assert [unique_rows_parts(1, k, 132) for k in (64, 128, 256, 512, 8192)] == [1, 1, 2, 4, 64]
    with pytest.raises(ValueError, match="parts"):
        launch_unique_rows(torch.zeros(1, 4, dtype=torch.int32), None, 3, torch.empty(1, 4), parts=3)


def test_decode_rows_names_the_bad_argument_before_routing():
    rows = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^rows"):
        decode_rows(rows[0], num_kv_rows=4)
    with pytest.raises(TypeError, match=r"^rows"):
        decode_rows(rows.tolist(), num_kv_rows=4)
    with pytest.raises(TypeError, match=r"^num_kv_rows"):
        decode_rows(rows, num_kv_rows="4")


def test_route_keeps_the_bitmap_union_and_hashes_where_it_would_sort():
    k = 2048
    assert route_row_dedup(k, 32 * SMEM_SCAN_RATIO * k, shared_memory=True) == "union"
    assert route_row_dedup(k, 32 * SMEM_SCAN_RATIO * k + 32, shared_memory=True) == "unique"
    assert route_row_dedup(k, 32 * BITMAP_SCAN_RATIO * k) == "union"
    assert route_row_dedup(k, 40_000_000) == "unique"
    assert route_row_dedup(MAX_UNIQUE_ENTRIES + 1, 40_000_000) == "union"  # past the kernel's row
    # the hash takes rows of up to 8,192 entries: the last one it takes is hashed
    assert MAX_UNIQUE_ENTRIES == 8192 and route_row_dedup(8192, 40_000_000) == "unique"
    # few tokens hash on any cache; from one more, the small cache's union again
    small = 32 * SMEM_SCAN_RATIO * k
    for tokens, route in ((1, "unique"), (DEDUP_HASH_MAX_TOKENS, "unique"), (DEDUP_HASH_MAX_TOKENS + 1, "union")):
        assert route_row_dedup(k, small, tokens=tokens, shared_memory=True) == route, tokens
    assert route_row_dedup(MAX_UNIQUE_ENTRIES + 1, 40_000_000, tokens=1) == "union"


@pytest.mark.parametrize("num_kv_rows", [50, 10_000_000])
@pytest.mark.parametrize("tokens", [6, 12])
def test_decode_rows_gives_each_tokens_unique_rows_on_either_route(num_kv_rows, tokens):
    rows = make_rows(4, tokens, 40, min(num_kv_rows, 50), sort=False)
    rows[0, 7] = num_kv_rows - 1  # a valid row only the large cache holds
    length = torch.tensor([40, 3, 0, 17, 40, 39] * (tokens // 6), dtype=torch.int32)
    got = decode_rows(rows, num_kv_rows=num_kv_rows, topk_length=length)
    union, union_lens = build_union(rows, group_size=1, num_kv_rows=num_kv_rows, topk_length=length)
    assert got.packed == (route_row_dedup(40, num_kv_rows, tokens=tokens) == "union")
    assert got.packed == (tokens > DEDUP_HASH_MAX_TOKENS and num_kv_rows == 50)
    for t, n in enumerate(union_lens.tolist()):
        if got.packed:  # the union itself: sorted, its count the kernels' topk_length
            assert torch.equal(got.topk_length, union_lens) and torch.equal(got.rows[t, :n], union[t, :n])
        else:  # each kept row where the caller listed it first, the caller's topk_length
            assert got.topk_length is length
            kept = got.rows[t][got.rows[t] >= 0]
            assert torch.equal(kept.sort().values, union[t, :n])
            first = [rows[t, :p].tolist().count(v) == 0 for p, v in enumerate(rows[t].tolist())]
            assert all(first[p] and rows[t, p] == v for p, v in enumerate(got.rows[t].tolist()) if v >= 0)


def _gpu_rows(tokens: int, topk: int, num_kv_rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows drawn from the cache with repeats near and far, ``-1`` and rows past the cache
    anywhere, and a ``topk_length`` (a zero, a short one) where there are tokens for it."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = torch.randint(0, num_kv_rows, (tokens, topk), device="cuda", generator=gen, dtype=torch.int32)
    pick = torch.randint(0, topk, (tokens, topk), device="cuda", generator=gen)
    repeat = torch.rand(tokens, topk, device="cuda", generator=gen) < 0.2
    rows = torch.where(repeat, rows.gather(1, pick), rows)  # a fifth repeat an entry before or after
    rows[torch.rand(rows.shape, device="cuda", generator=gen) < 0.03] = -1
    rows[:, -1] = num_kv_rows  # past the cache at the tail
    rows[:, topk // 3] = num_kv_rows + 7
    length = torch.full((tokens,), topk, dtype=torch.int32, device="cuda")
    if tokens > 2:
        length[0], length[1] = 0, topk // 5
    return rows, length


needs_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and triton_available()), reason="needs a CUDA GPU and Triton"
)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(("tokens", "topk"), [(1, 2048), (8, 2048), (70, 2048), (300, 512), (3, 100)])
def test_kernel_matches_the_reference_on_the_gpu_at_any_parts(tokens, topk):
    rows, length = _gpu_rows(tokens, topk, 40_000_000, seed=tokens + topk)
    want = unique_rows_reference(rows.cpu(), num_kv_rows=40_000_000, topk_length=length.cpu())
    assert torch.equal(unique_rows(rows, num_kv_rows=40_000_000, topk_length=length).cpu(), want)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for parts in {1, 2 * unique_rows_parts(tokens, topk, sms)}:
        out = torch.full_like(rows, -7)
        launch_unique_rows(rows, length, 40_000_000 - 1, out, parts=parts)
        assert torch.equal(out.cpu(), want), parts
    # launched as a programmatic dependent launch, as ahead of the decode kernels
    assert torch.equal(unique_rows(rows, num_kv_rows=40_000_000, topk_length=length, pdl=True).cpu(), want)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(
    ("backend", "heads", "tokens", "kv_fp8"),
    [("triton", 16, 4, False), ("gluon_small", 16, 4, False), ("gluon_small", 16, 4, True),
     ("gluon_stream", 16, 64, True), ("gluon", 64, 8, True), ("gluon", 128, 64, False)],
)  # fmt: skip
def test_decode_on_the_hash_route_counts_a_repeated_row_once(backend, heads, tokens, kv_fp8):
    """A cache past the bitmap union's ratio: the default call de-duplicates by the hash, whose
    rows (repeats ``-1`` in place) every kernel reads as it reads the caller's; the result is the
    reference's, which counts a row once, and differs from the same rows taken as unique."""
    from shardattn.ops.kv_fp8 import dequantize_kv, quantize_kv
    from shardattn.ops.sparse_mla import sparse_mla_reference
    from shardattn.ops.sparse_mla_decode import sparse_mla_decode
    from tests.test_sparse_mla_decode_gluon import _check, _sm90_gluon

    if backend != "triton" and not _sm90_gluon():
        pytest.skip("needs an sm_90 GPU and Triton's Gluon")
    topk, r = 512, 32 * SMEM_SCAN_RATIO * 512 + 64
    assert route_row_dedup(topk, r, shared_memory=True) == "unique"
    rows, length = _gpu_rows(tokens, topk, r, seed=heads + tokens)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    q = torch.randn(tokens, heads, 576, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(r, 576, device="cuda", generator=gen).bfloat16()
    if kv_fp8:
        kv = quantize_kv(kv.float())
    sinks = torch.randn(heads, device="cuda", generator=gen)
    got = sparse_mla_decode(q, kv, rows, scale=0.07, topk_length=length, sinks=sinks, backend=backend)
    rows_kv = dequantize_kv(kv) if kv_fp8 else kv
    ref = sparse_mla_reference(q, rows_kv, rows, scale=0.07, topk_length=length, sinks=sinks)
    _check(*got, *ref)
    twice = sparse_mla_decode(q, kv, rows, scale=0.07, topk_length=length, sinks=sinks, backend=backend,
                              rows_unique=True)[1]  # fmt: skip
    assert (twice - ref[1]).abs().max().item() > 1e-2  # repeats counted twice: the hash did drop them
