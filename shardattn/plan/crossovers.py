"""Every measured threshold a route uses, in one place.

Each constant is where one implementation starts to beat another on an H200 (heads, tokens, group
size, tiles, merges, union builder, decode kernel), with one line saying why. The runs behind
them (commands, tables, dates) are in ``docs/PERFORMANCE.md``, and the decision each one made,
with the variants measured against it, in ``docs/DECISIONS.md`` (``Dn`` below); a change here is a
routing change and should come with a run there. :mod:`shardattn.plan.routing` reads these (and so do the kernel
launchers for their tile choices); nothing else decides by number.

Example:
    >>> GLUON_MIN_HEADS, GROUPED_MAX_HEADS, SMALL_DECODE_MAX_TOKENS
    (32, 8, 16)
"""

from __future__ import annotations

from types import MappingProxyType

# ---- sparse-MLA prefill: which kernel, how many queries per tile ---------------------------------

#: Most heads at which grouping ``G = 64 / heads`` queries per tile beats the per-query Triton
#: kernel: the union build and membership masks cost more than the shared gathers save above it (D10).
GROUPED_MAX_HEADS = 8
#: Fewest heads at which the per-query Gluon kernel (sm_90) beats the per-query Triton kernel: its
#: tile is 64 heads, fewer pad it (D1).
GLUON_MIN_HEADS = 32
#: Most heads at which the grouped Gluon kernel runs (``G = 64 / heads`` of 8 / 4 / 2): beyond it
#: the per-query Gluon kernel fills the tile by itself (D10, D11).
GLUON_GROUPED_MAX_HEADS = 32
#: Rows of one grouped tile (``G`` queries x ``heads``): 128-row Triton programs spill registers,
#: so a default grouped step fills 64 rows (8 / 16 / 32 heads -> G = 8 / 4 / 2; D10).
TILE_ROWS = 64
#: Fewest new tokens for which a step is token-sharded (ShardQ / PCP); smaller steps run head-TP.
DEFAULT_MIN_TOKENS = 1024

# ---- ShardQ pipeline -------------------------------------------------------------------------------

#: Work of one chunk (tokens x heads x top-k) below which a ShardQ step is not cut further: about
#: 2.5-3 ms of kernel, so the host (1-1.5 ms to issue a chunk) stays ahead of the GPU (D40).
CHUNK_WORK = 4096 * 64 * 2048
#: The most chunks the planner picks by itself: more measured no faster on two GPUs (D40).
AUTO_MAX_CHUNKS = 4

# ---- union build -----------------------------------------------------------------------------------

#: Sorting builder per ``G`` on unsorted rows where no bitmap build takes them: the row sort at
#: ``G <= 2`` (one wider sort costs what the row sort costs), the fused build at 4 / 8 (D12).
UNION_METHOD = MappingProxyType({1: "sort", 2: "sort", 4: "fused", 8: "fused"})
#: The Triton bitmap build takes unsorted rows while the words it counts, ``ceil(R / 32)``, are at
#: most this many times the group's entries ``G * K``: beyond it the count costs more than a sort (D14).
BITMAP_SCAN_RATIO = 2
#: The same rule for the shared-memory bitmap build (sm_90) on unsorted rows: it counts in shared
#: memory, so it stays the fastest up to a larger cache (D15).
SMEM_SCAN_RATIO = 4
#: ... and on sorted rows at ``G > 1``, where the fused build needs no row sort and wins sooner (D15).
SMEM_SORTED_RATIO = 1
#: Decode's de-duplication takes the hash (each token spread over several programs) rather than
#: the bitmap union up to this many tokens on any cache: faster at 1 and 8 tokens, slower at 64 (D96).
DEDUP_HASH_MAX_TOKENS = 8

# ---- large and FP8 caches: gathering and staging rows before a prefill kernel ----------------------

#: The smallest grouped ``G`` for which a call on a cache too large for packed union entries
#: gathers the blocks its rows touch and runs grouped, instead of per query. Measured with the
#: earlier torch-op gathering (about 0.5 ms a 4K-token call, its host sync included): on an H200
#: with a 40M-row cache the bf16 step took 1.54 / 1.49 / 2.30 ms gathered against 2.24 / 2.12 /
#: 2.03 per query at 8 / 16 / 32 heads (G = 8 / 4 / 2; D53). The gathering is faster since D62 and
#: ``G = 2`` has not been measured again.
COMPACT_MIN_GROUP = 4
#: Fewest union entries for which a prefill call on ``fp8_ds_mla`` rows dequantises the rows it reads
#: once into a staged buffer; smaller (decode-sized) calls dequantise in the kernel (D50).
STAGE_MIN_ENTRIES = 1 << 16
#: ... and only where the union reads each staged row at least this many times on average: rows
#: spread over a large cache dequantise in the kernel (D50).
STAGE_MIN_REUSE = 2.0

# ---- sparse-MLA decode -----------------------------------------------------------------------------

#: Fewest heads at which decode runs the Gluon kernel (sm_90) instead of the Triton split-KV
#: kernel: its tile is 64 heads, fewer pad it (D16).
GLUON_DECODE_MIN_HEADS = 32
#: Fewest query rows (``tokens x heads``) at which it does: below, the Triton split-KV kernel is as
#: fast (32 heads x 1 token: 15.5 against Gluon's 15.3 us); from there Gluon is faster (64 heads x 1:
#: 17.8 against 19.8; 32 x 4: 17.3 against 20.4; D64).
GLUON_DECODE_MIN_QUERY_ROWS = 64
#: The same on ``fp8_ds_mla`` rows, where the FP8 producer costs more. At 128 query rows the Triton
#: kernel is faster (64 heads x 2 tokens 20.5 against Gluon's 22.3 us, 128 x 1 20.4 against 22.5,
#: 32 x 4 19.6 against 21.4); from 160 Gluon is (32 x 5 41.8 against 20.8; 64 x 3 30.7 against 21.4;
#: D64, D65).
GLUON_DECODE_FP8_MIN_QUERY_ROWS = 160
#: Most heads at which decode may run the small-batch Gluon kernel (heads as the ``wgmma`` N, 8 or
#: 16 wide: no padding to a 64-row tile; D28).
SMALL_DECODE_MAX_HEADS = 16
#: Most tokens at which it does: at 32 tokens its one large program per SM runs four waves and
#: the Triton split-KV kernel is faster (D28).
SMALL_DECODE_MAX_TOKENS = 16
#: Where the streaming kernel can run, the small-batch kernel takes a call only while its programs
#: at 128-entry splits (``tokens x ceil(topk / 128)``) fill at most this many waves of the SMs: at
#: top-k 2,048 from 9 tokens they run two waves, and there the streaming kernel was 1.01-1.19x
#: faster (4-16 tokens, top-k 1,536-8,192, 8-16 heads, both formats); within one wave it was level
#: or slower (D72).
SMALL_DECODE_MAX_WAVES = 1.0
#: The small-batch kernel takes 64-entry splits (one warpgroup) while their programs fill at most
#: this fraction of the SMs (one gather each, all in flight), else 128-entry splits on two (D31).
SMALL_DECODE_64_MAX_SM_FRACTION = 0.5
#: The same on ``fp8_ds_mla`` rows: 64-entry splits while their programs fit one wave (at 16 heads,
#: top-k 2,048: 3-4 tokens 1.04-1.06x faster than 128-entry splits; D59).
SMALL_DECODE_FP8_64_MAX_SM_FRACTION = 1.0
#: Heads of one small-batch program when two programs share a split's rows while they fit one
#: wave: each runs the softmax, P.V and the store on half the heads, on SMs that would idle (D33).
SMALL_DECODE_HEAD_GROUP = 8
#: Fewest 64-entry blocks per SM (``tokens x ceil(topk / 64) / num_sms``) at which a decode call of
#: at most :data:`SMALL_DECODE_MAX_HEADS` heads and more than :data:`SMALL_DECODE_MAX_TOKENS` tokens
#: runs the streaming Gluon kernel (one ring of blocks per SM) instead of the Triton split-KV kernel,
#: on bf16 / fp16 rows: any (from 0.5 blocks per SM it was 1.03-1.56x faster; D54, D58).
STREAM_DECODE_MIN_BLOCKS_PER_SM = 0.0
#: The same on ``fp8_ds_mla`` rows: from 1 block per SM (0.92-1.31x the Triton step there, faster at
#: 29 of 34 shapes; below it 0.80-0.90x; D58).
STREAM_DECODE_FP8_MIN_BLOCKS_PER_SM = 1.0
#: Columns and warps of a program of the column merge after the small-batch kernel: one warp holds
#: every split's partial of its columns, so the reductions over the splits need no shared memory (D34).
SMALL_MERGE_COLUMNS, SMALL_MERGE_WARPS = 64, 1
#: Columns and warps of a program of the column merge after the streaming kernel: one (token, head)
#: row's 512 columns on 4 warps: the streaming step took 0.77-1.01x its time with the small-batch
#: kernel's tile, 8-128 tokens at 2-16 slices (fewer, wider programs; D72).
STREAM_MERGE_COLUMNS, STREAM_MERGE_WARPS = 512, 4
#: Most (token, head) rows whose split partials merge with the column merge (every partial of a
#: column block loaded at once, one latency); more rows take the row merge (fewer, wider programs; D19).
COLUMN_MERGE_MAX_ROWS = 128
#: At most this many (token, head) rows the Triton split-KV kernel takes the one-wave split count
#: (the most splits whose programs fit one wave) instead of its bandwidth cost model (D23) ...
ONE_WAVE_MAX_ROWS = 128
#: ... of at most this many splits at <= 32 heads; at <= 16 heads a split of up to
#: :data:`ONE_WAVE_MAX_BLOCK_N` rows is gathered in one step (one tile, 8 warps; D25).
ONE_WAVE_MAX_SPLITS = 64
ONE_WAVE_MAX_BLOCK_N = 128

__all__ = [
    "AUTO_MAX_CHUNKS",
    "BITMAP_SCAN_RATIO",
    "CHUNK_WORK",
    "COLUMN_MERGE_MAX_ROWS",
    "COMPACT_MIN_GROUP",
    "DEFAULT_MIN_TOKENS",
    "GLUON_DECODE_FP8_MIN_QUERY_ROWS",
    "GLUON_DECODE_MIN_HEADS",
    "GLUON_DECODE_MIN_QUERY_ROWS",
    "GLUON_GROUPED_MAX_HEADS",
    "GLUON_MIN_HEADS",
    "GROUPED_MAX_HEADS",
    "ONE_WAVE_MAX_BLOCK_N",
    "ONE_WAVE_MAX_ROWS",
    "ONE_WAVE_MAX_SPLITS",
    "SMALL_DECODE_64_MAX_SM_FRACTION",
    "SMALL_DECODE_FP8_64_MAX_SM_FRACTION",
    "SMALL_DECODE_HEAD_GROUP",
    "SMALL_DECODE_MAX_HEADS",
    "SMALL_DECODE_MAX_TOKENS",
    "SMALL_DECODE_MAX_WAVES",
    "SMALL_MERGE_COLUMNS",
    "SMALL_MERGE_WARPS",
    "SMEM_SCAN_RATIO",
    "SMEM_SORTED_RATIO",
    "STAGE_MIN_ENTRIES",
    "STAGE_MIN_REUSE",
    "STREAM_DECODE_FP8_MIN_BLOCKS_PER_SM",
    "STREAM_DECODE_MIN_BLOCKS_PER_SM",
    "STREAM_MERGE_COLUMNS",
    "STREAM_MERGE_WARPS",
    "TILE_ROWS",
    "UNION_METHOD",
]
