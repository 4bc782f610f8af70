"""Every sparse-prefill Triton kernel under TRITON_INTERPRET=1 at tiny shapes (fp16 and fp32).

The interpreter must be switched on before Triton is imported, so the cases run in a subprocess
(tests/interpret/prefill_cases.py); each case compares with its torch reference.
"""

from __future__ import annotations

import pytest

from shardattn.ops.dispatch import triton_available
from tests.interpret import run_cases


@pytest.mark.interpret
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_prefill_kernels_match_references_under_interpreter():
    lines = run_cases("prefill_cases", SHARDATTN_SEED="0")
    assert lines[-1] == "0 failures: []"
    names = [ln.split()[1] for ln in lines if ln.startswith("ok")]
    # the case list covers every group size and the head counts 8, 16, 32, 64 and 128
    for g in (1, 2, 4, 8):
        assert any(f"G={g}" in n and n.startswith("attention") for n in names)
        assert any(f"union[G={g}" in n for n in names)
    for h in (8, 16, 32, 64, 128):
        assert any(f"H={h}," in n for n in names)
    assert "attention[groups" in " ".join(names) and any("dcp" in n for n in names)
    assert sum(n.startswith("rows_unique[") for n in names) == 4  # packed rows, both entry points
    # a cache past the bitmap's count: the per-query call de-duplicates by hash, then packs
    assert "hashed[route]" in names and sum(n.startswith("hashed[") for n in names) == 5
