"""Small-batch sparse-MLA decode at <= 16 heads on one or two warpgroups (sm_90, Gluon): kernel and launcher.

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
The torch reference is :func:`~shardattn.ops.sparse_mla.sparse_mla_reference`.
"""

from __future__ import annotations

import torch

from shardattn.kernels.gluon.compat import HAS_GLUON
from shardattn.kernels.triton.kv_fp8_read import ROPE_OFFSET, SCALE_OFFSET
from shardattn.kernels.triton.lse_merge import launch_lse_merge_columns, split_partials
from shardattn.plan.crossovers import SMALL_MERGE_COLUMNS, SMALL_MERGE_WARPS
from shardattn.plan.decode_routing import SMALL_DECODE_MAX_SPLITS, small_decode_heads, small_decode_tiles

__all__ = [
    "MAX_HEADS",
    "MAX_SPLITS",
    "compile_for_sm90",
    "launch_small_split",
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


def _resolve_warps(block_n: int, warps: int | None) -> int:
    """``warps``, or :func:`small_decode_warps` when None; a warpgroup needs 64 of the split's entries.

    Raises:
        ValueError: ``warps`` is not 4 or 8, or 8 with ``block_n`` below 128.
    """
    if warps is None:
        return small_decode_warps(block_n)
    if warps not in (4, 8) or warps * 16 > block_n:
        raise ValueError(f"warps must be 4, or 8 with block_n >= 128 (one warpgroup per 64 entries); got "
                         f"warps={warps}, block_n={block_n}")  # fmt: skip
    return warps


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
    from shardattn.kernels.gluon.compat import (
        async_load,
        cp,
        cta_barrier,
        fence_async_shared,
        gl,
        gluon,
        grid_dependency,
        nvmma_layout,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    # byte offsets of the scales and the rope values in an fp8_ds_mla row (shardattn.ops.kv_fp8)
    FP8_SCALE_OFFSET = gl.constexpr(SCALE_OFFSET)
    FP8_ROPE_OFFSET = gl.constexpr(ROPE_OFFSET)

    @gluon.constexpr_function
    def _acc_layout(heads: int, warps: int):
        """The ``wgmma`` accumulator with ``heads`` as N and rows / value columns as M, split over
        ``warps // 4`` warpgroups along M."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, heads, 16])

    @gluon.constexpr_function
    def _gather_layout(cols: int, warps: int):
        """``[rows, cols]`` bf16 / fp16 loads of 16 B a thread, a warp across ``min(cols, 256)`` columns."""
        across = min(32, cols // 8)
        return gl.BlockedLayout([1, 8], [32 // across, across], [warps, 1], [1, 0])

    @gluon.constexpr_function
    def _latent_layout(cols: int, warps: int, kv_fp8: bool):
        """The layout of one latent chunk ``[rows, cols]`` as it is read: 16 bytes a thread, 8 bf16 /
        fp16 values (:func:`_gather_layout`) or 16 fp8 codes (8 threads across 128 columns)."""
        if kv_fp8:
            return gl.BlockedLayout([1, 16], [32 // (cols // 16), cols // 16], [warps, 1], [1, 0])
        return _gather_layout(cols, warps)

    @gluon.jit
    def _fp8_chunk(KV, r, is_key, stride_kvr, c: gl.constexpr, CW: gl.constexpr, layout: gl.constexpr):
        """Latent chunk ``c`` (``CW`` = 128 codes, one scale tile) of the ``fp8_ds_mla`` rows ``r``:
        ``(codes [rows, CW] fp8, scale [rows] fp32)``, loaded into registers (16 bytes a thread);
        entries that are no key read 0."""
        cols = gl.arange(0, CW, layout=gl.SliceLayout(0, layout))
        row = KV + r.to(gl.int64) * stride_kvr
        codes = gl.load((row[:, None] + c * CW + cols[None, :]).to(gl.pointer_type(gl.float8e4nv)),
                        mask=is_key[:, None], other=0.0)  # fmt: skip
        scale = gl.load((row + FP8_SCALE_OFFSET + 4 * c).to(gl.pointer_type(gl.float32)), mask=is_key, other=0.0)
        return codes, scale

    @gluon.jit
    def _fp8_chunk_qk(k_nope, q_nope, codes, scale, s, c: gl.constexpr, CW: gl.constexpr):
        """Chunk ``c``'s latent values (``dtype(fp32(code) * scale)``) into its columns of ``k_nope``
        (the swizzled ``wgmma`` operand), fenced for the async proxy and synchronised across the
        program, then its part of ``S^T = K Q^T`` issued (async) into ``s``."""
        chunk = k_nope.slice(c * CW, CW, dim=1)
        chunk.store((codes.to(gl.float32) * scale[:, None]).to(k_nope.dtype))
        fence_async_shared()
        cta_barrier()
        return warpgroup_mma(chunk, q_nope.slice(c * CW, CW, dim=1).permute((1, 0)), s, is_async=True)

    @gluon.jit
    def _p_operand(dtype: gl.constexpr, BLOCK_N: gl.constexpr, HP: gl.constexpr):
        """Shared memory for ``P^T [BLOCK_N, HP]``, the B operand of ``O^T = V^T P^T``: rows-minor
        (32-byte swizzle) at 16 heads; at 8 a heads-minor row is 16 bytes, which no swizzle takes, so
        the buffer is ``[HP, BLOCK_N]`` and P^T is its transpose (entries-minor, as Q^T is)."""
        if HP >= 16:
            p_t = gl.allocate_shared_memory(dtype, [BLOCK_N, HP], nvmma_layout(HP, 16))
        else:
            p_t = gl.allocate_shared_memory(dtype, [HP, BLOCK_N], nvmma_layout(BLOCK_N, 16)).permute((1, 0))
        return p_t

    @gluon.jit
    def _entries(Rows, TopkLen, tok, split, stride_rt, stride_rk, K, R, BLOCK_N: gl.constexpr,
                 EVEN_K: gl.constexpr, HAS_TOPK_LEN: gl.constexpr, layout: gl.constexpr):  # fmt: skip
        """``(row, is_key)`` of the split's ``BLOCK_N`` entries in ``layout``: an entry past the
        row's top-k (``K`` or ``topk_length``) or outside ``[0, R)`` is no key (its row reads 0).
        ``EVEN_K``: ``K`` is a multiple of ``BLOCK_N``, so the index load needs no mask (a masked
        one measured slower, docs/PERFORMANCE.md)."""
        pos = split * BLOCK_N + gl.arange(0, BLOCK_N, layout=layout)
        k_len = K
        if HAS_TOPK_LEN:
            k_len = gl.minimum(gl.load(TopkLen + tok), K)
        if EVEN_K:
            r = gl.load(Rows + tok.to(gl.int64) * stride_rt + pos * stride_rk)
        else:
            r = gl.load(Rows + tok.to(gl.int64) * stride_rt + pos * stride_rk, mask=pos < K, other=-1)
        is_key = (pos < k_len) & (r >= 0) & (r < R)
        return gl.where(is_key, r, 0), is_key

    @gluon.jit
    def _small_split_kernel(Q, KV, Rows, TopkLen, Sinks, Out, Lse,
                            stride_qt, stride_qh, stride_kvr, stride_rt, stride_rk, K, R, H, HG,
                            stride_os, stride_ot, stride_oh, stride_ls, stride_lt, stride_lh, qk_scale,
                            HP: gl.constexpr, BLOCK_N: gl.constexpr, DV: gl.constexpr, DR: gl.constexpr,
                            EVEN_K: gl.constexpr, HAS_TOPK_LEN: gl.constexpr, HAS_SINKS: gl.constexpr,
                            PDL: gl.constexpr, NCHUNK: gl.constexpr, W: gl.constexpr,
                            KV_FP8: gl.constexpr = False):  # fmt: skip
        """One (token, split, group of ``HG`` heads): gather, ``S^T = K Q^T``, softmax per head,
        ``O^T = V^T P^T``, store. ``HP``: the ``wgmma`` N the group is padded to (8 or 16).
        ``KV_FP8``: ``KV`` holds ``fp8_ds_mla`` rows (uint8, ``stride_kvr`` bytes), dequantised
        into ``k_nope`` chunk by chunk (module docstring)."""
        gl.static_assert(not KV_FP8 or (DV == 512 and DR == 64 and NCHUNK == 4),
                         "fp8_ds_mla rows: 512 latent columns in 4 chunks of one scale tile each, 64 rope")  # fmt: skip
        if PDL:  # the grid before this one (a union build, an indexer) wrote q / rows: wait for it
            grid_dependency("griddepcontrol.wait")
        tok = gl.program_id(0)
        split = gl.program_id(1)
        h0 = gl.program_id(2) * HG  # this program's first head
        n_h = gl.minimum(H - h0, HG)  # and how many it holds
        dtype: gl.constexpr = Q.dtype.element_ty
        gather_v: gl.constexpr = _gather_layout(DV, W)  # [HP, 512]: 16 B a thread
        gather_r: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])  # [*, 64]
        s_layout: gl.constexpr = _acc_layout(HP, W)
        k_nope = gl.allocate_shared_memory(dtype, [BLOCK_N, DV], nvmma_layout(DV, 16))
        k_rope = gl.allocate_shared_memory(dtype, [BLOCK_N, DR], nvmma_layout(DR, 16))
        q_nope = gl.allocate_shared_memory(dtype, [HP, DV], nvmma_layout(DV, 16))
        q_rope = gl.allocate_shared_memory(dtype, [HP, DR], nvmma_layout(DR, 16))
        p_t = _p_operand(dtype, BLOCK_N, HP)

        # every row of the split and the token's Q in flight at once (invalid entries zero-filled), as
        # 1 + NCHUNK commit groups: Q and the rope columns, then the 512 latent columns in NCHUNK
        # column chunks, so Q.K^T runs on each chunk while the later ones are still arriving. The
        # split's indices are read once per layout that uses them (256-512 B, cached after the first)
        # rather than moved between layouts through shared memory
        cw: gl.constexpr = DV // NCHUNK
        gather_c: gl.constexpr = _latent_layout(cw, W, KV_FP8)
        r_c, key_c = _entries(Rows, TopkLen, tok, split, stride_rt, stride_rk, K, R, BLOCK_N, EVEN_K, HAS_TOPK_LEN,
                              gl.SliceLayout(1, gather_c))  # fmt: skip
        r_r, key_r = _entries(Rows, TopkLen, tok, split, stride_rt, stride_rk, K, R, BLOCK_N, EVEN_K, HAS_TOPK_LEN,
                              gl.SliceLayout(1, gather_r))  # fmt: skip
        _r_s, key_s = _entries(Rows, TopkLen, tok, split, stride_rt, stride_rk, K, R, BLOCK_N, EVEN_K, HAS_TOPK_LEN,
                               gl.SliceLayout(1, s_layout))  # fmt: skip
        cols_v = gl.arange(0, DV, layout=gl.SliceLayout(0, gather_v))
        cols_r = gl.arange(0, DR, layout=gl.SliceLayout(0, gather_r))
        q_base = Q + tok.to(gl.int64) * stride_qt + h0 * stride_qh
        h_v = gl.arange(0, HP, layout=gl.SliceLayout(1, gather_v))
        h_r = gl.arange(0, HP, layout=gl.SliceLayout(1, gather_r))
        async_load(q_nope, q_base + h_v[:, None] * stride_qh + cols_v[None, :], mask=(h_v < n_h)[:, None])
        async_load(q_rope, q_base + h_r[:, None] * stride_qh + DV + cols_r[None, :], mask=(h_r < n_h)[:, None])
        if KV_FP8:
            # the rope columns (bf16 at byte 528) with Q as one cp.async group; every latent code and
            # scale of the split into registers, 16 bytes a thread, issued at once
            fp8_row = KV + r_r.to(gl.int64)[:, None] * stride_kvr + FP8_ROPE_OFFSET
            async_load(k_rope, fp8_row.to(gl.pointer_type(dtype)) + cols_r[None, :], mask=key_r[:, None])
            cp.commit_group()
            codes0, scale0 = _fp8_chunk(KV, r_c, key_c, stride_kvr, 0, cw, gather_c)
            codes1, scale1 = _fp8_chunk(KV, r_c, key_c, stride_kvr, 1, cw, gather_c)
            codes2, scale2 = _fp8_chunk(KV, r_c, key_c, stride_kvr, 2, cw, gather_c)
            codes3, scale3 = _fp8_chunk(KV, r_c, key_c, stride_kvr, 3, cw, gather_c)
            cp.wait_group(0)
            fence_async_shared()
            cta_barrier()
            s = warpgroup_mma(k_rope, q_rope.permute((1, 0)), gl.zeros([BLOCK_N, HP], gl.float32, s_layout),
                              use_acc=False, is_async=True)  # fmt: skip
            # each chunk dequantised into k_nope, then its Q.K^T (which runs while the next is converted)
            s = _fp8_chunk_qk(k_nope, q_nope, codes0, scale0, s, 0, cw)
            s = _fp8_chunk_qk(k_nope, q_nope, codes1, scale1, s, 1, cw)
            s = _fp8_chunk_qk(k_nope, q_nope, codes2, scale2, s, 2, cw)
            s = _fp8_chunk_qk(k_nope, q_nope, codes3, scale3, s, 3, cw)
        else:
            async_load(k_rope, KV + r_r.to(gl.int64)[:, None] * stride_kvr + DV + cols_r[None, :],
                       mask=key_r[:, None])  # fmt: skip
            cp.commit_group()
            cols_c = gl.arange(0, cw, layout=gl.SliceLayout(0, gather_c))
            row_c = KV + r_c.to(gl.int64)[:, None] * stride_kvr + cols_c[None, :]
            for c in gl.static_range(NCHUNK):
                async_load(k_nope.slice(c * cw, cw, dim=1), row_c + c * cw, mask=key_c[:, None])
                cp.commit_group()

            # S^T [BLOCK_N, HP] = K Q^T (rows as wgmma M, heads as N), chunk by chunk as the groups land
            cp.wait_group(NCHUNK)
            fence_async_shared()
            cta_barrier()
            s = warpgroup_mma(k_rope, q_rope.permute((1, 0)), gl.zeros([BLOCK_N, HP], gl.float32, s_layout),
                              use_acc=False, is_async=True)  # fmt: skip
            for c in gl.static_range(NCHUNK):
                cp.wait_group(NCHUNK - 1 - c)
                fence_async_shared()
                cta_barrier()
                s = warpgroup_mma(k_nope.slice(c * cw, cw, dim=1), q_nope.slice(c * cw, cw, dim=1).permute((1, 0)),
                                  s, is_async=True)  # fmt: skip
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        # the softmax down each head
        s = gl.where(key_s[:, None], s * qk_scale, float("-inf"))
        heads = gl.arange(0, HP, layout=gl.SliceLayout(0, s_layout))
        m = gl.max(s, axis=0)
        if HAS_SINKS:  # the sink is one more logit of split 0 (no value)
            sink = gl.load(Sinks + h0 + heads, mask=(heads < n_h) & (split == 0), other=float("-inf"))
            sink = sink * 1.4426950408889634
            m = gl.maximum(m, sink)
        m_safe = gl.where(m == float("-inf"), 0.0, m)
        p = gl.exp2(s - m_safe[None, :])
        denom = gl.sum(p, axis=0)
        if HAS_SINKS:
            denom += gl.exp2(sink - m_safe)
        p_t.store(p.to(dtype))
        fence_async_shared()
        cta_barrier()

        # O^T [DV, HP] = V^T P^T (value columns as wgmma M)
        o_layout: gl.constexpr = _acc_layout(HP, W)
        o = warpgroup_mma(k_nope.permute((1, 0)), p_t, gl.zeros([DV, HP], gl.float32, o_layout),
                          use_acc=False, is_async=True)  # fmt: skip
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
        has = denom > 0.0
        d_safe = gl.where(has, denom, 1.0)
        lse = gl.where(has, (m_safe + gl.log2(d_safe)) * 0.6931471805599453, float("-inf"))
        o = o / gl.convert_layout(d_safe, gl.SliceLayout(0, o_layout))[None, :]
        store_l: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [W // 4, 4], [0, 1])  # 16 B a thread along Dv
        o = gl.convert_layout(o, store_l)
        cols = gl.arange(0, DV, layout=gl.SliceLayout(1, store_l))
        h_o = gl.arange(0, HP, layout=gl.SliceLayout(0, store_l))
        o_base = Out + split.to(gl.int64) * stride_os + tok.to(gl.int64) * stride_ot + h0 * stride_oh
        o_ptrs = o_base + h_o[None, :] * stride_oh + cols[:, None]
        gl.store(o_ptrs, o.to(Out.dtype.element_ty), mask=(h_o < n_h)[None, :])
        gl.store(Lse + split * stride_ls + tok * stride_lt + (h0 + heads) * stride_lh, lse, mask=heads < n_h)
        if PDL:  # the partial is stored: the merge may launch (it waits for this grid to complete)
            grid_dependency("griddepcontrol.launch_dependents")


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
    chunks: int = LATENT_CHUNKS,
    warps: int | None = None,
    heads_per_program: int | None = None,
) -> None:
    """Launch ``_small_split_kernel`` on validated tensors (no checks, no allocation, no sync).

    Args:
        q ``[T, H, 576]``, kv ``[R, 576]`` (bf16 / fp16), rows ``[T, K]`` int32, topk_length ``[T]``
        int32 / sinks ``[H]`` fp32 or None. dst_out ``[S, T, H, 512]`` fp32 / dst_lse ``[S, T, H]``
        fp32 partials, or with one split ``out [T, H, 512]`` (q's dtype) / ``lse [T, H]``.
        block_n, splits: :func:`small_decode_tiles`. pdl: a programmatic dependent launch.
        chunks: :data:`LATENT_CHUNKS` (1, 2 or 4; other values for measurements).
        warps: 4 or 8 (8 needs ``block_n`` 128); None: :func:`small_decode_warps`.
        heads_per_program: heads of one program (:func:`small_decode_heads`); None: all of them.

    Raises:
        ValueError: ``warps`` does not fit ``block_n``, or ``heads_per_program`` is not in
            ``[1, 16]`` (checked before any launch).
    """
    warps = _resolve_warps(block_n, warps)
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
        NCHUNK=chunks, W=warps, KV_FP8=kv.dtype == torch.uint8, num_warps=warps, launch_pdl=pdl,
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
    block_n, splits = small_decode_tiles(t, rows.shape[1], num_sms)
    if splits > 1:
        dst_out, dst_lse = split_partials(workspace, splits, t, h, out.shape[-1], q.device)
    else:
        dst_out, dst_lse = out, lse_out
    group = small_decode_heads(t, splits, h, num_sms)
    launch_small_split(
        q, kv, rows, topk_length, sinks, dst_out, dst_lse, block_n, splits, scale, pdl, heads_per_program=group
    )
    if splits > 1:
        launch_lse_merge_columns(
            dst_out, dst_lse, out, lse_out, pdl=pdl, block_d=SMALL_MERGE_COLUMNS, num_warps=SMALL_MERGE_WARPS
        )
    return out, lse_out


def compile_for_sm90(
    block_n: int = 64,
    *,
    split: bool = True,
    even_k: bool = True,
    topk_length: bool = False,
    sinks: bool = False,
    dtype: str = "bf16",
    chunks: int = LATENT_CHUNKS,
    warps: int | None = None,
    heads_per_program: int = MAX_HEADS,
    kv_fp8: bool = False,
):
    """Compile the split kernel for sm_90 ahead of time (no GPU needed); returns Triton's compiled
    kernel (``asm["ptx"]``, ``metadata``). ``split``: fp32 partials (else the one-split output in
    ``dtype``); ``even_k``: a top-k that is a multiple of ``block_n``; ``warps``: None for
    :func:`small_decode_warps`; ``heads_per_program``: 8 or fewer compiles the 8-wide ``wgmma``;
    ``kv_fp8``: ``fp8_ds_mla`` rows (uint8; ``dtype`` bf16).
    Raises RuntimeError without Gluon, ValueError for ``warps`` or ``heads_per_program`` out of range."""
    from shardattn.kernels.gluon.compat import GLUON_IMPORT_ERROR, compile_sm90

    warps = _resolve_warps(block_n, warps)
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
                  "HAS_TOPK_LEN": topk_length, "HAS_SINKS": sinks, "PDL": True, "NCHUNK": chunks,
                  "W": warps, "KV_FP8": kv_fp8}  # fmt: skip
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    aligned = ("Q", "KV", "Rows", "Out", "stride_qt", "stride_qh", "stride_kvr", "stride_rt", "K", "stride_os",
               "stride_ot", "stride_oh")  # fmt: skip
    return compile_sm90(_small_split_kernel, signature, constexprs, aligned=aligned, options={"num_warps": warps})
