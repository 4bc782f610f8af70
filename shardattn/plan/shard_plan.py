"""The :class:`ShardPlan` object: which rank runs which token of a step, and the index maps.

Built by the splits in :mod:`shardattn.plan.zigzag` (zigzag, cost-balanced) and reused by
:mod:`shardattn.plan.pcp`. Everything here is host-side and deterministic.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from shardattn._checks import check_int
from shardattn.plan._common import fingerprint_arrays, to_int64_tensor

__all__ = ["ShardPlan", "build_shard_plan", "expand_ranges", "token_cost"]

_PLAN_TENSORS = (
    "query_lens",
    "prefix_lens",
    "token_offsets",
    "token_request",
    "token_position",
    "token_rank",
    "counts",
    "rank_offsets",
    "gather_index",
    "restore_index",
    "padded_gather_index",
    "padded_restore_index",
    "rank_cost",
)


def token_cost(positions: np.ndarray | torch.Tensor, topk: int) -> np.ndarray:
    """Work of each query token: ``min(p + 1, topk)`` for position ``p`` (prefix included).

    >>> token_cost(np.array([0, 1, 5, 9]), topk=4).tolist()
    [1, 2, 4, 4]
    """
    topk = check_int("topk", topk, minimum=1)
    p = positions.numpy() if isinstance(positions, torch.Tensor) else np.asarray(positions)
    return np.minimum(p.astype(np.int64) + 1, topk)


@dataclass(frozen=True, eq=False)
class ShardPlan:
    """Which rank runs which token of a batch step, and the maps between the two orders.

    All tensors are ``torch.int64`` on CPU (``.to(device)`` copies them to a device once per step).
    ``T`` = new tokens of the step, ``R`` = requests, ``W`` = world size, ``P`` = ``padded_count``.

    Attributes:
        strategy: ``"zigzag"`` or ``"cost_balanced"`` (the split that was asked for).
        world_size, align, topk: the arguments of the split.
        sharded: False when the step was below ``min_tokens`` (see ``reason``); then every rank
            runs all ``T`` tokens with its own heads and the per-rank maps hold all tokens.
        reason: why the step is (not) sharded, readable.
        query_lens: ``[R]`` new tokens per request. prefix_lens: ``[R]`` cached tokens before them.
        token_offsets: ``[R+1]`` start of each request in token order.
        token_request / token_position / token_rank: ``[T]`` request id, position (prefix
            included) and owner rank of each token (``-1`` owner when not sharded).
        counts: ``[W]`` tokens per rank. rank_offsets: ``[W+1]`` cumulative counts.
        gather_index: ``[sum(counts)]`` token id at each slot of rank-major order:
            ``x_rank_major = x[gather_index]``.
        restore_index: ``[T]`` slot of each token in rank-major order:
            ``x = x_rank_major[restore_index]`` (inverse of ``gather_index`` when sharded).
        padded_count: ``P = max(counts)``, the per-rank size of equal-split collectives.
        padded_gather_index: ``[W*P]`` token id at slot ``r*P + i`` (``-1`` for padding).
        padded_restore_index: ``[T]`` slot of each token in the padded layout.
        rank_cost: ``[W]`` summed :func:`token_cost` per rank.
        chunk_bounds: ``[R, 2W+1]`` zigzag chunk boundaries inside each request (offsets into
            its new tokens), or ``None`` for the cost-balanced split.
    """

    strategy: str
    world_size: int
    align: int
    topk: int
    sharded: bool
    reason: str
    query_lens: torch.Tensor
    prefix_lens: torch.Tensor
    token_offsets: torch.Tensor
    token_request: torch.Tensor
    token_position: torch.Tensor
    token_rank: torch.Tensor
    counts: torch.Tensor
    rank_offsets: torch.Tensor
    gather_index: torch.Tensor
    restore_index: torch.Tensor
    padded_count: int
    padded_gather_index: torch.Tensor
    padded_restore_index: torch.Tensor
    rank_cost: torch.Tensor
    chunk_bounds: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """``T``, the new tokens of the step."""
        return int(self.token_request.shape[0])

    @property
    def num_requests(self) -> int:
        return int(self.query_lens.shape[0])

    @property
    def token_balance(self) -> float:
        """``max(counts) / mean(counts)``; 1.0 is perfect (and the value for an empty step)."""
        return _ratio(self.counts)

    @property
    def cost_balance(self) -> float:
        """``max(rank_cost) / mean(rank_cost)``; 1.0 is perfect (and the value for zero work)."""
        return _ratio(self.rank_cost)

    def _check_rank(self, rank: int) -> int:
        rank = check_int("rank", rank, minimum=0)
        if rank >= self.world_size:
            raise ValueError(f"rank must be < world_size={self.world_size}, got {rank}")
        return rank

    def token_ids(self, rank: int) -> torch.Tensor:
        """``[counts[rank]]`` token ids run by ``rank``, in rank-major order (request, then position)."""
        r = self._check_rank(rank)
        return self.gather_index[int(self.rank_offsets[r]) : int(self.rank_offsets[r + 1])]

    def request_ids(self, rank: int) -> torch.Tensor:
        """``[counts[rank]]`` request id of each of ``rank``'s tokens."""
        return self.token_request[self.token_ids(rank)]

    def positions(self, rank: int) -> torch.Tensor:
        """``[counts[rank]]`` position (prefix included) of each of ``rank``'s tokens."""
        return self.token_position[self.token_ids(rank)]

    def runs(self, rank: int) -> list[tuple[int, int, int]]:
        """Contiguous runs of ``rank``'s tokens as ``(request, start_position, stop_position)``."""
        req = self.request_ids(rank).numpy()
        pos = self.positions(rank).numpy()
        if req.size == 0:
            return []
        brk = np.flatnonzero((np.diff(req) != 0) | (np.diff(pos) != 1)) + 1
        starts = np.concatenate([[0], brk])
        stops = np.concatenate([brk, [req.size]])
        return [(int(req[a]), int(pos[a]), int(pos[b - 1]) + 1) for a, b in zip(starts, stops)]

    def to(self, device: torch.device | str) -> ShardPlan:
        """A copy whose tensors live on ``device`` (one host-to-device copy per tensor)."""
        moved = {name: getattr(self, name).to(device) for name in _PLAN_TENSORS}
        if self.chunk_bounds is not None:
            moved["chunk_bounds"] = self.chunk_bounds.to(device)
        return dataclasses.replace(self, **moved)

    def to_torch(self) -> dict[str, torch.Tensor]:
        """The index maps as a dict of ``torch.int64`` tensors (they are stored as tensors)."""
        out = {name: getattr(self, name) for name in _PLAN_TENSORS}
        if self.chunk_bounds is not None:
            out["chunk_bounds"] = self.chunk_bounds
        return out

    def fingerprint(self) -> int:
        """Stable 63-bit hash of the plan's contents; equal on every rank that planned the same step."""
        tensors = [getattr(self, n) for n in _PLAN_TENSORS]
        if self.chunk_bounds is not None:
            tensors.append(self.chunk_bounds)
        head = (self.strategy, self.world_size, self.align, self.topk, self.sharded, self.padded_count)
        return fingerprint_arrays("ShardPlan", *head, *tensors)

    def table(self) -> list[dict[str, object]]:
        """One row per rank: tokens, cost, and the runs it holds (for reports)."""
        return [
            {
                "rank": r,
                "tokens": int(self.counts[r]),
                "cost": int(self.rank_cost[r]),
                "runs": self.runs(r),
            }
            for r in range(self.world_size)
        ]

    def __repr__(self) -> str:
        return (
            f"ShardPlan(strategy={self.strategy!r}, world_size={self.world_size}, sharded={self.sharded}, "
            f"tokens={self.num_tokens}, requests={self.num_requests}, counts={self.counts.tolist()}, "
            f"padded_count={self.padded_count}, token_balance={self.token_balance:.3f}, "
            f"cost_balance={self.cost_balance:.3f}, reason={self.reason!r})"
        )


def _ratio(values: torch.Tensor) -> float:
    total = int(values.sum())
    if total == 0:
        return 1.0
    return float(int(values.max()) * values.numel() / total)


def expand_ranges(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """Concatenate ``arange(starts[i], stops[i])`` for all i (vectorised)."""
    lengths = np.maximum(stops - starts, 0)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    seg_start = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + (np.arange(total, dtype=np.int64) - seg_start)


def build_shard_plan(
    strategy: str,
    lens: np.ndarray,
    prefix: np.ndarray,
    w: int,
    a: int,
    k: int,
    sharded: bool,
    reason: str,
    rank_tokens: list[np.ndarray],
    chunk_bounds: np.ndarray | None,
) -> ShardPlan:
    """A :class:`ShardPlan` from the split a strategy chose (the planners of :mod:`shardattn.plan.zigzag`).

    Args:
        strategy, reason: the plan's name and why it is (or is not) sharded.
        lens, prefix: ``[B]`` int64 new and cached tokens per request.
        w, a, k: world size, token alignment (the union's group size) and top-k.
        sharded: False for a head-TP plan (every rank holds every token; ``rank_tokens`` then
            lists all tokens for each rank).
        rank_tokens: ``w`` int64 arrays, the step's token ids each rank attends, in its order.
        chunk_bounds: optional ``[B, 2w + 1]`` int64 zigzag chunk boundaries inside each request
            (:func:`~shardattn.plan.zigzag.zigzag_chunk_bounds`).
    """
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    t = int(offsets[-1])
    tok_req = np.repeat(np.arange(lens.size, dtype=np.int64), lens)
    tok_pos = np.arange(t, dtype=np.int64) - offsets[tok_req] + prefix[tok_req]
    counts = np.array([x.size for x in rank_tokens], dtype=np.int64)
    rank_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    gather = np.concatenate(rank_tokens) if rank_tokens else np.zeros(0, np.int64)
    gather = gather.astype(np.int64)
    padded = int(counts.max()) if counts.size else 0
    padded_gather = np.full(w * padded, -1, dtype=np.int64)
    slot_in_rank = np.arange(gather.size, dtype=np.int64) - np.repeat(rank_offsets[:-1], counts)
    rank_of_slot = np.repeat(np.arange(w, dtype=np.int64), counts)
    padded_slot = rank_of_slot * padded + slot_in_rank
    padded_gather[padded_slot] = gather
    cost = token_cost(tok_pos, k)
    if sharded:
        restore = np.empty(t, np.int64)
        restore[gather] = np.arange(gather.size, dtype=np.int64)
        padded_restore = np.empty(t, np.int64)
        padded_restore[gather] = padded_slot
        tok_rank = np.empty(t, np.int64)
        tok_rank[gather] = rank_of_slot
        rank_cost = np.array([int(cost[x].sum()) for x in rank_tokens], dtype=np.int64)
    else:
        restore = np.arange(t, dtype=np.int64)  # rank 0's copy
        padded_restore = np.arange(t, dtype=np.int64)
        tok_rank = np.full(t, -1, np.int64)
        rank_cost = np.full(w, int(cost.sum()), dtype=np.int64)
    return ShardPlan(
        strategy=strategy,
        world_size=w,
        align=a,
        topk=k,
        sharded=sharded,
        reason=reason,
        query_lens=to_int64_tensor(lens),
        prefix_lens=to_int64_tensor(prefix),
        token_offsets=to_int64_tensor(offsets),
        token_request=to_int64_tensor(tok_req),
        token_position=to_int64_tensor(tok_pos),
        token_rank=to_int64_tensor(tok_rank),
        counts=to_int64_tensor(counts),
        rank_offsets=to_int64_tensor(rank_offsets),
        gather_index=to_int64_tensor(gather),
        restore_index=to_int64_tensor(restore),
        padded_count=padded,
        padded_gather_index=to_int64_tensor(padded_gather),
        padded_restore_index=to_int64_tensor(padded_restore),
        rank_cost=to_int64_tensor(rank_cost),
        chunk_bounds=None if chunk_bounds is None else to_int64_tensor(chunk_bounds),
    )
