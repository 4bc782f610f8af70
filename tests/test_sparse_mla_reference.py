"""The sparse-MLA torch reference against the independent fp64 oracle (tests/oracle.py), and the
oracle itself against hand-derived cases."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardattn.ops.sparse_mla import sparse_mla_attention, sparse_mla_reference
from shardattn.ops.sparse_mla_decode import sparse_mla_decode
from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill
from tests.oracle import sparse_mla_oracle


def test_oracle_on_hand_derived_cases() -> None:
    # one key: out is its value, lse its logit; two equal logits: the mean of the values
    q = torch.tensor([[[1.0, 0.0, 2.0]]])
    kv = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.5], [7.0, 8.0, 9.0]])
    out, lse = sparse_mla_oracle(q, kv, torch.tensor([[1, -1, 9]]), scale=0.5, v_dim=2)
    assert out[0, 0].tolist() == [4.0, 5.0] and math.isclose(float(lse[0, 0]), 0.5 * 5.0)
    q2 = torch.tensor([[[1.0, 1.0, 0.0]]])
    kv2 = torch.tensor([[1.0, 0.0, 5.0], [0.0, 1.0, -5.0]])
    out, lse = sparse_mla_oracle(q2, kv2, torch.tensor([[0, 1, 0]]), scale=1.0, v_dim=2)  # 0 listed twice: once
    assert torch.allclose(out[0, 0], torch.tensor([0.5, 0.5], dtype=torch.float64))
    assert math.isclose(float(lse[0, 0]), 1.0 + math.log(2.0))
    # topk_length 1 keeps only the first entry; a sink adds exp(sink) to the denominator only
    out, lse = sparse_mla_oracle(
        q2, kv2, torch.tensor([[0, 1]]), scale=1.0, v_dim=2,
        topk_length=torch.tensor([1]), sinks=torch.tensor([1.0]),
    )  # fmt: skip
    assert torch.allclose(out[0, 0], torch.tensor([0.5, 0.0], dtype=torch.float64))
    assert math.isclose(float(lse[0, 0]), 1.0 + math.log(2.0))
    # no valid key: (0, -inf); with a sink: (0, sink)
    out, lse = sparse_mla_oracle(q2, kv2, torch.tensor([[-1, 2]]), scale=1.0, v_dim=2)
    assert out.abs().sum() == 0 and math.isinf(float(lse[0, 0])) and float(lse[0, 0]) < 0
    out, lse = sparse_mla_oracle(q2, kv2, torch.tensor([[-1, 2]]), scale=1.0, v_dim=2, sinks=torch.tensor([0.25]))
    assert out.abs().sum() == 0 and float(lse[0, 0]) == 0.25


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    t=st.integers(0, 6),
    h=st.integers(1, 4),
    d=st.integers(2, 12),
    r=st.integers(1, 20),
    k=st.integers(1, 12),
    dv_frac=st.floats(0.1, 1.0),
    invalid=st.floats(0.0, 0.8),
    dups=st.booleans(),
    with_len=st.booleans(),
    with_sinks=st.booleans(),
    empty_row=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_reference_matches_oracle(t, h, d, r, k, dv_frac, invalid, dups, with_len, with_sinks, empty_row, seed):
    """Random shapes; invalid entries (-1, negative, past the cache) anywhere; duplicates; empty rows."""
    g = torch.Generator().manual_seed(seed)
    dv = max(1, int(d * dv_frac))
    q, kv = torch.randn(t, h, d, generator=g), torch.randn(r, d, generator=g)
    rows = torch.randint(0, r, (t, k), generator=g, dtype=torch.int32)
    if dups and k > 1:
        rows[:, k // 2 :] = rows[:, : k - k // 2].clone()  # the second half repeats the first
    junk = torch.tensor([-1, -5, r, r + 3], dtype=torch.int32)[torch.randint(0, 4, (t, k), generator=g)]
    rows = torch.where(torch.rand(t, k, generator=g) < invalid, junk, rows)
    if empty_row and t:
        rows[t // 2] = junk[t // 2]
    length = torch.randint(0, k + 2, (t,), generator=g, dtype=torch.int32) if with_len else None
    sinks = torch.randn(h, generator=g) * 2 if with_sinks else None
    kw = dict(scale=0.7, v_dim=dv, topk_length=length, sinks=sinks)
    want_out, want_lse = sparse_mla_oracle(q, kv, rows, **kw)
    for compute in (torch.float32, torch.float64):
        x = torch.float64 if compute == torch.float64 else torch.float32
        out, lse = sparse_mla_reference(q.to(x), kv.to(x), rows, compute_dtype=compute, **kw)
        assert out.shape == (t, h, dv) and lse.shape == (t, h) and lse.dtype == torch.float32
        assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
        fin = torch.isfinite(want_lse)
        torch.testing.assert_close(lse[fin].double(), want_lse[fin], atol=1e-5, rtol=0)
        torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=0)


@pytest.mark.parametrize("entry", ["attention", "grouped", "decode"])
def test_split_q_latent_and_rope_equals_whole_q(entry: str) -> None:
    """Every public entry accepts ``(q_latent, q_rope)``: the same attention as the joined ``q``."""
    fn = {"attention": sparse_mla_attention, "grouped": sparse_mla_grouped_prefill, "decode": sparse_mla_decode}[entry]
    g = torch.Generator().manual_seed(4)
    q, kv = torch.randn(5, 3, 24, generator=g), torch.randn(11, 24, generator=g)
    rows = torch.randint(-1, 13, (5, 6), generator=g, dtype=torch.int32)
    want_out, want_lse = sparse_mla_oracle(q, kv, rows, scale=0.4, v_dim=16)
    out, lse = fn((q[..., :16], q[..., 16:]), kv, rows, scale=0.4, v_dim=16)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=0)
    fin = torch.isfinite(want_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    torch.testing.assert_close(lse[fin].double(), want_lse[fin], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kv_fp8", [False, True])
@pytest.mark.parametrize("entry", ["attention", "grouped", "decode"])
def test_an_empty_topk_gives_every_row_its_sink(entry: str, kv_fp8: bool) -> None:
    """``rows [T, 0]``: no token has a key, on every entry and format: ``(0, sink)`` per head, as the
    oracle gives, and ``(0, -inf)`` without sinks."""
    from shardattn.ops.kv_fp8 import quantize_kv

    fn = {"attention": sparse_mla_attention, "grouped": sparse_mla_grouped_prefill, "decode": sparse_mla_decode}[entry]
    g = torch.Generator().manual_seed(9)
    d, dv = (576, 512) if kv_fp8 else (24, 16)
    q, kv = torch.randn(3, 2, d, generator=g), torch.randn(7, d, generator=g)
    kv = quantize_kv(kv) if kv_fp8 else kv
    rows, sinks = torch.zeros(3, 0, dtype=torch.int32), torch.tensor([0.25, -1.5])
    want_out, want_lse = sparse_mla_oracle(q, kv if not kv_fp8 else torch.zeros(7, d), rows, scale=0.3, v_dim=dv,
                                           sinks=sinks)  # fmt: skip
    out, lse = fn(q, kv, rows, scale=0.3, v_dim=dv, sinks=sinks)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(want_out, torch.zeros_like(want_out))
    assert torch.equal(lse, sinks.expand(3, 2)) and torch.allclose(want_lse.float(), lse)
    out, lse = fn(q, kv, rows, scale=0.3, v_dim=dv)
    assert torch.equal(out, torch.zeros_like(out)) and bool(lse.isneginf().all())


@pytest.mark.parametrize("entry", ["sparse_mla_attention", "sparse_mla_decode"])
def test_cache_past_int32_rows_keeps_its_rows_valid(entry: str) -> None:
    """Regression: a cache of ``2**32 + 5`` rows (an expanded view: no memory) was compared with
    int32 rows as ``2**32 + 5`` wrapped to 5, so rows 5 and up were dropped as out of range."""
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(1, 16, generator=g).expand(2**32 + 5, 16)  # every row the same values
    q = torch.randn(2, 2, 16, generator=g)
    rows = torch.tensor([[7, 2**31 - 2], [3, -1]], dtype=torch.int32)  # two keys; one key
    fn = {"sparse_mla_attention": sparse_mla_attention, "sparse_mla_decode": sparse_mla_decode}[entry]
    out, lse = fn(q, kv, rows, scale=0.5, v_dim=8)
    logit = 0.5 * (q.double() @ kv[0].double())  # [T, H]: the same for every row
    want_lse = logit + torch.tensor([[math.log(2.0)], [0.0]], dtype=torch.float64)
    assert torch.isfinite(lse).all(), lse
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), kv[0, :8].double().expand(2, 2, 8), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("entry", ["reference", "attention", "decode"])
def test_short_lists_count_a_repeated_row_once(entry: str, k: int) -> None:
    """Top-k lists of 1 to 3 entries from a 3-row cache: a row listed twice (``[a, a]``, a
    duplicate behind an invalid entry, one past ``topk_length``) is one key, as in longer lists;
    invalid entries anywhere, rows with no valid key, sinks. Regression guard: a de-duplication
    skipped below some list length would count the repeat twice only for short lists."""
    g = torch.Generator().manual_seed(30 + k)
    t, h, d, dv, r = 12, 2, 8, 5, 3
    q, kv = torch.randn(t, h, d, generator=g, dtype=torch.float64), torch.randn(r, d, generator=g, dtype=torch.float64)
    rows = torch.randint(-1, r + 1, (t, k), generator=g, dtype=torch.int32)  # -1 and r: invalid
    rows[0] = 1  # the same row in every entry
    rows[1] = -1  # no valid key
    if k > 1:
        rows[2, -2:] = torch.tensor([2, 2])
        rows[3, -2:] = torch.tensor([0, -1])
    if k > 2:
        rows[4] = torch.tensor([0, -1, 0])  # a repeat behind an invalid entry
    length = torch.randint(0, k + 2, (t,), generator=g, dtype=torch.int32)
    length[0] = k
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float32)
    for kw in (dict(topk_length=None, sinks=None), dict(topk_length=length, sinks=sinks)):
        want_out, want_lse = sparse_mla_oracle(q, kv, rows, scale=0.6, v_dim=dv, **kw)
        if entry == "reference":
            out, lse = sparse_mla_reference(q, kv, rows, scale=0.6, v_dim=dv, compute_dtype=torch.float64, **kw)
        else:
            fn = sparse_mla_attention if entry == "attention" else sparse_mla_decode
            out, lse = fn(q.float(), kv.float(), rows, scale=0.6, v_dim=dv, **kw)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
        fin = torch.isfinite(want_lse)
        torch.testing.assert_close(lse[fin].double(), want_lse[fin], atol=1e-5, rtol=0)
        torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=0)
