"""The sparse-MLA Triton kernels on ``fp8_ds_mla`` rows under the interpreter, at tiny shapes.

Run as ``TRITON_INTERPRET=1 python -m tests.interpret.sparse_mla_fp8_cases`` (tests/test_sparse_mla_fp8.py
does this in a subprocess). Each case runs a kernel on an FP8 cache and on its rows dequantised
(:func:`~shardattn.ops.kv_fp8.dequantize_kv`) in q's dtype and compares both with the fp64 oracle
(tests/oracle.py) on the rows as the independent decoder of tests/fp8_oracle.py reads them, at the
dtype's tolerance (fp32: the IEEE path, 1e-5). Not bit for bit here: the FP8 kernels chain four
128-column dots where the bf16 kernel has one 512-column dot; on a GPU the two issue the same
``k``-steps in the same order (tested there bit for bit), the interpreter's matmul sums them in
another order. fp16 and
fp32 (the interpreter does not run bf16 dots); DSA row width (512 + 64: the format's). Prints one
line per case and exits 1 on any failure.
"""

from __future__ import annotations

import os
import sys

import torch

from shardattn.kernels.triton.lse_merge import launch_lse_merge, launch_lse_merge_columns, split_partials
from shardattn.kernels.triton.sparse_mla import launch_attention, tile_config
from shardattn.kernels.triton.sparse_mla_decode import launch_split_kernel
from shardattn.kernels.triton.sparse_mla_decode_config import sparse_mla_decode_config
from shardattn.ops.kv_fp8 import dequantize_kv, quantize_kv
from shardattn.ops.union import build_union
from tests.fp8_oracle import fp8_rows_decode
from tests.oracle import sparse_mla_oracle

FAILURES: list[str] = []
V_DIM = 512
SCALE = 576**-0.5


def _report(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILURES.append(name)


def fp8_cache(gen: torch.Generator, r: int) -> torch.Tensor:
    """``[r, 656]`` fp8_ds_mla rows: each row at its own magnitude, values down to 2**-12 of it (the
    subnormal codes), some all-zero latent tiles (the smallest scale)."""
    x = torch.randn(r, 576, generator=gen) * torch.exp2(torch.randint(-2, 3, (r, 1), generator=gen).float())
    x = x * torch.exp2(torch.randint(-12, 1, (r, 576), generator=gen).float())
    zero_tiles = torch.rand(r, 4, generator=gen) < 0.15
    x[:, :512] = x[:, :512].masked_fill(zero_tiles.repeat_interleave(128, dim=1), 0.0)
    return quantize_kv(x)


def edge_rows(gen: torch.Generator, t: int, k: int, r: int) -> torch.Tensor:
    """``[t, k]`` rows with invalid entries anywhere (-1 and out of range), an empty row (2), a
    row listing rows twice (4) and identical neighbours (5, 6)."""
    rows = torch.randint(0, r, (t, k), generator=gen, dtype=torch.int32)
    rows[torch.rand(t, k, generator=gen) < 0.2] = -1
    rows[0, ::3] = r + 5
    rows[min(2, t - 1)] = -1
    if t > 4:
        rows[4, : k // 2] = rows[4, k // 2 : 2 * (k // 2)]
    if t > 6:
        rows[5] = rows[6]
    return rows


def _close_to_oracle(out, lse, q, cache, rows, length, sinks, tol) -> tuple[bool, str]:
    kv64 = torch.from_numpy(fp8_rows_decode(cache.numpy()))
    want_o, want_l = sparse_mla_oracle(q, kv64, rows, scale=SCALE, v_dim=V_DIM, topk_length=length, sinks=sinks)
    fin = torch.isfinite(want_l)
    if not torch.equal(fin, torch.isfinite(lse)):
        return False, "LSE finiteness differs"
    err = ((out.double() - want_o).norm() / want_o.norm().clamp_min(1e-30)).item()
    lse_err = (lse.double()[fin] - want_l[fin]).abs().max().item() if fin.any() else 0.0
    empty = ~fin.any(dim=1) if sinks is None else torch.zeros(len(fin), dtype=torch.bool)
    zero_rows = bool((out[empty] == 0).all())
    return err < tol and lse_err < tol and zero_rows, f"rel_err={err:.1e} lse_err={lse_err:.1e}"


def prefill_cases(gen: torch.Generator, dtype: torch.dtype, name: str, tol: float) -> None:
    """Per-query (``G = 1``) and grouped (``G = 2, 4, 8``) tiles over FP8 rows."""
    t, k, r = 9, 24, 40
    cache = fp8_cache(gen, r)
    deq = dequantize_kv(cache, dtype)
    for heads, g in ((16, 1), (8, 2), (16, 4), (8, 8), (128, 1)):
        q = (torch.randn(t, heads, 576, generator=gen) * 0.5).to(dtype)
        rows = edge_rows(gen, t, k, r)
        sinks = torch.randn(heads, generator=gen) if g == 4 else None
        union, lens = build_union(rows, group_size=g, num_kv_rows=r)
        cfg = tile_config(heads, g, interpret=True)
        out8, lse8 = launch_attention(q, cache, union, lens, scale=SCALE, v_dim=V_DIM, config=cfg, sinks=sinks)
        out, lse = launch_attention(q, deq, union, lens, scale=SCALE, v_dim=V_DIM, config=cfg, sinks=sinks)
        ok, detail = _close_to_oracle(out8, lse8, q, cache, rows, None, sinks, tol)
        ok_deq, _ = _close_to_oracle(out, lse, q, cache, rows, None, sinks, tol)
        _report(f"prefill[{name},H={heads},G={g}]", ok and ok_deq, detail)


def _decode(q, kv, rows, length, sinks, splits, merge):
    """The Triton split kernel over each token's unique rows (as ``sparse_mla_decode`` runs it) and
    the merge of its ``splits`` partials."""
    t, h, _ = q.shape
    rows, length = build_union(rows, group_size=1, num_kv_rows=kv.shape[0], topk_length=length)
    width = rows.shape[1]
    per_split = -(-width // splits)
    chunk = -(-per_split // 16) * 16  # 16-row steps: several splits at this tiny top-k
    cfg = {**sparse_mla_decode_config(t, h, width, 132, splits), "BLOCK_N": 16, "chunk": chunk}
    cfg["num_splits"] = -(-width // chunk)
    assert cfg["num_splits"] == splits, cfg
    out = torch.empty(t, h, V_DIM, dtype=q.dtype)
    lse = torch.empty(t, h)
    if splits == 1:  # the kernel writes the result
        launch_split_kernel(q, kv, rows, length, sinks, out, lse, out, lse, cfg, SCALE)
        return out, lse
    part_o, part_l = split_partials(None, splits, t, h, V_DIM, q.device)
    launch_split_kernel(q, kv, rows, length, sinks, part_o, part_l, out, lse, cfg, SCALE)
    (launch_lse_merge_columns if merge == "columns" else launch_lse_merge)(part_o, part_l, out, lse)
    return out, lse


def decode_cases(gen: torch.Generator, dtype: torch.dtype, name: str, tol: float) -> None:
    """The split decode kernel (partials, then the row or column merge) over FP8 rows, with
    ``topk_length`` and sinks."""
    t, k, r = 7, 40, 50
    cache = fp8_cache(gen, r)
    deq = dequantize_kv(cache, dtype)
    # one split: the kernel's whole list, three 16-row steps (its prefetch two steps ahead)
    cases = ((16, 3, "columns", True, False), (8, 2, "rows", False, True), (16, 1, "none", True, True))
    for heads, splits, merge, with_len, with_sinks in cases:
        q = (torch.randn(t, heads, 576, generator=gen) * 0.5).to(dtype)
        rows = edge_rows(gen, t, k, r)
        length = torch.randint(0, k + 3, (t,), generator=gen, dtype=torch.int32) if with_len else None
        sinks = torch.randn(heads, generator=gen) if with_sinks else None
        out8, lse8 = _decode(q, cache, rows, length, sinks, splits, merge)
        out, lse = _decode(q, deq, rows, length, sinks, splits, merge)
        ok, detail = _close_to_oracle(out8, lse8, q, cache, rows, length, sinks, tol)
        ok_deq, _ = _close_to_oracle(out, lse, q, cache, rows, length, sinks, tol)
        _report(f"decode[{name},H={heads},S={splits},{merge}]", ok and ok_deq, detail)


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1 before running this module", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(int(os.environ.get("SHARDATTN_SEED", "0")))
    for dtype, name, tol in ((torch.float16, "fp16", 3e-3), (torch.float32, "fp32", 1e-6)):
        prefill_cases(gen, dtype, name, tol)
        decode_cases(gen, dtype, name, tol)
    print(f"{len(FAILURES)} failures: {FAILURES}", flush=True)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
