"""shardattn.parallel: the torch.distributed steps. Every function takes a ``ProcessGroup`` (or a
1-D ``DeviceMesh``, ``(mesh, dim name)``, or a :class:`Comm` over one); nothing here creates a
group or keeps global state.

* :mod:`~shardattn.parallel.comm`       :class:`Comm`: counted collectives, byte packing, the
  cross-rank agreement check that turns mismatched inputs into errors instead of hangs.
* :mod:`~shardattn.parallel.collector`  :func:`collect_partials`: merge per-rank partial outputs
  by their LSEs (all-to-all, all-gather or reduce-scatter).
* :mod:`~shardattn.parallel.shardq`     :func:`shardq_prefill`: head shards -> zigzag token shards
  -> sparse MLA -> back (two all-to-alls).
* :mod:`~shardattn.parallel.dcp`        :func:`dcp_sparse_mla_decode`; :mod:`~shardattn.parallel.dcp_gqa`
  :func:`dcp_gqa_decode`: KV split over ranks, q heads all-gathered, partials merged by the collector.
* :mod:`~shardattn.parallel.pcp`        :func:`pcp_prefill`: zigzag query tokens, new KV all-gathered.
* :mod:`~shardattn.parallel.gqa_head_tp` :func:`gqa_prefill_head_tp`, :mod:`~shardattn.parallel.gqa_prefill`
  :func:`gqa_prefill_pcp`: GQA prefill under head-TP (a local call) and PCP (zigzag tokens, new K/V
  all-gathered).

The per-rank :class:`~shardattn.runtime.Runtime` that runs these steps with its reserved
workspace, warm-up and CUDA graphs lives in :mod:`shardattn.runtime`.
"""

from __future__ import annotations

from shardattn.parallel.agreement import stable_fingerprint
from shardattn.parallel.collector import STRATEGIES, collect_partials, resolve_strategy
from shardattn.parallel.comm import Comm, pack_rows, packed_nbytes, unpack_rows
from shardattn.parallel.dcp import dcp_sparse_mla_decode
from shardattn.parallel.dcp_gqa import dcp_gqa_decode
from shardattn.parallel.gqa_head_tp import gqa_prefill_head_tp, head_tp_kv_heads
from shardattn.parallel.gqa_prefill import gqa_prefill_pcp
from shardattn.parallel.pcp import pcp_prefill
from shardattn.parallel.shardq import shardq_prefill

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
]
