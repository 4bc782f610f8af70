"""The fp32 torch reference of GQA paged decode (:func:`gqa_paged_decode_reference`), for the CPU
and as what the kernels are tested against; the contract (masks, sinks, empty rows) is
:mod:`shardattn.ops.gqa_decode`'s.

Each KV head's group of query heads runs as a sparse-MLA call whose rows are the visible key
positions (value first, key second in a row), so the softmax with sinks is
:func:`~shardattn.ops.sparse_mla.sparse_mla_reference`'s: one implementation of that math.
"""

from __future__ import annotations

import math

import torch

from shardattn.ops.sparse_mla import sparse_mla_reference

__all__ = ["gqa_paged_decode_reference"]


def _positions(cu: list[int], b: int, seq_len: int) -> tuple[int, int, int]:
    start, end = cu[b], cu[b + 1]
    return start, end, seq_len - (end - start)


def gqa_paged_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_q_lens: torch.Tensor,
    *,
    causal: bool = True,
    window_left: int = -1,
    sinks: torch.Tensor | None = None,
    scale: float,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (or fp64) torch reference of :func:`~shardattn.ops.gqa_decode.gqa_paged_decode` (reads
    ``seq_lens`` on the host).

    Args:
        q: ``[total_q, Hq, D]``; k_cache, v_cache: ``[num_pages, page, Hkv, D]``.
        block_table: ``[B, max_pages]`` int32; seq_lens: ``[B]`` int32 (drafts included).
        cu_q_lens: ``[B + 1]`` int32 query offsets (uniform drafts: ``arange(B + 1) * Q``).
        causal, window_left, sinks (``[Hq]`` fp32), scale: as in :func:`~shardattn.ops.gqa_decode.gqa_paged_decode`.
        compute_dtype: float32 or float64.
    Returns:
        ``(out [total_q, Hq, D] in q.dtype, lse [total_q, Hq] fp32)``.
    """
    total_q, hq, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    out = torch.zeros(total_q, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.full((total_q, hq), -math.inf, dtype=torch.float32, device=q.device)
    cu = [int(x) for x in cu_q_lens.tolist()]
    lens = [int(x) for x in seq_lens.tolist()]
    for b, seq_len in enumerate(lens):
        start, end, first = _positions(cu, b, seq_len)
        if end <= start or seq_len <= 0:
            continue  # a padded request: (0, -inf)
        pages = block_table[b, : -(-seq_len // page)].long()
        keys = k_cache[pages].reshape(-1, hkv, d)[:seq_len]
        values = v_cache[pages].reshape(-1, hkv, d)[:seq_len]
        pos = first + torch.arange(end - start, device=q.device)  # [Q]
        key_pos = torch.arange(seq_len, device=q.device)
        hi = pos + 1 if causal else torch.full_like(pos, seq_len)
        lo = (pos - window_left).clamp(min=0) if window_left >= 0 else torch.zeros_like(pos)
        visible = (key_pos[None, :] >= lo[:, None]) & (key_pos[None, :] < hi[:, None])
        rows = torch.where(visible, key_pos[None, :], torch.full_like(visible, -1, dtype=torch.long))
        for g in range(hkv):
            heads = slice(g * group, (g + 1) * group)
            # value first, key second: sparse MLA's "value = first v_dim dims of a row" layout
            kv = torch.cat([values[:, g], keys[:, g]], dim=-1)
            qg = torch.cat([torch.zeros_like(q[start:end, heads]), q[start:end, heads]], dim=-1)
            o, lse_g = sparse_mla_reference(
                qg,
                kv,
                rows.to(torch.int32),
                scale=scale,
                v_dim=d,
                sinks=None if sinks is None else sinks[heads],
                compute_dtype=compute_dtype,
            )
            out[start:end, heads] = o
            lse[start:end, heads] = lse_g
    return out, lse
