"""GQA paged decode: the torch reference against fp64 loops, the Triton kernel (interpreter and
GPU) against the reference, FlashInfer XQA against both when installed, and input validation."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from shardattn.ops.gqa_decode import gqa_paged_decode, run_gqa_paged_decode
from shardattn.ops.gqa_decode_reference import gqa_paged_decode_reference
from shardattn.testing.interpret import run_interpreted
from tests.oracle import gqa_oracle


@dataclass(frozen=True)
class Case:
    name: str
    seq_lens: tuple[int, ...]
    q_lens: tuple[int, ...] | None = None  # ragged drafts (cu_q_lens); None = uniform q_len
    q_len: int = 1
    hq: int = 4
    hkv: int = 2
    d: int = 16
    page: int = 16
    causal: bool = True
    window_left: int = -1
    sinks: bool = False
    extra_rows: int = 0  # rows of q past cu_q_lens[-1] (graph padding)


CASES = [
    Case("single_token", (20, 37, 1)),
    Case("single_token_padded_request", (20, 0, 33), sinks=True),
    Case("uniform_drafts_causal", (20, 5, 40), q_len=3),
    Case("uniform_drafts_noncausal_sinks", (20, 5, 40), q_len=3, causal=False, sinks=True),
    Case("ragged_0_2_4_4_4", (18, 33, 0, 0), q_lens=(2, 2, 0, 0)),
    Case("ragged_0_3_3", (35, 0), q_lens=(3, 0), sinks=True),
    Case("ragged_noncausal_window", (30, 17, 9), q_lens=(4, 1, 3), causal=False, window_left=5),
    Case("window_0_sees_itself", (20, 9), q_len=2, window_left=0),
    Case("window_wider_than_context", (20, 9), q_len=2, window_left=64),
    Case("window_edge_drafts", (33, 17), q_len=4, window_left=16, hq=8, hkv=2, d=32, page=32),
    Case("graph_padding_rows", (12, 20), q_lens=(1, 2), extra_rows=3),
]


def make_inputs(case: Case, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    batch = len(case.seq_lens)
    max_pages = max(1, max(-(-s // case.page) for s in case.seq_lens)) + 1
    num_pages = batch * max_pages + 2
    shape = (num_pages, case.page, case.hkv, case.d)
    k = torch.randn(shape, generator=g).to(dtype)
    v = torch.randn(shape, generator=g).to(dtype)
    table = torch.randperm(num_pages, generator=g)[: batch * max_pages].view(batch, max_pages).int()
    lens = torch.tensor(case.seq_lens, dtype=torch.int32)
    if case.q_lens is None:
        cu = None
        total = batch * case.q_len
    else:
        cu = torch.tensor([0, *torch.tensor(case.q_lens).cumsum(0).tolist()], dtype=torch.int32)
        total = int(cu[-1]) + case.extra_rows
    q = torch.randn(total, case.hq, case.d, generator=g).to(dtype)
    sinks = torch.randn(case.hq, generator=g) * 2 if case.sinks else None
    kw = dict(
        q_len_per_req=None if cu is not None else case.q_len,
        cu_q_lens=cu,
        causal=case.causal,
        window_left=case.window_left,
        sinks=sinks,
    )
    tensors = [t.to(device) for t in (q, k, v, table, lens)]
    kw = {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    return tensors, kw


def loop_reference(q, k, v, table, lens, *, q_len_per_req, cu_q_lens, causal, window_left, sinks):
    """Straightforward fp64 loops over requests, queries, heads and keys (tests/oracle.py)."""
    batch = table.shape[0]
    cu = cu_q_lens.tolist() if cu_q_lens is not None else [b * q_len_per_req for b in range(batch + 1)]
    return gqa_oracle(
        q, k, v, table, lens, cu, scale=q.shape[-1] ** -0.5, causal=causal, window_left=window_left, sinks=sinks
    )


def assert_lse_close(lse, ref, atol):
    assert lse.shape == ref.shape
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref.to(lse.dtype)))
    fin = torch.isfinite(ref)
    assert torch.isfinite(lse[fin]).all()
    torch.testing.assert_close(lse[fin].double(), ref[fin].double(), atol=atol, rtol=0)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_reference_matches_fp64_loops(case: Case):
    (q, k, v, table, lens), kw = make_inputs(case)
    out, lse = gqa_paged_decode(q, k, v, table, lens, return_lse=True, **kw)  # CPU -> reference
    ref_out, ref_lse = loop_reference(q, k, v, table, lens, **kw)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=0)
    assert_lse_close(lse, ref_lse, atol=2e-5)


def test_padded_requests_and_rows_write_zero_and_neg_inf():
    case = Case("pad", (12, 0, 20), q_lens=(1, 2, 2), extra_rows=2, sinks=True)
    (q, k, v, table, lens), kw = make_inputs(case)
    out, lse = gqa_paged_decode(q, k, v, table, lens, return_lse=True, **kw)
    padded = [1, 2, 5, 6]  # request 1 (seq_len 0) and the rows past cu_q_lens[-1]
    assert float(out[padded].abs().sum()) == 0.0
    assert torch.isneginf(lse[padded]).all()
    assert torch.isfinite(lse[[0, 3, 4]]).all()


def test_sinks_change_the_result_exactly_as_the_merge_says():
    """A sink is one more softmax term with value 0: out scales by exp(lse - lse_sink)."""
    case = Case("sinks", (20, 33), q_len=2, sinks=True)
    (q, k, v, table, lens), kw = make_inputs(case)
    sinks = kw.pop("sinks")
    base_out, base_lse = gqa_paged_decode_reference(
        q.double(),
        k.double(),
        v.double(),
        table,
        lens,
        torch.tensor([0, 2, 4], dtype=torch.int32),
        scale=case.d**-0.5,
        compute_dtype=torch.float64,
    )
    out, lse = gqa_paged_decode(q, k, v, table, lens, sinks=sinks, return_lse=True, **kw)
    want_lse = torch.logaddexp(base_lse.double(), sinks.double()[None, :])
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=0)
    want_out = base_out * torch.exp(base_lse.double() - want_lse)[..., None]
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=0)
    assert not torch.allclose(out.double(), base_out, atol=1e-3)


def test_window_zero_attends_to_its_own_position_only():
    case = Case("w0", (20, 9), q_len=2, window_left=0)
    (q, k, v, table, lens), kw = make_inputs(case)
    out, lse = gqa_paged_decode(q, k, v, table, lens, return_lse=True, **kw)
    for row, (b, pos) in enumerate([(0, 18), (0, 19), (1, 7), (1, 8)]):
        slot = k[int(table[b, pos // case.page]), pos % case.page]  # [Hkv, D]
        val = v[int(table[b, pos // case.page]), pos % case.page]
        kv_of_head = torch.arange(case.hq) // (case.hq // case.hkv)
        torch.testing.assert_close(out[row], val[kv_of_head], atol=1e-6, rtol=0)
        torch.testing.assert_close(lse[row], (q[row] * slot[kv_of_head]).sum(-1) * case.d**-0.5, atol=1e-5, rtol=0)


def _bad_call(**changes):
    (q, k, v, table, lens), kw = make_inputs(Case("bad", (20, 9), q_len=2))
    args = dict(q=q, k_cache=k, v_cache=v, block_table=table, seq_lens=lens)
    kw.update({n: x for n, x in changes.items() if n not in args})
    args.update({n: x for n, x in changes.items() if n in args})
    return gqa_paged_decode(
        args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), args.pop("block_table"), args.pop("seq_lens"), **kw
    )


@pytest.mark.parametrize(
    "changes, error, match",
    [
        ({"q": torch.zeros(4, 4, 16, dtype=torch.float16)}, TypeError, "k_cache must have dtype"),
        ({"seq_lens": torch.tensor([20, 9], dtype=torch.int64)}, TypeError, "seq_lens must have dtype"),
        ({"q": torch.zeros(5, 4, 16)}, ValueError, "q must have batch \\* q_len_per_req"),
        ({"q": torch.zeros(4, 3, 16)}, ValueError, "multiple of k_cache's KV heads"),
        ({"cu_q_lens": torch.tensor([0, 2, 4], dtype=torch.int32)}, ValueError, "not both"),
        ({"sinks": torch.zeros(3)}, ValueError, "sinks must have shape"),
        ({"window_left": -2}, ValueError, "window_left must be >= -1"),
        ({"seq_lens": torch.tensor([20, 999], dtype=torch.int32)}, ValueError, "seq_lens must be <="),
        ({"backend": "cuda"}, ValueError, "backend must be one of"),
        ({"return_lse": True, "backend": "flashinfer"}, ValueError, "returns no LSE"),
        ({"backend": "flashinfer"}, ValueError, "unavailable"),
        ({"backend": "triton"}, ValueError, "unavailable"),
    ],
    ids=[
        "q_dtype",
        "seq_lens_dtype",
        "rows",
        "heads",
        "both_q_lens",
        "sinks_shape",
        "window",
        "too_long",
        "backend_name",
        "xqa_lse",
        "xqa_cpu",
        "triton_cpu",
    ],
)
def test_bad_input_is_refused_with_the_argument_named(changes, error, match):
    with pytest.raises(error, match=match):
        _bad_call(**changes)


def test_ragged_offsets_are_checked_on_cpu():
    (q, k, v, table, lens), _ = make_inputs(Case("r", (20, 9), q_lens=(2, 2)))
    with pytest.raises(ValueError, match="cu_q_lens must start at 0"):
        gqa_paged_decode(q, k, v, table, lens, cu_q_lens=torch.tensor([0, 3, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="more queries than keys"):
        gqa_paged_decode(
            q,
            k,
            v,
            table,
            torch.tensor([20, 1], dtype=torch.int32),
            cu_q_lens=torch.tensor([0, 2, 4], dtype=torch.int32),
        )


def _triton_with_splits(q, k, v, table, lens, splits, *, q_len_per_req, cu_q_lens, causal, window_left, sinks, **out):
    """The Triton path at a given split count (a launch knob: the private runner's, not the op's)."""
    return run_gqa_paged_decode(
        q, k, v, table, lens, q_len_per_req=q_len_per_req, cu_q_lens=cu_q_lens, max_q_len=None, causal=causal,
        window_left=window_left, sinks=sinks, return_lse=True, scale=q.shape[-1] ** -0.5, backend="triton",
        num_splits=splits, **out,
    )  # fmt: skip


# ---- Triton interpreter (subprocess: TRITON_INTERPRET must be set before triton is imported) ----

INTERPRETED = [c for c in CASES if c.name != "window_wider_than_context"]


def interpreted_cases(dtype_name: str) -> None:
    """Run in a subprocess with TRITON_INTERPRET=1: Triton kernel vs reference on every case."""
    dtype = getattr(torch, dtype_name)
    atol = 2e-3 if dtype == torch.float16 else 1e-5
    cases = INTERPRETED if dtype == torch.float16 else INTERPRETED[::3]
    for i, case in enumerate(cases):
        for splits in (1, 3) if i % 3 == 0 else (1 + 2 * (i % 2),):
            (q, k, v, table, lens), kw = make_inputs(case, dtype)
            out, lse = _triton_with_splits(q, k, v, table, lens, splits, **kw)
            ref_out, ref_lse = gqa_paged_decode(q, k, v, table, lens, return_lse=True, backend="reference", **kw)
            torch.testing.assert_close(out.float(), ref_out.float(), atol=atol, rtol=0, msg=case.name)
            assert_lse_close(lse, ref_lse, atol=1e-4)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype_name", ["float16", "float32"])
def test_triton_kernel_matches_reference_under_interpreter(dtype_name):
    pytest.importorskip("triton", reason="the Triton kernel needs triton")
    run_interpreted(__name__, "interpreted_cases", dtype_name)


# ---- GPU: real shapes, poisoned outputs, every backend ----

GPU_CASES = [
    Case("gpu_single", tuple(range(900, 8000, 900)), hq=64, hkv=8, d=64, page=32),
    Case("gpu_drafts4", (4000, 17, 2500, 8192), q_len=4, hq=64, hkv=8, d=64, page=32, sinks=True),
    Case(
        "gpu_ragged",
        (4000, 0, 2500, 70),
        q_lens=(2, 0, 4, 1),
        hq=32,
        hkv=4,
        d=128,
        page=16,
        causal=False,
        window_left=300,
        extra_rows=2,
    ),
    Case("gpu_ragged_0_2_4_4_4", (3000, 40, 0, 0), q_lens=(2, 2, 0, 0), hq=64, hkv=8, d=64, page=64),
]


def _poisoned(q):
    return torch.full_like(q, float("nan")), torch.full(q.shape[:2], float("nan"), device=q.device)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[c.name for c in GPU_CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_triton_kernel_on_gpu(case, dtype):
    (q, k, v, table, lens), kw = make_inputs(case, dtype, device="cuda")
    ref_out, ref_lse = gqa_paged_decode_reference(
        q,
        k,
        v,
        table,
        lens,
        kw["cu_q_lens"]
        if kw["cu_q_lens"] is not None
        else torch.arange(len(case.seq_lens) + 1, device="cuda", dtype=torch.int32) * case.q_len,
        causal=case.causal,
        window_left=case.window_left,
        sinks=kw["sinks"],
        scale=case.d**-0.5,
    )
    for splits in (None, 1, 4):
        out, lse = _poisoned(q)
        _triton_with_splits(q, k, v, table, lens, splits, out=out, lse_out=lse, **kw)
        assert not out.isnan().any() and not lse.isnan().any()
        torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=0)
        assert_lse_close(lse, ref_lse, atol=1e-3)


# XQA JIT-compiles one module per (page, head_dim, group, window on/off, draft length, ragged):
# these cases share the benchmark's geometry so the GPU run compiles three modules, not ten.
XQA_CASES = [
    Case("xqa_single", (*range(900, 8000, 900), 0), hq=64, hkv=8, d=64, page=32, sinks=True),
    Case("xqa_drafts4", (4000, 17, 0, 8192), q_len=4, hq=64, hkv=8, d=64, page=32),
    Case("xqa_drafts4_noncausal", (4000, 17, 2500, 8192), q_len=4, hq=64, hkv=8, d=64, page=32, causal=False),
    Case("xqa_ragged", (4000, 0, 2500, 70), q_lens=(4, 0, 3, 1), hq=64, hkv=8, d=64, page=32, extra_rows=2),
    Case(
        "xqa_ragged_noncausal_sinks",
        (4000, 9, 0, 70),
        q_lens=(2, 4, 4, 1),
        hq=64,
        hkv=8,
        d=64,
        page=32,
        causal=False,
        sinks=True,
    ),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", XQA_CASES, ids=[c.name for c in XQA_CASES])
def test_flashinfer_xqa_matches_triton_and_reference(case):
    from shardattn.kernels import flashinfer_xqa

    (q, k, v, table, lens), kw = make_inputs(case, torch.bfloat16, device="cuda")
    reason = flashinfer_xqa.unavailable_reason(q, k)
    if reason is not None:
        pytest.skip(reason)
    if kw["cu_q_lens"] is not None:
        kw["max_q_len"] = 4
    xqa = gqa_paged_decode(q, k, v, table, lens, backend="flashinfer", out=_poisoned(q)[0], **kw)
    tri = gqa_paged_decode(q, k, v, table, lens, backend="triton", **kw)
    ref = gqa_paged_decode(q, k, v, table, lens, backend="reference", **kw)
    assert not xqa.isnan().any()
    torch.testing.assert_close(xqa.float(), ref.float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(xqa.float(), tri.float(), atol=2e-2, rtol=0)
