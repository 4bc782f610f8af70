"""Run test code under Triton's interpreter (``TRITON_INTERPRET=1``) in a fresh Python process.

The interpreter must be switched on before Triton is imported, so interpreter tests cannot run
in the pytest process (which has imported Triton already); they call a module-level function of
their own module in a subprocess instead.

:func:`interpreter_unusable_reason` says why the installed interpreter cannot run the library's
kernels, by running a kernel of their commonest form in a subprocess: Triton 3.6's interpreter
turns a loop bound into an int with ``int()`` of a one-element array, which numpy 2.4 refuses, so
every kernel whose loop bound is computed (``tl.minimum(lo + chunk, k_len)``) stops in a
``TypeError`` there (Triton 3.9's interpreter squeezes the array first; numpy < 2.4 accepts it).
"""

from __future__ import annotations

import os
import subprocess
import sys

#: Seconds an interpreted run may take.
DEFAULT_TIMEOUT_S = 600.0
#: Seconds the interpreter probe may take.
PROBE_TIMEOUT_S = 120.0


def run_interpreted(module: str, function: str, *args: str, timeout: float = DEFAULT_TIMEOUT_S) -> str:
    """Call ``module.function(*args)`` in a subprocess with ``TRITON_INTERPRET=1``; return its stdout.

    Args:
        module: importable module name (``__name__`` of the calling test module).
        function: name of a module-level function taking string arguments.
        args: string arguments passed through.
        timeout: seconds before the run is killed.
    Raises:
        AssertionError: the subprocess failed; the message holds the ends of its stdout and stderr.
    """
    proc = _interpreted(f"import {module} as m; m.{function}(*{list(args)!r})", timeout)
    assert proc.returncode == 0, f"{module}.{function}{args} failed under the interpreter:\n" + (
        proc.stdout[-3000:] + proc.stderr[-6000:]
    )
    return proc.stdout


def interpreter_probe() -> None:
    """Run a kernel whose loop bound is computed, under the interpreter (called in a subprocess
    by :func:`interpreter_unusable_reason`); raises where the interpreter cannot run it."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _bounded_loop(Lens, Out, K, CHUNK: tl.constexpr):
        t = tl.program_id(0)
        hi = tl.minimum(CHUNK, tl.minimum(tl.load(Lens + t), K))
        acc = tl.zeros([4], tl.int32)
        for _ in range(0, hi, 4):
            acc += 1
        tl.store(Out + t * 4 + tl.arange(0, 4), acc)

    lens = torch.tensor([7, 9], dtype=torch.int32)
    out = torch.zeros(8, dtype=torch.int32)
    _bounded_loop[(2,)](lens, out, 8, 16)
    assert out.tolist() == [2] * 4 + [2] * 4, out.tolist()


def interpreter_unusable_reason(timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the installed Triton interpreter cannot run the library's kernels, or None when it can:
    :func:`interpreter_probe` run in a subprocess under ``TRITON_INTERPRET=1``, and the last line of
    its error with the Triton and numpy versions (a missing Triton is a reason too)."""
    try:
        import numpy
        import triton
    except ImportError as e:
        return f"Triton is not installed ({e})"
    proc = _interpreted(f"import {__name__} as m; m.interpreter_probe()", timeout)
    if proc.returncode == 0:
        return None
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return (
        f"Triton {triton.__version__}'s interpreter fails on a computed loop bound with numpy "
        f"{numpy.__version__} ({last}); it runs with numpy < 2.4, as Triton 3.9's does with any"
    )


def _interpreted(call: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -c call`` under ``TRITON_INTERPRET=1``, its output captured."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-c", call], env=env, capture_output=True, text=True, timeout=timeout)
