"""The decode step of a Runtime: DCP or head-TP, sparse MLA or GQA, routed by the planner.

:class:`DecodeStep` holds what a decode step needs of its Runtime's config (group, layout,
route, workspace) and runs one step; :meth:`shardattn.runtime.runtime.Runtime.decode` calls it.
Its arguments are checked by :func:`~shardattn.runtime.decode_inputs.check_decode_inputs`; a
host plan's metadata reaches the device through
:class:`~shardattn.runtime.pinned_staging.PinnedStaging`, one reused pinned buffer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from shardattn.ops.gqa_decode import gqa_paged_decode
from shardattn.ops.sparse_mla_decode import sparse_mla_decode
from shardattn.ops.topk import convert_topk
from shardattn.parallel.comm import Comm
from shardattn.parallel.dcp import dcp_sparse_mla_decode
from shardattn.parallel.dcp_gqa import dcp_gqa_decode
from shardattn.parallel.gqa_head_tp import head_tp_kv_heads
from shardattn.parallel.packing import view_bytes
from shardattn.plan.context import DCPLayout
from shardattn.plan.decode_batch import DecodeBatch, plan_decode_batch, shard_of
from shardattn.plan.spec import ModelSpec
from shardattn.runtime.args import reject
from shardattn.runtime.decode_inputs import SparseCache, check_decode_inputs
from shardattn.runtime.modes import GQA_BACKEND
from shardattn.runtime.pinned_staging import PinnedStaging
from shardattn.runtime.workspace import RuntimeWorkspace

__all__ = ["DecodeStep"]


@dataclass(frozen=True)
class DecodeStep:
    """One Runtime's decode step.

    Attributes:
        spec: the model. comm: the group's :class:`~shardattn.parallel.comm.Comm`.
        layout: the DCP layout of the KV cache. ws: the Runtime's workspace (checked per step;
            its ``decode.*`` items hold the step's intermediates when q has the spec's dtype).
        dcp: the KV cache is split over the group (else head-TP). route_path: the planner's decode
            kernel path. heads_per_rank: ``H / W``. scale: softmax scale.
        return_lse: return the LSE; ``False``: every step returns ``(out, None)`` (the kernels
            and DCP's merge compute it all the same).
            causal: drafts attend causally.
        staging: the reused pinned buffer a batch's metadata crosses to the device through.
        kv_rows: checks a sparse-MLA cache against the Runtime's KV format and returns its rows
            (:meth:`~shardattn.runtime.runtime.Runtime.kv_rows`; ``None``: taken as given).
        bypass: told the queries' dtype when it is not the workspace's, so the step allocates its
            buffers instead (the Runtime logs it once, as its prefill does); ``None``: not told.
    """

    spec: ModelSpec
    comm: Comm
    layout: DCPLayout
    ws: RuntimeWorkspace
    dcp: bool
    route_path: str
    heads_per_rank: int
    scale: float
    return_lse: bool
    causal: bool
    staging: PinnedStaging = field(default_factory=PinnedStaging, compare=False, repr=False)
    kv_rows: Callable[[str, torch.Tensor], torch.Tensor] | None = field(default=None, compare=False, repr=False)
    bypass: Callable[[torch.dtype], None] | None = field(default=None, compare=False, repr=False)

    @functools.cached_property
    def kv_heads(self) -> tuple[int, int]:
        """``[start, stop)`` of the GQA KV heads this rank's cache holds: all under DCP, the rank's
        under head-TP."""
        if self.dcp:
            return 0, self.spec.num_kv_heads
        return head_tp_kv_heads(self.spec.num_heads, self.spec.num_kv_heads, self.comm.world_size, self.comm.rank)

    @functools.cached_property
    def kv_heads_from(self) -> str:
        """Where the count of :attr:`kv_heads` comes from, for a message about the cache's heads."""
        lo, hi = self.kv_heads
        if self.dcp:
            return f"all {hi} KV heads under DCP (the tokens are split, not the heads)"
        return f"this rank's {hi - lo} KV head(s) [{lo}, {hi}) of {self.spec.num_kv_heads} under head-TP"

    def local_heads(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice ``[rank * H/W, (rank + 1) * H/W)`` of a per-head tensor."""
        h = self.heads_per_rank
        return x[self.comm.rank * h : (self.comm.rank + 1) * h]

    def plan(
        self,
        seq_lens: object,
        qo_indptr: object | None = None,
        *,
        q_len: int | None = None,
        padded_requests: int | None = None,
        packed: bool | None = None,
    ) -> DecodeBatch:
        """Plan a batch on the host (:func:`~shardattn.plan.decode_batch.plan_decode_batch`) for this
        rank's layout and causality: packed (eager) by default, in ``q_len`` slots (a graph
        bucket) when ``q_len`` or ``padded_requests`` is given."""
        if packed is None:
            packed = q_len is None and padded_requests is None
        return plan_decode_batch(
            seq_lens,
            qo_indptr,
            layout=self.layout if self.dcp else None,
            rank=self.comm.rank,
            q_len=q_len,
            padded_requests=padded_requests,
            causal=self.causal,
            packed=packed,
        )

    def _planned_meta(
        self, batch: DecodeBatch, q: torch.Tensor, block_table: torch.Tensor, check: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(local_lens [T], req [T] or None, slot_req [T] or None)`` of a host plan on q's device,
        for the DCP GQA step.

        The metadata crosses once per plan and device (through the reused pinned buffer) and is
        kept with the plan, so the steps of every later layer reuse it: no copy, no host work.
        Under graph capture it is copied from the plan's own pinned tensor instead (a captured
        copy re-reads its source at every replay). ``req`` is ``None`` when query slot ``i`` reads
        block-table row ``i`` (the block table is then read as it is): one query per request, or
        a ``block_table`` of one row per query slot (where the plan has more query slots than
        request slots; where the counts are equal its rows are the requests'). ``slot_req`` is
        then, for a table of query slots, each slot's request (whose length the slot's row
        takes), else ``None``. The plan is checked against the inputs on the host; a mismatch
        raises on every rank, like the step's own checks.
        """
        try:
            if not isinstance(batch, DecodeBatch):
                raise TypeError(f"batch must be a DecodeBatch from plan(), got {type(batch).__name__}")
            shard = shard_of(self.layout if self.dcp else None, self.comm.rank)
            if batch.shard != shard or batch.causal not in (None, self.causal):
                raise ValueError(
                    f"batch was planned for shard (world_size, interleave, rank) {batch.shard}, causal "
                    f"{batch.causal}; this step is {shard}, causal {self.causal}: plan it with this Runtime's "
                    "decode_step.plan()"
                )
            if q.dim() != 3 or q.shape[0] != batch.num_slots:
                raise ValueError(f"q must have the plan's {batch.num_slots} query rows, got shape {list(q.shape)}")
            if isinstance(block_table, torch.Tensor) and block_table.dim() == 2:
                if block_table.shape[0] not in (batch.padded_requests, batch.num_slots):
                    raise ValueError(
                        f"block_table must have a row per request slot of the plan ({batch.padded_requests}, "
                        f"padded requests included) or per query slot ({batch.num_slots}), got "
                        f"{list(block_table.shape)}"
                    )
                room = int(block_table.shape[1]) * self.spec.page_size
                if batch.max_kv_len > room:
                    raise ValueError(
                        f"batch puts up to {batch.max_kv_len} KV tokens of a query on rank {self.comm.rank}, past its "
                        f"block_table's {block_table.shape[1]} pages of {self.spec.page_size}"
                    )
        except (TypeError, ValueError) as e:  # the peers are about to check their inputs, or to wait for ours
            reject(self.comm, e, collective=True, check=check)
        device = q.device
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            meta = batch.pinned_meta.to(device, non_blocking=True)
            lens, req = meta[0], meta[1]
        else:
            cached = batch.on_device.get(device)
            if cached is None:
                meta = self.staging.upload(batch.meta, device)
                cached = batch.on_device[device] = meta[0], meta[1]
            lens, req = cached
        rows = block_table.shape[0] if isinstance(block_table, torch.Tensor) and block_table.dim() == 2 else -1
        if batch.rows_are_requests and rows == batch.num_slots:
            return lens, None, None
        if rows == batch.num_slots != batch.padded_requests:  # a row per query slot: slot i reads row i
            return lens, None, req
        return lens, req, None

    def __call__(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        block_table: torch.Tensor,
        seq_lens: torch.Tensor | Sequence[int],
        *,
        topk_pos: torch.Tensor | None = None,
        req_ids: torch.Tensor | Sequence[int] | None = None,
        topk_length: torch.Tensor | None = None,
        topk_unique: bool = False,
        q_len_per_req: int | None = None,
        cu_q_lens: torch.Tensor | Sequence[int] | None = None,
        max_q_len: int | None = None,
        window_left: int = -1,
        sinks: torch.Tensor | None = None,
        batch: DecodeBatch | None = None,
        meta: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        check: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run one decode step (DCP or head-TP, by mode), routed by the planner.

        Arguments, shapes, dtypes and the result: :meth:`Runtime.decode
        <shardattn.runtime.runtime.Runtime.decode>`. Here, ``batch`` reaches the device in one copy
        per plan (through the reused pinned buffer; kept with the plan, so the steps of later
        layers copy nothing; under graph capture, from the plan's own pinned copy, which the
        replays re-read). A plan of one query per request reads the block table as it is (no
        gather of its rows). With ``batch`` and ``check``, the ranks agree on the plan's host
        fingerprint of the lengths, not on lengths read back from the device.
        """
        dcp = self.dcp
        try:
            seq_lens, block_table, topk_length, cu_q_lens, cache = check_decode_inputs(
                self, q, kv_cache, block_table, seq_lens, topk_pos=topk_pos, req_ids=req_ids,
                topk_length=topk_length, topk_unique=topk_unique, q_len_per_req=q_len_per_req,
                cu_q_lens=cu_q_lens, max_q_len=max_q_len, window_left=window_left, sinks=sinks,
                batch=batch, meta=meta, check=check,
            )  # fmt: skip
        except (TypeError, ValueError) as e:
            reject(self.comm, e, collective=dcp, check=check)
        # the buffers are sized for the spec's dtype; other dtypes (fp32 on a CPU) allocate per step
        if q.dtype == self.ws.dtype:
            buffers = self.ws.decode_buffers("dcp" if dcp else "headtp")
        else:
            buffers = {}
            if self.bypass is not None:
                self.bypass(q.dtype)
        page = self.spec.page_size
        if isinstance(cache, SparseCache):
            if dcp:
                out, lse = dcp_sparse_mla_decode(
                    q,
                    cache.kv,
                    cache.topk_pos,
                    cache.req_ids,
                    block_table,
                    self.layout,
                    self.comm,
                    block_size=page,
                    scale=self.scale,
                    v_dim=self.spec.v_dim,
                    seq_lens=seq_lens,
                    topk_length=topk_length,
                    sinks=sinks,
                    rows_unique=topk_unique,
                    check=check,
                    workspace=buffers,
                )
                return self._result(out, lse)
            rows_ws, pos = buffers.get("rows"), cache.topk_pos
            # unique rows: the valid ones packed at the front, their count the kernel's topk_length,
            # so it reads no entry past them (a request shorter than the top-k leaves the rest
            # invalid); otherwise the de-duplication drops the invalid entries itself (D89)
            rows, counts = convert_topk(
                pos, cache.req_ids, block_table, block_size=page, seq_lens=seq_lens, topk_length=topk_length,
                packed=topk_unique, out=None if rows_ws is None or pos.dim() != 2 else view_bytes(
                    rows_ws, tuple(pos.shape), torch.int32, "rows"
                ),
            )  # fmt: skip
            out, lse = sparse_mla_decode(
                q,
                cache.kv,
                rows,
                scale=self.scale,
                v_dim=self.spec.v_dim,
                topk_length=counts if topk_unique else None,
                sinks=None if sinks is None else self.local_heads(sinks),
                rows_unique=topk_unique,
            )
            return self._result(out, lse)
        k_cache, v_cache = cache
        backend = GQA_BACKEND[self.route_path]
        if dcp:
            step_meta: torch.Tensor | tuple[torch.Tensor, torch.Tensor | None] | None = meta
            fingerprint = None
            if meta is None and batch is not None:  # planned: the plan's metadata, its host fingerprint
                local_lens, req, slot_req = self._planned_meta(batch, q, block_table, check)
                step_meta = local_lens, req
                fingerprint = batch.fingerprint if check else None
                if seq_lens.shape[0] != batch.padded_requests:  # a padded plan: its lengths, padding's 0s too
                    seq_lens = batch.seq_lens.to(q.device)
                if slot_req is not None:  # a block-table row per query slot: each takes its request's length
                    seq_lens = seq_lens.index_select(0, slot_req)
            out, lse = dcp_gqa_decode(
                q,
                k_cache,
                v_cache,
                block_table,
                seq_lens,
                self.layout,
                self.comm,
                q_len_per_req=q_len_per_req,
                cu_q_lens=cu_q_lens,
                causal=self.causal,
                sinks=sinks,
                scale=self.scale,
                backend=backend,
                meta=step_meta,
                check=check,
                lens_fingerprint=fingerprint,
                workspace=buffers,
            )
            return self._result(out, lse)
        result = gqa_paged_decode(
            q,
            k_cache,
            v_cache,
            block_table,
            seq_lens,
            q_len_per_req=q_len_per_req,
            cu_q_lens=cu_q_lens,
            max_q_len=max_q_len,
            causal=self.causal,
            window_left=window_left,
            sinks=None if sinks is None else self.local_heads(sinks),
            return_lse=self.return_lse,
            scale=self.scale,
            backend=backend,
        )
        return (result, None) if isinstance(result, torch.Tensor) else result  # out alone without return_lse

    def _result(self, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A step's ``(out, lse)`` as returned: ``lse`` only with :attr:`return_lse`."""
        return out, (lse if self.return_lse else None)
