"""One-launch small-batch sparse-MLA decode: the last split of each token merges the partials.

Under TRITON_INTERPRET=1 (sequential programs: the counter logic, not its concurrency) and on a
GPU (concurrent programs; repeated launches must agree bit for bit and leave the counters 0).
"""

from __future__ import annotations

import pytest
import torch

from shardattn.kernels.sparse_mla import sparse_mla_reference
from shardattn.kernels.sparse_mla_decode import sparse_mla_decode, sparse_mla_decode_config
from shardattn.testing.interpret import run_interpreted


def _inputs(t, h, d, r, k, *, dtype, device="cpu", seed=0, with_len=False, with_sinks=False, empty_row=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g).to(dtype)
    kv = torch.randn(r, d, generator=g).to(dtype)
    rows = torch.stack([torch.randperm(r, generator=g)[:k] for _ in range(t)]).int()
    rows[torch.rand(t, k, generator=g) < 0.2] = -1  # invalid anywhere in a row
    if empty_row and t > 1:
        rows[-1] = -1  # a token with no valid key
    tlen = torch.randint(0, k + 1, (t,), generator=g).int() if with_len else None
    sinks = torch.randn(h, generator=g) if with_sinks else None
    mv = (lambda x: None if x is None else x.to(device)) if device != "cpu" else (lambda x: x)
    return mv(q), mv(kv), mv(rows), mv(tlen), mv(sinks)


def _check(out, lse, ref_out, ref_lse, atol, what):
    torch.testing.assert_close(out.float(), ref_out.float(), atol=atol, rtol=0, msg=what)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), what
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin], ref_lse[fin].float(), atol=1e-4, rtol=0, msg=what)


# (name, tokens, heads, head dim, value dim, kv rows, top-k, splits asked, topk_length, sinks);
# a split covers whole 64-row blocks, so top-k sets how many splits really run (checked below)
CASES = [
    ("t1 h16 4 splits", 1, 16, 48, 32, 300, 256, 4, False, False),
    ("t3 h16 3 splits, topk_length, sinks", 3, 16, 48, 32, 300, 190, 3, True, True),
    ("t2 h40 (3 head blocks) 2 splits", 2, 40, 40, 32, 200, 128, 2, False, True),
    ("t2 h16 7 splits (not a power of 2)", 2, 16, 24, 16, 500, 448, 7, False, False),
    ("t1 h16 5 splits, one row all invalid", 1, 16, 24, 16, 400, 320, 5, False, False),
]


def interpreted_fused_cases(dtype_name: str) -> None:
    dtype = getattr(torch, dtype_name)
    atol = 2e-3 if dtype == torch.float16 else 1e-5
    for name, t, h, d, dv, r, k, splits, with_len, with_sinks in CASES:
        q, kv, rows, tlen, sinks = _inputs(t, h, d, r, k, dtype=dtype, with_len=with_len, with_sinks=with_sinks)
        if "all invalid" in name:
            rows[0, 64:] = -1  # every split but the first sees no key: (0, -inf) partials merge away
        ref_out, ref_lse = sparse_mla_reference(q, kv, rows, scale=0.2, v_dim=dv, topk_length=tlen, sinks=sinks)
        cfg = sparse_mla_decode_config(t, h, k, 132, splits, head_dim=d, v_dim=dv)
        assert cfg["num_splits"] == splits, (name, cfg)  # the tree really has this many leaves
        counters = torch.zeros(t * -(-h // cfg["BLOCK_H"]) * cfg["num_splits"], dtype=torch.int32)
        for call in range(2):  # the counters come back zeroed: a second call reuses them
            out = torch.full((t, h, dv), float("nan"), dtype=dtype)
            lse = torch.full((t, h), float("nan"))
            sparse_mla_decode(
                q, kv, rows, scale=0.2, v_dim=dv, topk_length=tlen, sinks=sinks, num_splits=splits,
                rows_unique=True, fused_merge=True, counters=counters, out=out, lse_out=lse,
            )  # fmt: skip
            _check(out, lse, ref_out, ref_lse, atol, f"{name} call {call}")
            assert counters.eq(0).all(), name
        unfused = sparse_mla_decode(
            q, kv, rows, scale=0.2, v_dim=dv, topk_length=tlen, sinks=sinks, num_splits=splits, rows_unique=True,
            fused_merge=False,
        )  # fmt: skip
        _check(unfused[0], unfused[1], ref_out, ref_lse, atol, name + " unfused")
        print("ok", name)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype_name", ["float16", "float32"])
def test_fused_merge_matches_reference_under_interpreter(dtype_name):
    pytest.importorskip("triton", reason="the Triton kernel needs triton")
    out = run_interpreted(__name__, "interpreted_fused_cases", dtype_name)
    assert out.count("ok ") == len(CASES)


def test_bad_counters_are_refused():
    pytest.importorskip("triton", reason="the Triton kernel needs triton")
    if not torch.cuda.is_available():
        pytest.skip("the CPU path runs the torch reference (no counters)")
    q, kv, rows, _, _ = _inputs(2, 16, 576, 4096, 2048, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="counters must be an int32"):
        bad = torch.zeros(1, dtype=torch.int32).cuda()
        sparse_mla_decode(q, kv, rows, scale=0.04, num_splits=8, fused_merge=True, counters=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_fused_merge_on_gpu_is_exact_repeatable_and_resets_counters(heads, tokens):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    q, kv, rows, _, sinks = _inputs(tokens, heads, 576, 1 << 15, 2048, dtype=torch.bfloat16, device="cuda",
                                    seed=heads + tokens, with_sinks=True)  # fmt: skip
    ref_out, ref_lse = sparse_mla_reference(q.float(), kv.float(), rows, scale=576**-0.5, v_dim=512, sinks=sinks)
    cfg = sparse_mla_decode_config(tokens, heads, 2048, torch.cuda.get_device_properties(0).multi_processor_count)
    assert cfg["num_splits"] > 1  # the fused path is what runs
    counters = torch.zeros(tokens * -(-heads // cfg["BLOCK_H"]) * cfg["num_splits"], dtype=torch.int32, device="cuda")
    first = None
    for _ in range(20):  # concurrent programs: every launch must merge the same partials the same way
        out = torch.full((tokens, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((tokens, heads), float("nan"), device="cuda")
        kw = dict(rows_unique=True, fused_merge=True, counters=counters, out=out, lse_out=lse)
        sparse_mla_decode(q, kv, rows, scale=576**-0.5, sinks=sinks, **kw)
        if first is None:
            first = (out.clone(), lse.clone())
            _check(out, lse, ref_out, ref_lse, 2e-2, f"H{heads} T{tokens}")
        else:
            assert torch.equal(out, first[0]) and torch.equal(lse, first[1])
        assert int(counters.abs().sum()) == 0
    unfused = sparse_mla_decode(q, kv, rows, scale=576**-0.5, sinks=sinks, rows_unique=True, fused_merge=False)
    torch.testing.assert_close(unfused[0].float(), first[0].float(), atol=1e-2, rtol=0)
