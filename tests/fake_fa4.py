"""A CPU stand-in for FA4's ``flash_attn_varlen_func``: its documented contract in fp64 loops.

Written from flash-attn-4 4.0.0b36's source (``flash_attn/cute/interface.py``, ``mask.py``,
``softmax.py``, ``seqlen_info.py``), sharing no code with the library, so the adapter's boundary
conversions (LSE layout, window tuple, page-table clamping, key offsets) are exercised on CPU:

* sequence ``b``: query rows ``[cu_seqlens_q[b], cu_seqlens_q[b + 1])``; keys rows
  ``[cu_seqlens_k[b], cu_seqlens_k[b] + seqused_k[b])``, or positions ``j < seqused_k[b]`` at
  ``k[page_table[b, j // page], j % page]`` (``cu_seqlens_k`` must then be ``None``);
* masks bottom-right: query ``i`` of ``m``, ``L`` keys: ``j <= i + L - m`` (causal, or a right
  window ``i + L - m + right``), ``j >= i + L - m - left`` (left window);
* ``learnable_sink [H]``: a natural-log logit in the denominator, not scaled;
* returns ``(out [T, H, D] in q's dtype, lse [H, T] fp32 natural log)``.

It also asserts what FA4 asserts (int32 metadata, shapes) and what its cp.async path needs (every
page-table entry inside the cache), records each call's keyword arguments in ``calls``, and keeps
in ``compiled`` the compile key FA4 would form for each call (the parts of ``_flash_attn_fwd``'s key
the library's calls can change: dtype, head dim, query heads per KV head, causal / local, sinks,
LSE or not, ``cu_seqlens_k`` / ``seqused_k`` / ``page_table`` given, TMA pages (page size 128 at
head_dim 64 on SM90), more than 256 sequences), so a test can count what a real FA4 compiles.
"""

from __future__ import annotations

import math

import torch


class FakeFA4:
    """Callable like ``flash_attn_varlen_func``; ``calls`` lists each call's keyword arguments.

    ``compute=False`` checks the arguments and records the call and its compile key, but returns
    zeros (for tests of which kernels run, not of their values)."""

    def __init__(self, compute: bool = True) -> None:
        self.compute = compute
        self.calls: list[dict] = []
        self.compiled: set[tuple] = set()

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor | None = None,
        seqused_k: torch.Tensor | None = None,
        page_table: torch.Tensor | None = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple = (None, None),
        learnable_sink: torch.Tensor | None = None,
        return_lse: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.calls.append(
            dict(
                causal=causal,
                window_size=window_size,
                paged=page_table is not None,
                sink=learnable_sink is not None,
                return_lse=return_lse,
                segments=cu_seqlens_q.numel() - 1,
                seqused=seqused_k is not None,
            )
        )
        local = window_size[0] is not None
        self.compiled.add(
            (
                q.dtype, q.shape[-1], q.shape[1] // k.shape[-2], causal and not local, local,
                learnable_sink is not None, return_lse, cu_seqlens_k is None, seqused_k is None,
                page_table is not None, page_table is not None and k.shape[1] == 128,
                cu_seqlens_q.numel() - 1 > 256,
            )
        )  # fmt: skip
        assert q.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == q.dtype
        for t in (cu_seqlens_q, cu_seqlens_k, seqused_k, page_table):
            assert t is None or (t.dtype == torch.int32 and t.is_contiguous())
        batch = cu_seqlens_q.numel() - 1
        t_q, heads, _ = q.shape
        hkv = k.shape[-2]
        assert heads % hkv == 0
        if page_table is not None:
            assert cu_seqlens_k is None, "page_table is not supported with cu_seqlens_k"
            assert page_table.shape[0] == batch
            assert bool(((page_table >= 0) & (page_table < k.shape[0])).all()), "page id outside the cache"
            page = k.shape[1]
        else:
            assert cu_seqlens_k is not None and cu_seqlens_k.shape == (batch + 1,)
        assert page_table is None or seqused_k is not None, "paged keys take their lengths from seqused_k"
        assert seqused_k is None or seqused_k.shape == (batch,)
        if learnable_sink is not None:
            assert learnable_sink.shape == (heads,)
        if not self.compute:
            return q.new_zeros(q.shape), torch.zeros(heads, t_q) if return_lse else None
        left, right = window_size
        if causal:
            right = 0
        scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
        q64, k64, v64 = q.double(), k.double(), v.double()
        out = torch.zeros(t_q, heads, v.shape[-1], dtype=torch.float64)
        lse = torch.full((heads, t_q), -math.inf, dtype=torch.float64)
        cu_q = cu_seqlens_q.tolist()
        used = (seqused_k if seqused_k is not None else cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
        for b in range(batch):
            m, n_keys = cu_q[b + 1] - cu_q[b], used[b]
            if page_table is not None:
                keys = [k64[page_table[b, j // page], j % page] for j in range(n_keys)]
                vals = [v64[page_table[b, j // page], j % page] for j in range(n_keys)]
            else:
                start = int(cu_seqlens_k[b])
                keys = [k64[start + j] for j in range(n_keys)]
                vals = [v64[start + j] for j in range(n_keys)]
            for i in range(m):
                row = cu_q[b] + i
                seen = [
                    j
                    for j in range(n_keys)
                    if (right is None or j <= i + n_keys - m + right) and (left is None or j >= i + n_keys - m - left)
                ]
                for h in range(heads):
                    g = h // (heads // hkv)
                    logits = [scale * float(q64[row, h] @ keys[j][g]) for j in seen]
                    terms = logits + ([float(learnable_sink[h])] if learnable_sink is not None else [])
                    if not terms:
                        continue
                    top = max(terms)
                    total = math.log(sum(math.exp(x - top) for x in terms)) + top
                    lse[h, row] = total
                    for j, x in zip(seen, logits):
                        out[row, h] += math.exp(x - total) * vals[j][g]
        return out.to(q.dtype), lse.float() if return_lse else None
