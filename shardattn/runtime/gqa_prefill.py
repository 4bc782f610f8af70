"""The Runtime's GQA prefill steps: head-TP (the rank's heads, a local call) and PCP (zigzag tokens).

What runs (:func:`run_gqa_prefill_step`), per mode's step (:data:`~shardattn.runtime.modes.GQA_PREFILL_STEP`):

* **head-TP**: rank ``r`` holds query heads ``[r H/W, (r+1) H/W)`` of every new token and the KV
  heads they read (:func:`~shardattn.parallel.gqa_head_tp.head_tp_kv_heads`); one local
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
kernel. The kernel object (:class:`~shardattn.ops.gqa_prefill_kernels.FA4SegmentKernel`) is the
Runtime's, so the page table it derives from a block table is made once per table, not per layer.
The plan also holds its FA4 launches (:class:`~shardattn.kernels.fa4_launch.FA4Launches`): the
plan's first FA4 call of each form runs FA4's public function and keeps its compiled kernel and
arguments, so later layers launch that kernel directly (:mod:`shardattn.kernels.fa4_launch`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardattn._checks import FLOAT_DTYPES, check_int, check_pages_in_use, check_sink_logits, check_tensor
from shardattn.kernels.fa4_launch import FA4Launches
from shardattn.ops.gqa_prefill_kernels import SegmentKernel
from shardattn.ops.gqa_prefill_segments import PagedPrefix, Segments, attend_segments, plan_segments
from shardattn.parallel.comm import Comm
from shardattn.parallel.gqa_head_tp import head_tp_kv_heads
from shardattn.parallel.gqa_prefill import PCPSegments, gqa_prefill_pcp, pcp_segments
from shardattn.plan.pcp import PCPPlan
from shardattn.plan.spec import ModelSpec
from shardattn.runtime.args import as_index, check_gqa_cache, check_queries

__all__ = ["GQAInputs", "GQAStepPlan", "check_gqa_prefill_inputs", "plan_gqa_step", "run_gqa_prefill_step"]


@dataclass(frozen=True)
class GQAStepPlan:
    """What a GQA prefill step's layers share: its segments and cached lengths, on the device.

    Attributes:
        segments: this rank's query segments (head-TP: the requests; PCP: its zigzag runs).
        prefix_lens: ``[B]`` int32 cached tokens per request, on the device.
        query_lens, prefix: the host lengths (``[B]`` each).
        max_prefix: the longest cached prefix.
        max_seq: the most KV tokens of one request (prefix and new tokens).
        pcp: under PCP, the rank's share of the plan on the device (its segments, prefix lengths
            and KV rows: :func:`~shardattn.parallel.gqa_prefill.pcp_segments`); ``None`` under head-TP.
        launches: the plan's FA4 launches (filled by its first FA4 call of each form).
        checked_table: the last CPU block table whose values passed the check, with what it was
            checked for (held, so no other tensor can take its address; its version counter
            tells an in-place write): a plan's layers check one table once.
    """

    segments: Segments
    prefix_lens: torch.Tensor
    query_lens: tuple[int, ...]
    prefix: tuple[int, ...]
    max_prefix: int
    max_seq: int
    pcp: PCPSegments | None = None
    launches: FA4Launches = field(default_factory=FA4Launches, compare=False, repr=False)
    checked_table: list = field(default_factory=list, compare=False, repr=False)

    def seq_lens(self) -> list[int]:
        """``[B]`` KV tokens of each request (prefix and new tokens)."""
        return [p + n for p, n in zip(self.prefix, self.query_lens)]


@dataclass(frozen=True)
class GQAInputs:
    """A GQA prefill step's checked tensors (:func:`check_gqa_prefill_inputs`).

    Attributes:
        k_new, v_new: ``[T, Hkv_r, D]`` each (PCP ``[T_r, Hkv, D]``), the new tokens' keys and
            values; ``None`` when they are in the cache already.
        cache: ``(k_cache, v_cache, block_table)``: ``[pages, page_size, Hkv_r, D]`` each and
            ``[B, M]`` int32; ``None`` without a paged cache.
    """

    k_new: torch.Tensor | None
    v_new: torch.Tensor | None
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None


def plan_gqa_step(
    query_lens: list[int], prefix: list[int] | None, device: torch.device, *, shard: PCPPlan | None, rank: int
) -> GQAStepPlan:
    """The step's :class:`GQAStepPlan` (host arithmetic, one copy to ``device``; ``shard``: the PCP plan)."""
    pre = [0] * len(query_lens) if prefix is None else list(prefix)
    pin = device.type == "cuda"
    seq = max((p + n for p, n in zip(pre, query_lens)), default=0)
    if shard is not None:
        mine = pcp_segments(shard, rank, device, pin=pin)
        return GQAStepPlan(mine.segments, mine.prefix_lens, tuple(query_lens), tuple(pre), mine.max_prefix, seq, mine)
    segments = plan_segments(query_lens, pre, device, pin=pin)
    lens = torch.tensor(pre, dtype=torch.int32).to(device)
    return GQAStepPlan(segments, lens, tuple(query_lens), tuple(pre), max(pre, default=0), seq)


def _pair(name: str, value: object, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(value, tuple | list) and len(value) == 2):
        raise TypeError(f"{name} must be a (k, v) pair of tensors for a GQA model ({what}), got {type(value).__name__}")
    return value[0], value[1]


def _is(t: object, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> bool:
    """``t`` is a plain tensor of exactly ``shape``, ``dtype`` and ``device``: the checks' fast
    accept (anything else runs the full check, which names what is wrong)."""
    return type(t) is torch.Tensor and t.shape == shape and t.dtype == dtype and t.device == device


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
    sinks: object,
    gqa: GQAStepPlan,
    num_tokens: int,
    rank_tokens: int,
    heads_per_rank: int,
    tokens_from: str,
) -> GQAInputs:
    """Check one rank's GQA prefill arguments under :meth:`Runtime.prefill
    <shardattn.runtime.runtime.Runtime.prefill>`'s names (shapes and dtypes on the host; values
    of CPU tensors only: no device sync). ``sinks``: ``[H]`` fp32 (every head) or ``None``.

    Arguments of the expected shapes pass after one comparison each; the messages are made only
    for an argument that fails."""
    if rows is not None or topk_pos is not None or topk_length is not None:
        name = "rows" if rows is not None else "topk_pos" if topk_pos is not None else "topk_length"
        raise ValueError(f"{name} is sparse MLA's top-k; a GQA prefill attends every earlier token: pass None")
    if type(window_left) is not int or window_left < -1:
        check_int("window_left", window_left, minimum=-1)
    w, r = comm.world_size, comm.rank
    d = spec.head_dim
    if step == "pcp":
        tokens, heads, lo, hi = rank_tokens, spec.num_heads, 0, spec.num_kv_heads
    else:
        tokens, heads = num_tokens, heads_per_rank
        lo, hi = head_tp_kv_heads(spec.num_heads, spec.num_kv_heads, w, r)
    hkv = hi - lo
    if not (type(q) is torch.Tensor and q.shape == (tokens, heads, d) and q.dtype in FLOAT_DTYPES):
        if step == "pcp":
            tokens_from = f"rank {r}'s share of the PCP plan (plan.tokens_of({r})) is"
            heads_from = f"every one of the model's {heads} heads under PCP"
        else:
            heads_from = f"this rank's {heads} heads (H/W: {spec.num_heads} heads over {w} ranks)"
        check_queries(q, tokens=tokens, heads=heads, head_dim=d, tokens_from=tokens_from, heads_from=heads_from)
    dtype, device = q.dtype, q.device
    # the fast accept only on a device, where the values are not read (on the CPU they are checked finite)
    if sinks is not None and not (_is(sinks, (spec.num_heads,), torch.float32, device) and device.type != "cpu"):
        check_sink_logits(sinks, spec.num_heads, device=device)
    k_new = v_new = None
    if kv_new is not None:
        k_new, v_new = _pair("kv_new", kv_new, "the new tokens' keys and values")
        shape = (tokens, hkv, d)
        for name, x in (("kv_new[0]", k_new), ("kv_new[1]", v_new)):
            if not _is(x, shape, dtype, device):
                check_tensor(name, x, dtypes=(dtype,), shape=shape, device=device)
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
        return GQAInputs(k_new, v_new, None)

    def kv_heads_from() -> str:  # for the message only
        if step == "pcp":
            return f"all {hkv} KV heads under PCP"
        return f"this rank's {hkv} KV head(s) [{lo}, {hi}) of {spec.num_kv_heads} under head-TP"

    kc, vc = check_gqa_cache(
        kv_cache, page_size=spec.page_size, kv_heads=hkv, head_dim=d, dtype=dtype, device=device,
        kv_heads_from=kv_heads_from,
    )  # fmt: skip
    table = block_table
    if not (type(table) is torch.Tensor and table.dtype == torch.int32):
        table = as_index("block_table", block_table)
        if table is None:
            raise ValueError("kv_cache needs its block_table [B, M] int32 (the pages of each request)")
    if not (table.dim() == 2 and _is(table, (len(gqa.query_lens), table.shape[1]), torch.int32, device)):
        check_tensor("block_table", table, dtypes=(torch.int32,), shape=(len(gqa.query_lens), None), device=device)
    need = gqa.max_seq if kv_new is None else gqa.max_prefix
    capacity = table.shape[1] * kc.shape[1]
    if need > capacity:
        what = "seq_lens (prefix and new tokens in the cache: kv_new=None)" if kv_new is None else "prefix_lens"
        raise ValueError(f"block_table holds {capacity} positions per request, but {what} reach {need}")
    if table.device.type == "cpu":  # checked once per table and step (an inference tensor: every call)
        memo = (table, None if table.is_inference() else table._version, table.stride(), kc.shape[:2], kv_new is None)
        held = gqa.checked_table
        if memo[1] is None or not (held and held[0][0] is table and held[0][1:] == memo[1:]):
            lens = gqa.prefix if kv_new is not None else gqa.seq_lens()
            check_pages_in_use(table, lens, page_size=kc.shape[1], num_pages=kc.shape[0], whose="requests")
            held[:] = [memo]
    return GQAInputs(k_new, v_new, (kc, vc, table))


def run_gqa_prefill_step(
    shard: PCPPlan | None,
    gqa: GQAStepPlan,
    q: torch.Tensor,
    given: GQAInputs,
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
    """One layer of a planned GQA prefill step: PCP on ``shard`` (the step's PCP plan), head-TP
    without one (``given``: :func:`check_gqa_prefill_inputs`'s tensors; ``sinks`` every head's,
    ``local_sinks`` the rank's). Returns ``(out, lse or None)``."""
    k, v, cache = given.k_new, given.v_new, given.cache
    if shard is not None:
        kc, vc, table = (None, None, None) if cache is None else cache
        return gqa_prefill_pcp(
            q, k, v, shard, comm, k_cache=kc, v_cache=vc, block_table=table, sinks=sinks, window_left=window_left,
            scale=scale, check=check, segments=gqa.pcp, kernel=kernel, return_lse=return_lse,
            launches=gqa.launches,
        )  # fmt: skip
    prefix = None if cache is None else PagedPrefix(*cache, gqa.prefix_lens, gqa.max_prefix)
    return attend_segments(
        q, k, v, gqa.segments, kernel=kernel, prefix=prefix, window_left=window_left, sinks=local_sinks,
        scale=scale, return_lse=return_lse, launches=gqa.launches,
    )  # fmt: skip
