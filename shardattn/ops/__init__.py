"""The public single-GPU operations: validation, dispatch to the kernels, torch references.

* :mod:`shardattn.ops.kv_fp8`: the FP8 KV-row format (``fp8_ds_mla``): quantise, dequantise, write.
"""

from shardattn.ops.kv_fp8 import (
    FP8_DS_MLA,
    KV_FP8_DS_MLA,
    WRITE_SATURATED,
    WRITE_SKIPPED,
    WRITE_STORED,
    KVRowLayout,
    check_fp8_kv,
    check_write_status,
    dequantize_kv,
    quantize_kv,
    quantize_kv_reference,
    write_kv,
)

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
