"""LSE merge: the CPU path and the Triton kernel (interpreter) against fp64 loops, the kernel on the GPU
against the reference, empty partials (``-inf``) and all-empty rows, destinations given by the caller."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardattn.kernels.backend import triton_available
from shardattn.kernels.triton.lse_merge import launch_lse_merge_columns
from shardattn.ops.lse_merge import lse_merge, lse_merge_reference
from shardattn.testing.interpret import run_interpreted


def make_partials(p, t, h, d, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    outs = torch.randn(p, t, h, d, generator=g).to(dtype)
    lses = torch.randn(p, t, h, generator=g) * 3
    empty = torch.rand(p, t, h, generator=g) < 0.3
    lses[empty] = -math.inf
    outs[empty] = 0  # an empty partial is (0, -inf)
    lses[:, 0, 0] = -math.inf  # a row empty everywhere
    outs[:, 0, 0] = 0
    return outs.to(device), lses.to(device)


def loop_merge(outs, lses):
    p, t, h, d = outs.shape
    out = torch.zeros(t, h, d, dtype=torch.float64)
    lse = torch.full((t, h), -math.inf, dtype=torch.float64)
    for i in range(t):
        for j in range(h):
            ls = [float(lses[k, i, j]) for k in range(p)]
            if all(x == -math.inf for x in ls):
                continue
            m = max(ls)
            z = sum(math.exp(x - m) for x in ls)
            lse[i, j] = m + math.log(z)
            for k in range(p):
                out[i, j] += math.exp(ls[k] - lse[i, j]) * outs[k, i, j].double()
    return out, lse


def assert_merged(out, lse, ref_out, ref_lse, atol):
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin].double(), ref_lse[fin].double(), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.double(), ref_out.double(), atol=atol, rtol=0)


@pytest.mark.parametrize("p", [1, 2, 5])
def test_reference_matches_fp64_loops(p):
    outs, lses = make_partials(p, 3, 4, 8)
    out, lse = lse_merge(outs, lses)  # CPU -> reference
    ref_out, ref_lse = loop_merge(outs, lses)
    assert_merged(out, lse, ref_out, ref_lse, atol=1e-5)
    assert float(out[0, 0].abs().sum()) == 0.0 and math.isinf(float(lse[0, 0]))


@pytest.mark.parametrize("centre", [-300.0, -120.0, 120.0, 300.0])
def test_lses_far_from_zero_merge_without_under_or_overflow(centre):
    """LSEs of -300 to 300 (exp of any of them under- or overflows fp32): the merge shifts by the
    largest LSE first, so the result is the fp64 loops'; empty partials and an all-empty row
    included."""
    outs, lses = make_partials(3, 4, 5, 6, seed=11)
    lses = lses + centre  # fp32 LSEs a few ulps of |centre| apart: the tolerances scale with it
    out, lse = lse_merge(outs, lses)
    ref_out, ref_lse = loop_merge(outs, lses)
    assert out.isfinite().all() and torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    ulp = torch.finfo(torch.float32).eps * abs(centre)
    torch.testing.assert_close(lse[fin].double(), ref_lse[fin], atol=4 * ulp, rtol=0)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=0)


@pytest.mark.parametrize("marker", [-math.inf, math.inf])
@pytest.mark.parametrize("junk", [math.nan, math.inf, -math.inf])
def test_reference_ignores_what_empty_partials_hold(marker, junk):
    """An empty partial (LSE -inf, or FlashMLA's +inf) contributes nothing on the CPU path, as in the
    kernels, whatever its output holds: NaN or inf included."""
    outs, lses = make_partials(3, 3, 4, 8)
    empty = torch.isneginf(lses)
    ref_out, ref_lse = loop_merge(outs, lses)
    lses[empty] = marker
    outs[empty] = junk
    out, lse = lse_merge(outs, lses)
    assert_merged(out, lse, ref_out, ref_lse, atol=1e-5)


def nan_partials(dtype=torch.float32):
    """Partials with row (1, 0) broken in one partial (NaN LSE) and row (2, 1) broken in its output
    alone (NaN values under a finite LSE), beside rows the NaN must not reach."""
    outs, lses = make_partials(3, 3, 2, 8, dtype, seed=5)
    lses[:, 1:, :] = torch.randn(3, 2, 2)  # the broken rows' other partials are not empty
    lses[1, 1, 0] = math.nan
    outs[2, 2, 1, 3] = math.nan
    return outs, lses


def assert_nan_rows(out, lse, outs, lses):
    """Rows (1, 0) and (2, 1) NaN where the break reaches (a NaN LSE: the row and its LSE; a NaN
    output value: that column), every other row the merge of the clean partials."""
    assert bool(out[1, 0].isnan().all()) and math.isnan(float(lse[1, 0]))
    assert bool(out[2, 1, 3].isnan()) and not out[2, 1, :3].isnan().any() and math.isfinite(float(lse[2, 1]))
    clean = torch.ones(3, 2, dtype=torch.bool)
    clean[1, 0] = False
    ref_out, ref_lse = loop_merge(torch.where(outs.isnan(), 0, outs), torch.where(lses.isnan(), 0, lses))
    torch.testing.assert_close(lse[clean].double(), ref_lse[clean], atol=1e-5, rtol=0)
    keep = clean[..., None].expand(-1, -1, 8).clone()
    keep[2, 1, 3] = False
    torch.testing.assert_close(out.double()[keep], ref_out[keep], atol=2e-3, rtol=0)


def test_a_nan_partial_makes_its_row_nan_not_empty():
    """A NaN LSE or a NaN in a non-empty partial's output reaches the merged row (a broken partial is
    seen, not dropped as empty); the other rows are unaffected."""
    outs, lses = nan_partials()
    out, lse = lse_merge(outs, lses)
    assert_nan_rows(out, lse, outs, lses)


def interpreted_nan_cases() -> None:
    from shardattn.kernels.triton.lse_merge import launch_lse_merge

    outs, lses = nan_partials(torch.float16)
    for merge in (launch_lse_merge, launch_lse_merge_columns):
        out = torch.zeros(3, 2, 8, dtype=torch.float16)
        lse = torch.zeros(3, 2)
        merge(outs, lses, out, lse)
        assert_nan_rows(out, lse, outs, lses)
        print("ok", merge.__name__)


@pytest.mark.interpret
def test_a_nan_partial_makes_its_row_nan_in_both_merge_kernels_under_interpreter():
    pytest.importorskip("triton", reason="the Triton kernels need triton")
    assert run_interpreted(__name__, "interpreted_nan_cases").count("ok ") == 2


def test_given_destinations_are_filled_in_place():
    outs, lses = make_partials(3, 2, 2, 8)
    out = torch.full((2, 2, 8), float("nan"), dtype=torch.float16)
    lse = torch.full((2, 2), float("nan"))
    got_out, got_lse = lse_merge(outs, lses, out=out, lse_out=lse)
    assert got_out.data_ptr() == out.data_ptr() and got_lse.data_ptr() == lse.data_ptr()
    ref_out, ref_lse = loop_merge(outs, lses)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-3, rtol=0)
    assert_merged(out, lse, ref_out, ref_lse, atol=1e-3)
    with pytest.raises(ValueError, match="out must have shape"):
        lse_merge(outs, lses, out=torch.zeros(2, 2, 7))
    with pytest.raises(TypeError, match="lse_out must have dtype"):
        lse_merge(outs, lses, lse_out=torch.zeros(2, 2, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_two_byte_partials_into_an_fp32_out_are_rounded_once(dtype):
    """Two-byte partials merged into a caller's fp32 ``out`` keep the fp32 merge, as the kernels do
    (they store their fp32 accumulator in out's dtype): the CPU path did not round it to the
    partials' dtype first."""
    outs, lses = make_partials(4, 6, 3, 32, dtype, seed=3)
    ref_out, ref_lse = loop_merge(outs, lses)
    out = torch.full((6, 3, 32), float("nan"))
    got_out, got_lse = lse_merge(outs, lses, out=out)
    assert got_out is out and out.dtype == torch.float32
    assert_merged(out, got_lse, ref_out, ref_lse, atol=1e-5)
    own, _ = lse_merge(outs, lses)  # without out: the partials' dtype, rounded from the same fp32 merge
    assert own.dtype == dtype and torch.equal(own, out.to(dtype))


def interpreted_cases(dtype_name: str) -> None:
    dtype = getattr(torch, dtype_name)
    atol = 2e-3 if dtype == torch.float16 else 1e-5
    for p, t, h, d in [(1, 3, 2, 16), (2, 5, 3, 24), (8, 2, 4, 64)]:
        outs, lses = make_partials(p, t, h, d, dtype)
        out, lse = lse_merge(outs, lses)
        ref_out, ref_lse = loop_merge(outs, lses)
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert_merged(out, lse, ref_out, ref_lse, atol)
    # strided partials (a slice of a bigger buffer) and garbage in empty partials
    outs, lses = make_partials(3, 4, 2, 16, dtype)
    big = torch.full((3, 4, 2, 32), float("nan"), dtype=dtype)
    big[..., :16] = outs
    outs_garbage = big[..., :16].clone()
    outs_garbage[torch.isneginf(lses)] = float("nan")
    out, lse = lse_merge(big[..., :16], lses)
    ref_out, ref_lse = loop_merge(outs, lses)
    assert_merged(out, lse, ref_out, ref_lse, atol)
    out, _ = lse_merge(outs_garbage, lses)  # the kernel ignores empty partials' contents
    assert_merged(out, lse, ref_out, ref_lse, atol)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype_name", ["float16", "float32"])
def test_triton_kernel_matches_reference_under_interpreter(dtype_name):
    pytest.importorskip("triton", reason="the Triton kernel needs triton")
    run_interpreted(__name__, "interpreted_cases", dtype_name)


def interpreted_column_cases(dtype_name: str) -> None:
    """The column merge: partial counts that are and are not powers of 2, a column block that
    does not divide D, row blocks of 1 or more rows (the last one short: 5, 7 or 15 rows in blocks
    of 2 / 4; the Gluon decode's tile at 3 slices), +inf (FlashMLA's empty marker), NaN garbage in empty partials."""
    dtype = getattr(torch, dtype_name)
    atol = 2e-3 if dtype == torch.float16 else 1e-5
    cases = [(1, 2, 3, 16, 16, 1), (3, 2, 3, 40, 16, 1), (8, 3, 2, 64, 32, 1), (5, 1, 4, 24, 128, 1)]
    cases += [(2, 1, 5, 32, 32, 2), (3, 7, 1, 40, 16, 4)]
    from shardattn.kernels.gluon.sparse_mla_decode import gluon_merge_tile

    cases += [(3, 3, 5, 512, *gluon_merge_tile(3, 512)[::-1])]  # the Gluon decode's tile: 2 rows x 512
    for p, t, h, d, block_d, block_rows in cases:
        outs, lses = make_partials(p, t, h, d, dtype, seed=p + d)
        ref_out, ref_lse = loop_merge(outs, lses)
        lses_flash = torch.where(torch.isneginf(lses) & (torch.arange(h) % 2 == 0), math.inf, lses)
        garbage = torch.where(torch.isinf(lses)[..., None], float("nan"), outs.float()).to(dtype)
        out = torch.full((t, h, d), float("nan"), dtype=dtype)
        lse = torch.full((t, h), float("nan"))
        launch_lse_merge_columns(garbage, lses_flash, out, lse, block_d=block_d, block_rows=block_rows, num_warps=1)
        assert_merged(out, lse, ref_out, ref_lse, atol)
        print("ok", p, t, h, d, block_rows)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype_name", ["float16", "float32"])
def test_column_merge_matches_reference_under_interpreter(dtype_name):
    pytest.importorskip("triton", reason="the Triton kernel needs triton")
    assert run_interpreted(__name__, "interpreted_column_cases", dtype_name).count("ok ") == 7


def interpreted_split_and_merge_cases() -> None:
    """The small-batch and streaming kernels' launch-and-merge: one split written straight into the
    result, more into fp32 partials (a caller's workspace or allocated) merged into it."""
    from shardattn.kernels.gluon.sparse_mla_decode_small import launch_split_and_merge
    from shardattn.kernels.triton.lse_merge import split_partials_numel

    for splits, with_ws in [(1, False), (3, False), (4, True)]:
        outs, lses = make_partials(splits, 2, 3, 64, seed=splits)
        seen = []

        def launch(dst_out, dst_lse, outs=outs, lses=lses, splits=splits, seen=seen):
            seen.append(dst_out.data_ptr())
            dst_out.copy_(outs[0] if splits == 1 else outs)
            dst_lse.copy_(lses[0] if splits == 1 else lses)

        ws = torch.full((split_partials_numel(splits, 2, 3, 64),), float("nan")) if with_ws else None
        out = torch.full((2, 3, 64), float("nan"))
        lse = torch.full((2, 3), float("nan"))
        launch_split_and_merge(launch, splits, out, lse, ws, pdl=False)
        assert len(seen) == 1 and (seen[0] == out.data_ptr()) == (splits == 1)
        assert ws is None or seen[0] == ws.data_ptr()
        ref_out, ref_lse = loop_merge(outs, lses)
        assert_merged(out, lse, ref_out, ref_lse, 1e-5)
        print("ok", splits)


@pytest.mark.interpret
def test_split_and_merge_under_interpreter():
    pytest.importorskip("triton", reason="the column merge needs triton")
    assert run_interpreted(__name__, "interpreted_split_and_merge_cases").count("ok ") == 3


@pytest.mark.gpu
@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_triton_kernel_on_gpu(p, dtype):
    outs, lses = make_partials(p, 257, 16, 512, dtype, device="cuda")
    out = torch.full((257, 16, 512), float("nan"), dtype=dtype, device="cuda")
    lse = torch.full((257, 16), float("nan"), device="cuda")
    lse_merge(outs, lses, out=out, lse_out=lse)
    ref_out, ref_lse = lse_merge_reference(outs, lses)
    assert_merged(out, lse, ref_out.float(), ref_lse, atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    launch_lse_merge_columns(outs, lses, out, lse)
    assert_merged(out, lse, ref_out.float(), ref_lse, atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    launch_lse_merge_columns(outs, lses, out, lse, block_d=512, block_rows=max(1, 4096 // (p * 512)))
    assert_merged(out, lse, ref_out.float(), ref_lse, atol=1e-2 if dtype == torch.bfloat16 else 1e-5)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    parts=st.integers(2, 6),
    split=st.integers(1, 5),
    empty=st.lists(st.booleans(), min_size=6, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_merge_of_merges_equals_one_merge(parts: int, split: int, empty: list[bool], seed: int) -> None:
    """Merging is associative: two partial merges merged again give the one-shot merge (the
    collector relies on this when ranks merge their own partials first)."""
    split = min(split, parts - 1)
    g = torch.Generator().manual_seed(seed)
    outs = torch.randn(parts, 5, 3, 8, generator=g, dtype=torch.float64)
    lses = torch.randn(parts, 5, 3, generator=g, dtype=torch.float64) * 4
    for i, e in enumerate(empty[:parts]):
        if e:
            lses[i] = -math.inf  # a partial with no key at all
    lses[:, 0] = -math.inf  # a row empty in every partial
    weights_lse = lses.float()
    one_out, one_lse = lse_merge_reference(outs, weights_lse)
    a_out, a_lse = lse_merge_reference(outs[:split], weights_lse[:split])
    b_out, b_lse = lse_merge_reference(outs[split:], weights_lse[split:])
    two_out, two_lse = lse_merge_reference(torch.stack([a_out, b_out]), torch.stack([a_lse, b_lse]))
    assert not torch.isnan(two_out).any() and not torch.isnan(two_lse).any()
    torch.testing.assert_close(two_out, one_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(two_lse, one_lse, atol=1e-5, rtol=0)
    assert bool((one_out[0] == 0).all()) and bool(torch.isneginf(one_lse[0]).all())


def test_programmatic_dependent_launch_only_on_sm90_gpus(monkeypatch):
    """PDL (``griddepcontrol``) is asked for only on CUDA devices of compute capability 9+, never
    on the CPU or under the interpreter (which cannot run its inline PTX)."""
    from shardattn.kernels import backend

    assert not backend.pdl_supported(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not backend.pdl_supported(torch.device("cuda", 0))
    monkeypatch.delenv("TRITON_INTERPRET")
    if torch.cuda.is_available():
        major = torch.cuda.get_device_capability(0)[0]
        assert backend.pdl_supported(torch.device("cuda", 0)) == (major >= 9 and backend.triton_available())


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_pdl_kernels_compile_for_sm90_with_grid_dependency_control():
    """AOT for sm_90 with the installed Triton (no GPU): with ``PDL`` the column merge waits on the
    grid before it (``griddepcontrol.wait``) and the decode split kernel lets the next grid launch
    and waits (``griddepcontrol.launch_dependents`` and ``.wait``); without ``PDL`` neither is there."""
    from shardattn.testing.ptx_digest import triton_sm90_ptx

    def ptx(module: str, kernel: str, pointers: dict, floats: tuple, constexprs: dict) -> str:
        return triton_sm90_ptx(module, kernel, pointers, constexprs, floats=floats, launch_pdl=constexprs["PDL"])

    merge_ptrs = {"Outs": "*fp32", "Lses": "*fp32", "Out": "*bf16", "Lse": "*fp32"}
    split_ptrs = {
        "Q": "*bf16", "KV": "*bf16", "Rows": "*i32", "TopkLen": "*i32", "Sinks": "*fp32", "Out": "*fp32",
        "Lse": "*fp32", "FinalOut": "*bf16", "FinalLse": "*fp32", "Counters": "*i32",
    }  # fmt: skip
    split_consts = {
        "DV": 512, "DR": 64, "BLOCK_DV": 512, "BLOCK_DR": 64, "BLOCK_H": 16, "BLOCK_N": 32, "HAS_TOPK_LEN": False,
        "HAS_SINKS": False, "HAS_ROPE": True, "IEEE": False,
    }  # fmt: skip
    for pdl in (True, False):
        merge_consts = {"BLOCK_P": 64, "BLOCK_R": 1, "BLOCK_D": 128, "PDL": pdl}
        merge = ptx("shardattn.kernels.triton.lse_merge", "_lse_merge_columns_kernel", merge_ptrs, (), merge_consts)
        split = ptx(
            "shardattn.kernels.triton.sparse_mla_decode", "_sparse_mla_decode_kernel", split_ptrs, ("qk_scale",),
            {**split_consts, "PDL": pdl},
        )  # fmt: skip
        assert ("griddepcontrol.wait" in merge) == pdl
        assert ("griddepcontrol.launch_dependents" in split) == pdl and ("griddepcontrol.wait" in split) == pdl


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_split_partials_views_fit_the_fp32_workspace_without_overlap(dtype):
    """The partial outputs (fp32 or a 2-byte dtype) and their fp32 LSEs are disjoint views that fit
    in :func:`split_partials_numel` fp32 words, whatever the element count's parity."""
    from shardattn.kernels.triton.lse_merge import split_partials, split_partials_numel

    s, t, h, d = 3, 1, 5, 7  # odd output count: the 2-byte outputs end mid-word
    ws = torch.zeros(split_partials_numel(s, t, h, d))
    outs, lses = split_partials(ws, s, t, h, d, ws.device, out_dtype=dtype)
    assert outs.shape == (s, t, h, d) and outs.dtype == dtype and lses.shape == (s, t, h)
    assert lses.dtype == torch.float32
    outs.fill_(1.0)
    lses.fill_(-5.0)
    assert (outs == 1.0).all() and (lses == -5.0).all()  # neither write touched the other
    end = lses.data_ptr() + lses.numel() * 4
    assert end <= ws.data_ptr() + ws.numel() * 4 and outs.data_ptr() == ws.data_ptr()
