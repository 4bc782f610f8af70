"""Every sparse-prefill Triton kernel under TRITON_INTERPRET=1 at tiny shapes (fp16 and fp32).

The interpreter must be switched on before Triton is imported, so the cases run in a subprocess
(tests/interpret/prefill_cases.py); each case compares with its torch reference.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardattn.kernels.registry import triton_available

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.interpret
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_prefill_kernels_match_references_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "SHARDATTN_SEED": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.interpret.prefill_cases"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[-1] == "0 failures: []"
    names = [ln.split()[1] for ln in lines if ln.startswith("ok")]
    # the case list covers every group size and head count the issue names
    for g in (1, 2, 4, 8):
        assert any(f"G={g}" in n and n.startswith("attention") for n in names)
        assert any(f"union[G={g}" in n for n in names)
    for h in (8, 16, 32, 64, 128):
        assert any(f"H={h}," in n for n in names)
    assert "attention[groups" in " ".join(names) and any("dcp" in n for n in names)
