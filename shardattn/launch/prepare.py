"""The launcher's synthetic steps, ready to time: the call, what the report says, how to check it.

:func:`prepare_prefill` and :func:`prepare_decode` build one step kind for a Runtime from the run's
configuration (the same global tensors on every rank, from one seed) and return a
:class:`Prepared`: the call on this rank, its path and routing reason, its work (FLOPs or bytes),
and, on rank 0, the single-process reference with the slice each rank returns.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from shardattn.launch.gqa_workloads import build_gqa_decode, build_gqa_prefill
from shardattn.launch.workload_parts import new_token_slots
from shardattn.launch.workloads import PrefillStep, build_decode, build_prefill, overlap_model
from shardattn.ops.gqa_decode_reference import gqa_paged_decode_reference
from shardattn.ops.gqa_prefill import gqa_prefill
from shardattn.ops.kv_fp8 import quantize_kv
from shardattn.ops.row_entries import valid_mask
from shardattn.ops.sparse_mla import flops, sparse_mla_reference
from shardattn.ops.topk import DcpShard, convert_topk
from shardattn.parallel.gqa_head_tp import head_tp_kv_heads
from shardattn.parallel.local_attention import with_lse
from shardattn.plan.kv_format import KV_FP8_DS_MLA, kv_row_bytes
from shardattn.runtime.runtime import Runtime
from shardattn.workload import union_ratio

if TYPE_CHECKING:
    from shardattn.launch.run_config import RunConfig

__all__ = ["Prepared", "prepare_decode", "prepare_prefill"]


def _token_rows(step: PrefillStep, page: int) -> torch.Tensor:
    """``[T]`` int64 KV-cache row of every new token of a prefill step (its own key and value)."""
    pages, slots = new_token_slots(step.req_ids.long(), step.query_lens, step.prefix_lens, step.block_table, page)
    return pages * page + slots


@dataclass
class Prepared:
    """A step ready to time: the call, what the report says about it, and how to check it."""

    step: str
    call: Callable[[bool], tuple[torch.Tensor, torch.Tensor]]  # call(check): one step on this rank
    path: str
    reason: str
    tokens: int
    union: float | None
    work: float  # FLOPs (prefill) or bytes (decode) of one call on this rank
    reference: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None  # rank 0 only: full (out, lse)
    part: Callable[[torch.Tensor, int], torch.Tensor]  # (full reference tensor, rank) -> what that rank returns


def _step_args(cfg: RunConfig, mla: bool) -> dict[str, Any]:
    """The synthetic-step builders' arguments that come straight from the run's configuration
    (``mla``: also the sparse-MLA ones: heads, head dim, top-k, overlap)."""
    s, spec = cfg.shape, cfg.spec
    args: dict[str, Any] = {
        "requests": s.requests,
        "cached": s.cached,
        "dtype": cfg.dtype,
        "device": cfg.device,
        "seed": cfg.opts.seed,
        "block_size": spec.page_size,
    }
    if mla:
        args.update(heads=spec.num_heads, head_dim=spec.head_dim, topk=s.topk, overlap=overlap_model(cfg.opts.overlap))
    return args


def _heads(rt: Runtime, x: torch.Tensor, rank: int | None = None) -> torch.Tensor:
    h, r = rt.heads_per_rank, rt.rank if rank is None else rank
    return x[:, r * h : (r + 1) * h]


def _kv_cache(rt: Runtime, kv: torch.Tensor) -> torch.Tensor:
    """The step's KV rows in the Runtime's format: as built, or as ``fp8_ds_mla`` rows."""
    return quantize_kv(kv) if rt.kv_format == KV_FP8_DS_MLA else kv


def prepare_gqa_prefill(cfg: RunConfig, rt: Runtime) -> Prepared:
    """A GQA prefill step: head-TP with the new keys already in the paged cache (``kv_new=None``, the
    engine's form: one paged call), or PCP with each rank's new K/V all-gathered by the step."""
    s, spec = cfg.shape, cfg.spec
    g = build_gqa_prefill(
        q_heads=spec.num_heads, kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, sinks=spec.has_sinks,
        tokens=s.tokens, **_step_args(cfg, mla=False),
    )  # fmt: skip
    plan = rt.plan_prefill(g.query_lens, g.prefix_lens)
    dev, window = cfg.device, cfg.opts.window
    if plan.step == "pcp":
        mine = plan.tokens_of(rt.rank).to(dev)
        q, kv_new, cache = g.q[mine], (g.k[mine], g.v[mine]), (g.k_cache, g.v_cache)
        heads = spec.num_heads
        tokens_of = {r: plan.tokens_of(r).to(dev) for r in range(rt.world_size)}

        def part(full: torch.Tensor, r: int) -> torch.Tensor:
            return full.index_select(0, tokens_of[r].to(full.device))

    else:
        lo, hi = head_tp_kv_heads(spec.num_heads, spec.num_kv_heads, rt.world_size, rt.rank)
        q, kv_new = _heads(rt, g.q).contiguous(), None
        cache = (g.k_cache[:, :, lo:hi].contiguous(), g.v_cache[:, :, lo:hi].contiguous())
        heads, mine = rt.heads_per_rank, torch.arange(g.num_tokens, device=dev)

        def part(full: torch.Tensor, r: int) -> torch.Tensor:
            return _heads(rt, full, r)

    def call(check: bool) -> tuple[torch.Tensor, torch.Tensor]:
        out = rt.prefill(
            q, cache, kv_new=kv_new, block_table=g.block_table, plan=plan, sinks=g.sinks, window_left=window,
            check=check,
        )  # fmt: skip
        return with_lse(out, "Runtime.prefill")

    def reference() -> tuple[torch.Tensor, torch.Tensor]:
        cu = torch.tensor([0, *g.query_lens], device=dev).cumsum(0).to(torch.int32)
        return gqa_prefill(
            g.q, g.k, g.v, cu, k_cache=g.k_cache, v_cache=g.v_cache, block_table=g.block_table,
            prefix_lens=torch.tensor(g.prefix_lens, dtype=torch.int32, device=dev), sinks=g.sinks, scale=rt.scale,
            window_left=window, return_lse=True, backend="reference",
        )  # fmt: skip

    positions = [p + j for p, n in zip(g.prefix_lens, g.query_lens) for j in range(n)]
    # the (query, key) pairs the rank's tokens attend: keys 0..p, the last window + 1 of them under a window
    pairs = sum(p + 1 if window < 0 else min(p + 1, window + 1) for p in (positions[i] for i in mine.tolist()))
    form = "kv in cache" if kv_new is None else "kv gathered"
    return Prepared(
        "prefill", call, f"{plan.step}/{plan.route.path} ({form})", plan.route.reason, int(mine.numel()), None,
        4.0 * spec.head_dim * heads * pairs, reference if rt.rank == 0 else None, part,
    )  # fmt: skip


def prepare_prefill(cfg: RunConfig, rt: Runtime) -> Prepared:
    s, spec = cfg.shape, cfg.spec
    if spec.kind == "gqa":
        return prepare_gqa_prefill(cfg, rt)
    step = build_prefill(tokens=s.tokens, recorded=cfg.recorded, **_step_args(cfg, mla=True))
    kv = _kv_cache(rt, step.kv)  # the cache the step reads (the reference reads the same)
    plan = rt.plan_prefill(step.query_lens, step.prefix_lens, kv_rows=int(step.kv.shape[0]))
    mine = plan.tokens_of(rt.rank).to(cfg.device)
    rows_mine = step.rows.index_select(0, mine)
    length = None if step.topk_length is None else step.topk_length.index_select(0, mine)
    keys = int(valid_mask(rows_mine, int(step.kv.shape[0]), length).sum())
    heads = spec.num_heads if plan.step in ("shardq", "pcp") else rt.heads_per_rank
    g = plan.route.group_size
    ratio = union_ratio(rows_mine, g, length) if g > 1 else None
    scale, unique = rt.scale, cfg.opts.topk_unique

    def reference() -> tuple[torch.Tensor, torch.Tensor]:
        return sparse_mla_reference(step.q, kv, step.rows, scale=scale, v_dim=spec.v_dim, topk_length=step.topk_length)

    if plan.step == "pcp":  # every head of the rank's own tokens; their new KV rows; prefix from the cache
        q_tok = step.q.index_select(0, mine).contiguous()
        pos_mine = step.positions.index_select(0, mine)
        own = _token_rows(step, spec.page_size).index_select(0, mine)
        kv_new = kv.index_select(0, own).contiguous()
        tokens_of = {r: plan.tokens_of(r).to(cfg.device) for r in range(rt.world_size)}

        def call(check: bool) -> tuple[torch.Tensor, torch.Tensor]:
            out = rt.prefill(
                q_tok,
                kv,
                topk_pos=pos_mine,
                kv_new=kv_new,
                block_table=step.block_table,
                plan=plan,
                topk_length=length,
                topk_unique=unique,
                check=check,
            )
            return with_lse(out, "Runtime.prefill")

        def part(full: torch.Tensor, r: int) -> torch.Tensor:
            return full.index_select(0, tokens_of[r].to(full.device))

    else:
        q_local = _heads(rt, step.q).contiguous()

        def call(check: bool) -> tuple[torch.Tensor, torch.Tensor]:
            out = rt.prefill(
                q_local, kv, step.rows, plan=plan, topk_length=step.topk_length, topk_unique=unique, check=check
            )
            return with_lse(out, "Runtime.prefill")

        def part(full: torch.Tensor, r: int) -> torch.Tensor:
            return _heads(rt, full, r)

    path = f"{plan.step}/{plan.route.path}" + (f" G={g}" if g > 1 else "")
    return Prepared(
        "prefill",
        call,
        path,
        plan.route.reason,
        int(mine.numel()),
        None if ratio is None or math.isnan(ratio) else ratio,
        flops(keys, heads, spec.head_dim, spec.v_dim),
        reference if rt.rank == 0 else None,
        part,
    )


def prepare_decode(cfg: RunConfig, rt: Runtime) -> Prepared:
    s, spec = cfg.shape, cfg.spec
    dcp = rt.decode_is_dcp
    shard = DcpShard(rt.world_size if dcp else 1, rt.layout.interleave if dcp else 1, rt.rank if dcp else 0)
    elem = torch.finfo(cfg.dtype).bits // 8
    route = rt.decode_route
    if spec.kind == "sparse_mla":
        step = build_decode(q_lens=s.query_lens, causal=cfg.opts.causal, shard=shard, **_step_args(cfg, mla=True))
        q_local = _heads(rt, step.q).contiguous()
        local_rows, _ = convert_topk(
            step.positions, step.req_ids, step.local_table, block_size=spec.page_size, seq_lens=step.seq_lens, dcp=shard
        )
        keys = int((local_rows >= 0).sum())
        heads = spec.num_heads if dcp else rt.heads_per_rank
        row_bytes = kv_row_bytes(rt.kv_format, spec.head_dim, spec.v_dim) if rt.kv_format == KV_FP8_DS_MLA else None
        row_bytes = row_bytes or spec.head_dim * elem
        work = keys * row_bytes + step.num_tokens * heads * (spec.head_dim + spec.v_dim) * elem
        local_kv, whole_kv = _kv_cache(rt, step.local_kv), _kv_cache(rt, step.kv)

        def call(check: bool) -> tuple[torch.Tensor, torch.Tensor]:
            out = rt.decode(
                q_local,
                local_kv,
                step.local_table,
                step.seq_lens,
                topk_pos=step.positions,
                req_ids=step.req_ids,
                topk_unique=cfg.opts.topk_unique,
                check=check,
            )
            return with_lse(out, "Runtime.decode")

        def reference() -> tuple[torch.Tensor, torch.Tensor]:
            return sparse_mla_reference(step.q, whole_kv, step.rows, scale=rt.scale, v_dim=spec.v_dim)

        tokens = step.num_tokens
    else:
        g = build_gqa_decode(
            q_heads=spec.num_heads,
            kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            sinks=spec.has_sinks,
            q_lens=s.query_lens,
            shard=shard,
            **_step_args(cfg, mla=False),
        )
        q_local = _heads(rt, g.q).contiguous()
        local_lens = rt.layout.local_seq_lens(g.seq_lens, rt.rank) if dcp else g.seq_lens
        # DCP: the rank's tokens of every KV head; head-TP: the rank's KV heads of every token
        lo, hi = (
            (0, spec.num_kv_heads)
            if dcp
            else head_tp_kv_heads(spec.num_heads, spec.num_kv_heads, rt.world_size, rt.rank)
        )
        cache = (g.local_k_cache[:, :, lo:hi].contiguous(), g.local_v_cache[:, :, lo:hi].contiguous())
        # the KV tokens each request's queries read: all of them, or under a window (head-TP only, so
        # global lengths) the queries' last window + Q of them
        q_lens = g.cu_q_lens.diff().to(local_lens.device)
        read = local_lens if cfg.opts.window < 0 else torch.minimum(local_lens, q_lens + cfg.opts.window)
        work = int(read.sum()) * (hi - lo) * spec.head_dim * 2 * elem
        work += g.num_tokens * (spec.num_heads if dcp else rt.heads_per_rank) * spec.head_dim * 2 * elem
        causal, window = cfg.opts.causal, cfg.opts.window

        # the host plan of the batch (DCP: per-query local lengths and block-table rows, one
        # pinned tensor, one copy per step): the lean step, no device index arithmetic
        batch = rt.decode_step.plan(g.seq_lens.tolist(), g.cu_q_lens.tolist()) if dcp else None

        def call(check: bool) -> tuple[torch.Tensor, torch.Tensor]:
            out = rt.decode(
                q_local,
                cache,
                g.local_block_table,
                g.seq_lens,
                cu_q_lens=g.cu_q_lens,
                sinks=g.sinks,
                window_left=window,
                batch=batch,
                check=check,
            )
            return with_lse(out, "Runtime.decode")

        def reference() -> tuple[torch.Tensor, torch.Tensor]:
            return gqa_paged_decode_reference(
                g.q,
                g.k_cache,
                g.v_cache,
                g.block_table,
                g.seq_lens,
                g.cu_q_lens,
                causal=causal,
                window_left=window,
                sinks=g.sinks,
                scale=rt.scale,
            )

        tokens = g.num_tokens
    path = f"{'dcp' if dcp else 'headtp'}/{route.path}"
    return Prepared(
        "decode",
        call,
        path,
        route.reason,
        tokens,
        None,
        float(work),
        reference if rt.rank == 0 else None,
        lambda full, r: _heads(rt, full, r),
    )
