"""Sparse-MLA kernels reading ``fp8_ds_mla`` KV rows (``KV_FP8``): each dequantises in the kernel
(``dtype(fp32(code) * scale)``) before its matrix multiplies, so on an FP8 cache it returns bit for
bit what the same kernel returns on :func:`~shardattn.ops.kv_fp8.dequantize_kv`'s rows.

* CPU: the kernels' row layout is the format's; the independent decoder of tests/fp8_oracle.py
  reads what ``dequantize_kv`` reads; the Triton kernels under the interpreter against the fp64
  oracle on the decoded rows (tests/interpret/sparse_mla_fp8_cases.py; fp32 to 1e-6); every FP8
  variant compiles for sm_90 with the instructions it is written for (16-byte code loads, the e4m3
  conversion, wgmma, the fences), the Gluon ones without local-memory spills (ptxas's report;
  the 64-key kernel's producer: at most one register).
* sm_90 GPU: tests/test_sparse_mla_fp8_gpu.py.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardattn.kernels.backend import COMPILE_OPTIONS, triton_available
from shardattn.kernels.gluon.sparse_mla import gluon_unavailable_reason
from shardattn.ops.kv_fp8 import FP8_DS_MLA, dequantize_kv, quantize_kv
from shardattn.ops.sparse_mla import sparse_mla_attention
from shardattn.ops.sparse_mla_decode import sparse_mla_decode
from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill
from tests.fp8_oracle import fp8_rows_decode, make_rows
from tests.interpret import run_cases
from tests.oracle import sparse_mla_oracle
from tests.ptxas_report import ptxas_path, ptxas_report

needs_gluon = pytest.mark.skipif(gluon_unavailable_reason() is not None, reason=str(gluon_unavailable_reason()))
needs_ptxas = pytest.mark.skipif(ptxas_path() is None, reason="no ptxas in the installed Triton")

# ---- the row layout and the decoder (CPU) ----


def test_kernels_read_the_format_layout():
    from shardattn.kernels.triton import kv_fp8_read as read

    lay = FP8_DS_MLA
    assert (lay.latent_dim, lay.rope_dim, lay.tile_size) == (read.LATENT, read.ROPE, read.TILE)
    assert (lay.scale_offset, lay.rope_offset, lay.row_bytes) == (read.SCALE_OFFSET, read.ROPE_OFFSET, read.ROW_BYTES)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**20), n=st.integers(1, 6), dtype_name=st.sampled_from(["bf16", "fp16", "fp32"]))
def test_independent_decoder_reads_what_dequantize_reads(seed, n, dtype_name):
    """Rows written here (every magnitude of the dtype, zero tiles, -0.0) and rows with any codes
    (NaN codes included) under any power-of-two scales: the fp64 decoder equals ``dequantize_kv``
    in fp32, element for element."""
    packed = quantize_kv(make_rows(seed, n, dtype_name, specials=False))
    g = np.random.default_rng(seed)
    raw = g.integers(0, 256, size=(n, 656), dtype=np.uint8)
    raw[:, 512:528] = np.exp2(g.integers(-13, 9, size=(n, 4))).astype(np.float32).view(np.uint8).reshape(n, 16)
    raw[:, 528:] = packed[:, 528:].numpy()  # finite rope bits
    for rows in (packed, torch.from_numpy(raw)):
        want = fp8_rows_decode(rows.numpy())
        got = dequantize_kv(rows, torch.float32).double().numpy()
        assert np.array_equal(got, want, equal_nan=True)


# ---- the Triton kernels under the interpreter (CPU) ----


@pytest.mark.interpret
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_triton_kernels_on_fp8_rows_match_the_dequantised_run_and_the_oracle():
    lines = run_cases("sparse_mla_fp8_cases", SHARDATTN_SEED="0")
    assert lines[-1] == "0 failures: []"
    names = [ln.split()[1] for ln in lines if ln.startswith("ok")]
    for g in (1, 2, 4, 8):
        assert any(f"G={g}]" in n for n in names)
    assert sum(n.startswith("decode[") for n in names) == 6


# ---- sm_90 compiles (CPU, ahead of time) ----


def _triton_sm90(fn, pointers: dict[str, str], constexprs: dict, *, ones=(), num_warps=4, num_stages=2, pdl=False):
    """Triton's compiled kernel of ``fn`` for sm_90 as a launch on contiguous DSA tensors sees it:
    ``pointers`` name -> type; the arguments in ``ones`` are 1 (unit strides, which Triton
    specialises); every other ``stride_*`` and every pointer 16-byte divisible; the remaining
    arguments i32 (``qk_scale`` fp32)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {**constexprs, **dict.fromkeys(ones, 1)}
    signature = {
        n: "constexpr" if n in constexprs else pointers.get(n, "fp32" if n == "qk_scale" else "i32")
        for n in fn.arg_names
    }
    names = list(signature)
    aligned = [n for n in names if n in pointers or (n.startswith("stride_") and n not in constexprs)]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {**COMPILE_OPTIONS, "num_warps": num_warps, "num_stages": num_stages, "launch_pdl": pdl}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _q_loads(cfg: dict) -> int:
    """16-byte loads a thread makes of a decode program's q latent (four ``[BLOCK_H, 128]`` bf16 tiles;
    the rope's ``[BLOCK_H, 64]`` takes narrower ones)."""
    return 4 * -(-cfg["BLOCK_H"] * 128 * 2 // 16 // (32 * cfg["num_warps"]))


def _counts(ptx: str, *patterns: str) -> dict[str, int]:
    return {p: ptx.count(p) for p in patterns}


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@needs_ptxas
@pytest.mark.parametrize(("heads", "group"), [(128, 1), (16, 1)])
def test_triton_prefill_compiles_fp8_variant_for_sm90(heads, group):
    from shardattn.kernels.triton.sparse_mla import attention_kernel, tile_config

    tile = tile_config(heads, group)
    pointers = {"Q": "*bf16", "KV": "*u8", "UNION": "*i32", "LENS": "*i32", "SINKS": "*fp32", "OUT": "*bf16",
                "LSE": "*fp32"}  # fmt: skip
    constexprs = {"G": group, "BLOCK_H": tile.block_h, "BLOCK_N": tile.block_n, "D_V": 512, "D_R": 64,
                  "HAS_SINK": group > 1, "IEEE": False, "KV_FP8": True}  # fmt: skip
    compiled = _triton_sm90(attention_kernel(), pointers, constexprs, num_warps=tile.num_warps,
                            num_stages=tile.num_stages)  # fmt: skip
    bf16 = _triton_sm90(attention_kernel(), {**pointers, "KV": "*bf16"}, {**constexprs, "KV_FP8": False},
                        num_warps=tile.num_warps, num_stages=tile.num_stages).asm["ptx"]  # fmt: skip
    ptx = compiled.asm["ptx"]
    # 64 rows x 512 codes a step, 16 bytes a cp.async (the pipeline stages them), 2 codes a conversion
    assert ptx.count("cvt.rn.f16x2.e4m3x2") >= tile.block_n * 512 // 2 // (32 * tile.num_warps)
    assert "cp.async.cg.shared.global" in ptx and ", 0x10" in ptx
    assert ("wgmma.mma_async" in ptx) == (tile.block_m >= 64) and ("mma.sync" in ptx) == (tile.block_m < 64)
    # a scale tile at a time beside the fp32 accumulator: no more spills than the bf16 variant's,
    # or a few registers where it has none (Triton 3.9, sm_90a: 0 / 52 / 28 bytes against the bf16
    # variant's 240 / 260 / 0 at 128 heads, G = 8 and 16 heads)
    assert ptxas_report(ptx).spill_stores <= max(ptxas_report(bf16).spill_stores, 32)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@needs_ptxas
@pytest.mark.parametrize(("tokens", "heads"), [(1, 16), (8, 32), (64, 128)])
def test_triton_decode_compiles_fp8_variant_for_sm90(tokens, heads):
    from shardattn.kernels.triton.sparse_mla_decode import _sparse_mla_decode_kernel
    from shardattn.kernels.triton.sparse_mla_decode_config import sparse_mla_decode_config

    cfg = sparse_mla_decode_config(tokens, heads, 2048, 132, kv_fp8=True)
    bf16_cfg = sparse_mla_decode_config(tokens, heads, 2048, 132)
    assert cfg["num_warps"] == 8 and {**cfg, "num_warps": bf16_cfg["num_warps"]} == bf16_cfg  # the splits alike
    part = "*fp32" if cfg["num_splits"] > 1 else "*bf16"
    pointers = {"Q": "*bf16", "KV": "*u8", "Rows": "*i32", "TopkLen": "*i32", "Sinks": "*bf16", "Out": part,
                "Lse": "*fp32", "FinalOut": "*bf16", "FinalLse": "*fp32", "Counters": "*fp32"}  # fmt: skip
    constexprs = {"DV": 512, "DR": 64, "BLOCK_DV": 512, "BLOCK_DR": 64, "BLOCK_H": cfg["BLOCK_H"],
                  "BLOCK_N": cfg["BLOCK_N"], "HAS_TOPK_LEN": True, "HAS_SINKS": False, "HAS_ROPE": True,
                  "IEEE": False, "SPREAD": 0, "BLOCK_S": 2, "MERGE_C": 16, "PDL": True, "KV_FP8": True}  # fmt: skip
    constexprs = {k: v for k, v in constexprs.items() if k in _sparse_mla_decode_kernel.arg_names}
    ones = ("stride_qd", "stride_kvd", "stride_rk", "stride_od", "stride_yd")
    compiled = _triton_sm90(_sparse_mla_decode_kernel, pointers, constexprs, ones=ones, num_warps=cfg["num_warps"],
                            num_stages=cfg["num_stages"], pdl=True)  # fmt: skip
    bf16 = _triton_sm90(_sparse_mla_decode_kernel, {**pointers, "KV": "*bf16"}, {**constexprs, "KV_FP8": False},
                        ones=ones, num_warps=bf16_cfg["num_warps"], num_stages=cfg["num_stages"], pdl=True)  # fmt: skip
    ptx = compiled.asm["ptx"]
    assert "cvt.rn.f16x2.e4m3x2" in ptx
    assert "cp.async.cg.shared.global" in ptx and ", 0x10" in ptx  # the rope, 16 bytes a copy
    # the codes to registers, 16 bytes a load; up to 32 heads the first block's before the loop and
    # the next block's in it (the hand prefetch): twice a block's loads
    if cfg["BLOCK_H"] <= 32:
        code_loads = cfg["BLOCK_N"] * 512 // 16 // (32 * cfg["num_warps"])
        assert ptx.count("ld.global.v4.b32") - _q_loads(cfg) >= 2 * code_loads
    assert ptx.count("griddepcontrol.wait") == 1
    # no more spills than the bf16 variant (sm_90a, Triton 3.6: 0 / 0 / 0 bytes against 0 / 316 /
    # 40; 3.9: 0 / 0 / 40 against 0 / 176 / 172); at 4 warps the FP8 variant spilled 1.2 KB at 32 heads
    assert ptxas_report(ptx).spill_stores <= ptxas_report(bf16.asm["ptx"]).spill_stores


@needs_gluon
@needs_ptxas
@pytest.mark.parametrize(("block_n", "group", "split"), [(64, 16, True), (128, 8, False)])
def test_small_decode_kernel_compiles_fp8_variant_for_sm90(block_n, group, split):
    """Codes in registers (16-byte loads, all issued before the first chunk is converted), rope
    and Q by cp.async in one group, each chunk converted, stored, fenced and synchronised before its
    wgmma; the same wgmma work as the bf16 kernel; no spills."""
    from shardattn.kernels.gluon.sparse_mla_decode_small import LATENT_CHUNKS, compile_for_sm90, small_decode_warps

    compiled = compile_for_sm90(block_n, heads_per_program=group, split=split, kv_fp8=True)
    bf16 = compile_for_sm90(block_n, heads_per_program=group, split=split).asm["ptx"]
    ptx = compiled.asm["ptx"]
    threads = 32 * small_decode_warps(block_n)
    width = 8 if group <= 8 else 16
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)) == {f"m64n{width}k16"}
    assert ptx.count("wgmma.mma_async") == bf16.count("wgmma.mma_async")
    assert ptx.count("ld.global.v4") == block_n * 512 // 16 // threads  # every code, 16 bytes a load
    first_cvt = ptx.index("cvt.rn.f16x2.e4m3x2")
    assert ptx.rindex("ld.global.v4") < first_cvt  # all issued before the first conversion
    assert ptx.count("cp.async.commit_group") == 1 and re.findall(r"cp\.async\.wait_group\s+(\d+);", ptx) == ["0"]
    assert ptx.count("fence.proxy.async") >= 1 + LATENT_CHUNKS  # Q and rope, then each chunk (and P)
    assert ptx.count("griddepcontrol.wait") == 1 and ptx.count("griddepcontrol.launch_dependents") == 1
    assert compiled.metadata.shared <= 232448
    assert ptxas_report(ptx).spill_stores == 0


@needs_gluon
@needs_ptxas
@pytest.mark.parametrize(
    ("case", "kwargs"),
    [
        ("h128", {"heads": 128}),
        ("g8h8", {"heads": 8, "group_size": 8}),
        ("decode.raw_rows", {"heads": 128, "raw_rows": True}),
    ],
)
def test_ws64_kernel_compiles_fp8_variant_for_sm90(case, kwargs):
    """The producer copies each half block's raw bytes with cp.async (16-byte code copies, 4-byte
    scale copies, one commit group a half), waits for each half one group behind, converts e4m3 to
    bf16 through fp16 and fp32 with one conversion-unit instruction a pair (``e4m3_times_bf16``)
    and multiplies by the scale in bf16, fences, and one thread arrives for all 128 (the right
    halves' rope copies arrive on their own); it asks the L2 for the next pair's rows; the consumers'
    wgmma work is the bf16 kernel's; registers 200 / 200 / 104; shared memory as the bf16 kernel's;
    spills: at most 72 bytes (Triton 3.9 at these three shapes: 52 / 68 / 24; the bf16 kernel 0)."""

    from shardattn.kernels.gluon.sparse_mla import FP8_CONSUMER_REGS, compile_kernel_for_sm90
    from shardattn.kernels.gluon.sparse_mla_decode import gluon_decode_config

    if kwargs.get("raw_rows"):
        kwargs = {**kwargs, "config": gluon_decode_config(128)}
    compiled = compile_kernel_for_sm90("prefill", kv_fp8=True, **kwargs)
    ptx = compiled.asm["ptx"]
    bf16 = compile_kernel_for_sm90("prefill", **kwargs)
    assert ptx.count("wgmma.mma_async") == bf16.asm["ptx"].count("wgmma.mma_async") > 0
    halves = 4
    assert ptx.count("cvt.rn.f16x2.e4m3x2") == halves * 64 * 256 // 2 // 128  # 64 x 256 codes a half
    # e4m3x2 -> fp16x2 -> two fp32 whose upper halves are the bf16 values, then times the scale in bf16
    assert ptx.count("cvt.f32.f16") == 2 * ptx.count("cvt.rn.f16x2.e4m3x2")
    assert ptx.count("prmt.b32") >= ptx.count("mul.rn.bf16x2") == halves * 64 * 256 // 2 // 128
    assert re.search(r"prmt\.b32 \w+, \w+, \w+, 0x7632;", ptx)
    assert ptx.count("cp.async.ca.shared.global") == halves * 2  # 2 scale tiles x 1 row a thread, 4 bytes
    assert ptx.count("cp.async.commit_group") >= halves and ptx.count("cp.async.wait_group") >= halves
    assert "ld.global.v4" not in ptx  # the codes travel by cp.async, not through registers
    assert ptx.count("cp.async.bulk.prefetch.L2.global") == 2 * 4  # the next pair's 2 blocks x 4 rows a thread
    assert len(re.findall(r"mbarrier\.arrive\.shared::cta\.b64 _, \[%r\d+\], 128;", ptx)) == halves
    assert ptx.count("cp.async.mbarrier.arrive.shared.b64") == 2  # the right halves' rope copies
    assert ptx.count("fence.proxy.async") >= halves
    regs = [int(r) for r in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)]
    assert {FP8_CONSUMER_REGS, 3 * 168 - 2 * FP8_CONSUMER_REGS} <= set(regs)
    assert compiled.metadata.shared == bf16.metadata.shared <= 232448
    assert ptxas_report(ptx).spill_stores <= 72


# ---- the public ops on FP8 caches (CPU: the torch reference) ----

OPS = {
    "attention": lambda *a, **k: sparse_mla_attention(*a, **k),
    "grouped": lambda *a, **k: sparse_mla_grouped_prefill(*a, **k),
    "decode": lambda *a, **k: sparse_mla_decode(*a, **k),
}


def _fp8_case(seed: int, t: int, h: int, k: int, r: int, exp: int):
    """DSA rows at magnitude ``2**exp`` (values down to ``2**-12`` of it, some zero tiles), their
    fp8_ds_mla cache, fp32 queries, rows with invalid entries anywhere and a listed-twice row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(r, 576, generator=g) * 2.0**exp * torch.exp2(torch.randint(-12, 1, (r, 576), generator=g).float())
    x[:, :512] *= (torch.rand(r, 4, generator=g) > 0.2).float().repeat_interleave(128, dim=1)
    rows = torch.randint(-2, r + 2, (t, k), generator=g, dtype=torch.int32)
    if k > 1:
        rows[0, -1] = rows[0, 0]
    q = torch.randn(t, h, 576, generator=g) * 2.0 ** (-exp) * 0.3
    return q, quantize_kv(x), rows, g


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**16), t=st.integers(1, 4), h=st.sampled_from([1, 3, 8]), k=st.integers(1, 12),
    r=st.integers(1, 20), exp=st.integers(-6, 6), op=st.sampled_from(sorted(OPS)), with_len=st.booleans(),
    with_sinks=st.booleans(), paged=st.booleans(),
)  # fmt: skip
def test_ops_on_fp8_caches_match_the_oracle_on_the_decoded_rows(seed, t, h, k, r, exp, op, with_len, with_sinks, paged):
    """Every sparse-MLA op on an fp8_ds_mla cache (flat or paged) equals the fp64 oracle run on the
    rows as tests/fp8_oracle.py decodes them, to fp32 rounding: the quantisation is the only
    approximation; invalid entries anywhere, a row listed twice, ``topk_length``, sinks, empty rows."""
    q, cache, rows, g = _fp8_case(seed, t, h, k, r, exp)
    length = torch.randint(0, k + 2, (t,), generator=g, dtype=torch.int32) if with_len else None
    sinks = torch.randn(h, generator=g) if with_sinks else None
    kv = cache.view(-1, 1, 656) if paged else cache
    out, lse = OPS[op](q, kv, rows, scale=0.07, topk_length=length, sinks=sinks)
    kv64 = torch.from_numpy(fp8_rows_decode(cache.numpy()))
    want_o, want_l = sparse_mla_oracle(q, kv64, rows, scale=0.07, v_dim=512, topk_length=length, sinks=sinks)
    assert out.shape == (t, h, 512) and lse.shape == (t, h)
    fin = torch.isfinite(want_l)
    assert torch.equal(fin, torch.isfinite(lse)) and bool((out[~fin.any(dim=1)] == 0).all())
    scale = max(1.0, float(want_o.abs().max()))
    assert float((out.double() - want_o).abs().max()) <= 2e-5 * scale
    if fin.any():
        lse_scale = max(1.0, float(want_l[fin].abs().max()))
        assert float((lse.double()[fin] - want_l[fin]).abs().max()) <= 2e-5 * lse_scale


def test_reference_dequantises_only_the_gathered_rows(monkeypatch):
    """The CPU reference never dequantises the whole cache: it gathers the step's rows, then
    dequantises those ([T, K, 656] at a time)."""
    import shardattn.ops.kv_fp8 as kv_fp8

    seen = []
    real = kv_fp8.dequantize_kv
    monkeypatch.setattr(
        kv_fp8, "dequantize_kv", lambda packed, dtype=torch.bfloat16: seen.append(packed.shape) or real(packed, dtype)
    )
    q, cache, rows, _ = _fp8_case(1, 3, 2, 5, 4096, 0)
    sparse_mla_attention(q, cache, rows, scale=0.07)
    assert seen == [torch.Size([3, 5, 656])]


def test_route_reasons_name_the_kv_format():
    from shardattn.ops.dispatch import decode_path, prefill_path

    q, cache, rows, _ = _fp8_case(2, 2, 2, 4, 8, 0)
    assert "fp8_ds_mla" in prefill_path(q, cache, v_dim=512).reason
    assert "dequantised by the torch reference" in prefill_path(q, cache, v_dim=512).reason  # CPU tensors
    assert "fp8_ds_mla" in decode_path(q, cache, rows, 512)[1]
    from shardattn.ops.dispatch import FP8_READS, kv_reason

    assert "staged once" in kv_reason(cache, "prefill") and "staged" not in kv_reason(cache, "decode")
    assert set(FP8_READS) == {"decode", "prefill", "reference"}
    assert "fp8_ds_mla" not in prefill_path(q, dequantize_kv(cache, torch.float32), v_dim=512).reason
