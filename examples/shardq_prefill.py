"""ShardQ sparse-MLA prefill of a GLM-5-like layer on 2 ranks, checked against one process.

Under tensor parallelism every rank holds H/W heads of every query token and the whole KV cache.
The Runtime moves the queries to zigzag token shards (every head), runs the sparse attention,
and moves the outputs back, so the caller keeps its head-sharded layout.

    python examples/shardq_prefill.py                       # spawns 2 CPU ranks (gloo)
    torchrun --nproc-per-node 2 examples/shardq_prefill.py  # one rank per GPU when there are GPUs
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from shardattn import PrefillOptions, Runtime, convert_topk, mla_softmax_scale, sparse_mla_reference
from shardattn.launch.local import run_ranks

QUERY_LENS, CACHED, TOPK, PAGE = [96, 64], [32, 0], 32, 64
# the model's softmax scale, from its config.json (GLM-5: qk_nope_head_dim 192, qk_rope_head_dim 64)
SCALE = mla_softmax_scale(192, 64)


def main(group: dist.ProcessGroup) -> None:
    """The step, on every rank of ``group`` (one GPU per rank when there are GPUs)."""
    rank = dist.get_rank(group)
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    rt = Runtime(  # small demo step: shard anything from 64 tokens on, whatever the cost model would pick
        "glm5",
        group,
        scale=SCALE,
        max_batched_tokens=256,
        mode="shardq",
        device=device,
        topk=TOPK,
        prefill_options=PrefillOptions(min_shard_tokens=64, cost_model=None),
    )
    spec, h = rt.spec, rt.heads_per_rank
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)  # same inputs on every rank

    # the paged KV cache (replicated under TP): request r's tokens live in blocks table[r]
    kv_lens = [c + n for c, n in zip(CACHED, QUERY_LENS)]
    table = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32, device=device)
    kv = torch.randn(3 * PAGE, spec.head_dim, generator=gen, device=device).to(dtype)
    # every new token's top-k: request-local positions up to its own (-1 = none)
    req = torch.repeat_interleave(torch.arange(len(QUERY_LENS), device=device), torch.tensor(QUERY_LENS, device=device))
    pos = torch.cat([c + torch.arange(n, device=device) for c, n in zip(CACHED, QUERY_LENS)])
    topk_pos = (torch.rand(len(pos), TOPK, generator=gen, device=device) * (pos[:, None] + 1)).int()
    topk_pos[:, -4:] = -1  # a few invalid entries per row
    rows, _ = convert_topk(
        topk_pos, req.int(), table, block_size=PAGE, seq_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device)
    )
    q = torch.randn(len(pos), spec.num_heads, spec.head_dim, generator=gen, device=device).to(dtype)

    q_local = q[:, rank * h : (rank + 1) * h].contiguous()  # this rank's heads, as TP gives them
    out, lse = rt.prefill(q_local, kv, rows, query_lens=QUERY_LENS, prefix_lens=CACHED)

    ref_out, ref_lse = sparse_mla_reference(q, kv, rows, scale=SCALE, v_dim=spec.v_dim)
    heads = slice(rank * h, (rank + 1) * h)  # every token has a valid row: finite LSEs
    plan = rt.plan_prefill(QUERY_LENS, CACHED)
    assert lse is not None and plan.token_plan is not None  # the default options' LSE; a ShardQ plan's tokens
    errors = torch.stack([(out.float() - ref_out[:, heads].float()).abs().max(), (lse - ref_lse[:, heads]).abs().max()])
    err = errors.max().item()  # NaN if either holds one
    print(
        f"rank {rank}: q {tuple(q_local.shape)} -> out {tuple(out.shape)}, lse {tuple(lse.shape)}; "
        f"ran {int(plan.token_plan.counts[rank])} tokens x {spec.num_heads} heads ({plan.route.path}); "
        f"max error of out and lse vs one process {err:.2e}"
    )
    if not err <= (3e-2 if dtype == torch.bfloat16 else 1e-4):
        raise SystemExit(f"rank {rank}: error {err} too large")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    run_ranks(main)  # torchrun's ranks, or 2 spawned ones (one GPU each when there are 2)
