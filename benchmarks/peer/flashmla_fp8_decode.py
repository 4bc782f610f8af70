"""FlashMLA's SM90 FP8 sparse decode on shardattn's tensors, through ctypes (benchmarks only).

The library is built from a FlashMLA checkout (not part of shardattn) by
``benchmarks/peer/build_flashmla_peer.sh FLASHMLA_DIR CUTLASS_DIR OUT.so fp8_decode``; its C ABI
is ``flashmla_sparse_fp8_decode.cu`` beside this file. :class:`FlashMLAFp8Decode` converts at the
boundary, once:

* inputs: ``q [T, H, 576]`` bf16 (``H`` padded with zero heads to 64 or 128, FlashMLA's only
  head counts), the cache of fp8_ds_mla rows (:func:`shardattn.ops.kv_fp8.check_fp8_kv`: paged
  ``[pages, page_size, 656]`` with contiguous pages' rows, or flat ``[R, 656]``), ``rows
  [T, K]`` int32 global rows with shardattn's rule (-1 or out of range = invalid, anywhere)
  turned into FlashMLA's (only -1 masked; K padded with -1 to a multiple of 64). Each token is a
  request of one query (``b = T``, ``s_q = 1``), as in serving decode. Unlike shardattn, FlashMLA
  counts a row listed twice by one token twice: give it unique rows (an indexer's top-k is).
* outputs: ``(out [T, H, 512] bf16, lse [T, H] fp32)``, natural-log LSE; FlashMLA's ``+inf`` for
  a row with no valid key becomes ``-inf`` (shardattn's ``(0, -inf)``).

The scheduler metadata (which SM partition runs which blocks of which token) depends on ``T``,
``K`` and the SM count only; :meth:`FlashMLAFp8Decode.prepare` computes it once, and the returned
call launches the split-KV kernel and the combine, as FlashMLA does on every layer.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from shardattn.ops.kv_fp8 import FP8_DS_MLA, check_fp8_kv
from shardattn.ops.lse_merge import empty_as_neg_inf

TOPK_BLOCK = 64  # FlashMLA's sparse decode reads the top-k in blocks of 64
D_QK, D_V = 576, 512


def peer_heads(heads: int) -> int:
    """FlashMLA's head count for ``heads`` query heads: 64 or 128 (padded with zero heads)."""
    if not 0 < heads <= 128:
        raise ValueError(f"FlashMLA's sparse decode runs up to 128 heads, got {heads}")
    return 64 if heads <= 64 else 128


def peer_indices(rows: torch.Tensor, num_kv_rows: int) -> torch.Tensor:
    """shardattn's ``rows [T, K]`` (-1 or out of range invalid) as FlashMLA's indices ``[T, K']``
    int32: invalid entries -1, ``K'`` the next multiple of 64 (padding -1).

    >>> peer_indices(torch.tensor([[3, -5, 9, 12]], dtype=torch.int32), 10).shape
    torch.Size([1, 64])
    >>> peer_indices(torch.tensor([[3, -5, 9, 12]], dtype=torch.int32), 10)[0, :5].tolist()
    [3, -1, 9, -1, -1]
    """
    t, k = rows.shape
    out = torch.full((t, -(-k // TOPK_BLOCK) * TOPK_BLOCK), -1, dtype=torch.int32, device=rows.device)
    valid = (rows >= 0) & (rows < num_kv_rows)
    out[:, :k] = torch.where(valid, rows, -1).to(torch.int32)
    return out


def cache_geometry(cache: torch.Tensor) -> tuple[int, int, int]:
    """``(num_blocks, page_block_size, block stride in bytes)`` of a fp8_ds_mla cache as FlashMLA
    addresses it (a flat cache is pages of one row)."""
    check_fp8_kv("cache", cache)
    if cache.dim() == 2:
        return cache.shape[0], 1, cache.stride(0)
    if cache.stride(1) != FP8_DS_MLA.row_bytes:
        raise ValueError(f"FlashMLA needs each page's rows contiguous (stride 656), got strides {cache.stride()}")
    return cache.shape[0], cache.shape[1], cache.stride(0)


@dataclass
class PeerCall:
    """One prepared decode: :meth:`run` launches FlashMLA's kernels on fixed buffers (capturable in
    a CUDA graph); :meth:`result` returns the outputs in shardattn's conventions."""

    launch: object
    heads: int
    out: torch.Tensor  # [T, H', 512] bf16, FlashMLA's
    lse: torch.Tensor  # [T, H'] fp32, FlashMLA's (+inf empty)
    keep: tuple  # tensors whose pointers the library holds

    def run(self) -> None:
        self.launch()

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [T, H, 512] bf16, lse [T, H] fp32)``: empty rows ``(0, -inf)``."""
        return self.out[:, : self.heads], empty_as_neg_inf(self.lse[:, : self.heads])


class FlashMLAFp8Decode:
    """FlashMLA's SM90 FP8 sparse decode from the shared library at ``path``."""

    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        self._meta_ints = lib.flashmla_sparse_fp8_decode_sched_meta_ints
        self._meta_ints.restype, self._meta_ints.argtypes = i, []
        self._parts = lib.flashmla_sparse_fp8_decode_num_sm_parts
        self._parts.restype, self._parts.argtypes = i, [i, i, i]
        self._metadata = lib.flashmla_sparse_fp8_decode_metadata
        self._metadata.restype, self._metadata.argtypes = i, [i, i, i, i, p, p, p]
        self._decode = lib.flashmla_sparse_fp8_decode_sm90
        self._decode.restype = i
        self._decode.argtypes = [p] * 9 + [i] * 12 + [f, i, p]

    def prepare(self, q: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor, scale: float) -> PeerCall:
        """Convert and allocate once for ``q [T, H, 576]`` bf16 (CUDA), a fp8_ds_mla ``cache`` and
        ``rows [T, K]`` int32; compute the scheduler metadata (on the current stream)."""
        t, h, d = q.shape
        if q.dtype != torch.bfloat16 or d != D_QK or not q.is_cuda:
            raise ValueError(
                f"q must be a CUDA bf16 [T, H, {D_QK}] tensor, got {q.dtype} {list(q.shape)} on {q.device}"
            )
        blocks, page, block_stride = cache_geometry(cache)
        hp = peer_heads(h)
        qp = torch.zeros(t, hp, D_QK, dtype=q.dtype, device=q.device)
        qp[:, :h] = q
        idx = peer_indices(rows, blocks * page)
        topk = idx.shape[1]
        dev = q.device
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        parts = self._parts(sms, 1, hp)
        sched = torch.empty(parts, self._meta_ints(), dtype=torch.int32, device=dev)
        splits = torch.empty(t + 1, dtype=torch.int32, device=dev)
        lse_accum = torch.empty(t + parts, 1, hp, dtype=torch.float32, device=dev)
        o_accum = torch.empty(t + parts, 1, hp, D_V, dtype=torch.float32, device=dev)
        out = torch.empty(t, hp, D_V, dtype=torch.bfloat16, device=dev)
        lse = torch.empty(t, hp, dtype=torch.float32, device=dev)
        stream = ctypes.c_void_p(torch.cuda.current_stream(dev).cuda_stream)
        rc = self._metadata(t, 1, topk, parts, sched.data_ptr(), splits.data_ptr(), stream)
        if rc:
            raise RuntimeError(f"flashmla_sparse_fp8_decode_metadata returned {rc}")
        ptrs = [x.data_ptr() for x in (qp, cache, idx, out, lse, lse_accum, o_accum, sched, splits)]
        sizes = [t, 1, hp, topk, blocks, page, qp.stride(0), qp.stride(0), qp.stride(1), block_stride]
        sizes += [idx.stride(0), idx.stride(0)]

        def launch() -> None:
            stream = torch.cuda.current_stream(dev).cuda_stream  # the capture stream under a graph
            rc = self._decode(*ptrs, *sizes, scale, parts, stream)
            if rc:
                raise RuntimeError(f"flashmla_sparse_fp8_decode_sm90 returned {rc}")

        keep = (qp, cache, idx, out, lse, lse_accum, o_accum, sched, splits)
        return PeerCall(launch, h, out, lse, keep)

    def __call__(
        self, q: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prepare, run once, return ``(out [T, H, 512] bf16, lse [T, H] fp32)``."""
        call = self.prepare(q, cache, rows, scale)
        call.run()
        return call.result()
