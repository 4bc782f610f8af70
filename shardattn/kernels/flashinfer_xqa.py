"""Adapter to FlashInfer's XQA decode kernel (optional extra ``shardattn[flashinfer]``).

:func:`xqa_paged_decode` runs :func:`~shardattn.ops.gqa_decode.gqa_paged_decode`'s contract on
``flashinfer.decode.xqa_batch_decode_with_kv_cache`` (SM90 / SM100 / SM120): uniform and ragged
drafts (causal or not, as a draft-block bit mask), sliding window, sinks. XQA returns no LSE, so
it is never used when an LSE is needed (DCP, ``return_lse``). Its head-dim rule is
:func:`shardattn.plan.cudagraph.xqa_head_dim_supported`, the same function the CUDA-graph policy
uses. FlashInfer is imported lazily behind a cached getter; nothing here runs at import time.

Boundary conversions made here, once: seq_lens as uint32 (a reinterpreting view), sinks as
``[Hkv, Hq / Hkv]``, and padded requests (``seq_lens == 0``) and rows past ``cu_q_lens[-1]``
zeroed after the call (XQA leaves them undefined), so the output matches the other backends.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from shardattn.kernels.backend import unit_stride

__all__ = ["draft_mask", "get_xqa", "unavailable_reason", "xqa_paged_decode"]

#: Bytes of the zero-initialised XQA workspace (semaphores + scratch), one per device.
WORKSPACE_BYTES = 256 << 20
XQA_SM_MAJORS = (9, 10, 12)
#: Page sizes FlashInfer XQA is built for (its JIT module's ``tokens_per_page``).
XQA_PAGE_SIZES = (16, 32, 64, 128)


@functools.lru_cache(maxsize=1)
def _load() -> tuple[Callable | None, str | None]:
    try:
        from flashinfer.decode import xqa_batch_decode_with_kv_cache
    except Exception as exc:  # ImportError, or a broken install
        return None, f"flashinfer is not importable ({type(exc).__name__}: {exc})"
    return xqa_batch_decode_with_kv_cache, None


def get_xqa() -> Callable | None:
    """``flashinfer.decode.xqa_batch_decode_with_kv_cache``, or ``None`` when not importable (cached)."""
    return _load()[0]


def unavailable_reason(q: torch.Tensor, k_cache: torch.Tensor, *, non_causal_drafts: bool = False) -> str | None:
    """Why XQA cannot run these tensors, or ``None`` when it can (no device sync).

    Args:
        q: ``[total_q, Hq, D]``; k_cache: ``[num_pages, page_size, Hkv, D]``.
        non_causal_drafts: drafts (several queries a request) that see every key.
    """
    if q.device.type != "cuda" or not torch.cuda.is_available():
        return f"XQA needs CUDA tensors, got {q.device}"
    from shardattn.plan.cudagraph import xqa_head_dim_supported  # the one head-dim rule

    major = torch.cuda.get_device_capability(q.device)[0]
    why = sm_reason(major, non_causal_drafts)
    if why is not None:
        return why
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"XQA needs fp16/bf16, got {q.dtype}"
    if not xqa_head_dim_supported(q.shape[-1]):
        return f"XQA does not support head_dim {q.shape[-1]} (16..256, a multiple of 16)"
    if k_cache.shape[1] not in XQA_PAGE_SIZES:
        return f"XQA needs page_size in {XQA_PAGE_SIZES}, got {k_cache.shape[1]}"
    if get_xqa() is None:
        return _load()[1]
    return None


def sm_reason(major: int, non_causal_drafts: bool) -> str | None:
    """Why XQA does not run on a GPU of compute capability ``major``.x, or ``None``.

    >>> sm_reason(10, True), sm_reason(9, True), sm_reason(8, False)
    ('XQA runs causal drafts only on SM100', None, 'XQA runs on SM90/SM100/SM120, this GPU is SM8x')
    """
    if major not in XQA_SM_MAJORS:
        return f"XQA runs on SM90/SM100/SM120, this GPU is SM{major}x"
    if non_causal_drafts and major == 10:  # FlashInfer's XQA has no non-causal draft mask there
        return "XQA runs causal drafts only on SM100"
    return None


@functools.lru_cache(maxsize=16)
def _workspace(device: torch.device) -> torch.Tensor:
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def draft_mask(cu_q_lens: torch.Tensor, total_q: int, max_q_len: int, *, causal: bool) -> torch.Tensor:
    """XQA's draft-block mask, packed: ``[total_q, words]`` uint16 (device ops only, no sync).

    Bit ``i`` of row ``r`` (request ``b``, local query ``j``) is set when query ``j`` sees draft
    ``i`` of its request: ``i <= j`` (causal) or ``i < Q_b`` (non-causal). ``words = 2 *
    ceil(max_q_len / 32)`` (32-bit groups as pairs of uint16).

    Example:
        >>> m = draft_mask(torch.tensor([0, 2, 3], dtype=torch.int32), 3, 2, causal=True)
        >>> m.view(torch.int32).view(-1).tolist()
        [1, 3, 1]
    """
    device = cu_q_lens.device
    rows = torch.arange(total_q, device=device, dtype=torch.int32)
    req = (torch.searchsorted(cu_q_lens, rows, right=True) - 1).clamp(0, cu_q_lens.numel() - 2)
    local = rows - cu_q_lens[req]
    q_lens = cu_q_lens[req + 1] - cu_q_lens[req]
    n_words = (max_q_len + 31) // 32
    col = torch.arange(n_words * 32, device=device, dtype=torch.int32)
    limit = (local + 1) if causal else q_lens
    bits = (col[None, :] < limit[:, None]).view(total_q, n_words, 32).to(torch.int64)
    weights = torch.ones(32, dtype=torch.int64, device=device) << torch.arange(32, device=device)
    words = (bits * weights).sum(-1)  # [total_q, n_words] in [0, 2^32)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.contiguous().view(torch.int16).view(torch.uint16)


def xqa_paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    q_len_per_req: int | None,
    cu_q_lens: torch.Tensor | None,
    max_q_len: int,
    causal: bool,
    window_left: int,
    sinks: torch.Tensor | None,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run validated :func:`~shardattn.ops.gqa_decode.gqa_paged_decode` arguments on XQA.

    Shapes as there; ``max_q_len`` is the host bound on draft lengths. Returns ``out
    [total_q, Hq, D]`` in q's dtype (no LSE). XQA reads ``q``, ``out`` and the block table as
    dense arrays (only the caches' strides are passed), so views of another layout are copied
    (``out``: written through a dense buffer); a call with no request or no query launches
    nothing.
    """
    xqa = get_xqa()
    if xqa is None:
        raise RuntimeError(f"XQA cannot run: {_load()[1]}")
    total_q, hq, _ = q.shape
    seq_lens, cu_q_lens = unit_stride(seq_lens), unit_stride(cu_q_lens)
    q, block_table = q.contiguous(), block_table.contiguous()
    batch = block_table.shape[0]
    hkv = k_cache.shape[2]
    page = k_cache.shape[1]
    given = out
    out = torch.empty_like(q) if out is None or not out.is_contiguous() else out
    if batch == 0 or total_q == 0:
        out.zero_()
        return _written(given, out)
    lens_u32 = seq_lens.view(torch.uint32) if hasattr(torch, "uint32") else seq_lens
    kwargs = {
        "bmm1_scale": float(scale),
        "bmm2_scale": 1.0,
        "window_left": int(window_left),
        "out": out,
        "sinks": None if sinks is None else sinks.reshape(hkv, hq // hkv).contiguous(),
        "kv_layout": "NHD",
    }
    if cu_q_lens is not None:
        q_len = max(2, int(max_q_len))  # XQA's ragged path wants the max draft length, > 1
        kwargs["q_cu_seq_lens"] = cu_q_lens
        kwargs["mask"] = draft_mask(cu_q_lens, total_q, q_len, causal=causal)
        kwargs["q_len_per_req"] = q_len
    elif q_len_per_req is None:
        raise ValueError("xqa_paged_decode needs q_len_per_req or cu_q_lens")
    elif (q_len := int(q_len_per_req)) > 1:
        cu = torch.arange(batch + 1, device=q.device, dtype=torch.int32) * q_len
        kwargs["mask"] = draft_mask(cu, total_q, q_len, causal=causal).view(batch, q_len, -1)
        kwargs["q_len_per_req"] = q_len
    xqa(
        q,
        (k_cache, v_cache),
        _workspace(q.device),
        block_table,
        lens_u32,
        block_table.shape[1] * page,
        **kwargs,
    )
    # padded requests and rows of no request: XQA leaves them undefined; the contract says 0
    if cu_q_lens is not None:
        rows = torch.arange(total_q, device=q.device, dtype=torch.int32)
        req = (torch.searchsorted(cu_q_lens, rows, right=True) - 1).clamp(0, batch - 1)
        live = (rows < cu_q_lens[-1]) & (seq_lens[req] > 0)
    else:
        live = (seq_lens > 0).repeat_interleave(q_len) if q_len > 1 else seq_lens > 0
    out.masked_fill_(~live[:, None, None], 0)
    return _written(given, out)


def _written(given: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """``out``, copied into the caller's ``given`` where that is another (strided) tensor."""
    if given is None or given is out:
        return out
    return given.copy_(out)
