"""A DeepSeek-V3.2 decode loop over an FP8 KV cache split over 2 ranks (DCP), checked.

The cache is in DeepSeek's FP8 format (``fp8_ds_mla``: 656 bytes a token, FlashMLA's), each rank
holding its DCP shard of every request in pages of its own. Each step first stores the new
token's KV row, quantised, in the cache of the rank that owns its position (``write_kv``: an
engine's "concat and cache"), then every rank attends over its shard and the partial outputs are
merged by their log-sum-exp. The check attends in one process over the whole cache's rows as the
FP8 cache holds them (dequantised): quantisation is the only approximation of the FP8 step.

    python examples/fp8_cache_decode.py                       # spawns 2 CPU ranks (gloo)
    torchrun --nproc-per-node 2 examples/fp8_cache_decode.py  # one rank per GPU when there are GPUs
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from shardattn import DecodeOptions, Runtime, convert_topk, sparse_mla_reference
from shardattn.launch.local import run_ranks
from shardattn.ops.kv_fp8 import FP8_DS_MLA, dequantize_kv, write_kv

PROMPTS, STEPS, TOPK, INTERLEAVE = [300, 77, 1], 3, 48, 4  # three requests, three decode steps


def main(group: dist.ProcessGroup) -> None:
    """The decode loop, on every rank of ``group`` (one GPU per rank when there are GPUs)."""
    rank = dist.get_rank(group)
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    rt = Runtime(
        "deepseek-v32",  # 128 heads; the preset carries the model's softmax scale (YaRN mscale included)
        group,
        kv_dtype="fp8_ds_mla",
        max_batched_tokens=64,
        mode="dcp-decode",
        device=device,
        topk=TOPK,
        decode_options=DecodeOptions(dcp_interleave=INTERLEAVE),
    )
    spec, layout, page, h = rt.spec, rt.layout, rt.spec.page_size, rt.heads_per_rank
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)  # same "model state" on every rank
    batch, longest = len(PROMPTS), max(PROMPTS) + STEPS

    # this rank's cache: each request's tokens that it owns, in pages of its own; and the whole
    # cache as one process would hold it, for the check (one page run per request in both)
    local_pages, whole_pages = -(-layout.max_local_len(longest) // page), -(-longest // page)
    cache = torch.zeros(batch * local_pages, page, FP8_DS_MLA.row_bytes, dtype=torch.uint8, device=device)
    table = torch.arange(batch * local_pages, dtype=torch.int32, device=device).view(batch, local_pages)
    whole = torch.zeros(batch * whole_pages, page, FP8_DS_MLA.row_bytes, dtype=torch.uint8, device=device)
    whole_table = torch.arange(batch * whole_pages, dtype=torch.int32, device=device).view(batch, whole_pages)

    def store(positions: torch.Tensor, rows: torch.Tensor, b: int) -> None:
        """Concat and cache: request ``b``'s KV rows at ``positions``, the ones this rank owns."""
        mine = layout.owner(positions) == rank
        local = layout.local_index(positions[mine])
        write_kv(cache, table[b, local // page].long() * page + local % page, rows[mine])
        write_kv(whole, whole_table[b, positions // page].long() * page + positions % page, rows)

    for b, n in enumerate(PROMPTS):  # the prompts' rows, as prefill left them
        store(torch.arange(n, device=device), torch.randn(n, spec.head_dim, generator=gen, device=device).to(dtype), b)
    seq_lens = torch.tensor(PROMPTS, dtype=torch.int32, device=device)
    req = torch.arange(batch, dtype=torch.int32, device=device)
    errors = []
    for _ in range(STEPS):
        new_rows = torch.randn(batch, spec.head_dim, generator=gen, device=device).to(dtype)
        for b in range(batch):
            store(seq_lens[b : b + 1].long(), new_rows[b : b + 1], b)
        seq_lens += 1
        # the indexer's top-k: request-global positions (identical on every rank)
        topk_pos = (torch.rand(batch, TOPK, generator=gen, device=device) * seq_lens[:, None]).int()
        q = torch.randn(batch, spec.num_heads, spec.head_dim, generator=gen, device=device).to(dtype)
        out, lse = rt.decode(q[:, rank * h : (rank + 1) * h].contiguous(), cache, table, seq_lens,
                             topk_pos=topk_pos, req_ids=req)  # fmt: skip

        rows, _ = convert_topk(topk_pos, req, whole_table, block_size=page, seq_lens=seq_lens)
        kv = dequantize_kv(whole.flatten(0, 1), torch.float32).to(dtype)
        ref, ref_lse = sparse_mla_reference(q, kv, rows, scale=rt.scale, v_dim=spec.v_dim)
        heads = slice(rank * h, (rank + 1) * h)  # every token has a valid row: finite LSEs
        assert lse is not None  # the default DecodeOptions return the LSE
        errors += [(out.float() - ref[:, heads].float()).abs().max(), (lse - ref_lse[:, heads]).abs().max()]
    worst = torch.stack(errors).max().item()  # NaN if any holds one
    print(
        f"rank {rank}: {STEPS} steps over a {FP8_DS_MLA.row_bytes}-byte-a-token cache of "
        f"{cache.shape[0]} pages ({rt.decode_route.path}); max error of out and lse vs one process {worst:.2e}"
    )
    if not worst <= (3e-2 if dtype == torch.bfloat16 else 1e-4):
        raise SystemExit(f"rank {rank}: error {worst} too large")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    run_ranks(main)  # torchrun's ranks, or 2 spawned ones (one GPU each when there are 2)
