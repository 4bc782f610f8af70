"""Prefill context parallelism (PCP): zigzag token split plus the KV all-gather layout.

Under PCP the prefill tokens of a step are split across ranks with :func:`zigzag_split` (never
gated: a PCP step is always split). Each rank computes the KV rows of its own tokens only, but
causal attention of a token at position ``p`` needs every KV row of its request at positions
``<= p``: the cached prefix (``< prefix_len``, already in the KV cache) and the step's new
tokens up to ``p``, which other ranks computed. So every rank all-gathers the new KV rows.

All-gather layout. Rank ``r`` contributes its tokens in rank-major order, zero-padded to
``P = padded_count`` rows; the gathered buffer has ``W * P`` rows and new token ``g`` (token
order) is at row ``kv_row[g] = r * P + i`` (``= shard.padded_restore_index[g]``)::

    W = 2, one request of 8 new tokens, P = 4
    rank 0 sends  t0 t1 t6 t7        gathered rows  0  1  2  3 | 4  5  6  7
    rank 1 sends  t2 t3 t4 t5        token          t0 t1 t6 t7| t2 t3 t4 t5
    kv_row = [0, 1, 4, 5, 6, 7, 2, 3]   (gathered[kv_row] is the KV in token order)

What a rank needs: for every request it holds a token of, the new tokens from the request's
first one up to its own last one (``need_stop[r, i]`` of them; 0 if it holds none). Rank 0 of a
zigzag split holds the last chunk, so it needs the whole request; a smaller ``needed_kv_tokens``
is the saving a point-to-point (ring) exchange could make over the all-gather.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from shardattn._checks import check_same_device, check_tensor
from shardattn.plan._common import check_world_size, fingerprint_arrays, to_int64_tensor
from shardattn.plan.shard_plan import ShardPlan
from shardattn.plan.zigzag import zigzag_split

__all__ = ["PCPPlan", "pcp_plan"]


@dataclass(frozen=True, eq=False)
class PCPPlan:
    """Token split and KV all-gather layout of one PCP prefill step (module docstring).

    Attributes:
        shard: the zigzag :class:`ShardPlan` (``sharded=True``); its ``gather_index`` /
            ``restore_index`` / ``padded_*`` maps move queries and outputs.
        kv_row: ``[T]`` int64, row of new token ``g`` in the all-gathered KV buffer.
        gathered_rows: ``W * P``, the rows of the all-gathered KV buffer.
        need_stop: ``[W, R]`` int64, new tokens of request ``i`` that rank ``r`` needs
            (offsets ``[0, need_stop)`` of its new tokens; positions
            ``[prefix_i, prefix_i + need_stop)``), 0 where rank ``r`` holds none of them.
    """

    shard: ShardPlan
    kv_row: torch.Tensor
    gathered_rows: int
    need_stop: torch.Tensor

    @property
    def world_size(self) -> int:
        return self.shard.world_size

    @property
    def needed_kv_tokens(self) -> torch.Tensor:
        """``[W]`` new KV rows each rank reads (vs ``T`` rows in the all-gather)."""
        return self.need_stop.sum(dim=1)

    def needed_ranges(self, rank: int) -> list[tuple[int, int, int]]:
        """``(request, start_position, stop_position)`` of the new KV rank ``rank`` needs.

        Positions include the prefix; the cached prefix ``[0, start_position)`` is read from
        the KV cache and is not part of the all-gather.
        """
        r = self.shard._check_rank(rank)
        prefix = self.shard.prefix_lens
        return [(i, int(prefix[i]), int(prefix[i]) + int(n)) for i, n in enumerate(self.need_stop[r].tolist()) if n > 0]

    def kv_indptr(self, rank: int) -> torch.Tensor:
        """``[R+1]`` int64 offsets into :meth:`kv_index` per request."""
        r = self.shard._check_rank(rank)
        return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(self.need_stop[r], 0)])

    def kv_index(self, rank: int) -> torch.Tensor:
        """``[needed_kv_tokens[rank]]`` gathered-buffer rows of the new KV ``rank`` needs.

        Request by request, in position order: for request ``i`` the entries
        ``kv_index[kv_indptr[i] + o]`` for ``o < need_stop[rank, i]`` are the rows of positions
        ``prefix_i + o``.
        """
        r = self.shard._check_rank(rank)
        starts = self.shard.token_offsets[:-1]
        pieces = [self.kv_row[int(s) : int(s) + int(n)] for s, n in zip(starts.tolist(), self.need_stop[r].tolist())]
        return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)

    def gathered_rows_for(self, positions: torch.Tensor, request_ids: torch.Tensor) -> torch.Tensor:
        """Gathered-buffer row of request-local KV positions (for sparse top-k rows).

        Args:
            positions: ``[n, K]`` int32/int64 request positions (prefix included).
            request_ids: ``[n]`` int32/int64 request of each row (use ``shard.request_ids(rank)``);
                an id outside the step's requests is a ``ValueError`` on CPU tensors (on a device
                it is not checked: no sync).

        Returns:
            ``[n, K]`` int64: the row in the all-gathered buffer for positions of the step's new
            tokens; ``-1`` for cached-prefix positions (read them from the KV cache), negative or
            out-of-range positions. Runs on the device of the inputs (move the plan with
            :meth:`to`), without synchronising.
        """
        check_tensor("positions", positions, dtypes=(torch.int32, torch.int64), ndim=2)
        check_tensor("request_ids", request_ids, dtypes=(torch.int32, torch.int64), shape=[positions.shape[0]])
        check_same_device(positions=positions, request_ids=request_ids, kv_row=self.kv_row)
        n_req = self.shard.query_lens.numel()
        if (
            request_ids.device.type == "cpu"
            and request_ids.numel()
            and not (int(request_ids.min()) >= 0 and int(request_ids.max()) < n_req)
        ):  # where the check costs no device sync
            raise ValueError(
                f"request_ids must be in [0, {n_req}) (the step's requests), got {request_ids.min().item()} .. "
                f"{request_ids.max().item()}"
            )
        req = request_ids.to(torch.int64)
        prefix = self.shard.prefix_lens[req][:, None]
        new = self.shard.query_lens[req][:, None]
        off = positions.to(torch.int64) - prefix
        valid = (off >= 0) & (off < new)
        g = (self.shard.token_offsets[req][:, None] + off.clamp(min=0)).clamp(max=max(self.kv_row.numel() - 1, 0))
        if self.kv_row.numel() == 0:
            return torch.full_like(off, -1)
        return torch.where(valid, self.kv_row[g], torch.full_like(off, -1))

    def to(self, device: torch.device | str) -> PCPPlan:
        """A copy whose tensors live on ``device`` (its fingerprint, once computed, goes with it)."""
        moved = dataclasses.replace(
            self, shard=self.shard.to(device), kv_row=self.kv_row.to(device), need_stop=self.need_stop.to(device)
        )
        if "_fingerprint" in self.__dict__:
            object.__setattr__(moved, "_fingerprint", self.__dict__["_fingerprint"])
        return moved

    def fingerprint(self) -> int:
        """Stable 63-bit hash of the plan; equal on every rank that planned the same step. Computed
        once (it reads every tensor of the plan, a device sync where they live on one): a plan is
        not changed after it is made."""
        cached = self.__dict__.get("_fingerprint")
        if cached is None:
            cached = fingerprint_arrays(
                "PCPPlan", self.shard.fingerprint(), self.gathered_rows, self.kv_row, self.need_stop
            )
            object.__setattr__(self, "_fingerprint", cached)
        return int(cached)

    def __repr__(self) -> str:
        return (
            f"PCPPlan(world_size={self.world_size}, tokens={self.shard.num_tokens}, "
            f"counts={self.shard.counts.tolist()}, gathered_rows={self.gathered_rows}, "
            f"needed_kv_tokens={self.needed_kv_tokens.tolist()})"
        )


def pcp_plan(
    query_lens: object,
    world_size: int,
    *,
    prefix_lens: object = None,
    align: int = 1,
    topk: int = 2048,
) -> PCPPlan:
    """Plan a PCP prefill step: zigzag split (never gated) plus the KV all-gather layout.

    Args:
        query_lens: ``[R]`` new (prefill) tokens per request.
        world_size: PCP ranks ``W >= 1``.
        prefix_lens: ``[R]`` cached tokens before the new ones; default 0.
        align: chunk boundaries are multiples of ``align`` (see :func:`zigzag_split`).
        topk: only for the cost figures of the split.

    >>> plan = pcp_plan([8], 2)
    >>> plan.kv_row.tolist(), plan.need_stop.tolist()
    ([0, 1, 4, 5, 6, 7, 2, 3], [[8], [6]])
    >>> plan.needed_ranges(1), plan.kv_index(1).tolist()
    ([(0, 0, 6)], [0, 1, 4, 5, 6, 7])
    """
    check_world_size(world_size)
    shard = zigzag_split(query_lens, world_size, align=align, min_tokens=0, prefix_lens=prefix_lens, topk=topk)
    w, r_count = shard.world_size, shard.num_requests
    need = np.zeros((w, r_count), dtype=np.int64)
    offsets = shard.token_offsets.numpy()
    for r in range(w):
        ids = shard.token_ids(r).numpy()
        if ids.size:
            req = shard.token_request.numpy()[ids]
            last = np.zeros(r_count, dtype=np.int64)
            np.maximum.at(last, req, ids - offsets[req] + 1)
            need[r] = last
    return PCPPlan(
        shard=shard,
        kv_row=shard.padded_restore_index.clone(),
        gathered_rows=w * shard.padded_count,
        need_stop=to_int64_tensor(need),
    )
