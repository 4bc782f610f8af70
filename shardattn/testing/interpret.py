"""Run test code under Triton's interpreter (``TRITON_INTERPRET=1``) in a fresh Python process.

The interpreter must be switched on before Triton is imported, so interpreter tests cannot run
in the pytest process (which has imported Triton already); they call a module-level function of
their own module in a subprocess instead.
"""

from __future__ import annotations

import os
import subprocess
import sys

#: Seconds an interpreted run may take.
DEFAULT_TIMEOUT_S = 600.0


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
    env = dict(os.environ, TRITON_INTERPRET="1")
    call = f"import {module} as m; m.{function}(*{list(args)!r})"
    proc = subprocess.run([sys.executable, "-c", call], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{module}.{function}{args} failed under the interpreter:\n" + (
        proc.stdout[-3000:] + proc.stderr[-6000:]
    )
    return proc.stdout
