"""The decode step of a Runtime: DCP or head-TP, sparse MLA or GQA, routed by the planner.

:class:`DecodeStep` holds what a decode step needs of its Runtime's config (group, layout,
route, workspace) and runs one step; :meth:`shardattn.runtime.runtime.Runtime.decode` calls it.
Its host metadata reaches the device through :class:`PinnedStaging`, one reused pinned buffer
(pinning per step costs far more than the copy; copying from pageable memory makes the driver
wait for the stream first).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from shardattn._checks import check_bool, check_int, check_sink_logits, check_tensor
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
from shardattn.runtime.args import (
    as_index,
    check_drafts_on_host,
    check_gqa_cache,
    check_paged_rows,
    check_plan_lengths,
    check_table_on_host,
    reject,
)
from shardattn.runtime.modes import GQA_BACKEND
from shardattn.runtime.workspace import RuntimeWorkspace

__all__ = ["DecodeStep", "PinnedStaging"]


class _SparseCache(NamedTuple):
    """A sparse-MLA decode step's checked cache and top-k: ``kv [R, row]`` rows (the Runtime's KV
    format), ``topk_pos [T, K]`` and ``req_ids [T]`` int32."""

    kv: torch.Tensor
    topk_pos: torch.Tensor
    req_ids: torch.Tensor


class PinnedStaging:
    """One pinned staging buffer (allocated on first use, grown when too small)."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def upload(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``host`` (a CPU tensor) on ``device``: one non-blocking copy through the pinned buffer.

        Args:
            host: CPU tensor (any dtype and shape). device: destination.
        Returns:
            a new tensor on ``device`` (``host`` itself for a CPU device).
        """
        if device.type != "cuda":
            return host if host.device == device else host.to(device)
        n = host.numel() * host.element_size()
        if self._buf is None or self._buf.numel() < n:
            self._buf = torch.empty(max(n, 1 << 14), dtype=torch.uint8, pin_memory=True)
            self._copied = torch.cuda.Event()
        elif self._copied is not None and self._copied.query() is False:
            self._copied.synchronize()  # the previous step's copy is still reading the buffer
        staged = self._buf[:n].view(host.dtype).view(host.shape)
        staged.copy_(host)
        out = torch.empty(host.shape, dtype=host.dtype, device=device)
        out.copy_(staged, non_blocking=True)
        assert self._copied is not None
        self._copied.record()
        return out


@dataclass(frozen=True)
class DecodeStep:
    """One Runtime's decode step.

    Attributes:
        spec: the model. comm: the group's :class:`~shardattn.parallel.comm.Comm`.
        layout: the DCP layout of the KV cache. ws: the Runtime's workspace (checked per step;
            its ``decode.*`` items hold the step's intermediates when q has the spec's dtype).
        dcp: the KV cache is split over the group (else head-TP). route_path: the planner's decode
            kernel path. heads_per_rank: ``H / W``. scale: softmax scale.
        return_lse: return the LSE (head-TP GQA may skip it). causal: drafts attend causally.
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
    def _kv_heads(self) -> tuple[int, int]:
        """``[start, stop)`` of the GQA KV heads this rank's cache holds: all under DCP, the rank's
        under head-TP."""
        if self.dcp:
            return 0, self.spec.num_kv_heads
        return head_tp_kv_heads(self.spec.num_heads, self.spec.num_kv_heads, self.comm.world_size, self.comm.rank)

    @functools.cached_property
    def _kv_heads_from(self) -> str:
        lo, hi = self._kv_heads
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
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(local_lens [T], req [T] or None)`` of a host plan on q's device, for the DCP GQA step.

        The metadata crosses once per plan and device (through the reused pinned buffer) and is
        kept with the plan, so the steps of every later layer reuse it: no copy, no host work.
        Under graph capture it is copied from the plan's own pinned tensor instead (a captured
        copy re-reads its source at every replay). ``req`` is ``None`` when query ``i`` belongs
        to request ``i`` (the block table is then read as it is). The plan is checked against the
        inputs on the host; a mismatch raises on every rank, like the step's own checks.
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
        return lens, None if batch.rows_are_requests and rows == batch.num_slots else req

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
            heads, dim = self.heads_per_rank, self.spec.head_dim
            t, h, d = check_tensor("q", q, ndim=3).shape
            if d != dim:
                raise ValueError(f"q must have last dim {dim} (the model's head_dim), got shape {list(q.shape)}")
            if h != heads:
                world = self.comm.world_size
                raise ValueError(
                    f"q must hold this rank's {heads} heads (H/W: {self.spec.num_heads} heads over {world} ranks), "
                    f"got {h} heads (shape {list(q.shape)})"
                )
            check_bool("topk_unique", topk_unique)
            check_int("window_left", window_left, minimum=-1)
            if window_left >= 0 and (dcp or self.spec.kind != "gqa"):
                raise ValueError(
                    f"window_left={window_left}: sliding windows are supported by head-TP GQA decode only "
                    + ("(under DCP a global window is not a local one; use mode 'headtp')" if dcp else "(sparse MLA)")
                )
            given_seq_lens, given_cu_q_lens = seq_lens, cu_q_lens  # as passed: host lists move to q's device here
            seq_lens = as_index("seq_lens", seq_lens, q.device)
            block_table = as_index("block_table", block_table)
            topk_pos, topk_length = as_index("topk_pos", topk_pos), as_index("topk_length", topk_length)
            req_ids, cu_q_lens = as_index("req_ids", req_ids, q.device), as_index("cu_q_lens", cu_q_lens, q.device)
            k = int(topk_pos.shape[1]) if isinstance(topk_pos, torch.Tensor) and topk_pos.dim() == 2 else self.ws.topk
            self.ws.check("decode", "dcp" if dcp else "headtp", tokens=t, topk=k)
            if sinks is not None and not dcp:  # every head's, before head-TP takes the rank's (DCP checks them)
                check_sink_logits(sinks, self.spec.num_heads, device=q.device)
            cache: _SparseCache | tuple[torch.Tensor, torch.Tensor]
            if self.spec.kind == "sparse_mla":
                gqa_only = {"q_len_per_req": q_len_per_req, "cu_q_lens": cu_q_lens, "max_q_len": max_q_len}
                for name, x in {**gqa_only, "batch": batch, "meta": meta}.items():
                    if x is not None:
                        raise ValueError(f"{name} is GQA decode's; a sparse-MLA step reads topk_pos: pass None")
                if topk_pos is None or req_ids is None:
                    raise ValueError("sparse-MLA decode needs topk_pos [T, K] and req_ids [T]")
                if isinstance(topk_pos, torch.Tensor) and topk_pos.dim() == 2 and topk_pos.shape[0] != t:  # q's T
                    raise ValueError(f"topk_pos must have one row per query ({t}), got shape {list(topk_pos.shape)}")
                if not isinstance(kv_cache, torch.Tensor):
                    raise TypeError("kv_cache of a sparse-MLA model must be one [R, D] tensor")
                if kv_cache.dim() == 3:  # paged rows: the block table's pages are the model's
                    check_paged_rows("kv_cache", kv_cache, self.spec.page_size)
                if self.kv_rows is not None:  # the Runtime's KV format (rows in q's dtype, or fp8_ds_mla)
                    kv_cache = self.kv_rows("kv_cache", kv_cache)
                if kv_cache.dtype != torch.uint8:  # rows in q's dtype, named as the caller passed them
                    check_tensor("kv_cache", kv_cache, dtypes=(q.dtype,), ndim=2)
                if not dcp:  # positions past the table would read no key (the DCP step checks its shard's)
                    check_table_on_host(
                        block_table,
                        seq_lens,
                        page_size=self.spec.page_size,
                        kv_rows=kv_cache.shape[0] * (kv_cache.shape[1] if kv_cache.dim() == 3 else 1),
                    )
                cache = _SparseCache(kv_cache, topk_pos, req_ids)
            else:
                for name, x in (("topk_pos", topk_pos), ("req_ids", req_ids), ("topk_length", topk_length)):
                    if x is not None:
                        raise ValueError(f"{name} is sparse MLA's; a GQA decode attends every earlier token: pass None")
                cache = check_gqa_cache(
                    kv_cache, page_size=self.spec.page_size, kv_heads=self._kv_heads[1] - self._kv_heads[0],
                    head_dim=dim, dtype=q.dtype, device=q.device, kv_heads_from=lambda: self._kv_heads_from,
                )  # fmt: skip
                if not dcp and (batch is not None or meta is not None):
                    raise ValueError(
                        f"{'batch' if batch is not None else 'meta'} is a DCP decode's plan; a head-TP step plans "
                        "nothing: pass None"
                    )
                if batch is not None and meta is not None:
                    raise ValueError("pass batch (a host plan) or meta (its metadata on the device), not both")
                if dcp and batch is not None and check:  # its lengths replace those passed beside it
                    check_plan_lengths(batch, given_seq_lens, given_cu_q_lens, q_len_per_req=q_len_per_req)
                if max_q_len is not None:  # a promise about the drafts, in every mode (DCP reads no bound)
                    check_int("max_q_len", max_q_len, minimum=0)
                planned = dcp and (batch is not None or meta is not None)  # a DCP plan's metadata replaces the drafts
                if not planned and isinstance(block_table, torch.Tensor) and block_table.dim() == 2:
                    # the drafts against the values as passed (on a device the op reads none)
                    check_drafts_on_host(
                        given_seq_lens, given_cu_q_lens, q_len_per_req=q_len_per_req,
                        max_q_len=max_q_len, tokens=t, requests=block_table.shape[0],
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
        if isinstance(cache, _SparseCache):
            if dcp:
                return dcp_sparse_mla_decode(
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
            rows_ws, pos = buffers.get("rows"), cache.topk_pos
            # the valid rows packed at the front, their count the kernel's topk_length: it reads no
            # entry past them (a request shorter than the top-k leaves the rest invalid)
            rows, counts = convert_topk(
                pos, cache.req_ids, block_table, block_size=page, seq_lens=seq_lens, topk_length=topk_length,
                packed=True, out=None if rows_ws is None or pos.dim() != 2 else view_bytes(
                    rows_ws, tuple(pos.shape), torch.int32, "rows"
                ),
            )  # fmt: skip
            return sparse_mla_decode(
                q,
                cache.kv,
                rows,
                scale=self.scale,
                v_dim=self.spec.v_dim,
                topk_length=counts,
                sinks=None if sinks is None else self.local_heads(sinks),
                rows_unique=topk_unique,
            )
        k_cache, v_cache = cache
        backend = GQA_BACKEND[self.route_path]
        if dcp:
            step_meta: torch.Tensor | tuple[torch.Tensor, torch.Tensor | None] | None = meta
            fingerprint = None
            if meta is None and batch is not None:  # planned: the plan's metadata, its host fingerprint
                step_meta = self._planned_meta(batch, q, block_table, check)
                fingerprint = batch.fingerprint if check else None
                if seq_lens.shape[0] != batch.padded_requests:  # a padded plan: its lengths, padding's 0s too
                    seq_lens = batch.seq_lens.to(q.device)
            return dcp_gqa_decode(
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
