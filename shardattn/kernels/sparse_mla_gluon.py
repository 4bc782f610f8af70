"""Gluon (``triton.experimental.gluon``) sparse-MLA prefill for Hopper (sm_90): launch, AOT compile.

Three kernels serve the per-query path of :mod:`shardattn.kernels.sparse_mla_triton` one level
lower. The routed one (:func:`gluon_config`) is the warp-specialised 64-key kernel of
:mod:`shardattn.kernels.sparse_mla_gluon_ws64`, for per-query tiles (2.0-2.2x the Triton kernel at
64 / 128 heads on an H200, docs/PERFORMANCE.md) and grouped ones (:data:`GROUPED_CONFIG`). The
32-key kernel of :mod:`shardattn.kernels.sparse_mla_gluon_ws` and the simpler 8-warp variant
(``"pipelined"``, :mod:`shardattn.kernels.sparse_mla_gluon_pipelined`, as fast as Triton) stay as
the baselines the benchmarks time.
This module holds what they share: the configurations (:class:`GluonConfig`), the launcher
(:func:`launch_gluon_attention`: unions, or raw rows on the 64-key kernel) and the AOT compile.

Outputs follow :func:`shardattn.kernels.sparse_mla.sparse_mla_attention`: ``out [T, H, Dv]`` in
q's dtype, ``lse [T, H]`` fp32 natural log. Inputs: bf16/fp16 ``q [T, H, Dv + Dr]`` and
``kv [R, Dv + Dr]`` with unit last stride, ``Dv = 512`` and ``Dr = 64`` (DSA models; other
shapes take the Triton kernel: :func:`gluon_supports` says why a case does not run).

:func:`compile_for_sm90` compiles a kernel variant ahead of time for sm_90 with no GPU and
returns its PTX (CI runs it, so a Gluon API change fails there).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from shardattn.kernels.gluon_compat import GLUON_IMPORT_ERROR as _GLUON_IMPORT_ERROR
from shardattn.kernels.gluon_compat import HAS_GLUON
from shardattn.kernels.prepared_union import PreparedUnion, union_for_call
from shardattn.kernels.sparse_mla_gluon_pipelined import NUM_WARPS
from shardattn.kernels.sparse_mla_gluon_ws import NOT_SPECIALIZED, WS_MAXNREG, WS_NUM_WARPS
from shardattn.kernels.sparse_mla_triton import launch_destinations, launch_strides
from shardattn.kernels.union import GROUP_SIZES, num_groups

if HAS_GLUON:
    import triton

LOG2E = 1.4426950408889634
BLOCK_H = 64
KINDS = ("prefill",)
VARIANTS = ("pipelined", "ws", "ws64")


@dataclass(frozen=True)
class GluonConfig:
    """Compile-time shape of one Gluon prefill launch (part of the warm-up key).

    ``variant``: ``"pipelined"`` (:mod:`shardattn.kernels.sparse_mla_gluon_pipelined`: 8 warps,
    ``stages``-deep ring), ``"ws"``
    (:mod:`shardattn.kernels.sparse_mla_gluon_ws`: producer + two consumer warpgroups, a fixed
    4-slot ring; ``regs`` = registers of consumer WG1 and of the producer) or ``"ws64"``
    (:mod:`shardattn.kernels.sparse_mla_gluon_ws64`: 64-key blocks in pairs, per-query or grouped;
    ``block_n`` 64; ``staged_out``: each consumer warpgroup stores its output columns through a
    key buffer it alone still reads, 16 bytes per thread, instead of 4 from the accumulator;
    ``persistent``: one program per SM walks tile after tile, the next tile's first key pair
    gathered while this one ends, its output staged through Q's buffers).
    """

    block_n: int = 64
    stages: int = 2
    variant: str = "pipelined"
    regs: tuple[int, int] = (224, 56)
    async_arrive: bool = True
    prefetch_qk: bool = False
    heads_fastest: bool = False
    early_kv: bool = False
    opaque_slots: bool = False
    staged_out: bool = False
    persistent: bool = False

    @property
    def label(self) -> str:
        flags = ("q" if self.prefetch_qk else "") + ("h" if self.heads_fastest else "")
        if self.variant == "ws64":
            options = (("k", self.early_kv), ("z", self.opaque_slots), ("s", self.staged_out), ("P", self.persistent))
            return f"ws64r{self.regs[0]}{flags}" + "".join(c for c, on in options if on)
        if self.variant == "ws":
            return f"ws{self.block_n}r{self.regs[0]}{'a' if self.async_arrive else 'w'}{flags}"
        return f"p{self.block_n}x{self.stages}"

    @property
    def block_h(self) -> int:
        return BLOCK_H

    @property
    def num_warps(self) -> int:
        return NUM_WARPS if self.variant == "pipelined" else WS_NUM_WARPS

    @property
    def warp_specialized(self) -> bool:
        return self.variant != "pipelined"


#: The 32-key warp-specialised kernel (the grouped path before the 64-key kernel took groups).
WS32_CONFIG = GluonConfig(32, 4, "ws", (224, 56), async_arrive=True)
#: The 64-key kernel on FlashMLA's schedule with opaque slot indices (no spilled wgmma
#: descriptors) and its output stored through shared memory in 16-byte pieces: per-query prefill
#: (routed as :func:`gluon_config`: 1.22-1.29x ``WS32_CONFIG`` and 1.06-1.12x the same kernel
#: without opaque slots on an H200 at 64 / 128 heads; the staged output 1.04-1.05x at the power
#: limit, half the L2 write sectors; docs/DECISIONS.md, D2 and D4) and decode.
WS64_CONFIG = GluonConfig(64, 2, "ws64", (224, 56), opaque_slots=True, staged_out=True)
#: Grouped tiles (``G > 1``): the 64-key kernel with membership masks, measured on an H200 at 8 /
#: 16 / 32 heads (G = 8 / 4 / 2), T = 4K / 16K: kernel 1.27-1.39x and step (union build
#: included) 1.13-1.29x the 32-key kernel's (docs/DECISIONS.md, D10).
GROUPED_CONFIG = WS64_CONFIG


def gluon_config(heads: int, d_v: int = 512, d_r: int = 64, group_size: int = 1) -> GluonConfig:
    """Tile of the Gluon prefill kernel for these shapes.

    DSA shapes (``Dv = 512``, ``Dr = 64``), one query per tile (``group_size = 1``): the 64-key
    kernel (:mod:`~shardattn.kernels.sparse_mla_gluon_ws64`; shared memory Q 72 KB + two 72 KB
    key blocks + an 8 KB P buffer), with a token's head blocks adjacent in the grid when it has
    more than one (``heads > 64``: its programs share the rows in L2; measured 1.06x at 128
    heads, T = 16K; with one head block the flag only costs a division, 0.96-0.98x at 64 heads) and
    Q loaded by the producer ahead of the first gathers (``early_kv``: 1.014-1.018x at 128 heads,
    level at 64, at the power limit), one program per SM walking tiles in turn (``persistent``:
    the next tile's first key pair gathered during this one's epilogue, a program's first tile
    loading Q before its first gathers; at the power limit 1.00-1.02x at 64 / 128 heads, L2-flushed
    bursts 1.00-1.05x at top-k 2,048 and up to 1.23x at 256; docs/DECISIONS.md, D5-D6);
    grouped tiles (``group_size > 1``): the same kernel, ``64 / G`` heads of ``G`` queries per
    tile, each row masked to its query's keys (:data:`GROUPED_CONFIG`). 64 rows per program,
    fewer pad it.
    """
    del d_v, d_r
    two_blocks = heads > BLOCK_H
    if group_size > 1:
        return GROUPED_CONFIG
    return replace(WS64_CONFIG, heads_fastest=two_blocks, early_kv=two_blocks, persistent=True)


@functools.lru_cache(maxsize=1)
def gluon_available() -> str | None:
    """``None`` when Triton's Gluon with the Hopper ops imports, else why not (cached)."""
    return None if HAS_GLUON else f"triton.experimental.gluon unavailable ({_GLUON_IMPORT_ERROR})"


def gluon_supports(q: torch.Tensor, kv: torch.Tensor, v_dim: int) -> str | None:
    """``None`` when the Gluon kernel runs these tensors, else the reason it does not.

    ``q``: ``[T, H, D]`` or head-blocked ``[B, T, H/B, D]`` (every stride but the last is checked
    for the 16-byte alignment cp.async needs); ``kv``: ``[R, D]``.
    """
    why = gluon_available()
    if why is not None:
        return why
    if q.device.type != "cuda":
        return f"tensor on {q.device} (the Gluon kernel needs CUDA)"
    major = torch.cuda.get_device_capability(q.device)[0]
    if major != 9:
        return f"compute capability {major}.x (the Gluon kernel is written for sm_90 wgmma)"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {q.dtype} (the Gluon kernel takes bf16/fp16)"
    d_r = q.shape[-1] - v_dim
    if (v_dim, d_r) != (512, 64):
        return f"head dims {v_dim} + {d_r} (the Gluon kernel is built and checked for DSA's 512 + 64)"
    if q.stride(-1) != 1 or kv.stride(-1) != 1:
        return "q and kv need a unit last-dim stride"
    if any((st * q.element_size()) % 16 for st in q.stride()[:-1]) or q.data_ptr() % 16:
        return "q rows must be 16-byte aligned for cp.async"
    if (kv.stride(0) * kv.element_size()) % 16 or kv.data_ptr() % 16:
        return "kv rows must be 16-byte aligned for cp.async"
    return None


def prefill_kernel():
    """The 8-warp Gluon prefill kernel (for warm-up, compile counting and reports); needs Gluon."""
    from shardattn.kernels.sparse_mla_gluon_pipelined import pipelined_kernel

    return pipelined_kernel()


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the Gluon kernel on prepared unions, or on raw rows (inputs already validated).

    ``q``, ``out`` and ``lse`` may each be *head-blocked*: ``[B, T, H/B, ...]`` holds head
    ``b * H/B + i`` of token ``t`` at ``[b, t, i]`` (an all-to-all receive or send buffer, read or
    written in place); otherwise ``[T, H, ...]``. Any 16-byte aligned strides, unit last-dim stride.

    Args:
        q: ``[T, H, D]`` or ``[B, T, H/B, D]`` bf16/fp16; kv: ``[R, D]``.
        union: ``[ceil(T/G), W]`` int32 from :func:`~shardattn.kernels.union.build_union` with
            ``group_size``: sorted unique valid rows per token (``G = 1``) or packed entries with
            one membership bit per query (``G > 1``); lens: ``[ceil(T/G)]`` int32 entries used.
            With ``raw_rows``: union is the caller's ``[T, K]`` rows (invalid entries, ``< 0`` or
            ``>= R``, anywhere; a duplicate counts twice) and lens its ``topk_length`` or None.
        config: :func:`gluon_config` for ``group_size`` when None (``G > 1`` and ``raw_rows`` need
            a warp-specialised variant; ``raw_rows`` the ``"ws64"`` one).
        out / lse: optional destinations ``[T, H, v_dim]`` / ``[T, H]`` (or head-blocked), q's dtype / fp32.
        group_size: ``G`` queries per 64-row tile (``1, 2, 4, 8``; ``G > 1`` needs ``H <= 64 / G``).
        raw_rows: attend ``union`` as raw rows, masked per entry (no union build, no packing).
    Returns:
        ``(out, lse)``: the given destinations, or new ``[T, H, v_dim]`` q.dtype and ``[T, H]`` fp32.
    """
    d = q.shape[-1]
    h = q.shape[0] * q.shape[2] if q.dim() == 4 else q.shape[1]
    cfg = config or gluon_config(h, v_dim, d - v_dim, group_size)
    if group_size > 1 and (not cfg.warp_specialized or h > BLOCK_H // group_size):
        raise ValueError(
            f"group_size={group_size} needs a warp-specialised variant and <= {BLOCK_H // group_size} heads"
        )
    if raw_rows and (cfg.variant != "ws64" or group_size != 1):
        raise ValueError("raw_rows needs the 'ws64' variant and group_size=1")
    _check_persistent(cfg)
    t, h, out, lse = launch_destinations(q, v_dim, out, lse)
    if t == 0 or h == 0:
        return out, lse
    hb, q_strides, out_strides, lse_strides = launch_strides(h, q, out, lse)
    strides = (*q_strides, kv.stride(0), union.stride(0), *out_strides, *lse_strides)
    heads_per_tile = BLOCK_H // group_size
    grid = (num_groups(t, group_size), triton.cdiv(h, heads_per_tile))
    if cfg.persistent:  # one program per SM (one fits: 225 KB of shared memory), tiles in turn
        grid = (min(grid[0] * grid[1], _num_sms(q.device)),)
    elif cfg.warp_specialized and cfg.heads_fastest:  # 1-D grid, a query's head blocks adjacent
        grid = (grid[0] * grid[1],)
    fn, constexprs, options = _kernel_args(
        cfg, group_size, v_dim, d - v_dim, sinks is not None, raw_rows=raw_rows, has_lens=lens is not None
    )
    sink_arg = sinks if sinks is not None else lse
    lens_arg = lens if lens is not None else union
    extra = (kv.shape[0], union.shape[1]) if cfg.variant == "ws64" else ()  # R, K
    fn[grid](
        q, kv, union, lens_arg, sink_arg, out, lse, t, h, hb, *strides, scale * LOG2E, *extra, **constexprs, **options
    )  # fmt: skip
    return out, lse


def _check_persistent(cfg: GluonConfig) -> None:
    if cfg.persistent and (cfg.variant != "ws64" or cfg.prefetch_qk):
        raise ValueError(f"persistent needs the 'ws64' variant without prefetch_qk, got {cfg.label}")


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _kernel_args(
    cfg: GluonConfig,
    group_size: int,
    v_dim: int,
    rope_dim: int,
    sinks: bool,
    *,
    raw_rows: bool = False,
    has_lens: bool = True,
):
    """``(kernel, constexpr arguments, launch options)`` of a configuration (the launcher's and the
    AOT compile's)."""
    common = {"D_V": v_dim, "D_R": rope_dim, "HAS_SINK": sinks}
    flags = {"PREFETCH_QK": cfg.prefetch_qk, "HEADS_FASTEST": cfg.heads_fastest}
    options = {"num_warps": WS_NUM_WARPS, "maxnreg": WS_MAXNREG}
    if cfg.variant == "ws64":
        from shardattn.kernels.sparse_mla_gluon_ws64 import ws64_kernel

        ws64 = {"EARLY_KV": cfg.early_kv, "OPAQUE_SLOTS": cfg.opaque_slots, "STAGED_OUT": cfg.staged_out,
                "G": group_size, "RAW_ROWS": raw_rows, "PERSISTENT": cfg.persistent}  # fmt: skip
        ws64["HAS_LENS"] = has_lens or not raw_rows
        return ws64_kernel(), {**common, "CONSUMER_REGS": cfg.regs[0], **flags, **ws64}, options
    if cfg.variant == "ws":
        from shardattn.kernels.sparse_mla_gluon_ws import ws_kernel

        regs = {"WG1_REGS": cfg.regs[0], "LOAD_REGS": cfg.regs[1], "ASYNC_ARRIVE": cfg.async_arrive}
        return ws_kernel(), {"G": group_size, "BLOCK_N": cfg.block_n, **common, **regs, **flags}, options
    tile = {"BLOCK_N": cfg.block_n, "STAGES": cfg.stages}
    return prefill_kernel(), {**tile, **common}, {"num_warps": NUM_WARPS}


def sparse_mla_gluon(
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    *,
    scale: float,
    v_dim: int = 512,
    topk_length: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    config: GluonConfig | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    prepared: PreparedUnion | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-query Gluon path: rows sorted and de-duplicated (``G = 1`` union), then attended.

    Inputs must already be validated (the public entry is
    :func:`shardattn.kernels.sparse_mla.sparse_mla_attention`).

    Args:
        q: ``[T, H, D]`` bf16/fp16 (or head-blocked ``[B, T, H/B, D]``); kv: ``[R, D]``; rows:
            ``[T, K]`` int32 global rows (-1 / out of range invalid, anywhere); topk_length:
            ``[T]`` int32 or None; sinks: ``[H]`` fp32.
        out / lse: optional destinations, plain or head-blocked (:func:`launch_gluon_attention`).
        prepared: the ``G = 1`` union of ``rows`` built ahead (checked by the caller), else built here.
    Returns:
        ``(out [T, H, v_dim] q.dtype, lse [T, H] fp32)`` (the given destinations when passed).
    """
    union, lens = union_for_call(prepared, rows, group_size=1, num_kv_rows=kv.shape[0], topk_length=topk_length)
    return launch_gluon_attention(
        q, kv, union, lens, scale=scale, v_dim=v_dim, config=config, sinks=sinks, out=out, lse=lse
    )


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
):
    """Compile a Gluon kernel variant for sm_90 ahead of time (no GPU needed); returns its PTX.

    Args:
        kind: ``"prefill"`` (the only Gluon kernel so far).
        heads: query heads per rank (the tile is 64 rows: ``64 / group_size`` heads of
            ``group_size`` queries; at most that many heads when ``group_size > 1``).
        group_size: queries per tile, ``1`` (per-query) or ``2 / 4 / 8`` (grouped: the union's
            packed entries and membership masks; a warp-specialised variant).
        config: the variant (default :func:`gluon_config`'s); raw_rows: the ``"ws64"`` kernel's
            raw-row mode (rows masked per entry, as decode launches it).
    Returns:
        The PTX text of the compiled kernel.
    Raises:
        ValueError: an unknown ``kind``, an unsupported ``group_size`` or too many heads for it.
        RuntimeError: Gluon is not available in the installed Triton.
    """
    return compile_kernel_for_sm90(
        kind, heads, group_size, v_dim=v_dim, rope_dim=rope_dim, sinks=sinks, dtype=dtype, config=config,
        raw_rows=raw_rows,
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
    if group_size > 1 and not cfg.warp_specialized:
        raise ValueError(f"group_size={group_size} needs a warp-specialised variant, got {cfg.variant!r}")
    if raw_rows and (cfg.variant != "ws64" or group_size != 1):
        raise ValueError(f"raw_rows needs the 'ws64' variant and group_size=1, got {cfg.variant!r}, {group_size}")
    _check_persistent(cfg)
    why = gluon_available()
    if why is not None:
        raise RuntimeError(why)
    from shardattn.kernels.gluon_compat import compile_sm90

    ptr = f"*{dtype}"
    ws = cfg.warp_specialized
    signature = {
        "Q": ptr, "KV": ptr, "UNION": "*i32", "LENS": "*i32", "SINKS": "*fp32", "OUT": ptr, "LSE": "*fp32",
        "T": "i32", "H": "i32", "HB": "i32",
        "stride_qb": "i32", "stride_qt": "i32", "stride_qh": "i32", "stride_kvr": "i32",
        "stride_ug" if ws else "stride_ut": "i32",
        "stride_ob": "i32", "stride_ot": "i32", "stride_oh": "i32",
        "stride_lb": "i32", "stride_lt": "i32", "stride_lh": "i32",
        "qk_scale": "fp32",
    }  # fmt: skip
    if cfg.variant == "ws64":
        signature.update({"R": "i32", "K": "i32"})
    fn, constexprs, options = _kernel_args(cfg, group_size, v_dim, rope_dim, sinks, raw_rows=raw_rows)
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    # what the launcher's specialisation sees at run time: 16-byte aligned pointers and strides
    # (except the arguments it never specialises)
    aligned = [
        n for n in signature if (signature[n].startswith("*") or n.startswith("stride_")) and n not in NOT_SPECIALIZED
    ]
    return compile_sm90(fn, signature, constexprs, aligned=aligned, options=options)


__all__ = [
    "BLOCK_H",
    "GROUPED_CONFIG",
    "WS32_CONFIG",
    "WS64_CONFIG",
    "GluonConfig",
    "compile_for_sm90",
    "compile_kernel_for_sm90",
    "gluon_available",
    "gluon_config",
    "gluon_supports",
    "launch_gluon_attention",
    "prefill_kernel",
    "sparse_mla_gluon",
]
