"""Sparse-MLA decode on the Gluon per-query kernel (sm_90): row lists, pseudo-query splits, merge.

The warp-specialised Gluon prefill kernel (:mod:`shardattn.kernels.sparse_mla_gluon`) runs one
query token x 64 heads per program over the token's whole row list. Decode is the same math with
few tokens, so this module only prepares its inputs and, where one program per (token, head
block) would leave SMs idle, cuts each token's row list into ``S`` slices run as *pseudo-queries*:

* **row lists** (:func:`split_rows`): the kernel attends ``union[p, :lens[p]]`` and masks only
  past ``lens[p]``, so the valid rows of each token (``0 <= row < R``, within ``topk_length``;
  invalid entries anywhere) are first packed to the front, in order, and cut into ``S`` slices
  of ``chunk`` rows: pseudo-query ``p = s * T + t`` holds slice ``s`` of token ``t``
  (``union [S * T, chunk]``, ``lens [S * T]``). One small Triton kernel, one program per token.
  With the default ``rows_unique=False`` the rows are first sorted and de-duplicated by
  :func:`~shardattn.kernels.union.build_union` (a row listed twice is one key); with
  ``rows_unique=True`` they are packed as given (a duplicate then counts twice, exactly as on
  the Triton path). One slice of unique rows on the 64-key kernel needs no packing: the kernel
  reads the caller's ``[T, K]`` rows in place and masks each entry (``raw_rows``: an entry outside
  ``[0, R)`` or past ``topk_length`` is no key), so the whole path is one launch.
* **q** of pseudo-query ``p`` is ``q[p mod T]``: a stride-0 view for one token, else ``S`` copies.
* **partials** land in ``[S, T, H, Dv]`` / ``[S, T, H]`` fp32 (the layout of
  :func:`~shardattn.kernels.lse_merge.split_partials`, so a caller's ``workspace`` serves) and
  :func:`~shardattn.kernels.lse_merge.launch_lse_merge` merges them into ``out`` / ``lse``.
  With one slice the kernel writes ``out`` / ``lse`` directly.
* **sinks** with ``S`` slices: every slice gets ``sink - log(S)``, so the merged denominator holds
  ``S * exp(sink) / S = exp(sink)`` once (exact; an all-empty row gives ``(0, sink)``).

The split count (:func:`gluon_decode_plan`) minimises a wave model of the kernel: a program costs
``CTA_OVERHEAD_US + chunk * KEY_US`` (one program per SM: the kernel uses 225 KB of shared memory),
and splitting adds the merge and the partial bytes. Everything depends on shapes only (no host
sync), so a launch is CUDA-graph capturable.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import replace

import torch

from shardattn.kernels.backend import use_triton
from shardattn.kernels.lse_merge import launch_lse_merge, lse_merge_reference, split_partials, split_partials_numel
from shardattn.kernels.union import build_union

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None

__all__ = [
    "CTA_OVERHEAD_US",
    "DECODE_KERNEL",
    "DECODE_KERNELS",
    "KEY_US",
    "MAX_SPLITS",
    "SPLIT_ROWS",
    "gluon_decode_config",
    "gluon_decode_plan",
    "reads_raw_rows",
    "sparse_mla_decode_gluon",
    "split_rows",
    "split_rows_reference",
]

#: Rows of a slice are a multiple of this: one 64-key block of the 64-key kernel, a pair of the
#: 32-key kernel's blocks (the 64-key kernel takes blocks in pairs and masks the second past
#: ``lens``, so a slice of an odd number of blocks costs one half-empty pair, nothing more).
SPLIT_ROWS = 64
#: Most slices per top-k row.
MAX_SPLITS = 32
#: One program's fixed cost (Q load, ring fill, epilogue), us (estimate).
CTA_OVERHEAD_US = 3.0
#: One program's time per key row at 64 heads, us: 82 us per 2,048 rows (the prefill kernel at
#: ~455 TFLOP/s on an H200, docs/DECISIONS.md, D1).
KEY_US = 0.04
#: The merge kernel's launch and fixed cost, us (estimate), and the bytes per us the partials
#: (written by the kernel, read by the merge) and q copies move.
MERGE_US = 4.0
BYTES_PER_US = 3.0e6
HEAD_BLOCK = 64


def gluon_decode_plan(
    num_tokens: int,
    num_heads: int,
    topk: int,
    num_sms: int,
    num_splits: int | None = None,
    *,
    v_dim: int = 512,
    head_dim: int = 576,
    max_partial_elems: int | None = None,
) -> dict[str, int]:
    """Slices per top-k row and rows per slice of a Gluon decode launch (host-side, shapes only).

    Args:
        num_tokens, num_heads, topk: the launch's ``T``, ``H`` and ``K``.
        num_sms: SMs of the GPU (one program per SM at a time).
        num_splits: slices asked for (rounded to ``SPLIT_ROWS``-row slices); None = the wave model.
        max_partial_elems: fp32 elements a caller's workspace holds; fewer slices are used when
            the model's choice would not fit (None = no limit).
    Returns:
        ``{"num_splits": S, "chunk": rows per slice}`` with ``S * chunk >= topk``.

    Example:
        >>> [gluon_decode_plan(t, 128, 2048, 132)["num_splits"] for t in (1, 8, 64, 256)]
        [16, 8, 1, 1]
    """
    k = max(int(topk), 1)
    hb = -(-num_heads // HEAD_BLOCK)

    def shape(s: int) -> tuple[int, int]:
        per_slice = -(-k // s)
        chunk = -(-per_slice // SPLIT_ROWS) * SPLIT_ROWS
        return -(-k // chunk), chunk

    def fits(s: int) -> bool:
        return max_partial_elems is None or split_partials_numel(s, num_tokens, num_heads, v_dim) <= max_partial_elems

    if num_splits is None:

        def cost(s: int) -> float:
            waves = -(-num_tokens * hb * s // num_sms)
            chunk = shape(s)[1]
            t = waves * (CTA_OVERHEAD_US + chunk * KEY_US)
            if s > 1:
                part = split_partials_numel(s, num_tokens, num_heads, v_dim) * 4 * 2
                q_copy = (num_tokens > 1) * s * num_tokens * num_heads * head_dim * 2 * 2
                t += MERGE_US + (part + q_copy) / BYTES_PER_US
            return t

        candidates = sorted({shape(1 << i)[0] for i in range(MAX_SPLITS.bit_length()) if (1 << i) <= MAX_SPLITS})
        s = min((c for c in candidates if fits(c)), key=cost, default=1)
    else:
        s = shape(max(1, min(int(num_splits), k)))[0]
        while s > 1 and not fits(s):
            s = shape(s // 2)[0] if s > 2 else 1
    if s > 1 and not fits(s):
        s = 1
    s, chunk = shape(s)
    return {"num_splits": s, "chunk": chunk}


#: Kernel configurations decode can run, by name: ``"ws32h"`` the 32-key kernel, ``"ws64h"`` the
#: 64-key kernel, ``"ws64hz"`` the 64-key kernel with opaque slot indices (no spilled wgmma
#: descriptors) and Q loaded by its producer (as 128-head prefill); ``h``: a query's head blocks
#: adjacent in the grid (at 128 heads a token's two programs read the same rows, the second finds
#: them in L2), ``"ws64z"`` without it; ``"ws64hzP"``: ``"ws64hz"`` as a persistent kernel (one
#: program per SM walks its slices in turn, as per-query prefill).
DECODE_KERNELS = ("ws32h", "ws64h", "ws64hz", "ws64hzP", "ws64z")
#: The routed one: the fastest measured at 128 heads and never slower than the others at 32-64
#: heads (docs/DECISIONS.md, D17); the persistent ``"ws64hzP"`` (prefill's routed kernel)
#: measured level with it, so the simpler one-tile grid stays routed (D6).
DECODE_KERNEL = "ws64hz"


@functools.cache
def _decode_configs() -> dict:
    """:data:`DECODE_KERNELS` by name, built once (the Gluon module loads only when decode takes this path)."""
    from shardattn.kernels.sparse_mla_gluon import WS32_CONFIG, WS64_CONFIG

    return {
        "ws32h": replace(WS32_CONFIG, heads_fastest=True),
        "ws64h": replace(WS64_CONFIG, heads_fastest=True, opaque_slots=False),
        "ws64hz": replace(WS64_CONFIG, heads_fastest=True, opaque_slots=True, early_kv=True),
        "ws64hzP": replace(WS64_CONFIG, heads_fastest=True, opaque_slots=True, early_kv=True, persistent=True),
        "ws64z": replace(WS64_CONFIG, heads_fastest=False, opaque_slots=True),
    }


def gluon_decode_config(num_heads: int, v_dim: int = 512, rope_dim: int = 64, kernel: str | None = None):
    """The Gluon kernel's configuration for decode.

    Args:
        num_heads, v_dim, rope_dim: the launch's shapes (every configuration serves them: 64
            heads per program, fewer pad it).
        kernel: one of :data:`DECODE_KERNELS`; None = the routed :data:`DECODE_KERNEL`.
    Returns:
        A :class:`~shardattn.kernels.sparse_mla_gluon.GluonConfig`.
    Raises:
        ValueError: an unknown ``kernel``.
    """
    del num_heads, v_dim, rope_dim
    name = DECODE_KERNEL if kernel is None else kernel
    configs = _decode_configs()
    if name not in configs:
        raise ValueError(f"kernel must be one of {DECODE_KERNELS}, got {name!r}")
    return configs[name]


def split_rows_reference(
    rows: torch.Tensor,
    *,
    num_kv_rows: int,
    num_splits: int,
    chunk: int,
    topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`split_rows` (entries past ``lens`` are ``-1`` here).

    Example:
        >>> rows = torch.tensor([[5, -1, 7, 9, 99]], dtype=torch.int32)
        >>> u, n = split_rows_reference(rows, num_kv_rows=10, num_splits=2, chunk=2)
        >>> u.tolist(), n.tolist()
        ([[5, 7], [9, -1]], [2, 1])
    """
    t, k = rows.shape
    r = rows.long()
    valid = (r >= 0) & (r < num_kv_rows)
    if topk_length is not None:
        valid &= torch.arange(k, device=rows.device)[None, :] < topk_length.long()[:, None]
    pos = valid.long().cumsum(1) - 1
    width = num_splits * chunk
    packed = torch.full((t, width + 1), -1, dtype=torch.int32, device=rows.device)
    packed.scatter_(1, torch.where(valid, pos, width), torch.where(valid, r, -1).int())
    union = packed[:, :width].view(t, num_splits, chunk).transpose(0, 1).reshape(num_splits * t, chunk)
    count = valid.sum(1)
    starts = torch.arange(num_splits, device=rows.device)[:, None] * chunk
    lens = (count[None, :] - starts).clamp(0, chunk).reshape(-1).int()
    return union.contiguous(), lens


def split_rows(
    rows: torch.Tensor,
    *,
    num_kv_rows: int,
    num_splits: int,
    chunk: int,
    topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's valid rows packed in order and cut into ``num_splits`` slices of ``chunk`` rows.

    Args:
        rows: ``[T, K]`` int32 KV rows; ``-1`` / out of ``[0, num_kv_rows)`` invalid, anywhere.
        num_kv_rows: ``R``. num_splits, chunk: ``S`` and rows per slice, ``S * chunk >= K``.
        topk_length: ``[T]`` int32 leading entries of each row to use, optional.
    Returns:
        ``(union [S * T, chunk] int32, lens [S * T] int32)``: pseudo-query ``p = s * T + t`` holds
        valid rows ``s * chunk ..`` of token ``t``, ``lens[p]`` of them (entries past it are
        unspecified on the Triton path). CUDA tensors (or the interpreter) run the Triton kernel.
    """
    t, k = rows.shape
    if num_splits * chunk < k:
        raise ValueError(f"num_splits * chunk must cover the row ({num_splits} * {chunk} < {k})")
    if triton is None or not use_triton(rows) or t == 0:
        return split_rows_reference(
            rows, num_kv_rows=num_kv_rows, num_splits=num_splits, chunk=chunk, topk_length=topk_length
        )
    union = torch.empty(num_splits * t, chunk, dtype=torch.int32, device=rows.device)
    lens = torch.empty(num_splits * t, dtype=torch.int32, device=rows.device)
    block = min(1024, max(16, triton.next_power_of_2(max(k, 1))))
    _split_rows_kernel[(t,)](
        rows, topk_length if topk_length is not None else rows, union, lens,
        t, k, num_kv_rows, rows.stride(0), rows.stride(1), chunk, num_splits,
        BLOCK=block, BLOCK_S=max(MAX_SPLITS, triton.next_power_of_2(num_splits)), HAS_LEN=topk_length is not None,
    )  # fmt: skip
    return union, lens


if triton is not None:

    @triton.jit(do_not_specialize=["T", "K", "R", "chunk", "S"])
    def _split_rows_kernel(
        ROWS, TOPK_LEN, UNION, LENS,
        T, K, R, stride_rt, stride_rk, chunk, S,
        BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, HAS_LEN: tl.constexpr,
    ):  # fmt: skip
        """One token: its valid rows, in order, to ``UNION[(pos // chunk) * T + t, pos % chunk]``."""
        t = tl.program_id(0).to(tl.int64)
        k_end = K
        if HAS_LEN:
            k_end = tl.minimum(k_end, tl.load(TOPK_LEN + t))
        base = 0
        for c0 in range(0, K, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            ok = c < k_end
            row = tl.load(ROWS + t * stride_rt + c * stride_rk, mask=ok, other=-1)
            ok = ok & (row >= 0) & (row < R)
            flag = ok.to(tl.int32)
            pos = base + tl.cumsum(flag, 0) - 1
            dst = (pos // chunk).to(tl.int64) * T * chunk + t * chunk + pos % chunk
            tl.store(UNION + dst, row, mask=ok)
            base += tl.sum(flag, 0)
        s = tl.arange(0, BLOCK_S)
        n = tl.minimum(tl.maximum(base - s * chunk, 0), chunk)
        tl.store(LENS + s.to(tl.int64) * T + t, n, mask=s < S)


def _gluon_attend(
    q, kv, union, lens, *, scale, v_dim, sinks, out, lse, raw_rows: bool = False, kernel: str | None = None
) -> None:
    from shardattn.kernels.sparse_mla_gluon import launch_gluon_attention

    cfg = gluon_decode_config(q.shape[1], v_dim, q.shape[-1] - v_dim, kernel)
    launch_gluon_attention(
        q, kv, union, lens, scale=scale, v_dim=v_dim, config=cfg, sinks=sinks, out=out, lse=lse, raw_rows=raw_rows
    )


def reads_raw_rows(rows: torch.Tensor, topk_length: torch.Tensor | None, kernel: str | None = None) -> bool:
    """Whether a one-slice launch of ``kernel`` reads ``rows`` in place (no packing): the 64-key
    kernel with contiguous int32 rows (and int32 ``topk_length``)."""
    return (
        gluon_decode_config(0, kernel=kernel).variant == "ws64"
        and rows.dtype == torch.int32
        and rows.stride(-1) == 1
        and (topk_length is None or topk_length.dtype == torch.int32)
    )


def sparse_mla_decode_gluon(
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    *,
    scale: float,
    v_dim: int,
    out: torch.Tensor,
    lse_out: torch.Tensor,
    num_sms: int,
    topk_length: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    num_splits: int | None = None,
    rows_unique: bool = False,
    workspace: torch.Tensor | None = None,
    attend: Callable[..., None] | None = None,
    kernel: str | None = None,
    pack_rows: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse-MLA decode through the Gluon kernel (inputs validated by
    :func:`~shardattn.kernels.sparse_mla_decode.sparse_mla_decode`, which routes here).

    Args:
        q: ``[T, H, D]`` bf16/fp16; kv: ``[R, D]``; rows: ``[T, K]`` int32 (invalid anywhere).
        out, lse_out: destinations ``[T, H, v_dim]`` (q's dtype) and ``[T, H]`` fp32.
        num_sms: SMs of the device (the split model). num_splits: slices asked for (None = model).
        rows_unique: skip the de-duplication (duplicates then count twice, as on the Triton path).
        workspace: optional flat fp32 buffer for the partials (fewer slices if it is too small).
        attend: the per-pseudo-query kernel ``attend(q, kv, union, lens, *, scale, v_dim, sinks,
            out, lse, raw_rows)``; default the Gluon kernel (tests pass a torch stand-in to check
            the slicing, sinks and merge on the CPU). ``raw_rows=True``: ``union`` is the caller's
            rows (invalid entries anywhere) and ``lens`` its ``topk_length`` (None = all ``K``).
        kernel: the default ``attend``'s configuration, one of :data:`DECODE_KERNELS` (None = the
            routed :data:`DECODE_KERNEL`).
        pack_rows: pack the rows even where the kernel could read them in place (a benchmark's
            baseline; same result).
    Returns:
        ``(out, lse_out)``.
    """
    if kernel is not None and kernel not in DECODE_KERNELS:
        raise ValueError(f"kernel must be one of {DECODE_KERNELS}, got {kernel!r}")
    attend = functools.partial(_gluon_attend, kernel=kernel) if attend is None else attend
    t, h, _ = q.shape
    r = kv.shape[0]
    k = rows.shape[1]
    src, src_len = rows, topk_length
    deduped = not rows_unique and k > 1
    if deduped:
        src, src_len = build_union(rows, group_size=1, num_kv_rows=r, topk_length=topk_length)
    limit = None if workspace is None else workspace.numel()
    plan = gluon_decode_plan(t, h, k, num_sms, num_splits, v_dim=v_dim, head_dim=q.shape[-1], max_partial_elems=limit)
    s, chunk = plan["num_splits"], plan["chunk"]
    if s == 1:
        if deduped:  # the union's entries past lens are masked by the kernel
            union, lens = src, src_len
        elif not pack_rows and reads_raw_rows(src, src_len, kernel):  # one launch: rows read in place
            attend(q, kv, src, src_len, scale=scale, v_dim=v_dim, sinks=sinks, out=out, lse=lse_out, raw_rows=True)
            return out, lse_out
        else:
            union, lens = split_rows(src, num_kv_rows=r, num_splits=1, chunk=max(chunk, k), topk_length=src_len)
        attend(q, kv, union, lens, scale=scale, v_dim=v_dim, sinks=sinks, out=out, lse=lse_out)
        return out, lse_out
    union, lens = split_rows(src, num_kv_rows=r, num_splits=s, chunk=chunk, topk_length=src_len)
    q_p = q.expand(s, h, q.shape[-1]) if t == 1 else q.unsqueeze(0).expand(s, t, h, q.shape[-1]).reshape(s * t, h, -1)
    part_out, part_lse = split_partials(workspace, s, t, h, v_dim, q.device)
    sinks_p = None if sinks is None else sinks - math.log(s)  # S shares of exp(sink): once in the merge
    attend(
        q_p, kv, union, lens, scale=scale, v_dim=v_dim, sinks=sinks_p,
        out=part_out.view(s * t, h, v_dim), lse=part_lse.view(s * t, h),
    )  # fmt: skip
    if q.is_cuda and triton is not None:
        launch_lse_merge(part_out, part_lse, out, lse_out)
    else:
        ref_out, ref_lse = lse_merge_reference(part_out, part_lse)
        out.copy_(ref_out)
        lse_out.copy_(ref_lse)
    return out, lse_out
