"""Each token's rows with every repeat dropped in place: decode's de-duplication.

A row a token's top-k lists twice is one key, so a decode step without ``rows_unique`` reads each
token's rows through one of these. :func:`unique_rows` keeps every entry where it stands, ``-1``
over each repeat (the row stays at its first occurrence), at a cost that follows the top-k alone
on any cache size (:mod:`shardattn.kernels.triton.unique_rows`: a hash table per token, no sort);
:func:`~shardattn.ops.union.build_union` with ``group_size=1`` packs the rows sorted at the front,
from a bitmap scan whose cost follows the cache size or from a row sort. :func:`decode_rows`
picks between them (:func:`~shardattn.plan.union_routing.route_row_dedup`) and says which it
gave: the decode kernels read either, as they read the caller's rows (an invalid entry anywhere is
no key) or as packed rows (the count their ``topk_length``).

    >>> rows = torch.tensor([[5, 3, 5, -1, 9], [7, 7, 12, 2, 7]], dtype=torch.int32)
    >>> unique_rows(rows, num_kv_rows=10).tolist()
    [[5, 3, -1, -1, 9], [7, -1, -1, 2, -1]]
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from shardattn._checks import INDEX_DTYPES, check_bool, check_int, check_same_device, check_tensor
from shardattn.kernels.backend import pdl_supported, use_triton
from shardattn.kernels.gluon.union_smem import smem_unsupported_reason
from shardattn.kernels.triton.unique_rows import MAX_ENTRIES, launch_unique_rows
from shardattn.kernels.union_layout import MAX_PLAIN_ROW
from shardattn.ops.union import build_union
from shardattn.plan.union_routing import route_row_dedup

__all__ = ["DecodeRows", "decode_rows", "unique_rows", "unique_rows_reference"]


class DecodeRows(NamedTuple):
    """Decode's de-duplicated rows. ``rows`` ``[T, K]`` int32; ``topk_length`` ``[T]`` (or
    ``None``), the decode kernels' ``topk_length``; ``packed``: each token's rows are at the front
    of its row, ``topk_length`` of them (past that, unspecified), else each entry stands where the
    caller listed it, ``-1`` where it was a repeat or no row."""

    rows: torch.Tensor
    topk_length: torch.Tensor | None
    packed: bool


def _check(rows: torch.Tensor, num_kv_rows: int, topk_length: torch.Tensor | None) -> None:
    check_tensor("rows", rows, dtypes=INDEX_DTYPES, ndim=2)
    check_int("num_kv_rows", num_kv_rows, minimum=0)
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtypes=INDEX_DTYPES, shape=(rows.shape[0],))
    check_same_device(rows=rows, topk_length=topk_length)


def unique_rows_reference(
    rows: torch.Tensor, *, num_kv_rows: int, topk_length: torch.Tensor | None = None
) -> torch.Tensor:
    """Torch reference of :func:`unique_rows` (the same output, exactly)."""
    _check(rows, num_kv_rows, topk_length)
    k = rows.shape[1]
    r = rows.long()
    valid = (r >= 0) & (r < min(num_kv_rows, MAX_PLAIN_ROW + 1))
    if topk_length is not None:
        valid &= torch.arange(k, device=rows.device)[None, :] < topk_length.long()[:, None]
    # a stable sort by row puts each row's first occurrence first in its run
    never = MAX_PLAIN_ROW + 1
    key, order = torch.sort(torch.where(valid, r, never), dim=1, stable=True)
    starts = torch.ones_like(valid)
    starts[:, 1:] = key[:, 1:] != key[:, :-1]
    keep = torch.zeros_like(valid).scatter_(1, order, starts & (key < never))
    return torch.where(keep, r, -1).to(torch.int32)


def unique_rows(
    rows: torch.Tensor,
    *,
    num_kv_rows: int,
    topk_length: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Each token's rows with every repeat dropped in place.

    Args:
        rows: ``[T, K]`` int32 row numbers; an entry outside ``[0, num_kv_rows)`` or at a
            position ``>= topk_length[t]`` is no row.
        num_kv_rows: rows of the cache ``R``.
        topk_length: optional ``[T]`` int32, each token's valid prefix of ``rows``.
        pdl: where the device takes it, launch the kernel so that the next kernel in the stream
            launches at once; only for a next kernel that is itself a programmatic dependent launch
            (it waits for this one before it reads: the small-batch, streaming, Triton and sliced
            Gluon decode kernels); ahead of any other it measured slower (docs/DECISIONS.md, D97, D98).

    Returns:
        ``[T, K]`` int32: each entry's row where it is the row's first valid occurrence in its
        token, else ``-1``. The Triton kernel (rows of up to
        :data:`~shardattn.kernels.triton.unique_rows.MAX_ENTRIES` entries; longer ones take the
        reference) gives exactly the reference's output.
    """
    _check(rows, num_kv_rows, topk_length)
    check_bool("pdl", pdl)
    return _unique_rows(rows, num_kv_rows, topk_length, pdl)


def _unique_rows(rows: torch.Tensor, num_kv_rows: int, topk_length: torch.Tensor | None, pdl: bool) -> torch.Tensor:
    """:func:`unique_rows` on checked arguments."""
    t, k = rows.shape
    if not use_triton(rows, topk_length) or k > MAX_ENTRIES or t == 0 or k == 0:
        return unique_rows_reference(rows, num_kv_rows=num_kv_rows, topk_length=topk_length)
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    out = torch.empty(t, k, dtype=torch.int32, device=rows.device)
    pdl = pdl and pdl_supported(rows.device)
    launch_unique_rows(rows, topk_length, min(num_kv_rows - 1, MAX_PLAIN_ROW), out, pdl=pdl)
    return out


def decode_rows(
    rows: torch.Tensor, *, num_kv_rows: int, topk_length: torch.Tensor | None = None, pdl: bool = False
) -> DecodeRows:
    """Decode's de-duplicated rows (see the module): each entry in place by :func:`unique_rows`,
    with the caller's ``topk_length``, at few tokens and on caches past the bitmap's ratio; else
    packed and sorted by :func:`~shardattn.ops.union.build_union`
    (:func:`~shardattn.plan.union_routing.route_row_dedup`). ``pdl``: as :func:`unique_rows`'s
    (the decode kernel after it is a programmatic dependent launch)."""
    _check(rows, num_kv_rows, topk_length)  # before the route reads the shape
    shared_memory = smem_unsupported_reason(rows, 1) is None
    route = route_row_dedup(rows.shape[1], num_kv_rows, tokens=rows.shape[0], shared_memory=shared_memory)
    if route == "union":
        union, lens = build_union(rows, group_size=1, num_kv_rows=num_kv_rows, topk_length=topk_length)
        return DecodeRows(union, lens, packed=True)
    return DecodeRows(_unique_rows(rows, num_kv_rows, topk_length, pdl), topk_length, packed=False)
