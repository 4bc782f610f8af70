"""One routed sparse-MLA decode shape launched a few times, eagerly, for a kernel profiler to read.

Nothing is timed here: run it under Nsight Compute and skip the warm-up launches, e.g. the Gluon
kernel's third launch on FP8 rows at 128 heads x 64 tokens::

    ncu --clock-control none -k regex:ws64 -c 1 --launch-skip 2 --section WarpStateStats \\
        python benchmarks/profile_decode.py --heads 128 --tokens 64 --kv-dtype fp8_ds_mla

Inputs as ``decode_floor.py``'s (``decode_inputs.py``): a cache of ``--cache-rows`` random rows in
the format asked for, each token's ``--topk`` distinct random rows of it, random q;
``rows_unique=True`` (no de-duplication launch in front of the kernel) unless ``--dedupe``. The
script prints the kernel the call routes to, so the profiler's ``-k`` filter can name it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_inputs import build_caches, distinct_rows  # beside this script

from shardattn.ops.dispatch import sparse_decode_kernel
from shardattn.ops.sparse_mla_decode import sparse_mla_decode


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--cache-rows", type=int, default=65536)
    p.add_argument("--kv-dtype", choices=("bf16", "fp8_ds_mla"), default="fp8_ds_mla")
    p.add_argument("--launches", type=int, default=3, help="calls made (profile the last one)")
    p.add_argument("--dedupe", action="store_true", help="the default call (rows de-duplicated first)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_decode.py needs a CUDA GPU (it launches a GPU kernel for a profiler)", file=sys.stderr)
        return 2
    g = torch.Generator(device="cuda").manual_seed(0)
    kv = build_caches(a.cache_rows, [a.kv_dtype])[a.kv_dtype]
    rows = distinct_rows(a.tokens, a.topk, a.cache_rows, g)
    q = torch.randn(a.tokens, a.heads, 576, device="cuda", generator=g).bfloat16()
    kernel, reason = sparse_decode_kernel(q, kv, 512, rows)
    print(f"{a.heads} heads x {a.tokens} tokens, top-k {a.topk}, {a.kv_dtype}: {kernel} ({reason})")
    for _ in range(a.launches):
        sparse_mla_decode(q, kv, rows, scale=576**-0.5, rows_unique=not a.dedupe)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
