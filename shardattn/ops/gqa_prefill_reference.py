"""The torch reference of GQA prefill's one kernel shape: segments of queries over ranges of keys.

Segment ``s`` holds query rows ``[cu_q[s], cu_q[s + 1])`` (``m`` rows) and ``L = k_len[s]`` keys:
rows ``[cu_k[s], cu_k[s] + L)`` of contiguous ``k`` / ``v`` (ranges may overlap; ``cu_k[S]`` is not
read, as in FA4's ``cu_seqlens_k`` with ``seqused_k``), or positions ``j < L`` at
``cache[page_table[s, j // page], j % page]`` of a paged cache. Masks are aligned bottom-right
(as FA4's, :mod:`shardattn.kernels.fa4`): with ``off = L - m``, query ``i`` sees key ``j`` when::

    j <= i + off                      (causal)
    j >= i + off - window_left        (window_left >= 0)

Query head ``h`` reads KV head ``h // (H / Hkv)``. Sinks add one logit per query head (natural
log, not scaled) to the softmax denominator; the LSE (fp32, natural log) includes it. A query
with no visible key gives ``(0, -inf)`` (``(0, sink)`` with sinks).

The computation is fp32 on q's device, chunked over queries so that a chunk's scores stay under
:data:`CHUNK_BYTES` whatever the segment lengths (no ``[T, T]`` matrix), and restricted to the
keys a chunk can see (a window costs ``O(m (chunk + window))``). It reads the segment lengths on
the host (one device sync on a GPU). Why not ``torch.nn.functional.scaled_dot_product_attention``
on a GPU without FA4: its public API returns no LSE (needed by every merge of partials: PCP, a
cached prefix), has no sinks, aligns ``is_causal`` top-left and takes a window only as a dense
mask; FA4 is the fast path (4.16 ms against SDPA's 4.92 ms at 4 x 8K tokens, 64 / 8 heads,
head_dim 64 on an H200), this one is the correct one everywhere.
"""

from __future__ import annotations

import math

import torch

from shardattn.ops.softmax_rows import softmax_rows

__all__ = ["CHUNK_BYTES", "segment_attention_reference"]

#: Bytes of fp32 scores one query chunk may hold (bounds memory on CPU and GPU alike).
CHUNK_BYTES = 64 << 20


def _key_rows(s: int, lo: int, hi: int, starts: list[int], page_table: torch.Tensor | None, page: int) -> torch.Tensor:
    """Rows of the (flattened) key tensor holding key positions ``[lo, hi)`` of segment ``s``:
    contiguous keys from row ``starts[s]``, or paged keys through ``page_table[s]``."""
    device = page_table.device if page_table is not None else None
    pos = torch.arange(lo, hi, device=device)
    if page_table is None:
        return pos + starts[s]
    return page_table[s, pos // page].long() * page + pos % page


def segment_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    k_len: torch.Tensor,
    *,
    cu_k: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    causal: bool,
    window_left: int,
    sinks: torch.Tensor | None,
    scale: float,
    chunk_bytes: int = CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of query segments over key ranges (module docstring), fp32, chunked.

    Args:
        q: ``[T, H, D]``; k, v: ``[Tk, Hkv, D]`` contiguous keys (with ``cu_k``), or
            ``[num_pages, page, Hkv, D]`` paged (with ``page_table``), in any float dtype.
        cu_q: ``[S + 1]`` int32 query offsets; k_len: ``[S]`` int32 keys per segment.
        cu_k: ``[S + 1]`` int32, ``cu_k[s]`` the first key row of segment ``s`` (contiguous keys).
        page_table: ``[S, M]`` int32 pages of each segment (paged keys; the pages holding its
            ``k_len`` keys must be valid). One of ``cu_k`` and ``page_table`` is given.
        causal, window_left (``-1`` = none), sinks (``[H]`` fp32 or None), scale: masks and softmax.
        chunk_bytes: the bound on one chunk's fp32 scores.
    Returns:
        ``(out [T, H, D] in q's dtype, lse [T, H] fp32)``; rows of no segment are ``(0, -inf)``.
    """
    if cu_k is None and page_table is None:
        raise ValueError("cu_k (contiguous keys) or page_table (paged keys) must be given")
    t, h, d = q.shape
    hkv = k.shape[-2]
    group = h // hkv
    out = torch.zeros(t, h, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((t, h), -math.inf, dtype=torch.float32, device=q.device)
    paged = page_table is not None
    page = k.shape[1] if paged else 1
    keys = k.reshape(-1, hkv, d)
    values = v.reshape(-1, hkv, v.shape[-1])
    cu = cu_q.tolist()
    lens = k_len.tolist()
    starts = [] if cu_k is None or paged else cu_k[:-1].tolist()
    sink = None if sinks is None else sinks.float().view(1, hkv, group)
    for s, length in enumerate(lens):
        q0, m = cu[s], cu[s + 1] - cu[s]
        if m <= 0:
            continue
        off = length - m
        chunk = max(1, min(m, chunk_bytes // (4 * h * max(length, 1))))
        for i0 in range(0, m, chunk):
            i1 = min(m, i0 + chunk)
            lo = max(0, i0 + off - window_left) if window_left >= 0 else 0
            hi = max(lo, min(length, i1 + off) if causal else length)
            rows = _key_rows(s, lo, hi, starts, page_table, page).to(q.device)
            kc = keys[rows].float()  # [n, Hkv, D]
            vc = values[rows].float()
            qc = q[q0 + i0 : q0 + i1].float().reshape(i1 - i0, hkv, group, d)
            scores = torch.einsum("cgrd,ngd->cgrn", qc, kc) * scale  # [c, Hkv, G, n]
            qi = torch.arange(i0, i1, device=q.device)[:, None] + off
            kj = torch.arange(lo, hi, device=q.device)[None, :]
            visible = kj <= qi if causal else torch.ones_like(kj <= qi)
            if window_left >= 0:
                visible &= kj >= qi - window_left
            scores = scores.masked_fill(~visible[:, None, None, :], -math.inf)
            probs, row_lse = softmax_rows(scores, sink)  # [c, Hkv, G, n], [c, Hkv, G]
            o = torch.einsum("cgrn,ngd->cgrd", probs, vc)
            out[q0 + i0 : q0 + i1] = o.reshape(i1 - i0, h, -1).to(q.dtype)
            lse[q0 + i0 : q0 + i1] = row_lse.reshape(i1 - i0, h)
    return out, lse
