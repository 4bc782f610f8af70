"""Sparse-MLA decode with the KV cache split over 2 ranks (decode context parallelism), checked.

Each rank stores only its DCP shard of every request's KV cache: token t lives on rank
(t // I) % N at local index (t // (N*I)) * I + t % I. A decode step gathers the query heads,
attends over the local shard, and merges the partial outputs by their log-sum-exp.

    python examples/dcp_decode.py                       # spawns 2 CPU ranks (gloo)
    torchrun --nproc-per-node 2 examples/dcp_decode.py  # one rank per GPU when there are GPUs
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.distributed as dist

from shardattn import DecodeOptions, Runtime, convert_topk, mla_softmax_scale, shard_kv_cache, sparse_mla_reference
from shardattn.launch.local import run_ranks

CONTEXT, TOPK, INTERLEAVE = [300, 77, 1], 48, 4  # three decode requests, one new token each
# the model's softmax scale, from its config.json (GLM-5: qk_nope_head_dim 192, qk_rope_head_dim 64)
SCALE = mla_softmax_scale(192, 64)


def main(group: dist.ProcessGroup) -> None:
    """The step, on every rank of ``group`` (one GPU per rank when there are GPUs)."""
    rank = dist.get_rank(group)
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    rt = Runtime(
        "glm5",
        group,
        scale=SCALE,
        max_batched_tokens=64,
        mode="dcp-decode",
        device=device,
        topk=TOPK,
        decode_options=DecodeOptions(dcp_interleave=INTERLEAVE),
    )
    spec, layout, page, h = rt.spec, rt.layout, rt.spec.page_size, rt.heads_per_rank
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)  # same "model state" on every rank

    # the whole cache, as one process would hold it (contiguous pages per request)
    pages = [-(-n // page) for n in CONTEXT]
    first = list(itertools.accumulate(pages, initial=0))  # each request's first page
    table = torch.full((len(CONTEXT), max(pages)), -1, dtype=torch.int32)
    for b, n in enumerate(pages):
        table[b, :n] = torch.arange(first[b], first[b] + n)
    table = table.to(device)
    kv = torch.randn(first[-1] * page, spec.head_dim, generator=gen, device=device).to(dtype)
    seq_lens = torch.tensor(CONTEXT, dtype=torch.int32, device=device)

    # this rank's shard: its tokens of each request, in local order, in pages of its own
    kv_local, table_local = shard_kv_cache(kv, table, CONTEXT, layout, rank, page_size=page)

    # the indexer's top-k: request-global positions (identical on every rank)
    req = torch.arange(len(CONTEXT), dtype=torch.int32, device=device)
    topk_pos = (torch.rand(len(CONTEXT), TOPK, generator=gen, device=device) * seq_lens[:, None]).int()
    q = torch.randn(len(CONTEXT), spec.num_heads, spec.head_dim, generator=gen, device=device).to(dtype)
    q_local = q[:, rank * h : (rank + 1) * h].contiguous()

    out, lse = rt.decode(q_local, kv_local, table_local, seq_lens, topk_pos=topk_pos, req_ids=req)

    rows, _ = convert_topk(topk_pos, req, table, block_size=page, seq_lens=seq_lens)
    ref, ref_lse = sparse_mla_reference(q, kv, rows, scale=SCALE, v_dim=spec.v_dim)
    heads = slice(rank * h, (rank + 1) * h)  # every token has a valid row: finite LSEs
    assert lse is not None  # the default DecodeOptions return the LSE
    errors = torch.stack([(out.float() - ref[:, heads].float()).abs().max(), (lse - ref_lse[:, heads]).abs().max()])
    err = errors.max().item()  # NaN if either holds one
    print(
        f"rank {rank}: holds {kv_local.shape[0]} of {kv.shape[0]} KV rows; out {tuple(out.shape)}, "
        f"lse {tuple(lse.shape)} ({rt.decode_route.path}); max error of out and lse vs one process {err:.2e}"
    )
    if not err <= (3e-2 if dtype == torch.bfloat16 else 1e-4):
        raise SystemExit(f"rank {rank}: error {err} too large")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    run_ranks(main)  # torchrun's ranks, or 2 spawned ones (one GPU each when there are 2)
