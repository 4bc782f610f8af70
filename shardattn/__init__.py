"""shardattn: sharded sparse attention (sparse MLA and GQA) for LLM inference across GPUs.

The public API, importable from the package (each name loads its module on first use, so
``import shardattn`` imports neither torch nor Triton)::

    from shardattn import Runtime, get_preset, sparse_mla_decode, shardq_prefill, route_prefill

Parts (see docs/ARCHITECTURE.md):

* :mod:`shardattn.ops`      the single-GPU operations: sparse-MLA prefill and decode, GQA prefill and decode,
  LSE merge, top-k conversion, unions, the FP8 KV-row format; torch references beside each.
* :mod:`shardattn.parallel` the torch.distributed steps: ShardQ, DCP, PCP, the collector.
* :mod:`shardattn.runtime`  the per-rank :class:`Runtime`: workspace, warm-up, routing, CUDA graphs.
* :mod:`shardattn.plan`     pure host planning: splits, layouts, workspace bounds, routing with its
  measured crossovers, the cost model, CUDA-graph levels, model presets.
* :mod:`shardattn.errors`   the exceptions beyond ``ValueError`` / ``TypeError``.
* :mod:`shardattn.serving`  the Ray actor pool; :mod:`shardattn.launch` ``torchrun -m shardattn.launch``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_OPS = {
    "sparse_mla_attention": "shardattn.ops.sparse_mla",
    "sparse_mla_reference": "shardattn.ops.sparse_mla",
    "sparse_mla_grouped_prefill": "shardattn.ops.sparse_mla_grouped",
    "sparse_mla_decode": "shardattn.ops.sparse_mla_decode",
    "gqa_paged_decode": "shardattn.ops.gqa_decode",
    "gqa_paged_decode_reference": "shardattn.ops.gqa_decode_reference",
    "gqa_prefill": "shardattn.ops.gqa_prefill",
    "lse_merge": "shardattn.ops.lse_merge",
    "lse_merge_reference": "shardattn.ops.lse_merge",
    "convert_topk": "shardattn.ops.topk",
    "convert_topk_reference": "shardattn.ops.topk",
    "DcpShard": "shardattn.ops.topk",
    "build_union": "shardattn.ops.union",
    "build_union_reference": "shardattn.ops.union",
    "prepare_union": "shardattn.ops.prepared_union",
    "PreparedUnion": "shardattn.ops.prepared_union",
    "quantize_kv": "shardattn.ops.kv_fp8",
    "dequantize_kv": "shardattn.ops.kv_fp8",
    "write_kv": "shardattn.ops.kv_fp8",
}
_STEPS = {
    "shardq_prefill": "shardattn.parallel.shardq",
    "dcp_sparse_mla_decode": "shardattn.parallel.dcp",
    "dcp_gqa_decode": "shardattn.parallel.dcp_gqa",
    "pcp_prefill": "shardattn.parallel.pcp",
    "gqa_prefill_head_tp": "shardattn.parallel.gqa_head_tp",
    "gqa_prefill_pcp": "shardattn.parallel.gqa_prefill",
    "collect_partials": "shardattn.parallel.collector",
    "Comm": "shardattn.parallel.comm",
    "resolve_group": "shardattn.parallel.groups",
    "Runtime": "shardattn.runtime.runtime",
    "PrefillOptions": "shardattn.runtime.options",
    "DecodeOptions": "shardattn.runtime.options",
}
_PLAN = {
    "ModelSpec": "shardattn.plan.spec",
    "mla_softmax_scale": "shardattn.plan.spec",
    "get_preset": "shardattn.plan.spec",
    "PRESETS": "shardattn.plan.spec",
    "zigzag_split": "shardattn.plan.zigzag",
    "cost_balanced_split": "shardattn.plan.zigzag",
    "ShardPlan": "shardattn.plan.shard_plan",
    "pcp_plan": "shardattn.plan.pcp",
    "PCPPlan": "shardattn.plan.pcp",
    "DCPLayout": "shardattn.plan.context",
    "shard_kv_cache": "shardattn.plan.dcp_shard",
    "pipeline_plan": "shardattn.plan.pipeline",
    "workspace_bounds": "shardattn.plan.workspace",
    "plan_decode_batch": "shardattn.plan.decode_batch",
    "cudagraph_support": "shardattn.plan.cudagraph",
    "CGSupport": "shardattn.plan.cudagraph",
    "Route": "shardattn.plan.routing",
    "route_prefill": "shardattn.plan.routing",
    "route_decode": "shardattn.plan.decode_routing",
    "route_prefill_kernel": "shardattn.plan.routing",
    "route_sparse_decode_kernel": "shardattn.plan.decode_routing",
    "route_decode_merge": "shardattn.plan.decode_routing",
    "route_union_method": "shardattn.plan.union_routing",
    "CostModel": "shardattn.plan.cost",
    "StepShape": "shardattn.plan.step_shape",
    "choose_prefill": "shardattn.plan.cost_choice",
    "load_calibration": "shardattn.plan.calibration",
    "NodeLayout": "shardattn.plan.nodes",
    "LinkRate": "shardattn.plan.links",
    "LINKS": "shardattn.plan.links",
}
_ERRORS = {
    name: "shardattn.errors"
    for name in (
        "CalibrationWarning",
        "LaunchError",
        "PeerFailedError",
        "PlacementTimeoutError",
        "RankFailedError",
        "WorkspaceExceededError",
    )
}
#: Every public name and the module it lives in.
_PUBLIC = {**_OPS, **_STEPS, **_PLAN, **_ERRORS}

__all__ = ["__version__", *sorted(_PUBLIC)]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'shardattn' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
