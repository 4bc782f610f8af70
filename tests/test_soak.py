"""Short soaks (CPU, gloo): the Runtime over hundreds of random steps, the Ray pool with ranks killed.

The benchmarks ``benchmarks/soak_runtime.py`` and ``benchmarks/soak_pool.py`` run for minutes or
hours on a GPU host; here they run at CI length and their own verdicts are checked field by field:
every checked output right, nothing compiled or left unwarmed after the warm-up, not one live tensor
more after it (the strict check at this length: a step that kept one tensor would show hundreds),
RSS within 3 % (the allocator's drift at this length is ~0.3 %; a leak of 40 KB a step would pass
it), no request lost without ``restart()`` saying so, no KV page leaked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardattn.serving.errors import ray_unavailable_reason

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def _run(args: list[str], timeout: float = 300.0) -> subprocess.CompletedProcess:
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    env["CUDA_VISIBLE_DEVICES"] = ""  # gloo ranks on the CPU, on any machine
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_runtime_soak_keeps_memory_flat_and_compiles_nothing_after_warm_up(tmp_path: Path) -> None:
    details = tmp_path / "soak_runtime.json"
    proc = _run([
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(BENCH / "soak_runtime.py"),
        "--steps", "200", "--warmup-steps", "40", "--check-every", "10", "--sample-every", "20",
        "--max-growth-pct", "3", "--details", str(details),
    ])  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(details.read_text())
    assert run["passed"] and len(run["ranks"]) == 2
    for r in run["ranks"]:
        assert r["steps"] == 200 and r["prefill_steps"] > 20 and r["decode_steps"] > 100, r
        assert r["prefill_steps"] + r["decode_steps"] == 200, r  # the warm-up's calls are not steps
        # a check every 10th step and the warm-up's two
        assert r["checks"] == 22 and r["failed_checks"] == 0 and r["max_err"] < 1e-4, r
        assert r["compiles_after_warmup"] == 0 and r["unwarmed_routes"] == 0, r
        assert len(r["live_tensors"]) >= 8 and r["live_tensor_growth"] == 0, r["live_tensors"]
        assert r["rss_growth_pct"] is not None and r["rss_growth_pct"] < 3.0, r["rss_mb"]


@pytest.mark.skipif(
    ray_unavailable_reason() is not None, reason=f"optional dependency missing: {ray_unavailable_reason()}"
)
def test_pool_soak_loses_nothing_unreported_and_leaks_nothing(tmp_path: Path) -> None:
    """80 steps of traffic, a rank killed between steps (step 20) and one exiting inside a decode
    step (from step 50): two failures, each followed by restart()."""
    details = tmp_path / "soak_pool.json"
    proc = _run([
        sys.executable, str(BENCH / "soak_pool.py"), "--steps", "80", "--kill-steps", "20", "--fault-steps", "50",
        "--kill-every", "0", "--sample-steps", "10", "--warmup-s", "2", "--max-growth-pct", "3",
        "--device", "cpu", "--details", str(details),
    ])  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(details.read_text())
    assert run["passed"] and run["steps"] == 80
    assert run["outputs_checked"] >= 100 and run["wrong_outputs"] == 0 and run["max_err"] < 2e-5, run["errors"]
    assert run["failures"] == 2 and [k["how"] for k in run["kills"]] == ["between steps", "inside a decode step"]
    assert run["lost_reported"] > 0 and run["lost_unreported"] == 0 and run["reported_unknown"] == 0
    assert run["pages_leaked"] == 0 and run["page_mismatches"] == 0 and run["requests_left_in_ledger"] == 0
    assert run["refused"] >= 1 and run["refusals_unclear"] == 0
    assert run["driver_tensors_leaked"] == 0 and all(v == 0 for v in run["rank_live_tensor_growth"].values())
    assert run["driver_rss_growth_pct"] is not None and run["driver_rss_growth_pct"] < 3.0
