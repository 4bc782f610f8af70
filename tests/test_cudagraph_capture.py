"""CUDA-graph capture of decode steps: the policy check (CPU), and on a GPU capture/replay of GQA
decode (uniform drafts), sparse-MLA decode and the LSE merge, bitwise equal to eager, with padded
batch sizes masked (out 0, lse -inf) and buffers allocated once."""

from __future__ import annotations

import math

import pytest
import torch

from shardattn.plan.cudagraph import CGSupport
from shardattn.runtime.cudagraph import GraphInput, GraphRunner
from shardattn.runtime.graph_capture import check_capture_allowed


@pytest.mark.parametrize(
    "support, q_len, ragged, ok",
    [
        (CGSupport.NEVER, 1, False, False),
        (CGSupport.UNIFORM_SINGLE_TOKEN_DECODE, 1, False, True),
        (CGSupport.UNIFORM_SINGLE_TOKEN_DECODE, 4, False, False),
        (CGSupport.UNIFORM_BATCH, 4, False, True),
        (CGSupport.UNIFORM_BATCH, 2, True, False),
        (CGSupport.ALWAYS, 2, True, True),
    ],
    ids=["never", "dcp_single_token", "dcp_drafts", "uniform_drafts", "ragged_needs_always", "always"],
)
def test_policy_allows_exactly_its_levels(support, q_len, ragged, ok):
    if ok:
        check_capture_allowed(support, q_len_per_req=q_len, ragged=ragged)
    else:
        with pytest.raises(ValueError, match=f"CUDA-graph support is {support.name}"):
            check_capture_allowed(support, q_len_per_req=q_len, ragged=ragged)


def test_runner_refuses_a_forbidden_mode_before_touching_a_gpu():
    spec = [GraphInput("seq_lens", (), torch.int32)]
    with pytest.raises(ValueError, match=r"UNIFORM_SINGLE_TOKEN_DECODE .* UNIFORM_BATCH is needed"):
        GraphRunner(
            lambda seq_lens: seq_lens,
            spec,
            support=CGSupport.UNIFORM_SINGLE_TOKEN_DECODE,
            batch_sizes=[1, 2],
            q_len_per_req=3,
        )
    with pytest.raises(TypeError, match="support must be a CGSupport"):
        check_capture_allowed(3, q_len_per_req=1)
    with pytest.raises(ValueError, match="per must be one of"):
        GraphInput("q", (4,), torch.float16, per="head")
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):  # a CPU runner pads, never captures
        GraphRunner(lambda seq_lens: seq_lens, spec, support=CGSupport.ALWAYS, batch_sizes=[1], device="cpu").capture()


def _gqa_runner(q_len, hq=64, hkv=8, d=64, page=32, max_pages=40, sizes=(1, 2, 4, 8), backend="triton"):
    from shardattn.ops.gqa_decode import gqa_paged_decode

    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(600, page, hkv, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(600, page, hkv, d, device="cuda", generator=g).bfloat16()
    sinks = torch.randn(hq, device="cuda", generator=g)

    def step(q, block_table, seq_lens):
        return gqa_paged_decode(
            q,
            k,
            v,
            block_table,
            seq_lens,
            q_len_per_req=q_len,
            sinks=sinks,
            return_lse=backend == "triton",
            backend=backend,
        )

    inputs = [
        GraphInput("q", (hq, d), torch.bfloat16, per="token"),
        GraphInput("block_table", (max_pages,), torch.int32),
        GraphInput("seq_lens", (), torch.int32),
    ]
    support = CGSupport.UNIFORM_BATCH if q_len > 1 else CGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    runner = GraphRunner(step, inputs, support=support, batch_sizes=sizes, q_len_per_req=q_len).capture()

    def step_inputs(batch, seed):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        q = torch.randn(batch * q_len, hq, d, device="cuda", generator=gen).bfloat16()
        table = torch.randint(0, 600, (batch, max_pages), device="cuda", generator=gen, dtype=torch.int32)
        lens = torch.randint(q_len, max_pages * page, (batch,), device="cuda", generator=gen, dtype=torch.int32)
        return {"q": q, "block_table": table, "seq_lens": lens}

    return runner, step_inputs


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1, 4], ids=["single_token", "drafts4"])
def test_gqa_replay_equals_eager_bitwise_with_padding(q_len):
    runner, step_inputs = _gqa_runner(q_len)
    ptrs = {n: b.data_ptr() for n, b in runner.buffers.items()}
    for batch, seed in [(3, 1), (8, 2), (1, 3), (5, 4)]:
        x = step_inputs(batch, seed)
        out, lse = (t.clone() for t in runner.run(batch, **x))
        eager_out, eager_lse = runner.eager(batch, **x)
        assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
        assert out.shape == (batch * q_len, 64, 64)
        padded = runner.padded_size(batch)
        full_out, full_lse = runner.graphs[padded].outputs
        assert float(full_out[batch * q_len :].float().abs().sum()) == 0.0  # padded rows: 0, -inf
        assert torch.isneginf(full_lse[batch * q_len :]).all()
    assert ptrs == {n: b.data_ptr() for n, b in runner.buffers.items()}  # allocated once


@pytest.mark.gpu
def test_sparse_mla_and_merge_capture_bitwise():
    from shardattn.ops.lse_merge import lse_merge
    from shardattn.ops.sparse_mla_decode import run_sparse_mla_decode

    kv = torch.randn(20000, 576, device="cuda").bfloat16()

    def step(q, rows):
        out, lse = run_sparse_mla_decode(q, kv, rows, scale=576**-0.5, num_splits=4, kernel="triton")
        merged = lse_merge(torch.stack([out, out]), torch.stack([lse, torch.full_like(lse, -math.inf)]))
        return (out, lse, *merged)

    inputs = [GraphInput("q", (16, 576), torch.bfloat16), GraphInput("rows", (2048,), torch.int32, pad_value=-1)]
    runner = GraphRunner(step, inputs, support=CGSupport.UNIFORM_SINGLE_TOKEN_DECODE, batch_sizes=[2, 8]).capture()
    q = torch.randn(5, 16, 576, device="cuda").bfloat16()
    rows = torch.randint(-1, 20000, (5, 2048), device="cuda", dtype=torch.int32)
    got = [t.clone() for t in runner.run(5, q=q, rows=rows)]
    want = runner.eager(5, q=q, rows=rows)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(got[0], got[2])  # merging with an empty partial is the identity
    full = runner.graphs[8].outputs
    assert torch.isneginf(full[1][5:]).all() and float(full[0][5:].float().abs().sum()) == 0.0


@pytest.mark.gpu
def test_flashinfer_xqa_capture_when_installed():
    from shardattn.kernels import flashinfer_xqa

    probe = torch.zeros(1, 64, 64, device="cuda", dtype=torch.bfloat16)
    reason = flashinfer_xqa.unavailable_reason(probe, torch.zeros(1, 32, 8, 64, device="cuda"))
    if reason is not None:
        pytest.skip(reason)
    runner, step_inputs = _gqa_runner(4, backend="flashinfer")
    x = step_inputs(3, 7)
    got = runner.run(3, **x).clone()
    assert torch.equal(got, runner.eager(3, **x))
    assert float(runner.graphs[4].outputs[12:].float().abs().sum()) == 0.0
