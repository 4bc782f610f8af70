"""The bitmap union build in shared memory (Gluon, sm_90): no sort and no L2 atomics.

:mod:`shardattn.kernels.triton.union_bitmap`'s three phases (mark, count, place) cost three random L2
operations per entry, because its bitmap, counts and union live in global memory. Here each
persistent program keeps all three in one shared-memory region, so an entry costs a
shared-memory atomic, an 8-byte shared load and a shared-memory atomic, and the union leaves the
SM once, coalesced. Per group ``g`` (its ``G`` queries' entries read twice, from L2 after the
first time):

1. **mark**: ``red.shared.or`` of every valid entry's bit in a window of ``WW`` bitmap words
   (``32 * WW`` rows; a larger cache is counted window by window, the entries re-read each time);
2. **count**: the window's words, one CTA-wide scan: ``packed[w] = (below[w], word[w])`` with
   ``below`` the union rows under word ``w`` (running over windows); the word is cleared; with
   block marks (``HAS_MARKS``), a word with rows in it sets its block's mark in global memory;
3. **place**: an entry's rank is ``below + popc(word & bits under its row)``; ``G > 1`` ORs
   ``row | bit_j << 24`` into the union slot (``G = 1`` stores the row);

then the union's ``lens[g]`` slots are copied out and zeroed. The output equals every other
builder's exactly (sorted by row, unique, ``lens``); entries past ``lens[g]`` are unspecified.

Shared memory is reached by inline PTX at byte offsets from ``global_smem`` (Triton's dynamic
shared-memory symbol; Gluon in Triton 3.6 has no shared-memory atomics). The region is the
kernel's only and largest explicit allocation, zeroed at the start and kept alive to the end, so
Triton's allocator places it at offset 0 and puts its own scratch (the scan's, the sum's) after
it; :func:`region_is_first` checks that on the compiled kernel, and the launcher refuses a
compile where it does not hold. Region: ``WW`` int32 bitmap words, ``WW`` int32 pairs (below,
word), ``G * KPAD`` int32 union slots (``KPAD`` = ``K`` rounded up to a power of two), the whole
rounded up to a power of two.

Measured: docs/DECISIONS.md, D15; docs/PERFORMANCE.md, union build.
"""

from __future__ import annotations

import re
from types import MappingProxyType

import torch

from shardattn._ints import next_pow2
from shardattn.kernels.backend import COMPILE_OPTIONS, unit_stride
from shardattn.kernels.gluon.compat import GLUON_IMPORT_ERROR, HAS_GLUON, cta_barrier, gl, gluon

#: Bitmap words a program counts at once (a window of ``32 * WW`` rows): 2,048 (65,536 rows) when
#: the cache fits one, else 4,096 (131,072), so a group on a larger cache is counted window by
#: window (its entries re-read per window). Two compile keys per ``G``, whatever the cache size.
WINDOWS = (2048, 4096)
#: Launch config per ``(G, window)``: entries a mark / place step holds (``STEP = G x BLOCK``),
#: words counted at once (``CW``), warps and persistent programs per SM (fewer where shared memory
#: runs out). The fastest of a sweep of launch configs on an H200 (T = 4K on a 64K-row cache for
#: window 2,048, 16K on 128K rows for 4,096; K = 2,048).
CONFIGS = MappingProxyType(
    {
        (1, 2048): {"STEP": 2048, "CW": 1024, "num_warps": 8, "per_sm": 3},
        (2, 2048): {"STEP": 2048, "CW": 1024, "num_warps": 8, "per_sm": 3},
        (4, 2048): {"STEP": 2048, "CW": 1024, "num_warps": 8, "per_sm": 3},
        (8, 2048): {"STEP": 4096, "CW": 2048, "num_warps": 16, "per_sm": 1},
        (1, 4096): {"STEP": 1024, "CW": 1024, "num_warps": 4, "per_sm": 3},
        (2, 4096): {"STEP": 1024, "CW": 1024, "num_warps": 4, "per_sm": 3},
        (4, 4096): {"STEP": 4096, "CW": 2048, "num_warps": 16, "per_sm": 1},
        (8, 4096): {"STEP": 4096, "CW": 2048, "num_warps": 16, "per_sm": 1},
    }
)
#: Most union slots a program holds (``G * KPAD``): 64 KB of int32.
MAX_UNION_SLOTS = 16384
#: Shared memory of an sm_90 SM, what each CTA reserves, and room for Triton's own scratch.
SM_SHARED_BYTES = 228 * 1024
CTA_RESERVED_BYTES = 1024
SCRATCH_BYTES = 8192


def union_slots(group_size: int, topk: int) -> int:
    """Union slots of a program: ``G * KPAD`` (``KPAD``: ``K`` rounded up to a power of two, at
    least 128)."""
    return group_size * max(128, next_pow2(topk))


def window_words(num_kv_rows: int) -> int:
    """The window of a cache of ``R`` rows: the smallest of :data:`WINDOWS` that holds its words,
    else the largest."""
    words = -(-num_kv_rows // 32)
    return next((w for w in WINDOWS if words <= w), WINDOWS[-1])


def region_words(group_size: int, topk: int, window: int) -> int:
    """Int32 words of the region: ``3 * window + G * KPAD`` rounded up to a power of two (Triton
    allocates power-of-two shapes)."""
    return next_pow2(3 * window + union_slots(group_size, topk))


def smem_unsupported_reason(rows: torch.Tensor, group_size: int) -> str | None:
    """``None`` when the shared-memory build runs these rows, else why not."""
    if not HAS_GLUON:
        return f"triton.experimental.gluon unavailable ({GLUON_IMPORT_ERROR})"
    if rows.device.type != "cuda":
        return f"rows on {rows.device} (the shared-memory build needs CUDA)"
    major, minor = torch.cuda.get_device_capability(rows.device)
    if major != 9:
        return f"compute capability {major}.{minor} (the shared-memory build is written and checked for sm_90)"
    if union_slots(group_size, rows.shape[1]) > MAX_UNION_SLOTS:
        return f"G * KPAD = {union_slots(group_size, rows.shape[1])} union slots (at most {MAX_UNION_SLOTS})"
    return None


def launch_config(group_size: int, topk: int, num_kv_rows: int) -> dict[str, int]:
    """Constexprs, warps and programs per SM of :func:`smem_union` (:data:`CONFIGS`; the compile
    key is all but ``per_sm``)."""
    window = window_words(num_kv_rows)
    cfg = CONFIGS[(group_size, window)]
    num_warps = cfg["num_warps"]
    region = region_words(group_size, topk, window)
    by_smem = SM_SHARED_BYTES // (4 * region + SCRATCH_BYTES + CTA_RESERVED_BYTES)
    return {
        "BLOCK": max(16, min(next_pow2(topk), cfg["STEP"] // group_size)),
        "WG": min(group_size, num_warps),
        "WW": window,
        "CW": min(window, cfg["CW"]),
        "REGION": region,
        "num_warps": num_warps,
        "per_sm": max(1, min(cfg["per_sm"], by_smem)),
    }


if HAS_GLUON:

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _popc(x):
        return gl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _smem_or(addr, val, live):
        # region byte ``addr`` |= val where live (no value back)
        return gl.inline_asm_elementwise(
            "{ .reg .u32 a; .reg .pred p; setp.ne.b32 p, $3, 0; mov.u32 a, global_smem; add.u32 a, a, $1;"
            " @p red.shared.or.b32 [a], $2; mov.b32 $0, 0; }",
            "=r,r,r,r", [addr, val, live.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1,
        )  # fmt: skip

    @gluon.jit
    def _smem_store(addr, val, live):
        return gl.inline_asm_elementwise(
            "{ .reg .u32 a; .reg .pred p; setp.ne.b32 p, $3, 0; mov.u32 a, global_smem; add.u32 a, a, $1;"
            " @p st.shared.b32 [a], $2; mov.b32 $0, 0; }",
            "=r,r,r,r", [addr, val, live.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1,
        )  # fmt: skip

    @gluon.jit
    def _smem_load(addr, live):
        # region int32 at byte ``addr`` (0 where not live)
        return gl.inline_asm_elementwise(
            "{ .reg .u32 a; .reg .pred p; setp.ne.b32 p, $2, 0; mov.u32 a, global_smem; add.u32 a, a, $1;"
            " mov.b32 $0, 0; @p ld.shared.b32 $0, [a]; }",
            "=r,r,r", [addr, live.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1,
        )  # fmt: skip

    @gluon.jit
    def _smem_store_pair(addr, lo, hi):
        return gl.inline_asm_elementwise(
            "{ .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, $1; st.shared.v2.b32 [a], {$2, $3}; mov.b32 $0, 0; }",
            "=r,r,r,r", [addr, lo, hi], dtype=gl.int32, is_pure=False, pack=1,
        )  # fmt: skip

    @gluon.jit
    def _smem_load_pair(addr, live):
        return gl.inline_asm_elementwise(
            "{ .reg .u32 a; .reg .pred p; setp.ne.b32 p, $3, 0; mov.u32 a, global_smem; add.u32 a, a, $2;"
            " mov.b32 $0, 0; mov.b32 $1, 0; @p ld.shared.v2.b32 {$0, $1}, [a]; }",
            "=r,=r,r,r", [addr, live.to(gl.int32)], dtype=(gl.int32, gl.int32), is_pure=False, pack=1,
        )  # fmt: skip

    @gluon.jit
    def _group_entries(ROWS, t, k_end, c, num_rows, stride_rows_t):
        # [G, BLOCK] rows of the group's queries t at columns c (row as int32, 0 where invalid)
        ok = gl.expand_dims(c, 0) < gl.expand_dims(k_end, 1)
        ptr = ROWS + gl.expand_dims(t * stride_rows_t, 1) + gl.expand_dims(c, 0)
        row = gl.load(ptr, mask=ok, other=-1)
        ok = ok & (row >= 0) & (row < num_rows)
        return gl.where(ok, row, 0).to(gl.int32), ok

    @gluon.jit
    def _mark(row, ok, wb, WW: gl.constexpr):
        # set the bits of the entries inside the window of words [wb, wb + WW)
        w = (row >> 5) - wb
        live = ok & (w >= 0) & (w < WW)
        _smem_or(w * 4, gl.full(row.shape, 1, gl.int32, row.type.layout) << (row & 31), live)

    @gluon.jit
    def _place(row, ok, wb, member, WW: gl.constexpr, G: gl.constexpr):
        # each entry inside the window at its rank: below its word + the bits under it in the word
        w = (row >> 5) - wb
        live = ok & (w >= 0) & (w < WW)
        below, word = _smem_load_pair(4 * WW + w * 8, live)
        low = (gl.full(row.shape, 1, gl.int32, row.type.layout) << (row & 31)) - 1
        slot = 12 * WW + (below + _popc(word & low)) * 4
        if G > 1:
            _smem_or(slot, row | member, live)
        else:
            _smem_store(slot, row, live)

    @gluon.jit(do_not_specialize=["T", "num_rows", "n_groups", "words"])
    def _smem_union_kernel(
        ROWS, TOPK_LEN, UNION, LENS, MARKS,
        T, K, num_rows, n_groups, stride_rows_t, stride_union_g, words,
        G: gl.constexpr, BLOCK: gl.constexpr, WW: gl.constexpr, CW: gl.constexpr, REGION: gl.constexpr,
        WG: gl.constexpr, HAS_LEN: gl.constexpr, HAS_MARKS: gl.constexpr = False, MARK_SHIFT: gl.constexpr = 1,
    ):  # fmt: skip
        NW: gl.constexpr = gl.num_warps()
        # entries [G, BLOCK]: WG warps across the queries, the rest along the rows (no replicas when
        # BLOCK >= 128 * NW / WG)
        EL: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [WG, NW // WG], [1, 0])
        WL: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])  # words and slots, lane-consecutive
        OUT_STEP: gl.constexpr = 128 * NW
        OUT: gl.constexpr = 12 * WW  # byte offsets in the region: bitmap 0, pairs 4 * WW, slots
        region = gl.allocate_shared_memory(gl.int32, [REGION], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        oo = gl.arange(0, OUT_STEP, layout=WL)
        region.slice(0, OUT_STEP).store(gl.zeros([OUT_STEP], gl.int32, WL))  # Triton's only access: at 0
        for z0 in gl.static_range(0, REGION, OUT_STEP):  # the bitmap and the slots start at 0
            _smem_store((z0 + oo) * 4, gl.zeros_like(oo), oo >= 0)
        cta_barrier()
        jj = gl.arange(0, G, layout=gl.SliceLayout(1, EL))
        kk = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, EL))
        cw = gl.arange(0, CW, layout=WL)
        member = gl.expand_dims(gl.full([G], 1, gl.int32, gl.SliceLayout(1, EL)) << (24 + jj), 1)
        for g in range(gl.program_id(0), n_groups, gl.num_programs(0)):  # g: a scalar tensor (typed int)
            t = g.to(gl.int64) * G + jj  # type: ignore[attr-defined]
            k_end = gl.where(t < T, K, 0)
            if HAS_LEN:
                k_end = gl.minimum(k_end, gl.load(TOPK_LEN + t, mask=t < T, other=0))
            total = gl.to_tensor(0)
            for wb in range(0, words, WW):
                # 1. mark (each step's entries load while the previous step's bits are set)
                row, ok = _group_entries(ROWS, t, k_end, kk, num_rows, stride_rows_t)
                for k0 in range(BLOCK, K + BLOCK, BLOCK):
                    row_next, ok_next = _group_entries(ROWS, t, k_end, k0 + kk, num_rows, stride_rows_t)
                    _mark(row, ok, wb, WW)
                    row, ok = row_next, ok_next
                row, ok = _group_entries(ROWS, t, k_end, kk, num_rows, stride_rows_t)  # loads across the count
                cta_barrier()
                # 2. count: (below, word) pairs; the words cleared for the next window or group
                for c0 in gl.static_range(0, WW, CW):
                    word = _smem_load((c0 + cw) * 4, cw >= 0)
                    cnt = _popc(word)
                    below = total + gl.associative_scan(cnt, 0, _add) - cnt
                    _smem_store_pair(4 * WW + (c0 + cw) * 8, below, word)
                    if HAS_MARKS:  # the union has rows in this word: its block of 2**MARK_SHIFT words is touched
                        gl.store(MARKS + ((wb + c0 + cw) >> MARK_SHIFT), gl.full([CW], 1, gl.int32, WL), mask=word != 0)
                    _smem_store((c0 + cw) * 4, gl.zeros_like(word), cw >= 0)
                    total += gl.sum(cnt, axis=0)
                cta_barrier()
                # 3. place
                for k0 in range(BLOCK, K + BLOCK, BLOCK):
                    row_next, ok_next = _group_entries(ROWS, t, k_end, k0 + kk, num_rows, stride_rows_t)
                    _place(row, ok, wb, member, WW, G)
                    row, ok = row_next, ok_next
                cta_barrier()
            # the union leaves coalesced; its slots are zeroed for the next group
            union = UNION + g.to(gl.int64) * stride_union_g  # type: ignore[attr-defined]
            for c0 in range(0, total, OUT_STEP):
                c = c0 + oo
                m = c < total
                gl.store(union + c, _smem_load(OUT + c * 4, m), mask=m)
                _smem_store(OUT + c * 4, gl.zeros_like(c), m)
            gl.store(LENS + g, total)
            cta_barrier()
        region.slice(0, OUT_STEP).store(gl.zeros([OUT_STEP], gl.int32, WL))  # live to the end


def smem_kernels() -> tuple:
    """The Gluon kernel, for compile counting; empty without Gluon."""
    return (_smem_union_kernel,) if HAS_GLUON else ()


_OFFSET = re.compile(r"@global_smem, i(?:32|64) (\d+)")


def region_is_first(llir: str, region: int) -> bool:
    """Whether a compiled kernel's LLVM IR puts Triton's own shared memory after the region of
    ``region`` int32 words: every constant offset from ``global_smem`` is 0 (the region's own
    accesses) or past the region."""
    return all(int(off) == 0 or int(off) >= 4 * region for off in _OFFSET.findall(llir))


def smem_union(
    rows: torch.Tensor,
    topk_length: torch.Tensor | None,
    num_kv_rows: int,
    group_size: int,
    union: torch.Tensor,
    lens: torch.Tensor,
    *,
    block_marks: torch.Tensor | None = None,
    mark_block_rows: int = 64,
) -> None:
    """Launch the shared-memory build (inputs checked by :func:`~shardattn.ops.union.build_union`;
    :func:`smem_unsupported_reason` said yes).

    Args:
        rows: ``[T, K]`` int32 or int64, unit stride along ``K``; invalid entries anywhere.
        topk_length: ``[T]`` int32 or ``None``.
        num_kv_rows: ``R <= 2**24 - 1``.
        group_size: ``G`` in ``(1, 2, 4, 8)``.
        union: ``[ceil(T/G), G*K]`` int32 output; lens: ``[ceil(T/G)]`` int32 output.
        block_marks: optional ``[ceil(R / mark_block_rows)]`` int32: set to 1 at every block of
            ``mark_block_rows`` (a power of 2, at least 32) rows the union has a row in, from the
            bitmap's words as they are counted (no second read of the union); other entries untouched.
    """
    topk_length = unit_stride(topk_length)
    t, k = rows.shape
    n_groups = union.shape[0]
    if n_groups == 0:
        return
    cfg = launch_config(group_size, k, num_kv_rows)
    sms = torch.cuda.get_device_properties(rows.device).multi_processor_count
    programs = max(1, min(n_groups, cfg.pop("per_sm") * sms))
    words = max(1, -(-num_kv_rows // 32))
    marks = {} if block_marks is None else {"HAS_MARKS": True, "MARK_SHIFT": mark_block_rows.bit_length() - 6}
    compiled = _smem_union_kernel[(programs,)](
        rows, topk_length if topk_length is not None else lens, union, lens,
        block_marks if block_marks is not None else lens,
        t, k, num_kv_rows, n_groups, rows.stride(0), union.stride(0), words,
        G=group_size, HAS_LEN=topk_length is not None, **marks, **cfg, **COMPILE_OPTIONS,
    )  # fmt: skip
    _check_region(compiled, cfg["REGION"])


def _check_region(compiled, region: int) -> None:
    # once per compiled kernel (the mark lives on Triton's object, not in this module)
    if getattr(compiled, "shardattn_region_checked", False):
        return
    if not region_is_first(compiled.asm["llir"], region):
        raise RuntimeError(
            "the shared-memory union build's region is not at offset 0 of the compiled kernel's shared "
            "memory (a Triton allocator change?); use method='sort' or method='fused'"
        )
    compiled.shardattn_region_checked = True


def compile_for_sm90(group_size: int, topk: int = 2048, num_kv_rows: int = 65536, *, marks: bool = False):
    """Compile the shared-memory build for sm_90 ahead of time (no GPU needed); returns Triton's
    compiled kernel (``asm["ptx"]``, ``asm["llir"]``, ``metadata``); ``marks``: the variant that also
    marks the 64-row blocks the union touches.

    Raises:
        RuntimeError: Gluon is not available in the installed Triton.
    """
    if not HAS_GLUON:
        raise RuntimeError(f"triton.experimental.gluon unavailable ({GLUON_IMPORT_ERROR})")
    from shardattn.kernels.gluon.compat import compile_sm90

    cfg = launch_config(group_size, topk, num_kv_rows)
    num_warps = cfg.pop("num_warps")
    cfg.pop("per_sm")
    constexprs = {"G": group_size, "HAS_LEN": True, "HAS_MARKS": marks, "MARK_SHIFT": 1, **cfg}
    signature = {
        "ROWS": "*i32", "TOPK_LEN": "*i32", "UNION": "*i32", "LENS": "*i32", "MARKS": "*i32",
        "T": "i32", "K": "i32", "num_rows": "i32", "n_groups": "i32", "stride_rows_t": "i32",
        "stride_union_g": "i32", "words": "i32",
        **dict.fromkeys(constexprs, "constexpr"),
    }  # fmt: skip
    return compile_sm90(_smem_union_kernel, signature, constexprs, options={"num_warps": num_warps})
