"""Union builders: the sorted union of a query group's KV rows, one membership bit per query.

Grouped sparse-MLA prefill packs ``G`` consecutive query tokens into one tile; the tile gathers
the union of their top-k rows once and masks, per query, the rows it did not pick. Group ``g``
holds queries ``g*G .. g*G + G - 1`` (a group may span requests: every query keeps its own
rows through its bit). Its union entry packs (``docs``: "Membership encoding")::

    entry = row | (member_bits << 24)      row < 2**24 - 1, bit j set <=> query g*G + j picked row

as int32 (bit 31 is query 7's bit, so an entry may be negative; ``-1`` = 0xFFFFFFFF cannot be
an entry because rows stop below ``2**24 - 1``). Entries are sorted by row, unique, and padded
with ``-1`` up to the buffer width ``G * K``; ``lens[g]`` counts them. With ``G = 1`` entries are
plain rows (no bits, any int32 row): the sorted, de-duplicated valid rows of each query.

Rules:
    * an entry ``rows[t, k]`` is valid when ``0 <= row < num_kv_rows`` and ``k < topk_length[t]``;
    * a row a query lists twice is one key (one bit): duplicates never count twice;
    * queries past ``T`` (the tail of the last group) have no rows; their outputs are discarded;
    * ``G > 1`` needs ``num_kv_rows <= 2**24 - 1``, else :func:`build_union` raises (route such
      steps to the per-query path, ``G = 1``); nothing is truncated.

Triton path: a keys kernel writes ``row * 8 + j`` per entry, ``torch.sort`` sorts each group's
``G * K`` keys, and a compaction kernel (one program per group) marks run ends and ORs each
run's bits with prefix sums. The cost depends on ``G * K`` per group, never on the sequence
length. (Sorting inside one Triton program with ``tl.sort`` measured 2.6x slower on an H200 at
G = 8, K = 2048, and was dropped.) All ``G`` sort the whole group's keys: for ``G = 2`` this
replaces "sort one list and look the other up", one code path for every ``G``. On the Triton
path entries past ``lens[g]`` are left unspecified (the attention kernel never reads them).

Example:
    >>> rows = torch.tensor([[5, 3, -1], [3, 9, 3], [7, 7, 2]], dtype=torch.int32)
    >>> union, lens = build_union(rows, group_size=2, num_kv_rows=10)
    >>> lens.tolist()
    [3, 2]
    >>> [(e & 0xFFFFFF, (e >> 24) & 0xFF) for e in union[0, :3].tolist()]
    [(3, 3), (5, 1), (9, 2)]
    >>> union[1].tolist()
    [16777218, 16777223, -1, -1, -1, -1]
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference still works
    triton = None

from shardattn._checks import INDEX_DTYPES, check_int, check_same_device, check_tensor
from shardattn.kernels.registry import use_triton

#: Rows at or above this cannot be packed (24 bits, ``0xFFFFFF`` reserved so ``-1`` is no entry).
MAX_PACKED_ROWS = 2**24 - 1
#: Group sizes the membership byte allows.
GROUP_SIZES = (1, 2, 4, 8)
ROW_BITS = 24
#: Largest row the G = 1 path accepts (int32 max is the sort sentinel).
MAX_PLAIN_ROW = 2**31 - 2


def num_groups(num_tokens: int, group_size: int) -> int:
    """``ceil(num_tokens / group_size)``."""
    return -(-num_tokens // group_size)


def pack_entries(rows: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Pack ``row | bits << 24`` into int32 (two's complement when bit 31 is set).

    Args:
        rows: int64 rows ``< 2**24 - 1``; bits: int64 membership bits ``< 256``.
    Returns:
        int32 entries.
    """
    v = rows | (bits << ROW_BITS)
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def unpack_entries(entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_entries`: ``(rows int64, bits int64)``."""
    e = entries.long() & 0xFFFFFFFF
    return e & 0xFFFFFF, e >> ROW_BITS


def _check(rows, group_size, num_kv_rows, topk_length):
    check_tensor("rows", rows, dtypes=INDEX_DTYPES, ndim=2)
    check_int("group_size", group_size)
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    check_int("num_kv_rows", num_kv_rows, minimum=0)
    if group_size > 1 and num_kv_rows > MAX_PACKED_ROWS:
        raise ValueError(
            f"num_kv_rows must be <= {MAX_PACKED_ROWS} for group_size > 1 (24-bit packed rows), got "
            f"{num_kv_rows}; route this step to the per-query path (group_size=1)"
        )
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtypes=INDEX_DTYPES, shape=(rows.shape[0],))
    check_same_device(rows=rows, topk_length=topk_length)


def build_union_reference(
    rows: torch.Tensor,
    *,
    group_size: int,
    num_kv_rows: int,
    topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`build_union` (same outputs, exactly)."""
    _check(rows, group_size, num_kv_rows, topk_length)
    t, k = rows.shape
    g_count = num_groups(t, group_size)
    dev = rows.device
    union = torch.full((g_count, group_size * k), -1, dtype=torch.int32, device=dev)
    lens = torch.zeros(g_count, dtype=torch.int32, device=dev)
    if t == 0 or k == 0:
        return union, lens
    r = rows.long()
    valid = (r >= 0) & (r < num_kv_rows) & (r <= MAX_PLAIN_ROW)
    if topk_length is not None:
        valid &= torch.arange(k, device=dev)[None, :] < topk_length.long()[:, None]
    tok = torch.arange(t, device=dev)[:, None].expand(t, k)
    grp, j, r = (tok // group_size)[valid], (tok % group_size)[valid], r[valid]
    keys = torch.unique((grp * max(num_kv_rows, 1) + r) * 8 + j)  # sorted; (group, row, query) once
    group_row, bit = keys // 8, torch.ones_like(keys) << (keys % 8)
    uniq, inverse = torch.unique_consecutive(group_row, return_inverse=True)
    bits = torch.zeros_like(uniq).scatter_add_(0, inverse, bit)
    ug, ur = uniq // max(num_kv_rows, 1), uniq % max(num_kv_rows, 1)
    counts = torch.bincount(ug, minlength=g_count)
    start = torch.cumsum(counts, 0) - counts
    slot = torch.arange(uniq.numel(), device=dev) - start[ug]
    union[ug, slot] = pack_entries(ur, bits) if group_size > 1 else ur.to(torch.int32)
    return union, counts.to(torch.int32)


if triton is not None:

    @triton.jit
    def _max_combine(a, b):
        return tl.maximum(a, b)

    @triton.jit(do_not_specialize=["T", "max_row"])
    def _union_keys_kernel(
        ROWS, TOPK_LEN, KEYS,
        T, K, max_row, stride_rows_t,
        G: tl.constexpr, BLOCK_K: tl.constexpr, HAS_LEN: tl.constexpr,
    ):  # fmt: skip
        # keys[t, k] = row * 8 + (t % G) (plain row for G == 1), INT32_MAX when invalid or t >= T
        SHIFT: tl.constexpr = 3 if G > 1 else 0
        t = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_end = tl.where(t < T, K, 0)
        if HAS_LEN:
            k_end = tl.minimum(k_end, tl.load(TOPK_LEN + t, mask=t < T, other=0))
        ok = c < k_end
        row = tl.load(ROWS + t * stride_rows_t + c, mask=ok, other=-1)
        ok = ok & (row >= 0) & (row <= max_row)
        key = tl.where(ok, (row << SHIFT) | (t % G).to(tl.int32), 2147483647)
        tl.store(KEYS + t * K + c, key, mask=c < K)

    @triton.jit
    def _union_compact_kernel(
        SORTED, UNION, LENS,
        width, stride_sorted_g, stride_union_g,
        G: tl.constexpr, CHUNK: tl.constexpr,
    ):  # fmt: skip
        # One program per group over its sorted keys: a row's run ends where the next key's row
        # differs; its bits are (inclusive bit sum at the end) - (exclusive sum at the run start),
        # exact duplicates contributing once. Chunks carry counts and sums across.
        SENT: tl.constexpr = 2147483647
        SHIFT: tl.constexpr = 3 if G > 1 else 0
        g = tl.program_id(0).to(tl.int64)
        src = SORTED + g * stride_sorted_g
        dst = UNION + g * stride_union_g
        n = tl.full([], 0, tl.int32)
        cs = tl.full([], 0, tl.int32)
        sb = tl.full([], 0, tl.int32)
        for c0 in range(0, width, CHUNK):
            i = c0 + tl.arange(0, CHUNK)
            in_w = i < width
            key = tl.load(src + i, mask=in_w, other=SENT)
            prev = tl.load(src + i - 1, mask=in_w & (i > 0), other=-1)
            nxt = tl.load(src + i + 1, mask=(i + 1) < width, other=SENT)
            valid = key != SENT
            is_end = valid & ((nxt >> SHIFT) != (key >> SHIFT))
            ends = is_end.to(tl.int32)
            slot = n + tl.cumsum(ends, axis=0) - 1
            if G > 1:
                contrib = tl.where(valid & (key != prev), 1 << (key & 7), 0)
                csum = cs + tl.cumsum(contrib, axis=0)
                is_start = (prev >> SHIFT) != (key >> SHIFT)
                run_base = tl.associative_scan(tl.where(is_start, csum - contrib, 0), 0, _max_combine)
                run_base = tl.maximum(run_base, sb)
                entry = (key >> SHIFT) | ((csum - run_base) << 24)
                cs = tl.max(csum, axis=0)
                sb = tl.max(run_base, axis=0)
            else:
                entry = key
            tl.store(dst + slot, entry, mask=is_end)
            n += tl.sum(ends, axis=0)
        tl.store(LENS + g, n)


def union_kernels() -> tuple:
    """The Triton union kernels (keys, compact), for warm-up and compile counting."""
    return _union_keys_kernel, _union_compact_kernel


def union_launch_config(group_size: int, topk: int) -> dict[str, int]:
    """Constexprs of the union kernels for ``(G, K)`` (the warm-up key)."""
    kp = max(16, 1 << max(0, topk - 1).bit_length())
    return {"G": group_size, "BLOCK_K": min(kp, 1024), "CHUNK": min(group_size * kp, 2048)}


def build_union(
    rows: torch.Tensor,
    *,
    group_size: int,
    num_kv_rows: int,
    topk_length: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted union of each group's valid rows with membership bits (see the module docstring).

    Args:
        rows: ``[T, K]`` int32 global KV rows, ``-1`` / out of range = invalid, anywhere.
        group_size: ``G`` in ``(1, 2, 4, 8)``.
        num_kv_rows: ``R``, rows of the KV cache (valid rows are ``< R``); ``<= 2**24 - 1``
            when ``G > 1``.
        topk_length: ``[T]`` int32, optional per-row count of leading entries to use.
        out: optional preallocated ``(union [ceil(T/G), G*K] int32, lens [ceil(T/G)] int32)``.
    Returns:
        ``(union [ceil(T/G), G*K] int32, lens [ceil(T/G)] int32)``; on the Triton path the
        entries past ``lens[g]`` are unspecified (the reference fills them with ``-1``).
    """

    _check(rows, group_size, num_kv_rows, topk_length)
    t, k = rows.shape
    g_count = num_groups(t, group_size)
    if out is not None:
        union, lens = out
        check_tensor("out[0]", union, dtypes=INDEX_DTYPES, shape=(g_count, group_size * k), device=rows.device)
        check_tensor("out[1]", lens, dtypes=INDEX_DTYPES, shape=(g_count,), device=rows.device)
    if not use_triton(rows, topk_length):
        ref_union, ref_lens = build_union_reference(
            rows, group_size=group_size, num_kv_rows=num_kv_rows, topk_length=topk_length
        )
        if out is None:
            return ref_union, ref_lens
        union.copy_(ref_union)
        lens.copy_(ref_lens)
        return union, lens
    if out is None:
        union = torch.empty(g_count, group_size * k, dtype=torch.int32, device=rows.device)
        lens = torch.empty(g_count, dtype=torch.int32, device=rows.device)
    if g_count == 0:
        return union, lens
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    max_row = min(num_kv_rows - 1, MAX_PLAIN_ROW)
    lengths = topk_length if topk_length is not None else lens
    cfg = union_launch_config(group_size, k)
    keys = torch.empty(g_count * group_size, k, dtype=torch.int32, device=rows.device)
    _union_keys_kernel[(g_count * group_size, triton.cdiv(k, cfg["BLOCK_K"]))](
        rows, lengths, keys, t, k, max_row, rows.stride(0),
        G=group_size, BLOCK_K=cfg["BLOCK_K"], HAS_LEN=topk_length is not None,
    )  # fmt: skip
    ordered = torch.sort(keys.view(g_count, group_size * k), dim=1).values
    _union_compact_kernel[(g_count,)](
        ordered, union, lens, group_size * k, ordered.stride(0), union.stride(0),
        G=group_size, CHUNK=cfg["CHUNK"],
    )  # fmt: skip
    return union, lens
