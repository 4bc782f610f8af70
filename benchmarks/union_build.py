"""Union build of grouped sparse-MLA prefill on one GPU: the routed builder beside the sorting one.

    python benchmarks/union_build.py --json union_build.json
    python benchmarks/union_build.py --heads 8 --tokens 4096 --pool-rows 1048576   # a large cache
    python benchmarks/union_build.py --heads --tokens 4096 --pool-rows 40000000   # per-query cases alone
    python benchmarks/union_build.py --device cpu --heads 8 --tokens 64 --topk 32 --kv-rows 256

A grouped tile holds ``G = 64 / heads`` consecutive queries (8 / 4 / 2 at 8 / 16 / 32 heads);
each group's rows are merged into one sorted union with a membership bit per query before the
kernel runs, and a per-query step (``G = 1``) de-duplicates its rows (the same build, or on a
large cache the hash below). Per case
(DSA-like top-k through a shuffled 64-token block table; a cache of 65,536 rows up to T = 4K,
131,072 above, or the request's blocks drawn from ``--pool-rows``), on unsorted rows as an
indexer's ``torch.topk`` leaves them:

* **routed**: ``build_union(method="auto")``, the builder a step runs (on sm_90 the bitmap in
  shared memory while the cache is small enough, :func:`~shardattn.plan.union_routing.route_union_method`);
* **baseline**: the sorting build of the same run (each query's rows sorted, then merged into the
  group in one launch, ``method="fused"``; at ``G = 1`` the row sort and compaction, ``"sort"``);
* at ``G > 1`` the grouped kernel alone on that union, and the routed build's share of the step
  ``build / (build + kernel)``;
* at ``G = 1`` also the de-duplication a per-query step runs (``union_for_call``): the routed
  build, or on a cache too large for the bitmap's count each query's repeats dropped by hash and
  the rest packed (unsorted: the per-query kernels need no order), against the same baseline.

Every timed build is checked exact (``lens`` and every entry below; the step's unsorted lists as
sets) against the torch reference first, into buffers filled with a sentinel, and the grouped
kernel's output on 64 sampled tokens against the fp32 reference. CUDA-event medians of ``--reps``
runs, L2 flushed before each. ``--device cpu`` runs the same code on the CPU (the torch reference
builder; a dry run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefill_inputs import (
    D_R,
    D_V,
    TOLERANCE,
    attention_buffers,
    default_kv_rows,
    l2_flush,
    make_case,
    random_qkv,
    rel_err,
    timed,
    union_buffers,
)
from records import add_device_argument, add_json_argument, environment, lacks_gpu, print_table, record, write_json

from shardattn.ops.prepared_union import PreparedUnion, union_for_call
from shardattn.ops.sparse_mla import sparse_mla_reference
from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill
from shardattn.ops.union import MAX_PACKED_ROWS, build_union, build_union_reference
from shardattn.plan.routing import tile_group_size

BENCHMARK = "union-build"
#: The sorting build per ``G`` (the baseline): one launch per group after the row sort, or at
#: ``G = 1`` the row sort and its compaction.
SORTING = {1: "sort", 2: "fused", 4: "fused", 8: "fused"}


def exact(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Same ``lens`` and the same entries below each group's length (past it: unspecified)."""
    (u, n), (ru, rn) = got, want
    prefix = torch.arange(u.shape[1], device=u.device)[None, :] < rn[:, None]
    return bool(torch.equal(n, rn) and torch.equal(u[prefix], ru[prefix]))


def same_rows(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """:func:`exact` for per-query lists in any order: each token's first ``lens`` entries, sorted."""
    (u, n), (ru, rn) = got, want
    past = torch.arange(u.shape[1], device=u.device)[None, :] >= n[:, None]
    ordered = u.masked_fill(past, torch.iinfo(torch.int32).max).sort(dim=1).values
    return exact((ordered, n), (ru, rn))


def check_kernel(run, out: torch.Tensor, q, kv, rows, scale: float, what: str) -> None:
    """Run ``run`` once (it writes ``out [T, H, D_V]``) and compare 64 sampled tokens with the
    fp32 reference (rel. error below :data:`TOLERANCE`) before the kernel is timed."""
    out.fill_(float("nan"))
    run()
    sample = torch.randperm(q.shape[0], generator=torch.Generator().manual_seed(1))[:64].to(q.device)
    ref, _ = sparse_mla_reference(q[sample].float(), kv, rows[sample], scale=scale, v_dim=D_V)
    err = rel_err(out[sample], ref)
    if not err < TOLERANCE:
        raise RuntimeError(f"{what}: rel. error {err:.3g} against the fp32 reference")


def time_case(heads: int | None, tokens: int, topk: int, kv_rows: int, pool_rows: int | None, device, flush, reps,
              env) -> list[dict]:  # fmt: skip
    """The records of one case: ``heads`` None is the per-query de-duplication (``G = 1``)."""
    g = 1 if heads is None else tile_group_size(heads)
    cache = pool_rows or kv_rows
    _, _, _, _, rows, _ = make_case(tokens, kv_rows, topk, "dsa", 0, pool_rows, device=device)
    want = build_union_reference(rows, group_size=g, num_kv_rows=cache)
    u, ln = union_buffers(tokens, topk, g, device)
    builds = {
        "routed": lambda: build_union(rows, group_size=g, num_kv_rows=cache, out=(u, ln)),
        "sorting": lambda: build_union(rows, group_size=g, num_kv_rows=cache, out=(u, ln), method=SORTING[g]),
    }
    ms = {}
    for name, fn in builds.items():
        u.fill_(-7)  # so a build that writes nothing cannot pass on the one before it
        ln.fill_(-7)
        fn()
        if not exact((u, ln), want):
            raise RuntimeError(f"the {name} build at G = {g}, T = {tokens} is not the reference union")
        ms[name] = timed(fn, flush, reps)
    config = {"G": g, "tokens": tokens, "topk": topk, "kv_rows": cache}
    out = [record(BENCHMARK, config, "build ms", ms["routed"], "ms", "lower", ("sorting build, same run",
                                                                               ms["sorting"]), env)]  # fmt: skip
    line = f"G = {g}, T = {tokens}: routed {ms['routed']:.4f} ms, sorting {ms['sorting']:.4f} ms"
    if g == 1:  # what a per-query step runs: the routed build, or the hash and the pack (any order)
        rows_of = torch.empty(1, 1, dtype=torch.bfloat16, device=device).expand(cache, 1)  # only R is read

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            return union_for_call(None, rows, rows_of, group_size=1, dtype=torch.bfloat16, out=(u, ln))[1:]

        u.fill_(-7)
        ln.fill_(-7)
        if not same_rows(step(), want):
            raise RuntimeError(f"the per-query step's de-duplication at T = {tokens} does not hold the reference rows")
        ms["step"] = timed(step, flush, reps)
        out.append(record(BENCHMARK, config, "per-query step ms", ms["step"], "ms", "lower",
                          ("sorting build, same run", ms["sorting"]), env))  # fmt: skip
        line += f", per-query step {ms['step']:.4f} ms"
    if g > 1:
        q, kv = random_qkv(tokens, heads, cache, 0, device)
        o, s = attention_buffers(q)
        prepared = PreparedUnion(*build_union(rows, group_size=g, num_kv_rows=cache), g, tokens)
        scale = (D_V + D_R) ** -0.5

        def run_kernel():
            sparse_mla_grouped_prefill(q, kv, rows, scale=scale, v_dim=D_V, group_size=g, out=o, lse_out=s,
                                       prepared_union=prepared)  # fmt: skip

        check_kernel(run_kernel, o, q, kv, rows, scale, f"the grouped kernel at G = {g}, T = {tokens}")
        kernel = timed(run_kernel, flush, reps)
        share = 100 * ms["routed"] / (ms["routed"] + kernel)
        out.append(record(BENCHMARK, config, "share of the grouped step", share, "%", "lower", None, env))
        line += f", grouped kernel {kernel:.4f} ms: share {share:.1f} %"
    print(line, flush=True)
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, nargs="*", default=[8, 16, 32], help="grouped cases (G = 64 / heads; "
                    "none: the per-query de-duplication alone)")  # fmt: skip
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--kv-rows", type=int, default=None, help="rows of the request (default: 65,536 up to 4K "
                    "tokens, 131,072 above)")  # fmt: skip
    ap.add_argument("--pool-rows", type=int, default=None, help="KV cache rows the request's blocks come from")
    ap.add_argument("--no-dedup", action="store_true", help="skip the per-query (G = 1) de-duplication cases")
    ap.add_argument("--reps", type=int, default=20)
    add_device_argument(ap)
    add_json_argument(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if lacks_gpu(args.device):
        return 2
    bad = [h for h in args.heads if tile_group_size(h) == 1]
    if bad:
        print(f"--heads: {bad} fill a 64-row tile alone (G = 1); grouped cases need fewer than 64", file=sys.stderr)
        return 2
    if args.heads and args.pool_rows is not None and args.pool_rows > MAX_PACKED_ROWS:
        print(f"--pool-rows {args.pool_rows:,}: grouped unions pack rows in 24 bits (at most {MAX_PACKED_ROWS:,}); "
              "pass --heads with no value for the per-query cases alone", file=sys.stderr)  # fmt: skip
        return 2
    if not args.heads and args.no_dedup:
        print("--heads with no value and --no-dedup leave nothing to time", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    env = environment(device=device)
    print(f"{env['gpu']}, torch {env['versions']['torch']}, Triton {env['versions']['triton']}", flush=True)
    flush = l2_flush(device)
    records = []
    for tokens in args.tokens:
        kv_rows = args.kv_rows or default_kv_rows(tokens)
        for heads in [*args.heads, *([] if args.no_dedup else [None])]:
            records += time_case(heads, tokens, args.topk, kv_rows, args.pool_rows, device, flush, args.reps, env)
    print_table(records, "union build")
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
