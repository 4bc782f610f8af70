"""Pipelined ShardQ: each rank's token share cut into chunks, and the runs each chunk moves.

A pipelined ShardQ step (:func:`~shardattn.parallel.shardq.shardq_prefill`) exchanges queries and
outputs chunk by chunk, so chunk ``c``'s kernel runs while the query exchange of a later chunk
and the output exchange of chunk ``c - 1`` are in flight. Chunk ``c`` of rank ``r`` is the slice
``bounds[r, c] : bounds[r, c + 1]`` of ``r``'s tokens in rank-major order
(:meth:`~shardattn.plan.shard_plan.ShardPlan.token_ids`); every boundary but the last is a
multiple of ``align`` (the kernel's group size ``G``), so the kernel's groups are those of the
unchunked step and the result is bit for bit the same. A chunk may hold no token of some rank.

Nothing is packed: the queries a rank sends and the outputs it receives are contiguous token
runs of token-order tensors, moved in place by point-to-point messages. :meth:`PipelinePlan.runs`
``(rank, chunk)`` lists them as ``(token_start, offset in the chunk, tokens)`` (the same list on
every rank, so sends and receives pair up). With ``W = 2``, one request of 8 tokens, zigzag:
rank 0 holds t0 t1 t6 t7 (chunk 0 = [t0 t1], chunk 1 = [t6 t7]), rank 1 holds t2..t5 (chunk 0 =
[t2 t3], chunk 1 = [t4 t5]):

>>> from shardattn.plan.zigzag import zigzag_split
>>> plan = pipeline_plan(zigzag_split([8], 2, min_tokens=0), chunks=2)
>>> plan.runs(0, 0), plan.runs(0, 1)  # rank 0: tokens 0..1, then tokens 6..7
(((0, 0, 2),), ((6, 0, 2),))
>>> plan.runs(1, 0), plan.runs(1, 1)  # rank 1: tokens 2..3, then tokens 4..5
(((2, 0, 2),), ((4, 0, 2),))

The number of chunks comes from the step's work (:func:`choose_chunks`): enough that the exposed
first query exchange and last output exchange are short, few enough that each chunk's kernel
outlasts the host's time to issue the chunk.

Tapered chunks (``taper=True``, opt-in, not measured yet): the shares are cut in proportion to
:func:`chunk_weights`, ``1, 2, ..., 2, 1`` for ``C >= 3``. Why: with ``x`` and ``y`` the time per
token of the query and output exchanges and ``k`` the kernel's, the device sees, around chunk
``c``'s kernel, the output exchange of chunk ``c - 1`` and the query exchange of chunk ``c + 1``
(one communication stream), and nothing hides chunk 0's query exchange nor chunk ``C - 1``'s
output exchange. With ``n`` tokens per rank::

    exposed comm          equal chunks: (x + y) n / C      tapered: (x + y) n / (2C - 2)
                          (C = 3: n/3 -> n/4; C = 4: n/4 -> n/6; large C: halved)
    hidden when           equal chunks: k >= x + y         tapered, middle chunks: k >= x + y (the same);
                                                           chunk 0: k >= 2x, chunk 1: 2k >= y + 2x,
                                                           chunk C - 1: k >= 2y

(a small chunk's kernel must outlast its big neighbour's exchange). On two H200s ``x + y`` is about
0.6 ``k`` at glm5 (exchanges 1.59 ms against a 2.55 ms kernel at 8K tokens), so
``x, y`` about 0.3 ``k`` and every condition holds. ``C <= 2`` has no middle chunk: the weights
are equal.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from shardattn._checks import check_bool, check_int
from shardattn.plan.crossovers import AUTO_MAX_CHUNKS, CHUNK_WORK
from shardattn.plan.shard_plan import ShardPlan

__all__ = [
    "AUTO_MAX_CHUNKS",
    "CHUNK_ALIGN",
    "CHUNK_WORK",
    "MAX_CHUNKS",
    "PipelinePlan",
    "choose_chunks",
    "chunk_weights",
    "pipeline_plan",
]

#: The most chunks a step can be cut into (each costs two message groups and a few launches).
MAX_CHUNKS = 8
#: Bytes: each chunk's receive / send buffer starts at a multiple (aligned vector loads, and one
#: kernel specialisation whatever the chunk sizes).
CHUNK_ALIGN = 256


def choose_chunks(
    rank_tokens: int,
    *,
    heads: int = 64,
    topk: int = 2048,
    chunk_work: int = CHUNK_WORK,
    max_chunks: int = AUTO_MAX_CHUNKS,
) -> int:
    """Chunks for a step whose largest rank share is ``rank_tokens`` tokens of ``heads`` heads
    attending ``topk`` keys each: ``floor(work / chunk_work)`` in ``[1, max_chunks]``.

    >>> [choose_chunks(n) for n in (0, 4096, 8191, 8192, 16384, 10**6)]
    [1, 1, 1, 2, 4, 4]
    >>> choose_chunks(4096, heads=128), choose_chunks(16384, heads=16)
    (2, 1)
    """
    n = check_int("rank_tokens", rank_tokens, minimum=0)
    h = check_int("heads", heads, minimum=1)
    k = check_int("topk", topk, minimum=1)
    per = check_int("chunk_work", chunk_work, minimum=1)
    top = check_int("max_chunks", max_chunks, minimum=1)
    return max(1, min(top, n * h * k // per))


def chunk_weights(chunks: int, *, taper: bool = False) -> tuple[int, ...]:
    """Relative sizes of a step's ``chunks`` chunks: all 1, or with ``taper`` (``C >= 3``) halved
    first and last chunks, ``1, 2, ..., 2, 1`` (module docstring: the exposed exchanges halve).

    >>> chunk_weights(4), chunk_weights(4, taper=True), chunk_weights(2, taper=True)
    ((1, 1, 1, 1), (1, 2, 2, 1), (1, 1))
    """
    c = check_int("chunks", chunks, minimum=1)
    check_bool("taper", taper)
    if not taper or c < 3:
        return (1,) * c
    return (1,) + (2,) * (c - 2) + (1,)


@dataclass(frozen=True, eq=False)
class PipelinePlan:
    """Chunk boundaries of every rank's share and the token runs each chunk moves.

    Attributes:
        world_size, chunks, align: ``W``, ``C`` and the boundary alignment.
        taper: whether the chunks follow the tapered :func:`chunk_weights`.
        bounds: ``[W, C + 1]`` int64 offsets into each rank's rank-major token list.
    """

    world_size: int
    chunks: int
    align: int
    taper: bool
    bounds: np.ndarray
    _runs: tuple[tuple[tuple[tuple[int, int, int], ...], ...], ...]

    def count(self, rank: int, chunk: int) -> int:
        """Tokens of ``rank`` in ``chunk``."""
        return int(self.bounds[rank, chunk + 1] - self.bounds[rank, chunk])

    def counts(self, chunk: int) -> list[int]:
        """``[W]`` tokens of every rank in ``chunk``."""
        return [self.count(r, chunk) for r in range(self.world_size)]

    def runs(self, rank: int, chunk: int) -> tuple[tuple[int, int, int], ...]:
        """``(token_start, offset, length)`` of each contiguous token run of ``rank``'s ``chunk``:
        tokens ``token_start .. token_start + length`` (token order) are rows ``offset ..`` of the chunk."""
        return self._runs[chunk][rank]

    def token_runs(self) -> list[tuple[int, int]]:
        """``(token_start, length)`` of every run of every rank and chunk, in token order: they tile
        the step's tokens (``[0, T)``), so one split of a token-order tensor gives every run's view.

        >>> from shardattn.plan.zigzag import zigzag_split
        >>> pipeline_plan(zigzag_split([8], 2, min_tokens=0), 2).token_runs()
        [(0, 2), (2, 2), (4, 2), (6, 2)]
        """
        return sorted((s, n) for per_rank in self._runs for runs in per_rank for s, _, n in runs)

    @property
    def one_message_per_peer(self) -> bool:
        """Whether the step gathers what it sends to a peer into one message (and scatters what it
        receives) rather than sending each token run as its own message: when it is one chunk.

        Measured on two H200s (docs/DECISIONS.md, D41): a message costs about 30 us of host time,
        which an unchunked step pays before its device starts, while a chunked step issues later
        chunks' messages behind earlier kernels and pays only the gather and scatter copies.
        """
        return self.chunks == 1

    def fingerprint(self) -> tuple[int, int, int, bool, bytes]:
        return (self.world_size, self.chunks, self.align, self.taper, self.bounds.tobytes())


def pipeline_plan(plan: ShardPlan, chunks: int, *, align: int = 1, taper: bool = False) -> PipelinePlan:
    """Cut every rank's share of a sharded ``plan`` into ``chunks`` chunks (boundaries multiples of ``align``).

    Chunk ``i`` of a share of ``n`` tokens ends at ``floor(n * S_i / S) // align * align`` (the last
    at ``n``), ``S_i`` the sum of the first ``i + 1`` :func:`chunk_weights` and ``S`` their total:
    equal chunks, or tapered ones with ``taper``. A chunk may be empty for a rank (few tokens,
    or ``align`` larger than its piece).

    Args:
        plan: a sharded :class:`~shardattn.plan.shard_plan.ShardPlan`.
        chunks: ``C`` in ``[1, MAX_CHUNKS]``. align: the kernel's group size ``G`` (boundaries keep its groups).
        taper: first and last chunks half the middle ones (:func:`chunk_weights`).
    Returns:
        the :class:`PipelinePlan`; ``chunks = 1`` is the unchunked step.

    >>> from shardattn.plan.zigzag import zigzag_split
    >>> pp = pipeline_plan(zigzag_split([8], 2, min_tokens=0), 2)
    >>> pp.counts(0), pp.runs(0, 1), pp.runs(1, 0)
    ([2, 2], ((6, 0, 2),), ((2, 0, 2),))
    >>> pipeline_plan(zigzag_split([48], 2, min_tokens=0), 4, taper=True).bounds[0].tolist()
    [0, 4, 12, 20, 24]
    """
    if not isinstance(plan, ShardPlan):
        raise TypeError(f"plan must be a ShardPlan, got {type(plan).__name__}")
    if not plan.sharded:
        raise ValueError(f"plan must be sharded to be pipelined ({plan.reason})")
    c = check_int("chunks", chunks, minimum=1)
    if c > MAX_CHUNKS:
        raise ValueError(f"chunks must be in [1, {MAX_CHUNKS}] (the workspace holds that many), got {c}")
    a = check_int("align", align, minimum=1)
    ends = np.cumsum(chunk_weights(c, taper=taper))  # S_0 .. S_{C-1}
    w = plan.world_size
    bounds = np.zeros((w, c + 1), dtype=np.int64)
    runs: list[list[tuple[tuple[int, int, int], ...]]] = [[] for _ in range(c)]
    for r in range(w):
        ids = plan.token_ids(r).numpy()
        n = len(ids)
        for i in range(1, c):
            bounds[r, i] = min(n, (n * int(ends[i - 1]) // int(ends[-1])) // a * a)
        bounds[r, c] = n
        bounds[r] = np.maximum.accumulate(bounds[r])
        for i in range(c):
            piece = ids[bounds[r, i] : bounds[r, i + 1]]
            cuts = [0, *(np.flatnonzero(np.diff(piece) != 1) + 1).tolist(), len(piece)]
            runs[i].append(tuple((int(piece[s]), int(s), int(e - s)) for s, e in itertools.pairwise(cuts) if e > s))
    return PipelinePlan(w, c, a, taper, bounds, tuple(tuple(x) for x in runs))
