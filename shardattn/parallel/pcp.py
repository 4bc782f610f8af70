"""Prefill context parallelism (PCP) for sparse MLA: zigzag query tokens, all-gathered new KV.

The step's new tokens are split over the ``W`` ranks of the PCP group by
:func:`~shardattn.plan.pcp_plan` (zigzag, never gated). Each rank computed the queries and KV
rows of its own tokens; a query may pick (top-k) any KV row of its request: the cached prefix,
which every rank holds in its paged cache, or a new token, possibly computed by another rank::

    rank r: q [T_r, H, D], kv_new [T_r, D] (its zigzag tokens), topk_pos [T_r, K]
        -- all-gather of kv_new (padded to P rows) -->  gathered [W * P, D]
           (new token g is gathered[plan.kv_row[g]]: the request's KV order, by the plan's map)
           started asynchronously: the attention over the prefix cache (positions already on
           every rank) runs while it is in flight (no host synchronisation on NCCL)
        -- sparse attention over the gathered rows of new-token positions, and over the prefix
           cache for prefix positions; the two partials merged by LSE (lse_merge) -->
           out [T_r, H, Dv], lse [T_r, H]
        -- optionally (gather_output=True) an all-gather of out + lse, restored to token order

No causal mask is added: a query attends to the positions its top-k lists (the indexer picks
only visible ones). Positions past a request's tokens, or negative, are invalid (as anywhere).

Collectives: one all-gather (plus one with ``gather_output``), plus the agreement check.
"""

from __future__ import annotations

import torch

from shardattn._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_bool,
    check_int,
    check_same_device,
    check_scale,
    check_sink_logits,
    check_tensor,
)
from shardattn.ops.lse_merge import lse_merge
from shardattn.ops.sparse_mla import check_kv_rows, sparse_mla_attention
from shardattn.ops.topk import INT32_MAX, convert_topk
from shardattn.parallel.agreement import Fingerprint
from shardattn.parallel.comm import Comm, pack_rows, unpack_rows
from shardattn.parallel.groups import GroupLike
from shardattn.parallel.local_attention import AttentionFn, with_lse
from shardattn.plan.pcp import PCPPlan

__all__ = ["gather_pcp_outputs", "pcp_prefill"]


def _check_inputs(
    q: torch.Tensor,
    kv_new: torch.Tensor,
    topk_pos: torch.Tensor,
    plan: PCPPlan,
    comm: Comm,
    v_dim: int,
    kv_cache: torch.Tensor | None,
    block_table: torch.Tensor | None,
    block_size: int | None,
    topk_length: torch.Tensor | None,
    sinks: torch.Tensor | None,
    gather_output: bool,
    scale: float,
    check: bool,
    kv_format: str | None = None,
) -> int:
    """Validate one rank's PCP inputs; returns the fingerprint the ranks must agree on."""
    if not isinstance(plan, PCPPlan):
        raise TypeError(f"plan must be a PCPPlan (from pcp_plan), got {type(plan).__name__}")
    if plan.world_size != comm.world_size:
        raise ValueError(f"plan is for world_size={plan.world_size}, but the group has {comm.world_size} ranks")
    mine = int(plan.shard.counts[comm.rank])
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3)
    t, h, d = q.shape
    if t != mine:
        raise ValueError(f"q must hold rank {comm.rank}'s {mine} tokens (plan), got {t}")
    if not 0 < check_int("v_dim", v_dim) <= d:
        raise ValueError(f"v_dim must be in (0, {d}], got {v_dim}")
    check_tensor("kv_new", kv_new, ndim=2)  # new rows are rows, never pages
    kv_new = check_kv_rows("kv_new", kv_new, q, v_dim=v_dim, kv_format=kv_format)
    if kv_new.shape[0] != t:
        raise ValueError(f"kv_new must hold one row per token of q ({t}), got shape {list(kv_new.shape)}")
    check_scale("scale", scale)
    check_bool("gather_output", gather_output)
    check_bool("check", check)
    check_tensor("topk_pos", topk_pos, dtypes=INDEX_DTYPES, ndim=2)
    if topk_pos.shape[0] != t:
        raise ValueError(f"topk_pos must have one row per token ({t}), got shape {list(topk_pos.shape)}")
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtypes=INDEX_DTYPES, shape=(t,))
    if sinks is not None:
        check_sink_logits(sinks, h)
    prefix = plan.shard.prefix_lens
    has_prefix = bool((prefix > 0).any())
    given = [x is not None for x in (kv_cache, block_table, block_size)]
    if any(given) and not all(given):
        raise ValueError("kv_cache, block_table and block_size go together (the cached prefix); give all or none")
    if has_prefix and not all(given):
        raise ValueError(
            f"the plan has cached prefixes (prefix_lens={prefix.tolist()}): pass kv_cache, block_table and "
            "block_size holding them"
        )
    if kv_cache is not None and block_table is not None and block_size is not None:
        paged = kv_cache if isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 3 else None
        kv_cache = check_kv_rows("kv_cache", kv_cache, q, v_dim=v_dim, kv_format=kv_format)  # its rows
        if paged is not None and paged.shape[1] != block_size:  # rows are read as block * block_size + offset
            raise ValueError(
                f"kv_cache's pages hold {paged.shape[1]} rows, but block_size is {block_size}: they must be one"
            )
        if kv_cache.dtype != kv_new.dtype:
            raise ValueError(f"kv_cache and kv_new must hold one row format, got {kv_cache.dtype} and {kv_new.dtype}")
        check_tensor("block_table", block_table, dtypes=INDEX_DTYPES, ndim=2)
        bs = check_int("block_size", block_size, minimum=1, maximum=INT32_MAX)  # the converted rows are int32
        n_req, m = block_table.shape
        if n_req != plan.shard.num_requests:
            raise ValueError(f"block_table must have one row per request ({plan.shard.num_requests}), got {n_req}")
        if n_req and int(prefix.max()) > m * bs:
            i = int(prefix.argmax())
            raise ValueError(f"prefix_lens[{i}]={int(prefix[i])} is past block_table's {m} blocks of {bs}")
        if block_table.device.type == "cpu" and block_table.numel():
            top = int(block_table.max())
            if (top + 1) * bs > kv_cache.shape[0]:
                raise ValueError(
                    f"block_table points past kv_cache: block {top} needs rows up to {(top + 1) * bs}, "
                    f"kv_cache has {kv_cache.shape[0]}"
                )
    check_same_device(
        q=q, kv_new=kv_new, topk_pos=topk_pos, kv_cache=kv_cache, block_table=block_table,
        topk_length=topk_length, sinks=sinks,
    )  # fmt: skip
    return Fingerprint("pcp", {
        "the plan (query_lens, prefix_lens)": plan.fingerprint() if check else None, "q's heads": h,
        "q's head dim": d, "q's dtype": q.dtype, "kv_new's dtype": kv_new.dtype, "v_dim": v_dim,
        "the top-k width": topk_pos.shape[1], "sinks / topk_length (given or not)": (
            sinks is not None, topk_length is not None), "gather_output": gather_output,
        "kv_cache / block_table (given or not)": all(given), "scale": float(scale),
    })  # fmt: skip


def pcp_prefill(
    q: torch.Tensor,
    kv_new: torch.Tensor,
    topk_pos: torch.Tensor,
    plan: PCPPlan,
    group: GroupLike | Comm,
    *,
    scale: float,
    v_dim: int = 512,
    kv_cache: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    block_size: int | None = None,
    topk_length: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    gather_output: bool = False,
    attention: AttentionFn = sparse_mla_attention,
    check: bool = True,
    kv_format: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA prefill over a zigzag token split, new KV rows all-gathered.

    Every rank of ``group`` calls this with the same ``plan`` and the tensors of its own tokens
    (``plan.shard.token_ids(rank)``, in that order).

    Args:
        q: ``[T_r, H, D]`` fp16/bf16/fp32 queries of this rank's tokens (all heads).
        kv_new: ``[T_r, D]`` the KV rows of this rank's tokens (q's dtype), or their
            ``fp8_ds_mla`` rows (uint8 ``[T_r, 656]``: the all-gather moves 656-byte rows).
        topk_pos: ``[T_r, K]`` int32 request positions (cached prefix included) of each token's
            top-k; negative / past the request's tokens = invalid, anywhere in a row.
        plan: :func:`~shardattn.plan.pcp_plan` of the step (``world_size`` = the group's).
        group: the PCP process group or a :class:`~shardattn.parallel.comm.Comm`
            (a ``ProcessGroup``, a 1-D ``DeviceMesh`` or ``(mesh, dim name)``: :mod:`~shardattn.parallel.groups`).
        scale: softmax scale, the model's (:func:`~shardattn.plan.spec.mla_softmax_scale`).
        v_dim: value width (512 for DSA models).
        kv_cache: ``[R, D]`` rows of the paged cache holding the cached prefixes (the same on
            every rank; in ``kv_new``'s format: ``fp8_ds_mla`` rows may be paged
            ``[P, block_size, 656]``), with ``block_table [num_requests, M]`` int32 and
            ``block_size``; needed when the plan has ``prefix_lens > 0``.
        topk_length: ``[T_r]`` int32 leading ``topk_pos`` entries to use, optional.
        sinks: ``[H]`` fp32 sink logits, optional (counted once).
        gather_output: also all-gather the outputs and return every token's, in token order.
        attention: the local kernel, called like :func:`~shardattn.ops.sparse_mla.sparse_mla_attention`.
        check: agree on the plan and shapes first (one small all-gather, a host sync).
        kv_format: the format ``kv_new`` and ``kv_cache`` must hold
            (:data:`shardattn.plan.kv_format.KV_FORMATS`); ``None`` takes it from their dtype.
    Returns:
        ``(out [T_r, H, v_dim] in q's dtype, lse [T_r, H] fp32)`` for this rank's tokens, or
        ``[T, H, v_dim]`` / ``[T, H]`` in token order with ``gather_output``. A token with no valid
        key is ``(0, -inf)`` (``(0, sink)`` with sinks).

    Example (every rank of a PCP group of ``W`` runs this)::

        plan = pcp_plan(query_lens, W, prefix_lens=prefix_lens)
        ids = plan.shard.token_ids(rank)                  # this rank's tokens
        out, lse = pcp_prefill(q[ids], kv[ids], topk_pos[ids], plan, group, scale=576 ** -0.5,
                               kv_cache=cache, block_table=table, block_size=64)
        # q[ids] [T_r, H, 576] -> out [T_r, H, 512], lse [T_r, H]
    """
    comm = Comm.wrap(group)

    def validate() -> int:
        return _check_inputs(
            q, kv_new, topk_pos, plan, comm, v_dim, kv_cache, block_table, block_size, topk_length, sinks,
            gather_output, scale, check, kv_format,
        )  # fmt: skip

    comm.agree_on("PCP plan and inputs", validate, check=check)
    if kv_cache is not None and kv_cache.dim() == 3:  # a paged fp8_ds_mla cache, pages in turn (checked)
        kv_cache = kv_cache.flatten(0, 1)
    with comm.reporting_failures():  # a failure from here on is reported to the waiting peers
        dev = q.device
        if plan.kv_row.device != dev:
            plan = plan.to(dev)
        w, rank = comm.world_size, comm.rank
        t = q.shape[0]
        p = plan.shard.padded_count

        # the new tokens' KV, rank-major, P rows per rank: new token g is gathered[plan.kv_row[g]];
        # the all-gather runs while the cached prefix (already on every rank) is attended
        row = kv_new.shape[1]  # D values, or 656 bytes of an fp8_ds_mla row
        padded = kv_new.new_zeros(p, row)
        padded[:t] = kv_new
        gathering, pending = comm.all_gather_async(padded)

        req = plan.shard.request_ids(rank)
        rows = plan.gathered_rows_for(topk_pos, req)  # [T_r, K] int64, -1 for prefix / invalid
        if topk_length is not None:
            cols = torch.arange(rows.shape[1], device=dev)
            rows = torch.where(cols[None, :] < topk_length[:, None].to(torch.int64), rows, torch.full_like(rows, -1))
        prefix_part = None
        if kv_cache is not None and block_table is not None and block_size is not None:  # all or none (checked)
            prefix_rows, _ = convert_topk(
                topk_pos, req.to(torch.int32), block_table, block_size=block_size,
                seq_lens=plan.shard.prefix_lens.to(torch.int32), topk_length=topk_length,
            )  # fmt: skip
            prefix_part = with_lse(attention(q, kv_cache, prefix_rows, scale=scale, v_dim=v_dim, return_lse=True))
        pending.wait()
        gathered = gathering.view(w * p, row)
        new_part = attention(q, gathered, rows.to(torch.int32), scale=scale, v_dim=v_dim, sinks=sinks, return_lse=True)
        out, lse = with_lse(new_part)
        if prefix_part is not None:
            out_p, lse_p = prefix_part
            out, lse = lse_merge(torch.stack([out, out_p]), torch.stack([lse, lse_p]))
        if not gather_output:
            return out, lse
        return gather_pcp_outputs(out, lse, comm, p, plan.kv_row)


def gather_pcp_outputs(
    out: torch.Tensor, lse: torch.Tensor, comm: Comm, padded: int, kv_row: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's ``(out [T_r, H, Dv], lse [T_r, H] fp32)`` of a PCP step, in token order: one
    all-gather of each rank's pair padded to ``padded`` rows (``P``, packed as bytes), then token
    ``g`` read from slot ``kv_row[g]`` of the rank-major ``[W * P]`` layout (:attr:`PCPPlan.kv_row`
    on ``out``'s device). Returns ``(out [T, H, Dv], lse [T, H])``."""
    w = comm.world_size
    t, h, dv = out.shape
    specs = [((padded, h, dv), out.dtype), ((padded, h), torch.float32)]
    mine_out, mine_lse = out.new_zeros(padded, h, dv), lse.new_zeros(padded, h)
    mine_out[:t], mine_lse[:t] = out, lse
    got = comm.all_gather(pack_rows([mine_out.unsqueeze(0), mine_lse.unsqueeze(0)])[0])
    all_out, all_lse = unpack_rows(got, specs)  # [W, P, H, Dv], [W, P, H]
    return all_out.reshape(w * padded, h, dv)[kv_row], all_lse.reshape(w * padded, h)[kv_row]
