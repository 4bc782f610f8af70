"""KV-cache row formats: what one KV row holds and how many bytes it takes (no tensors).

* a dense format (``"bfloat16"``, ``"float16"``, ``"float32"``; ``"bf16"``, ``"fp16"``,
  ``"fp32"`` are the same): ``D`` values of that dtype, the value (``P.V``) the first ``Dv``;
* :data:`KV_FP8_DS_MLA` (``"fp8_ds_mla"``, DeepSeek's "FP8 with scale", FlashMLA's
  ``V32_FP8Sparse``): 656 bytes, 512 e4m3 latent codes, 4 fp32 scales, 64 bf16 rope values
  (:mod:`shardattn.ops.kv_fp8` reads and writes it), for DSA models only (``D = 576``,
  ``Dv = 512``).

The plan sizes buffers and the cost model prices reads by these bytes; the ops check tensors
against them (:func:`shardattn.ops.kv_fp8.resolve_kv`).

>>> kv_row_bytes("bf16", 576), kv_row_bytes("fp8_ds_mla", 576)
(1152, 656)
>>> kv_format_name("kv_dtype", "fp16")
'float16'
"""

from __future__ import annotations

from shardattn.plan.spec import DTYPE_BYTES

__all__ = [
    "DENSE_KV_FORMATS",
    "FP8_DS_MLA_DIMS",
    "FP8_DS_MLA_ROW_BYTES",
    "KV_FORMATS",
    "KV_FP8_DS_MLA",
    "kv_format_name",
    "kv_row_bytes",
]

#: The FP8 row format's name (vLLM's ``kv_cache_dtype`` for it).
KV_FP8_DS_MLA = "fp8_ds_mla"
#: Bytes of one :data:`KV_FP8_DS_MLA` row, and the (head, value) dims it holds.
FP8_DS_MLA_ROW_BYTES = 656
FP8_DS_MLA_DIMS = (576, 512)
#: Rows of ``D`` values in one dtype.
DENSE_KV_FORMATS = ("bfloat16", "float16", "float32")
KV_FORMATS = (*DENSE_KV_FORMATS, KV_FP8_DS_MLA)
_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def kv_format_name(name: str, value: object) -> str:
    """``value`` as a format of :data:`KV_FORMATS` (``"bf16"`` / ``"fp16"`` / ``"fp32"`` accepted).

    Raises:
        ValueError: naming ``name`` and the formats, for anything else.
    """
    if isinstance(value, str):
        value = _ALIASES.get(value, value)
        if value in KV_FORMATS:
            return value
    raise ValueError(f"{name} must be one of {', '.join(KV_FORMATS)} (or bf16, fp16, fp32), got {value!r}")


def kv_row_bytes(kv_format: str, head_dim: int, v_dim: int | None = None) -> int:
    """Bytes of one KV row of ``head_dim`` values in ``kv_format``.

    Raises:
        ValueError: an unknown format, or :data:`KV_FP8_DS_MLA` for dims other than its 576 / 512.
    """
    fmt = kv_format_name("kv_format", kv_format)
    if fmt == KV_FP8_DS_MLA:
        if head_dim != FP8_DS_MLA_DIMS[0] or v_dim not in (None, FP8_DS_MLA_DIMS[1]):
            raise ValueError(
                f"{KV_FP8_DS_MLA} rows hold {FP8_DS_MLA_DIMS[0]} values ({FP8_DS_MLA_DIMS[1]} latent + 64 rope), "
                f"got head_dim={head_dim}, v_dim={v_dim}"
            )
        return FP8_DS_MLA_ROW_BYTES
    return head_dim * DTYPE_BYTES[fmt]
