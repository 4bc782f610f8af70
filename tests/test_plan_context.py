"""DCP layout: owner / local index bijection, local lengths, speculative-decode lengths, top-k translation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardattn.plan import (
    DCPLayout,
    causal_token_seq_lens,
    dcp_causal_local_lens,
    dcp_global_index,
    dcp_local_index,
    dcp_local_seq_lens,
    dcp_owner,
    dcp_translate_topk,
)

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True)
layouts = st.tuples(st.integers(1, 8), st.integers(1, 8))


@SETTINGS
@given(layouts, st.integers(0, 200))
def test_local_global_bijection(layout, seq_len):
    n, i = layout
    lay = DCPLayout(n, i)
    t = torch.arange(seq_len)
    owner, local = lay.owner(t), lay.local_index(t)
    seen = []
    for r in range(n):
        mine = t[owner == r]
        # local indices of a rank are exactly 0..local_len-1, in global order
        assert local[owner == r].tolist() == list(range(mine.numel()))
        assert lay.local_len(seq_len, r) == mine.numel()
        assert torch.equal(lay.global_index(local[owner == r], r), mine)
        assert torch.equal(lay.owned_positions(seq_len, r), mine)
        seen += mine.tolist()
    assert sorted(seen) == list(range(seq_len))
    assert lay.max_local_len(seq_len) == max(lay.local_len(seq_len, r) for r in range(n))


@SETTINGS
@given(layouts, st.lists(st.integers(-3, 300), min_size=0, max_size=8))
def test_local_seq_lens_count_owned_tokens(layout, lens):
    n, i = layout
    seq = torch.tensor(lens, dtype=torch.int32)
    for r in range(n):
        got = dcp_local_seq_lens(seq, r, n, i)
        assert got.dtype == torch.int32
        want = [int((dcp_owner(torch.arange(max(L, 0)), n, i) == r).sum()) for L in lens]
        assert got.tolist() == want


def _ragged(draw_lens: list[int], ctx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    indptr = torch.tensor([0, *torch.tensor(draw_lens).cumsum(0).tolist()] if draw_lens else [0])
    seq = torch.tensor([c + q for c, q in zip(ctx, draw_lens)], dtype=torch.int64)
    return seq, indptr


@SETTINGS
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 40)), min_size=1, max_size=6),
    st.integers(0, 3),
    layouts,
    st.booleans(),
)
def test_spec_decode_lengths_match_loop(reqs, extra_pad, layout, causal):
    q_lens = [q for q, _ in reqs]
    seq, indptr = _ragged(q_lens, [c for _, c in reqs])
    t = sum(q_lens) + extra_pad  # padded tokens of a graph batch see nothing
    got = causal_token_seq_lens(seq, indptr, t, causal=causal)
    want = []
    for (q, _), L in zip(reqs, seq.tolist()):
        want += [L - q + j + 1 if causal else L for j in range(q)]
    want += [0] * extra_pad
    assert got.tolist() == want
    n, i = layout
    for r in range(n):
        loc = dcp_causal_local_lens(seq.to(torch.int32), indptr.to(torch.int32), t, r, n, i, causal=causal)
        assert loc.dtype == torch.int32
        assert loc.tolist() == [DCPLayout(n, i).local_len(v, r) for v in want]


def test_spec_decode_example_query_j_sees_prefix_plus_j():
    # seq_len 10, 3 queries: query j sees tokens < 10 - 3 + j + 1
    got = causal_token_seq_lens(torch.tensor([10]), torch.tensor([0, 3]), 3)
    assert got.tolist() == [8, 9, 10]


@SETTINGS
@given(layouts, st.integers(1, 6), st.integers(1, 10), st.integers(0, 10**6), st.booleans())
def test_translate_topk_matches_loop(layout, t, k, seed, use_int32):
    n, i = layout
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, 60, (t,), generator=g)
    pos = torch.randint(-5, 70, (t, k), generator=g)  # invalid entries anywhere in a row
    tl = torch.randint(0, k + 1, (t,), generator=g)
    dtype = torch.int32 if use_int32 else torch.int64
    pos, seq, tl = pos.to(dtype), seq.to(dtype), tl.to(dtype)
    for r in range(n):
        got = dcp_translate_topk(pos, r, n, i, seq_lens=seq, topk_length=tl)
        assert got.dtype == dtype
        want = torch.full((t, k), -1, dtype=torch.int64)
        bare = dcp_translate_topk(pos, r, n, i)
        for a in range(t):
            for b in range(k):
                p = int(pos[a, b])
                owned = p >= 0 and (p // i) % n == r
                assert int(bare[a, b]) == ((p // (n * i)) * i + p % i if owned else -1)
                if owned and p < int(seq[a]) and b < int(tl[a]):
                    want[a, b] = (p // (n * i)) * i + p % i
        assert torch.equal(got.to(torch.int64), want)
        # translation agrees with the layout's local index where owned
        lay = DCPLayout(n, i)
        assert torch.equal(lay.translate_topk(pos, r, seq_lens=seq, topk_length=tl), got)


def test_translate_topk_compares_int64_lengths_without_wrapping():
    """int32 positions against int64 lengths past int32: compared in int64 (a length of 2**32 + 2
    cast to int32 is 2, which dropped every position from 2 up)."""
    pos = torch.tensor([[0, 1, 2, 3, -1]], dtype=torch.int32)
    for seq in (2**32 + 2, 2**31):
        got = dcp_translate_topk(pos, 0, 1, 1, seq_lens=torch.tensor([seq]))
        assert got.tolist() == [[0, 1, 2, 3, -1]], seq


def test_functions_never_need_data_on_meta_device():
    # meta tensors carry no data: a function that ran here cannot have synchronised on values
    m = torch.device("meta")
    seq = torch.empty(4, dtype=torch.int32, device=m)
    indptr = torch.empty(5, dtype=torch.int32, device=m)
    assert dcp_local_seq_lens(seq, 1, 4, 2).shape == (4,)
    assert dcp_causal_local_lens(seq, indptr, 9, 1, 4, 2).shape == (9,)
    pos = torch.empty(9, 16, dtype=torch.int32, device=m)
    out = dcp_translate_topk(pos, 1, 4, 2, seq_lens=torch.empty(9, dtype=torch.int32, device=m))
    assert out.shape == (9, 16) and out.device == m
    assert dcp_global_index(dcp_local_index(pos, 4, 2), 1, 4, 2).shape == (9, 16)


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: DCPLayout(0, 1), ValueError, "world_size must be >= 1"),
        (lambda: DCPLayout(2, 1.5), TypeError, "interleave must be an int"),
        (lambda: DCPLayout(2, 0), ValueError, "interleave must be >= 1"),
        (lambda: dcp_owner(torch.arange(4), 2, 0), ValueError, "interleave must be >= 1"),
        (lambda: dcp_owner(torch.arange(4.0), 2), TypeError, "positions must have dtype"),
        (lambda: dcp_local_seq_lens(torch.tensor([3]), 2, 2), ValueError, "rank must be < world_size=2"),
        (lambda: dcp_global_index(torch.arange(3), -1, 2), ValueError, "rank must be >= 0"),
        (lambda: dcp_translate_topk(torch.zeros(3, dtype=torch.int32), 0, 2), ValueError, "2 dimensions"),
        (
            lambda: dcp_translate_topk(torch.zeros(3, 2, dtype=torch.int32), 0, 2, seq_lens=torch.zeros(2)),
            TypeError,
            "seq_lens must have dtype",
        ),
        (
            lambda: causal_token_seq_lens(torch.tensor([3, 4]), torch.tensor([0, 1]), 1),
            ValueError,
            r"qo_indptr must have shape \[3\]",
        ),
        (
            lambda: causal_token_seq_lens(torch.tensor([3]), torch.tensor([0, 1]), -1),
            ValueError,
            "num_tokens must be >= 0",
        ),
        (lambda: DCPLayout(2).local_len(-1, 0), ValueError, "seq_len must be >= 0"),
    ],
    ids=[
        "world-size-0",
        "interleave-float",
        "interleave-0",
        "fn-interleave-0",
        "float-positions",
        "rank-too-big",
        "rank-negative",
        "topk-1d",
        "seq-lens-float",
        "indptr-shape",
        "num-tokens-negative",
        "seq-len-negative",
    ],
)
def test_bad_arguments_raise(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
