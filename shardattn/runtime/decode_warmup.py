"""Decode warm-up: a Runtime's decode kernels launched once on tiny inputs, the way its steps call them.

Takes the config as plain arguments (no Runtime import), so :mod:`shardattn.runtime.runtime`
depends on this module and not the other way round; the prefill side uses the kernels' own key
list (:func:`shardattn.runtime.warmup.compile_keys`).
"""

from __future__ import annotations

import itertools

import torch

from shardattn.kernels.gluon.union_smem import WINDOWS as UNION_WINDOWS
from shardattn.ops.dispatch import sparse_decode_kernel
from shardattn.ops.gqa_decode import gqa_paged_decode
from shardattn.ops.sparse_mla_decode import run_sparse_mla_decode, sparse_mla_decode
from shardattn.ops.topk import DcpShard, convert_topk
from shardattn.ops.unique_rows import decode_rows, unique_rows
from shardattn.plan.spec import ModelSpec

#: Split counts whose column merges (one compiled variant per power of 2 of the count) the warm-up runs.
COLUMN_MERGE_WARMUP_SPLITS = (2, 4, 8, 16, 32, 64)


def small_kernel_sizes(
    topk: int, max_decode_tokens: int, num_sms: int, heads: int = 16, *, kv_fp8: bool = False
) -> set[int]:
    """Token counts up to ``max_decode_tokens`` at which each compiled variant of the small-batch
    Gluon decode kernel first runs on ``num_sms`` SMs at ``heads`` heads: its ``BLOCK_N``
    (:func:`~shardattn.kernels.gluon.sparse_mla_decode_small.small_decode_tiles`) and the heads a
    program takes (:func:`~shardattn.kernels.gluon.sparse_mla_decode_small.small_decode_heads`)
    change with the batch (and with ``kv_fp8``, ``fp8_ds_mla`` rows).

    >>> sorted(small_kernel_sizes(2048, 64, 132)), sorted(small_kernel_sizes(2048, 64, 132, kv_fp8=True))
    ([1, 3, 5], [1, 3, 5])
    >>> sorted(small_kernel_sizes(2048, 2, 132))
    [1]
    """
    from shardattn.plan.decode_routing import SMALL_DECODE_MAX_TOKENS, small_decode_heads, small_decode_tiles

    first: dict[tuple[int, int], int] = {}
    for t in range(1, min(max_decode_tokens, SMALL_DECODE_MAX_TOKENS) + 1):
        block_n, splits = small_decode_tiles(t, topk, num_sms, kv_fp8=kv_fp8)
        first.setdefault((block_n, small_decode_heads(t, splits, heads, num_sms)), t)
    return set(first.values())


def compiles_kernels(device: torch.device) -> bool:
    """``True`` when launches on ``device`` compile kernels (CUDA; on the CPU the references run)."""
    return device.type == "cuda"


def _sink_options(spec: ModelSpec, heads: int, device: torch.device, dcp: DcpShard | None) -> tuple:
    """The sinks a step hands this rank's decode kernel: ``(None,)`` for a spec without them (a
    step refuses sinks there) and for a DCP rank other than 0 (the sink term is counted once, on
    rank 0), else one ``[heads]`` tensor (a step with sinks always passes them)."""
    if not spec.has_sinks or (dcp is not None and dcp.rank != 0):
        return (None,)
    return (torch.zeros(heads, device=device),)


def _grids(kernel: str, kv_fp8: bool) -> tuple[dict | None, ...]:
    """The launch configurations the warm-up forces on ``kernel``: the 64-key Gluon kernel's two
    grids where its plan may take either (bf16 / fp16 rows: persistent past one wave of tiles; on
    ``fp8_ds_mla`` rows one tile a program, :func:`~shardattn.kernels.gluon.sparse_mla_decode.gluon_decode_plan`),
    else the kernel's own (``None``)."""
    if kernel != "gluon":
        return (None,)
    return ({"persistent": False},) if kv_fp8 else ({"persistent": False}, {"persistent": True})


def warm_up_decode(
    spec: ModelSpec,
    *,
    device: torch.device,
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    topk: int,
    max_decode_tokens: int,
    scale: float,
    dcp: DcpShard | None,
    need_lse: bool,
    gqa_backend: str,
    kv_fp8: bool = False,
) -> int:
    """Run a Runtime's decode kernels locally (no collective) on tiny inputs, the way its steps call them.

    Args:
        spec: the model. device, dtype: where and in what the steps run.
        heads / kv_heads: query / KV heads one decode kernel call sees (DCP: all of them).
        topk: top-k width (sparse MLA). max_decode_tokens: the largest decode step.
        scale: softmax scale. dcp: this rank's DCP shard (``None``: head-TP decode).
        need_lse: the steps ask the GQA kernel for its LSE. gqa_backend: the GQA kernel's backend.
        kv_fp8: the sparse-MLA cache holds ``fp8_ds_mla`` rows (the kernels' FP8 variants).

    Covers: top-k conversion with this mode's flags (DCP shard or not, with and without
    ``topk_length``; packed as a ``topk_unique`` step converts, and not), the de-duplication as
    the other steps call it (no ``topk_length``; the hash, and the bitmap union at each of its
    windows a larger cache takes), the decode kernel at 1, 2 and
    ``max_decode_tokens`` query tokens (unsplit and split-KV, so the LSE merge too), with sinks
    as the rank's steps pass them (a spec with sinks: always, but under DCP only on rank 0), and
    for GQA head-TP uniform and ragged drafts. The decode kernels publish no compile-key list (unlike prefill),
    so this mirrors their call sites.
    Sparse MLA on sm_90 routes by batch size (the small-batch Gluon kernel, Triton below the Gluon
    crossovers, Gluon above: :func:`~shardattn.plan.decode_routing.route_sparse_decode_kernel`), so the
    routed call also runs at the sizes where the small kernel's tile or heads a program change
    (:func:`small_kernel_sizes`), the Triton kernel is also run
    at every size (the variants a smaller batch than ``max_decode_tokens`` may need) and, where
    ``max_decode_tokens`` reaches Gluon, that path unsplit and at every :data:`COLUMN_MERGE_WARMUP_SPLITS`
    row slices (its two kernel variants, written to ``out`` or to fp32 partials, and the merge's
    variant for each power of 2 of the slices), on each grid its plan may take (:func:`_grids`); where it reaches the
    streaming Gluon kernel, that kernel unsplit and at every :data:`COLUMN_MERGE_WARMUP_SPLITS` slices
    (the merge's variant for each power of 2 of the slices a smaller batch's plan may take); at one
    token the Triton path at every :data:`COLUMN_MERGE_WARMUP_SPLITS` (the column merge's variants).
    """
    gen = torch.Generator(device="cpu").manual_seed(0)
    d, page, h = spec.head_dim, spec.page_size, heads
    sizes = sorted({1, 2, max_decode_tokens}) if compiles_kernels(device) else [2]  # nothing compiles on the CPU
    if compiles_kernels(device) and spec.kind == "sparse_mla" and device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        sizes = sorted({*sizes, *small_kernel_sizes(topk, max_decode_tokens, sms, heads, kv_fp8=kv_fp8)})
    dev, dt = device, dtype
    launches = 0

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dev, dt)

    if spec.kind == "sparse_mla":
        kv = randn(4 * page, d)
        if kv_fp8:
            from shardattn.ops.kv_fp8 import quantize_kv

            kv = quantize_kv(kv)
        table = torch.arange(4, dtype=torch.int32, device=dev)[None, :]
        seq = torch.tensor([4 * page], dtype=torch.int32, device=dev)
        sink_options = _sink_options(spec, h, dev, dcp)
        for t in sizes:
            q = randn(t, h, d)
            pos = torch.randint(-1, 4 * page, (t, topk), generator=gen, dtype=torch.int32).to(dev)
            req = torch.zeros(t, dtype=torch.int32, device=dev)
            converted = {}
            for length, unique in itertools.product(
                (None, torch.full((t,), max(1, topk // 2), dtype=torch.int32, device=dev)), (False, True)
            ):
                # as the step converts: packed with unique rows (the count their kernels' topk_length),
                # else as listed (the de-duplication drops the invalid entries; no topk_length: D89)
                converted[unique] = convert_topk(
                    pos, req, table, block_size=page, seq_lens=seq, topk_length=length, dcp=dcp, packed=unique
                )
                launches += 1
            row_lists = [(converted[False][0], None, False), (converted[True][0], converted[True][1], True)]
            if compiles_kernels(device) and t == max(sizes):
                # the warm-up cache is small (past a few tokens its de-duplication is the bitmap
                # union); a real cache past the bitmap's ratio de-duplicates by hash at every
                # batch (ops.unique_rows.decode_rows), a programmatic dependent launch ahead of the
                # small-batch, streaming, Triton and sliced Gluon kernels, a plain one ahead of the others
                for pdl in (False, True):
                    hashed = unique_rows(converted[False][0], num_kv_rows=kv.shape[0], pdl=pdl)
                    launches += 1
                # and hands the kernels its rows (repeats -1) with no topk_length: their own variants
                row_lists.append((hashed, None, True))
                # the bitmap union compiles a variant per window of words (union_smem.WINDOWS): a
                # cache past the first window's rows takes the next one, where the route keeps the
                # union (the rows stay the small cache's: only the window, from num_kv_rows, is
                # compiled in)
                for window in UNION_WINDOWS[1:]:
                    decode_rows(converted[False][0], num_kv_rows=32 * window)
                    launches += 1
            rows = converted[True][0]
            gluon = (
                compiles_kernels(device) and t == max(sizes) and sparse_decode_kernel(q, kv, spec.v_dim)[0] == "gluon"
            )
            stream = (
                compiles_kernels(device)
                and t == max(sizes)
                and sparse_decode_kernel(q, kv, spec.v_dim, rows)[0] == "gluon_stream"
            )
            forced = (  # (kernel, split counts) run with the kernel and its splits forced, in this order
                # the column merge compiles one variant per power of 2 of the split count, which
                # depends on the batch: cover them all at one token, on a union and on raw rows
                ("triton", COLUMN_MERGE_WARMUP_SPLITS if t == 1 and compiles_kernels(device) else ()),
                # unsplit (unique rows: read in place) and sliced: the kernel is not specialised on the
                # slices, its merge compiles one variant per power of 2 of them (gluon_merge_tile); on
                # both grids (the plan's depends on the batch: gluon_decode_plan)
                ("gluon", (1, *COLUMN_MERGE_WARMUP_SPLITS) if gluon else ()),
                # written to out, and to fp32 partials + the column merge at each power of 2 of the slices
                # a batch's plan may take: every slice count a plan takes (the kernel is specialised on it,
                # not on the batch: NOT_SPECIALIZED)
                ("gluon_stream", (1, *COLUMN_MERGE_WARMUP_SPLITS) if stream else ()),
            )
            for sinks, (rows, valid, unique) in itertools.product(sink_options, row_lists):
                # topk_unique (rows_unique): the kernels see the raw rows, not a union: their own variants
                for backend in (None, "triton") if compiles_kernels(device) else (None,):  # routed, and Triton's
                    sparse_mla_decode(
                        q, kv, rows, scale=scale, v_dim=spec.v_dim, topk_length=valid, sinks=sinks, backend=backend,
                        rows_unique=unique,
                    )  # fmt: skip
                    launches += 1
                for kernel, counts in forced:
                    for splits, config in itertools.product(counts, _grids(kernel, kv_fp8)):
                        run_sparse_mla_decode(
                            q, kv, rows, scale=scale, v_dim=spec.v_dim, topk_length=valid, sinks=sinks,
                            kernel=kernel, num_splits=splits, rows_unique=unique, config=config,
                        )  # fmt: skip
                        launches += 1
        return launches
    k = randn(2, page, kv_heads, d)
    lse, backend = need_lse, gqa_backend
    sink_options = _sink_options(spec, h, dev, dcp)
    for t in sizes:
        keys = max(min(page, 3), 2)  # room for the head-TP drafts' pairs, on pages of one token too
        table = torch.zeros(t, -(-keys // page), dtype=torch.int32, device=dev)
        lens = torch.full((t,), keys, dtype=torch.int32, device=dev)
        for sinks in sink_options:
            q = randn(t, h, d)
            gqa_paged_decode(q, k, k, table, lens, q_len_per_req=1, sinks=sinks, return_lse=lse, backend=backend)
            launches += 1
            if dcp is None and t > 1:  # head-TP drafts: uniform pairs and a ragged batch
                pairs = table[: t // 2]
                qq = randn(t // 2 * 2, h, d)
                gqa_paged_decode(
                    qq, k, k, pairs, lens[: t // 2], q_len_per_req=2, sinks=sinks, return_lse=lse, backend=backend
                )
                cu = torch.arange(t // 2 + 1, dtype=torch.int32, device=dev) * 2
                gqa_paged_decode(
                    qq,
                    k,
                    k,
                    pairs,
                    lens[: t // 2],
                    cu_q_lens=cu,
                    max_q_len=2,
                    sinks=sinks,
                    return_lse=lse,
                    backend=backend,
                )
                launches += 2
    return launches
