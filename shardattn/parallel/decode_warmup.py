"""Decode warm-up of a Runtime: its decode kernels launched once on tiny inputs, the way its steps call them.

Kept apart from :mod:`shardattn.parallel.runtime` so that module holds the step logic; the
prefill side uses the kernels' own key list (:func:`shardattn.kernels.warmup.compile_keys`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shardattn.kernels.gqa_decode import gqa_paged_decode
from shardattn.kernels.sparse_mla_decode import sparse_mla_decode
from shardattn.kernels.topk import DcpShard, convert_topk

if TYPE_CHECKING:
    from shardattn.parallel.runtime import Runtime

#: Decode route path -> ``backend`` argument of the GQA decode kernel.
GQA_BACKEND = {"triton": "triton", "flashinfer-xqa": "flashinfer", "reference": "reference"}


def warm_up_decode(rt: Runtime) -> int:
    """Run ``rt``'s decode kernels locally (no collective) on tiny inputs, the way its steps call them.

    Covers: top-k conversion with this mode's flags (DCP shard or not, with and without
    ``topk_length``), the decode kernel at 1, 2 and ``max_decode_tokens`` query tokens (unsplit
    and split-KV, so the LSE merge too), with and without sinks where a step may pass them
    (under DCP only rank 0 does), and for GQA head-TP uniform and ragged drafts. The decode
    kernels publish no compile-key list (unlike prefill), so this mirrors their call sites.
    """
    gen = torch.Generator(device="cpu").manual_seed(0)
    dcp = rt.decode_is_dcp
    d, page = rt.spec.head_dim, rt.spec.page_size
    h = rt.spec.num_heads if dcp else rt.heads_per_rank
    on_gpu = rt.device.type == "cuda"
    sizes = sorted({1, 2, rt.max_decode_tokens}) if on_gpu else [2]  # nothing compiles on the CPU
    dev, dt = rt.device, rt.dtype
    launches = 0

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dev, dt)

    if rt.spec.kind == "sparse_mla":
        kv = randn(4 * page, d)
        table = torch.arange(4, dtype=torch.int32, device=dev)[None, :]
        seq = torch.tensor([4 * page], dtype=torch.int32, device=dev)
        shard = DcpShard(rt.world_size, rt.layout.interleave, rt.rank) if dcp else None
        sink_options = (None, torch.zeros(h, device=dev)) if rt.spec.has_sinks else (None,)
        for t in sizes:
            q = randn(t, h, d)
            pos = torch.randint(-1, 4 * page, (t, rt.topk), generator=gen, dtype=torch.int32).to(dev)
            req = torch.zeros(t, dtype=torch.int32, device=dev)
            for length in (None, torch.full((t,), max(1, rt.topk // 2), dtype=torch.int32, device=dev)):
                rows, _ = convert_topk(pos, req, table, block_size=page, seq_lens=seq, topk_length=length, dcp=shard)
                launches += 1
            for sinks in sink_options:
                sparse_mla_decode(q, kv, rows, scale=rt.scale, v_dim=rt.spec.v_dim, sinks=sinks)
                launches += 1
        return launches
    hkv = rt.spec.num_kv_heads if dcp else max(1, rt.spec.num_kv_heads // rt.world_size)
    k = randn(2, page, hkv, d)
    lse = rt.decode_lse or dcp
    backend = GQA_BACKEND[rt.decode_route.path]
    sink_options = (None, torch.zeros(h, device=dev)) if rt.spec.has_sinks else (None,)
    for t in sizes:
        table = torch.zeros(t, 1, dtype=torch.int32, device=dev)
        lens = torch.full((t,), min(page, 3), dtype=torch.int32, device=dev)
        for sinks in sink_options:
            q = randn(t, h, d)
            gqa_paged_decode(q, k, k, table, lens, q_len_per_req=1, sinks=sinks, return_lse=lse, backend=backend)
            launches += 1
            if not dcp and t > 1:  # head-TP drafts: uniform pairs and a ragged batch
                pairs = torch.zeros(t // 2, 1, dtype=torch.int32, device=dev)
                qq = randn(t // 2 * 2, h, d)
                gqa_paged_decode(
                    qq, k, k, pairs, lens[: t // 2], q_len_per_req=2, sinks=sinks, return_lse=lse, backend=backend
                )
                cu = torch.arange(t // 2 + 1, dtype=torch.int32, device=dev) * 2
                gqa_paged_decode(
                    qq,
                    k,
                    k,
                    pairs,
                    lens[: t // 2],
                    cu_q_lens=cu,
                    max_q_len=2,
                    sinks=sinks,
                    return_lse=lse,
                    backend=backend,
                )
                launches += 2
    return launches
