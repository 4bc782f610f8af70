"""Launcher pieces that run in one process: options, defaults, the report, the torchrun environment."""

from __future__ import annotations

import json
import math

import pytest
import torch
from rich.console import Console

from shardattn.launch.cli import LaunchError, parse_options, resolve_shape
from shardattn.launch.process_group import DistEnv, pick_device
from shardattn.launch.report import RankRow, Report, percentile, render, summarize_times, write_json
from shardattn.launch.runner import plan_run
from shardattn.launch.workloads import BLOCK_SIZE, build_decode, build_prefill, overlap_model
from shardattn.ops.row_entries import valid_mask
from shardattn.ops.topk import DcpShard, convert_topk
from shardattn.plan import dcp_owner


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--mode", "ring"], r"argument --mode: invalid choice: 'ring'"),
        (["--tokens", "0"], r"--tokens must be >= 1, got 0"),
        (["--tokens", "abc"], r"argument --tokens: invalid int value: 'abc'"),
        (["--cached", "1,x"], r"expected comma-separated integers"),
        (["--timeout", "0"], r"--timeout must be >= 1"),
        (["--query-len", "0"], r"--query-len entries must be >= 1"),
        (["--window", "-2"], r"--window must be >= -1, got -2"),
        (["--seed", "99999999999999999999999"], r"--seed must be <= 18,446,744,073,709,551,615"),
        (["--timeout", "1e14"], r"--timeout must be <= 1,000,000"),
        (["--tokens", "3000000000"], r"--tokens must be <= 2,147,483,647"),
        (["--query-len", "1,3000000000"], r"--query-len entries must be <= 2,147,483,647"),
        (["--json", "/nonexistent/dir/r.json"], r"--json /nonexistent/dir/r.json: cannot write a report"),
        (["--json", "/"], r"--json /: cannot write a report there \(a directory\)"),
        (["--bogus"], r"unrecognized arguments: --bogus"),
    ],
    ids=[
        "bad-mode",
        "zero-tokens",
        "non-int",
        "bad-list",
        "timeout",
        "query-len",
        "window",
        "seed-huge",
        "timeout-huge",
        "tokens-huge",
        "query-len-huge",
        "json-no-dir",
        "json-a-dir",
        "unknown",
    ],
)
def test_bad_option_is_one_line(argv: list[str], match: str) -> None:
    with pytest.raises(LaunchError, match=match) as info:
        parse_options(argv)
    assert "\n" not in str(info.value)
    assert str(info.value).startswith("shardattn.launch: error: ")
    assert info.value.status == 2


CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("argv", "world", "match"),
    [
        (
            [],
            3,
            r"preset glm5 has 64 query heads, which 3 ranks cannot split evenly .* run 1, 2, 4, 8, 16, 32, 64 ranks",
        ),
        (["--preset", "deepseek-v32"], 6, r"128 query heads, which 6 ranks cannot split evenly .* 32, 64, 128 ranks"),
        (["--topk", "4096"], 2, r"--topk 4096 is larger than the KV cache of the longest request \(256 tokens\)"),
        (["--mode", "dcp-decode", "--topk", "200", "--cached", "150"], 2, r"longest request \(151 tokens\)"),
        (["--preset", "llama"], 2, r"unknown model preset 'llama'; known presets: deepseek-v32, glm5, gqa-64-8"),
        (["--preset", "gqa-64-8", "--mode", "shardq"], 2, r"--mode shardq needs a sparse-MLA preset"),
        (["--fail-rank", "2"], 2, r"--fail-rank 2 is not a rank of this world of 2"),
        (["--tokens", "3", "--requests", "4"], 2, r"--tokens 3 gives some of the 4 requests no new token"),
        (["--topk-file", "/nonexistent/x.pt"], 2, r"--topk-file /nonexistent/x.pt: no such file"),
        (["--mode", "dcp-decode", "--topk-file", "x.pt"], 2, r"--topk-file holds prefill top-k"),
        (
            ["--topk-file", "x.pt", "--tokens", "32", "--requests", "2", "--topk", "16", "--cached", "3,4"],
            2,
            r"--topk-file sets the step's shape .* drop --tokens, --requests, --topk, --cached$",
        ),
        (["--overlap", "1.5"], 2, r"overlap as a number must be in \[0, 1\], got 1.5"),
        (["--overlap", "lots"], 2, r"overlap must be one of \['dsa', 'dsa_low', 'random'\]"),
        (["--graph"], 2, r"--graph captures CUDA graphs and needs a GPU per rank"),
        (["--window", "4"], 2, r"--window is a GQA model's sliding window; glm5 is a sparse-MLA model"),
        (["--cached", "2000000000"], 2, r"the step.s tensors need at least [0-9.]+ GiB per rank .* free on this cpu"),
        (["--preset", "gqa-64-8", "--window", "4"], 2, r"--window: mode dcp-decode decodes with DCP, which refuses"),
        (["--preset", "gqa-64-8", "--mode", "pcp", "--window", "4"], 2, r"--window: mode pcp decodes with DCP"),
        (
            ["--preset", "gqa-64-8", "--kv-dtype", "fp8_ds_mla"],
            2,
            r"--kv-dtype fp8_ds_mla holds DSA sparse-MLA rows .* preset gqa-64-8 is a gqa model",
        ),
        (["--mode", "dcp-decode", "--tokens", "7"], 2, r"--tokens sets the prefill's new tokens; mode dcp-decode runs"),
        (["--preset", "gqa-64-8", "--topk", "50"], 2, r"--topk sets a sparse-MLA top-k; gqa-64-8 is a GQA model"),
        (["--preset", "gqa-64-8", "--overlap", "random"], 2, r"--overlap shapes a sparse-MLA top-k; gqa-64-8 is"),
        (["--mode", "headtp", "--min-shard-tokens", "9"], 2, r"--min-shard-tokens is ShardQ's gate; mode headtp's"),
        (["--mode", "headtp", "--calibration", "t.json"], 2, r"--calibration routes ShardQ steps; mode headtp's"),
        (["--compare", "--query-len", "4"], 2, r"--query-len sets the decode's queries; --compare runs prefills only"),
        (["--mode", "headtp", "--interleave", "4"], 2, r"--interleave is DCP's interleave; mode headtp decodes with"),
        (["--non-causal"], 2, r"--non-causal lets speculative drafts .* every request decodes one query \(--query-len"),
        (
            ["--preset", "gqa-64-8", "--non-causal", "--query-len", "1"],
            2,
            r"--non-causal lets speculative drafts see every KV token of their request; every request decodes one",
        ),
        (["--compare", "--non-causal"], 2, r"--non-causal lets .*; --compare runs prefills only"),
        (
            ["--compare", "--topk-file", "x.pt", "--overlap", "random"],
            2,
            r"--overlap shapes a synthetic top-k; --topk-file gives the prefill's and --compare runs prefills only",
        ),
        (
            ["--preset", "gqa-64-8", "--mode", "headtp", "--topk-file", "x.pt"],
            2,
            r"--topk-file holds a sparse-MLA top-k; gqa-64-8 is GQA: drop it",
        ),
        (["--preset", "gqa-64-8", "--topk-file", "x.pt"], 2, r"--topk-file holds a sparse-MLA top-k; gqa-64-8 is GQA"),
        (["--preset", "gqa-64-8", "--topk-unique"], 2, r"--topk-unique is a sparse-MLA top-k's promise; gqa-64-8"),
        (["--calibration", "/nonexistent/t.json"], 2, r"--calibration /nonexistent/t.json: no such file"),
        (["--calibration", "/"], 2, r"--calibration /: not a calibration table"),
        (["--preset", "gqa-64-8", "--compare"], 2, r"--compare sets sparse-MLA prefill steps side by side; gqa-64-8"),
        (["--heads", "67108864", "--mode", "dcp-decode"], 2, r"GiB are free on this cpu .*; ask for fewer --heads"),
    ],
    ids=[
        "heads-3",
        "heads-6",
        "topk-prefill",
        "topk-decode",
        "preset",
        "gqa-mixed",
        "fail-rank",
        "tokens",
        "topk-file",
        "topk-file-decode",
        "topk-file-and-shape",
        "overlap-range",
        "overlap-name",
        "graph-needs-gpu",
        "window-mla",
        "too-large-for-memory",
        "window-dcp-decode",
        "window-pcp",
        "fp8-kv-gqa",
        "unused-tokens",
        "unused-topk",
        "unused-overlap",
        "unused-min-shard-tokens",
        "unused-calibration",
        "unused-query-len",
        "unused-interleave",
        "unused-non-causal-one-query",
        "unused-non-causal-one-query-gqa",
        "unused-non-causal-no-decode",
        "unused-overlap-with-topk-file",
        "unused-topk-file-gqa-prefill",
        "unused-topk-file-gqa-decode",
        "unused-topk-unique-gqa",
        "calibration-missing",
        "calibration-not-a-table",
        "compare-gqa",
        "heads-past-memory",
    ],
)
def test_impossible_configuration_is_one_line(argv: list[str], world: int, match: str) -> None:
    with pytest.raises(LaunchError, match=match) as info:
        plan_run(parse_options(argv), world, CPU)
    assert "\n" not in str(info.value) and info.value.status == 2
    assert str(info.value).startswith("shardattn.launch: error: ")


def test_recorded_positions_size_the_memory_check(tmp_path) -> None:
    """A --topk-file position far past the request grows its cache (a dump of global rows): the
    memory check counts those rows and names the file, not options the file forbids."""
    path = tmp_path / "far.pt"
    topk = torch.zeros(32, 16, dtype=torch.int32)
    topk[3, 5] = 2**30
    torch.save({"topk": topk}, path)
    with pytest.raises(LaunchError, match=rf"--topk-file {path}'s positions \(up to 1,073,741,824\) make a KV"):
        plan_run(parse_options(["--topk-file", str(path)]), 2, CPU)


@pytest.mark.parametrize("mode", ["mixed", "dcp-decode"])
def test_requests_past_memory_are_refused_before_their_lengths_are_listed(monkeypatch, mode: str) -> None:
    """Regression: --requests 2147483647 listed a cached length and a query length per request (two
    tuples of 2**31 entries) before the memory check, and the allocator killed every rank without
    a word; every request holds a token, so the count alone is refused first, in one line."""
    from shardattn.launch import runner

    def listed(*args, **kwargs):
        raise AssertionError("the per-request lengths were listed")

    monkeypatch.setattr(runner, "resolve_shape", listed)
    with pytest.raises(LaunchError, match=r"GiB are free on this cpu for each of its ranks; ask for fewer --requests$"):
        plan_run(parse_options(["--mode", mode, "--requests", "2147483647"]), 2, CPU)


@pytest.mark.parametrize("shape", [(0, 16), (4, 0)], ids=["no-token", "no-entry"])
def test_an_empty_recorded_top_k_is_refused_naming_the_file(tmp_path, shape: tuple[int, int]) -> None:
    """A --topk-file of no token or no entry sizes an empty step: refused naming the file (not
    --tokens, which was not given, nor the Runtime's top-k once ranks are up)."""
    path = tmp_path / "empty.pt"
    torch.save({"topk": torch.zeros(shape, dtype=torch.int32)}, path)
    with pytest.raises(LaunchError, match=rf"--topk-file {path}: its top-k is \[{shape[0]}, {shape[1]}\]; a step"):
        plan_run(parse_options(["--topk-file", str(path)]), 2, CPU)


def test_a_recorded_top_k_that_repeats_a_position_is_refused_under_topk_unique(tmp_path) -> None:
    """--topk-unique promises no position twice in a token's top-k (the steps would count it twice):
    a --topk-file that repeats one within a token's valid entries is refused naming token and
    position; a repeat past a token's valid count, or without the flag, is not."""
    path = tmp_path / "twice.pt"
    topk = torch.arange(4 * 8, dtype=torch.int32).view(4, 8) % 24
    topk[2, 6] = topk[2, 1]  # token 2 lists position 17 twice
    topk[1, 7] = topk[1, 0]  # token 1 repeats past its valid count: never read
    valid = torch.tensor([8, 7, 8, 8], dtype=torch.int32)
    torch.save({"topk": topk, "valid": valid}, path)
    with pytest.raises(LaunchError, match=rf"--topk-file {path}: token 2 lists position 17 twice, which --topk-unique"):
        plan_run(parse_options(["--topk-file", str(path), "--topk-unique"]), 2, CPU)
    assert plan_run(parse_options(["--topk-file", str(path)]), 2, CPU).recorded is not None
    topk[2, 6] = -1
    torch.save({"topk": topk, "valid": valid}, path)
    assert plan_run(parse_options(["--topk-file", str(path), "--topk-unique"]), 2, CPU).opts.topk_unique


@pytest.mark.distributed
def test_a_gqa_runtime_whose_kv_heads_do_not_split_is_refused_when_built(dist_pool) -> None:
    """8 KV heads over 3 head-TP ranks: the Runtime refuses it when it is made (the launcher's one
    line), not at the first step."""
    for message in dist_pool.run(_gqa_three_ranks, world_size=3):
        assert message == "num_kv_heads (8) must be divisible by the 3 ranks of head-TP", message


def _gqa_three_ranks(group) -> str:
    import dataclasses

    from shardattn import Runtime
    from shardattn.plan.spec import get_preset

    spec = dataclasses.replace(get_preset("gqa-64-8"), num_heads=24)
    try:
        Runtime(spec, group, mode="headtp", max_batched_tokens=64, warmup=False)
    except ValueError as e:
        return str(e)
    return "built"


def test_plan_run_defaults_on_cpu(tmp_path) -> None:
    cfg = plan_run(parse_options([]), 4, CPU)
    assert (cfg.mode, cfg.steps, cfg.check, cfg.iters, cfg.dtype) == (
        "mixed",
        ("prefill", "decode"),
        True,
        3,
        torch.float32,
    )
    assert any("reduced step" in n for n in cfg.notes) and cfg.min_shard_tokens == 1
    gqa = plan_run(parse_options(["--preset", "gqa-64-8"]), 2, CPU)
    assert (gqa.mode, gqa.steps) == ("dcp-decode", ("decode",))
    assert plan_run(parse_options(["--no-check", "--iters", "5"]), 2, CPU).check is False
    assert cfg.fingerprint() == plan_run(parse_options([]), 4, CPU).fingerprint()
    assert cfg.fingerprint() != plan_run(parse_options(["--seed", "1"]), 4, CPU).fingerprint()
    # a recorded top-k sets the step's shape
    torch.save({"topk": torch.tensor([[0, -1], [0, 1], [2, 1]], dtype=torch.int32)}, tmp_path / "t.pt")
    rec = plan_run(parse_options(["--mode", "shardq", "--topk-file", str(tmp_path / "t.pt")]), 2, CPU)
    assert (rec.shape.tokens, rec.shape.topk, rec.shape.requests) == (3, 2, 1)


def test_options_some_step_uses_are_kept(tmp_path) -> None:
    """--non-causal with drafts, and --overlap beside --topk-file where a decode step draws its own
    top-k, change the run: accepted."""
    drafts = plan_run(parse_options(["--non-causal", "--query-len", "1,3"]), 2, CPU)
    assert drafts.opts.causal is False and drafts.shape.query_lens == (1, 3)
    torch.save({"topk": torch.tensor([[0, -1], [0, 1], [2, 1]], dtype=torch.int32)}, tmp_path / "t.pt")
    rec = plan_run(parse_options(["--topk-file", str(tmp_path / "t.pt"), "--overlap", "random"]), 2, CPU)
    assert rec.steps == ("prefill", "decode") and rec.opts.overlap == "random"


def test_defaults_are_small_on_cpu_and_real_on_gpu() -> None:
    opts = parse_options([])
    cpu = resolve_shape(opts, on_gpu=False, preset_topk=2048, decode_only=False)
    gpu = resolve_shape(opts, on_gpu=True, preset_topk=2048, decode_only=False)
    assert (cpu.tokens, cpu.topk, cpu.requests, cpu.reduced) == (256, 64, 2, True)
    assert (gpu.tokens, gpu.topk, gpu.reduced) == (8192, 2048, False)
    assert cpu.cached == (128, 128) and cpu.query_lens == (1, 1)
    explicit = resolve_shape(
        parse_options(["--tokens", "300", "--topk", "100"]), on_gpu=False, preset_topk=2048, decode_only=False
    )
    assert not explicit.reduced and explicit.tokens == 300


def test_per_request_lists_must_match_requests() -> None:
    opts = parse_options(["--requests", "3", "--cached", "1,2"])
    with pytest.raises(LaunchError, match=r"--cached takes one value or one per request \(3\), got 2"):
        resolve_shape(opts, on_gpu=False, preset_topk=2048, decode_only=False)
    shape = resolve_shape(
        parse_options(["--requests", "3", "--cached", "1,2,3"]), on_gpu=False, preset_topk=64, decode_only=False
    )
    assert shape.cached == (1, 2, 3)


def test_torchrun_environment() -> None:
    assert DistEnv.from_env({}) == DistEnv(0, 1, 0, None, None)
    env = DistEnv.from_env(
        {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "123"}
    )
    assert (env.rank, env.world_size, env.local_rank, env.launched) == (1, 2, 1, True)
    with pytest.raises(ValueError, match=r"RANK must be in \[0, WORLD_SIZE=2\), got 5"):
        DistEnv.from_env({"RANK": "5", "WORLD_SIZE": "2", "MASTER_PORT": "1"})
    assert pick_device("cpu", env) == torch.device("cpu")
    if not torch.cuda.is_available():
        assert pick_device("auto", env) == torch.device("cpu")
        with pytest.raises(ValueError, match=r"--device cuda: local rank 1 needs GPU 1, but 0 visible"):
            pick_device("cuda", env)


def test_percentiles_and_times() -> None:
    assert percentile([3.0], 90) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 10) == pytest.approx(1.4)
    med, p10, p90 = summarize_times([0.004, 0.001, 0.002, 0.003])
    assert (med, p10, p90) == (2.5, pytest.approx(1.3), pytest.approx(3.7))
    with pytest.raises(ValueError, match="values must not be empty"):
        percentile([], 50)


def _row(rank: int, error: float | None, tol: float | None = 1e-3) -> RankRow:
    return RankRow(
        rank,
        "prefill",
        "shardq/grouped",
        "G = 2 for 64 heads",
        128,
        1.5,
        1.2,
        1.9,
        union_ratio=1.15,
        tflops=0.5,
        error=error,
        tolerance=tol,
    )


def test_report_verdict_table_and_json(tmp_path) -> None:
    ok = Report({"preset": "glm5", "mode": "shardq", "world_size": 2}, [_row(0, 1e-6), _row(1, 2e-6)], ["reduced"])
    bad = Report({"preset": "glm5"}, [_row(0, 1e-6), _row(1, 5e-2)])
    nan = Report({"preset": "glm5"}, [_row(0, math.nan)])
    unchecked = Report({"preset": "glm5"}, [_row(0, None, None)])
    assert (ok.checked, ok.passed) == (True, True)
    assert (bad.checked, bad.passed) == (True, False)
    assert nan.passed is False, "a NaN error must fail the check"
    assert (unchecked.checked, unchecked.passed) == (False, True)

    console = Console(record=True, width=200)
    render(bad, console)
    text = console.export_text()
    for needle in ("shardq/grouped", "G = 2 for 64 heads", "1.150", "5.0e-02 FAIL", "check FAILED", "1e-03"):
        assert needle in text, needle

    path = tmp_path / "r.json"
    write_json(nan, str(path))
    data = json.loads(path.read_text())
    assert data["passed"] is False and data["rows"][0]["error"] is None and data["rows"][0]["passed"] is False


def test_prefill_workload_rows_match_positions() -> None:
    args = dict(heads=4, head_dim=24, tokens=40, requests=3, cached=(0, 5, 70), topk=16, dtype=torch.float32, seed=3)
    step = build_prefill(overlap=overlap_model("dsa"), device=torch.device("cpu"), **args)
    assert step.query_lens == [14, 13, 13] and step.q.shape == (40, 4, 24)
    valid = step.positions >= 0
    assert torch.equal(valid, step.rows >= 0), "every valid position maps to a row"
    assert torch.equal(valid_mask(step.rows, step.kv.shape[0], None), valid)
    # a token at position p sees min(topk, p + 1) distinct positions, none past its own
    pos_in_req = torch.cat([torch.arange(n) for n in step.query_lens])
    position = torch.tensor(step.prefix_lens).repeat_interleave(torch.tensor(step.query_lens)) + pos_in_req
    assert torch.equal(valid.sum(1), torch.clamp(position + 1, max=16))
    assert bool((step.positions <= position[:, None]).all())
    # rows follow the block table: row = table[req, p // B] * B + p % B
    p = step.positions.long().clamp(min=0)
    expect = step.block_table.long()[step.req_ids.long()[:, None], p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
    assert torch.equal(step.rows.long()[valid], expect[valid])
    again = build_prefill(overlap="dsa", device=torch.device("cpu"), **args)
    assert torch.equal(again.q, step.q) and torch.equal(again.rows, step.rows), "same seed, same step on every rank"


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63)], ids=["largest", "smallest"])
def test_every_seed_the_option_takes_builds_a_step(seed: int) -> None:
    """Regression: --seed takes torch's whole seed range, but the steps seed generators at ``seed + 8``,
    ``seed * 7919 + 1`` and so on, which overflowed there (a traceback on every rank); derived seeds
    wrap modulo 2**64, as torch reads a negative seed, so every seed in range is its own step."""
    from shardattn.launch.gqa_workloads import build_gqa_decode, build_gqa_prefill

    cpu, one = torch.device("cpu"), DcpShard(1, 1, 0)
    parse_options(["--seed", str(seed)])  # in range
    mla = dict(heads=2, head_dim=8, requests=2, cached=(5, 9), topk=4, overlap="dsa", dtype=torch.float32, device=cpu)
    gqa = dict(
        q_heads=4, kv_heads=2, head_dim=8, sinks=True, requests=2, cached=(5, 9), dtype=torch.float32, device=cpu
    )
    steps = {
        "prefill": lambda s: build_prefill(tokens=6, seed=s, **mla).rows,
        "decode": lambda s: build_decode(q_lens=(1, 2), causal=True, shard=one, seed=s, **mla).positions,
        "gqa prefill": lambda s: build_gqa_prefill(tokens=6, seed=s, **gqa).q,
        "gqa decode": lambda s: build_gqa_decode(q_lens=(1, 2), shard=one, seed=s, **gqa).q,
    }
    twin = seed - 2**64 if seed > 0 else seed + 2**64  # the same seed to torch (-1 and 2**64 - 1)
    for name, build in steps.items():
        assert torch.equal(build(seed), build(twin)), name


@pytest.mark.parametrize("interleave", [1, 2, 64], ids=lambda i: f"I{i}")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
def test_decode_workload_shards_cover_the_cache(interleave: int, causal: bool) -> None:
    world = 3
    steps = [
        build_decode(
            heads=2,
            head_dim=24,
            requests=3,
            cached=(100, 300, 5),
            q_lens=(1, 2, 3),
            topk=32,
            overlap="dsa",
            causal=causal,
            dtype=torch.float32,
            device=torch.device("cpu"),
            seed=1,
            shard=DcpShard(world, interleave, r),
        )
        for r in range(world)
    ]
    full = steps[0]
    assert full.seq_lens.tolist() == [101, 302, 8] and full.q.shape[0] == 6
    owned_total = 0
    for r, s in enumerate(steps):
        shard = DcpShard(world, interleave, r)
        local_rows, _ = convert_topk(
            s.positions, s.req_ids, s.local_table, block_size=BLOCK_SIZE, seq_lens=s.seq_lens, dcp=shard
        )
        own = (s.positions >= 0) & (dcp_owner(s.positions.long().clamp(min=0), world, interleave) == r)
        assert torch.equal(own, local_rows >= 0)
        assert torch.equal(s.local_kv[local_rows[own].long()], full.kv[full.rows[own].long()])
        owned_total += int(own.sum())
    assert owned_total == int((full.rows >= 0).sum()), "each valid key lives on exactly one rank"
    # request 2 (5 cached + 3 drafts): causal draft j sees 5 + j + 1 tokens, non-causal all 8
    last = full.positions[3:]
    counts = (last >= 0).sum(1).tolist()
    assert counts == ([6, 7, 8] if causal else [8, 8, 8])
