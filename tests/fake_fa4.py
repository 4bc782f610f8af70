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
* returns ``(out [T, H, D] in q's dtype, lse [H, T] fp32 natural log)``; like FA4 it computes the
  LSE where ``return_lse`` asks for it or an input requires grad.

It also asserts what FA4 asserts (int32 metadata, shapes) and what its cp.async path needs (every
page-table entry inside the cache), records each call's keyword arguments in ``calls``, and keeps
in ``compiled`` the compile key FA4 would form for each call (the parts of ``_flash_attn_fwd``'s key
the library's calls can change: dtype, head dim, query heads per KV head, causal / local, sinks,
LSE or not, ``cu_seqlens_k`` / ``seqused_k`` / ``page_table`` given, TMA pages (page size 128 at
head_dim 64 on SM90), more than 256 sequences), so a test can count what a real FA4 compiles.

Like FA4, a public call allocates the output and LSE, looks its kernel up in
``_flash_attn_fwd.compile_cache`` by that key (compiling a :class:`FakeKernel` on a miss) and calls
it with SM90's 18 positional arguments, in ``FlashAttentionForwardSm90.__call__``'s order. The kernel
writes the output and LSE in place (``launches`` counts its calls, public or direct) and asserts
that its arguments are of its compile key, so a direct launch of the wrong kernel fails.
``interface`` holds what the fast launch's guard reads, so the adapter's fast launch
(``shardattn.kernels.fa4_launch``) runs on CPU the plumbing it runs on FA4.
"""

from __future__ import annotations

import math
import types
from typing import NamedTuple

import torch


class AuxData(NamedTuple):
    """FA4's ``utils.AuxData`` (score-mod tensors and scalars; none here)."""

    tensors: object = None
    scalars: object = None


class CompileCache:
    """FA4's ``JITCache``: compiled kernels by compile key (``in``, ``[key]``, ``[key] =``)."""

    def __init__(self) -> None:
        self.cache: dict[tuple, FakeKernel] = {}

    def __contains__(self, key: tuple) -> bool:
        return key in self.cache

    def __getitem__(self, key: tuple) -> FakeKernel:
        return self.cache[key]

    def __setitem__(self, key: tuple, fn: FakeKernel) -> None:
        self.cache[key] = fn


def _launch_key(q, k, cu_q, cu_k, used_k, table, sink, lse, left) -> tuple:
    """What a kernel can check of its compile key from its arguments (all but causal)."""
    return (
        q.dtype, q.shape[-1], q.shape[1] // k.shape[-2], left is not None, sink is not None, lse is not None,
        cu_k is None, used_k is None, table is not None, table is not None and k.shape[1] == 128,
        cu_q.numel() - 1 > 256,
    )  # fmt: skip


class FakeKernel:
    """One compiled forward kernel (``FlashAttentionForwardSm90.__call__``'s signature), for one
    compile key: writes ``mO`` (and ``mLSE``) in place."""

    def __init__(self, owner: FakeFA4, key: tuple) -> None:
        self.owner = owner
        self.key = key

    def __call__(
        self,
        mQ: torch.Tensor,
        mK: torch.Tensor,
        mV: torch.Tensor,
        mO: torch.Tensor,
        mLSE: torch.Tensor | None,
        softmax_scale: float,
        mCuSeqlensQ: torch.Tensor | None = None,
        mCuSeqlensK: torch.Tensor | None = None,
        mSeqUsedQ: torch.Tensor | None = None,
        mSeqUsedK: torch.Tensor | None = None,
        mPageTable: torch.Tensor | None = None,
        window_size_left: int | None = None,
        window_size_right: int | None = None,
        learnable_sink: torch.Tensor | None = None,
        blocksparse_tensors: object = None,
        aux_data: AuxData | None = None,
        mCuTotalMBlocks: torch.Tensor | None = None,
        mCuTotalSplitsMBlocks: torch.Tensor | None = None,
        stream: object = None,
    ) -> None:
        self.owner.launches += 1
        got = _launch_key(mQ, mK, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mPageTable, learnable_sink, mLSE,
                          window_size_left)  # fmt: skip
        causal = self.key[3]
        assert got == self.key[:3] + self.key[4:], f"kernel of {self.key} launched with arguments of {got}"
        assert mSeqUsedQ is None and blocksparse_tensors is None and mCuTotalMBlocks is None
        for t in (mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mPageTable, learnable_sink):
            assert t is None or isinstance(t, torch.Tensor)
        assert mO.shape == (*mQ.shape[:2], mV.shape[-1]) and mO.dtype == mQ.dtype
        assert mLSE is None or (mLSE.shape == (mQ.shape[1], mQ.shape[0]) and mLSE.dtype == torch.float32)
        if learnable_sink is not None:
            assert learnable_sink.shape == (mQ.shape[1],) and learnable_sink.dtype == torch.float32
        if not self.owner.compute:
            return
        right = 0 if causal else window_size_right
        out, lse = _attend(mQ, mK, mV, softmax_scale, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mPageTable,
                           window_size_left, right, learnable_sink)  # fmt: skip
        mO.copy_(out)
        if mLSE is not None:
            mLSE.copy_(lse)


class FakeFA4:
    """Callable like ``flash_attn_varlen_func``; ``calls`` lists each public call's keyword arguments.

    ``compute=False`` checks the arguments and records the call and its compile key, but its
    kernels write nothing (the outputs hold what ``torch.empty`` gave; for tests of which kernels
    run, not of their values). ``launches`` counts kernel calls; ``interface`` is a stand-in for
    ``flash_attn.cute.interface`` (the public function, ``_flash_attn_fwd`` with its
    ``compile_cache``, the SM90 / SM100 kernel classes).
    """

    def __init__(self, compute: bool = True) -> None:
        self.compute = compute
        self.calls: list[dict] = []
        self.launches = 0

        def _flash_attn_fwd(*args: object, **kwargs: object) -> None:
            raise AssertionError("the adapter never calls _flash_attn_fwd itself")

        _flash_attn_fwd.compile_cache = CompileCache()
        self.fwd = _flash_attn_fwd
        self.interface = types.SimpleNamespace(
            flash_attn_varlen_func=self, _flash_attn_fwd=_flash_attn_fwd,
            FlashAttentionForwardSm90=FakeKernel, FlashAttentionForwardSm100=FakeKernel,
        )  # fmt: skip

    @property
    def compiled(self) -> set[tuple]:
        """The compile keys of the kernels compiled so far."""
        cache = self.fwd.compile_cache
        return set(getattr(cache, "cache", cache))

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
        else:
            assert cu_seqlens_k is not None and cu_seqlens_k.shape == (batch + 1,)
        assert page_table is None or seqused_k is not None, "paged keys take their lengths from seqused_k"
        assert seqused_k is None or seqused_k.shape == (batch,)
        if learnable_sink is not None:
            assert learnable_sink.shape == (heads,)
        causal, local, left, right = _resolve_window(causal, window_size)
        with_lse = return_lse or q.requires_grad or k.requires_grad or v.requires_grad  # as FA4 allocates it
        key = (
            q.dtype, q.shape[-1], heads // hkv, causal, local, learnable_sink is not None, with_lse,
            cu_seqlens_k is None, seqused_k is None, page_table is not None,
            page_table is not None and k.shape[1] == 128, batch > 256,
        )  # fmt: skip
        out = torch.empty(t_q, heads, v.shape[-1], dtype=q.dtype, device=q.device)
        lse = torch.empty(heads, t_q, dtype=torch.float32, device=q.device) if with_lse else None
        scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
        seqlen_k = k.shape[0] * k.shape[1] if page_table is not None else k.shape[0]
        if seqlen_k == 0 or t_q == 0:  # FA4 returns before any kernel
            out.zero_()
            if lse is not None:
                lse.copy_(learnable_sink[:, None].expand_as(lse) if learnable_sink is not None else -math.inf)
            return out, lse
        cache = self.fwd.compile_cache
        if key not in cache:
            cache[key] = FakeKernel(self, key)
        cache[key](
            q.detach(), k.detach(), v.detach(), out.detach(), lse, scale, cu_seqlens_q, cu_seqlens_k, None,
            seqused_k, page_table, left, right, learnable_sink, None, AuxData(None, None), None, None,
        )  # fmt: skip
        return out, lse


def _resolve_window(causal: bool, window_size: tuple) -> tuple[bool, bool, int | None, int | None]:
    """FA4's ``_resolve_causal_local_window``: ``(causal, local, left, right)`` of the kernel."""
    left, right = window_size
    if causal:
        right = 0
    if left is None and right == 0:
        return True, False, None, None
    if left is not None or right is not None:
        return False, True, left, right
    return False, False, None, None


def _attend(q, k, v, scale, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table, left, right, sink) -> tuple:
    """The contract in fp64 loops: ``(out [T, H, D] in q's dtype, lse [H, T] fp32)``."""
    batch = cu_seqlens_q.numel() - 1
    t_q, heads, _ = q.shape
    hkv = k.shape[-2]
    q64, k64, v64 = q.double(), k.double(), v.double()
    out = torch.zeros(t_q, heads, v.shape[-1], dtype=torch.float64)
    lse = torch.full((heads, t_q), -math.inf, dtype=torch.float64)
    cu_q = cu_seqlens_q.tolist()
    used = (seqused_k if seqused_k is not None else cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
    for b in range(batch):
        m, n_keys = cu_q[b + 1] - cu_q[b], used[b]
        if page_table is not None:
            page = k.shape[1]
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
                terms = logits + ([float(sink[h])] if sink is not None else [])
                if not terms:
                    continue
                top = max(terms)
                total = math.log(sum(math.exp(x - top) for x in terms)) + top
                lse[h, row] = total
                for j, x in zip(seen, logits):
                    out[row, h] += math.exp(x - total) * vals[j][g]
    return out.to(q.dtype), lse.float()
