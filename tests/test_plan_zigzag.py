"""Zigzag and cost-balanced token splits: invariants, an exhaustive-search oracle of the documented
rule, the gate, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardattn.plan import (
    ShardPlan,
    balance_report,
    cost_balanced_split,
    token_cost,
    zigzag_chunk_bounds,
    zigzag_split,
)

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True)


def _extra_assignments(w: int, rem: int):
    """Every way to give ``rem`` extra units to ``w`` ranks, at most 2 (one per chunk) each."""
    if w == 0:
        if rem == 0:
            yield ()
        return
    for e in range(min(2, rem) + 1):
        for rest in _extra_assignments(w - 1, rem - e):
            yield (e, *rest)


def _bounds(sizes: list[int], n: int, align: int) -> list[int]:
    """Chunk boundaries of ``sizes`` units per chunk (the request's last unit may be short)."""
    bounds = [0]
    for size in sizes:
        bounds.append(min(bounds[-1] + size * align, n))
    return bounds


def _zigzag_oracle(lens: list[int], w: int, align: int) -> list[list[int]]:
    """Token ids per rank, found by exhaustive search over the documented rule (module docstring of
    shardattn.plan.zigzag), not by replaying the planner's loop.

    Per request of ``n`` tokens, ``u = ceil(n / align)`` units: every chunk gets ``u // 2W`` units and
    the ``u % 2W`` extras are dealt one at a time to the least-loaded eligible rank (a rank's tokens
    so far in the step plus its base units of this request at their size, the short last unit
    included; each extra dealt adds ``align``), ties to the lower rank. Dealing one at a time to
    the smallest ``(load, rank)`` picks exactly the ``u % 2W`` smallest of the keys
    ``(load_r + j * align, r)``, ``j`` in ``{0, 1}``: the search takes, over every assignment of
    0, 1 or 2 extras per rank, the one whose sorted keys are smallest. A rank's first extra
    lengthens chunk ``r``, its second chunk ``2W-1-r``; rank ``r`` owns chunks ``r`` and ``2W-1-r``.
    """
    slots = 2 * w
    load = [0] * w
    ranks: list[list[int]] = [[] for _ in range(w)]
    start = 0
    for n in lens:
        units = -(-n // align)
        base, rem = divmod(units, slots)
        # tokens of the base units of rank r: 2 * base full units; the request's last unit, short
        # by units * align - n, closes chunk 2W-1 (rank 0's late chunk) whenever base > 0
        before = [load[r] + 2 * base * align - (units * align - n if base and r == 0 else 0) for r in range(w)]
        best = min(
            _extra_assignments(w, rem),
            key=lambda e: sorted((before[r] + j * align, r) for r in range(w) for j in range(e[r])),
        )
        sizes = [base] * slots
        for r, e in enumerate(best):
            if e >= 1:
                sizes[r] += 1
            if e == 2:
                sizes[slots - 1 - r] += 1
        bounds = _bounds(sizes, n, align)
        # with align > 1 and a unit in every chunk: while the busiest rank (this request counted)
        # holds 2 * align or more beyond the least loaded, a unit moves between their early chunks
        while base and align > 1:
            after = [load[r] + sum(bounds[c + 1] - bounds[c] for c in (r, slots - 1 - r)) for r in range(w)]
            hi = sorted(range(w), key=lambda r: (-after[r], r))[0]
            lo = sorted(range(w), key=lambda r: (after[r], r))[0]
            if after[hi] - after[lo] < 2 * align or sizes[hi] == 0:
                break
            sizes[hi] -= 1
            sizes[lo] += 1
            bounds = _bounds(sizes, n, align)
        for r in range(w):
            for c in (r, slots - 1 - r):
                ranks[r].extend(range(start + bounds[c], start + bounds[c + 1]))
                load[r] += bounds[c + 1] - bounds[c]
        start += n
    return ranks


def test_oracle_on_the_docstring_examples():
    assert _zigzag_oracle([8], 2, 1) == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert _zigzag_oracle([5, 3], 2, 1) == [[0, 1, 4, 5], [2, 3, 6, 7]]  # request 1's extras: rank 1
    assert _zigzag_oracle([10], 2, 4) == [[0, 1, 2, 3, 8, 9], [4, 5, 6, 7]]  # units 4, 4, 2
    # a single request: extras to the early chunks of ranks 0, 1, ..., then to the late chunks
    assert _zigzag_oracle([7], 3, 1) == [[0, 1, 6], [2, 5], [3, 4]]
    assert _zigzag_oracle([8], 3, 1) == [[0, 1, 7], [2, 3, 6], [4, 5]]
    assert _zigzag_oracle([1] * 9, 3, 1) == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]  # short requests spread


steps = st.tuples(
    st.lists(st.integers(0, 300), min_size=0, max_size=6),
    st.integers(1, 8),
    st.integers(1, 8),
    st.integers(0, 3000),
)


def _prefix(lens: list[int], seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 4000, size=len(lens)).tolist()


def _check_permutation_maps(plan: ShardPlan) -> None:
    t = plan.num_tokens
    x = torch.arange(t) * 7 + 3
    gathered = torch.cat([plan.token_ids(r) for r in range(plan.world_size)])
    # each token on exactly one rank
    assert sorted(gathered.tolist()) == list(range(t))
    assert torch.equal(gathered, plan.gather_index)
    # restore of gather is the identity, padded and unpadded
    assert torch.equal(x[plan.gather_index][plan.restore_index], x)
    padded = torch.full((plan.world_size * plan.padded_count,), -1, dtype=torch.int64)
    mask = plan.padded_gather_index >= 0
    padded[mask] = x[plan.padded_gather_index[mask]]
    assert torch.equal(padded[plan.padded_restore_index], x)
    assert int(mask.sum()) == t
    assert plan.counts.tolist() == [plan.token_ids(r).numel() for r in range(plan.world_size)]
    assert plan.padded_count == (max(plan.counts.tolist()) if plan.world_size else 0)
    for r in range(plan.world_size):
        assert (plan.token_rank[plan.token_ids(r)] == r).all()
        # rank-local order: by request, then increasing position
        req, pos = plan.request_ids(r), plan.positions(r)
        key = req * 10**9 + pos
        assert torch.equal(key, torch.sort(key).values)
    cost = token_cost(plan.token_position, plan.topk)
    assert int(plan.rank_cost.sum()) == int(cost.sum())


@SETTINGS
@given(steps)
def test_zigzag_invariants_match_the_search_oracle(step):
    lens, w, align, seed = step
    prefix = _prefix(lens, seed)
    plan = zigzag_split(lens, w, align=align, min_tokens=0, prefix_lens=prefix)
    assert plan.sharded and plan.strategy == "zigzag"
    ref = _zigzag_oracle(lens, w, align)
    assert [plan.token_ids(r).tolist() for r in range(w)] == ref
    _check_permutation_maps(plan)
    # positions include the prefix
    offs = plan.token_offsets
    for i, n in enumerate(lens):
        got = plan.token_position[int(offs[i]) : int(offs[i]) + n].tolist()
        assert got == list(range(prefix[i], prefix[i] + n))


@SETTINGS
@given(steps)
def test_zigzag_chunks_are_aligned_and_ranks_bounded(step):
    lens, w, align, _ = step
    bounds = zigzag_chunk_bounds(lens, w, align=align)
    assert bounds.shape == (len(lens), 2 * w + 1)
    for i, n in enumerate(lens):
        b = bounds[i]
        assert b[0] == 0 and b[-1] == n and (np.diff(b) >= 0).all()
        assert all(x % align == 0 or x == n for x in b.tolist())
        # the chunks hold the request's units
        assert sum(-(-(b[c + 1] - b[c]) // align) for c in range(2 * w)) == -(-n // align)
    # documented bound on the busiest rank
    plan = zigzag_split(lens, w, align=align, min_tokens=0)
    t = sum(lens)
    bound = -(-t // w) + (0 if align == 1 else 2 * align - 1)
    assert plan.padded_count <= bound
    # a run of a rank never starts inside a group of `align` queries
    for r in range(w):
        for _req, start, _stop in plan.runs(r):
            assert start % align == 0


@SETTINGS
@given(steps)
def test_cost_balanced_invariants(step):
    lens, w, align, seed = step
    prefix = _prefix(lens, seed)
    plan = cost_balanced_split(lens, w, align=align, min_tokens=0, prefix_lens=prefix, topk=512)
    assert plan.strategy == "cost_balanced" and plan.chunk_bounds is None
    _check_permutation_maps(plan)
    for r in range(w):
        ids = plan.token_ids(r)
        # one contiguous piece of the step per rank
        assert torch.equal(ids, torch.arange(int(ids[0]), int(ids[0]) + ids.numel())) if ids.numel() else True
        for _req, start, _stop in plan.runs(r):
            off = start - prefix[_req]
            assert off % align == 0
    # each rank within one unit's cost of the mean at either end
    cost = token_cost(plan.token_position, 512)
    unit_max = align * 512
    mean = cost.sum() / w
    assert (plan.rank_cost.numpy() <= mean + 2 * unit_max).all()


@pytest.mark.parametrize("requests", [8, 1000])
@pytest.mark.parametrize(("n", "w", "align"), [(7, 2, 2), (61, 2, 8), (47, 3, 4)])
def test_short_last_units_do_not_pile_up_on_one_side(requests, n, w, align):
    # units divide 2W and the last unit is short, request after request: before the rebalancing
    # every request left rank 0 short, so rank 1 grew past the bound (8 x 7 tokens: 24 / 32)
    assert -(-n // align) % (2 * w) == 0 and n % align
    lens = [n] * requests
    plan = zigzag_split(lens, w, align=align, min_tokens=0)
    assert int(plan.counts.max()) <= -(-sum(lens) // w) + 2 * align - 1
    assert [plan.token_ids(r).tolist() for r in range(w)] == _zigzag_oracle(lens, w, align)


def test_zigzag_docstring_example_exact():
    plan = zigzag_split([8], 2, min_tokens=0)
    assert plan.token_ids(0).tolist() == [0, 1, 6, 7]
    assert plan.token_ids(1).tolist() == [2, 3, 4, 5]
    assert plan.restore_index.tolist() == [0, 1, 4, 5, 6, 7, 2, 3]
    assert plan.chunk_bounds.tolist() == [[0, 2, 4, 6, 8]]
    assert plan.padded_gather_index.tolist() == [0, 1, 6, 7, 2, 3, 4, 5]


@pytest.mark.parametrize(
    ("lens", "w", "align", "expected"),
    [
        ([3], 4, 1, [[0], [1], [2], []]),
        ([5, 3], 2, 1, [[0, 1, 4, 5], [2, 3, 6, 7]]),
        ([10], 2, 4, [[0, 1, 2, 3, 8, 9], [4, 5, 6, 7]]),
        ([1, 1, 1, 1], 2, 1, [[0, 2], [1, 3]]),
        ([1] * 9, 3, 1, [[0, 3, 6], [1, 4, 7], [2, 5, 8]]),
    ],
    ids=["shorter-than-2W", "extras-to-least-loaded", "align-tail", "single-tokens-alternate", "spread"],
)
def test_zigzag_remainder_rule_examples(lens, w, align, expected):
    plan = zigzag_split(lens, w, align=align, min_tokens=0)
    assert [plan.token_ids(r).tolist() for r in range(w)] == expected


def test_rank_that_owns_nothing_has_empty_maps():
    plan = zigzag_split([1], 3, min_tokens=0)
    assert plan.counts.tolist() == [1, 0, 0]
    assert plan.token_ids(2).numel() == 0 and plan.runs(2) == []
    assert plan.padded_gather_index.tolist() == [0, -1, -1]


def test_gate_below_min_tokens_keeps_head_tp():
    plan = zigzag_split([100, 200], 4, min_tokens=1024)
    assert not plan.sharded
    assert "min_tokens=1024" in plan.reason and "head tensor parallelism" in plan.reason
    for r in range(4):
        assert plan.token_ids(r).tolist() == list(range(300))
    assert plan.restore_index.tolist() == list(range(300))
    assert (plan.token_rank == -1).all()
    assert plan.cost_balance == 1.0
    assert zigzag_split([1024], 4).sharded  # the gate is "fewer than"
    assert not cost_balanced_split([1023], 4).sharded


def test_zigzag_cost_is_balanced_for_a_ramp():
    # before the top-k plateau, a token's cost is linear in its position: zigzag is exact
    plan = zigzag_split([4096], 4, topk=10**6)
    assert plan.cost_balance == 1.0 and plan.token_balance == 1.0


def test_balance_report_cost_balanced_not_worse():
    rep = balance_report([6000, 300, 50], 4, prefix_lens=[0, 1500, 3000], topk=2048)
    rows = rep.table()
    assert [r["split"] for r in rows] == ["zigzag", "cost_balanced"]
    assert rep.cost_balanced.cost_balance <= rep.zigzag.cost_balance
    assert rep.cost_balanced.cost_balance < 1.01


def test_fingerprint_is_stable_and_sensitive():
    a = zigzag_split([900, 700], 4, min_tokens=0, prefix_lens=[5, 0])
    b = zigzag_split(np.array([900, 700]), 4, min_tokens=0, prefix_lens=torch.tensor([5, 0]))
    assert a.fingerprint() == b.fingerprint()
    assert 0 <= a.fingerprint() < 2**63
    assert a.fingerprint() != zigzag_split([900, 700], 4, min_tokens=0, prefix_lens=[5, 1]).fingerprint()
    assert a.fingerprint() != zigzag_split([900, 700], 4, min_tokens=0, prefix_lens=[5, 0], align=2).fingerprint()
    assert a.fingerprint() != cost_balanced_split([900, 700], 4, min_tokens=0, prefix_lens=[5, 0]).fingerprint()


def test_to_and_to_torch_keep_values():
    plan = zigzag_split([40, 9], 3, min_tokens=0, align=2)
    moved = plan.to("cpu")
    maps = plan.to_torch()
    assert maps["gather_index"].dtype == torch.int64
    assert torch.equal(moved.gather_index, plan.gather_index)
    assert torch.equal(maps["chunk_bounds"], plan.chunk_bounds)
    assert moved.fingerprint() == plan.fingerprint()
    assert [row["tokens"] for row in plan.table()] == plan.counts.tolist()


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(query_lens=[4], world_size=0), ValueError, "world_size must be >= 1"),
        (dict(query_lens=[4], world_size=2.0), TypeError, "world_size must be an int"),
        (dict(query_lens=[4, -1], world_size=2), ValueError, r"query_lens\[1\] must be >= 0"),
        (dict(query_lens=[4.5], world_size=2), TypeError, r"query_lens\[0\] must be an int"),
        (dict(query_lens=torch.tensor([1.0]), world_size=2), TypeError, "query_lens must hold integers"),
        (dict(query_lens=[[1, 2]], world_size=2), TypeError, r"query_lens\[0\] must be an int"),
        (dict(query_lens=[4], world_size=2, align=0), ValueError, "align must be >= 1"),
        (dict(query_lens=[4], world_size=2, min_tokens=-1), ValueError, "min_tokens must be >= 0"),
        (dict(query_lens=[4], world_size=2, prefix_lens=[1, 2]), ValueError, "prefix_lens must have 1 entries"),
        (dict(query_lens=[4], world_size=2, prefix_lens=[-3]), ValueError, r"prefix_lens\[0\] must be >= 0"),
        (dict(query_lens=[4], world_size=2, topk=0), ValueError, "topk must be >= 1"),
        (dict(query_lens="12", world_size=2), TypeError, "query_lens must be a sequence of ints"),
    ],
    ids=[
        "world-size-0",
        "world-size-float",
        "negative-length",
        "float-length",
        "float-tensor",
        "nested-list",
        "align-0",
        "min-tokens-negative",
        "prefix-wrong-count",
        "prefix-negative",
        "topk-0",
        "string",
    ],
)
@pytest.mark.parametrize("split", [zigzag_split, cost_balanced_split], ids=["zigzag", "cost"])
def test_bad_arguments_raise(split, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        split(**kwargs)


def test_bad_rank_raises():
    plan = zigzag_split([8], 2, min_tokens=0)
    with pytest.raises(ValueError, match="rank must be < world_size=2"):
        plan.token_ids(2)


def test_chunk_bounds_refuse_lengths_the_split_refuses():
    with pytest.raises(ValueError, match="query_lens"):
        zigzag_chunk_bounds([2**31], 2)


def _cost_balanced_oracle(lens: list[int], w: int, align: int, topk: int) -> list[list[int]]:
    """The documented cost-balanced rule by exhaustive scan: for each ``j`` the unit boundary whose
    cost before it is nearest ``j * C / W`` (the earlier on a tie), never left of the previous cut."""
    costs: list[int] = []
    starts: list[int] = []  # token ids where a unit starts
    for n in lens:
        for p in range(n):
            if p % align == 0:
                starts.append(len(costs))
            costs.append(min(p + 1, topk))
    t = len(costs)
    edges = [*starts, t]
    before = [sum(costs[:e]) for e in edges]
    total = sum(costs)
    cuts = [0]
    for j in range(1, w):
        dist = [abs(c * w - j * total) for c in before]
        nearest = dist.index(min(dist))  # the first index of the minimum: the earlier boundary
        cuts.append(max(nearest, cuts[-1]))
    cuts.append(len(edges) - 1)
    return [list(range(edges[cuts[r]], edges[cuts[r + 1]])) for r in range(w)]


def test_cost_balanced_ties_go_to_the_earlier_boundary():
    # [3] at topk=1 over 2 ranks: costs 1 1 1; the boundaries after tokens 1 and 2 are both 0.5 from
    # C / 2 = 1.5, and the earlier one wins
    assert [cost_balanced_split([3], 2, min_tokens=0, topk=1).token_ids(r).tolist() for r in range(2)] == [[0], [1, 2]]
    for lens in ([1], [2], [3], [4], [5], [1, 1], [2, 1], [1, 3], [3, 3], [2, 2, 2], [5, 1, 4], [0, 6, 1]):
        for w in (2, 3, 4):
            for align in (1, 2, 3):
                for topk in (1, 2, 3, 100):
                    plan = cost_balanced_split(lens, w, align=align, min_tokens=0, topk=topk)
                    ref = _cost_balanced_oracle(lens, w, align, topk)
                    assert [plan.token_ids(r).tolist() for r in range(w)] == ref, (lens, w, align, topk)
