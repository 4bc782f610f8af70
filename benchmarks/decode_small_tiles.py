"""Which split tile and head group should the small-batch sparse-MLA decode kernel take at each batch (one GPU)?

Times the whole step (the split kernel of
:mod:`~shardattn.kernels.gluon.sparse_mla_decode_small` and the column merge after it, both
programmatic dependent launches) and the split kernel alone on every tile it can run, on
``decode.py``'s small sparse-MLA decode shapes: top-k 2,048 unique random rows of 262,144 (one
invalid entry in the first and last token), bf16, 576 columns, 16 heads. Tiles: 32 splits of 64
entries on one warpgroup, 16 splits of 128 on one warpgroup, 16 of 128 on two (each warpgroup
64 of the rows and 256 of the value columns); each with all 16 heads in a program and with two
programs of 8 (:func:`small_decode_heads`); the routed merge (:data:`SMALL_MERGE_COLUMNS`
columns on :data:`SMALL_MERGE_WARPS` warp a program) and, on all 16 heads, the merge routed before
it (four warps on 256 columns at up to 16 splits, on 128 above). Every step is checked against
the fp32 reference first. Graph replays with the L2 flushed between replays
(``graph_timing.replay_us``), the least of ``--rounds`` rounds;
``--warm-inputs`` rewrites q and the top-k rows after each flush, as the kernels that produce
them would leave them in the L2 (the KV rows stay cold). The routed variant
(:func:`small_decode_tiles`, :func:`small_decode_heads`) is printed in bold; ``--json`` keeps the
table for ``plot_small_tiles.py``.

    cd benchmarks && python decode_small_tiles.py --json small_tiles.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from graph_timing import gpu_banner, replay_us, trivial_graph_us  # beside this script

from shardattn.kernels.gluon.sparse_mla_decode_small import launch_small_split, small_decode_warps
from shardattn.kernels.triton.lse_merge import launch_lse_merge_columns, split_partials
from shardattn.ops.sparse_mla import sparse_mla_reference
from shardattn.plan.crossovers import SMALL_MERGE_COLUMNS, SMALL_MERGE_WARPS
from shardattn.plan.routing import small_decode_heads, small_decode_tiles

ROWS, TOPK, HEADS, SCALE = 1 << 18, 2048, 16, 0.07
#: (entries a split, warps)
TILES = ((64, 4), (128, 4), (128, 8))
#: heads a program
GROUPS = (16, 8)


def _inputs(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.argsort(torch.rand(batch, ROWS, device="cuda"), dim=1)[:, :TOPK].int().contiguous()
    rows[0, 5] = -1
    rows[-1, 100] = ROWS + 3
    return torch.randn(batch, HEADS, 576, device="cuda").bfloat16(), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,2,3,4,6,8,16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the table (us) and the routed variant per batch here")
    parser.add_argument("--warm-inputs", action="store_true", help="q and the top-k rows in the L2 at each replay")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(gpu_banner(), flush=True)
    print(f"graph of one 1-element kernel: {trivial_graph_us(rounds=args.rounds):.2f} us", flush=True)
    kv = torch.randn(ROWS, 576, device="cuda").bfloat16()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batches = [int(b) for b in args.batches.split(",")]
    table: dict[str, dict[int, float]] = {}
    routed: dict[int, str] = {}
    for batch in batches:
        q, rows = _inputs(batch)
        warm = ((q, q.clone()), (rows, rows.clone())) if args.warm_inputs else ()
        ref_out, ref_lse = sparse_mla_reference(q, kv, rows, scale=SCALE)
        block, block_splits = small_decode_tiles(batch, TOPK, sms)
        group_routed = small_decode_heads(batch, block_splits, HEADS, sms)
        for (bn, warps), group in ((tile, g) for tile in TILES for g in GROUPS):
            splits = TOPK // bn
            part, lse = split_partials(None, splits, batch, HEADS, 512, q.device)
            out = torch.empty(batch, HEADS, 512, device="cuda", dtype=torch.bfloat16)
            lse_out = torch.empty(batch, HEADS, device="cuda")

            def split(bn=bn, warps=warps, splits=splits, part=part, lse=lse, q=q, rows=rows, group=group):
                launch_small_split(q, kv, rows, None, None, part, lse, bn, splits, SCALE, True, warps=warps,
                                   heads_per_program=group)  # fmt: skip

            tile = f"{splits} x {bn}, {warps} warps, {group} heads a program"
            is_routed = (bn, warps, group) == (block, small_decode_warps(block), group_routed)
            routed_merge = (SMALL_MERGE_COLUMNS, SMALL_MERGE_WARPS)
            merges = [routed_merge] + ([(256 if splits <= 16 else 128, 4)] if group == HEADS else [])
            for columns, merge_warps in merges:

                def step(split=split, part=part, lse=lse, out=out, lse_out=lse_out, columns=columns, mw=merge_warps):
                    split()
                    launch_lse_merge_columns(part, lse, out, lse_out, pdl=True, block_d=columns, num_warps=mw)

                out.fill_(float("nan"))
                step()
                torch.testing.assert_close(out.float(), ref_out.float(), rtol=2e-2, atol=2e-2)
                torch.testing.assert_close(lse_out, ref_lse, rtol=1e-3, atol=1e-3)
                name = f"{tile}, merge {columns} columns on {merge_warps} warps"
                table.setdefault(name, {})[batch] = replay_us(step, rep=40, rounds=args.rounds, warm=warm)
                if is_routed and (columns, merge_warps) == routed_merge:
                    routed[batch] = name
            if group == HEADS or is_routed:
                alone = replay_us(split, rep=40, rounds=args.rounds, warm=warm)
                table.setdefault(f"{tile}: split kernel alone", {})[batch] = alone
        print(f"batch {batch} done", flush=True)
    print("| variant (us) | " + " | ".join(f"{b} tokens" for b in batches) + " |")
    print("|---|" + "---|" * len(batches))
    for name, row in table.items():
        cells = (
            "-" if b not in row else f"**{row[b]:.2f}**" if routed.get(b) == name else f"{row[b]:.2f}" for b in batches
        )
        print(f"| {name} | " + " | ".join(cells) + " |")
    warmth = " -- q and top-k warm in the L2" if args.warm_inputs else ""
    print(f"(bold: the routed tile, head group and merge; -: not run){warmth}")
    if args.json:
        floor = trivial_graph_us(rounds=args.rounds)
        record = {"gpu": torch.cuda.get_device_name(), "floor_us": floor, "table_us": table, "routed": routed,
                  "warm_inputs": args.warm_inputs}  # fmt: skip
        Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
