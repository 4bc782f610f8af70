"""What the launcher prints: a table that fits 100 columns, each reason once, notes only where they
apply, the presets in ``--help``, progress off a terminal, and the library's logging."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardattn.launch.cli import build_parser, parse_options, resolve_shape
from shardattn.launch.progress import RunProgress
from shardattn.launch.report import WIDTH, RankRow, Report, render, render_compare
from shardattn.launch.runner import plan_run
from shardattn.plan.cost import CONSERVATIVE, CostModel
from shardattn.plan.cost_choice import choose_prefill
from shardattn.plan.spec import PRESETS, get_preset
from shardattn.plan.step_shape import StepShape

CPU = torch.device("cpu")
ROUTED = "cost model (NVIDIA H200): ShardQ G=8 3.42 ms predicted, best rejected head-TP 2.54 ms"


def _worst_case() -> Report:
    """A 4-rank --compare run on GPUs with the longest labels and numbers the table shows."""
    rows = []
    for variant, path in (("head-TP", "headtp/per-query"), ("ShardQ", "shardq/grouped G=8"), ("router", None)):
        for r in range(4):
            rows.append(RankRow(r, "prefill", path or "shardq/grouped G=8", ROUTED, 16384, 12345.678, 12001.2,
                                13999.9, 1.234, 612.5, None, 5e-2, 3e-2, variant))  # fmt: skip
    for r in range(4):
        rows.append(RankRow(r, "decode", "dcp/triton (graph)", "CUDA graph replay", 256, 0.01234, 0.0111,
                            0.0133, None, None, 1234.5, 1.2e-7, 3e-2))  # fmt: skip
    config = {"preset": "deepseek-v32", "mode": "mixed", "world_size": 4, "backend": "nccl", "dtype": "bfloat16"}
    return Report(config, rows, ["a note that is longer than one line of the terminal " * 3])


def test_the_report_fits_100_columns_off_a_terminal_and_says_why_once(capsys) -> None:
    """Before: a 160-column console off a terminal (a 165-column table) and the reason on every row."""
    report = _worst_case()
    render(report)  # pytest's captured stdout is not a terminal
    render_compare(report)
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert WIDTH == 100 and max(len(line) for line in lines) <= WIDTH, max(lines, key=len)
    assert text.count("cost model (NVIDIA H200)") == 3 + 3, text  # once per variant, once in the compare table
    assert text.count("CUDA graph replay") == 1, text
    for cell in ("shardq/grouped G=8", "headtp/per-query", "612.5 TFLOP/s", "1234 GB/s", "5.0e-02 FAIL"):
        assert cell in text, cell  # whole, not folded over two lines
    assert "check FAILED" in text and "3e-02" in text


def test_shardq_gate_note_only_where_shardq_runs() -> None:
    def notes(*argv: str) -> str:
        return " ".join(plan_run(parse_options(list(argv)), 2, CPU).notes)

    assert "ShardQ gate lowered" in notes("--mode", "mixed")
    assert "ShardQ gate lowered" in notes("--mode", "headtp", "--compare")
    for mode in ("headtp", "pcp", "dcp-decode"):
        assert "ShardQ gate lowered" not in notes("--mode", mode), mode
    # one rank never shards (its step runs head-TP, and says so): no gate to lower
    assert "ShardQ gate lowered" not in " ".join(plan_run(parse_options(["--mode", "shardq"]), 1, CPU).notes)


def test_conservative_cost_model_reason_reads_plainly() -> None:
    shape = StepShape.of(get_preset("glm5"), 2, 8192)
    reason = choose_prefill(CostModel(CONSERVATIVE), shape).reason
    assert reason.startswith("cost model (the conservative default): "), reason
    assert "(default (conservative))" not in reason


def test_preset_help_lists_the_presets() -> None:
    text = " ".join(build_parser().format_help().split())
    assert f"model preset: {', '.join(sorted(PRESETS))} (default glm5)" in text
    for name in PRESETS:  # every preset's own scale, the one a run takes without --softmax-scale
        assert f"{name} {get_preset(name).softmax_scale:.4g}" in text.split("--softmax-scale")[2], name
    for defaults in ("(default: 2 CPU; GPU 4, 64 in dcp-decode)", "default 128 CPU, 8192 GPU)"):
        assert defaults in text, defaults
    gpu = resolve_shape(parse_options([]), on_gpu=True, preset_topk=2048, decode_only=True)
    cpu = resolve_shape(parse_options([]), on_gpu=False, preset_topk=2048, decode_only=True)
    assert (gpu.requests, gpu.cached[0], cpu.requests, cpu.cached[0]) == (64, 8192, 2, 128)
    assert "--log-level {debug,info,warning,error}" in text
    assert parse_options(["--log-level", "debug"]).log_level == "debug"


def test_progress_off_a_terminal_says_nothing_for_a_quick_run_then_a_line_per_phase() -> None:
    now = [0.0]
    out = io.StringIO()
    p = RunProgress("shardattn.launch", file=out, terminal=False, quiet_s=2.0, every_s=5.0, clock=lambda: now[0])
    p.phase("building the Runtime")
    now[0] = 1.0
    p.tick()
    assert out.getvalue() == "", "nothing while the run is younger than quiet_s"
    now[0] = 2.5
    p.tick()  # the running phase, once the run is old enough
    p.phase("prefill: timing", total=4)
    p.advance()
    now[0] = 4.0
    p.tick()  # too soon after the phase's line
    now[0] = 8.0
    p.tick()
    p.close()
    assert out.getvalue().splitlines() == [
        "shardattn.launch: building the Runtime",
        "shardattn.launch: prefill: timing",
        "shardattn.launch: prefill: timing 1/4, 6 s, about 16 s left",
    ]


def test_the_library_configures_no_logging_handler() -> None:
    code = (
        "import logging, shardattn.runtime.runtime, shardattn.launch.runner, shardattn.calibrate.__main__\n"
        "print([h for name in ('shardattn', 'shardattn.runtime.planning') for h in logging.getLogger(name).handlers])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _log_body(group) -> list[str]:
    import logging

    from shardattn.runtime.options import PrefillOptions
    from shardattn.runtime.runtime import Runtime
    from tests.test_runtime import MLA, _prefill_step

    seen: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: seen.append(f"{record.levelname} {record.name}: {record.getMessage()}")  # type: ignore[method-assign]
    logger = logging.getLogger("shardattn")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        rt = Runtime(
            MLA, group, max_batched_tokens=128, mode="shardq", prefill_options=PrefillOptions(min_shard_tokens=1)
        )
        step = _prefill_step()
        rt.plan_prefill(step.query_lens, step.prefix_lens)
        rt.decode_route  # noqa: B018  (its route is logged once, when first asked)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    return seen


@pytest.mark.distributed
def test_route_decisions_are_logged_at_debug_on_the_shardattn_logger(dist_pool) -> None:
    for records in dist_pool.run(_log_body, world_size=2):
        prefill = [r for r in records if r.startswith("DEBUG shardattn.runtime.planning: prefill of 62 tokens")]
        assert prefill and "shardq, reference G=1: no GPU" in prefill[0], records
        assert any(r.startswith("DEBUG shardattn.runtime.planning: decode steps (head-TP): reference") for r in records)
    assert dist.is_available()


#: gqa-64-8 at 16 heads on head-TP ranks, a sliding window of 3: 12 new tokens after 5 and 30
#: cached ones; decode 1 and 3 queries after them
WINDOWED = ["--preset", "gqa-64-8", "--heads", "16", "--mode", "headtp", "--tokens", "24", "--requests", "2",
            "--cached", "5,30", "--query-len", "1,3", "--window", "3", "--iters", "1"]  # fmt: skip


def _visible(query_pos: torch.Tensor, keys: int, window: int) -> torch.Tensor:
    """``[Q, keys]``: the causal keys each query position sees, its last ``window + 1`` (-1: all)."""
    k = torch.arange(keys)[None, :]
    seen = k <= query_pos[:, None]
    return seen & (k >= query_pos[:, None] - window) if window >= 0 else seen


def _launch(group, argv: list[str]) -> None:
    """The launcher's run on the pool's ranks (``argv``: its options)."""
    from shardattn.launch.process_group import DistEnv, LaunchGroups
    from shardattn.launch.runner import run

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    cfg = plan_run(parse_options([*argv, "--no-progress"]), world, CPU)
    groups = LaunchGroups(DistEnv(rank, world, rank, None, None), CPU, group, group, "gloo", 60.0)
    assert run(cfg, groups) == 0


@pytest.mark.distributed
def test_a_windowed_step_reports_the_work_of_its_window(dist_pool, tmp_path) -> None:
    """Regression: a GQA step's rate counted every causal key of a query (prefill FLOPs, decode
    bytes read) where a sliding window reads its last window + 1 only, so a windowed run's TFLOP/s
    and GB/s were inflated; the rate is the window's work over the time (counted here from masks)."""
    path = tmp_path / "r.json"
    dist_pool.run(_launch, [*WINDOWED, "--json", str(path)], world_size=2)
    report = json.loads(path.read_text())
    assert report["passed"] and report["config"]["window"] == 3
    spec, window, elem, heads, kv_heads = get_preset("gqa-64-8"), 3, 4, 8, 4  # per rank: 16 / 2 and 8 / 2 heads
    cached, new, q_lens = (5, 30), (12, 12), (1, 3)
    pairs = sum(int(_visible(torch.arange(c, c + n), c + n, window).sum()) for c, n in zip(cached, new))
    read = sum(int(_visible(torch.arange(c, c + q), c + q, window).any(0).sum()) for c, q in zip(cached, q_lens))
    flops = 4.0 * spec.head_dim * heads * pairs
    nbytes = (read * kv_heads + sum(q_lens) * heads) * spec.head_dim * 2 * elem
    for row in report["rows"]:
        work = (
            row["tflops"] * 1e9 * row["time_ms"]
            if row["step"] == "prefill"
            else row["gbytes_per_s"] * 1e6 * row["time_ms"]
        )
        assert work == pytest.approx(flops if row["step"] == "prefill" else nbytes, rel=1e-9), row


@pytest.mark.distributed
def test_a_shardq_step_the_gate_keeps_on_head_tp_says_so(dist_pool, tmp_path) -> None:
    """Regression: mode shardq with the gate above the step ran head-TP and said only why its kernel
    is the kernel it is ("no GPU: torch reference"); the reason now starts with the gate."""
    path = tmp_path / "r.json"
    dist_pool.run(_launch, ["--mode", "shardq", "--min-shard-tokens", "300", "--json", str(path)], world_size=2)
    rows = json.loads(path.read_text())["rows"]
    prefill = [r for r in rows if r["step"] == "prefill"]
    assert len(prefill) == 2 and all(r["path"] == "headtp/reference" for r in prefill), prefill
    for r in prefill:
        assert r["reason"].startswith("min_tokens=300 > max_batched_tokens=256: head-TP; no GPU"), r["reason"]


def _report_dir_removed(group, path: str) -> tuple[int, str]:
    """The launcher's run whose --json directory, writable when the options were checked, is gone
    when the report is written: the rank's status and what it said on stderr."""
    import contextlib
    import os

    from shardattn.launch.process_group import DistEnv, LaunchGroups
    from shardattn.launch.runner import run

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    cfg = plan_run(parse_options(["--mode", "dcp-decode", "--json", path, "--no-progress"]), world, CPU)
    dist.barrier(group)  # every rank has checked the path before it goes
    if rank == 0:
        os.rmdir(os.path.dirname(path))
    groups = LaunchGroups(DistEnv(rank, world, rank, None, None), CPU, group, group, "gloo", 60.0)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = run(cfg, groups)
    return status, err.getvalue()


@pytest.mark.distributed
def test_a_report_the_file_system_refuses_at_the_end_is_one_line(dist_pool, tmp_path) -> None:
    """Regression: a --json path that could no longer be written when the run ended (its directory
    removed, a full disk) raised a traceback on rank 0 after the table and left its peers to time
    out; it is one line from rank 0 naming where the report was kept instead, and status 2 on every
    rank."""
    (tmp_path / "out").mkdir()
    path = tmp_path / "out" / "r.json"
    results = dist_pool.run(_report_dir_removed, str(path), world_size=2)
    assert [status for status, _ in results] == [2, 2]
    lines = results[0][1].strip().splitlines()
    said = f"shardattn.launch: error: --json {path}: could not write the report (No such file or directory; kept in "
    assert len(lines) == 1 and lines[0].startswith(said) and lines[0].endswith(".json)"), lines
    kept = Path(lines[0][len(said) : -1])
    assert json.loads(kept.read_text())["config"]["mode"] == "dcp-decode", "the report, kept elsewhere"
    kept.unlink()
    assert results[1][1] == "" and not path.exists()
