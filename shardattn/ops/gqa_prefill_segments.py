"""How one GQA prefill call is cut into kernel calls: query segments, key buffers, prefix partials.

Both the single-GPU op (:func:`~shardattn.ops.gqa_prefill.gqa_prefill`) and the PCP step
(:mod:`shardattn.parallel.gqa_prefill`) describe their queries as *segments*: segment ``s`` holds
query rows ``[cu_q[s], cu_q[s + 1])``, all of request ``req[s]``, at new-token offsets
``[stop[s] - m_s, stop[s])`` (the op: one segment per request; PCP: one per contiguous run of a
rank's zigzag tokens). A query at new offset ``o`` of request ``b`` sits at position
``prefix_b + o`` and sees the cached prefix ``[0, prefix_b)`` and the new tokens ``<= o``, within
``window_left`` of its position.

:func:`attend_segments` runs them in one of three forms (the choice depends only on the
arguments, never on measured speed):

* **paged** (the new keys already written into the paged cache after each request's prefix, as an
  engine's cache write does before attention; ``k = v = None``): one call over positions
  ``[0, prefix_b + stop_s)`` of the cache, the causal mask and the window aligned at the end, the
  sinks once. No key is copied, nothing is merged.

* **combined** (no cached prefix, or a window): one kernel call over a contiguous key buffer
  holding, per request, the last ``tail_b = min(prefix_b, window_left)`` prefix keys followed by
  its new keys (:func:`key_buffer`; no copy at all when there is no prefix tail and the new keys
  are already in token order). Segment ``s`` of request ``b`` reads buffer rows
  ``[base_b - tail_b, base_b + stop_s)`` (``base_b``: the row of the request's first new key), and
  the bottom-right causal mask with the window is exactly the contract. Sinks enter once.
* **split** (a cached prefix, no window): the prefix is read in place from the paged cache
  (every query sees all of it: no mask, no sink), the new keys in a second call (causal, with the
  sinks), and the two partials are merged by :func:`~shardattn.ops.lse_merge.lse_merge`. This
  copies no prefix key (a prefix may be far longer than the new tokens) at the cost of one merge
  pass over the two partial outputs, and the prefix call needs no new key, so PCP runs it while
  the new keys are still being all-gathered (``keys_ready``). A window cannot take this form: a
  kernel's window is aligned to the end of each segment's keys, while the prefix part would need
  it aligned to each segment's first query; with a window the copied prefix keys are at most
  ``window_left`` per request.

The kernel calls go through a :class:`~shardattn.ops.gqa_prefill_kernels.SegmentKernel`
(:mod:`~shardattn.ops.gqa_prefill_kernels`: the torch reference or the FA4 adapter), so the CPU
path runs exactly the composition the GPU path runs. A plan's calls (a step's layers) pass
the plan's :class:`~shardattn.kernels.fa4_launch.FA4Launches` for the calls whose metadata are the
plan's own tensors (every form but the windowed prefix copy, whose key offsets are made per call),
so an FA4 kernel of a fast-launch kernel object is resolved once per plan and call form.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shardattn.kernels.fa4_launch import FA4Launches
from shardattn.ops.gqa_prefill_kernels import SegmentKernel, require_lse
from shardattn.ops.lse_merge import run_lse_merge

__all__ = [
    "PagedPrefix",
    "Segments",
    "attend_segments",
    "key_buffer",
    "plan_segments",
    "prefix_tail",
]


@dataclass(frozen=True)
class Segments:
    """Query segments of one kernel call (module docstring), all on q's device.

    Attributes:
        cu_q: ``[S + 1]`` int32 query-row offsets.
        stop: ``[S]`` int32 new-token offset one past the segment's last query.
        token_offsets: ``[R + 1]`` int32 / int64 start of each request's new tokens in token order.
        req: ``[S]`` int64 request of each segment; ``None``: segment ``s`` is request ``s``, whole
            (then ``cu_q`` is ``token_offsets`` and ``stop`` the request lengths).
        token_request: ``[N]`` int64 request of each new token; ``None``: computed when needed.
        seg_first: ``[S + 1]`` int32 first new-key row of each segment's request (the last entry
            repeated, never read); ``None``: computed when needed.
        seg_prefix / seg_keys: ``[S]`` int32 cached tokens of each segment's request, and those plus
            ``stop`` (the paged form's keys); ``None``: computed when needed.

    :func:`plan_segments` builds every field on the host and moves them in one copy, once per step
    (an engine's layers reuse it); :meth:`for_requests` derives them on the device.
    """

    cu_q: torch.Tensor
    stop: torch.Tensor
    token_offsets: torch.Tensor
    req: torch.Tensor | None = None
    token_request: torch.Tensor | None = None
    seg_first: torch.Tensor | None = None
    seg_prefix: torch.Tensor | None = None
    seg_keys: torch.Tensor | None = None

    @classmethod
    def for_requests(cls, cu_q_lens: torch.Tensor) -> Segments:
        """One segment per request, queries in token order (``cu_q_lens [B + 1]`` int32; one
        device op)."""
        return cls(cu_q_lens, (cu_q_lens[1:] - cu_q_lens[:-1]).to(torch.int32), cu_q_lens)

    def to(self, device: torch.device | str) -> Segments:
        """A copy whose tensors live on ``device``."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        moved: dict[str, Any] = {f.name: move(getattr(self, f.name)) for f in dataclasses.fields(self)}
        return dataclasses.replace(self, **moved)

    def of_segments(self, per_request: torch.Tensor) -> torch.Tensor:
        """``per_request[req[s]]`` for every segment (the tensor itself when segments are requests)."""
        return per_request if self.req is None else per_request[self.req]

    def first_key_rows(self) -> torch.Tensor:
        """``[S + 1]`` int32: :attr:`seg_first` (computed from the token offsets when not planned)."""
        if self.seg_first is not None:
            return self.seg_first
        start = self.of_segments(self.token_offsets[:-1])
        return torch.cat([start, start[-1:]]).to(torch.int32)

    def prefix_of_segments(self, prefix_lens: torch.Tensor) -> torch.Tensor:
        """``[S]`` int32 cached tokens of each segment's request (:attr:`seg_prefix` when planned)."""
        return self.seg_prefix if self.seg_prefix is not None else self.of_segments(prefix_lens).to(torch.int32)

    def keys_in_cache(self, prefix_lens: torch.Tensor) -> torch.Tensor:
        """``[S]`` int32 keys of each segment in the paged form: its request's prefix plus its new
        tokens up to ``stop`` (:attr:`seg_keys` when planned)."""
        if self.seg_keys is not None:
            return self.seg_keys
        return (self.prefix_of_segments(prefix_lens) + self.stop).to(torch.int32)

    def request_of_tokens(self, num_tokens: int) -> torch.Tensor:
        """``[num_tokens]`` int64 request of each new token (no sync: ``num_tokens`` is given)."""
        if self.token_request is not None:
            return self.token_request
        offsets = self.token_offsets.long()
        req = torch.arange(offsets.numel() - 1, device=offsets.device)
        return torch.repeat_interleave(req, offsets[1:] - offsets[:-1], output_size=num_tokens)


@dataclass(frozen=True)
class PagedPrefix:
    """The cached prefixes of a call's requests, in the paged layout of GQA decode.

    Attributes:
        k_cache, v_cache: ``[num_pages, page, Hkv, D]``.
        block_table: ``[R, M]`` int32 pages of each request.
        lens: ``[R]`` int32 cached tokens of each request (positions ``[0, lens[b])``).
        max_len: a host bound on ``lens`` (``M * page`` when nothing tighter is known).
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    lens: torch.Tensor
    max_len: int


def plan_segments(
    query_lens: Sequence[int],
    prefix_lens: Sequence[int] | None,
    device: torch.device | str,
    *,
    runs: Sequence[tuple[int, int, int]] | None = None,
    pin: bool = False,
) -> Segments:
    """A call's :class:`Segments` with every field computed on the host and moved in one copy.

    Args:
        query_lens: ``[R]`` new tokens of each request. prefix_lens: ``[R]`` cached tokens (``None``: 0).
        device: where the tensors go.
        runs: the segments as ``(request, first, stop)`` position runs (prefix included; PCP: a
            rank's :meth:`~shardattn.plan.ShardPlan.runs`); ``None``: one segment per request, whole.
        pin: stage the copy in page-locked memory (a non-blocking host-to-device copy).
    Returns:
        the segments, ``req`` and ``token_request`` set only with ``runs``.

    >>> seg = plan_segments([3, 2], [4, 0], "cpu")
    >>> seg.cu_q.tolist(), seg.seg_keys.tolist(), seg.seg_first.tolist()
    ([0, 3, 5], [7, 2], [0, 3, 3])
    """
    n = np.asarray(query_lens, dtype=np.int64)
    pre = np.zeros_like(n) if prefix_lens is None else np.asarray(prefix_lens, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(n)])
    if runs is None:
        req = np.arange(n.size)
        stop = n
    else:
        req = np.array([r for r, _, _ in runs], dtype=np.int64)
        stop = np.array([b for _, _, b in runs], dtype=np.int64) - pre[req]
        lens = np.array([b - a for _, a, b in runs], dtype=np.int64)
    seg_len = stop if runs is None else lens
    cu_q = np.concatenate([[0], np.cumsum(seg_len)])
    first = offsets[req]
    first = np.concatenate([first, first[-1:] if first.size else [0]])
    parts = [cu_q, stop, offsets, first, pre[req], pre[req] + stop]
    if runs is not None:
        parts += [req, np.repeat(np.arange(n.size), n)]
    sizes = [p.size for p in parts]
    host = torch.from_numpy(np.concatenate(parts).astype(np.int32))
    if pin and torch.cuda.is_available():
        host = host.pin_memory()
    flat = host.to(device, non_blocking=pin)
    views = list(torch.split(flat, sizes))
    seg = Segments(views[0], views[1], views[2], seg_first=views[3], seg_prefix=views[4], seg_keys=views[5])
    if runs is None:
        return seg
    return dataclasses.replace(seg, req=views[6].long(), token_request=views[7].long())


def prefix_tail(prefix: PagedPrefix | None, window_left: int) -> int:
    """Prefix keys per request the combined form copies: ``min(window_left, max_len)`` with a
    window, 0 without a prefix or a window (the split form reads the prefix in place)."""
    if prefix is None or window_left < 0:
        return 0
    return min(window_left, prefix.max_len)


def key_buffer(
    k: torch.Tensor,
    v: torch.Tensor,
    segments: Segments,
    *,
    new_rows: torch.Tensor | None,
    tail: int,
    prefix: PagedPrefix | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The combined form's contiguous keys (device ops only, no sync).

    Request ``b``'s region starts at ``token_offsets[b] + b * tail``: ``tail`` slots whose last
    ``tail_b = min(prefix_b, tail)`` hold its prefix positions ``[prefix_b - tail_b, prefix_b)``
    (the others zeros, never read), then its new keys in token order.

    Args:
        k, v: ``[rows, Hkv, D]`` new keys; token ``g`` is row ``new_rows[g]`` (``None``: row ``g``).
        segments: the call's segments (token offsets and requests).
        tail, prefix: :func:`prefix_tail` and the cached prefixes (needed when ``tail > 0``).
    Returns:
        ``(k_buf, v_buf, first [R], tail_len [R])``: the buffers (``k`` and ``v`` themselves when
        nothing needs copying), the buffer row of each request's first key (its first prefix key
        held, else its first new key) and the number of prefix keys held before its new keys.
    """
    offsets = segments.token_offsets.long()
    r = offsets.numel() - 1
    if tail == 0:
        first = offsets[:-1]
        tail_len = torch.zeros_like(first)
        if new_rows is None:
            return k, v, first, tail_len
        return k[new_rows], v[new_rows], first, tail_len
    if prefix is None:
        raise ValueError(f"prefix must hold the cached prefixes to copy {tail} keys of each (tail > 0)")
    n = k.shape[0] if new_rows is None else new_rows.numel()
    token_request = segments.request_of_tokens(n)
    req = torch.arange(r, device=offsets.device)
    k_buf = k.new_zeros(n + r * tail, *k.shape[1:])
    v_buf = v.new_zeros(n + r * tail, *v.shape[1:])
    dst = torch.arange(n, device=k.device) + (token_request + 1) * tail
    src = slice(None) if new_rows is None else new_rows
    k_buf[dst] = k[src]
    v_buf[dst] = v[src]
    page = prefix.k_cache.shape[1]
    lens = prefix.lens.long()
    pos = lens[:, None] - tail + torch.arange(tail, device=k.device)[None, :]  # [R, tail] positions
    valid = pos >= 0
    safe = pos.clamp(min=0)
    pages = prefix.block_table.long().gather(1, safe // page).clamp(min=0)
    rows = (pages * page + safe % page).reshape(-1)
    slots = (offsets[:-1, None] + req[:, None] * tail + torch.arange(tail, device=k.device)[None, :]).reshape(-1)
    keep = valid.reshape(-1, 1, 1)
    k_buf[slots] = torch.where(keep, prefix.k_cache.flatten(0, 1)[rows], 0)
    v_buf[slots] = torch.where(keep, prefix.v_cache.flatten(0, 1)[rows], 0)
    tail_len = lens.clamp(max=tail)
    return k_buf, v_buf, offsets[:-1] + (req + 1) * tail - tail_len, tail_len


def attend_segments(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    segments: Segments,
    *,
    kernel: SegmentKernel,
    prefix: PagedPrefix | None,
    window_left: int,
    sinks: torch.Tensor | None,
    scale: float,
    new_rows: torch.Tensor | None = None,
    keys_ready: Callable[[], None] | None = None,
    return_lse: bool = True,
    launches: FA4Launches | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of the segments' queries over their prefix and new keys (module docstring).

    Args:
        q: ``[T, H, D]`` the segments' queries. k, v: ``[rows, Hkv, D]`` the new keys (token
            ``g`` at row ``new_rows[g]``, or ``g``); read only after ``keys_ready()``. ``None``
            (both): the new keys are in ``prefix``'s cache at positions ``[prefix_b, prefix_b +
            n_b)`` (the paged form; ``prefix.lens`` still counts the cached tokens before them).
        segments: the query segments; kernel: the kernel implementation.
        prefix: the cached prefixes (``None``: none).
        window_left, sinks (``[H]`` fp32 or None), scale: the contract's window, sinks and scale.
        keys_ready: called once before anything reads ``k`` / ``v`` (PCP: the all-gather's wait),
            after the split form's prefix call.
        return_lse: return the LSE (``False``: ``None``, and a kernel without an LSE where no
            merge needs one).
        launches: the plan's FA4 launches (``segments`` from :func:`plan_segments`, reused by
            the plan's calls); passed to the calls whose metadata are the plan's tensors.
    Returns:
        ``(out [T, H, D] in q's dtype, lse [T, H] fp32 natural log or None)``; the LSE may be a view.
    """
    ready = keys_ready if keys_ready is not None else (lambda: None)
    if q.shape[0] == 0:
        ready()
        d_v = q.shape[-1] if v is None else v.shape[-1]
        lse = q.new_zeros(q.shape[:2], dtype=torch.float32) if return_lse else None
        return q.new_zeros(q.shape[0], q.shape[1], d_v), lse
    if (k is None) != (v is None):
        raise ValueError("k and v go together: both the new keys, or both None (the new keys in prefix's cache)")
    kw = dict(window_left=window_left, sinks=sinks, scale=scale)
    if k is None or v is None:  # the paged form: the new keys are in the cache after the prefix
        if prefix is None:
            raise ValueError("k and v are None (the new keys in the paged cache): prefix must hold that cache")
        ready()
        table = kernel.table(prefix.block_table, segments, prefix.k_cache.shape[0])
        return kernel.paged(
            q, prefix.k_cache, prefix.v_cache, table, segments.cu_q, segments.keys_in_cache(prefix.lens),
            causal=True, return_lse=return_lse, launches=launches, **kw,
        )  # fmt: skip
    if prefix is not None and prefix.max_len == 0:
        prefix = None  # no request has a cached token
    partial = None
    if prefix is not None and window_left < 0:  # the split form: the prefix in place, first
        table = kernel.table(prefix.block_table, segments, prefix.k_cache.shape[0])
        partial = require_lse(kernel.paged(
            q, prefix.k_cache, prefix.v_cache, table, segments.cu_q, segments.prefix_of_segments(prefix.lens),
            causal=False, window_left=-1, sinks=None, scale=scale, return_lse=True, launches=launches,
        ))  # fmt: skip
    ready()
    tail = prefix_tail(prefix, window_left)
    k_len: torch.Tensor | None
    if tail == 0 and new_rows is None and segments.req is None:  # keys = the new tokens, as they are
        k_buf, v_buf, cu_k, k_len = k, v, segments.cu_q, None
    else:
        k_buf, v_buf, first, tail_len = key_buffer(k, v, segments, new_rows=new_rows, tail=tail, prefix=prefix)
        if tail == 0:
            cu_k, k_len = segments.first_key_rows(), segments.stop
        else:
            start = segments.of_segments(first)
            cu_k = torch.cat([start, start[-1:]]).to(torch.int32)  # cu_k[S] is never read
            k_len = (segments.of_segments(tail_len) + segments.stop).to(torch.int32)
    need_lse = return_lse or partial is not None
    planned = launches if tail == 0 else None  # with a prefix tail the key offsets are this call's
    result = kernel.contiguous(
        q, k_buf, v_buf, segments.cu_q, cu_k, k_len, causal=True, return_lse=need_lse, launches=planned, **kw
    )
    if partial is not None:
        new_out, new_lse = require_lse(result)
        result = run_lse_merge(torch.stack([new_out, partial[0]]), torch.stack([new_lse, partial[1]]))
    out, lse = result
    return out, (lse if return_lse else None)
