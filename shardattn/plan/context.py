"""Decode context parallelism (DCP): where each KV token lives, and index translation.

Under DCP the KV cache of every request is spread over ``N`` ranks in blocks of ``I``
(``interleave``) tokens, round robin. KV token ``t`` of a request lives on rank
``(t // I) % N`` at local index ``(t // (N*I)) * I + t % I``. ``N = 2, I = 2``::

    global t   0 1 2 3 4 5 6 7 8 9
    owner      0 0 1 1 0 0 1 1 0 0
    local      0 1 0 1 2 3 2 3 4 5

Each rank attends over its own rows, returns a partial output with its log-sum-exp, and a
collector merges the partials. The functions below are vectorised torch ops that run on any
device and never synchronise with the GPU (no ``.item()``, no data-dependent shapes): they are
called inside the parallel steps and inside CUDA graphs. :class:`DCPLayout` bundles them for a
fixed ``(world_size, interleave)`` and adds host-side helpers.

Speculative decode (``q_len > 1``): query ``j`` of a request with ``L`` KV tokens (its own
new tokens included) and ``Q`` queries sees the global tokens ``< L - Q + j + 1`` (causal), or
all ``L`` tokens (non-causal drafts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardattn._checks import check_bool, check_int, check_same_device, check_tensor
from shardattn.plan._common import MAX_TOKENS, check_world_size

__all__ = [
    "DCPLayout",
    "causal_token_seq_lens",
    "dcp_causal_local_lens",
    "dcp_global_index",
    "dcp_local_index",
    "dcp_local_seq_lens",
    "dcp_owner",
    "dcp_translate_topk",
]

_INT_DTYPES = (torch.int32, torch.int64)


def _check_layout(world_size: object, interleave: object) -> tuple[int, int]:
    """``(N, I)`` checked: ``N * I`` (one round of blocks) at most :data:`MAX_TOKENS`, so the layout's
    arithmetic on int32 positions stays in int32."""
    n = check_world_size(world_size)
    i = check_int("interleave", interleave, minimum=1)
    if n * i > MAX_TOKENS:
        raise ValueError(
            f"interleave must be <= {MAX_TOKENS // n:,} at world_size={n} (world_size * interleave positions are "
            f"int32), got {i:,}"
        )
    return n, i


def _check_rank(rank: object, world_size: int) -> int:
    rank = check_int("rank", rank, minimum=0)
    if rank >= world_size:
        raise ValueError(f"rank must be < world_size={world_size}, got {rank}")
    return rank


def dcp_owner(positions: torch.Tensor, world_size: int, interleave: int = 1) -> torch.Tensor:
    """Owner rank ``(t // I) % N`` of each global KV position (``>= 0``); same shape and dtype.

    >>> dcp_owner(torch.arange(10), 2, 2).tolist()
    [0, 0, 1, 1, 0, 0, 1, 1, 0, 0]
    """
    n, i = _check_layout(world_size, interleave)
    check_tensor("positions", positions, dtypes=_INT_DTYPES)
    return torch.div(positions, i, rounding_mode="floor") % n


def dcp_local_index(positions: torch.Tensor, world_size: int, interleave: int = 1) -> torch.Tensor:
    """Local index ``(t // (N*I)) * I + t % I`` of each global KV position on its owner rank.

    >>> dcp_local_index(torch.arange(10), 2, 2).tolist()
    [0, 1, 0, 1, 2, 3, 2, 3, 4, 5]
    """
    n, i = _check_layout(world_size, interleave)
    check_tensor("positions", positions, dtypes=_INT_DTYPES)
    return torch.div(positions, n * i, rounding_mode="floor") * i + positions % i


def dcp_global_index(local: torch.Tensor, rank: int, world_size: int, interleave: int = 1) -> torch.Tensor:
    """Global position of local row ``local`` of ``rank`` (inverse of :func:`dcp_local_index`).

    ``global = (local // I) * N * I + rank * I + local % I``.

    >>> dcp_global_index(torch.arange(6), 1, 2, 2).tolist()
    [2, 3, 6, 7, 10, 11]
    """
    n, i = _check_layout(world_size, interleave)
    r = _check_rank(rank, n)
    check_tensor("local", local, dtypes=_INT_DTYPES)
    return torch.div(local, i, rounding_mode="floor") * (n * i) + r * i + local % i


def dcp_local_seq_lens(seq_lens: torch.Tensor, rank: int, world_size: int, interleave: int = 1) -> torch.Tensor:
    """How many of the global tokens ``[0, L)`` rank ``rank`` holds, for every ``L`` in ``seq_lens``.

    ``(L // (N*I)) * I + clamp(L % (N*I) - rank * I, 0, I)``; rank 0 holds the most. Negative
    lengths (padding) give 0. Same shape and dtype as ``seq_lens``.

    >>> dcp_local_seq_lens(torch.tensor([0, 1, 3, 10]), 1, 2, 2).tolist()
    [0, 0, 1, 4]
    """
    n, i = _check_layout(world_size, interleave)
    r = _check_rank(rank, n)
    check_tensor("seq_lens", seq_lens, dtypes=_INT_DTYPES)
    lens = seq_lens.clamp(min=0)
    full = torch.div(lens, n * i, rounding_mode="floor") * i
    return full + (lens % (n * i) - r * i).clamp(min=0, max=i)


def causal_token_seq_lens(
    seq_lens: torch.Tensor, qo_indptr: torch.Tensor, num_tokens: int, *, causal: bool = True
) -> torch.Tensor:
    """Global KV tokens visible to each query token of a (speculative) decode batch.

    Args:
        seq_lens: ``[B]`` int32/int64, KV tokens per request (the step's new tokens included).
        qo_indptr: ``[B+1]`` int32/int64, query offsets (request ``b`` owns query tokens
            ``qo_indptr[b]:qo_indptr[b+1]``); zero-length (padded) requests are allowed.
        num_tokens: ``T``, the host-known number of query tokens (usually ``qo_indptr[-1]``;
            tokens at or past ``qo_indptr[-1]`` are padding and see 0 tokens).
        causal: query ``j`` of a request with ``Q`` queries sees ``L - Q + j + 1`` tokens;
            ``False`` (non-causal drafts): every query sees all ``L``.

    Returns:
        ``[T]`` visible lengths, dtype of ``seq_lens``, on its device. No GPU synchronisation.

    >>> causal_token_seq_lens(torch.tensor([5, 9]), torch.tensor([0, 1, 4]), 4).tolist()
    [5, 7, 8, 9]
    """
    check_tensor("seq_lens", seq_lens, dtypes=_INT_DTYPES, ndim=1)
    b = seq_lens.shape[0]
    check_tensor("qo_indptr", qo_indptr, dtypes=_INT_DTYPES, shape=[b + 1])
    check_same_device(seq_lens=seq_lens, qo_indptr=qo_indptr)
    t_count = check_int("num_tokens", num_tokens, minimum=0)
    check_bool("causal", causal)
    dev = seq_lens.device
    if b == 0:
        return torch.zeros(t_count, dtype=seq_lens.dtype, device=dev)
    ends = qo_indptr[1:].to(torch.int64).contiguous()
    tok = torch.arange(t_count, dtype=torch.int64, device=dev)
    req = torch.searchsorted(ends, tok, right=True)  # requests whose end is <= t
    valid = req < b
    req = req.clamp(max=b - 1)
    lens = seq_lens.to(torch.int64)[req]
    if causal:
        start = qo_indptr.to(torch.int64)[req]
        q = ends[req] - start
        vis = lens - q + (tok - start) + 1
    else:
        vis = lens
    return torch.where(valid, vis.clamp(min=0), torch.zeros_like(vis)).to(seq_lens.dtype)


def dcp_causal_local_lens(
    seq_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    num_tokens: int,
    rank: int,
    world_size: int,
    interleave: int = 1,
    *,
    causal: bool = True,
) -> torch.Tensor:
    """``[T]`` local KV length per query token on ``rank`` (speculative decode under DCP).

    :func:`causal_token_seq_lens` followed by :func:`dcp_local_seq_lens`.

    >>> dcp_causal_local_lens(torch.tensor([9]), torch.tensor([0, 3]), 3, 0, 2, 2).tolist()
    [4, 4, 5]
    """
    vis = causal_token_seq_lens(seq_lens, qo_indptr, num_tokens, causal=causal)
    return dcp_local_seq_lens(vis, rank, world_size, interleave)


def dcp_translate_topk(
    topk_positions: torch.Tensor,
    rank: int,
    world_size: int,
    interleave: int = 1,
    *,
    seq_lens: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
) -> torch.Tensor:
    """Turn request-global top-k positions into ``rank``'s local positions.

    Args:
        topk_positions: ``[T, K]`` int32/int64 global KV positions of each query's top-k
            (``-1`` or any negative value = invalid, anywhere in a row).
        rank, world_size, interleave: the DCP layout.
        seq_lens: optional ``[T]`` visible KV tokens per query; positions ``>= seq_lens[t]`` are
            invalid (out of range).
        topk_length: optional ``[T]``; columns ``>= topk_length[t]`` are invalid.

    Returns:
        ``[T, K]`` same dtype: the local index where ``rank`` owns the position, ``-1`` where
        another rank owns it or the entry is invalid. No GPU synchronisation.

    >>> dcp_translate_topk(torch.tensor([[0, 2, 5, -1, 9]]), 0, 2, 2, seq_lens=torch.tensor([9])).tolist()
    [[0, -1, 3, -1, -1]]
    """
    n, i = _check_layout(world_size, interleave)
    r = _check_rank(rank, n)
    check_tensor("topk_positions", topk_positions, dtypes=_INT_DTYPES, ndim=2)
    t = topk_positions.shape[0]
    valid = topk_positions >= 0
    if seq_lens is not None:
        check_tensor("seq_lens", seq_lens, dtypes=_INT_DTYPES, shape=[t])
        check_same_device(topk_positions=topk_positions, seq_lens=seq_lens)
        valid &= topk_positions < seq_lens[:, None]  # compared in the wider dtype: no wrap of int64 lengths
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtypes=_INT_DTYPES, shape=[t])
        check_same_device(topk_positions=topk_positions, topk_length=topk_length)
        col = torch.arange(topk_positions.shape[1], device=topk_positions.device)
        valid &= col[None, :] < topk_length.to(col.dtype)[:, None]
    pos = topk_positions.clamp(min=0)
    owned = valid & (dcp_owner(pos, n, i) == r)
    local = dcp_local_index(pos, n, i)
    return torch.where(owned, local, torch.full_like(local, -1))


@dataclass(frozen=True)
class DCPLayout:
    """The DCP KV layout for ``world_size`` ranks and ``interleave`` tokens per block.

    Methods take tensors (any device, no GPU sync) unless they say "host". ``rank`` is an int.

    >>> lay = DCPLayout(2, 2)
    >>> lay.owner(torch.tensor([0, 2, 5])).tolist(), lay.local_index(torch.tensor([0, 2, 5])).tolist()
    ([0, 1, 0], [0, 0, 3])
    >>> lay.local_len(10, 1), lay.max_local_len(9)
    (4, 5)
    """

    world_size: int
    interleave: int = 1

    def __post_init__(self) -> None:
        _check_layout(self.world_size, self.interleave)

    def owner(self, positions: torch.Tensor) -> torch.Tensor:
        """The rank holding each global position (any int tensor; same shape)."""
        return dcp_owner(positions, self.world_size, self.interleave)

    def local_index(self, positions: torch.Tensor) -> torch.Tensor:
        """Each global position's index in its owner's local order (same shape)."""
        return dcp_local_index(positions, self.world_size, self.interleave)

    def global_index(self, local: torch.Tensor, rank: int) -> torch.Tensor:
        """The global positions of ``rank``'s local indices ``local`` (the inverse of :meth:`local_index`)."""
        return dcp_global_index(local, rank, self.world_size, self.interleave)

    def local_seq_lens(self, seq_lens: torch.Tensor, rank: int) -> torch.Tensor:
        """``[B]`` tokens of each request's ``[0, seq_len)`` that ``rank`` holds."""
        return dcp_local_seq_lens(seq_lens, rank, self.world_size, self.interleave)

    def causal_local_lens(
        self, seq_lens: torch.Tensor, qo_indptr: torch.Tensor, num_tokens: int, rank: int, *, causal: bool = True
    ) -> torch.Tensor:
        """``[num_tokens]`` local KV length each query token sees on ``rank``: its request's
        (``qo_indptr [B + 1]``) ``seq_lens`` cut causally at the token's own position (``causal``;
        else the whole request)."""
        return dcp_causal_local_lens(
            seq_lens, qo_indptr, num_tokens, rank, self.world_size, self.interleave, causal=causal
        )

    def translate_topk(
        self,
        topk_positions: torch.Tensor,
        rank: int,
        *,
        seq_lens: torch.Tensor | None = None,
        topk_length: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``topk_positions [T, K]`` (global, request-local) as ``rank``'s local positions; the
        positions another rank holds, past ``seq_lens`` or past ``topk_length`` become ``-1``."""
        return dcp_translate_topk(
            topk_positions,
            rank,
            self.world_size,
            self.interleave,
            seq_lens=seq_lens,
            topk_length=topk_length,
        )

    def local_len(self, seq_len: int, rank: int) -> int:
        """Host: tokens of ``[0, seq_len)`` held by ``rank``."""
        seq_len = check_int("seq_len", seq_len, minimum=0)
        r = _check_rank(rank, self.world_size)
        n, i = self.world_size, self.interleave
        return (seq_len // (n * i)) * i + min(max(seq_len % (n * i) - r * i, 0), i)

    def max_local_len(self, seq_len: int) -> int:
        """Host: the largest local length over ranks (rank 0's), e.g. for sizing a local cache."""
        return self.local_len(seq_len, 0)

    def owned_positions(self, seq_len: int, rank: int) -> torch.Tensor:
        """Host: ``[local_len]`` int64 global positions of ``rank``'s rows of ``[0, seq_len)``, ascending."""
        n_local = self.local_len(seq_len, rank)
        return self.global_index(torch.arange(n_local, dtype=torch.int64), rank)
