"""Where does one program of the small-batch decode split kernel spend its time (one GPU)?

Builds a copy of :mod:`shardattn.kernels.gluon.sparse_mla_decode_small` whose split kernel reads
the SM clock (``%clock64``) between its phases and writes the stamps to a buffer, then launches
it (without programmatic dependent launch, one launch at a time, the L2 flushed before each) on
``decode.py``'s small sparse-MLA decode shapes: top-k 2,048 unique random rows of 262,144, bf16,
16 heads, the routed tiles at 1 / 2 / 4 / 8 tokens, ``--chunks`` latent column chunks. Prints per
phase the median over programs and launches, the maximum, and the program that ended last.
Cycles are turned into microseconds at ``--ghz`` (the H200's maximum SM clock: a slower clock
makes the phases longer than printed, not shorter). The copy is the library kernel with stamp
lines added at fixed statements; if one of them is not found the script stops.

    cd benchmarks && python decode_small_timeline.py
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
import tempfile
from pathlib import Path

import torch

import shardattn.kernels.gluon.sparse_mla_decode_small as small
from shardattn.kernels.triton.lse_merge import split_partials

ROWS, TOPK, HEADS = 1 << 18, 2048, 16
#: (kernel text with ``@`` where the stamp goes, stamp index, the phase that ends there)
STAMPS = (
    ("        tok = gl.program_id(0)\n@", 1, "start to the first statement"),
    ("            cp.commit_group()\n@\n", 2, "index loads and gather issue"),
    (
        "        cp.wait_group(NCHUNK)\n        fence_async_shared()\n        cta_barrier()\n@",
        3,
        "Q and rope columns land",
    ),
    ("@        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))\n", 4, "latent columns land, Q.K^T issued"),
    ("        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))\n@", 5, "Q.K^T finishes"),
    (
        "        p_t.store(p.to(dtype))\n        fence_async_shared()\n        cta_barrier()\n@",
        6,
        "softmax, P to shared memory",
    ),
    ("        o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))\n@", 7, "P.V"),
    ("        o = gl.convert_layout(o, store_l)\n@", 8, "normalise, to the store layout"),
    ("(h0 + heads) * stride_lh, lse, mask=heads < n_h)\n@", 9, "partial and LSE stores issued"),
)
STAMP_FN = """
    @gluon.jit
    def _stamp(Tm, i: gl.constexpr):
        t = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
        program = (gl.program_id(0) * gl.num_programs(1) + gl.program_id(1)) * gl.num_programs(2) + gl.program_id(2)
        gl.store(Tm + program * 16 + i, t)

    @gluon.jit
    def _small_split_kernel("""


def stamped_module(directory: Path):
    """Import a copy of the small-batch kernel module with clock stamps (argument ``tm``: int64,
    16 per program) in its split kernel."""
    src = inspect.getsource(small)
    begin = src.index("    def _small_split_kernel(")
    for anchor, index, _ in STAMPS:
        text = anchor.replace("@", "")
        at = src.find(text, begin)
        if at < 0:
            raise SystemExit(f"stamp {index}: statement not found in the kernel: {text!r}")
        where = at + anchor.index("@")
        src = src[:where] + f"        _stamp(Tm, {index})\n" + src[where:]
    for old, new in (
        ('"""One (token, split, group', '_stamp(Tm, 0)\n        """One (token, split, group'),
        ("qk_scale,\n", "qk_scale, Tm,\n"),
        ("\n    @gluon.jit\n    def _small_split_kernel(", STAMP_FN),
        ("float(scale) * LOG2E,", "float(scale) * LOG2E, tm,"),
        (
            "    heads_per_program: int | None = None,\n) -> None:",
            "    heads_per_program: int | None = None,\n    tm=None,\n) -> None:",
        ),
    ):
        if old not in src:
            raise SystemExit(f"statement not found in the kernel module: {old!r}")
        src = src.replace(old, new, 1)
    path = directory / "small_stamped.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("small_stamped", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["small_stamped"] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--chunks", default="1,4")
    parser.add_argument("--launches", type=int, default=10)
    parser.add_argument("--ghz", type=float, default=1.98)
    args = parser.parse_args()
    torch.manual_seed(0)
    kv = torch.randn(ROWS, 576, device="cuda").bfloat16()
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    with tempfile.TemporaryDirectory() as tmp:
        mod = stamped_module(Path(tmp))
        for batch in map(int, args.batches.split(",")):
            rows = torch.argsort(torch.rand(batch, ROWS, device="cuda"), dim=1)[:, :TOPK].int().contiguous()
            q = torch.randn(batch, HEADS, 576, device="cuda").bfloat16()
            block_n, splits = small.small_decode_tiles(batch, TOPK, sms)
            group = small.small_decode_heads(batch, splits, HEADS, sms)
            programs = batch * splits * -(-HEADS // group)
            part, lse = split_partials(None, splits, batch, HEADS, 512, q.device)
            for chunks in map(int, args.chunks.split(",")):
                tm = torch.zeros(programs * 16, dtype=torch.int64, device="cuda")
                phases, last = [], []
                for launch in range(args.launches + 2):
                    flush.zero_()
                    mod.launch_small_split(q, kv, rows, None, None, part, lse, block_n, splits, 0.1, False,
                                           chunks=chunks, heads_per_program=group, tm=tm)  # fmt: skip
                    torch.cuda.synchronize()
                    if launch < 2:
                        continue
                    stamps = tm.view(-1, 16)[:, :10].double()
                    us = (stamps[:, 1:] - stamps[:, :-1]) / args.ghz / 1e3
                    phases.append(us)
                    last.append(us[(stamps[:, 9] - stamps[:, 0]).argmax()])
                allp = torch.cat(phases)
                med, top = allp.median(dim=0).values, allp.max(dim=0).values
                slow = torch.stack(last).median(dim=0).values
                total = allp.sum(1).median().item()
                print(f"\n{batch} tokens, {splits} x {block_n}, {group} heads a program, {chunks} latent chunks: "
                      f"a program takes {total:.2f} us "
                      f"(median over programs and {args.launches} launches)")  # fmt: skip
                print("| phase (us) | median | max | longest program |")
                print("|---|---|---|---|")
                for i, (_, _, name) in enumerate(STAMPS):
                    print(f"| {name} | {med[i]:.2f} | {top[i]:.2f} | {slow[i]:.2f} |")


if __name__ == "__main__":
    main()
