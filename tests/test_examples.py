"""The examples run as a user would run them: their ``main(group)`` on 2 ranks, and one script end to end."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NAMES = ["shardq_prefill", "dcp_decode", "gqa_spec_decode"]
RAY_NAMES = ["ray_service"]  # run by tests/test_ray_pool.py, on that module's Ray instance


def _run_example(group, name: str) -> str:
    """Load ``examples/<name>.py`` on this rank and run its ``main(group)``; returns what it printed."""
    import contextlib
    import io

    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        module.main(group)  # raises SystemExit when its own check fails
    return buf.getvalue()


def test_every_example_is_listed() -> None:
    assert sorted(p.stem for p in EXAMPLES.glob("*.py")) == sorted(NAMES + RAY_NAMES)


@pytest.mark.distributed
@pytest.mark.parametrize("name", NAMES)
def test_example_main_on_two_ranks(dist_pool, name: str) -> None:
    printed = dist_pool.run(_run_example, name, world_size=2)
    for rank, text in enumerate(printed):
        assert text.startswith(f"rank {rank}: "), text
        error = float(text.rsplit(" ", 1)[-1])
        assert error <= 1e-4, text


def test_example_script_spawns_its_own_ranks() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "gqa_spec_decode.py")], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert [line.split(":")[0] for line in lines] == ["rank 0", "rank 1"], proc.stdout
    assert all("drafts [1, 3, 2] -> out (6, 32, 64)" in line for line in lines)
