"""The launcher's own errors under real ``torchrun``: one line on the terminal, whichever rank finds it.

torchrun stops every rank as soon as one exits non-zero, so a message only rank 0 printed could be
lost when a faster rank exited first (seen in 1 of 6 runs of ``--heads 6`` on 4 ranks). Each case
runs a few times to catch that race; every run must show the line exactly once, and torchrun's
own summary must name it with the rank's exit status (2, :data:`~shardattn.launch.cli.EXIT_USAGE`).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from shardattn.launch.cli import EXIT_USAGE
from tests.test_launch_e2e import RUN_LIMIT_S, _env

CASES = {
    "parse": (2, ["--mode", "ring"], "argument --mode: invalid choice: 'ring'"),  # before torch is imported
    "preset": (2, ["--preset", "nope"], "--preset: unknown model preset 'nope'; known presets: deepseek-v32, glm5"),
    "heads-6-on-4": (4, ["--heads", "6"], "--heads 6 gives 6 query heads, which 4 ranks cannot split evenly"),
    "gqa-shardq": (4, ["--preset", "gqa-64-8", "--mode", "shardq"], "--mode shardq needs a sparse-MLA preset"),
}
#: (case, attempt): the races show up after torch is imported, so those cases run twice.
RUNS = ["parse-0", "preset-0", "preset-1", "heads-6-on-4-0", "heads-6-on-4-1", "gqa-shardq-0"]


@pytest.mark.distributed
@pytest.mark.parametrize("run", RUNS)
def test_torchrun_shows_the_error_once_whichever_rank_exits_first(run: str) -> None:
    nproc, args, message = CASES[run.rsplit("-", 1)[0]]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    proc = subprocess.run(
        [*cmd, "-m", "shardattn.launch", *args], env=_env(), capture_output=True, text=True, timeout=RUN_LIMIT_S
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    ours = [line for line in out.splitlines() if line.startswith("shardattn.launch: error: ")]
    assert len(ours) == 1 and message in ours[0], out
    # torchrun's summary names the rank that printed it, with the launcher's exit status
    assert f"traceback : {ours[0]}" in out, out
    assert f"exitcode  : {EXIT_USAGE} " in out, out
