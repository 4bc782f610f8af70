"""How fast can one launch gather a small decode step's KV rows into shared memory (one GPU)?

``decode_small_sweep.py --floors-only`` reads the rows into registers (a Triton kernel, 16-64
rows a step): few bytes in flight per SM, so a program of 128 rows pays several memory round
trips. This probe issues every row of a program at once as ``cp.async`` copies into shared
memory (a Gluon kernel: 128 rows of 1,152 B are 144 KB in flight per SM), waits once, and writes
one float. Shapes as ``decode.py``'s small sparse-MLA decode: top-k 2,048 unique random rows of
262,144, bf16, 576 columns; 1 / 2 / 4 / 8 tokens; each token's rows cut into ``splits`` programs.
Graph replays with the L2 flushed between replays (as ``decode.py``), minimum over rounds; beside
them, the graph of one 1-element kernel and the register read kernel on the same grids.

    python benchmarks/decode_gather_floor.py
"""

from __future__ import annotations

import argparse

import torch
from decode_small_sweep import _read_rows_kernel  # beside this script
from graph_timing import gpu_banner, replay_us, trivial_graph_us

from shardattn.kernels.gluon.compat import async_load, cp, cta_barrier, gl, gluon

ROWS, TOPK = 1 << 18, 2048
GRIDS = ((64, 4), (32, 4), (32, 8), (16, 4), (16, 8))  # (programs per token, warps)


@gluon.jit
def gather_split_rows(KV, Rows, tok, split, stride_kv, K, BN: gl.constexpr, lv: gl.constexpr, lr: gl.constexpr,
                      plain: gl.constexpr):  # fmt: skip
    """``cp.async`` rows ``rows[tok, split * BN : + BN]`` (576 bf16 columns each) into shared memory
    at once (``lv`` / ``lr``: the ``[BN, 512]`` / ``[BN, 64]`` load layouts, ``plain`` the shared
    one), wait, and return the sum of their last 64 columns (so the copies are observed)."""
    nope = gl.allocate_shared_memory(gl.bfloat16, [BN, 512], plain)
    rope = gl.allocate_shared_memory(gl.bfloat16, [BN, 64], plain)
    base = Rows + tok.to(gl.int64) * K + split * BN
    r_v = gl.load(base + gl.arange(0, BN, layout=gl.SliceLayout(1, lv))).to(gl.int64) * stride_kv
    r_r = gl.load(base + gl.arange(0, BN, layout=gl.SliceLayout(1, lr))).to(gl.int64) * stride_kv
    async_load(nope, KV + r_v[:, None] + gl.arange(0, 512, layout=gl.SliceLayout(0, lv))[None, :])
    async_load(rope, KV + r_r[:, None] + 512 + gl.arange(0, 64, layout=gl.SliceLayout(0, lr))[None, :])
    cp.commit_group()
    cp.wait_group(0)
    cta_barrier()
    return gl.sum(gl.sum(rope.load(lr).to(gl.float32), axis=1), axis=0)


@gluon.jit
def _gather_rows_smem(KV, Rows, Out, stride_kv, K, BN: gl.constexpr, NW: gl.constexpr):
    """Program (token, split): :func:`gather_split_rows` and one float written."""
    tok = gl.program_id(0)
    split = gl.program_id(1)
    lv: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NW, 1], [1, 0])
    lr: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    tail = gather_split_rows(KV, Rows, tok, split, stride_kv, K, BN, lv, lr, plain)
    gl.store(Out + tok * gl.num_programs(1) + split, tail)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(gpu_banner(), flush=True)
    kv = torch.randn(ROWS, 576, device="cuda").bfloat16()
    print(f"graph of one 1-element kernel: {trivial_graph_us(rounds=args.rounds):.2f} us")
    print("| tokens | programs per token x rows, warps | cp.async into shared memory | register read (Triton) |")
    print("|---|---|---|---|")
    for batch in map(int, args.batches.split(",")):
        rows = torch.argsort(torch.rand(batch, ROWS, device="cuda"), dim=1)[:, :TOPK].int()
        for splits, warps in GRIDS:
            bn = TOPK // splits
            out = torch.empty(batch, splits, device="cuda")

            def smem(out=out, splits=splits, warps=warps, bn=bn, batch=batch, rows=rows):
                _gather_rows_smem[(batch, splits)](kv, rows, out, kv.stride(0), TOPK, BN=bn, NW=warps, num_warps=warps)

            smem()
            want = kv[rows.long(), 512:].float().view(batch, splits, -1).sum(-1)
            torch.testing.assert_close(out, want, rtol=1e-3, atol=0.5)

            def regs(out=out, splits=splits, warps=warps, bn=bn, batch=batch, rows=rows):
                _read_rows_kernel[(batch, splits)](kv, rows, out, kv.stride(0), TOPK, bn, BLOCK_N=min(bn, 32),
                                                   num_warps=warps)  # fmt: skip

            t_smem, t_regs = (replay_us(f, rep=40, rounds=args.rounds) for f in (smem, regs))
            print(f"| {batch} | {splits} x {bn}, {warps} | {t_smem:.2f} | {t_regs:.2f} |", flush=True)


if __name__ == "__main__":
    main()
