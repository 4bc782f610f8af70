"""The streaming Gluon decode kernel (sm_90): its plan (CPU), its sm_90 compile (CPU, ahead of time),
and on an sm_90 GPU the kernel against the fp32 reference and the fp64 oracle (NaN-poisoned
outputs, invalid rows anywhere, a token with no key, ``topk_length`` 0 / short, sinks, top-k
tails, fewer heads than the tile, fp16, many tiles a program, one slice written directly),
``fp8_ds_mla`` rows bit for bit against the bf16 rows they dequantise to, and CUDA-graph replay."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from shardattn.kernels.gluon.compat import HAS_GLUON
from shardattn.kernels.gluon.sparse_mla_decode_stream import (
    MAX_HEADS,
    MAX_SPLITS,
    compile_for_sm90,
    stream_decode_limits,
    stream_decode_plan,
    stream_stages,
)
from shardattn.kernels.gluon.sparse_mla_decode_stream_kernel import NOT_SPECIALIZED
from shardattn.kernels.triton.lse_merge import split_partials_numel
from shardattn.ops.sparse_mla import sparse_mla_reference
from shardattn.plan.crossovers import (
    SMALL_DECODE_MAX_HEADS,
    SMALL_DECODE_MAX_TOKENS,
    STREAM_DECODE_FP8_MIN_BLOCKS_PER_SM,
    STREAM_DECODE_MIN_BLOCKS_PER_SM,
)
from shardattn.plan.decode_routing import route_sparse_decode_kernel
from shardattn.runtime.decode_warmup import COLUMN_MERGE_WARMUP_SPLITS
from tests.ptxas_report import ptxas_report
from tests.test_sparse_mla_decode_gluon import SCALE, _check, needs_sm90
from tests.test_sparse_mla_decode_gluon_small import _small_case, check_empty_rows_and_oracle

# ---- routing and the plan (CPU) ----


def test_routing_streams_calls_of_few_heads_with_enough_blocks_per_sm_and_says_why():
    assert SMALL_DECODE_MAX_HEADS == MAX_HEADS
    least = {False: STREAM_DECODE_MIN_BLOCKS_PER_SM, True: STREAM_DECODE_FP8_MIN_BLOCKS_PER_SM}
    assert least[False] < 1 <= least[True]  # so both sides of each crossover are asked below
    for sms, fp8 in itertools.product((132, 78), (False, True)):
        for topk in (64, 256, 512, 2048):
            for t in (SMALL_DECODE_MAX_TOKENS + 1, 32, 64, 128, 256, 1024):
                per_sm = t * -(-topk // 64) / sms
                for h in (1, 8, 16, 17):
                    route = route_sparse_decode_kernel(h, num_tokens=t, topk=topk, num_sms=sms, sm=90, kv_fp8=fp8,
                                                       small_missing=None, stream_missing=None)  # fmt: skip
                    streams = h <= MAX_HEADS and per_sm >= least[fp8]
                    assert (route.path == "gluon_stream") == streams, (h, t, topk, sms, fp8, route)
                    if streams:
                        assert "streaming" in route.reason and "measured" in route.reason
                        assert ("fp8_ds_mla rows" in route.reason) == fp8
    forced = route_sparse_decode_kernel(16, num_tokens=64, topk=2048, sm=90, small_missing=None, stream_missing=None,
                                        stream_min_blocks_per_sm=16)  # fmt: skip
    assert forced.path == "triton"  # 15.5 blocks per SM < 16 asked
    # the small-batch kernel keeps its calls; no top-k, a kernel that cannot run, or no sm_90: no streaming
    kw = {"num_tokens": 256, "sm": 90, "small_missing": None, "stream_missing": None}
    assert route_sparse_decode_kernel(16, **{**kw, "num_tokens": 1}, topk=8192).path == "gluon_small"
    assert route_sparse_decode_kernel(16, **kw).path == "triton"
    assert route_sparse_decode_kernel(16, **{**kw, "stream_missing": "x"}, topk=2048).path == "triton"
    assert route_sparse_decode_kernel(16, **{**kw, "sm": 100}, topk=2048).path == "triton"
    assert route_sparse_decode_kernel(16, **{**kw, "gluon_missing": "no gluon"}, topk=2048).path == "triton"
    assert route_sparse_decode_kernel(16, num_tokens=256, topk=2048, sm=90).path == "triton"  # callers that do not ask
    with pytest.raises(ValueError, match="topk"):
        route_sparse_decode_kernel(16, **kw, topk=-1)
    with pytest.raises(ValueError, match="num_sms"):
        route_sparse_decode_kernel(16, **kw, topk=2048, num_sms=0)


def test_the_op_refuses_more_heads_than_the_tile_before_any_launch():
    from shardattn.kernels.gluon.sparse_mla_decode_stream import sparse_mla_decode_stream

    q, kv, rows = torch.zeros(2, MAX_HEADS + 1, 576), torch.zeros(4, 576), torch.zeros(2, 64, dtype=torch.int32)
    out, lse = torch.zeros(2, MAX_HEADS + 1, 512), torch.zeros(2, MAX_HEADS + 1)
    with pytest.raises(ValueError, match="at most 16 heads"):
        sparse_mla_decode_stream(q, kv, rows, scale=0.1, out=out, lse_out=lse, topk_length=None, sinks=None,
                                 workspace=None, num_sms=132, pdl=False)  # fmt: skip


def test_backend_gluon_stream_is_refused_where_it_cannot_run():
    from shardattn.ops.sparse_mla_decode import sparse_mla_decode

    q, kv = torch.zeros(2, 16, 576), torch.zeros(4, 576)
    rows = torch.zeros(2, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="'gluon_stream' cannot run here"):
        sparse_mla_decode(q, kv, rows, scale=0.1, backend="gluon_stream")
    with pytest.raises(ValueError, match="'gluon_stream'"):
        sparse_mla_decode(q, kv, rows, scale=0.1, backend="stream")


@pytest.mark.parametrize("kv_fp8", [False, True])
@pytest.mark.parametrize("sms", [132, 78, 16])
@pytest.mark.parametrize("topk", [1, 63, 64, 65, 100, 256, 512, 2048, 8192])
def test_plan_covers_every_entry_once_in_slices_of_at_least_stages_minus_one_blocks(kv_fp8, sms, topk):
    nb = -(-topk // 64)
    for tokens in (1, 3, 17, 64, 100, 256, 1024):
        for asked in (None, 1, 2, 3, 7, 64, 1000):
            plan = stream_decode_plan(tokens, topk, sms, kv_fp8=kv_fp8, num_splits=asked)
            s, blocks, programs = plan["num_splits"], plan["blocks"], plan["programs"]
            assert 1 <= s <= MAX_SPLITS and blocks >= stream_stages(kv_fp8) - 1
            assert (s - 1) * blocks < nb <= s * blocks  # every block in exactly one slice, no empty slice
            assert programs == min(sms, tokens * s)
            if asked is not None and blocks > stream_stages(kv_fp8) - 1:
                assert s <= max(1, min(asked, MAX_SPLITS, nb))


def test_plan_fills_the_sms_at_mid_batches_and_takes_one_slice_past_a_wave():
    assert stream_decode_plan(64, 2048, 132, kv_fp8=False)["num_splits"] == 2  # 128 programs, not 64
    assert stream_decode_plan(256, 2048, 132, kv_fp8=False)["num_splits"] == 1
    assert stream_decode_plan(256, 2048, 132, kv_fp8=True)["num_splits"] == 1
    assert stream_decode_plan(4, 2048, 132, kv_fp8=False)["num_splits"] >= 16


def test_plan_takes_fewer_slices_where_the_workspace_holds_fewer_partials():
    full = stream_decode_plan(8, 2048, 132, kv_fp8=False, num_heads=16)["num_splits"]
    assert full > 2
    limit = split_partials_numel(2, 8, 16, 512)
    plan = stream_decode_plan(8, 2048, 132, kv_fp8=False, num_heads=16, max_partial_elems=limit)
    assert plan["num_splits"] <= 2
    assert stream_decode_plan(8, 2048, 132, kv_fp8=False, max_partial_elems=0)["num_splits"] == 1


def test_limits_name_what_the_kernel_does_not_take():
    rows = torch.zeros(2, 2048, dtype=torch.int32)
    assert stream_decode_limits(torch.zeros(2, MAX_HEADS, 576), rows) is None
    assert "at most 16 heads" in stream_decode_limits(torch.zeros(2, MAX_HEADS + 1, 576), rows)
    assert "empty top-k" in stream_decode_limits(torch.zeros(2, 8, 576), rows[:, :0])


# ---- the sm_90 compile (CPU, ahead of time) ----


def _specialisation(value: int) -> str:
    """The class Triton specialises an int launch argument on."""
    return "one" if value == 1 else "multiple of 16" if value % 16 == 0 else "other"


@pytest.mark.skipif(not HAS_GLUON, reason="needs Triton's Gluon")
def test_kernel_specialises_on_no_argument_a_batch_changes(monkeypatch):
    """Every int launch argument the kernel is specialised on but the slice count falls in one class (1,
    a multiple of 16, other) at every batch of a step (17-297 tokens) with the same slices, and every
    slice count a plan takes is one the warm-up runs, so the kernels it compiled serve all of them;
    the rest are :data:`NOT_SPECIALIZED`."""
    from shardattn.kernels.gluon import sparse_mla_decode_stream as stream

    kernel = stream._stream_decode_kernel
    names = [p.name for p in kernel.params]
    assert {p.name for p in kernel.params if p.do_not_specialize} == set(NOT_SPECIALIZED)
    launches: list[tuple] = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(args)

    monkeypatch.setattr(stream, "_stream_decode_kernel", Recorder())
    classes: dict[tuple, set] = {}
    for kv_fp8, heads, topk, t in itertools.product((False, True), (8, 12, 16), (256, 700, 2048), range(17, 300, 7)):
        q = torch.empty(t, heads, 576, dtype=torch.bfloat16)
        kv = torch.empty(640, 656, dtype=torch.uint8) if kv_fp8 else torch.empty(640, 576, dtype=torch.bfloat16)
        rows = torch.empty(t, topk, dtype=torch.int32)
        plan = stream_decode_plan(t, topk, 132, kv_fp8=kv_fp8, num_heads=heads)
        s = plan["num_splits"]
        out = torch.empty(s, t, heads, 512) if s > 1 else torch.empty(t, heads, 512, dtype=torch.bfloat16)
        lse = torch.empty(s, t, heads) if s > 1 else torch.empty(t, heads)
        stream.launch_stream_decode(q, kv, rows, None, None, out, lse, plan, 0.1, True)
        args = dict(zip(names, launches.pop(), strict=False))
        fixed = {n: _specialisation(v) for n, v in args.items() if type(v) is int and n not in NOT_SPECIALIZED}
        classes.setdefault((kv_fp8, heads, topk, s), set()).add(tuple(sorted(fixed.items())))
        warmed = {stream_decode_plan(1, topk, 132, kv_fp8=kv_fp8, num_splits=n)["num_splits"]
                  for n in (1, *COLUMN_MERGE_WARMUP_SPLITS)}  # fmt: skip
        assert s in warmed, (t, topk, s, warmed)  # the warm-up compiled this slice count's variant
    assert all(len(c) == 1 for c in classes.values()), {k: c for k, c in classes.items() if len(c) > 1}


@pytest.mark.parametrize(
    ("split", "with_len", "sinks", "dtype", "heads", "kv_fp8"),
    [
        (True, False, False, "bf16", 16, False),
        (False, True, True, "bf16", 16, False),
        (True, True, True, "fp16", 8, False),
        (True, False, False, "bf16", 16, True),
        (False, True, True, "bf16", 8, True),
    ],
)
def test_kernel_compiles_for_sm90_with_a_cp_async_ring_and_no_spills(split, with_len, sinks, dtype, heads, kv_fp8):
    from shardattn.kernels.gluon.sparse_mla import gluon_available, gluon_unavailable_reason

    if not gluon_available():
        pytest.skip(gluon_unavailable_reason())
    compiled = compile_for_sm90(split=split, topk_length=with_len, sinks=sinks, dtype=dtype, heads=heads,
                                kv_fp8=kv_fp8)  # fmt: skip
    ptx = compiled.asm["ptx"]
    width = 8 if heads <= 8 else 16
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)) == {f"m64n{width}k16"}
    assert compiled.metadata.num_warps == 4 and compiled.metadata.shared <= 232448
    # S^T: 36 k-steps of 16 over 576 columns; O^T: 8 M tiles x 4 k-steps; in the loop body once
    assert ptx.count("wgmma.mma_async") == 36 + 32
    stages = stream_stages(kv_fp8)
    waits = [int(w) for w in re.findall(r"cp\.async\.wait_group\s+(\d+);", ptx)]
    assert waits == [stages - 1, 0]  # block c landed (its group and STAGES - 2 later ones in flight), drain
    assert ptx.count("cp.async.cg.shared.global") > 0  # 16-byte gathers
    assert ("cvt.rn.f16x2.e4m3x2" in ptx) == kv_fp8
    assert ptx.count("griddepcontrol.wait") == 1 and ptx.count("griddepcontrol.launch_dependents") == 1
    report = ptxas_report(ptx)
    if report is not None:
        assert report.spill_stores == 0 and report.spill_loads == 0, report


# ---- on an sm_90 GPU ----


def _stream_case(tokens, heads, seed, k=2048, dtype=torch.bfloat16):
    """The small-batch tests' inputs (unique valid rows, invalid entries kept where they were, a
    128-entry stretch with no key), plus a whole 64-entry block with no key and ``topk_length``
    clamped to the top-k."""
    q, kv, rows, length, sinks = _small_case(tokens, heads, seed, k=k, dtype=dtype)
    if k >= 256 and tokens > 3:
        rows[3, 64:128] = -1
    return q, kv, rows, length.clamp(max=k), sinks


def _run(q, kv, rows, length, sinks, num_splits=None, workspace=None):
    from shardattn.kernels.gluon.sparse_mla_decode_stream import sparse_mla_decode_stream

    t, h, _ = q.shape
    out = torch.full((t, h, 512), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((t, h), float("nan"), device=q.device)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sparse_mla_decode_stream(q, kv, rows, scale=SCALE, out=out, lse_out=lse, topk_length=length, sinks=sinks,
                             workspace=workspace, num_sms=sms, pdl=False, num_splits=num_splits)  # fmt: skip
    return out, lse


STREAM_CASES = [
    (64, 16, 2048, True, True, torch.bfloat16, None),
    (70, 16, 2048, False, False, torch.bfloat16, None),
    (33, 8, 1000, True, True, torch.bfloat16, 3),  # a top-k tail, 8 heads on the 8-wide wgmma
    (5, 3, 200, False, True, torch.float16, 1),  # one slice: the result written directly
    (300, 16, 512, True, False, torch.bfloat16, None),  # several tiles a program
    (3, 16, 64, True, True, torch.bfloat16, 1),  # one block a tile
    (9, 12, 2048, True, True, torch.bfloat16, 64),  # the most slices
]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(("tokens", "heads", "k", "with_len", "with_sinks", "dtype", "splits"), STREAM_CASES)
def test_stream_kernel_matches_reference(tokens, heads, k, with_len, with_sinks, dtype, splits):
    q, kv, rows, length, sinks = _stream_case(tokens, heads, seed=tokens * 31 + heads + k, k=k, dtype=dtype)
    length = length if with_len else None
    sinks = sinks if with_sinks else None
    out, lse = _run(q, kv, rows, length, sinks, num_splits=splits)
    ref_o, ref_l = sparse_mla_reference(q, kv, rows, scale=SCALE, topk_length=length, sinks=sinks)
    _check(out, lse, ref_o, ref_l)
    check_empty_rows_and_oracle(out, lse, q, kv, rows, length, sinks, oracle=tokens <= 5)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(
    ("tokens", "heads", "k", "splits"),
    [(64, 16, 2048, None), (20, 12, 700, 5), (200, 8, 256, None), (3, 16, 64, None), (2, 16, 100, 1)],
)
def test_stream_kernel_on_fp8_rows_equals_the_bf16_rows_they_hold(tokens, heads, k, splits):
    """The FP8 path differs from the bf16 one only in its loads (and dequantisation into the same
    bf16 values), so its output is the bf16 run's on the dequantised rows, bit for bit."""
    from shardattn.ops.kv_fp8 import dequantize_kv, quantize_kv

    q, kv, rows, length, sinks = _stream_case(tokens, heads, seed=7 * tokens + k, k=k)
    cache = quantize_kv(kv.float() * torch.exp2(torch.randint(-4, 4, (kv.shape[0], 1), device="cuda")))
    got = _run(q, cache, rows, length, sinks, num_splits=splits)
    want = _run(q, dequantize_kv(cache), rows, length, sinks, num_splits=splits)
    assert torch.isfinite(got[0]).all() and not got[1].isnan().any()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    _check(*got, *sparse_mla_reference(q, dequantize_kv(cache), rows, scale=SCALE, topk_length=length, sinks=sinks))


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("kv_fp8", [False, True])
def test_routed_decode_streams_at_16_heads_and_64_tokens_duplicates_once(kv_fp8):
    """The public entry routes a 64-token, 16-head call here; default ``rows_unique=False``: a row
    listed twice is one key (the union is built first), as on the Triton path."""
    from shardattn.ops.dispatch import sparse_decode_kernel
    from shardattn.ops.kv_fp8 import dequantize_kv, quantize_kv
    from shardattn.ops.sparse_mla_decode import sparse_mla_decode

    q, kv, rows, length, sinks = _stream_case(64, 16, seed=5)
    rows[0, 1000:1100] = rows[0, 0:100]
    if kv_fp8:
        kv = quantize_kv(kv.float())
    name, reason = sparse_decode_kernel(q, kv, 512, rows)
    assert name == "gluon_stream", reason
    got = sparse_mla_decode(q, kv, rows, scale=SCALE, topk_length=length, sinks=sinks)
    rows_kv = dequantize_kv(kv) if kv_fp8 else kv
    tri = sparse_mla_decode(q, rows_kv, rows, scale=SCALE, topk_length=length, sinks=sinks, backend="triton")
    _check(*got, *sparse_mla_reference(q, rows_kv, rows, scale=SCALE, topk_length=length, sinks=sinks))
    assert ((got[0].float() - tri[0].float()).norm() / tri[0].float().norm()).item() < 1e-2
    assert torch.equal(torch.isneginf(got[1]), torch.isneginf(tri[1]))


@pytest.mark.gpu
@needs_sm90
def test_stream_kernel_takes_fewer_slices_in_a_small_workspace():
    q, kv, rows, length, sinks = _stream_case(8, 16, seed=13)
    ref = sparse_mla_reference(q, kv, rows, scale=SCALE, topk_length=length, sinks=sinks)
    ws = torch.full((split_partials_numel(2, 8, 16, 512),), float("nan"), device="cuda")
    _check(*_run(q, kv, rows, length, sinks, workspace=ws), *ref)


@pytest.mark.gpu
@needs_sm90
def test_stream_kernel_graph_capture_replays_bitwise():
    from shardattn.runtime.graph_capture import DecodeGraph

    tokens = 64
    q, kv, rows, length, sinks = _stream_case(tokens, 16, seed=41)
    s_q, s_rows, s_len = q.clone(), rows.clone(), length.clone()
    out = torch.empty(tokens, 16, 512, dtype=q.dtype, device="cuda")
    lse = torch.empty(tokens, 16, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def step():
        from shardattn.kernels.gluon.sparse_mla_decode_stream import sparse_mla_decode_stream

        sparse_mla_decode_stream(s_q, kv, s_rows, scale=SCALE, out=out, lse_out=lse, topk_length=s_len, sinks=sinks,
                                 workspace=None, num_sms=sms, pdl=True)  # fmt: skip

    graph = DecodeGraph(step, {})
    for seed in (51, 52):  # new inputs copied into the static buffers, outputs poisoned
        q2, _, rows2, len2, _ = _stream_case(tokens, 16, seed=seed)
        s_q.copy_(q2), s_rows.copy_(rows2), s_len.copy_(len2)
        out.fill_(float("nan")), lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = _run(q2, kv, rows2, len2, sinks)
        assert torch.equal(out, eager[0]) and torch.equal(lse, eager[1])
        _check(out, lse, *sparse_mla_reference(q2, kv, rows2, scale=SCALE, topk_length=len2, sinks=sinks))
