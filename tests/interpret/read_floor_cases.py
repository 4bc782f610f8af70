"""The read-floor kernel (benchmarks/read_floor.py) under the interpreter, against its torch reference.

Run as ``TRITON_INTERPRET=1 python -m tests.interpret.read_floor_cases`` (tests/test_read_floor.py
does this in a subprocess). Rows of both formats' widths (bf16: 288 words, fp8_ds_mla: 164), invalid
ids anywhere in a row (negative, past the cache), a row with no valid id, a top-k that is not a
multiple of a program's rows, every configuration. Prints one line per case and exits 1 on any mismatch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from read_floor import CONFIGS, read_rows, read_rows_reference, row_words


def main() -> int:
    failures = 0
    g = torch.Generator().manual_seed(0)
    for width_bytes, dtype in ((1152, torch.bfloat16), (656, torch.uint8)):
        n = 50
        raw = torch.randint(-(2**31), 2**31 - 1, (n, width_bytes // 4), generator=g, dtype=torch.int64)
        kv = raw.to(torch.int32).view(torch.uint8).view(dtype).view(n, -1)
        words = row_words(kv)
        for t, k in ((3, 37), (1, 16), (2, 70)):
            rows = torch.randint(0, n, (t, k), generator=g, dtype=torch.int32)
            rows[0, k // 2] = -1
            rows[-1, -1] = n + 3
            if t > 1:
                rows[1] = -5  # no valid id
            for cfg in CONFIGS:
                got = read_rows(words, rows, cfg)
                want = read_rows_reference(words, rows, cfg[0])
                ok = torch.equal(got, want)
                failures += not ok
                print(f"{'ok  ' if ok else 'FAIL'} width {width_bytes} t {t} k {k} config {cfg}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
