"""Decode context parallelism (DCP): the KV cache split over ranks, partials merged by LSE.

Every request's KV tokens are spread over the ``N`` ranks of the DCP group by the
:class:`~shardattn.plan.DCPLayout` (token ``t`` on rank ``(t // I) % N`` at local index
``(t // (N*I)) * I + t % I``). A decode step::

    rank r: q [T, H/N, D] (its heads)
        -- all-gather -->  q [T, H, D]
        -- local attention over its KV shard (indices translated to the rank's local rows) -->
           partial out [T, H, Dv], lse [T, H]       (a row with no local key: (0, -inf))
        -- collector (one all-to-all of packed out + lse, local LSE merge) -->
           out [T, H/N, Dv], lse [T, H/N]

Two kernels: sparse MLA (:func:`dcp_sparse_mla_decode`; each query's request-global top-k
positions become local rows by :func:`~shardattn.kernels.topk.convert_topk` with the rank's
:class:`~shardattn.kernels.topk.DcpShard`) and GQA over a paged cache (:func:`dcp_gqa_decode`;
every query token gets its own causal *local* length,
:meth:`~shardattn.plan.DCPLayout.causal_local_lens`, so uniform and ragged drafts are exact).

Sinks are counted once: only rank 0 passes them to its local kernel. Rank 0 holds global token
0, so its local row is non-empty whenever the global row is, and an empty global row stays
``(0, -inf)`` for GQA (``(0, sink)`` for sparse MLA, as in the single-process kernel). Sliding
windows are not supported under DCP (a global window is not a local one).

Collectives per step: one all-gather (q) plus the collector's (one all-to-all with
``scatter_heads=True``), plus one small agreement all-gather with ``check=True``.

Buffers: with ``workspace`` (a Runtime's reserved ``decode.*`` items, flat ``uint8``) the step
allocates none of its large intermediates: ``"q"`` holds the gathered queries ``[N, T, H/N, D]``
and their head-major copy ``[T, H, D]`` one after the other, ``"rows"`` the converted top-k
(sparse MLA), ``"out"`` / ``"lse"`` the local partial, ``"send"`` / ``"recv"`` the collector's
packed all-to-all (:func:`~shardattn.parallel.collector.collect_partials`). Every one of them is
written before it is read within the step, and nothing in them is needed after the step returns
(the merged result is a new tensor), so the buffers may be shared with other steps that never run
at the same time (the Runtime's arena, :mod:`~shardattn.parallel.runtime_workspace`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardattn._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_choice,
    check_int,
    check_same_device,
    check_scale,
    check_tensor,
)
from shardattn.kernels.gqa_decode import BACKENDS, run_gqa_paged_decode
from shardattn.kernels.sparse_mla import check_head_dim, sparse_mla_attention
from shardattn.kernels.topk import DcpShard, convert_topk
from shardattn.parallel.collector import collect_checked, resolve_strategy
from shardattn.parallel.comm import Comm, stable_fingerprint
from shardattn.parallel.groups import GroupLike
from shardattn.parallel.packing import view_bytes
from shardattn.plan.context import DCPLayout

__all__ = ["dcp_gqa_decode", "dcp_sparse_mla_decode"]


def _check_common(q: torch.Tensor, layout: DCPLayout, comm: Comm, sinks: torch.Tensor | None) -> None:
    if not isinstance(layout, DCPLayout):
        raise TypeError(f"layout must be a DCPLayout, got {type(layout).__name__}")
    if layout.world_size != comm.world_size:
        raise ValueError(f"layout is for world_size={layout.world_size}, but the group has {comm.world_size} ranks")
    check_tensor("q_heads_local", q, dtypes=FLOAT_DTYPES, ndim=3)
    if q.shape[1] < 1:
        raise ValueError(f"q_heads_local must hold at least one head, got shape {list(q.shape)}")
    if sinks is not None:
        check_tensor("sinks", sinks, dtypes=(torch.float32,), shape=(q.shape[1] * comm.world_size,))


def _host_values(t: torch.Tensor | None) -> list[int] | None:
    """Small host-side lists for the fingerprint (a device tensor costs a copy: only with ``check``)."""
    return None if t is None else [int(x) for x in t.tolist()]


Workspace = dict[str, torch.Tensor]


def _gather_heads(q: torch.Tensor, comm: Comm, ws: Workspace) -> torch.Tensor:
    """``[T, H/N, D]`` on every rank -> ``[T, H, D]`` (rank r's heads at ``r*H/N``), in ``ws["q"]`` if given."""
    t, h, d = q.shape
    w = comm.world_size
    buf = ws.get("q")
    gathered = view_bytes(buf, (w, t, h, d), q.dtype, "q")
    gathered = comm.all_gather(q, out=gathered).permute(1, 0, 2, 3)
    if buf is None:
        return gathered.reshape(t, w * h, d)
    n = w * t * h * d * q.element_size()
    full = view_bytes(buf[n:], (t, w, h, d), q.dtype, "q")
    assert full is not None
    return full.copy_(gathered).view(t, w * h, d)


def _partial_buffers(ws: Workspace, q_full: torch.Tensor, v_dim: int) -> dict[str, torch.Tensor]:
    """The local kernel's ``out=`` / ``lse=`` destinations in ``ws["out"]`` / ``ws["lse"]`` (none without)."""
    if "out" not in ws or "lse" not in ws:
        return {}
    t, h, _ = q_full.shape
    out = view_bytes(ws["out"], (t, h, v_dim), q_full.dtype, "out")
    lse = view_bytes(ws["lse"], (t, h), torch.float32, "lse")
    assert out is not None and lse is not None
    return {"out": out, "lse": lse}


def dcp_sparse_mla_decode(
    q_heads_local: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_pos: torch.Tensor,
    req_ids: torch.Tensor,
    block_table: torch.Tensor,
    layout: DCPLayout,
    group: GroupLike | Comm,
    *,
    block_size: int,
    scale: float,
    v_dim: int = 512,
    seq_lens: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    scatter_heads: bool = True,
    strategy: str = "auto",
    attention: Callable[..., tuple[torch.Tensor, torch.Tensor]] = sparse_mla_attention,
    check: bool = True,
    workspace: Workspace | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode with the KV cache split over the DCP group.

    Args:
        q_heads_local: ``[T, H/N, D]`` fp16/bf16/fp32, this rank's heads of the step's queries.
        kv_cache: ``[R_local, D]`` this rank's KV rows (q's dtype); block ``b`` of the local block
            table is rows ``b * block_size .. (b+1) * block_size``; the value is ``[:, :v_dim]``.
        topk_pos: ``[T, K]`` int32 request-global token positions of each query's top-k
            (``-1`` / negative / ``>= seq_lens`` = invalid, anywhere), identical on every rank.
        req_ids: ``[T]`` int32 request of each query.
        block_table: ``[B, M]`` int32 this rank's local block table (its blocks hold local
            positions, :meth:`~shardattn.plan.DCPLayout.local_index`); ``-1`` = unallocated.
        layout: the DCP layout; ``layout.world_size`` must be the group's size.
        group: the DCP process group or a :class:`~shardattn.parallel.comm.Comm`
            (a ``ProcessGroup``, a 1-D ``DeviceMesh`` or ``(mesh, dim name)``: :mod:`~shardattn.parallel.groups`).
        block_size: tokens per block. scale: softmax scale. v_dim: value width.
        seq_lens: ``[B]`` int32 global request lengths; positions at or past them are invalid.
        topk_length: ``[T]`` int32 leading ``topk_pos`` entries to use, optional.
        sinks: ``[H]`` fp32 sink logits (all heads), counted once (rank 0), optional.
        scatter_heads: return this rank's heads (``[T, H/N, Dv]``); ``False``: all heads.
        strategy: the collector's strategy (:func:`~shardattn.parallel.collector.collect_partials`).
        attention: the local kernel, called like :func:`~shardattn.kernels.sparse_mla.sparse_mla_attention`
            (with ``out=`` / ``lse=`` destinations when ``workspace`` is given).
        check: agree on shapes and layout first (one small all-gather, a host sync); bad input on
            any rank then raises on every rank.
        workspace: optional flat ``uint8`` buffers ``{"q", "rows", "out", "lse", "send", "recv"}``
            the intermediates live in (module docstring); default: allocated per step.
    Returns:
        ``(out [T, H/N or H, v_dim] in q's dtype, lse [T, H/N or H] fp32)``, equal to sparse MLA
        over the whole (unsplit) cache; a query with no valid key is ``(0, -inf)``.

    Example (every rank of a DCP group of ``N`` runs this)::

        layout = DCPLayout(N, interleave=1)
        out, lse = dcp_sparse_mla_decode(q_local, kv_local, topk_pos, req_ids, table_local, layout,
                                         group, block_size=64, scale=576 ** -0.5, seq_lens=seq_lens)
        # q_local [T, H/N, 576] -> out [T, H/N, 512], lse [T, H/N]
    """
    comm = Comm.wrap(group)
    chosen = ""  # the collector's strategy, resolved by validate()

    def validate() -> int:
        nonlocal chosen
        q = q_heads_local
        _check_common(q, layout, comm, sinks)
        t, _, d = q.shape
        check_tensor("kv_cache", kv_cache, dtypes=(q.dtype,), ndim=2)
        check_head_dim("q_heads_local", q, "kv_cache", kv_cache)
        check_scale("scale", scale)
        check_tensor("topk_pos", topk_pos, dtypes=INDEX_DTYPES, ndim=2)
        if topk_pos.shape[0] != t:
            raise ValueError(f"topk_pos must have one row per query ({t}), got shape {list(topk_pos.shape)}")
        check_tensor("req_ids", req_ids, dtypes=INDEX_DTYPES, shape=(t,))
        check_tensor("block_table", block_table, dtypes=INDEX_DTYPES, ndim=2)
        b, m = block_table.shape
        bs = check_int("block_size", block_size, minimum=1)
        if not 0 < check_int("v_dim", v_dim) <= d:
            raise ValueError(f"v_dim must be in (0, {d}], got {v_dim}")
        if seq_lens is not None:
            check_tensor("seq_lens", seq_lens, dtypes=INDEX_DTYPES, shape=(b,))
        if topk_length is not None:
            check_tensor("topk_length", topk_length, dtypes=INDEX_DTYPES, shape=(t,))
        check_same_device(
            q_heads_local=q, kv_cache=kv_cache, topk_pos=topk_pos, req_ids=req_ids, block_table=block_table,
            seq_lens=seq_lens, topk_length=topk_length, sinks=sinks,
        )  # fmt: skip
        if block_table.device.type == "cpu" and block_table.numel():  # value checks that cost no sync
            top = int(block_table.max())
            if (top + 1) * bs > kv_cache.shape[0]:
                raise ValueError(
                    f"block_table points past kv_cache: block {top} needs rows up to {(top + 1) * bs}, "
                    f"kv_cache has {kv_cache.shape[0]}"
                )
            if seq_lens is not None:
                local = layout.local_seq_lens(seq_lens, comm.rank)
                if b and int(local.max()) > m * bs:
                    i = int(local.argmax())
                    raise ValueError(
                        f"seq_lens[{i}]={int(seq_lens[i])} puts {int(local[i])} tokens on rank {comm.rank}, "
                        f"but its block_table holds {m} blocks of {bs}"
                    )
        chosen = resolve_strategy(strategy, comm.backend, scatter_heads=scatter_heads)
        if not check:
            return 0  # nothing to agree on: skip hashing on the step's hot path
        return stable_fingerprint(
            "dcp_sparse_mla", layout, tuple(q.shape), q.dtype, v_dim, topk_pos.shape[1], b, sinks is not None,
            scatter_heads, strategy, _host_values(seq_lens) if check else None,
        )  # fmt: skip

    comm.agree_on("DCP sparse MLA decode inputs", validate, check=check)
    with comm.reporting_failures():  # a failure from here on is reported to the waiting peers
        ws = workspace or {}
        q_full = _gather_heads(q_heads_local, comm, ws)
        rows, _ = convert_topk(
            topk_pos, req_ids, block_table, block_size=block_size, seq_lens=seq_lens, topk_length=topk_length,
            dcp=DcpShard(layout.world_size, layout.interleave, comm.rank),
            out=view_bytes(ws.get("rows"), tuple(topk_pos.shape), torch.int32, "rows"),
        )  # fmt: skip
        out, lse = attention(
            q_full, kv_cache, rows, scale=scale, v_dim=v_dim, sinks=sinks if comm.rank == 0 else None, return_lse=True,
            **_partial_buffers(ws, q_full, v_dim),
        )  # fmt: skip
        # checked above; out / lse come from the checked inputs: the collector runs unchecked
        return collect_checked(out, lse, comm, chosen, scatter_heads, ws or None)


def dcp_gqa_decode(
    q_heads_local: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    layout: DCPLayout,
    group: GroupLike | Comm,
    *,
    q_len_per_req: int | None = None,
    cu_q_lens: torch.Tensor | None = None,
    causal: bool = True,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
    scatter_heads: bool = True,
    strategy: str = "auto",
    backend: str = "auto",
    meta: torch.Tensor | tuple[torch.Tensor, torch.Tensor | None] | None = None,
    check: bool = True,
    lens_fingerprint: int | None = None,
    workspace: Workspace | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GQA decode over a paged KV cache split over the DCP group (speculative drafts included).

    Args:
        q_heads_local: ``[total_q, Hq/N, D]`` fp16/bf16/fp32, this rank's query heads, requests'
            queries packed in order.
        k_cache, v_cache: ``[num_pages, page_size, Hkv, D]`` this rank's paged cache (q's dtype),
            holding its local tokens (:meth:`~shardattn.plan.DCPLayout.local_index`);
            ``Hq % Hkv == 0``.
        block_table: ``[B, max_pages]`` int32 this rank's local page table.
        seq_lens: ``[B]`` int32 *global* keys per request, drafts included (0 = padding).
        layout: the DCP layout; ``layout.world_size`` must be the group's size.
        group: the DCP process group or a :class:`~shardattn.parallel.comm.Comm`
            (a ``ProcessGroup``, a 1-D ``DeviceMesh`` or ``(mesh, dim name)``: :mod:`~shardattn.parallel.groups`).
        q_len_per_req: uniform drafts per request (default 1); or
        cu_q_lens: ``[B+1]`` int32 ragged query offsets (rows past ``cu_q_lens[-1]`` are padding).
        causal: drafts see each other causally (query ``j`` of ``Q`` sees ``L - Q + j + 1`` keys).
        sinks: ``[Hq]`` fp32 sink logits, counted once (rank 0), optional.
        scale: softmax scale (default ``D ** -0.5``).
        scatter_heads, strategy: the collector's output layout and strategy.
        backend: the local kernel's backend (:func:`~shardattn.kernels.gqa_decode.gqa_paged_decode`).
        meta: ``[2, total_q]`` int32 on q's device, the host-planned metadata of this rank
            (:meth:`~shardattn.plan.decode_batch.DecodeBatch.to`: each query's local KV length, 0
            for padding, and its block-table row). It replaces the per-step index arithmetic
            (the lean path: no torch op besides the kernels, the collectives and one gather of
            block-table rows); ``q_len_per_req`` / ``cu_q_lens`` are then not needed. Also
            a pair of ``[total_q]`` int32 tensors (two static graph inputs), whose second may be
            ``None`` when query ``i`` reads block-table row ``i`` (one query per request: the
            block table is read as it is, with no gather of its rows).
        check: agree on shapes, layout and lengths first (one small all-gather, a host sync).
            Either way the inputs are checked on this rank first; values (lengths, pages) only
            when they live on the CPU, where reading them costs no device synchronisation.
        lens_fingerprint: with ``check``, a host fingerprint of the lengths (a plan's
            :attr:`~shardattn.plan.decode_batch.DecodeBatch.fingerprint`), agreed on instead of
            ``seq_lens`` / ``cu_q_lens`` read back from the device (which costs a sync of its own).
        workspace: optional flat ``uint8`` buffers ``{"q", "out", "lse", "send", "recv"}`` the
            intermediates live in (module docstring); default: allocated per step.
    Returns:
        ``(out [total_q, Hq/N or Hq, D] in q's dtype, lse [total_q, Hq/N or Hq] fp32)``, equal to
        :func:`~shardattn.kernels.gqa_decode.gqa_paged_decode` over the whole cache.

    Example (every rank of a DCP group of ``N`` runs this)::

        out, lse = dcp_gqa_decode(q_local, k_local, v_local, table_local, seq_lens, DCPLayout(N), group,
                                  q_len_per_req=2)
        # q_local [2B, Hq/N, D] -> out [2B, Hq/N, D], lse [2B, Hq/N]
    """
    comm = Comm.wrap(group)
    chosen = ""  # the collector's strategy, resolved by validate()

    def validate() -> int:
        nonlocal chosen
        q = q_heads_local
        _check_common(q, layout, comm, sinks)
        t, h, d = q.shape
        check_tensor("k_cache", k_cache, dtypes=(q.dtype,), ndim=4)
        pages, page, hkv, dk = k_cache.shape
        check_tensor("v_cache", v_cache, dtypes=(q.dtype,), shape=tuple(k_cache.shape))
        if dk != d:
            raise ValueError(f"q_heads_local must have last dim {dk} (k_cache's head dim), got {d}")
        if scale is not None:
            check_scale("scale", scale)
        check_choice("backend", backend, BACKENDS)
        if hkv < 1 or (h * comm.world_size) % hkv:
            raise ValueError(f"query heads ({h} x {comm.world_size} ranks) must be a multiple of KV heads ({hkv})")
        check_tensor("block_table", block_table, dtypes=INDEX_DTYPES, ndim=2)
        b = block_table.shape[0]
        check_tensor("seq_lens", seq_lens, dtypes=INDEX_DTYPES, shape=(b,))
        if q_len_per_req is not None and cu_q_lens is not None:
            raise ValueError("give q_len_per_req (uniform drafts) or cu_q_lens (ragged drafts), not both")
        meta_lens = meta_req = None
        if isinstance(meta, tuple | list):
            if len(meta) != 2:
                raise ValueError(f"meta must be a [2, T] tensor or a (local_lens, req) pair, got {len(meta)} items")
            meta_lens, meta_req = meta
            check_tensor("meta[0]", meta_lens, dtypes=(torch.int32,), shape=(t,))
            if meta_req is None:  # query i reads block-table row i
                if b != t:
                    raise ValueError(
                        f"meta[1] = None reads block_table row i for query i: block_table must have {t} rows, got {b}"
                    )
            else:
                check_tensor("meta[1]", meta_req, dtypes=(torch.int32,), shape=(t,))
        elif meta is not None:
            check_tensor("meta", meta, dtypes=(torch.int32,), shape=(2, t))
            meta_lens, meta_req = meta[0], meta[1]
        elif cu_q_lens is not None:
            check_tensor("cu_q_lens", cu_q_lens, dtypes=INDEX_DTYPES, shape=(b + 1,))
        else:
            ql = 1 if q_len_per_req is None else check_int("q_len_per_req", q_len_per_req, minimum=1)
            if t != b * ql:
                raise ValueError(f"q_heads_local must have B * q_len_per_req = {b * ql} rows, got {t}")
        check_same_device(
            q_heads_local=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seq_lens=seq_lens,
            cu_q_lens=cu_q_lens, sinks=sinks, meta_lens=meta_lens, meta_req=meta_req,
        )  # fmt: skip
        if seq_lens.device.type == "cpu" and b:  # value checks that would stall a GPU: CPU tensors only
            _check_host_values(
                seq_lens, block_table, layout, comm.rank, pages=pages, page=page, t=t, cu_q_lens=cu_q_lens,
                meta_lens=meta_lens, meta_req=meta_req,
            )  # fmt: skip
        chosen = resolve_strategy(strategy, comm.backend, scatter_heads=scatter_heads)
        if not check:
            return 0  # nothing to agree on: skip hashing on the step's hot path
        lens = (_host_values(seq_lens), _host_values(cu_q_lens)) if lens_fingerprint is None else (lens_fingerprint,)
        return stable_fingerprint(
            "dcp_gqa", layout, tuple(q.shape), q.dtype, hkv, b, q_len_per_req, causal, sinks is not None,
            scatter_heads, strategy, meta is not None, *lens,
        )  # fmt: skip

    comm.agree_on("DCP GQA decode inputs", validate, check=check)
    with comm.reporting_failures():  # a failure from here on is reported to the waiting peers
        ws = workspace or {}
        q_full = _gather_heads(q_heads_local, comm, ws)
        t, hq, d = q_full.shape
        b = block_table.shape[0]
        if b == 0 or t == 0:
            out = q_full.new_zeros(t, hq, d)
            lse = torch.full((t, hq), float("-inf"), dtype=torch.float32, device=q_full.device)
            return collect_checked(out, lse, comm, chosen, scatter_heads, ws or None)
        if meta is not None:  # planned on the host: no index arithmetic here
            local_lens, req = meta[0], meta[1]
        else:
            cu = cu_q_lens
            if cu is None:
                ql = 1 if q_len_per_req is None else q_len_per_req
                cu = torch.arange(b + 1, dtype=seq_lens.dtype, device=seq_lens.device) * ql
            # every query becomes a one-token "request" with its own causal local length and its request's pages
            local_lens = layout.causal_local_lens(seq_lens, cu, t, comm.rank, causal=causal).to(torch.int32)
            tok = torch.arange(t, device=cu.device)
            req = torch.searchsorted(cu[1:].to(torch.int64).contiguous(), tok, right=True).clamp(max=b - 1)
        # checked above; the local kernel's arguments are built from checked inputs: no second check
        dest = _partial_buffers(ws, q_full, d)
        out, lse = run_gqa_paged_decode(
            q_full, k_cache, v_cache, block_table if req is None else block_table.index_select(0, req), local_lens,
            q_len_per_req=1, cu_q_lens=None, max_q_len=None, causal=True, window_left=-1,
            sinks=sinks if comm.rank == 0 else None, return_lse=True, scale=d**-0.5 if scale is None else float(scale),
            backend=backend, out=dest.get("out"), lse_out=dest.get("lse"),
        )  # fmt: skip
        return collect_checked(out, lse, comm, chosen, scatter_heads, ws or None)


def _check_host_values(
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    layout: DCPLayout,
    rank: int,
    *,
    pages: int,
    page: int,
    t: int,
    cu_q_lens: torch.Tensor | None,
    meta_lens: torch.Tensor | None,
    meta_req: torch.Tensor | None,
) -> None:
    """The DCP GQA step's value checks, for CPU tensors only (on a GPU each read would stall the
    host: the step skips them there). Raises ``ValueError`` naming the argument."""
    b, m = block_table.shape
    if int(seq_lens.min()) < 0:
        raise ValueError("seq_lens must be >= 0")
    local = layout.local_seq_lens(seq_lens, rank)
    if int(local.max()) > m * page:
        i = int(local.argmax())
        raise ValueError(
            f"seq_lens[{i}]={int(seq_lens[i])} puts {int(local[i])} tokens on rank {rank}, "
            f"past its block_table's {m} pages of {page}"
        )
    # the pages a request uses on this rank must exist (unused entries may hold anything, e.g. -1)
    in_use = torch.arange(m) < ((local.long() + page - 1) // page)[:, None]
    bad = ((block_table < 0) | (block_table >= pages)) & in_use
    if bool(bad.any()):
        reqs = bad.any(dim=1).nonzero().flatten()[:8].tolist()
        raise ValueError(f"block_table holds pages outside [0, {pages}) for requests {reqs}")
    if cu_q_lens is not None:
        cu = cu_q_lens.tolist()
        if cu[0] != 0 or cu != sorted(cu) or cu[-1] > t:
            raise ValueError(f"cu_q_lens must start at 0, not decrease and end <= {t}, got {cu}")
    if meta_lens is not None and t and int(meta_lens.max()) > m * page:
        raise ValueError(f"meta[0] holds local lengths past the block_table's {m} pages of {page}")
    if meta_req is not None and t and (int(meta_req.min()) < 0 or int(meta_req.max()) >= b):
        raise ValueError(f"meta[1] holds request rows outside [0, {b})")
