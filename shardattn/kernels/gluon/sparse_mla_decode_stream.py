"""Streaming sparse-MLA decode at <= 16 heads and many tokens (sm_90, Gluon): its plan and launcher.

At few heads a decode step is a read of the picked rows: 16 heads x 64 tokens x 2,048 rows is
under 5 GFLOP against 151 MB of bf16 rows. What bounds it is how many bytes each SM keeps in
flight, and the per-program kernels lose there: the small-batch kernel
(:mod:`~shardattn.kernels.gluon.sparse_mla_decode_small`) issues a split's rows at once and then
computes, so an SM idles between its programs and at many tokens its fp32 partials cost nearly
half the rows' bytes again; the Triton split kernel refills its pipeline in every program.

This kernel keeps one stream of 64-row blocks per SM:

* **persistent programs**: ``min(num_sms, T * S)`` programs, program ``p`` walks the (token,
  slice) tiles ``p, p + P, ...``, each ``NB`` blocks of 64 of the token's entries
  (:func:`stream_decode_plan` picks ``S``); the ring runs on across tiles, so the next tile's
  first blocks (and its Q, double-buffered) are in flight while this tile finishes;
* **a cp.async ring** of ``STAGES`` blocks: bf16 rows 2 x 72 KB (1,152 bytes a row); ``fp8_ds_mla``
  rows 3 x 41 KB raw (codes, scales and the rope values, each copied to its own buffer), one
  dequantised block (``bf16(code) * scale`` chunk by chunk, :mod:`~shardattn.kernels.gluon.e4m3`);
* per block ``S^T = K Q^T`` on ``wgmma`` with the rows as M and the heads (padded to 8 or 16) as
  N, the online softmax down each head (base 2, the library's), ``O^T += V^T P^T`` with the 512
  value columns as M (the accumulator is 64 fp32 registers a thread at 16 heads); the softmax's
  denominator is kept per row slot, like ``S^T``, and summed down the rows once a tile, so the
  only reduction across the warps in the loop is the running max;
* per tile its output and LSE: straight into ``out`` / ``lse`` with one slice, else fp32 partials
  ``[S, T, H, 512]`` merged by :func:`~shardattn.ops.lse_merge.launch_lse_merge_columns`, a
  program per (token, head) row (:data:`~shardattn.plan.crossovers.STREAM_MERGE_COLUMNS`).

Contract as :func:`~shardattn.ops.sparse_mla_decode.sparse_mla_decode`: an entry outside
``[0, R)`` or past ``topk_length`` anywhere in a row is no key; the rows are each token's unique
rows (the caller builds the union first when they may repeat); sinks join slice 0's denominator;
a head with no key gives ``(0, -inf)`` (``(0, sink)`` with sinks). The grid depends on shapes
only, so a launch is CUDA-graph capturable. The torch reference is
:func:`~shardattn.ops.sparse_mla.sparse_mla_reference`; the kernel itself:
:mod:`shardattn.kernels.gluon.sparse_mla_decode_stream_kernel`.
"""

from __future__ import annotations

import torch

from shardattn.kernels.backend import COMPILE_OPTIONS, unit_stride
from shardattn.kernels.gluon.compat import HAS_GLUON
from shardattn.kernels.gluon.sparse_mla_decode_small import LOG2E, _padded_heads, launch_split_and_merge
from shardattn.kernels.split_count import pick_splits
from shardattn.kernels.triton.lse_merge import split_partials_numel
from shardattn.plan.crossovers import STREAM_MERGE_COLUMNS, STREAM_MERGE_WARPS

__all__ = [
    "MAX_HEADS",
    "compile_for_sm90",
    "launch_stream_decode",
    "sparse_mla_decode_stream",
    "stream_decode_limits",
    "stream_decode_plan",
    "stream_stages",
]

#: Heads the kernel holds (the ``wgmma`` N; fewer are padded to 8 or 16 and masked), as the
#: small-batch kernel.
MAX_HEADS = 16
#: Most slices of a token's row list.
MAX_SPLITS = 64
#: Bytes of a 64-row block in each format (bf16: 576 x 2 a row; fp8_ds_mla: 656 a row).
BLOCK_BYTES = {False: 64 * 1152, True: 64 * 656}
#: The plan's model: the bytes per us HBM serves picked rows (the read floor's rate at batch 64 on
#: an H200, docs/PERFORMANCE.md), the most one program streams in each format (measured unsplit at
#: 16-64 tokens, top-k 2,048, 8-16 heads: bf16 33-35 KB a us, fp8_ds_mla 11.2-13; D72) and the
#: merge's fixed cost in us (estimate).
HBM_BYTES_PER_US = 3.3e6
PROGRAM_BYTES_PER_US = {False: 33e3, True: 11.5e3}
MERGE_US = 3.0


def stream_stages(kv_fp8: bool) -> int:
    """Blocks of the ring: 2 of bf16 rows (72 KB each), 3 of ``fp8_ds_mla`` rows (41 KB raw each,
    plus one 64 KB dequantised block); both fit sm_90's 227 KB with the double-buffered Q."""
    return 3 if kv_fp8 else 2


def stream_decode_plan(
    num_tokens: int,
    topk: int,
    num_sms: int,
    *,
    kv_fp8: bool,
    num_heads: int = MAX_HEADS,
    num_splits: int | None = None,
    max_partial_elems: int | None = None,
) -> dict[str, int]:
    """Slices per token, blocks per slice and programs of a streaming launch (host-side, shapes only).

    A program's time is its blocks (``ceil(T * S / P)`` tiles of ``NB``) at its share of HBM or at
    what one program streams, whichever is less; more than one slice adds the merge and the
    partials' bytes. Each slice holds at least ``STAGES - 1`` blocks (a tile's Q buffer must be free
    when its first block is issued).

    Args:
        num_tokens, topk: ``T`` and ``K``. num_sms: SMs of the device. kv_fp8: ``fp8_ds_mla`` rows.
        num_heads: ``H`` (the partials' size). num_splits: slices asked for (None = the model).
        max_partial_elems: fp32 elements a caller's workspace holds (fewer slices if they would not fit).
    Returns:
        ``{"num_splits": S, "blocks": NB, "programs": P}`` with ``S * NB * 64 >= K`` and
        ``NB >= STAGES - 1``.

    Example:
        >>> [stream_decode_plan(t, 2048, 132, kv_fp8=False)["num_splits"] for t in (64, 128, 256)]
        [2, 1, 1]
    """
    nb = max(1, -(-int(topk) // 64))
    min_blocks = stream_stages(kv_fp8) - 1
    block_bytes = BLOCK_BYTES[kv_fp8]

    def shape(s: int) -> tuple[int, int]:
        blocks = max(-(-nb // s), min_blocks)  # past K a block is empty (no key, no load)
        return -(-nb // blocks), blocks

    def fits(s: int) -> bool:
        return max_partial_elems is None or split_partials_numel(s, num_tokens, num_heads, 512) <= max_partial_elems

    def cost(s: int) -> float:
        s, blocks = shape(s)
        tiles = max(1, num_tokens * s)
        programs = min(num_sms, tiles)
        rate = min(HBM_BYTES_PER_US / programs, PROGRAM_BYTES_PER_US[kv_fp8])
        t = -(-tiles // programs) * blocks * block_bytes / rate
        if s > 1:
            t += MERGE_US + 2 * split_partials_numel(s, num_tokens, num_heads, 512) * 4 / HBM_BYTES_PER_US
        return t

    limit = min(MAX_SPLITS, nb)
    s, blocks = shape(pick_splits(shape, fits, cost, asked=num_splits, limit=limit, max_splits=MAX_SPLITS))
    return {"num_splits": s, "blocks": blocks, "programs": min(num_sms, max(1, num_tokens * s))}


def stream_decode_limits(q: torch.Tensor, rows: torch.Tensor) -> str | None:
    """``None`` when the kernel takes these heads and top-k, else why not (the Gluon kernels'
    shape, dtype and alignment rules are :func:`~shardattn.kernels.gluon.sparse_mla.gluon_unsupported_reason`'s)."""
    if q.dim() != 3 or q.shape[1] > MAX_HEADS:
        return f"q of shape {tuple(q.shape)} (the streaming kernel holds at most {MAX_HEADS} heads)"
    if rows.shape[-1] < 1:
        return "an empty top-k (the streaming kernel needs at least one entry)"
    return None


if HAS_GLUON:
    from shardattn.kernels.gluon.sparse_mla_decode_stream_kernel import _stream_decode_kernel


def launch_stream_decode(
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    topk_length: torch.Tensor | None,
    sinks: torch.Tensor | None,
    dst_out: torch.Tensor,
    dst_lse: torch.Tensor,
    plan: dict[str, int],
    scale: float,
    pdl: bool,
) -> None:
    """Launch the kernel on validated tensors (no checks, no allocation, no sync).

    Args:
        q ``[T, H, 576]`` bf16 / fp16; kv ``[R, 576]`` (q's dtype) or ``[R, 656]`` uint8
        ``fp8_ds_mla`` rows (q bf16); rows ``[T, K]`` int32; topk_length ``[T]`` int32 / sinks
        ``[H]`` fp32 or None. dst_out ``[S, T, H, 512]`` fp32 / dst_lse ``[S, T, H]`` fp32 partials,
        or with one slice ``out [T, H, 512]`` (q's dtype) / ``lse [T, H]``. plan:
        :func:`stream_decode_plan`. pdl: a programmatic dependent launch.
    """
    topk_length, sinks = unit_stride(topk_length), unit_stride(sinks)
    t, h, d = q.shape
    s, nb, programs = plan["num_splits"], plan["blocks"], plan["programs"]
    kv_fp8 = kv.dtype == torch.uint8
    s_os, s_ls = (dst_out.stride(0), dst_lse.stride(0)) if s > 1 else (0, 0)
    _stream_decode_kernel[(programs,)](
        q, kv, rows, topk_length if topk_length is not None else rows, sinks if sinks is not None else dst_lse,
        dst_out, dst_lse,
        q.stride(0), q.stride(1), kv.stride(0), rows.stride(0), rows.stride(1), t, rows.shape[1], kv.shape[0], h,
        s, nb, programs,
        s_os, dst_out.stride(-3), dst_out.stride(-2), s_ls, dst_lse.stride(-2), dst_lse.stride(-1),
        float(scale) * LOG2E,
        HP=_padded_heads(h), DV=512, DR=d - 512, STAGES=stream_stages(kv_fp8),
        HAS_TOPK_LEN=topk_length is not None, HAS_SINKS=sinks is not None, PDL=pdl, KV_FP8=kv_fp8,
        num_warps=4, launch_pdl=pdl, **COMPILE_OPTIONS,
    )  # fmt: skip


def sparse_mla_decode_stream(
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    *,
    scale: float,
    out: torch.Tensor,
    lse_out: torch.Tensor,
    topk_length: torch.Tensor | None,
    sinks: torch.Tensor | None,
    workspace: torch.Tensor | None,
    num_sms: int,
    pdl: bool,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The streaming kernel and, with more than one slice, the column merge, into ``out`` / ``lse_out``.

    Validated tensors (:func:`~shardattn.ops.sparse_mla_decode.sparse_mla_decode` checks them;
    :func:`stream_decode_limits` and the Gluon rules must hold); ``rows`` are each token's unique
    rows. ``workspace``: optional flat fp32 buffer for the partials (fewer slices if it is too
    small). ``num_splits``: slices asked for (None = :func:`stream_decode_plan`'s model).
    Capture-safe: no host sync, the grid depends on shapes only.

    Raises:
        ValueError: more heads than :data:`MAX_HEADS` or an empty top-k (before any launch).
    """
    why = stream_decode_limits(q, rows)
    if why is not None:
        raise ValueError(f"the streaming decode kernel cannot take {why}")
    t, h, _d = q.shape
    limit = None if workspace is None else workspace.numel()
    plan = stream_decode_plan(
        t, rows.shape[1], num_sms, kv_fp8=kv.dtype == torch.uint8, num_heads=h, num_splits=num_splits,
        max_partial_elems=limit,
    )  # fmt: skip

    def launch(dst_out: torch.Tensor, dst_lse: torch.Tensor) -> None:
        launch_stream_decode(q, kv, rows, topk_length, sinks, dst_out, dst_lse, plan, scale, pdl)

    launch_split_and_merge(
        launch, plan["num_splits"], out, lse_out, workspace, pdl, STREAM_MERGE_COLUMNS, STREAM_MERGE_WARPS
    )
    return out, lse_out


def compile_for_sm90(
    *,
    split: bool = True,
    topk_length: bool = False,
    sinks: bool = False,
    dtype: str = "bf16",
    heads: int = MAX_HEADS,
    kv_fp8: bool = False,
):
    """Compile the kernel for sm_90 ahead of time (no GPU needed); returns Triton's compiled kernel
    (``asm["ptx"]``, ``metadata``). ``split``: fp32 partials (else the one-slice output in
    ``dtype``); ``heads``: 8 or fewer compiles the 8-wide ``wgmma``; ``kv_fp8``: ``fp8_ds_mla`` rows
    (uint8; ``dtype`` bf16). Raises RuntimeError without Gluon."""
    from shardattn.kernels.gluon.compat import GLUON_IMPORT_ERROR, compile_sm90

    if not HAS_GLUON:
        raise RuntimeError(f"triton.experimental.gluon unavailable ({GLUON_IMPORT_ERROR})")
    names = ["Q", "KV", "Rows", "TopkLen", "Sinks", "Out", "Lse", "stride_qt", "stride_qh", "stride_kvr",
             "stride_rt", "stride_rk", "T", "K", "R", "H", "S", "NB", "n_prog", "stride_os", "stride_ot",
             "stride_oh", "stride_ls", "stride_lt", "stride_lh", "qk_scale"]  # fmt: skip
    out_t = "*fp32" if split else f"*{dtype}"
    kv_t = "*u8" if kv_fp8 else f"*{dtype}"
    types = [f"*{dtype}", kv_t, "*i32", "*i32", "*fp32", out_t, "*fp32"] + ["i32"] * 18 + ["fp32"]
    signature = dict(zip(names, types, strict=True))
    constexprs = {"HP": _padded_heads(heads), "DV": 512, "DR": 64, "STAGES": stream_stages(kv_fp8),
                  "HAS_TOPK_LEN": topk_length, "HAS_SINKS": sinks, "PDL": True, "KV_FP8": kv_fp8}  # fmt: skip
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    aligned = ("Q", "KV", "Rows", "Out", "stride_qt", "stride_qh", "stride_kvr", "stride_rt", "stride_os",
               "stride_ot", "stride_oh")  # fmt: skip
    return compile_sm90(_stream_decode_kernel, signature, constexprs, aligned=aligned, options={"num_warps": 4})
