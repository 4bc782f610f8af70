"""Launcher options ``--heads`` (override the preset's head count) and ``--compare`` (head-TP, ShardQ
and the router's step side by side), parsed and run on CPU gloo ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from shardattn.launch.cli import LaunchError, parse_options
from shardattn.launch.runner import compare_variants, plan_run
from shardattn.plan.cost import CostModel

CPU = torch.device("cpu")


def test_heads_overrides_the_preset() -> None:
    cfg = plan_run(parse_options(["--heads", "16"]), 2, CPU)
    assert cfg.spec.num_heads == 16 and cfg.spec.head_dim == 576  # everything else is glm5's
    assert cfg.describe()["heads"] == 16
    assert cfg.fingerprint() != plan_run(parse_options([]), 2, CPU).fingerprint()


@pytest.mark.parametrize(
    ("argv", "world", "match"),
    [
        (["--heads", "0"], 2, "--heads must be >= 1"),
        (["--heads", "6"], 4, "6 query heads, which 4 ranks cannot split"),
        (["--preset", "gqa-64-8", "--heads", "12"], 2, "--heads 12: num_heads .12. must be a multiple of num_kv_heads"),
        (["--compare", "--mode", "pcp"], 2, "--compare .* mode pcp takes another input layout"),
        (
            ["--compare", "--preset", "gqa-64-8"],
            2,
            "--compare sets sparse-MLA prefill steps .* gqa-64-8 is a GQA model",
        ),
    ],
    ids=["zero", "indivisible", "gqa-groups", "compare-pcp", "compare-gqa"],
)
def test_bad_heads_or_compare_is_one_line(argv: list[str], world: int, match: str) -> None:
    with pytest.raises(LaunchError, match=match) as info:
        plan_run(parse_options(argv), world, CPU)
    assert "\n" not in str(info.value) and info.value.status == 2


def test_compare_runs_three_variants_and_routes_on_the_cpu() -> None:
    cfg = plan_run(parse_options(["--compare", "--mode", "shardq"]), 2, CPU)
    variants = compare_variants(cfg)
    assert [(label, mode) for label, mode, _ in variants] == [
        ("head-TP", "headtp"),
        ("ShardQ", "shardq"),
        ("router", "shardq"),
    ]
    assert variants[1][2] is None and isinstance(variants[2][2], CostModel)  # the model answers on the CPU


@pytest.mark.distributed
def test_compare_with_heads_two_ranks(tmp_path) -> None:
    path = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "shardattn.launch"]
    cmd += ["--heads", "16", "--compare", "--mode", "shardq", "--tokens", "64", "--topk", "16", "--cached", "32"]
    cmd += ["--iters", "1", "--no-progress", "--json", str(path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200", "CUDA_VISIBLE_DEVICES": ""}  # CPU ranks anywhere
    env.pop("RANK", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "prefill paths side by side" in proc.stdout
    report = json.loads(path.read_text())
    assert report["config"]["heads"] == 16 and report["passed"]
    rows = report["rows"]
    assert sorted((r["variant"], r["rank"]) for r in rows) == sorted(
        (v, r) for v in ("head-TP", "ShardQ", "router") for r in (0, 1)
    )
    assert all(r["error"] is not None and r["error"] <= 1e-4 for r in rows)  # every variant checked
    by = {e["variant"]: e for e in report["compare"]}
    assert by["head-TP"]["path"].startswith("headtp/") and by["ShardQ"]["path"].startswith("shardq/")
    assert by["router"]["reason"].startswith("cost model (") and by["head-TP"]["x_headtp"] == 1.0
