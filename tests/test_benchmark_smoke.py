"""The benchmarks still parse their arguments, run end to end where they can on the CPU, and write
records in the one format (``benchmarks/records.py``).

A benchmark that breaks is found here rather than on a GPU run: the CPU dry runs (tiny shapes, the
torch reference paths, gloo) go through the same code that builds inputs, checks outputs against
the reference, times, prints the table and writes the records; their numbers are not looked at.
"""

from __future__ import annotations

import doctest
import importlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from shardattn.ops.kv_fp8 import dequantize_kv
from shardattn.serving.errors import ray_unavailable_reason

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
BENCHMARKS = ("sparse_prefill", "union_build", "decode", "decode_dcp", "scaling", "ray_pool", "decode_fp8_peer",
              "kv_fp8_write", "gqa_prefill", "gqa_prefill_host", "soak_pool", "soak_runtime",
              "shm_roundtrip", "decode_floor", "host_growth", "decode_ab", "decode_packed", "decode_dedup")  # fmt: skip
ENV = {"gpu": "CPU", "date": "2026-12-02", "commit": "abc1234", "command": "python benchmarks/x.py",
       "versions": {"torch": "2.13.0", "triton": "3.9.0"}}  # fmt: skip


def _module(name: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


def _run(args: list[str], timeout: float = 240.0) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


def _records(path: Path) -> list[dict]:
    records = _module("records")
    return records.read_json(path)  # validates every record


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_parses_its_arguments(name: str) -> None:
    parser = _module(name).build_parser()
    assert "--json" in parser.format_help()
    assert parser.parse_args(["--json", "out.json"]).json == "out.json"


def test_gpu_only_benchmarks_refuse_to_run_without_their_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    """Without CUDA (or torchrun) they stop with exit status 2 and say why, before any work."""
    assert _module("decode").main(["--only", "sparse,bogus"]) == 2
    assert "unknown sections ['bogus']" in capsys.readouterr().err
    if "RANK" not in os.environ:
        assert _module("decode_dcp").main([]) == 2
        assert "torchrun" in capsys.readouterr().err
    assert _module("union_build").main(["--heads", "64", "--device", "cpu"]) == 2  # 64 heads are not grouped
    # grouped unions on a cache past 24-bit rows, and nothing to time: refused before any work
    assert _module("union_build").main(["--heads", "8", "--pool-rows", "40000000", "--device", "cpu"]) == 2
    assert _module("union_build").main(["--heads", "--no-dedup", "--device", "cpu"]) == 2
    assert "G = 1" in capsys.readouterr().err
    assert _module("decode_fp8_peer").main([]) == 2
    assert "--peer-lib" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert _module("kv_fp8_write").main([]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
        assert _module("decode_floor").main([]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
        assert _module("profile_decode").main(["--heads", "64"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
        assert _module("decode_ab").main(["--cases", "16x4x64"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
        assert _module("decode_packed").main([]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
        assert _module("decode_dedup").main([]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_decode_ab_reads_its_cases_and_compares_bits(capsys: pytest.CaptureFixture[str]) -> None:
    """Cases are HEADSxTOKENSxTOPK (anything else is refused under ``--cases``); outputs compare by
    their bytes, so -0.0 is not 0.0 and a NaN equals the same NaN."""
    ab = _module("decode_ab")
    assert ab.build_parser().parse_args(["--cases", "16x64x2048", "8X4X512"]).cases == [(16, 64, 2048), (8, 4, 512)]
    for bad in ("16x64", "16x0x64", "ax2x3"):
        with pytest.raises(SystemExit):
            ab.build_parser().parse_args(["--cases", bad])
        assert "--cases" in capsys.readouterr().err
    x = torch.tensor([0.0, float("nan"), float("-inf")])
    assert ab._same_bits(x, x.clone())
    assert not ab._same_bits(x, torch.tensor([-0.0, float("nan"), float("-inf")]))
    assert not ab._same_bits(x, x.double())


def test_sparse_prefill_cpu_run_writes_its_records(tmp_path: Path) -> None:
    out = tmp_path / "sparse_prefill.json"
    text = _run([sys.executable, str(BENCH / "sparse_prefill.py"), "--device", "cpu", "--heads", "4", "16",
                 "--tokens", "32", "--topk", "32", "--kv-rows", "128", "--reps", "1", "--json", str(out)])  # fmt: skip
    assert "routed step rel. error" in text and "sparse-MLA prefill" in text
    assert "routed step, rows unique rel. error" in text  # per-query (G = 1) cases: the topk_unique step too
    recs = _records(out)
    metrics = ["step TFLOP/s", "kernel TFLOP/s", "step TFLOP/s, rows unique"]
    assert [(r["config"]["heads"], r["metric"]) for r in recs] == [(h, m) for h in (4, 16) for m in metrics]
    assert all(r["benchmark"] == "sparse-prefill" and r["value"] > 0 and r["gpu"] == "CPU" for r in recs)
    assert recs[0]["command"].startswith("python benchmarks/sparse_prefill.py --device cpu")
    assert recs[0]["config"] == {"heads": 4, "tokens": 32, "topk": 32, "pass": "first"}


def test_sparse_prefill_rounds_name_themselves_in_the_configuration(tmp_path: Path) -> None:
    out = tmp_path / "sparse_prefill.json"
    _run([sys.executable, str(BENCH / "sparse_prefill.py"), "--device", "cpu", "--heads", "4", "--tokens", "32",
          "--topk", "32", "--kv-rows", "128", "--reps", "1", "--rounds", "3", "--json", str(out)])  # fmt: skip
    recs = _records(out)
    assert [r["metric"] for r in recs] == ["step TFLOP/s", "kernel TFLOP/s", "step TFLOP/s, rows unique"]
    assert all(r["config"] == {"heads": 4, "tokens": 32, "topk": 32, "pass": "first", "rounds": 3} for r in recs)
    bad = subprocess.run([sys.executable, str(BENCH / "sparse_prefill.py"), "--device", "cpu", "--rounds", "0"],
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2 and "--rounds and --reps must be at least 1" in bad.stderr


def test_sparse_prefill_rounds_alternate_the_order_and_take_the_median_of_round_medians() -> None:
    sp = _module("sparse_prefill")
    case = sp.Case.__new__(sp.Case)
    calls: list[str] = []
    case.runs = {name: (lambda name=name: calls.append(name)) for name in ("step", "kernel", "peer")}
    per_round = iter([3.0, 1.0, 2.0, 9.0, 9.0, 9.0, 5.0, 4.0, 6.0])  # rounds 0, 1 (reversed), 2

    def fake_timed(run, flush, reps):
        run()
        return next(per_round)

    with mock.patch.object(sp, "timed", fake_timed):
        ms = case.time(None, 1, rounds=3)
    assert calls == ["step", "kernel", "peer", "peer", "kernel", "step", "step", "kernel", "peer"]
    assert ms == {"step": 5.0, "kernel": 4.0, "peer": 6.0}  # step 3 / 9 / 5, kernel 1 / 9 / 4, peer 2 / 9 / 6


def test_host_growth_cpu_run_records_bytes_per_call(tmp_path: Path) -> None:
    out = tmp_path / "host_growth.json"
    _run([sys.executable, str(BENCH / "host_growth.py"), "--repeats", "300", "--only", "reseeded", "broadcast",
          "--json", str(out)])  # fmt: skip
    recs = _records(out)
    assert [r["config"]["operation"] for r in recs] == ["one generator reseeded", "broadcast, one-rank group"]
    assert all(r["benchmark"] == "host-growth" and r["unit"] == "B" and r["config"]["repeats"] == 300 for r in recs)
    assert abs(recs[0]["value"]) < 200  # reseeding one generator keeps nothing


def test_decode_inputs_draw_distinct_rows_and_caches_of_the_same_values() -> None:
    inputs = _module("decode_inputs")
    rows = inputs.distinct_rows(3, 40, 50, torch.Generator().manual_seed(0))
    assert rows.shape == (3, 40) and rows.dtype == torch.int32 and int(rows.min()) >= 0 and int(rows.max()) < 50
    assert all(len(set(r.tolist())) == 40 for r in rows)
    assert not torch.equal(rows[0], rows[0].sort().values)  # random order, not sorted
    with pytest.raises(ValueError, match="exceeds"):
        inputs.distinct_rows(1, 51, 50, torch.Generator())
    kv8, kv = inputs.fp8_cache_and_values(5, device="cpu")
    caches = inputs.build_caches(5, ["bf16", "fp8_ds_mla"], device="cpu")
    assert kv8.shape == (5, 656) and kv8.dtype == torch.uint8 and torch.equal(kv8, caches["fp8_ds_mla"])
    assert torch.equal(kv, dequantize_kv(kv8)) and kv.dtype == torch.bfloat16
    assert (caches["bf16"].float() - kv.float()).abs().max() < 0.25  # the same draws, bf16 and quantised


def test_union_build_cpu_run_checks_and_records(tmp_path: Path) -> None:
    out = tmp_path / "union.json"
    argv = ["--device", "cpu", "--heads", "8", "--tokens", "64", "--topk", "32", "--kv-rows", "256", "--reps", "1"]
    assert _module("union_build").main([*argv, "--json", str(out)]) == 0
    recs = _records(out)
    assert [(r["config"]["G"], r["metric"]) for r in recs] == [
        (8, "build ms"), (8, "share of the grouped step"), (1, "build ms"), (1, "per-query step ms")
    ]  # fmt: skip
    build = recs[0]
    assert build["baseline"]["name"] == "sorting build, same run"
    assert build["ratio"] == pytest.approx(build["baseline"]["value"] / build["value"])
    assert 0 < recs[1]["value"] < 100


def test_union_build_times_the_per_query_cases_alone_on_a_large_pool(tmp_path: Path) -> None:
    """``--heads`` with no value: the per-query (G = 1) cases alone, as on a pool past 24-bit rows."""
    out = tmp_path / "union.json"
    argv = ["--device", "cpu", "--heads", "--tokens", "64", "--topk", "32", "--kv-rows", "256", "--pool-rows",
            "100000", "--reps", "1", "--json", str(out)]  # fmt: skip
    assert _module("union_build").main(argv) == 0
    recs = _records(out)
    assert [(r["config"]["G"], r["config"]["kv_rows"], r["metric"]) for r in recs] == [
        (1, 100000, "build ms"), (1, 100000, "per-query step ms")
    ]  # fmt: skip


@pytest.mark.parametrize("broken", ["sorting build writes nothing", "kernel writes a constant"])
def test_union_build_refuses_to_time_a_wrong_build_or_kernel(broken: str, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _module("union_build")
    real_build, real_kernel = bench.build_union, bench.sparse_mla_grouped_prefill
    if broken.startswith("sorting"):
        monkeypatch.setattr(bench, "build_union", lambda *a, method="auto", **k: None if method != "auto" else
                            real_build(*a, method=method, **k))  # fmt: skip
    else:
        monkeypatch.setattr(bench, "sparse_mla_grouped_prefill", lambda *a, out, **k: (real_kernel(*a, out=out, **k),
                            out.fill_(123.0)))  # fmt: skip
    argv = ["--device", "cpu", "--heads", "8", "--tokens", "64", "--topk", "32", "--kv-rows", "256", "--reps", "1"]
    with pytest.raises(RuntimeError, match=r"sorting build|grouped kernel"):
        bench.main(argv)


def test_runtime_soak_refuses_a_run_that_ends_inside_its_warm_up(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _module("soak_runtime")
    assert bench.main(["--steps", "20", "--warmup-steps", "40"]) == 2
    assert "--steps 20 must exceed --warmup-steps 40" in capsys.readouterr().err
    report = _module("soak_runtime_report")
    rank = {"compiles_after_warmup": None, "failed_checks": 0, "unwarmed_routes": 0, "checks": 3,
            "live_tensor_growth": None, "rss_growth_pct": None, "cuda_growth_pct": None}  # fmt: skip
    assert not report.passed([rank], None)  # a --minutes run stopped before the warm-up ended


def test_pool_soak_counts_nan_lses_and_missing_outputs_as_wrong() -> None:
    soak_pool = _module("soak_pool")
    ref_out, ref_lse = torch.zeros(2, 3, 4, dtype=torch.float64), torch.tensor([[0.5, -float("inf"), 1.0]] * 2)

    class Mirror:
        def expected(self, req):
            return ref_out, ref_lse.double()

    def judged(outs: list, n_reqs: int) -> dict:
        soak = object.__new__(soak_pool.Soak)  # the check alone, without a pool
        soak.mirror, soak.atol, soak.max_err, soak.errors = Mirror(), 1e-2, 0.0, []
        soak.counts = {"outputs_checked": 0, "wrong_outputs": 0}
        soak.check(outs, [type("Req", (), {"id": i})() for i in range(n_reqs)])
        return soak.counts

    good = (ref_out.float(), ref_lse.clone())
    assert judged([good, good], 2) == {"outputs_checked": 2, "wrong_outputs": 0}
    nan_lse = ref_lse.clone()
    nan_lse[0, 0] = float("nan")
    assert judged([good, (ref_out.float(), nan_lse)], 2)["wrong_outputs"] == 1
    assert judged([good], 2)["wrong_outputs"] == 1  # a request the pool returned nothing for
    off = ref_out.float() + 1.0
    assert judged([(off, ref_lse.clone())], 1)["wrong_outputs"] == 1


def test_scaling_measures_two_cpu_ranks_and_predicts_more(tmp_path: Path) -> None:
    """Every path and a tapered, one-union ShardQ variant (checked bit-equal to the plain step by
    the benchmark itself) on two gloo ranks, then predictions for 4 and 8 ranks."""
    out = tmp_path / "scaling.json"
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(BENCH / "scaling.py"),
          "--tokens", "1024", "--topk", "16", "--reps", "1", "--configs", "2", "--shardq-chunks", "3", "--taper",
          "--one-union", "--json", str(out)])  # fmt: skip
    recs = _records(out)
    variant = [r for r in recs if r["metric"] == "ShardQ step ms, 3 chunks, tapered, one union build"]
    assert len(variant) == 1 and variant[0]["baseline"]["name"] == "ShardQ step, same run"
    assert {r["benchmark"] for r in recs} == {"prefill-scaling", "cost-model"}
    assert recs[0]["command"].startswith("torchrun --nproc-per-node 2 benchmarks/scaling.py")
    assert recs[0]["gpu"] == "2 x CPU" and recs[0]["config"]["ranks"] == 2
    router = next(r for r in recs if r["metric"] == "router's step ms")
    shardq = next(r for r in recs if r["metric"] == "ShardQ step ms")
    assert router["baseline"]["value"] == min(shardq["value"], shardq["baseline"]["value"])
    paths = [r["config"]["path"] for r in recs if r["benchmark"] == "cost-model"]
    assert {"head-TP", "ShardQ", "router"} <= set(paths)

    sim = tmp_path / "sim.json"
    assert _module("scaling").main(["--predict-only", "--simulate", "4", "8", "--json", str(sim)]) == 0
    recs = _records(sim)
    assert {r["config"]["ranks"] for r in recs} == {4, 8}
    assert {r["metric"] for r in recs} == {"predicted ShardQ step ms", "predicted router's step ms"}
    # the router never picks a path it predicts slower than head-TP
    assert all(r["value"] <= r["baseline"]["value"] * (1 + 1e-9) for r in recs if "router" in r["metric"])


def test_scaling_simulates_hosts_and_shows_where_the_network_changes_the_route(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """2 x 8 and 4 x 8 H200s on the shipped table: ShardQ's all-to-all sends half (3/4) of its bytes
    over a 50 GB/s NIC, so glm5 at 32K tokens on 2 x 8 takes head-TP where one host of 16 takes ShardQ."""
    sim = tmp_path / "sim.json"
    args = ["--predict-only", "--gpu", "NVIDIA H200", "--simulate", "16", "32", "--nodes", "2", "4"]
    assert _module("scaling").main([*args, "--json", str(sim)]) == 0
    text = capsys.readouterr().out
    assert "between hosts: ib-ndr, 50 GB/s per GPU" in text and "| 16 | 2 x 8 | glm5 (64 heads) | 32768 |" in text
    assert "glm5 T=32768 on 16 ranks: one host shardq/per-query" in text
    recs = _records(sim)
    hosts = {(r["config"]["ranks"], r["config"].get("hosts", 1)) for r in recs}
    assert hosts == {(16, 1), (16, 2), (32, 1), (32, 4)}

    def predicted(metric: str, hosts: int) -> float:
        return next(
            r["value"] for r in recs if r["metric"] == metric and r["config"]["model"] == "glm5"
            and r["config"]["tokens"] == 32768 and r["config"]["ranks"] == 16 and r["config"].get("hosts", 1) == hosts
        )  # fmt: skip

    sq_one, sq_two = predicted("predicted ShardQ step ms", 1), predicted("predicted ShardQ step ms", 2)
    router_two = predicted("predicted router's step ms", 2)
    assert sq_one < router_two < sq_two  # one host: ShardQ; two hosts: head-TP, faster than ShardQ there
    two = [r for r in recs if r["config"].get("hosts") == 2]
    assert all(r["config"]["ranks per host"] == 8 and r["config"]["network GB/s"] == 50.0 for r in two)
    # crossing hosts only ever adds to ShardQ's time here (the network is slower than NVLink)
    for r in (r for r in recs if r["metric"] == "predicted ShardQ step ms" and "hosts" in r["config"]):
        one = next(o for o in recs if o["metric"] == r["metric"] and "hosts" not in o["config"]
                   and all(o["config"][k] == r["config"][k] for k in ("model", "tokens", "ranks")))  # fmt: skip
        assert r["value"] >= one["value"]


@pytest.mark.skipif(
    ray_unavailable_reason() is not None, reason=f"optional dependency missing: {ray_unavailable_reason()}"
)
def test_ray_pool_cpu_run_checks_every_api_and_the_timed_call_form(tmp_path: Path) -> None:
    """The docstring's CPU run: prompts longer than the decode context fit the pool it builds, and
    the call the rounds time (no new KV row) is checked against fp64 attention with the others."""
    out = tmp_path / "ray_pool.json"
    text = _run([sys.executable, str(BENCH / "ray_pool.py"), "--device", "cpu", "--preset", "tiny", "--requests", "8",
                 "--context", "32", "--iters", "3", "--rounds", "1", "--json", str(out)])  # fmt: skip
    assert "'decode_batch, no new KV row'" in text
    recs = _records(out)
    assert len(recs) == 3 and all(r["benchmark"] == "ray-pool" and r["value"] > 0 for r in recs)


def test_ray_pool_records_are_medians_over_rounds() -> None:
    ray_pool, records = _module("ray_pool"), _module("records")
    args = ray_pool.build_parser().parse_args(["--requests", "8", "--context", "32"])
    env = ENV
    times = {"torchrun": [1.0, 1.2, 1.6], **{api: [2.0, 1.9, 3.0] for api in ray_pool.APIS}}
    recs = ray_pool.round_records(args, times, env)
    assert len(recs) == 2 * len(ray_pool.APIS)
    step, over = recs[0], recs[1]
    assert step["value"] == 2.0 and step["baseline"]["value"] == 1.2 and step["ratio"] == pytest.approx(0.6)
    assert over["metric"] == "over torchrun, median of rounds" and over["value"] == pytest.approx(1.0)  # 1.0, .7, 1.4
    no_baseline = ray_pool.round_records(args, {"torchrun": [None], **{a: [5.0] for a in ray_pool.APIS}}, env)
    assert [r["baseline"] for r in no_baseline] == [None] * len(ray_pool.APIS)
    for rec in recs + no_baseline:
        records.validate(rec)


def test_records_doctests() -> None:
    failures, _ = doctest.testmod(_module("records"))
    assert failures == 0


def test_soak_stats_doctests() -> None:
    failures, tried = doctest.testmod(_module("soak_stats"))
    assert failures == 0 and tried > 0


def test_soak_traffic_preempts_the_newest_held_request_outside_the_step() -> None:
    from types import SimpleNamespace

    traffic_mod = _module("soak_pool_traffic")
    cfg = SimpleNamespace(max_requests=8, num_pages=6, pages_for=lambda n: -(-n // 4))  # pages of 4 tokens
    counts = dict.fromkeys(("arrived", "preempted", "requeued", "completed"), 0)
    traffic = traffic_mod.Traffic(random.Random(0), cfg, 96, 1.5, counts)
    reqs = [traffic_mod.Req(i, prompt=8, gen=4, prefilled=p) for i, p in enumerate((8, 8, 0, 4))]
    traffic.active = {r.id: r for r in reqs}
    traffic.next_id = 4
    freed: list[int] = []
    free_pages = {"n": 1}

    def free(i: int) -> None:
        freed.append(i)
        free_pages["n"] += cfg.pages_for(reqs[i].length)

    # request 0 grows by 8 tokens (2 pages, 1 free): request 3 (newest held, outside the step) goes
    # first and frees 1 page; request 2 holds nothing, so it stays
    step = traffic.make_room([(reqs[0], 8)], lambda: free_pages["n"], free)
    assert step == [(reqs[0], 8)] and freed == [3] and counts["preempted"] == 1
    assert 3 not in traffic.active and [(r.id, r.prompt, r.gen) for r in traffic.waiting] == [(4, 8, 4)]
    # nothing else is held outside the step: its last request is dropped, then the first fits
    free_pages["n"] = 2
    step = traffic.make_room([(reqs[0], 8), (reqs[1], 8)], lambda: free_pages["n"], free)
    assert step == [(reqs[0], 8)] and freed == [3]
    reqs[0].generated = 4
    assert traffic.take_done() == [0] and counts["completed"] == 1 and 0 not in traffic.active


def test_record_ratio_follows_what_is_better() -> None:
    records = _module("records")
    env = ENV
    faster = records.record("b", {"n": 1}, "step ms", 2.0, "ms", "lower", ("old", 3.0), env)
    higher = records.record("b", {"n": 1}, "TFLOP/s", 300.0, "TFLOP/s", "higher", ("peer", 200.0), env)
    predicted = records.record("b", {"n": 1}, "predicted ms", 1.1, "ms", "none", ("measured", 1.0), env)
    assert (faster["ratio"], higher["ratio"], predicted["ratio"]) == pytest.approx((1.5, 1.5, 1.1))
    assert json.loads(json.dumps(faster)) == faster


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda r: r.pop("commit"), r"missing \['commit'\]"),
        (lambda r: r.update(extra=1), r"unexpected \['extra'\]"),
        (lambda r: r.update(ratio=2.0), "does not follow"),
        (lambda r: r.update(baseline={"name": "x", "value": None}, ratio=None), "needs the ratio"),
        (lambda r: r.update(baseline=None), "ratio without a baseline"),
        (lambda r: r.update(date="1 Dec 2026"), "YYYY-MM-DD"),
        (lambda r: r.update(better="faster"), "better must be one of"),
        (lambda r: r.update(value=float("nan")), "finite number"),
        (lambda r: r.update(config={"heads": [64]}), r"config\['heads'\]"),
        (lambda r: r.update(versions={"torch": "2"}), "versions"),
    ],
)
def test_a_broken_record_is_refused_naming_the_field(change, match: str) -> None:
    records = _module("records")
    env = ENV
    rec = records.record("b", {"heads": 64}, "step ms", 2.0, "ms", "lower", ("old", 3.0), env)
    change(rec)
    with pytest.raises(ValueError, match=match):
        records.validate(rec)


def test_the_command_is_what_a_user_types(monkeypatch: pytest.MonkeyPatch) -> None:
    records = _module("records")
    argv = [str(BENCH / "decode.py"), "--only", "gqa,merge"]
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert records.command_line(argv) == "python benchmarks/decode.py --only gqa,merge"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert records.command_line(argv) == "torchrun --nproc-per-node 2 benchmarks/decode.py --only gqa,merge"
    # an output file's directory is the measuring machine's: the command keeps its name only
    argv = [str(BENCH / "decode.py"), "--json", "/elsewhere/out/decode.json", "--peer", str(BENCH / "peer" / "x.cu")]
    assert records.command_line(argv).endswith("decode.py --json decode.json --peer benchmarks/peer/x.cu")
    assert records.portable_command("cd benchmarks && python a.py --json /o/a.json") == (
        "cd benchmarks && python a.py --json a.json"
    )


def test_gqa_prefill_cpu_run_checks_the_step_and_records(tmp_path: Path) -> None:
    """Every CPU case at TP 1 and 8 (the step checked bit-equal to the op by the benchmark);
    without CUDA FA4 is not timed, so the records carry no baseline."""
    out = tmp_path / "gqa_prefill.json"
    text = _run([sys.executable, str(BENCH / "gqa_prefill.py"), "--device", "cpu", "--iters", "1", "--warmup", "0",
                 "--json", str(out)])  # fmt: skip
    assert "FA4 not timed: FA4 needs CUDA tensors" in text and "GQA prefill" in text
    recs = _records(out)
    host = {f"{w} host ms per call" for w in ("op", "step", "runtime")}  # no FA4 on a CPU: no fa4 row
    assert len(recs) == 36 and {r["metric"] for r in recs} == {"op ms", "head-TP step ms", "Runtime.prefill ms", *host}
    assert {r["config"]["case"] for r in recs} == {"2x48", "2x48 window 5", "2x(24 on 40)"}
    assert all(r["benchmark"] == "gqa-prefill" and r["baseline"] is None for r in recs)


def test_gqa_prefill_host_times_both_launch_paths_and_records(tmp_path: Path) -> None:
    """The CPU host-time benchmark: every row with the fast launch and the public path, the fast
    launch's row against the public one; the route printed says which path each Runtime took."""
    out = tmp_path / "gqa_prefill_host.json"
    text = _run([sys.executable, str(BENCH / "gqa_prefill_host.py"), "--tp", "8", "--iters", "3", "--warmup", "2",
                 "--json", str(out)])  # fmt: skip
    assert "FA4 fast launch: the compiled kernel called directly" in text and "FA4 fast launch off" in text
    recs = _records(out)
    assert len(recs) == 8 and {r["config"]["tp"] for r in recs} == {8}
    fast = [r for r in recs if r["metric"].endswith("fast launch")]
    assert len(fast) == 4 and all(r["baseline"] is not None and r["value"] > 0 for r in fast)


def test_decode_packed_cpu_run_checks_and_records(tmp_path: Path) -> None:
    """The dry run converts, packs, checks the packed call against the in-place one and records
    both ``rows_unique`` forms for every share."""
    out = tmp_path / "packed.json"
    argv = ["--device", "cpu", "--heads", "4", "--tokens", "2", "--topk", "64", "--cache-rows", "4096",
            "--kv-dtype", "fp8_ds_mla", "--json", str(out)]  # fmt: skip
    assert _module("decode_packed").main(argv) == 0
    recs = _records(out)
    assert {(r["config"]["share"], r["metric"]) for r in recs} == {
        (share, f"step us, rows_unique={u}") for share in ("all", "dcp4", "short") for u in (False, True)
    }
    assert all(r["baseline"]["name"] == "rows converted in place, same run" for r in recs)
    assert _module("decode_packed").main(["--device", "cpu", "--topk", "2000", "--cache-rows", "4096"]) == 2


def test_decode_dedup_cpu_run_checks_and_records(tmp_path: Path) -> None:
    """The dry run checks the hash against the union and the default decode against the sorted
    union's, and records the de-duplication and both step comparisons for every case."""
    out = tmp_path / "dedup.json"
    argv = ["--device", "cpu", "--cache-rows", "4096", "--heads", "4", "--tokens", "2", "--topk", "64", "--kv-dtype",
            "bf16", "--json", str(out)]  # fmt: skip
    assert _module("decode_dedup").main(argv) == 0
    recs = _records(out)
    assert {r["metric"] for r in recs} == {"dedup us, hash", "step us, default", "step us, default vs kernel"}
    assert all(r["baseline"] is not None and r["value"] > 0 for r in recs)
    assert _module("decode_dedup").main(["--device", "cpu", "--cache-rows", "100", "--topk", "64"]) == 2


def test_a_cpu_run_on_a_gpu_machine_records_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A benchmark run with ``--device cpu`` (or on gloo ranks) where a GPU is visible records
    ``"CPU"``, not the GPU it did not use."""
    records = _module("records")
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    names = {None: "NVIDIA H100 80GB HBM3", 0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA H200"}
    monkeypatch.setattr("torch.cuda.get_device_name", lambda d=None: names[getattr(d, "index", d)])
    assert records.environment()["gpu"] == "NVIDIA H100 80GB HBM3"
    assert records.environment(2, "cuda")["gpu"] == "2 x NVIDIA H100 80GB HBM3"
    assert records.environment(device="cuda:1")["gpu"] == "NVIDIA H200"  # the device named, not the current one
    assert records.environment(device="cpu")["gpu"] == "CPU"
    assert records.environment(2, torch.device("cpu"))["gpu"] == "2 x CPU"
