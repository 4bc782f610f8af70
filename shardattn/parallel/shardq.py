"""ShardQ prefill: turn head sharding into token sharding for sparse MLA, and back.

Under tensor parallelism every rank holds ``H / W`` heads of every query token and the whole
(replicated) KV cache. A sparse MLA kernel tiles 64 or 128 query rows per step, so 8 or 16 heads
per rank leave most of each tile as padding. ShardQ moves queries so each rank runs *every* head
for a zigzag slice of the step's tokens (:func:`~shardattn.plan.zigzag_split`), then moves the
outputs back::

    rank r: q [T, H/W, D] (all tokens, its heads)
        -- first all-to-all -->  q [T_r, H, D] (its zigzag tokens, all heads)
        -- local sparse attention over the replicated KV, rows[tokens of r] -->
           out [T_r, H, Dv], lse [T_r, H]
        -- second all-to-all (out and lse, one message each per peer) -->
           out [T, H/W, Dv], lse [T, H/W] in token order

The step is pipelined (:mod:`shardattn.parallel.shardq_pipeline`): each rank's tokens are cut
into ``C`` chunks whose exchanges run beside the kernels, with the messages, buffers and host
work described there. Two opt-in options, same bits (neither measured on GPUs yet):
``taper=True`` cuts the shares ``1, 2, ..., 2, 1`` (:func:`~shardattn.plan.pipeline.chunk_weights`)
and ``one_union=True`` builds the union of the rank's whole share once
(:func:`~shardattn.ops.prepared_union.prepare_union`) and gives each chunk's kernel call its slice.

Exactly ``2 C`` exchanges (each counted as one ``"all_to_all"``) per sharded step (plus, with
``check=True``, one small all-gather that makes the ranks agree on the plan and shapes first). A
plan that is not sharded (fewer tokens than ``min_tokens``) runs head-TP locally with no data
collective (with ``check=True``, the agreement's one small all-gather still runs).
"""

from __future__ import annotations

from typing import Literal, overload

import torch

from shardattn._checks import (
    INDEX_DTYPES,
    check_bool,
    check_disjoint,
    check_int,
    check_not_inputs,
    check_queries_tensor,
    check_same_device,
    check_scale,
    check_sink_logits,
    check_tensor,
)
from shardattn.ops.prepared_union import SLICE_GROUPS
from shardattn.ops.sparse_mla import check_kv_rows, sparse_mla_attention
from shardattn.ops.union import GROUP_SIZES, MAX_PACKED_ROWS
from shardattn.parallel.agreement import Fingerprint
from shardattn.parallel.comm import Comm
from shardattn.parallel.groups import GroupLike
from shardattn.parallel.local_attention import AttentionFn, with_lse
from shardattn.parallel.shardq_pipeline import check_pipeline_workspace, run_pipelined
from shardattn.plan.pipeline import MAX_CHUNKS, PipelinePlan, choose_chunks, pipeline_plan
from shardattn.plan.zigzag import ShardPlan

__all__ = ["shardq_prefill"]


def _check_inputs(
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    plan: ShardPlan,
    comm: Comm,
    v_dim: int,
    topk_length: torch.Tensor | None,
    sinks: torch.Tensor | None,
    scale: float,
    check: bool,
    pipeline: tuple[int | None, int, bool, bool],
    kv_format: str | None = None,
    return_lse: bool = True,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
) -> int:
    """Validate one rank's ShardQ inputs; returns the fingerprint the ranks must agree on
    (``pipeline``: ``(chunks, align, taper, one_union)``, which every rank must cut alike).
    ``out`` / ``lse_out``: the destinations, ``[T, H/W, v_dim]`` in q's dtype / ``[T, H/W]`` fp32,
    contiguous, sharing no memory with each other or with an input (the step's exchanges write them
    while later chunks still read ``q_heads_local``, ``kv`` and ``sinks``)."""
    if not isinstance(plan, ShardPlan):
        raise TypeError(f"plan must be a ShardPlan (from zigzag_split), got {type(plan).__name__}")
    if plan.world_size != comm.world_size:
        raise ValueError(f"plan is for world_size={plan.world_size}, but the group has {comm.world_size} ranks")
    check_queries_tensor("q_heads_local", q)
    t, h, d = q.shape
    if t != plan.num_tokens:
        raise ValueError(f"q_heads_local must hold the step's {plan.num_tokens} tokens (plan), got {t}")
    check_int("v_dim", v_dim, minimum=1)
    if v_dim > d:
        raise ValueError(f"v_dim must be <= the head dim {d}, got {v_dim}")
    kv = check_kv_rows("kv", kv, q, v_dim=v_dim, kv_format=kv_format, q_name="q_heads_local")
    check_scale("scale", scale)
    check_bool("return_lse", return_lse)
    check_bool("check", check)
    check_tensor("rows", rows, dtypes=INDEX_DTYPES, ndim=2)
    if rows.shape[0] != t:
        raise ValueError(f"rows must have one row per token ({t}), got shape {list(rows.shape)}")
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtypes=INDEX_DTYPES, shape=(t,))
    if sinks is not None:
        check_sink_logits(sinks, h * comm.world_size)
    check_same_device(q_heads_local=q, kv=kv, rows=rows, topk_length=topk_length, sinks=sinks)
    for name, dest, dtype, shape in (("out", out, q.dtype, (t, h, v_dim)), ("lse_out", lse_out, torch.float32, (t, h))):
        if dest is not None:
            check_tensor(name, dest, dtypes=(dtype,), shape=shape, device=q.device)
            if not dest.is_contiguous():
                raise ValueError(f"{name} must be contiguous (the step's exchanges write it as a dense buffer)")
    check_disjoint(out=out, lse_out=lse_out)
    check_not_inputs({"out": out, "lse_out": lse_out}, _inputs(q, kv, rows, topk_length, sinks), reader="the step")
    chunks, align, taper, one_union = pipeline
    if chunks is not None and not 1 <= check_int("chunks", chunks) <= MAX_CHUNKS:
        raise ValueError(f"chunks must be in [1, {MAX_CHUNKS}] (or None: the planner's), got {chunks}")
    check_int("align", align, minimum=1)
    check_bool("taper", taper)
    check_bool("one_union", one_union)
    if one_union and align not in GROUP_SIZES:  # the union's G (checked here, before any message)
        raise ValueError(f"align must be one of {GROUP_SIZES} with one_union (the union's group size), got {align}")
    if one_union and align > 1 and kv.shape[0] > MAX_PACKED_ROWS:
        raise ValueError(
            f"one_union with align={align} needs kv with <= {MAX_PACKED_ROWS} rows (24-bit packed union entries), "
            f"got {kv.shape[0]}; use align=1 (the per-query path) for such caches"
        )
    return Fingerprint(
        "shardq",
        {
            "the plan (query_lens, prefix_lens)": plan.fingerprint() if check else None,
            "chunks / align / taper / one_union": pipeline,
            "q's shape": tuple(q.shape),
            "q's dtype": q.dtype,
            "kv's dtype": kv.dtype,
            # replicated: a rank runs every rank's heads of its tokens over its own copy, so a copy of
            # other rows would give every rank wrong outputs of those tokens, silently
            "kv's rows": tuple(kv.shape[:-1]),  # [R] or [pages, page_size]
            "the top-k width": rows.shape[1],
            "v_dim": v_dim,
            "sinks (given or not)": sinks is not None,
            "topk_length (given or not)": topk_length is not None,
            "scale": float(scale),
            "return_lse": return_lse,  # it decides what the output exchange carries
        },
    )


def _inputs(
    q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, topk_length: torch.Tensor | None, sinks: torch.Tensor | None
) -> dict[str, torch.Tensor | None]:
    """The tensors a ShardQ step reads, by argument name: no destination may share memory with them."""
    return {"q_heads_local": q, "kv": kv, "rows": rows, "topk_length": topk_length, "sinks": sinks}


@overload
def shardq_prefill(
    q_heads_local: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, plan: ShardPlan, group: GroupLike | Comm, *,
    scale: float, v_dim: int = ..., topk_length: torch.Tensor | None = ..., sinks: torch.Tensor | None = ...,
    return_lse: Literal[True] = ..., attention: AttentionFn = ..., check: bool = ..., chunks: int | None = ...,
    align: int = ..., taper: bool = ..., one_union: bool = ..., workspace: dict[str, torch.Tensor] | None = ...,
    out: torch.Tensor | None = ..., lse_out: torch.Tensor | None = ..., kv_format: str | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip
@overload
def shardq_prefill(
    q_heads_local: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, plan: ShardPlan, group: GroupLike | Comm, *,
    scale: float, v_dim: int = ..., topk_length: torch.Tensor | None = ..., sinks: torch.Tensor | None = ...,
    return_lse: Literal[False], attention: AttentionFn = ..., check: bool = ..., chunks: int | None = ...,
    align: int = ..., taper: bool = ..., one_union: bool = ..., workspace: dict[str, torch.Tensor] | None = ...,
    out: torch.Tensor | None = ..., lse_out: torch.Tensor | None = ..., kv_format: str | None = ...,
) -> torch.Tensor: ...  # fmt: skip
@overload
def shardq_prefill(
    q_heads_local: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, plan: ShardPlan, group: GroupLike | Comm, *,
    scale: float, v_dim: int = ..., topk_length: torch.Tensor | None = ..., sinks: torch.Tensor | None = ...,
    return_lse: bool = ..., attention: AttentionFn = ..., check: bool = ..., chunks: int | None = ...,
    align: int = ..., taper: bool = ..., one_union: bool = ..., workspace: dict[str, torch.Tensor] | None = ...,
    out: torch.Tensor | None = ..., lse_out: torch.Tensor | None = ..., kv_format: str | None = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip
def shardq_prefill(
    q_heads_local: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    plan: ShardPlan,
    group: GroupLike | Comm,
    *,
    scale: float,
    v_dim: int = 512,
    topk_length: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = True,
    attention: AttentionFn = sparse_mla_attention,
    check: bool = True,
    chunks: int | None = 1,
    align: int = 1,
    taper: bool = False,
    one_union: bool = False,
    workspace: dict[str, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    kv_format: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA prefill with queries moved from head shards to zigzag token shards and back.

    Every rank of ``group`` calls this with the same ``plan`` and its own head slice (heads
    ``rank * H/W .. (rank+1) * H/W``, the usual TP split).

    Args:
        q_heads_local: ``[T, H/W, D]`` fp16/bf16/fp32, this rank's heads of all ``T`` tokens of
            the step (``D = 576`` for DSA models).
        kv: ``[R, D]`` the KV rows in q's dtype, identical on every rank (replicated under TP; with
            ``check`` the ranks agree on ``R``);
            the value is ``kv[:, :v_dim]``. Or ``fp8_ds_mla`` rows (uint8 ``[R, 656]`` or paged
            ``[P, page, 656]``; ``kv_format`` declares the format, ``None`` takes ``kv``'s): each
            rank's kernel reads the local FP8 cache and dequantises in place.
        rows: ``[T, K]`` int32 global KV rows of every token's top-k (identical on every rank);
            ``-1`` / out of range = invalid, anywhere in a row.
        plan: :func:`~shardattn.plan.zigzag_split` of the step (``world_size`` = the group's).
        group: the TP process group, or a :class:`~shardattn.parallel.comm.Comm` over it
            (a ``ProcessGroup``, a 1-D ``DeviceMesh`` or ``(mesh, dim name)``: :mod:`~shardattn.parallel.groups`).
        scale: softmax scale, the model's (:func:`~shardattn.plan.spec.mla_softmax_scale`).
        v_dim: value width (512 for DSA models).
        topk_length: ``[T]`` int32 per-token count of leading ``rows`` entries to use, optional.
        sinks: ``[H]`` fp32 per-head sink logits (all heads), optional.
        return_lse: also return the LSE (packed into the second all-to-all).
        attention: the local kernel, called like
            :func:`~shardattn.ops.sparse_mla.sparse_mla_attention` with ``return_lse=True``
            and ``out=``/``lse_out=`` destinations; sharded steps pass it head-blocked ``q``, ``out``
            and ``lse`` (``[W, n, H/W, ...]``: the receive and send buffers, used in place) and
            ``q_ready=``, a callable it must run before it reads ``q`` (the wait of the chunk's
            query exchange: work that needs only ``rows``, like the union build, goes before it).
        check: make the ranks agree on the plan and shapes first (one small all-gather, a host
            sync); bad input or a different plan on any rank then raises on every rank.
        chunks: pipeline depth ``C``; ``None``: the planner's
            :func:`~shardattn.plan.pipeline.choose_chunks` of the largest rank share's work. Every
            value gives the same result, bit for bit. Default 1 (not pipelined); the Runtime passes
            ``None``.
        align: chunk boundaries are multiples of it (the kernel's group size ``G``).
        taper: cut the first and last chunks half as large as the middle ones (``C >= 3``;
            :func:`~shardattn.plan.pipeline.chunk_weights`): the exposed first query exchange and
            last output exchange shrink. Opt-in (not measured on GPUs yet); same bits.
        one_union: build the union of the rank's whole share once, right after chunk 0's query
            exchange is issued (:func:`~shardattn.ops.prepared_union.prepare_union`, ``G =
            align``), and hand each chunk's kernel call its slice as ``prepared_union=`` (so no
            row sort runs between two chunks' kernels). ``attention`` must then take that keyword
            and use ``G = align`` (the Runtime's does; the default ``sparse_mla_attention`` takes
            ``G = 1`` only, so ``align > 1`` with it is a ``ValueError``); chunk boundaries
            are then multiples of ``4 G`` (:data:`~shardattn.ops.prepared_union.SLICE_GROUPS`:
            aligned slices, the kernels' compiled variants). Opt-in; same bits. A ``workspace``
            without room for the whole union: per-chunk builds, as without it.
        workspace: optional ``uint8`` buffers ``{"q", "out", "lse", "rows", "union", "lens"}`` the
            receive / send buffers, the rank's rows of ``rows`` (int32) and, with ``one_union``,
            the whole share's union and lengths are carved from (the Runtime's ``prefill.packed_q``
            / ``.out`` / ``.lse`` / ``.topk_rows`` / ``.union`` / ``.union_offsets``); default:
            allocated per step. A one-chunk step also stages in ``"out"`` the queries it sends
            and in ``"q"`` the outputs and LSEs it receives, so each must hold the larger of its
            two uses (``"out"``: the ``(T - n) * H/W * D`` elements of q's dtype sent, ``n`` the
            rank's tokens, each peer's piece 256-byte aligned; a ``ValueError`` otherwise).
        out / lse_out: optional destinations ``[T, H/W, v_dim]`` / ``[T, H/W]`` (contiguous), sharing
            no memory with each other, the ``workspace`` or an input (nor may a ``workspace`` buffer
            share memory with an input): a ``ValueError`` before any exchange (on every rank with ``check``).
    Returns:
        ``out [T, H/W, v_dim]`` in q's dtype, token order, this rank's heads; and
        ``lse [T, H/W]`` fp32 natural log with ``return_lse``. A token with no valid row is
        ``(0, -inf)`` (``(0, sink)`` with sinks). Equal to running the kernel on all heads of
        all tokens in one process.

    Example (every rank of a TP group of ``W`` runs this)::

        plan = zigzag_split(query_lens, W, align=G, min_tokens=1024)   # same on every rank
        out, lse = shardq_prefill(q_local, kv, rows, plan, group, scale=576 ** -0.5)
        # q_local [T, H/W, 576] -> out [T, H/W, 512], lse [T, H/W]
    """
    comm = Comm.wrap(group)
    pipeline = (chunks, align, taper, one_union)
    piped: list[PipelinePlan] = []  # the sharded step's chunks, cut while its inputs are checked

    def validate() -> int:
        fingerprint = _check_inputs(
            q_heads_local,
            kv,
            rows,
            plan,
            comm,
            v_dim,
            topk_length,
            sinks,
            scale,
            check,
            pipeline,
            kv_format,
            return_lse,
            out,
            lse_out,
        )
        if plan.sharded:  # the workspace against the chunks it holds, before any exchange
            h = q_heads_local.shape[1]
            c = chunks if chunks is not None else choose_chunks(int(plan.counts.max()), heads=h * comm.world_size,
                                                                topk=max(1, rows.shape[1]))  # fmt: skip
            # one_union: chunk slices of the union start 16-byte aligned (SLICE_GROUPS), as whole builds do
            pipe = pipeline_plan(plan, c, align=align * (SLICE_GROUPS if one_union else 1), taper=taper)
            check_pipeline_workspace(
                workspace, pipe, comm.rank, q_heads_local, v_dim, rows.shape[1], rows.dtype == torch.int32, one_union,
                return_lse,
            )  # fmt: skip
            piped.append(pipe)
        inputs = _inputs(q_heads_local, kv, rows, topk_length, sinks)
        for name, buf in workspace.items() if isinstance(workspace, dict) else ():
            if isinstance(buf, torch.Tensor):  # (a non-tensor: the workspace check names it)
                # the step writes out / lse_out and the workspace: none may hold another, nor an input
                check_disjoint(out=out, lse_out=lse_out, **{f"workspace['{name}']": buf})
                check_not_inputs({f"workspace['{name}']": buf}, inputs, reader="the step")
        if not callable(attention):
            raise TypeError(f"attention must be callable like sparse_mla_attention, got {type(attention).__name__}")
        if one_union and align > 1 and attention is sparse_mla_attention:
            raise ValueError(
                f"one_union with align={align} hands the kernel a union of group size {align}, which the default "
                "attention (sparse_mla_attention, G = 1 prepared unions) does not take: pass align=1, or an "
                "attention that takes a grouped prepared_union (the Runtime's)"
            )
        return fingerprint

    comm.agree_on("ShardQ plan and inputs", validate, check=check)
    if kv.dim() == 3:  # a paged fp8_ds_mla cache, pages in turn (checked): its rows
        kv = kv.flatten(0, 1)
    with comm.reporting_failures():  # a failure from here on is reported to the waiting peers
        q = q_heads_local
        h, rank = q.shape[1], comm.rank
        if not plan.sharded:  # head-TP: all tokens, this rank's heads, nothing moves
            local_sinks = None if sinks is None else sinks[rank * h : (rank + 1) * h]
            kw = {} if out is None and lse_out is None else {"out": out, "lse_out": lse_out}
            result = attention(
                q, kv, rows, scale=scale, v_dim=v_dim, topk_length=topk_length, sinks=local_sinks, return_lse=True, **kw
            )
            out, lse_out = with_lse(result)
            return (out, lse_out) if return_lse else out

        return run_pipelined(
            q, kv, rows, plan, piped[0], comm, scale=scale, v_dim=v_dim, topk_length=topk_length, sinks=sinks,
            return_lse=return_lse, attention=attention, workspace=workspace, out=out, lse=lse_out,
            union_groups=align if one_union else None,
        )  # fmt: skip
