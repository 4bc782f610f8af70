"""Synthetic GQA steps for the launcher: decode (speculative drafts, sinks) and prefill after cached
prefixes, over paged caches built from one seed on every rank, global and a rank's DCP shard."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardattn.launch.workload_parts import (
    BLOCK_SIZE,
    SyntheticStep,
    dcp_local_cache,
    decode_cache,
    new_token_slots,
    paged,
    split_tokens,
    token_requests,
    values,
)
from shardattn.ops.topk import DcpShard
from shardattn.workload import seeded_generator

__all__ = ["GQADecodeStep", "GQAPrefillStep", "build_gqa_decode", "build_gqa_prefill"]


@dataclass
class GQADecodeStep(SyntheticStep):
    """One GQA decode step over a paged cache (speculative drafts, sinks), global and DCP-local.

    Attributes:
        q: ``[T, Hq, d]``. k_cache, v_cache: ``[pages, BLOCK_SIZE, Hkv, d]``. block_table:
        ``[B, M]`` int32. seq_lens: ``[B]`` int32 (drafts included). cu_q_lens: ``[B+1]`` int32.
        sinks: ``[Hq]`` fp32 or None. local_*: this rank's DCP shard (``local_seq_lens`` are the
        local key counts; the drafts' causal limits come from the global lengths).
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    cu_q_lens: torch.Tensor
    sinks: torch.Tensor | None
    local_k_cache: torch.Tensor
    local_v_cache: torch.Tensor
    local_block_table: torch.Tensor


def build_gqa_decode(
    *,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    sinks: bool,
    requests: int,
    cached: tuple[int, ...],
    q_lens: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    shard: DcpShard,
    block_size: int = BLOCK_SIZE,
) -> GQADecodeStep:
    """Build a GQA decode step: ``requests`` requests of ``cached + q_len`` KV tokens."""
    gen = seeded_generator(device, seed + 11)
    q_list, seq, table, blocks = decode_cache(cached, q_lens, device, gen, block_size)
    k = values((blocks, block_size, kv_heads, head_dim), gen, device, dtype)
    v = values((blocks, block_size, kv_heads, head_dim), gen, device, dtype)
    q = values((int(sum(q_list)), q_heads, head_dim), gen, device, dtype)
    s = torch.randn(q_heads, generator=gen, device=device).float() if sinks else None
    (local_k, local_v), local_table = dcp_local_cache((k, v), table, seq, shard, block_size)
    cu = torch.tensor([0, *q_list], dtype=torch.int32, device=device).cumsum(0).to(torch.int32)
    return GQADecodeStep(
        q,
        k,
        v,
        table,
        torch.tensor(seq, dtype=torch.int32, device=device),
        cu,
        s,
        local_k,
        local_v,
        local_table,
    )


@dataclass
class GQAPrefillStep(SyntheticStep):
    """One GQA prefill step, global: new tokens after cached prefixes in a paged cache.

    Attributes:
        q: ``[T, Hq, d]``; k, v: ``[T, Hkv, d]`` the new tokens' keys and values. k_cache, v_cache:
        ``[pages, block, Hkv, d]`` holding every request's prefix and then its new keys (what an
        engine's cache write leaves before attention). block_table: ``[B, M]`` int32.
        query_lens, prefix_lens: per request. sinks: ``[Hq]`` fp32 or None.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    query_lens: list[int]
    prefix_lens: list[int]
    sinks: torch.Tensor | None


def build_gqa_prefill(
    *,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    sinks: bool,
    tokens: int,
    requests: int,
    cached: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    block_size: int = BLOCK_SIZE,
) -> GQAPrefillStep:
    """Build a GQA prefill step: ``tokens`` new tokens over ``requests`` requests after ``cached`` ones."""
    gen = seeded_generator(device, seed + 13)
    query_lens, prefix_lens = split_tokens(tokens, requests), list(cached)
    seq = [p + n for p, n in zip(prefix_lens, query_lens)]
    table, blocks = paged(seq, device, gen, block_size)
    k_cache = values((blocks, block_size, kv_heads, head_dim), gen, device, dtype)
    v_cache = values((blocks, block_size, kv_heads, head_dim), gen, device, dtype)
    q = values((tokens, q_heads, head_dim), gen, device, dtype)
    page, slot = new_token_slots(token_requests(query_lens, device), query_lens, prefix_lens, table, block_size)
    k, v = k_cache[page, slot], v_cache[page, slot]  # the new tokens' own keys, already in the cache
    s = torch.randn(q_heads, generator=gen, device=device).float() if sinks else None
    return GQAPrefillStep(q, k, v, k_cache, v_cache, table, query_lens, prefix_lens, s)
