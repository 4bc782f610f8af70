"""ptxas's resource report of a compiled kernel's PTX (registers, local-memory spills), for the
sm_90 compile tests: the PTX is assembled again by the ptxas the installed Triton ships, with
``-v``, on the CPU (no GPU needed).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PtxasReport:
    """Registers a thread uses (the kernel's launch maximum under ``setmaxnreg``) and the bytes a
    thread spills to local memory (stores, loads)."""

    registers: int
    spill_stores: int
    spill_loads: int


def ptxas_path() -> str | None:
    """The ptxas Triton uses for sm_90, or None when it cannot be found."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(90).path
    except Exception:
        return None


def ptxas_report(ptx: str, arch: str = "sm_90a") -> PtxasReport:
    """Assemble ``ptx`` for ``arch`` and parse ptxas's ``-v`` report.

    Raises:
        RuntimeError: no ptxas, or it failed (its message included).
    """
    ptxas = ptxas_path()
    if ptxas is None:
        raise RuntimeError("no ptxas in the installed Triton")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        proc = subprocess.run(
            [ptxas, f"-arch={arch}", "-v", str(src), "-o", str(Path(tmp) / "kernel.cubin")],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed: {proc.stderr[-2000:]}")
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", proc.stderr)
    regs = re.search(r"Used (\d+) registers", proc.stderr)
    if spills is None or regs is None:
        raise RuntimeError(f"no resource report in ptxas's output: {proc.stderr[-2000:]}")
    return PtxasReport(int(regs.group(1)), int(spills.group(1)), int(spills.group(2)))
