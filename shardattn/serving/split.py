"""How a pool step's queries are split over the ranks, and the ranks' outputs put back.

Every step but a PCP prefill splits the heads: rank ``r`` gets heads ``r*H/W .. (r+1)*H/W`` of
every query token and returns those heads. A PCP prefill (``pcp`` mode) splits the tokens:
rank ``r`` gets every head of its zigzag tokens (the plan every rank's Runtime makes from the
same lengths) and returns those tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shardattn.plan.pcp import pcp_plan

__all__ = ["assemble", "pcp_token_ids", "query_parts"]


def pcp_token_ids(counts: Sequence[int], starts: Sequence[int], world_size: int) -> list[torch.Tensor]:
    """``[T_r]`` int64 step-token ids (token order) of each rank's PCP prefill, sparse MLA or GQA:
    the plan's zigzag split (the top-k changes only the plan's cost figures, not the split).

    >>> [t.tolist() for t in pcp_token_ids([8], [0], 2)]
    [[0, 1, 6, 7], [2, 3, 4, 5]]
    """
    plan = pcp_plan(list(counts), world_size, prefix_lens=list(starts))
    return [plan.shard.token_ids(r) for r in range(world_size)]


def query_parts(
    q: torch.Tensor, world_size: int, heads_per_rank: int, token_ids: list[torch.Tensor] | None
) -> list[torch.Tensor]:
    """Each rank's part of ``q [T, H, D]``: ``[T, H/W, D]`` (its heads) or ``[T_r, H, D]`` (its tokens)."""
    if token_ids is not None:
        return [q.index_select(0, ids) for ids in token_ids]
    h = heads_per_rank
    return [q[:, r * h : (r + 1) * h] for r in range(world_size)]


def assemble(
    results: Sequence[tuple[torch.Tensor, Any]],
    token_ids: list[torch.Tensor] | None,
    tokens: int,
    return_lse: bool,
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every rank's ``(out, lse)`` -> ``(out [T, H, Dv], lse [T, H] fp32 or None)``, token order
    (one copy of each; ``out``: an optional destination, heads split only)."""
    if token_ids is None:  # each rank returned its heads of every token
        out = torch.cat([o for o, _ in results], dim=1, out=out)
        return out, torch.cat([s for _, s in results], dim=1) if return_lse else None
    first = results[0][0]
    out = first.new_empty(tokens, *first.shape[1:])
    lse = torch.empty(tokens, first.shape[1], dtype=torch.float32) if return_lse else None
    for ids, (o, s) in zip(token_ids, results):  # each rank returned every head of its tokens
        out[ids] = o
        if lse is not None:
            lse[ids] = s
    return out, lse
