"""GQA prefill over a process group by head tensor parallelism (head-TP): a local call per rank.

The math is :func:`~shardattn.ops.gqa_prefill.gqa_prefill`'s (causal over a cached prefix and the
new tokens, sinks, left window); the PCP step is :mod:`shardattn.parallel.gqa_prefill`'s.

**Head-TP** (:func:`gqa_prefill_head_tp`): rank ``r`` of ``W`` holds query heads
``[r H/W, (r+1) H/W)`` of every token and the KV heads they read (:func:`head_tp_kv_heads`:
``Hkv/W`` of them, or, when ``Hkv < W``, the one KV head its query heads share, replicated over
``W / Hkv`` ranks); the step is one local call, no collective::

    rank r: q [T, H/W, D], k, v [T, Hkv/W or 1, D], cache of those KV heads -> out [T, H/W, D]
"""

from __future__ import annotations

import functools
from typing import Literal, overload

import torch

from shardattn._checks import FLOAT_DTYPES, check_int, check_sink_logits, check_tensor
from shardattn.ops.gqa_prefill import gqa_prefill
from shardattn.parallel.comm import Comm
from shardattn.parallel.groups import GroupLike

__all__ = ["gqa_prefill_head_tp", "head_tp_kv_heads"]


@functools.lru_cache(maxsize=64)  # pure; a Runtime asks on every layer
def head_tp_kv_heads(num_heads: int, num_kv_heads: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of the KV heads rank ``rank`` holds under ``world_size``-way head-TP.

    ``num_kv_heads / world_size`` heads when ``num_kv_heads >= world_size``, else the one KV head
    its ``num_heads / world_size`` query heads read (query head ``h`` reads KV head
    ``h // (num_heads / num_kv_heads)``).

    >>> [head_tp_kv_heads(64, 8, 4, r) for r in range(4)]
    [(0, 2), (2, 4), (4, 6), (6, 8)]
    >>> [head_tp_kv_heads(64, 8, 16, r)[0] for r in (0, 1, 2, 15)]
    [0, 0, 1, 7]
    """
    h = check_int("num_heads", num_heads, minimum=1)
    hkv = check_int("num_kv_heads", num_kv_heads, minimum=1)
    w = check_int("world_size", world_size, minimum=1)
    r = check_int("rank", rank, minimum=0)
    if r >= w:
        raise ValueError(f"rank must be < world_size={w}, got {r}")
    if h % hkv:
        raise ValueError(f"num_heads ({h}) must be a multiple of num_kv_heads ({hkv})")
    if h % w:
        raise ValueError(f"num_heads ({h}) must be divisible by the {w} ranks of head-TP")
    if hkv >= w:
        if hkv % w:
            raise ValueError(f"num_kv_heads ({hkv}) must be divisible by the {w} ranks of head-TP")
        per = hkv // w
        return r * per, (r + 1) * per
    if w % hkv:
        raise ValueError(f"{w} head-TP ranks must be a multiple of num_kv_heads ({hkv}) to replicate KV heads")
    first = r * (h // w) // (h // hkv)
    return first, first + 1


@overload
def gqa_prefill_head_tp(
    q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, cu_q_lens: torch.Tensor,
    group: GroupLike | Comm, *,
    num_kv_heads: int, k_cache: torch.Tensor | None = ..., v_cache: torch.Tensor | None = ...,
    block_table: torch.Tensor | None = ..., prefix_lens: torch.Tensor | None = ..., sinks: torch.Tensor | None = ...,
    window_left: int = ..., scale: float | None = ..., return_lse: Literal[False] = ..., backend: str = ...,
) -> torch.Tensor: ...  # fmt: skip
@overload
def gqa_prefill_head_tp(
    q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, cu_q_lens: torch.Tensor,
    group: GroupLike | Comm, *,
    num_kv_heads: int, k_cache: torch.Tensor | None = ..., v_cache: torch.Tensor | None = ...,
    block_table: torch.Tensor | None = ..., prefix_lens: torch.Tensor | None = ..., sinks: torch.Tensor | None = ...,
    window_left: int = ..., scale: float | None = ..., return_lse: Literal[True], backend: str = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip
@overload
def gqa_prefill_head_tp(
    q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, cu_q_lens: torch.Tensor,
    group: GroupLike | Comm, *,
    num_kv_heads: int, k_cache: torch.Tensor | None = ..., v_cache: torch.Tensor | None = ...,
    block_table: torch.Tensor | None = ..., prefix_lens: torch.Tensor | None = ..., sinks: torch.Tensor | None = ...,
    window_left: int = ..., scale: float | None = ..., return_lse: bool = ..., backend: str = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip
def gqa_prefill_head_tp(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cu_q_lens: torch.Tensor,
    group: GroupLike | Comm,
    *,
    num_kv_heads: int,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    prefix_lens: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    window_left: int = -1,
    scale: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """GQA prefill of this rank's heads under head tensor parallelism (a local call; module docstring).

    Args:
        q: ``[T, H/W, D]`` this rank's query heads of every new token.
        k, v: ``[T, Hkv_r, D]`` its KV heads (:func:`head_tp_kv_heads`), or ``None`` both: the new
            keys already written into ``k_cache`` / ``v_cache`` (as in
            :func:`~shardattn.ops.gqa_prefill.gqa_prefill`).
        cu_q_lens: ``[B + 1]`` int32 request offsets of the new tokens.
        group: the head-TP group or a :class:`~shardattn.parallel.comm.Comm` (its rank and size only)
            (a ``ProcessGroup``, a 1-D ``DeviceMesh`` or ``(mesh, dim name)``: :mod:`~shardattn.parallel.groups`).
        num_kv_heads: ``Hkv`` of the whole model.
        k_cache, v_cache, block_table, prefix_lens: the cached prefixes, the cache holding this
            rank's KV heads (as in :func:`~shardattn.ops.gqa_prefill.gqa_prefill`).
        sinks: ``[H]`` fp32 sink logits of *all* heads (the rank's slice is taken here).
        window_left, scale, return_lse, backend: as in :func:`~shardattn.ops.gqa_prefill.gqa_prefill`.
    Returns:
        ``out [T, H/W, D]`` (and ``lse [T, H/W]`` fp32 with ``return_lse``).

    Example (every rank of a head-TP group of ``W`` runs this)::

        lo, hi = head_tp_kv_heads(64, 8, W, rank)
        out = gqa_prefill_head_tp(q[:, rank * 64 // W : (rank + 1) * 64 // W], k[:, lo:hi], v[:, lo:hi],
                                  cu_q_lens, group, num_kv_heads=8, sinks=sinks)
    """
    comm = Comm.wrap(group)
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3)
    h_local = q.shape[1]
    h = h_local * comm.world_size
    hkv = check_int("num_kv_heads", num_kv_heads, minimum=1)
    if h_local < 1:
        raise ValueError(f"q must hold at least one query head, got shape {list(q.shape)}")
    if h % hkv:  # named here: the model's head count is q's, not an argument
        raise ValueError(
            f"q's query heads ({h_local} per rank, {h} over {comm.world_size} rank{'s' * (comm.world_size > 1)}) "
            f"must be a multiple of num_kv_heads ({hkv})"
        )
    lo, hi = head_tp_kv_heads(h, hkv, comm.world_size, comm.rank)
    # the rank's KV heads: the new keys', or the cache's where they are written there already
    name, keys = ("k", k) if k is not None or k_cache is None else ("k_cache", k_cache)
    if keys is not None:
        keys = check_tensor(name, keys, ndim=3 if name == "k" else 4)
        if keys.shape[-2] != hi - lo:
            raise ValueError(
                f"{name} must hold this rank's {hi - lo} KV head(s) (KV heads [{lo}, {hi}) of {num_kv_heads}, read "
                f"by query heads [{comm.rank * h_local}, {(comm.rank + 1) * h_local}) of {h}), got shape "
                f"{list(keys.shape)}"
            )
    if sinks is not None:
        check_sink_logits(sinks, h)
        sinks = sinks[comm.rank * h_local : (comm.rank + 1) * h_local]
    return gqa_prefill(
        q, k, v, cu_q_lens, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
        prefix_lens=prefix_lens, sinks=sinks, window_left=window_left, scale=scale, return_lse=return_lse,
        backend=backend,
    )  # fmt: skip
