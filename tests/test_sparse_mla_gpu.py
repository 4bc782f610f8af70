"""GPU checks of the sparse-prefill Triton kernels at real shapes (D = 576, Dv = 512, bf16, K = 2048).

Outputs are NaN-poisoned before each run so unwritten rows fail; errors are measured against the
fp32 reference on sampled tokens (bf16 bound: relative error below 1e-2).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

pytestmark = pytest.mark.gpu

D_V, D_R, K = 512, 64, 2048


def _setup(heads: int, tokens: int, kv_rows: int, seed: int = 0):
    from shardattn.ops.topk import convert_topk
    from shardattn.workload import synthetic_topk

    dev = torch.device("cuda")
    pos = synthetic_topk(tokens, K, start_position=kv_rows - tokens, overlap="dsa", seed=seed, device=dev)
    table = torch.randperm(kv_rows // 64, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    req = torch.zeros(tokens, dtype=torch.int32, device=dev)
    lens = torch.tensor([kv_rows], dtype=torch.int32, device=dev)
    rows, _ = convert_topk(pos, req, table[None, :].to(dev), block_size=64, seq_lens=lens)  # as the runtime calls it
    rows[3] = -1  # an empty row
    rows[4, :512] = rows[4, 512:1024]  # duplicates
    gen = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(tokens, heads, D_V + D_R, device=dev, generator=gen).to(torch.bfloat16)
    kv = torch.randn(kv_rows, D_V + D_R, device=dev, generator=gen).to(torch.bfloat16)
    return q, kv, rows


@pytest.mark.parametrize("group_size", [None, 1], ids=["grouped", "per_query"])
@pytest.mark.parametrize("heads", [8, 16, 32, 64, 128], ids=lambda h: f"h{h}")
def test_prefill_matches_reference_at_real_shape(heads, group_size):
    from shardattn.kernels.triton.sparse_mla import launch_attention, tile_config
    from shardattn.ops.dispatch import prefill_path
    from shardattn.ops.sparse_mla import sparse_mla_reference
    from shardattn.ops.union import build_union

    q, kv, rows = _setup(heads, 4093, 65536)  # odd token count: a tail group
    scale = (D_V + D_R) ** -0.5
    path = prefill_path(q, kv, v_dim=D_V, group_size=group_size)
    assert path.backend in ("triton", "gluon"), path.reason
    # the Triton kernel at the routed G, also where sm_90 routes to Gluon (tested in test_sparse_mla_gluon.py)
    tile = path.tile or tile_config(heads, path.group_size)
    union, lens = build_union(rows, group_size=path.group_size, num_kv_rows=kv.shape[0])
    out = torch.full((q.shape[0], heads, D_V), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[0], heads), float("nan"), device=q.device)
    launch_attention(q, kv, union, lens, scale=scale, v_dim=D_V, config=tile, out=out, lse=lse)
    assert torch.isfinite(out).all() and not lse.isnan().any()
    assert (out[3] == 0).all() and lse[3].isneginf().all()
    sample = torch.tensor([0, 3, 4, 1000, 2047, 4092], device=q.device)
    ref_o, ref_lse = sparse_mla_reference(q[sample], kv, rows[sample], scale=scale, v_dim=D_V)
    err = ((out[sample].float() - ref_o.float()).norm() / ref_o.float().norm()).item()
    assert err < 1e-2, err
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse[sample]))
    assert (lse[sample][fin] - ref_lse[fin]).abs().max().item() < 2e-2


def test_public_entry_points_dispatch_to_triton():
    from shardattn.ops.sparse_mla import sparse_mla_attention, sparse_mla_reference
    from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill

    q, kv, rows = _setup(16, 257, 65536, seed=1)
    sinks = torch.randn(16, device=q.device)
    scale = (D_V + D_R) ** -0.5
    ref_o, ref_lse = sparse_mla_reference(q, kv, rows, scale=scale, v_dim=D_V, sinks=sinks)
    for fn in (sparse_mla_attention, sparse_mla_grouped_prefill):
        out, lse = fn(q, kv, rows, scale=scale, v_dim=D_V, sinks=sinks)
        err = ((out.float() - ref_o.float()).norm() / ref_o.float().norm()).item()
        assert err < 1e-2, (fn.__name__, err)
        assert (lse - ref_lse).abs().max().item() < 2e-2


@pytest.mark.parametrize("heads", [16, 128], ids=lambda h: f"h{h}")  # grouped (G = 4) and per-query
def test_warmup_covers_fp8_prefill_staged_and_in_the_kernel(heads):
    """After the warm-up of an FP8 spec, prefill on ``fp8_ds_mla`` rows compiles nothing: staged
    (a request's rows: each block read by many queries; a small cache mirrored, a large one packed)
    nor dequantised in the kernel (rows drawn over the whole large cache)."""
    from shardattn.kernels.gluon.sparse_mla import gluon_available
    from shardattn.kernels.triton.kv_fp8_stage import stage_kernels
    from shardattn.kernels.triton.sparse_mla import attention_kernel
    from shardattn.kernels.triton.union import union_kernels
    from shardattn.ops import kv_fp8_stage, prepared_union
    from shardattn.ops.kv_fp8 import quantize_kv
    from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill
    from shardattn.runtime.warmup import PrefillSpec, compiled_variants, warmup

    dev = torch.device("cuda")
    warmup(dev, PrefillSpec(heads=heads, topk=K, kv_fp8=True))
    kernels = (attention_kernel(), *union_kernels(), *stage_kernels())
    if gluon_available():
        from shardattn.kernels.gluon.sparse_mla_kernel import ws64_kernel

        kernels = (*kernels, ws64_kernel())
    before = [compiled_variants(k) for k in kernels]
    staged = []

    def spy(real):
        def staging(*args, **kwargs):
            result = real(*args, **kwargs)
            staged.append(result is not None)
            return result

        return staging

    with (  # the mirror layout stages on the union; the packed one counts first and builds on the staged rows
        mock.patch.object(kv_fp8_stage, "stage_fp8_union", spy(kv_fp8_stage.stage_fp8_union)),
        mock.patch.object(prepared_union, "stage_touched", spy(kv_fp8_stage.stage_touched)),
    ):
        for tokens, kv_rows, spread in ((1024, 65536, False), (1024, 1 << 20, False), (333, 1 << 20, True)):
            q, kv, rows = _setup(heads, tokens, 65536, seed=tokens)
            if kv_rows > kv.shape[0]:  # a cache of 2**20 rows (beyond the mirror's): the request's rows in it
                kv = torch.cat([kv, torch.randn(kv_rows - kv.shape[0], D_V + D_R, device=dev).to(torch.bfloat16)])
            if spread:  # rows anywhere in it: staging does not pay
                rows = torch.randint(-1, kv_rows, rows.shape, dtype=torch.int32, device=dev)
            sparse_mla_grouped_prefill(q, quantize_kv(kv), rows, scale=0.04, v_dim=D_V)
    torch.cuda.synchronize()
    assert staged == [True, True, False]  # mirrored, packed, in the kernel
    assert [compiled_variants(k) for k in kernels] == before


@pytest.mark.parametrize("heads", [8, 128], ids=lambda h: f"h{h}")  # grouped (G = 8, merge union) and per-query
def test_warmup_covers_runtime_keys(heads):
    from shardattn.kernels.triton.sparse_mla import attention_kernel
    from shardattn.kernels.triton.topk import convert_topk_kernel
    from shardattn.kernels.triton.union import union_kernels
    from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill
    from shardattn.ops.topk import convert_topk
    from shardattn.runtime.warmup import PrefillSpec, compiled_variants, warmup

    dev = torch.device("cuda")
    warmup(dev, PrefillSpec(heads=heads, topk=K))
    kernels = (attention_kernel(), *union_kernels(), convert_topk_kernel())
    from shardattn.kernels.gluon.sparse_mla import gluon_available

    if gluon_available():  # the routed Gluon kernel (per-query and grouped) too
        from shardattn.kernels.gluon.sparse_mla_kernel import ws64_kernel

        kernels = (*kernels, ws64_kernel())
    before = [compiled_variants(k) for k in kernels]
    for tokens, kv_rows, group_size in ((4096, 65536, None), (4097, 70000, None), (333, 65536, 1)):
        q, kv, _ = _setup(heads, tokens, kv_rows, seed=tokens)
        pos = torch.randint(-1, kv_rows, (tokens, K), dtype=torch.int32, device=dev)
        rows, _ = convert_topk(
            pos, torch.zeros(tokens, dtype=torch.int32, device=dev),
            torch.arange(kv_rows // 16, dtype=torch.int32, device=dev)[None, :], block_size=16,
            seq_lens=torch.tensor([kv_rows], dtype=torch.int32, device=dev),
        )  # fmt: skip
        sparse_mla_grouped_prefill(q, kv, rows, scale=0.04, v_dim=D_V, group_size=group_size)
    torch.cuda.synchronize()
    assert [compiled_variants(k) for k in kernels] == before
