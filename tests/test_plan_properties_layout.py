"""Property tests of the token and KV layouts: zigzag / cost-balanced splits, PCP, DCP.

Every token of a step is owned by exactly one rank and the index maps invert each other (ragged
requests, empty ones, fewer tokens than ranks, alignments that do not divide, cached prefixes up
to the int32 limit); every DCP position is owned once and its local index maps back; a layout
whose arithmetic would leave int32 is refused with a ``ValueError`` naming the argument.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardattn.plan._common import MAX_TOKENS
from shardattn.plan.context import DCPLayout, dcp_local_seq_lens, dcp_translate_topk
from shardattn.plan.pcp import pcp_plan
from shardattn.plan.zigzag import cost_balanced_split, zigzag_split

lengths = st.lists(st.one_of(st.integers(0, 3), st.integers(0, 60)), min_size=0, max_size=6)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    lens=lengths, w=st.integers(1, 8), align=st.sampled_from([1, 2, 3, 4, 5, 8]), topk=st.integers(1, 64),
    near_limit=st.booleans(), split=st.sampled_from([zigzag_split, cost_balanced_split]),
)  # fmt: skip
def test_every_token_is_owned_once_and_the_maps_invert(lens, w, align, topk, near_limit, split) -> None:
    prefix = [MAX_TOKENS - n if near_limit else 3 * i for i, n in enumerate(lens)]
    plan = split(lens, w, align=align, min_tokens=0, prefix_lens=prefix, topk=topk)
    t = sum(lens)
    owned = np.concatenate([plan.token_ids(r).numpy() for r in range(w)])
    assert sorted(owned.tolist()) == list(range(t))
    assert plan.counts.tolist() == [plan.token_ids(r).numel() for r in range(w)]
    gather, restore = plan.gather_index.numpy(), plan.restore_index.numpy()
    assert (gather[restore] == np.arange(t)).all() and (restore[gather] == np.arange(t)).all()
    padded = plan.padded_gather_index.numpy()
    assert (padded[plan.padded_restore_index.numpy()] == np.arange(t)).all() and int((padded >= 0).sum()) == t
    expected = [p + i for n, p in zip(lens, prefix) for i in range(n)]
    assert plan.token_position.tolist() == expected  # positions past int32 are refused, never wrapped
    if split is zigzag_split:
        assert max(plan.counts.tolist()) <= -(-t // w) + (2 * align - 1 if align > 1 else 0)
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        for i, row in enumerate(plan.chunk_bounds.tolist()):  # boundaries keep align-groups whole
            assert all(b % align == 0 or b == lens[i] for b in row) and row[0] == 0 and row[-1] == lens[i]
            assert offsets[i + 1] - offsets[i] == lens[i]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(lens=lengths, w=st.integers(1, 8), align=st.sampled_from([1, 2, 4]))
def test_pcp_gathers_every_new_row_once(lens, w, align) -> None:
    plan = pcp_plan(lens, w, align=align)
    t = sum(lens)
    rows = plan.kv_row.tolist()
    assert len(set(rows)) == t and all(0 <= r < plan.gathered_rows for r in rows)
    for r in range(w):  # a rank needs every new row up to its last token of each request
        for i, start, stop in plan.needed_ranges(r):
            assert 0 < stop - start <= lens[i]


def test_positions_past_int32_are_refused_naming_the_argument() -> None:
    with pytest.raises(ValueError, match=r"prefix_lens \+ query_lens\[0\]"):
        zigzag_split([2], 2, min_tokens=0, prefix_lens=[MAX_TOKENS - 1])
    with pytest.raises(ValueError, match="world_size"):
        zigzag_split([2], 0)
    with pytest.raises(ValueError, match="align"):
        pcp_plan([2], 2, align=0)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    w=st.integers(1, 8), interleave=st.one_of(st.integers(1, 9), st.integers(1, MAX_TOKENS)),
    seq_len=st.integers(0, 200), dtype=st.sampled_from([torch.int32, torch.int64]), data=st.data(),
)  # fmt: skip
def test_dcp_positions_are_owned_once_and_local_indices_invert(w, interleave, seq_len, dtype, data) -> None:
    if w * interleave > MAX_TOKENS:
        with pytest.raises(ValueError, match="interleave"):
            DCPLayout(w, interleave)
        return
    lay = DCPLayout(w, interleave)
    high = data.draw(st.integers(seq_len, MAX_TOKENS))  # the last positions an int32 cache can hold
    pos = torch.tensor(sorted({*range(seq_len), *range(max(0, high - 8), high)}), dtype=dtype)
    owner, local = lay.owner(pos), lay.local_index(pos)
    assert bool((owner >= 0).all() and (owner < w).all() and (local >= 0).all() and (local <= pos).all())
    for r in range(w):
        mine = owner == r
        assert torch.equal(lay.global_index(local[mine], r), pos[mine])
        assert lay.local_len(seq_len, r) == int(((pos < seq_len) & mine).sum())
        length = torch.tensor([seq_len, high], dtype=dtype)
        assert dcp_local_seq_lens(length, r, w, interleave).tolist() == [
            lay.local_len(seq_len, r), lay.local_len(high, r)
        ]  # fmt: skip
        translated = dcp_translate_topk(pos[None], r, w, interleave)[0]
        assert torch.equal(translated, torch.where(mine, local, torch.full_like(local, -1)))
    assert sum(lay.local_len(seq_len, r) for r in range(w)) == seq_len


@pytest.mark.parametrize(("w", "interleave"), [(8, MAX_TOKENS), (3, 2**30), (2, 2**30)])
def test_a_dcp_round_past_int32_is_refused(w: int, interleave: int) -> None:
    """On int32 positions the layout's ``N * I`` arithmetic would wrap (a local index of position 5
    came out as -2147483642, and rank 2 of 3 held -2**30 of 2**31 - 1 tokens)."""
    with pytest.raises(ValueError, match="interleave must be <="):
        DCPLayout(w, interleave)
    with pytest.raises(ValueError, match="interleave"):
        dcp_local_seq_lens(torch.tensor([MAX_TOKENS], dtype=torch.int32), w - 1, w, interleave)
