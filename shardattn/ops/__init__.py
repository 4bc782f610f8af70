"""The public single-GPU operations: validation, dispatch to the kernels, torch references.

* :mod:`shardattn.ops.kv_fp8`: the FP8 KV-row format (``fp8_ds_mla``): quantise, dequantise, write;
  its byte layout and the check of a cache of its rows: :mod:`shardattn.ops.kv_fp8_layout`.
* :mod:`shardattn.ops.gqa_prefill`: GQA prefill (varlen, causal, a cached prefix in a paged cache,
  sinks, left window) on FA4 or the torch reference; ``gqa_prefill_route`` says which and why.
  (Imported from its module: a function of the module's name here would hide the module.)
"""

from shardattn.ops.kv_fp8 import (
    KV_FP8_DS_MLA,
    WRITE_SATURATED,
    WRITE_SKIPPED,
    WRITE_STORED,
    check_write_status,
    dequantize_kv,
    quantize_kv,
    quantize_kv_reference,
    write_kv,
)
from shardattn.ops.kv_fp8_layout import FP8_DS_MLA, KVRowLayout, check_fp8_kv

__all__ = [
    "FP8_DS_MLA",
    "KV_FP8_DS_MLA",
    "WRITE_SATURATED",
    "WRITE_SKIPPED",
    "WRITE_STORED",
    "KVRowLayout",
    "check_fp8_kv",
    "check_write_status",
    "dequantize_kv",
    "quantize_kv",
    "quantize_kv_reference",
    "write_kv",
]
