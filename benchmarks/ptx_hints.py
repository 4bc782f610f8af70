"""Experiment: FlashMLA's memory and wait hints on the routed Gluon prefill kernel, by rewriting its PTX.

FlashMLA's SM90 sparse prefill gathers with ``cp.async.cg.shared.global.L2::cache_hint.L2::256B``
(an ``evict_last`` policy and a 256-byte L2 prefetch) and waits on mbarriers with CUTLASS's
``try_wait`` suspend-time hint; Triton 3.6 emits neither (its ``eviction_policy`` on Gluon's
``async_copy`` is dropped; Triton 3.9 honours it). This script installs a Triton compile-stage hook
(``knobs.runtime.add_stages_inspection_hook``) that rewrites the kernel's PTX before ``ptxas``, then
times the routed per-query kernel as ``prefill_clocks.py`` does (one L2-flushed burst, then
``--sustain`` seconds at the power limit with clock and power sampled). One hint per process and
per Triton cache (the hook is not part of Triton 3.6's cache key), so run it once per hint with
its own ``TRITON_CACHE_DIR``, alternating hints::

    for h in none 256 sleep sleep 256 none; do
        TRITON_CACHE_DIR=/tmp/tc_$h python benchmarks/ptx_hints.py --hint $h --heads 64 --tokens 16384
    done

Hints: ``none``; ``256`` / ``128`` (the ``L2::256B`` / ``L2::128B`` prefetch on every gather);
``el`` / ``el256`` (an ``evict_last`` policy, with the prefetch); ``sleep`` (``try_wait`` with a
10 ms suspend-time hint, CUTLASS's). The output is checked bit for bit against the unhinted run's.
Nothing here is used by the library. (``el`` / ``el256`` as written here, one policy register made
at the kernel's entry and used in every partition, stopped the kernel with an illegal-instruction
error on the H200: benchmarks/RESULTS.md.)
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch
import triton

sys.path.insert(0, __file__.rsplit("/", 1)[0])

CP_ASYNC = re.compile(r"cp\.async\.cg\.shared\.global \[([^\]]*)\], \[([^\]]*)\], 0x10, (%r\d+);")
TRY_WAIT = re.compile(r"mbarrier\.try_wait\.parity\.(shared(?:::cta)?)\.b64 complete, \[(%r\d+)\], (%r\d+);")


def rewrite(ptx: str, hint: str) -> str:
    """``ptx`` with ``hint`` applied to every gather (or wait); unchanged for ``none`` or a kernel
    without ``cp.async`` gathers."""
    if hint == "none" or not CP_ASYNC.search(ptx):
        return ptx
    if hint == "sleep":
        return TRY_WAIT.sub(r"mbarrier.try_wait.parity.\1.b64 complete, [\2], \3, 10000000;", ptx)
    size = {"256": ".L2::256B", "128": ".L2::128B", "el": "", "el256": ".L2::256B"}[hint]
    if not hint.startswith("el"):
        return CP_ASYNC.sub(r"cp.async.cg.shared.global" + size + r" [\1], [\2], 0x10, \3;", ptx)
    ptx = CP_ASYNC.sub(r"cp.async.cg.shared.global.L2::cache_hint" + size + r" [\1], [\2], 0x10, \3, %rdl2pol;", ptx)
    body = re.search(r"\.entry[^{]*\{\n", ptx).end()  # the policy, made once at the kernel's start
    policy = "\t.reg .b64 %rdl2pol;\n\tcreatepolicy.fractional.L2::evict_last.b64 %rdl2pol, 1.0;\n"
    return ptx[:body] + policy + ptx[body:]


def install(hint: str) -> None:
    """Rewrite the PTX of every kernel compiled from now on in this process."""

    def hook(*args):
        if not args:  # Triton >= 3.7 asks for a cache key
            return f"ptx-hint-{hint}", f"ptx-hint-{hint}"
        stages = args[1]
        make_ptx = stages["ptx"]
        stages["ptx"] = lambda src, metadata: rewrite(make_ptx(src, metadata), hint)

    triton.knobs.runtime.add_stages_inspection_hook = hook


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hint", choices=("none", "256", "128", "el", "el256", "sleep"), default="none")
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--sustain", type=float, default=3.0)
    ap.add_argument("--reference", default="/tmp/ptx_hints_out", help="where the unhinted run keeps its output")
    args = ap.parse_args(argv)
    install(args.hint)
    from prefill_clocks import Sampler, setup, sustained, window
    from prefill_inputs import timed

    run, fl, label = setup(args.heads, args.tokens, 2048)
    run()
    torch.cuda.synchronize()
    out = {n: c.cell_contents for n, c in zip(run.__code__.co_freevars, run.__closure__)}["out"]
    ref = f"{args.reference}_{args.heads}_{args.tokens}.pt"
    if args.hint == "none" and not os.path.exists(ref):
        torch.save(out.cpu(), ref)
    same = torch.equal(torch.load(ref), out.cpu()) if os.path.exists(ref) else None
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    burst_ms = timed(run, flush, 20)
    sampler = Sampler()
    sustained(run, 1.5)  # reach the power limit first
    n, secs, start, end = sustained(run, args.sustain)
    w = window(sampler.stop(), start + (end - start) / 4, end)
    tf = fl * n / secs / 1e12
    mhz, watts = w.get("sm_mhz", float("nan")), w.get("watts", float("nan"))
    print(
        f"hint={args.hint:6s} {label} {args.heads} x {args.tokens}: output equal to unhinted: {same} | burst "
        f"{fl / burst_ms / 1e9:.0f} TF/s | sustained {tf:.1f} TF/s @ {mhz:.0f} MHz {watts:.0f} W "
        f"{watts / tf:.3f} J/TFLOP"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
