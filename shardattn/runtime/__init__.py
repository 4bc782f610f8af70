"""The per-rank Runtime: one object per rank that runs the library's steps for a model and a group.

* :mod:`~shardattn.runtime.runtime`    :class:`Runtime`: routing per step, the steps, warm-up, graph policy.
* :mod:`~shardattn.runtime.options`    :class:`PrefillOptions`, :class:`DecodeOptions`: the Runtime's options
  beyond its sizes, frozen and checked.
* :mod:`~shardattn.runtime.args`       one meaning per argument name; host lists and int64 indices
  converted once.
* :mod:`~shardattn.runtime.planning`   the routes and token splits of the Runtime's steps.
* :mod:`~shardattn.runtime.workspace`  :class:`RuntimeWorkspace`: the arena reserved once and every
  step's items laid over it, the per-step checks.
* :mod:`~shardattn.runtime.prefill`    the prefill dispatch (PCP / head-TP / ShardQ) and its plan.
* :mod:`~shardattn.runtime.decode`     :class:`DecodeStep`: the decode step (DCP or head-TP, sparse MLA or GQA).
* :mod:`~shardattn.runtime.warmup`     every kernel variant a step can launch, compiled up front.
* :mod:`~shardattn.runtime.graphs`     the CUDA-graph level and decode capture; :mod:`~shardattn.runtime.cudagraph`
  the graph runner (buckets over one static arena).
* :mod:`~shardattn.runtime.modes`      which parallel step each mode's prefill and decode run.

The names load on first use (the Runtime imports every kernel).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Runtime": "shardattn.runtime.runtime",
    "PrefillOptions": "shardattn.runtime.options",
    "DecodeOptions": "shardattn.runtime.options",
    "PrefillPlan": "shardattn.runtime.prefill",
    "DecodeStep": "shardattn.runtime.decode",
    "RuntimeWorkspace": "shardattn.runtime.workspace",
    "MODES": "shardattn.runtime.modes",
    "DecodeGraph": "shardattn.runtime.graph_capture",
    "GraphInput": "shardattn.runtime.cudagraph",
    "GraphRunner": "shardattn.runtime.cudagraph",
    "DecodeGraphs": "shardattn.runtime.graphs",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shardattn.runtime' has no attribute {name!r}")
