"""GQA prefill over a process group by context parallelism (PCP); head tensor parallelism is
:mod:`shardattn.parallel.gqa_head_tp`'s.

The math is :func:`~shardattn.ops.gqa_prefill.gqa_prefill`'s (causal over a cached prefix
and the new tokens, sinks, left window).

**PCP** (:func:`gqa_prefill_pcp`): the step's new tokens are split over the ranks by
:func:`~shardattn.plan.pcp_plan` (zigzag, the plan of the sparse-MLA PCP step); each rank holds
all heads of its tokens and computed their K and V::

    rank r: q [T_r, H, D], k_new, v_new [T_r, Hkv, D] (its zigzag tokens, plan.shard.token_ids(r))
        -- all-gather of (k_new, v_new) padded to P rows, started asynchronously -->
           gathered [W * P, 2, Hkv, D]; new token g is row plan.kv_row[g]
        while it is in flight (cached prefix, no window): the rank's queries over the cached
           prefix, read in place from the paged cache (every rank holds it): partial 1
        -- each contiguous run of the rank's tokens (request b, new offsets [a, c)) attends the
           request's new keys [0, c) with the causal mask aligned at its own offset, sinks
           included: partial 2 (with a window: the prefix's last window_left keys and the new
           keys in one buffer, one call, no partial 1) -->
        -- partials merged by LSE (ops.lse_merge) --> out [T_r, H, D], lse [T_r, H]
        -- optionally (gather_output=True) an all-gather of out + lse, restored to token order

With ``k_new = v_new = None`` every rank's paged cache already holds the step's new keys after each
request's prefix (an engine that writes the whole step's K/V into every rank's cache): nothing is
gathered, and each run of the rank's tokens attends positions ``[0, prefix_b + c)`` of the cache in
one paged call (the causal mask and the window aligned at the run's last query).

Sinks are counted once (in the call over the new keys: every query sees itself). A rank that owns
no token runs the collectives and returns empty tensors. Collectives: one all-gather (plus one
with ``gather_output``), plus the agreement check with ``check=True``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, overload

import torch

from shardattn._checks import (
    FLOAT_DTYPES,
    check_bool,
    check_int,
    check_pages_in_use,
    check_queries_tensor,
    check_same_device,
    check_scale,
    check_sink_logits,
    check_tensor,
)
from shardattn.kernels.fa4_launch import FA4Launches
from shardattn.ops.gqa_prefill import check_new_keys, check_prefix_inputs, gqa_prefill_route, segment_kernel
from shardattn.ops.gqa_prefill_kernels import SegmentKernel
from shardattn.ops.gqa_prefill_segments import PagedPrefix, Segments, attend_segments, plan_segments
from shardattn.parallel.agreement import Fingerprint
from shardattn.parallel.comm import Comm
from shardattn.parallel.groups import GroupLike
from shardattn.parallel.pcp import gather_pcp_outputs
from shardattn.plan.pcp import PCPPlan

__all__ = ["PCPSegments", "gqa_prefill_pcp", "pcp_segments"]


@dataclass(frozen=True)
class PCPSegments:
    """One rank's share of a PCP plan, on the device, made once per plan (:func:`pcp_segments`), so
    the step of every layer copies nothing and reads nothing back.

    Attributes:
        segments: the rank's query segments, one per contiguous run of its tokens.
        prefix_lens: ``[B]`` int32 cached tokens of each request, on the device.
        kv_row: ``[T]`` int64 row of new token ``g`` in the all-gathered KV buffer, on the device.
        num_tokens: the rank's tokens. prefix, query_lens: ``[B]`` cached and new tokens per request
            (host ints).
        rank, plan_fingerprint: the rank and the plan (:meth:`PCPPlan.fingerprint`) it was made
            for: the step refuses another's.
    """

    segments: Segments
    prefix_lens: torch.Tensor
    kv_row: torch.Tensor
    num_tokens: int
    prefix: tuple[int, ...]
    query_lens: tuple[int, ...]
    rank: int = -1
    plan_fingerprint: int | None = None

    @property
    def max_prefix(self) -> int:
        """The longest cached prefix (0: no request has a cached token)."""
        return max(self.prefix, default=0)

    @property
    def max_seq(self) -> int:
        """The most KV positions of one request (its prefix and new tokens)."""
        return max((p + n for p, n in zip(self.prefix, self.query_lens)), default=0)


@dataclass(frozen=True)
class _RankInputs:
    """What one rank's checked PCP inputs run on: its share of the plan, the cached prefix it reads
    (``None``: none) and the segment kernel."""

    mine: PCPSegments
    prefix: PagedPrefix | None
    kernel: SegmentKernel


def pcp_segments(plan: PCPPlan, rank: int, device: torch.device | str = "cpu", *, pin: bool = False) -> PCPSegments:
    """Rank ``rank``'s share of ``plan`` on ``device`` (host arithmetic; the segments cross in one copy,
    the prefix lengths and the KV rows in one each; ``pin``: through page-locked memory).

    One segment per contiguous run of the rank's tokens (:meth:`~shardattn.plan.ShardPlan.runs`,
    in the rank's token order): its request and the new-token offset one past its last query.

    >>> from shardattn.plan import pcp_plan
    >>> mine = pcp_segments(pcp_plan([8], 2, prefix_lens=[3]), 0)
    >>> mine.segments.cu_q.tolist(), mine.segments.req.tolist(), mine.segments.stop.tolist(), mine.max_prefix
    ([0, 2, 4], [0, 0], [2, 8], 3)
    """
    shard = plan.shard
    device = torch.device(device)
    prefix = [int(x) for x in shard.prefix_lens.tolist()]
    lens = (shard.token_offsets[1:] - shard.token_offsets[:-1]).tolist()
    segments = plan_segments(lens, prefix, device, runs=shard.runs(rank), pin=pin)
    kv_row = plan.kv_row.to(device, copy=True)  # the step's own: never the plan's tensor
    prefix_lens = torch.tensor(prefix, dtype=torch.int32).to(device)
    return PCPSegments(
        segments, prefix_lens, kv_row, int(shard.counts[rank]), tuple(prefix), tuple(lens), rank, plan.fingerprint()
    )


def _check_pcp(
    q: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    mine: PCPSegments,
    comm: Comm,
    caches: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    sinks: torch.Tensor | None,
    window_left: object,
    scale: object,
    gather_output: object,
    plan_fingerprint: int | None,
) -> tuple[int, PagedPrefix | None, torch.Tensor]:
    """Validate one rank's PCP inputs against its share of the plan (``mine``: host values only, no
    read of a plan tensor); returns the fingerprint the ranks agree on (``plan_fingerprint``
    included), the cached prefix the step reads (``None``: none) and the keys its route is asked
    about (``k_new``, or ``k_cache`` holding the new keys)."""
    t_mine = mine.num_tokens
    check_queries_tensor("q", q)
    t, h, d = q.shape
    if t != t_mine:
        raise ValueError(f"q must hold rank {comm.rank}'s {t_mine} tokens (plan), got {t}")
    k_cache, v_cache, block_table = caches
    hkv = check_new_keys(
        q, k_new, v_new, k_cache, names=("k_new", "v_new"), cache="the cache",
        where="every rank's cache", holders="k_cache, v_cache and block_table",
    )  # fmt: skip
    check_int("window_left", window_left, minimum=-1)
    used_scale = d**-0.5 if scale is None else check_scale("scale", scale)
    check_bool("gather_output", gather_output)
    if sinks is not None:
        check_sink_logits(sinks, h)
    has_prefix = mine.max_prefix > 0 or k_new is None
    prefix = None
    if k_cache is None or v_cache is None or block_table is None:
        if any(x is not None for x in caches):
            raise ValueError("k_cache, v_cache and block_table go together (the cached prefix); give all or none")
        if mine.max_prefix > 0 or k_new is None:  # has_prefix: a cached prefix, or the new keys in the cache
            raise ValueError(
                f"the plan has cached prefixes (prefix_lens={list(mine.prefix[:8])}): pass k_cache, v_cache and "
                "block_table holding them"
            )
        keys = k_new
    else:
        check_prefix_inputs(
            q, hkv, k_cache, v_cache, block_table, mine.prefix_lens, len(mine.prefix),
            "k_new" if k_new is not None else "k_cache",
        )  # fmt: skip
        capacity = block_table.shape[1] * k_cache.shape[1]
        if (mine.max_seq if k_new is None else mine.max_prefix) > capacity:
            what = "prefix_lens plus the new tokens" if k_new is None else "prefix_lens"
            seq = [p + n for p, n in zip(mine.prefix, mine.query_lens)] if k_new is None else list(mine.prefix)
            raise ValueError(f"{what} must fit the block table ({capacity} positions), got {seq[:8]}")
        if has_prefix:
            prefix = PagedPrefix(k_cache, v_cache, block_table, mine.prefix_lens, mine.max_prefix)
        keys = k_cache if k_new is None else k_new
    check_same_device(
        q=q, k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache, block_table=block_table, sinks=sinks
    )
    if k_new is None and prefix is not None and prefix.block_table.device.type == "cpu":
        # every page the new tokens use, read from the cache (host lengths; the prefixes' pages passed above)
        num_pages, page = prefix.k_cache.shape[:2]
        check_pages_in_use(
            prefix.block_table, [p + n for p, n in zip(mine.prefix, mine.query_lens)], page_size=page,
            num_pages=num_pages, whose="the new tokens of requests",
        )  # fmt: skip
    fingerprint = Fingerprint("gqa-pcp", {
        "the plan (query_lens, prefix_lens)": plan_fingerprint, "q's heads": h, "the KV heads": hkv,
        "the head dim": d, "q's dtype": q.dtype, "sinks (given or not)": sinks is not None,
        "window_left": window_left, "gather_output": gather_output, "a cached prefix": has_prefix,
        "k_new / v_new (given or not)": k_new is None, "scale": used_scale,
    })  # fmt: skip
    return fingerprint, prefix, keys


@overload
def gqa_prefill_pcp(
    q: torch.Tensor, k_new: torch.Tensor | None, v_new: torch.Tensor | None, plan: PCPPlan, group: GroupLike | Comm, *,
    k_cache: torch.Tensor | None = ..., v_cache: torch.Tensor | None = ..., block_table: torch.Tensor | None = ...,
    sinks: torch.Tensor | None = ..., window_left: int = ..., scale: float | None = ..., gather_output: bool = ...,
    backend: str = ..., check: bool = ..., segments: PCPSegments | None = ..., kernel: SegmentKernel | None = ...,
    return_lse: Literal[True] = ..., launches: FA4Launches | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip
@overload
def gqa_prefill_pcp(
    q: torch.Tensor, k_new: torch.Tensor | None, v_new: torch.Tensor | None, plan: PCPPlan, group: GroupLike | Comm, *,
    k_cache: torch.Tensor | None = ..., v_cache: torch.Tensor | None = ..., block_table: torch.Tensor | None = ...,
    sinks: torch.Tensor | None = ..., window_left: int = ..., scale: float | None = ..., gather_output: bool = ...,
    backend: str = ..., check: bool = ..., segments: PCPSegments | None = ..., kernel: SegmentKernel | None = ...,
    return_lse: Literal[False], launches: FA4Launches | None = ...,
) -> tuple[torch.Tensor, None]: ...  # fmt: skip
@overload
def gqa_prefill_pcp(
    q: torch.Tensor, k_new: torch.Tensor | None, v_new: torch.Tensor | None, plan: PCPPlan, group: GroupLike | Comm, *,
    k_cache: torch.Tensor | None = ..., v_cache: torch.Tensor | None = ..., block_table: torch.Tensor | None = ...,
    sinks: torch.Tensor | None = ..., window_left: int = ..., scale: float | None = ..., gather_output: bool = ...,
    backend: str = ..., check: bool = ..., segments: PCPSegments | None = ..., kernel: SegmentKernel | None = ...,
    return_lse: bool = ..., launches: FA4Launches | None = ...,
) -> tuple[torch.Tensor, torch.Tensor | None]: ...  # fmt: skip
def gqa_prefill_pcp(
    q: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    plan: PCPPlan,
    group: GroupLike | Comm,
    *,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    window_left: int = -1,
    scale: float | None = None,
    gather_output: bool = False,
    backend: str = "auto",
    check: bool = True,
    segments: PCPSegments | None = None,
    kernel: SegmentKernel | None = None,
    return_lse: bool = True,
    launches: FA4Launches | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GQA prefill over a zigzag token split, the new tokens' K and V all-gathered (module docstring).

    Every rank of ``group`` calls this with the same ``plan`` and the tensors of its own tokens
    (``plan.shard.token_ids(rank)``, in that order).

    Args:
        q: ``[T_r, H, D]`` fp16/bf16/fp32 queries of this rank's tokens (all heads).
        k_new, v_new: ``[T_r, Hkv, D]`` their keys and values (q's dtype), or both ``None``: the
            step's new keys are in every rank's cache after the prefixes (module docstring).
        plan: :func:`~shardattn.plan.pcp_plan` of the step (``world_size`` = the group's); its
            ``prefix_lens`` are the cached tokens of each request.
        group: the PCP process group or a :class:`~shardattn.parallel.comm.Comm`
            (a ``ProcessGroup``, a 1-D ``DeviceMesh`` or ``(mesh, dim name)``: :mod:`~shardattn.parallel.groups`).
        k_cache, v_cache: ``[num_pages, page, Hkv, D]`` the paged cache holding the cached prefixes
            (the same on every rank), with ``block_table [num_requests, M]`` int32; needed when the
            plan has ``prefix_lens > 0``.
        sinks: ``[H]`` fp32 sink logits, optional (counted once).
        window_left: sliding window (``-1`` = none). scale: softmax scale, default ``D ** -0.5``.
        gather_output: also all-gather the outputs and return every token's, in token order.
        backend: the local kernel (:func:`~shardattn.ops.gqa_prefill.gqa_prefill_route`).
        check: agree on the plan and shapes first (one small all-gather, a host sync).
        segments: this rank's :func:`pcp_segments` on q's device (planned once per step, so a
            layer copies nothing and reads nothing back; default: planned here). kernel: the kernel
            implementation (default: ``backend``'s route's).
        return_lse: return the LSE (``False``: ``None``; needs ``gather_output=False``).
        launches: the FA4 launches of the plan ``segments`` belong to (a Runtime's plan; see
            :func:`~shardattn.ops.gqa_prefill_segments.attend_segments`).
    Returns:
        ``(out [T_r, H, D] in q's dtype, lse [T_r, H] fp32)`` for this rank's tokens, or
        ``[T, H, D]`` / ``[T, H]`` in token order with ``gather_output``.

    Example (every rank of a PCP group of ``W`` runs this)::

        plan = pcp_plan(query_lens, W, prefix_lens=prefix_lens)
        ids = plan.shard.token_ids(rank)
        out, lse = gqa_prefill_pcp(q[ids], k[ids], v[ids], plan, group, k_cache=kc, v_cache=vc,
                                   block_table=table, sinks=sinks)
        # q[ids] [T_r, 64, 64] -> out [T_r, 64, 64], lse [T_r, 64]
    """
    comm = Comm.wrap(group)
    checked: _RankInputs | None = None

    def validate() -> int:
        nonlocal checked
        check_bool("check", check)
        mine = segments
        if not isinstance(plan, PCPPlan):
            raise TypeError(f"plan must be a PCPPlan (from pcp_plan), got {type(plan).__name__}")
        if plan.world_size != comm.world_size:
            raise ValueError(f"plan is for world_size={plan.world_size}, but the group has {comm.world_size} ranks")
        plan_fp = plan.fingerprint()  # computed once per plan: no tensor read on later layers
        if mine is None:
            check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3)
            mine = pcp_segments(plan, comm.rank, q.device)
        elif not isinstance(mine, PCPSegments):
            raise TypeError(f"segments must be pcp_segments' PCPSegments, got {type(mine).__name__}")
        elif mine.rank != comm.rank or mine.plan_fingerprint != plan_fp:  # another rank's, or another plan's
            whose = f"rank {mine.rank}'s share" if mine.rank != comm.rank else "another plan's share"
            raise ValueError(
                f"segments are {whose}: pass pcp_segments(plan, {comm.rank}, device) of this step's plan on rank "
                f"{comm.rank}"
            )
        fingerprint, prefix, keys = _check_pcp(
            q, k_new, v_new, mine, comm, (k_cache, v_cache, block_table), sinks, window_left, scale, gather_output,
            plan_fp if check else None,
        )  # fmt: skip
        if not isinstance(return_lse, bool) or (gather_output and not return_lse):
            raise ValueError(f"return_lse must be a bool, True with gather_output, got {return_lse!r}")
        if kernel is not None and not all(callable(getattr(kernel, m, None)) for m in ("contiguous", "paged")):
            raise TypeError(f"kernel must be a SegmentKernel (segment_kernel's), got {type(kernel).__name__}")
        kern = segment_kernel(gqa_prefill_route(q, keys, backend=backend)) if kernel is None else kernel
        checked = _RankInputs(mine, prefix, kern)
        return fingerprint

    comm.agree_on("GQA PCP plan and inputs", validate, check=check)
    if checked is None:  # agree_on returns only after validate() has run
        raise RuntimeError("gqa_prefill_pcp: the inputs were not validated")
    mine, prefix = checked.mine, checked.prefix
    with comm.reporting_failures():  # a failure from here on is reported to the waiting peers
        w = comm.world_size
        t, _, d = q.shape
        keys_ready = None
        k_all = v_all = new_rows = None
        if k_new is not None and v_new is not None:  # both or neither (checked)
            hkv = k_new.shape[1]
            p = plan.shard.padded_count
            padded = k_new.new_zeros(p, 2, hkv, d)
            padded[:t, 0] = k_new
            padded[:t, 1] = v_new
            gathering, pending = comm.all_gather_async(padded)
            gathered = gathering.view(w * p, 2, hkv, d)
            k_all, v_all, new_rows, keys_ready = gathered[:, 0], gathered[:, 1], mine.kv_row, pending.wait
        out, lse = attend_segments(
            q, k_all, v_all, mine.segments, kernel=checked.kernel, prefix=prefix,
            window_left=window_left, sinks=sinks, scale=d**-0.5 if scale is None else scale, new_rows=new_rows,
            keys_ready=keys_ready, return_lse=return_lse, launches=launches if segments is not None else None,
        )  # fmt: skip
        if not gather_output:
            return out, lse
        if lse is None:  # the checks refuse gather_output without return_lse
            raise RuntimeError("gather_output needs the LSE (return_lse=True)")
        return gather_pcp_outputs(out, lse, comm, plan.shard.padded_count, mine.kv_row)
