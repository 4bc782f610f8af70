"""Rows of the bad-input table for the planner (``shardattn.plan``; tests/test_bad_input.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from shardattn import plan as P
from shardattn.plan.decode_routing import route_sparse_decode_kernel
from shardattn.plan.pipeline import pipeline_plan
from shardattn.plan.step_shape import StepShape
from shardattn.plan.union_routing import route_union_method
from tests.bad_input.table import META, Call, Gives, Raises, Row


def _kv_pages(
    pages: int = 2, heads: int = 1, dim: int = 8, dtype: torch.dtype = torch.float32, device: torch.device | None = None
) -> torch.Tensor:
    """A paged GQA cache ``[pages, 4, heads, dim]`` of distinct values (on the CPU unless ``device``)."""
    return torch.arange(pages * 4 * heads * dim, dtype=dtype).view(pages, 4, heads, dim).to(device or "cpu")


def _pair_shards_match(res: Any) -> str | None:
    """A ``(k, v)`` shard of :func:`_kv_pages` with value width 6: rank 0's tokens 0, 2, 4 of request 0
    (rows 0, 2, 4 of its pages 0 and 1) in one page, the K rows and V rows of the same tokens."""
    (k, v), table = res
    if k.shape != (1, 4, 1, 8) or v.shape != (1, 4, 1, 6) or table.tolist() != [[0]]:
        return f"shapes {list(k.shape)}, {list(v.shape)}, table {table.tolist()}"
    want_k, want_v = _kv_pages().view(8, 1, 8)[[0, 2, 4]], _kv_pages(dim=6).view(8, 1, 6)[[0, 2, 4]]
    if not (torch.equal(k.view(4, 1, 8)[:3], want_k) and torch.equal(v.view(4, 1, 6)[:3], want_v)):
        return "the shard's rows are not the rank's tokens"
    return None


def plan_rows() -> list[Row]:
    """Rows of the planner's public functions and classes."""

    def row(rid: str, fn: Callable[..., Any], args: tuple, kw: dict, expect: Raises | Gives) -> Row:
        return Row(rid, lambda _g: Call(fn, args, kw), expect)

    pos = torch.arange(6)
    spec = P.get_preset("glm5")
    pair_table = torch.tensor([[0, 1]], dtype=torch.int32)
    return [
        row(
            "zigzag_split-world-size-absurd",
            P.zigzag_split,
            ([8, 8], 2**40),
            {},
            Raises(ValueError, r"^world_size must be <= 65536, got 1099511627776"),
        ),
        row(
            "pipeline_plan-chunks-past-max",
            pipeline_plan,
            (P.zigzag_split([64], 2, min_tokens=0), 9),
            {},
            Raises(ValueError, r"^chunks must be in \[1, 8\]"),
        ),
        row(
            "route_sparse_decode_kernel-num-sms-0",
            route_sparse_decode_kernel,
            (16,),
            {"num_tokens": 64, "topk": 2048, "num_sms": 0, "sm": 90},
            Raises(ValueError, r"^num_sms must be >= 1"),
        ),
        row(
            "route_sparse_decode_kernel-num-sms-on-cpu",  # checked wherever it is not used
            route_sparse_decode_kernel,
            (16,),
            {"num_tokens": 64, "device_type": "cpu", "num_sms": 1.5},
            Raises(TypeError, r"^num_sms must be an int"),
        ),
        row(
            "StepShape-heads-str",
            StepShape,
            (),
            {"heads": "64", "world_size": 2, "tokens": 4096, "topk": 2048},
            Raises(TypeError, r"^StepShape.heads must be an int"),
        ),
        row(
            "StepShape-kv-format-unknown",
            StepShape,
            (),
            {"heads": 64, "world_size": 2, "tokens": 4096, "topk": 2048, "kv_format": "int4"},
            Raises(ValueError, r"^StepShape.kv_format must be one of"),
        ),
        row("bucket_for-negative", P.bucket_for, (-1, (1, 2)), {}, Raises(ValueError, r"^num_requests must be >= 0")),
        row(
            "bucket_for-above-largest-runs-eager",
            P.bucket_for,
            (9, (1, 2, 4, 8)),
            {},
            Gives(lambda b: None if b is None else f"bucket {b} for a batch above every bucket"),
        ),
        row(
            "plan_decode_batch-seq-lens-negative",
            P.plan_decode_batch,
            ([3, -1],),
            {},
            Raises(ValueError, r"^seq_lens must be non-negative"),
        ),
        row(
            "plan_decode_batch-padded-below-batch",
            P.plan_decode_batch,
            ([3, 4],),
            {"padded_requests": 1},
            Raises(ValueError, r"^padded_requests=1 is smaller than the batch"),
        ),
        row(
            "plan_decode_batch-drafts-past-q-len",
            P.plan_decode_batch,
            ([3, 4], [0, 1, 5]),
            {"q_len": 2},
            Raises(ValueError, r"more than q_len=2"),
        ),
        row(
            "plan_decode_batch-layout-int",
            P.plan_decode_batch,
            ([3],),
            {"layout": 3},
            Raises(TypeError, r"^layout must be a DCPLayout"),
        ),
        row(
            "zigzag_split-query-lens-negative",
            P.zigzag_split,
            ([3, -1], 2),
            {},
            Raises(ValueError, r"^query_lens\[1\] must be >= 0"),
        ),
        row(
            "zigzag_split-query-lens-float",
            P.zigzag_split,
            ([3.0], 2),
            {},
            Raises(TypeError, r"^query_lens\[0\] must be an int"),
        ),
        row(
            "zigzag_split-query-lens-2d",
            P.zigzag_split,
            (np.ones((2, 2), dtype=np.int64), 2),
            {},
            Raises(ValueError, r"^query_lens must be 1-D"),
        ),
        row(
            "zigzag_split-query-lens-on-meta",
            P.zigzag_split,
            (torch.ones(2, dtype=torch.int64, device=META), 2),
            {},
            Raises(ValueError, r"^query_lens must be a CPU tensor"),
        ),
        row(
            "shard_kv_cache-no-page-size",
            P.shard_kv_cache,
            (torch.zeros(8, 4), torch.zeros(1, 2, dtype=torch.int32), [5], P.DCPLayout(2), 0),
            {},
            Raises(ValueError, r"^page_size is required"),
        ),
        row(
            "shard_kv_cache-past-block-table",
            P.shard_kv_cache,
            (torch.zeros(8, 4), torch.zeros(1, 2, dtype=torch.int32), [9], P.DCPLayout(2), 0),
            {"page_size": 4},
            Raises(ValueError, r"^seq_lens\[0\]=9 needs 3 pages, past block_table's 2"),
        ),
        row(
            "shard_kv_cache-rank-past-layout",
            P.shard_kv_cache,
            (torch.zeros(8, 4), torch.zeros(1, 2, dtype=torch.int32), [5], P.DCPLayout(2), 2),
            {"page_size": 4},
            Raises(ValueError, r"^rank must be < the layout's world_size=2"),
        ),
        row(  # regression: a K/V pair of different dtypes came back as a mismatched shard pair
            "shard_kv_cache-pair-dtypes-differ",
            P.shard_kv_cache,
            ((_kv_pages(), _kv_pages(dtype=torch.float16)), pair_table, [5], P.DCPLayout(2), 0),
            {},
            Raises(TypeError, r"^kv_cache\[1\] must have dtype in \(float32\), got float16"),
        ),
        row(
            "shard_kv_cache-pair-pages-differ",
            P.shard_kv_cache,
            ((_kv_pages(), _kv_pages(pages=3)), pair_table, [5], P.DCPLayout(2), 0),
            {},
            Raises(ValueError, r"^kv_cache\[1\] must have shape \[2, 4, 1, \*\]"),
        ),
        row(
            "shard_kv_cache-pair-heads-differ",
            P.shard_kv_cache,
            ((_kv_pages(), _kv_pages(heads=2)), pair_table, [5], P.DCPLayout(2), 0),
            {},
            Raises(ValueError, r"^kv_cache\[1\] must have shape \[2, 4, 1, \*\]"),
        ),
        row(
            "shard_kv_cache-pair-on-meta",
            P.shard_kv_cache,
            ((_kv_pages(), _kv_pages(device=META)), pair_table, [5], P.DCPLayout(2), 0),
            {},
            Raises(ValueError, r"^kv_cache\[1\] must be on cpu, got meta"),
        ),
        row(  # the value width may differ from the key's (v_dim)
            "shard_kv_cache-pair-v-dim-differs",
            P.shard_kv_cache,
            ((_kv_pages(), _kv_pages(dim=6)), pair_table, [5], P.DCPLayout(2), 0),
            {},
            Gives(_pair_shards_match),
        ),
        row(  # regression: a raw NotImplementedError (cannot copy out of meta tensor)
            "shard_kv_cache-block-table-on-meta",
            P.shard_kv_cache,
            (torch.zeros(8, 4), torch.zeros(1, 2, dtype=torch.int32, device=META), [5], P.DCPLayout(2), 0),
            {"page_size": 4},
            Raises(ValueError, r"^block_table must hold values \(it is read on the host\), got a tensor on meta"),
        ),
        row(
            "shard_kv_cache-seq-lens-on-meta",
            P.shard_kv_cache,
            (
                torch.zeros(8, 4),
                torch.zeros(1, 2, dtype=torch.int32),
                torch.ones(1, dtype=torch.int64, device=META),
                P.DCPLayout(2),
                0,
            ),
            {"page_size": 4},
            Raises(ValueError, r"^seq_lens must hold values \(it is read on the host\), got a tensor on meta"),
        ),
        row("zigzag_split-world-size-0", P.zigzag_split, ([3], 0), {}, Raises(ValueError, r"^world_size must be >= 1")),
        row("zigzag_split-align-0", P.zigzag_split, ([3], 2), {"align": 0}, Raises(ValueError, r"^align must be >= 1")),
        row(
            "zigzag_split-prefix-count",
            P.zigzag_split,
            ([3, 4], 2),
            {"prefix_lens": [1]},
            Raises(ValueError, r"^prefix_lens must have 2 entries"),
        ),
        row(
            "zigzag_split-no-request",
            P.zigzag_split,
            ([], 2),
            {"min_tokens": 0},
            Gives(lambda plan: None if plan.num_tokens == 0 else "tokens"),
        ),
        row(
            "cost_balanced_split-world-size-float",
            P.cost_balanced_split,
            ([3], 1.5),
            {},
            Raises(TypeError, r"^world_size must be an int"),
        ),
        row(
            "zigzag_chunk_bounds-align-negative",
            P.zigzag_chunk_bounds,
            ([3], 2),
            {"align": -1},
            Raises(ValueError, r"^align must be >= 1"),
        ),
        row(
            "balance_report-topk-0", P.balance_report, ([3], 2), {"topk": 0}, Raises(ValueError, r"^topk must be >= 1")
        ),
        row("pcp_plan-world-size-0", P.pcp_plan, ([3], 0), {}, Raises(ValueError, r"^world_size must be >= 1")),
        row(
            "pcp_plan-prefix-negative",
            P.pcp_plan,
            ([3], 2),
            {"prefix_lens": [-2]},
            Raises(ValueError, r"^prefix_lens\[0\] must be >= 0"),
        ),
        row("token_cost-topk-0", P.token_cost, (np.arange(3), 0), {}, Raises(ValueError, r"^topk must be >= 1")),
        row(
            "dcp_owner-positions-float",
            P.dcp_owner,
            (pos.float(), 2),
            {},
            Raises(TypeError, r"^positions must have dtype"),
        ),
        row("dcp_owner-world-size-0", P.dcp_owner, (pos, 0), {}, Raises(ValueError, r"world_size must be >= 1")),
        row(
            "dcp_local_index-interleave-0",
            P.dcp_local_index,
            (pos, 2, 0),
            {},
            Raises(ValueError, r"interleave must be >= 1"),
        ),
        row(
            "dcp_global_index-rank-past-world", P.dcp_global_index, (pos, 2, 2), {}, Raises(ValueError, r"rank must be")
        ),
        row(
            "dcp_local_seq_lens-seq-lens-float",
            P.dcp_local_seq_lens,
            (pos.float(), 0, 2),
            {},
            Raises(TypeError, r"^seq_lens must have dtype"),
        ),
        row(
            "dcp_translate_topk-seq-lens-shape",
            P.dcp_translate_topk,
            (pos.view(2, 3), 0, 2),
            {"seq_lens": torch.ones(3, dtype=torch.int64)},
            Raises(ValueError, r"^seq_lens must have shape \[2\]"),
        ),
        row(
            "dcp_translate_topk-seq-lens-on-meta",
            P.dcp_translate_topk,
            (pos.view(2, 3), 0, 2),
            {"seq_lens": torch.ones(2, dtype=torch.int64, device=META)},
            Raises(ValueError, r"seq_lens differs"),
        ),
        row(
            "causal_token_seq_lens-qo-indptr-float",
            P.causal_token_seq_lens,
            (torch.tensor([3, 4]), torch.tensor([0.0, 1.0, 2.0]), 2),
            {},
            Raises(TypeError, r"^qo_indptr must have dtype"),
        ),
        row(
            "causal_token_seq_lens-causal-str",
            P.causal_token_seq_lens,
            (torch.tensor([3, 4]), torch.tensor([0, 1, 2]), 2),
            {"causal": "no"},
            Raises(TypeError, r"^causal must be a bool, got str"),
        ),
        row(
            "dcp_causal_local_lens-rank-negative",
            P.dcp_causal_local_lens,
            (torch.tensor([3, 4]), torch.tensor([0, 1, 2]), 2, -1, 2),
            {},
            Raises(ValueError, r"rank must be"),
        ),
        row("DCPLayout-world-size-0", P.DCPLayout, (0,), {}, Raises(ValueError, r"world_size must be >= 1")),
        row(
            "ModelSpec-kind",
            P.ModelSpec,
            ("mla", 8, 1, 48, 32, 16, 16),
            {},
            Raises(ValueError, r"^kind must be one of"),
        ),
        row(
            "ModelSpec-heads-float",
            P.ModelSpec,
            ("gqa", 8.0, 1, 48, 32, 0, 16),
            {},
            Raises(TypeError, r"^num_heads must be an int"),
        ),
        row(
            "ModelSpec-v-dim-past-head-dim",
            P.ModelSpec,
            ("sparse_mla", 8, 1, 48, 64, 16, 16),
            {},
            Raises(ValueError, r"v_dim \(64\) must be <= head_dim"),
        ),
        row("get_preset-unknown", P.get_preset, ("llama",), {}, Raises(ValueError, r"unknown model preset 'llama'")),
        row(
            "route_prefill-heads-0",
            P.route_prefill,
            (0,),
            {"num_tokens": 8, "kv_rows": 8},
            Raises(ValueError, r"num_heads must be >= 1"),
        ),
        row(
            "route_prefill-tokens-negative",
            P.route_prefill,
            (8,),
            {"num_tokens": -1, "kv_rows": 8},
            Raises(ValueError, r"num_tokens must be >= 0"),
        ),
        row(
            "route_prefill-device-type-unknown",
            P.route_prefill,
            (8,),
            {"num_tokens": 8, "kv_rows": 8, "device_type": "bogus"},
            Raises(ValueError, r"^device_type must be a device type such as 'cuda' or 'cpu', got 'bogus'"),
        ),
        row(
            "route_prefill-gluon-str",
            P.route_prefill,
            (8,),
            {"num_tokens": 8, "kv_rows": 8, "gluon": "no"},
            Raises(TypeError, r"^gluon must be a bool, got str"),
        ),
        row(
            "route_union_method-shared-memory-int",
            route_union_method,
            (4, 2048, 1 << 16),
            {"shared_memory": 1},
            Raises(TypeError, r"^shared_memory must be a bool, got int"),
        ),
        row(
            "route_union_method-rows-sorted-str",
            route_union_method,
            (4, 2048, 1 << 16),
            {"rows_sorted": "yes"},
            Raises(TypeError, r"^rows_sorted must be a bool, got str"),
        ),
        row("route_decode-spec-str", P.route_decode, ("glm5",), {}, Raises(TypeError, r"^spec must be a ModelSpec")),
        row(
            "route_decode-device-type-unknown",
            P.route_decode,
            (spec,),
            {"device_type": "bogus"},
            Raises(ValueError, r"^device_type must be a device type such as 'cuda' or 'cpu', got 'bogus'"),
        ),
        row("tile_group_size-heads-0", P.tile_group_size, (0,), {}, Raises(ValueError, r"num_heads must be >= 1")),
        row(
            "grouped_group_size-heads-str",
            P.grouped_group_size,
            ("8",),
            {},
            Raises(TypeError, r"num_heads must be an int"),
        ),
        row(
            "workspace_bounds-mode",
            P.workspace_bounds,
            (spec,),
            {"max_batched_tokens": 8, "world_size": 2, "mode": "ring"},
            Raises(ValueError, r"^mode must be one of"),
        ),
        row(
            "workspace_bounds-tokens-negative",
            P.workspace_bounds,
            (spec,),
            {"max_batched_tokens": -1, "world_size": 2, "mode": "shardq"},
            Raises(ValueError, r"^max_batched_tokens must be >= 0"),
        ),
        row(
            "arena_offsets-size-negative",
            P.arena_offsets,
            ({"out": -1},),
            {},
            Raises(ValueError, r"^sizes\['out'\] must be >= 0"),
        ),
        row(
            "arena_offsets-lifetime-reversed",
            P.arena_offsets,
            ({"out": 8}, {"out": (3, 1)}),
            {},
            Raises(ValueError, r"^lifetimes\['out'\] must have first <= last"),
        ),
        row(
            "cudagraph_support-mode",
            P.cudagraph_support,
            ("train", "triton"),
            {"head_dim": 64},
            Raises(ValueError, r"^mode must be one of"),
        ),
        row(
            "explain_cudagraph_support-kernel",
            P.explain_cudagraph_support,
            ("decode", "cutlass"),
            {"head_dim": 64},
            Raises(ValueError, r"^kernel must be one of"),
        ),
        row(
            "cudagraph_support-host-meta-str",
            P.cudagraph_support,
            ("decode", "triton"),
            {"head_dim": 64, "dcp_size": 2, "host_meta": "no"},
            Raises(TypeError, r"^host_meta must be a bool, got str"),
        ),
        row(
            "xqa_head_dim_supported-0",
            P.xqa_head_dim_supported,
            (0,),
            {},
            Raises(ValueError, r"^head_dim must be >= 1"),
        ),
        row(
            "decode_query_lens-decreasing",
            P.decode_query_lens,
            ([0, 2, 1], 2),
            {},
            Raises(ValueError, r"^qo_indptr must be non-decreasing"),
        ),
        row(
            "decode_query_lens-too-short",
            P.decode_query_lens,
            ([0, 2], 2),
            {},
            Raises(ValueError, r"^qo_indptr must have at least"),
        ),
    ]
