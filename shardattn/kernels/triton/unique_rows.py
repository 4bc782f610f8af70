"""Each token's unique valid rows in first-occurrence order, by hashing: no sort, no bitmap.

A decode step reads each of a token's KV rows once, so a row its top-k lists twice must become
one key. The union builders (:mod:`shardattn.ops.union`) give sorted rows: the bitmap builds pay
a scan that follows the cache size, the sorting build a ``torch.sort`` of ``[T, K]`` keys. This
kernel's cost follows ``K`` alone: one program per token keeps an open hash table of ``SLOTS``
int64 words in global scratch, emptied once when the program starts, and resolves its entries in
rounds, each over the entries still pending (at first every valid one):

1. every pending entry ``atomic_min``\\ s its word at the slot its row's hash names this round; a
   word is ``(tag << 44) | (lane << 31) | row``, the tag falling by one each round, so the slot
   holds this round's lowest lane that hashed to it, with its row, whatever earlier rounds left;
2. after a CTA barrier each pending entry reads its slot (through L2): the same row means its row
   is settled, kept by the lane found there, which is the row's first occurrence (every entry of
   a row hashes to one slot, so all of them are pending together and the lowest among them is the
   lowest of the slot); another row means a collision, pending again in the next round under a
   new hash.

A round is one atomic and one read, both in L2, between two barriers. Each round settles at least
the row of every slot written (the lowest lane's), so the loop ends within ``K`` rounds (the tag's
19 bits hold more); with ``SLOTS = 2 * BLOCK`` a round settles about four rows in five, so
``K = 2,048`` takes about five rounds. The kept lanes then write their rows to the front of the
token's output row in lane order (a prefix sum), ``-1`` after, and the count to ``lens``. The
result is exact and deterministic; the contract and the torch reference:
:func:`shardattn.ops.unique_rows.unique_rows`.
"""

from __future__ import annotations

import torch

from shardattn._ints import next_pow2
from shardattn.kernels.backend import COMPILE_OPTIONS, unit_stride
from shardattn.plan.union_routing import MAX_UNIQUE_ENTRIES

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference still works
    triton = None

__all__ = ["MAX_ENTRIES", "launch_unique_rows", "unique_rows_config"]

#: Most entries a token's row list may hold here (one program holds them all in registers).
MAX_ENTRIES = MAX_UNIQUE_ENTRIES


if triton is not None:

    @triton.jit
    def _mix(h):
        # one step of a bijective 32-bit mix (xor-shift, odd multiply): equal rows keep equal
        # hashes, distinct rows distinct ones, with fresh top bits every round
        h = h ^ (h >> 16)
        return h * 0x85EBCA6B

    @triton.jit(do_not_specialize=["T", "K", "max_row"])
    def _unique_rows_kernel(
        ROWS, TOPK_LEN, SCRATCH, OUT, LENS,
        T, K, max_row, stride_rows_t, stride_out_t,
        HAS_LEN: tl.constexpr, BLOCK: tl.constexpr, SLOT_BITS: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        k_end = K
        if HAS_LEN:
            k_end = tl.minimum(k_end, tl.load(TOPK_LEN + t))
        row_ptr = ROWS + t * stride_rows_t
        raw = tl.load(row_ptr + c, mask=c < k_end, other=-1)
        pending = (c < k_end) & (raw >= 0) & (raw <= max_row)
        row = tl.where(pending, raw, -1).to(tl.int32)
        table = SCRATCH + t * (1 << SLOT_BITS)
        for part in tl.static_range((1 << SLOT_BITS) // BLOCK):  # empty: above any word a round writes
            tl.store(table + part * BLOCK + c, tl.full([BLOCK], 0x7FFFFFFFFFFFFFFF, tl.int64))
        # the word's low 44 bits: lane (13 bits, K <= 8,192) then row (31 bits, max_row < 2**31)
        entry = (c.to(tl.int64) << 31) | tl.where(pending, row, 0).to(tl.int64)
        tag = tl.full([], (1 << 19) - 1, tl.int64)  # falls by one a round: K rounds at most
        keep = c < 0
        h = row.to(tl.uint32) * 0x9E3779B1
        tl.debug_barrier()
        while tl.max(pending.to(tl.int32), axis=0) > 0:
            h = _mix(h)
            slot = (h >> (32 - SLOT_BITS)).to(tl.int32)
            tl.atomic_min(table + slot, (tag << 44) | entry, mask=pending, sem="relaxed")
            tl.debug_barrier()
            word = tl.load(table + slot, mask=pending, other=0, cache_modifier=".cg")
            first = ((word >> 31) & 0x1FFF).to(tl.int32)
            first_row = (word & 0x7FFFFFFF).to(tl.int32)
            settled = pending & (first_row == row)
            keep = keep | (settled & (first == c))
            pending = pending & (first_row != row)
            tag -= 1
            tl.debug_barrier()  # every lane has read its slot before the next round's atomics
        kept = keep.to(tl.int32)
        n = tl.sum(kept, axis=0)
        pos = tl.cumsum(kept, axis=0) - 1
        out_ptr = OUT + t * stride_out_t
        tl.store(out_ptr + pos, row, mask=keep)
        tl.store(out_ptr + c, tl.full([BLOCK], -1, tl.int32), mask=(c >= n) & (c < K))
        tl.store(LENS + t, n)


def unique_rows_config(topk: int) -> dict[str, int]:
    """Constexprs and warps of the kernel for a row list of ``topk`` entries (the warm-up key):
    ``BLOCK`` (``topk`` rounded up to a power of two, at least 16) and ``SLOT_BITS`` (a table of
    ``2 * BLOCK`` slots)."""
    block = max(16, next_pow2(topk))
    return {"BLOCK": block, "SLOT_BITS": block.bit_length(), "num_warps": 8 if block >= 2048 else 4}


def launch_unique_rows(
    rows: torch.Tensor,
    topk_length: torch.Tensor | None,
    max_row: int,
    out: torch.Tensor,
    lens: torch.Tensor,
) -> None:
    """Write each token's unique valid rows into ``out`` ``[T, K]`` int32 (first-occurrence order,
    ``-1`` after) and their count into ``lens`` ``[T]`` int32. ``rows`` ``[T, K]`` int32/int64 with
    a unit last stride; an entry is valid when ``0 <= row <= max_row`` and its position is under
    ``topk_length[t]`` (int32/int64 ``[T]``, or ``None``). Inputs are checked by the caller;
    ``K <= MAX_ENTRIES``."""
    t, k = rows.shape
    if t == 0:
        return
    cfg = unique_rows_config(k)
    scratch = torch.empty(t, 1 << cfg["SLOT_BITS"], dtype=torch.int64, device=rows.device)
    topk_length = unit_stride(topk_length)
    _unique_rows_kernel[(t,)](
        rows, topk_length if topk_length is not None else lens, scratch, out, lens,
        t, k, max_row, rows.stride(0), out.stride(0),
        HAS_LEN=topk_length is not None, BLOCK=cfg["BLOCK"], SLOT_BITS=cfg["SLOT_BITS"],
        num_warps=cfg["num_warps"], **COMPILE_OPTIONS,
    )  # fmt: skip
