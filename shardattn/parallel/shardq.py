"""ShardQ prefill: turn head sharding into token sharding for sparse MLA, and back.

Under tensor parallelism every rank holds ``H / W`` heads of every query token and the whole
(replicated) KV cache. A sparse MLA kernel tiles 64 or 128 query rows per step, so 8 or 16 heads
per rank leave most of each tile as padding. ShardQ moves queries so each rank runs *every* head
for a zigzag slice of the step's tokens (:func:`~shardattn.plan.zigzag_split`), then moves the
outputs back::

    rank r: q [T, H/W, D] (all tokens, its heads)
        -- all-to-all #1 -->  q [T_r, H, D] (its zigzag tokens, all heads)
        -- local sparse attention over the replicated KV, rows[tokens of r] -->
           out [T_r, H, Dv], lse [T_r, H]
        -- all-to-all #2 (out and lse packed as bytes in one message) -->
           out [T, H/W, Dv], lse [T, H/W] in token order

Exactly two all-to-alls per sharded step (plus, with ``check=True``, one small all-gather that
makes the ranks agree on the plan and shapes first). A plan that is not sharded (fewer tokens
than ``min_tokens``) runs head-TP locally with no collective at all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from shardattn._checks import FLOAT_DTYPES, INDEX_DTYPES, check_int, check_same_device, check_scale, check_tensor
from shardattn.kernels.sparse_mla import check_head_dim, sparse_mla_attention
from shardattn.parallel.comm import Comm, pack_rows, packed_nbytes, stable_fingerprint, unpack_rows
from shardattn.plan.zigzag import ShardPlan

__all__ = ["shardq_prefill"]

AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _check_inputs(
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    plan: ShardPlan,
    comm: Comm,
    v_dim: int,
    topk_length: torch.Tensor | None,
    sinks: torch.Tensor | None,
    scale: float,
    check: bool,
) -> int:
    """Validate one rank's ShardQ inputs; returns the fingerprint the ranks must agree on."""
    if not isinstance(plan, ShardPlan):
        raise TypeError(f"plan must be a ShardPlan (from zigzag_split), got {type(plan).__name__}")
    if plan.world_size != comm.world_size:
        raise ValueError(f"plan is for world_size={plan.world_size}, but the group has {comm.world_size} ranks")
    check_tensor("q_heads_local", q, dtypes=FLOAT_DTYPES, ndim=3)
    t, h, d = q.shape
    if t != plan.num_tokens:
        raise ValueError(f"q_heads_local must hold the step's {plan.num_tokens} tokens (plan), got {t}")
    if h < 1:
        raise ValueError(f"q_heads_local must hold at least one head, got shape {list(q.shape)}")
    check_tensor("kv", kv, dtypes=(q.dtype,), ndim=2)
    check_head_dim("q_heads_local", q, "kv", kv)
    check_tensor("rows", rows, dtypes=INDEX_DTYPES, ndim=2)
    if rows.shape[0] != t:
        raise ValueError(f"rows must have one row per token ({t}), got shape {list(rows.shape)}")
    check_scale("scale", scale)
    check_int("v_dim", v_dim, minimum=1)
    if v_dim > d:
        raise ValueError(f"v_dim must be <= the head dim {d}, got {v_dim}")
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtypes=INDEX_DTYPES, shape=(t,))
    if sinks is not None:
        check_tensor("sinks", sinks, dtypes=(torch.float32,), shape=(h * comm.world_size,))
    check_same_device(q_heads_local=q, kv=kv, rows=rows, topk_length=topk_length, sinks=sinks)
    return stable_fingerprint(
        "shardq",
        plan.fingerprint() if check else None,
        tuple(q.shape),
        q.dtype,
        rows.shape[1],
        v_dim,
        sinks is not None,
    )


def shardq_prefill(
    q_heads_local: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    plan: ShardPlan,
    group: dist.ProcessGroup | Comm,
    *,
    scale: float,
    v_dim: int = 512,
    topk_length: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = True,
    attention: AttentionFn = sparse_mla_attention,
    check: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA prefill with queries moved from head shards to zigzag token shards and back.

    Every rank of ``group`` calls this with the same ``plan`` and its own head slice (heads
    ``rank * H/W .. (rank+1) * H/W``, the usual TP split).

    Args:
        q_heads_local: ``[T, H/W, D]`` fp16/bf16/fp32, this rank's heads of all ``T`` tokens of
            the step (``D = 576`` for DSA models).
        kv: ``[R, D]`` the KV rows in q's dtype, identical on every rank (replicated under TP);
            the value is ``kv[:, :v_dim]``.
        rows: ``[T, K]`` int32 global KV rows of every token's top-k (identical on every rank);
            ``-1`` / out of range = invalid, anywhere in a row.
        plan: :func:`~shardattn.plan.zigzag_split` of the step (``world_size`` = the group's).
        group: the TP process group, or a :class:`~shardattn.parallel.comm.Comm` over it.
        scale: softmax scale. v_dim: value width (512 for DSA models).
        topk_length: ``[T]`` int32 per-token count of leading ``rows`` entries to use, optional.
        sinks: ``[H]`` fp32 per-head sink logits (all heads), optional.
        return_lse: also return the LSE (packed into the second all-to-all).
        attention: the local kernel, called like
            :func:`~shardattn.kernels.sparse_mla.sparse_mla_attention` with ``return_lse=True``.
        check: make the ranks agree on the plan and shapes first (one small all-gather, a host
            sync); bad input or a different plan on any rank then raises on every rank.
    Returns:
        ``out [T, H/W, v_dim]`` in q's dtype, token order, this rank's heads; and
        ``lse [T, H/W]`` fp32 natural log with ``return_lse``. A token with no valid row is
        ``(0, -inf)`` (``(0, sink)`` with sinks). Equal to running the kernel on all heads of
        all tokens in one process.

    Example (every rank of a TP group of ``W`` runs this)::

        plan = zigzag_split(seq_lens, W, align=G, min_tokens=1024)   # same on every rank
        out, lse = shardq_prefill(q_local, kv, rows, plan, group, scale=576 ** -0.5)
        # q_local [T, H/W, 576] -> out [T, H/W, 512], lse [T, H/W]
    """
    comm = Comm.wrap(group)
    comm.agree_on(
        "ShardQ plan and inputs",
        lambda: _check_inputs(q_heads_local, kv, rows, plan, comm, v_dim, topk_length, sinks, scale, check),
        check=check,
    )
    with comm.reporting_failures():  # a failure from here on is reported to the waiting peers
        q = q_heads_local
        h, d = q.shape[1], q.shape[2]
        w, rank = comm.world_size, comm.rank
        if not plan.sharded:  # head-TP: all tokens, this rank's heads, nothing moves
            local_sinks = None if sinks is None else sinks[rank * h : (rank + 1) * h]
            out, lse = attention(
                q, kv, rows, scale=scale, v_dim=v_dim, topk_length=topk_length, sinks=local_sinks, return_lse=True
            )
            return (out, lse) if return_lse else out

        counts = [int(c) for c in plan.counts.tolist()]
        mine = counts[rank]
        dev = q.device
        gather = plan.gather_index.to(dev, non_blocking=True)
        ids = plan.token_ids(rank).to(dev, non_blocking=True)

        # all-to-all #1: rank j receives its tokens' rows of this rank's heads
        q_recv = comm.all_to_all(q.index_select(0, gather), counts, [mine] * w)  # [W * T_r, h, D]
        q_tok = q_recv.view(w, mine, h, d).permute(1, 0, 2, 3).reshape(mine, w * h, d)  # [T_r, H, D]

        out, lse = attention(
            q_tok,
            kv,
            rows.index_select(0, ids),
            scale=scale,
            v_dim=v_dim,
            topk_length=None if topk_length is None else topk_length.index_select(0, ids),
            sinks=sinks,
            return_lse=True,
        )

        # all-to-all #2: head slice j of this rank's tokens goes back to rank j, LSE in the same bytes
        parts = [out.reshape(mine, w, h, v_dim).permute(1, 0, 2, 3)]
        if return_lse:
            parts.append(lse.reshape(mine, w, h).permute(1, 0, 2))

        def specs(n: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
            s = [((n, h, v_dim), out.dtype)]
            return [*s, ((n, h), torch.float32)] if return_lse else s

        send = pack_rows(parts)  # [W, bytes of T_r tokens]
        sizes = [int(send.shape[1])] * w
        recv_sizes = [packed_nbytes(specs(c)) for c in counts]
        recv = comm.all_to_all(send.view(-1), sizes, recv_sizes)
        pieces = [unpack_rows(chunk.view(1, -1), specs(c)) for chunk, c in zip(recv.split(recv_sizes), counts)]
        restore = plan.restore_index.to(dev, non_blocking=True)
        out_tok = torch.cat([p[0][0] for p in pieces]).index_select(0, restore)  # [T, h, Dv]
        if not return_lse:
            return out_tok
        lse_tok = torch.cat([p[1][0] for p in pieces]).index_select(0, restore)
        return out_tok, lse_tok
