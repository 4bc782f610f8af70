"""FA4's compile keys a prefill configuration meets (:class:`FA4Variant`) and their warm-up
(:func:`warm_up`), so that no step compiles; :func:`compiled_count` tells what a process compiled.

The calls go through :mod:`shardattn.kernels.fa4` with the argument forms real calls pass, so they
produce the same compile keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from shardattn.kernels import fa4

__all__ = ["WARMUP_ROWS_PER_SEGMENT", "FA4Variant", "compiled_count", "warm_up"]


@dataclass(frozen=True)
class FA4Variant:
    """One FA4 compile key a prefill configuration meets (everything but the lengths).

    Attributes:
        dtype: q / k / v dtype. num_heads, num_kv_heads, head_dim: of one kernel call (a rank's).
        causal: causal (bottom-right) mask, else every key of the segment.
        window: a left window is given (its width is a runtime value).
        sinks: learnable sinks are given.
        page_size: the paged form with this page size (TMA or cp.async pages differ), or ``None``
            for contiguous keys.
        many_segments: more than 256 segments (FA4 then adds a block-to-batch lookup).
        lse: the LSE is computed (``return_lse``).
        seqused: contiguous keys take their lengths from ``seqused_k`` (paged keys always do).
    """

    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool = True
    window: bool = False
    sinks: bool = False
    page_size: int | None = None
    many_segments: bool = False
    lse: bool = True
    seqused: bool = True


#: Query rows of every warm-up segment: enough that SM100's two-stage Q tile (chosen when
#: ``rows x heads-per-KV-head`` exceed the 128-row tile) is the one real prefills compile.
WARMUP_ROWS_PER_SEGMENT = 128


def warm_up(variants: Iterable[FA4Variant], device: torch.device | str, *, fn: Callable | None = None) -> int:
    """Run FA4 once per variant on small inputs, so later calls of those keys compile nothing.

    Calls go through :func:`~shardattn.kernels.fa4.fa4_varlen` / :func:`~shardattn.kernels.fa4.fa4_paged`
    with the argument forms real calls pass (the variant's LSE and ``seqused_k``, no
    ``max_seqlen_q``), so they produce the same compile keys.

    Returns:
        the number of variants run (0 when FA4 is not importable and ``fn`` is not given).
    """
    if fn is None and fa4.get_fa4() is None:
        return 0
    device = torch.device(device)
    count = 0
    for var in dict.fromkeys(variants):  # each distinct variant once, in order
        segs = 257 if var.many_segments else 1
        rows = WARMUP_ROWS_PER_SEGMENT if segs == 1 else 2
        t = segs * rows
        g = torch.Generator(device="cpu").manual_seed(count)
        q = torch.randn(t, var.num_heads, var.head_dim, generator=g).to(device=device, dtype=var.dtype)
        cu_q = torch.arange(segs + 1, dtype=torch.int32, device=device) * rows
        k_len = torch.full((segs,), rows, dtype=torch.int32, device=device)
        sinks = torch.zeros(var.num_heads, dtype=torch.float32, device=device) if var.sinks else None
        kw = dict(
            causal=var.causal, window_left=64 if var.window else -1, sinks=sinks, scale=var.head_dim**-0.5,
            return_lse=var.lse,
        )  # fmt: skip
        if var.page_size is None:
            kv = torch.randn(t, 2, var.num_kv_heads, var.head_dim, generator=g).to(device=device, dtype=var.dtype)
            fa4.fa4_varlen(q, kv[:, 0], kv[:, 1], cu_q, cu_q, k_len if var.seqused else None, fn=fn, **kw)
        else:
            pages = math.ceil(rows / var.page_size)
            shape = (segs * pages, var.page_size, var.num_kv_heads, var.head_dim)
            cache = torch.zeros(shape, dtype=var.dtype, device=device)
            table = torch.arange(segs * pages, dtype=torch.int32, device=device).view(segs, pages)
            fa4.fa4_paged(q, cache, cache, table, cu_q, k_len, fn=fn, **kw)
        count += 1
    return count


def compiled_count() -> int | None:
    """How many FA4 forward kernels this process has compiled or loaded (``None`` without FA4).

    Reads FA4's in-process compile cache (``_flash_attn_fwd.compile_cache``, a private
    attribute: ``None`` where a version lacks it); tests use it to show that a warmed-up
    configuration compiles nothing more.
    """
    if fa4.get_fa4() is None:
        return None
    from flash_attn.cute import interface

    cache = getattr(getattr(interface._flash_attn_fwd, "compile_cache", None), "cache", None)
    return None if cache is None else len(cache)
