"""The Runtime's prefill step: the plan of one step and its dispatch to the mode's parallel step.

:class:`PrefillPlan` is what :meth:`Runtime.plan_prefill <shardattn.runtime.runtime.Runtime.plan_prefill>`
returns (plan once per step, run it for every layer); :func:`run_prefill_step` runs one layer of
it: PCP (:func:`~shardattn.parallel.pcp.pcp_prefill`), head-TP (the kernel on this rank's heads,
nothing moves) or ShardQ (:func:`~shardattn.parallel.shardq.shardq_prefill`, its receive and
send buffers carved from the Runtime's workspace: :func:`shardq_buffers`).

:func:`workspace_prefill_attention` is one rank's kernel call with its union in the reserved
workspace: the grouped kernel needs a union buffer of ``ceil(T / G) * G * K`` int32 entries; the
Runtime reserves the planner's bound for it once. A rank holding more tokens than that buffer
covers (the zigzag slack) runs in passes over the same buffer; passes start at multiples of
``G``, so the groups are those of one call and the result is bit for bit that of one call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardattn._checks import FLOAT_DTYPES, check_tensor
from shardattn.ops.kv_fp8 import resolve_kv
from shardattn.ops.prepared_union import PreparedUnion
from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill
from shardattn.parallel.comm import Comm
from shardattn.parallel.pcp import pcp_prefill
from shardattn.parallel.shardq import shardq_prefill
from shardattn.plan.kv_format import KV_FP8_DS_MLA
from shardattn.plan.routing import Route
from shardattn.plan.spec import ModelSpec
from shardattn.plan.zigzag import ShardPlan
from shardattn.runtime.args import as_index, check_paged_rows, check_queries
from shardattn.runtime.workspace import WorkspaceExceededError

__all__ = [
    "PCPInputs",
    "PrefillPlan",
    "RowInputs",
    "check_prefill_inputs",
    "run_prefill_step",
    "shardq_buffers",
    "workspace_prefill_attention",
]

#: ``shardq_prefill`` workspace key -> the Runtime's workspace item (``prefill.<item>``).
SHARDQ_BUFFERS = (
    ("q", "packed_q"),
    ("out", "out"),
    ("lse", "lse"),
    ("rows", "topk_rows"),
    ("union", "union"),
    ("lens", "union_offsets"),
)


@dataclass(frozen=True)
class PrefillPlan:
    """How one prefill step runs: the step, the planner's route and the token split.

    Attributes:
        step: ``"shardq"``, ``"headtp"`` (also ShardQ steps below the gate) or ``"pcp"``.
        route: the planner's :class:`~shardattn.plan.routing.Route` for this rank's kernel call.
        shard: the token split (:class:`~shardattn.plan.zigzag.ShardPlan`, or a
            :class:`~shardattn.plan.pcp.PCPPlan` under PCP); ``None`` for a head-TP mode.
        num_tokens: new tokens of the step.
        gqa: a GQA step's lengths and segments on the device
            (:class:`~shardattn.runtime.gqa_prefill.GQAStepPlan`); ``None`` for sparse MLA.
        made_for: the Runtime configuration the plan holds for, in words (the model's kind and
            heads, the mode, the group's size and the rank): a Runtime refuses a plan of another.
            ``""`` for a plan built by hand (a route forced for a test or a benchmark): not checked.
    """

    step: str
    route: Route
    shard: Any
    num_tokens: int
    gqa: Any = None
    made_for: str = ""

    @property
    def token_plan(self) -> ShardPlan | None:
        """The zigzag split (under PCP: the PCP plan's), or ``None``."""
        return getattr(self.shard, "shard", self.shard)

    def count_of(self, rank: int) -> int:
        """Tokens ``rank``'s kernel runs: its share of the token split (every token without one)."""
        plan = self.token_plan
        return self.num_tokens if plan is None else int(plan.counts[rank])

    def tokens_of(self, rank: int) -> torch.Tensor:
        """``[n]`` int64 token ids (token order) whose queries ``rank``'s kernel runs."""
        plan = self.token_plan
        if plan is None or not plan.sharded:
            return torch.arange(self.num_tokens)
        return plan.token_ids(rank)


def shardq_buffers(workspace: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The ShardQ receive / send buffers, rank rows and union among a Runtime's workspace items
    (``{"q", "out", "lse", "rows", "union", "lens"}``)."""
    return {key: workspace[f"prefill.{item}"] for key, item in SHARDQ_BUFFERS if f"prefill.{item}" in workspace}


@dataclass(frozen=True)
class RowInputs:
    """A ShardQ / head-TP step's checked tensors (:func:`check_prefill_inputs`).

    Attributes:
        kv_cache: ``[R, D]`` KV rows in q's dtype, or ``fp8_ds_mla`` rows (a paged cache as a flat view).
        rows: ``[T, K]`` int32 global rows of ``kv_cache``.
        topk_length: ``[T]`` int32 leading top-k entries to use, or ``None``.
    """

    kv_cache: torch.Tensor
    rows: torch.Tensor
    topk_length: torch.Tensor | None


@dataclass(frozen=True)
class PCPInputs:
    """A PCP step's checked tensors (:func:`check_prefill_inputs`).

    Attributes:
        kv_new: ``[T_r, D]`` the KV rows of the rank's own new tokens.
        topk_pos: ``[T_r, K]`` int32 positions inside each token's request.
        kv_cache, block_table: the paged cache of the cached prefixes and its ``[B, M]`` int32 pages
            (``None`` without cached prefixes).
        topk_length: ``[T_r]`` int32 leading top-k entries to use, or ``None``.
    """

    kv_new: torch.Tensor
    topk_pos: torch.Tensor
    kv_cache: torch.Tensor | None
    block_table: torch.Tensor | None
    topk_length: torch.Tensor | None


def check_prefill_inputs(
    plan: PrefillPlan,
    spec: ModelSpec,
    rank: int,
    heads_per_rank: int,
    *,
    q: torch.Tensor,
    kv_cache: torch.Tensor | None,
    rows: torch.Tensor | None,
    topk_pos: torch.Tensor | None,
    kv_new: torch.Tensor | None,
    block_table: torch.Tensor | None,
    topk_length: torch.Tensor | None,
    tokens_from: str,
    kv_format: str | None = None,
) -> RowInputs | PCPInputs:
    """Check one rank's prefill arguments under the names :meth:`Runtime.prefill
    <shardattn.runtime.runtime.Runtime.prefill>` gives them (the plan's step decides which are
    needed), and convert int64 / list indices to int32 (:func:`~shardattn.runtime.args.as_index`).

    ``tokens_from`` says where the step's token count came from, for the message (``"query_lens
    sums to"``). ``kv_format``: the format ``kv_cache`` / ``kv_new`` must hold (``None``: rows in
    q's dtype, or ``fp8_ds_mla`` rows by their uint8 dtype; a paged FP8 cache is returned as its
    rows). Returns the tensors the step reads: :class:`PCPInputs` for a PCP step, else :class:`RowInputs`.
    """
    world = spec.num_heads // heads_per_rank
    if plan.step == "pcp":
        if rows is not None:
            raise ValueError(
                "rows are global KV rows, which the ShardQ and head-TP modes read; a PCP step reads its top-k as "
                "positions inside each request: pass topk_pos [T_r, K]"
            )
        if topk_pos is None:
            raise ValueError("a PCP prefill needs topk_pos [T_r, K] (its tokens' top-k positions in their requests)")
        if kv_new is None:
            raise ValueError("a PCP prefill needs kv_new [T_r, D] (the KV rows of the rank's own new tokens)")
        check_queries(
            q, tokens=plan.count_of(rank), heads=spec.num_heads, head_dim=spec.head_dim,
            tokens_from=f"rank {rank}'s share of the PCP plan (plan.tokens_of({rank})) is",
            heads_from=f"every one of the model's {spec.num_heads} heads under PCP",
        )  # fmt: skip
        if kv_format != KV_FP8_DS_MLA and isinstance(kv_new, torch.Tensor) and kv_new.dtype in FLOAT_DTYPES:
            if kv_new.dim() == 2 and kv_new.shape[1] != spec.head_dim:  # q has the model's width
                raise ValueError(
                    f"kv_new must have last dim {spec.head_dim} (the model's head_dim), got shape {list(kv_new.shape)}"
                )
        if (kv_cache is None) != (block_table is None):
            only = "kv_cache" if block_table is None else "block_table"
            raise ValueError(
                "kv_cache and block_table go together in a PCP prefill (the paged cache of the cached prefixes "
                f"and its pages): give both or neither, got only {only}"
            )
        prefix = plan.shard.shard.prefix_lens
        if kv_cache is None and bool((prefix > 0).any()):
            raise ValueError(
                f"the plan has cached prefixes (prefix_lens={prefix.tolist()}): pass kv_cache and block_table "
                "holding them"
            )
        if kv_cache is not None:
            kv_cache = _kv_rows(kv_cache, spec, q, kv_format=kv_format, paged=True)
        if kv_format is not None:  # the step checks the rest (its rows, q's dtype)
            resolve_kv("kv_new", kv_new, head_dim=spec.head_dim, v_dim=spec.v_dim, kv_format=kv_format)
        return PCPInputs(
            kv_new=kv_new,
            topk_pos=as_index("topk_pos", topk_pos),
            kv_cache=kv_cache,
            block_table=as_index("block_table", block_table),
            topk_length=as_index("topk_length", topk_length),
        )
    pcp_only = {"topk_pos": topk_pos, "kv_new": kv_new, "block_table": block_table}
    for name, what in (
        ("topk_pos", "request positions"),
        ("kv_new", "the rank's new KV rows"),
        ("block_table", "the pages of the cached prefixes"),
    ):
        if pcp_only[name] is not None:  # nothing the step would not read is taken and dropped
            raise ValueError(
                f"{name} is PCP's ({what}); a {plan.step} step reads the top-k as global rows of kv_cache: pass "
                "rows [T, K] and the whole kv_cache"
            )
    if rows is None:
        raise ValueError("prefill needs rows [T, K] int32 (global rows of kv_cache of every token's top-k)")
    cache = check_tensor("kv_cache", kv_cache)
    check_queries(
        q, tokens=plan.num_tokens, heads=heads_per_rank, head_dim=spec.head_dim, tokens_from=tokens_from,
        heads_from=f"this rank's {heads_per_rank} heads (H/W: {spec.num_heads} heads over {world} ranks)",
    )  # fmt: skip
    cache = _kv_rows(cache, spec, q, kv_format=kv_format, paged=False)
    return RowInputs(kv_cache=cache, rows=as_index("rows", rows), topk_length=as_index("topk_length", topk_length))


def _kv_rows(
    kv_cache: torch.Tensor, spec: ModelSpec, q: torch.Tensor, *, kv_format: str | None, paged: bool
) -> torch.Tensor:
    """``kv_cache`` checked against ``kv_format`` (a declared format, or ``fp8_ds_mla`` rows by their
    uint8 dtype; else rows in q's dtype) as ``[R, row]`` rows: a paged ``[P, page, row]`` cache as a
    flat view (row ``p * page + i``), of ``spec.page_size`` rows a page when ``paged`` (its block
    table's pages are the model's)."""
    rows = passed = check_tensor("kv_cache", kv_cache)
    if paged and passed.dim() == 3:
        check_paged_rows("kv_cache", passed, spec.page_size)
    fp8 = kv_format == KV_FP8_DS_MLA or (kv_format is None and passed.dtype == torch.uint8)
    if fp8 or kv_format is not None or passed.dim() == 3:  # a declared format, fp8_ds_mla rows, or pages
        rows = resolve_kv("kv_cache", passed, head_dim=spec.head_dim, v_dim=spec.v_dim, kv_format=kv_format)[0]
        if fp8:
            return rows
    check_tensor("kv_cache", rows, dtypes=(q.dtype,), ndim=2)  # rows in q's dtype, declared or not
    if rows.shape[1] != spec.head_dim:  # q has the model's width: the cache is the odd one
        raise ValueError(
            f"kv_cache must have last dim {spec.head_dim} (the model's head_dim), got shape {list(passed.shape)}"
        )
    return rows


def run_prefill_step(
    plan: PrefillPlan,
    q: torch.Tensor,
    given: RowInputs | PCPInputs,
    *,
    comm: Comm,
    spec: ModelSpec,
    scale: float,
    attention: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    local_sinks: torch.Tensor | None,
    shardq_workspace: dict[str, torch.Tensor],
    chunks: int | None,
    taper: bool,
    one_union: bool,
    sinks: torch.Tensor | None,
    check: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer of a planned prefill step (``given``: :func:`check_prefill_inputs`'s tensors;
    ``attention`` is the Runtime's kernel call on the plan's route, ``local_sinks`` the rank's heads
    of ``sinks``, ``chunks`` / ``taper`` / ``one_union`` the ShardQ pipeline's depth, chunk shape
    and union build). Returns ``(out, lse)``."""
    v = spec.v_dim
    kv_cache, topk_length = given.kv_cache, given.topk_length
    if isinstance(given, PCPInputs):
        return pcp_prefill(
            q, given.kv_new, given.topk_pos, plan.shard, comm, scale=scale, v_dim=v, kv_cache=kv_cache,
            block_table=given.block_table, block_size=spec.page_size if kv_cache is not None else None,
            topk_length=topk_length, sinks=sinks, attention=attention, check=check,
        )  # fmt: skip
    rows = given.rows
    if plan.shard is None:  # a head-TP mode: nothing moves
        return attention(
            q, given.kv_cache, rows, scale=scale, v_dim=v, topk_length=topk_length, sinks=local_sinks, return_lse=True
        )
    return shardq_prefill(
        q, given.kv_cache, rows, plan.shard, comm, scale=scale, v_dim=v, topk_length=topk_length, sinks=sinks,
        attention=attention, check=check, chunks=chunks, taper=taper, align=plan.route.group_size,
        one_union=one_union, workspace=shardq_workspace,
    )  # fmt: skip


def workspace_prefill_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    *,
    route: Route,
    union_ws: torch.Tensor,
    lens_ws: torch.Tensor,
    scale: float,
    v_dim: int,
    topk_length: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = True,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    q_ready: Callable[[], None] | None = None,
    rows_sorted: bool = False,
    prepared_union: PreparedUnion | None = None,
    rows_unique: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse-MLA prefill of ``q`` on ``route``, the union built into ``union_ws`` / ``lens_ws``.

    Args:
        q: ``[T, H, D]``; kv: ``[R, D]``; rows: ``[T, K]`` int32 global KV rows (``-1`` invalid).
        route: the planner's route (path, group size ``G``).
        union_ws / lens_ws: ``uint8`` workspace items ``prefill.union`` / ``prefill.union_offsets``.
        scale, v_dim, topk_length, sinks: as :func:`~shardattn.ops.sparse_mla.sparse_mla_attention`.
        return_lse: accepted for signature compatibility; the LSE is always returned.
        out / lse_out: optional destinations, written in place; ``q``, ``out`` and ``lse_out`` may be
            head-blocked ``[B, T, H/B, ...]`` (an all-to-all buffer, read or written in place).
        q_ready: optional callable run once before any kernel reads ``q`` (the first pass's union
            build is issued before it; see
            :func:`~shardattn.ops.sparse_mla_grouped.sparse_mla_grouped_prefill`).
        rows_sorted: each token's valid rows arrive ascending (trusted): the union build skips
            its row sort (every pass; a pass is a slice of whole rows).
        prepared_union: the union of these rows built ahead (a slice of a whole share's,
            :func:`~shardattn.ops.prepared_union.prepare_union`): one call, no build, no passes.
        rows_unique: no row twice in a token's list (trusted): a per-query call packs each token's
            valid rows into the union workspace instead of building the union
            (:func:`~shardattn.ops.prepared_union.union_for_call`).
    Returns:
        ``(out [T, H, v_dim] in q's dtype, lse [T, H] fp32)`` (the given destinations when passed).
    Raises:
        WorkspaceExceededError: the union buffer cannot hold one group.
    """
    g, (t, k) = route.group_size, rows.shape
    call = functools.partial(
        sparse_mla_grouped_prefill, kv=kv, scale=scale, v_dim=v_dim, group_size=g, rows_sorted=rows_sorted,
        rows_unique=rows_unique,
    )  # fmt: skip
    if prepared_union is not None or route.path == "reference" or t == 0 or k == 0:
        return call(
            q, rows=rows, topk_length=topk_length, sinks=sinks, out=out, lse_out=lse_out, q_ready=q_ready,
            prepared_union=prepared_union,
        )  # fmt: skip
    per_pass = min(union_ws.numel() // (k * 4), lens_ws.numel() // 4 * g) // g * g
    if per_pass < 1:
        raise WorkspaceExceededError(
            f"workspace item 'prefill.union' ({union_ws.numel()} B) cannot hold one group of {g} x top-k {k}"
        )
    if t <= per_pass:
        return _one_pass(call, q, rows, topk_length, sinks, union_ws, lens_ws, g, k, out, lse_out, q_ready)
    if out is None:
        out = q.new_empty(t, _heads(q), v_dim)
    if lse_out is None:
        lse_out = torch.empty(t, _heads(q), dtype=torch.float32, device=q.device)
    for t0 in range(0, t, per_pass):
        t1 = min(t, t0 + per_pass)
        length = None if topk_length is None else topk_length[t0:t1]
        _one_pass(
            call, _tokens(q, t0, t1, 3), rows[t0:t1], length, sinks, union_ws, lens_ws, g, k,
            _tokens(out, t0, t1, 3), _tokens(lse_out, t0, t1, 2), q_ready if t0 == 0 else None,
        )  # fmt: skip
    return out, lse_out


def _heads(q: torch.Tensor) -> int:
    return q.shape[0] * q.shape[2] if q.dim() == 4 else q.shape[1]


def _tokens(x: torch.Tensor, t0: int, t1: int, plain_dims: int) -> torch.Tensor:
    """Tokens ``t0:t1`` of a plain (``plain_dims`` dims, tokens first) or head-blocked tensor (one more dim)."""
    return x[:, t0:t1] if x.dim() > plain_dims else x[t0:t1]


def _one_pass(
    call: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    q: torch.Tensor,
    rows: torch.Tensor,
    length: torch.Tensor | None,
    sinks: torch.Tensor | None,
    union_ws: torch.Tensor,
    lens_ws: torch.Tensor,
    g: int,
    k: int,
    out: torch.Tensor | None,
    lse_out: torch.Tensor | None,
    q_ready: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    n_groups = -(-rows.shape[0] // g)
    union = union_ws[: n_groups * g * k * 4].view(torch.int32).view(n_groups, g * k)
    lens = lens_ws[: n_groups * 4].view(torch.int32)
    return call(
        q, rows=rows, topk_length=length, sinks=sinks, union=(union, lens), out=out, lse_out=lse_out, q_ready=q_ready
    )
