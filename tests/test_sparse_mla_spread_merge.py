"""One-launch sparse-MLA decode with the spread merge: every split merges 1/S of its token's cells.

Under TRITON_INTERPRET=1 the programs run one after another, so a spin barrier could never be
passed; there the launcher runs the same kernel as two launches (attention + arrival, then wait +
merge + departure): the barrier is trivially satisfied and these tests check the slicing of the
cells, the merge math and the counter reset, not the concurrency. The GPU tests (``-m gpu``)
check the real one-launch kernel: concurrent programs, repeated launches and graph replays bit for
bit equal, counters back at 0.
"""

from __future__ import annotations

import pytest
import torch

from shardattn.kernels.sparse_mla import sparse_mla_reference
from shardattn.kernels.sparse_mla_decode import merge_kind, sparse_mla_decode, sparse_mla_decode_config, spread_fits
from shardattn.parallel.cudagraph import DecodeGraph
from shardattn.testing.interpret import run_interpreted


def _inputs(t, h, d, r, k, *, dtype, device="cpu", seed=0, with_len=False, with_sinks=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g).to(dtype)
    kv = torch.randn(r, d, generator=g).to(dtype)
    rows = torch.stack([torch.randperm(r, generator=g)[:k] for _ in range(t)]).int()
    rows[torch.rand(t, k, generator=g) < 0.2] = -1  # invalid anywhere in a row
    rows[0, 5] = r + 7  # out of range: invalid too
    if t > 1:
        rows[t // 2] = -1  # a token with no valid key: (0, -inf), or (0, sink) with sinks
    tlen = torch.randint(0, k + 1, (t,), generator=g).int() if with_len else None
    if tlen is not None:
        tlen[0] = 0  # topk_length 0: an empty row too
    sinks = torch.randn(h, generator=g) if with_sinks else None
    mv = (lambda x: None if x is None else x.to(device)) if device != "cpu" else (lambda x: x)
    return mv(q), mv(kv), mv(rows), mv(tlen), mv(sinks)


def _check(out, lse, ref_out, ref_lse, atol, what):
    assert not out.isnan().any() and not lse.isnan().any(), what  # every poisoned cell was written
    torch.testing.assert_close(out.float(), ref_out.float(), atol=atol, rtol=0, msg=what)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), what
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin], ref_lse[fin].float(), atol=1e-4, rtol=0, msg=what)


# (name, tokens, heads, head dim, value dim, kv rows, top-k, splits, topk_length, sinks); a split
# covers whole 64-row blocks, so top-k sets how many splits run (checked below). Value dims and
# split counts vary how the (head, column) cells are cut: 1-8 column slices per head, or several
# heads per program when there are fewer splits than heads.
CASES = [
    ("t1 h16 4 splits (4 heads per program)", 1, 16, 48, 32, 300, 256, 4, False, False),
    ("t3 h16 3 splits, topk_length, sinks", 3, 16, 48, 32, 300, 190, 3, True, True),
    ("t2 h40 (one 64-head block) 2 splits, sinks", 2, 40, 40, 32, 200, 128, 2, False, True),
    ("t2 h16 7 splits (not a power of 2)", 2, 16, 24, 16, 500, 448, 7, False, False),
    ("t1 h16 32 splits (2 column slices per head)", 1, 16, 24, 16, 2100, 2048, 32, False, False),
    ("t2 h8 64 splits (8 column slices per head), topk_length", 2, 8, 24, 16, 4200, 4096, 64, True, False),
    ("t4 h16 5 splits, dv 20 (a ragged column slice)", 4, 16, 28, 20, 400, 320, 5, False, True),
]


def interpreted_spread_cases(dtype_name: str) -> None:
    dtype = getattr(torch, dtype_name)
    atol = 2e-3 if dtype == torch.float16 else 1e-5
    for name, t, h, d, dv, r, k, splits, with_len, with_sinks in CASES:
        q, kv, rows, tlen, sinks = _inputs(t, h, d, r, k, dtype=dtype, with_len=with_len, with_sinks=with_sinks)
        ref_out, ref_lse = sparse_mla_reference(q, kv, rows, scale=0.2, v_dim=dv, topk_length=tlen, sinks=sinks)
        cfg = sparse_mla_decode_config(t, h, k, 132, splits, head_dim=d, v_dim=dv)
        assert cfg["num_splits"] == splits and spread_fits(t, h, splits, 132), (name, cfg)
        n = t * -(-h // cfg["BLOCK_H"])  # barriers: arrival counts, then generations
        counters = torch.zeros(2 * n + 6, dtype=torch.int32)  # larger than needed: generations at numel // 2
        for call in range(3):  # the same counters each call
            out = torch.full((t, h, dv), float("nan"), dtype=dtype)
            lse = torch.full((t, h), float("nan"))
            sparse_mla_decode(
                q, kv, rows, scale=0.2, v_dim=dv, topk_length=tlen, sinks=sinks, num_splits=splits,
                rows_unique=True, counters=counters, out=out, lse_out=lse, config={"merge": "spread"},
            )  # fmt: skip
            _check(out, lse, ref_out, ref_lse, atol, f"{name} call {call}")
            gens = counters[n + 3 : 2 * n + 3]
            assert counters[: n + 3].eq(0).all() and gens.eq(call + 1).all(), (name, counters)  # counts reset
        cols = sparse_mla_decode(
            q, kv, rows, scale=0.2, v_dim=dv, topk_length=tlen, sinks=sinks, num_splits=splits, rows_unique=True,
            config={"merge": "columns"},
        )  # fmt: skip
        torch.testing.assert_close(cols[0].float(), out.float(), atol=atol, rtol=0, msg=name + " vs column merge")
        routed = sparse_mla_decode(q, kv, rows, scale=0.2, v_dim=dv, topk_length=tlen, sinks=sinks, rows_unique=True)
        _check(*routed, ref_out, ref_lse, atol, name + " routed (a separate merge)")
        print("ok", name)
    # forced, but the launch does not fit in one wave: refused before any kernel runs
    q, kv, rows, _, _ = _inputs(5, 16, 24, 2048, 2048, dtype=dtype)
    try:
        sparse_mla_decode(q, kv, rows, scale=0.2, v_dim=16, num_splits=32, rows_unique=True,
                          config={"merge": "spread"})  # fmt: skip
    except ValueError as e:
        assert "one wave" in str(e) and "num_splits" in str(e), e
        print("ok refused")
    # too few counters: refused
    q, kv, rows, _, _ = _inputs(3, 16, 24, 300, 256, dtype=dtype)
    try:
        sparse_mla_decode(q, kv, rows, scale=0.2, v_dim=16, num_splits=4, rows_unique=True,
                          counters=torch.zeros(2, dtype=torch.int32), config={"merge": "spread"})  # fmt: skip
    except ValueError as e:
        assert "counters" in str(e), e
        print("ok refused")


@pytest.mark.interpret
@pytest.mark.parametrize("dtype_name", ["float16", "float32"])
def test_spread_merge_matches_reference_under_interpreter(dtype_name):
    pytest.importorskip("triton", reason="the Triton kernel needs triton")
    out = run_interpreted(__name__, "interpreted_spread_cases", dtype_name)
    assert out.count("ok ") == len(CASES) + 2, out[-2000:]


def test_routing_takes_one_wave_splits_and_a_separate_merge():
    # 16 heads, 1-8 tokens, 132 SMs: the most splits (<= 64) that fit in one wave, column merge;
    # the spread merge is opt-in (config) only: measured no faster than the column merge; a split of
    # 64 or 128 rows is one step of 8 warps
    for t, splits, block_n, warps in ((1, 64, 32, 4), (2, 64, 32, 4), (4, 32, 64, 8), (8, 16, 128, 8)):
        cfg = sparse_mla_decode_config(t, 16, 2048, 132)
        want = (splits, block_n, warps, "columns")
        assert (cfg["num_splits"], cfg["BLOCK_N"], cfg["num_warps"], cfg["merge"]) == want, (t, cfg)
        assert cfg["num_splits"] * cfg["chunk"] == 2048 and cfg["cost_model_splits"] == 32
        assert "one wave" in cfg["reason"] and spread_fits(t, 16, cfg["num_splits"], 132)
    # one step only for 2-byte inputs at <= 16 heads (an fp32 or a 32-head tile of 128 rows is too big)
    assert sparse_mla_decode_config(8, 16, 2048, 132, elem_bytes=4)["BLOCK_N"] == 64
    assert (
        sparse_mla_decode_config(4, 32, 2048, 132)["BLOCK_N"],
        sparse_mla_decode_config(4, 32, 2048, 132)["num_warps"],
    ) == (64, 4)
    # 8 tokens on a 64-SM GPU: 8 splits fit; 128 heads: up to the cost model's count; many rows: as before
    assert sparse_mla_decode_config(8, 16, 2048, 64)["num_splits"] == 8
    assert sparse_mla_decode_config(1, 128, 2048, 132)["num_splits"] == 32
    assert sparse_mla_decode_config(8, 128, 2048, 132)["merge"] == "rows"
    assert sparse_mla_decode_config(16, 16, 2048, 132)["merge"] == "rows"
    assert not spread_fits(5, 16, 32, 132) and spread_fits(2, 128, 32, 132) and not spread_fits(3, 128, 32, 132)
    assert merge_kind(1, 16, 64) == "columns" and merge_kind(1, 16, 1) == "none"
    # a short top-k the cost model does not split stays one split
    assert sparse_mla_decode_config(1, 16, 64, 132)["num_splits"] == 1


# ---- GPU: the real one-launch kernel ----


def _gpu_inputs(tokens, heads, seed):
    return _inputs(tokens, heads, 576, 1 << 15, 2048, dtype=torch.bfloat16, device="cuda", seed=seed,
                   with_len=True, with_sinks=True)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("heads, tokens", [(16, 1), (16, 2), (16, 4), (16, 8), (128, 1)])
def test_spread_merge_on_gpu_matches_reference_and_repeats_exactly(heads, tokens):
    """Real shapes (top-k 2048 of 2^15 rows, bf16, D 576 / Dv 512) with invalid rows anywhere, an
    empty row, topk_length (one 0) and sinks; 20 launches on NaN-poisoned outputs give the same
    bits and leave the counters 0; the column merge agrees."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    q, kv, rows, tlen, sinks = _gpu_inputs(tokens, heads, heads + tokens)
    ref_out, ref_lse = sparse_mla_reference(q, kv, rows, scale=576**-0.5, topk_length=tlen, sinks=sinks)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = sparse_mla_decode_config(tokens, heads, 2048, sms)
    splits = cfg["num_splits"]
    assert splits > 1 and spread_fits(tokens, heads, splits, sms), cfg
    n = tokens * -(-heads // cfg["BLOCK_H"])
    counters = torch.zeros(2 * n, dtype=torch.int32, device="cuda")
    first = None
    for call in range(20):
        out = torch.full((tokens, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((tokens, heads), float("nan"), device="cuda")
        kw = dict(num_splits=splits, config={"merge": "spread"}, counters=counters, out=out, lse_out=lse)
        sparse_mla_decode(q, kv, rows, scale=576**-0.5, topk_length=tlen, sinks=sinks, rows_unique=True, **kw)
        if first is None:
            first = (out.clone(), lse.clone())
            _check(out, lse, ref_out, ref_lse, 2e-2, f"H{heads} T{tokens}")
        else:
            assert torch.equal(out, first[0]) and torch.equal(lse, first[1])
        assert counters[:n].eq(0).all() and counters[n:].eq(call + 1).all(), counters  # one generation a call
    cols = sparse_mla_decode(q, kv, rows, scale=576**-0.5, topk_length=tlen, sinks=sinks, rows_unique=True,
                             num_splits=splits, config={"merge": "columns"})  # fmt: skip
    torch.testing.assert_close(cols[0].float(), first[0].float(), atol=1e-2, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8])
def test_spread_merge_graph_replays_bit_exact(tokens):
    """The spread merge on the routed split kernel, captured in a CUDA graph: 50 replays equal the
    eager result bit for bit and leave the counts 0; new inputs copied into the graph's buffers
    give the new reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    heads = 16
    q, kv, rows, tlen, sinks = _gpu_inputs(tokens, heads, 7 + tokens)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = sparse_mla_decode_config(tokens, heads, 2048, sms)
    assert spread_fits(tokens, heads, cfg["num_splits"], sms), cfg
    counters = torch.zeros(2 * tokens, dtype=torch.int32, device="cuda")
    out = torch.full((tokens, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((tokens, heads), float("nan"), device="cuda")
    ws = torch.empty(cfg["num_splits"] * tokens * heads * 513, device="cuda")

    kw = dict(counters=counters, out=out, lse_out=lse, workspace=ws, config={"merge": "spread"})

    def step():
        sparse_mla_decode(q, kv, rows, scale=576**-0.5, topk_length=tlen, sinks=sinks, rows_unique=True, **kw)

    step()
    eager = (out.clone(), lse.clone())
    g = DecodeGraph(step, {}, warmup=1)  # one more eager call on a side stream, then the capture
    for _ in range(50):
        out.fill_(float("nan"))
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager[0]) and torch.equal(lse, eager[1])
    assert counters[:tokens].eq(0).all() and counters[tokens:].eq(52).all(), counters  # 2 eager calls, 50 replays
    q2, _, rows2, tlen2, _ = _gpu_inputs(tokens, heads, 99)
    q.copy_(q2)
    rows.copy_(rows2)
    tlen.copy_(tlen2)
    g.replay()
    ref_out, ref_lse = sparse_mla_reference(q, kv, rows, scale=576**-0.5, topk_length=tlen, sinks=sinks)
    _check(out, lse, ref_out, ref_lse, 2e-2, f"T{tokens} new inputs")
