"""The Runtime's modes: which parallel step each mode's prefill and decode run.

==============  ============================================  =================================
mode            prefill                                        decode
==============  ============================================  =================================
``shardq``      ShardQ (head-TP below the planner's gate)      head-TP
``headtp``      head-TP                                        head-TP
``pcp``         PCP (zigzag tokens, KV all-gather)             DCP
``dcp-decode``  none (raises)                                  DCP
``mixed``       ShardQ (head-TP below the planner's gate)      DCP
==============  ============================================  =================================

A GQA model has no ShardQ step (dense attention splits by heads or tokens without one): its
prefill (:data:`GQA_PREFILL_STEP`) is head-TP in ``headtp`` and ``mixed``, PCP in ``pcp``; the
``shardq`` mode refuses a GQA model, whose decode is that of the table.
"""

from __future__ import annotations

__all__ = ["DECODE_STEP", "GQA_BACKEND", "GQA_PREFILL_STEP", "MODES", "PREFILL_STEP", "prefill_step_of"]

MODES = ("shardq", "headtp", "pcp", "dcp-decode", "mixed")
#: The parallel step each mode's prefill / decode runs (``None``: the mode has no prefill).
PREFILL_STEP: dict[str, str | None] = {
    "shardq": "shardq",
    "headtp": "headtp",
    "pcp": "pcp",
    "dcp-decode": None,
    "mixed": "shardq",
}
DECODE_STEP: dict[str, str] = {
    "shardq": "headtp",
    "headtp": "headtp",
    "pcp": "dcp",
    "dcp-decode": "dcp",
    "mixed": "dcp",
}
#: Decode route path -> ``backend`` argument of the GQA decode kernel.
GQA_BACKEND = {"triton": "triton", "reference": "reference"}
#: The prefill step of each mode for a GQA model (``None``: none; ``shardq`` refuses the model).
GQA_PREFILL_STEP: dict[str, str | None] = {
    "shardq": None,
    "headtp": "headtp",
    "pcp": "pcp",
    "dcp-decode": None,
    "mixed": "headtp",
}


def prefill_step_of(kind: str, mode: str) -> str | None:
    """The prefill step a ``kind`` (``"sparse_mla"`` / ``"gqa"``) model runs in ``mode`` (``None``: none).

    >>> prefill_step_of("gqa", "mixed"), prefill_step_of("sparse_mla", "mixed")
    ('headtp', 'shardq')
    """
    return (GQA_PREFILL_STEP if kind == "gqa" else PREFILL_STEP)[mode]
