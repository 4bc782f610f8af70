"""Each token's unique valid KV rows, in the order the token lists them first: decode's de-duplication.

A row a token's top-k lists twice is one key, so a decode step without ``rows_unique`` reads each
token's rows through one of these. :func:`unique_rows` keeps the caller's order (a row at its
first occurrence) and costs the same on any cache size (:mod:`shardattn.kernels.triton.unique_rows`:
a hash table per token, no sort); :func:`~shardattn.ops.union.build_union` with ``group_size=1``
gives the rows sorted, from a bitmap scan whose cost follows the cache size or from a row sort.
:func:`decode_rows` picks between them
(:func:`~shardattn.plan.union_routing.route_decode_dedup`). Both outputs are packed: a token's
rows at the front of its row, the count in ``lens``, which the decode kernels take as
``topk_length`` (entries past it are ``-1`` from :func:`unique_rows`, unspecified from the union).

    >>> rows = torch.tensor([[5, 3, 5, -1, 9], [7, 7, 12, 2, 7]], dtype=torch.int32)
    >>> out, lens = unique_rows(rows, num_kv_rows=10)
    >>> out.tolist(), lens.tolist()
    ([[5, 3, 9, -1, -1], [7, 2, -1, -1, -1]], [3, 2])
"""

from __future__ import annotations

import torch

from shardattn._checks import INDEX_DTYPES, check_int, check_same_device, check_tensor
from shardattn.kernels.backend import use_triton
from shardattn.kernels.gluon.union_smem import smem_unsupported_reason
from shardattn.kernels.triton.unique_rows import MAX_ENTRIES, launch_unique_rows
from shardattn.kernels.union_layout import MAX_PLAIN_ROW
from shardattn.ops.union import build_union
from shardattn.plan.union_routing import route_decode_dedup

__all__ = ["decode_rows", "unique_rows", "unique_rows_reference"]


def _check(rows: torch.Tensor, num_kv_rows: int, topk_length: torch.Tensor | None) -> None:
    check_tensor("rows", rows, dtypes=INDEX_DTYPES, ndim=2)
    check_int("num_kv_rows", num_kv_rows, minimum=0)
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtypes=INDEX_DTYPES, shape=(rows.shape[0],))
    check_same_device(rows=rows, topk_length=topk_length)


def unique_rows_reference(
    rows: torch.Tensor, *, num_kv_rows: int, topk_length: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`unique_rows` (same outputs, exactly)."""
    _check(rows, num_kv_rows, topk_length)
    t, k = rows.shape
    dev = rows.device
    r = rows.long()
    valid = (r >= 0) & (r < min(num_kv_rows, MAX_PLAIN_ROW + 1))
    if topk_length is not None:
        valid &= torch.arange(k, device=dev)[None, :] < topk_length.long()[:, None]
    # a stable sort by row puts each row's first occurrence first in its run
    never = MAX_PLAIN_ROW + 1
    key, order = torch.sort(torch.where(valid, r, never), dim=1, stable=True)
    starts = torch.ones_like(valid)
    starts[:, 1:] = key[:, 1:] != key[:, :-1]
    keep = torch.zeros_like(valid).scatter_(1, order, starts & (key < never))
    lens = keep.sum(dim=1)
    out = torch.full((t, k), -1, dtype=torch.int32, device=dev)
    slot = torch.cumsum(keep.long(), dim=1) - 1
    tok = torch.arange(t, device=dev)[:, None].expand(t, k)
    out[tok[keep], slot[keep]] = r[keep].to(torch.int32)
    return out, lens.to(torch.int32)


def unique_rows(
    rows: torch.Tensor,
    *,
    num_kv_rows: int,
    topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's unique valid rows in first-occurrence order, packed.

    Args:
        rows: ``[T, K]`` int32 row numbers; an entry outside ``[0, num_kv_rows)`` or at a
            position ``>= topk_length[t]`` is no row.
        num_kv_rows: rows of the cache ``R``.
        topk_length: optional ``[T]`` int32, each token's valid prefix of ``rows``.

    Returns:
        ``(out, lens)``: ``out`` ``[T, K]`` int32, token ``t``'s ``lens[t]`` unique rows at the front
        in the order they first appear, ``-1`` after; ``lens`` ``[T]`` int32. The Triton kernel
        (rows of up to :data:`~shardattn.kernels.triton.unique_rows.MAX_ENTRIES` entries; longer
        ones take the reference) gives exactly the reference's output.
    """
    _check(rows, num_kv_rows, topk_length)
    return _unique_rows(rows, num_kv_rows, topk_length)


def _unique_rows(
    rows: torch.Tensor, num_kv_rows: int, topk_length: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`unique_rows` on checked arguments."""
    t, k = rows.shape
    if not use_triton(rows, topk_length) or k > MAX_ENTRIES or t == 0 or k == 0:
        return unique_rows_reference(rows, num_kv_rows=num_kv_rows, topk_length=topk_length)
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    out = torch.empty(t, k, dtype=torch.int32, device=rows.device)
    lens = torch.empty(t, dtype=torch.int32, device=rows.device)
    launch_unique_rows(rows, topk_length, min(num_kv_rows - 1, MAX_PLAIN_ROW), out, lens)
    return out, lens


def decode_rows(
    rows: torch.Tensor, *, num_kv_rows: int, topk_length: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode's de-duplicated rows ``(rows, lens)``, packed (see the module): sorted by
    :func:`~shardattn.ops.union.build_union` where its bitmap build runs, else in first-occurrence
    order by :func:`unique_rows` (:func:`~shardattn.plan.union_routing.route_decode_dedup`)."""
    _check(rows, num_kv_rows, topk_length)  # before the route reads the shape
    shared_memory = smem_unsupported_reason(rows, 1) is None
    if route_decode_dedup(rows.shape[1], num_kv_rows, shared_memory=shared_memory) == "union":
        return build_union(rows, group_size=1, num_kv_rows=num_kv_rows, topk_length=topk_length)
    return _unique_rows(rows, num_kv_rows, topk_length)
