"""Sparse-MLA decode on the Gluon kernel: routing, row slicing, sinks and merge (CPU, with a torch
stand-in for the kernel), the row-slicing Triton kernel (interpreter), and on an sm_90 GPU the
routed path against the fp32 reference at real shapes (NaN-poisoned outputs, invalid rows
anywhere, empty rows, ``topk_length``, sinks, drafts, duplicates per ``rows_unique``) and under
CUDA-graph capture and replay."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from shardattn.kernels.gluon.sparse_mla_decode import (
    MAX_SPLITS,
    SPLIT_ROWS,
    gluon_decode_config,
    gluon_decode_plan,
    reads_raw_rows,
)
from shardattn.kernels.triton.lse_merge import split_partials_numel
from shardattn.kernels.triton.pack_rows import pack_rows, pack_rows_reference
from shardattn.ops.dispatch import sparse_decode_kernel
from shardattn.ops.sparse_mla import sparse_mla_reference
from shardattn.ops.sparse_mla_decode import run_sparse_mla_decode, sparse_mla_decode
from shardattn.ops.sparse_mla_decode_gluon import sparse_mla_decode_gluon
from shardattn.plan.crossovers import DEDUP_HASH_MAX_TOKENS
from shardattn.plan.decode_routing import (
    GLUON_DECODE_FP8_MIN_QUERY_ROWS,
    GLUON_DECODE_MIN_HEADS,
    GLUON_DECODE_MIN_QUERY_ROWS,
    route_sparse_decode_kernel,
)
from shardattn.runtime.graph_capture import DecodeGraph
from shardattn.testing.interpret import run_interpreted
from tests.oracle import sparse_mla_oracle

# ---- routing (CPU) ----


def test_routing_sends_many_heads_on_sm90_to_gluon_and_says_why():
    route = route_sparse_decode_kernel(128, sm=90)
    assert route.path == "gluon" and "Gluon" in route.reason
    assert route_sparse_decode_kernel(GLUON_DECODE_MIN_HEADS, sm=(9, 0)).path == "gluon"
    low = route_sparse_decode_kernel(GLUON_DECODE_MIN_HEADS - 1, sm=90)
    assert low.path == "triton" and "Triton" in low.reason and "measured" in low.reason
    assert route_sparse_decode_kernel(128, sm=100).path == "triton"
    assert route_sparse_decode_kernel(128, sm=None).path == "triton"
    missing = route_sparse_decode_kernel(128, sm=90, gluon_missing="no gluon here")
    assert missing.path == "triton" and missing.reason.startswith("no gluon here")
    assert route_sparse_decode_kernel(128, device_type="cpu").path == "reference"
    with pytest.raises(ValueError, match="num_heads"):
        route_sparse_decode_kernel(0, sm=90)
    # small batches are latency bound: Triton below the measured query rows (tokens x heads), a
    # higher count on fp8_ds_mla rows
    for least, fp8 in ((GLUON_DECODE_MIN_QUERY_ROWS, False), (GLUON_DECODE_FP8_MIN_QUERY_ROWS, True)):
        for heads in (32, 64):
            tokens = -(-least // heads)
            assert route_sparse_decode_kernel(heads, num_tokens=tokens, sm=90, kv_fp8=fp8).path == "gluon"
            if tokens > 1:
                small = route_sparse_decode_kernel(heads, num_tokens=tokens - 1, sm=90, kv_fp8=fp8)
                assert small.path == "triton" and "latency bound" in small.reason
                assert ("fp8_ds_mla" in small.reason) == fp8
    assert GLUON_DECODE_FP8_MIN_QUERY_ROWS > GLUON_DECODE_MIN_QUERY_ROWS


def test_registry_and_backend_argument_on_cpu():
    q, kv = torch.zeros(2, 128, 576), torch.zeros(4, 576)
    name, reason = sparse_decode_kernel(q, kv, 512)
    assert name == "reference" and "cpu" in reason
    rows = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="backend='gluon' cannot run here"):
        sparse_mla_decode(q, kv, rows, scale=0.1, backend="gluon")
    with pytest.raises(ValueError, match="backend must be"):
        sparse_mla_decode(q, kv, rows, scale=0.1, backend="cuda")
    with pytest.raises(ValueError, match="backend='triton' cannot run here: no CUDA tensors or no Triton"):
        sparse_mla_decode(q, kv, rows, scale=0.1, backend="triton")  # forced: no silent fallback
    out, _ = sparse_mla_decode(q, kv, rows, scale=0.1)  # routed: the reference
    assert out.shape == (2, 128, 512)
    for backend in (None, "triton", "gluon", "gluon_small", "gluon_stream"):  # no key: the empty result, forced too
        out, lse = sparse_mla_decode(q, kv[:0], rows, scale=0.1, backend=backend)
        assert not out.any() and bool(lse.isneginf().all()), backend


@pytest.mark.parametrize("heads", [64, 128])
def test_plan_covers_the_row_and_fills_the_machine(heads):
    previous = None
    for tokens in (1, 2, 8, 64, 256):
        plan = gluon_decode_plan(tokens, heads, 2048, 132)
        s, chunk = plan["num_splits"], plan["chunk"]
        assert s * chunk >= 2048 and (s - 1) * chunk < 2048 and chunk % SPLIT_ROWS == 0
        if previous is not None:
            assert s <= previous  # fewer slices as tokens grow
        previous = s
    assert gluon_decode_plan(1, heads, 2048, 132)["num_splits"] > 1
    assert gluon_decode_plan(256, heads, 2048, 132)["num_splits"] == 1
    # asked-for slices are honoured (rounded to whole blocks); a small workspace caps them
    assert gluon_decode_plan(5, heads, 2048, 132, 7) == {"num_splits": 7, "chunk": 320, "persistent": False}
    cap = split_partials_numel(4, 8, heads, 512)
    capped = gluon_decode_plan(8, heads, 2048, 132, 16, max_partial_elems=cap)
    assert split_partials_numel(capped["num_splits"], 8, heads, 512) <= cap and capped["num_splits"] > 1
    assert gluon_decode_plan(8, heads, 2048, 132, max_partial_elems=0)["num_splits"] == 1
    assert gluon_decode_plan(3, heads, 0, 132)["num_splits"] == 1


@pytest.mark.parametrize("heads", [32, 64, 128])
def test_plan_slices_fp8_rows_at_least_as_finely(heads):
    # an fp8_ds_mla key costs the program twice a bf16 one: never fewer slices, never past the cap
    plans = {}
    for topk in (256, 512, 2048):
        for tokens in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            bf16, fp8 = (gluon_decode_plan(tokens, heads, topk, 132, kv_fp8=f)["num_splits"] for f in (False, True))
            assert bf16 <= fp8 <= MAX_SPLITS
            plans[tokens, topk] = (bf16, fp8)
    assert plans[8, 2048] == {32: (16, 16), 64: (8, 16), 128: (8, 8)}[heads]  # 64 x 8: 16 measured faster
    assert plans[1, 2048] == (MAX_SPLITS, MAX_SPLITS)


def test_decode_takes_one_configuration_whose_slices_are_whole_blocks():
    cfg = gluon_decode_config(128)
    assert (cfg.heads_fastest, cfg.early_kv, cfg.persistent) == (True, True, False)
    assert gluon_decode_config(64) == cfg
    assert gluon_decode_config(64, persistent=True) == dataclasses.replace(cfg, persistent=True)
    assert SPLIT_ROWS % 64 == 0  # a slice is a whole number of the 64-key kernel's blocks


@pytest.mark.parametrize("kv_fp8", [False, True])
def test_plan_takes_the_persistent_grid_past_one_wave_of_bf16_tiles(kv_fp8):
    seen = set()
    for tokens, heads, topk in itertools.product((1, 8, 64, 65, 128, 256), (32, 64, 128), (512, 2048)):
        plan = gluon_decode_plan(tokens, heads, topk, 132, kv_fp8=kv_fp8)
        tiles = tokens * -(-heads // 64) * plan["num_splits"]
        assert plan["persistent"] == (not kv_fp8 and tiles > 132), (tokens, heads, topk)
        seen.add(plan["persistent"])
    assert seen == ({False} if kv_fp8 else {False, True})


@pytest.mark.parametrize(
    ("tokens", "splits", "forced"),
    [(2, 2, None), (5, 1, None), (3, 2, None), (8, 4, None), (8, 4, False), (2, 2, True)],
)
def test_the_launch_takes_the_plans_grid(monkeypatch, tokens, splits, forced):
    """The Gluon launch gets the persistent configuration exactly where the plan asks for it (more
    tiles than SMs on bf16 rows), sliced or not, or as forced (``persistent=``, the warm-up's and
    benchmarks' knob); checked on the CPU, the launcher recorded."""
    import shardattn.kernels.gluon.sparse_mla as gluon_launch
    from shardattn.kernels.gluon.sparse_mla_decode import gluon_attend

    launches = []
    monkeypatch.setattr(
        gluon_launch, "launch_gluon_attention", lambda *a, **kw: launches.append((kw["q_slices"], kw["config"]))
    )
    h, dv, k, sms = 8, 16, 256, 4
    q, kv, rows, _, _ = _case(tokens, h, 24, dv, 40, k, seed=tokens)
    out, lse = torch.empty(tokens, h, dv), torch.empty(tokens, h)
    sparse_mla_decode_gluon(
        q, kv, rows, scale=0.3, v_dim=dv, out=out, lse_out=lse, num_sms=sms, num_splits=splits, attend=gluon_attend,
        rows_unique=True, persistent=forced,
    )  # fmt: skip
    plan = gluon_decode_plan(tokens, h, k, sms, splits, persistent=forced)
    assert launches == [(plan["num_splits"], gluon_decode_config(h, persistent=plan["persistent"]))]
    want = tokens * plan["num_splits"] > sms if forced is None else forced
    assert plan["persistent"] == want


def test_pack_rows_reference_packs_valid_rows_in_order():
    rows = torch.tensor([[5, -1, 7, 9, 99, 2], [-1, -1, -1, -1, -1, -1], [1, 2, 3, 4, 5, 6]], dtype=torch.int32)
    length = torch.tensor([6, 6, 3], dtype=torch.int32)
    union, lens = pack_rows_reference(rows, num_kv_rows=10, width=8, topk_length=length)
    assert lens.tolist() == [4, 0, 3] and union.shape == (3, 8)
    assert union[0, :4].tolist() == [5, 7, 9, 2] and union[2, :3].tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="width"):
        pack_rows(rows, num_kv_rows=10, width=5)


def _case(t, h, d, dv, r, k, seed, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g).to(dtype)
    kv = torch.randn(r, d, generator=g).to(dtype)
    rows = torch.randint(0, r, (t, k), generator=g, dtype=torch.int32)
    rows[torch.rand(t, k, generator=g) < 0.2] = -1  # invalid anywhere
    rows[:, 3] = r + 5  # out of range
    rows[0] = -1  # a token with no valid key
    length = torch.randint(0, k + 1, (t,), generator=g, dtype=torch.int32)
    length[1] = 0
    sinks = torch.randn(h, generator=g) * 2
    return [x.to(device) for x in (q, kv, rows, length, sinks)]


def _reference_attend(
    q, kv, union, lens, *, scale, v_dim, sinks, out, lse, raw_rows=False, q_slices=1, persistent=False
):  # fmt: skip
    """A torch stand-in for the Gluon kernel: query ``p = t * S + s`` (``S = q_slices``) attends
    ``union[p, :n]`` with token ``t``'s q, ``n`` = ``lens[t] - s * W`` clamped to ``[0, W]``, every
    entry a key (as the kernel does: it never de-duplicates); ``raw_rows``: the caller's rows,
    ``lens`` None (every entry) or ``topk_length``, invalid entries masked; ``persistent`` changes
    only the kernel's grid."""
    p, w = union.shape
    if lens is None:
        assert raw_rows
        n = torch.full((p,), w)
    else:
        n = (lens.long().repeat_interleave(q_slices) - torch.arange(p) % q_slices * w).clamp(0, w)
    union = torch.where(torch.arange(w)[None, :] < n[:, None], union, -1)
    union, kv = _each_occurrence(union, kv)
    q_p = q.repeat_interleave(q_slices, dim=0)
    o, s = sparse_mla_reference(q_p.contiguous(), kv, union, scale=scale, v_dim=v_dim, sinks=sinks)
    out.copy_(o)
    lse.copy_(s)


def _each_occurrence(rows: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows', kv')`` where the ``i``-th repeat of a row in a token's list reads copy ``i`` of ``kv``:
    each occurrence is then its own key, which is what ``rows_unique=True`` computes."""
    r = kv.shape[0]
    out = rows.clone()
    copies = 1
    for t in range(rows.shape[0]):
        seen: dict[int, int] = {}
        for j, v in enumerate(rows[t].tolist()):
            if 0 <= v < r:
                out[t, j] = v + seen.get(v, 0) * r
                seen[v] = seen.get(v, 0) + 1
                copies = max(copies, seen[v])
            else:
                out[t, j] = -1  # stays invalid against the larger cache
    return out.to(rows.device), torch.cat([kv] * copies)


@pytest.mark.parametrize("splits", [1, 2, 3, None])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["nosink", "sink"])
@pytest.mark.parametrize("rows_unique", [False, True], ids=["dedup", "unique"])
@pytest.mark.parametrize("k", [200, 256])
@pytest.mark.parametrize("t", [12, 4, 1])
def test_slicing_sinks_and_merge_match_the_oracle_on_cpu(splits, with_sinks, rows_unique, k, t):
    h, d, dv, r = 8, 24, 16, 40
    q, kv, rows, length, sinks = _case(max(t, 4), h, d, dv, r, k, seed=splits or 0)
    rows[2, 100:150] = rows[2, 0:50]  # duplicates
    if t == 1:  # one token: the one with duplicates
        q, rows, length = q[2:3], rows[2:3], length[2:3]
    if splits == 1 and not with_sinks:
        length = None  # the in-place launch without lengths attends every entry
    sinks = sinks if with_sinks else None
    out = torch.full((t, h, dv), float("nan"))
    lse = torch.full((t, h), float("nan"))
    calls = []

    def attend(q_, kv_, union, *args, raw_rows=False, q_slices=1, **kw):
        calls.append((raw_rows, q_slices, union.shape, q_ is q))
        _reference_attend(q_, kv_, union, *args, raw_rows=raw_rows, q_slices=q_slices, **kw)

    sparse_mla_decode_gluon(
        q, kv, rows, scale=0.3, v_dim=dv, out=out, lse_out=lse, num_sms=4, topk_length=length, sinks=sinks,
        num_splits=splits, rows_unique=rows_unique, attend=attend,
    )  # fmt: skip
    plan = gluon_decode_plan(t, h, k, 4, splits)
    s, chunk = plan["num_splits"], plan["chunk"]
    # one launch on the caller's q; rows read in place where the slices cover the row exactly, else
    # packed first: raw (masked per entry) when unique or de-duplicated by the hash (up to 8
    # tokens), as built when the union packed them (more tokens on this small cache)
    in_place = s == 1 or s * chunk == k
    raw = rows_unique or t <= DEDUP_HASH_MAX_TOKENS
    assert calls == [(raw and in_place, s, (t * s, chunk if s > 1 else k), True)]
    if rows_unique:  # a duplicate counts twice
        rows_e, kv_e = _each_occurrence(rows, kv)
        ref_o, ref_l = sparse_mla_oracle(q, kv_e, rows_e, scale=0.3, v_dim=dv, topk_length=length, sinks=sinks)
    else:
        ref_o, ref_l = sparse_mla_oracle(q, kv, rows, scale=0.3, v_dim=dv, topk_length=length, sinks=sinks)
    torch.testing.assert_close(out.double(), ref_o, atol=1e-5, rtol=0)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_l))
    fin = torch.isfinite(ref_l)
    torch.testing.assert_close(lse.double()[fin], ref_l[fin], atol=1e-5, rtol=0)
    if t > 1:
        assert (out[0] == 0).all()  # empty tokens: 0, lse -inf (or the sink)
        if length is not None:
            assert (out[1] == 0).all()
        if with_sinks:
            torch.testing.assert_close(lse[0], sinks)


@pytest.mark.parametrize("splits", [1, 3])
def test_a_sliced_launch_and_the_hash_before_it_are_dependent_launches(monkeypatch, splits):
    """Where the device takes programmatic dependent launches, the Gluon decode kernel is one when a
    merge follows it (sliced), and the hash ahead of it then lets it launch at once; one slice
    keeps plain launches. The decisions are checked on the CPU: the launcher and the hash recorded."""
    import shardattn.kernels.backend as backend
    import shardattn.kernels.gluon.sparse_mla as gluon_launch
    import shardattn.ops.sparse_mla_decode_gluon as decode_gluon
    from shardattn.kernels.gluon.sparse_mla_decode import gluon_attend

    launches, hashes = [], []
    monkeypatch.setattr(backend, "pdl_supported", lambda device: True)
    monkeypatch.setattr(gluon_launch, "launch_gluon_attention", lambda *a, **kw: launches.append(kw["pdl"]))
    real_rows = decode_gluon.decode_rows

    def recorded_rows(*a, pdl=False, **kw):
        hashes.append(pdl)
        return real_rows(*a, **kw)

    monkeypatch.setattr(decode_gluon, "decode_rows", recorded_rows)
    t, h, dv, k = 2, 8, 16, 256
    q, kv, rows, _, _ = _case(t, h, 24, dv, 40, k, seed=1)
    rows[0, 10] = rows[0, 200]  # a repeat: the hash runs
    out, lse = torch.empty(t, h, dv), torch.empty(t, h)
    sparse_mla_decode_gluon(
        q, kv, rows, scale=0.3, v_dim=dv, out=out, lse_out=lse, num_sms=4, num_splits=splits, attend=gluon_attend
    )  # fmt: skip
    assert launches == [splits > 1] and hashes == [splits > 1]


# ---- the row-slicing Triton kernel under the interpreter ----


def interpreted_pack_rows() -> None:
    g = torch.Generator().manual_seed(3)
    for t, k, width, with_len in ((3, 40, 64, False), (5, 2500, 2688, True), (2, 130, 130, True)):
        rows = torch.randint(-2, 300, (t, k), generator=g, dtype=torch.int32)
        rows[0] = -1
        length = torch.randint(0, k + 1, (t,), generator=g, dtype=torch.int32) if with_len else None
        union, lens = pack_rows(rows, num_kv_rows=290, width=width, topk_length=length)
        ref_u, ref_n = pack_rows_reference(rows, num_kv_rows=290, width=width, topk_length=length)
        assert torch.equal(lens, ref_n), (t, k, width)
        keep = torch.arange(width)[None, :] < lens[:, None]
        assert torch.equal(union[keep], ref_u[keep]), (t, k, width)
        out = (torch.full((t, width), -7, dtype=torch.int32), torch.full((t,), -7, dtype=torch.int32))
        got = pack_rows(rows, num_kv_rows=290, width=width, topk_length=length, out=out)  # a prefill's workspace
        assert got[0] is out[0] and got[1] is out[1] and torch.equal(out[1], ref_n)
        assert torch.equal(out[0][keep], ref_u[keep]), (t, k, width)


@pytest.mark.interpret
def test_pack_rows_kernel_matches_reference_under_interpreter():
    pytest.importorskip("triton", reason="the kernel needs triton")
    run_interpreted(__name__, "interpreted_pack_rows")


# ---- GPU: the routed Gluon path at real shapes ----


def _sm90_gluon() -> bool:
    from shardattn.kernels.gluon.sparse_mla import gluon_available

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and gluon_available()


needs_sm90 = pytest.mark.skipif(not _sm90_gluon(), reason="needs an sm_90 GPU and Triton's Gluon")
SCALE = 576**-0.5


def _gpu_case(tokens, heads, seed, r=50000, k=2048):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    rows = torch.randint(0, r, (tokens, k), device=dev, generator=gen, dtype=torch.int32)
    rows[torch.rand(rows.shape, device=dev, generator=gen) < 0.05] = -1  # invalid anywhere
    rows[:, -3:] = r + 11  # out of range at the tail
    length = torch.full((tokens,), k, dtype=torch.int32, device=dev)
    if tokens > 2:
        rows[tokens // 2] = -1  # an empty row
        length[tokens - 1] = 33  # short
        length[1] = 0  # zero
    q = torch.randn(tokens, heads, 576, device=dev, generator=gen).bfloat16()
    kv = torch.randn(r, 576, device=dev, generator=gen).bfloat16()
    sinks = torch.randn(heads, device=dev, generator=gen) * 2
    return q, kv, rows, length, sinks


def _check(out, lse, ref_o, ref_l):
    assert torch.isfinite(out).all() and not lse.isnan().any()  # every element written
    err = ((out.float() - ref_o.float()).norm() / ref_o.float().norm().clamp_min(1e-6)).item()
    assert err < 1e-2, err
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_l))
    fin = torch.isfinite(ref_l)
    assert (lse[fin] - ref_l[fin]).abs().max().item() < 1e-2


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(
    ("heads", "tokens", "with_sinks"),
    [(128, 1, True), (128, 64, False), (128, 256, True), (64, 1, False), (64, 64, True), (64, 256, False)],
)
def test_gluon_decode_matches_reference(heads, tokens, with_sinks):
    q, kv, rows, length, sinks = _gpu_case(tokens, heads, seed=heads + tokens)
    sinks = sinks if with_sinks else None
    rows[0, 1000:1100] = rows[0, 0:100]  # duplicates (one key each by default)
    name, reason = sparse_decode_kernel(q, kv, 512)
    assert (name == "gluon") == (tokens * heads >= GLUON_DECODE_MIN_QUERY_ROWS), reason
    out = torch.full((tokens, heads, 512), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((tokens, heads), float("nan"), device=q.device)
    backend = "gluon" if name != "gluon" else None  # small batches: forced (routed to Triton)
    sparse_mla_decode(q, kv, rows, scale=SCALE, topk_length=length, sinks=sinks, out=out, lse_out=lse, backend=backend)
    ref_o, ref_l = sparse_mla_reference(q, kv, rows, scale=SCALE, topk_length=length, sinks=sinks)
    _check(out, lse, ref_o, ref_l)
    if tokens > 2:
        assert (out[tokens // 2] == 0).all() and (out[1] == 0).all()
    if sinks is not None and tokens > 2:  # an empty row's LSE is the sink
        torch.testing.assert_close(lse[tokens // 2], sinks, atol=1e-5, rtol=1e-6)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(
    ("heads", "tokens", "splits", "with_sinks", "rows_unique"),
    [
        (128, 64, None, True, False),
        (64, 200, 1, False, False),
        (128, 6, 5, True, False),
        (64, 3, 3, False, False),
        (64, 8, 4, True, False),
        (64, 64, 2, False, True),
        (128, 8, 8, True, True),
        (128, 40, 4, True, True),
        (64, 160, 2, True, False),
    ],
)
def test_decode_kernel_matches_reference(heads, tokens, splits, with_sinks, rows_unique):
    """The decode configuration through the whole Gluon path: one slice and sliced, one tile a program
    and the persistent grid (more tiles than SMs on bf16 rows: 64 x 200, 128 x 40 x 4 slices,
    64 x 160 x 2), slices of an odd
    number of 64-key blocks (5 slices of 448 rows, packed first: the 64-key kernel's last pair half
    empty), slices read in place from the union or from the caller's rows (2, 4 or 8 of a 2,048-entry
    row), empty and short rows, invalid rows anywhere, duplicates (one key each; twice with
    ``rows_unique``), sinks; NaN-poisoned outputs."""
    q, kv, rows, length, sinks = _gpu_case(tokens, heads, seed=7 * heads + tokens)
    sinks = sinks if with_sinks else None
    rows[0, 1000:1100] = rows[0, 0:100]
    out = torch.full((tokens, heads, 512), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((tokens, heads), float("nan"), device=q.device)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sparse_mla_decode_gluon(
        q, kv, rows, scale=SCALE, v_dim=512, out=out, lse_out=lse, num_sms=sms, topk_length=length, sinks=sinks,
        num_splits=splits, rows_unique=rows_unique,
    )  # fmt: skip
    if rows_unique:
        rows_e, kv_e = _each_occurrence(rows.cpu(), kv)
        ref_o, ref_l = sparse_mla_reference(q, kv_e, rows_e.cuda(), scale=SCALE, topk_length=length, sinks=sinks)
    else:
        ref_o, ref_l = sparse_mla_reference(q, kv, rows, scale=SCALE, topk_length=length, sinks=sinks)
    _check(out, lse, ref_o, ref_l)
    if tokens > 2:
        assert (out[tokens // 2] == 0).all() and (out[1] == 0).all()


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(("heads", "tokens", "slices"), [(128, 40, 4), (64, 160, 2), (64, 5, 2)])
def test_persistent_grid_runs_sliced_rows_as_one_tile_a_program_does(heads, tokens, slices):
    """The 64-key kernel on the persistent grid (one program per SM walking tiles in turn) with each
    token's raw rows cut into slices (``q_slices``: tile ``g`` reads token ``g // slices``'s q):
    the partials of one tile a program bit for bit, and, merged, the doubled-key reference's
    result: invalid rows anywhere, an empty row, ``topk_length`` 0 / 33, NaN-poisoned partials."""
    from shardattn.kernels.gluon.sparse_mla import GluonConfig, launch_gluon_attention
    from shardattn.ops.lse_merge import lse_merge_reference

    q, kv, rows, length, _ = _gpu_case(tokens, heads, seed=13 * heads + tokens)
    chunk = rows.shape[1] // slices
    partials = []
    for persistent in (False, True):
        cfg = GluonConfig(heads_fastest=True, early_kv=True, persistent=persistent)
        out = torch.full((tokens * slices, heads, 512), float("nan"), device=q.device)
        lse = torch.full((tokens * slices, heads), float("nan"), device=q.device)
        launch_gluon_attention(
            q, kv, rows.view(tokens * slices, chunk), length, scale=SCALE, v_dim=512, config=cfg, out=out, lse=lse,
            raw_rows=True, q_slices=slices,
        )  # fmt: skip
        partials.append((out, lse))
    (out0, lse0), (out1, lse1) = partials
    assert torch.equal(out1.view(torch.int32), out0.view(torch.int32))
    assert torch.equal(lse1.view(torch.int32), lse0.view(torch.int32))
    merged, merged_lse = lse_merge_reference(
        out1.view(tokens, slices, heads, 512).transpose(0, 1), lse1.view(tokens, slices, heads).transpose(0, 1)
    )
    rows_e, kv_e = _each_occurrence(rows.cpu(), kv)
    ref_o, ref_l = sparse_mla_reference(q, kv_e, rows_e.cuda(), scale=SCALE, topk_length=length)
    _check(merged, merged_lse, ref_o, ref_l)


@pytest.mark.gpu
@needs_sm90
def test_drafts_unique_rows_duplicates_count_twice_like_triton():
    """4 requests x 3 draft tokens (neighbouring drafts share most rows), forced slices, a small
    workspace, ``rows_unique=True`` with a duplicate: Gluon == doubled-key reference == Triton."""
    q, kv, rows, length, sinks = _gpu_case(12, 128, seed=5)
    for d in range(1, 3):  # drafts of request i share 3/4 of the first draft's rows
        rows[d::3, :1536] = rows[0::3, :1536]
    rows[4, 500:520] = rows[4, 0:20]
    ws = torch.full((split_partials_numel(3, 12, 128, 512),), float("nan"), device="cuda")
    out = torch.full((12, 128, 512), float("nan"), dtype=q.dtype, device="cuda")
    lse = torch.full((12, 128), float("nan"), device="cuda")
    run_sparse_mla_decode(
        q, kv, rows, scale=SCALE, topk_length=length, sinks=sinks, num_splits=5, rows_unique=True, out=out,
        lse_out=lse, workspace=ws, kernel="gluon",
    )  # fmt: skip
    rows_e, kv_e = _each_occurrence(rows.cpu(), kv)
    ref_o, ref_l = sparse_mla_reference(q, kv_e, rows_e.cuda(), scale=SCALE, topk_length=length, sinks=sinks)
    _check(out, lse, ref_o, ref_l)
    tri_o, tri_l = sparse_mla_decode(
        q, kv, rows, scale=SCALE, topk_length=length, sinks=sinks, rows_unique=True, backend="triton"
    )
    assert ((out.float() - tri_o.float()).norm() / tri_o.float().norm()).item() < 1e-2
    assert torch.equal(torch.isneginf(lse), torch.isneginf(tri_l))


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("tokens", [1, 64])
def test_gluon_decode_graph_capture_replays_bitwise(tokens):
    q, kv, rows, length, sinks = _gpu_case(tokens, 128, seed=11)
    s_q, s_rows, s_len = q.clone(), rows.clone(), length.clone()
    out = torch.empty(tokens, 128, 512, dtype=q.dtype, device="cuda")
    lse = torch.empty(tokens, 128, device="cuda")

    backend = "gluon" if tokens == 1 else None  # one token: forced (routed to Triton); 64: routed to Gluon
    assert tokens == 1 or sparse_decode_kernel(q, kv, 512)[0] == "gluon"

    def step():
        sparse_mla_decode(
            s_q, kv, s_rows, scale=SCALE, topk_length=s_len, sinks=sinks, out=out, lse_out=lse, backend=backend
        )

    graph = DecodeGraph(step, {})  # warmed up on a side stream, then captured
    for seed in (21, 22):  # new inputs copied into the static buffers, outputs poisoned
        q2, _, rows2, len2, _ = _gpu_case(tokens, 128, seed=seed)
        s_q.copy_(q2), s_rows.copy_(rows2), s_len.copy_(len2)
        out.fill_(float("nan")), lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        got_o, got_l = out.clone(), lse.clone()
        eager_o, eager_l = sparse_mla_decode(q2, kv, rows2, scale=SCALE, topk_length=len2, sinks=sinks, backend=backend)
        assert torch.equal(got_o, eager_o) and torch.equal(got_l, eager_l)
        ref_o, ref_l = sparse_mla_reference(q2, kv, rows2, scale=SCALE, topk_length=len2, sinks=sinks)
        _check(got_o, got_l, ref_o, ref_l)
    assert math.isfinite(float(lse[tokens - 1, 0]))


# ---- decode warm-up: every variant the size-dependent routing can reach (CPU, calls recorded) ----


@pytest.mark.parametrize("routed", ["gluon", "gluon_stream", "triton"])
def test_decode_warmup_runs_triton_at_every_size_and_both_gluon_variants(monkeypatch, routed):
    import shardattn.runtime.decode_warmup as dw
    from shardattn.plan.spec import get_preset

    calls = []

    def record(q, kv, rows, **kw):
        calls.append((q.shape[0], kw.get("backend"), kw.get("num_splits"), kw.get("rows_unique", False)))

    def record_run(q, kv, rows, *, kernel, config=None, **kw):
        record(q, kv, rows, backend=kernel, **kw)
        if kernel == "gluon":
            grids.append((kw["num_splits"], kw["rows_unique"], config))

    grids = []

    monkeypatch.setattr(dw, "sparse_mla_decode", record)
    monkeypatch.setattr(dw, "run_sparse_mla_decode", record_run)
    monkeypatch.setattr(dw, "sparse_decode_kernel", lambda q, kv, v_dim, rows=None: (routed, "test"))
    monkeypatch.setattr(dw, "convert_topk", lambda pos, *a, **k: (pos, None))
    monkeypatch.setattr(dw, "compiles_kernels", lambda device: True)  # as on a GPU, with CPU tensors
    spec = get_preset("glm5")
    dw.warm_up_decode(
        spec, device=torch.device("cpu"), dtype=torch.bfloat16, heads=64, kv_heads=1, topk=64, max_decode_tokens=40,
        scale=0.1, dcp=None, need_lse=True, gqa_backend="triton",
    )  # fmt: skip
    for t, unique in itertools.product((1, 2, 40), (False, True)):  # topk_unique: raw rows, their own variants
        assert (t, None, None, unique) in calls and (t, "triton", None, unique) in calls
    merges = {(1, "triton", s, u) for s in dw.COLUMN_MERGE_WARMUP_SPLITS for u in (False, True)}
    assert merges <= set(calls)  # every column merge, on a union and on raw rows
    for kernel in ("gluon", "gluon_stream"):
        ran = {c for c in calls if c[1] == kernel}
        # unsplit and sliced, on a union and on unique rows (gluon unsplit: read in place, the raw-row
        # kernel variant): written to out, and to partials with the merge at every power of 2 of the
        # slices a smaller batch's plan may take
        slices = (1, *dw.COLUMN_MERGE_WARMUP_SPLITS)
        want = {(40, kernel, s, u) for s in slices for u in (False, True)}
        assert ran == (want if routed == kernel else set())
    # the Gluon kernel on both grids (which one a batch's plan takes depends on the batch); on
    # fp8_ds_mla rows the plan takes one tile a program only
    both = {(s, u, p) for s in slices for u in (False, True) for p in (False, True)}
    assert {(s, u, cfg["persistent"]) for s, u, cfg in grids} == (both if routed == "gluon" else set())
    assert dw._grids("gluon", kv_fp8=True) == ({"persistent": False},) and dw._grids("triton", False) == (None,)


@pytest.mark.parametrize("dcp", [None, (2, 1, 1)])
def test_decode_warmup_converts_and_deduplicates_as_the_steps_do(monkeypatch, dcp):
    """A step packs the converted rows only with ``topk_unique`` (their count then the kernel's
    ``topk_length``); without it the rows stay unpacked and no ``topk_length`` reaches the decode,
    so the de-duplication (the union or the hash) runs without one: the warm-up takes each form."""
    import shardattn.runtime.decode_warmup as dw
    from shardattn.ops.topk import DcpShard
    from shardattn.plan.spec import get_preset

    converts, decodes, hashes = set(), set(), set()
    convert_topk = dw.convert_topk

    def convert(pos, *args, topk_length=None, packed=False, **kw):
        converts.add((topk_length is not None, packed))
        return convert_topk(pos, *args, topk_length=topk_length, packed=packed, **kw)

    def decode(q, kv, rows, *, topk_length=None, rows_unique=False, **kw):
        decodes.add((rows_unique, topk_length is not None))

    monkeypatch.setattr(dw, "convert_topk", convert)
    monkeypatch.setattr(dw, "sparse_mla_decode", decode)
    monkeypatch.setattr(dw, "run_sparse_mla_decode", decode)
    monkeypatch.setattr(
        dw,
        "unique_rows",
        lambda rows, *, num_kv_rows, topk_length=None, pdl=False: hashes.add((topk_length, pdl)) or rows,
    )
    monkeypatch.setattr(dw, "sparse_decode_kernel", lambda q, kv, v_dim, rows=None: ("triton", "test"))
    monkeypatch.setattr(dw, "compiles_kernels", lambda device: True)  # as on a GPU, with CPU tensors
    caches = set()
    monkeypatch.setattr(dw, "decode_rows", lambda rows, *, num_kv_rows, topk_length=None: caches.add(num_kv_rows))
    dw.warm_up_decode(
        get_preset("glm5"), device=torch.device("cpu"), dtype=torch.bfloat16, heads=16, kv_heads=1, topk=64,
        max_decode_tokens=4, scale=0.1, dcp=None if dcp is None else DcpShard(*dcp), need_lse=True,
        gqa_backend="triton",
    )  # fmt: skip
    assert converts == {(length, packed) for length in (False, True) for packed in (False, True)}
    # raw rows: no topk_length; unique rows: their count; the hash's rows (a large cache's de-duplication
    # at any batch) handed on as unique with no topk_length
    assert decodes == {(False, False), (True, True), (True, False)}
    assert hashes == {(None, False), (None, True)}  # the hash ahead of plain and of PDL launches
    # the bitmap union's variant for each window past the first (a cache of more rows)
    from shardattn.kernels.gluon.union_smem import WINDOWS

    assert caches == {32 * w for w in WINDOWS[1:]}


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(
    ("heads", "tokens", "with_len", "with_sinks"),
    [(128, 64, True, True), (128, 130, False, False), (64, 200, True, False), (32, 64, False, True)],
)
def test_one_slice_reads_rows_in_place_like_the_packed_path(heads, tokens, with_len, with_sinks):
    """``rows_unique=True``, one slice: the 64-key kernel reads the rows in place (no packing
    launch) and masks each entry: invalid rows anywhere, out of range, a pair whose first block (or
    both blocks) hold no key, an empty row, ``topk_length`` 0 / 33 / none, duplicates counted twice;
    the doubled-key reference's result, on NaN-poisoned outputs."""
    q, kv, rows, length, sinks = _gpu_case(tokens, heads, seed=11 * heads + tokens)
    r = kv.shape[0]
    rows[0, 1000:1100] = rows[0, 0:100]  # duplicates: two keys each
    rows[2, :64] = -1  # block 0 of the first pair holds no key, block 1 does
    rows[3, :64] = r + 5
    rows[3, 64:128] = -1  # the whole first pair holds no key
    rows[4, 128:192] = -1  # block 0 of the second pair holds no key
    length = length if with_len else None
    sinks = sinks if with_sinks else None
    assert reads_raw_rows(rows, length)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.full((tokens, heads, 512), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((tokens, heads), float("nan"), device=q.device)
    sparse_mla_decode_gluon(
        q, kv, rows, scale=SCALE, v_dim=512, out=out, lse_out=lse, num_sms=sms, topk_length=length,
        sinks=sinks, num_splits=1, rows_unique=True,
    )  # fmt: skip
    rows_e, kv_e = _each_occurrence(rows.cpu(), kv)
    ref_o, ref_l = sparse_mla_reference(q, kv_e, rows_e.cuda(), scale=SCALE, topk_length=length, sinks=sinks)
    _check(out, lse, ref_o, ref_l)
    assert (out[tokens // 2] == 0).all()  # the empty row


@pytest.mark.parametrize("kind", ["sparse_mla", "gqa"])
@pytest.mark.parametrize(("has_sinks", "dcp", "want"), [
    (False, None, {False}), (True, None, {True}), (True, (2, 1, 0), {True}), (True, (2, 1, 1), {False}),
])  # fmt: skip
def test_decode_warmup_runs_the_sinks_the_steps_pass(monkeypatch, kind, has_sinks, dcp, want):
    """A step with sinks always passes them (the Runtime refuses a call without), except that a DCP
    rank other than 0 counts no sink term: the warm-up compiles those variants and no other."""
    import dataclasses

    import shardattn.runtime.decode_warmup as dw
    from shardattn.ops.topk import DcpShard
    from shardattn.plan.spec import get_preset

    seen = set()

    def kernel(*args, sinks=None, **kw):
        seen.add(sinks is not None)

    for name in ("sparse_mla_decode", "run_sparse_mla_decode", "gqa_paged_decode"):
        monkeypatch.setattr(dw, name, kernel)
    monkeypatch.setattr(dw, "sparse_decode_kernel", lambda q, kv, v_dim, rows=None: ("triton", "test"))
    spec = dataclasses.replace(get_preset("glm5" if kind == "sparse_mla" else "gqa-64-8"), has_sinks=has_sinks)
    dw.warm_up_decode(
        spec, device=torch.device("cpu"), dtype=torch.float32, heads=8, kv_heads=spec.num_kv_heads, topk=32,
        max_decode_tokens=4, scale=0.1, dcp=None if dcp is None else DcpShard(*dcp), need_lse=True,
        gqa_backend="reference",
    )  # fmt: skip
    assert seen == want
