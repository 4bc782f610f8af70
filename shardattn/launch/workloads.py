"""Synthetic sparse-MLA steps for the launcher: the same global tensors on every rank, from one seed
(GQA steps: :mod:`shardattn.launch.gqa_workloads`; the parts both use:
:mod:`shardattn.launch.workload_parts`).

Every rank builds the whole step (queries of all heads, the KV cache, the top-k) from the same
seed on its own device, then takes its share: its head slice for tensor-parallel prefill, its
DCP shard of the KV cache for decode. Rank 0 also keeps the global tensors to compute the
single-process reference.

Top-k (sparse MLA): query token ``t`` of request ``r`` at position ``p`` (cached prefix included)
picks ``min(topk, p + 1)`` distinct request-local positions in ``[0, p]`` (non-causal decode
drafts: in ``[0, L)``), neighbouring queries overlapping like a DSA indexer's
(:func:`shardattn.workload.synthetic_topk`), or the positions come from a recorded dump
(:func:`shardattn.workload.load_topk_dump`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardattn.launch.workload_parts import (
    BLOCK_SIZE,
    SyntheticStep,
    dcp_local_cache,
    decode_cache,
    paged,
    split_tokens,
    token_requests,
    values,
)
from shardattn.ops.topk import DcpShard, convert_topk
from shardattn.workload import PRESETS, Overlap, seeded_generator, synthetic_topk

__all__ = ["BLOCK_SIZE", "DecodeStep", "PrefillStep", "build_decode", "build_prefill", "overlap_model", "request_topk"]


def overlap_model(name_or_rho: str) -> str | Overlap:
    """``--overlap``: a :data:`shardattn.workload.PRESETS` name, or a number in ``[0, 1]`` used as ``rho``.

    >>> overlap_model("dsa"), overlap_model("0.5").rho
    ('dsa', 0.5)
    """
    if name_or_rho in PRESETS:
        return name_or_rho
    try:
        rho = float(name_or_rho)
    except ValueError:
        choices = sorted(PRESETS)
        raise ValueError(f"overlap must be one of {choices} or a number in [0, 1], got {name_or_rho!r}") from None
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"overlap as a number must be in [0, 1], got {rho}")
    return Overlap(rho=rho, drift=PRESETS["dsa"].drift)


def request_topk(
    starts: list[int],
    counts: list[int],
    topk: int,
    *,
    overlap: str | Overlap,
    seed: int,
    device: torch.device,
    limits: list[int] | None = None,
) -> torch.Tensor:
    """Top-k positions of the query tokens of several requests, concatenated request by request.

    Request ``r`` has ``counts[r]`` consecutive queries, the first at position ``starts[r]``;
    each picks among the positions up to its own (causal). ``limits[r]`` (optional) further
    invalidates positions ``>= limits[r]``. Seeded per request (``seed + r``).

    Returns:
        ``[sum(counts), topk]`` int32, ``-1`` padded.
    """
    parts = []
    for r, (start, n) in enumerate(zip(starts, counts)):
        pos = synthetic_topk(n, topk, start_position=start, overlap=overlap, seed=seed + r, device=device)
        if limits is not None:
            pos = torch.where(pos < limits[r], pos, torch.full_like(pos, -1))
        parts.append(pos)
    if not parts:
        return torch.empty(0, topk, dtype=torch.int32, device=device)
    return torch.cat(parts)


@dataclass
class PrefillStep(SyntheticStep):
    """One sparse-MLA prefill step, global (all heads, all tokens).

    Attributes:
        q: ``[T, H, D]``. kv: ``[R_kv, D]`` paged KV rows. rows: ``[T, K]`` int32 global rows.
        positions: ``[T, K]`` int32 request-local top-k positions (``-1`` invalid).
        req_ids: ``[T]`` int32. block_table: ``[B, M]`` int32. query_lens: ``[B]`` new tokens;
        prefix_lens: ``[B]`` cached tokens; topk_length: ``[T]`` int32 or None.
    """

    kv: torch.Tensor
    rows: torch.Tensor
    positions: torch.Tensor
    req_ids: torch.Tensor
    block_table: torch.Tensor
    query_lens: list[int]
    prefix_lens: list[int]
    topk_length: torch.Tensor | None
    topk: int


def build_prefill(
    *,
    heads: int,
    head_dim: int,
    tokens: int,
    requests: int,
    cached: tuple[int, ...],
    topk: int,
    overlap: str | Overlap,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    recorded: tuple[torch.Tensor, torch.Tensor] | None = None,
    block_size: int = BLOCK_SIZE,
) -> PrefillStep:
    """Build a prefill step (identical on every rank for the same arguments).

    With ``recorded`` (``(topk [T, K], valid [T])`` from :func:`~shardattn.workload.load_topk_dump`)
    the step is one request of ``T`` new tokens after ``cached[0]`` cached ones, with those
    positions; ``tokens``, ``requests`` and ``topk`` are taken from it.
    """
    gen = seeded_generator(device, seed)
    if recorded is not None:
        positions, valid = (t.to(device) for t in recorded)
        tokens, topk = positions.shape
        query_lens, prefix_lens = [tokens], [cached[0]]
        topk_length = valid
        kv_lens = [max(prefix_lens[0] + tokens, int(positions.max()) + 1 if positions.numel() else 0)]
    else:
        query_lens, prefix_lens = split_tokens(tokens, requests), list(cached)
        kv_lens = [c + n for c, n in zip(prefix_lens, query_lens)]
        topk_length = None
        positions = request_topk(prefix_lens, query_lens, topk, overlap=overlap, seed=seed + 1, device=device)
    req = token_requests(query_lens, device)
    table, blocks = paged(kv_lens, device, gen, block_size)
    kv = values((blocks * block_size, head_dim), gen, device, dtype)
    q = values((tokens, heads, head_dim), gen, device, dtype)
    req32 = req.to(torch.int32)
    rows, _ = convert_topk(
        positions,
        req32,
        table,
        block_size=block_size,
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
        topk_length=topk_length,
    )
    return PrefillStep(q, kv, rows, positions, req32, table, query_lens, prefix_lens, topk_length, topk)


@dataclass
class DecodeStep(SyntheticStep):
    """One sparse-MLA decode step (speculative drafts allowed), global, with this rank's DCP shard.

    Attributes:
        q: ``[T, H, D]`` (``T = sum(q_lens)``). kv: ``[R_kv, D]`` the global paged KV.
        rows: ``[T, K]`` int32 global rows (for the reference). positions: ``[T, K]`` int32
        request-global top-k positions. req_ids: ``[T]`` int32. block_table: ``[B, M]`` int32.
        seq_lens: ``[B]`` int32 KV tokens per request, drafts included. q_lens: per request.
        local_kv, local_table: this rank's DCP shard of the cache (local positions) and its
        block table.
    """

    kv: torch.Tensor
    rows: torch.Tensor
    positions: torch.Tensor
    req_ids: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    q_lens: list[int]
    local_kv: torch.Tensor
    local_table: torch.Tensor
    topk: int


def build_decode(
    *,
    heads: int,
    head_dim: int,
    requests: int,
    cached: tuple[int, ...],
    q_lens: tuple[int, ...],
    topk: int,
    overlap: str | Overlap,
    causal: bool,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    shard: DcpShard,
    block_size: int = BLOCK_SIZE,
) -> DecodeStep:
    """Build a sparse-MLA decode step: ``requests`` requests of ``cached + q_len`` KV tokens."""
    gen = seeded_generator(device, seed + 7)
    q_list, seq_lens, table, blocks = decode_cache(cached, q_lens, device, gen, block_size)
    req = torch.repeat_interleave(torch.arange(requests, device=device), torch.tensor(q_list, device=device))
    # causal: query j of a request of L tokens and Q queries sits at L - Q + j; non-causal: every
    # query may pick any of the L tokens (drawn as if at the last position)
    starts = [n - q for n, q in zip(seq_lens, q_list)] if causal else [n - 1 for n in seq_lens]
    positions = request_topk(starts, q_list, topk, overlap=overlap, seed=seed + 8, device=device, limits=seq_lens)
    kv = values((blocks * block_size, head_dim), gen, device, dtype)
    q = values((int(sum(q_list)), heads, head_dim), gen, device, dtype)
    req32 = req.to(torch.int32)
    lens32 = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    rows, _ = convert_topk(positions, req32, table, block_size=block_size, seq_lens=lens32)
    local_kv, local_table = dcp_local_cache(kv, table, seq_lens, shard, block_size)
    return DecodeStep(q, kv, rows, positions, req32, table, lens32, q_list, local_kv, local_table, topk)
