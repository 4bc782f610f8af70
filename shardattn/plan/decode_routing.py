"""Which kernel a decode step takes, and why.

GQA decode takes the Triton kernel (:func:`route_decode`): it returns the LSE that DCP and a
consumer need, and it matched or beat FlashInfer XQA on the same inputs (D46, D81); XQA stays a
backend a caller names (``gqa_paged_decode(backend="flashinfer")``). Sparse MLA decode runs the sparse kernels (they
return the LSE, so they serve DCP); :func:`route_sparse_decode_kernel` picks one: on SM90 the Gluon
small-batch kernel at up to :data:`SMALL_DECODE_MAX_HEADS` heads and
:data:`SMALL_DECODE_MAX_TOKENS` tokens while its programs at 128-entry splits fill at most
:data:`SMALL_DECODE_MAX_WAVES` waves of the SMs where the streaming kernel could run (its tile:
:func:`small_decode_tiles`, :func:`small_decode_heads`); at up to :data:`SMALL_DECODE_MAX_HEADS`
heads and more tokens the Gluon streaming kernel from :data:`STREAM_DECODE_MIN_BLOCKS_PER_SM` (bf16 / fp16) or
:data:`STREAM_DECODE_FP8_MIN_BLOCKS_PER_SM` (``fp8_ds_mla``) 64-entry blocks per SM; the Gluon
warp-specialised kernel at :data:`GLUON_DECODE_MIN_HEADS` heads or more and at least
:data:`GLUON_DECODE_MIN_QUERY_ROWS` (``fp8_ds_mla``: :data:`GLUON_DECODE_FP8_MIN_QUERY_ROWS`)
tokens x heads; else Triton. :func:`route_decode_merge` picks the merge of the Triton kernel's
splits. Without a GPU all take the torch ``reference``.

Every threshold is a measured crossover of :mod:`shardattn.plan.crossovers`; the prefill routes
and the :class:`~shardattn.plan.routing.Route` they all return: :mod:`shardattn.plan.routing`.
"""

from __future__ import annotations

import torch

from shardattn._checks import check_bool, check_int
from shardattn.plan.crossovers import (
    COLUMN_MERGE_MAX_ROWS,
    GLUON_DECODE_FP8_MIN_QUERY_ROWS,
    GLUON_DECODE_MIN_HEADS,
    GLUON_DECODE_MIN_QUERY_ROWS,
    SMALL_DECODE_64_MAX_SM_FRACTION,
    SMALL_DECODE_FP8_64_MAX_SM_FRACTION,
    SMALL_DECODE_HEAD_GROUP,
    SMALL_DECODE_MAX_HEADS,
    SMALL_DECODE_MAX_TOKENS,
    SMALL_DECODE_MAX_WAVES,
    STREAM_DECODE_FP8_MIN_BLOCKS_PER_SM,
    STREAM_DECODE_MIN_BLOCKS_PER_SM,
)
from shardattn.plan.routing import Route, device_type_of, sm_of
from shardattn.plan.spec import ModelSpec

__all__ = [
    "DECODE_MERGES",
    "DECODE_PATHS",
    "GLUON_DECODE_FP8_MIN_QUERY_ROWS",
    "GLUON_DECODE_MIN_HEADS",
    "GLUON_DECODE_MIN_QUERY_ROWS",
    "GQA_DECODE_REASON",
    "SMALL_DECODE_MAX_HEADS",
    "SMALL_DECODE_MAX_SPLITS",
    "SMALL_DECODE_MAX_TOKENS",
    "SPARSE_DECODE_KERNELS",
    "route_decode",
    "route_decode_merge",
    "route_sparse_decode_kernel",
    "small_decode_heads",
    "small_decode_tiles",
]

DECODE_PATHS = ("triton", "reference")
GQA_DECODE_REASON = (
    "GQA decode: the Triton kernel (it returns the LSE, and matched or beat FlashInfer XQA on the same inputs: "
    "1.02-1.09x on an H200, 1.04-1.17x on an H100; D46, D81)"
)
SPARSE_DECODE_KERNELS = ("gluon_small", "gluon_stream", "gluon", "triton", "reference")
"""Every kernel :func:`route_sparse_decode_kernel` picks."""
DECODE_MERGES = ("none", "columns", "rows")
SMALL_DECODE_MAX_SPLITS = 64
"""Most splits of a row the small-batch decode kernel takes (its column merge loads every split's
partial of a column block at once)."""


def route_decode(spec: ModelSpec, *, device_type: str | torch.device = "cuda") -> Route:
    """Route a decode step (module docstring): the torch reference off the GPU, else the sparse
    decode kernels (sparse MLA) or the Triton kernel (GQA).

    Args:
        spec: the model.
        device_type: ``"cuda"``, ``"cpu"``, ... (or a ``torch.device``).

    >>> from shardattn.plan.spec import get_preset
    >>> route_decode(get_preset("gqa-64-8")).path
    'triton'
    >>> route_decode(get_preset("gqa-64-8"), device_type="cpu").reason
    "no GPU (device type 'cpu'): torch reference"
    """
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"spec must be a ModelSpec, got {type(spec).__name__}")
    dev = device_type_of(device_type)
    if dev != "cuda":
        return Route("reference", 1, f"no GPU (device type {dev!r}): torch reference")
    if spec.kind == "sparse_mla":
        why = "sparse MLA decode: sparse decode kernel (returns the LSE; route_sparse_decode_kernel picks it)"
        return Route("triton", 1, why)
    return Route("triton", 1, GQA_DECODE_REASON)


def route_sparse_decode_kernel(
    num_heads: int,
    *,
    num_tokens: int | None = None,
    device_type: str | torch.device = "cuda",
    sm: int | tuple[int, int] | None = None,
    gluon_missing: str | None = None,
    gluon_min_heads: int = GLUON_DECODE_MIN_HEADS,
    gluon_min_query_rows: int = GLUON_DECODE_MIN_QUERY_ROWS,
    gluon_fp8_min_query_rows: int = GLUON_DECODE_FP8_MIN_QUERY_ROWS,
    small_missing: str | None = "not asked",
    small_max_heads: int = SMALL_DECODE_MAX_HEADS,
    small_max_tokens: int = SMALL_DECODE_MAX_TOKENS,
    stream_missing: str | None = "not asked",
    topk: int | None = None,
    num_sms: int = 132,
    kv_fp8: bool = False,
    stream_min_blocks_per_sm: float | None = None,
) -> Route:
    """Which kernel runs a sparse-MLA decode call: ``gluon_small``, ``gluon_stream``, ``gluon``, ``triton``
    or ``reference``.

    Args:
        num_heads: query heads of the call (all heads under DCP, ``H / TP`` under head-TP).
        num_tokens: query tokens of the call (requests x draft length); None = large enough.
        device_type: ``"cuda"``, ``"cpu"``, ... (or a ``torch.device``).
        sm: compute capability, ``90`` or ``(9, 0)``; ``None`` = unknown (no Gluon).
        gluon_missing: why the Gluon kernel cannot run these tensors (None = it can).
        gluon_min_heads: fewest heads at which the Gluon decode beats Triton (measured).
        gluon_min_query_rows: fewest ``tokens x heads`` at which it does (measured).
        gluon_fp8_min_query_rows: the same on ``fp8_ds_mla`` rows (``kv_fp8``; measured).
        small_missing: why the Gluon small-batch kernel cannot run these tensors (None = it can;
            the default keeps it out, for callers that do not ask).
        small_max_heads / small_max_tokens: the largest call it takes (measured crossovers).
        stream_missing: why the Gluon streaming kernel cannot run these tensors (None = it can; the
            default keeps it out). topk: the call's top-k width (None = unknown: no streaming).
            num_sms: the device's SMs. kv_fp8: the rows are ``fp8_ds_mla``.
            stream_min_blocks_per_sm: the fewest 64-entry blocks per SM at which it runs at up to
            ``small_max_heads`` heads; None: the measured crossover of the rows' format
            (:data:`~shardattn.plan.crossovers.STREAM_DECODE_MIN_BLOCKS_PER_SM`, ``..._FP8_...``).

    >>> route_sparse_decode_kernel(16, num_tokens=4, sm=90, small_missing=None).path
    'gluon_small'
    >>> route_sparse_decode_kernel(128, sm=90).reason
    'SM90, 128 heads >= 32: Gluon warp-specialised kernel (row slices merged by LSE)'
    >>> route_sparse_decode_kernel(16, sm=90).path
    'triton'
    >>> route_sparse_decode_kernel(16, num_tokens=64, topk=2048, sm=90, stream_missing=None).path
    'gluon_stream'
    >>> [route_sparse_decode_kernel(16, num_tokens=t, topk=2048, sm=90, small_missing=None, stream_missing=None).path
    ...  for t in (8, 12)]  # 128 / 192 programs of 128 entries on 132 SMs
    ['gluon_small', 'gluon_stream']
    >>> [route_sparse_decode_kernel(16, num_tokens=32, topk=256, sm=90, stream_missing=None, kv_fp8=f).path
    ...  for f in (False, True)]  # 0.97 blocks of 64 entries per SM
    ['gluon_stream', 'triton']
    >>> [route_sparse_decode_kernel(h, num_tokens=1, sm=90).path for h in (32, 64)]
    ['triton', 'gluon']
    >>> route_sparse_decode_kernel(128, device_type="cpu").path
    'reference'
    """
    h = check_int("num_heads", num_heads, minimum=1)
    t = None if num_tokens is None else check_int("num_tokens", num_tokens, minimum=0)
    check_int("gluon_min_heads", gluon_min_heads, minimum=1)
    check_int("gluon_min_query_rows", gluon_min_query_rows, minimum=0)
    check_int("gluon_fp8_min_query_rows", gluon_fp8_min_query_rows, minimum=0)
    check_int("small_max_heads", small_max_heads, minimum=0)
    check_int("small_max_tokens", small_max_tokens, minimum=0)
    check_int("num_sms", num_sms, minimum=1)
    check_bool("kv_fp8", kv_fp8)
    if topk is not None:
        check_int("topk", topk, minimum=0)
    sm_v = sm_of(sm)
    dev = device_type_of(device_type)
    if dev != "cuda":
        return Route("reference", 1, f"no GPU (device type {dev!r}): torch reference")
    if gluon_missing is not None:
        return Route("triton", 1, f"{gluon_missing}: Triton split-KV decode kernel")
    if sm_v is None or sm_v // 10 != 9:
        return Route("triton", 1, f"SM{sm_v} is not SM90 (the Gluon kernel uses Hopper wgmma): Triton split-KV decode")
    blocks = None if t is None or topk is None else t * -(-topk // 64)
    least = stream_min_blocks_per_sm
    if least is None:
        least = STREAM_DECODE_FP8_MIN_BLOCKS_PER_SM if kv_fp8 else STREAM_DECODE_MIN_BLOCKS_PER_SM
    per_sm = None if blocks is None else blocks / num_sms
    streams = stream_missing is None and per_sm is not None and h <= small_max_heads and per_sm >= least
    # where the streaming kernel runs, the small-batch kernel only while its 128-entry splits fit its waves
    small_waves = None if t is None or topk is None else t * -(-topk // 128) / num_sms
    small_passed = streams and small_waves is not None and small_waves > SMALL_DECODE_MAX_WAVES
    small_fits = t is not None and 1 <= t <= small_max_tokens and h <= small_max_heads and not small_passed
    if small_missing is None and small_fits:
        why = (
            f"SM90, {h} heads <= {small_max_heads} and {t} tokens <= {small_max_tokens}: Gluon small-batch kernel "
            "(a warpgroup per 64 entries, rows gathered at once, heads as the wgmma N; faster than Triton there, "
            "measured)"
        )
        return Route("gluon_small", 1, why)
    if streams:
        why = (
            f"SM90, {h} heads <= {small_max_heads} and {per_sm:.2f} blocks of 64 entries per SM >= {least:g} "
            f"({'fp8_ds_mla' if kv_fp8 else 'bf16 / fp16'} rows): Gluon streaming kernel (persistent, a "
            "cp.async ring of blocks per SM, heads as the wgmma N; faster than Triton there, measured)"
        )
        if small_passed and t is not None and t <= small_max_tokens:
            why += (
                f"; not the small-batch kernel: its 128-entry splits would fill {small_waves:.2f} waves of "
                f"{num_sms} SMs > {SMALL_DECODE_MAX_WAVES:g} (slower there, measured)"
            )
        return Route("gluon_stream", 1, why)
    if h < gluon_min_heads:
        why = f"{h} heads < {gluon_min_heads}: the Triton split-KV decode kernel is faster there (measured)"
        return Route("triton", 1, why)
    least = gluon_fp8_min_query_rows if kv_fp8 else gluon_min_query_rows
    if t is not None and t * h < least:
        why = (
            f"{t} tokens x {h} heads < {least} query rows ({'fp8_ds_mla' if kv_fp8 else 'bf16 / fp16'} rows): "
            "latency bound, the Triton split-KV decode kernel is as fast or faster there (measured)"
        )
        return Route("triton", 1, why)
    why = f"SM90, {h} heads >= {gluon_min_heads}: Gluon warp-specialised kernel (row slices merged by LSE)"
    return Route("gluon", 1, why)


def route_decode_merge(num_tokens: int, num_heads: int, num_splits: int) -> Route:
    """Which kernel merges a split-KV decode call's partials: ``path`` ``"none"`` (one split: the
    kernel writes the result), ``"columns"`` (at most :data:`COLUMN_MERGE_MAX_ROWS` (token, head)
    rows: one program per (row, column block) loading every partial at once) or ``"rows"``.

    >>> route_decode_merge(1, 16, 32).path, route_decode_merge(8, 128, 8).reason
    ('columns', 'row merge: 1024 (token, head) rows > 128')
    >>> route_decode_merge(4, 16, 1).path
    'none'
    """
    num_tokens = check_int("num_tokens", num_tokens, minimum=0)
    num_heads = check_int("num_heads", num_heads, minimum=0)
    if check_int("num_splits", num_splits, minimum=1) == 1:
        return Route("none", 1, "1 split: the kernel writes the result, no merge")
    n = num_tokens * num_heads
    if n <= COLUMN_MERGE_MAX_ROWS:
        return Route("columns", 1, f"column merge: {n} (token, head) rows <= {COLUMN_MERGE_MAX_ROWS}")
    return Route("rows", 1, f"row merge: {n} (token, head) rows > {COLUMN_MERGE_MAX_ROWS}")


def small_decode_tiles(num_tokens: int, topk: int, num_sms: int, *, kv_fp8: bool = False) -> tuple[int, int]:
    """``(BLOCK_N, splits)`` of the small-batch decode kernel: 64-entry splits (one warpgroup) while
    their programs fill at most :data:`~shardattn.plan.crossovers.SMALL_DECODE_64_MAX_SM_FRACTION`
    of ``num_sms`` (on ``fp8_ds_mla`` rows, ``kv_fp8``:
    :data:`~shardattn.plan.crossovers.SMALL_DECODE_FP8_64_MAX_SM_FRACTION`) and a row fits in
    :data:`SMALL_DECODE_MAX_SPLITS` of them, else 128 (two warpgroups). At top-k 2048 on 132 SMs:
    32 splits of 64 at 1-2 tokens (1-4 on FP8 rows), 16 of 128 from 3 (from 5).

    >>> small_decode_tiles(1, 2048, 132), small_decode_tiles(3, 2048, 132), small_decode_tiles(1, 100, 132)
    ((64, 32), (128, 16), (64, 2))
    >>> small_decode_tiles(4, 2048, 132, kv_fp8=True), small_decode_tiles(5, 2048, 132, kv_fp8=True)
    ((64, 32), (128, 16))
    """
    num_tokens = check_int("num_tokens", num_tokens, minimum=0)
    topk = check_int("topk", topk, minimum=1)
    num_sms = check_int("num_sms", num_sms, minimum=1)
    check_bool("kv_fp8", kv_fp8)
    blocks = -(-topk // 64)
    fraction = SMALL_DECODE_FP8_64_MAX_SM_FRACTION if kv_fp8 else SMALL_DECODE_64_MAX_SM_FRACTION
    fits = num_tokens * blocks <= num_sms * fraction
    block_n = 64 if fits and blocks <= SMALL_DECODE_MAX_SPLITS else 128
    return block_n, -(-topk // block_n)


def small_decode_heads(num_tokens: int, splits: int, heads: int, num_sms: int) -> int:
    """Heads one small-batch split program takes: :data:`~shardattn.plan.crossovers.SMALL_DECODE_HEAD_GROUP`
    (8) while the programs that then read each split's rows twice, one per group of heads, still fit
    in one wave of ``num_sms``; else all ``heads`` (8 or fewer: all of them, on the 8-wide ``wgmma``).

    >>> small_decode_heads(2, 32, 16, 132), small_decode_heads(5, 16, 16, 132), small_decode_heads(1, 32, 8, 132)
    (8, 16, 8)
    """
    num_tokens = check_int("num_tokens", num_tokens, minimum=0)
    splits = check_int("splits", splits, minimum=1)
    heads = check_int("heads", heads, minimum=1)
    num_sms = check_int("num_sms", num_sms, minimum=1)
    if heads <= SMALL_DECODE_HEAD_GROUP:
        return heads
    groups = -(-heads // SMALL_DECODE_HEAD_GROUP)
    return SMALL_DECODE_HEAD_GROUP if num_tokens * splits * groups <= num_sms else heads
