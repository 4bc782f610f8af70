"""PTX digests of the routed kernel variants: proof that a change of Python left the kernels alone.

Every routed kernel variant (the Triton kernels and the Gluon sm_90 kernels, at the DSA shapes
the library launches them with) is compiled ahead of time for sm_90 on the CPU (no GPU needed),
its PTX is stripped of what only debugging reads (``.loc`` / ``.file`` lines, the debug sections
and their labels, comments) and hashed. A reorganisation of the Python code (moved modules,
renamed helpers, deleted unrouted variants) must leave every digest as it was: the baseline is
``tests/ptx_digests.json``, keyed by the Triton version that produced it (PTX differs between
Triton versions, so a version without a baseline has nothing to compare).

Run::

    python -m shardattn.testing.ptx_digest                   # print every variant's digest
    python -m shardattn.testing.ptx_digest --write FILE      # (re)write FILE's entry for this Triton
    python -m shardattn.testing.ptx_digest --check FILE      # compare; exit 1 on a difference
    python -m shardattn.testing.ptx_digest --check FILE --ci # only the representative variants

``--ci`` compiles the representative subset (:data:`CI_VARIANTS`) that ``tests/test_ptx_digest.py``
checks within about a minute on two CPU cores; the full list takes a few minutes.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

from shardattn.kernels.backend import COMPILE_OPTIONS

#: The baseline file, relative to the repository root.
BASELINE = Path("tests") / "ptx_digests.json"

_DEBUG_LINE = re.compile(r"^\s*\.(loc|file)\b")
_DEBUG_LABEL = re.compile(r"^\$L__(tmp|func_begin|func_end|info_string|debug)\w*:")


def strip_debug(ptx: str) -> str:
    """``ptx`` without what only debugging reads: ``.loc`` / ``.file`` lines, ``.section .debug_*``
    blocks, debug labels, comments and blank lines (so moving a kernel's source changes nothing).

    >>> strip_debug(".entry k()\\n{\\n\\t.loc 1 2 3\\n\\tret; // done\\n}\\n.section .debug_abbrev\\n{\\n.b8 1\\n}")
    '.entry k()\\n{\\nret;\\n}'
    """
    out: list[str] = []
    in_debug = False
    for line in ptx.splitlines():
        text = line.split("//", 1)[0].strip()
        if in_debug:
            if text == "}":
                in_debug = False
            continue
        if text.startswith(".section") and ".debug" in text:
            in_debug = True
            continue
        if not text or _DEBUG_LINE.match(text) or _DEBUG_LABEL.match(text):
            continue
        out.append(text)
    return "\n".join(out)


def digest(ptx: str) -> str:
    """sha256 of :func:`strip_debug` of ``ptx``."""
    return hashlib.sha256(strip_debug(ptx).encode()).hexdigest()


def _attr(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def triton_sm90_ptx(
    module: str,
    kernel: str,
    pointers: dict[str, str],
    constexprs: dict,
    *,
    floats: tuple[str, ...] = (),
    num_warps: int = 4,
    num_stages: int = 3,
    launch_pdl: bool = False,
) -> str:
    """PTX of the Triton kernel ``module.kernel`` for sm_90: ``pointers`` (name -> ``"*bf16"`` ...),
    ``floats`` fp32 scalars, every other argument an i32; pointers 16-byte aligned (as torch's
    allocations are)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _attr(module, kernel)
    # constexprs not named keep their defaults (a kernel's newer variants, off by default)
    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **constexprs}
    signature: dict[str, str] = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name in floats else "i32"
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in pointers}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {**COMPILE_OPTIONS, "num_warps": num_warps, "num_stages": num_stages, "launch_pdl": launch_pdl}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


# ---- the variants ------------------------------------------------------------------------------
# Module paths of the kernels and of the configuration functions that pick a routed variant.
_GLUON_PREFILL = "shardattn.kernels.gluon.sparse_mla"
_GLUON_DECODE = "shardattn.kernels.gluon.sparse_mla_decode"
_GLUON_SMALL = "shardattn.kernels.gluon.sparse_mla_decode_small"
_GLUON_STREAM = "shardattn.kernels.gluon.sparse_mla_decode_stream"
_GLUON_UNION = "shardattn.kernels.gluon.union_smem"
_TRITON_PREFILL = "shardattn.kernels.triton.sparse_mla"
_TRITON_DECODE = "shardattn.kernels.triton.sparse_mla_decode"
_TRITON_DECODE_CONFIG = "shardattn.kernels.triton.sparse_mla_decode_config"
_TRITON_MERGE = "shardattn.kernels.triton.lse_merge"
_TRITON_GQA = "shardattn.kernels.triton.gqa_decode"
_TRITON_TOPK = "shardattn.kernels.triton.topk"
_TRITON_UNION = "shardattn.kernels.triton.union"
_TRITON_FUSED = "shardattn.kernels.triton.union_fused"
_TRITON_BITMAP = "shardattn.kernels.triton.union_bitmap"
_TRITON_PACK_ROWS = "shardattn.kernels.triton.pack_rows"
_TRITON_UNIQUE = "shardattn.kernels.triton.unique_rows"

_BF16_ATTN = {"Q": "*bf16", "KV": "*bf16", "UNION": "*i32", "LENS": "*i32", "SINKS": "*fp32", "OUT": "*bf16"}


def _gluon_prefill(heads: int, group_size: int = 1, *, sinks: bool = False, dtype: str = "bf16", **fp8: bool) -> str:
    compile_kernel = _attr(_GLUON_PREFILL, "compile_kernel_for_sm90")
    return compile_kernel("prefill", heads, group_size, sinks=sinks, dtype=dtype, **fp8).asm["ptx"]


def _gluon_decode(*, raw_rows: bool, sinks: bool = False, persistent: bool = False, **flags: bool) -> str:
    config = _attr(_GLUON_DECODE, "gluon_decode_config")(128, persistent=persistent)
    compile_kernel = _attr(_GLUON_PREFILL, "compile_kernel_for_sm90")
    return compile_kernel("prefill", 128, 1, sinks=sinks, config=config, raw_rows=raw_rows, **flags).asm["ptx"]


def _gluon_small(block_n: int, heads_per_program: int, *, split: bool = True, **flags: bool) -> str:
    compile_kernel = _attr(_GLUON_SMALL, "compile_for_sm90")
    return compile_kernel(block_n, split=split, heads_per_program=heads_per_program, **flags).asm["ptx"]


def _gluon_stream(heads: int, *, split: bool = True, **flags: bool) -> str:
    return _attr(_GLUON_STREAM, "compile_for_sm90")(split=split, heads=heads, **flags).asm["ptx"]


def _gluon_union(group_size: int, num_kv_rows: int, *, marks: bool = False) -> str:
    return _attr(_GLUON_UNION, "compile_for_sm90")(group_size, 2048, num_kv_rows, marks=marks).asm["ptx"]


def _triton_prefill(heads: int, group_size: int, *, sinks: bool = False, kv_fp8: bool = False) -> str:
    tile = _attr(_TRITON_PREFILL, "tile_config")(heads, group_size)
    constexprs = {"G": group_size, "BLOCK_H": tile.block_h, "BLOCK_N": tile.block_n, "D_V": 512, "D_R": 64,
                  "HAS_SINK": sinks, "IEEE": False}  # fmt: skip
    pointers = {**_BF16_ATTN, "LSE": "*fp32"}
    if kv_fp8:  # fp8_ds_mla rows: uint8 (the variant is new: bf16's arguments stay as they were)
        pointers["KV"], constexprs["KV_FP8"] = "*u8", True
    return triton_sm90_ptx(
        _TRITON_PREFILL, "_sparse_mla_fwd_kernel", pointers, constexprs,
        floats=("qk_scale",), num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip


def _triton_decode(tokens: int, heads: int, *, kv_fp8: bool = False) -> str:
    config = _attr(_TRITON_DECODE_CONFIG, "sparse_mla_decode_config")
    cfg = config(tokens, heads, 2048, 132, kv_fp8=True) if kv_fp8 else config(tokens, heads, 2048, 132)
    split = cfg["num_splits"] > 1
    partial = "*fp32" if split else "*bf16"
    pointers = {"Q": "*bf16", "KV": "*bf16", "Rows": "*i32", "TopkLen": "*i32", "Sinks": "*bf16", "Out": partial,
                "Lse": "*fp32", "FinalOut": "*bf16", "FinalLse": "*fp32", "Counters": "*fp32"}  # fmt: skip
    constexprs = {"DV": 512, "DR": 64, "BLOCK_DV": 512, "BLOCK_DR": 64, "BLOCK_H": cfg["BLOCK_H"],
                  "BLOCK_N": cfg["BLOCK_N"], "HAS_TOPK_LEN": False, "HAS_SINKS": False, "HAS_ROPE": True,
                  "IEEE": False, "PDL": True}  # fmt: skip
    if kv_fp8:
        pointers["KV"], constexprs["KV_FP8"] = "*u8", True
    return triton_sm90_ptx(
        _TRITON_DECODE, "_sparse_mla_decode_kernel", pointers, constexprs, floats=("qk_scale",),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], launch_pdl=True,
    )  # fmt: skip


def _triton_merge(kernel: str, constexprs: dict, num_warps: int) -> str:
    pointers = {"Outs": "*fp32", "Lses": "*fp32", "Out": "*bf16", "Lse": "*fp32"}
    return triton_sm90_ptx(_TRITON_MERGE, kernel, pointers, constexprs, num_warps=num_warps, launch_pdl=True)


def _triton_gqa() -> str:
    pointers = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "BlockTable": "*i32", "SeqLens": "*i32", "CuQ": "*i32",
                "Sinks": "*fp32", "Out": "*fp32", "Lse": "*fp32"}  # fmt: skip
    constexprs = {"Q_LEN": 1, "GROUP": 8, "PAGE": 32, "HEAD_DIM": 64, "BLOCK_D": 64, "BLOCK_Q": 1, "BLOCK_M": 16,
                  "BLOCK_N": 64, "CAUSAL": True, "HAS_WINDOW": False, "HAS_SINKS": True, "IEEE": False}  # fmt: skip
    return triton_sm90_ptx(_TRITON_GQA, "_gqa_decode_kernel", pointers, constexprs, floats=("qk_scale",), num_stages=3)


def _triton_topk(packed: bool = False) -> str:
    config = _attr(_TRITON_TOPK, "convert_topk_config")(2048, True, False, True, packed)
    pointers = {"POS": "*i32", "REQ": "*i32", "TABLE": "*i32", "SEQ": "*i32", "TOPK_LEN": "*i32", "ROWS": "*i32",
                "COUNTS": "*i32"}  # fmt: skip
    return triton_sm90_ptx(_TRITON_TOPK, "_convert_topk_kernel", pointers, config)


def _triton_union_keys(group_size: int) -> str:
    cfg = _attr(_TRITON_UNION, "union_launch_config")(group_size, 2048)
    pointers = {"ROWS": "*i32", "TOPK_LEN": "*i32", "KEYS": "*i32"}
    constexprs = {"G": group_size, "BLOCK_K": cfg["BLOCK_K"], "HAS_LEN": False}
    return triton_sm90_ptx(_TRITON_UNION, "_union_keys_kernel", pointers, constexprs)


def _triton_union_compact(group_size: int) -> str:
    cfg = _attr(_TRITON_UNION, "union_launch_config")(group_size, 2048)
    pointers = {"SORTED": "*i32", "UNION": "*i32", "LENS": "*i32"}
    return triton_sm90_ptx(_TRITON_UNION, "_union_compact_kernel", pointers, {"G": group_size, "CHUNK": cfg["CHUNK"]})


def _triton_unique_rows() -> str:
    cfg = dict(_attr(_TRITON_UNIQUE, "unique_rows_config")(2048))
    num_warps = cfg.pop("num_warps")
    pointers = {"ROWS": "*i32", "TOPK_LEN": "*i32", "SCRATCH": "*i64", "OUT": "*i32"}
    constexprs = {**cfg, "HAS_LEN": True, "PDL": True}
    return triton_sm90_ptx(
        _TRITON_UNIQUE, "_unique_rows_kernel", pointers, constexprs, num_warps=num_warps, launch_pdl=True
    )


def _triton_fused(group_size: int) -> str:
    cfg = dict(_attr(_TRITON_FUSED, "fused_launch_config")(group_size, 2048))
    num_warps = cfg.pop("num_warps")
    pointers = {"ROWS": "*i32", "TOPK_LEN": "*i32", "UNION": "*i32", "LENS": "*i32", "SCRATCH": "*i32", "CUM": "*i32"}
    return triton_sm90_ptx(
        _TRITON_FUSED, "_fused_union_kernel", pointers, {**cfg, "HAS_LEN": False}, num_warps=num_warps
    )


def _triton_bitmap(group_size: int) -> str:
    cfg = dict(_attr(_TRITON_BITMAP, "bitmap_launch_config")(group_size, 2048))
    num_warps = cfg.pop("num_warps")
    pointers = {"ROWS": "*i32", "TOPK_LEN": "*i32", "UNION": "*i32", "LENS": "*i32", "BITMAP": "*i32",
                "PACKED": "*i64"}  # fmt: skip
    constexprs = {**cfg, "G": group_size, "HAS_LEN": False}
    return triton_sm90_ptx(_TRITON_BITMAP, "_bitmap_union_kernel", pointers, constexprs, num_warps=num_warps)


def _triton_pack_rows() -> str:
    pointers = {"ROWS": "*i32", "TOPK_LEN": "*i32", "UNION": "*i32", "LENS": "*i32"}
    constexprs = {"BLOCK": 1024, "HAS_LEN": False}
    return triton_sm90_ptx(_TRITON_PACK_ROWS, "_pack_rows_kernel", pointers, constexprs)


#: name -> PTX of one routed variant (DSA shapes: 512 + 64 dims, top-k 2048, bf16 unless named).
VARIANTS: dict[str, Callable[[], str]] = {
    # Gluon sparse-MLA prefill, per query (persistent 64-key kernel; above 64 heads head blocks adjacent, Q early)
    "gluon.prefill.h64": lambda: _gluon_prefill(64),
    "gluon.prefill.h128": lambda: _gluon_prefill(128),
    "gluon.prefill.h64.sinks": lambda: _gluon_prefill(64, sinks=True),
    "gluon.prefill.h128.fp16": lambda: _gluon_prefill(128, dtype="fp16"),
    # Gluon grouped prefill (the same kernel, G queries x 64 / G heads a tile)
    "gluon.grouped.g2.h32": lambda: _gluon_prefill(32, 2),
    "gluon.grouped.g4.h16": lambda: _gluon_prefill(16, 4),
    "gluon.grouped.g8.h8": lambda: _gluon_prefill(8, 8),
    "gluon.grouped.g4.h16.sinks": lambda: _gluon_prefill(16, 4, sinks=True),
    # Gluon decode at >= 32 heads (the routed decode configuration; raw rows in place, or a union)
    "gluon.decode.raw_rows": lambda: _gluon_decode(raw_rows=True),
    "gluon.decode.union": lambda: _gluon_decode(raw_rows=False),
    "gluon.decode.raw_rows.sinks": lambda: _gluon_decode(raw_rows=True, sinks=True),
    "gluon.decode.raw_rows.sliced": lambda: _gluon_decode(raw_rows=True, pdl=True),  # a dependent launch
    "gluon.decode.raw_rows.persistent": lambda: _gluon_decode(raw_rows=True, persistent=True),
    "gluon.decode.raw_rows.sliced.persistent": lambda: _gluon_decode(raw_rows=True, pdl=True, persistent=True),
    # Gluon small-batch decode at <= 16 heads (64-entry splits on one warpgroup, 128 on two; 8 or 16 heads)
    "gluon.small.b64.h16": lambda: _gluon_small(64, 16),
    "gluon.small.b128.h16": lambda: _gluon_small(128, 16),
    "gluon.small.b64.h8": lambda: _gluon_small(64, 8),
    "gluon.small.b64.h16.one_split.len.sinks": lambda: _gluon_small(
        64, 16, split=False, even_k=False, topk_length=True, sinks=True
    ),
    # Gluon streaming decode at <= 16 heads (slice partials or one slice into out; 8 or 16 heads)
    "gluon.stream.h16": lambda: _gluon_stream(16),
    "gluon.stream.h8": lambda: _gluon_stream(8),
    "gluon.stream.h16.one_slice.len.sinks": lambda: _gluon_stream(16, split=False, topk_length=True, sinks=True),
    # Gluon shared-memory union build (both windows)
    "gluon.union_smem.g1.w2048": lambda: _gluon_union(1, 65536),
    "gluon.union_smem.g8.w2048": lambda: _gluon_union(8, 65536),
    "gluon.union_smem.g4.w4096": lambda: _gluon_union(4, 131072),
    "gluon.union_smem.g8.w2048.marks": lambda: _gluon_union(8, 65536, marks=True),
    # Triton sparse-MLA prefill (per query below 32 heads; grouped at 8 heads)
    "triton.prefill.g1.h16": lambda: _triton_prefill(16, 1),
    "triton.prefill.g1.h128": lambda: _triton_prefill(128, 1),
    "triton.prefill.g8.h8": lambda: _triton_prefill(8, 8, sinks=True),
    # Triton split-KV decode (one-wave split at 16 heads x 1 token; 128 heads x 8 and x 64 tokens)
    "triton.decode.t1.h16": lambda: _triton_decode(1, 16),
    "triton.decode.t8.h128": lambda: _triton_decode(8, 128),
    "triton.decode.t64.h128": lambda: _triton_decode(64, 128),
    # the sparse-MLA kernels on fp8_ds_mla KV rows (dequantised in the kernel before the bf16 multiplies)
    "gluon.prefill.h128.fp8": lambda: _gluon_prefill(128, kv_fp8=True),
    "gluon.grouped.g8.h8.fp8": lambda: _gluon_prefill(8, 8, kv_fp8=True),
    "gluon.decode.raw_rows.fp8": lambda: _gluon_decode(raw_rows=True, kv_fp8=True),
    "gluon.small.b64.h16.fp8": lambda: _gluon_small(64, 16, kv_fp8=True),
    "gluon.small.b128.h8.fp8": lambda: _gluon_small(128, 8, kv_fp8=True),
    "gluon.stream.h16.fp8": lambda: _gluon_stream(16, kv_fp8=True),
    "triton.prefill.g1.h128.fp8": lambda: _triton_prefill(128, 1, kv_fp8=True),
    "triton.prefill.g8.h8.fp8": lambda: _triton_prefill(8, 8, sinks=True, kv_fp8=True),
    "triton.decode.t1.h16.fp8": lambda: _triton_decode(1, 16, kv_fp8=True),
    "triton.decode.t64.h16.fp8": lambda: _triton_decode(64, 16, kv_fp8=True),
    # Triton LSE merges (rows; columns at 128 and at the small kernel's 64 columns on one warp; the
    # Gluon decode's row blocks of two slices)
    "triton.merge.rows": lambda: _triton_merge("_lse_merge_kernel", {"BLOCK_R": 8, "BLOCK_D": 512, "PDL": True}, 4),
    "triton.merge.columns": lambda: _triton_merge(
        "_lse_merge_columns_kernel", {"BLOCK_P": 32, "BLOCK_R": 1, "BLOCK_D": 128, "PDL": True}, 4
    ),
    "triton.merge.columns.small": lambda: _triton_merge(
        "_lse_merge_columns_kernel", {"BLOCK_P": 32, "BLOCK_R": 1, "BLOCK_D": 64, "PDL": True}, 1
    ),
    "triton.merge.columns.rows4": lambda: _triton_merge(
        "_lse_merge_columns_kernel", {"BLOCK_P": 2, "BLOCK_R": 4, "BLOCK_D": 512, "PDL": True}, 4
    ),
    # Triton GQA paged decode, top-k conversion, union builders, decode row slices
    "triton.gqa_decode": _triton_gqa,
    "triton.convert_topk": _triton_topk,
    "triton.convert_topk.packed": lambda: _triton_topk(packed=True),
    "triton.union.keys.g1": lambda: _triton_union_keys(1),
    "triton.union.keys.g2": lambda: _triton_union_keys(2),
    "triton.union.compact.g2": lambda: _triton_union_compact(2),
    "triton.union.fused.g8": lambda: _triton_fused(8),
    "triton.union.bitmap.g4": lambda: _triton_bitmap(4),
    "triton.unique_rows": _triton_unique_rows,
    "triton.pack_rows": _triton_pack_rows,
}

#: The representative subset the CI test compiles (about a minute on two CPU cores): the routed
#: Gluon prefill (per query and grouped), the Gluon decode and small-batch kernels, the Triton
#: prefill, split-KV decode and merge kernels.
CI_VARIANTS = (
    "gluon.prefill.h128",
    "gluon.grouped.g4.h16",
    "gluon.decode.raw_rows",
    "gluon.small.b64.h16",
    "triton.prefill.g1.h16",
    "triton.decode.t1.h16",
    "triton.merge.columns",
)


def triton_key() -> str:
    """The baseline's key for the installed Triton: ``"triton <version>"``."""
    import triton

    return f"triton {triton.__version__}"


def compute(names: list[str] | None = None) -> dict[str, str]:
    """``{variant: digest}`` of ``names`` (default: every variant), compiled now."""
    return {name: digest(VARIANTS[name]()) for name in (names or list(VARIANTS))}


def compare(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    """Lines naming each variant whose digest differs from ``expected`` (or that it lacks)."""
    return [
        f"{name}: {actual[name][:16]} != baseline {expected.get(name, 'missing')[:16]}"
        for name in actual
        if expected.get(name) != actual[name]
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardattn.testing.ptx_digest", description=__doc__.split("\n")[0])
    parser.add_argument("--write", type=Path, help="write this Triton's digests into FILE (other versions kept)")
    parser.add_argument("--check", type=Path, help="compare with FILE's digests for this Triton")
    parser.add_argument("--ci", action="store_true", help="only the representative variants (CI_VARIANTS)")
    parser.add_argument("--only", nargs="*", help="these variants")
    args = parser.parse_args(argv)
    names = list(args.only or (CI_VARIANTS if args.ci else VARIANTS))
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    actual = compute(names)
    key = triton_key()
    if args.write:
        data = json.loads(args.write.read_text()) if args.write.exists() else {}
        data[key] = {**data.get(key, {}), **actual}
        args.write.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    if args.check:
        expected = json.loads(args.check.read_text()).get(key)
        if expected is None:
            print(f"{args.check} has no digests for {key}")
            return 1
        diff = compare(expected, actual)
        for line in diff:
            print(line)
        print(f"{len(actual) - len(diff)} of {len(actual)} variants match {key}'s baseline")
        return 1 if diff else 0
    for name, value in actual.items():
        print(f"{value}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
