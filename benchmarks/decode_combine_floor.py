"""What does combining a small decode step's splits cost, before any attention math (one GPU)?

Every split-KV decode step gathers its rows, writes one partial per split, and combines the
partials once all are written. This probe times that skeleton with the attention math left out,
on the shapes of ``decode.py``'s small sparse-MLA decode (top-k 2,048 unique random rows of
262,144, bf16, 576 columns, 16 heads, fp32 partials of 16 x 512; 1 / 2 / 4 / 8 tokens):

* **two launches**: one CTA per (token, split, group of heads) gathers its rows into shared
  memory (:func:`decode_gather_floor.gather_split_rows`), then (``+ partial``) stores its heads'
  fp32 partial (32 KB at 16 heads a program, 16 KB at 8) and LSEs, then (``+ merge``) the
  library's column merge combines them as a programmatic dependent launch (how the small-batch
  kernel's step runs; four warps on 128 columns, and one warp on 64 as the small kernel's step
  merges), on 32 splits of 64 rows and 16 of 128, with 16 and with 8 heads a program;
* **one launch, a 16-block cluster per token** (16 splits of 128 rows, the most rows a cluster
  of 16 covers at top-k 2,048): the same gather, the partial store, a cluster barrier
  (``barrier.cluster`` release / acquire), and each block merging 32 of the 512 columns over the
  16 partials through the L2. Compiled with ``num_ctas=16`` and layouts replicated over the
  cluster, so the per-block stores are inline PTX (Triton stores a replicated tensor from the
  first block only).

Both merges are checked against :func:`~shardattn.ops.lse_merge.lse_merge_reference`. Graph
replays with the L2 flushed between replays (``graph_timing.replay_us``), the least of 3 rounds.

    cd benchmarks && python decode_combine_floor.py
"""

from __future__ import annotations

import argparse

import torch
from decode_gather_floor import gather_split_rows  # beside this script
from graph_timing import gpu_banner, replay_us, trivial_graph_us

from shardattn.kernels.gluon.compat import gl, gluon, grid_dependency
from shardattn.kernels.triton.lse_merge import launch_lse_merge_columns
from shardattn.ops.lse_merge import lse_merge_reference
from shardattn.plan.crossovers import SMALL_MERGE_COLUMNS, SMALL_MERGE_WARPS

ROWS, TOPK, HEADS, DV = 1 << 18, 2048, 16, 512
CLUSTER = 16


@gluon.jit
def _partial_value(tail, split, h, c):
    """A partial that depends on the gathered rows (so the copies are observed) and on its cell."""
    return tail * 1e-3 + (h[:, None] * 512 + c[None, :]).to(gl.float32) * 1e-4 + split.to(gl.float32)


@gluon.jit
def _gather_partial(
    KV, Rows, Part, Lse, Out, stride_kv, K, T, BN: gl.constexpr, PARTIAL: gl.constexpr, HG: gl.constexpr
):
    """One CTA per (token, split, group of ``HG`` of the 16 heads): gather; with ``PARTIAL`` store
    its heads' fp32 partial ``[HG, 512]`` and LSEs to ``Part [S, T, 16, 512]`` / ``Lse [S, T, 16]``
    (else one float to ``Out``); a programmatic dependent launch that releases the merge after its
    stores."""
    grid_dependency("griddepcontrol.wait")
    tok = gl.program_id(0)
    split = gl.program_id(1)
    h0 = gl.program_id(2) * HG
    lv: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    lr: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    tail = gather_split_rows(KV, Rows, tok, split, stride_kv, K, BN, lv, lr, plain)
    if PARTIAL:
        pl: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
        h = h0 + gl.arange(0, HG, layout=gl.SliceLayout(1, pl))
        c = gl.arange(0, 512, layout=gl.SliceLayout(0, pl))
        row = (split * T + tok).to(gl.int64)
        gl.store(Part + row * 8192 + h[:, None] * 512 + c[None, :], _partial_value(tail, split, h, c))
        gl.store(Lse + row * 16 + h, gl.zeros([HG], gl.float32, gl.SliceLayout(1, pl)) + tail * 1e-3 + split * 0.1)
    else:
        gl.store(Out + (tok * gl.num_programs(1) + split) * gl.num_programs(2) + gl.program_id(2), tail)
    grid_dependency("griddepcontrol.launch_dependents")


@gluon.jit
def _store_f32(ptrs, vals, PACK: gl.constexpr):
    """Per-block ``st.global`` of fp32 ``vals`` (1 or 4 consecutive a thread): inline PTX, since a
    store of a tensor replicated over the cluster is issued by its first block only."""
    if PACK == 4:
        gl.inline_asm_elementwise(
            "st.global.v4.f32 [$4], {$8, $9, $10, $11}; mov.u32 $0, 0; mov.u32 $1, 0; mov.u32 $2, 0; mov.u32 $3, 0;",
            "=r,=r,=r,=r,l,l,l,l,r,r,r,r", [ptrs.to(gl.int64), vals], dtype=gl.int32, is_pure=False, pack=4,
        )  # fmt: skip
    else:
        gl.inline_asm_elementwise(
            "st.global.f32 [$1], $2; mov.u32 $0, 0;", "=r,l,r", [ptrs.to(gl.int64), vals], dtype=gl.int32,
            is_pure=False, pack=1,
        )  # fmt: skip


@gluon.jit
def _cluster_combine(KV, Rows, Part, Lse, Out, LseOut, stride_kv, K, T, BN: gl.constexpr, STAGE: gl.constexpr):
    """``num_ctas=16``: a cluster per token, its block rank the split. ``STAGE`` 0: gather only
    (one float per block to ``Out``); 1: + the partial store; 2: + the cluster barrier; 3: + each
    block merging columns ``[32 r, 32 r + 32)`` of the 16 partials into ``Out [T, 16, 512]`` fp32 and
    ``LseOut [T, 16]``."""
    tok = gl.program_id(0)  # the cluster
    split = gl.inline_asm_elementwise("mov.u32 $0, %cluster_ctarank;", "=r", [], dtype=gl.int32, is_pure=True, pack=1)
    lv: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0], cga_layout=[[0, 0], [0, 0], [0, 0], [0, 0]])
    lr: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0], cga_layout=[[0, 0], [0, 0], [0, 0], [0, 0]])
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0], cga_layout=[[0, 0], [0, 0], [0, 0], [0, 0]])
    tail = gather_split_rows(KV, Rows, tok, split, stride_kv, K, BN, lv, lr, plain)
    pl: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0], cga_layout=[[0, 0], [0, 0], [0, 0], [0, 0]])
    h = gl.arange(0, 16, layout=gl.SliceLayout(1, pl))
    if STAGE == 0:
        one = gl.arange(0, 1, layout=gl.SliceLayout(1, pl))
        _store_f32(Out + tok * 16 + split + one, gl.zeros([1], gl.float32, gl.SliceLayout(1, pl)) + tail, 1)
    else:
        c = gl.arange(0, 512, layout=gl.SliceLayout(0, pl))
        row = (split * T + tok).to(gl.int64)
        _store_f32(Part + row * 8192 + h[:, None] * 512 + c[None, :], _partial_value(tail, split, h, c), 4)
        lse_val = gl.zeros([16], gl.float32, gl.SliceLayout(1, pl)) + tail * 1e-3 + split.to(gl.float32) * 0.1
        _store_f32(Lse + row * 16 + h, lse_val, 1)
        if STAGE >= 2:
            gl.inline_asm_elementwise(
                "barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned; mov.u32 $0, 0;",
                "=r", [], dtype=gl.int32, is_pure=False, pack=1,
            )  # fmt: skip
        if STAGE == 3:
            # [source split, head, column] over the 16 partials; .cg loads: another block wrote them
            l3: gl.constexpr = gl.BlockedLayout(
                [1, 1, 4], [2, 2, 8], [4, 1, 1], [2, 1, 0], cga_layout=[[0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
            )
            l_sh: gl.constexpr = gl.SliceLayout(2, l3)
            l_sc: gl.constexpr = gl.SliceLayout(1, l3)
            l_hc: gl.constexpr = gl.SliceLayout(0, l3)
            src = gl.arange(0, 16, layout=gl.SliceLayout(1, l_sh))
            hd = gl.arange(0, 16, layout=gl.SliceLayout(0, l_sh))
            lse3 = gl.load(Lse + (src[:, None] * T + tok) * 16 + hd[None, :], cache_modifier=".cg")[:, :, None]
            m = gl.max(lse3, axis=0)
            w = gl.exp(lse3 - m[None, :, :])
            total = gl.sum(w, axis=0)
            col = gl.arange(0, 32, layout=gl.SliceLayout(0, l_sc)) + split * 32
            offs = (src[:, None, None] * T + tok).to(gl.int64) * 8192 + hd[None, :, None] * 512 + col[None, None, :]
            merged = gl.sum(gl.load(Part + offs, cache_modifier=".cg") * w, axis=0) / total
            h_o = gl.arange(0, 16, layout=gl.SliceLayout(1, l_hc))
            c_o = gl.arange(0, 32, layout=gl.SliceLayout(0, l_hc)) + split * 32
            _store_f32(Out + (tok * 16 + h_o[:, None]).to(gl.int64) * 512 + c_o[None, :], merged, 4)
            gl.store(LseOut + tok * 16 + h_o[:, None], m + gl.log(total))  # the same in every block: the first stores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(gpu_banner(), flush=True)
    kv = torch.randn(ROWS, 576, device="cuda").bfloat16()
    print(f"graph of one 1-element kernel: {trivial_graph_us(rounds=args.rounds):.2f} us")
    table: dict[str, dict[int, float]] = {}
    batches = [int(b) for b in args.batches.split(",")]
    for batch in batches:
        rows = torch.argsort(torch.rand(batch, ROWS, device="cuda"), dim=1)[:, :TOPK].int().contiguous()
        for splits, group in ((32, 16), (16, 16), (32, 8), (16, 8)):
            bn = TOPK // splits
            part = torch.empty(splits, batch, HEADS, DV, device="cuda")
            lse = torch.empty(splits, batch, HEADS, device="cuda")
            out = torch.empty(batch, HEADS, DV, device="cuda", dtype=torch.bfloat16)
            lse_out = torch.empty(batch, HEADS, device="cuda")
            one = torch.empty(batch * splits * (HEADS // group), device="cuda")

            def split_kernel(partial, bn=bn, splits=splits, part=part, lse=lse, one=one, rows=rows, batch=batch,
                             group=group):  # fmt: skip
                _gather_partial[(batch, splits, HEADS // group)](
                    kv, rows, part, lse, one, kv.stride(0), TOPK, batch, BN=bn, PARTIAL=partial, HG=group,
                    num_warps=4, launch_pdl=True,
                )  # fmt: skip

            def step(columns, warps, split_kernel=split_kernel, part=part, lse=lse, out=out, lse_out=lse_out):
                split_kernel(True)
                launch_lse_merge_columns(part, lse, out, lse_out, pdl=True, block_d=columns, num_warps=warps)

            for merge in ((128, 4), (SMALL_MERGE_COLUMNS, SMALL_MERGE_WARPS)):
                out.zero_()
                step(*merge)
                want_out, want_lse = lse_merge_reference(part, lse)
                torch.testing.assert_close(out.float(), want_out, rtol=1e-2, atol=1e-2)
                torch.testing.assert_close(lse_out, want_lse, rtol=1e-4, atol=1e-3)
            shape = f"{splits} x {bn}, {group} heads a program"
            for name, fn in ((f"two launches, {shape}: gather", lambda f=split_kernel: f(False)),
                             (f"two launches, {shape}: gather + partial", lambda f=split_kernel: f(True)),
                             (f"two launches, {shape}: + merge, 128 columns on 4 warps", lambda f=step: f(128, 4)),
                             (f"two launches, {shape}: + merge, {SMALL_MERGE_COLUMNS} columns on "
                              f"{SMALL_MERGE_WARPS} warp (the small kernel's)",
                              lambda f=step: f(SMALL_MERGE_COLUMNS, SMALL_MERGE_WARPS))):  # fmt: skip
                table.setdefault(name, {})[batch] = replay_us(fn, rep=40, rounds=args.rounds)
        part = torch.zeros(CLUSTER, batch, HEADS, DV, device="cuda")
        lse = torch.zeros(CLUSTER, batch, HEADS, device="cuda")
        out = torch.zeros(batch, HEADS, DV, device="cuda")
        lse_out = torch.zeros(batch, HEADS, device="cuda")
        names = ("gather", "gather + partial", "gather + partial + cluster barrier", "... + merge in the cluster")
        for stage, name in enumerate(names):

            def cluster(stage=stage, part=part, lse=lse, out=out, lse_out=lse_out, rows=rows, batch=batch):
                _cluster_combine[(batch,)](kv, rows, part, lse, out, lse_out, kv.stride(0), TOPK, batch,
                                           BN=TOPK // CLUSTER, STAGE=stage, num_warps=4, num_ctas=CLUSTER)  # fmt: skip

            cluster()
            if stage == 3:
                want_out, want_lse = lse_merge_reference(part, lse)
                torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-4)
                torch.testing.assert_close(lse_out, want_lse, rtol=1e-5, atol=1e-4)
            key = f"one launch, 16-block cluster, 16 x 128: {name}"
            table.setdefault(key, {})[batch] = replay_us(cluster, rep=40, rounds=args.rounds)
        print(f"batch {batch} done", flush=True)
    print("| variant (us) | " + " | ".join(f"{b} tokens" for b in batches) + " |")
    print("|---|" + "---|" * len(batches))
    for name, row in table.items():
        print(f"| {name} | " + " | ".join(f"{row[b]:.2f}" for b in batches) + " |")


if __name__ == "__main__":
    main()
