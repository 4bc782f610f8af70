"""The parts the launcher's synthetic steps are built of (:mod:`shardattn.launch.workloads`,
:mod:`shardattn.launch.gqa_workloads`, which seed them with :func:`shardattn.workload.seeded_generator`):
the queries every step holds, values, paged block tables, token splits, where a prefill's new
tokens sit in its cache, and a rank's DCP shard of a paged cache."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from shardattn.ops.topk import DcpShard
from shardattn.plan.context import DCPLayout
from shardattn.plan.dcp_shard import shard_kv_cache

__all__ = [
    "BLOCK_SIZE",
    "SyntheticStep",
    "dcp_local_cache",
    "decode_cache",
    "new_token_slots",
    "paged",
    "split_tokens",
    "token_requests",
    "values",
]

#: Tokens per KV-cache block of the synthetic paged caches (default; the launcher passes the spec's).
BLOCK_SIZE = 64


@dataclass
class SyntheticStep:
    """What every synthetic step holds first: its queries, ``q [T, H, D]`` (all heads, all tokens)."""

    q: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.q.shape[0])


def values(shape: tuple[int, ...], gen: torch.Generator, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Synthetic activations of ``shape``: normal draws from ``gen`` scaled by 0.5, in ``dtype``."""
    return (torch.randn(shape, generator=gen, device=device) * 0.5).to(dtype)


def decode_cache(
    cached: tuple[int, ...], q_lens: tuple[int, ...], device: torch.device, gen: torch.Generator, block: int
) -> tuple[list[int], list[int], torch.Tensor, int]:
    """A decode step's lengths and paged table: (``q_lens`` as a list, KV tokens per request
    ``cached + q_len`` (drafts included), ``[B, M]`` int32 block table, total blocks)."""
    q_list = list(q_lens)
    seq_lens = [c + q for c, q in zip(cached, q_list)]
    table, blocks = paged(seq_lens, device, gen, block)
    return q_list, seq_lens, table, blocks


def paged(lengths: list[int], device: torch.device, gen: torch.Generator, block: int) -> tuple[torch.Tensor, int]:
    """A block table ``[B, M]`` int32 whose blocks are a random permutation of all blocks."""
    blocks = [math.ceil(n / block) for n in lengths]
    total = sum(blocks)
    perm = torch.randperm(total, generator=gen, device=device).to(torch.int32)
    width = max(1, max(blocks, default=1))
    table = torch.full((len(lengths), width), -1, dtype=torch.int32, device=device)
    start = 0
    for b, n in enumerate(blocks):
        table[b, :n] = perm[start : start + n]
        start += n
    return table, total


def split_tokens(total: int, requests: int) -> list[int]:
    """``total`` tokens over ``requests`` requests, the first ``total % requests`` one more."""
    base, extra = divmod(total, requests)
    return [base + (1 if r < extra else 0) for r in range(requests)]


def token_requests(counts: list[int], device: torch.device) -> torch.Tensor:
    """``[sum(counts)]`` int64 request of every token, request ``r`` holding ``counts[r]`` consecutive ones."""
    return torch.repeat_interleave(torch.arange(len(counts), device=device), torch.tensor(counts, device=device))


def new_token_slots(
    req: torch.Tensor, query_lens: list[int], prefix_lens: list[int], table: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(page [T], slot [T])`` int64: where each new token of a prefill step sits in its paged cache
    (``req [T]``: the token's request, :func:`token_requests`; request ``r``'s ``query_lens[r]`` new
    tokens follow its ``prefix_lens[r]`` cached ones in the pages ``table [B, M]`` lists, ``block``
    tokens a page)."""
    device = req.device
    starts = torch.tensor([0, *query_lens], device=device).cumsum(0)[:-1]
    pos = torch.tensor(prefix_lens, device=device)[req] + torch.arange(req.numel(), device=device) - starts[req]
    return table.long()[req, pos // block], pos % block


def dcp_local_cache(
    kv: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    table: torch.Tensor,
    seq_lens: list[int],
    shard: DcpShard,
    block: int,
) -> tuple[Any, torch.Tensor]:
    """This rank's DCP shard of a paged cache and its block table (:func:`~shardattn.plan.dcp_shard.shard_kv_cache`)."""
    world, inter, rank = shard
    return shard_kv_cache(kv, table, seq_lens, DCPLayout(world, inter), rank, page_size=block)
