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

Two kernels: sparse MLA (:func:`dcp_sparse_mla_decode`, here; each query's request-global top-k
positions become local rows by :func:`~shardattn.ops.topk.convert_topk` with the rank's
:class:`~shardattn.ops.topk.DcpShard`, attended by the decode op
:func:`~shardattn.ops.sparse_mla_decode.sparse_mla_decode`) and GQA over a paged cache
(:func:`~shardattn.parallel.dcp_gqa.dcp_gqa_decode`; every query token gets its own causal
*local* length, :meth:`~shardattn.plan.DCPLayout.causal_local_lens`, so uniform and ragged
drafts are exact).

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
at the same time (the Runtime's arena, :mod:`~shardattn.runtime.workspace`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardattn._checks import (
    INDEX_DTYPES,
    check_block_table_holds,
    check_bool,
    check_int,
    check_not_inputs,
    check_queries_tensor,
    check_same_device,
    check_scale,
    check_sink_logits,
    check_tensor,
)
from shardattn.ops.sparse_mla import check_kv_rows
from shardattn.ops.sparse_mla_decode import sparse_mla_decode
from shardattn.ops.topk import INT32_MAX, DcpShard, convert_topk
from shardattn.parallel.agreement import Fingerprint
from shardattn.parallel.collector import collect_checked, exchange_bytes, exchange_dtypes, resolve_strategy
from shardattn.parallel.comm import Comm
from shardattn.parallel.groups import GroupLike
from shardattn.parallel.packing import check_byte_buffers, view_bytes
from shardattn.plan.context import DCPLayout
from shardattn.plan.workspace import ITEM_LIFETIMES

__all__ = ["dcp_sparse_mla_decode"]


def _check_common(q: torch.Tensor, layout: DCPLayout, comm: Comm, sinks: torch.Tensor | None) -> None:
    if not isinstance(layout, DCPLayout):
        raise TypeError(f"layout must be a DCPLayout, got {type(layout).__name__}")
    if layout.world_size != comm.world_size:
        raise ValueError(f"layout is for world_size={layout.world_size}, but the group has {comm.world_size} ranks")
    check_queries_tensor("q_heads_local", q)
    if sinks is not None:
        check_sink_logits(sinks, q.shape[1] * comm.world_size)


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


#: ``workspace`` key -> the phases of the step in which the buffer is written or read: the
#: ``dcp-decode`` items of :data:`~shardattn.plan.workspace.ITEM_LIFETIMES`, by which the Runtime's
#: arena lets buffers never in use at the same time share bytes.
_LIVE = {
    key: ITEM_LIFETIMES["dcp-decode"][item]
    for key, item in (("q", "packed_q"), ("rows", "topk_rows"), ("out", "out"), ("lse", "lse"), ("send", "send"),
                      ("recv", "recv"))
}  # fmt: skip
#: The last phase of the step (:data:`_LIVE`'s) that reads the step's inputs: the local kernel, the
#: phase that writes the partials. A buffer first written at or before it ("q", "rows", "out",
#: "lse") must not hold an input; the collector's "send" / "recv" are written after it and may.
_KERNEL_PHASE = _LIVE["out"][0]


def check_dcp_workspace(
    workspace: object,
    q: torch.Tensor,
    world_size: int,
    v_dim: int,
    topk: int,
    strategy: str,
    scatter_heads: bool,
    inputs: dict[str, torch.Tensor | None] | None = None,
) -> None:
    """A DCP decode step's ``workspace`` (:func:`dcp_sparse_mla_decode`'s and
    :func:`~shardattn.parallel.dcp_gqa.dcp_gqa_decode`'s; ``topk`` 0 for GQA, which converts no
    rows and reads no ``"rows"``) holds what the step views in it: the gathered queries twice
    (``"q"``), the rows, the local partials (``"out"``, ``"lse"``) and the collector's exchange
    (``"send"``, ``"recv"``). Each buffer the step reads is contiguous, starts aligned for the
    widest element it is viewed as, and shares no memory with another buffer in use at the same
    time (:data:`_LIVE`: the queries' bytes may hold the packed send buffer, say), nor, for a buffer
    written while the step still reads its ``inputs`` (the tensors it was given, by argument
    name), with an input. Checked where the ranks agree."""
    t, h, d = q.shape
    w, e = world_size, q.element_size()
    need = {
        "q": 2 * w * t * h * d * e,
        "out": t * w * h * v_dim * e,
        "lse": t * w * h * 4,
        **exchange_bytes(t, w * h, v_dim, q.dtype, w, scatter_heads, strategy),
    }
    if topk:
        need["rows"] = t * topk * 4
    views = {"q": q.dtype, "rows": torch.int32, "out": q.dtype, "lse": torch.float32, **exchange_dtypes(q.dtype)}
    buffers = check_byte_buffers(workspace, need, q.device, dtypes=views, live=_LIVE)
    if inputs is not None:
        written: dict[str, torch.Tensor | None] = {
            f"workspace[{k!r}]": buffers[k] for k in need if k in buffers and _LIVE[k][0] <= _KERNEL_PHASE
        }
        check_not_inputs(written, inputs, reader="the step")


def _partial_buffers(ws: Workspace, q_full: torch.Tensor, v_dim: int) -> dict[str, torch.Tensor]:
    """The local kernel's ``out=`` / ``lse_out=`` destinations in ``ws["out"]`` / ``ws["lse"]`` (none without)."""
    if "out" not in ws or "lse" not in ws:
        return {}
    t, h, _ = q_full.shape
    out = view_bytes(ws["out"], (t, h, v_dim), q_full.dtype, "out")
    lse = view_bytes(ws["lse"], (t, h), torch.float32, "lse")
    assert out is not None and lse is not None
    return {"out": out, "lse_out": lse}


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
    rows_unique: bool = False,
    attention: Callable[..., tuple[torch.Tensor, torch.Tensor]] = sparse_mla_decode,
    check: bool = True,
    workspace: Workspace | None = None,
    kv_format: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode with the KV cache split over the DCP group.

    Args:
        q_heads_local: ``[T, H/N, D]`` fp16/bf16/fp32, this rank's heads of the step's queries.
        kv_cache: ``[R_local, D]`` this rank's KV rows (q's dtype), or its ``fp8_ds_mla`` rows
            (uint8 ``[R_local, 656]`` or paged ``[P, block_size, 656]``: every rank's shard in the
            same format); block ``b`` of the local block table is rows
            ``b * block_size .. (b+1) * block_size``; the value is ``[:, :v_dim]``.
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
        rows_unique: no position appears twice in a row of ``topk_pos`` (an indexer's top-k): the
            local decode skips its de-duplication (duplicates would then count twice).
        attention: the local decode, called like :func:`~shardattn.ops.sparse_mla_decode.sparse_mla_decode`
            (the default; with ``out=`` / ``lse_out=`` destinations when ``workspace`` is given).
        check: agree on shapes and layout first (one small all-gather, a host sync); bad input on
            any rank then raises on every rank.
        workspace: optional flat ``uint8`` buffers ``{"q", "rows", "out", "lse", "send", "recv"}``
            the intermediates live in (module docstring; ``"q"``, ``"rows"``, ``"out"`` and ``"lse"``
            may not share memory with an input); default: allocated per step.
        kv_format: the format ``kv_cache`` must hold (:data:`shardattn.plan.kv_format.KV_FORMATS`);
            ``None`` takes it from its dtype. The ranks agree on it with ``check``.
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
    kv_rows = kv_cache  # the cache as [R, row] rows (a paged fp8_ds_mla cache: a flat view), by validate()

    def validate() -> int:
        nonlocal chosen, kv_rows
        q = q_heads_local
        _check_common(q, layout, comm, sinks)
        t, _, d = q.shape
        if not 0 < check_int("v_dim", v_dim) <= d:
            raise ValueError(f"v_dim must be in (0, {d}], got {v_dim}")
        kv_rows = check_kv_rows("kv_cache", kv_cache, q, v_dim=v_dim, kv_format=kv_format, q_name="q_heads_local")
        check_scale("scale", scale)
        check_tensor("topk_pos", topk_pos, dtypes=INDEX_DTYPES, ndim=2)
        if topk_pos.shape[0] != t:
            raise ValueError(f"topk_pos must have one row per query ({t}), got shape {list(topk_pos.shape)}")
        check_tensor("req_ids", req_ids, dtypes=INDEX_DTYPES, shape=(t,))
        check_tensor("block_table", block_table, dtypes=INDEX_DTYPES, ndim=2)
        b = block_table.shape[0]
        bs = check_int("block_size", block_size, minimum=1, maximum=INT32_MAX)  # the converted rows are int32
        if kv_cache.dim() == 3 and kv_cache.shape[1] != bs:  # rows are read as block * block_size + offset
            raise ValueError(
                f"kv_cache's pages hold {kv_cache.shape[1]} rows, but block_size is {bs}: they must be one"
            )
        if seq_lens is not None:
            check_tensor("seq_lens", seq_lens, dtypes=INDEX_DTYPES, shape=(b,))
        if topk_length is not None:
            check_tensor("topk_length", topk_length, dtypes=INDEX_DTYPES, shape=(t,))
        check_same_device(
            q_heads_local=q, kv_cache=kv_cache, topk_pos=topk_pos, req_ids=req_ids, block_table=block_table,
            seq_lens=seq_lens, topk_length=topk_length, sinks=sinks,
        )  # fmt: skip
        if block_table.device.type == "cpu":  # value checks that cost no sync
            local = None if seq_lens is None else layout.local_seq_lens(seq_lens, comm.rank)
            check_block_table_holds(block_table, bs, kv_rows.shape[0], seq_lens, local, rank=comm.rank)
        check_bool("rows_unique", rows_unique)
        check_bool("scatter_heads", scatter_heads)
        check_bool("check", check)
        chosen = resolve_strategy(strategy, comm.backend, scatter_heads=scatter_heads)
        inputs = {
            "q_heads_local": q, "kv_cache": kv_cache, "topk_pos": topk_pos, "req_ids": req_ids,
            "block_table": block_table, "seq_lens": seq_lens, "topk_length": topk_length, "sinks": sinks,
        }  # fmt: skip
        check_dcp_workspace(workspace, q, comm.world_size, v_dim, topk_pos.shape[1], chosen, scatter_heads, inputs)
        if not check:
            return 0  # nothing to agree on: skip hashing on the step's hot path
        return Fingerprint("dcp_sparse_mla", {
            "the DCP layout (interleave)": layout, "q's shape": tuple(q.shape), "q's dtype": q.dtype,
            "kv's dtype": kv_rows.dtype, "v_dim": v_dim, "the top-k width": topk_pos.shape[1],
            "the requests (block_table rows)": b,
            "sinks / topk_length (given or not)": (sinks is not None, topk_length is not None),
            "scale": float(scale), "scatter_heads / strategy / rows_unique": (scatter_heads, strategy, rows_unique),
            "seq_lens": _host_values(seq_lens) if check else None,
        })  # fmt: skip

    comm.agree_on("DCP sparse MLA decode inputs", validate, check=check)
    with comm.reporting_failures():  # a failure from here on is reported to the waiting peers
        ws = workspace or {}
        q_full = _gather_heads(q_heads_local, comm, ws)
        # unique rows: this rank's (about K / W of a top-k) packed at the front, their count the
        # local kernel's topk_length, so it reads no other rank's entries; otherwise the
        # de-duplication drops those entries itself (D89)
        rows, counts = convert_topk(
            topk_pos, req_ids, block_table, block_size=block_size, seq_lens=seq_lens, topk_length=topk_length,
            dcp=DcpShard(layout.world_size, layout.interleave, comm.rank), packed=rows_unique,
            out=view_bytes(ws.get("rows"), tuple(topk_pos.shape), torch.int32, "rows"),
        )  # fmt: skip
        out, lse = attention(
            q_full, kv_rows, rows, scale=scale, v_dim=v_dim, topk_length=counts if rows_unique else None,
            sinks=sinks if comm.rank == 0 else None, rows_unique=rows_unique, **_partial_buffers(ws, q_full, v_dim),
        )  # fmt: skip
        # checked above; out / lse come from the checked inputs: the collector runs unchecked
        return collect_checked(out, lse, comm, chosen, scatter_heads, ws or None)
