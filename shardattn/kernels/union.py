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

Triton paths (``method``; the cost depends on ``G * K`` per group, never on the sequence length):

* ``"sort"``: a keys kernel writes ``row * 8 + j`` per entry (int32: ``row < 2**24`` so keys
  stay below ``2**27``), ``torch.sort`` sorts each group's ``G * K`` keys, and a compaction
  kernel (one program per group) marks run ends and ORs each run's bits with prefix sums.
  With ``G = 1`` this is the per-query row sort (sorted, de-duplicated rows).
* ``"merge"``: each query's rows are sorted and de-duplicated first (the ``G = 1`` build, one
  ``K``-wide sort per query), then ``log2(G)`` merge levels join pairs of sorted unique lists:
  every element finds itself in the partner list by a vectorised binary search, and its output
  position is ``k + #(partner-only < x)`` (an element of the first list) or
  ``#(first < x) + #(partner-only before it)`` (a partner-only element); a row in both lists
  is written once with the OR of both bit sets. No sort wider than ``K``.
* ``"fused"`` (:mod:`shardattn.kernels.union_fused`): one launch, one program per group: its
  query lists (filtered, de-duplicated), every merge level (merge path: one binary search per
  8 outputs, then a serial merge) and the compaction. With ``rows_sorted=True`` (each query's
  valid rows already ascending, e.g. a sorted indexer top-k) there is no row sort at all;
  otherwise the row sort (``torch.sort`` of ``[T, K]`` keys) comes first.
* ``"bitmap"`` (:mod:`shardattn.kernels.union_bitmap`): no sort; one bit per KV row, so its cost
  follows the entries and the KV cache size, not the row order; ``num_kv_rows <= 2**24 - 1``.
  On sm_90 with Gluon it runs in shared memory (:mod:`shardattn.kernels.union_smem`), 3.0-4.7x
  the Triton kernel, which runs elsewhere.
* ``"auto"`` (:func:`auto_method`) takes ``"bitmap"`` on the shared-memory kernel when the KV
  cache is small enough for its count (:data:`SMEM_SCAN_RATIO`, :data:`SMEM_SORTED_RATIO`),
  else ``"fused"`` whenever ``rows_sorted``, ``"bitmap"`` when the cache is small enough for
  the Triton kernel's count (:data:`BITMAP_SCAN_RATIO`), and otherwise
  the builder per ``G`` of :data:`UNION_METHOD` (all measured on an H200, docs/DECISIONS.md,
  D12-D15). Sorting inside one Triton program with ``tl.sort`` measured 2.6x slower than
  ``torch.sort`` at G = 8 (whole group) and 1.9x slower at G = 1 (one row).

On the Triton path entries past ``lens[g]`` are left unspecified (the attention kernel never
reads them).

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

from shardattn._checks import INDEX_DTYPES, check_choice, check_int, check_same_device, check_tensor
from shardattn.kernels.backend import use_triton
from shardattn.kernels.union_bitmap import MAX_ROWS as MAX_BITMAP_ROWS
from shardattn.kernels.union_bitmap import bitmap_kernels, bitmap_union
from shardattn.kernels.union_choice import (  # noqa: F401 (the choice's names, public here too)
    BITMAP_SCAN_RATIO,
    METHODS,
    SMEM_SCAN_RATIO,
    SMEM_SORTED_RATIO,
    UNION_METHOD,
    auto_method,
)
from shardattn.kernels.union_fused import fused_kernel, fused_union
from shardattn.kernels.union_smem import smem_kernels, smem_supports, smem_union

if triton is not None:
    from shardattn.kernels.union_fused import compact_sorted_keys

#: Rows at or above this cannot be packed (24 bits, ``0xFFFFFF`` reserved so ``-1`` is no entry).
MAX_PACKED_ROWS = 2**24 - 1
#: Group sizes the membership byte allows.
GROUP_SIZES = (1, 2, 4, 8)
ROW_BITS = 24
#: Largest row the G = 1 path accepts (int32 max is the sort sentinel).
MAX_PLAIN_ROW = 2**31 - 2
#: How each query's rows are sorted (``G = 1`` and the first merge level): ``torch.sort`` of
#: ``[T, K]`` keys, or a ``tl.sort`` per query row in one Triton program (measured 1.9-2.0x
#: slower than ``torch.sort`` on an H200 at K = 2048; kept as an option).
ROW_SORTS = ("auto", "torch", "triton")
ROW_SORT_AUTO = "torch"


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


def _check(rows, group_size, num_kv_rows, topk_length, rows_sorted=False):
    check_tensor("rows", rows, dtypes=INDEX_DTYPES, ndim=2)
    if not isinstance(rows_sorted, bool):
        raise TypeError(f"rows_sorted must be a bool, got {type(rows_sorted).__name__}")
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
        # one program per group over its sorted keys (compact_sorted_keys)
        g = tl.program_id(0).to(tl.int64)
        n = compact_sorted_keys(SORTED + g * stride_sorted_g, UNION + g * stride_union_g, width, G, CHUNK)
        tl.store(LENS + g, n)

    @triton.jit(do_not_specialize=["T", "max_row"])
    def _row_sort_kernel(
        ROWS, TOPK_LEN, KEYS,
        T, K, max_row, stride_rows_t,
        BLOCK_K: tl.constexpr, HAS_LEN: tl.constexpr,
    ):  # fmt: skip
        # one program per query: its valid rows sorted ascending, INT32_MAX (invalid) at the end
        t = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK_K)
        k_end = K
        if HAS_LEN:
            k_end = tl.minimum(k_end, tl.load(TOPK_LEN + t))
        ok = c < k_end
        row = tl.load(ROWS + t * stride_rows_t + c, mask=ok, other=-1)
        ok = ok & (row >= 0) & (row <= max_row)
        key = tl.sort(tl.where(ok, row, 2147483647))
        tl.store(KEYS + t * K + c, key, mask=c < K)

    @triton.jit
    def _entry_key(e, PLAIN: tl.constexpr):
        if PLAIN:
            return e
        return e & 0xFFFFFF

    @triton.jit
    def _lower_bound(base, n, x, STEPS: tl.constexpr, PLAIN: tl.constexpr):
        # per lane: the first index in [0, n) whose row is >= x (n when none); STEPS >= bits of n
        lo = tl.zeros_like(x)
        cnt = tl.zeros_like(x) + n
        for _ in tl.static_range(STEPS):
            half = cnt // 2
            mid = lo + half
            v = _entry_key(tl.load(base + mid, mask=cnt > 0, other=0), PLAIN)
            go = (cnt > 0) & (v < x)
            lo = tl.where(go, mid + 1, lo)
            cnt = tl.where(go, cnt - half - 1, half)
        return lo

    @triton.jit(do_not_specialize=["n_in"])
    def _union_merge_kernel(
        SRC, SRC_LEN, DST, DST_LEN,
        n_in, stride_src, stride_dst,
        PLAIN: tl.constexpr, G: tl.constexpr, STEPS: tl.constexpr, CHUNK: tl.constexpr,
    ):  # fmt: skip
        # Program m merges the sorted unique lists A = 2m and B = 2m + 1 (lists past n_in are
        # empty) into DST[m]. PLAIN: the inputs are plain rows of queries 2m, 2m + 1 (first level).
        m = tl.program_id(0).to(tl.int64)
        ia = 2 * m
        ib = ia + 1
        la = tl.load(SRC_LEN + ia, mask=ia < n_in, other=0)
        lb = tl.load(SRC_LEN + ib, mask=ib < n_in, other=0)
        a_ptr = SRC + ia * stride_src
        b_ptr = SRC + ib * stride_src
        dst = DST + m * stride_dst
        common = tl.full([], 0, tl.int32)
        for c0 in range(0, la, CHUNK):  # A's entries: position k + #(B-only < a_k)
            i = c0 + tl.arange(0, CHUNK)
            ok = i < la
            e = tl.load(a_ptr + i, mask=ok, other=0)
            x = _entry_key(e, PLAIN)
            lo = _lower_bound(b_ptr, lb, x, STEPS, PLAIN)
            hit = ok & (lo < lb)
            f = tl.load(b_ptr + lo, mask=hit, other=0)
            found = hit & (_entry_key(f, PLAIN) == x)
            if PLAIN:
                bits = tl.where(found, 3, 1) << (ia % G).to(tl.int32)
            else:
                bits = ((e >> 24) & 0xFF) | tl.where(found, (f >> 24) & 0xFF, 0)
            fi = found.to(tl.int32)
            before = common + tl.cumsum(fi, axis=0) - fi
            tl.store(dst + (i + lo - before), x | (bits << 24), mask=ok)
            common += tl.sum(fi, axis=0)
        b_only = tl.full([], 0, tl.int32)
        for c0 in range(0, lb, CHUNK):  # B-only entries: position #(A < b_k) + #(B-only before k)
            i = c0 + tl.arange(0, CHUNK)
            ok = i < lb
            e = tl.load(b_ptr + i, mask=ok, other=0)
            x = _entry_key(e, PLAIN)
            lo = _lower_bound(a_ptr, la, x, STEPS, PLAIN)
            hit = ok & (lo < la)
            f = tl.load(a_ptr + lo, mask=hit, other=0)
            new = ok & ((lo >= la) | (_entry_key(f, PLAIN) != x))
            if PLAIN:
                bits = tl.full([CHUNK], 1, tl.int32) << (ib % G).to(tl.int32)
            else:
                bits = (e >> 24) & 0xFF
            ni = new.to(tl.int32)
            before = b_only + tl.cumsum(ni, axis=0) - ni
            tl.store(dst + (lo + before), x | (bits << 24), mask=new)
            b_only += tl.sum(ni, axis=0)
        tl.store(DST_LEN + m, la + b_only)


def union_kernels() -> tuple:
    """The Triton union kernels (keys, compact, row sort, merge, fused, bitmap), for warm-up and compile counting."""
    kernels = (_union_keys_kernel, _union_compact_kernel, _row_sort_kernel, _union_merge_kernel)
    return (*kernels, fused_kernel(), *bitmap_kernels(), *smem_kernels())


def union_launch_config(group_size: int, topk: int) -> dict[str, int]:
    """Constexprs of the union kernels for ``(G, K)`` (the warm-up key).

    ``BLOCK_K``/``CHUNK``: keys and compaction kernels; ``ROW_BLOCK``: the ``tl.sort`` row
    kernel; ``MERGE_CHUNK`` and ``MERGE_STEPS`` (one binary-search step count per merge level,
    ``bit_length`` of the level's input width ``2**level * K``).
    """
    kp = max(16, 1 << max(0, topk - 1).bit_length())
    levels = max(0, group_size.bit_length() - 1)
    return {
        "G": group_size,
        "BLOCK_K": min(kp, 1024),
        "CHUNK": min(group_size * kp, 2048),
        "ROW_BLOCK": kp,
        "MERGE_CHUNK": min(kp, 1024),
        "MERGE_STEPS": tuple((topk << lvl).bit_length() for lvl in range(levels)),
    }


def _resolve(
    group_size: int,
    method: str,
    row_sort: str,
    rows_sorted: bool,
    topk: int,
    num_kv_rows: int,
    shared_memory: bool = False,
) -> tuple[str, str]:
    check_choice("method", method, METHODS)
    check_choice("row_sort", row_sort, ROW_SORTS)
    if method == "auto":
        method = auto_method(group_size, topk, num_kv_rows, rows_sorted, shared_memory)
    if group_size == 1 and method != "bitmap" and not (method == "fused" and rows_sorted):
        method = "sort"  # one query per group: the row sort is the whole build
    return method, ROW_SORT_AUTO if row_sort == "auto" else row_sort


def build_union(
    rows: torch.Tensor,
    *,
    group_size: int,
    num_kv_rows: int,
    topk_length: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    method: str = "auto",
    row_sort: str = "auto",
    rows_sorted: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted union of each group's valid rows with membership bits (see the module docstring).

    Args:
        rows: ``[T, K]`` int32 global KV rows, ``-1`` / out of range = invalid, anywhere.
        group_size: ``G`` in ``(1, 2, 4, 8)``.
        num_kv_rows: ``R``, rows of the KV cache (valid rows are ``< R``); ``<= 2**24 - 1``
            when ``G > 1``.
        topk_length: ``[T]`` int32, optional per-row count of leading entries to use.
        out: optional preallocated ``(union [ceil(T/G), G*K] int32, lens [ceil(T/G)] int32)``.
        method: Triton builder, ``"auto"`` (:func:`auto_method`), ``"sort"``, ``"merge"``,
            ``"fused"`` or ``"bitmap"`` (same outputs; ignored by the torch reference; ``G = 1``
            is the row sort unless ``"fused"`` on sorted rows or ``"bitmap"``).
        row_sort: per-query row sort of the ``G = 1`` build, the first merge level and the
            fused build of unsorted rows, ``"auto"``, ``"torch"`` or ``"triton"`` (same outputs).
        rows_sorted: the caller guarantees that each query's *valid* entries are non-decreasing
            in list order (invalid ones anywhere, repeats allowed; the sorted-input contract of
            :mod:`shardattn.kernels.union_fused`). Trusted, not checked: the ``"fused"`` builder
            then skips the row sort (a list that breaks the order gets an unspecified, in-bounds
            union); the ``"sort"`` / ``"merge"`` builders and the reference sort anyway.
    Returns:
        ``(union [ceil(T/G), G*K] int32, lens [ceil(T/G)] int32)``; on the Triton path the
        entries past ``lens[g]`` are unspecified (the reference fills them with ``-1``).
    """

    _check(rows, group_size, num_kv_rows, topk_length, rows_sorted)
    shared_memory = smem_supports(rows, group_size) is None
    method, row_sort = _resolve(group_size, method, row_sort, rows_sorted, rows.shape[1], num_kv_rows, shared_memory)
    if method == "bitmap" and num_kv_rows > MAX_BITMAP_ROWS:
        raise ValueError(f"num_kv_rows must be <= {MAX_BITMAP_ROWS} for method='bitmap', got {num_kv_rows}")
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
    if method == "bitmap":  # the kernel known above: no second look at the device
        if shared_memory:
            smem_union(rows, topk_length, num_kv_rows, group_size, union, lens)
        else:
            bitmap_union(rows, topk_length, num_kv_rows, group_size, union, lens, kernel="triton")
        return union, lens
    cfg = union_launch_config(group_size, k)
    if method == "fused":
        max_row = min(num_kv_rows - 1, MAX_PLAIN_ROW)
        if rows_sorted:
            fused_union(rows, topk_length, max_row, group_size, union, lens)
        else:  # each query's rows sorted first (invalid = INT32_MAX at the end, topk_length applied)
            keys = _sorted_row_keys(rows, topk_length, num_kv_rows, row_sort)
            fused_union(keys, None, max_row, group_size, union, lens)
        return union, lens
    if group_size == 1:
        _row_lists(rows, topk_length, num_kv_rows, row_sort, union, lens)
        return union, lens
    if method == "sort":
        _sort_build(rows, topk_length, num_kv_rows, group_size, cfg, union, lens)
        return union, lens
    # per-query sorted unique rows, then log2(G) merge levels
    src = torch.empty(t, k, dtype=torch.int32, device=rows.device)
    src_len = torch.empty(t, dtype=torch.int32, device=rows.device)
    _row_lists(rows, topk_length, num_kv_rows, row_sort, src, src_len)
    for level, steps in enumerate(cfg["MERGE_STEPS"]):
        n_in = src.shape[0]
        last = level == len(cfg["MERGE_STEPS"]) - 1
        if last:
            dst, dst_len = union, lens
        else:
            n_out = -(-n_in // 2)
            dst = torch.empty(n_out, 2 * src.shape[1], dtype=torch.int32, device=rows.device)
            dst_len = torch.empty(n_out, dtype=torch.int32, device=rows.device)
        _union_merge_kernel[(dst.shape[0],)](
            src, src_len, dst, dst_len, n_in, src.stride(0), dst.stride(0),
            PLAIN=level == 0, G=group_size, STEPS=steps, CHUNK=cfg["MERGE_CHUNK"],
        )  # fmt: skip
        src, src_len = dst, dst_len
    return union, lens


def _sorted_row_keys(rows, topk_length, num_kv_rows, row_sort):
    """``[T, K]`` int32: each query's valid rows ascending, INT32_MAX (invalid) at the end."""
    t, k = rows.shape
    cfg = union_launch_config(1, k)
    keys = torch.empty(t, k, dtype=torch.int32, device=rows.device)
    kernel = _row_sort_kernel if row_sort == "triton" else _union_keys_kernel
    grid = (t,) if row_sort == "triton" else (t, triton.cdiv(k, cfg["BLOCK_K"]))
    block = {"BLOCK_K": cfg["ROW_BLOCK"]} if row_sort == "triton" else {"BLOCK_K": cfg["BLOCK_K"], "G": 1}
    kernel[grid](
        rows, topk_length if topk_length is not None else keys, keys, t, k, min(num_kv_rows - 1, MAX_PLAIN_ROW),
        rows.stride(0), HAS_LEN=topk_length is not None, **block,
    )  # fmt: skip
    return keys if row_sort == "triton" else torch.sort(keys, dim=1).values


def _row_lists(rows, topk_length, num_kv_rows, row_sort, lists, lens):
    """Write each query's sorted, de-duplicated valid rows into ``lists [T, K]``, ``lens [T]``."""
    t, k = rows.shape
    cfg = union_launch_config(1, k)
    if row_sort == "torch":
        _sort_build(rows, topk_length, num_kv_rows, 1, cfg, lists, lens)
        return
    keys = torch.empty(t, k, dtype=torch.int32, device=rows.device)
    _row_sort_kernel[(t,)](
        rows, topk_length if topk_length is not None else lens, keys,
        t, k, min(num_kv_rows - 1, MAX_PLAIN_ROW), rows.stride(0),
        BLOCK_K=cfg["ROW_BLOCK"], HAS_LEN=topk_length is not None,
    )  # fmt: skip
    _union_compact_kernel[(t,)](keys, lists, lens, k, keys.stride(0), lists.stride(0), G=1, CHUNK=cfg["CHUNK"])


def _sort_build(rows, topk_length, num_kv_rows, group_size, cfg, union, lens):
    """The ``"sort"`` builder: keys kernel, ``torch.sort`` of each group's keys, compaction."""
    t, k = rows.shape
    g_count = union.shape[0]
    keys = torch.empty(g_count * group_size, k, dtype=torch.int32, device=rows.device)
    _union_keys_kernel[(g_count * group_size, triton.cdiv(k, cfg["BLOCK_K"]))](
        rows, topk_length if topk_length is not None else lens, keys, t, k, min(num_kv_rows - 1, MAX_PLAIN_ROW),
        rows.stride(0), G=group_size, BLOCK_K=cfg["BLOCK_K"], HAS_LEN=topk_length is not None,
    )  # fmt: skip
    ordered = torch.sort(keys.view(g_count, group_size * k), dim=1).values
    _union_compact_kernel[(g_count,)](
        ordered, union, lens, group_size * k, ordered.stride(0), union.stride(0),
        G=group_size, CHUNK=cfg["CHUNK"],
    )  # fmt: skip
