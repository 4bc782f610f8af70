"""The cost-model router: gates, the fastest predicted path, calibration files, and the Runtime's choice.

The model is pure host code, so CI checks the choice logic with tables built here; the
distributed test runs the routed step on gloo ranks against the single-process reference.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
import torch.distributed as dist

from shardattn.launch.workloads import build_prefill
from shardattn.ops.sparse_mla import sparse_mla_reference
from shardattn.plan.cost import (
    CONSERVATIVE,
    Calibration,
    CalibrationWarning,
    CollectiveRate,
    CostModel,
    KernelPoint,
    StepOverhead,
    candidate_group_sizes,
    load_calibration,
    shipped_calibration,
)
from shardattn.plan.cost_choice import choose_prefill
from shardattn.plan.spec import ModelSpec
from shardattn.plan.step_shape import StepShape
from shardattn.runtime.options import PrefillOptions
from shardattn.runtime.runtime import Runtime

MLA = ModelSpec("sparse_mla", 8, 1, 48, 32, 16, 16, dtype="float32", softmax_scale=0.3)  # not 48 ** -0.5


def _table(*, a2a_gbps: float, small_heads_ms: float, eight_heads_ms: float = 1.0) -> Calibration:
    """A table where a per-query call costs ``small_heads_ms`` per 1M (token x key) at <= 4 heads
    and ``eight_heads_ms`` at 8 heads: tiny head counts waste the tile, so ShardQ pays when collectives are fast."""
    pts = []
    for heads, ms in ((1, small_heads_ms), (2, small_heads_ms), (4, small_heads_ms), (8, eight_heads_ms)):
        pts += [KernelPoint(heads, 64, 1, 1.0, t, 1024, ms * t * 1024 / 2**20) for t in (1024, 4096)]
    return Calibration(
        gpu="Test GPU",
        kernels=tuple(pts),
        collectives=tuple(CollectiveRate("all_to_all", w, 0.01, a2a_gbps) for w in (2, 4)),
        copy_gbps=4000.0,
        union_ratio={2: 1.2, 4: 1.3, 8: 1.4},
        steps={"shardq": StepOverhead(0.01, 1.0), "headtp": StepOverhead(0.0, 1.0)},
        source="test",
    )


SHARDQ_WINS = _table(a2a_gbps=1000.0, small_heads_ms=1.0)  # 4 heads per rank cost what 8 heads cost
HEADTP_WINS = _table(a2a_gbps=0.5, small_heads_ms=0.5)  # linear in heads, and a very slow link
# the Runtime test's steps are tiny (64 tokens, top-k 16): kernel rates large enough to outweigh latency
RT_SHARDQ_WINS = _table(a2a_gbps=1000.0, small_heads_ms=1e4, eight_heads_ms=1e4)


def _shape(world: int, tokens: int = 4096) -> StepShape:
    return StepShape(heads=8, world_size=world, tokens=tokens, topk=1024, head_dim=48, v_dim=32, dtype_bytes=4)


# -- choice logic -----------------------------------------------------------------------------------
@pytest.mark.parametrize("table", [SHARDQ_WINS, HEADTP_WINS, CONSERVATIVE], ids=["shardq", "headtp", "default"])
def test_router_picks_head_tp_on_one_rank(table) -> None:
    choice = choose_prefill(CostModel(table), _shape(1), min_shard_tokens=1)
    assert choice.best.step == "headtp"
    assert "one rank" in choice.reason


def test_router_picks_head_tp_below_the_gate() -> None:
    choice = choose_prefill(CostModel(SHARDQ_WINS), _shape(2, tokens=1000), min_shard_tokens=1024)
    assert choice.best.step == "headtp"
    assert "1000 tokens < min_shard_tokens=1024" in choice.reason
    above = choose_prefill(CostModel(SHARDQ_WINS), _shape(2, tokens=4096), min_shard_tokens=1024)
    assert above.best.step == "shardq"


@pytest.mark.parametrize(("table", "want"), [(SHARDQ_WINS, "shardq"), (HEADTP_WINS, "headtp")], ids=["fast", "slow"])
@pytest.mark.parametrize("world", [2, 4])
def test_router_picks_the_fastest_predicted_path(table, want, world) -> None:
    model = CostModel(table)
    shape = _shape(world)
    choice = choose_prefill(model, shape, min_shard_tokens=1)
    preds = model.predict(shape, steps=("headtp", "shardq"))
    assert choice.best == min(preds, key=lambda p: p.ms)
    assert choice.best.step == want
    other = min((p for p in preds if p.step != want), key=lambda p: p.ms)
    assert choice.rejected == other and other.ms > choice.best.ms
    assert f"{choice.best.ms:.2f} ms" in choice.reason and f"{other.ms:.2f} ms" in choice.reason


def test_prediction_parts_add_up_and_scale() -> None:
    model = CostModel(SHARDQ_WINS)
    p = model.predict_step(_shape(2), "shardq")
    assert math.isclose(p.ms, p.kernel_ms + p.comm_ms + p.other_ms)
    assert p.kernel_ms == pytest.approx(model.kernel_ms(8, 2048, 1024))  # all heads, half the tokens
    assert model.kernel_ms(8, 8192, 1024) == pytest.approx(2 * model.kernel_ms(8, 4096, 1024))  # linear in tokens
    assert model.kernel_ms(6, 4096, 1024) == pytest.approx(0.5 * (model.kernel_ms(4, 4096, 1024) + 4.0))
    slow = CostModel(SHARDQ_WINS, collective_overrides={"all_to_all": CollectiveRate("all_to_all", 2, 0.01, 1.0)})
    assert slow.predict_step(_shape(2), "shardq").comm_ms > 100 * p.comm_ms


def test_predictions_are_the_documented_sums_of_their_terms() -> None:
    # a table of exact lines (ms = a_h + b_h * tokens * topk at 8 and 32 heads), one rate per
    # collective and overheads that hide half the exposed time: each step's time written out here
    # term by term from the model's definitions (kernel, collectives moving (W-1)/W of their bytes,
    # copies reading and writing what moves, the step's overhead on those)
    lines = {8: (0.05, 1e-6), 32: (0.08, 2.5e-6)}
    pts = tuple(
        KernelPoint(h, 64, 1, 1.0, t, 1024, a + b * t * 1024) for h, (a, b) in lines.items() for t in (1024, 4096)
    )
    ov = {"headtp": StepOverhead(0.01, 1.0), "shardq": StepOverhead(0.1, 1.5, 0.5), "pcp": StepOverhead(0.2, 1.25, 0.4)}
    rates = {"all_to_all": (0.02, 200.0), "all_gather": (0.03, 100.0)}
    table = Calibration(
        gpu="Test GPU",
        kernels=pts,
        collectives=tuple(CollectiveRate(op, 4, lat, gbps) for op, (lat, gbps) in rates.items()),
        copy_gbps=1000.0,
        union_ratio={2: 1.2, 4: 1.3, 8: 1.4},
        steps=ov,
        source="test",
    )
    model = CostModel(table)
    h, w, t, k, d, dv, e = 80, 4, 4096, 512, 576, 512, 2
    shape = StepShape(heads=h, world_size=w, tokens=t, topk=k, head_dim=d, v_dim=dv, dtype_bytes=e)

    def line(heads: int, tokens: int) -> float:
        a, b = lines[heads]
        return a + b * tokens * k

    def coll(op: str, nbytes: int) -> float:
        lat, gbps = rates[op]
        return lat + nbytes * (w - 1) / w / (gbps * 1e9) * 1e3

    def total(step: str, kernel: float, comm: float, moved: int) -> float:
        exposed = comm + 2 * moved / 1e12 * 1e3
        o = ov[step]
        return kernel + o.fixed_ms + o.factor * (exposed - o.hidden * min(exposed, kernel))

    # head-TP: 20 heads a rank, halfway between the 8- and 32-head lines
    kernel = 0.5 * line(8, t) + 0.5 * line(32, t)
    assert model.predict_step(shape, "headtp").ms == pytest.approx(kernel + 0.01, rel=1e-9)
    # ShardQ: all 80 heads on a quarter of the tokens (past 32 heads: proportional to the heads);
    # this rank's 20 heads of every token out as queries and back as outputs and fp32 LSEs
    kernel = line(32, t // w) * h / 32
    q_bytes, o_bytes = t * (h // w) * d * e, t * (h // w) * (dv * e + 4)
    comm = coll("all_to_all", q_bytes) + coll("all_to_all", o_bytes)
    pred = model.predict_step(shape, "shardq")
    assert (pred.kernel_ms, pred.comm_ms) == (pytest.approx(kernel, rel=1e-9), pytest.approx(comm, rel=1e-9))
    assert pred.ms == pytest.approx(total("shardq", kernel, comm, q_bytes + o_bytes), rel=1e-9)
    # PCP: the new tokens' KV rows all-gathered; the rank's outputs and LSEs of its heads copied
    comm = coll("all_gather", t * d * e)
    moved = t * d * e + (t // w) * h * (dv * e + 4)
    pred = model.predict_step(shape, "pcp")
    assert pred.comm_ms == pytest.approx(comm, rel=1e-9)
    assert pred.ms == pytest.approx(total("pcp", kernel, comm, moved), rel=1e-9)


def test_candidate_groups_fit_the_tile() -> None:
    assert candidate_group_sizes(16) == (1, 2, 4)
    assert candidate_group_sizes(128) == (1,)
    model = CostModel(CONSERVATIVE)
    names = {p.name for p in model.predict(StepShape(heads=16, world_size=2, tokens=8192, topk=2048))}
    assert {"headtp/grouped G=8", "shardq/grouped G=4", "pcp/per-query"} <= names


# -- calibration files ------------------------------------------------------------------------------
def test_table_round_trips_through_json() -> None:
    assert Calibration.from_json(SHARDQ_WINS.to_json()) == SHARDQ_WINS


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (None, "does not exist"),
        ("{not json", "unusable"),
        ('{"format": 1, "gpu": "Test GPU"}', "unusable"),
        ("negative", "unusable"),
        ("other-gpu", "measured on 'Other GPU'"),
    ],
    ids=["missing", "corrupt", "incomplete", "negative-rate", "other-gpu"],
)
def test_bad_calibration_file_warns_and_falls_back(tmp_path, content, match) -> None:
    path = tmp_path / "cal.json"
    if content == "negative":
        bad = dataclasses.replace(SHARDQ_WINS, copy_gbps=-1.0)
        path.write_text(bad.to_json())
    elif content == "other-gpu":
        path.write_text(dataclasses.replace(SHARDQ_WINS, gpu="Other GPU").to_json())
    elif content is not None:
        path.write_text(content)
    with pytest.warns(CalibrationWarning, match=match) as record:
        cal = load_calibration("Test GPU", path)
    assert cal is CONSERVATIVE
    assert "-m shardattn.calibrate --out FILE" in str(record[0].message)
    assert choose_prefill(CostModel(cal), _shape(2)).best.ms > 0  # the default still answers


def test_matching_file_is_used_without_warning(tmp_path) -> None:
    path = tmp_path / "cal.json"
    path.write_text(SHARDQ_WINS.to_json())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_calibration("test  gpu", path) == SHARDQ_WINS  # names compare case- and space-insensitively


def test_unknown_gpu_warns_and_gets_the_default() -> None:
    with pytest.warns(CalibrationWarning, match="no calibration table ships for GPU 'Imaginary GPU 9000'"):
        assert load_calibration("Imaginary GPU 9000") is CONSERVATIVE


def test_shipped_h200_table_loads() -> None:
    cal = shipped_calibration("NVIDIA H200")
    if cal is None:
        pytest.skip("no H200 table shipped in this checkout")
    assert not cal.conservative and any(c.op == "all_to_all" and c.world_size == 2 for c in cal.collectives)
    model = CostModel(cal)  # validates
    assert model.kernel_format("fp8_ds_mla") == "fp8_ds_mla"  # FP8 steps priced by FP8 kernel points

    def per_query_shapes(fmt: str) -> set[tuple[int, int]]:
        return {(k.heads, k.tokens) for k in cal.kernels if k.group_size == 1 and k.kv_format == fmt}

    assert per_query_shapes("fp8_ds_mla") == per_query_shapes("bfloat16"), "FP8 points at the bf16 points' shapes"


# -- the Runtime's routed step ----------------------------------------------------------------------
def _routed_body(group, table: Calibration) -> dict:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    seq, cached = [40, 24], (8, 0)
    step = build_prefill(
        heads=MLA.num_heads,
        head_dim=MLA.head_dim,
        tokens=sum(seq),
        requests=2,
        cached=cached,
        topk=MLA.topk,
        overlap="dsa",
        dtype=torch.float32,
        device=torch.device("cpu"),
        seed=3,
        block_size=MLA.page_size,
    )
    options = PrefillOptions(min_shard_tokens=1, cost_model=CostModel(table))
    rt = Runtime(MLA, group, max_batched_tokens=64, mode="mixed", prefill_options=options)
    plan = rt.plan_prefill(step.query_lens, step.prefix_lens, kv_rows=int(step.kv.shape[0]))
    rt.comm.reset_counts()
    h = MLA.num_heads // world
    out, lse = rt.prefill(step.q[:, rank * h : (rank + 1) * h].contiguous(), step.kv, step.rows, plan=plan)
    ref_out, ref_lse = sparse_mla_reference(step.q, step.kv, step.rows, scale=0.3, v_dim=MLA.v_dim)
    err = float((out - ref_out[:, rank * h : (rank + 1) * h]).abs().max())
    same_inf = torch.equal(torch.isinf(lse), torch.isinf(ref_lse[:, rank * h : (rank + 1) * h]))
    return {"step": plan.step, "reason": plan.route.reason, "err": err, "inf": same_inf, "counts": dict(rt.comm.counts)}


@pytest.mark.distributed
@pytest.mark.parametrize(("table", "want"), [(RT_SHARDQ_WINS, "shardq"), (HEADTP_WINS, "headtp")], ids=["sq", "tp"])
def test_runtime_takes_the_cost_models_choice(dist_pool, table, want) -> None:
    results = dist_pool.run(_routed_body, table, world_size=2)
    for res in results:
        assert res["step"] == want, res
        assert res["reason"].startswith("cost model (Test GPU): ") and "best rejected" in res["reason"]
        assert res["err"] <= 1e-5 and res["inf"], res
        assert res["counts"].get("all_to_all", 0) == (2 if want == "shardq" else 0)
        assert res["counts"].get("agreement", 0) == 1, res  # a head-TP step the cost model picks agrees too


def _bad_rows_on_rank_1(group, table: Calibration) -> str:
    """Rank 1's rows are 1-D on a step the cost model runs head-TP (no collective of its own)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    options = PrefillOptions(min_shard_tokens=1, cost_model=CostModel(table))
    rt = Runtime(MLA, group, max_batched_tokens=64, mode="mixed", prefill_options=options)
    h, t = MLA.num_heads // world, 24
    q, kv = torch.randn(t, h, MLA.head_dim), torch.randn(40, MLA.head_dim)
    rows = torch.randint(0, 40, (t, MLA.topk), dtype=torch.int32)
    try:
        rt.prefill(q, kv, rows[0] if rank == 1 else rows, query_lens=[t])
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.distributed
def test_a_bad_tensor_on_a_cost_model_head_tp_step_raises_on_every_rank(dist_pool) -> None:
    first, second = dist_pool.run(_bad_rows_on_rank_1, HEADTP_WINS, world_size=2)
    assert "rank(s) [1] of 2 rejected their inputs" in first, first  # at once, not at the group's timeout
    assert second.startswith("rows must have 2 dimensions"), second


# -- calibration and step measurement on the CPU ---------------------------------------------------------
def test_calibrate_command_writes_a_loadable_table(tmp_path) -> None:
    from shardattn.calibrate.__main__ import main

    out = tmp_path / "cpu.json"
    argv = ["--out", str(out), "--heads", "8", "16", "--tokens", "32", "64", "--topk", "8", "--cached", "32"]
    assert main([*argv, "--reps", "1", "--no-progress", "--cpu"]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cal = load_calibration("cpu", out)
    assert {(k.heads, k.group_size, k.tokens) for k in cal.kernels} == {
        (h, g, t) for t in (32, 64) for h, g in ((8, 1), (8, 8), (16, 1), (16, 4))
    }
    assert all(k.ms > 0 and k.topk == 8 for k in cal.kernels)
    assert choose_prefill(CostModel(cal), _shape(2)).best.ms > 0


def test_median_points_keeps_each_jobs_median_pass() -> None:
    """Fresh random times over shuffled passes: every job keeps the (lower) median of its passes,
    as a point one pass measured; passes over other jobs are refused."""
    from shardattn.calibrate.kernels import median_points

    gen = torch.Generator().manual_seed(7)
    jobs = [(8, 1, 32), (8, 8, 32), (16, 4, 64), (128, 1, 64)]
    for n_passes in (1, 2, 3, 4, 5):
        times = torch.rand(n_passes, len(jobs), generator=gen).add_(0.1).tolist()
        passes = []
        for i in range(n_passes):
            order = torch.randperm(len(jobs), generator=gen).tolist()
            passes.append([KernelPoint(h, 64, g, 1.0 + i, t, 8, times[i][j]) for j in order for h, g, t in [jobs[j]]])
        got = {(p.heads, p.group_size, p.tokens): p for p in median_points(passes)}
        assert list(got) == [(p.heads, p.group_size, p.tokens) for p in passes[0]]
        for j, job in enumerate(jobs):
            col = sorted(times[i][j] for i in range(n_passes))
            assert got[job].ms == col[(n_passes - 1) // 2]
            i = [times[k][j] for k in range(n_passes)].index(got[job].ms)
            assert got[job].union_ratio == 1.0 + i  # the whole point of that pass, not a mix
    one = [KernelPoint(8, 64, 1, 1.0, 32, 8, 1.0)]
    with pytest.raises(ValueError, match="pass 1 timed other jobs"):
        median_points([one, [dataclasses.replace(one[0], tokens=64)]])
    with pytest.raises(ValueError, match="at least one pass"):
        median_points([])


def test_calibrate_passes_are_recorded_and_checked(tmp_path, capsys) -> None:
    from shardattn.calibrate.__main__ import main

    out = tmp_path / "cpu.json"
    argv = ["--out", str(out), "--heads", "8", "--tokens", "32", "--topk", "8", "--cached", "32", "--reps", "1"]
    argv.append("--cpu")
    assert main([*argv, "--no-progress", "--no-steps", "--passes", "2"]) == 0
    cal = Calibration.from_json(out.read_text())
    assert "kernel points the median of 2 pass(es)" in cal.source
    assert {(k.heads, k.group_size, k.tokens) for k in cal.kernels} == {(8, 1, 32), (8, 8, 32)}
    capsys.readouterr()
    assert main([*argv, "--no-progress", "--passes", "0"]) == 2
    assert capsys.readouterr().err == "shardattn.calibrate: error: --passes must be >= 1, got 0\n"


def test_calibrate_merge_into_keeps_the_tables_collectives_and_steps(tmp_path, capsys) -> None:
    """``--merge-into``: new kernel points in place of the table's at the same key, the table's
    other points, collectives and step overheads; another GPU's table is refused before anything
    is measured, in one line."""
    from shardattn.calibrate.__main__ import main

    table = dataclasses.replace(RT_SHARDQ_WINS, gpu="cpu", source="two-rank run")
    path = tmp_path / "table.json"
    path.write_text(table.to_json())
    out = tmp_path / "merged.json"
    argv = ["--out", str(out), "--heads", "8", "--tokens", "32", "--topk", "8", "--cached", "32", "--reps", "1"]
    argv.append("--cpu")
    assert main([*argv, "--no-progress", "--merge-into", str(path)]) == 0
    merged = Calibration.from_json(out.read_text())
    assert merged.collectives == table.collectives and merged.steps == table.steps
    fresh = {(k.heads, k.group_size, k.tokens) for k in merged.kernels} - {
        (k.heads, k.group_size, k.tokens) for k in table.kernels
    }
    assert fresh == {(8, 1, 32), (8, 8, 32)}
    assert set(table.kernels) <= set(merged.kernels)  # the table's points at other keys are kept
    assert merged.source.startswith("two-rank run; bfloat16 kernel points re-measured: ")
    # FP8 points added to a bf16 table: its bf16 points stay (the table must keep them to load),
    # and so does the note of the run that measured them
    assert main([*argv, "--no-progress", "--merge-into", str(out), "--kv-dtype", "fp8_ds_mla"]) == 0
    both = Calibration.from_json(out.read_text())
    assert {k.kv_format for k in both.kernels} == {"bfloat16", "fp8_ds_mla"}
    assert {k for k in both.kernels if k.kv_format == "bfloat16"} == set(merged.kernels)
    assert both.source.startswith(merged.source + "; fp8_ds_mla kernel points re-measured: "), both.source
    capsys.readouterr()
    path.write_text(dataclasses.replace(table, gpu="Other GPU").to_json())
    assert main([*argv, "--no-progress", "--merge-into", str(path)]) == 2
    err = capsys.readouterr().err
    assert "the table is for 'Other GPU', this GPU is 'cpu'" in err and err.count("\n") == 1


def _paths_body(group) -> dict:
    from shardattn.calibrate.steps import measure_paths

    model = CostModel(RT_SHARDQ_WINS)
    return measure_paths(
        group, MLA, tokens=64, requests=2, cached=16, device=torch.device("cpu"), model=model, reps=1, warmup=0,
        min_shard_tokens=1, min_group_tokens=1,
    )  # fmt: skip


@pytest.mark.distributed
def test_measure_paths_times_every_path_with_its_prediction(dist_pool) -> None:
    for res in dist_pool.run(_paths_body, world_size=2):
        assert set(res["ms"]) == set(res["predicted_ms"]) == {"kernel", "kernel_headtp", "headtp", "shardq", "router"}
        assert all(v > 0 for v in res["ms"].values())
        assert res["path"]["headtp"].startswith("headtp/") and res["path"]["shardq"].startswith("shardq/")
        assert res["path"]["router"].startswith("shardq/")  # the table makes ShardQ the faster
        assert res["reason"]["router"].startswith("cost model (Test GPU)")
        assert res["rank_tokens"] == 32


def test_kernel_points_are_keyed_by_kv_format() -> None:
    """A table's fp8_ds_mla points price FP8 steps; without them (the conservative default) the
    bf16 points do; PCP's all-gather moves the format's row bytes (656 for fp8_ds_mla)."""
    import dataclasses

    from shardattn.plan.cost import KernelPoint

    bf16 = CostModel(CONSERVATIVE)
    assert bf16.kernel_format("fp8_ds_mla") == "bfloat16"
    args = (64, 8192, 2048)
    assert bf16.kernel_ms(*args, kv_format="fp8_ds_mla") == bf16.kernel_ms(*args)
    fp8_points = tuple(dataclasses.replace(k, ms=k.ms / 2, kv_format="fp8_ds_mla") for k in CONSERVATIVE.kernels)
    both = CostModel(dataclasses.replace(CONSERVATIVE, kernels=CONSERVATIVE.kernels + fp8_points))
    assert both.kernel_format("fp8_ds_mla") == "fp8_ds_mla"
    assert both.kernel_ms(*args, kv_format="fp8_ds_mla") < both.kernel_ms(*args) == bf16.kernel_ms(*args)
    shape = StepShape(heads=64, world_size=4, tokens=8192, topk=2048)
    fp8 = dataclasses.replace(shape, kv_format="fp8_ds_mla")
    assert (shape.kv_row_bytes, fp8.kv_row_bytes) == (1152, 656)
    assert bf16.predict_step(fp8, "pcp").comm_ms < bf16.predict_step(shape, "pcp").comm_ms
    bad = KernelPoint(8, 64, 1, 1.0, 4096, 2048, 1.0, kv_format="int8")
    with pytest.raises(ValueError, match="bad KV format 'int8'"):
        dataclasses.replace(CONSERVATIVE, kernels=(*CONSERVATIVE.kernels, bad)).validate()


# -- a step's shape and what predict_step takes -----------------------------------------------------
@pytest.mark.parametrize(("heads", "world"), [(4, 8), (12, 8), (6, 4)])
def test_heads_that_do_not_divide_over_the_ranks_are_refused(heads: int, world: int) -> None:
    """Head-TP gives each rank ``heads / world_size`` heads: 4 heads on 8 ranks priced ShardQ's
    exchange at 0 bytes (``4 // 8``), so a shape whose heads do not divide is refused."""
    want = rf"^StepShape.heads must be a multiple of StepShape.world_size .*heads={heads}, world_size={world}"
    with pytest.raises(ValueError, match=want):
        StepShape(heads=heads, world_size=world, tokens=8192, topk=2048)
    model = CostModel(CONSERVATIVE)
    for h in (8, 16):  # dividing heads: the exchange moves bytes, more heads more of them
        assert model.predict_step(StepShape(heads=h, world_size=8, tokens=8192, topk=2048), "shardq").comm_ms > 0


@pytest.mark.parametrize(
    ("ratio", "exc", "match"),
    [
        ({2: -5.0}, ValueError, r"^StepShape.union_ratio\[2\] must be a finite number > 0, got -5.0"),
        ({4: 0.0}, ValueError, r"^StepShape.union_ratio\[4\] must be a finite number > 0, got 0.0"),
        ({8: math.inf}, ValueError, r"^StepShape.union_ratio\[8\] must be a finite number > 0, got inf"),
        ({2: math.nan}, ValueError, r"^StepShape.union_ratio\[2\] must be a finite number > 0, got nan"),
        ({2: "1.2"}, TypeError, r"^StepShape.union_ratio\[2\] must be a float"),
        ({1: 1.0}, ValueError, r"^StepShape.union_ratio's G must be one of \(2, 4, 8\), got 1"),
        ({16: 2.0}, ValueError, r"^StepShape.union_ratio's G must be one of \(2, 4, 8\), got 16"),
        ({"2": 1.2}, TypeError, r"^StepShape.union_ratio's G must be an int, got str"),
        ([1.2], TypeError, r"^StepShape.union_ratio must be a dict of G -> ratio, got list"),
    ],
    ids=["negative", "zero", "inf", "nan", "str", "G-1", "G-16", "G-str", "list"],
)
def test_union_ratio_is_checked(ratio: object, exc: type, match: str) -> None:
    """A negative union ratio priced a grouped step at a negative time; a ratio at G = 1 (per-query,
    which no ratio scales) was silently unused."""
    with pytest.raises(exc, match=match):
        StepShape(heads=8, world_size=2, tokens=8192, topk=2048, union_ratio=ratio)


def test_union_ratio_given_prices_the_grouped_step() -> None:
    shape = StepShape(heads=8, world_size=2, tokens=8192, topk=2048, union_ratio={2: 1, 8: 1.5})
    assert shape.union_ratio == {2: 1.0, 8: 1.5} and all(type(v) is float for v in shape.union_ratio.values())
    model = CostModel(CONSERVATIVE)
    wider = dataclasses.replace(shape, union_ratio={2: 1.9, 8: 1.5})
    assert model.predict_step(wider, "shardq", 2).kernel_ms > model.predict_step(shape, "shardq", 2).kernel_ms > 0


@pytest.mark.parametrize("world", [1, 2], ids=["one-rank", "two-ranks"])
@pytest.mark.parametrize(
    ("step", "group_size", "exc", "match"),
    [
        ("bogus", 1, ValueError, r"^step must be 'headtp', 'shardq' or 'pcp', got 'bogus'"),
        ("shardq", 0, ValueError, r"^group_size must be >= 1, got 0"),
        ("headtp", 3, ValueError, r"^group_size must be one of \(1, 2, 4, 8\), got 3"),
        ("shardq", 2.0, TypeError, r"^group_size must be an int, got float"),
    ],
    ids=["step", "G-0", "G-3", "G-float"],
)
def test_predict_step_checks_its_arguments_at_every_world_size(world, step, group_size, exc, match) -> None:
    """One rank took every step as head-TP before looking at it (``"bogus"`` priced as head-TP),
    and G = 0 divided by zero (in ``kernel_ms`` too)."""
    model = CostModel(CONSERVATIVE)
    with pytest.raises(exc, match=match):
        model.predict_step(StepShape(heads=64, world_size=world, tokens=8192, topk=2048), step, group_size)
    if step != "bogus":
        with pytest.raises(exc, match=match):
            model.kernel_ms(8, 4096, 2048, group_size=group_size)
    with pytest.raises(TypeError, match=r"^shape must be a StepShape, got dict"):
        model.predict_step({"heads": 64}, "headtp")


def test_calibrate_cpu_flag_measures_on_the_cpu_where_there_is_a_gpu(monkeypatch) -> None:
    """``--cpu`` means the CPU, also on a GPU machine: its table is named ``cpu`` and its ranks use gloo."""
    from shardattn.calibrate.merge import measure_device, this_gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert measure_device(cpu=False) == torch.device("cuda", 0)
    assert measure_device(cpu=True) == torch.device("cpu")
    assert this_gpu(measure_device(cpu=True)) == "cpu"


def test_the_shipped_table_never_prices_more_heads_cheaper() -> None:
    """The H200 table's 8-head points are slower than its 16-head ones (measured so): a head-TP step
    of 128 heads on 8 ranks (16 a rank) is predicted at least as slow as one of 64 (8 a rank)."""
    model = CostModel(shipped_calibration("NVIDIA H200") or CONSERVATIVE)
    small, large = (model.predict_step(StepShape(h, 8, 65536, 2048), "headtp") for h in (64, 128))
    assert large.ms >= small.ms, (small, large)
    assert model.kernel_ms(16, 16384, 2048) >= model.kernel_ms(8, 16384, 2048)


def test_a_step_on_fp8_rows_says_which_kernel_points_priced_it() -> None:
    """fp8_ds_mla steps on a table without fp8_ds_mla points are priced by its bfloat16 points; the
    reason names the format and says so (and says nothing of the kind once the table has them)."""
    shape = StepShape(heads=64, world_size=2, tokens=8192, topk=2048, kv_format="fp8_ds_mla")
    bf16_only = choose_prefill(CostModel(CONSERVATIVE), shape).reason
    assert "fp8_ds_mla KV rows priced by the table's bfloat16 kernel points" in bf16_only, bf16_only
    assert "-m shardattn.calibrate" in bf16_only, bf16_only
    fp8_points = tuple(dataclasses.replace(k, kv_format="fp8_ds_mla") for k in CONSERVATIVE.kernels)
    both = CostModel(dataclasses.replace(CONSERVATIVE, kernels=CONSERVATIVE.kernels + fp8_points))
    own = choose_prefill(both, shape).reason
    assert "fp8_ds_mla KV rows priced by its own kernel points" in own and "bfloat16" not in own, own
    dense = choose_prefill(CostModel(CONSERVATIVE), dataclasses.replace(shape, kv_format=None)).reason
    assert "KV rows" not in dense, dense


MLA_DSA = ModelSpec("sparse_mla", 4, 1, 576, 512, 16, 16, dtype="float32", softmax_scale=0.3)


def _fp8_routed_reason(group, table: Calibration) -> str:
    options = PrefillOptions(min_shard_tokens=1, cost_model=CostModel(table))
    rt = Runtime(MLA_DSA, group, max_batched_tokens=64, mode="mixed", prefill_options=options, kv_dtype="fp8_ds_mla")
    return rt.plan_prefill([40, 24], [8, 0], kv_rows=128).route.reason


@pytest.mark.distributed
def test_a_cost_routed_step_on_fp8_rows_names_the_format(dist_pool) -> None:
    """The cost model's route, like the gate's, ends naming the fp8_ds_mla rows, and says which
    kernel points priced them."""
    for reason in dist_pool.run(_fp8_routed_reason, RT_SHARDQ_WINS, world_size=2):
        assert reason.startswith("cost model (Test GPU): ") and reason.endswith("; fp8_ds_mla KV rows"), reason
        assert "priced by the table's bfloat16 kernel points" in reason, reason
