"""The small-batch sparse-MLA decode kernel (sm_90, Gluon): one (token, split, group of heads)
program gathers its rows, runs ``S^T = K Q^T`` and ``O^T = V^T P^T`` on ``wgmma`` and stores the
split's partial. What it computes and why it is shaped so, its launcher and its limits:
:mod:`shardattn.kernels.gluon.sparse_mla_decode_small`.
"""

from __future__ import annotations

from shardattn.kernels.gluon.compat import HAS_GLUON
from shardattn.kernels.triton.kv_fp8_read import ROPE_OFFSET, SCALE_OFFSET

__all__: list[str] = []

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
    from shardattn.kernels.gluon.e4m3 import e4m3_times_bf16
    from shardattn.kernels.gluon.sparse_mla_epilogue import _row_lse

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
        """Chunk ``c``'s latent values (``bf16(code) * bf16(scale)``, the fp32 product rounded to bf16)
        into its columns of ``k_nope`` (the swizzled ``wgmma`` operand), fenced for the async proxy and
        synchronised across the program, then its part of ``S^T = K Q^T`` issued (async) into ``s``."""
        chunk = k_nope.slice(c * CW, CW, dim=1)
        chunk.store(e4m3_times_bf16(codes, scale.to(gl.bfloat16)[:, None]))
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
        d_safe, lse = _row_lse(m_safe, denom)
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
