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
"""

from __future__ import annotations

__all__ = ["DECODE_STEP", "GQA_BACKEND", "MODES", "PREFILL_STEP"]

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
GQA_BACKEND = {"triton": "triton", "flashinfer-xqa": "flashinfer", "reference": "reference"}
