"""Grouped prefill on a cache of more than ``2**24 - 1`` rows on an sm_90 GPU (``gpu``): the call
gathers the blocks its rows touch (:mod:`shardattn.ops.kv_compact`) and runs grouped; its output
is bit for bit the routed call's on a small cache holding the same blocks, and the fp32 reference's
within bf16 rounding; in CUDA-graph capture it runs per query. The map itself, on the CPU against
the fp64 oracle: tests/test_kv_compact.py.
"""

from __future__ import annotations

import pytest
import torch

from shardattn.kernels.union_layout import MAX_PACKED_ROWS
from shardattn.ops import sparse_mla_grouped
from shardattn.ops.kv_compact import COMPACT_BLOCK_ROWS
from shardattn.ops.kv_fp8 import quantize_kv
from shardattn.ops.sparse_mla import sparse_mla_reference
from tests.test_sparse_mla_fp8_gpu import needs_sm90

pytestmark = pytest.mark.gpu


def _large_case(fmt: str, heads: int, seed: int = 0):
    """A cache of ``2**24 + 100`` rows (last block partial), zero except 24 blocks spread over it
    (the last among them), and the same 24 blocks as a small cache; rows into those blocks with
    invalid entries anywhere, an out-of-range row, a duplicate and a token with no valid key."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    num_rows = (1 << 24) + 100
    last = (num_rows - 1) // COMPACT_BLOCK_ROWS
    blocks = torch.cat([torch.randperm(last, device=dev, generator=g)[:23], torch.tensor([last], device=dev)]).sort()
    blocks = blocks.values
    small_rows_of = torch.arange(24 * COMPACT_BLOCK_ROWS, device=dev)
    big_rows_of = (blocks[:, None] * COMPACT_BLOCK_ROWS + torch.arange(COMPACT_BLOCK_ROWS, device=dev)).flatten()
    values = torch.randn(24 * COMPACT_BLOCK_ROWS, 576, device=dev, generator=g)
    small = quantize_kv(values) if fmt == "fp8_ds_mla" else values.bfloat16()
    big = torch.zeros(num_rows, small.shape[1], dtype=small.dtype, device=dev)
    inside = big_rows_of < num_rows
    big[big_rows_of[inside]] = small[inside]
    tokens, k = 64, 256
    pick = torch.randint(0, int(inside.sum()), (tokens, k), device=dev, generator=g)
    small_rows, big_rows = small_rows_of[pick].int(), big_rows_of[pick].int()
    for r in (small_rows, big_rows):
        r[torch.rand(r.shape, device=dev, generator=torch.Generator(device=dev).manual_seed(1)) < 0.05] = -1
        r[0, -1] = r[0, 0]
        r[5] = -1
    big_rows[1, 3], small_rows[1, 3] = num_rows + 5, -1  # out of range: invalid on either cache
    q = (torch.randn(tokens, heads, 576, device=dev, generator=g) * 0.3).bfloat16()
    return q, big, big_rows, small, small_rows


@needs_sm90
@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "bf16"])
@pytest.mark.parametrize(("heads", "workspace"), [(8, False), (16, True)])
def test_grouped_prefill_past_packed_rows_runs_grouped(fmt, heads, workspace, monkeypatch):
    """``workspace``: a union workspace sized for the per-query union, used as the grouped buffers."""
    q, big, big_rows, small, small_rows = _large_case(fmt, heads)
    t, k = big_rows.shape
    union = (torch.empty(t, k, dtype=torch.int32, device=q.device), torch.empty(t, dtype=torch.int32, device=q.device))
    assert big.shape[0] > MAX_PACKED_ROWS
    compacted = []
    compact = sparse_mla_grouped.compact_rows
    monkeypatch.setattr(sparse_mla_grouped, "compact_rows", lambda *a, **k: compacted.append(1) or compact(*a, **k))
    got = sparse_mla_grouped.sparse_mla_grouped_prefill(
        q, big, big_rows, scale=0.05, union=union if workspace else None
    )
    assert compacted  # gathered, so the route's G > 1 could run
    want = sparse_mla_grouped.sparse_mla_grouped_prefill(q, small, small_rows, scale=0.05)
    assert len(compacted) == 1  # the small cache needs no gathering
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    ref = sparse_mla_reference(q.float(), big, big_rows, scale=0.05)
    assert (got[0].float() - ref[0].float()).abs().max() < 2e-2
    assert torch.equal(torch.isinf(got[1]), torch.isinf(ref[1])) and bool(torch.isinf(got[1][5]).all())


@needs_sm90
def test_grouped_prefill_past_packed_rows_in_capture_runs_per_query():
    q, big, big_rows, _, _ = _large_case("fp8_ds_mla", 8)
    out = torch.empty(q.shape[0], q.shape[1], 512, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:2], device=q.device)
    eager = sparse_mla_grouped.sparse_mla_grouped_prefill(q, big, big_rows, scale=0.05, group_size=1)
    sparse_mla_grouped.sparse_mla_grouped_prefill(q, big, big_rows, scale=0.05, out=out, lse_out=lse)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sparse_mla_grouped.sparse_mla_grouped_prefill(q, big, big_rows, scale=0.05, out=out, lse_out=lse)
    out.zero_()
    graph.replay()
    assert torch.equal(out, eager[0]) and torch.equal(lse, eager[1])
