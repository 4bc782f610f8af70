"""The fused union builder: one program per group, its query lists, every merge level and the compaction.

:func:`shardattn.ops.union.build_union` with ``method="fused"`` launches
:func:`fused_union` once. Program ``g`` owns group ``g`` (queries ``g*G .. g*G + G - 1``) and runs,
separated by CTA barriers (its scratch lives in global memory, mostly L2):

1. **lists**: each query's valid rows, whose order the caller guarantees (``rows_sorted``) or a
   row sort provided (``torch.sort`` of ``[T, K]`` keys), are filtered (``-1``, out of range,
   past ``topk_length``, past ``T``) and de-duplicated, a row counting once: an entry is kept
   when it exceeds every valid row before it (prefix max). Query ``j``'s keys ``row * 8 + j``
   go to slot ``j`` (width ``K``) of a ping-pong buffer, their counts to ``CUM`` as an exclusive
   prefix over ``j``;
2. **merge levels** (``log2 G``): level ``l`` joins lists ``2p, 2p + 1`` (width ``K << l``) into
   list ``p`` (width ``K << (l + 1)``) by merge path: each lane owns 8 consecutive outputs,
   finds its split point with one binary search along its diagonal, then merges 8 steps
   serially and stores its 8 keys as one 32-byte vector. Keys are unique across lists (the
   query index is in the low bits), so no tie rule is needed;
3. **compaction** (:func:`compact_sorted_keys`, shared with the ``"sort"`` builder): a row's run
   of keys becomes one packed entry ``row | bits << 24``.

The output equals the other builders' exactly (entries, order, ``lens``); entries past
``lens[g]`` are unspecified. Scratch: one ``[ceil(T/G), G*K]`` int32 buffer besides the output
(the output buffer is the other half of the ping-pong) and ``[ceil(T/G), G + 1]`` counts.

Sorted-input contract (``rows_sorted=True``, trusted, not checked): in every query's list the
*valid* entries are non-decreasing in list order; invalid entries (``-1``, ``>= num_kv_rows``,
past ``topk_length``) may sit anywhere; a row may repeat (one key). A list that breaks the
order gets an unspecified but in-bounds union (an entry smaller than a valid entry before it
is dropped); nothing is written outside the outputs.
"""

from __future__ import annotations

import torch

from shardattn._ints import next_pow2
from shardattn.kernels.backend import COMPILE_OPTIONS, unit_stride

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference still works
    triton = None


def fused_launch_config(group_size: int, topk: int) -> dict[str, int]:
    """Constexprs of :func:`fused_union` for ``(G, K)`` (the warm-up key).

    ``CHUNK`` / ``CCHUNK``: entries per step of the list / compaction loops; ``LANES``: merge
    lanes per step (each 8 outputs: a binary split search, then 8 serial merge steps, one
    dependent load each); ``STEPS``: :func:`search_steps`; ``num_warps``.

    These (256 lanes, 4 warps) are the fastest of the configs timed on an H200; a multi-way split
    search and a windowed 8-output merge measured slower and were removed (docs/DECISIONS.md, D12
    and "Removed variants").
    """
    kp = max(16, next_pow2(topk))
    return {
        "G": group_size,
        "CHUNK": min(kp, 1024),
        "CCHUNK": min(group_size * kp, 2048),
        "LANES": 256,
        "STEPS": search_steps(topk),
        "num_warps": 4,
    }


def search_steps(topk: int) -> int:
    """``STEPS`` of the binary split search: the first level's (``+ LEVEL`` in the kernel)."""
    return topk.bit_length()


if triton is not None:

    @triton.jit
    def _max_combine(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def compact_sorted_keys(src, dst, width, G: tl.constexpr, CHUNK: tl.constexpr):
        """Sorted keys ``src[:width]`` (``row * 8 + j``, or plain rows when ``G == 1``; INT32_MAX =
        invalid) -> one entry per row at ``dst`` (``row | bits << 24``); returns the entry count.

        A row's run ends where the next key's row differs; its bits are (inclusive bit sum at the
        end) - (exclusive sum at the run start), exact duplicates contributing once. Chunks carry
        counts and sums across."""
        SENT: tl.constexpr = 2147483647
        SHIFT: tl.constexpr = 3 if G > 1 else 0
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
        return n

    @triton.jit
    def _query_list(src, k_end, max_row, dst, j, K, SHIFT: tl.constexpr, CHUNK: tl.constexpr):
        # the valid, first-occurrence entries of one query's ordered list -> keys at dst; their count
        n = tl.full([], 0, tl.int32)
        seen = tl.full([], -1, tl.int32)  # the largest valid row of earlier chunks
        for c0 in range(0, K, CHUNK):
            c = c0 + tl.arange(0, CHUNK)
            ok = c < k_end
            row = tl.load(src + c, mask=ok, other=-1)
            ok = ok & (row >= 0) & (row <= max_row)
            p_ok = (c >= 1) & (c <= k_end)
            prow = tl.load(src + c - 1, mask=p_ok, other=-1)
            prow = tl.where(p_ok & (prow >= 0) & (prow <= max_row), prow, -1)
            before = tl.maximum(tl.associative_scan(prow, 0, _max_combine), seen)  # max valid row before c
            keep = ok & (row > before)
            ki = keep.to(tl.int32)
            tl.store(dst + n + tl.cumsum(ki, axis=0) - ki, (row << SHIFT) | j, mask=keep)
            n += tl.sum(ki, axis=0)
            seen = tl.maximum(seen, tl.max(tl.where(ok, row, -1), axis=0))
        return n

    @triton.jit
    def _merge_step(a_ptr, b_ptr, la, lb, i, j, a, b, live):
        # one serial merge-path step per lane: emit min(a, b), advance that side, load its next key
        take = a < b
        v = tl.where(take, a, b)
        i = i + take.to(tl.int32)
        j = j + (1 - take.to(tl.int32))
        more = live & tl.where(take, i < la, j < lb)
        nxt = tl.load(tl.where(take, a_ptr + i, b_ptr + j), mask=more, other=2147483647)
        a = tl.where(take, nxt, a)
        b = tl.where(take, b, nxt)
        return v, i, j, a, b

    @triton.jit
    def _merge_level(
        src, dst, cum, K,
        LEVEL: tl.constexpr, G: tl.constexpr, LANES: tl.constexpr, STEPS: tl.constexpr,
    ):  # fmt: skip
        # lists 2p, 2p + 1 of width W = K << LEVEL at src -> list p of width 2W at dst (merge path)
        INF: tl.constexpr = 2147483647
        PAIRS: tl.constexpr = G >> (LEVEL + 1)
        W = K << LEVEL
        runs = (2 * W + 7) // 8  # lane runs per pair
        for q0 in range(0, PAIRS * runs, LANES):
            q = q0 + tl.arange(0, LANES)  # lane run q: pair q // runs, outputs from d
            p = q // runs
            d = (q - p * runs) * 8
            in_g = q < PAIRS * runs
            c0 = tl.load(cum + ((2 * p) << LEVEL), mask=in_g, other=0)
            c1 = tl.load(cum + ((2 * p + 1) << LEVEL), mask=in_g, other=0)
            c2 = tl.load(cum + ((2 * p + 2) << LEVEL), mask=in_g, other=0)
            la = c1 - c0
            lb = c2 - c1
            live = in_g & (d < la + lb)
            a_ptr = src + p * 2 * W
            b_ptr = a_ptr + W
            # the split: the first i in [lo, hi] with a[i] > b[d - 1 - i] (keys are distinct)
            lo = tl.maximum(d - lb, 0)
            hi = tl.minimum(d, la)
            for _ in tl.static_range(STEPS + LEVEL):
                run = live & (lo < hi)
                mid = (lo + hi) // 2
                av = tl.load(a_ptr + mid, mask=run, other=0)
                bv = tl.load(b_ptr + d - 1 - mid, mask=run, other=0)
                go = run & (av < bv)
                lo = tl.where(go, mid + 1, lo)
                hi = tl.where(run & ~go, mid, hi)
            i = lo
            j = d - lo
            # the merge: 8 serial steps, one dependent load each
            a = tl.load(a_ptr + i, mask=live & (i < la), other=INF)
            b = tl.load(b_ptr + j, mask=live & (j < lb), other=INF)
            v0, i, j, a, b = _merge_step(a_ptr, b_ptr, la, lb, i, j, a, b, live)
            v1, i, j, a, b = _merge_step(a_ptr, b_ptr, la, lb, i, j, a, b, live)
            v2, i, j, a, b = _merge_step(a_ptr, b_ptr, la, lb, i, j, a, b, live)
            v3, i, j, a, b = _merge_step(a_ptr, b_ptr, la, lb, i, j, a, b, live)
            v4, i, j, a, b = _merge_step(a_ptr, b_ptr, la, lb, i, j, a, b, live)
            v5, i, j, a, b = _merge_step(a_ptr, b_ptr, la, lb, i, j, a, b, live)
            v6, i, j, a, b = _merge_step(a_ptr, b_ptr, la, lb, i, j, a, b, live)
            v7, i, j, a, b = _merge_step(a_ptr, b_ptr, la, lb, i, j, a, b, live)
            # join() adds the minor dimension: the innermost join picks the lowest bit of the index
            run8 = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
            run8 = tl.reshape(run8, [LANES, 8])
            col = tl.arange(0, 8)
            out = d[:, None] + col[None, :]
            tl.store(
                dst + p[:, None] * 2 * W + out, run8,
                mask=live[:, None] & (out < (la + lb)[:, None]),
            )  # fmt: skip

    @triton.jit(do_not_specialize=["T", "max_row"])
    def _fused_union_kernel(
        ROWS, TOPK_LEN, UNION, LENS, SCRATCH, CUM,
        T, K, max_row, stride_rows_t, stride_union_g,
        G: tl.constexpr, HAS_LEN: tl.constexpr, CHUNK: tl.constexpr, CCHUNK: tl.constexpr,
        LANES: tl.constexpr, STEPS: tl.constexpr,
    ):  # fmt: skip
        # One program per group: query lists -> log2(G) merge levels -> compaction (module docstring).
        # Buffers alternate so that the last level lands in SCRATCH and the compaction writes UNION.
        LEVELS: tl.constexpr = 3 if G == 8 else (2 if G == 4 else (1 if G == 2 else 0))
        SHIFT: tl.constexpr = 3 if G > 1 else 0
        g = tl.program_id(0).to(tl.int64)
        out = UNION + g * stride_union_g
        scr = SCRATCH + g * G * K
        cum = CUM + g * (G + 1)
        total = tl.full([], 0, tl.int32)
        for j in tl.static_range(G):
            t = g * G + j
            k_end = tl.where(t < T, K, 0)
            if HAS_LEN:
                k_end = tl.minimum(k_end, tl.load(TOPK_LEN + t, mask=t < T, other=0))
            if LEVELS % 2 == 0 and G > 1:  # level m's lists live in SCRATCH when LEVELS - m is even
                n = _query_list(ROWS + t * stride_rows_t, k_end, max_row, scr + j * K, j, K, SHIFT, CHUNK)
            else:
                n = _query_list(ROWS + t * stride_rows_t, k_end, max_row, out + j * K, j, K, SHIFT, CHUNK)
            tl.store(cum + j, total)
            total += n
        tl.store(cum + G, total)
        if G == 1:  # the de-duplicated list is the output
            tl.store(LENS + g, total)
        else:
            tl.debug_barrier()
            for level in tl.static_range(LEVELS):
                if (LEVELS - level) % 2 == 0:
                    _merge_level(scr, out, cum, K, level, G, LANES, STEPS)
                else:
                    _merge_level(out, scr, cum, K, level, G, LANES, STEPS)
                tl.debug_barrier()
            tl.store(LENS + g, compact_sorted_keys(scr, out, total, G, CCHUNK))


def fused_kernel():
    """The fused union kernel (for warm-up and compile counting)."""
    return _fused_union_kernel


def fused_union(
    lists: torch.Tensor,
    topk_length: torch.Tensor | None,
    max_row: int,
    group_size: int,
    union: torch.Tensor,
    lens: torch.Tensor,
) -> None:
    """Launch the fused build (checked inputs, CUDA or interpreter; see the module docstring).

    Args:
        lists: ``[T, K]`` int32 rows whose valid entries are non-decreasing per row (the
            caller's sorted top-k, or a row sort's keys with INT32_MAX = invalid), unit last stride.
        topk_length: ``[T]`` int32 or None. max_row: largest valid row (``num_kv_rows - 1``).
        group_size: ``G``. union / lens: ``[ceil(T/G), G*K]`` / ``[ceil(T/G)]`` int32 outputs,
            contiguous rows.
    """
    topk_length = unit_stride(topk_length)
    t, k = lists.shape
    g_count = union.shape[0]
    cfg = fused_launch_config(group_size, k)
    scratch = torch.empty(g_count, group_size * k, dtype=torch.int32, device=lists.device) if group_size > 1 else union
    cum = torch.empty(g_count, group_size + 1, dtype=torch.int32, device=lists.device)
    _fused_union_kernel[(g_count,)](
        lists, topk_length if topk_length is not None else lens, union, lens, scratch, cum,
        t, k, max_row, lists.stride(0), union.stride(0),
        G=group_size, HAS_LEN=topk_length is not None, CHUNK=cfg["CHUNK"], CCHUNK=cfg["CCHUNK"],
        LANES=cfg["LANES"], STEPS=cfg["STEPS"], num_warps=cfg["num_warps"], **COMPILE_OPTIONS,
    )  # fmt: skip
