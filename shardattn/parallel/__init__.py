"""shardattn.parallel: the torch.distributed steps. Every function takes a ``ProcessGroup`` (or a
:class:`Comm` over one); nothing here creates a group or keeps global state.

* :mod:`~shardattn.parallel.comm`       :class:`Comm`: counted collectives, byte packing, the
  cross-rank agreement check that turns mismatched inputs into errors instead of hangs.
* :mod:`~shardattn.parallel.collector`  :func:`collect_partials`: merge per-rank partial outputs
  by their LSEs (all-to-all, all-gather or reduce-scatter).
* :mod:`~shardattn.parallel.shardq`     :func:`shardq_prefill`: head shards -> zigzag token shards
  -> sparse MLA -> back (two all-to-alls).
* :mod:`~shardattn.parallel.dcp`        :func:`dcp_sparse_mla_decode`, :func:`dcp_gqa_decode`: KV
  split over ranks, q heads all-gathered, partials merged by the collector.
* :mod:`~shardattn.parallel.pcp`        :func:`pcp_prefill`: zigzag query tokens, new KV all-gathered.
* :mod:`~shardattn.parallel.gqa_prefill` :func:`gqa_prefill_head_tp`, :func:`gqa_prefill_pcp`: GQA
  prefill under head-TP (a local call) and PCP (zigzag tokens, new K/V all-gathered).
* :mod:`~shardattn.parallel.cudagraph`  CUDA-graph capture of decode steps (buckets, one-copy loads).
* :mod:`~shardattn.parallel.decode_graphs`  :class:`DecodeGraphs`: the DCP GQA step's graph buckets
  (ragged drafts padded, real rows returned, eager above the buckets);
  :mod:`~shardattn.parallel.host_staging` the reused pinned buffer of per-step metadata.
* :mod:`~shardattn.parallel.runtime`    :class:`Runtime`: workspace, warm-up, routing, graph policy;
  its parts: :mod:`~shardattn.parallel.modes` (which step each mode runs),
  :mod:`~shardattn.parallel.runtime_workspace` (reserved buffers and checks),
  :mod:`~shardattn.parallel.prefill_attention` (the prefill kernel call over the union workspace),
  :mod:`~shardattn.parallel.runtime_decode` (the decode step), :mod:`~shardattn.parallel.decode_warmup`.

``Runtime`` and the CUDA-graph helpers load on first use (they pull in every kernel).
"""

from __future__ import annotations

from typing import Any

from shardattn.parallel.collector import STRATEGIES, collect_partials, resolve_strategy
from shardattn.parallel.comm import Comm, pack_rows, packed_nbytes, stable_fingerprint, unpack_rows
from shardattn.parallel.dcp import dcp_gqa_decode, dcp_sparse_mla_decode
from shardattn.parallel.gqa_prefill import gqa_prefill_head_tp, gqa_prefill_pcp, head_tp_kv_heads
from shardattn.parallel.pcp import pcp_prefill
from shardattn.parallel.shardq import shardq_prefill

_LAZY = {
    "Runtime": "shardattn.parallel.runtime",
    "PrefillPlan": "shardattn.parallel.runtime",
    "WorkspaceExceededError": "shardattn.parallel.runtime_workspace",
    "MODES": "shardattn.parallel.modes",
    "DecodeGraph": "shardattn.parallel.cudagraph",
    "GraphInput": "shardattn.parallel.cudagraph",
    "GraphRunner": "shardattn.parallel.cudagraph",
    "check_capture_allowed": "shardattn.parallel.cudagraph",
    "DecodeGraphs": "shardattn.parallel.decode_graphs",
}

__all__ = [
    "STRATEGIES",
    "Comm",
    "collect_partials",
    "dcp_gqa_decode",
    "dcp_sparse_mla_decode",
    "gqa_prefill_head_tp",
    "gqa_prefill_pcp",
    "head_tp_kv_heads",
    "pack_rows",
    "packed_nbytes",
    "pcp_prefill",
    "resolve_strategy",
    "shardq_prefill",
    "stable_fingerprint",
    "unpack_rows",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shardattn.parallel' has no attribute {name!r}")
