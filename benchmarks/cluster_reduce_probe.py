"""Does the installed Triton lower a reduction across a thread-block cluster (sm_90, no GPU needed)?

The probe: a Gluon kernel launched as clusters of 8 blocks holds an ``[8, 512]`` fp32 tensor
split over the cluster (block ``i`` holds row ``i``: ``BlockedLayout(..., cga_layout=...)``) and
sums it over that axis, once directly (``direct``) and once after an explicit move to a layout
split over the columns (``convert``). A one-launch small-batch decode would combine its splits'
partials this way, through distributed shared memory. Prints, per form, whether it compiled and
how many cluster instructions its PTX holds (benchmarks/RESULTS.md, twelfth session; run it with either Triton)::

    python benchmarks/cluster_reduce_probe.py
"""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

BLOCKS, COLS = 8, 512
ROWS_SPLIT = gl.BlockedLayout([1, 4], [1, 32], [1, 4], [1, 0], [[1, 0], [2, 0], [4, 0]])
COLS_SPLIT = gl.BlockedLayout([1, 1], [8, 4], [1, 4], [1, 0], [[0, 1], [0, 2], [0, 4]])
REPLICATED = gl.BlockedLayout([4], [32], [4], [0], [[0], [0], [0]])


@gluon.jit
def _probe(X, Y, N: gl.constexpr, C: gl.constexpr, CONVERT: gl.constexpr,
           LA: gl.constexpr, LB: gl.constexpr, L1: gl.constexpr):  # fmt: skip
    rows = gl.arange(0, C, layout=gl.SliceLayout(1, LA))
    cols = gl.arange(0, N, layout=gl.SliceLayout(0, LA))
    x = gl.load(X + rows[:, None] * N + cols[None, :])
    if CONVERT:
        total = gl.sum(gl.convert_layout(x, LB), axis=0)
        gl.store(Y + gl.arange(0, N, layout=gl.SliceLayout(0, LB)), total)
    else:
        total = gl.convert_layout(gl.sum(x, axis=0), L1)
        gl.store(Y + gl.arange(0, N, layout=L1), total)


def main() -> None:
    print(f"Triton {triton.__version__}")
    for convert in (False, True):
        consts = {"N": COLS, "C": BLOCKS, "CONVERT": convert, "LA": ROWS_SPLIT, "LB": COLS_SPLIT, "L1": REPLICATED}
        signature = {"X": "*fp32", "Y": "*fp32", **dict.fromkeys(consts, "constexpr")}
        name = "convert" if convert else "direct"
        try:
            ptx = triton.compile(
                GluonASTSource(_probe, signature, constexprs=consts),
                target=GPUTarget("cuda", 90, 32),
                options={"num_warps": 4, "num_ctas": BLOCKS},
            ).asm["ptx"]
        except Exception as exc:  # the probe reports any compiler failure
            print(f"{name}: does not compile ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
            continue
        counts = {w: ptx.count(w) for w in ("mapa", "st.shared::cluster", "ld.shared::cluster", "barrier.cluster")}
        print(f"{name}: compiles; " + ", ".join(f"{w} x{n}" for w, n in counts.items()))


if __name__ == "__main__":
    main()
