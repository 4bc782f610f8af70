"""Gluon (``triton.experimental.gluon``) sparse-MLA prefill for Hopper (sm_90): launch, AOT compile.

Three kernels serve the per-query path of :mod:`shardattn.kernels.sparse_mla_triton` one level
lower. The routed ones (:func:`gluon_config`) are warp-specialised: per-query tiles run the
64-key kernel of :mod:`shardattn.kernels.sparse_mla_gluon_ws64` (2.0-2.2x the Triton kernel at
64 / 128 heads on an H200, benchmarks/RESULTS.md), grouped tiles the 32-key kernel of
:mod:`shardattn.kernels.sparse_mla_gluon_ws`. This module holds the simpler 8-warp variant (``"pipelined"``, as
fast as Triton; kept as the baseline the benchmark times), described here: a program owns one
query token and ``BLOCK_H = 64`` heads (128 heads: two programs per query) with two consumer
warpgroups (8 warps). It walks the token's sorted, de-duplicated rows
(``union[t, :lens[t]]`` from :func:`shardattn.kernels.union.build_union` with ``G = 1``)
``BLOCK_N`` at a time:

* every KV row (``Dv + Dr`` bf16, 576 for DSA models) is gathered with ``cp.async`` into a
  ``STAGES``-deep shared-memory ring (nope ``[BLOCK_N, Dv]`` and rope ``[BLOCK_N, Dr]`` parts,
  128-byte swizzled), ``STAGES - 1`` tiles ahead of the tile being consumed;
* ``S = Q K^T`` and ``O += P V`` run on ``wgmma`` (``warpgroup_mma``) with Q held in shared
  memory for the whole loop; the two warpgroups split S by key columns and O by value columns
  (``[64, 256]`` fp32 accumulators each, 128 registers), P passes between them through shared
  memory;
* the fp32 online softmax is the library's (base 2, ``(0, -inf)`` for an empty row, sinks
  folded in after the loop), masked past ``lens[t]``.

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
from shardattn.kernels.sparse_mla_gluon_ws import NOT_SPECIALIZED, WS_MAXNREG, WS_NUM_WARPS
from shardattn.kernels.sparse_mla_triton import launch_destinations, launch_strides
from shardattn.kernels.union import GROUP_SIZES, num_groups

if HAS_GLUON:
    import triton

    from shardattn.kernels.gluon_compat import async_load as _async_load
    from shardattn.kernels.gluon_compat import (
        cp,
        fence_async_shared,
        gl,
        gluon,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from shardattn.kernels.gluon_compat import cta_barrier as _cta_barrier
    from shardattn.kernels.gluon_compat import nvmma_layout as _nvmma

LOG2E = 1.4426950408889634
BLOCK_H = 64
NUM_WARPS = 8
KINDS = ("prefill",)
VARIANTS = ("pipelined", "ws", "ws64")


@dataclass(frozen=True)
class GluonConfig:
    """Compile-time shape of one Gluon prefill launch (part of the warm-up key).

    ``variant``: ``"pipelined"`` (this module's kernel: 8 warps, ``stages``-deep ring), ``"ws"``
    (:mod:`shardattn.kernels.sparse_mla_gluon_ws`: producer + two consumer warpgroups, a fixed
    4-slot ring; ``regs`` = registers of consumer WG1 and of the producer) or ``"ws64"``
    (:mod:`shardattn.kernels.sparse_mla_gluon_ws64`: 64-key blocks in pairs, per-query only;
    ``block_n`` 64).
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

    @property
    def label(self) -> str:
        flags = ("q" if self.prefetch_qk else "") + ("h" if self.heads_fastest else "")
        if self.variant == "ws64":
            return f"ws64r{self.regs[0]}{flags}" + ("k" if self.early_kv else "") + ("z" if self.opaque_slots else "")
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


#: The 32-key warp-specialised kernel: the grouped path (``G > 1``).
WS32_CONFIG = GluonConfig(32, 4, "ws", (224, 56), async_arrive=True)
#: The 64-key kernel on FlashMLA's schedule with opaque slot indices (no spilled wgmma
#: descriptors): per-query prefill (routed as :func:`gluon_config`: 1.22-1.29x ``WS32_CONFIG`` and
#: 1.06-1.12x the same kernel without opaque slots on an H200 at 64 / 128 heads,
#: benchmarks/RESULTS.md) and decode.
WS64_CONFIG = GluonConfig(64, 2, "ws64", (224, 56), opaque_slots=True)


def gluon_config(heads: int, d_v: int = 512, d_r: int = 64, group_size: int = 1) -> GluonConfig:
    """Tile of the Gluon prefill kernel for these shapes.

    DSA shapes (``Dv = 512``, ``Dr = 64``), one query per tile (``group_size = 1``): the 64-key
    kernel (:mod:`~shardattn.kernels.sparse_mla_gluon_ws64`; shared memory Q 72 KB + two 72 KB
    key blocks + an 8 KB P buffer), with a token's head blocks adjacent in the grid when it has
    more than one (``heads > 64``: its programs share the rows in L2; measured 1.06x at 128
    heads, T = 16K; with one head block the flag only costs a division, 0.96-0.98x at 64 heads);
    grouped tiles (``group_size > 1``): the 32-key kernel (Q 72 KB + a 4-slot ring of 36 KB +
    8 KB of P buffers). 64 heads per program, fewer pad it.
    """
    del d_v, d_r
    return replace(WS64_CONFIG, heads_fastest=heads > BLOCK_H) if group_size == 1 else WS32_CONFIG


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


if HAS_GLUON:

    @gluon.constexpr_function
    def _gather_layout(inner: int):
        """Blocked layout for ``[rows, inner]`` gathers: 16-byte vectors, a warp along one row."""
        tpc = min(32, inner // 8)
        return gl.BlockedLayout([1, 8], [32 // tpc, tpc], [NUM_WARPS, 1], [1, 0])

    @gluon.jit
    def _issue_tile(
        KV, u_base, n_len, stride_kvr, j, nope_ring, rope_ring,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr,
    ):  # fmt: skip
        """cp.async tile ``j`` of the row list into ring slot ``j % STAGES`` (zeros past ``n_len``)."""
        lv: gl.constexpr = _gather_layout(D_V)
        lr: gl.constexpr = _gather_layout(D_R)
        slot = j % STAGES
        n_v = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, lv))
        ok_v = n_v < n_len
        row_v = gl.load(u_base + n_v, mask=ok_v, other=0).to(gl.int64)
        dv = gl.arange(0, D_V, layout=gl.SliceLayout(0, lv))
        _async_load(nope_ring.index(slot), KV + row_v[:, None] * stride_kvr + dv[None, :], mask=ok_v[:, None])
        n_r = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, lr))
        ok_r = n_r < n_len
        row_r = gl.load(u_base + n_r, mask=ok_r, other=0).to(gl.int64)
        dr = gl.arange(0, D_R, layout=gl.SliceLayout(0, lr))
        _async_load(rope_ring.index(slot), KV + row_r[:, None] * stride_kvr + D_V + dr[None, :], mask=ok_r[:, None])
        cp.commit_group()

    @gluon.jit(do_not_specialize=NOT_SPECIALIZED)
    def _sparse_mla_gluon_fwd(
        Q, KV, UNION, LENS, SINKS, OUT, LSE,
        T, H, HB,
        stride_qb, stride_qt, stride_qh, stride_kvr, stride_ut,
        stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, stride_lh,
        qk_scale,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        D_V: gl.constexpr, D_R: gl.constexpr, HAS_SINK: gl.constexpr,
    ):  # fmt: skip
        BH: gl.constexpr = 64
        dtype: gl.constexpr = Q.dtype.element_ty
        t = gl.program_id(0).to(gl.int64)
        hb = gl.program_id(1)

        mma_s: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16]
        )
        mma_o: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D_V // 2, 16]
        )
        p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
        lv: gl.constexpr = _gather_layout(D_V)
        lr: gl.constexpr = _gather_layout(D_R)

        q_nope = gl.allocate_shared_memory(dtype, [BH, D_V], _nvmma(D_V, 16))
        q_rope = gl.allocate_shared_memory(dtype, [BH, D_R], _nvmma(D_R, 16))
        nope_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_V], _nvmma(D_V, 16))
        rope_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_R], _nvmma(D_R, 16))

        # Q tile (rows past H zero-filled), its own cp.async group
        h_v = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, lv))
        dv = gl.arange(0, D_V, layout=gl.SliceLayout(0, lv))
        row_v = t * stride_qt + (h_v // HB).to(gl.int64) * stride_qb + (h_v % HB).to(gl.int64) * stride_qh
        _async_load(q_nope, Q + row_v[:, None] + dv[None, :], mask=(h_v < H)[:, None])
        h_r = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, lr))
        dr = gl.arange(0, D_R, layout=gl.SliceLayout(0, lr))
        row_r = t * stride_qt + (h_r // HB).to(gl.int64) * stride_qb + (h_r % HB).to(gl.int64) * stride_qh
        _async_load(q_rope, Q + row_r[:, None] + D_V + dr[None, :], mask=(h_r < H)[:, None])
        cp.commit_group()

        n_len = gl.load(LENS + t)
        u_base = UNION + t * stride_ut
        for j0 in gl.static_range(STAGES - 1):
            _issue_tile(KV, u_base, n_len, stride_kvr, j0, nope_ring, rope_ring, BLOCK_N, STAGES, D_V, D_R)

        m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, mma_s))
        l_i = gl.zeros([BH], gl.float32, layout=gl.SliceLayout(1, mma_s))
        acc = gl.zeros([BH, D_V], gl.float32, layout=mma_o)
        s_zero = gl.zeros([BH, BLOCK_N], gl.float32, layout=mma_s)
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_s))
        n_tiles = gl.cdiv(n_len, BLOCK_N)
        for j in range(n_tiles):
            # slot (j - 1) % STAGES was consumed last iteration: every warp is past its wgmma
            _cta_barrier()
            _issue_tile(KV, u_base, n_len, stride_kvr, j + STAGES - 1, nope_ring, rope_ring, BLOCK_N, STAGES, D_V, D_R)
            cp.wait_group(STAGES - 1)
            _cta_barrier()
            fence_async_shared()
            slot = j % STAGES
            kn = nope_ring.index(slot)
            kr = rope_ring.index(slot)
            s = warpgroup_mma(q_nope, kn.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma(q_rope, kr.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            s = gl.where((j * BLOCK_N + cols < n_len)[None, :], s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=1))  # finite: a tile holds >= 1 valid key
            p = gl.exp2(s - m_new[:, None])
            alpha = gl.exp2(m_i - m_new)
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, mma_o))[:, None]
            pa = gl.convert_layout(p.to(dtype), p_op)
            acc = warpgroup_mma(pa, kn, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        cp.wait_group(0)

        h = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, mma_s))
        if HAS_SINK:
            sink = gl.load(SINKS + h, mask=h < H, other=0.0) * 1.4426950408889634
            m_f = gl.maximum(m_i, sink)
            alpha = gl.exp2(m_i - m_f)
            l_i = l_i * alpha + gl.exp2(sink - m_f)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, mma_o))[:, None]
            m_i = m_f
        has = l_i > 0.0
        l_safe = gl.where(has, l_i, 1.0)
        lse = gl.where(has, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        gl.store(LSE + t * stride_lt + (h // HB).to(gl.int64) * stride_lb + (h % HB) * stride_lh, lse, mask=h < H)
        out = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, mma_o))[:, None]
        h_o = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, mma_o))
        d_o = gl.arange(0, D_V, layout=gl.SliceLayout(0, mma_o))
        row_o = t * stride_ot + (h_o // HB).to(gl.int64) * stride_ob + (h_o % HB).to(gl.int64) * stride_oh
        o_ptr = OUT + row_o[:, None] + d_o[None, :]
        gl.store(o_ptr, out.to(dtype), mask=(h_o < H)[:, None])


def prefill_kernel():
    """The Gluon prefill kernel (for warm-up, compile counting and reports); needs Gluon."""
    return _sparse_mla_gluon_fwd


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the Gluon kernel on prepared unions (inputs already validated).

    ``q``, ``out`` and ``lse`` may each be *head-blocked*: ``[B, T, H/B, ...]`` holds head
    ``b * H/B + i`` of token ``t`` at ``[b, t, i]`` (an all-to-all receive or send buffer, read or
    written in place); otherwise ``[T, H, ...]``. Any 16-byte aligned strides, unit last-dim stride.

    Args:
        q: ``[T, H, D]`` or ``[B, T, H/B, D]`` bf16/fp16; kv: ``[R, D]``.
        union: ``[ceil(T/G), W]`` int32 from :func:`~shardattn.kernels.union.build_union` with
            ``group_size``: sorted unique valid rows per token (``G = 1``) or packed entries with
            one membership bit per query (``G > 1``); lens: ``[ceil(T/G)]`` int32 entries used.
        config: :func:`gluon_config` for ``group_size`` when None (``G > 1`` needs the ``"ws"`` variant).
        out / lse: optional destinations ``[T, H, v_dim]`` / ``[T, H]`` (or head-blocked), q's dtype / fp32.
        group_size: ``G`` queries per 64-row tile (``1, 2, 4, 8``; ``G > 1`` needs ``H <= 64 / G``).
    Returns:
        ``(out, lse)``: the given destinations, or new ``[T, H, v_dim]`` q.dtype and ``[T, H]`` fp32.
    """
    d = q.shape[-1]
    h = q.shape[0] * q.shape[2] if q.dim() == 4 else q.shape[1]
    cfg = config or gluon_config(h, v_dim, d - v_dim, group_size)
    if group_size > 1 and (cfg.variant != "ws" or h > BLOCK_H // group_size):  # ws64 is per-query
        raise ValueError(f"group_size={group_size} needs the 'ws' variant and <= {BLOCK_H // group_size} heads")
    t, h, out, lse = launch_destinations(q, v_dim, out, lse)
    if t == 0 or h == 0:
        return out, lse
    hb, q_strides, out_strides, lse_strides = launch_strides(h, q, out, lse)
    strides = (*q_strides, kv.stride(0), union.stride(0), *out_strides, *lse_strides)
    heads_per_tile = BLOCK_H // group_size
    grid = (num_groups(t, group_size), triton.cdiv(h, heads_per_tile))
    if cfg.warp_specialized and cfg.heads_fastest:  # 1-D grid, a query's head blocks adjacent
        grid = (grid[0] * grid[1],)
    fn, constexprs, options = _kernel_args(cfg, group_size, v_dim, d - v_dim, sinks is not None)
    sink_arg = sinks if sinks is not None else lse
    fn[grid](q, kv, union, lens, sink_arg, out, lse, t, h, hb, *strides, scale * LOG2E, **constexprs, **options)
    return out, lse


def _kernel_args(cfg: GluonConfig, group_size: int, v_dim: int, rope_dim: int, sinks: bool):
    """``(kernel, constexpr arguments, launch options)`` of a configuration (the launcher's and the
    AOT compile's)."""
    common = {"D_V": v_dim, "D_R": rope_dim, "HAS_SINK": sinks}
    flags = {"PREFETCH_QK": cfg.prefetch_qk, "HEADS_FASTEST": cfg.heads_fastest}
    options = {"num_warps": WS_NUM_WARPS, "maxnreg": WS_MAXNREG}
    if cfg.variant == "ws64":
        from shardattn.kernels.sparse_mla_gluon_ws64 import ws64_kernel

        ws64 = {"EARLY_KV": cfg.early_kv, "OPAQUE_SLOTS": cfg.opaque_slots}
        return ws64_kernel(), {**common, "CONSUMER_REGS": cfg.regs[0], **flags, **ws64}, options
    if cfg.variant == "ws":
        from shardattn.kernels.sparse_mla_gluon_ws import ws_kernel

        regs = {"WG1_REGS": cfg.regs[0], "LOAD_REGS": cfg.regs[1], "ASYNC_ARRIVE": cfg.async_arrive}
        return ws_kernel(), {"G": group_size, "BLOCK_N": cfg.block_n, **common, **regs, **flags}, options
    tile = {"BLOCK_N": cfg.block_n, "STAGES": cfg.stages}
    return _sparse_mla_gluon_fwd, {**tile, **common}, {"num_warps": NUM_WARPS}


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
):
    """Compile a Gluon kernel variant for sm_90 ahead of time (no GPU needed); returns its PTX.

    Args:
        kind: ``"prefill"`` (the only Gluon kernel so far).
        heads: query heads per rank (the tile is 64 rows: ``64 / group_size`` heads of
            ``group_size`` queries; at most that many heads when ``group_size > 1``).
        group_size: queries per tile, ``1`` (per-query) or ``2 / 4 / 8`` (grouped: the union's
            packed entries and membership masks; the ``"ws"`` variant only).
    Returns:
        The PTX text of the compiled kernel.
    Raises:
        ValueError: an unknown ``kind``, an unsupported ``group_size`` or too many heads for it.
        RuntimeError: Gluon is not available in the installed Triton.
    """
    return compile_kernel_for_sm90(
        kind, heads, group_size, v_dim=v_dim, rope_dim=rope_dim, sinks=sinks, dtype=dtype, config=config
    ).asm["ptx"]


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
    if group_size > 1 and cfg.variant != "ws":
        raise ValueError(f"group_size={group_size} needs the 'ws' variant, got {cfg.variant!r}")
    why = gluon_available()
    if why is not None:
        raise RuntimeError(why)
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

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
    fn, constexprs, options = _kernel_args(cfg, group_size, v_dim, rope_dim, sinks)
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    # what the launcher's specialisation sees at run time: 16-byte aligned pointers and strides
    # (except the arguments it never specialises)
    names = list(signature)
    aligned = [
        n for n in names if (signature[n].startswith("*") or n.startswith("stride_")) and n not in NOT_SPECIALIZED
    ]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = GluonASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


__all__ = [
    "BLOCK_H",
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
