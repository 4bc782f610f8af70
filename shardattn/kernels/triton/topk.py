"""The Triton kernel of the top-k conversion and its launcher (the contract and the torch reference:
:mod:`shardattn.ops.topk`). One program per query token converts its row of request-local
positions into global (or DCP-local) KV rows and counts the valid ones."""

from __future__ import annotations

import torch

from shardattn._ints import next_pow2
from shardattn.kernels.backend import COMPILE_OPTIONS, unit_stride

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference still works
    triton = None

__all__ = ["convert_topk_config", "convert_topk_kernel", "launch_convert_topk"]


if triton is not None:
    _RUNTIME_INTS = ["B", "M", "stride_table_b", "block_size", "block_stride", "dcp_world", "dcp_inter", "dcp_rank"]

    @triton.jit(do_not_specialize=_RUNTIME_INTS)
    def _convert_topk_kernel(
        POS, REQ, TABLE, SEQ, TOPK_LEN, ROWS, COUNTS,
        K, B, M,
        stride_pos_t, stride_table_b, stride_rows_t,
        block_size, block_stride, dcp_world, dcp_inter, dcp_rank,
        HAS_SEQ: tl.constexpr, HAS_LEN: tl.constexpr, HAS_DCP: tl.constexpr, BLOCK_K: tl.constexpr,
        PACK: tl.constexpr = False,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        req = tl.load(REQ + t).to(tl.int64)
        req_ok = (req >= 0) & (req < B)
        req_safe = tl.where(req_ok, req, 0)
        k_end = K
        if HAS_LEN:
            k_end = tl.minimum(tl.load(TOPK_LEN + t), K)
        k_end = tl.where(req_ok, k_end, 0)  # a bad request id empties the row
        seq = 0
        if HAS_SEQ:
            seq = tl.load(SEQ + req_safe, mask=req_ok, other=0).to(tl.int64)
        count = tl.zeros([BLOCK_K], dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            in_k = offs < K
            pos = tl.load(POS + t * stride_pos_t + offs, mask=in_k, other=-1).to(tl.int64)
            valid = in_k & (pos >= 0) & (offs < k_end)
            if HAS_SEQ:
                valid &= pos < seq
            local = pos
            if HAS_DCP:
                valid &= ((pos // dcp_inter) % dcp_world) == dcp_rank
                local = (pos // (dcp_world * dcp_inter)) * dcp_inter + pos % dcp_inter
            blk = local // block_size
            valid &= blk < M
            entry = tl.load(TABLE + req_safe * stride_table_b + blk, mask=valid, other=-1).to(tl.int64)
            valid &= entry >= 0
            row = entry * block_stride + local % block_size
            valid &= row <= 2147483647
            if PACK:  # the valid rows in order at the front; the rest -1 (below)
                at = tl.sum(count, axis=0) + tl.cumsum(valid.to(tl.int32), axis=0) - 1
                tl.store(ROWS + t * stride_rows_t + at, row.to(tl.int32), mask=valid)
            else:
                tl.store(ROWS + t * stride_rows_t + offs, tl.where(valid, row, -1).to(tl.int32), mask=in_k)
            count += valid.to(tl.int32)
        total = tl.sum(count, axis=0)
        if PACK:
            for k0 in range(0, K, BLOCK_K):
                offs = k0 + tl.arange(0, BLOCK_K)
                tail = (offs < K) & (offs >= total)
                tl.store(ROWS + t * stride_rows_t + offs, tl.full([BLOCK_K], -1, tl.int32), mask=tail)
        tl.store(COUNTS + t, total)


def convert_topk_kernel():
    """The Triton conversion kernel (for warm-up and compile counting); needs Triton."""
    return _convert_topk_kernel


def convert_topk_config(topk: int, seq_lens: bool, topk_length: bool, dcp: bool, packed: bool = False) -> dict:
    """Compile-time parameters of the conversion kernel for these flags (the warm-up key)."""
    block_k = 1024 if topk > 512 else max(16, next_pow2(topk))
    cfg = {"HAS_SEQ": bool(seq_lens), "HAS_LEN": bool(topk_length), "HAS_DCP": bool(dcp), "BLOCK_K": block_k}
    return {**cfg, "PACK": True} if packed else cfg


def launch_convert_topk(
    topk_pos: torch.Tensor,
    req_ids: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor | None,
    topk_length: torch.Tensor | None,
    rows: torch.Tensor,
    counts: torch.Tensor,
    *,
    block_size: int,
    block_stride: int,
    dcp: tuple[int, int, int] | None,
    packed: bool = False,
) -> None:
    """Launch the conversion on checked tensors (``topk_pos`` and ``block_table`` unit last stride)
    into ``rows [T, K]`` (unit last stride) and ``counts [T]`` int32; ``dcp`` = ``(world,
    interleave, rank)`` or None; ``packed``: each token's valid rows in order at the front of its
    row, ``-1`` after them."""
    t, k = topk_pos.shape
    req_ids, seq_lens, topk_length = unit_stride(req_ids), unit_stride(seq_lens), unit_stride(topk_length)
    world, inter, rank = dcp if dcp is not None else (1, 1, 0)
    cfg = convert_topk_config(k, seq_lens is not None, topk_length is not None, dcp is not None, packed)
    _convert_topk_kernel[(t,)](
        topk_pos, req_ids, block_table, seq_lens if seq_lens is not None else counts,
        topk_length if topk_length is not None else counts, rows, counts,
        k, block_table.shape[0], block_table.shape[1],
        topk_pos.stride(0), block_table.stride(0), rows.stride(0),
        block_size, block_stride, world, inter, rank,
        **cfg, **COMPILE_OPTIONS,
    )  # fmt: skip
