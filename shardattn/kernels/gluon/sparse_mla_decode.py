"""Sparse-MLA decode on the Gluon per-query kernel (sm_90): its options, its slice plan, its launch.

The warp-specialised Gluon prefill kernel (:mod:`shardattn.kernels.gluon.sparse_mla`) runs one
query token x 64 heads per program over the token's whole row list. Decode is the same math with
few tokens; where one program per (token, head block) would leave SMs idle, each token's row list
is cut into ``S`` slices run as pseudo-queries and merged by LSE
(:mod:`shardattn.ops.sparse_mla_decode_gluon` runs that path).

The split count (:func:`gluon_decode_plan`) minimises a wave model of the kernel: a program costs
``CTA_OVERHEAD_US + chunk * KEY_US[kv_fp8]`` (one program per SM: the kernel uses 225 KB of shared memory),
and splitting adds the merge and the partial bytes (the slices are read in place: no copy of q or
of the rows). Where the tiles make more than one wave on bf16 / fp16 rows, the plan asks for the
persistent grid (a program starts its next tile's gathers during this one's epilogue); on
``fp8_ds_mla`` rows the persistent producer spills and every launch is one tile a program
(docs/DECISIONS.md, D101, D102). Everything depends on shapes only (no host sync), so a launch is
CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from shardattn._ints import next_pow2
from shardattn.kernels.split_count import pick_splits
from shardattn.kernels.triton.lse_merge import split_partials_numel

__all__ = [
    "CTA_OVERHEAD_US",
    "KEY_US",
    "MAX_SPLITS",
    "SPLIT_ROWS",
    "gluon_attend",
    "gluon_decode_config",
    "gluon_decode_plan",
    "gluon_merge_tile",
    "reads_raw_rows",
]

#: Rows of a slice are a multiple of this: one 64-key block of the kernel (it takes blocks in pairs
#: and masks the second past ``lens``, so a slice of an odd number of blocks costs one half-empty
#: pair, nothing more).
SPLIT_ROWS = 64
#: Most slices per top-k row the model picks: 32 was never the fastest (1.09x the time of 16 at
#: 32-64 heads x 1-2 tokens, top-k 2,048; docs/DECISIONS.md, D65).
MAX_SPLITS = 16
#: One program's fixed cost (Q load, ring fill, epilogue), us (estimate).
CTA_OVERHEAD_US = 3.0
#: One program's time per key row at 64 heads, us, by whether the rows are ``fp8_ds_mla`` (the
#: producer dequantises them: one program over 2,048 rows took 1.9x the bf16 time on an H200, D65).
KEY_US = {False: 0.04, True: 0.08}
#: The merge kernel's launch and fixed cost, us, and the bytes per us the partials (written by the
#: kernel, read by the merge) move. A merge of two slices costs 4-7 us (D64); at 4.0 the plan split
#: 13 shapes that run 1.01-1.14x faster in one slice; at 8.0 it would also keep 7 more whole, 4 of
#: them 1.03-1.08x slower so (docs/DECISIONS.md, D104).
MERGE_US = 5.0
BYTES_PER_US = 3.0e6
HEAD_BLOCK = 64
#: Partial values one merge program loads (slices x rows x columns, :func:`gluon_merge_tile`): 4,096
#: at 4 warps was the fastest of 2,048 / 4,096 / 8,192 at 8 warps, 512 / 256 columns, measured on an
#: H200 behind the decode kernel at 32-128 heads x 4-64 tokens (docs/DECISIONS.md, D64).
MERGE_TILE_ELEMS = 4096


def gluon_decode_plan(
    num_tokens: int,
    num_heads: int,
    topk: int,
    num_sms: int,
    num_splits: int | None = None,
    *,
    v_dim: int = 512,
    max_partial_elems: int | None = None,
    kv_fp8: bool = False,
    persistent: bool | None = None,
) -> dict[str, int]:
    """Slices per top-k row and rows per slice of a Gluon decode launch (host-side, shapes only).

    Args:
        num_tokens, num_heads, topk: the launch's ``T``, ``H`` and ``K``.
        num_sms: SMs of the GPU (one program per SM at a time).
        num_splits: slices asked for (rounded to ``SPLIT_ROWS``-row slices); None = the wave model.
        max_partial_elems: fp32 elements a caller's workspace holds; fewer slices are used when
            the model's choice would not fit (None = no limit).
        kv_fp8: the rows are ``fp8_ds_mla`` (a key costs twice: more slices pay off sooner).
        persistent: the grid asked for (None = bf16 / fp16 rows whose tiles outnumber the SMs).
    Returns:
        ``{"num_splits": S, "chunk": rows per slice, "persistent": bool}`` with ``S * chunk >=
        topk``; ``persistent``: the launch takes the persistent grid (bf16 / fp16 rows whose ``T x
        head blocks x S`` tiles outnumber the SMs).

    Example:
        >>> [gluon_decode_plan(t, 128, 2048, 132)["num_splits"] for t in (1, 8, 64, 256)]
        [16, 8, 1, 1]
        >>> [gluon_decode_plan(t, 128, 2048, 132)["persistent"] for t in (8, 64, 256)]
        [False, False, True]
    """
    k = max(int(topk), 1)
    hb = -(-num_heads // HEAD_BLOCK)

    def shape(s: int) -> tuple[int, int]:
        per_slice = -(-k // s)
        chunk = -(-per_slice // SPLIT_ROWS) * SPLIT_ROWS
        return -(-k // chunk), chunk

    def fits(s: int) -> bool:
        return max_partial_elems is None or split_partials_numel(s, num_tokens, num_heads, v_dim) <= max_partial_elems

    def cost(s: int) -> float:
        waves = -(-num_tokens * hb * s // num_sms)
        chunk = shape(s)[1]
        t = waves * (CTA_OVERHEAD_US + chunk * KEY_US[kv_fp8])
        if s > 1:
            part = split_partials_numel(s, num_tokens, num_heads, v_dim) * 4 * 2
            t += MERGE_US + part / BYTES_PER_US
        return t

    s, chunk = shape(pick_splits(shape, fits, cost, asked=num_splits, limit=k, max_splits=MAX_SPLITS))
    if persistent is None:
        persistent = not kv_fp8 and num_tokens * hb * s > num_sms
    return {"num_splits": s, "chunk": chunk, "persistent": persistent}


def gluon_merge_tile(num_splits: int, v_dim: int = 512) -> tuple[int, int]:
    """``(block_rows, block_d)`` of the column merge after a sliced launch
    (:func:`~shardattn.kernels.triton.lse_merge.launch_lse_merge_columns`): a program loads every
    slice's partials of ``block_rows`` (token, head) rows x ``block_d`` columns at once, about
    :data:`MERGE_TILE_ELEMS` values (all ``v_dim`` columns of a row while the slices allow).

    Example:
        >>> [gluon_merge_tile(s) for s in (2, 4, 8, 16, 32)]
        [(4, 512), (2, 512), (1, 512), (1, 256), (1, 128)]
    """
    p = max(2, next_pow2(num_splits))
    width = next_pow2(v_dim)
    block_d = min(width, max(32, MERGE_TILE_ELEMS // p))
    return max(1, MERGE_TILE_ELEMS // (p * block_d)), block_d


def gluon_decode_config(num_heads: int = 0, v_dim: int = 512, rope_dim: int = 64, *, persistent: bool = False):
    """The Gluon kernel's options for decode: a token's head blocks adjacent in the grid (at 128
    heads its two programs read the same rows, the second from L2), Q loaded by the producer
    (docs/PERFORMANCE.md), and one tile a program unless ``persistent`` (the plan's choice,
    :func:`gluon_decode_plan`: the persistent grid measured level within one wave of tiles, 1-4 %
    faster past it on bf16 rows, slower on fp8_ds_mla rows, D101, D102). Every shape takes the same
    options otherwise (64 heads a program, fewer pad it).

    Returns:
        A :class:`~shardattn.kernels.gluon.sparse_mla.GluonConfig`.
    """
    del num_heads, v_dim, rope_dim
    from shardattn.kernels.gluon.sparse_mla import GluonConfig

    return GluonConfig(heads_fastest=True, early_kv=True, persistent=persistent)


def gluon_attend(
    q, kv, union, lens, *, scale, v_dim, sinks, out, lse, raw_rows: bool = False, q_slices: int = 1,
    persistent: bool = False,
) -> None:  # fmt: skip
    """Launch the Gluon kernel with the decode options on row lists ``union`` / ``lens`` (or, with
    ``raw_rows``, the caller's rows and ``topk_length``), each token's list cut into ``q_slices``
    slices run as queries of their own
    (:func:`~shardattn.kernels.gluon.sparse_mla.launch_gluon_attention`), on the persistent grid
    with ``persistent``. A sliced launch (``q_slices > 1``) is a programmatic dependent launch where
    the device takes one: it lets the merge after it launch at once; one slice, which no merge
    follows, keeps the plain launch (D98)."""
    from shardattn.kernels.backend import pdl_supported
    from shardattn.kernels.gluon.sparse_mla import launch_gluon_attention

    cfg = gluon_decode_config(q.shape[1], v_dim, q.shape[-1] - v_dim, persistent=persistent)
    launch_gluon_attention(
        q, kv, union, lens, scale=scale, v_dim=v_dim, config=cfg, sinks=sinks, out=out, lse=lse, raw_rows=raw_rows,
        q_slices=q_slices, pdl=q_slices > 1 and pdl_supported(q.device),
    )  # fmt: skip


def reads_raw_rows(rows: torch.Tensor, topk_length: torch.Tensor | None) -> bool:
    """Whether a one-slice launch reads ``rows`` in place (no packing): contiguous int32 rows (and
    int32 ``topk_length``)."""
    return (
        rows.dtype == torch.int32 and rows.stride(-1) == 1 and (topk_length is None or topk_length.dtype == torch.int32)
    )
