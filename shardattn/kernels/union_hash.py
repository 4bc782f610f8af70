"""The hashed union build (``build_union(..., method="hash")``): no sort at all, entries unordered.

Each query group's union is gathered in an open-addressing hash table in global memory (it
stays in L2), keyed by the row, whose slots hold the union entry itself (``row | bits << 24``,
:mod:`shardattn.kernels.union`'s packing; ``-1`` is an empty slot, never an entry). One program
builds the union of one group at a time (a persistent grid: program ``p`` takes groups ``p,
p + P, ...`` and owns table ``p``):

1. **clear** its table (``SLOTS`` int32, ``-1``), then a block barrier;
2. **insert** every valid entry of the group's ``G`` rows: ``atomic_cas(slot, -1, row | bit)``
   at ``hash(row)``; a slot that held the same row gets the query's bit by ``atomic_or``; a slot
   holding another row sends the entry on to the next slot (linear probing). ``SLOTS = 2 * G * K``
   slots for at most ``G * K`` rows: at most half full, so every probe sequence ends. A row a
   query lists twice sets the same bit twice (one key, as the module's rules say);
3. **compact**: after a barrier the program reads its table in slot order and writes the filled
   slots to ``union[g, :lens[g]]``.

The entries come out in slot (hash) order, not sorted by row: the attention kernels read a
group's entries in any order, so the union is the same set as the sorted builders' and the
outputs differ only by the rounding of another key order. It replaces the row sort (``torch.sort``
of ``[T, K]``: 0.31 ms per 4K tokens on an H200) and the merge levels of the sorted builders.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None

__all__ = ["hash_union", "hash_union_programs", "hash_union_slots"]

#: Persistent programs per SM (each owns one table while it builds a group's union).
PROGRAMS_PER_SM = 4
#: Keys inserted per step of a program (its vector width).
INSERT_BLOCK = 1024


def hash_union_slots(group_size: int, topk: int) -> int:
    """Slots of one table: a power of two >= ``2 * G * K`` (at most half full)."""
    return 1 << max(1, (2 * group_size * max(1, topk) - 1).bit_length())


def _table_stride(slots: int) -> int:
    """Elements per table: its slots, then a spare slot the idle lanes of a probe step write to."""
    return slots + 32


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def hash_union_programs(num_groups: int, device: torch.device) -> int:
    """Persistent programs for ``num_groups`` groups on ``device`` (one table each)."""
    sms = (
        _sm_count(device.index if device.index is not None else torch.cuda.current_device())
        if device.type == "cuda"
        else 8
    )
    return max(1, min(num_groups, PROGRAMS_PER_SM * sms))


def hash_union(
    rows: torch.Tensor,
    topk_length: torch.Tensor | None,
    num_kv_rows: int,
    group_size: int,
    union: torch.Tensor,
    lens: torch.Tensor,
    tables: torch.Tensor | None = None,
) -> None:
    """Fill ``union [ceil(T/G), G*K]`` / ``lens`` with each group's entries, unordered (module docstring).

    Args:
        rows: ``[T, K]`` int32, unit last stride; invalid entries (``< 0``, ``>= num_kv_rows``,
            past ``topk_length``) anywhere. num_kv_rows: ``<= 2**24 - 1``.
        tables: optional int32 scratch of at least ``programs * (slots + 32)`` elements
            (:func:`hash_union_programs`, :func:`hash_union_slots`); allocated when None (its
            contents need no initial value).
    """
    t, k = rows.shape
    groups = union.shape[0]
    slots = hash_union_slots(group_size, k)
    programs = hash_union_programs(groups, rows.device)
    need = programs * _table_stride(slots)
    if tables is None or tables.numel() < need:
        tables = torch.empty(need, dtype=torch.int32, device=rows.device)
    _hash_union_kernel[(programs,)](
        rows, topk_length if topk_length is not None else rows, tables, union, lens,
        t, k, num_kv_rows, groups, rows.stride(0), union.stride(0),
        G=group_size, SLOTS=slots, LOG2_SLOTS=slots.bit_length() - 1,
        BLOCK=min(INSERT_BLOCK, triton.next_power_of_2(max(k, 16))), CBLOCK=min(2048, slots),
        HAS_LEN=topk_length is not None,
    )  # fmt: skip


if triton is not None:

    @triton.jit
    def _slot_of(r, LOG2_SLOTS: tl.constexpr):
        """Fibonacci hashing of a row into ``[0, 2**LOG2_SLOTS)``: the top bits of ``r * 2**32 / phi``
        (int32 product, wrapping), read unsigned."""
        x = (r * -1640531527).to(tl.uint32, bitcast=True) >> (32 - LOG2_SLOTS)
        return x.to(tl.int32, bitcast=True)

    @triton.jit(do_not_specialize=["T", "K", "R", "num_groups"])
    def _hash_union_kernel(
        ROWS, TOPK_LEN, TABLES, UNION, LENS,
        T, K, R, num_groups, stride_rt, stride_ug,
        G: tl.constexpr, SLOTS: tl.constexpr, LOG2_SLOTS: tl.constexpr, BLOCK: tl.constexpr, CBLOCK: tl.constexpr,
        HAS_LEN: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        table = TABLES + pid.to(tl.int64) * (SLOTS + 32)
        sc = tl.arange(0, CBLOCK)
        for grp in range(pid, num_groups, tl.num_programs(0)):
            for s0 in range(0, SLOTS, CBLOCK):  # 1. clear
                tl.store(table + s0 + sc, tl.full([CBLOCK], -1, tl.int32))
            tl.debug_barrier()
            for j in tl.static_range(G):  # 2. insert query j's valid rows
                t = tl.cast(grp, tl.int64) * G + j
                k_end = tl.where(t < T, K, 0)
                if HAS_LEN:
                    k_end = tl.minimum(k_end, tl.load(TOPK_LEN + t, mask=t < T, other=0))
                for c0 in range(0, k_end, BLOCK):
                    c = c0 + tl.arange(0, BLOCK)
                    ok = c < k_end
                    r = tl.load(ROWS + t * stride_rt + c, mask=ok, other=-1)
                    todo = ok & (r >= 0) & (r < R)
                    bit = tl.full([BLOCK], 1, tl.int32) << (24 + j)  # int32: query 7's bit is the sign bit
                    entry = r | bit
                    h = _slot_of(r, LOG2_SLOTS)
                    while tl.max(todo.to(tl.int32), 0) > 0:
                        # lanes with nothing left to place write the spare slot (never read back)
                        empty = tl.full([BLOCK], -1, tl.int32)
                        at = table + tl.where(todo, h, SLOTS)
                        old = tl.atomic_cas(at, empty, entry, sem="relaxed", scope="cta")
                        same = todo & (old != -1) & ((old & 0xFFFFFF) == r)
                        tl.atomic_or(table + h, bit, mask=same, sem="relaxed", scope="cta")
                        todo = todo & (old != -1) & ~same
                        h = (h + 1) & (SLOTS - 1)
            tl.debug_barrier()
            base = 0
            for s0 in range(0, SLOTS, CBLOCK):  # 3. compact the filled slots
                e = tl.load(table + s0 + sc, cache_modifier=".cg")
                full = e != -1
                pos = base + tl.cumsum(full.to(tl.int32), 0) - 1
                tl.store(UNION + tl.cast(grp, tl.int64) * stride_ug + pos, e, mask=full)
                base += tl.sum(full.to(tl.int32), 0)
            tl.store(LENS + grp, base)
            tl.debug_barrier()
