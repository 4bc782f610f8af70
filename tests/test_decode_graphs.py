"""Graph buckets: the GraphRunner's host logic (padding, validation, routing) on the CPU, the
DCP GQA DecodeGraphs over gloo (uncaptured: same padding and metadata, eager), and on a GPU the
captured buckets replaying bit for bit what the padded step computes eagerly."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from shardattn.plan.cudagraph import CGSupport
from shardattn.plan.spec import ModelSpec
from shardattn.runtime.cudagraph import GraphInput, GraphRunner
from shardattn.runtime.graph_capture import check_capture_allowed
from shardattn.runtime.graphs import DecodeGraphs
from shardattn.runtime.options import DecodeOptions
from shardattn.runtime.runtime import Runtime
from tests.test_dcp import _gqa_case


def _runner(**kw):
    seen: list[dict] = []

    def step(q, block_table, seq_lens):
        seen.append({"q": q.clone(), "block_table": block_table.clone(), "seq_lens": seq_lens.clone()})
        return q * 2, seq_lens + 1

    inputs = [
        GraphInput("q", (3,), torch.float32, per="token"),
        GraphInput("block_table", (2,), torch.int32, pad_value=-1),
        GraphInput("seq_lens", (), torch.int32),
    ]
    args = dict(support=CGSupport.UNIFORM_BATCH, batch_sizes=[4, 1, 2], q_len_per_req=2, device="cpu")
    return GraphRunner(step, inputs, **{**args, **kw}), seen


def test_runner_pads_to_the_nearest_bucket_and_cuts_padding():
    runner, seen = _runner()
    assert runner.batch_sizes == (1, 2, 4)
    q = torch.randn(6, 3)
    bt = torch.arange(6, dtype=torch.int32).view(3, 2)
    lens = torch.tensor([5, 6, 7], dtype=torch.int32)
    # dirty the buffers first: a larger step, then a smaller one must re-pad every padding row
    runner.eager(4, q=torch.randn(8, 3), block_table=bt.repeat(2, 1)[:4], seq_lens=torch.ones(4, dtype=torch.int32))
    out, lens_out = runner.eager(3, q=q, block_table=bt, seq_lens=lens)
    assert runner.last_route == (4, "eager: 3 requests padded to the batch of 4")
    assert runner.route(3) == (4, "eager (not captured): 3 requests padded to the batch of 4")
    got = seen[-1]
    assert torch.equal(got["q"][:6], q) and torch.equal(got["q"][6:], torch.zeros(2, 3))
    assert torch.equal(got["block_table"][3], torch.tensor([-1, -1], dtype=torch.int32))
    assert got["seq_lens"].tolist() == [5, 6, 7, 0]
    # outputs: the real rows only (tokens and requests), padding never returned
    assert out.shape == (6, 3) and torch.equal(out, 2 * q)
    assert lens_out.tolist() == [6, 7, 8]
    # the buffers are views of one arena and never move
    assert all(
        b.untyped_storage().data_ptr() == runner.arena.untyped_storage().data_ptr() for b in runner.buffers.values()
    )


def test_runner_runs_eager_above_the_largest_bucket_and_says_so():
    runner, seen = _runner()
    q = torch.randn(10, 3)
    out, _ = runner.eager(
        5, q=q, block_table=torch.zeros(5, 2, dtype=torch.int32), seq_lens=torch.ones(5, dtype=torch.int32)
    )
    assert runner.last_route[0] is None and "exceed the largest captured batch (4)" in runner.last_route[1]
    assert seen[-1]["q"].shape == (10, 3) and torch.equal(out, 2 * q)  # the caller's tensors, unpadded
    with pytest.raises(ValueError, match="exceed the largest captured batch"):
        runner.padded_size(5)


def test_runner_validates_inputs_before_copying():
    runner, _ = _runner()
    ok = dict(
        q=torch.randn(2, 3), block_table=torch.zeros(1, 2, dtype=torch.int32), seq_lens=torch.ones(1, dtype=torch.int32)
    )
    with pytest.raises(ValueError, match=r"missing \['seq_lens'\]"):
        runner.load(1, q=ok["q"], block_table=ok["block_table"])
    with pytest.raises(ValueError, match=r"unexpected \['x'\]"):
        runner.load(1, **ok, x=ok["q"])
    with pytest.raises(ValueError, match=r"q must have shape \[2, 3\] and dtype torch.float32"):
        runner.load(1, **{**ok, "q": torch.randn(3, 3)})
    with pytest.raises(ValueError, match=r"dtype torch\.int32"):
        runner.load(1, **{**ok, "seq_lens": torch.ones(1)})
    with pytest.raises(TypeError, match=r"must be a torch\.Tensor"):
        runner.load(1, **{**ok, "q": [[0.0] * 3] * 2})
    with pytest.raises(ValueError, match="batch must be >= 1"):
        runner.load(0, **ok)
    with pytest.raises(RuntimeError, match="before capture"):
        runner.run(1, **ok)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        runner.capture()
    with pytest.raises(TypeError, match="warmup"):
        runner.capture(warmup=1.5)
    with pytest.raises(ValueError, match="batch_sizes must name at least one"):
        _runner(batch_sizes=[])
    with pytest.raises(ValueError, match="distinct names"):
        GraphRunner(lambda **k: k, [GraphInput("a", (), torch.int32)] * 2, support=CGSupport.ALWAYS, batch_sizes=[1])


def test_runner_and_inputs_validate_their_arguments_with_or_without_a_graph_level():
    for support in (CGSupport.UNIFORM_BATCH, None):
        with pytest.raises(TypeError, match=r"batch_sizes\[\]"):
            _runner(support=support, batch_sizes=[2.9])
        with pytest.raises(ValueError, match="q_len_per_req must be >= 1"):
            _runner(support=support, q_len_per_req=0)
        with pytest.raises(TypeError, match="ragged must be a bool"):
            _runner(support=support, ragged="yes")
    with pytest.raises(ValueError, match=r"GraphInput\('bt'\)\.pad_value must be an integer torch\.int32 holds"):
        GraphInput("bt", (2,), torch.int32, pad_value=0.5)
    with pytest.raises(ValueError, match="pad_value"):
        GraphInput("bt", (2,), torch.int32, pad_value=2**40)
    with pytest.raises(TypeError, match=r"GraphInput\('q'\)\.dtype must be a torch\.dtype"):
        GraphInput("q", (3,), "float32")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"row_shape\[\] must be >= 0"):
        GraphInput("q", (3, -1), torch.float32)
    GraphInput("q", (3,), torch.float32, pad_value=float("-inf"))  # any float pads a float input


def test_runner_checks_inputs_above_the_largest_bucket_too():
    runner, _ = _runner()
    lens = torch.ones(5, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"q must have shape \[10, 3\]"):
        runner.eager(5, q=torch.randn(20, 3), block_table=torch.zeros(5, 2, dtype=torch.int32), seq_lens=lens)
    with pytest.raises(ValueError, match=r"dtype torch\.float32"):
        runner.eager(5, q=torch.randn(10, 3).double(), block_table=torch.zeros(5, 2, dtype=torch.int32), seq_lens=lens)


def test_padded_ragged_batches_need_uniform_batch_only():
    check_capture_allowed(CGSupport.UNIFORM_BATCH, q_len_per_req=4, ragged=True, padded=True)
    with pytest.raises(ValueError, match="ALWAYS is needed"):
        check_capture_allowed(CGSupport.UNIFORM_BATCH, q_len_per_req=4, ragged=True)
    with pytest.raises(ValueError, match="UNIFORM_BATCH is needed"):
        check_capture_allowed(CGSupport.UNIFORM_SINGLE_TOKEN_DECODE, q_len_per_req=4, ragged=True, padded=True)
    with pytest.raises(ValueError, match="UNIFORM_BATCH is needed"):
        _runner(support=CGSupport.UNIFORM_SINGLE_TOKEN_DECODE, ragged=True)


# ------------------------------------------------------------------ DCP GQA buckets over gloo
def test_buckets_past_max_decode_tokens_are_refused_at_construction(one_rank_group: dist.ProcessGroup) -> None:
    """A bucket's step runs all its slots (padding included): buckets whose slots exceed the
    Runtime's max_decode_tokens are refused when built, naming both, not at a later step of fewer
    real queries (which raised that the step exceeded max_decode_tokens)."""
    spec = ModelSpec("gqa", 4, 2, 16, 16, 0, 4, dtype="float32")
    rt = Runtime(spec, one_rank_group, max_batched_tokens=1, mode="dcp-decode", max_decode_tokens=8, device="cpu")
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(8, 4, 2, 16, generator=gen) for _ in range(2))
    with pytest.raises(ValueError, match=r"batch_sizes: the largest bucket, 4 requests of q_len=4 .* 16 query rows .*"
                       r"max_decode_tokens=8"):  # fmt: skip
        DecodeGraphs(rt, (k, v), batch_sizes=[2, 4], q_len=4, max_pages=4, capture=False)
    graphs = DecodeGraphs(rt, (k, v), batch_sizes=[1, 2], q_len=4, max_pages=4, capture=False)  # 8 rows: fits
    q, table = torch.randn(3, 4, 16, generator=gen), torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
    out, lse = graphs(q, table, [5, 6], [0, 1, 3])
    want, want_lse = rt.decode(q, (k, v), table, [5, 6], cu_q_lens=[0, 1, 3])
    assert graphs.last_route[0] == 2 and torch.equal(out, want) and lse is not None and torch.equal(lse, want_lse)


def _graphs_body(group: dist.ProcessGroup, case: dict, steps: list, return_lse: bool = True) -> list:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    options = DecodeOptions(return_lse=return_lse)
    rt = Runtime("gqa-64-8", group, max_batched_tokens=1, mode="dcp-decode", warmup=False, decode_options=options)
    level = rt.cudagraph_support("decode").name
    mine = case["local"][rank]
    h = rt.heads_per_rank
    graphs = DecodeGraphs(
        rt, (mine["k"], mine["v"]), batch_sizes=[2, 4], q_len=4, max_pages=mine["table"].shape[1],
        sinks=case["sinks"], capture=False,
    )  # fmt: skip
    results = []
    for reqs, q_lens, *given in steps:
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + n)
        q = case["q"][: cu[-1], rank * h : (rank + 1) * h]
        seq = case["seq_lens"][reqs].tolist()
        out, lse = graphs(q, mine["table"][reqs], seq, None if given == ["none"] else cu)  # None: one query each
        old_out, old_lse = rt.decode(
            q, (mine["k"], mine["v"]), mine["table"][reqs], case["seq_lens"][reqs],
            cu_q_lens=torch.tensor(cu, dtype=torch.int32), sinks=case["sinks"], check=False,
        )  # fmt: skip
        same_lse = torch.equal(lse, old_lse) if return_lse else lse is None and old_lse is None
        results.append((graphs.last_route, torch.equal(out, old_out), same_lse, out.shape[0]))
    del world
    return [level, results]


@pytest.mark.distributed
@pytest.mark.parametrize("return_lse", [True, False], ids=["lse", "no-lse"])
def test_dcp_gqa_buckets_pad_ragged_batches_and_return_only_real_rows(dist_pool, nproc, return_lse: bool):
    world = min(nproc, 2)
    lens = [40, 33, 9, 50, 21, 17]
    case = _gqa_case(
        5, lens, [1] * 6, world, 1, ragged=True, sinks=True, pad_rows=30, hq_per_rank=64 // world, hkv=8, d=64, page=32
    )
    steps = [
        ([0, 1, 2], [1, 4, 2]),  # ragged, bucket 4 (one padded request)
        ([0, 1, 2, 3], [4, 4, 4, 4]),  # uniform, bucket 4 exactly
        ([4], [3]),  # bucket 2
        ([0, 1, 2, 3, 4], [1, 1, 1, 1, 1]),  # above the buckets: eager
        ([0, 1], [1, 5]),  # a request longer than the graphs' q_len: eager
        ([0, 1, 2], [1, 1, 1], "none"),  # qo_indptr=None: one query each, in a bucket (it read q_len each)
        ([0, 1, 2, 3, 4], [1, 1, 1, 1, 1], "none"),  # ... and above the buckets, alike
    ]
    for level, results in dist_pool.run(_graphs_body, case, steps, return_lse, world_size=world):
        assert level == "NEVER"  # CPU: the torch reference is never captured (the runner pads and runs eagerly)
        for (route, same_out, same_lse, rows), (_, q_lens, *_) in zip(results, steps):
            assert same_out and same_lse, route  # equal to the unpadded step, padding dropped
            assert rows == sum(q_lens)
        routes = [r[0] for r in results]
        assert [r[0] for r in routes] == [4, 4, 2, None, None, 4, None]
        assert "padding queries" in routes[0][1] and "padding" not in routes[1][1]
        assert "exceed the largest captured batch (4)" in routes[3][1]
        assert "more than q_len=4" in routes[4][1]


# --------------------------------------------------------------------------------- on a GPU
def _gpu_body(group: dist.ProcessGroup) -> list:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    rt = Runtime("gqa-64-8", group, max_batched_tokens=1, mode="dcp-decode")
    lens = [300, 257, 90, 511, 64, 200, 129, 33]
    case = _gqa_case(
        9, lens, [1] * 8, world, 1, ragged=True, sinks=True, pad_rows=40, hq_per_rank=64 // world, hkv=8, d=64, page=32
    )
    assert rt.cudagraph_support("decode").name == "UNIFORM_BATCH"
    dev = torch.device("cuda", torch.cuda.current_device())
    mine = {k: v.to(dev) for k, v in case["local"][rank].items()}
    sinks = case["sinks"].to(dev)
    h = rt.heads_per_rank
    out = []
    for q_len in (1, 4):
        graphs = DecodeGraphs(rt, (mine["k"], mine["v"]), batch_sizes=[2, 4, 8], q_len=q_len,
                              max_pages=mine["table"].shape[1], sinks=sinks)  # fmt: skip
        for b in (1, 2, 3, 5, 8, 9):
            if b > len(lens):
                b = len(lens)
            g = torch.Generator().manual_seed(b * 10 + q_len)
            n = torch.randint(1, q_len + 1, (b,), generator=g).tolist()
            cu = [0]
            for x in n:
                cu.append(cu[-1] + x)
            q = case["q"][: cu[-1], rank * h : (rank + 1) * h].to(dev)
            seq = lens[:b]
            rep = tuple(t.clone() for t in graphs(q, mine["table"][:b], seq, cu))
            route = graphs.last_route
            eag = graphs.eager(q, mine["table"][:b], seq, cu)
            same = all(torch.equal(x, y) for x, y in zip(rep, eag))
            finite = bool(torch.isfinite(rep[0]).all())
            out.append((q_len, b, route, same, rep[0].shape[0] == cu[-1], finite, math.isfinite(float(rep[1][0, 0]))))
    return out


@pytest.mark.gpu
def test_every_bucket_replays_bitwise_equal_to_eager(dist_pool):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    world = min(2, torch.cuda.device_count())
    for results in dist_pool.run(_gpu_body, world_size=world, backend="nccl"):
        for q_len, b, route, bitwise, rows_ok, finite, _ in results:
            assert bitwise and rows_ok and finite, (q_len, b, route)
            assert route[0] is not None or b > 8
