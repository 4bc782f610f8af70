"""The read floor of sparse decode: a Triton kernel that only reads the picked KV rows once.

A decode step must read every picked row of its tokens at least once; a kernel that does only
that (loads each valid row's bytes, sums them as int32 words so that no load is dropped, writes
one small vector a program) bounds how fast any decode kernel can be on the same rows and cache.
``benchmarks/decode_floor.py`` times it beside the routed decode. Rows outside ``[0, R)`` are not
read (as decode skips them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: (rows a program reads, rows a load, warps) tried; the floor is the fastest.
CONFIGS = ((32, 16, 4), (64, 16, 4), (64, 32, 8), (128, 32, 8))


def row_words(kv: torch.Tensor) -> torch.Tensor:
    """``kv`` ``[R, B]`` or ``[pages, page, B]`` (any dtype, ``B`` bytes a multiple of 4, rows
    contiguous) as ``[R, B / 4]`` int32 words."""
    flat = kv.reshape(-1, kv.shape[-1])
    if not flat.is_contiguous() or (flat.shape[1] * flat.element_size()) % 4:
        raise ValueError(f"kv rows must be contiguous and a multiple of 4 bytes, got {tuple(kv.shape)} {kv.dtype}")
    return flat.view(torch.uint8).view(torch.int32)


@triton.jit
def _read_rows_kernel(
    words_ptr, rows_ptr, out_ptr, num_rows, topk, stride_t,
    ROW_WORDS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    part = tl.program_id(1)
    offs_w = tl.arange(0, BLOCK_W)
    acc = tl.zeros([BLOCK_W], dtype=tl.int32)
    end = tl.minimum((part + 1) * ROWS, topk)
    for start in range(part * ROWS, end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        idx = tl.load(rows_ptr + t * stride_t + offs_n, mask=offs_n < end, other=-1)
        ok = (idx >= 0) & (idx < num_rows)
        ptrs = words_ptr + idx.to(tl.int64)[:, None] * ROW_WORDS + offs_w[None, :]
        acc += tl.sum(tl.load(ptrs, mask=ok[:, None] & (offs_w[None, :] < ROW_WORDS), other=0), axis=0)
    tl.store(out_ptr + (t * tl.num_programs(1) + part) * BLOCK_W + offs_w, acc)


def read_rows(
    words: torch.Tensor, rows: torch.Tensor, config: tuple[int, int, int] = CONFIGS[1], out: torch.Tensor | None = None
) -> torch.Tensor:
    """Reads the picked rows once (module docstring).

    Args:
        words: ``[R, W]`` int32 (:func:`row_words`). rows: ``[T, K]`` int32 row ids (invalid: any
            value outside ``[0, R)``). config: (rows a program, rows a load, warps).
        out: ``[T, ceil(K / rows a program), next_pow2(W)]`` int32 to write, else allocated.
    Returns:
        ``out``: per program, the int32 sum (wrapping) of each word column over its valid rows.
    """
    per_prog, block_n, warps = config
    t, k = rows.shape
    block_w = triton.next_power_of_2(words.shape[1])
    parts = triton.cdiv(k, per_prog)
    if out is None:
        out = torch.empty(t, parts, block_w, dtype=torch.int32, device=words.device)
    if t and parts:
        _read_rows_kernel[(t, parts)](
            words, rows, out, words.shape[0], k, rows.stride(0),
            ROW_WORDS=words.shape[1], ROWS=per_prog, BLOCK_N=block_n, BLOCK_W=block_w, num_warps=warps,
        )  # fmt: skip
    return out


def read_rows_reference(words: torch.Tensor, rows: torch.Tensor, per_prog: int) -> torch.Tensor:
    """What :func:`read_rows` writes, in torch (int64 sums wrapped to int32)."""
    t, k = rows.shape
    block_w = triton.next_power_of_2(words.shape[1])
    parts = -(-k // per_prog)
    ok = (rows >= 0) & (rows < words.shape[0])
    picked = words[torch.where(ok, rows, 0).long()].long() * ok[..., None]  # [T, K, W]
    picked = torch.nn.functional.pad(picked, (0, block_w - words.shape[1], 0, parts * per_prog - k))
    sums = picked.view(t, parts, per_prog, block_w).sum(2)
    return (((sums + 2**31) % 2**32) - 2**31).to(torch.int32)
