"""GQA speculative decode (64 query / 8 KV heads, head dim 64, attention sinks) under DCP on 2 ranks.

Three requests verify ragged drafts of 1, 3 and 2 tokens in one step; every draft token sees
the cache plus the drafts before it (causal). The KV cache is split over the ranks by the DCP
layout; the outputs match one process running the whole cache.

    python examples/gqa_spec_decode.py                       # spawns 2 CPU ranks (gloo)
    torchrun --nproc-per-node 2 examples/gqa_spec_decode.py  # one rank per GPU when there are GPUs
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from shardattn import Runtime, gqa_paged_decode_reference
from shardattn.launch.local import run_ranks

DRAFTS, CACHED = [1, 3, 2], [40, 100, 7]  # query tokens and cached tokens per request
SCALE = 64**-0.5  # the model's softmax scale (GPT-OSS: 1 / sqrt(head_dim))


def main(group: dist.ProcessGroup) -> None:
    """The step, on every rank of ``group`` (one GPU per rank when there are GPUs)."""
    rank = dist.get_rank(group)
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    rt = Runtime("gqa-64-8", group, scale=SCALE, max_batched_tokens=64, mode="dcp-decode", device=device)
    spec, layout, page, h = rt.spec, rt.layout, rt.spec.page_size, rt.heads_per_rank
    hkv, d = spec.num_kv_heads, spec.head_dim
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)

    seq = [c + q for c, q in zip(CACHED, DRAFTS)]  # KV tokens per request, drafts included
    seq_lens = torch.tensor(seq, dtype=torch.int32, device=device)
    cu_q_lens = torch.tensor([0, *DRAFTS], device=device).cumsum(0).int()
    q = torch.randn(sum(DRAFTS), spec.num_heads, d, generator=gen, device=device).to(dtype)
    sinks = torch.randn(spec.num_heads, generator=gen, device=device)
    # the whole cache (one page run per request), then this rank's shard of it
    pages = [-(-n // page) for n in seq]
    k = torch.randn(sum(pages), page, hkv, d, generator=gen, device=device).to(dtype)
    v = torch.randn(sum(pages), page, hkv, d, generator=gen, device=device).to(dtype)
    first = [sum(pages[:b]) for b in range(len(seq))]
    table = torch.full((len(seq), max(pages)), -1, dtype=torch.int32, device=device)
    for b, n in enumerate(pages):
        table[b, :n] = torch.arange(first[b], first[b] + n, dtype=torch.int32)

    local_k, local_v, local_table, used = [], [], [], 0
    for b, n in enumerate(seq):
        owned = layout.owned_positions(n, rank).to(device)
        src = (first[b] + owned // page, owned % page)
        need = max(1, -(-owned.numel() // page))
        kb = torch.zeros(need * page, hkv, d, dtype=dtype, device=device)
        vb = torch.zeros_like(kb)
        kb[: owned.numel()], vb[: owned.numel()] = k[src], v[src]
        local_k.append(kb.view(need, page, hkv, d))
        local_v.append(vb.view(need, page, hkv, d))
        local_table.append(torch.arange(used, used + need, dtype=torch.int32))
        used += need
    table_local = torch.nn.utils.rnn.pad_sequence(local_table, batch_first=True, padding_value=-1).to(device)
    caches = (torch.cat(local_k), torch.cat(local_v))

    q_local = q[:, rank * h : (rank + 1) * h].contiguous()
    out, lse = rt.decode(q_local, caches, table_local, seq_lens, cu_q_lens=cu_q_lens, sinks=sinks)

    ref, ref_lse = gqa_paged_decode_reference(q, k, v, table, seq_lens, cu_q_lens, sinks=sinks, scale=SCALE)
    heads = slice(rank * h, (rank + 1) * h)
    assert lse is not None  # the default DecodeOptions return the LSE
    errors = torch.stack([(out.float() - ref[:, heads].float()).abs().max(), (lse - ref_lse[:, heads]).abs().max()])
    err = errors.max().item()  # NaN if either holds one
    print(
        f"rank {rank}: drafts {DRAFTS} -> out {tuple(out.shape)}, lse {tuple(lse.shape)} "
        f"({rt.decode_route.path}); graphs: {rt.cudagraph_support('decode').name}; max error of out and lse {err:.2e}"
    )
    if not err <= (3e-2 if dtype == torch.bfloat16 else 1e-4):
        raise SystemExit(f"rank {rank}: error {err} too large")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    run_ranks(main)  # torchrun's ranks, or 2 spawned ones (one GPU each when there are 2)
