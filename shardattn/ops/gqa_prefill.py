"""GQA prefill: varlen causal attention of new tokens over their request's cached prefix and themselves.

Request ``b`` brings ``n_b = cu_q_lens[b + 1] - cu_q_lens[b]`` new tokens (rows of ``q``, ``k``,
``v`` in token order) after ``P_b = prefix_lens[b]`` cached ones (0 without a prefix). Its new
token ``j`` sits at position ``p = P_b + j`` and sees the keys at positions ``t`` with::

    lo <= t <= p,   lo = max(0, p - window_left) with a window (window_left >= 0), else 0

A key at ``t < P_b`` is ``k_cache[block_table[b, t // page], t % page]`` (the paged layout of
:mod:`shardattn.ops.gqa_decode`); a key at ``t >= P_b`` is row ``cu_q_lens[b] + t - P_b`` of
``k`` / ``v``. Query head ``h`` reads KV head ``h // (H / Hkv)``. Sinks add one fp32 logit per
query head (natural log, not scaled) to the softmax denominator and the LSE. LSE: fp32, natural
log, ``[T, H]``; every query sees at least itself, so no row of a prefill is empty (an empty row
would be ``(0, -inf)``, ``(0, sink)`` with sinks, as in every op of the library).

With ``k = v = None`` the new tokens' keys and values are already in the paged cache, at positions
``[P_b, P_b + n_b)`` of request ``b`` (an engine writes them there before attention, as vLLM's
``reshape_and_cache`` does): one paged call reads them and the prefix, nothing is copied or merged.

Dispatch (:func:`gqa_prefill_route`, a :class:`~shardattn.plan.routing.Route` with its reason):
FA4 (:mod:`shardattn.kernels.fa4`) where it is importable and runs these tensors (SM90 / SM100,
fp16 / bf16, its head dims), else the fp32 torch reference
(:mod:`~shardattn.ops.gqa_prefill_reference`), on CPU and GPU alike. Both run the same
composition (:mod:`~shardattn.ops.gqa_prefill_segments`): one paged call when the new keys are in
the cache, one call over contiguous keys, or, with a cached prefix and no window, the prefix read
in place from the paged cache plus the new keys, merged by LSE. On the FA4 path with pages of
FA4's key tile (128 tokens at head_dim 64 or 128 on SM90) whole pages load by TMA: the rows of a
request's last page past its keys must hold finite values (any; a zero-initialised cache does),
as FA4 requires.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import replace
from typing import Literal, overload

import torch

from shardattn._checks import (
    INDEX_DTYPES,
    check_bool,
    check_choice,
    check_int,
    check_page_size,
    check_pages_in_use,
    check_queries_tensor,
    check_same_device,
    check_scale,
    check_sink_logits,
    check_tensor,
)
from shardattn.kernels import fa4, fa4_warmup
from shardattn.kernels.fa4_launch import FA4Private
from shardattn.ops.gqa_prefill_kernels import FA4SegmentKernel, SegmentKernel, TorchSegmentKernel, require_lse
from shardattn.ops.gqa_prefill_segments import PagedPrefix, Segments, attend_segments
from shardattn.plan.routing import Route

__all__ = [
    "BACKENDS",
    "check_new_keys",
    "check_prefix_inputs",
    "fa4_variants",
    "gqa_prefill",
    "gqa_prefill_route",
    "segment_kernel",
]

BACKENDS = ("auto", "fa4", "reference")


def gqa_prefill_route(q: torch.Tensor, k: torch.Tensor, *, backend: str = "auto") -> Route:
    """Which kernel runs a GQA prefill of these tensors, and why (no device sync).

    Args:
        q: ``[T, H, D]``; k: ``[T, Hkv, D]`` (or the paged cache) in q's dtype.
        backend: ``"auto"`` (FA4 where it runs, else the reference), ``"fa4"`` (raises
            ``ValueError`` with the reason where it cannot run) or ``"reference"``.
    Returns:
        ``Route(path="fa4" | "reference", group_size=1, reason)``.

    >>> gqa_prefill_route(torch.zeros(4, 8, 64), torch.zeros(4, 1, 64)).reason
    "FA4 needs CUDA tensors, got device type 'cpu': torch reference"
    """
    check_choice("backend", backend, BACKENDS)
    if backend == "reference":
        return Route("reference", 1, "backend='reference': torch reference")
    ok, why = fa4.fa4_supports(q, k)
    if ok:
        return Route("fa4", 1, why)
    if backend == "fa4":
        raise ValueError(f"backend='fa4' is unavailable: {why}")
    return Route("reference", 1, f"{why}: torch reference")


def segment_kernel(route: Route, private: FA4Private | None = None) -> SegmentKernel:
    """The kernel implementation of a route's path (``private``: FA4's fast-launch pieces, for a
    kernel whose planned calls launch FA4's compiled kernel directly)."""
    return FA4SegmentKernel(private=private) if route.path == "fa4" else TorchSegmentKernel()


def check_prefix_inputs(
    q: torch.Tensor,
    hkv: int,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    block_table: torch.Tensor | None,
    prefix_lens: torch.Tensor | None,
    batch: int,
    keys_from: str = "k",
) -> PagedPrefix | None:
    """Validate a cached prefix (all four arguments or none); returns it (``max_len``: the block
    table's capacity, ``max_pages * page``), or ``None`` when none is given. ``hkv``: the KV heads
    of the new keys, named ``keys_from`` in the message where the cache holds others.

    Values (lengths, pages) are checked only on CPU tensors, where reading them costs no sync
    (lengths given on the CPU are checked against the table's capacity wherever the table lives).
    """
    if k_cache is None and v_cache is None and block_table is None and prefix_lens is None:
        return None
    if k_cache is None or v_cache is None or block_table is None or prefix_lens is None:
        raise ValueError(
            "k_cache, v_cache, block_table and prefix_lens go together (the cached prefix); give all or none"
        )
    d = q.shape[-1]
    check_tensor("k_cache", k_cache, dtypes=(q.dtype,), ndim=4)
    num_pages, page, cache_hkv, dk = k_cache.shape
    check_page_size("k_cache", k_cache)
    if dk != d or cache_hkv != hkv:
        raise ValueError(
            f"k_cache must have shape [*, *, {hkv}, {d}] ({keys_from}'s {hkv} KV heads, q's head_dim {d}; the new "
            f"keys and the cache must agree), got {list(k_cache.shape)}"
        )
    check_tensor("v_cache", v_cache, dtypes=(q.dtype,), shape=tuple(k_cache.shape))
    check_tensor("block_table", block_table, dtypes=INDEX_DTYPES, ndim=2)
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table must have one row per request ({batch}), got shape {list(block_table.shape)}")
    check_tensor("prefix_lens", prefix_lens, dtypes=INDEX_DTYPES, shape=(batch,))
    if prefix_lens.device.type == "cpu" and batch:
        capacity = block_table.shape[1] * page
        lens = prefix_lens.tolist()
        if min(lens) < 0 or max(lens) > capacity:
            raise ValueError(f"prefix_lens must be in [0, max_pages * page_size = {capacity}], got {lens[:8]}")
    if prefix_lens.device.type == "cpu" and block_table.device.type == "cpu" and batch:
        check_pages_in_use(block_table, lens, page_size=page, num_pages=num_pages, whose="the prefixes of requests")
    return PagedPrefix(k_cache, v_cache, block_table, prefix_lens, block_table.shape[1] * page)


def check_new_keys(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    k_cache: torch.Tensor | None,
    *,
    names: tuple[str, str] = ("k", "v"),
    cache: str = "k_cache / v_cache",
    where: str = "the paged cache",
    holders: str = "k_cache, v_cache, block_table and prefix_lens",
) -> int:
    """Check a prefill's new keys and values against ``q [T, H, D]`` (checked): ``k``, ``v``
    ``[T, Hkv, D]`` in q's dtype, or both ``None`` with ``k_cache [pages, page, Hkv, D]`` holding
    them; returns ``Hkv`` (``H`` a multiple of it). ``names``, ``cache``, ``where`` and ``holders``
    word the messages for the caller's arguments (the PCP step's ``k_new`` / ``v_new``)."""
    t, h, d = q.shape
    kn, vn = names
    if (k is None) != (v is None):
        raise ValueError(f"{kn} and {vn} go together: give both, or neither when the new keys are in {cache}")
    if k is None:
        if k_cache is None:
            raise ValueError(f"{kn} and {vn} are None (the new keys already in {where}): pass {holders} holding them")
        check_tensor("k_cache", k_cache, dtypes=(q.dtype,), ndim=4)
        hkv = k_cache.shape[2]
    else:
        check_tensor(kn, k, dtypes=(q.dtype,), ndim=3)
        if k.shape[0] != t or k.shape[2] != d:
            raise ValueError(f"{kn} must have shape [{t}, Hkv, {d}] (q's tokens and head_dim), got {list(k.shape)}")
        hkv = k.shape[1]
    if hkv < 1 or h % hkv:
        raise ValueError(f"q heads ({h}) must be a multiple of {kn if k is not None else 'k_cache'}'s KV heads ({hkv})")
    if k is not None and v is not None:
        check_tensor(vn, v, dtypes=(q.dtype,), shape=tuple(k.shape))
    return hkv


def _check_inputs(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cu_q_lens: torch.Tensor,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    block_table: torch.Tensor | None,
    prefix_lens: torch.Tensor | None,
    sinks: torch.Tensor | None,
    window_left: object,
    return_lse: object,
) -> tuple[torch.Tensor, PagedPrefix | None]:
    """Validate :func:`gqa_prefill`'s arguments; returns the keys its route reads (``k``, or
    ``k_cache`` holding the new keys) and the cached prefix (``None``: none)."""
    check_queries_tensor("q", q)
    t, h, _ = q.shape
    hkv = check_new_keys(q, k, v, k_cache)
    check_tensor("cu_q_lens", cu_q_lens, dtypes=INDEX_DTYPES, ndim=1)
    if cu_q_lens.numel() < 1:
        raise ValueError("cu_q_lens must have B + 1 >= 1 entries, got 0")
    batch = cu_q_lens.numel() - 1
    check_int("window_left", window_left, minimum=-1)
    check_bool("return_lse", return_lse)
    if sinks is not None:
        check_sink_logits(sinks, h)
    keys_from = "k" if k is not None else "k_cache"
    prefix = check_prefix_inputs(q, hkv, k_cache, v_cache, block_table, prefix_lens, batch, keys_from)
    check_same_device(
        q=q, k=k, v=v, cu_q_lens=cu_q_lens, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
        prefix_lens=prefix_lens, sinks=sinks,
    )  # fmt: skip
    if cu_q_lens.device.type == "cpu":
        cu = cu_q_lens.tolist()
        if cu[0] != 0 or any(b < a for a, b in itertools.pairwise(cu)) or cu[-1] != t:
            raise ValueError(f"cu_q_lens must start at 0, not decrease and end at q's {t} tokens, got {cu[:9]}")
        if k is None and prefix is not None and prefix.lens.device.type == "cpu" and batch:
            capacity = prefix.max_len
            seq = [p + b - a for p, a, b in zip(prefix.lens.tolist(), cu, cu[1:])]
            if max(seq) > capacity:
                raise ValueError(
                    f"prefix_lens plus the new tokens must fit the block table ({capacity} positions) when the new "
                    f"keys are in the cache, got {seq[:8]}"
                )
            # every page the call reads (block_table is on the CPU with cu_q_lens); the prefixes' passed above
            num_pages, page = prefix.k_cache.shape[:2]
            check_pages_in_use(
                prefix.block_table, seq, page_size=page, num_pages=num_pages, whose="the new tokens of requests"
            )
    if k is not None:
        return k, prefix
    if prefix is None:  # never: check_new_keys wants k_cache with k = None, check_prefix_inputs the rest with it
        raise ValueError(
            "k and v are None (the new keys already in the paged cache): pass k_cache, v_cache, block_table and "
            "prefix_lens holding them"
        )
    return prefix.k_cache, prefix


@overload
def gqa_prefill(
    q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, cu_q_lens: torch.Tensor, *,
    k_cache: torch.Tensor | None = ..., v_cache: torch.Tensor | None = ..., block_table: torch.Tensor | None = ...,
    prefix_lens: torch.Tensor | None = ..., sinks: torch.Tensor | None = ..., window_left: int = ...,
    scale: float | None = ..., return_lse: Literal[False] = ..., backend: str = ...,
) -> torch.Tensor: ...  # fmt: skip
@overload
def gqa_prefill(
    q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, cu_q_lens: torch.Tensor, *,
    k_cache: torch.Tensor | None = ..., v_cache: torch.Tensor | None = ..., block_table: torch.Tensor | None = ...,
    prefix_lens: torch.Tensor | None = ..., sinks: torch.Tensor | None = ..., window_left: int = ...,
    scale: float | None = ..., return_lse: Literal[True], backend: str = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip
@overload
def gqa_prefill(
    q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, cu_q_lens: torch.Tensor, *,
    k_cache: torch.Tensor | None = ..., v_cache: torch.Tensor | None = ..., block_table: torch.Tensor | None = ...,
    prefix_lens: torch.Tensor | None = ..., sinks: torch.Tensor | None = ..., window_left: int = ...,
    scale: float | None = ..., return_lse: bool = ..., backend: str = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip
def gqa_prefill(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cu_q_lens: torch.Tensor,
    *,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    prefix_lens: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    window_left: int = -1,
    scale: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """GQA prefill attention of new tokens over a cached prefix and themselves (module docstring).

    Args:
        q: ``[T, H, D]`` fp16/bf16/fp32, the new tokens' queries, requests in order.
        k, v: ``[T, Hkv, D]`` the new tokens' keys and values in q's dtype (``H % Hkv == 0``), or
            both ``None``: they are in the paged cache after each request's prefix (module docstring).
        cu_q_lens: ``[B + 1]`` int32 offsets of the requests' new tokens (``cu_q_lens[-1] == T``;
            checked when on the CPU, the caller's promise on a GPU). Empty requests are allowed.
        k_cache, v_cache: ``[num_pages, page, Hkv, D]`` paged cache holding the cached prefixes
            (q's dtype), with block_table ``[B, max_pages]`` int32 and prefix_lens ``[B]`` int32
            (cached tokens per request, 0 allowed); all four or none.
        sinks: ``[H]`` fp32 sink logits, optional.
        window_left: sliding window, a token at ``p`` sees positions ``[p - window_left, p]``;
            ``-1`` = none.
        scale: softmax scale, default ``D ** -0.5``; finite and > 0.
        return_lse: also return the LSE.
        backend: ``"auto"``, ``"fa4"`` or ``"reference"`` (:func:`gqa_prefill_route`).
    Returns:
        ``out [T, H, D]`` in q's dtype, and ``lse [T, H]`` fp32 natural log with ``return_lse``.
    Raises:
        TypeError / ValueError: naming the argument, before any kernel runs.

    Example (two requests, the second after 5 cached tokens in pages 2 and 0):
        >>> q, k, v = torch.randn(7, 8, 16), torch.randn(7, 2, 16), torch.randn(7, 2, 16)
        >>> cu = torch.tensor([0, 3, 7], dtype=torch.int32)
        >>> cache = torch.randn(3, 4, 2, 16)
        >>> table = torch.tensor([[1, 1], [2, 0]], dtype=torch.int32)
        >>> out, lse = gqa_prefill(q, k, v, cu, k_cache=cache, v_cache=cache, block_table=table,
        ...                        prefix_lens=torch.tensor([0, 5], dtype=torch.int32), return_lse=True)
        >>> tuple(out.shape), tuple(lse.shape), bool(lse.isfinite().all())
        ((7, 8, 16), (7, 8), True)
    """
    check_choice("backend", backend, BACKENDS)
    keys, prefix = _check_inputs(
        q, k, v, cu_q_lens, k_cache, v_cache, block_table, prefix_lens, sinks, window_left, return_lse
    )
    scale = q.shape[-1] ** -0.5 if scale is None else check_scale("scale", scale)
    route = gqa_prefill_route(q, keys, backend=backend)
    result = attend_segments(
        q, k, v, Segments.for_requests(cu_q_lens), kernel=segment_kernel(route), prefix=prefix,
        window_left=window_left, sinks=sinks, scale=scale, return_lse=return_lse,
    )  # fmt: skip
    if not return_lse:
        return result[0]
    out, lse = require_lse(result)
    return out, lse.contiguous()


def fa4_variants(
    *,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    sinks: bool,
    windows: Iterable[bool] = (False, True),
    page_size: int | None = None,
    max_segments: int = 1,
    return_lse: bool = True,
    runs: bool = False,
) -> list[fa4_warmup.FA4Variant]:
    """The FA4 compile keys a prefill configuration meets (pass them to :func:`shardattn.kernels.fa4_warmup.warm_up`).

    Args:
        dtype, num_heads, num_kv_heads, head_dim: of one kernel call (a rank's heads under head-TP).
        sinks: the model has sinks. windows: which of (no window, a window) its layers use.
        page_size: the paged cache's page size when requests may have cached prefixes, or new keys
            already in the cache (``None``: never).
        max_segments: most segments of one call (requests; under PCP up to twice a rank's requests).
        return_lse: the calls return the LSE (a merge of partials computes one anyway).
        runs: segments are runs of tokens (PCP), not whole requests: contiguous keys always take
            their lengths from ``seqused_k``.
    Returns:
        the variants, each once, per window setting: the contiguous causal call (whole requests:
        ``cu_seqlens_k`` alone; with a merge after it, its LSE variant), with a prefix and a window
        the call over a buffer holding the prefix's tail (``seqused_k``), with pages the paged
        causal call over keys already in the cache; and with pages, no window, the split form's
        prefix call (no mask, no sink). Each also with more than 256 segments when
        ``max_segments`` exceeds 256.

    >>> len(fa4_variants(dtype=torch.bfloat16, num_heads=64, num_kv_heads=8, head_dim=64, sinks=True,
    ...                  page_size=64, return_lse=False))
    7
    """
    many = [False, True] if check_int("max_segments", max_segments, minimum=1) > 256 else [False]
    base = fa4_warmup.FA4Variant(dtype=dtype, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    out: list[fa4_warmup.FA4Variant] = []
    for m in many:
        for w in dict.fromkeys(windows):
            new = replace(base, causal=True, window=w, sinks=sinks, many_segments=m)
            lses = dict.fromkeys([return_lse, *([True] if page_size is not None and not w else [])])
            for lse in lses:  # the new keys as they are (PCP: gathered), merged with a prefix when there is one
                out.append(replace(new, seqused=runs, lse=lse))
            if page_size is not None:
                if w:  # a prefix's last window_left keys copied before the new ones
                    out.append(replace(new, seqused=True, lse=return_lse))
                out.append(replace(new, page_size=page_size, lse=return_lse))  # keys in the cache
        if page_size is not None and False in windows:  # the split form: prefix without a window
            out.append(replace(base, causal=False, page_size=page_size, many_segments=m))
    return list(dict.fromkeys(out))
