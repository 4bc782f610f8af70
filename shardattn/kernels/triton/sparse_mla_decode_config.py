"""The launch configuration of the Triton split-KV sparse-MLA decode kernel (host-side, shape-only):
tiles, warps, the split count and the merge of the splits (:func:`sparse_mla_decode_config`), and
the dtype of the split partials (:func:`partials_dtype`). The kernel and its runner:
:mod:`shardattn.kernels.triton.sparse_mla_decode`.
"""

from __future__ import annotations

from typing import Any, TypedDict, cast

import torch

from shardattn._ints import next_pow2
from shardattn.plan.crossovers import ONE_WAVE_MAX_BLOCK_N, ONE_WAVE_MAX_ROWS, ONE_WAVE_MAX_SPLITS
from shardattn.plan.decode_routing import route_decode_merge
from shardattn.plan.routing import Route

__all__ = [
    "CONFIG_KEYS",
    "MERGES",
    "DecodeLaunchConfig",
    "decode_launch",
    "merge_reason",
    "partials_dtype",
    "sparse_mla_decode_config",
]

#: Keys a caller's ``config=`` may override (tuning).
CONFIG_KEYS = frozenset({"BLOCK_H", "BLOCK_N", "num_warps", "num_stages", "merge", "pdl", "partials"})
MERGES = ("rows", "columns")


class _DecodeLaunch(TypedDict):
    BLOCK_H: int  # heads of one program
    BLOCK_N: int  # rows of one loop step
    num_splits: int
    chunk: int  # rows of one split, a multiple of BLOCK_N
    num_warps: int
    num_stages: int
    merge: str  # "rows" / "columns" / "none" (one split)
    reason: str
    cost_model_splits: int  # the cost model's split count, before the one-wave choice


class DecodeLaunchConfig(_DecodeLaunch, total=False):
    """One launch of the Triton split-KV decode: :func:`sparse_mla_decode_config`'s keys, and
    ``pdl`` / ``partials`` where a caller's ``config=`` gives them (:data:`CONFIG_KEYS`)."""

    pdl: bool
    partials: str  # "auto" / "input" / "fp32": :func:`partials_dtype`


def _block_h(num_heads: int) -> int:
    """Heads of one program: 64 above 32 heads, else the next power of two (at least 16)."""
    return 64 if num_heads > 32 else max(16, next_pow2(num_heads))


def sparse_mla_decode_config(
    num_tokens: int,
    num_heads: int,
    topk: int,
    num_sms: int,
    num_splits: int | None = None,
    *,
    head_dim: int = 576,
    v_dim: int = 512,
    elem_bytes: int = 2,
    kv_fp8: bool = False,
) -> DecodeLaunchConfig:
    """Tile sizes, split count and rows per split for a launch (host-side, shape-only).

    Splitting a top-k row fills more SMs but writes and re-reads fp32 partials of
    ``H * v_dim`` per token and split: at 128 heads that is 0.5 MB against 2.4 MB of KV rows,
    so the split count minimises ``(kv bytes + splits * partial bytes) / busy fraction``, where
    the busy fraction is ``min(1, programs * splits / slots)``, ``slots`` = the programs that
    saturate memory bandwidth: one per SM for 64-head tiles, two for smaller ones (calibrated
    on an H200 with fixed split counts: docs/PERFORMANCE.md).

    One wave: where the cost model splits and there are at most
    :data:`~shardattn.plan.crossovers.ONE_WAVE_MAX_ROWS` (token, head) rows, the split count becomes
    the largest power of two whose launch fits in one wave (``tokens x head blocks x splits <=
    SMs``), up to :data:`~shardattn.plan.crossovers.ONE_WAVE_MAX_SPLITS` at <= 32 heads (then 32-row
    tiles), else up to the cost model's count; at <= 16 heads a split of 64 or 128 rows is one
    tile of 8 warps (one gather, no second loop step). The thresholds are measured crossovers
    (docs/PERFORMANCE.md). ``kv_fp8`` (``fp8_ds_mla`` rows): the same tiles and splits at 8 warps.

    Returns:
        ``{"BLOCK_H", "BLOCK_N", "num_splits", "chunk", "num_warps", "num_stages", "merge",
        "reason", "cost_model_splits"}`` (``merge``: the path of
        :func:`~shardattn.plan.decode_routing.route_decode_merge`, ``reason`` its reason after the split
        count; ``cost_model_splits``: the cost model's split count, before the one-wave choice).

    Example:
        >>> [sparse_mla_decode_config(t, 128, 2048, 132)["num_splits"] for t in (1, 8, 64)]
        [32, 8, 1]
        >>> sparse_mla_decode_config(8, 16, 2048, 132)["reason"]
        '16 splits (one wave); column merge: 128 (token, head) rows <= 128'
    """
    block_h = _block_h(num_heads)
    block_n = 64
    # fp8_ds_mla rows (kv_fp8): 8 warps at every tile; the dequantised latent beside the fp32
    # accumulators spills at 4 (ptxas, sm_90a, 32 heads: 1.2 KB a thread, none at 8). The split
    # count is the bf16 launch's.
    num_warps = 8 if block_h >= 64 or kv_fp8 else 4
    programs = max(1, num_tokens * -(-num_heads // block_h))
    n_blocks = max(1, -(-topk // block_n))
    one_wave = False
    if num_splits is None:
        kv_bytes = num_tokens * topk * head_dim * elem_bytes
        part_bytes = num_tokens * num_heads * (v_dim + 1) * 4 * 2
        slots = num_sms * (1 if block_h >= 64 else 2)

        def cost(s: int) -> float:
            return (kv_bytes + (s > 1) * s * part_bytes) / min(1.0, programs * s / slots)

        num_splits = min(range(1, min(n_blocks, 64) + 1), key=cost)
        cost_model = num_splits
        fit = min(num_sms // programs, ONE_WAVE_MAX_SPLITS if block_h <= 32 else num_splits)
        if num_splits > 1 and fit > 1 and num_tokens * num_heads <= ONE_WAVE_MAX_ROWS:
            num_splits, one_wave = 1 << (fit.bit_length() - 1), True
            per_split = -(-topk // num_splits)
            if per_split <= 32:
                block_n = 32
            elif block_h <= 16 and elem_bytes <= 2 and per_split <= ONE_WAVE_MAX_BLOCK_N:
                block_n = ONE_WAVE_MAX_BLOCK_N if per_split > 64 else 64  # the split in one gather
                num_warps = 8
    else:
        cost_model = num_splits
    chunk = -(-max(1, -(-topk // num_splits)) // block_n) * block_n
    splits = max(1, -(-max(topk, 1) // chunk))
    merge = route_decode_merge(num_tokens, num_heads, splits)
    return DecodeLaunchConfig(
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        num_splits=splits,
        chunk=chunk,
        num_warps=num_warps,
        num_stages=2,
        merge=merge.path,
        reason=merge_reason(merge, splits, one_wave=one_wave),
        cost_model_splits=cost_model,
    )


def decode_launch(
    num_tokens: int,
    num_heads: int,
    topk: int,
    num_sms: int,
    num_splits: int | None = None,
    config: dict[str, Any] | None = None,
    *,
    head_dim: int = 576,
    v_dim: int = 512,
    elem_bytes: int = 2,
    kv_fp8: bool = False,
) -> DecodeLaunchConfig:
    """The launch :func:`~shardattn.kernels.triton.sparse_mla_decode.run_split_decode` runs:
    :func:`sparse_mla_decode_config`'s, with a caller's ``config`` overrides of its keys
    (:data:`CONFIG_KEYS`: ``BLOCK_H``, ``BLOCK_N``, ``num_warps``, ``num_stages``, ``merge`` =
    ``"rows"`` / ``"columns"``, ``pdl`` = ``False`` for plain launches, ``partials`` = ``"fp32"`` /
    ``"input"`` / ``"auto"``: :func:`partials_dtype`) applied and the split count re-derived from
    the overridden ``BLOCK_N``. Host-side and shape-only, so a caller sizes the split partials
    (``num_splits``) before anything runs.

    Raises:
        ValueError / TypeError: an unknown ``config`` key or value.

    Example:
        >>> decode_launch(8, 16, 2048, 132, 4, {"BLOCK_N": 128})["chunk"]
        512
    """
    if config:
        unknown = set(config) - CONFIG_KEYS
        if unknown:
            raise ValueError(f"config keys must be among {sorted(CONFIG_KEYS)}; got {sorted(unknown)}")
        if config.get("merge", "rows") not in MERGES:
            raise ValueError(f"config['merge'] must be 'rows' or 'columns', got {config['merge']!r}")
        if not isinstance(config.get("pdl", False), bool):
            raise TypeError(f"config['pdl'] must be a bool, got {type(config['pdl']).__name__}")
        if config.get("partials", "auto") not in ("auto", "input", "fp32"):
            raise ValueError(f"config['partials'] must be 'auto', 'input' or 'fp32', got {config['partials']!r}")
    cfg = sparse_mla_decode_config(
        num_tokens, num_heads, topk, num_sms, num_splits, head_dim=head_dim, v_dim=v_dim, elem_bytes=elem_bytes,
        kv_fp8=kv_fp8,
    )  # fmt: skip
    if not config:
        return cfg
    want = num_splits if num_splits is not None else cfg["num_splits"]
    cfg = cast(DecodeLaunchConfig, {**cfg, **config})  # keys checked against CONFIG_KEYS above
    per_split = -(-max(topk, 1) // want)
    cfg["chunk"] = -(-per_split // cfg["BLOCK_N"]) * cfg["BLOCK_N"]
    cfg["num_splits"] = max(1, -(-max(topk, 1) // cfg["chunk"]))
    merge = route_decode_merge(num_tokens, num_heads, cfg["num_splits"])
    if "merge" not in config:
        cfg["merge"], cfg["reason"] = merge.path, merge_reason(merge, cfg["num_splits"])
    else:
        cfg["reason"] = f"{cfg['num_splits']} splits; {cfg['merge']} merge: config"
    return cfg


def partials_dtype(dtype: torch.dtype, merge: str, choice: str = "auto") -> torch.dtype:
    """The dtype of the split partials' outputs for inputs of ``dtype`` merged by ``merge``:
    ``choice`` ``"fp32"``, ``"input"`` (``dtype`` where it is a 2-byte float) or ``"auto"``: the
    input dtype under the row merge (a few wide programs read every partial: half the bytes
    measured 7 % faster at 128 heads x 8 tokens), fp32 under the column merge (one
    latency each; no gain measured; docs/PERFORMANCE.md).

    Example:
        >>> partials_dtype(torch.bfloat16, "rows"), partials_dtype(torch.bfloat16, "columns")
        (torch.bfloat16, torch.float32)
    """
    half = dtype in (torch.bfloat16, torch.float16) and (choice == "input" or (choice == "auto" and merge == "rows"))
    return dtype if half else torch.float32


def merge_reason(merge: Route, num_splits: int, *, one_wave: bool = False) -> str:
    """``merge``'s reason after the split count (``one_wave``: the one-wave choice)."""
    if merge.path == "none":
        return merge.reason
    return f"{num_splits} splits{' (one wave)' if one_wave else ''}; {merge.reason}"
