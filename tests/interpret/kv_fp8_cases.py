"""The FP8 KV-row write kernel under the interpreter, against the oracle and the torch reference.

Run as ``TRITON_INTERPRET=1 python -m tests.interpret.kv_fp8_cases`` (tests/test_kv_fp8.py does
this in a subprocess). Under the interpreter :func:`quantize_kv` and :func:`write_kv` run the
Triton kernel on CPU tensors; each case compares its bytes (and ``status``) with the torch
reference and the independent oracle (tests/fp8_oracle.py). fp16 and fp32 rows only (the
interpreter does not run bf16). The kernel rounds with integer operations, so the interpreter
runs the GPU's arithmetic; the ``ties`` rows put every e4m3 rounding tie and its fp32 neighbours
in the latent. Prints one line per case and exits 1 on any mismatch.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

from shardattn.ops.kv_fp8 import WRITE_SKIPPED, quantize_kv, quantize_kv_reference, write_kv
from tests.fp8_oracle import E4M3, fp8_rows_oracle, make_rows

FAILURES: list[str] = []


def _report(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILURES.append(name)


def tie_rows(dtype: torch.dtype) -> torch.Tensor:
    """Rows whose tiles have scale 1 (each holds 448) and whose other latent values are every
    midpoint between neighbouring e4m3 values, both signs, and (fp32) their neighbours one ulp away."""
    mids = (E4M3[1:] + E4M3[:-1]) / 2
    vals = [mids, -mids]
    if dtype == torch.float32:
        m32 = mids.astype(np.float32)
        vals += [
            np.nextafter(m32, np.float32(np.inf)),
            np.nextafter(m32, np.float32(0)),
            -np.nextafter(m32, np.float32(0)),
        ]
    flat = np.concatenate(vals)
    per_tile = 127  # one slot of each tile holds 448
    tiles = -(-flat.size // per_tile)
    flat = np.resize(flat, tiles * per_tile).reshape(tiles, per_tile)
    latent = np.concatenate([np.full((tiles, 1), 448.0), flat], axis=1).reshape(-1)
    latent = np.resize(latent, (-(-latent.size // 512)) * 512).reshape(-1, 512)
    rope = np.linspace(-3, 3, 64)[None, :].repeat(latent.shape[0], axis=0)
    return torch.from_numpy(np.concatenate([latent, rope], axis=1)).to(dtype)


def quantize_case(name: str, rows: torch.Tensor, as_pair: bool = False) -> None:
    """``quantize_kv`` on ``rows`` (``as_pair``: as ``(latent, rope)`` views of a wider buffer)."""
    status = torch.full((rows.shape[0],), -1, dtype=torch.int32)
    if as_pair:
        wide = torch.zeros(rows.shape[0], 600, dtype=rows.dtype)
        wide[:, :576] = rows
        packed = quantize_kv((wide[:, :512], wide[:, 512:576]), status=status)
    else:
        packed = quantize_kv(rows, status=status)
    ref, ref_status = quantize_kv_reference(rows)
    want, flags = fp8_rows_oracle(rows.double().numpy())
    ok = torch.equal(packed, ref) and torch.equal(packed, torch.from_numpy(want))
    ok = ok and torch.equal(status, ref_status) and status.tolist() == [int(f) for f in flags]
    _report(name, ok, f"rows={rows.shape[0]} differing bytes={(packed != torch.from_numpy(want)).sum().item()}")


def write_case(gen: torch.Generator, layout: str, slot_dtype: torch.dtype, dtype: torch.dtype, seed: int) -> None:
    pages, page_size, n = 3, 4, 9
    pad = int(layout == "padded")
    storage = torch.randint(0, 256, (pages, page_size + pad, 656), dtype=torch.uint8, generator=gen)
    cache = storage[:, :page_size].reshape(-1, 656) if layout == "flat" else storage[:, :page_size]
    slots = torch.randperm(pages * page_size + 4, generator=gen)[:n] - 2  # distinct; -2, -1, 12, 13 skip
    slots[0] = 2**31 - 1 if slot_dtype == torch.int32 else 2**40
    rows = make_rows(seed, n, "fp16" if dtype == torch.float16 else "fp32")
    expect = storage.clone()
    ref, ref_flags = quantize_kv_reference(rows)
    want_status = []
    for i, s in enumerate(slots.tolist()):
        if 0 <= s < pages * page_size:
            expect[s // page_size, s % page_size] = ref[i]
            want_status.append(int(ref_flags[i]))
        else:
            want_status.append(WRITE_SKIPPED)
    status = torch.full((n,), -1, dtype=torch.int32)
    write_kv(cache, slots.to(slot_dtype), rows, status=status)
    dt = str(dtype).replace("torch.", "")
    name = f"write[{layout},{str(slot_dtype).replace('torch.', '')},dtype={dt}]"
    _report(name, torch.equal(storage, expect) and status.tolist() == want_status, f"status={status.tolist()}")


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1 before running this module", file=sys.stderr)
        return 2
    seed = int(os.environ.get("SHARDATTN_SEED", "0"))
    gen = torch.Generator().manual_seed(seed)
    for dtype in (torch.float16, torch.float32):
        dt = str(dtype).replace("torch.", "")
        quantize_case(f"ties[dtype={dt}]", tie_rows(dtype))
        quantize_case(f"random[dtype={dt}]", make_rows(seed, 6, "fp16" if dtype == torch.float16 else "fp32"))
        quantize_case(f"pair[dtype={dt}]", make_rows(seed + 1, 3, "fp16" if dtype == torch.float16 else "fp32"), True)
        for layout in ("paged", "padded", "flat"):
            for slot_dtype in (torch.int32, torch.int64):
                write_case(gen, layout, slot_dtype, dtype, seed)
    print(f"{len(FAILURES)} failures: {FAILURES}", flush=True)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
