"""Sparse-MLA decode: few query tokens, many heads, each token with its own top-k rows.

Same contract as :func:`~shardattn.kernels.sparse_mla.sparse_mla_attention` (and tested against
its reference :func:`~shardattn.kernels.sparse_mla.sparse_mla_reference`)::

    out[t, h] = softmax(scale * q[t, h] . kv[rows[t]]^T) @ kv[rows[t], :v_dim]

Decode has one query token per request (or ``q_len`` tokens under speculative decoding: each
draft token has its own top-k row, so it is simply another token). It is memory bound: the
work is reading ``K`` rows of 576 dims per token. The Triton kernel ``_sparse_mla_decode_kernel``
runs one program per (head block, token, split of the top-k row); head blocks of a token are the
fastest grid axis so they read the same rows while those are in L2. Splits write partial outputs
(fp32; in q's 2-byte dtype under the row merge, which reads them all with few programs: faster
there and not under the column merge, docs/DECISIONS.md, D26) and fp32 LSEs; one split writes the
result directly.

Merging the splits (:func:`merge_kind`, chosen by measured numbers, docs/DECISIONS.md, D19-D20): at
most :data:`COLUMN_MERGE_MAX_ROWS` (token, head) rows, a second launch with one program per
(token, head, 128 output columns) that loads every split's LSE and slice at once
(:func:`~shardattn.kernels.lse_merge.launch_lse_merge_columns`: one memory latency whatever the
split count, where the row merge pays one per split); above,
:func:`~shardattn.kernels.lse_merge.launch_lse_merge` (fewer, wider programs). The opt-in
``config={"merge": "spread"}`` merges in the same launch spread over all programs: each split
arrives at a per-(token, head block) barrier and, once all arrived, merges ``1/S`` of the block's
(head, column) cells with the column merge's math (:mod:`~shardattn.kernels.sparse_mla_decode_triton`);
it needs the launch in one wave (:func:`spread_fits`) and measured no faster than the column
merge on the same split kernel (:func:`merge_kind`), so it is not routed. Small batches take the one-wave split count
(:func:`sparse_mla_decode_config`). The torch reference is
:func:`~shardattn.kernels.sparse_mla.sparse_mla_reference`.

On sm_90 and newer (:func:`~shardattn.kernels.registry.pdl_supported`) the split kernel and its
merge are programmatic dependent launches: the split kernel waits for the grid before it (a
union build, a caller's indexer) before reading anything and lets the merge launch once its
partials are stored; the merge waits for the split grid before reading them. What it saves is
launch latency (docs/DECISIONS.md, D24); ``config={"pdl": False}`` launches plainly.

Backends: on an sm_90 GPU with Triton's Gluon, DSA shapes and bf16/fp16, calls of at most
:data:`~shardattn.plan.routing.SMALL_DECODE_MAX_HEADS` heads and
:data:`~shardattn.plan.routing.SMALL_DECODE_MAX_TOKENS` tokens run the small-batch Gluon kernel
(:mod:`~shardattn.kernels.sparse_mla_decode_gluon_small`: one warpgroup per 64 entries of a split,
its rows gathered at once, the heads as the ``wgmma`` N; the same column merge); at
:data:`~shardattn.plan.routing.GLUON_DECODE_MIN_HEADS` heads or more (DSA shapes, bf16/fp16) and
batches of at least :data:`~shardattn.plan.routing.GLUON_DECODE_MIN_PROGRAMS` whole-row programs,
the call runs the warp-specialised Gluon kernel instead
(:mod:`~shardattn.kernels.sparse_mla_decode_gluon`: one program per token x 64 heads over the
whole row, or over row slices merged by LSE when that leaves SMs idle); same contract, same
outputs. :func:`~shardattn.kernels.registry.sparse_decode_kernel` says which runs and why;
``backend=`` forces one.

A row listed twice by one token is one key (the library-wide rule): by default the rows are
first sorted and de-duplicated by :func:`~shardattn.kernels.union.build_union` (``G = 1``: one
bitmap launch, in shared memory on sm_90, while the cache's words are within its ratio, else a
row sort); ``rows_unique=True`` skips that when the caller guarantees unique rows (an
indexer's top-k is), and duplicates would then count twice.

LSE: fp32 natural log, includes the sink term; a row with no valid key gives ``(0, -inf)``
(``(0, sink)`` with sinks), so a DCP rank with an empty local shard contributes the merge
identity. Capture-safe: no host sync; the grid depends on shapes and ``num_splits`` only.
"""

from __future__ import annotations

import functools

import torch

from shardattn._checks import check_int, check_tensor
from shardattn.kernels.lse_merge import (
    launch_lse_merge,
    launch_lse_merge_columns,
    split_partials,
    split_partials_numel,
)
from shardattn.kernels.registry import pdl_supported, sparse_decode_kernel, use_triton
from shardattn.kernels.sparse_mla import check_sparse_mla_inputs, empty_kv_result, join_q, sparse_mla_reference
from shardattn.kernels.union import build_union

try:  # Triton is optional: without it every path runs the torch reference.
    import triton

    from shardattn.kernels.sparse_mla_decode_triton import (
        SPREAD_ARRIVE,
        SPREAD_MERGE,
        SPREAD_OFF,
        SPREAD_ONE_LAUNCH,
        launch_split_kernel,
    )
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None

__all__ = [
    "COLUMN_MERGE_MAX_ROWS",
    "ONE_WAVE_MAX_ROWS",
    "ONE_WAVE_MAX_SPLITS",
    "merge_kind",
    "merge_reason",
    "partials_dtype",
    "sparse_mla_decode",
    "sparse_mla_decode_config",
    "spread_fits",
]

#: At most this many (token, head) rows merge with the column merge (:func:`merge_kind`).
COLUMN_MERGE_MAX_ROWS = 128
#: At most this many (token, head) rows take the one-wave split count
#: (:func:`sparse_mla_decode_config`) ...
ONE_WAVE_MAX_ROWS = 128
#: ... of at most this many splits (64 of 32 rows at top-k 2048) at <= 32 heads; at <= 16 heads
#: (bf16 / fp16) a split of up to this many rows is gathered in one step (one tile, 8 warps).
ONE_WAVE_MAX_SPLITS = 64
ONE_WAVE_MAX_BLOCK_N = 128
#: Keys a caller's ``config=`` may override (tuning).
CONFIG_KEYS = frozenset({"BLOCK_H", "BLOCK_N", "num_warps", "num_stages", "merge", "pdl", "partials"})
MERGES = ("rows", "columns", "spread")
#: ``backend=`` values: routed, or one kernel forced.
BACKENDS = (None, "triton", "gluon", "gluon_small")


def _block_h(num_heads: int) -> int:
    """Heads of one program: 64 above 32 heads, else the next power of two (at least 16)."""
    return 64 if num_heads > 32 else max(16, 1 << max(0, (num_heads - 1).bit_length()))


def spread_fits(num_tokens: int, num_heads: int, num_splits: int, num_sms: int, block_h: int | None = None) -> bool:
    """Whether a launch fits in one wave: ``tokens x head blocks x splits`` programs at most
    ``num_sms`` (one resident program per SM is certain). The spread merge needs it (no program
    may wait at its spin barrier for a program of its token that is not resident)."""
    block_h = block_h or _block_h(num_heads)
    return num_tokens * -(-num_heads // block_h) * num_splits <= num_sms


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


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
) -> dict[str, int | str]:
    """Tile sizes, split count and rows per split for a launch (host-side, shape-only).

    Splitting a top-k row fills more SMs but writes and re-reads fp32 partials of
    ``H * v_dim`` per token and split: at 128 heads that is 0.5 MB against 2.4 MB of KV rows,
    so the split count minimises ``(kv bytes + splits * partial bytes) / busy fraction``, where
    the busy fraction is ``min(1, programs * splits / slots)``, ``slots`` = the programs that
    saturate memory bandwidth: one per SM for 64-head tiles, two for smaller ones (calibrated
    on an H200 with fixed split counts).

    One wave: where the cost model splits and there are at most :data:`ONE_WAVE_MAX_ROWS`
    (token, head) rows, the split count becomes the largest power of two whose launch fits in one
    wave (:func:`spread_fits`), up to :data:`ONE_WAVE_MAX_SPLITS` at <= 32 heads (then 32-row
    tiles), else up to the cost model's count: faster with the column merge at 16 heads than the
    cost model's count (docs/DECISIONS.md, D23). It is also the launch the opt-in spread merge
    needs. At <= 16 heads a split of 64 or 128 rows is one tile of 8 warps (one gather, no second
    loop step: docs/DECISIONS.md, D25).

    Returns:
        ``{"BLOCK_H", "BLOCK_N", "num_splits", "chunk", "num_warps", "num_stages", "merge",
        "reason", "cost_model_splits"}`` (``merge`` and ``reason``: :func:`merge_kind`;
        ``cost_model_splits``: the cost model's split count, before the one-wave choice).

    Example:
        >>> [sparse_mla_decode_config(t, 128, 2048, 132)["num_splits"] for t in (1, 8, 64)]
        [32, 8, 1]
        >>> sparse_mla_decode_config(8, 16, 2048, 132)["reason"]
        '16 splits (one wave); column merge: 128 (token, head) rows <= 128'
    """
    block_h = _block_h(num_heads)
    block_n = 64
    num_warps = 8 if block_h >= 64 else 4
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
    return {
        "BLOCK_H": block_h,
        "BLOCK_N": block_n,
        "num_splits": splits,
        "chunk": chunk,
        "num_warps": num_warps,
        "num_stages": 2,
        "merge": merge_kind(num_tokens, num_heads, splits),
        "reason": merge_reason(num_tokens, num_heads, splits, one_wave=one_wave),
        "cost_model_splits": cost_model,
    }


def _small_fits(
    workspace: torch.Tensor | None, t: int, h: int, topk: int, v_dim: int, num_sms: int, backend: str | None
) -> bool:
    """Whether the small-batch kernel's partials fit a caller's ``workspace`` (always without
    one); a routed call with too small a workspace runs Triton, a forced one raises."""
    from shardattn.kernels.sparse_mla_decode_gluon_small import small_decode_tiles

    splits = small_decode_tiles(t, topk, num_sms)[1]
    need = split_partials_numel(splits, t, h, v_dim)
    if workspace is None or workspace.numel() >= need:
        return True
    if backend == "gluon_small":
        raise ValueError(f"workspace must hold >= {need} fp32 elements for the small-batch kernel's {splits} splits")
    return False


def merge_kind(num_tokens: int, num_heads: int, num_splits: int) -> str:
    """Which kernel merges the splits: ``"none"`` (one split), ``"columns"``
    (:func:`~shardattn.kernels.lse_merge.launch_lse_merge_columns`, at most
    :data:`COLUMN_MERGE_MAX_ROWS` (token, head) rows) or ``"rows"``
    (:func:`~shardattn.kernels.lse_merge.launch_lse_merge`).

    Measured on an H200 (docs/DECISIONS.md, D19): columns win at 16 heads x 1-8 tokens and 128
    heads x 1 token; rows win at 128 heads x 8 tokens (4,096 column programs of 8 splits each cost
    more than 128 row programs).

    The one-launch spread merge (``config={"merge": "spread"}``) is never routed: on the same
    split kernel it measured slower than the column merge at 1-4 tokens and level at 8
    (docs/DECISIONS.md, D20), and its spin barrier would hang if another kernel kept SMs busy
    while a token's splits waited.
    """
    if num_splits <= 1:
        return "none"
    return "columns" if num_tokens * num_heads <= COLUMN_MERGE_MAX_ROWS else "rows"


def partials_dtype(dtype: torch.dtype, merge: str, choice: str = "auto") -> torch.dtype:
    """The dtype of the split partials' outputs for inputs of ``dtype`` merged by ``merge``:
    ``choice`` ``"fp32"``, ``"input"`` (``dtype`` where it is a 2-byte float) or ``"auto"``: the
    input dtype under the row merge (a few wide programs read every partial: half the bytes is
    faster there), fp32 under the column and spread merges (one latency each; no gain measured;
    docs/DECISIONS.md, D26).

    Example:
        >>> partials_dtype(torch.bfloat16, "rows"), partials_dtype(torch.bfloat16, "columns")
        (torch.bfloat16, torch.float32)
    """
    half = dtype in (torch.bfloat16, torch.float16) and (choice == "input" or (choice == "auto" and merge == "rows"))
    return dtype if half else torch.float32


def merge_reason(num_tokens: int, num_heads: int, num_splits: int, *, one_wave: bool = False) -> str:
    """Why :func:`merge_kind` chose its kernel, in words (for logs and routes); ``one_wave``: the
    split count is :func:`sparse_mla_decode_config`'s one-wave choice."""
    n = num_tokens * num_heads
    kind = merge_kind(num_tokens, num_heads, num_splits)
    if kind == "none":
        return "1 split: the kernel writes the result, no merge"
    word, sign = ("column", "<=") if kind == "columns" else ("row", ">")
    splits = f"{num_splits} splits (one wave)" if one_wave else f"{num_splits} splits"
    return f"{splits}; {word} merge: {n} (token, head) rows {sign} {COLUMN_MERGE_MAX_ROWS}"


def sparse_mla_decode(
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    kv: torch.Tensor,
    rows: torch.Tensor,
    *,
    scale: float,
    v_dim: int = 512,
    topk_length: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    num_splits: int | None = None,
    rows_unique: bool = False,
    config: dict[str, int | str] | None = None,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse-MLA decode attention with split-KV and a merge; returns the LSE (DCP needs it).

    Args:
        q: ``[T, H, D]`` fp16/bf16/fp32 (``D = 576``: 512 latent + 64 rope), or
            ``(q_latent, q_rope)``. T = decode tokens (requests x draft length).
        kv: ``[R, D]`` KV rows in q's dtype; the value is ``kv[:, :v_dim]``.
        rows: ``[T, K]`` int32 global rows; ``-1`` / out of range = invalid, anywhere.
        scale: softmax scale. v_dim: value width (512).
        topk_length: ``[T]`` int32 per-row count of leading entries to use, optional.
        sinks: ``[H]`` fp32 sink logits, optional.
        num_splits: splits of each top-k row (default: about two waves of programs).
        rows_unique: the caller guarantees no row appears twice in a token's list (skips the
            de-duplication sort on the Triton path; duplicates would then count twice).
        config: launch-configuration overrides (keys of :func:`sparse_mla_decode_config`:
            ``BLOCK_H``, ``BLOCK_N``, ``num_warps``, ``num_stages`` and ``merge`` = ``"rows"`` /
            ``"columns"`` / ``"spread"``, ``pdl`` = ``False`` to launch the split kernel and the
            merge without programmatic dependent launch, ``partials`` = ``"fp32"`` / ``"input"``
            (q's 2-byte dtype) for the split partials' outputs (default ``"auto"``: q's dtype
            under the row merge, which reads them all with few programs, fp32 otherwise);
            for tuning and baselines; a forced ``"spread"`` whose launch does not fit in one
            wave is a ``ValueError``).
        out, lse_out: optional destinations ``[T, H, v_dim]`` (q's dtype) and ``[T, H]`` fp32.
        workspace: optional flat fp32 buffer of ``num_splits * T * H * (v_dim + 1)`` elements for
            the split partials; with ``out``, ``lse_out`` and it, nothing is allocated.
        counters: int32 zeros for the spread merge, reused across calls and graph replays: at
            least ``2 * T * ceil(H / BLOCK_H)`` (arrival counts, left 0, in the first half;
            generations, which change every call, in the second). Default: allocated
            (zero-filled, one fill kernel more).
        backend: ``None`` (routed: :func:`~shardattn.kernels.registry.sparse_decode_kernel`),
            ``"triton"``, ``"gluon"`` or ``"gluon_small"`` (forced, also outside the routing's
            crossovers; a ``ValueError`` where the kernel cannot run these tensors). ``config``
            and ``counters`` are Triton options: with them the routed call runs Triton. On the
            Gluon path ``num_splits`` is the number of row slices and a ``workspace`` too small
            for the chosen slices makes it use fewer. The small-batch Gluon kernel picks its own
            splits (:func:`~shardattn.kernels.sparse_mla_decode_gluon_small.small_decode_tiles`):
            a routed call with ``num_splits``, or with a ``workspace`` too small for those
            splits, runs Triton.
    Returns:
        ``(out [T, H, v_dim] in q's dtype, lse [T, H] fp32 natural log)``; a row with no valid
        key is ``(0, -inf)`` (``(0, sink)`` with sinks). CPU tensors run the reference.

    Example:
        >>> q, kv = torch.randn(2, 4, 24), torch.randn(9, 24)
        >>> rows = torch.tensor([[0, 8, -1], [-1, -1, -1]], dtype=torch.int32)
        >>> out, lse = sparse_mla_decode(q, kv, rows, scale=0.2, v_dim=16)
        >>> tuple(out.shape), bool(lse[1].isneginf().all())
        ((2, 4, 16), True)
    """
    q = join_q(q)
    check_sparse_mla_inputs(q, kv, rows, v_dim=v_dim, topk_length=topk_length, sinks=sinks, scale=scale)
    t, h, d = q.shape
    if num_splits is not None:
        check_int("num_splits", num_splits, minimum=1)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be None, 'triton', 'gluon' or 'gluon_small', got {backend!r}")
    if config:
        unknown = set(config) - CONFIG_KEYS
        if unknown:
            raise ValueError(f"config keys must be among {sorted(CONFIG_KEYS)}; got {sorted(unknown)}")
        if config.get("merge", "rows") not in MERGES:
            raise ValueError(f"config['merge'] must be 'rows', 'columns' or 'spread', got {config['merge']!r}")
        if not isinstance(config.get("pdl", False), bool):
            raise TypeError(f"config['pdl'] must be a bool, got {type(config['pdl']).__name__}")
        if config.get("partials", "auto") not in ("auto", "input", "fp32"):
            raise ValueError(f"config['partials'] must be 'auto', 'input' or 'fp32', got {config['partials']!r}")
    triton_only = config is not None or counters is not None
    if backend in ("gluon", "gluon_small") and triton_only:
        raise ValueError(f"backend={backend!r} takes no config or counters (Triton options)")
    if backend == "gluon_small" and num_splits is not None:
        raise ValueError("backend='gluon_small' chooses its own splits (small_decode_tiles): pass num_splits=None")
    if out is not None:
        check_tensor("out", out, dtypes=(q.dtype,), shape=(t, h, v_dim), device=q.device)
    if lse_out is not None:
        check_tensor("lse_out", lse_out, dtypes=(torch.float32,), shape=(t, h), device=q.device)
    kernel = "reference"
    if kv.shape[0] > 0 and triton is not None and use_triton(q):
        kernel, why = sparse_decode_kernel(q, kv, v_dim, rows) if h > 0 else ("triton", "no heads")
        if backend in ("gluon", "gluon_small"):  # forced: wherever it runs, whatever the crossover says
            from shardattn.kernels.sparse_mla_decode_gluon_small import small_decode_supports
            from shardattn.kernels.sparse_mla_gluon import gluon_supports

            why = gluon_supports(q, kv, v_dim) if backend == "gluon" else small_decode_supports(q, kv, rows, v_dim)
            if why is not None:
                raise ValueError(f"backend={backend!r} cannot run here: {why}")
            kernel = backend
        if backend == "triton" or (kernel in ("gluon", "gluon_small") and triton_only):
            kernel = "triton"
        if kernel == "gluon_small" and backend is None and num_splits is not None:
            kernel = "triton"  # a caller's split count is the Triton kernel's
    elif backend in ("gluon", "gluon_small"):
        why = "kv has no rows" if kv.shape[0] == 0 else "no CUDA tensors or no Triton"
        raise ValueError(f"backend={backend!r} cannot run here: {why}")
    if kernel == "reference":
        if kv.shape[0] == 0:  # every row index is out of range: every row is empty, on every backend
            ref_out, ref_lse = empty_kv_result(q, v_dim, sinks)
        else:
            ref_out, ref_lse = sparse_mla_reference(
                q, kv, rows, scale=scale, v_dim=v_dim, topk_length=topk_length, sinks=sinks
            )
        out = ref_out if out is None else out.copy_(ref_out)
        lse_out = ref_lse if lse_out is None else lse_out.copy_(ref_lse)
        return out, lse_out
    out = torch.empty(t, h, v_dim, dtype=q.dtype, device=q.device) if out is None else out
    lse_out = torch.empty(t, h, dtype=torch.float32, device=q.device) if lse_out is None else lse_out
    if t == 0 or h == 0:
        return out, lse_out
    num_sms = _sm_count(q.device.index or 0) if q.is_cuda else 132
    if kernel == "gluon":
        from shardattn.kernels.sparse_mla_decode_gluon import sparse_mla_decode_gluon

        return sparse_mla_decode_gluon(
            q, kv, rows, scale=float(scale), v_dim=v_dim, out=out, lse_out=lse_out, num_sms=num_sms,
            topk_length=topk_length, sinks=sinks, num_splits=num_splits, rows_unique=rows_unique, workspace=workspace,
        )  # fmt: skip
    topk = rows.shape[1]
    if not rows_unique and topk > 1:
        rows, topk_length = build_union(rows, group_size=1, num_kv_rows=kv.shape[0], topk_length=topk_length)
    if kernel == "gluon_small" and _small_fits(workspace, t, h, rows.shape[1], v_dim, num_sms, backend):
        from shardattn.kernels.sparse_mla_decode_gluon_small import sparse_mla_decode_small

        return sparse_mla_decode_small(
            q, kv, rows, scale=float(scale), out=out, lse_out=lse_out, topk_length=topk_length, sinks=sinks,
            workspace=workspace, num_sms=num_sms, pdl=pdl_supported(q.device),
        )  # fmt: skip
    cfg = sparse_mla_decode_config(
        t, h, topk, num_sms, num_splits, head_dim=d, v_dim=v_dim, elem_bytes=q.element_size()
    )
    if config:
        want = num_splits if num_splits is not None else cfg["num_splits"]
        cfg = {**cfg, **config}
        per_split = -(-max(topk, 1) // want)
        cfg["chunk"] = -(-per_split // cfg["BLOCK_N"]) * cfg["BLOCK_N"]
        cfg["num_splits"] = max(1, -(-max(topk, 1) // cfg["chunk"]))
        if "merge" not in config:
            cfg["merge"] = merge_kind(t, h, cfg["num_splits"])
            cfg["reason"] = merge_reason(t, h, cfg["num_splits"])
        else:
            cfg["reason"] = f"{cfg['num_splits']} splits; {cfg['merge']} merge: config"
    splits = cfg["num_splits"]
    n_hblocks = triton.cdiv(h, cfg["BLOCK_H"])
    spread = splits > 1 and cfg.get("merge") == "spread"
    if spread and not spread_fits(t, h, splits, num_sms, cfg["BLOCK_H"]):
        raise ValueError(
            f"config['merge'] = 'spread' needs the launch in one wave: {t * n_hblocks * splits} programs "
            f"(tokens x head blocks x num_splits) > {num_sms} SMs; ask fewer num_splits"
        )
    if splits > 1:
        out_dtype = partials_dtype(q.dtype, cfg["merge"], cfg.get("partials", "auto"))
        dst_out, dst_lse = split_partials(workspace, splits, t, h, v_dim, q.device, out_dtype=out_dtype)
    else:
        dst_out, dst_lse = out, lse_out
    if spread:
        need = t * n_hblocks * 2
        if counters is None:
            counters = torch.zeros(need, dtype=torch.int32, device=q.device)
        elif counters.dtype != torch.int32 or counters.numel() < need or counters.device != q.device:
            raise ValueError(f"counters must be an int32 tensor on {q.device} with >= {need} elements")
    else:
        counters = lse_out  # unused
    if spread and not q.is_cuda:  # the interpreter runs programs in turn: a spin would never end
        for mode in (SPREAD_ARRIVE, SPREAD_MERGE):
            launch_split_kernel(
                q, kv, rows, topk_length, sinks, dst_out, dst_lse, out, lse_out, counters, cfg, scale, mode
            )  # fmt: skip
        return out, lse_out
    mode = SPREAD_ONE_LAUNCH if spread else SPREAD_OFF
    pdl = cfg.get("pdl", True) and pdl_supported(q.device)
    launch_split_kernel(
        q, kv, rows, topk_length, sinks, dst_out, dst_lse, out, lse_out, counters, cfg, scale, mode, pdl=pdl
    )  # fmt: skip
    if splits > 1 and not spread:
        if cfg.get("merge") == "columns":
            launch_lse_merge_columns(dst_out, dst_lse, out, lse_out, pdl=pdl)
        else:
            launch_lse_merge(dst_out, dst_lse, out, lse_out, pdl=pdl)
    return out, lse_out
