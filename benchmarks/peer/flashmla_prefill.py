"""FlashMLA's SM90 sparse prefill as a measured peer, launched through ctypes (benchmarks only).

``build_flashmla_peer.sh`` (beside this file) builds the shared library from a FlashMLA checkout
and the CUTLASS it pins (neither is part of shardattn); ``flashmla_sparse_prefill.cu`` is its
C-ABI wrapper. The kernel takes 64 or 128 heads and a top-k that is a multiple of 128; fewer
heads run padded to 64 (FlashMLA's own answer for 8-32 heads a rank), so their time counts the
padding as FlashMLA would spend it.
"""

from __future__ import annotations

import ctypes

import torch

D_QK, D_V = 576, 512


def load(path: str) -> ctypes.CDLL:
    """The library ``build_flashmla_peer.sh`` wrote."""
    lib = ctypes.CDLL(path)
    lib.flashmla_sparse_prefill_sm90.restype = ctypes.c_int
    return lib


def padded_heads(heads: int) -> int:
    """Heads the peer runs for ``heads`` real ones: 64 up to 64, else 128 (more is refused)."""
    if heads > 128:
        raise ValueError(f"the FlashMLA peer takes at most 128 heads, got {heads}")
    return 64 if heads <= 64 else 128


def runner(lib: ctypes.CDLL, q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, scale: float):
    """A closure launching the peer on ``q [T, H, 576]`` (padded to :func:`padded_heads` with zero
    heads), ``kv [N, 576]`` and per-query ``rows [T, topk]`` int32 (``-1`` invalid); returns
    ``(run, out [T, H, 512], lse [T, H])``: views of the real heads of the peer's outputs."""
    t, h, d = q.shape
    if d != D_QK or rows.shape[1] % 128:
        raise ValueError(f"the peer takes 576-wide q and top-k a multiple of 128, got {d} / {rows.shape[1]}")
    hp = padded_heads(h)
    qp = q if hp == h else torch.cat([q, q.new_zeros(t, hp - h, d)], dim=1)
    out = torch.empty(t, hp, D_V, dtype=q.dtype, device=q.device)
    lse = torch.empty(t, hp, dtype=torch.float32, device=q.device)
    max_logits = torch.empty_like(lse)
    idx = rows.contiguous()
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    ptr = ctypes.c_void_p
    args = (ptr(qp.data_ptr()), ptr(kv.data_ptr()), ptr(idx.data_ptr()), ptr(out.data_ptr()),
            ptr(max_logits.data_ptr()), ptr(lse.data_ptr()), t, kv.shape[0], hp, idx.shape[1],
            qp.stride(0), qp.stride(1), kv.stride(0), idx.stride(0), ctypes.c_float(scale), sms)  # fmt: skip

    def run(_alive=(qp, kv, idx, out, max_logits, lse)):  # the peer gets raw pointers: keep the tensors
        rc = lib.flashmla_sparse_prefill_sm90(*args, ptr(torch.cuda.current_stream().cuda_stream))
        if rc:
            raise RuntimeError(f"flashmla_sparse_prefill_sm90 returned {rc}")

    return run, out[:, :h], lse[:, :h]
