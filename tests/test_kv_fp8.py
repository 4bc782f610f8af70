"""The FP8 KV-row format (``fp8_ds_mla``): quantise, dequantise and the cache write, against the
independent oracle of tests/fp8_oracle.py and FlashMLA's reference quantiser re-implemented there.

CPU tests run the torch reference; the Triton kernel runs under ``TRITON_INTERPRET=1`` at tiny
shapes (tests/interpret/kv_fp8_cases.py) and, marked ``gpu``, on a GPU against the reference bit
for bit (bf16 included, which the interpreter does not run).
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardattn.kernels.backend import COMPILE_OPTIONS
from shardattn.ops.dispatch import triton_available
from shardattn.ops.kv_fp8 import (
    FP8_DS_MLA,
    WRITE_SATURATED,
    WRITE_SKIPPED,
    WRITE_STORED,
    check_write_status,
    dequantize_kv,
    quantize_kv,
    quantize_kv_reference,
    resolve_kv,
    write_kv,
)
from tests.fp8_oracle import DTYPES, flashmla_quantize, fp8_rows_oracle, make_rows
from tests.interpret import run_cases

NAN, INF = float("nan"), float("inf")


def oracle(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    packed, flags = fp8_rows_oracle(rows.double().numpy())
    return torch.from_numpy(packed), torch.from_numpy(flags)


# -- quantisation against the oracle and FlashMLA's reference ----------------------------------


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**20), n=st.integers(1, 5), dtype_name=st.sampled_from(sorted(DTYPES)))
def test_quantize_matches_oracle(seed: int, n: int, dtype_name: str) -> None:
    rows = make_rows(seed, n, dtype_name)
    status = torch.full((n,), -1, dtype=torch.int32)
    packed = quantize_kv(rows, status=status)
    want, flags = oracle(rows)
    assert packed.dtype == torch.uint8 and packed.shape == (n, 656)
    assert torch.equal(packed, want), f"bytes differ at {(packed != want).nonzero()[:8].tolist()}"
    assert status.tolist() == [WRITE_SATURATED if f else WRITE_STORED for f in flags.tolist()]
    assert torch.equal(quantize_kv_reference(rows)[0], packed)


@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
def test_every_magnitude_matches_flashmla(dtype_name: str) -> None:
    """Each positive finite value of the dtype as a tile's largest magnitude (with its 127 smaller
    companions spread below it): bytes equal FlashMLA's reference quantiser's (bf16: the whole row;
    fp16: latent and scales, FlashMLA keeps fp16 rope bytes)."""
    dtype = DTYPES[dtype_name]
    bits = torch.arange(1, 0x7F80 if dtype == torch.bfloat16 else 0x7C00, dtype=torch.int32)
    amax = bits.to(torch.int16).view(dtype)
    tiles = -(-amax.numel() // 4) * 4
    amax = torch.cat([amax, amax[: tiles - amax.numel()]]).float()
    spread = torch.linspace(1.0, -0.999, 128)  # both signs, every magnitude below the max
    latent = (amax[:, None] * spread[None, :]).to(dtype).float().reshape(-1, 512)
    rope = torch.randn(latent.shape[0], 64, generator=torch.Generator().manual_seed(0))
    rows = torch.cat([latent, rope], dim=1).to(dtype)
    ours, theirs = quantize_kv(rows), flashmla_quantize(rows)
    width = 656 if dtype == torch.bfloat16 else 528
    assert torch.equal(ours[:, :width], theirs[:, :width])


def test_all_zero_and_negative_zero_tiles() -> None:
    """An all-zero tile is scale 2**-13 with zero codes (FlashMLA's floor); -0.0 keeps its sign."""
    rows = torch.zeros(2, 576, dtype=torch.bfloat16)
    rows[1, :128] = -0.0
    rows[1, 200] = 3.0
    packed = quantize_kv(rows)
    scales = packed[:, 512:528].contiguous().view(torch.float32)
    assert scales[0].tolist() == [2.0**-13] * 4 and scales[1].tolist() == [2.0**-13, 2.0**-7, 2.0**-13, 2.0**-13]
    assert packed[0, :512].eq(0).all() and packed[1, :128].eq(0x80).all()
    assert torch.equal(packed, flashmla_quantize(rows))
    back = dequantize_kv(packed, torch.float32)
    assert back[1, :128].signbit().all() and back[1, 200].item() == 3.0


def test_non_finite_rows_are_stored_saturated() -> None:
    rows = torch.randn(3, 576, generator=torch.Generator().manual_seed(1))
    rows[0, 5], rows[0, 130], rows[0, 552] = NAN, INF, -INF  # latent tiles 0 and 1, rope
    rows[1, 512:] = INF  # a rope with no finite value
    status = torch.empty(3, dtype=torch.int32)
    packed = quantize_kv(rows, status=status)
    back = dequantize_kv(packed, torch.float32)
    assert torch.isfinite(back).all()
    scale = packed[0, 512:528].contiguous().view(torch.float32)
    assert back[0, 5].item() == 0.0 and back[0, 130].item() == 448.0 * scale[1].item()
    rope_max = rows[0, 512:].abs().nan_to_num(posinf=0).max().to(torch.bfloat16).item()
    assert back[0, 552].item() == -rope_max
    assert back[1, 512:].eq(0).all()
    assert status.tolist() == [WRITE_SATURATED, WRITE_SATURATED, WRITE_STORED]
    with pytest.raises(ValueError, match=r"2 KV rows held NaN or inf .*rows \[0, 1\]"):
        check_write_status(status)
    check_write_status(torch.tensor([0, 2, 0], dtype=torch.int32))  # skipped rows are not errors


def test_fp32_near_the_top_of_the_range_dequantises_to_infinity() -> None:
    """The format's documented limit: |x| >= 248 * 2**120 rounds to the code of 256 at scale 2**120."""
    rows = torch.zeros(1, 576)
    rows[0, 0], rows[0, 1] = 248 * 2.0**120, 247 * 2.0**120
    back = dequantize_kv(quantize_kv(rows), torch.float32)
    assert back[0, 0].item() == INF and back[0, 1].item() == 240 * 2.0**120


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_infinity_beside_the_largest_scale_stays_finite(dtype) -> None:
    """A tile whose finite values need scale 2**120 (>= 448 * 2**119): an infinity saturates to
    240 x 2**120, the largest finite value there (448 x 2**120 read back as inf)."""
    rows = torch.zeros(2, 576, dtype=dtype)
    rows[0, 0], rows[0, 7], rows[1, 200] = 448 * 2.0**119 * 1.01, -INF, INF  # tile 0 at 2**120; tile 1 at 2**-13
    status = torch.empty(2, dtype=torch.int32)
    packed = quantize_kv(rows, status=status)
    back = dequantize_kv(packed, torch.float32)
    assert torch.isfinite(back).all() and status.tolist() == [WRITE_SATURATED, WRITE_SATURATED]
    assert back[0, 7].item() == -240 * 2.0**120 and back[1, 200].item() == 448 * 2.0**-13
    want, _ = fp8_rows_oracle(rows.double().numpy())
    assert torch.equal(packed, torch.from_numpy(want))


def test_caches_whose_rows_are_not_4_byte_aligned_are_refused() -> None:
    """The fp32 scales sit 512 bytes into a row: a cache starting at an odd byte, or with a row
    stride that is no multiple of 4, was accepted and then faulted on a GPU (misaligned address)."""
    rows = quantize_kv(torch.randn(2, 576, generator=torch.Generator().manual_seed(2)))
    odd = torch.zeros(2 * 656 + 1, dtype=U8)[1:].view(2, 656)
    wide = torch.zeros(2, 658, dtype=U8)[:, :656]
    for kv in (odd, wide, torch.zeros(2, 3, 658, dtype=U8)[:, :, :656]):
        with pytest.raises(ValueError, match=r"cache's fp8_ds_mla rows must start at multiples of 4 bytes"):
            write_kv(kv, torch.tensor([0, 1]), torch.randn(2, 576))
        with pytest.raises(ValueError, match=r"packed's fp8_ds_mla rows must start at multiples of 4 bytes"):
            dequantize_kv(kv)
    aligned = torch.zeros(2, 660, dtype=U8)[:, :656].copy_(rows)  # a stride of 660: read
    assert torch.equal(dequantize_kv(aligned), dequantize_kv(rows))
    assert torch.equal(dequantize_kv(wide[:1].copy_(rows[:1])), dequantize_kv(rows[:1]))  # one row: any stride


def test_a_paged_cache_of_one_row_a_page_reads_as_rows() -> None:
    """Pages of one row follow one another whatever the stride of their size-1 dim (a permuted
    view): they were refused as pages that do not follow one another."""
    kv = torch.zeros(1, 3, 656, dtype=U8).permute(1, 0, 2)  # [3, 1, 656], rows at p * 656
    rows, fmt = resolve_kv("kv", kv, head_dim=576, v_dim=512)
    assert fmt == "fp8_ds_mla" and rows.shape == (3, 656) and rows.stride() == (656, 1)


def test_one_row_reads_whatever_its_row_stride() -> None:
    """A row's stride says nothing when there is one row: an expanded row (stride 0) was refused
    as overlapping rows, although two rows cannot overlap."""
    row = quantize_kv(torch.randn(1, 576, generator=torch.Generator().manual_seed(3)))
    assert torch.equal(dequantize_kv(row.as_strided((1, 656), (0, 1))), dequantize_kv(row))
    with pytest.raises(ValueError, match=r"contiguous, non-overlapping fp8_ds_mla rows"):
        dequantize_kv(row[0].expand(2, 656))


def test_the_fp8_view_hint_is_given_only_where_the_width_is_right() -> None:
    """Passing ``.view(torch.uint8)`` helps a float8 view of the rows, not a tensor of the wrong
    width (it was suggested for both)."""
    with pytest.raises(ValueError, match=r"pass \.view\(torch\.uint8\)"):
        dequantize_kv(torch.zeros(2, 656, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match=r"got float8_e4m3fn \[2, 576\]$"):
        dequantize_kv(torch.zeros(2, 576, dtype=torch.float8_e4m3fn))


@settings(max_examples=30, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**20), dtype_name=st.sampled_from(sorted(DTYPES)))
def test_round_trip_error_bound(seed: int, dtype_name: str) -> None:
    """Finite values come back within half an e4m3 step: relative 2**-4 in the normal range,
    absolute 2**-10 x scale below it; the rope exactly (bf16 rows) or as bf16 (others)."""
    rows = make_rows(seed, 4, dtype_name, specials=False)
    assert rows.float().abs().max() < 2.0**126  # clear of the format's overflow corner
    packed = quantize_kv(rows)
    back = dequantize_kv(packed, torch.float32).double()
    x = rows.double()
    scale = packed[:, 512:528].contiguous().view(torch.float32).double().repeat_interleave(128, dim=1)
    err = (back[:, :512] - x[:, :512]).abs()
    assert (err <= torch.maximum(x[:, :512].abs() * 2**-4, scale * 2**-10)).all()
    normal = x[:, :512].abs() >= scale * 2**-6
    assert (err[normal] <= x[:, :512].abs()[normal] * 2**-4).all()
    assert torch.equal(back[:, 512:], x[:, 512:].to(torch.bfloat16).double())
    assert dequantize_kv(packed).dtype == torch.bfloat16 and dequantize_kv(packed, torch.float16).shape == (4, 576)


# -- the cache write (torch reference on CPU) ----------------------------------------------------


def _cache(pages: int, page_size: int, layout: str, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``(storage, cache)``: random bytes; ``cache`` is ``[pages, page_size, 656]`` ("paged"), the same
    with a padding row after each page ("padded": FlashMLA allocates its pages so), or
    ``[pages * page_size, 656]`` ("flat"), a view of ``storage``."""
    pad = int(layout == "padded")
    storage = torch.randint(0, 256, (pages, page_size + pad, 656), dtype=torch.uint8).to(device)
    cache = storage[:, :page_size]
    return storage, cache.reshape(-1, 656) if layout == "flat" else cache


def _expected(storage, layout, page_size, slots, rows) -> tuple[torch.Tensor, list[int]]:
    """The storage after writing ``rows`` at ``slots``, from the oracle; the status per row."""
    want, flags = oracle(rows)
    pages = storage.shape[0]
    expect = storage.clone()
    status = []
    for i, s in enumerate(slots.tolist()):
        if not 0 <= s < pages * page_size:
            status.append(WRITE_SKIPPED)
            continue
        expect[s // page_size, s % page_size] = want[i]
        status.append(WRITE_SATURATED if flags[i] else WRITE_STORED)
    return expect, status


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**20),
    pages=st.integers(1, 4),
    page_size=st.integers(1, 5),
    layout=st.sampled_from(["paged", "padded", "flat"]),
    slot_dtype=st.sampled_from([torch.int32, torch.int64]),
    as_pair=st.booleans(),
)
def test_write_stores_each_slot_and_nothing_else(seed, pages, page_size, layout, slot_dtype, as_pair) -> None:
    """Every stored row holds the oracle's bytes at its slot; skipped slots (-1, past the cache,
    negative, far out) write nothing; no other byte changes (padding rows between pages included)."""
    g = torch.Generator().manual_seed(seed)
    storage, cache = _cache(pages, page_size, layout)
    capacity = pages * page_size
    n = int(torch.randint(1, capacity + 4, (), generator=g))
    slots = torch.randperm(capacity + 3, generator=g)[:n] - 1  # distinct; -1, capacity, capacity + 1 skip
    far = torch.tensor([-7, 2**40 if slot_dtype == torch.int64 else 2**31 - 1])
    slots = torch.where(torch.rand(n, generator=g) < 0.15, far[torch.randint(0, 2, (n,), generator=g)], slots)
    rows = make_rows(seed, n, "bf16")
    expect, want_status = _expected(storage, layout, page_size, slots, rows)
    status = torch.full((n,), -1, dtype=torch.int32)
    write_kv(cache, slots.to(slot_dtype), (rows[:, :512], rows[:, 512:]) if as_pair else rows, status=status)
    assert torch.equal(storage, expect)
    assert status.tolist() == want_status


def test_repeated_slots_are_refused_on_cpu_before_any_write() -> None:
    cache = torch.zeros(8, 656, dtype=torch.uint8)
    rows = torch.ones(4, 576)
    with pytest.raises(ValueError, match=r"slots must be distinct among the rows stored; repeated: \[3\]"):
        write_kv(cache, torch.tensor([3, 1, 3, -1]), rows)
    assert cache.eq(0).all()
    write_kv(cache, torch.tensor([-1, 9, -1, 2]), rows)  # repeats among skipped slots are fine
    assert cache[2].ne(0).any() and cache[[0, 1, 3, 4, 5, 6, 7]].eq(0).all()


def test_empty_write_and_empty_quantize() -> None:
    cache = torch.zeros(2, 3, 656, dtype=torch.uint8)
    write_kv(cache, torch.zeros(0, dtype=torch.int64), torch.zeros(0, 576))
    assert cache.eq(0).all() and quantize_kv(torch.zeros(0, 576)).shape == (0, 656)


# -- bad input: raised before any write, naming the argument and the format ----------------------


U8, BF16, I32, I64 = torch.uint8, torch.bfloat16, torch.int32, torch.int64
GOOD = {
    "cache": lambda: torch.zeros(2, 4, 656, dtype=U8),
    "slots": lambda: torch.tensor([0, 5]),
    "rows": lambda: torch.ones(2, 576, dtype=BF16),
}
#: (id, argument, bad value, error, message): the message names the argument and, for KV tensors, the format
BAD = [
    (
        "cache-bf16-rows",
        "cache",
        lambda: torch.zeros(8, 576, dtype=BF16),
        ValueError,
        r"cache must be uint8 .*fp8_ds_mla",
    ),
    ("cache-width", "cache", lambda: torch.zeros(8, 576, dtype=U8), ValueError, r"cache must be uint8 \[rows, 656\]"),
    (
        "cache-fp8-typed",
        "cache",
        lambda: torch.zeros(8, 656, dtype=torch.float8_e4m3fn),
        ValueError,
        r"view\(torch.uint8",
    ),
    ("cache-1d", "cache", lambda: torch.zeros(656, dtype=U8), ValueError, r"cache must be uint8"),
    (
        "cache-strided",
        "cache",
        lambda: torch.zeros(8, 1312, dtype=U8)[:, ::2],
        ValueError,
        r"cache must have contiguous",
    ),
    ("cache-not-tensor", "cache", lambda: [0] * 656, TypeError, r"cache must be a torch.Tensor of fp8_ds_mla"),
    (
        "cache-pages-overlap",
        "cache",
        lambda: torch.zeros(1, 4, 656, dtype=U8).expand(3, 4, 656),  # every page the same bytes
        ValueError,
        r"cache must have non-overlapping pages, got shape \[3, 4, 656\] strides \(0, 656, 1\)",
    ),
    (
        "cache-pages-interleaved",
        "cache",
        lambda: torch.zeros(6 * 656, dtype=U8).as_strided((3, 4, 656), (656, 656, 1)),  # page p row i = row p + i
        ValueError,
        r"cache must have non-overlapping pages",
    ),
    (
        "rows-width",
        "rows",
        lambda: torch.ones(2, 512),
        ValueError,
        r"rows must be fp16/bf16/fp32 \[R, 576\].*fp8_ds_mla",
    ),
    ("rows-uint8", "rows", lambda: torch.zeros(2, 656, dtype=U8), ValueError, r"rows must be .*fp8_ds_mla.*uint8"),
    ("rows-pair-width", "rows", lambda: (torch.ones(2, 512), torch.ones(2, 32)), ValueError, r"rope \[R, 64\]"),
    ("rows-pair-dtype", "rows", lambda: (torch.ones(2, 512), torch.ones(2, 64).half()), ValueError, r"rows's latent"),
    ("slots-float", "slots", lambda: torch.zeros(2), TypeError, r"slots must have dtype in \(int32, int64\)"),
    ("slots-length", "slots", lambda: torch.zeros(3, dtype=I64), ValueError, r"slots must have shape \[2\]"),
    ("status-dtype", "status", lambda: torch.zeros(2, dtype=I64), TypeError, r"status must have dtype in \(int32\)"),
    ("status-strided", "status", lambda: torch.zeros(4, dtype=I32)[::2], ValueError, r"status must be contiguous"),
    (
        "slots-device",
        "slots",
        lambda: torch.zeros(2, dtype=I64, device="meta"),
        ValueError,
        r"one device; slots differs",
    ),
]


@pytest.mark.parametrize(("arg", "make", "kind", "match"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_write_rejects_bad_input(arg, make, kind, match) -> None:
    args = {k: v() for k, v in GOOD.items()}
    kwargs = {"status": make()} if arg == "status" else {}
    if arg != "status":
        args[arg] = make()
    cache_before = args["cache"].clone() if isinstance(args["cache"], torch.Tensor) else None
    with pytest.raises(kind, match=match):
        write_kv(args["cache"], args["slots"], args["rows"], **kwargs)
    if cache_before is not None and cache_before.dtype == torch.uint8 and cache_before.dim() > 1:
        assert torch.equal(args["cache"], cache_before)


def test_dequantize_and_quantize_reject_bad_input() -> None:
    with pytest.raises(ValueError, match=r"packed must be uint8 .*fp8_ds_mla.*bfloat16 \[3, 576\]"):
        dequantize_kv(torch.zeros(3, 576, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="dtype must be one of"):
        dequantize_kv(torch.zeros(3, 656, dtype=torch.uint8), torch.int8)
    with pytest.raises(ValueError, match=r"rows must be .*\[R, 576\].*fp8_ds_mla rows, got float32 \[3, 577\]"):
        quantize_kv(torch.zeros(3, 577))
    assert FP8_DS_MLA.row_bytes == 656 and FP8_DS_MLA.num_tiles == 4


def test_fp64_dequantisation_is_exact_for_any_scale_and_feeds_the_fp64_reference() -> None:
    """A non-power-of-two scale (vLLM writes amax / 448): code x scale needs up to 28 bits, exact in
    fp64 only. The fp64 reference of fp8 rows raised a TypeError (dequantize_kv refused fp64)."""
    from shardattn.ops.sparse_mla import sparse_mla_reference

    packed = quantize_kv(torch.randn(5, 576, generator=torch.Generator().manual_seed(4)))
    packed[:, 512:528] = torch.full((5, 4), 1 / 3, dtype=torch.float32).view(torch.uint8)  # scales of 1/3
    codes = packed[:, :512].view(torch.float8_e4m3fn).double()
    want = codes * torch.tensor(1 / 3, dtype=torch.float32).double()
    got = dequantize_kv(packed, torch.float64)
    assert got.dtype == torch.float64 and torch.equal(got[:, :512], want)
    q = torch.randn(2, 4, 576, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    rows = torch.tensor([[0, 3, -1], [4, 4, 9]], dtype=torch.int32)
    out, lse = sparse_mla_reference(q, packed, rows, scale=0.05, v_dim=512, compute_dtype=torch.float64)
    ref_out, ref_lse = sparse_mla_reference(q, got, rows, scale=0.05, v_dim=512, compute_dtype=torch.float64)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


# -- the Triton kernel: interpreter (CPU) and GPU --------------------------------------------------


@pytest.mark.interpret
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_write_kernel_matches_reference_under_interpreter() -> None:
    lines = run_cases("kv_fp8_cases", SHARDATTN_SEED="0")
    assert lines[-1] == "0 failures: []", lines[-12:]
    names = [ln.split()[1] for ln in lines if ln.startswith("ok")]
    assert any(n.startswith("ties") for n in names) and any(n.startswith("write[padded") for n in names)
    assert {"float16", "float32"} <= {n.split("dtype=")[1].rstrip("]") for n in names if "dtype=" in n}


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_write_kernel_compiles_for_sm90(dtype_name: str) -> None:
    """AOT for sm_90 with the installed Triton (no GPU; pointers and strides 16-byte aligned, as
    Triton specialises them at launch for rows of 656 bytes): the kernel compiles for every input
    dtype, rounds with integer operations (no float division, log2 or fp8 conversion instruction)
    and stores the 512 latent codes 8 bytes a thread."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from shardattn.kernels.triton.kv_fp8 import _write_fp8_rows_kernel

    names = _write_fp8_rows_kernel.arg_names
    elem = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}[dtype_name]
    pointers = {"Latent": elem, "Rope": elem, "Slots": "*i64", "Cache": "*u8", "Status": "*i32"}
    constexprs = {"NUM_TILES": 4, "TILE": 128, "ROPE": 64, "SCALE_OFFSET": 512, "ROPE_OFFSET": 528,
                  "MIN_SCALE_EXP": -13, "TOP_EXP": 120, "TOP_SAT": 240.0, "HAS_SLOTS": True,
                  "HAS_STATUS": True}  # fmt: skip
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i64") for n in names}
    aligned = [*pointers, "stride_latent_r", "stride_rope_r", "stride_cache_page", "stride_cache_slot"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=_write_fp8_rows_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={**COMPILE_OPTIONS, "num_warps": 2}).asm["ptx"]
    body = ptx[ptx.index(".entry") :]
    assert re.search(r"st\.global\.v[24]\.b32", body), "latent codes not stored 8 bytes a thread"
    for instruction in (r"div\.(rn|full|approx)", r"lg2\.", r"cvt\.\w*\.e4m3"):
        assert not re.search(instruction, body), instruction


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("layout", ["flat", "paged", "padded"])
def test_triton_write_equals_reference_on_gpu(dtype_name: str, layout: str) -> None:
    n, pages, page_size = 300, 5, 64
    rows = make_rows(7, n, dtype_name).cuda()
    slots = (torch.randperm(pages * page_size + 40)[:n] - 20).cuda()  # distinct; some outside
    storage, cache = _cache(pages, page_size, layout, "cuda")
    ref_storage = storage.cpu()
    ref_cache = ref_storage[:, :page_size].reshape(-1, 656) if layout == "flat" else ref_storage[:, :page_size]
    status = torch.full((n,), -1, dtype=torch.int32, device="cuda")
    ref_status = torch.full((n,), -1, dtype=torch.int32)
    write_kv(cache, slots, rows, status=status)
    write_kv(ref_cache, slots.cpu(), rows.cpu(), status=ref_status)
    assert torch.equal(storage.cpu(), ref_storage) and torch.equal(status.cpu(), ref_status)
    assert torch.equal(quantize_kv(rows).cpu(), quantize_kv(rows.cpu()))


@pytest.mark.gpu
def test_triton_quantize_equals_flashmla_on_gpu() -> None:
    rows = make_rows(3, 4096, "bf16", specials=False).cuda()
    assert torch.equal(quantize_kv(rows), flashmla_quantize(rows))


@pytest.mark.gpu
def test_write_captures_in_a_cuda_graph() -> None:
    """The write launches no host synchronisation: it captures, and replays read new rows and slots."""
    cache = torch.zeros(4, 64, 656, dtype=torch.uint8, device="cuda")
    rows = torch.zeros(32, 576, dtype=torch.bfloat16, device="cuda")
    slots = torch.full((32,), -1, dtype=torch.int64, device="cuda")
    status = torch.zeros(32, dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        write_kv(cache, slots, rows, status=status)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        write_kv(cache, slots, rows, status=status)
    new_rows = make_rows(11, 32, "bf16").cuda()
    rows.copy_(new_rows)
    slots.copy_(torch.randperm(256)[:32].cuda())
    graph.replay()
    ref = torch.zeros(4, 64, 656, dtype=torch.uint8)
    ref_status = torch.empty(32, dtype=torch.int32)
    write_kv(ref, slots.cpu(), new_rows.cpu(), status=ref_status)
    torch.cuda.synchronize()
    assert torch.equal(cache.cpu(), ref) and torch.equal(status.cpu(), ref_status)
