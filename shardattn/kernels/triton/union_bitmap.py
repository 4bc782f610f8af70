"""The bitmap union builder: a group's union from a bit per KV row, with no sort at all.

:func:`shardattn.ops.union.build_union` with ``method="bitmap"`` runs the same three phases in
shared memory on sm_90 with Gluon (:mod:`shardattn.kernels.gluon.union_smem`, several times faster)
and elsewhere (other GPUs, a Triton without Gluon, the interpreter) launches this module's Triton
kernel, described below, once (:func:`bitmap_union`). Every other builder sorts: the rows of each
query (``torch.sort`` of ``[T, K]``, the larger part of an unsorted build) and then merges. Here a
persistent program owns a bitmap of one bit per KV row (``ceil(R / 32)`` int32 words, zero between
groups) and a packed int64 array of the same width, and builds each of its groups in three phases
separated by CTA barriers (the scratch lives in global memory: the bitmap, which atomics set, is
read through L2 only; the packed words, which the program writes itself, through L1):

1. **mark**: every valid entry of the group's ``G`` queries sets its row's bit (``atomic_or``; a
   row listed twice, or by several queries, is one bit); the group's lowest and highest rows
   bound the words the next phase reads;
2. **count**: over those words, ``packed[w] = below[w] << 32 | word[w]``, where ``below[w]`` (an
   exclusive prefix of the bit counts) is the number of union rows below word ``w``; the total
   is ``lens[g]``; each word is cleared as it is read, so the bitmap is zero for the next group;
3. **place**: an entry's position in the sorted union is
   ``below[row >> 5] + popcount(word & (bits below row & 31))``, one 8-byte load, so each
   query writes its rows in place, ``G > 1`` ORing its membership bit into the packed entry
   ``row | bits << 24`` (the ``lens[g]`` entries are zeroed first), ``G = 1`` storing the row.

The output equals the other builders' exactly (entries sorted by row, unique, ``lens``);
entries past ``lens[g]`` are unspecified. The cost does not depend on the row order: per entry
one atomic, one 8-byte load (L1 serves a group's repeats) and one atomic (a store at
``G = 1``), the rows read twice, plus ``span / 32`` words counted per group, where ``span`` is
the distance between the group's lowest and highest row (so ``G = 1`` on a long span pays the
scan once per query; ``plan.union_routing.route_union_method`` weighs it). Measured:
docs/PERFORMANCE.md. Scratch:
``3 * ceil(R / 32)`` int32 per program, so the program count is capped by
:data:`SCRATCH_BYTES` (a large KV cache gets fewer programs; :data:`MAX_ROWS` bounds ``R``).

Example (the torch path runs the reference; the Triton kernel gives the same):
    >>> from shardattn.ops.union import build_union
    >>> rows = torch.tensor([[5, 3, -1], [3, 9, 3]], dtype=torch.int32)
    >>> union, lens = build_union(rows, group_size=2, num_kv_rows=10, method="bitmap")
    >>> lens.tolist(), [e & 0xFFFFFF for e in union[0, :3].tolist()]
    ([3], [3, 5, 9])
"""

from __future__ import annotations

import torch

from shardattn.kernels.backend import COMPILE_OPTIONS, unit_stride

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference still works
    triton = None

#: Largest ``num_kv_rows`` the bitmap builder takes (a program's scratch is ``3 R / 8`` bytes).
MAX_ROWS = 2**24 - 1
#: Scratch budget of one launch: programs x ``3 * ceil(R / 32)`` int32 stays below this.
SCRATCH_BYTES = 64 << 20
#: Persistent programs per SM (when the scratch budget allows): 4 and 16 measured the same on an
#: H200 (docs/DECISIONS.md, D14), 4 takes a quarter of the scratch.
PROGRAMS_PER_SM = 4


def bitmap_words(num_kv_rows: int) -> int:
    """Int32 words of one program's bitmap: ``ceil(R / 32)`` (at least 1)."""
    return max(1, -(-num_kv_rows // 32))


def bitmap_launch_config(group_size: int, topk: int) -> dict[str, int]:
    """Constexprs of :func:`bitmap_union` for ``(G, K)`` (the warm-up key)."""
    block = min(1024, max(16, triton.next_power_of_2(topk))) if triton is not None else 1024
    return {"BLOCK": block, "WCHUNK": 1024, "num_warps": 4}


def bitmap_programs(num_groups: int, num_kv_rows: int, device: torch.device) -> int:
    """Persistent programs of one launch: :data:`PROGRAMS_PER_SM` per SM (4 SMs off the GPU), capped
    by the groups and by :data:`SCRATCH_BYTES` of scratch (12 bytes per bitmap word; at least one)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    by_scratch = SCRATCH_BYTES // (12 * bitmap_words(num_kv_rows))
    return max(1, min(num_groups, PROGRAMS_PER_SM * sms, by_scratch))


if triton is not None:

    @triton.jit
    def _popcount(x):
        # bits set in each int32 lane (SWAR; no multiply, so nothing overflows)
        x = x - ((x >> 1) & 0x55555555)
        x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
        x = (x + (x >> 4)) & 0x0F0F0F0F
        x = x + (x >> 8)
        x = x + (x >> 16)
        return x & 0x3F

    @triton.jit
    def _entries(ROWS, TOPK_LEN, t, T, K, k0, num_rows, stride_rows_t, BLOCK: tl.constexpr, HAS_LEN: tl.constexpr):
        # one chunk of query t's entries: (row as int32, 0 where invalid; valid mask)
        c = k0 + tl.arange(0, BLOCK)
        k_end = tl.where(t < T, K, 0)
        if HAS_LEN:
            k_end = tl.minimum(k_end, tl.load(TOPK_LEN + t, mask=t < T, other=0))
        ok = c < k_end
        row = tl.load(ROWS + t * stride_rows_t + c, mask=ok, other=-1)
        ok = ok & (row >= 0) & (row < num_rows)
        return tl.where(ok, row, 0), ok

    @triton.jit
    def _mark(ROWS, TOPK_LEN, bitmap, g, T, K, num_rows, stride_rows_t,
              G: tl.constexpr, BLOCK: tl.constexpr, HAS_LEN: tl.constexpr):  # fmt: skip
        # set the bit of every valid row of the group's queries; the group's lowest and highest row
        lo = tl.full([], 2147483647, tl.int32)
        hi = tl.full([], -1, tl.int32)
        for j in tl.static_range(G):
            t = g.to(tl.int64) * G + j
            for k0 in range(0, K, BLOCK):
                row, ok = _entries(ROWS, TOPK_LEN, t, T, K, k0, num_rows, stride_rows_t, BLOCK, HAS_LEN)
                tl.atomic_or(bitmap + (row >> 5), 1 << (row & 31), mask=ok, sem="relaxed")
                lo = tl.minimum(lo, tl.min(tl.where(ok, row, 2147483647), axis=0))
                hi = tl.maximum(hi, tl.max(tl.where(ok, row, -1), axis=0))
        return lo, hi

    @triton.jit(do_not_specialize=["T", "num_rows", "n_groups", "words"])
    def _bitmap_union_kernel(
        ROWS, TOPK_LEN, UNION, LENS, BITMAP, PACKED,
        T, K, num_rows, n_groups, stride_rows_t, stride_union_g, words,
        G: tl.constexpr, BLOCK: tl.constexpr, WCHUNK: tl.constexpr, HAS_LEN: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        bitmap = BITMAP + pid.to(tl.int64) * words
        packed = PACKED + pid.to(tl.int64) * words
        for i in range(0, tl.cdiv(n_groups - pid, nprog)):
            g = pid + i * nprog
            union = UNION + g.to(tl.int64) * stride_union_g
            # 1. mark: one bit per row; the lowest and highest row bound the counted words
            lo, hi = _mark(ROWS, TOPK_LEN, bitmap, g, T, K, num_rows, stride_rows_t, G, BLOCK, HAS_LEN)
            tl.debug_barrier()
            # 2. count: PACKED[w] = (union rows below word w) << 32 | word w; the bitmap is
            # cleared as it is read (the next phase reads the packed copy: one load per entry)
            total = tl.zeros([], tl.int32)
            for w0 in range(lo >> 5, (hi >> 5) + 1, WCHUNK):
                w = w0 + tl.arange(0, WCHUNK)
                live = w <= (hi >> 5)
                word = tl.load(bitmap + w, mask=live, other=0, cache_modifier=".cg")
                cnt = _popcount(word)
                below = total + tl.cumsum(cnt, axis=0) - cnt
                tl.store(packed + w, (below.to(tl.int64) << 32) | (word.to(tl.int64) & 0xFFFFFFFF), mask=live)
                tl.debug_barrier()  # every thread holding a copy of the words has read them
                tl.store(bitmap + w, tl.zeros_like(word), mask=live)
                total += tl.sum(cnt, axis=0)
            tl.store(LENS + g, total)
            if G > 1:  # the packed entries are ORed together: start from 0
                for k0 in range(0, total, BLOCK):
                    c = k0 + tl.arange(0, BLOCK)
                    tl.store(union + c, tl.zeros_like(c), mask=c < total)
            tl.debug_barrier()
            # 3. place: each entry at its rank, with its query's bit
            for j in tl.static_range(G):
                t = g.to(tl.int64) * G + j
                for k0 in range(0, K, BLOCK):
                    row, ok = _entries(ROWS, TOPK_LEN, t, T, K, k0, num_rows, stride_rows_t, BLOCK, HAS_LEN)
                    # this program wrote them (barrier above): L1 serves the group's repeats
                    v = tl.load(packed + (row >> 5), mask=ok, other=0)
                    rank = (v >> 32).to(tl.int32) + _popcount(v.to(tl.int32) & ~(-1 << (row & 31)))
                    if G > 1:
                        bit = tl.full([], 1, tl.int32) << (24 + j)
                        tl.atomic_or(union + rank, row | bit, mask=ok, sem="relaxed")
                    else:
                        tl.store(union + rank, row, mask=ok)
            tl.debug_barrier()


def bitmap_kernels() -> tuple:
    """The Triton kernel, for compile counting; empty without Triton."""
    return (_bitmap_union_kernel,) if triton is not None else ()


def bitmap_union(
    rows: torch.Tensor,
    topk_length: torch.Tensor | None,
    num_kv_rows: int,
    group_size: int,
    union: torch.Tensor,
    lens: torch.Tensor,
) -> None:
    """Launch the Triton bitmap builder (inputs checked by :func:`~shardattn.ops.union.build_union`,
    which runs the shared-memory Gluon kernel, :mod:`~shardattn.kernels.gluon.union_smem`, instead
    where that runs).

    Args:
        rows: ``[T, K]`` int32, unit stride along ``K``; invalid entries anywhere.
        topk_length: ``[T]`` int32 or ``None``.
        num_kv_rows: ``R <=`` :data:`MAX_ROWS`; a row is valid when ``0 <= row < R``.
        group_size: ``G`` in ``(1, 2, 4, 8)``.
        union: ``[ceil(T/G), G*K]`` int32 output (unit stride along the width).
        lens: ``[ceil(T/G)]`` int32 output.
    """
    topk_length = unit_stride(topk_length)
    t, k = rows.shape
    n_groups = union.shape[0]
    words = bitmap_words(num_kv_rows)
    programs = bitmap_programs(n_groups, num_kv_rows, rows.device)
    cfg = bitmap_launch_config(group_size, k)
    bitmap = torch.zeros(programs, words, dtype=torch.int32, device=rows.device)
    packed = torch.empty(programs, words, dtype=torch.int64, device=rows.device)
    _bitmap_union_kernel[(programs,)](
        rows, topk_length if topk_length is not None else lens, union, lens, bitmap, packed,
        t, k, num_kv_rows, n_groups, rows.stride(0), union.stride(0), words,
        G=group_size, HAS_LEN=topk_length is not None, **cfg, **COMPILE_OPTIONS,
    )  # fmt: skip
