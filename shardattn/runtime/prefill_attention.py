"""One rank's sparse prefill kernel call with its union in a reserved workspace.

The grouped kernel needs a union buffer of ``ceil(T / G) * G * K`` int32 entries; the Runtime
reserves the planner's bound for it once. A rank holding more tokens than that buffer covers
(the zigzag slack) runs in passes over the same buffer; passes start at multiples of ``G``, so
the groups are those of one call and the result is bit for bit that of one call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from shardattn.ops.prepared_union import PreparedUnion
from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill
from shardattn.plan.routing import Route
from shardattn.runtime.workspace import WorkspaceExceededError

__all__ = ["workspace_prefill_attention"]


def workspace_prefill_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    *,
    route: Route,
    union_ws: torch.Tensor,
    lens_ws: torch.Tensor,
    scale: float,
    v_dim: int,
    topk_length: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = True,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    q_ready: Callable[[], None] | None = None,
    rows_sorted: bool = False,
    prepared_union: PreparedUnion | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse-MLA prefill of ``q`` on ``route``, the union built into ``union_ws`` / ``lens_ws``.

    Args:
        q: ``[T, H, D]``; kv: ``[R, D]``; rows: ``[T, K]`` int32 global KV rows (``-1`` invalid).
        route: the planner's route (path, group size ``G``).
        union_ws / lens_ws: ``uint8`` workspace items ``prefill.union`` / ``prefill.union_offsets``.
        scale, v_dim, topk_length, sinks: as :func:`~shardattn.ops.sparse_mla.sparse_mla_attention`.
        return_lse: accepted for signature compatibility; the LSE is always returned.
        out / lse: optional destinations, written in place; ``q``, ``out`` and ``lse`` may be
            head-blocked ``[B, T, H/B, ...]`` (an all-to-all buffer, read or written in place).
        q_ready: optional callable run once before any kernel reads ``q`` (the first pass's union
            build is issued before it; see
            :func:`~shardattn.ops.sparse_mla_grouped.sparse_mla_grouped_prefill`).
        rows_sorted: each token's valid rows arrive ascending (trusted): the union build skips
            its row sort (every pass; a pass is a slice of whole rows).
        prepared_union: the union of these rows built ahead (a slice of a whole share's,
            :func:`~shardattn.ops.prepared_union.prepare_union`): one call, no build, no passes.
    Returns:
        ``(out [T, H, v_dim] in q's dtype, lse [T, H] fp32)`` (the given destinations when passed).
    Raises:
        WorkspaceExceededError: the union buffer cannot hold one group.
    """
    g, (t, k) = route.group_size, rows.shape
    call = functools.partial(
        sparse_mla_grouped_prefill, kv=kv, scale=scale, v_dim=v_dim, group_size=g, rows_sorted=rows_sorted
    )
    if prepared_union is not None or route.path == "reference" or t == 0 or k == 0:
        return call(
            q, rows=rows, topk_length=topk_length, sinks=sinks, out=out, lse=lse, q_ready=q_ready,
            prepared_union=prepared_union,
        )  # fmt: skip
    per_pass = min(union_ws.numel() // (k * 4), lens_ws.numel() // 4 * g) // g * g
    if per_pass < 1:
        raise WorkspaceExceededError(
            f"workspace item 'prefill.union' ({union_ws.numel()} B) cannot hold one group of {g} x top-k {k}"
        )
    if t <= per_pass:
        return _one_pass(call, q, rows, topk_length, sinks, union_ws, lens_ws, g, k, out, lse, q_ready)
    if out is None:
        out = q.new_empty(t, _heads(q), v_dim)
    if lse is None:
        lse = torch.empty(t, _heads(q), dtype=torch.float32, device=q.device)
    for t0 in range(0, t, per_pass):
        t1 = min(t, t0 + per_pass)
        length = None if topk_length is None else topk_length[t0:t1]
        _one_pass(
            call, _tokens(q, t0, t1, 3), rows[t0:t1], length, sinks, union_ws, lens_ws, g, k,
            _tokens(out, t0, t1, 3), _tokens(lse, t0, t1, 2), q_ready if t0 == 0 else None,
        )  # fmt: skip
    return out, lse


def _heads(q: torch.Tensor) -> int:
    return q.shape[0] * q.shape[2] if q.dim() == 4 else q.shape[1]


def _tokens(x: torch.Tensor, t0: int, t1: int, plain_dims: int) -> torch.Tensor:
    """Tokens ``t0:t1`` of a plain (``plain_dims`` dims, tokens first) or head-blocked tensor (one more dim)."""
    return x[:, t0:t1] if x.dim() > plain_dims else x[t0:t1]


def _one_pass(
    call: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    q: torch.Tensor,
    rows: torch.Tensor,
    length: torch.Tensor | None,
    sinks: torch.Tensor | None,
    union_ws: torch.Tensor,
    lens_ws: torch.Tensor,
    g: int,
    k: int,
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    q_ready: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    n_groups = -(-rows.shape[0] // g)
    union = union_ws[: n_groups * g * k * 4].view(torch.int32).view(n_groups, g * k)
    lens = lens_ws[: n_groups * 4].view(torch.int32)
    return call(q, rows=rows, topk_length=length, sinks=sinks, union=(union, lens), out=out, lse=lse, q_ready=q_ready)
