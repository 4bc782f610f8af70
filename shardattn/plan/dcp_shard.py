"""One rank's DCP shard of a paged KV cache, cut from the whole cache as one process holds it.

Under decode context parallelism each rank stores only its tokens of every request (token ``t``
on rank ``(t // I) % W`` at local index ``(t // (W*I)) * I + t % I``: :class:`DCPLayout`), in
pages of its own, addressed by its own block table; :meth:`Runtime.decode
<shardattn.runtime.runtime.Runtime.decode>` under DCP takes that shard and table with the
requests' global ``seq_lens``. :func:`shard_kv_cache` builds both from the whole cache: a
request's owned tokens, in local order, fill fresh pages of the shard one after another.

It is set-up code (a test, an example, a cache that is re-sharded): the index maps are planned
on the host, and the rows are gathered with one indexing per cache tensor on the cache's device.
An engine that writes each new token straight to its owner keeps its shard this way from the start.

>>> import torch
>>> kv = torch.arange(12.0).view(12, 1)            # pages of 4 rows: request 0 in pages 0, 1
>>> table = torch.tensor([[0, 1]], dtype=torch.int32)
>>> shard, local_table = shard_kv_cache(kv, table, [6], DCPLayout(2, 1), 1, page_size=4)
>>> shard.flatten().tolist(), local_table.tolist()  # rank 1 holds positions 1, 3, 5
([1.0, 3.0, 5.0, 0.0], [[0]])
"""

from __future__ import annotations

from typing import overload

import torch

from shardattn._checks import check_int, check_tensor
from shardattn.plan._common import as_lengths
from shardattn.plan.context import DCPLayout

__all__ = ["shard_kv_cache"]

KVCache = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def _check_readable(name: str, value: torch.Tensor) -> None:
    """``value``'s values can be read on the host: not a ``meta`` tensor (shapes only, no data)."""
    if value.device.type == "meta":
        raise ValueError(f"{name} must hold values (it is read on the host), got a tensor on meta")


@overload
def shard_kv_cache(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: object, layout: DCPLayout, rank: int, *,
    page_size: int | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip
@overload
def shard_kv_cache(
    kv_cache: tuple[torch.Tensor, torch.Tensor], block_table: torch.Tensor, seq_lens: object, layout: DCPLayout,
    rank: int, *, page_size: int | None = ...,
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]: ...  # fmt: skip
def shard_kv_cache(
    kv_cache: KVCache,
    block_table: torch.Tensor,
    seq_lens: object,
    layout: DCPLayout,
    rank: int,
    *,
    page_size: int | None = None,
) -> tuple[KVCache, torch.Tensor]:
    """``rank``'s DCP shard of the whole paged cache, and its block table.

    Args:
        kv_cache: the whole cache: sparse MLA ``[R, D]`` rows (``R`` a multiple of ``page_size``),
            or GQA ``(k_cache, v_cache)`` each ``[pages, page_size, Hkv, D]`` (or one such tensor).
        block_table: ``[B, M]`` int32 / int64 pages of each request in the whole cache.
        seq_lens: ``[B]`` KV tokens per request (a list, or a tensor; a device tensor is read once).
        layout: the DCP layout (world size and interleave of the decode group).
        rank: the rank whose shard to build.
        page_size: rows per page (an int >= 1); required for a 2-D cache (the model's
            ``page_size``), read from the shape of a paged one (when given, it must match it).
    Returns:
        ``(shard, table)``: ``shard`` like ``kv_cache`` (same dtype and device), holding the rank's
        rows in pages of its own (padding rows are zero); ``table`` ``[B, max(1, pages)]`` int32 on
        ``block_table``'s device, ``-1`` past a request's pages. Pass them with the global
        ``seq_lens`` to a DCP decode step.
    Raises:
        ValueError / TypeError: a cache that is not one or two tensors, a ``(k_cache, v_cache)`` pair
            whose dtypes, devices or dims but the last differ, a paged cache of 0-row pages, a
            ``page_size`` that is not an int >= 1 or does not match, a ``block_table`` or
            ``seq_lens`` on the ``meta`` device (they are read on the host), a request longer than
            its row of ``block_table``, a page id outside the cache.
    """
    if not isinstance(layout, DCPLayout):
        raise TypeError(f"layout must be a DCPLayout, got {type(layout).__name__}")
    check_int("rank", rank, minimum=0)
    if rank >= layout.world_size:
        raise ValueError(f"rank must be < the layout's world_size={layout.world_size}, got {rank}")
    pair = isinstance(kv_cache, tuple | list)
    given: list[object] = list(kv_cache) if pair else [kv_cache]
    if pair and len(given) != 2:
        raise TypeError(f"kv_cache must be one tensor or a (k_cache, v_cache) pair, got {len(given)} items")
    parts = [check_tensor(f"kv_cache[{i}]" if pair else "kv_cache", part) for i, part in enumerate(given)]
    first = parts[0]
    if pair:  # one shard pair out of one cache: V as K but the last dim (v_dim may differ)
        shape = (*first.shape[:-1], None) if first.dim() else ()
        check_tensor("kv_cache[1]", parts[1], dtypes=(first.dtype,), shape=shape, device=first.device)
    if first.dim() == 2:
        if page_size is None:
            raise ValueError("page_size is required for a [R, D] cache of rows (the model's page_size)")
        page = check_int("page_size", page_size, minimum=1)
        if first.shape[0] % page:
            raise ValueError(f"kv_cache must hold whole pages of {page} rows, got {first.shape[0]} rows")
    elif first.dim() >= 3:
        page = int(first.shape[1])
        if page == 0:
            name = "kv_cache[0]" if pair else "kv_cache"
            raise ValueError(
                f"{name} must have pages of >= 1 rows ([pages, page_size, ...]), got shape {list(first.shape)}"
            )
        if page_size is not None and check_int("page_size", page_size, minimum=1) != page:
            raise ValueError(f"page_size={page_size} differs from kv_cache's pages of {page} rows")
    else:
        raise ValueError(f"kv_cache must be [R, D] rows or [pages, page_size, ...], got shape {list(first.shape)}")
    num_pages = int(first.shape[0]) // page if first.dim() == 2 else int(first.shape[0])
    check_tensor("block_table", block_table, dtypes=(torch.int32, torch.int64), ndim=2)
    _check_readable("block_table", block_table)
    if isinstance(seq_lens, torch.Tensor):
        _check_readable("seq_lens", seq_lens)
    host_lens = seq_lens.cpu() if isinstance(seq_lens, torch.Tensor) else seq_lens
    lens = as_lengths("seq_lens", host_lens, count=int(block_table.shape[0])).tolist()
    table = block_table.cpu().long()

    src, dst, pages = [], [], []
    start = 0
    for b, n in enumerate(lens):
        if -(-n // page) > table.shape[1]:
            raise ValueError(f"seq_lens[{b}]={n} needs {-(-n // page)} pages, past block_table's {table.shape[1]}")
        owned = layout.owned_positions(n, rank)
        ids = table[b, owned // page]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_pages):
            raise ValueError(f"block_table[{b}] names a page outside the cache's {num_pages} for request {b}'s tokens")
        src.append(ids * page + owned % page)
        dst.append(start * page + torch.arange(owned.numel(), dtype=torch.int64))
        pages.append(-(-owned.numel() // page))
        start += pages[-1]
    src_rows = torch.cat(src) if src else torch.zeros(0, dtype=torch.int64)
    dst_rows = torch.cat(dst) if dst else torch.zeros(0, dtype=torch.int64)
    shards = []
    for part in parts:
        rows = part.reshape(-1, *part.shape[2:]) if part.dim() > 2 else part
        out = rows.new_zeros(start * page, *rows.shape[1:])
        out[dst_rows.to(out.device)] = rows[src_rows.to(out.device)]
        shards.append(out.reshape(start, page, *part.shape[2:]) if part.dim() > 2 else out)
    local_table = torch.full((len(lens), max(1, max(pages, default=1))), -1, dtype=torch.int32)
    first_page = 0
    for b, n in enumerate(pages):
        local_table[b, :n] = torch.arange(first_page, first_page + n, dtype=torch.int32)
        first_page += n
    shard: KVCache = (shards[0], shards[1]) if pair else shards[0]
    return shard, local_table.to(block_table.device)
