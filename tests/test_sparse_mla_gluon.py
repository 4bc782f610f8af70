"""The Gluon sparse-MLA prefill kernels: AOT compile for sm_90 (CPU, no GPU), routing, GPU checks.

CPU tests compile each kernel variant for sm_90 with the installed Triton (so a Gluon API change
fails CI) and skip cleanly when that Triton has no Gluon. GPU tests (marked ``gpu``; they skip
without an sm_90 GPU) compare every variant with the fp32 reference at real shapes (D = 576,
Dv = 512, bf16, K = 2048) on NaN-poisoned outputs, with invalid entries anywhere in a row, empty
rows, duplicates, out-of-range rows, ``topk_length`` (short and zero), sinks and a tail tile.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from shardattn.kernels.gluon.sparse_mla import (
    GROUPED_CONFIG,
    GluonConfig,
    compile_for_sm90,
    compile_kernel_for_sm90,
    gluon_available,
    gluon_config,
    gluon_unavailable_reason,
)
from shardattn.ops.dispatch import sparse_prefill_kernel
from shardattn.plan.routing import (
    GLUON_GROUPED_MAX_HEADS,
    GLUON_MIN_HEADS,
    gluon_grouped_group_size,
    route_prefill_kernel,
)

needs_gluon = pytest.mark.skipif(not gluon_available(), reason=str(gluon_unavailable_reason()))

D_V, D_R, K = 512, 64, 2048
WS = gluon_config(128)
#: One tile a program (grouped tiles), and with Q loaded by the producer (decode's options but for
#: the grid).
ONE_TILE = GluonConfig()
EARLY = GluonConfig(early_kv=True)
#: One program per SM walking tiles in turn: token groups fastest, or a token's head blocks adjacent.
PERSISTENT = GluonConfig(persistent=True)
PERSISTENT_H = GluonConfig(heads_fastest=True, persistent=True)


@needs_gluon
def test_compile_for_sm90_returns_ptx_with_wgmma_and_cp_async():
    ptx = compile_for_sm90("prefill", 128)
    assert ".target sm_90a" in ptx
    assert "wgmma.mma_async" in ptx
    assert "cp.async.cg.shared.global" in ptx
    assert "setmaxnreg" in ptx  # warp-specialised: the partitions re-balance registers


@needs_gluon
@pytest.mark.parametrize(("heads", "group_size"), [(32, 2), (16, 4), (8, 8)])
def test_compile_grouped_variant_for_sm90(heads, group_size):
    kernel = compile_kernel_for_sm90("prefill", heads, group_size, sinks=True)
    ptx = kernel.asm["ptx"]
    assert ".target sm_90a" in ptx and "wgmma.mma_async" in ptx and "setmaxnreg" in ptx
    assert 0 < kernel.metadata.shared <= 232448


@needs_gluon
def test_compile_64_key_raw_row_mode_masks_entries_in_the_kernel():
    """Decode's one-launch mode: the 64-key kernel reading the caller's rows, with and without lengths."""

    cfg = GluonConfig(heads_fastest=True)
    raw = compile_kernel_for_sm90("prefill", 128, config=cfg, raw_rows=True, sinks=True)
    plain = compile_kernel_for_sm90("prefill", 128, config=cfg, sinks=True)
    assert "wgmma.mma_async" in raw.asm["ptx"] and raw.asm["ptx"] != plain.asm["ptx"]
    assert 0 < raw.metadata.shared <= 232448


@needs_gluon
def test_compile_64_key_variant_with_every_option_fits_shared_memory():
    """Q in the producer and the head-fastest grid (decode's options) compile with sinks within sm_90's
    shared memory."""
    cfg = GluonConfig(heads_fastest=True, early_kv=True)
    kernel = compile_kernel_for_sm90("prefill", 128, config=cfg, sinks=True)
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "setmaxnreg" in ptx and "cp.async.mbarrier.arrive" in ptx
    assert 0 < kernel.metadata.shared <= 232448


@needs_gluon
@pytest.mark.parametrize(("heads", "group_size", "raw_rows"), [(64, 1, False), (16, 4, False), (128, 1, True)])
def test_persistent_variant_compiles_for_sm90_within_shared_memory(heads, group_size, raw_rows):
    """The persistent kernel (tile loop in every partition, Q reloaded per tile, output staged
    through Q) compiles for sm_90 in each mode, fits sm_90's shared memory and differs from the
    one-tile kernel."""
    one = compile_kernel_for_sm90("prefill", heads, group_size, config=ONE_TILE, raw_rows=raw_rows)
    cfg = PERSISTENT
    kernel = compile_kernel_for_sm90("prefill", heads, group_size, config=cfg, raw_rows=raw_rows)
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "st.global.v4.b32" in ptx and "nctaid.x" in ptx
    assert ptx != one.asm["ptx"] and cfg.label.endswith("P")
    assert 0 < kernel.metadata.shared <= 232448


@needs_gluon
@pytest.mark.parametrize(("heads", "group_size", "raw_rows"), [(128, 1, False), (16, 4, False), (128, 1, True)])
def test_staged_output_is_stored_in_16_byte_pieces(heads, group_size, raw_rows):
    """The output goes through shared memory: every output store is 16 bytes wide (from the
    accumulator's registers each would be 4, two bf16 of one row: every 32-byte sector written in
    two halves)."""
    ptx = compile_kernel_for_sm90("prefill", heads, group_size, config=ONE_TILE, raw_rows=raw_rows).asm["ptx"]
    stores = {line.split("st.global", 1)[1].split()[0] for line in ptx.splitlines() if "st.global" in line}
    assert ".v4.b32" in stores
    assert stores - {".v4.b32"} <= {".b32"}  # the LSE column (fp32, one per row) besides


def test_configs_follow_the_measured_options():
    from shardattn.kernels.gluon.sparse_mla_decode import gluon_decode_config

    assert [gluon_config(64 // g, group_size=g).label for g in (2, 4, 8)] == [GROUPED_CONFIG.label] * 3
    # head blocks adjacent and Q loaded by the producer only where a token has two head blocks
    assert [gluon_config(h).heads_fastest for h in (32, 64, 65, 128)] == [False, False, True, True]
    assert [gluon_config(h).early_kv for h in (32, 64, 65, 128)] == [False, False, True, True]
    # per query a persistent grid (measured faster at 64 and 128 heads); grouped tiles one per program
    assert [gluon_config(h).persistent for h in (32, 64, 128)] == [True] * 3
    assert not any(gluon_config(64 // g, group_size=g).persistent for g in (2, 4, 8))
    decode = gluon_decode_config(128)
    assert (decode.heads_fastest, decode.early_kv) == (True, True)
    # decode: prefill's 128-head kernel but for its grid (one program per tile, measured faster there)
    assert replace(decode, persistent=True) == gluon_config(128) and not decode.persistent


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "decode", "heads": 128}, "kind must be"),
        ({"kind": "prefill", "heads": 16, "group_size": 8}, "heads must be <= 8 for group_size=8"),
        ({"kind": "prefill", "heads": 8, "group_size": 3}, "group_size must be one of"),
        ({"kind": "prefill", "heads": 8, "group_size": 8, "config": WS, "raw_rows": True}, "needs group_size=1"),
    ],
)
def test_compile_rejects_what_is_not_written(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compile_for_sm90(**kwargs)


def test_routing_picks_gluon_on_sm90_only_where_measured_faster():
    assert route_prefill_kernel(128, sm=90).path == "gluon"
    assert route_prefill_kernel(GLUON_MIN_HEADS, sm=(9, 0)).path == "gluon"
    assert route_prefill_kernel(GLUON_MIN_HEADS - 1, sm=90).path == "triton"
    assert route_prefill_kernel(128, sm=100).path == "triton"
    assert route_prefill_kernel(128, sm=None).path == "triton"
    missing = route_prefill_kernel(128, sm=90, gluon_missing="no gluon here")
    assert (missing.path, missing.reason) == ("triton", "no gluon here: Triton kernel")
    assert route_prefill_kernel(128, device_type="cpu").path == "reference"


def test_grouped_launch_rejects_more_heads_than_the_tile_holds():
    from shardattn.kernels.gluon.sparse_mla import launch_gluon_attention

    q, kv = torch.zeros(4, 16, D_V + D_R, dtype=torch.bfloat16), torch.zeros(8, D_V + D_R, dtype=torch.bfloat16)
    union, lens = torch.zeros(1, 8 * K, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="<= 8 heads"):
        launch_gluon_attention(q, kv, union, lens, scale=0.1, v_dim=D_V, group_size=8)
    with pytest.raises(ValueError, match="raw_rows needs"):  # raw rows: the 64-key kernel, one query per tile
        launch_gluon_attention(q[:, :4], kv, union, lens, scale=0.1, v_dim=D_V, group_size=8, raw_rows=True)


def test_registry_on_cpu_tensors_is_the_reference():
    q, kv = torch.zeros(2, 64, D_V + D_R), torch.zeros(4, D_V + D_R)
    name, reason = sparse_prefill_kernel(q, kv, D_V)
    assert name == "reference" and "cpu" in reason


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _case(heads: int, tokens: int = 131, kv_rows: int = 65536, seed: int = 0):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    rows = torch.randint(0, kv_rows, (tokens, K), device=dev, generator=gen, dtype=torch.int32)
    rows[torch.rand(rows.shape, device=dev, generator=gen) < 0.05] = -1  # invalid anywhere
    rows[3] = -1  # empty row
    rows[4, : K // 2] = rows[4, K // 2 :]  # every row twice
    rows[5, -7:] = kv_rows + 3  # out of range
    length = torch.full((tokens,), K, dtype=torch.int32, device=dev)
    length[6], length[7], length[8], length[tokens - 1] = 100, 0, 1, 33  # short, zero, one, tail tile
    q = torch.randn(tokens, heads, D_V + D_R, device=dev, generator=gen).to(torch.bfloat16)
    kv = torch.randn(kv_rows, D_V + D_R, device=dev, generator=gen).to(torch.bfloat16)
    sinks = torch.randn(heads, device=dev, generator=gen) * 2
    return q, kv, rows, length, sinks


def _assert_close(out, lse, q, kv, rows, length, sinks):
    from shardattn.ops.sparse_mla import sparse_mla_reference

    ref_o, ref_l = sparse_mla_reference(
        q, kv, rows, scale=(D_V + D_R) ** -0.5, v_dim=D_V, topk_length=length, sinks=sinks
    )
    assert torch.isfinite(out).all() and not lse.isnan().any()  # every element written
    err = ((out.float() - ref_o.float()).norm() / ref_o.float().norm()).item()
    assert err < 1e-2, err
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_l))
    fin = torch.isfinite(ref_l)
    assert (lse[fin] - ref_l[fin]).abs().max().item() < 1e-2
    assert (out[3] == 0).all() and (out[7] == 0).all()  # empty rows: out = 0 (also with sinks)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90() or not gluon_available(), reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize("config", [WS, ONE_TILE, EARLY], ids=lambda c: c.label)
@pytest.mark.parametrize("heads", [16, 64, 128], ids=lambda h: f"h{h}")
@pytest.mark.parametrize("with_sinks", [False, True], ids=["nosink", "sink"])
def test_gluon_variants_match_reference_at_real_shape(config, heads, with_sinks):
    from shardattn.kernels.gluon.sparse_mla import launch_gluon_attention
    from shardattn.ops.union import build_union

    q, kv, rows, length, sinks = _case(heads, seed=heads)
    sinks = sinks if with_sinks else None
    union, lens = build_union(rows, group_size=1, num_kv_rows=kv.shape[0], topk_length=length)
    out = torch.full((q.shape[0], heads, D_V), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[0], heads), float("nan"), device=q.device)
    launch_gluon_attention(
        q, kv, union, lens, scale=(D_V + D_R) ** -0.5, v_dim=D_V, config=config, sinks=sinks, out=out, lse=lse
    )
    torch.cuda.synchronize()
    _assert_close(out, lse, q, kv, rows, length, sinks)
    if sinks is None:
        assert lse[3].isneginf().all() and lse[7].isneginf().all()


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90() or not gluon_available(), reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize("entry", ["attention", "grouped_prefill"])
def test_public_entry_points_route_to_gluon_and_match(entry):
    from shardattn.ops.sparse_mla import sparse_mla_attention
    from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill

    q, kv, rows, length, sinks = _case(128, tokens=77, seed=7)
    assert sparse_prefill_kernel(q, kv, D_V)[0] == "gluon"
    fn = sparse_mla_attention if entry == "attention" else sparse_mla_grouped_prefill
    out, lse = fn(q, kv, rows, scale=(D_V + D_R) ** -0.5, v_dim=D_V, topk_length=length, sinks=sinks)
    _assert_close(out, lse, q, kv, rows, length, sinks)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90() or not gluon_available(), reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize("heads", [64, 128], ids=lambda h: f"h{h}")
def test_rows_unique_prefill_packs_the_callers_rows_and_matches(heads, monkeypatch):
    """``rows_unique=True``: the per-query kernel on each query's valid rows packed in the caller's
    order (repeats dropped first, as an indexer's top-k has none), invalid and out-of-range entries
    anywhere, an empty row, ``topk_length`` short / zero / one, sinks: the fp32 reference's result,
    no union built; both entry points."""
    from shardattn.ops import prepared_union
    from shardattn.ops.sparse_mla import sparse_mla_attention
    from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill
    from shardattn.ops.unique_rows import unique_rows_reference

    q, kv, rows, length, sinks = _case(heads, tokens=77, seed=11)
    rows = unique_rows_reference(rows, num_kv_rows=kv.shape[0])
    rows[5, -7:] = kv.shape[0] + 3  # out of range again
    monkeypatch.setattr(prepared_union, "build_union", lambda *a, **k: pytest.fail("a union was built"))
    for fn in (sparse_mla_grouped_prefill, sparse_mla_attention):
        out = torch.full((q.shape[0], heads, D_V), float("nan"), dtype=q.dtype, device=q.device)
        lse = torch.full((q.shape[0], heads), float("nan"), device=q.device)
        fn(q, kv, rows, scale=(D_V + D_R) ** -0.5, v_dim=D_V, topk_length=length, sinks=sinks, out=out, lse_out=lse,
           rows_unique=True)  # fmt: skip
        torch.cuda.synchronize()
        _assert_close(out, lse, q, kv, rows, length, sinks)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90() or not gluon_available(), reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize("heads", [64, 128], ids=lambda h: f"h{h}")
def test_a_per_query_call_on_a_large_cache_hashes_its_rows_and_matches(heads, monkeypatch):
    """On a cache past the bitmap's count (300,000 rows: the union build would sort) the per-query
    call drops each query's repeats by hash and packs the rest (no union build): the fp32
    reference's result with a row listed twice, every row of a query twice, invalid and
    out-of-range entries anywhere, an empty row, ``topk_length`` short / zero / one, sinks; both
    entry points."""
    from shardattn.kernels.gluon.union_smem import smem_unsupported_reason
    from shardattn.ops import prepared_union
    from shardattn.ops.sparse_mla import sparse_mla_attention
    from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill
    from shardattn.plan.union_routing import route_row_dedup

    q, kv, rows, length, sinks = _case(heads, tokens=77, kv_rows=300_000, seed=12)
    rows[9, 100:200] = rows[9, 0:100]  # a hundred rows twice
    smem = smem_unsupported_reason(rows, 1) is None
    assert route_row_dedup(K, kv.shape[0], shared_memory=smem) == "unique"
    monkeypatch.setattr(prepared_union, "build_union", lambda *a, **k: pytest.fail("a union was built"))
    for fn in (sparse_mla_grouped_prefill, sparse_mla_attention):
        out = torch.full((q.shape[0], heads, D_V), float("nan"), dtype=q.dtype, device=q.device)
        lse = torch.full((q.shape[0], heads), float("nan"), device=q.device)
        fn(q, kv, rows, scale=(D_V + D_R) ** -0.5, v_dim=D_V, topk_length=length, sinks=sinks, out=out, lse_out=lse)
        torch.cuda.synchronize()
        _assert_close(out, lse, q, kv, rows, length, sinks)


@needs_gluon
@pytest.mark.parametrize("heads", [8, 16, 32, 64, 128], ids=lambda h: f"h{h}")
def test_warmup_lists_the_gluon_keys_exactly_where_routing_sends_heads(heads):
    from shardattn.runtime.warmup import PrefillSpec, compile_keys

    keys = [k for k in compile_keys(PrefillSpec(heads=heads, topk=K, sinks=True)) if k.kernel == "gluon_attention"]
    expect = []
    g = gluon_grouped_group_size(heads)
    if g is not None:  # the default step's grouped Gluon tile
        expect.append(
            {"config": GROUPED_CONFIG.label, "G": g, "HAS_SINK": True, "dtype": torch.bfloat16, "KV_FP8": False}
        )
    if heads >= GLUON_MIN_HEADS:  # the per-query side
        expect.append(
            {"config": gluon_config(heads).label, "G": 1, "HAS_SINK": True, "dtype": torch.bfloat16, "KV_FP8": False}
        )
    assert sorted((k.params for k in keys), key=lambda p: p["G"]) == sorted(expect, key=lambda p: p["G"])


def test_grouped_routing_follows_the_tile_and_the_measured_crossover():
    assert [gluon_grouped_group_size(h, gluon_grouped_max_heads=32) for h in (8, 16, 32, 64)] == [8, 4, 2, None]
    for heads, g in ((8, 8), (16, 4), (32, 2)):
        route = route_prefill_kernel(heads, sm=90, group_size=g, gluon_grouped_max_heads=32)
        assert (route.path, route.group_size) == ("gluon", g) and f"G = {g}" in route.reason
        assert route_prefill_kernel(heads, sm=100, group_size=g, gluon_grouped_max_heads=32).path == "triton"
        assert route_prefill_kernel(heads, sm=90, group_size=g, gluon_grouped_max_heads=heads // 2).path == "triton"
    assert route_prefill_kernel(16, sm=90, group_size=8, gluon_grouped_max_heads=32).path == "triton"  # 128 rows
    assert route_prefill_kernel(8, sm=90, group_size=8, gluon_missing="no gluon").path == "triton"
    if GLUON_GROUPED_MAX_HEADS == 0:  # not routed until measured
        assert gluon_grouped_group_size(8) is None
        assert "not routed" in route_prefill_kernel(8, sm=90, group_size=8).reason


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90() or not gluon_available(), reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize(("heads", "group_size"), [(8, 8), (16, 4), (32, 2), (12, 4)], ids=lambda v: str(v))
@pytest.mark.parametrize("with_sinks", [False, True], ids=["nosink", "sink"])
@pytest.mark.parametrize("config", [GROUPED_CONFIG, EARLY, PERSISTENT], ids=lambda c: c.label)
def test_grouped_gluon_matches_reference_at_real_shape(heads, group_size, with_sinks, config):
    """Grouped tiles (one tile a program, Q from the producer, persistent): a tail group (131 tokens),
    a whole group with no key, padded heads (12 of 16)."""
    from shardattn.kernels.gluon.sparse_mla import launch_gluon_attention
    from shardattn.ops.union import build_union

    q, kv, rows, length, sinks = _case(heads, seed=100 + heads)
    rows[16:24] = -1  # one whole group (G <= 8) without a key
    sinks = sinks if with_sinks else None
    union, lens = build_union(rows, group_size=group_size, num_kv_rows=kv.shape[0], topk_length=length)
    out = torch.full((q.shape[0], heads, D_V), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[0], heads), float("nan"), device=q.device)
    launch_gluon_attention(
        q, kv, union, lens, scale=(D_V + D_R) ** -0.5, v_dim=D_V, sinks=sinks, out=out, lse=lse,
        group_size=group_size, config=config,
    )  # fmt: skip
    torch.cuda.synchronize()
    _assert_close(out, lse, q, kv, rows, length, sinks)
    assert (out[16:24] == 0).all()
    if sinks is None:
        assert lse[16:24].isneginf().all()


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90() or not gluon_available(), reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize(("heads", "blocks", "entry"), [(64, 4, "attention"), (128, 8, "grouped"), (16, 2, "G4")])
def test_head_blocked_buffers_are_read_and_written_in_place(heads, blocks, entry):
    """q, out and lse as ``[B, T, H/B, ...]`` (an all-to-all buffer): no copies, same result.

    64 / 128 heads through the public entries (routed to the per-query Gluon kernel), 16 heads
    through the grouped Gluon kernel's launcher (``G = 4``)."""
    from shardattn.kernels.gluon.sparse_mla import launch_gluon_attention
    from shardattn.ops.dispatch import prefill_path
    from shardattn.ops.sparse_mla import sparse_mla_attention
    from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill
    from shardattn.ops.union import build_union

    q, kv, rows, length, sinks = _case(heads, tokens=93, seed=heads + blocks)
    t, hb, scale = q.shape[0], heads // blocks, (D_V + D_R) ** -0.5
    q_blk = q.unflatten(1, (blocks, hb)).movedim(1, 0).contiguous()  # [B, T, H/B, D]
    out = torch.full((blocks, t, hb, D_V), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((blocks, t, hb), float("nan"), device=q.device)
    if entry == "G4":
        union, lens = build_union(rows, group_size=4, num_kv_rows=kv.shape[0], topk_length=length)
        o, s = launch_gluon_attention(
            q_blk, kv, union, lens, scale=scale, v_dim=D_V, sinks=sinks, out=out, lse=lse, group_size=4
        )
    else:
        assert prefill_path(q, kv, v_dim=D_V).backend == "gluon"
        fn = sparse_mla_attention if entry == "attention" else sparse_mla_grouped_prefill
        o, s = fn(q_blk, kv, rows, scale=scale, v_dim=D_V, topk_length=length, sinks=sinks, out=out, lse_out=lse)
    torch.cuda.synchronize()
    assert o is out and s is lse
    _assert_close(out.movedim(0, 1).flatten(1, 2), lse.movedim(0, 1).flatten(1, 2), q, kv, rows, length, sinks)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90() or not gluon_available(), reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize("config", [PERSISTENT, PERSISTENT_H], ids=lambda c: c.label)
@pytest.mark.parametrize(("heads", "tokens"), [(64, 700), (128, 333), (16, 300)], ids=lambda v: str(v))
@pytest.mark.parametrize("with_sinks", [False, True], ids=["nosink", "sink"])
def test_persistent_kernel_walks_many_tiles_per_program(config, heads, tokens, with_sinks):
    """Several tiles per program (more tiles than SMs), with one program's tiles empty three times in
    a row (its row-sum exchange and Q hand-over alternate buffers and phases across tiles), a tail,
    short rows, sinks: every output equal to the fp32 reference, in the raw-row mode too."""
    from shardattn.kernels.gluon.sparse_mla import launch_gluon_attention
    from shardattn.ops.union import build_union

    q, kv, rows, length, sinks = _case(heads, tokens=tokens, seed=tokens + heads)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles_per_token = -(-heads // 64)
    program = 5
    # program 5's tiles (token-group-fastest or head-blocks-adjacent order): three in a row empty
    if config.heads_fastest:
        empty = [(program + k * sms) // tiles_per_token for k in range(3)]
    else:
        empty = [(program + k * sms) % tokens for k in range(3)]
    rows[empty] = -1
    sinks = sinks if with_sinks else None
    scale = (D_V + D_R) ** -0.5
    union, lens = build_union(rows, group_size=1, num_kv_rows=kv.shape[0], topk_length=length)
    assert tokens * tiles_per_token > 2 * sms
    for raw in (False, True):  # raw rows: the union's sorted unique rows read in place, masked per entry
        out = torch.full((tokens, heads, D_V), float("nan"), dtype=q.dtype, device=q.device)
        lse = torch.full((tokens, heads), float("nan"), device=q.device)
        launch_gluon_attention(
            q, kv, union, lens, scale=scale, v_dim=D_V, config=config, sinks=sinks, out=out, lse=lse, raw_rows=raw
        )
        torch.cuda.synchronize()
        _assert_close(out, lse, q, kv, rows, length, sinks)
        assert (out[empty] == 0).all()
