"""Gluon (``triton.experimental.gluon``) sparse-MLA prefill for Hopper (sm_90): launch, AOT compile.

The warp-specialised 64-key kernel of :mod:`shardattn.kernels.gluon.sparse_mla_kernel` serves the
per-query path (one query x 64 heads a tile), the grouped path (``G`` queries x ``64 / G`` heads,
membership masks) and decode (raw rows masked in the kernel). This module holds its compile-time
options (:class:`GluonConfig`, :func:`gluon_config`), the launcher (:func:`launch_gluon_attention`:
unions, or raw rows) and the AOT compile.

Outputs follow :func:`shardattn.ops.sparse_mla.sparse_mla_attention`: ``out [T, H, Dv]`` in
q's dtype, ``lse [T, H]`` fp32 natural log. Inputs: bf16/fp16 ``q [T, H, Dv + Dr]`` and
``kv [R, Dv + Dr]`` with unit last stride, ``Dv = 512`` and ``Dr = 64`` (DSA models; other
shapes take the Triton kernel: :func:`gluon_unsupported_reason` says why a case does not run).

:func:`compile_for_sm90` compiles a kernel variant ahead of time for sm_90 with no GPU and
returns its PTX (CI runs it, so a Gluon API change fails there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardattn.kernels.backend import COMPILE_OPTIONS, sm_count, unit_stride
from shardattn.kernels.gluon.compat import GLUON_IMPORT_ERROR as _GLUON_IMPORT_ERROR
from shardattn.kernels.gluon.compat import HAS_GLUON
from shardattn.kernels.gluon.sparse_mla_epilogue import WS_MAXNREG, WS_NUM_WARPS
from shardattn.kernels.gluon.sparse_mla_kernel import NOT_SPECIALIZED
from shardattn.kernels.triton.sparse_mla import launch_destinations, launch_strides
from shardattn.kernels.union_layout import GROUP_SIZES, num_groups

if HAS_GLUON:
    import triton

LOG2E = 1.4426950408889634
BLOCK_H = 64
KINDS = ("prefill",)
#: Registers per thread of each consumer warpgroup (the fewest spills found in the compiled
#: kernel); the producer, the default partition, gets what they leave of ``3 * WS_MAXNREG``.
CONSUMER_REGS = 224
#: Registers of each consumer warpgroup on ``fp8_ds_mla`` rows, where the producer dequantises
#: through registers and gets what two consumers at 200 leave it (104; at 224 it would get 56):
#: this split alone made decode 1.06-1.10x faster than 216 / 200 / 88, and the consumers lose under
#: 3 % at 200 on bf16 rows (docs/DECISIONS.md, D51).
FP8_CONSUMER_REGS = 200


@dataclass(frozen=True)
class GluonConfig:
    """Compile-time options of one launch of the 64-key kernel (part of the warm-up key).

    ``heads_fastest``: a 1-D grid with a token's head blocks adjacent (its programs share the rows
    in L2); ``early_kv``: the producer loads Q, so the gathers start without waiting for it;
    ``persistent``: one program per SM walks tile after tile, the next tile's first key pair
    gathered while this one ends, its output staged through Q's buffers.
    """

    heads_fastest: bool = False
    early_kv: bool = False
    persistent: bool = False

    @property
    def label(self) -> str:
        options = (("h", self.heads_fastest), ("k", self.early_kv), ("P", self.persistent))
        return "ws64" + "".join(c for c, on in options if on)


#: Grouped tiles (``G > 1``) and the base of the per-query configuration: one tile a program.
GROUPED_CONFIG = GluonConfig()


def gluon_config(heads: int, d_v: int = 512, d_r: int = 64, group_size: int = 1) -> GluonConfig:
    """Tile of the Gluon prefill kernel for these shapes.

    DSA shapes (``Dv = 512``, ``Dr = 64``), one query per tile (``group_size = 1``): the 64-key
    kernel (:mod:`~shardattn.kernels.gluon.sparse_mla_kernel`; shared memory Q 72 KB + two 72 KB
    key blocks + an 8 KB P buffer), with a token's head blocks adjacent in the grid when it has
    more than one (``heads > 64``: its programs share the rows in L2; with one head block the flag
    only costs a division) and Q loaded by the producer ahead of the first gathers (``early_kv``,
    faster at 128 heads, level at 64), one program per SM walking tiles in turn (``persistent``:
    the next tile's first key pair gathered during this one's epilogue, a program's first tile
    loading Q before its first gathers; level or faster everywhere measured, docs/PERFORMANCE.md);
    grouped tiles (``group_size > 1``): the same kernel, ``64 / G`` heads of ``G`` queries per
    tile, each row masked to its query's keys (:data:`GROUPED_CONFIG`). 64 rows per program,
    fewer pad it.
    """
    del d_v, d_r
    two_blocks = heads > BLOCK_H
    if group_size > 1:
        return GROUPED_CONFIG
    return GluonConfig(heads_fastest=two_blocks, early_kv=two_blocks, persistent=True)


def gluon_available() -> bool:
    """``True`` when Triton's Gluon with the Hopper ops imports (:func:`gluon_unavailable_reason` says
    why not otherwise)."""
    return HAS_GLUON


def gluon_unavailable_reason() -> str | None:
    """Why Triton's Gluon with the Hopper ops does not import here, or ``None`` when it does."""
    return None if HAS_GLUON else f"triton.experimental.gluon unavailable ({_GLUON_IMPORT_ERROR})"


def gluon_unsupported_reason(q: torch.Tensor, kv: torch.Tensor, v_dim: int) -> str | None:
    """``None`` when the Gluon kernel runs these tensors, else the reason it does not.

    ``q``: ``[T, H, D]`` or head-blocked ``[B, T, H/B, D]``; ``kv``: ``[R, D]``, or ``[R, 656]``
    uint8 ``fp8_ds_mla`` rows with a bf16 ``q`` (layouts: :func:`stride_reason`).
    """
    why = gluon_unavailable_reason()
    if why is not None:
        return why
    if q.device.type != "cuda":
        return f"tensor on {q.device} (the Gluon kernel needs CUDA)"
    major = torch.cuda.get_device_capability(q.device)[0]
    if major != 9:
        return f"compute capability {major}.x (the Gluon kernel is written for sm_90 wgmma)"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {q.dtype} (the Gluon kernel takes bf16/fp16)"
    if kv.dtype == torch.uint8 and q.dtype != torch.bfloat16:
        return f"fp8_ds_mla rows with q in {q.dtype} (the Gluon kernels dequantise them to bf16)"
    d_r = q.shape[-1] - v_dim
    if (v_dim, d_r) != (512, 64):
        return f"head dims {v_dim} + {d_r} (the Gluon kernel is built and checked for DSA's 512 + 64)"
    return stride_reason(q, kv)


def stride_reason(q: torch.Tensor, kv: torch.Tensor) -> str | None:
    """Why the Gluon kernels cannot take these layouts, or ``None``: unit last-dim strides, data
    16-byte aligned, and every other stride of ``q`` and ``kv``'s row stride a multiple of 16
    elements: the launcher specialises each integer stride on divisibility by 16, and the kernels'
    ``cp.async`` loads compile only for that variant (a bf16 cache padded to 584 values a row,
    16-byte aligned, failed to compile: ``PassManager::run failed``).

    >>> kv = torch.zeros(8, 584, dtype=torch.bfloat16)[:, :576]
    >>> stride_reason(torch.zeros(2, 4, 576, dtype=torch.bfloat16), kv)
    "kv's row stride must be a multiple of 16 elements (the kernels compile for no other), got 584"
    """
    if q.stride(-1) != 1 or kv.stride(-1) != 1:
        return "q and kv need a unit last-dim stride"
    if q.data_ptr() % 16 or kv.data_ptr() % 16:
        return "q and kv must start 16-byte aligned for cp.async"
    only = "(the kernels compile for no other)"
    if any(st % 16 for st in q.stride()[:-1]):
        return f"q's strides must be multiples of 16 elements {only}, got {q.stride()}"
    if kv.stride(-2) % 16:
        return f"kv's row stride must be a multiple of 16 elements {only}, got {kv.stride(-2)}"
    return None


def launch_gluon_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    union: torch.Tensor,
    lens: torch.Tensor,
    *,
    scale: float,
    v_dim: int,
    config: GluonConfig | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    group_size: int = 1,
    raw_rows: bool = False,
    q_slices: int = 1,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the Gluon kernel on prepared unions, or on raw rows (inputs already validated).

    ``q``, ``out`` and ``lse`` may each be *head-blocked*: ``[B, T, H/B, ...]`` holds head
    ``b * H/B + i`` of token ``t`` at ``[b, t, i]`` (an all-to-all receive or send buffer, read or
    written in place); otherwise ``[T, H, ...]``. Any 16-byte aligned strides, unit last-dim stride.

    Args:
        q: ``[T, H, D]`` or ``[B, T, H/B, D]`` bf16/fp16; kv: ``[R, D]``.
        union: ``[ceil(T/G), W]`` int32 from :func:`~shardattn.ops.union.build_union` with
            ``group_size``: sorted unique valid rows per token (``G = 1``) or packed entries with
            one membership bit per query (``G > 1``); lens: ``[ceil(T/G)]`` int32 entries used.
            With ``raw_rows``: union is the caller's ``[T, K]`` rows (invalid entries, ``< 0`` or
            ``>= R``, anywhere; a duplicate counts twice) and lens its ``topk_length`` or None.
        config: :func:`gluon_config` for ``group_size`` when None.
        out / lse: optional destinations ``[T, H, v_dim]`` / ``[T, H]`` (or head-blocked), q's dtype / fp32.
        group_size: ``G`` queries per 64-row tile (``1, 2, 4, 8``; ``G > 1`` needs ``H <= 64 / G``).
        raw_rows: attend ``union`` as raw rows, masked per entry (no union build, no packing).
        q_slices: ``S``, each token's row list cut into ``S`` slices of ``W`` entries run as
            queries of their own (decode's split, ``G = 1``, plain ``q``): query ``p = t * S + s``
            takes token ``t``'s q and entries ``[s * W, (s + 1) * W)`` of its list, ``union`` is
            ``[T * S, W]`` (a view of the ``[T, S * W]`` lists), ``lens`` (or ``topk_length``)
            ``[T]`` stays per token and ``out`` / ``lse`` (required) are ``[T * S, H, v_dim]`` /
            ``[T * S, H]``.
        pdl: a programmatic dependent launch (where
            :func:`~shardattn.kernels.backend.pdl_supported`): the kernel waits for the grid before
            it at its start and lets the one after it (decode's merge) launch at once.
    Returns:
        ``(out, lse)``: the given destinations, or new ``[T, H, v_dim]`` q.dtype and ``[T, H]`` fp32.
    """
    lens, sinks = unit_stride(lens), unit_stride(sinks)
    d = q.shape[-1]
    h = q.shape[0] * q.shape[2] if q.dim() == 4 else q.shape[1]
    cfg = config or gluon_config(h, v_dim, d - v_dim, group_size)
    if group_size > 1 and h > BLOCK_H // group_size:
        raise ValueError(f"group_size={group_size} takes <= {BLOCK_H // group_size} heads, got {h}")
    if raw_rows and group_size != 1:
        raise ValueError("raw_rows needs group_size=1")
    if q_slices > 1 and (group_size != 1 or q.dim() != 3 or out is None or lse is None):
        raise ValueError("q_slices > 1 needs group_size=1, a plain [T, H, D] q and the [T * S, ...] out and lse")
    t, h, out, lse = launch_destinations(q, v_dim, out, lse)
    t *= q_slices  # the queries the kernel runs: every slice of every token
    if t == 0 or h == 0:
        return out, lse
    hb, q_strides, out_strides, lse_strides = launch_strides(h, q, out, lse)
    strides = (*q_strides, kv.stride(0), union.stride(0), *out_strides, *lse_strides)
    heads_per_tile = BLOCK_H // group_size
    grid: tuple[int, ...] = (num_groups(t, group_size), triton.cdiv(h, heads_per_tile))
    if cfg.persistent:  # one program per SM (one fits: 225 KB of shared memory), tiles in turn
        grid = (min(grid[0] * grid[1], sm_count(q.device)),)
    elif cfg.heads_fastest:  # 1-D grid, a query's head blocks adjacent
        grid = (grid[0] * grid[1],)
    fn, constexprs, options = _kernel_args(
        cfg, group_size, v_dim, d - v_dim, sinks is not None, raw_rows=raw_rows, has_lens=lens is not None,
        kv_fp8=kv.dtype == torch.uint8, pdl=pdl,
    )  # fmt: skip
    sink_arg = sinks if sinks is not None else lse
    lens_arg = lens if lens is not None else union
    fn[grid](
        q, kv, union, lens_arg, sink_arg, out, lse, t, h, hb, *strides, scale * LOG2E, kv.shape[0], union.shape[1],
        q_slices, **constexprs, **options, launch_pdl=pdl, **COMPILE_OPTIONS,
    )  # fmt: skip
    return out, lse


def _kernel_args(
    cfg: GluonConfig,
    group_size: int,
    v_dim: int,
    rope_dim: int,
    sinks: bool,
    *,
    raw_rows: bool = False,
    has_lens: bool = True,
    kv_fp8: bool = False,
    pdl: bool = False,
):
    """``(kernel, constexpr arguments, launch options)`` of a configuration (the launcher's and the
    AOT compile's); ``kv_fp8``: ``fp8_ds_mla`` KV rows (the producer dequantises them); ``pdl``: a
    programmatic dependent launch."""
    from shardattn.kernels.gluon.sparse_mla_kernel import ws64_kernel

    constexprs = {
        "D_V": v_dim, "D_R": rope_dim, "HAS_SINK": sinks,
        "CONSUMER_REGS": FP8_CONSUMER_REGS if kv_fp8 else CONSUMER_REGS,
        "HEADS_FASTEST": cfg.heads_fastest, "EARLY_KV": cfg.early_kv, "G": group_size, "RAW_ROWS": raw_rows,
        "PERSISTENT": cfg.persistent, "HAS_LENS": has_lens or not raw_rows, "KV_FP8": kv_fp8, "PDL": pdl,
    }  # fmt: skip
    return ws64_kernel(), constexprs, {"num_warps": WS_NUM_WARPS, "maxnreg": WS_MAXNREG}


def compile_for_sm90(
    kind: str,
    heads: int,
    group_size: int = 1,
    *,
    v_dim: int = 512,
    rope_dim: int = 64,
    sinks: bool = False,
    dtype: str = "bf16",
    config: GluonConfig | None = None,
    raw_rows: bool = False,
    kv_fp8: bool = False,
    pdl: bool = False,
):
    """Compile a Gluon kernel variant for sm_90 ahead of time (no GPU needed); returns its PTX.

    Args:
        kind: ``"prefill"`` (the only Gluon kernel so far).
        heads: query heads per rank (the tile is 64 rows: ``64 / group_size`` heads of
            ``group_size`` queries; at most that many heads when ``group_size > 1``).
        group_size: queries per tile, ``1`` (per-query) or ``2 / 4 / 8`` (grouped: the union's
            packed entries and membership masks).
        config: the options (default :func:`gluon_config`'s); raw_rows: the raw-row mode (rows
            masked per entry, as decode launches it); kv_fp8: ``fp8_ds_mla`` KV rows (uint8,
            dequantised by the producer; ``dtype`` bf16); pdl: a programmatic dependent launch
            (decode's).
    Returns:
        The PTX text of the compiled kernel.
    Raises:
        ValueError: an unknown ``kind``, an unsupported ``group_size`` or too many heads for it.
        RuntimeError: Gluon is not available in the installed Triton.
    """
    return compile_kernel_for_sm90(
        kind, heads, group_size, v_dim=v_dim, rope_dim=rope_dim, sinks=sinks, dtype=dtype, config=config,
        raw_rows=raw_rows, kv_fp8=kv_fp8, pdl=pdl,
    ).asm["ptx"]  # fmt: skip


def compile_kernel_for_sm90(
    kind: str,
    heads: int,
    group_size: int = 1,
    *,
    v_dim: int = 512,
    rope_dim: int = 64,
    sinks: bool = False,
    dtype: str = "bf16",
    config: GluonConfig | None = None,
    raw_rows: bool = False,
    kv_fp8: bool = False,
    pdl: bool = False,
):
    """As :func:`compile_for_sm90`, returning Triton's compiled kernel (``asm``, ``metadata``)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    if heads < 1:
        raise ValueError(f"heads must be >= 1, got {heads}")
    cfg = config or gluon_config(heads, v_dim, rope_dim, group_size)
    if group_size > 1 and heads > BLOCK_H // group_size:
        raise ValueError(f"heads must be <= {BLOCK_H // group_size} for group_size={group_size}, got {heads}")
    if raw_rows and group_size != 1:
        raise ValueError(f"raw_rows needs group_size=1, got {group_size}")
    why = gluon_unavailable_reason()
    if why is not None:
        raise RuntimeError(why)
    from shardattn.kernels.gluon.compat import compile_sm90

    ptr = f"*{dtype}"
    signature = {
        "Q": ptr, "KV": "*u8" if kv_fp8 else ptr, "UNION": "*i32", "LENS": "*i32", "SINKS": "*fp32", "OUT": ptr,
        "LSE": "*fp32",
        "T": "i32", "H": "i32", "HB": "i32",
        "stride_qb": "i32", "stride_qt": "i32", "stride_qh": "i32", "stride_kvr": "i32",
        "stride_ug": "i32",
        "stride_ob": "i32", "stride_ot": "i32", "stride_oh": "i32",
        "stride_lb": "i32", "stride_lt": "i32", "stride_lh": "i32",
        "qk_scale": "fp32", "R": "i32", "K": "i32", "QS": "i32",
    }  # fmt: skip
    fn, constexprs, options = _kernel_args(
        cfg, group_size, v_dim, rope_dim, sinks, raw_rows=raw_rows, kv_fp8=kv_fp8, pdl=pdl
    )
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    # what the launcher's specialisation sees at run time: 16-byte aligned pointers and strides
    # (except the arguments it never specialises)
    aligned = [
        n for n in signature if (signature[n].startswith("*") or n.startswith("stride_")) and n not in NOT_SPECIALIZED
    ]
    return compile_sm90(fn, signature, constexprs, aligned=aligned, options=options)


__all__ = [
    "BLOCK_H",
    "CONSUMER_REGS",
    "FP8_CONSUMER_REGS",
    "GROUPED_CONFIG",
    "GluonConfig",
    "compile_for_sm90",
    "compile_kernel_for_sm90",
    "gluon_available",
    "gluon_config",
    "gluon_unavailable_reason",
    "gluon_unsupported_reason",
    "launch_gluon_attention",
    "stride_reason",
]
