"""Sparse-MLA kernels reading ``fp8_ds_mla`` KV rows on an sm_90 GPU (``gpu``): every kernel at DSA
shapes and bf16, bitwise against itself on the dequantised rows (prefill: in the kernel and staged in
both layouts, :mod:`shardattn.ops.kv_fp8_stage`), every e4m3 code at extreme scales, and against the
fp64 oracle. The CPU side (layout, decoder, interpreter, sm_90 compiles, the ops' reference) is
tests/test_sparse_mla_fp8.py.
"""

from __future__ import annotations

import pytest
import torch

from shardattn.kernels.gluon.sparse_mla import gluon_unavailable_reason
from shardattn.kernels.gluon.sparse_mla_decode import gluon_decode_plan
from shardattn.ops.kv_fp8 import dequantize_kv, quantize_kv
from shardattn.ops.sparse_mla import sparse_mla_attention
from shardattn.ops.sparse_mla_decode import run_sparse_mla_decode, sparse_mla_decode
from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill
from tests.fp8_oracle import fp8_rows_decode
from tests.oracle import sparse_mla_oracle
from tests.test_sparse_mla_fp8 import OPS


def _sm90() -> bool:
    return (
        torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and gluon_unavailable_reason() is None
    )


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU and Triton's Gluon")


def _gpu_case(tokens: int, heads: int, k: int, seed: int, r: int = 61_440):
    """bf16 queries, a DSA-like fp8_ds_mla cache of ``r`` rows, unique rows per token (an indexer's
    top-k) with invalid entries anywhere, an empty row, ``topk_length`` (one 0, one short), sinks."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(r, 576, device=dev, generator=g) * torch.exp2(torch.randint(-4, 4, (r, 1), device=dev, generator=g))
    cache = quantize_kv(x)
    rows = torch.argsort(torch.rand(tokens, r, device=dev, generator=g), dim=1)[:, :k].int()
    rows[torch.rand(rows.shape, device=dev, generator=g) < 0.05] = -1
    rows[:, -3:] = r + 7
    length = torch.full((tokens,), k, dtype=torch.int32, device=dev)
    if tokens > 2:
        rows[tokens // 2] = -1
        length[0], length[-1] = 0, 33
    q = (torch.randn(tokens, heads, 576, device=dev, generator=g) * 0.3).bfloat16()
    sinks = torch.randn(heads, device=dev, generator=g)
    return q, cache, rows, length, sinks


def _same(a: tuple, b: tuple, exact: bool = True, oracle: tuple | None = None) -> None:
    """FP8 run ``a`` against the bf16 run ``b`` on the dequantised rows: bit for bit (Gluon kernels:
    the FP8 path differs from the bf16 one only in its loads), or, for Triton kernels (Triton
    schedules the FP8 path's fp32 arithmetic in another order, so a rounding of P may flip), as
    close to the fp64 ``oracle`` (output, LSE) as the bf16 run."""
    assert torch.isfinite(a[0]).all() and not a[1].isnan().any()
    if exact:
        assert torch.equal(a[0], b[0]), float((a[0].float() - b[0].float()).abs().max())
        assert torch.equal(a[1], b[1])
        return
    for got, ref, want in zip(a, b, oracle, strict=True):  # output, then LSE
        fin = torch.isfinite(want)
        e_got = float((got.cpu().double() - want)[fin].abs().max())
        e_ref = float((ref.cpu().double() - want)[fin].abs().max())
        assert e_got <= 1.5 * e_ref + 1e-5, (e_got, e_ref)


def _oracle(q, deq, rows, kw) -> tuple:
    """fp64 output and LSE over the dequantised rows (``kw``: the call's topk_length / sinks)."""
    extra = {n: t.cpu() for n, t in kw.items()}
    return sparse_mla_oracle(q.cpu(), deq.cpu().double(), rows.cpu(), scale=0.06, v_dim=512, **extra)


def _small_at_fp8_tiles(q, kv, rows, topk_length=None, sinks=None) -> tuple:
    """The small-batch kernel on bf16 / fp16 rows ``kv`` with the tiles and head groups it takes on
    ``fp8_ds_mla`` rows (:func:`~shardattn.plan.decode_routing.small_decode_tiles`), and its merge."""
    from shardattn.kernels.gluon.sparse_mla_decode_small import launch_small_split, launch_split_and_merge
    from shardattn.plan.decode_routing import small_decode_heads, small_decode_tiles

    t, h, _ = q.shape
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    block_n, splits = small_decode_tiles(t, rows.shape[1], sms, kv_fp8=True)
    group = small_decode_heads(t, splits, h, sms)
    out = torch.empty(t, h, 512, dtype=q.dtype, device=q.device)
    lse = torch.empty(t, h, device=q.device)

    def launch(dst_out: torch.Tensor, dst_lse: torch.Tensor) -> None:
        launch_small_split(q, kv, rows, topk_length, sinks, dst_out, dst_lse, block_n, splits, 0.06, False,
                           heads_per_program=group)  # fmt: skip

    launch_split_and_merge(launch, splits, out, lse, None, False)
    return out, lse


def _gluon_at_fp8_slices(q, kv, rows, **kw) -> tuple:
    """The Gluon decode on bf16 / fp16 rows ``kv`` cut into the slices it takes on ``fp8_ds_mla``
    rows (:func:`~shardattn.kernels.gluon.sparse_mla_decode.gluon_decode_plan` prices an FP8 key
    higher, so it may cut them finer), with its merge."""
    t, h, _ = q.shape
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    splits = gluon_decode_plan(t, h, rows.shape[1], sms, kv_fp8=True)["num_splits"]
    return run_sparse_mla_decode(q, kv, rows, scale=0.06, rows_unique=True, kernel="gluon", num_splits=splits, **kw)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(
    ("backend", "tokens", "heads", "k"),
    [
        ("gluon_small", 1, 16, 2048), ("gluon_small", 4, 16, 2048), ("gluon_small", 3, 16, 2048),
        ("gluon_small", 8, 8, 1000), ("gluon_small", 2, 12, 2048), ("gluon_small", 5, 16, 64),
        ("triton", 1, 16, 2048), ("triton", 64, 16, 2048), ("triton", 8, 32, 2048), ("triton", 8, 128, 2048),
        ("gluon", 64, 64, 2048), ("gluon", 16, 128, 2048), ("gluon", 200, 128, 2048), ("gluon", 3, 128, 300),
        ("gluon", 16, 128, 512),  # FP8 rows: 4 slices, bf16: 2
    ],
)  # fmt: skip
def test_fp8_decode_equals_bf16_decode_on_dequantised_rows(backend, tokens, heads, k):
    q, cache, rows, length, sinks = _gpu_case(tokens, heads, k, seed=tokens * 7 + heads + k)
    deq = dequantize_kv(cache)

    def bf16(**kw):  # the bf16 kernel at the FP8 launch's configuration (Triton: 8 warps, the same splits;
        # the small-batch kernel: the FP8 rows' tiles, which take 64-entry splits at more tokens; Gluon:
        # the FP8 rows' slices)
        if backend == "gluon_small":
            return _small_at_fp8_tiles(q, deq, rows, **kw)
        if backend == "gluon":
            return _gluon_at_fp8_slices(q, deq, rows, **kw)
        return run_sparse_mla_decode(q, deq, rows, scale=0.06, rows_unique=True, config={"num_warps": 8}, **kw)

    for kw in ({}, {"topk_length": length, "sinks": sinks}):
        fp8 = sparse_mla_decode(q, cache, rows, scale=0.06, backend=backend, rows_unique=True, **kw)
        exact = backend != "triton"
        _same(fp8, bf16(**kw), exact, None if exact else _oracle(q, deq, rows, kw))
    paged = sparse_mla_decode(q, cache.view(-1, 64, 656), rows,
                              scale=0.06, backend=backend, rows_unique=True)  # fmt: skip
    _same(paged, bf16(), backend != "triton", None if backend != "triton" else _oracle(q, deq, rows, {}))


def _every_code_cache(r: int, seed: int) -> torch.Tensor:
    """``[r, 656]`` fp8_ds_mla rows whose codes are drawn from every finite e4m3 code (both zeros and
    signs, the subnormals, 448), under scales 2^-30 ... 2^20, with random bf16 rope values."""
    g = torch.Generator().manual_seed(seed)
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    codes = finite[torch.randint(0, len(finite), (r, 512), generator=g)]
    codes[:2, :254] = finite  # each code at least once in every tile position class
    scales = torch.exp2(torch.randint(-30, 21, (r, 4), generator=g).float())
    rope = torch.randn(r, 64, generator=g).bfloat16()
    return torch.cat([codes, scales.view(torch.uint8), rope.view(torch.uint8)], dim=1).cuda()


def _staging(monkeypatch, staging: str) -> list[bool]:
    """Prefill FP8 rows staged in the ``"mirror"`` or ``"packed"`` layout whatever the rule says (each
    call's staging recorded in the returned list), ``"packed_early"`` (packed, the touched blocks
    counted from the top-k rows and the union built over the rows moved into them, as on a cache
    past the mirror's rows; a prepared union is staged packed at the call), or ``"in_kernel"``
    (staging declined: every tile dequantises its rows)."""
    from shardattn.ops import kv_fp8_stage, prepared_union

    staged: list[bool] = []
    real, real_touched = kv_fp8_stage.stage_fp8_union, kv_fp8_stage.stage_touched
    layout = "packed" if staging == "packed_early" else staging

    def spy(*args, **kwargs):
        result = None if staging == "in_kernel" else real(*args, **{**kwargs, "layout": layout})
        staged.append(result is not None)
        return result

    def touched_spy(*args, **kwargs):
        result = real_touched(*args, **{**kwargs, "min_reuse": 0})
        staged.append(result is not None)
        return result

    monkeypatch.setattr(kv_fp8_stage, "stage_fp8_union", spy)
    if staging == "packed_early":
        monkeypatch.setattr(prepared_union, "stages_packed", lambda kv, entries: kv.dtype == torch.uint8)
        monkeypatch.setattr(prepared_union, "stage_touched", touched_spy)
    return staged


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(
    ("op", "tokens", "heads"),
    [("decode", 64, 64), ("decode", 16, 128), ("prefill", 100, 128), ("prefill_staged", 200, 128)],
)
def test_gluon_fp8_reads_every_code_at_extreme_scales(monkeypatch, op, tokens, heads):
    """The warp-specialised Gluon kernel's FP8 dequantisation (and the staging kernel's) equals the
    bf16 path on the dequantised rows bit for bit on every finite e4m3 code, subnormals included,
    under scales far from 1."""
    r = 4096
    cache = _every_code_cache(r, seed=tokens + heads)
    deq = dequantize_kv(cache)
    g = torch.Generator(device="cuda").manual_seed(heads)
    drawn = 2 + torch.argsort(torch.rand(tokens, r - 2, device="cuda", generator=g), dim=1)[:, :510]
    every = torch.tensor([[0, 1]], device="cuda").expand(tokens, 2)  # the rows holding every code
    rows = torch.cat([every, drawn], dim=1).int()
    q = (torch.randn(tokens, heads, 576, device="cuda", generator=g) * 1e-6).bfloat16()
    if op == "decode":
        fp8 = sparse_mla_decode(q, cache, rows, scale=0.06, backend="gluon", rows_unique=True)
        ref = _gluon_at_fp8_slices(q, deq, rows)
    else:
        staged = _staging(monkeypatch, "packed" if op == "prefill_staged" else "in_kernel")
        fp8, ref = (sparse_mla_attention(q, kv, rows, scale=0.06) for kv in (cache, deq))
        assert staged == [op == "prefill_staged"]
    _same(fp8, ref, True)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(
    ("path", "tokens", "heads", "group", "gluon"),  # gluon: the kernel that runs is a Gluon one (bit for bit)
    [("routed", 300, 128, 1, True), ("routed", 300, 64, 1, True), ("routed", 200, 16, 1, False),
     ("triton", 100, 128, 1, False), ("grouped", 257, 32, 2, True), ("grouped", 257, 16, 4, True),
     ("grouped", 257, 8, 8, True), ("grouped", 100, 8, 1, False)],
)  # fmt: skip
@pytest.mark.parametrize("staging", ["in_kernel", "mirror", "packed", "packed_early"])
def test_fp8_prefill_equals_bf16_prefill_on_dequantised_rows(monkeypatch, path, tokens, heads, group, gluon, staging):
    """Staged (either layout), every path runs the bf16 kernel on the staged rows: bit for bit the bf16 run."""
    from shardattn.ops.sparse_mla import sparse_mla_per_query

    staged = _staging(monkeypatch, staging)
    q, cache, rows, length, sinks = _gpu_case(tokens, heads, 2048, seed=tokens + heads * 3 + group)
    rows[5, 100:200] = rows[5, :100]  # listed twice: one key
    deq = dequantize_kv(cache)
    for kw in ({}, {"topk_length": length, "sinks": sinks}):
        if path == "routed":
            fp8, ref = (sparse_mla_attention(q, kv, rows, scale=0.06, **kw) for kv in (cache, deq))
        elif path == "triton":
            fp8, ref = (sparse_mla_per_query(q, kv, rows, scale=0.06, kernel="triton", **kw) for kv in (cache, deq))
        else:
            fp8, ref = (
                sparse_mla_grouped_prefill(q, kv, rows, scale=0.06, group_size=group, **kw) for kv in (cache, deq)
            )
        exact = gluon or staging != "in_kernel"
        _same(fp8, ref, exact, None if exact else _oracle(q, deq, rows, kw))
    assert staged == [staging != "in_kernel"] * 2  # one FP8 call per argument set


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(("op", "heads"), [("attention", 128), ("attention", 16), ("decode", 16), ("decode", 128)])
def test_fp8_kernels_match_the_oracle_on_the_decoded_rows(op, heads):
    q, cache, rows, length, sinks = _gpu_case(4, heads, 256, seed=heads)
    out, lse = OPS[op](q, cache, rows, scale=0.06, topk_length=length, sinks=sinks)
    kv64 = torch.from_numpy(fp8_rows_decode(cache.cpu().numpy()))
    want_o, want_l = sparse_mla_oracle(q.cpu(), kv64, rows.cpu(), scale=0.06, v_dim=512, topk_length=length.cpu(),
                                       sinks=sinks.cpu())  # fmt: skip
    err = float((out.cpu().double() - want_o).norm() / want_o.norm())
    assert err < 1e-2, err
    fin = torch.isfinite(want_l)
    assert float((lse.cpu().double()[fin] - want_l[fin]).abs().max()) < 1e-2
