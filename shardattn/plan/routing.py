"""Which kernel path a step takes, and why.

Prefill (sparse MLA): the grouped path packs ``G`` consecutive queries of ``heads`` heads into
one 64-row tile and gathers the union of their top-k rows once; each union entry packs the KV
row in 24 bits and one membership bit per query in the high 8 bits (so ``G <= 8`` and rows
``< 2^24 - 1``). Checks, in order (the first that applies decides):

1. no GPU (device type other than ``cuda``)            -> ``reference``
2. KV cache with ``2^24 - 1`` rows or more              -> ``per-query`` (rows do not fit 24 bits)
3. fewer than ``min_tokens`` new tokens in the step     -> ``per-query``
4. an LSE is needed and the grouped backend has none    -> ``per-query``
5. more than ``grouped_max_heads`` heads                -> ``per-query``
6. otherwise                                            -> ``grouped`` with ``G = 64 / heads``

Why 64-row tiles and at most 8 heads on the Triton kernel (``G = 128 / heads`` fits a 128-row
tile of a hand-written kernel): the Triton kernel holds 64 rows per program (128 rows spill
registers), and grouping beats its per-query path only up to :data:`GROUPED_MAX_HEADS` heads (the
union build plus the membership mask cost more than the shared gathers save above). A backend
with cheaper grouping passes its own ``grouped_max_heads`` / ``tile_rows``.

Every threshold is a measured crossover of :mod:`shardattn.plan.crossovers` (the runs behind
them: ``docs/PERFORMANCE.md``); the functions here turn them into decisions with reasons, and
``shardattn.ops.dispatch`` asks them with the tensors of a call.

Decode: GQA picks FlashInfer XQA when it is installed, the GPU is SM90 / SM100 / SM120, the head
dim passes :func:`xqa_head_dim_supported` (the same function the CUDA-graph policy uses), no
LSE is needed (XQA returns none, so never under DCP) and, on SM100, drafts are causal;
otherwise the Triton kernel. Sparse MLA decode runs the Triton sparse kernel (it returns the
LSE, so it serves DCP); :func:`route_sparse_decode_kernel` picks its kernel: on SM90 the Gluon
small-batch kernel at up to :data:`SMALL_DECODE_MAX_HEADS` heads and
:data:`SMALL_DECODE_MAX_TOKENS` tokens (its tile: :func:`small_decode_tiles`,
:func:`small_decode_heads`), the Gluon warp-specialised kernel at
:data:`GLUON_DECODE_MIN_HEADS` heads or more, else Triton; :func:`route_decode_merge` picks the
merge of the Triton kernel's splits. Without a GPU all take the torch ``reference``.

Union build: :func:`route_union_method` picks the builder ``build_union(method="auto")`` runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardattn._checks import check_int
from shardattn.plan.crossovers import (
    BITMAP_SCAN_RATIO,
    COLUMN_MERGE_MAX_ROWS,
    DEFAULT_MIN_TOKENS,
    GLUON_DECODE_MIN_HEADS,
    GLUON_DECODE_MIN_PROGRAMS,
    GLUON_GROUPED_MAX_HEADS,
    GLUON_MIN_HEADS,
    GROUPED_MAX_HEADS,
    SMALL_DECODE_64_MAX_SM_FRACTION,
    SMALL_DECODE_HEAD_GROUP,
    SMALL_DECODE_MAX_HEADS,
    SMALL_DECODE_MAX_TOKENS,
    SMEM_SCAN_RATIO,
    SMEM_SORTED_RATIO,
    TILE_ROWS,
    UNION_METHOD,
)
from shardattn.plan.cudagraph import xqa_head_dim_supported
from shardattn.plan.spec import ModelSpec

__all__ = [
    "DECODE_MERGES",
    "DECODE_PATHS",
    "GLUON_DECODE_MIN_HEADS",
    "GLUON_DECODE_MIN_PROGRAMS",
    "GLUON_GROUPED_MAX_HEADS",
    "GLUON_MIN_HEADS",
    "GROUPED_MAX_HEADS",
    "GROUP_SIZES",
    "MAX_GROUPED_KV_ROWS",
    "PREFILL_KERNELS",
    "PREFILL_PATHS",
    "SMALL_DECODE_MAX_HEADS",
    "SMALL_DECODE_MAX_SPLITS",
    "SMALL_DECODE_MAX_TOKENS",
    "TILE_ROWS",
    "UNION_METHODS",
    "XQA_SM",
    "Route",
    "gluon_grouped_group_size",
    "grouped_group_size",
    "prefill_group_size",
    "route_decode",
    "route_decode_merge",
    "route_prefill",
    "route_prefill_kernel",
    "route_sparse_decode_kernel",
    "route_union_method",
    "small_decode_heads",
    "small_decode_tiles",
    "tile_group_size",
]

GROUP_SIZES = (2, 4, 8)
"""Group sizes the membership byte allows (one bit per query, at most 8)."""
MAX_GROUPED_KV_ROWS = 2**24 - 1
"""The grouped path (and the bitmap union build) needs every KV row index ``< 2^24 - 1`` (24-bit
row field, all-ones reserved)."""
XQA_SM = (90, 100, 120)
PREFILL_PATHS = ("grouped", "per-query", "reference")
DECODE_PATHS = ("triton", "flashinfer-xqa", "reference")
PREFILL_KERNELS = ("gluon", "triton", "reference")
SMALL_DECODE_MAX_SPLITS = 64
"""Most splits of a row the small-batch decode kernel takes (its column merge loads every split's
partial of a column block at once)."""
DECODE_MERGES = ("none", "columns", "rows")
UNION_METHODS = ("sort", "fused", "bitmap")
SPARSE_DECODE_KERNELS = ("gluon_small", "gluon", "triton", "reference")


@dataclass(frozen=True)
class Route:
    """A routing decision: ``path``, the query group size (1 unless grouped) and a readable reason."""

    path: str
    group_size: int
    reason: str


def _device_type(device_type: object) -> str:
    if isinstance(device_type, torch.device):
        return device_type.type
    if isinstance(device_type, str):
        return torch.device(device_type).type
    raise TypeError(f"device_type must be a str or torch.device, got {type(device_type).__name__}")


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def tile_group_size(num_heads: int, *, tile_rows: int = TILE_ROWS) -> int:
    """Queries that fill a ``tile_rows`` tile: ``tile_rows // next_pow2(heads)`` clipped to ``[1, 8]``.

    >>> [tile_group_size(h) for h in (4, 8, 16, 32, 64, 128)]
    [8, 8, 4, 2, 1, 1]
    >>> tile_group_size(16, tile_rows=128)
    8
    """
    num_heads = check_int("num_heads", num_heads, minimum=1)
    padded = 1 << (num_heads - 1).bit_length()
    return max(1, min(max(GROUP_SIZES), tile_rows // padded))


def grouped_group_size(
    num_heads: int, *, grouped_max_heads: int = GROUPED_MAX_HEADS, tile_rows: int = TILE_ROWS
) -> int | None:
    """The ``G`` of the grouped path for ``num_heads`` heads, or ``None`` when it does not pay.

    >>> [grouped_group_size(h) for h in (4, 8, 16, 64, 128)]
    [8, 8, None, None, None]
    >>> [grouped_group_size(h, grouped_max_heads=64, tile_rows=128) for h in (16, 32, 64, 128)]
    [8, 4, 2, None]
    """
    num_heads = check_int("num_heads", num_heads, minimum=1)
    check_int("grouped_max_heads", grouped_max_heads, minimum=0)
    if num_heads > grouped_max_heads:
        return None
    g = tile_group_size(num_heads, tile_rows=tile_rows)
    return g if g in GROUP_SIZES else None


def gluon_grouped_group_size(num_heads: int, *, gluon_grouped_max_heads: int = GLUON_GROUPED_MAX_HEADS) -> int | None:
    """``G`` of the grouped Gluon kernel (64-row tile) for ``num_heads``, or ``None`` where it is not routed.

    >>> [gluon_grouped_group_size(h, gluon_grouped_max_heads=32) for h in (4, 8, 16, 32, 64)]
    [8, 8, 4, 2, None]
    """
    return grouped_group_size(num_heads, grouped_max_heads=gluon_grouped_max_heads, tile_rows=TILE_ROWS)


def prefill_group_size(num_heads: int, *, gluon: bool) -> int | None:
    """``G`` of a default grouped step for ``num_heads`` heads: the grouped Gluon kernel's where it
    runs (``gluon``: sm_90 with Gluon), else the Triton kernel's; ``None`` where grouping does not pay.

    >>> [prefill_group_size(h, gluon=True) for h in (8, 16, 32, 64)]
    [8, 4, 2, None]
    >>> [prefill_group_size(h, gluon=False) for h in (8, 16, 32, 64)]
    [8, None, None, None]
    """
    g = gluon_grouped_group_size(num_heads) if gluon else None
    return g if g is not None else grouped_group_size(num_heads)


def route_prefill(
    num_heads: int,
    *,
    num_tokens: int,
    kv_rows: int,
    device_type: str | torch.device = "cuda",
    min_tokens: int = DEFAULT_MIN_TOKENS,
    need_lse: bool = False,
    grouped_supports_lse: bool = True,
    grouped_max_heads: int = GROUPED_MAX_HEADS,
    tile_rows: int = TILE_ROWS,
    gluon: bool = False,
) -> Route:
    """Route a sparse MLA prefill step (checks in the module docstring).

    Args:
        num_heads: query heads the kernel runs per rank (all heads under ShardQ, ``H / TP``
            under head tensor parallelism).
        num_tokens: new query tokens of the step (per rank's kernel call).
        kv_rows: rows of the KV cache the top-k indices address.
        device_type: ``"cuda"``, ``"cpu"``, ... (or a ``torch.device``).
        min_tokens: smaller steps take the per-query path.
        need_lse: a consumer needs the LSE (e.g. a merge across ranks).
        grouped_supports_lse: the grouped backend returns the LSE (ours does).
        grouped_max_heads: most heads for which the grouped backend pays (see the module docstring).
        tile_rows: rows of the grouped backend's tile.
        gluon: the grouped Gluon kernel runs on this device (sm_90, Triton with Gluon): grouping
            then pays up to :data:`GLUON_GROUPED_MAX_HEADS` heads (:func:`prefill_group_size`).

    >>> route_prefill(8, num_tokens=8192, kv_rows=1 << 20)
    Route(path='grouped', group_size=8, reason='8 heads: 8 queries per 64-row tile')
    >>> route_prefill(64, num_tokens=8192, kv_rows=1 << 20).reason
    '64 heads > 8: grouping is slower than the per-query kernel there (measured)'
    >>> route_prefill(8, num_tokens=8192, kv_rows=1 << 24).path
    'per-query'
    >>> route_prefill(16, num_tokens=8192, kv_rows=1000, device_type="cpu").path
    'reference'
    """
    h = check_int("num_heads", num_heads, minimum=1)
    t = check_int("num_tokens", num_tokens, minimum=0)
    rows = check_int("kv_rows", kv_rows, minimum=0)
    m = check_int("min_tokens", min_tokens, minimum=0)
    _check_bool("need_lse", need_lse)
    _check_bool("grouped_supports_lse", grouped_supports_lse)
    dev = _device_type(device_type)
    if dev != "cuda":
        return Route("reference", 1, f"no GPU (device type {dev!r}): torch reference")
    if rows >= MAX_GROUPED_KV_ROWS:
        return Route("per-query", 1, f"KV cache has {rows} rows >= 2^24 - 1: rows do not fit the 24-bit union entry")
    if t < m:
        return Route("per-query", 1, f"{t} tokens < min_tokens={m}: step too small to group")
    if need_lse and not grouped_supports_lse:
        return Route("per-query", 1, "an LSE is needed and the grouped backend does not return one")
    g = gluon_grouped_group_size(h) if gluon else None
    if g is not None:
        return Route("grouped", g, f"{h} heads: {g} queries per {TILE_ROWS}-row tile (grouped Gluon kernel)")
    g = grouped_group_size(h, grouped_max_heads=grouped_max_heads, tile_rows=tile_rows)
    if g is None:
        if h > grouped_max_heads:
            return Route(
                "per-query",
                1,
                f"{h} heads > {grouped_max_heads}: grouping is slower than the per-query kernel there (measured)",
            )
        return Route("per-query", 1, f"{h} heads: no group of 2, 4 or 8 queries fits a {tile_rows}-row tile")
    return Route("grouped", g, f"{h} heads: {g} queries per {tile_rows}-row tile")


def _sm(sm: object) -> int | None:
    if sm is None:
        return None
    if isinstance(sm, tuple):
        if len(sm) != 2:
            raise ValueError(f"sm must be an int like 90 or a (major, minor) tuple, got {sm!r}")
        major = check_int("sm[0]", sm[0], minimum=0)
        minor = check_int("sm[1]", sm[1], minimum=0)
        return major * 10 + minor
    return check_int("sm", sm, minimum=0)


def route_decode(
    spec: ModelSpec,
    *,
    device_type: str | torch.device = "cuda",
    sm: int | tuple[int, int] | None = None,
    dcp_size: int = 1,
    xqa_installed: bool = False,
    need_lse: bool = False,
    non_causal: bool = False,
) -> Route:
    """Route a decode step (module docstring).

    Args:
        spec: the model.
        device_type: ``"cuda"``, ``"cpu"``, ... (or a ``torch.device``).
        sm: compute capability, ``90`` or ``(9, 0)``; ``None`` = unknown (no XQA).
        dcp_size: decode context-parallel ranks; ``> 1`` needs the LSE.
        xqa_installed: FlashInfer with the XQA decode API is importable.
        need_lse: a consumer needs the LSE.
        non_causal: speculative drafts attend non-causally.

    >>> from shardattn.plan.spec import get_preset
    >>> route_decode(get_preset("gqa-64-8"), sm=90, xqa_installed=True).path
    'flashinfer-xqa'
    >>> route_decode(get_preset("gqa-64-8"), sm=90, xqa_installed=True, dcp_size=2).reason
    'dcp_size=2 needs the LSE, which XQA does not return: Triton decode'
    """
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"spec must be a ModelSpec, got {type(spec).__name__}")
    sm_v = _sm(sm)
    dcp = check_int("dcp_size", dcp_size, minimum=1)
    _check_bool("xqa_installed", xqa_installed)
    _check_bool("need_lse", need_lse)
    _check_bool("non_causal", non_causal)
    dev = _device_type(device_type)
    if dev != "cuda":
        return Route("reference", 1, f"no GPU (device type {dev!r}): torch reference")
    if spec.kind == "sparse_mla":
        why = "sparse MLA decode: sparse decode kernel (returns the LSE; route_sparse_decode_kernel picks it)"
        return Route("triton", 1, why)
    if not xqa_installed:
        why = "FlashInfer XQA is not installed"
    elif sm_v not in XQA_SM:
        why = f"SM{sm_v} is not one of SM90/SM100/SM120" if sm_v is not None else "compute capability unknown"
    elif not xqa_head_dim_supported(spec.head_dim):
        why = f"head_dim {spec.head_dim} is outside XQA's limits (16..256, multiple of 16)"
    elif dcp > 1:
        why = f"dcp_size={dcp} needs the LSE, which XQA does not return"
    elif need_lse:
        why = "an LSE is needed, which XQA does not return"
    elif non_causal and sm_v == 100:
        why = "non-causal drafts are not supported by XQA on SM100"
    else:
        return Route("flashinfer-xqa", 1, f"FlashInfer XQA on SM{sm_v}, head_dim {spec.head_dim}")
    return Route("triton", 1, f"{why}: Triton decode")


def route_prefill_kernel(
    num_heads: int,
    *,
    device_type: str | torch.device = "cuda",
    sm: int | tuple[int, int] | None = None,
    gluon_missing: str | None = None,
    gluon_min_heads: int = GLUON_MIN_HEADS,
    group_size: int = 1,
    gluon_grouped_max_heads: int = GLUON_GROUPED_MAX_HEADS,
) -> Route:
    """Which kernel runs a sparse-MLA prefill step of ``group_size`` queries per tile: ``gluon``,
    ``triton`` or ``reference`` (the Route's ``group_size`` is the given one).

    Args:
        num_heads: query heads per rank.
        device_type: ``"cuda"``, ``"cpu"``, ... (or a ``torch.device``).
        sm: compute capability, ``90`` or ``(9, 0)``; ``None`` = unknown (no Gluon).
        gluon_missing: why the Gluon kernel cannot run here (None = it can: Triton has Gluon).
        gluon_min_heads: fewest heads at which per-query Gluon beats per-query Triton (measured).
        group_size: ``G``; ``1`` = per-query. ``G > 1`` runs the grouped Gluon kernel when its
            64-row tile holds ``G * heads`` rows and ``heads <= gluon_grouped_max_heads``.
        gluon_grouped_max_heads: most heads at which grouped Gluon beats the Triton paths (measured;
            ``0``: grouped steps run the Triton kernel).

    >>> route_prefill_kernel(128, sm=90).path
    'gluon'
    >>> route_prefill_kernel(8, sm=90).reason
    '8 heads < 32: the per-query Triton kernel is faster there (measured)'
    >>> route_prefill_kernel(128, sm=100).path
    'triton'
    >>> route_prefill_kernel(16, sm=90, group_size=4, gluon_grouped_max_heads=32).reason
    'SM90, 16 heads, G = 4: grouped Gluon warpgroup-MMA kernel (64-row tile)'
    >>> route_prefill_kernel(16, sm=90, group_size=8, gluon_grouped_max_heads=32).path
    'triton'
    """
    h = check_int("num_heads", num_heads, minimum=1)
    check_int("gluon_min_heads", gluon_min_heads, minimum=1)
    g = check_int("group_size", group_size, minimum=1)
    check_int("gluon_grouped_max_heads", gluon_grouped_max_heads, minimum=0)
    sm_v = _sm(sm)
    dev = _device_type(device_type)
    if dev != "cuda":
        return Route("reference", g, f"no GPU (device type {dev!r}): torch reference")
    if gluon_missing is not None:
        return Route("triton", g, f"{gluon_missing}: Triton kernel")
    if sm_v is None or sm_v // 10 != 9:
        return Route("triton", g, f"SM{sm_v} is not SM90 (the Gluon kernel uses Hopper wgmma): Triton kernel")
    if g > 1:
        if g * h > TILE_ROWS:
            why = f"{h} heads x G = {g} exceed the Gluon kernel's {TILE_ROWS}-row tile: Triton grouped kernel"
            return Route("triton", g, why)
        if gluon_grouped_max_heads == 0:
            return Route("triton", g, "grouped Gluon kernel not routed (no measured crossover): Triton grouped kernel")
        if h > gluon_grouped_max_heads:
            why = f"{h} heads > {gluon_grouped_max_heads}: grouped Gluon does not pay there (measured)"
            return Route("triton", g, why)
        return Route("gluon", g, f"SM90, {h} heads, G = {g}: grouped Gluon warpgroup-MMA kernel ({TILE_ROWS}-row tile)")
    if h < gluon_min_heads:
        why = f"{h} heads < {gluon_min_heads}: the per-query Triton kernel is faster there (measured)"
        return Route("triton", 1, why)
    return Route("gluon", 1, f"SM90, {h} heads: Gluon warpgroup-MMA kernel")


def route_sparse_decode_kernel(
    num_heads: int,
    *,
    num_tokens: int | None = None,
    device_type: str | torch.device = "cuda",
    sm: int | tuple[int, int] | None = None,
    gluon_missing: str | None = None,
    gluon_min_heads: int = GLUON_DECODE_MIN_HEADS,
    gluon_min_programs: int = GLUON_DECODE_MIN_PROGRAMS,
    small_missing: str | None = "not asked",
    small_max_heads: int = SMALL_DECODE_MAX_HEADS,
    small_max_tokens: int = SMALL_DECODE_MAX_TOKENS,
) -> Route:
    """Which kernel runs a sparse-MLA decode call: ``gluon_small``, ``gluon``, ``triton`` or ``reference``.

    Args:
        num_heads: query heads of the call (all heads under DCP, ``H / TP`` under head-TP).
        num_tokens: query tokens of the call (requests x draft length); None = large enough.
        device_type: ``"cuda"``, ``"cpu"``, ... (or a ``torch.device``).
        sm: compute capability, ``90`` or ``(9, 0)``; ``None`` = unknown (no Gluon).
        gluon_missing: why the Gluon kernel cannot run these tensors (None = it can).
        gluon_min_heads: fewest heads at which the Gluon decode beats Triton (measured).
        gluon_min_programs: fewest ``tokens x ceil(heads / 64)`` at which it does (measured).
        small_missing: why the Gluon small-batch kernel cannot run these tensors (None = it can;
            the default keeps it out, for callers that do not ask).
        small_max_heads / small_max_tokens: the largest call it takes (measured crossovers).

    >>> route_sparse_decode_kernel(16, num_tokens=4, sm=90, small_missing=None).path
    'gluon_small'
    >>> route_sparse_decode_kernel(128, sm=90).reason
    'SM90, 128 heads >= 32: Gluon warp-specialised kernel (row slices merged by LSE)'
    >>> route_sparse_decode_kernel(16, sm=90).path
    'triton'
    >>> route_sparse_decode_kernel(128, num_tokens=1, sm=90).path
    'triton'
    >>> route_sparse_decode_kernel(128, device_type="cpu").path
    'reference'
    """
    h = check_int("num_heads", num_heads, minimum=1)
    t = None if num_tokens is None else check_int("num_tokens", num_tokens, minimum=0)
    check_int("gluon_min_heads", gluon_min_heads, minimum=1)
    check_int("gluon_min_programs", gluon_min_programs, minimum=0)
    sm_v = _sm(sm)
    dev = _device_type(device_type)
    if dev != "cuda":
        return Route("reference", 1, f"no GPU (device type {dev!r}): torch reference")
    if gluon_missing is not None:
        return Route("triton", 1, f"{gluon_missing}: Triton split-KV decode kernel")
    if sm_v is None or sm_v // 10 != 9:
        return Route("triton", 1, f"SM{sm_v} is not SM90 (the Gluon kernel uses Hopper wgmma): Triton split-KV decode")
    check_int("small_max_heads", small_max_heads, minimum=0)
    check_int("small_max_tokens", small_max_tokens, minimum=0)
    if small_missing is None and t is not None and 1 <= t <= small_max_tokens and h <= small_max_heads:
        why = (
            f"SM90, {h} heads <= {small_max_heads} and {t} tokens <= {small_max_tokens}: Gluon small-batch kernel "
            "(a warpgroup per 64 entries, rows gathered at once, heads as the wgmma N; faster than Triton there, "
            "measured)"
        )
        return Route("gluon_small", 1, why)
    if h < gluon_min_heads:
        why = f"{h} heads < {gluon_min_heads}: the Triton split-KV decode kernel is faster there (measured)"
        return Route("triton", 1, why)
    programs = None if t is None else t * -(-h // 64)
    if programs is not None and programs < gluon_min_programs:
        why = (
            f"{t} tokens x {-(-h // 64)} head blocks < {gluon_min_programs} Gluon programs: latency bound, "
            "the Triton split-KV decode kernel is as fast there (measured)"
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
    if num_splits <= 1:
        return Route("none", 1, "1 split: the kernel writes the result, no merge")
    n = num_tokens * num_heads
    if n <= COLUMN_MERGE_MAX_ROWS:
        return Route("columns", 1, f"column merge: {n} (token, head) rows <= {COLUMN_MERGE_MAX_ROWS}")
    return Route("rows", 1, f"row merge: {n} (token, head) rows > {COLUMN_MERGE_MAX_ROWS}")


def small_decode_tiles(num_tokens: int, topk: int, num_sms: int) -> tuple[int, int]:
    """``(BLOCK_N, splits)`` of the small-batch decode kernel: 64-entry splits (one warpgroup) while
    their programs fill at most :data:`~shardattn.plan.crossovers.SMALL_DECODE_64_MAX_SM_FRACTION`
    of ``num_sms`` and a row fits in :data:`SMALL_DECODE_MAX_SPLITS` of them, else 128 (two
    warpgroups). At top-k 2048 on 132 SMs: 32 splits of 64 at 1-2 tokens, 16 of 128 from 3.

    >>> small_decode_tiles(1, 2048, 132), small_decode_tiles(3, 2048, 132), small_decode_tiles(1, 100, 132)
    ((64, 32), (128, 16), (64, 2))
    """
    blocks = -(-topk // 64)
    fits = num_tokens * blocks <= num_sms * SMALL_DECODE_64_MAX_SM_FRACTION
    block_n = 64 if fits and blocks <= SMALL_DECODE_MAX_SPLITS else 128
    return block_n, -(-topk // block_n)


def small_decode_heads(num_tokens: int, splits: int, heads: int, num_sms: int) -> int:
    """Heads one small-batch split program takes: :data:`~shardattn.plan.crossovers.SMALL_DECODE_HEAD_GROUP`
    (8) while the programs that then read each split's rows twice, one per group of heads, still fit
    in one wave of ``num_sms``; else all ``heads`` (8 or fewer: all of them, on the 8-wide ``wgmma``).

    >>> small_decode_heads(2, 32, 16, 132), small_decode_heads(5, 16, 16, 132), small_decode_heads(1, 32, 8, 132)
    (8, 16, 8)
    """
    if heads <= SMALL_DECODE_HEAD_GROUP:
        return heads
    groups = -(-heads // SMALL_DECODE_HEAD_GROUP)
    return SMALL_DECODE_HEAD_GROUP if num_tokens * splits * groups <= num_sms else heads


def route_union_method(
    group_size: int, topk: int, num_kv_rows: int, *, rows_sorted: bool = False, shared_memory: bool = False
) -> str:
    """The union builder ``build_union(method="auto")`` runs.

    The bitmap builds count one bit per KV row (their cost follows the cache size), the sorting
    builds sort the entries. With ``shared_memory`` (the bitmap runs on the shared-memory Gluon
    kernel: sm_90, Gluon) it is ``"bitmap"`` while ``ceil(R / 32)`` stays within
    :data:`~shardattn.plan.crossovers.SMEM_SCAN_RATIO` times the group's entries ``G * K`` on
    unsorted rows, and within :data:`~shardattn.plan.crossovers.SMEM_SORTED_RATIO` times on sorted
    rows at ``G > 1``. Otherwise ``"fused"`` on sorted rows; on unsorted rows ``"bitmap"`` (the
    Triton kernel) within :data:`~shardattn.plan.crossovers.BITMAP_SCAN_RATIO`, else the builder of
    :data:`~shardattn.plan.crossovers.UNION_METHOD` (``G = 1``: the row sort). Caches of
    :data:`MAX_GROUPED_KV_ROWS` rows or more never take the bitmap.

    >>> route_union_method(4, 2048, 1 << 16), route_union_method(4, 2048, 1 << 22)
    ('bitmap', 'fused')
    >>> route_union_method(2, 2048, 1 << 16, rows_sorted=True), route_union_method(2, 2048, 1 << 16, shared_memory=True)
    ('fused', 'bitmap')
    """
    words = -(-num_kv_rows // 32)
    entries = group_size * max(topk, 1)
    fits = num_kv_rows <= MAX_GROUPED_KV_ROWS
    if rows_sorted:  # G = 1 keeps the fused build of sorted rows (no count at all)
        smem_ratio = SMEM_SORTED_RATIO if group_size > 1 else 0
    else:
        smem_ratio = SMEM_SCAN_RATIO
    if shared_memory and fits and words <= smem_ratio * entries:
        return "bitmap"
    if rows_sorted:
        return "fused"
    if fits and words <= BITMAP_SCAN_RATIO * entries:
        return "bitmap"
    return UNION_METHOD[group_size]
