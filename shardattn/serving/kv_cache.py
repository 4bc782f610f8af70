"""One rank's shard of a pool's paged KV cache: resident tensors, writes, and prefix gathers.

The cache is allocated once (:class:`RankKVCache`), ``[num_pages, page_size, *row]`` per
component: sparse MLA has one component, the latent row ``[D]`` (or, resident in FP8, its
656-byte ``fp8_ds_mla`` row: uint8 ``[656]``, new rows quantised as they are stored,
:func:`~shardattn.ops.kv_fp8.write_kv`); GQA has two, K ``[Hkv, D]`` and V ``[Hkv, Dv]``. Which
rank holds a token, and at which local index, is the planner's :class:`~shardattn.plan.DCPLayout`
(a replicated cache uses ``DCPLayout(1)``: every rank holds every token at its global position).
Page ids come from the driver's :class:`~shardattn.plan.kv_pages.PagedKVBook` and are the same on
every rank, so one block table ``[B, M]`` int32 (local positions) addresses every rank's shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shardattn.ops.kv_fp8 import quantize_kv, write_kv
from shardattn.parallel.comm import Comm
from shardattn.plan.context import DCPLayout
from shardattn.plan.kv_cache_config import KVCacheConfig

__all__ = ["RankKVCache", "plan_rank_cache", "request_positions"]


def plan_rank_cache(
    page_size: int,
    rows: Sequence[tuple[tuple[int, ...], torch.dtype]],
    dcp: bool,
    world_size: int,
    interleave: int,
    max_requests: int,
    max_seq_len: int,
    num_pages: int | None,
    memory_limit_bytes: int | None,
) -> tuple[KVCacheConfig, dict[str, Any]]:
    """The pool's cache plan: its :class:`~shardattn.plan.kv_cache_config.KVCacheConfig` (DCP interleave
    over ``world_size`` ranks when ``dcp``, else a replica) and what each rank builds
    (:class:`RankKVCache`'s arguments, its ``bytes``, the ``memory_limit_bytes``).

    Raises:
        ValueError: the cache alone exceeds ``memory_limit_bytes``.
    """
    layout = DCPLayout(world_size, interleave) if dcp else DCPLayout(1)
    config = KVCacheConfig(page_size, layout, max_requests, max_seq_len, num_pages)
    row_bytes = sum(int(torch.Size(r).numel()) * torch.empty(0, dtype=d).element_size() for r, d in rows)
    nbytes = config.rows_per_rank * row_bytes
    spec: dict[str, Any] = {
        "rows": tuple(rows),
        "num_pages": config.num_pages,
        "page_size": page_size,
        "layout": layout,
        "bytes": nbytes,
        "memory_limit_bytes": memory_limit_bytes,
    }
    if memory_limit_bytes is not None and nbytes > memory_limit_bytes:
        raise ValueError(
            f"the KV cache alone needs {nbytes} B per rank, over memory_limit_bytes="
            f"{memory_limit_bytes}; lower max_requests, max_seq_len or num_pages"
        )
    return config, spec


def request_positions(starts: Sequence[int], counts: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pos [N], req [N])`` int64: positions ``starts[b] .. starts[b] + counts[b] - 1`` of every request ``b``.

    >>> [t.tolist() for t in request_positions([5, 0], [2, 3])]
    [[5, 6, 0, 1, 2], [0, 0, 1, 1, 1]]
    """
    counts_t = torch.tensor(list(counts), dtype=torch.int64)
    req = torch.repeat_interleave(torch.arange(len(counts_t)), counts_t)
    first = torch.cumsum(counts_t, 0) - counts_t  # offset of each request's first row
    pos = torch.tensor(list(starts), dtype=torch.int64)[req] + torch.arange(int(counts_t.sum())) - first[req]
    return pos, req


class RankKVCache:
    """Rank ``rank``'s pages of the KV cache (module docstring).

    Args:
        rows: the row shape and dtype of each component (``[((D,), bf16)]`` for sparse MLA).
        num_pages, page_size: pages per rank and tokens per page.
        layout: the token layout over the ranks; ``rank``: this rank; device: where pages live.
    """

    def __init__(
        self,
        rows: Sequence[tuple[tuple[int, ...], torch.dtype]],
        *,
        num_pages: int,
        page_size: int,
        layout: DCPLayout,
        rank: int,
        device: torch.device,
        heads: tuple[int, int] | None = None,
    ) -> None:
        self.layout, self.rank, self.page_size = layout, rank, page_size
        #: ``[start, stop)`` of the KV heads this rank keeps of every new row (a GQA pool under head-TP
        #: holds its rank's heads); ``None``: whole rows
        self.heads = heads
        self.row_specs = [(tuple(shape), dtype) for shape, dtype in rows]
        self.pages = [
            torch.zeros(num_pages, page_size, *shape, dtype=dtype, device=device) for shape, dtype in self.row_specs
        ]
        self.device = device

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.pages)

    def flat(self, i: int = 0) -> torch.Tensor:
        """Component ``i`` as ``[num_pages * page_size, *row]`` (page ``p`` is rows ``p*P .. (p+1)*P``)."""
        return self.pages[i].view(-1, *self.row_specs[i][0])

    def as_stored(self, rows: torch.Tensor, i: int = 0) -> torch.Tensor:
        """New rows of component ``i`` as the cache stores them: themselves, or their ``fp8_ds_mla``
        rows (:func:`~shardattn.ops.kv_fp8.quantize_kv`, the bytes :meth:`write` stores)."""
        if self.pages[i].dtype == torch.uint8 and rows.dtype != torch.uint8:
            return quantize_kv(rows)
        return rows

    def _slots(self, pos: torch.Tensor, req: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The positions this rank owns (a mask over ``pos``) and their flat cache rows."""
        if self.layout.world_size > 1:
            owned = self.layout.owner(pos) == self.rank
        else:  # a replica: every position
            owned = torch.ones_like(pos, dtype=torch.bool)
        local = self.layout.local_index(pos)
        page = table.to("cpu", torch.int64)[req, torch.div(local, self.page_size, rounding_mode="floor")]
        return owned, page * self.page_size + local % self.page_size

    def write(
        self, table: torch.Tensor, starts: Sequence[int], counts: Sequence[int], rows: Sequence[torch.Tensor]
    ) -> None:
        """Store new rows: request ``b`` of the step gets ``counts[b]`` rows at positions from ``starts[b]``.

        Args:
            table: ``[B, M]`` int32 block table of the step's requests (on the host).
            starts, counts: ``[B]`` host ints (cached tokens before the step, new tokens).
            rows: per component ``[sum(counts), *row]``, request-major, token order (a component
                resident as ``fp8_ds_mla`` rows takes the model's ``[n, 576]`` rows and quantises them).

        Raises:
            ValueError: ``table`` names a page outside the cache for a position this rank owns
                (before anything is written).
        """
        pos, req = request_positions(starts, counts)
        if pos.numel() == 0:
            return
        owned, flat_rows = self._slots(pos, req, table)
        num_pages = self.pages[0].shape[0]
        outside = owned & ((flat_rows < 0) | (flat_rows >= num_pages * self.page_size))
        if bool(outside.any()):  # an FP8 write would skip the row, a dense one fail inside index_copy_
            j = int(outside.nonzero()[0])
            raise ValueError(
                f"table names page {int(flat_rows[j]) // self.page_size} for position {int(pos[j])} of request "
                f"{int(req[j])}, outside this rank's {num_pages} pages of the KV cache"
            )
        src_idx = owned.nonzero().squeeze(1)
        dst = flat_rows[owned].to(self.device)
        src_idx = src_idx.to(self.device)
        for i, new in enumerate(rows):
            if self.heads is not None:
                new = new[:, self.heads[0] : self.heads[1]]
            mine = new.to(self.device).index_select(0, src_idx)
            if self.pages[i].dtype == torch.uint8 and mine.dtype != torch.uint8:  # fp8_ds_mla, quantised here
                write_kv(self.pages[i], dst, mine)
            else:
                self.flat(i).index_copy_(0, dst, mine)

    def gather_full(
        self,
        table: torch.Tensor,
        lens: Sequence[int],
        comm: Comm,
        i: int = 0,
        rank_heads: Sequence[tuple[int, int]] | None = None,
    ) -> list[torch.Tensor]:
        """Tokens ``[0, lens[b])`` of every request ``b``, in global order, on every rank.

        ``table``: ``[B, M]`` int32 block table of the requests (host; index math runs on the CPU).
        ``rank_heads``: per rank, ``[start, stop)`` of the KV heads (dim 1 of a GQA row) that rank
        receives, of a cache that holds whole rows; ``None``: whole rows.

        Under a split layout every rank sends its own rows: one uneven all-gather over ``comm``, or
        where ``rank_heads`` differ between ranks one all-to-all that sends each rank only its heads
        (every rank must call this with the same ``lens`` and ``rank_heads``); a replicated cache reads
        locally.

        Returns:
            ``B`` tensors ``[lens[b], *row]`` of component ``i`` (with ``rank_heads``: ``[lens[b],
            stop - start, *row[1:]]``, this rank's heads).
        """
        lay, w = self.layout, self.layout.world_size
        row = self.row_specs[i][0]
        if rank_heads is not None:
            if self.heads is not None:
                raise ValueError("rank_heads needs a cache of whole rows; this one keeps only its rank's KV heads")
            lo, hi = rank_heads[self.rank]
        if w == 1:
            pos, req = request_positions([0] * len(lens), lens)
            _, flat_rows = self._slots(pos, req, table)
            rows = self.flat(i).index_select(0, flat_rows.to(self.device))
            rows = rows if rank_heads is None else rows[:, lo:hi]
            return list(rows.split([int(n) for n in lens]))
        mine = [lay.owned_positions(int(n), self.rank) for n in lens]
        pos = torch.cat(mine) if mine else torch.zeros(0, dtype=torch.int64)
        req = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor([len(m) for m in mine], dtype=torch.int64))
        _, flat_rows = self._slots(pos, req, table)
        local = self.flat(i).index_select(0, flat_rows.to(self.device))
        sizes = [sum(lay.local_len(int(n), r) for n in lens) for r in range(w)]
        if rank_heads is None or len(set(rank_heads)) == 1:  # whole rows, or the same heads for every rank
            parts = comm.all_gather_uneven(local if rank_heads is None else local[:, lo:hi].contiguous(), sizes)
            row = tuple(parts[0].shape[1:])
        else:  # each rank's heads of every local row, sent to it alone
            pieces = [local[:, a:b].reshape(-1, *row[1:]) for a, b in rank_heads]
            recv = [n * (hi - lo) for n in sizes]
            got = comm.all_to_all(torch.cat(pieces), [len(x) for x in pieces], recv)
            parts = [x.view(n, hi - lo, *row[1:]) for x, n in zip(got.split(recv), sizes)]
            row = (hi - lo, *row[1:])
        out = [self.flat(i).new_empty((n, *row)) for n in lens]
        for r, part in enumerate(parts):
            start = 0
            for b, n in enumerate(lens):
                k = lay.local_len(int(n), r)
                out[b][lay.owned_positions(int(n), r).to(self.device)] = part[start : start + k]
                start += k
        return out
