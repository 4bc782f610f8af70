"""Scripts run under ``TRITON_INTERPRET=1`` in a subprocess (the switch must precede ``import triton``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_cases(script: str, **env: str) -> list[str]:
    """Run ``python -m tests.interpret.<script>`` from the repository root with
    ``TRITON_INTERPRET=1`` (and ``env``); assert it exits 0 and return its stdout lines."""
    proc = subprocess.run(
        [sys.executable, "-m", f"tests.interpret.{script}"],
        cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1", **env}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout.splitlines()
