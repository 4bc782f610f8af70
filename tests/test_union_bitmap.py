"""The bitmap union builder (``method="bitmap"``) and the ``"auto"`` choice between it and the
sorting builders: the kernel under the interpreter against the torch reference on fresh random
inputs (tests/interpret/union_bitmap_cases.py, in a subprocess because the interpreter must be
switched on before Triton is imported), the choice on the CPU."""

from __future__ import annotations

import pytest
import torch

from shardattn.kernels.backend import COMPILE_OPTIONS
from shardattn.kernels.gluon.compat import GLUON_IMPORT_ERROR, HAS_GLUON
from shardattn.kernels.triton import union_bitmap
from shardattn.kernels.triton.union_bitmap import MAX_ROWS, SCRATCH_BYTES, bitmap_programs, bitmap_union, bitmap_words
from shardattn.ops.dispatch import triton_available
from shardattn.ops.union import build_union, build_union_reference
from shardattn.plan.crossovers import BITMAP_SCAN_RATIO, UNION_METHOD
from shardattn.plan.union_routing import route_union_method
from tests.interpret import run_cases
from tests.interpret.union_cases import make_rows


@pytest.mark.interpret
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_bitmap_builder_matches_the_reference_under_interpreter():
    lines = run_cases("union_bitmap_cases")
    names = [ln.split()[1] for ln in lines if ln.startswith("ok")]
    for g in (1, 2, 4, 8):  # every group size, one program reusing its bitmap, rows at word edges
        assert any(n.startswith(f"bitmap[G={g},") and "per_sm=1" in n for n in names)
        assert f"word_edges[G={g}]" in names
    assert {"no_kv_rows[G=1]", "no_entries[G=8]"} <= set(names)
    assert sum(n.startswith("bitmap[") for n in names) >= 30
    assert lines[-1].startswith("0 failures")


@pytest.mark.parametrize("group_size", [1, 2, 4, 8])
def test_torch_path_gives_the_reference(group_size):
    rows = make_rows(5, 13, 9, 37, sort=False)
    kw = {"group_size": group_size, "num_kv_rows": 37}
    got = build_union(rows, method="bitmap", **kw)
    want = build_union_reference(rows, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_auto_takes_the_bitmap_while_its_count_is_within_the_ratio():
    k = 2048
    for g in (1, 2, 4, 8):
        limit = 32 * BITMAP_SCAN_RATIO * g * k  # rows whose words are exactly the ratio x the entries
        assert route_union_method(g, k, limit) == "bitmap"
        assert route_union_method(g, k, limit + 32) == UNION_METHOD[g]
        assert route_union_method(g, k, 65_536, rows_sorted=True) == "fused"
    assert route_union_method(8, 2048, 1 << 20) == "bitmap"  # the 1M-row cache measured at ratio 2
    assert route_union_method(4, 2048, 1 << 20) == UNION_METHOD[4]
    assert route_union_method(8, 1 << 20, MAX_ROWS + 1) == UNION_METHOD[8]  # past the 24-bit rows


def test_programs_respect_the_scratch_cap_and_the_group_count(monkeypatch):
    cpu = torch.device("cpu")
    assert bitmap_programs(3, 64, cpu) == 3
    assert bitmap_programs(10_000, 64, cpu) == 16  # 4 programs per SM, 4 SMs off the GPU
    big = bitmap_programs(10_000, MAX_ROWS, cpu)
    assert big >= 1 and big * 12 * bitmap_words(MAX_ROWS) <= SCRATCH_BYTES
    monkeypatch.setattr(union_bitmap, "SCRATCH_BYTES", 1)
    assert bitmap_programs(10_000, MAX_ROWS, cpu) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["gluon", "triton"])
@pytest.mark.parametrize("num_kv_rows", [65_536, 131_073, 1 << 20], ids=["64K", "128K+1", "1M"])
@pytest.mark.parametrize("group_size", [1, 2, 4, 8])
def test_bitmap_builder_on_the_gpu_at_real_shapes(group_size, num_kv_rows, kernel, monkeypatch):
    """T = 4,099 queries (a tail group) x K = 2,048 rows, 5 % invalid anywhere (-1 and past the cache),
    duplicates within rows, neighbours sharing most rows, an empty row, ``topk_length``; every
    builder's output poisoned first. Exact against the torch reference, on the shared-memory Gluon
    kernel as ``build_union`` launches it (one window of 131,072 rows, two with the last row alone in
    the second, 8) and on the Triton kernel, at its routed launch and at one program per SM (each
    program building many groups on one bitmap)."""
    if kernel == "gluon" and not HAS_GLUON:
        pytest.skip(f"Gluon unavailable: {GLUON_IMPORT_ERROR}")
    dev, gen = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(group_size)
    t, k = 4099, 2048
    base = torch.randint(0, num_kv_rows, (t // 4 + 1, k), device=dev, generator=gen, dtype=torch.int32)
    rows = base.repeat_interleave(4, dim=0)[:t].clone()
    fresh = torch.rand(t, k, device=dev, generator=gen) < 0.3  # neighbours share ~70 % of their rows
    rows[fresh] = torch.randint(0, num_kv_rows, (int(fresh.sum()),), device=dev, generator=gen, dtype=torch.int32)
    rows[torch.rand(t, k, device=dev, generator=gen) < 0.05] = -1
    rows[torch.rand(t, k, device=dev, generator=gen) < 0.01] = num_kv_rows + 5
    rows[:, 1000:1100] = rows[:, :100]  # duplicates within a row
    rows[7] = -1
    rows[9, :5] = num_kv_rows - 1  # the last row (alone in the last window at 131,073)
    length = torch.randint(0, k + 50, (t,), device=dev, generator=gen, dtype=torch.int32)
    for topk_length in (None, length):
        kw = {"group_size": group_size, "num_kv_rows": num_kv_rows, "topk_length": topk_length}
        want_u, want_n = build_union_reference(rows, **kw)
        for per_sm in (None,) if kernel == "gluon" else (None, 1):
            union = torch.full_like(want_u, -7)
            lens = torch.full_like(want_n, -7)
            if kernel == "gluon":  # what build_union runs on sm_90
                build_union(rows, method="bitmap", out=(union, lens), **kw)
            else:
                with monkeypatch.context() as patch:
                    if per_sm is not None:
                        patch.setattr(union_bitmap, "PROGRAMS_PER_SM", per_sm)
                    bitmap_union(rows, topk_length, num_kv_rows, group_size, union, lens)
            assert torch.equal(lens, want_n), (per_sm, topk_length is None)
            below = torch.arange(union.shape[1], device=dev)[None, :] < want_n[:, None]
            assert torch.equal(union[below], want_u[below]), (per_sm, topk_length is None)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("group_size", [1, 8])
def test_bitmap_kernel_compiles_for_sm90(group_size):
    """AOT for sm_90 with the installed Triton (no GPU): the kernel compiles, marks and places with
    global atomics (``G > 1``), and reads the atomically set words through L2 only."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from shardattn.kernels.triton.union_bitmap import bitmap_kernels, bitmap_launch_config

    (kernel,) = bitmap_kernels()
    sizes = ("T", "K", "num_rows", "n_groups", "stride_rows_t", "stride_union_g", "words")
    signature = {**dict.fromkeys(("ROWS", "TOPK_LEN", "UNION", "LENS", "BITMAP"), "*i32"), "PACKED": "*i64"}
    signature |= dict.fromkeys(sizes, "i32")
    cfg = bitmap_launch_config(group_size, 2048)
    constexprs = {"G": group_size, "BLOCK": cfg["BLOCK"], "WCHUNK": cfg["WCHUNK"], "HAS_LEN": True}
    signature |= dict.fromkeys(constexprs, "constexpr")
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    options = {**COMPILE_OPTIONS, "num_warps": cfg["num_warps"]}
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    ors = ptx.count(".or.b32")  # atom / red: the mark phase, and the place phase's member bits when G > 1
    assert ors >= (2 if group_size > 1 else 1)
    assert "ld.global.cg" in ptx


@pytest.mark.skipif(not HAS_GLUON, reason="Triton without Gluon")
@pytest.mark.parametrize("group_size", [1, 8])
def test_shared_memory_kernel_compiles_for_sm90(group_size):
    """AOT for sm_90 with the installed Triton (no GPU): the Gluon kernel's marks, counts and places
    are shared-memory instructions, no global atomics, and Triton's own shared memory (the scan's
    scratch) lies past the region the inline PTX addresses."""
    from shardattn.kernels.gluon.union_smem import compile_for_sm90, launch_config, region_is_first

    compiled = compile_for_sm90(group_size, 2048, 131_072)
    ptx, region = compiled.asm["ptx"], launch_config(group_size, 2048, 131_072)["REGION"]
    assert "red.shared.or.b32" in ptx and "ld.shared.v2.b32" in ptx and "st.shared.v2.b32" in ptx
    assert "atom.global" not in ptx and "red.global" not in ptx
    assert region_is_first(compiled.asm["llir"], region)
    assert compiled.metadata.shared >= 4 * region


def test_region_check_refuses_scratch_inside_the_region():
    from shardattn.kernels.gluon.union_smem import region_is_first

    llir = "getelementptr i8, ptr addrspace(3) @global_smem, i32 {}"
    assert region_is_first(llir.format(65536), 16384) and region_is_first(llir.format(0), 16384)
    assert not region_is_first(llir.format(4096), 16384)


def test_shared_memory_launch_config_and_occupancy():
    from shardattn.kernels.gluon.union_smem import (
        CTA_RESERVED_BYTES,
        MAX_UNION_SLOTS,
        SCRATCH_BYTES,
        SM_SHARED_BYTES,
        launch_config,
        union_slots,
        window_words,
    )

    assert window_words(64) == window_words(65_536) == 2048
    assert window_words(65_537) == window_words(1 << 24) == 4096
    for g in (1, 2, 4, 8):
        for rows in (64, 131_072, 1 << 20):
            cfg = launch_config(g, 2048, rows)
            assert cfg["REGION"] & (cfg["REGION"] - 1) == 0  # a power of two
            assert cfg["REGION"] >= 3 * cfg["WW"] + union_slots(g, 2048)
            assert cfg["BLOCK"] * g >= 128 * cfg["num_warps"]  # no replicated entries at K = 2048
            assert cfg["WW"] % cfg["CW"] == 0 and cfg["BLOCK"] % cfg["WG"] == 0
            per_cta = 4 * cfg["REGION"] + SCRATCH_BYTES + CTA_RESERVED_BYTES
            assert cfg["per_sm"] >= 1 and cfg["per_sm"] * per_cta <= max(SM_SHARED_BYTES, per_cta)
    assert launch_config(8, 2048, 65_536)["per_sm"] == 1  # 128 KB of region
    assert union_slots(8, 2048) == MAX_UNION_SLOTS and union_slots(1, 100) == 128


def test_gluon_kernel_refuses_what_it_cannot_run():
    from shardattn.kernels.gluon.union_smem import smem_unsupported_reason

    rows = torch.zeros(4, 2048, dtype=torch.int32)
    assert smem_unsupported_reason(rows, 8) is not None  # on the CPU


def test_auto_takes_the_shared_memory_bitmap_within_its_ratios():
    """On sm_90 with Gluon the bitmap runs in shared memory and wins further: sorted rows too at
    ``G > 1`` while the cache's words are within the group's entries, unsorted within 4x."""
    from shardattn.plan.crossovers import SMEM_SCAN_RATIO, SMEM_SORTED_RATIO

    k = 2048
    for g in (1, 2, 4, 8):
        limit = 32 * SMEM_SCAN_RATIO * g * k
        assert route_union_method(g, k, limit, shared_memory=True) == "bitmap"
        assert route_union_method(g, k, limit + 32, shared_memory=True) == UNION_METHOD[g]
        sorted_limit = 32 * SMEM_SORTED_RATIO * g * k
        assert route_union_method(g, k, sorted_limit, rows_sorted=True, shared_memory=True) == (
            "fused" if g == 1 else "bitmap"
        )
        assert route_union_method(g, k, sorted_limit + 32, rows_sorted=True, shared_memory=True) == "fused"
    assert route_union_method(8, 2048, MAX_ROWS + 1, shared_memory=True) == UNION_METHOD[8]


@pytest.mark.gpu
@pytest.mark.parametrize("topk", [1, 100, 4096])
@pytest.mark.parametrize("group_size", [1, 2, 4, 8])
def test_shared_memory_kernel_at_other_topk_widths(group_size, topk):
    """K = 1 / 100 / 4,096 (entries held by several threads when K is small; at G = 8, K = 4,096
    the union does not fit the region and the Triton kernel runs): exact against the reference on
    a 200,000-row cache (two windows), 5 % invalid entries, duplicates, ``topk_length``."""
    if not HAS_GLUON:
        pytest.skip(f"Gluon unavailable: {GLUON_IMPORT_ERROR}")
    from shardattn.kernels.gluon.union_smem import smem_unsupported_reason

    dev, gen = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(topk)
    t, num_kv_rows = 333, 200_000
    rows = torch.randint(0, num_kv_rows, (t, topk), device=dev, generator=gen, dtype=torch.int32)
    rows[torch.rand(t, topk, device=dev, generator=gen) < 0.05] = -1
    rows[:, topk // 2 :] = rows[:, : topk - topk // 2]  # duplicates within a row (when K > 1)
    length = torch.randint(0, topk + 3, (t,), device=dev, generator=gen, dtype=torch.int32)
    kw = {"group_size": group_size, "num_kv_rows": num_kv_rows, "topk_length": length}
    want_u, want_n = build_union_reference(rows, **kw)
    assert smem_unsupported_reason(rows, group_size) is not None or not (group_size == 8 and topk == 4096)
    union, lens = torch.full_like(want_u, -7), torch.full_like(want_n, -7)
    build_union(rows, method="bitmap", out=(union, lens), **kw)  # the shared-memory kernel where it runs
    assert torch.equal(lens, want_n)
    below = torch.arange(union.shape[1], device=dev)[None, :] < want_n[:, None]
    assert torch.equal(union[below], want_u[below])


def _touched_blocks(rows: torch.Tensor, num_kv_rows: int, topk_length: torch.Tensor | None, before: torch.Tensor):
    """``before`` with 1 at every 64-row block a valid entry of ``rows`` names (independent of the builders)."""
    valid = (rows >= 0) & (rows < num_kv_rows)
    if topk_length is not None:
        valid &= torch.arange(rows.shape[1], device=rows.device)[None, :] < topk_length[:, None]
    want = before.clone()
    want[rows[valid].long() // 64] = 1
    return want


@pytest.mark.parametrize("group_size", [1, 4])
def test_block_marks_on_the_torch_path(group_size):
    """``block_marks`` on the CPU: 1 at every 64-row block the union has a row in (invalid rows
    anywhere, rows past ``topk_length`` and past the cache ignored), every other entry as it was."""
    gen = torch.Generator().manual_seed(group_size)
    num_kv_rows, t, k = 5_000, 37, 120
    rows = torch.randint(-1, num_kv_rows + 40, (t, k), generator=gen, dtype=torch.int32)
    length = torch.randint(0, k + 2, (t,), generator=gen, dtype=torch.int32)
    before = torch.randint(0, 2, (-(-num_kv_rows // 64),), generator=gen, dtype=torch.int32) * 7
    marks = before.clone()
    union, lens = build_union(rows, group_size=group_size, num_kv_rows=num_kv_rows, topk_length=length,
                              block_marks=marks)  # fmt: skip
    assert torch.equal(marks, _touched_blocks(rows, num_kv_rows, length, before))
    want_u, want_n = build_union_reference(rows, group_size=group_size, num_kv_rows=num_kv_rows, topk_length=length)
    assert torch.equal(lens, want_n) and torch.equal(union, want_u)
    with pytest.raises(ValueError, match="block_marks"):
        build_union(rows, group_size=group_size, num_kv_rows=num_kv_rows, block_marks=marks[:-1])


@pytest.mark.skipif(not HAS_GLUON, reason="Triton without Gluon")
def test_shared_memory_kernel_with_marks_compiles_for_sm90():
    """The variant that marks the union's 64-row blocks: one more global store (predicated on the
    counted word), no global atomics, the region still first."""
    from shardattn.kernels.gluon.union_smem import compile_for_sm90, launch_config, region_is_first

    plain, marking = compile_for_sm90(8, 2048, 65_536), compile_for_sm90(8, 2048, 65_536, marks=True)
    assert marking.asm["ptx"].count("st.global") > plain.asm["ptx"].count("st.global")
    assert "atom.global" not in marking.asm["ptx"] and "red.global" not in marking.asm["ptx"]
    assert region_is_first(marking.asm["llir"], launch_config(8, 2048, 65_536)["REGION"])


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["bitmap", "sort", "fused"])
@pytest.mark.parametrize("num_kv_rows", [65_536, 131_073], ids=["64K", "128K+1"])
@pytest.mark.parametrize("group_size", [1, 8])
def test_block_marks_on_the_gpu(group_size, num_kv_rows, method):
    """``block_marks`` from every builder on the GPU (the shared-memory build marks while it counts,
    one window or two; the others after the build): the blocks of the valid entries, entries set
    before the call kept, the union unchanged."""
    dev, gen = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(group_size + num_kv_rows)
    t, k = 1_027, 2048
    rows = torch.randint(0, num_kv_rows, (t, k), device=dev, generator=gen, dtype=torch.int32)
    rows[torch.rand(t, k, device=dev, generator=gen) < 0.05] = -1
    rows[torch.rand(t, k, device=dev, generator=gen) < 0.01] = num_kv_rows + 5
    rows[:, 1000:1100] = rows[:, :100]
    rows[3] = -1
    rows[5, :3] = num_kv_rows - 1
    length = torch.randint(0, k + 50, (t,), device=dev, generator=gen, dtype=torch.int32)
    before = torch.randint(0, 2, (-(-num_kv_rows // 64),), device=dev, generator=gen, dtype=torch.int32)
    for topk_length in (None, length):
        kw = {"group_size": group_size, "num_kv_rows": num_kv_rows, "topk_length": topk_length}
        marks = before.clone()
        union, lens = build_union(rows, method=method, block_marks=marks, **kw)
        assert torch.equal(marks, _touched_blocks(rows, num_kv_rows, topk_length, before)), topk_length is None
        want_u, want_n = build_union_reference(rows, **kw)
        below = torch.arange(union.shape[1], device=dev)[None, :] < want_n[:, None]
        assert torch.equal(lens, want_n) and torch.equal(union[below], want_u[below])
