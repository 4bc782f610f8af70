"""``python -m shardattn.launch`` end to end on the CPU: under torchrun, bad options, a rank that dies.

Each test starts real rank processes (torchrun, or one process per rank with torchrun's
environment, so every rank's exit status can be read).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardattn.testing.pool import free_port

#: Wall-clock bound of one launcher run in these tests (CI: a 2-core box shared with other tests).
RUN_LIMIT_S = 120
ROOT = Path(__file__).resolve().parents[1]
#: The launcher run through test-only replacements (tests/launch_patched.py): argv prefix.
PATCHED = ["-m", "tests.launch_patched"]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    # CPU ranks (gloo) on any machine: auto would give each rank a GPU where there are enough
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "200", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("RANK", None)
    return {**env, **(extra or {})}


def _torchrun(nproc: int, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "shardattn.launch",
        *args,
    ]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=RUN_LIMIT_S)
    return proc, time.monotonic() - start


def _ranks(
    nproc: int,
    *args: str,
    timeout: float = RUN_LIMIT_S,
    rank_args: dict[int, list[str]] | None = None,
    entry: list[str] | None = None,
) -> tuple[list[tuple[int, str, str]], float]:
    """One launcher process per rank, with torchrun's variables; ``[(status, stdout, stderr)]`` per rank.

    ``rank_args`` adds options to some ranks only; ``entry`` replaces ``-m shardattn.launch``.
    """
    port = str(free_port())
    procs = []
    start = time.monotonic()
    for r in range(nproc):
        env = _env(
            {
                "RANK": str(r),
                "WORLD_SIZE": str(nproc),
                "LOCAL_RANK": str(r),
                "LOCAL_WORLD_SIZE": str(nproc),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            }
        )
        extra = (rank_args or {}).get(r, [])
        procs.append(
            subprocess.Popen(
                [sys.executable, *(entry or ["-m", "shardattn.launch"]), *args, *extra],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - start)))
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results, time.monotonic() - start


def _quiet(stderr: str) -> list[str]:
    """The launcher's own stderr lines (without torch's warnings)."""
    return [line for line in stderr.splitlines() if line.strip() and "Warning" not in line and "warn(" not in line]


@pytest.mark.distributed
def test_main_job_four_ranks_prints_the_table_and_checks_itself(tmp_path) -> None:
    path = tmp_path / "report.json"
    proc, elapsed = _torchrun(4, "--json", str(path), "--progress-after", "0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for needle in (
        "rank",
        "union",
        "median ms",
        "TFLOP/s",
        "max err",
        "shardq/",
        "dcp/",
        "check passed",
        "reduced step",
    ):
        assert needle in proc.stdout, f"{needle!r} missing from:\n{proc.stdout}"
    # off a terminal, a run older than --progress-after (2 s by default) says what it is doing, a
    # line per phase, on stderr
    assert "shardattn.launch: prefill: timing (shardq/reference)" in proc.stderr, proc.stderr
    report = json.loads(path.read_text())
    assert report["config"]["world_size"] == 4 and report["config"]["check"] is True
    assert len(report["config"]["workspace_bytes"]) == 4 and "prefill.union" in report["config"]["workspace_items"]
    assert report["checked"] and report["passed"]
    rows = report["rows"]
    assert sorted((r["rank"], r["step"]) for r in rows) == sorted(
        (r, s) for r in range(4) for s in ("prefill", "decode")
    )
    assert all(r["passed"] and r["error"] is not None and r["error"] <= 1e-4 for r in rows)
    prefill = [r for r in rows if r["step"] == "prefill"]
    assert sum(r["tokens"] for r in prefill) == report["config"]["tokens"], "ShardQ splits the step's tokens"
    assert all(r["time_ms"] > 0 and r["time_p10_ms"] <= r["time_ms"] <= r["time_p90_ms"] for r in rows)
    assert elapsed < RUN_LIMIT_S


@pytest.mark.distributed
def test_gqa_speculative_decode_two_ranks(tmp_path) -> None:
    path = tmp_path / "r.json"
    proc, _ = _torchrun(
        2, "--preset", "gqa-64-8", "--query-len", "1,3", "--cached", "60,37", "--json", str(path), "--profile"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("profile of one decode step on rank 0") == 1, proc.stdout  # rank 0 only
    report = json.loads(path.read_text())
    assert report["config"]["mode"] == "dcp-decode" and report["passed"]
    assert [(r["rank"], r["step"], r["tokens"]) for r in report["rows"]] == [(0, "decode", 4), (1, "decode", 4)]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("nproc", "args", "message"),
    [
        (2, ["--mode", "ring"], "argument --mode: invalid choice: 'ring'"),
        (3, [], "preset glm5 has 64 query heads, which 3 ranks cannot split evenly"),
    ],
    ids=["bad-option", "heads-not-divisible"],
)
def test_bad_configuration_one_line_and_every_rank_fails(nproc: int, args: list[str], message: str) -> None:
    results, _ = _ranks(nproc, *args, timeout=60)
    assert [status for status, _, _ in results] == [2] * nproc, results
    lines = [line for _, _, err in results for line in _quiet(err)]
    assert len(lines) == 1, lines
    assert lines[0].startswith("shardattn.launch: error: ") and message in lines[0], lines[0]
    assert all(out == "" for _, out, _ in results)


@pytest.mark.distributed
def test_ranks_started_with_different_options_all_stop() -> None:
    results, _ = _ranks(2, "--mode", "shardq", "--iters", "1", rank_args={1: ["--seed", "7"]}, timeout=90)
    assert [status for status, _, _ in results] == [2, 2], results
    lines = [line for _, _, err in results for line in _quiet(err)]
    assert len(lines) == 1, lines
    assert "launcher options (command line, version, device type): rank(s) [1] disagree" in lines[0], lines
    assert "disagree with rank(s) [0] on --seed (fingerprints" in lines[0], lines  # the option, by its flag


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("fail_at", "timeout", "message"),
    [("step", 30, "a peer rank failed or went silent"), ("setup", 8, "could not form the process group")],
    ids=["dies-before-first-collective", "dies-before-rendezvous"],
)
def test_dead_rank_makes_the_others_exit_within_the_timeout(fail_at: str, timeout: int, message: str) -> None:
    results, elapsed = _ranks(2, "--fail-rank", "1", "--fail-at", fail_at, "--timeout", str(timeout), timeout=90)
    (status0, _, err0), (status1, _, _) = results
    assert status1 == 17, "the injected failure"
    assert status0 == 4, err0
    assert message in err0
    # start-up (imports on a busy 2-core box) plus at most the timeout
    assert elapsed < timeout + 45, f"rank 0 took {elapsed:.0f} s to notice"


@pytest.mark.distributed
def test_failed_check_exits_with_status_3_on_every_rank(tmp_path) -> None:
    """A prefill kernel whose output is off by 0.5 (tests/launch_patched.py) fails ``--check``."""
    path = tmp_path / "r.json"
    args = ["--mode", "shardq", "--tokens", "32", "--topk", "16", "--iters", "1", "--check", "--json", str(path)]
    results, _ = _ranks(2, *args, entry=[*PATCHED, "corrupt-prefill"], timeout=90)
    assert [status for status, _, _ in results] == [3, 3], results
    assert "check FAILED" in results[0][1], results[0][1]
    report = json.loads(path.read_text())
    assert report["checked"] and report["passed"] is False
    prefill = [r for r in report["rows"] if r["step"] == "prefill"]
    assert prefill and all(r["passed"] is False and 0.4 < r["error"] < 0.6 for r in prefill), report["rows"]
    assert all(r["passed"] for r in report["rows"] if r["step"] == "decode"), report["rows"]  # its kernel is sound


@pytest.mark.distributed
@pytest.mark.parametrize(
    "args",
    [
        ["--mode", "mixed", "--tokens", "48", "--topk", "16", "--cached", "40,7", "--query-len", "1,2"],
        ["--mode", "pcp", "--tokens", "40", "--topk", "16", "--cached", "24,0", "--topk-unique"],
        ["--preset", "gqa-64-8", "--query-len", "1,3", "--cached", "30,9", "--non-causal"],
        ["--preset", "gqa-64-8", "--mode", "mixed", "--tokens", "13", "--cached", "9,0", "--query-len", "1,2"],
        ["--preset", "gqa-64-8", "--mode", "pcp", "--tokens", "13", "--cached", "5,11"],
        [
            "--preset",
            "gqa-64-8",
            "--mode",
            "headtp",
            "--tokens",
            "13",
            "--cached",
            "9,4",
            "--query-len",
            "2,1",
            "--window",
            "5",
        ],
    ],
    ids=[
        "mixed-shardq-dcp",
        "pcp-topk-unique",
        "gqa-noncausal-drafts",
        "gqa-mixed-headtp-dcp",
        "gqa-pcp",
        "gqa-headtp-window",
    ],
)
def test_check_against_the_independent_oracle(tmp_path, args: list[str]) -> None:
    """``--check`` with the library references swapped for tests/oracle.py passes (and so measures the steps
    against code they share nothing with)."""
    path = tmp_path / "r.json"
    results, _ = _ranks(2, *args, "--iters", "1", "--check", "--json", str(path), entry=[*PATCHED, "oracle"])
    assert [status for status, _, _ in results] == [0, 0], results
    report = json.loads(path.read_text())
    assert report["checked"] and report["passed"], report["rows"]
    assert all(r["error"] is not None and r["error"] <= 1e-4 for r in report["rows"]), report["rows"]
