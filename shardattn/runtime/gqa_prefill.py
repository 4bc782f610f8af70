"""The Runtime's GQA prefill steps: head-TP (the rank's heads, a local call) and PCP (zigzag tokens).

What runs (:func:`run_gqa_prefill_step`), per mode's step (:data:`~shardattn.runtime.modes.GQA_PREFILL_STEP`):

* **head-TP**: rank ``r`` holds query heads ``[r H/W, (r+1) H/W)`` of every new token and the KV
  heads they read (:func:`~shardattn.parallel.gqa_prefill.head_tp_kv_heads`); one local
  :func:`~shardattn.ops.gqa_prefill_segments.attend_segments` call, no collective. With
  ``kv_new=None`` (the new tokens' K/V already written into the paged cache, as an engine's cache
  write does before attention) that is one paged FA4 call over ``seq_lens`` keys per request: the
  call an engine makes of FA4 directly.
* **PCP**: :func:`~shardattn.parallel.gqa_prefill.gqa_prefill_pcp` on the plan's zigzag split:
  every head of the rank's tokens, the new K/V all-gathered (none with ``kv_new=None``: every
  rank's cache holds them), each run's causal offsets, the prefix read from the paged cache.

Everything that depends only on the lengths is computed once per step, in
:meth:`Runtime.plan_prefill <shardattn.runtime.runtime.Runtime.plan_prefill>`
(:class:`GQAStepPlan`: the segments on the device, moved in one copy), so an engine's layers reuse
it; a layer's call then checks shapes on the host (no device sync, no device op) and issues the
kernel. The kernel object (:class:`~shardattn.ops.gqa_prefill_segments.FA4SegmentKernel`) is the
Runtime's, so the page table it derives from a block table is made once per table, not per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardattn._checks import check_int, check_tensor
from shardattn.ops.gqa_prefill_segments import PagedPrefix, SegmentKernel, Segments, attend_segments, plan_segments
from shardattn.parallel.comm import Comm
from shardattn.parallel.gqa_prefill import gqa_prefill_pcp, head_tp_kv_heads
from shardattn.plan.pcp import PCPPlan
from shardattn.plan.spec import ModelSpec
from shardattn.runtime.args import as_index, check_queries

__all__ = ["GQAStepPlan", "check_gqa_prefill_inputs", "plan_gqa_step", "run_gqa_prefill_step"]


@dataclass(frozen=True)
class GQAStepPlan:
    """What a GQA prefill step's layers share: its segments and cached lengths, on the device.

    Attributes:
        segments: this rank's query segments (head-TP: the requests; PCP: its zigzag runs).
        prefix_lens: ``[B]`` int32 cached tokens per request, on the device.
        query_lens, prefix: the host lengths (``[B]`` each).
        max_prefix: the longest cached prefix.
    """

    segments: Segments
    prefix_lens: torch.Tensor
    query_lens: tuple[int, ...]
    prefix: tuple[int, ...]
    max_prefix: int

    @property
    def max_seq(self) -> int:
        """The most KV tokens of one request (prefix and new tokens)."""
        return max((p + n for p, n in zip(self.prefix, self.query_lens)), default=0)


def plan_gqa_step(
    query_lens: list[int], prefix: list[int] | None, device: torch.device, *, shard: PCPPlan | None, rank: int
) -> GQAStepPlan:
    """The step's :class:`GQAStepPlan` (host arithmetic, one copy to ``device``; ``shard``: the PCP plan)."""
    pre = [0] * len(query_lens) if prefix is None else list(prefix)
    runs = None if shard is None else shard.shard.runs(rank)
    pin = device.type == "cuda"
    segments = plan_segments(query_lens, pre, device, runs=runs, pin=pin)
    lens = torch.tensor(pre, dtype=torch.int32).to(device)
    return GQAStepPlan(segments, lens, tuple(query_lens), tuple(pre), max(pre, default=0))


def _pair(name: str, value: object, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(value, tuple | list) and len(value) == 2):
        raise TypeError(f"{name} must be a (k, v) pair of tensors for a GQA model ({what}), got {type(value).__name__}")
    return value[0], value[1]


def check_gqa_prefill_inputs(
    step: str,
    spec: ModelSpec,
    comm: Comm,
    *,
    q: torch.Tensor,
    kv_cache: object,
    kv_new: object,
    block_table: torch.Tensor | None,
    rows: object,
    topk_pos: object,
    topk_length: object,
    window_left: object,
    gqa: GQAStepPlan,
    num_tokens: int,
    rank_tokens: int,
    heads_per_rank: int,
    tokens_from: str,
) -> dict[str, torch.Tensor | None]:
    """Check one rank's GQA prefill arguments under :meth:`Runtime.prefill
    <shardattn.runtime.runtime.Runtime.prefill>`'s names (shapes and dtypes on the host; values
    of CPU tensors only: no device sync). Returns ``{"k_new", "v_new", "k_cache", "v_cache",
    "block_table"}``."""
    for name, value in (("rows", rows), ("topk_pos", topk_pos), ("topk_length", topk_length)):
        if value is not None:
            raise ValueError(f"{name} is sparse MLA's top-k; a GQA prefill attends every earlier token: pass None")
    check_int("window_left", window_left, minimum=-1)
    w, r = comm.world_size, comm.rank
    pcp = step == "pcp"
    if pcp:
        heads, hkv = spec.num_heads, spec.num_kv_heads
        check_queries(
            q, tokens=rank_tokens, heads=heads, head_dim=spec.head_dim,
            tokens_from=f"rank {r}'s share of the PCP plan (plan.tokens_of({r})) is",
            heads_from=f"every one of the model's {heads} heads under PCP",
        )  # fmt: skip
        kv_heads_from = f"all {hkv} KV heads under PCP"
    else:
        lo, hi = head_tp_kv_heads(spec.num_heads, spec.num_kv_heads, w, r)
        hkv = hi - lo
        check_queries(
            q, tokens=num_tokens, heads=heads_per_rank, head_dim=spec.head_dim, tokens_from=tokens_from,
            heads_from=f"this rank's {heads_per_rank} heads (H/W: {spec.num_heads} heads over {w} ranks)",
        )  # fmt: skip
        kv_heads_from = f"this rank's {hkv} KV head(s) [{lo}, {hi}) of {spec.num_kv_heads} under head-TP"
    out: dict[str, torch.Tensor | None] = dict.fromkeys(("k_new", "v_new", "k_cache", "v_cache", "block_table"))
    if kv_new is not None:
        k, v = _pair("kv_new", kv_new, "the new tokens' keys and values")
        shape = (q.shape[0], hkv, spec.head_dim)
        for name, x in (("kv_new[0]", k), ("kv_new[1]", v)):
            check_tensor(name, x, dtypes=(q.dtype,), shape=shape, device=q.device)
        out["k_new"], out["v_new"] = k, v
    if kv_cache is None:
        if kv_new is None:
            raise ValueError(
                "a GQA prefill needs kv_new (the new tokens' (k, v)) or kv_cache holding them after each prefix"
            )
        if gqa.max_prefix:
            raise ValueError(
                f"the step has cached prefixes (prefix_lens up to {gqa.max_prefix}): pass kv_cache (k_cache, "
                "v_cache) and block_table holding them"
            )
        if block_table is not None:
            raise ValueError("block_table goes with kv_cache (the paged cache); pass both or neither")
        return out
    kc, vc = _pair("kv_cache", kv_cache, "the paged cache")
    check_tensor("kv_cache[0]", kc, dtypes=(q.dtype,), ndim=4, device=q.device)
    if tuple(kc.shape[2:]) != (hkv, spec.head_dim):
        raise ValueError(
            f"kv_cache[0] must have shape [pages, page_size, {hkv}, {spec.head_dim}] ({kv_heads_from}), "
            f"got {list(kc.shape)}"
        )
    check_tensor("kv_cache[1]", vc, dtypes=(q.dtype,), shape=tuple(kc.shape), device=q.device)
    table = as_index("block_table", block_table)
    if table is None:
        raise ValueError("kv_cache needs its block_table [B, M] int32 (the pages of each request)")
    check_tensor("block_table", table, dtypes=(torch.int32,), shape=(len(gqa.query_lens), None), device=q.device)
    need = gqa.max_seq if kv_new is None else gqa.max_prefix
    capacity = table.shape[1] * kc.shape[1]
    if need > capacity:
        what = "seq_lens (prefix and new tokens in the cache: kv_new=None)" if kv_new is None else "prefix_lens"
        raise ValueError(f"block_table holds {capacity} positions per request, but {what} reach {need}")
    if table.device.type == "cpu":
        lens = gqa.prefix if kv_new is not None else [p + n for p, n in zip(gqa.prefix, gqa.query_lens)]
        page = kc.shape[1]
        bad = [
            b for b, n in enumerate(lens) if bool(((table[b, : -(-n // page)] < 0) | (table[b, : -(-n // page)]
                                                   >= kc.shape[0])).any())
        ]  # fmt: skip
        if bad:
            raise ValueError(f"block_table holds pages outside [0, {kc.shape[0]}) for requests {bad[:8]}")
    out["k_cache"], out["v_cache"], out["block_table"] = kc, vc, table
    return out


def run_gqa_prefill_step(
    step: str,
    shard: PCPPlan | None,
    gqa: GQAStepPlan,
    q: torch.Tensor,
    given: dict[str, torch.Tensor | None],
    *,
    comm: Comm,
    kernel: SegmentKernel,
    scale: float,
    sinks: torch.Tensor | None,
    local_sinks: torch.Tensor | None,
    window_left: int,
    return_lse: bool,
    check: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One layer of a planned GQA prefill step (``given``: :func:`check_gqa_prefill_inputs`'s tensors;
    ``sinks`` every head's, ``local_sinks`` the rank's). Returns ``(out, lse or None)``."""
    k, v, kc, vc, table = (given[n] for n in ("k_new", "v_new", "k_cache", "v_cache", "block_table"))
    if step == "pcp":
        return gqa_prefill_pcp(
            q, k, v, shard, comm, k_cache=kc, v_cache=vc, block_table=table, sinks=sinks, window_left=window_left,
            scale=scale, check=check, segments=gqa.segments, kernel=kernel, return_lse=return_lse,
        )  # fmt: skip
    prefix = None
    if kc is not None:
        prefix = PagedPrefix(kc, vc, table, gqa.prefix_lens, gqa.max_prefix)
    return attend_segments(
        q, k, v, gqa.segments, kernel=kernel, prefix=prefix, window_left=window_left, sinks=local_sinks,
        scale=scale, return_lse=return_lse,
    )  # fmt: skip
