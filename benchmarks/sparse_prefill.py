"""Sparse-MLA prefill on one GPU: the routed step and kernel beside Triton and FlashMLA, same run.

    python benchmarks/sparse_prefill.py --json sparse_prefill.json
    python benchmarks/sparse_prefill.py --heads 64 128 --peer-lib libpeer.so --sustain 4
    python benchmarks/sparse_prefill.py --heads 64 128 --tokens 4096 --peer-lib libpeer.so --rounds 8
    python benchmarks/sparse_prefill.py --device cpu --heads 4 --tokens 64 --topk 32 --kv-rows 256

Per case (``heads`` per rank, ``tokens`` T, top-k K; one request whose DSA-like top-k positions,
:func:`shardattn.workload.synthetic_topk`, go through a shuffled 64-token block table to global
rows of a cache of 65,536 rows up to T = 4K, 131,072 above, or, with ``--pool-rows``, blocks drawn
from a cache of that many rows; bf16, D 576 / Dv 512):

* **step**: the routed prefill as a serving step calls it,
  :func:`~shardattn.ops.sparse_mla_grouped.sparse_mla_grouped_prefill` with the routing's
  ``G`` (per-query from 64 heads; grouped tiles of ``G = 64 / heads`` queries at 8-32 heads on
  sm_90): the union build (de-duplication at ``G = 1``) and the kernel. Baseline: the best Triton
  step of the same run (the Triton kernel per query and, below 64 heads, on grouped tiles, each
  with its union build).
* **kernel**: the routed kernel alone on a union built beforehand (on a cache past 24-bit packed
  rows, ``--pool-rows`` above 16,777,215, the per-query union: at 8-16 heads the step gathers the
  blocks its rows touch and runs grouped, :mod:`shardattn.ops.kv_compact`; the kernel record does
  not). Peer (``--peer-lib``, a
  library ``benchmarks/peer/build_flashmla_peer.sh`` builds from a FlashMLA checkout): FlashMLA's
  SM90 sparse prefill on the same q, KV and rows (below 64 heads padded to 64 heads, as FlashMLA
  runs them); its output is checked against the routed kernel's first.

Effective TFLOP/s = ``2 * sum(valid top-k) * heads * (576 + 512) / time`` on real heads. Times:
CUDA-event medians of ``--reps`` runs, L2 flushed before each; with ``--rounds R`` (> 1) each
pass times every path of a case in R rounds, the order of its paths reversed every other round,
and a path's time is the median of its R round medians (the configuration then names ``rounds``:
a per-query kernel and FlashMLA's differ by less than one round's spread at the power limit).
Every path's output is checked against the fp32 reference on 64 sampled tokens before it is
timed. ``--sustain S`` then runs the last case's kernel back to back for S seconds (the GPU
reaches its power limit) and times every case again: a second pass of records, ``pass`` "after S
s back to back". ``--device cpu`` runs the same code on the CPU (the torch reference path, no
baseline; for a dry run).

``--kv-dtype fp8_ds_mla``: the cache is the ``fp8_ds_mla`` rows of the case's (656 bytes a row,
:mod:`shardattn.ops.kv_fp8`) and the bf16 paths read the bf16 rows they dequantise to (the same
values); each case adds the routed step and kernel on the FP8 cache, checked bit for bit against
the bf16 ones, and the kernel with every tile dequantising its rows (no staging,
:mod:`shardattn.ops.kv_fp8_stage`), and records only ``sparse-prefill-fp8`` (FP8 effective TFLOP/s,
baseline the bf16 routed path of the same run: a ratio >= 0.9 is the target; the bf16 and peer
times are printed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "peer"))
from prefill_inputs import (
    D_R,
    D_V,
    TOLERANCE,
    attention_buffers,
    default_kv_rows,
    fp8_rows_of,
    l2_flush,
    make_case,
    random_qkv,
    rel_err,
    timed,
    union_buffers,
)
from records import add_device_argument, add_json_argument, environment, lacks_gpu, print_table, record, write_json

from shardattn.kernels.triton.sparse_mla import launch_attention, tile_config
from shardattn.kernels.union_layout import MAX_PACKED_ROWS
from shardattn.ops import kv_fp8_stage
from shardattn.ops.dispatch import prefill_path
from shardattn.ops.prepared_union import prepare_union
from shardattn.ops.sparse_mla import flops, sparse_mla_reference
from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill
from shardattn.ops.union import build_union
from shardattn.plan.routing import tile_group_size

BENCHMARK = "sparse-prefill"


class Case:
    """One (heads, tokens) case: inputs, the routed path and a closure per timed path."""

    def __init__(
        self,
        heads: int,
        tokens: int,
        topk: int,
        kv_rows: int,
        device: torch.device,
        peer=None,
        fp8: bool = False,
        pool_rows: int | None = None,
        caches: dict | None = None,
    ):
        self.heads, self.tokens, self.topk, self.pool_rows = heads, tokens, topk, pool_rows
        _, _, _, _, rows, counts = make_case(tokens, kv_rows, topk, "dsa", 0, pool_rows=pool_rows, device=device)
        kv_rows = pool_rows or kv_rows  # the cache's rows
        q = random_qkv(tokens, heads, 0, 0, device)[0]
        kv, kv8 = shared_cache({} if caches is None else caches, kv_rows, fp8, device)
        self.flops = flops(int(counts.sum()), heads)
        scale = (D_V + D_R) ** -0.5
        path = prefill_path(q, kv, v_dim=D_V)
        self.path = f"{path.backend}, G = {path.group_size}"
        g = path.group_size
        out, lse = attention_buffers(q)
        union = union_buffers(tokens, topk, g, device)
        prepared = prepare_union(rows, group_size=g, num_kv_rows=kv_rows)

        def step():
            sparse_mla_grouped_prefill(q, kv, rows, scale=scale, v_dim=D_V, out=out, lse_out=lse, union=union)

        def kernel():
            sparse_mla_grouped_prefill(
                q, kv, rows, scale=scale, v_dim=D_V, out=out, lse_out=lse, prepared_union=prepared
            )

        self.runs = {"step": step, "kernel": kernel}
        sample = torch.randperm(tokens, generator=torch.Generator().manual_seed(1))[:64].to(device)
        ref_out, _ = sparse_mla_reference(q[sample].float(), kv, rows[sample], scale=scale, v_dim=D_V)
        kernel()  # the kernel on its prepared union: checked as the step is, before anything is timed
        self._check("routed kernel (prepared union)", out[sample], ref_out)
        kernel_out = (out.clone(), lse.clone())
        if g == 1:  # the synthetic top-k lists a position once: the step as a topk_unique caller runs it

            def step_unique():
                sparse_mla_grouped_prefill(q, kv, rows, scale=scale, v_dim=D_V, out=out, lse_out=lse, rows_unique=True)

            step_unique()
            self._check("routed step, rows unique", out[sample], ref_out)
            self.runs["step_unique"] = step_unique
        step()
        self._check("routed step", out[sample], ref_out)
        if kv8 is not None:
            out8, lse8 = attention_buffers(q)

            def step_fp8():
                sparse_mla_grouped_prefill(q, kv8, rows, scale=scale, v_dim=D_V, out=out8, lse_out=lse8, union=union)

            def kernel_fp8():
                sparse_mla_grouped_prefill(
                    q, kv8, rows, scale=scale, v_dim=D_V, out=out8, lse_out=lse8, prepared_union=prepared
                )

            def kernel_fp8_in_kernel():  # no staging: every tile dequantises the rows it reads
                with mock.patch.object(kv_fp8_stage, "stage_fp8_union", lambda *a, **k: None):
                    kernel_fp8()

            for name, run, (want, want_lse) in (  # each bit for bit its checked bf16 twin on the same values
                ("step", step_fp8, (out, lse)),
                ("kernel", kernel_fp8, kernel_out),
                ("kernel (in-kernel dequant)", kernel_fp8_in_kernel, kernel_out),
            ):
                out8.fill_(float("nan"))
                run()
                if not (torch.equal(out8, want) and torch.equal(lse8, want_lse)):
                    raise RuntimeError(
                        f"{heads} heads x {tokens}: the FP8 {name} differs from the bf16 step on its values"
                    )
            self.runs.update(step_fp8=step_fp8, kernel_fp8=kernel_fp8, kernel_fp8_in_kernel=kernel_fp8_in_kernel)
        if path.backend != "reference":  # the Triton steps, at G = 1 and at the tile-filling G
            for tg in sorted({1, tile_group_size(heads)} if kv_rows < MAX_PACKED_ROWS else {1}):  # 24-bit rows
                self.runs[f"triton_g{tg}"] = self._triton(q, kv, rows, tg, kv_rows, scale, sample, ref_out)
        if peer is not None:
            from flashmla_prefill import runner  # beside its .cu in peer/

            run, p_out, _ = runner(peer, q, kv, rows, scale)
            run()
            self._check("FlashMLA", p_out[sample], ref_out)
            self.runs["peer"] = run

    def _triton(self, q, kv, rows, g, kv_rows, scale, sample, ref_out):
        u, ln = union_buffers(q.shape[0], rows.shape[1], g, q.device)
        out, lse = attention_buffers(q)
        cfg = tile_config(q.shape[1], g)

        def run():
            build_union(rows, group_size=g, num_kv_rows=kv_rows, out=(u, ln))
            launch_attention(q, kv, u, ln, scale=scale, v_dim=D_V, config=cfg, out=out, lse=lse)

        run()
        self._check(f"Triton G = {g}", out[sample], ref_out)
        return run

    def _check(self, what: str, got: torch.Tensor, ref: torch.Tensor) -> None:
        err = rel_err(got, ref)
        print(f"check {self.heads} heads x {self.tokens}: {what} rel. error {err:.2e} against fp32", flush=True)
        if not err < TOLERANCE:
            raise RuntimeError(f"{what} at {self.heads} heads x {self.tokens} tokens: rel. error {err:.3g}")

    def time(self, flush, reps: int, rounds: int = 1) -> dict[str, float]:
        """Milliseconds of each path: the median of its ``rounds`` round medians of ``reps`` runs, the
        paths' order reversed every other round."""
        times: dict[str, list[float]] = {name: [] for name in self.runs}
        for r in range(rounds):
            for name in list(self.runs)[:: -1 if r % 2 else 1]:
                times[name].append(timed(self.runs[name], flush, reps))
        return {name: statistics.median(ms) for name, ms in times.items()}


def shared_cache(caches: dict, kv_rows: int, fp8: bool, device: torch.device):
    """``(kv, kv8)``: the bf16 cache of ``kv_rows`` rows (seed 0) and, with ``fp8``, its
    ``fp8_ds_mla`` rows (``kv`` then holds the values they dequantise to; else ``None``), built once
    into ``caches`` and shared by every case of that size (with ``--pool-rows``, every case)."""
    key = (kv_rows, fp8)
    if key not in caches:
        kv = random_qkv(0, 0, kv_rows, 0, device)[1]
        caches[key] = (kv, fp8_rows_of(kv) if fp8 else None)
    return caches[key]


def case_records(case: Case, ms: dict[str, float], pass_name: str, env: dict, rounds: int = 1) -> list[dict]:
    """The step and kernel records of one timed pass of ``case`` (``rounds``: of :meth:`Case.time`)."""
    config = {"heads": case.heads, "tokens": case.tokens, "topk": case.topk, "pass": pass_name}
    if case.pool_rows:
        config = {**config, "cache rows": case.pool_rows}
    if rounds > 1:
        config = {**config, "rounds": rounds}
    tf = {k: case.flops / (v * 1e-3) / 1e12 for k, v in ms.items()}
    triton = [tf[k] for k in tf if k.startswith("triton_")]
    step_base = ("best Triton step, same run", max(triton)) if triton else None
    out = [record(BENCHMARK, config, "step TFLOP/s", tf["step"], "TFLOP/s", "higher", step_base, env)]
    kernel_base = None
    if "peer" in tf:
        kernel_base = ("FlashMLA" + (" (padded to 64 heads)" if case.heads < 64 else "") + ", same run", tf["peer"])
    out.append(record(BENCHMARK, config, "kernel TFLOP/s", tf["kernel"], "TFLOP/s", "higher", kernel_base, env))
    if "step_unique" in tf:  # FlashMLA's contract (no row twice in a list): the step is the kernel on the rows
        out.append(record(BENCHMARK, config, "step TFLOP/s, rows unique", tf["step_unique"], "TFLOP/s", "higher",
                          kernel_base or step_base, env))  # fmt: skip
    if "step_fp8" in tf:  # the bf16 numbers are the FP8 records' baselines, not records of their own
        out = []
        fp8_runs = (("step_fp8", "step", "step"), ("kernel_fp8", "kernel", "kernel"),
                    ("kernel_fp8_in_kernel", "kernel", "kernel, no staging"))  # fmt: skip
        for run, bf16, metric in fp8_runs:
            base = (f"routed bf16 {bf16} on the dequantised rows, same run", tf[bf16])
            out.append(record(f"{BENCHMARK}-fp8", config, f"{metric} TFLOP/s", tf[run], "TFLOP/s", "higher", base, env))
    print(f"{case.heads} heads x {case.tokens} ({case.path}), {pass_name}: "
          + ", ".join(f"{k} {v:.3f} ms ({tf[k]:.0f} TF/s)" for k, v in ms.items()), flush=True)  # fmt: skip
    return out


def sustained(run, seconds: float) -> None:
    """``run`` back to back (no flush, no pause) for ``seconds``."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            run()
        torch.cuda.synchronize()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--kv-rows", type=int, default=None, help="KV cache rows (default: 65,536 up to 4K tokens, "
                    "131,072 above)")  # fmt: skip
    ap.add_argument("--pool-rows", type=int, default=None, help="rows of the cache the request's blocks are drawn "
                    "from, shuffled (default: the request's own KV rows)")  # fmt: skip
    ap.add_argument("--reps", type=int, default=20, help="timed runs per path (median)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of every path, order alternating (median)")
    ap.add_argument("--peer-lib", default=None, help="FlashMLA's sparse prefill, built by benchmarks/peer/")
    ap.add_argument("--sustain", type=float, default=0.0, help="seconds back to back, then a second pass")
    add_device_argument(ap)
    ap.add_argument(
        "--kv-dtype",
        choices=("bf16", "fp8_ds_mla"),
        default="bf16",
        help="fp8_ds_mla: also time the routed paths on the FP8 rows of the cache (module docstring)",
    )
    add_json_argument(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if lacks_gpu(args.device):
        return 2
    if args.peer_lib and args.device != "cuda":
        print("--peer-lib needs --device cuda", file=sys.stderr)
        return 2
    if args.rounds < 1 or args.reps < 1:
        print("--rounds and --reps must be at least 1", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    peer = None
    if args.peer_lib:
        from flashmla_prefill import load

        peer = load(args.peer_lib)
    env = environment(device=args.device)
    print(f"{env['gpu']}, torch {env['versions']['torch']}, Triton {env['versions']['triton']}", flush=True)
    fp8 = args.kv_dtype == "fp8_ds_mla"
    caches: dict = {}
    cases = [Case(h, t, args.topk, args.kv_rows or default_kv_rows(t), device, peer, fp8, args.pool_rows, caches)
             for t in args.tokens for h in args.heads]  # fmt: skip
    flush = l2_flush(device)
    records = []
    for case in cases:
        records += case_records(case, case.time(flush, args.reps, args.rounds), "first", env, args.rounds)
    if args.sustain > 0 and device.type == "cuda":
        sustained(cases[-1].runs["kernel"], args.sustain)
        name = f"after {args.sustain:g} s back to back"
        for case in cases:
            records += case_records(case, case.time(flush, args.reps, args.rounds), name, env, args.rounds)
    print_table(records, "sparse-MLA prefill")
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
