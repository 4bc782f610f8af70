"""Builds ``docs/PERFORMANCE.md`` from the benchmark records under ``docs/performance/``.

    python benchmarks/performance_page.py                    # rewrite the page from the records
    python benchmarks/performance_page.py --add run.json     # merge a run's records in, then rewrite
    python benchmarks/performance_page.py --check            # exit 1 when the page is not what the records give

``docs/performance/<benchmark>.json`` holds the records (``benchmarks/records.py``) of one table:
one operation, one record per (configuration, metric, GPU). ``--add FILE ...`` files each record of
a benchmark's ``--json`` output under its ``benchmark`` key, replacing the record that measured the
same configuration and metric on the same GPU (new ones go at the end of their table). The page has one section
per table, in :data:`SECTIONS` order, with the plots named there (files beside the records).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import config_text, fmt, key, portable_command, read_json, validate

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "performance"
PAGE = ROOT / "docs" / "PERFORMANCE.md"

#: ``benchmark`` key -> (title, what the table measures, plots beside it). The page's order.
SECTIONS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "sparse-prefill": (
        "Sparse-MLA prefill, one GPU",
        "The routed sparse-MLA prefill (bf16, D 576 / Dv 512, one request whose DSA-like top-k rows "
        "reach a cache of 65,536 rows at T = 4K and 131,072 at 16K), in effective TFLOP/s on real "
        "heads. *kernel*: the routed kernel on rows de-duplicated beforehand, beside FlashMLA's SM90 "
        "sparse prefill on the same inputs (`benchmarks/peer/`; below 64 heads FlashMLA runs padded to "
        "64). *step*: the union build (de-duplication) and the kernel, as a serving step runs them, "
        "beside the best Triton step. *step, rows unique*: the per-query step of a caller that promises "
        "no row twice in a list (`topk_unique` / `rows_unique`, FlashMLA's contract: each query's valid "
        "rows packed, no union build), beside FlashMLA. *pass first*: the first timing of the run; "
        "*after 4 s back to back*: the same cases again once the GPU sits at its power limit; *rounds "
        "R*: each path the median of R round medians, the paths' order alternating.",
        (),
    ),
    "sparse-prefill-fp8": (
        "Sparse-MLA prefill on FP8 KV rows",
        "The routed sparse-MLA prefill step and kernel (as in the section above) on an fp8_ds_mla "
        "cache, against the same routed step and kernel on the bf16 rows those values dequantise to, "
        "same run, in effective TFLOP/s; the outputs are equal bit for bit before either is timed. "
        "The FP8 step and kernel stage the blocks of rows the union reads, dequantised once "
        "(shardattn.ops.kv_fp8_stage: a 65,536-row cache is mirrored without a host synchronisation; "
        "'cache rows 4194304', the request's blocks scattered over a cache of 4M rows, is packed after "
        "one, the step's union built over the rows moved into the staged blocks, the kernel's prepared "
        "union moved at the call; on 'cache rows 40000000' the steps at 8-16 heads first gather the "
        "touched blocks, bf16 and FP8 alike); 'kernel, no staging' dequantises in the kernel, every "
        "tile the rows it reads. The target is a ratio of at least 0.9.",
        (),
    ),
    "gqa-prefill": (
        "GQA prefill, one GPU",
        "GQA prefill (64 q / 8 kv heads, head dim 64, bf16, sinks; new tokens causal, optionally a "
        "sliding window or a cached prefix read through a paged cache): the library's op, the "
        "head-TP step and `Runtime.prefill` (planned once, as an engine's layers reuse a plan) at one "
        "rank's heads of a TP group, against FA4's `flash_attn_varlen_func` called directly on the "
        "same tensors, same run; ratio > 1: ours faster. Each row also records its host time per call: "
        "where that reaches the GPU time (the op and step at TP 8 on the cases under 0.5 ms, the op at "
        "TP 8 on the cached-prefix case, FA4 direct in the window case at TP 8) the row is host-bound. "
        "The Runtime's target: at most 1.05x FA4 direct.",
        (),
    ),
    "union-build": (
        "Union build of grouped prefill",
        "Each group's sorted union of top-k rows with a membership bit per query (`G` = 64 / heads "
        "queries a tile; `G = 1`: the per-query de-duplication), on unsorted top-k rows. Ours: the "
        "routed builder (on sm_90 a bitmap in shared memory); baseline: the sorting build (each "
        "query's rows sorted, then merged), same run. The share is the build's part of the grouped "
        "step (build + kernel). *per-query step*: what a per-query (`G = 1`) prefill call runs "
        "instead (the routed build, or on a cache past the bitmap's count each query's repeats dropped "
        "by hash and the rest packed, unsorted; D108) against the same baseline.",
        ("union-build-2026-12-01.png",),
    ),
    "sparse-decode": (
        "Sparse-MLA decode, large batches",
        "One decode token per request, top-k 2,048 unique random rows of 262,144 (bf16, D 576 / Dv "
        "512), microseconds per step from graph replays with the L2 flushed. Ours: the routed path "
        "(the Gluon kernel on sm_90); baseline: the Triton split-KV kernel and its merge, same run.",
        (),
    ),
    "small-batch-decode": (
        "Sparse-MLA decode, small batches",
        "As above at 1-16 tokens, in microseconds per step (graph replay, L2 flushed). Ours: the "
        "routed path (on sm_90 the small-batch Gluon kernel up to 16 heads while its 128-entry splits "
        "fit one wave of the SMs, 1-8 tokens at top-k 2,048 on an H200, the streaming kernel beyond "
        "(D72); rows measured before D72 ran the small-batch kernel up to 16 tokens); baseline: "
        "the Triton split-KV kernel's routed configuration, same run. The plot times each split tile "
        "the small-batch kernel can take (routed points ringed).",
        ("small-batch-decode-2026-12-01.png",),
    ),
    "fp8-decode": (
        "Sparse-MLA decode on FP8 KV rows",
        "The routed sparse-MLA decode on an fp8_ds_mla cache (656-byte rows, dequantised to bf16 in "
        "the kernel) against the same routed decode on the bf16 rows those values dequantise to "
        "(1,152-byte rows), same inputs and run; the two outputs are equal bit for bit before either "
        "is timed. One token per request, top-k 2,048 unique random rows of 262,144, microseconds per "
        "step from graph replays with the L2 flushed; ratio > 1: FP8 faster.",
        (),
    ),
    "fp8-decode-peer": (
        "Sparse-MLA FP8 decode beside FlashMLA's",
        "The routed sparse-MLA decode on fp8_ds_mla rows (written by `shardattn.ops.kv_fp8.write_kv`) "
        "against FlashMLA's SM90 FP8 sparse decode on the same rows: microseconds per step, graph "
        "replays with the L2 flushed, top-k 2,048 of a 65,536-row paged cache, and (`--kv-rows 40000000`) "
        "of a 40M-row one (26 GB, each token's rows drawn over all of it). 'step us' is the call "
        "as made by default (the rows de-duplicated first: a row listed twice by a token is one key); "
        "'rows_unique=True' skips that, the contract FlashMLA's kernel has. The plot draws FlashMLA's "
        "time over ours, the latest of each shape (`python benchmarks/plot_records.py fp8-peer --png ...`).",
        ("fp8-decode-peer-2026-12-05.png",),
    ),
    "fp8-decode-accuracy": (
        "FP8 decode error",
        "The relative error (||out - ref|| / ||ref||, Frobenius) of decode on fp8_ds_mla rows against fp32 "
        "attention on the bf16 rows they were quantised from (DSA-like rows: per-channel magnitudes "
        "spread over two decades), shardattn's routed decode beside FlashMLA's SM90 FP8 decode on the "
        "same inputs. The quantisation is the only approximation either makes.",
        (),
    ),
    "decode-read-floor": (
        "Sparse-MLA decode against its read floor",
        "The routed sparse-MLA decode (one token per request, bf16 or fp8_ds_mla rows) against a kernel "
        "that only reads the same picked rows once (`benchmarks/read_floor.py`, its fastest "
        "configuration), same rows, cache and run; graph replays with the L2 flushed; each token's "
        "top-k distinct random rows over the whole cache (small, or tens of GB). Ratio = floor / "
        "decode; the target is a decode within 1.15x of the floor (ratio >= 0.87). *best swept* rows "
        "(`--sweep`): the fastest launch configuration found for that shape, named in the configuration. "
        "*no rows read* rows (`--no-reads`): the same step with every entry -1, so no row is read, "
        "against the step that reads them (ratio = with reads / without); where it is close to 1 the "
        "step is bound by its own instructions, not by HBM. *against Triton split-KV* rows (`--triton`): "
        "the routed step against the Triton split-KV kernel on the same call (ratio = Triton / routed). "
        "The plot draws the step ratios of the H200 on the 262,144-row cache, the latest of each shape "
        "(`python benchmarks/plot_records.py read-floor --png ...`).",
        ("decode-read-floor-2026-12-05.png",),
    ),
    "decode-cache-size": (
        "Sparse-MLA decode on a cache of real size",
        "The routed sparse-MLA decode (one token per request, top-k 2,048 distinct random rows over the "
        "whole cache, so every row lies on its own page) on a cache of tens of GB against the same "
        "decode on a 262,144-row cache, same run; bf16 and fp8_ds_mla rows (the same values); graph "
        "replays with the L2 flushed. Ratio = small-cache time / large-cache time; the target is a "
        "large-cache decode within 1.15x of the small-cache one (ratio >= 0.87). The H100 run of "
        "2026-12-06 misses it on bf16 rows at 64 heads x batch 256 (0.83x, rows sorted 0.84x; the "
        "other bf16 rows 0.89-0.95x, FP8 rows 0.94-1.02x). *rows sorted*: the large-cache decode on "
        "each token's rows sorted (the sort not timed).",
        (),
    ),
    "decode-dedup": (
        "Sparse-MLA decode's de-duplication",
        "A decode call without `rows_unique` reads each token's unique rows once. `dedup us`: the hash "
        "de-duplication (`shardattn.ops.unique_rows.unique_rows`: repeats dropped in place, a cost that "
        "follows the top-k alone) against the sorted union (`build_union`, `G = 1`: the shared-memory "
        "bitmap while the cache is small, the row sort beyond), same run. `step us, default`: the routed "
        "call (`route_row_dedup`: the hash up to 8 tokens and where the union would sort, else the "
        "union) against the "
        "sorted union then the kernel; `default vs kernel`: against the kernel alone on the caller's rows "
        "(`rows_unique=True`: what any de-duplication adds). Top-k distinct random rows, one repeated in "
        "every token; graph replays with the L2 flushed; ratio > 1: ours faster. The records at `486e783` "
        "launch the hash as a programmatic dependent launch ahead of every decode kernel, the Gluon kernel "
        "then a plain launch (0.7 us slower so at 64 heads x 8 tokens: D97); the library now makes the "
        "sliced Gluon kernel a dependent launch too, with the hash's dependent launch ahead of it, and keeps "
        "both plain where the Gluon kernel runs one slice (D98).",
        (),
    ),
    "decode-packed": (
        "Sparse-MLA decode as the steps convert its rows",
        "The top-k conversion and the routed decode of a head-TP or DCP step: each token's valid rows "
        "packed at the front (`convert_topk(packed=True)`, their count the decode's `topk_length`) "
        "against the rows converted in place (`-1` where invalid), with `rows_unique` False (the "
        "de-duplication drops invalid entries itself) and True (the kernel reads the rows as given). "
        "Shares: `all` (every position valid), `dcp4` (a DCP rank of 4 holds about a quarter), `short` "
        "(a 700-token request: the rest of the top-k is `-1`). Graph replays with the L2 flushed; ratio "
        "= in place / packed. The steps pack only with unique rows (D89).",
        (),
    ),
    "kv-fp8-write": (
        "FP8 KV-row write",
        "Writing new tokens' bf16 rows into a paged fp8_ds_mla cache at random slots "
        "(`shardattn.ops.kv_fp8.write_kv`) against storing the same rows as bf16, same run; graph "
        "replays with the L2 flushed.",
        (),
    ),
    "gqa-decode": (
        "GQA paged decode",
        "64 q / 8 kv heads, head dim 64, page 32, bf16, 64 requests of 8,192 tokens; graph replays. "
        "Ours: the Triton kernel; peer: FlashInfer XQA, same run.",
        (),
    ),
    "lse-merge": (
        "LSE merge",
        "Merging bf16 partial outputs by their LSEs, in TB/s (bytes read + written) against a 2 GiB "
        "device-to-device copy in the same run.",
        (),
    ),
    "decode-graph": (
        "Captured decode steps",
        "A decode step replayed from a CUDA graph against the same step launched eagerly (host bound at these sizes).",
        (),
    ),
    "dcp-decode": (
        "DCP decode on two GPUs",
        "GQA decode with the KV cache split over the ranks (gqa-64-8, 64 requests of 8,192 tokens, "
        "NCCL); whole steps on the host clock, the slowest rank's median. Baseline: the eager step "
        "given device tensors only (its index arithmetic on the device every step), same run.",
        (),
    ),
    "prefill-scaling": (
        "ShardQ and head-TP prefill on two GPUs",
        "Prefill of 4 requests with 8,192 cached tokens each (DSA-like top-k, bf16, NCCL) under head "
        "tensor parallelism and under ShardQ, and the step the cost-model router picks; the slowest "
        "rank's median. The router's step is compared with the faster of the two paths measured in "
        "the same run.",
        ("prefill-scaling-2026-12-01.png",),
    ),
    "cost-model": (
        "Cost-model accuracy",
        "The router's prediction of each path against the step measured in the same run (ratio = "
        "predicted / measured).",
        (),
    ),
    "prefill-scaling-predicted": (
        "Predicted prefill at more ranks",
        "Predictions of the cost model (`scaling.py --simulate`), not measurements.",
        (),
    ),
    "pool-soak": (
        "Ray pool soak",
        "`benchmarks/soak_pool.py`: the Ray actor pool serving requests with random arrivals, prefills, "
        "decodes and frees with its KV pages near capacity, one rank killed at a random moment every "
        "`--kill-every` seconds and the pool restarted; every output checked against fp64. Lost "
        "requests count those `restart()` did not report; leaked pages, pages in use that never "
        "returned; memory growth compares the median RSS of the last three samples with the first "
        "three after the warm-up.",
        (),
    ),
    "runtime-soak": (
        "Runtime soak",
        "`benchmarks/soak_runtime.py`: one `Runtime` under torchrun serving random prefill and decode "
        "steps (decode from CUDA-graph buckets on a GPU), every 50th step checked against the torch "
        "reference. After the warm-up: kernel compiles, live torch tensors (floor of the last samples "
        "over the first), and the growth of RSS and CUDA allocated memory (median of the last three "
        "samples over the first three).",
        (),
    ),
    "host-growth": (
        "Host memory left per call",
        "`benchmarks/host_growth.py`: glibc heap in use added per call of each operation a serving "
        "step (or a soak's harness) makes, over many calls after a warm-up: 0 is flat; a bounded "
        "cache shows as a number that falls as the calls grow.",
        (),
    ),
    "ray-pool": (
        "The Ray pool's decode step",
        "A 64-request decode step at 8,192 tokens of context through `RayRankPool` on two GPUs, "
        "against the same step under torchrun (`shardattn.launch --mode dcp-decode`), in alternating "
        "rounds; the median over rounds of each round's difference.",
        (),
    ),
}
HEADER = """# Performance

Generated by `python benchmarks/performance_page.py` from the records in `docs/performance/*.json`
(format: `benchmarks/records.py`); edit the records, not this page. Each row is one number
measured by the command shown, on the code of the commit shown, beside the baseline or peer
measured in the same run; a command names its script as it was at that commit (`git checkout
COMMIT` reruns it there). Ratio: how many times better ours is (a higher rate or a shorter time);
for a prediction, predicted / measured. `benchmarks/README.md` lists today's benchmarks and how to
regenerate this page; `docs/DECISIONS.md` says why the routes are what they are and what was
measured and rejected. A table may hold rows of several GPUs (the GPU column): compare a row with
its own baseline, and rows with each other only on the same GPU.
"""
COLUMNS = ("Configuration", "Metric", "Ours", "Baseline or peer (same run)", "Ratio", "Date", "GPU", "Commit",
           "Command")  # fmt: skip


def load(directory: Path = RECORDS) -> dict[str, list[dict]]:
    """The records of every ``<benchmark>.json`` in ``directory``, by benchmark; ``ValueError`` on a
    record filed under another benchmark's name, a benchmark :data:`SECTIONS` does not know, or two
    records of one (configuration, metric, GPU)."""
    tables: dict[str, list[dict]] = {}
    for path in sorted(directory.glob("*.json")):
        if path.stem not in SECTIONS:
            raise ValueError(f"{path}: no section for benchmark {path.stem!r} (benchmarks/performance_page.py)")
        recs = read_json(path)
        seen = set()
        for rec in recs:
            if rec["benchmark"] != path.stem:
                raise ValueError(f"{path}: a record of benchmark {rec['benchmark']!r}")
            if key(rec) in seen:
                what = f"{config_text(rec['config'])}, {rec['metric']} on {rec['gpu']}"
                raise ValueError(f"{path}: two records of {what}")
            seen.add(key(rec))
        tables[path.stem] = recs
    return tables


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def row(rec: dict) -> str:
    """One table row of a record."""
    base = rec["baseline"]
    if base is None:
        base_text = "-"
    elif base["value"] is None:
        base_text = base["name"]
    else:
        base_text = f"{base['name']}: {fmt(base['value'])} {rec['unit']}"
    cells = (
        config_text(rec["config"]),
        rec["metric"],
        f"**{fmt(rec['value'])} {rec['unit']}**",
        base_text,
        "-" if rec["ratio"] is None else f"{rec['ratio']:.2f}x",
        rec["date"],
        rec["gpu"],
        f"`{rec['commit']}`",
        f"`{rec['command']}`",
    )
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def render(tables: dict[str, list[dict]]) -> str:
    """The page (markdown) of :func:`load`'s tables."""
    parts = [HEADER]
    for name, (title, text, images) in SECTIONS.items():
        recs = tables.get(name)
        if not recs:
            continue
        parts.append(f"\n## {title}\n\n{textwrap.fill(text, width=100)}\n")
        parts.append("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
        parts += [row(rec) for rec in recs]
        for image in images:
            if not (RECORDS / image).exists():
                raise ValueError(f"section {name!r} names a plot that is not in {RECORDS}: {image}")
            parts.append(f"\n![{title}](performance/{image})")
    return "\n".join(parts) + "\n"


def add(paths: list[Path], directory: Path = RECORDS, commit: str | None = None) -> int:
    """Merges the records of ``paths`` into ``directory`` (module docstring); returns how many.
    ``commit``: the measured commit, for records written by a copy of the tree whose ``.git`` was
    not that commit's (their own ``commit`` field is then replaced). A command's absolute paths
    become file names (:func:`records.portable_command`), so that it runs as written anywhere."""
    tables = load(directory)
    count = 0
    for path in paths:
        for rec in read_json(path):
            if commit is not None:
                rec = {**rec, "commit": commit}
            rec = {**rec, "command": portable_command(rec["command"])}
            validate(rec)
            if rec["benchmark"] not in SECTIONS:
                raise ValueError(f"{path}: no section for benchmark {rec['benchmark']!r}")
            table = tables.setdefault(rec["benchmark"], [])
            at = next((i for i, old in enumerate(table) if key(old) == key(rec)), None)
            if at is None:
                table.append(rec)
            else:
                table[at] = rec
            count += 1
    for name, table in tables.items():
        (directory / f"{name}.json").write_text(json.dumps(table, indent=1) + "\n")
    return count


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--add", nargs="+", type=Path, default=[], metavar="FILE", help="records to merge in first")
    ap.add_argument("--check", action="store_true", help="only compare the page with the records")
    ap.add_argument("--commit", default=None, help="with --add: the commit the records measured (replaces theirs)")
    args = ap.parse_args(argv)
    if args.add and args.check:
        print("--add writes the records; --check only reads: pass one", file=sys.stderr)
        return 2
    if args.add:
        print(f"merged {add(args.add, commit=args.commit)} records into {RECORDS.relative_to(ROOT)}")
    page = render(load())
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != page:
            print(f"{PAGE.relative_to(ROOT)} is not what the records give: run python benchmarks/performance_page.py",
                  file=sys.stderr)  # fmt: skip
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
