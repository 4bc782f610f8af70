"""The routed sparse-MLA decode timed on fixed inputs, its outputs saved or compared bit for bit: the
before and after of a kernel change, on one GPU, one run after the other.

Run the checkout before the change with its package first on the path and ``--save DIR``, then
this checkout with ``--compare DIR`` (the inputs are seeded, so both runs see the same ones)::

    git worktree add /tmp/before <commit>
    PYTHONPATH=/tmp/before python benchmarks/decode_ab.py --save /tmp/ab
    python benchmarks/decode_ab.py --compare /tmp/ab --json decode_ab.json

Each case ``HxTxK`` (heads x tokens x top-k): ``decode_fp8_peer.py``'s inputs (DSA-like rows of a
``--cache-rows`` cache, one for every case, and each case's unique random top-k rows with -1 and
past-the-cache entries sprinkled in, one token with no valid row), on the bf16 rows and on the
same rows written as fp8_ds_mla;
``sparse_mla_decode(..., rows_unique=True)`` (``--dedupe``: the default call, rows de-duplicated
first), timed as CUDA-graph replays with the L2 flushed. Prints per case and format the kernel the
call routes to, its microseconds and, with ``--compare``, the saved run's and whether the output
and LSE equal the saved ones bit for bit (a kernel change that keeps the arithmetic must keep
them). ``--json``: records ``decode-ab`` (microseconds a step; baseline the saved run's, measured
just before on the same GPU by the checkout that ``--save`` ran).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_fp8_peer import SCALE, make_cache, make_queries  # beside this script
from graph_timing import replay_us
from records import add_json_argument, environment, print_table, record, write_json

import shardattn
from shardattn.ops.dispatch import sparse_decode_kernel
from shardattn.ops.sparse_mla_decode import sparse_mla_decode

#: The streaming kernel's shapes (8 / 16 heads, DECISIONS D68) and the Gluon kernel's (64 / 128).
DEFAULT_CASES = ("16x64x2048", "8x64x2048", "16x256x2048", "16x64x512", "16x128x256", "8x256x512",
                 "64x64x2048", "128x64x2048", "128x4x2048")  # fmt: skip


def parse_case(text: str) -> tuple[int, int, int]:
    """``"HxTxK"`` as ``(heads, tokens, topk)``; ``argparse.ArgumentTypeError`` naming the case
    otherwise (argparse reports it under ``--cases``)."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"a case is HEADSxTOKENSxTOPK with positive integers, got {text!r}")
    heads, tokens, topk = (int(p) for p in parts)
    return heads, tokens, topk


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", type=parse_case, default=[parse_case(c) for c in DEFAULT_CASES],
                   help="HEADSxTOKENSxTOPK ...")  # fmt: skip
    p.add_argument("--kv-dtype", nargs="+", choices=("bf16", "fp8_ds_mla"), default=["bf16", "fp8_ds_mla"])
    p.add_argument("--cache-rows", type=int, default=262144)
    p.add_argument("--dedupe", action="store_true", help="the default call (rows de-duplicated first)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--save", type=Path, default=None, metavar="DIR", help="save outputs and times here")
    mode.add_argument("--compare", type=Path, default=None, metavar="DIR", help="compare with a --save run")
    add_json_argument(p)
    return p


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN and -inf included): the tensors' bytes compared."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_ab.py needs a CUDA GPU (it times the GPU decode kernels)", file=sys.stderr)
        return 2
    saved: dict[str, float] = {}
    if a.compare is not None:
        if not (a.compare / "times.json").is_file():
            raise ValueError(f"--compare {a.compare}: no times.json there (write it with --save first)")
        saved = json.loads((a.compare / "times.json").read_text())["us"]
    if a.save is not None:
        a.save.mkdir(parents=True, exist_ok=True)
    print(f"shardattn from {Path(shardattn.__file__).parent}")
    env, records, times, lines = environment(), [], {}, []
    source, cache = make_cache(a.cache_rows, 64, seed=0)  # one cache for every case, each format made once
    formats = {"bf16": source.whole() if "bf16" in a.kv_dtype else None}
    formats["fp8_ds_mla"] = cache.reshape(-1, 656) if "fp8_ds_mla" in a.kv_dtype else None
    del cache
    for heads, tokens, topk in a.cases:
        q, rows, _valid = make_queries(tokens, heads, topk, a.cache_rows, 64, seed=tokens + heads + topk)
        for kind in a.kv_dtype:
            rows_kv = formats[kind]
            key = f"{heads}x{tokens}x{topk}-{kind}"
            kernel, _reason = sparse_decode_kernel(q, rows_kv, 512, rows)

            def step(q=q, rows_kv=rows_kv, rows=rows):
                return sparse_mla_decode(q, rows_kv, rows, scale=SCALE, rows_unique=not a.dedupe)

            out, lse = step()
            us = replay_us(step)
            times[key] = us
            same = "-"
            if a.save is not None:
                torch.save((out.cpu(), lse.cpu()), a.save / f"{key}.pt")
            elif a.compare is not None:
                if not (a.compare / f"{key}.pt").is_file():
                    raise ValueError(f"--compare {a.compare}: the saved run has no case {key}")
                ref_out, ref_lse = torch.load(a.compare / f"{key}.pt")
                same = str(_same_bits(out.cpu(), ref_out) and _same_bits(lse.cpu(), ref_lse))
            base = saved.get(key)
            lines.append(f"{key:24s} {kernel:14s} {us:9.2f} us  saved {base if base is not None else '-':>9}  "
                         f"bit-identical {same}")  # fmt: skip
            print(lines[-1], flush=True)
            config = {"heads": heads, "tokens": tokens, "topk": topk, "kv": kind, "kernel": kernel,
                      "cache_rows": a.cache_rows, "dedupe": a.dedupe}  # fmt: skip
            if same != "-":
                config["bit_identical"] = same == "True"
            baseline = None if base is None else ("the saved checkout's step (same GPU, run just before)", base)
            records.append(record("decode-ab", config, "step us", us, "us", "lower", baseline, env=env))
    if a.save is not None:
        meta = {"us": times, "package": str(Path(shardattn.__file__).parent)}
        (a.save / "times.json").write_text(json.dumps(meta, indent=1) + "\n")
    print_table(records, title="decode A/B")
    write_json(a.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
