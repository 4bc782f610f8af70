"""Which kernel path a prefill step takes, and why: the :class:`Route` every route returns.

Prefill (sparse MLA): the grouped path packs ``G`` consecutive queries of ``heads`` heads into
one 64-row tile and gathers the union of their top-k rows once; each union entry packs the KV
row in 24 bits and one membership bit per query in the high 8 bits (so ``G <= 8`` and rows
``< 2^24 - 1``). Checks, in order (the first that applies decides):

1. no GPU (device type other than ``cuda``)            -> ``reference``
2. KV cache with ``2^24 - 1`` rows or more              -> ``per-query`` (rows do not fit 24 bits)
3. fewer than ``min_tokens`` new tokens in the step     -> ``per-query``
4. an LSE is needed and the grouped backend has none    -> ``per-query``
5. ``gluon=True`` and at most ``GLUON_GROUPED_MAX_HEADS`` heads (8, 16 or 32)
                                                        -> ``grouped`` Gluon, ``G = 64 / heads``
6. more than ``grouped_max_heads`` heads                -> ``per-query``
7. otherwise                                            -> ``grouped`` with ``G = 64 / heads``

Why 64-row tiles and at most 8 heads on the Triton kernel (``G = 128 / heads`` fits a 128-row
tile of a hand-written kernel): the Triton kernel holds 64 rows per program (128 rows spill
registers), and grouping beats its per-query path only up to :data:`GROUPED_MAX_HEADS` heads (the
union build plus the membership mask cost more than the shared gathers save above). A backend
with cheaper grouping passes its own ``grouped_max_heads`` / ``tile_rows``.

Every threshold is a measured crossover of :mod:`shardattn.plan.crossovers` (the runs behind
them: ``docs/PERFORMANCE.md``); the functions here turn them into decisions with reasons, and
``shardattn.ops.dispatch`` asks them with the tensors of a call.

Decode routes live in :mod:`shardattn.plan.decode_routing`, the union builder's in
:mod:`shardattn.plan.union_routing`; both return this module's :class:`Route` and read their
arguments through :func:`device_type_of` / :func:`sm_of`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardattn._checks import check_bool, check_int
from shardattn._ints import next_pow2
from shardattn.plan.crossovers import (
    DEFAULT_MIN_TOKENS,
    GLUON_GROUPED_MAX_HEADS,
    GLUON_MIN_HEADS,
    GROUPED_MAX_HEADS,
    TILE_ROWS,
)

__all__ = [
    "GLUON_GROUPED_MAX_HEADS",
    "GLUON_MIN_HEADS",
    "GROUPED_MAX_HEADS",
    "GROUP_SIZES",
    "MAX_GROUPED_KV_ROWS",
    "PREFILL_KERNELS",
    "PREFILL_PATHS",
    "TILE_ROWS",
    "Route",
    "device_type_of",
    "gluon_grouped_group_size",
    "grouped_group_size",
    "prefill_group_size",
    "route_prefill",
    "route_prefill_kernel",
    "sm_of",
    "tile_group_size",
]

GROUP_SIZES = (2, 4, 8)
"""Group sizes the membership byte allows (one bit per query, at most 8)."""
MAX_GROUPED_KV_ROWS = 2**24 - 1
"""The grouped path (and the bitmap union build) needs every KV row index ``< 2^24 - 1`` (24-bit
row field, all-ones reserved)."""
PREFILL_PATHS = ("grouped", "per-query", "reference")
PREFILL_KERNELS = ("gluon", "triton", "reference")


@dataclass(frozen=True)
class Route:
    """A routing decision: ``path``, the query group size (1 unless grouped) and a readable reason."""

    path: str
    group_size: int
    reason: str


def device_type_of(device_type: object) -> str:
    """The device type (``"cuda"``, ``"cpu"``, ...) of a ``str`` or ``torch.device`` argument of a route."""
    if isinstance(device_type, torch.device):
        return device_type.type
    if isinstance(device_type, str):
        try:
            return torch.device(device_type).type
        except RuntimeError:  # torch's message names no argument
            raise ValueError(
                f"device_type must be a device type such as 'cuda' or 'cpu', got {device_type!r}"
            ) from None
    raise TypeError(f"device_type must be a str or torch.device, got {type(device_type).__name__}")


def sm_of(sm: object) -> int | None:
    """A compute capability argument of a route (``90`` or ``(9, 0)``) as one int; ``None`` stays ``None``."""
    if sm is None:
        return None
    if isinstance(sm, tuple):
        if len(sm) != 2:
            raise ValueError(f"sm must be an int like 90 or a (major, minor) tuple, got {sm!r}")
        major = check_int("sm[0]", sm[0], minimum=0)
        minor = check_int("sm[1]", sm[1], minimum=0)
        return major * 10 + minor
    return check_int("sm", sm, minimum=0)


def tile_group_size(num_heads: int, *, tile_rows: int = TILE_ROWS) -> int:
    """Queries that fill a ``tile_rows`` tile: ``tile_rows // next_pow2(heads)`` clipped to ``[1, 8]``.

    >>> [tile_group_size(h) for h in (4, 8, 16, 32, 64, 128)]
    [8, 8, 4, 2, 1, 1]
    >>> tile_group_size(16, tile_rows=128)
    8
    """
    num_heads = check_int("num_heads", num_heads, minimum=1)
    padded = next_pow2(num_heads)
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
    check_bool("need_lse", need_lse)
    check_bool("grouped_supports_lse", grouped_supports_lse)
    check_bool("gluon", gluon)
    dev = device_type_of(device_type)
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
    sm_v = sm_of(sm)
    dev = device_type_of(device_type)
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
