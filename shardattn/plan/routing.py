"""Which kernel path a step takes, and why.

Prefill (sparse MLA): the grouped path packs ``G = 128 / heads`` consecutive queries into one
128-row tile and gathers the union of their top-k rows once; each union entry packs the KV row
in 24 bits and one membership bit per query in the high 8 bits (so ``G <= 8`` and rows
``< 2^24 - 1``). Checks, in order (the first that applies decides):

1. no GPU (device type other than ``cuda``)            -> ``reference``
2. KV cache with ``2^24 - 1`` rows or more              -> ``per-query`` (rows do not fit 24 bits)
3. fewer than ``min_tokens`` new tokens in the step     -> ``per-query``
4. an LSE is needed and the grouped backend has none    -> ``per-query``
5. ``128 / heads`` is not one of 2, 4, 8                -> ``per-query``
6. otherwise                                            -> ``grouped`` with ``G = 128 / heads``

Decode: GQA picks FlashInfer XQA when it is installed, the GPU is SM90 / SM100 / SM120, the head
dim passes :func:`xqa_head_dim_supported` (the same function the CUDA-graph policy uses), no
LSE is needed (XQA returns none, so never under DCP) and, on SM100, drafts are causal;
otherwise the Triton kernel. Sparse MLA decode runs the Triton sparse kernel (it returns the
LSE, so it serves DCP). Without a GPU both take the torch ``reference``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardattn._checks import check_int
from shardattn.plan.cudagraph import xqa_head_dim_supported
from shardattn.plan.spec import ModelSpec
from shardattn.plan.zigzag import DEFAULT_MIN_TOKENS

__all__ = [
    "DECODE_PATHS",
    "GROUP_SIZES",
    "MAX_GROUPED_KV_ROWS",
    "PREFILL_PATHS",
    "TILE_ROWS",
    "XQA_SM",
    "Route",
    "grouped_group_size",
    "route_decode",
    "route_prefill",
]

TILE_ROWS = 128
"""Rows of one grouped tile: ``G`` queries times ``heads`` heads."""
GROUP_SIZES = (2, 4, 8)
"""Group sizes the membership byte allows (one bit per query, at most 8)."""
MAX_GROUPED_KV_ROWS = 2**24 - 1
"""The grouped path needs every KV row index ``< 2^24 - 1`` (24-bit row field, all-ones reserved)."""
XQA_SM = (90, 100, 120)
PREFILL_PATHS = ("grouped", "per-query", "reference")
DECODE_PATHS = ("triton", "flashinfer-xqa", "reference")


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


def grouped_group_size(num_heads: int) -> int | None:
    """``128 / num_heads`` when it is one of 2, 4, 8, else ``None``.

    >>> [grouped_group_size(h) for h in (16, 32, 64, 128, 24)]
    [8, 4, 2, None, None]
    """
    num_heads = check_int("num_heads", num_heads, minimum=1)
    if TILE_ROWS % num_heads:
        return None
    g = TILE_ROWS // num_heads
    return g if g in GROUP_SIZES else None


def route_prefill(
    num_heads: int,
    *,
    num_tokens: int,
    kv_rows: int,
    device_type: str | torch.device = "cuda",
    min_tokens: int = DEFAULT_MIN_TOKENS,
    need_lse: bool = False,
    grouped_supports_lse: bool = True,
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

    >>> route_prefill(64, num_tokens=8192, kv_rows=1 << 20)
    Route(path='grouped', group_size=2, reason='64 heads: 2 queries per 128-row tile')
    >>> route_prefill(64, num_tokens=8192, kv_rows=1 << 24).path
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
    g = grouped_group_size(h)
    if g is None:
        return Route("per-query", 1, f"{h} heads: 128 / heads is not one of 2, 4, 8")
    return Route("grouped", g, f"{h} heads: {g} queries per 128-row tile")


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
        return Route("triton", 1, "sparse MLA decode: Triton sparse kernel (returns the LSE)")
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
