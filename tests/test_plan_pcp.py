"""PCP plan: the simulated all-gather restores token order, each rank's needs cover its causal reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardattn.plan import pcp_plan, zigzag_split

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True)
steps = st.tuples(
    st.lists(st.integers(0, 200), min_size=0, max_size=5),
    st.integers(1, 6),
    st.integers(1, 4),
    st.integers(0, 10**6),
)


@SETTINGS
@given(steps)
def test_all_gather_layout_and_needs(step):
    lens, w, align, seed = step
    prefix = np.random.default_rng(seed).integers(0, 50, size=len(lens)).tolist()
    plan = pcp_plan(lens, w, prefix_lens=prefix, align=align)
    shard = plan.shard
    assert shard.sharded  # PCP is never gated by min_tokens
    ref = zigzag_split(lens, w, align=align, min_tokens=0, prefix_lens=prefix)
    assert shard.fingerprint() == ref.fingerprint()
    t, p = shard.num_tokens, shard.padded_count
    kv = torch.arange(t) * 10 + 1  # the "KV row" each token's owner computes
    # simulate the all-gather: every rank sends its tokens padded to P rows
    sends = []
    for r in range(w):
        buf = torch.zeros(p, dtype=torch.int64)
        ids = shard.token_ids(r)
        buf[: ids.numel()] = kv[ids]
        sends.append(buf)
    gathered = torch.cat(sends) if sends else torch.zeros(0, dtype=torch.int64)
    assert gathered.numel() == plan.gathered_rows
    assert torch.equal(gathered[plan.kv_row], kv)
    offs = shard.token_offsets.tolist()
    for r in range(w):
        ids = shard.token_ids(r).tolist()
        need = plan.need_stop[r].tolist()
        # brute force: a rank needs new tokens up to its last own token of each request
        want = [0] * len(lens)
        for g in ids:
            req = int(shard.token_request[g])
            want[req] = max(want[req], g - offs[req] + 1)
        assert need == want
        # every causal read of every own token is covered
        for g in ids:
            req = int(shard.token_request[g])
            assert g - offs[req] < need[req]
        idx, ptr = plan.kv_index(r), plan.kv_indptr(r)
        assert ptr.tolist() == [0, *np.cumsum(want).tolist()]
        for i in range(len(lens)):
            rows = idx[ptr[i] : ptr[i + 1]]
            assert torch.equal(gathered[rows], kv[offs[i] : offs[i] + want[i]])
        assert plan.needed_ranges(r) == [(i, prefix[i], prefix[i] + n) for i, n in enumerate(want) if n]
    assert plan.needed_kv_tokens.tolist() == plan.need_stop.sum(1).tolist()


def test_gathered_rows_for_sparse_positions():
    plan = pcp_plan([6, 4], 2, prefix_lens=[3, 0])
    req = torch.tensor([0, 0, 1])
    pos = torch.tensor([[0, 2, 3, 8, 9, -1], [5, 4, 7, 3, 100, 2], [0, 1, 3, 4, -7, 2]], dtype=torch.int32)
    got = plan.gathered_rows_for(pos, req)
    kv_row = plan.kv_row.tolist()
    want = []
    prefix, lens, offs = [3, 0], [6, 4], [0, 6]
    for a in range(3):
        i = int(req[a])
        row = []
        for v in pos[a].tolist():
            o = v - prefix[i]
            row.append(kv_row[offs[i] + o] if 0 <= o < lens[i] else -1)
        want.append(row)
    assert got.tolist() == want
    assert got[0, :3].tolist() == [-1, -1, kv_row[0]]  # prefix positions come from the cache


def test_example_rank0_needs_whole_request():
    plan = pcp_plan([8], 2)
    assert plan.kv_row.tolist() == [0, 1, 4, 5, 6, 7, 2, 3]
    assert plan.need_stop.tolist() == [[8], [6]]
    assert plan.fingerprint() == pcp_plan([8], 2).fingerprint()
    assert plan.fingerprint() != pcp_plan([8], 2, prefix_lens=[1]).fingerprint()


def test_empty_step_and_rank_without_tokens():
    plan = pcp_plan([2], 3)
    assert plan.shard.counts.tolist() == [1, 1, 0]
    assert plan.kv_index(2).numel() == 0 and plan.needed_ranges(2) == []
    empty = pcp_plan([], 2)
    assert empty.gathered_rows == 0 and empty.kv_index(0).numel() == 0


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(query_lens=[4], world_size=0), ValueError, "world_size must be >= 1"),
        (dict(query_lens=[-4], world_size=2), ValueError, r"query_lens\[0\] must be >= 0"),
        (dict(query_lens=[4], world_size=2, align=0), ValueError, "align must be >= 1"),
    ],
    ids=["world-size-0", "negative-length", "align-0"],
)
def test_bad_arguments_raise(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        pcp_plan(**kwargs)


@pytest.mark.parametrize("req", [-1, 2])
def test_gathered_rows_for_refuses_a_request_outside_the_step(req):
    # request -1 read the last request's offsets (wrong rows, no error); 2 of 2 an IndexError
    plan = pcp_plan([4, 4], 2, prefix_lens=[2, 0])
    with pytest.raises(ValueError, match=r"request_ids must be in \[0, 2\)"):
        plan.gathered_rows_for(torch.tensor([[2, 3]]), torch.tensor([req]))
