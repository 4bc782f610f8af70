"""``python -m shardattn.calibrate`` as a user meets it: refused on a CPU without ``--cpu``, progress
with the time left in any output, no deprecated collective, and no silent zero step model."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardattn.calibrate.__main__ import NO_GPU, build_parser, main
from shardattn.plan.cost import CONSERVATIVE, Calibration, CostModel

SMALL = ["--heads", "8", "--tokens", "32", "--topk", "8", "--cached", "32", "--reps", "1", "--no-steps"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: calibrate runs there")
def test_a_cpu_is_refused_in_one_line_without_cpu(tmp_path, capsys) -> None:
    out = tmp_path / "t.json"
    assert main(["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [NO_GPU] and "--cpu" in NO_GPU and "GPU" in NO_GPU
    assert not out.exists()
    assert "Without CUDA it refuses unless --cpu" in " ".join(build_parser().format_help().split())


def test_progress_and_the_time_left_off_a_terminal(tmp_path, capsys) -> None:
    """Off a terminal (pytest captures stderr) rank 0 says what it will measure, each phase with its
    count, elapsed and the time left, and how long it took."""
    out = tmp_path / "t.json"
    assert main(["--out", str(out), *SMALL, "--passes", "2", "--cpu"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("shardattn.calibrate: ")]
    assert lines[0].startswith("shardattn.calibrate: 2 kernel point(s) x 2 pass(es) on each of 1 rank(s)"), lines
    passes = [line for line in lines if "kernel points, pass 2 of 2" in line]
    assert passes and "2/5" in passes[0] and "left" in passes[0], lines
    assert lines[-1].startswith("shardattn.calibrate: measured in "), lines
    assert Calibration.from_json(out.read_text()).kernels


def _collectives_body(group) -> list[str]:
    from shardattn.calibrate.kernels import collective_rates

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        rates = collective_rates(group, device=torch.device("cpu"), sizes_mib=(1, 2), reps=1)
    assert [r.op for r in rates] == ["all_to_all", "all_gather"]
    return [f"{w.category.__name__}: {w.message}" for w in seen]


@pytest.mark.distributed
def test_collective_rates_call_no_deprecated_collective(dist_pool) -> None:
    for rank, seen in enumerate(dist_pool.run(_collectives_body, world_size=2)):
        assert not [w for w in seen if "deprecated" in w], (rank, seen)


def _degenerate_body(group, ran_shardq: bool = True) -> dict:
    """Whole steps that cost less than their kernel (as on a CPU) fit a zero model: the table keeps
    the conservative overhead and a warning names the steps. ``ran_shardq=False``: the ShardQ
    Runtime ran head-TP (below its gate), which must never be fitted as ShardQ."""
    import argparse

    import shardattn.calibrate.__main__ as cal_main

    def fake_paths(group, spec, *, tokens, **kw) -> dict:  # ShardQ "faster than its kernel"
        ms = {"kernel": 5.0, "kernel_headtp": 4.0, "headtp": 4.5, "shardq": 4.0}
        world = dist.get_world_size(group)
        path = {"shardq": "shardq/per-query" if ran_shardq else "headtp/per-query"}
        reason = {"shardq": "below the gate"}
        return {"ms": ms, "rank_tokens": tokens // world, "ranks_per_node": world, "path": path, "reason": reason}

    real, cal_main.measure_paths = cal_main.measure_paths, fake_paths
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    cal_main.log.addHandler(handler)
    try:
        args = argparse.Namespace(topk=64, cached=32, reps=1, step_tokens=[4096, 16384])
        table = cal_main._fit_steps(CONSERVATIVE, group, torch.device("cpu"), args, lambda: None)
    finally:
        cal_main.measure_paths = real
        cal_main.log.removeHandler(handler)
    return {"shardq": table.steps["shardq"], "pcp": table.steps["pcp"], "records": records}


@pytest.mark.distributed
def test_a_degenerate_step_fit_warns_naming_the_steps_and_is_not_kept(dist_pool) -> None:
    for res in dist_pool.run(_degenerate_body, world_size=2):
        assert res["shardq"] == CONSERVATIVE.steps["shardq"] == res["pcp"], res
        (message,) = res["records"]
        assert "the shardq step overhead fitted to 0.000 ms + 0.000 x" in message, message
        assert message.count("beyond the kernel -1.000 ms") == 8, message  # every step named
        assert "keeps the conservative default" in message


def _headtp_fit_body(group) -> str:
    try:
        _degenerate_body(group, ran_shardq=False)
    except RuntimeError as e:
        return str(e)
    return "fitted"


@pytest.mark.distributed
def test_steps_that_ran_head_tp_are_never_fitted_as_shardq(dist_pool) -> None:
    for message in dist_pool.run(_headtp_fit_body, world_size=2):
        assert message == "the ShardQ step of 4096 tokens ran 'headtp/per-query': {'shardq': 'below the gate'}"


def test_a_fixed_cost_alone_is_a_degenerate_fit() -> None:
    """``factor = 0`` prices every collective at nothing (across hosts too), whatever ``fixed_ms``."""
    from shardattn.calibrate.fit import degenerate_fit
    from shardattn.plan.cost import StepOverhead

    why = degenerate_fit("shardq", StepOverhead(1.19, 0.0), [(0.5, 3.0, 1.19)])
    assert why is not None and "collectives and copies free" in why


def test_whole_step_configurations_that_do_not_divide_are_refused_first(tmp_path, capsys, monkeypatch) -> None:
    """Three ranks split none of the configurations' 64 / 16 / 128 / 32 heads: refused in one line
    before anything is measured (it failed on every rank after the kernel points)."""
    from shardattn.calibrate.__main__ import step_configs

    assert [h for _p, h in step_configs(32)] == [None, None, 32]  # glm5 at 16 heads does not split 32 ways
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "3"), ("MASTER_PORT", "1")):  # rank 0 of torchrun's 3
        monkeypatch.setenv(name, value)
    out = tmp_path / "t.json"
    argv = ["--out", str(out), *[a for a in SMALL if a != "--no-steps"], "--no-progress", "--cpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no whole-step configuration's heads divide over 3 ranks" in err[0], err
    assert "pass --no-steps" in err[0] and not out.exists()


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"RANK": "3", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, "RANK must be in [0, WORLD_SIZE=2), got 3"),
        ({"RANK": "0", "WORLD_SIZE": "two", "MASTER_PORT": "1"}, "incomplete torchrun environment"),
    ],
    ids=["rank-out-of-the-world", "world-size-not-a-number"],
)
def test_a_broken_torchrun_environment_is_one_line(tmp_path, capsys, monkeypatch, environ, message) -> None:
    """Regression: a ``WORLD_SIZE`` that is no integer raised a traceback, and a rank past the world
    exited 2 without a word; both are one line naming the variables."""
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "t.json"
    assert main(["--out", str(out), *SMALL, "--no-progress", "--cpu"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardattn.calibrate: error: ") and message in err[0], err
    assert not out.exists()


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--passes", "0"], "--passes must be >= 1, got 0"),
        (["--reps", "0"], "--reps must be >= 1, got 0"),
        (["--topk", "0"], "--topk must be >= 1, got 0"),
        (["--heads", "8", "0"], "--heads must be >= 1, got 0"),
        (["--cached", "-1"], "--cached must be >= 0, got -1"),
        (["--kv-dtype", "fp4"], "argument --kv-dtype: invalid choice"),
        (["--merge-into", "no/such/table.json"], "--merge-into no/such/table.json: no table readable there"),
        (["--tokens", "4"], "--tokens must be >= 8, got 4"),
        (["--out", "/nonexistent/dir/t.json"], "--out /nonexistent/dir/t.json: cannot write the table there (no dir"),
        (["--out", "/"], "--out /: cannot write the table there (a directory)"),
        (["--step-tokens", "512"], "--step-tokens must be >= 1024, got 512"),
        (["--kv-dtype", "fp8_ds_mla"], "--kv-dtype must include bf16"),
    ],
    ids=[
        "passes-0",
        "reps-0",
        "topk-0",
        "heads-0",
        "cached-negative",
        "kv-dtype",
        "merge-into-missing",
        "tokens-below-a-group",
        "out-no-dir",
        "out-a-dir",
        "step-tokens-below-the-shardq-gate",
        "fp8-points-alone",
    ],
)
def test_a_bad_option_is_one_line_with_status_2(tmp_path, capsys, option, message) -> None:
    """Regression: ``--passes 0`` (and ``--reps 0``, ``--topk 0``, a missing ``--merge-into`` table) raised
    a traceback after the start-up; every bad option is one line on stderr before anything runs."""
    out = tmp_path / "t.json"
    assert main(["--out", str(out), *SMALL, "--no-progress", "--cpu", *option]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardattn.calibrate: error: ") and message in err[0], err
    assert "Traceback" not in captured.err and not out.exists()


@pytest.mark.parametrize(
    ("option", "why"),
    [([], "--no-steps"), (["--merge-into", "t.json"], "--merge-into"), ([], "one rank")],
    ids=["no-steps", "merge-into", "one-rank"],
)
def test_step_tokens_where_no_step_is_timed_is_one_line(tmp_path, capsys, option, why) -> None:
    """Regression: ``--step-tokens`` was taken and ignored where no whole step is timed (``--no-steps``,
    ``--merge-into``, one rank): it is refused naming what times none."""
    small = SMALL if why == "--no-steps" else [a for a in SMALL if a != "--no-steps"]
    argv = ["--out", str(tmp_path / "t.json"), *small, "--no-progress", "--cpu", "--step-tokens", "8192", *option]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"shardattn.calibrate: error: --step-tokens sizes the whole steps, and {why} times none"], err


def test_a_kv_format_listed_twice_is_measured_once(tmp_path) -> None:
    """Regression: ``--kv-dtype bf16 bf16`` timed every point twice in a pass, and the median of the
    passes then raised a traceback after the whole measurement; a format listed twice is one, as a
    head or token count listed twice is."""
    out = tmp_path / "t.json"
    twice = ["--kv-dtype", "bf16", "bf16"]
    assert main(["--out", str(out), *SMALL, "--no-progress", "--cpu", "--passes", "1", *twice]) == 0
    table = Calibration.from_json(out.read_text())
    keys = [(p.kv_format, p.heads, p.group_size, p.tokens) for p in table.kernels]
    assert sorted(keys) == [("bfloat16", 8, 1, 32), ("bfloat16", 8, 8, 32)]


def test_a_table_the_file_system_refuses_at_the_end_is_kept_and_one_line(tmp_path, capsys, monkeypatch) -> None:
    """Regression: an --out that could no longer be written once the points were measured (its
    directory removed, a full disk) raised a traceback and lost the measurement; the table is kept
    in a temporary file, named in one line, status 2."""
    import shardattn.calibrate.__main__ as calibrate_main

    measure = calibrate_main.calibrate
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "t.json"

    def measure_then_lose_the_directory(args, group):
        table = measure(args, group)
        (tmp_path / "out").rmdir()
        return table

    monkeypatch.setattr(calibrate_main, "calibrate", measure_then_lose_the_directory)
    assert main(["--out", str(out), *SMALL, "--no-progress", "--cpu", "--passes", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    said = f"shardattn.calibrate: error: --out {out}: could not write the table (No such file or directory; kept in "
    assert len(err) == 1 and err[0].startswith(said) and err[0].endswith(".json)"), err
    kept = Path(err[0][len(said) : -1])
    assert len(Calibration.from_json(kept.read_text()).kernels) == 2 and not out.exists()
    kept.unlink()


def test_a_merge_into_table_that_does_not_parse_is_one_line(tmp_path, capsys) -> None:
    """A file that is not a table (or a partial one) is refused before anything is measured."""
    out, bad = tmp_path / "t.json", tmp_path / "bad.json"
    for text in ("not json", '{"gpu": "x"}'):
        bad.write_text(text)
        assert main(["--out", str(out), *SMALL, "--no-progress", "--cpu", "--merge-into", str(bad)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--merge-into {bad}: no table readable there (" in err[0], err
        assert not out.exists()


def test_a_merge_keeps_the_union_ratios_it_did_not_measure() -> None:
    """Fresh points of per-query calls only carry the default union ratios: the table's measured
    ones stay; a grouped size it measured replaces the table's."""
    import dataclasses

    from shardattn.calibrate.merge import merge_kernel_points
    from shardattn.plan.calibration import KernelPoint

    table = dataclasses.replace(CONSERVATIVE, gpu="G", union_ratio={2: 1.5, 4: 1.6, 8: 1.7}, conservative=False)
    perq = (KernelPoint(8, 64, 1, 1.0, 4096, 2048, 1.0),)
    fresh = dataclasses.replace(table, kernels=perq, union_ratio=dict(CONSERVATIVE.union_ratio))
    assert merge_kernel_points(table, fresh).union_ratio == {2: 1.5, 4: 1.6, 8: 1.7}
    grouped = (*perq, KernelPoint(8, 64, 8, 1.3, 4096, 2048, 0.8))
    fresh = dataclasses.replace(fresh, kernels=grouped, union_ratio={8: 1.3, 2: 1.16, 4: 1.3})
    assert merge_kernel_points(table, fresh).union_ratio == {2: 1.5, 4: 1.6, 8: 1.3}


def test_a_merge_keeps_the_note_of_each_formats_run() -> None:
    """A table's source names the run behind each KV format's points: a merge replaces the note
    of the formats it measured and keeps the others' (a note of no format is of bfloat16 points)."""
    from shardattn.calibrate.merge import merged_source

    legacy = "two ranks, 12-01; kernel points re-measured: one rank, 12-03, 3 passes"
    fp8 = merged_source(legacy, "one rank, 12-07, 3 passes; extra", {"fp8_ds_mla"})
    assert fp8 == (
        "two ranks, 12-01; bfloat16 kernel points re-measured: one rank, 12-03, 3 passes"
        "; fp8_ds_mla kernel points re-measured: one rank, 12-07, 3 passes"
    )
    again = merged_source(fp8, "one rank, 12-09", {"bfloat16"})
    assert again == (
        "two ranks, 12-01; bfloat16 kernel points re-measured: one rank, 12-09"
        "; fp8_ds_mla kernel points re-measured: one rank, 12-07, 3 passes"
    )
    both = merged_source(again, "one rank, 12-10", {"bfloat16", "fp8_ds_mla"})
    assert both.count("re-measured") == 2 and "12-07" not in both and "12-09" not in both
    first = merged_source("two ranks", "one rank", {"bfloat16"})
    assert first == "two ranks; bfloat16 kernel points re-measured: one rank"


def _wrong_kernel_body(group, corrupt: str) -> str:
    """A path whose kernel writes a constant (``corrupt``: the kernel alone on rank 1 only, or the
    Runtime's steps on every rank), or whose check itself raises on rank 1 only, is refused by
    every rank before it is timed (none is left waiting in a collective)."""
    from unittest import mock

    import shardattn.calibrate.steps as steps
    import shardattn.runtime.prefill as runtime_prefill
    from shardattn.plan.spec import ModelSpec

    real = steps.sparse_mla_grouped_prefill
    rank = dist.get_rank(group)

    def constant(*a, **k):
        out = real(*a, **k)
        out[0].fill_(123.0)
        return out

    def raises(*a, **k):
        raise IndexError("a check that fails on one rank")

    spec = ModelSpec("sparse_mla", num_heads=8, num_kv_heads=1, head_dim=64, v_dim=48, topk=8, page_size=4,
                     dtype="float32", softmax_scale=0.125)  # fmt: skip
    patch, paths = {
        "kernel on rank 1": ((steps, "sparse_mla_grouped_prefill", constant if rank == 1 else real), ("kernel",)),
        "check raises on rank 1": (
            (steps, "sparse_mla_reference", raises if rank == 1 else steps.sparse_mla_reference), ("kernel",)),
        "runtime steps": ((runtime_prefill, "sparse_mla_grouped_prefill", constant), ("headtp",)),
    }[corrupt]  # fmt: skip
    with mock.patch.object(*patch), pytest.raises(RuntimeError) as err:
        steps.measure_paths(group, spec, tokens=32, requests=2, cached=16, device=torch.device("cpu"),
                            model=CostModel(CONSERVATIVE), reps=1, warmup=0, paths=paths)  # fmt: skip
    return str(err.value)


@pytest.mark.distributed
@pytest.mark.parametrize("corrupt", ["kernel on rank 1", "check raises on rank 1", "runtime steps"])
def test_a_path_off_the_reference_is_refused_on_every_rank_before_timing(dist_pool, corrupt: str) -> None:
    for message in dist_pool.run(_wrong_kernel_body, corrupt, world_size=2):
        assert "against the fp32 reference" in message and "nothing timed" in message, message
