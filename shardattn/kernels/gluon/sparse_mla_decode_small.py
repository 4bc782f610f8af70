"""Small-batch sparse-MLA decode at <= 16 heads on one or two warpgroups (sm_90, Gluon): its launcher.

The Triton split-KV kernel (:mod:`~shardattn.kernels.triton.sparse_mla_decode`) gathers a split's
rows through its pipeline a step at a time and runs Q.K^T and P.V on ``mma.sync`` with the heads
as M. At 16 heads and 1-16 tokens a decode step is latency bound, and this kernel shortens the
chain. One program per (token, split of ``BLOCK_N`` = 64 or 128 top-k entries, group of heads),
one warpgroup at 64 entries and two at 128 (:func:`small_decode_warps`; each takes half of every
``wgmma``'s M). The heads are one group, or two of 8 while the programs still fit one wave
(:func:`small_decode_heads`): two programs then gather the same rows and each runs the tail of
the step (softmax, P.V, the partial's store) on half the heads, on SMs that would otherwise idle:

* every row of the split (576 columns, 1,152 B in bf16) and the token's Q are issued at once as
  ``cp.async`` copies into shared memory (up to 144 KB in flight per SM), in 1 +
  :data:`LATENT_CHUNKS` groups: Q with the 64 rope columns, then the 512 latent columns in chunks;
* ``S^T = K Q^T`` on ``wgmma`` with the split's rows as M and the heads (padded to 8 or 16) as N, one
  chunk at a time as its group lands (the ``wgmma`` runs while later chunks arrive); the softmax
  runs down the rows of each head;
* ``O^T = V^T P^T`` on ``wgmma`` with the 512 value columns as M: 8 or 16 heads need no padding
  to the 64-row tile a heads-as-M ``wgmma`` would (the accumulator at 16 heads is 64 fp32
  registers a thread on one warpgroup, 32 on two; half that at 8);
* the fp32 partial and LSE of the split go to ``[S, T, H, 512]`` / ``[S, T, H]`` (the layout of
  :func:`~shardattn.ops.lse_merge.split_partials`), merged by
  :func:`~shardattn.ops.lse_merge.launch_lse_merge_columns` (:data:`SMALL_MERGE_COLUMNS`
  columns on one warp a program); one split writes ``out`` (q's dtype) and ``lse`` directly.

Contract as :func:`~shardattn.ops.sparse_mla_decode.sparse_mla_decode`: an entry outside
``[0, R)`` or past ``topk_length`` anywhere in a row is no key; sinks join split 0's denominator;
a row with no key gives ``(0, -inf)`` (``(0, sink)`` with sinks). On sm_90 the kernel and its merge
are programmatic dependent launches like the Triton path's. Its whole steps are faster than the
Triton split kernel's at up to 16 heads and 16 tokens (graph replays, L2 flushed:
docs/PERFORMANCE.md), so :func:`~shardattn.plan.decode_routing.route_sparse_decode_kernel` routes those
calls here (the crossovers: :mod:`shardattn.plan.crossovers`).
The torch reference is :func:`~shardattn.ops.sparse_mla.sparse_mla_reference`. The kernel itself:
:mod:`shardattn.kernels.gluon.sparse_mla_decode_small_kernel`; here its limits, launch, runner
and ahead-of-time compile.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardattn.kernels.backend import COMPILE_OPTIONS, unit_stride
from shardattn.kernels.gluon.compat import HAS_GLUON
from shardattn.kernels.triton.lse_merge import launch_lse_merge_columns, split_partials
from shardattn.plan.crossovers import SMALL_MERGE_COLUMNS, SMALL_MERGE_WARPS
from shardattn.plan.decode_routing import SMALL_DECODE_MAX_SPLITS, small_decode_heads, small_decode_tiles

__all__ = [
    "MAX_HEADS",
    "MAX_SPLITS",
    "compile_for_sm90",
    "launch_small_split",
    "launch_split_and_merge",
    "small_decode_limits",
    "small_decode_unsupported_reason",
    "small_decode_warps",
    "sparse_mla_decode_small",
]

#: Heads the kernel holds (the ``wgmma`` N; fewer are padded and masked).
MAX_HEADS = 16
#: Most splits of a row (the column merge loads all ``S`` partials of a column block at once).
MAX_SPLITS = SMALL_DECODE_MAX_SPLITS
#: Column chunks of the 512 latent columns, each its own ``cp.async`` group, so Q.K^T starts on the
#: first chunk while the others are in flight.
LATENT_CHUNKS = 4
LOG2E = 1.4426950408889634


def small_decode_warps(block_n: int) -> int:
    """Warps of a split program: one warpgroup at 64 entries; two at 128, each taking 64 of the
    rows in ``S^T = K Q^T`` and 256 of the value columns in ``O^T = V^T P^T`` (faster than one
    warpgroup at 128 entries at 5-8 tokens, level at 12-16; docs/PERFORMANCE.md).

    >>> small_decode_warps(64), small_decode_warps(128)
    (4, 8)
    """
    return 4 if block_n <= 64 else 8


def _padded_heads(heads_per_program: int) -> int:
    """The ``wgmma`` N (``HP``) a program of ``heads_per_program`` heads pads to: 8 or 16."""
    return 8 if heads_per_program <= 8 else MAX_HEADS


def _resolve_heads(heads: int, heads_per_program: int | None) -> int:
    """``heads_per_program``, or all ``heads`` when None.

    Raises:
        ValueError: ``heads_per_program`` is not an int in ``[1, 16]``.
    """
    if heads_per_program is None:
        return heads
    if not isinstance(heads_per_program, int) or not 1 <= heads_per_program <= MAX_HEADS:
        raise ValueError(f"heads_per_program must be an int in [1, {MAX_HEADS}]; got {heads_per_program!r}")
    return heads_per_program


def small_decode_unsupported_reason(q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, v_dim: int) -> str | None:
    """``None`` when this kernel runs these tensors, else the reason it does not (the Gluon
    kernels' shape, dtype, alignment and device rules, at most :data:`MAX_HEADS` heads, a
    non-empty top-k of at most :data:`MAX_SPLITS` 128-entry splits)."""
    from shardattn.kernels.gluon.sparse_mla import gluon_unsupported_reason

    return gluon_unsupported_reason(q, kv, v_dim) or small_decode_limits(q, rows)


def small_decode_limits(q: torch.Tensor, rows: torch.Tensor) -> str | None:
    """The part of :func:`small_decode_unsupported_reason` that is this kernel's own (heads and top-k), for
    callers that already asked ``gluon_unsupported_reason``."""
    if q.dim() != 3 or q.shape[1] > MAX_HEADS:
        return f"q of shape {tuple(q.shape)} (the small-batch kernel holds at most {MAX_HEADS} heads)"
    topk = rows.shape[-1]
    if not 1 <= topk <= 128 * MAX_SPLITS:
        return f"top-k {topk} (the small-batch kernel takes 1 to {128 * MAX_SPLITS} entries)"
    return None


if HAS_GLUON:
    from shardattn.kernels.gluon.sparse_mla_decode_small_kernel import _small_split_kernel


def launch_small_split(
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    topk_length: torch.Tensor | None,
    sinks: torch.Tensor | None,
    dst_out: torch.Tensor,
    dst_lse: torch.Tensor,
    block_n: int,
    splits: int,
    scale: float,
    pdl: bool,
    heads_per_program: int | None = None,
) -> None:
    """Launch ``_small_split_kernel`` on validated tensors (no checks, no allocation, no sync).

    Args:
        q ``[T, H, 576]``, kv ``[R, 576]`` (bf16 / fp16), rows ``[T, K]`` int32, topk_length ``[T]``
        int32 / sinks ``[H]`` fp32 or None. dst_out ``[S, T, H, 512]`` fp32 / dst_lse ``[S, T, H]``
        fp32 partials, or with one split ``out [T, H, 512]`` (q's dtype) / ``lse [T, H]``.
        block_n, splits: :func:`small_decode_tiles` (the warps: :func:`small_decode_warps`). pdl: a
        programmatic dependent launch. heads_per_program: heads of one program
        (:func:`small_decode_heads`); None: all of them.

    Raises:
        ValueError: ``heads_per_program`` is not in ``[1, 16]`` (checked before any launch).
    """
    topk_length, sinks = unit_stride(topk_length), unit_stride(sinks)
    warps = small_decode_warps(block_n)
    t, h, d = q.shape
    group = min(h, _resolve_heads(h, heads_per_program))
    v_dim = dst_out.shape[-1]
    s_os, s_ls = (dst_out.stride(0), dst_lse.stride(0)) if splits > 1 else (0, 0)
    _small_split_kernel[(t, splits, -(-h // group))](
        q, kv, rows, topk_length if topk_length is not None else rows, sinks if sinks is not None else dst_lse,
        dst_out, dst_lse,
        q.stride(0), q.stride(1), kv.stride(0), rows.stride(0), rows.stride(1), rows.shape[1], kv.shape[0], h, group,
        s_os, dst_out.stride(-3), dst_out.stride(-2), s_ls, dst_lse.stride(-2), dst_lse.stride(-1),
        float(scale) * LOG2E,
        HP=_padded_heads(group), BLOCK_N=block_n, DV=v_dim, DR=d - v_dim, EVEN_K=rows.shape[1] % block_n == 0,
        HAS_TOPK_LEN=topk_length is not None, HAS_SINKS=sinks is not None, PDL=pdl,
        NCHUNK=LATENT_CHUNKS, W=warps, KV_FP8=kv.dtype == torch.uint8, num_warps=warps, launch_pdl=pdl,
        **COMPILE_OPTIONS,
    )  # fmt: skip


def sparse_mla_decode_small(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """The split kernel and, with more than one split, the column merge, into ``out`` / ``lse_out``.

    Validated tensors (:func:`~shardattn.ops.sparse_mla_decode.sparse_mla_decode` checks them
    and :func:`small_decode_unsupported_reason` must hold); ``rows`` are the unique rows of each token (the
    caller builds the union first when they may repeat). ``workspace``: optional flat fp32 buffer
    of :func:`~shardattn.ops.lse_merge.split_partials_numel` elements for the splits of
    :func:`small_decode_tiles`. Capture-safe: no host sync, the grid depends on shapes only.
    """
    t, h, _d = q.shape
    block_n, splits = small_decode_tiles(t, rows.shape[1], num_sms, kv_fp8=kv.dtype == torch.uint8)
    group = small_decode_heads(t, splits, h, num_sms)

    def launch(dst_out: torch.Tensor, dst_lse: torch.Tensor) -> None:
        launch_small_split(
            q, kv, rows, topk_length, sinks, dst_out, dst_lse, block_n, splits, scale, pdl, heads_per_program=group
        )

    launch_split_and_merge(launch, splits, out, lse_out, workspace, pdl)
    return out, lse_out


def launch_split_and_merge(
    launch: Callable[[torch.Tensor, torch.Tensor], None],
    splits: int,
    out: torch.Tensor,
    lse_out: torch.Tensor,
    workspace: torch.Tensor | None,
    pdl: bool,
    merge_columns: int = SMALL_MERGE_COLUMNS,
    merge_warps: int = SMALL_MERGE_WARPS,
) -> None:
    """``launch(dst_out, dst_lse)`` of a split decode kernel and the merge after it (the small-batch and
    streaming kernels'): with one split straight into ``out [T, H, Dv]`` / ``lse_out [T, H]``; else
    into fp32 partials ``[splits, T, H, Dv]`` / ``[splits, T, H]`` in ``workspace`` (allocated when
    None; :func:`~shardattn.kernels.triton.lse_merge.split_partials`), merged into them by the
    column merge, a program per (token, head) row and ``merge_columns`` columns on ``merge_warps``
    warps (the small-batch kernel's: one warp per 64 columns, :data:`SMALL_MERGE_COLUMNS`; the
    streaming kernel's: :data:`~shardattn.plan.crossovers.STREAM_MERGE_COLUMNS`)."""
    if splits == 1:
        launch(out, lse_out)
        return
    t, h, v_dim = out.shape
    dst_out, dst_lse = split_partials(workspace, splits, t, h, v_dim, out.device)
    launch(dst_out, dst_lse)
    launch_lse_merge_columns(dst_out, dst_lse, out, lse_out, pdl=pdl, block_d=merge_columns, num_warps=merge_warps)


def compile_for_sm90(
    block_n: int = 64,
    *,
    split: bool = True,
    even_k: bool = True,
    topk_length: bool = False,
    sinks: bool = False,
    dtype: str = "bf16",
    heads_per_program: int = MAX_HEADS,
    kv_fp8: bool = False,
):
    """Compile the split kernel for sm_90 ahead of time (no GPU needed); returns Triton's compiled
    kernel (``asm["ptx"]``, ``metadata``). ``split``: fp32 partials (else the one-split output in
    ``dtype``); ``even_k``: a top-k that is a multiple of ``block_n``; ``heads_per_program``: 8 or
    fewer compiles the 8-wide ``wgmma``; ``kv_fp8``: ``fp8_ds_mla`` rows (uint8; ``dtype`` bf16).
    Raises RuntimeError without Gluon, ValueError for ``heads_per_program`` out of range."""
    from shardattn.kernels.gluon.compat import GLUON_IMPORT_ERROR, compile_sm90

    warps = small_decode_warps(block_n)
    group = _resolve_heads(MAX_HEADS, heads_per_program)
    if not HAS_GLUON:
        raise RuntimeError(f"triton.experimental.gluon unavailable ({GLUON_IMPORT_ERROR})")

    names = ["Q", "KV", "Rows", "TopkLen", "Sinks", "Out", "Lse", "stride_qt", "stride_qh", "stride_kvr",
             "stride_rt", "stride_rk", "K", "R", "H", "HG", "stride_os", "stride_ot", "stride_oh",
             "stride_ls", "stride_lt", "stride_lh", "qk_scale"]  # fmt: skip
    out_t = "*fp32" if split else f"*{dtype}"
    kv_t = "*u8" if kv_fp8 else f"*{dtype}"
    types = [f"*{dtype}", kv_t, "*i32", "*i32", "*fp32", out_t, "*fp32"] + ["i32"] * 15 + ["fp32"]
    signature = dict(zip(names, types, strict=True))
    constexprs = {"HP": _padded_heads(group), "BLOCK_N": block_n, "DV": 512, "DR": 64, "EVEN_K": even_k,
                  "HAS_TOPK_LEN": topk_length, "HAS_SINKS": sinks, "PDL": True, "NCHUNK": LATENT_CHUNKS,
                  "W": warps, "KV_FP8": kv_fp8}  # fmt: skip
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    aligned = ("Q", "KV", "Rows", "Out", "stride_qt", "stride_qh", "stride_kvr", "stride_rt", "K", "stride_os",
               "stride_ot", "stride_oh")  # fmt: skip
    return compile_sm90(_small_split_kernel, signature, constexprs, aligned=aligned, options={"num_warps": warps})
