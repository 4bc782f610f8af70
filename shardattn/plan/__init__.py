"""shardattn.plan: deterministic host-side planning (no GPU work, no process group).

* :mod:`~shardattn.plan.zigzag`   ShardQ / PCP token splits (zigzag, cost-balanced), balance.
* :mod:`~shardattn.plan.shard_plan` the ShardPlan object: per-rank tokens, gather/restore maps.
* :mod:`~shardattn.plan.context`  DCP KV layout, local lengths, top-k translation.
* :mod:`~shardattn.plan.dcp_shard` a rank's DCP shard of a whole paged KV cache, and its block table.
* :mod:`~shardattn.plan.pcp`      PCP prefill plan: zigzag split plus the KV all-gather layout.
* :mod:`~shardattn.plan.spec`     ModelSpec and presets.
* :mod:`~shardattn.plan.workspace` itemised per-rank workspace bounds.
* :mod:`~shardattn.plan.routing`  which kernel path a step takes, and why.
* :mod:`~shardattn.plan.cudagraph` CUDA-graph support levels; decode query-length analysis.
* :mod:`~shardattn.plan.decode_batch` a decode batch's metadata (one int32 tensor) and its
  graph-bucket padding.
"""

from shardattn.plan.context import (
    DCPLayout,
    causal_token_seq_lens,
    dcp_causal_local_lens,
    dcp_global_index,
    dcp_local_index,
    dcp_local_seq_lens,
    dcp_owner,
    dcp_translate_topk,
)
from shardattn.plan.cudagraph import (
    CG_KERNELS,
    CG_MODES,
    CGSupport,
    DecodeQueryLens,
    cudagraph_support,
    decode_query_lens,
    explain_cudagraph_support,
    xqa_head_dim_supported,
)
from shardattn.plan.dcp_shard import shard_kv_cache
from shardattn.plan.decode_batch import DecodeBatch, bucket_for, plan_decode_batch
from shardattn.plan.decode_routing import DECODE_PATHS, route_decode
from shardattn.plan.pcp import PCPPlan, pcp_plan
from shardattn.plan.routing import (
    GROUP_SIZES,
    GROUPED_MAX_HEADS,
    MAX_GROUPED_KV_ROWS,
    PREFILL_PATHS,
    TILE_ROWS,
    Route,
    grouped_group_size,
    route_prefill,
    tile_group_size,
)
from shardattn.plan.shard_plan import ShardPlan, token_cost
from shardattn.plan.spec import DTYPE_BYTES, KINDS, PRESETS, ModelSpec, get_preset
from shardattn.plan.workspace import (
    ITEM_LIFETIMES,
    WORKSPACE_ITEMS,
    WORKSPACE_MODES,
    WorkspaceBounds,
    arena_offsets,
    workspace_bounds,
)
from shardattn.plan.zigzag import (
    DEFAULT_MIN_TOKENS,
    BalanceReport,
    balance_report,
    cost_balanced_split,
    zigzag_chunk_bounds,
    zigzag_split,
)

__all__ = [
    "CG_KERNELS",
    "CG_MODES",
    "DECODE_PATHS",
    "DEFAULT_MIN_TOKENS",
    "DTYPE_BYTES",
    "GROUPED_MAX_HEADS",
    "GROUP_SIZES",
    "ITEM_LIFETIMES",
    "KINDS",
    "MAX_GROUPED_KV_ROWS",
    "PREFILL_PATHS",
    "PRESETS",
    "TILE_ROWS",
    "WORKSPACE_ITEMS",
    "WORKSPACE_MODES",
    "BalanceReport",
    "CGSupport",
    "DCPLayout",
    "DecodeBatch",
    "DecodeQueryLens",
    "ModelSpec",
    "PCPPlan",
    "Route",
    "ShardPlan",
    "WorkspaceBounds",
    "arena_offsets",
    "balance_report",
    "bucket_for",
    "causal_token_seq_lens",
    "cost_balanced_split",
    "cudagraph_support",
    "dcp_causal_local_lens",
    "dcp_global_index",
    "dcp_local_index",
    "dcp_local_seq_lens",
    "dcp_owner",
    "dcp_translate_topk",
    "decode_query_lens",
    "explain_cudagraph_support",
    "get_preset",
    "grouped_group_size",
    "pcp_plan",
    "plan_decode_batch",
    "route_decode",
    "route_prefill",
    "shard_kv_cache",
    "tile_group_size",
    "token_cost",
    "workspace_bounds",
    "xqa_head_dim_supported",
    "zigzag_chunk_bounds",
    "zigzag_split",
]
