"""Each token's rows with every repeat dropped in place, by hashing: no sort, no bitmap.

A decode step reads each of a token's KV rows once, so a row its top-k lists twice must become
one key. The union builders (:mod:`shardattn.ops.union`) give sorted rows: the bitmap builds pay
a scan that follows the cache size, the sorting build a ``torch.sort`` of ``[T, K]`` keys. This
kernel's cost follows ``K`` alone, and it moves nothing: each entry keeps its position, its row
where it is the row's first valid occurrence in the token, ``-1`` where it repeats an earlier
entry or is no row, which the decode kernels read as they read the caller's rows (an invalid
entry anywhere is no key). A token's entries are spread over ``parts`` programs by their row's
hash (every entry of a row goes to one part), and each program keeps an open hash table of
``2 * BLOCK / parts`` int64 words in global scratch, emptied once when the program starts, and
resolves its entries in rounds, each over the entries still pending (at first every valid one of
its part):

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
19 bits hold more); with twice as many slots as entries a round settles about four rows in five,
so ``K = 2,048`` takes about five rounds. One program's 2,048 atomics and reads a round, more than
their latency, bound a token (D95), hence the parts: few tokens spread over the SMs
(:func:`unique_rows_parts`). Each program then writes its own lanes. The result is exact and
deterministic, whatever the parts; the contract and the torch reference:
:func:`shardattn.ops.unique_rows.unique_rows`.
"""

from __future__ import annotations

import torch

from shardattn._ints import next_pow2
from shardattn.kernels.backend import COMPILE_OPTIONS, sm_count, unit_stride
from shardattn.plan.union_routing import MAX_UNIQUE_ENTRIES

try:
    import triton
    import triton.language as tl

    from shardattn.kernels.triton.lse_merge import gdc_launch_dependents, gdc_wait
except ImportError:  # the torch reference still works
    triton = None

__all__ = ["MAX_ENTRIES", "launch_unique_rows", "unique_rows_config", "unique_rows_parts"]

#: Most entries a token's row list may hold here (one program holds them all in registers).
MAX_ENTRIES = MAX_UNIQUE_ENTRIES


if triton is not None:

    @triton.jit
    def _mix(h):
        # one step of a bijective 32-bit mix (xor-shift, odd multiply): equal rows keep equal
        # hashes, distinct rows distinct ones, with fresh top bits every round
        h = h ^ (h >> 16)
        return h * 0x85EBCA6B

    @triton.jit(do_not_specialize=["T", "K", "max_row", "parts", "table_bits"])
    def _unique_rows_kernel(
        ROWS, TOPK_LEN, SCRATCH, OUT,
        T, K, max_row, stride_rows_t, stride_out_t, parts, table_bits,
        HAS_LEN: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
    ):  # fmt: skip
        if PDL:  # wait for the grid that wrote the rows; the decode after this one may launch now
            gdc_wait()  # (it waits for this grid to complete before it reads a row)
            gdc_launch_dependents()
        t = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        c = tl.arange(0, BLOCK)
        k_end = K
        if HAS_LEN:
            k_end = tl.minimum(k_end, tl.load(TOPK_LEN + t))
        raw = tl.load(ROWS + t * stride_rows_t + c, mask=c < k_end, other=-1)
        valid = (c < k_end) & (raw >= 0) & (raw <= max_row)
        row = tl.where(valid, raw, -1).to(tl.int32)
        h = row.to(tl.uint32) * 0x9E3779B1
        # this program's lanes: those whose row's hash names its part (every entry of a row alike)
        mine = (c < K) & (((h >> 24) & (parts - 1)).to(tl.int32) == part)
        pending = mine & valid
        slots = 1 << table_bits
        table = SCRATCH + (t * parts + part) * slots
        for s0 in tl.static_range(0, 2 * BLOCK, BLOCK):  # empty (above any word a round writes)
            tl.store(table + s0 + c, tl.full([BLOCK], 0x7FFFFFFFFFFFFFFF, tl.int64), mask=s0 + c < slots)
        # the word's low 44 bits: lane (13 bits, K <= 8,192) then row (31 bits, max_row < 2**31)
        entry = (c.to(tl.int64) << 31) | tl.where(valid, row, 0).to(tl.int64)
        tag = tl.full([], (1 << 19) - 1, tl.int64)  # falls by one a round: K rounds at most
        keep = c < 0
        tl.debug_barrier()
        while tl.max(pending.to(tl.int32), axis=0) > 0:
            h = _mix(h)
            slot = (h >> (32 - table_bits)).to(tl.int32)
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
        # each of this program's lanes where it stands: its row where kept, else -1
        tl.store(OUT + t * stride_out_t + c, tl.where(keep, row, -1), mask=mine)


def unique_rows_config(topk: int) -> dict[str, int]:
    """Constexprs and warps of the kernel for a row list of ``topk`` entries (the warm-up key):
    ``BLOCK`` (``topk`` rounded up to a power of two, at least 16)."""
    block = max(16, next_pow2(topk))
    return {"BLOCK": block, "num_warps": 8 if block >= 2048 else 4}


def unique_rows_parts(tokens: int, topk: int, num_sms: int) -> int:
    """Programs a token's entries are spread over: the most, a power of two, that keep
    ``tokens x parts`` within ``num_sms`` and give each part at least 128 lanes of the block (one
    program's atomics and reads a round are what bound a round, so few tokens spread).

    >>> unique_rows_parts(1, 2048, 132), unique_rows_parts(64, 2048, 132), unique_rows_parts(1, 512, 132)
    (16, 2, 4)
    """
    block = unique_rows_config(topk)["BLOCK"]
    parts = 1
    while 2 * parts * tokens <= num_sms and 2 * parts * 128 <= block:
        parts *= 2
    return parts


def launch_unique_rows(
    rows: torch.Tensor,
    topk_length: torch.Tensor | None,
    max_row: int,
    out: torch.Tensor,
    *,
    parts: int | None = None,
    pdl: bool = False,
) -> None:
    """Write each token's rows into ``out`` ``[T, K]`` int32, each entry at its position: its row
    where it is the row's first valid occurrence in the token, else ``-1``. ``rows`` ``[T, K]``
    int32/int64 with a unit last stride; an entry is valid when ``0 <= row <= max_row`` and its
    position is under ``topk_length[t]`` (int32/int64 ``[T]``, or ``None``). ``parts``: programs a
    token is spread over, a power of two (default :func:`unique_rows_parts` on the device's SMs).
    ``pdl``: a programmatic dependent launch (where :func:`~shardattn.kernels.backend.pdl_supported`),
    which waits for the grid before it and lets the one after it launch at once (for a decode
    kernel launched so). Inputs are checked by the caller; ``K <= MAX_ENTRIES``."""
    t, k = rows.shape
    if t == 0:
        return
    cfg = unique_rows_config(k)
    block = cfg["BLOCK"]
    if parts is None:
        parts = unique_rows_parts(t, k, sm_count(rows.device))
    if parts < 1 or parts & (parts - 1) or parts > block:
        raise ValueError(f"parts must be a power of two from 1 to {block}, got {parts}")
    table_bits = (2 * block // parts).bit_length() - 1  # 2 x BLOCK slots a token
    scratch = torch.empty(t * parts << table_bits, dtype=torch.int64, device=rows.device)
    topk_length = unit_stride(topk_length)
    _unique_rows_kernel[(t, parts)](
        rows, topk_length if topk_length is not None else rows, scratch, out,
        t, k, max_row, rows.stride(0), out.stride(0), parts, table_bits,
        HAS_LEN=topk_length is not None, BLOCK=block, PDL=pdl, num_warps=cfg["num_warps"], launch_pdl=pdl,
        **COMPILE_OPTIONS,
    )  # fmt: skip
