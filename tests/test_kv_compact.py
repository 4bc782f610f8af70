"""The compact cache of a grouped prefill over a cache too large for packed union entries
(:mod:`shardattn.ops.kv_compact`): the fp64 oracle over the compact cache and mapped rows equals
the oracle over the original ones (invalid entries anywhere, out-of-range rows, ``topk_length``,
duplicates, rows with no valid key, a cache whose last block is partial, ``fp8_ds_mla`` bytes), the
map keeps each token's row order, and blocks past ``max_rows`` give ``None``. The call on a cache of
more than ``2**24 - 1`` rows: tests/test_sparse_mla_fp8_gpu.py (sm_90).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardattn.ops.kv_compact import COMPACT_BLOCK_ROWS, compact_rows
from shardattn.ops.kv_fp8 import dequantize_kv, quantize_kv
from tests.oracle import sparse_mla_oracle


def _case(seed: int, t: int, k: int, r: int, with_len: bool):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(-3, r + 3, (t, k), generator=g, dtype=torch.int32)
    rows[0, -1] = rows[0, 0]  # a row listed twice
    if t > 1:
        rows[-1] = -1  # a token with no valid key
    lens = torch.randint(0, k + 1, (t,), generator=g, dtype=torch.int32) if with_len else None
    return rows, lens, g


@settings(max_examples=25, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), t=st.integers(1, 5), k=st.integers(1, 9), r=st.integers(1, 400),
       with_len=st.booleans())  # fmt: skip
def test_attention_over_the_compact_cache_is_the_attention_over_the_cache(seed, t, k, r, with_len):
    rows, lens, g = _case(seed, t, k, r, with_len)
    kv = torch.randn(r, 40, generator=g, dtype=torch.float64)
    q = torch.randn(t, 3, 40, generator=g, dtype=torch.float64)
    compact = compact_rows(kv, rows, lens, max_rows=1 << 24)
    assert compact is not None
    small_kv, small_rows = compact
    assert small_kv.shape[0] % COMPACT_BLOCK_ROWS == 0 and small_rows.dtype == torch.int32
    want = sparse_mla_oracle(q, kv, rows, scale=0.3, v_dim=32, topk_length=lens)
    got = sparse_mla_oracle(q, small_kv, small_rows, scale=0.3, v_dim=32, topk_length=lens)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # every valid row lands on a copy of itself; invalid entries become -1
    valid = (rows >= 0) & (rows < r)
    if lens is not None:
        valid &= torch.arange(k)[None, :] < lens[:, None]
    assert torch.equal(small_rows < 0, ~valid)
    assert torch.equal(small_kv[small_rows[valid].long()], kv[rows[valid].long()])


@settings(max_examples=15, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), r=st.integers(64, 3000))
def test_the_map_keeps_each_tokens_row_order(seed, r):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, r, (4, 30), generator=g, dtype=torch.int32).sort(dim=1).values
    small_rows = compact_rows(torch.zeros(r, 2), rows, None, max_rows=1 << 24)[1]
    assert bool((small_rows[:, 1:] >= small_rows[:, :-1]).all())  # ascending stays ascending
    assert torch.equal(small_rows[:, 1:] == small_rows[:, :-1], rows[:, 1:] == rows[:, :-1])


def test_fp8_rows_are_gathered_as_bytes():
    g = torch.Generator().manual_seed(3)
    kv8 = quantize_kv(torch.randn(300, 576, generator=g))
    rows = torch.tensor([[299, 0, 150, -1], [151, 299, 400, 2]], dtype=torch.int32)
    small_kv, small_rows = compact_rows(kv8, rows, None, max_rows=1 << 24)
    assert small_kv.dtype == torch.uint8 and small_kv.shape == (3 * COMPACT_BLOCK_ROWS, kv8.shape[1])
    q = torch.randn(2, 2, 576, generator=g, dtype=torch.float64)
    want = sparse_mla_oracle(q, dequantize_kv(kv8, torch.float32).double(), rows, scale=0.05, v_dim=512)
    got = sparse_mla_oracle(q, dequantize_kv(small_kv, torch.float32).double(), small_rows, scale=0.05, v_dim=512)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize(("max_rows", "fits"), [(3 * COMPACT_BLOCK_ROWS, True), (3 * COMPACT_BLOCK_ROWS - 1, False)])
def test_blocks_past_max_rows_give_none(max_rows, fits):
    rows = torch.tensor([[0, 64, 128, 129]], dtype=torch.int32)  # three blocks
    assert (compact_rows(torch.zeros(200, 4), rows, None, max_rows=max_rows) is not None) == fits


def test_no_valid_row_gives_an_empty_cache():
    small_kv, small_rows = compact_rows(torch.zeros(100, 4), torch.tensor([[-1, 100]], dtype=torch.int32), None,
                                       max_rows=64)  # fmt: skip
    assert small_kv.shape == (0, 4) and small_rows.tolist() == [[-1, -1]]
