"""Token splits of a batch step across ranks (ShardQ, PCP): zigzag and cost-balanced.

A batch step holds the new tokens of several requests, concatenated request by request
("token order"; token id ``g`` in ``[0, T)``). A split gives each rank a subset of the tokens
("rank-major order": rank 0's tokens, then rank 1's, ...) together with the index maps that move
a token-major tensor into rank-major order and back.

Zigzag rule (``zigzag_split``), for world size ``W``: every request's new tokens are cut into
``2W`` contiguous chunks and rank ``r`` takes chunks ``r`` and ``2W-1-r``. Under causal
attention a token's work grows with its position, so pairing an early chunk with a late one
gives every rank the same work. One request of 8 tokens over ``W = 2`` ranks::

    token      0 1 | 2 3 | 4 5 | 6 7
    chunk       0  |  1  |  2  |  3
    rank        0  |  1  |  1  |  0

    causal mask (q rows, k columns)         rank 0 holds q rows 0 1 6 7, rank 1 rows 2 3 4 5
      q\\k 0 1 2 3 4 5 6 7                    rank 0   0 1 2 3 4 5 6 7     rank 1   0 1 2 3 4 5 6 7
       0   1 . . . . . . .                     q0     1 . . . . . . .      q2     1 1 1 . . . . .
       1   1 1 . . . . . .                     q1     1 1 . . . . . .      q3     1 1 1 1 . . . .
       2   1 1 1 . . . . .                     q6     1 1 1 1 1 1 1 .      q4     1 1 1 1 1 . . .
       3   1 1 1 1 . . . .                     q7     1 1 1 1 1 1 1 1      q5     1 1 1 1 1 1 . .
       4   1 1 1 1 1 . . .                          (18 entries)               (18 entries)
       5   1 1 1 1 1 1 . .
       6   1 1 1 1 1 1 1 .
       7   1 1 1 1 1 1 1 1

Chunk boundaries (the one rule for every length): a request of ``n`` new tokens is cut into
``u = ceil(n / align)`` *units* of ``align`` tokens (only its last unit may be shorter). Each of
the ``2W`` chunks gets ``u // (2W)`` units. The ``u % (2W)`` extra units are dealt one at a time
to the rank holding the fewest tokens so far in the step (this request's units counted at their
size), among ranks that still have a chunk of this request without an extra; ties go to the
lower rank; a rank's first extra lengthens its early chunk ``r``, its second its late chunk
``2W-1-r``. With ``align > 1`` and every chunk holding a unit, the short last unit leaves rank 0
short, request after request: while the busiest rank then holds ``2 * align`` tokens or more
beyond the least loaded one, a unit moves from the busiest rank's early chunk to the least loaded
rank's. Requests are taken in batch order. So:

* every chunk boundary is a multiple of ``align`` from the request's first new token (a group of
  ``align`` consecutive queries never straddles two ranks);
* a length that does not divide puts its extra units on the least-loaded ranks;
* a request shorter than ``2W`` units leaves some chunks empty (a rank may own nothing);
* a single request: its extras go to the early chunks of ranks ``0, 1, ...``, then to the late
  chunks;
* many short requests are spread over the ranks instead of all landing on rank 0;
* every rank holds at most ``ceil(T / W) + 2 * align - 1`` tokens (``T`` = step tokens; exactly
  ``ceil(T / W)`` at most when ``align == 1``).

Cost: a token at position ``p`` (cached prefix included) costs ``min(p + 1, topk)`` (a sparse
query attends to at most ``topk`` keys). ``cost_balance`` is the busiest rank's cost over the mean.

Gate: a step with fewer than ``min_tokens`` new tokens is not sharded (``sharded=False`` and a
``reason``): every rank keeps head tensor parallelism and runs *all* tokens with its own heads,
so nothing moves. The per-rank accessors then return every token for every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from shardattn._checks import check_int
from shardattn.plan._common import MAX_TOKENS, as_lengths, check_token_counts, check_world_size
from shardattn.plan.crossovers import DEFAULT_MIN_TOKENS
from shardattn.plan.shard_plan import ShardPlan, build_shard_plan, expand_ranges, token_cost

__all__ = [
    "DEFAULT_MIN_TOKENS",
    "BalanceReport",
    "ShardPlan",
    "balance_report",
    "cost_balanced_split",
    "token_cost",
    "zigzag_chunk_bounds",
    "zigzag_split",
]


def _check_common(
    query_lens: object,
    world_size: object,
    align: object,
    min_tokens: object,
    prefix_lens: object,
    topk: object,
) -> tuple[np.ndarray, np.ndarray, int, int, int, int]:
    w = check_world_size(world_size)
    a = check_int("align", align, minimum=1)
    m = check_int("min_tokens", min_tokens, minimum=0)
    k = check_int("topk", topk, minimum=1, maximum=MAX_TOKENS)
    lens = check_token_counts("query_lens", as_lengths("query_lens", query_lens))
    if prefix_lens is None:
        prefix = np.zeros_like(lens)
    else:  # a request's tokens sit at positions prefix .. prefix + query_len - 1
        prefix = as_lengths("prefix_lens", prefix_lens, count=lens.shape[0])
        check_token_counts("prefix_lens + query_lens", check_token_counts("prefix_lens", prefix) + lens)
    return lens, prefix, w, a, m, k


def zigzag_chunk_bounds(query_lens: object, world_size: int, *, align: int = 1) -> np.ndarray:
    """``[R, 2W+1]`` chunk boundaries of every request under the zigzag rule (module docstring).

    Row ``i`` holds offsets into request ``i``'s new tokens; chunk ``c`` is
    ``[bounds[i, c], bounds[i, c+1])`` and belongs to rank ``min(c, 2W-1-c)``.

    >>> zigzag_chunk_bounds([8], 2).tolist()
    [[0, 2, 4, 6, 8]]
    >>> zigzag_chunk_bounds([5, 3], 2).tolist()   # request 1's extras: rank 1 has fewer tokens
    [[0, 2, 3, 4, 5], [0, 1, 2, 3, 3]]
    >>> zigzag_chunk_bounds([10], 2, align=4).tolist()   # units 4, 4, 2 (the last is short)
    [[0, 4, 8, 8, 10]]
    """
    lens = check_token_counts("query_lens", as_lengths("query_lens", query_lens))
    w = check_world_size(world_size)
    a = check_int("align", align, minimum=1)
    return _chunk_bounds(lens, w, a)


def _chunk_bounds(lens: np.ndarray, w: int, a: int) -> np.ndarray:
    # plain Python: per request the work is O(W) on tiny lists, where numpy calls cost more
    slots = 2 * w
    rows = []
    load = [0] * w  # tokens per rank so far in this step
    for n in lens.tolist():
        units = -(-n // a)
        base, rem = divmod(units, slots)
        sizes = [base] * slots
        if rem:
            extras = [0] * w
            guess = [x + 2 * base * a for x in load]  # this request's units, counted as full ...
            if base:  # ... except the short last unit, which closes chunk 2W-1 (rank 0)
                guess[0] -= units * a - n
            for _ in range(rem):
                r = min((g, k) for k, g in enumerate(guess) if extras[k] < 2)[1]  # ties -> lower rank
                sizes[r if extras[r] == 0 else slots - 1 - r] += 1
                extras[r] += 1
                guess[r] += a
        row = _rows_of(sizes, n, a)
        if base and a > 1:  # the short last unit (rank 0's late chunk) can leave rank 0 behind
            row = _rebalance(sizes, row, load, n, w, a)
        rows.append(row)
        for r in range(w):
            load[r] += row[r + 1] - row[r] + row[slots - r] - row[slots - 1 - r]
    return np.asarray(rows, dtype=np.int64).reshape(lens.size, slots + 1)


def _rows_of(sizes: list[int], n: int, a: int) -> list[int]:
    # chunk boundaries of units per chunk: only the last unit of the request may be short
    row = [0]
    for size in sizes:
        row.append(min(row[-1] + size * a, n))
    return row


def _rebalance(sizes: list[int], row: list[int], load: list[int], n: int, w: int, a: int) -> list[int]:
    """While the busiest rank holds ``2 * align`` tokens or more beyond the least loaded one (this
    request counted), one unit of the busiest rank's early chunk moves to the least loaded rank's
    early chunk (every chunk holds a unit, and early chunks hold whole ones)."""
    slots = 2 * w
    while True:
        after = [load[r] + row[r + 1] - row[r] + row[slots - r] - row[slots - 1 - r] for r in range(w)]
        hi = max(range(w), key=lambda r: (after[r], -r))  # ties -> lower rank
        lo = min(range(w), key=lambda r: (after[r], r))
        if after[hi] - after[lo] < 2 * a or sizes[hi] == 0:
            return row
        sizes[hi] -= 1
        sizes[lo] += 1
        row = _rows_of(sizes, n, a)


def _gate(lens: np.ndarray, w: int, m: int) -> tuple[bool, str]:
    t = int(lens.sum())
    if t < m:
        return False, (
            f"{t} new tokens < min_tokens={m}: not token-sharded; every rank keeps head "
            f"tensor parallelism and runs all {t} tokens with its own heads"
        )
    return True, f"{t} new tokens >= min_tokens={m}: token-sharded over {w} ranks"


# cut(lens, prefix, w, align, topk) -> (each rank's token ids in token order, chunk bounds or None)
_Cut = Callable[[np.ndarray, np.ndarray, int, int, int], tuple[list[np.ndarray], "np.ndarray | None"]]


def _split(strategy: str, cut: _Cut, query_lens, world_size, align, min_tokens, prefix_lens, topk) -> ShardPlan:
    """Checks the arguments, applies the ``min_tokens`` gate (unsharded: every rank holds every
    token), else builds the plan from ``cut``'s per-rank tokens."""
    lens, prefix, w, a, m, k = _check_common(query_lens, world_size, align, min_tokens, prefix_lens, topk)
    sharded, reason = _gate(lens, w, m)
    if not sharded:
        every = np.arange(int(lens.sum()), dtype=np.int64)
        return build_shard_plan(strategy, lens, prefix, w, a, k, False, reason, [every] * w, None)
    rank_tokens, bounds = cut(lens, prefix, w, a, k)
    return build_shard_plan(strategy, lens, prefix, w, a, k, True, reason, rank_tokens, bounds)


def zigzag_split(
    query_lens: object,
    world_size: int,
    *,
    align: int = 1,
    min_tokens: int = DEFAULT_MIN_TOKENS,
    prefix_lens: object = None,
    topk: int = 2048,
) -> ShardPlan:
    """Zigzag split of a batch step's new tokens over ``world_size`` ranks (see module docstring).

    Args:
        query_lens: ``[R]`` new tokens per request (ints >= 0; list, numpy or CPU tensor).
        world_size: ranks ``W >= 1``.
        align: chunk boundaries are multiples of ``align`` tokens from each request's first
            new token (use the query group size ``G``). ``>= 1``.
        min_tokens: steps with fewer new tokens are not sharded (``sharded=False``).
        prefix_lens: ``[R]`` cached tokens before the new ones (positions start there); default 0.
        topk: the cost of a token at position ``p`` is ``min(p + 1, topk)``.

    Returns:
        A :class:`ShardPlan` with ``strategy="zigzag"``; rank ``r`` holds chunks ``r`` and
        ``2W-1-r`` of every request, in request order.

    >>> plan = zigzag_split([8], 2, min_tokens=0)
    >>> plan.token_ids(0).tolist(), plan.token_ids(1).tolist()
    ([0, 1, 6, 7], [2, 3, 4, 5])
    >>> plan.restore_index.tolist()
    [0, 1, 4, 5, 6, 7, 2, 3]
    >>> plan.rank_cost.tolist(), plan.cost_balance
    ([18, 18], 1.0)
    >>> zigzag_split([8], 2).sharded   # 8 < min_tokens=1024
    False
    """
    return _split("zigzag", _zigzag_cut, query_lens, world_size, align, min_tokens, prefix_lens, topk)


def _zigzag_cut(lens: np.ndarray, prefix: np.ndarray, w: int, a: int, k: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Rank ``r`` takes chunks ``r`` and ``2W-1-r`` of every request (module docstring)."""
    bounds = _chunk_bounds(lens, w, a)
    offsets = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64) if lens.size else lens
    rank_tokens = []
    for r in range(w):
        lo, hi = r, 2 * w - 1 - r
        # per request: chunk r then chunk 2W-1-r (increasing positions), requests in order
        starts = np.stack([bounds[:, lo], bounds[:, hi]], axis=1) + offsets[:, None]
        stops = np.stack([bounds[:, lo + 1], bounds[:, hi + 1]], axis=1) + offsets[:, None]
        rank_tokens.append(expand_ranges(starts.reshape(-1), stops.reshape(-1)))
    return rank_tokens, bounds


def cost_balanced_split(
    query_lens: object,
    world_size: int,
    *,
    align: int = 1,
    min_tokens: int = DEFAULT_MIN_TOKENS,
    prefix_lens: object = None,
    topk: int = 2048,
) -> ShardPlan:
    """Split that balances :func:`token_cost` rather than token counts (same interface as zigzag).

    Rule: cut every request into units of ``align`` tokens (the last unit of a request may be
    shorter), lay all units of the step end to end in token order, and cut that line into ``W``
    contiguous pieces at the unit boundaries nearest to the cost quantiles ``r * C / W``
    (``C`` = total cost; ties go to the earlier boundary); rank ``r`` takes piece ``r``. A piece
    may span requests (a rank then holds several runs); every boundary is still a multiple of
    ``align`` inside its request, and each rank's cost is within one unit's cost of ``C / W``
    at either end.

    >>> plan = cost_balanced_split([8], 2, min_tokens=0, topk=4)
    >>> [plan.token_ids(r).tolist() for r in range(2)], plan.rank_cost.tolist()
    ([[0, 1, 2, 3, 4], [5, 6, 7]], [14, 12])
    """
    return _split("cost_balanced", _cost_cut, query_lens, world_size, align, min_tokens, prefix_lens, topk)


def _cost_cut(lens: np.ndarray, prefix: np.ndarray, w: int, a: int, k: int) -> tuple[list[np.ndarray], None]:
    """Rank ``r`` takes the ``r``-th contiguous piece between cost quantiles (:func:`cost_balanced_split`)."""
    t = int(lens.sum())
    tok_req = np.repeat(np.arange(lens.size, dtype=np.int64), lens)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    local = np.arange(t, dtype=np.int64) - offsets[tok_req]
    cost = token_cost(local + prefix[tok_req], k)
    # a unit starts at every token whose in-request offset is a multiple of align
    unit_start = np.flatnonzero(local % a == 0)
    cum_at_start = np.concatenate([[0], np.cumsum(cost)])[unit_start]
    boundaries = np.concatenate([unit_start, [t]]).astype(np.int64)
    cum = np.concatenate([cum_at_start, [int(cost.sum())]]).astype(np.int64)
    total = int(cum[-1])
    cuts = [0]
    for j in range(1, w):
        target = j * total  # compare cum * w against j * total: exact integers
        hi = min(int(np.searchsorted(cum * w, target, side="left")), cum.size - 1)
        lo = max(hi - 1, 0)
        pick = lo if abs(int(cum[lo]) * w - target) <= abs(int(cum[hi]) * w - target) else hi
        cuts.append(max(pick, cuts[-1]))
    cuts.append(cum.size - 1)
    tb = boundaries[np.asarray(cuts)]
    rank_tokens = [np.arange(tb[r], tb[r + 1], dtype=np.int64) for r in range(w)]
    return rank_tokens, None


class BalanceReport(NamedTuple):
    """Both splits of one step, for comparing their balance."""

    zigzag: ShardPlan
    cost_balanced: ShardPlan

    def table(self) -> list[dict[str, object]]:
        """One row per split: token and cost balance (max / mean, 1.0 is perfect)."""
        return [
            {
                "split": p.strategy,
                "sharded": p.sharded,
                "token_balance": round(p.token_balance, 4),
                "cost_balance": round(p.cost_balance, 4),
                "max_rank_cost": int(p.rank_cost.max()) if p.world_size else 0,
            }
            for p in (self.zigzag, self.cost_balanced)
        ]


def balance_report(
    query_lens: object,
    world_size: int,
    *,
    align: int = 1,
    min_tokens: int = DEFAULT_MIN_TOKENS,
    prefix_lens: object = None,
    topk: int = 2048,
) -> BalanceReport:
    """Plan a step both ways (:func:`zigzag_split` and :func:`cost_balanced_split`)."""
    zigzag, cost_balanced = (
        split(query_lens, world_size, align=align, min_tokens=min_tokens, prefix_lens=prefix_lens, topk=topk)
        for split in (zigzag_split, cost_balanced_split)
    )
    return BalanceReport(zigzag, cost_balanced)
