"""Model attention specs: the shapes the planner, the kernels and the Runtime agree on.

>>> get_preset("glm5").num_heads, get_preset("glm5").head_dim, get_preset("glm5").topk
(64, 576, 2048)
>>> get_preset("gqa-64-8").queries_per_kv_head
8

The softmax scale is the model's, not ``head_dim ** -0.5``: after weight absorption an MLA query
has 576 dims, but the model scales its logits by ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``
(times YaRN's ``mscale ** 2`` where the model uses YaRN):

>>> round(get_preset("deepseek-v32").softmax_scale, 6), get_preset("glm5").softmax_scale
(0.135234, 0.0625)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shardattn._checks import check_bool, check_choice, check_int, check_scale

__all__ = ["DTYPE_BYTES", "KINDS", "PRESETS", "ModelSpec", "get_preset", "mla_softmax_scale"]

KINDS = ("sparse_mla", "gqa")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class ModelSpec:
    """Attention shape of one model (per layer; all layers alike).

    Attributes:
        kind: ``"sparse_mla"`` (DeepSeek-V3.2 / GLM-5 DSA, after weight absorption) or ``"gqa"``.
        num_heads: query heads of the whole model (before tensor parallelism).
        num_kv_heads: KV heads (1 for MLA: one latent row per token).
        head_dim: query/key dims (576 = 512 latent + 64 rope for MLA).
        v_dim: value/output dims (512 for MLA: the first 512 dims of the KV row; GQA: ``head_dim``).
        topk: KV rows each query attends to (2048 for DSA); 0 for GQA, whose attention is dense
            (``ValueError`` otherwise).
        page_size: tokens per KV-cache page.
        has_sinks: one learned sink logit per head (GPT-OSS). A Runtime's steps then take
            ``sinks`` (``[H]`` fp32), and only then: a mismatch is a ``ValueError``.
        dtype: activation / KV dtype name, a key of ``DTYPE_BYTES``.
        softmax_scale: the model's softmax scale (keyword only). Required for ``sparse_mla``: the
            model's is ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times YaRN's
            ``mscale ** 2`` where it applies (:func:`mla_softmax_scale`), never
            ``head_dim ** -0.5`` of the absorbed 576-dim rows. For ``gqa`` it defaults to
            ``head_dim ** -0.5``.
    """

    kind: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_dim: int
    topk: int
    page_size: int
    has_sinks: bool = False
    dtype: str = "bfloat16"
    softmax_scale: float | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, KINDS)
        check_int("num_heads", self.num_heads, minimum=1)
        check_int("num_kv_heads", self.num_kv_heads, minimum=1)
        check_int("head_dim", self.head_dim, minimum=1)
        check_int("v_dim", self.v_dim, minimum=1)
        check_int("topk", self.topk, minimum=0)
        check_int("page_size", self.page_size, minimum=1)
        check_choice("dtype", self.dtype, tuple(DTYPE_BYTES))
        check_bool("has_sinks", self.has_sinks)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.kind == "sparse_mla":
            if self.num_kv_heads != 1:
                raise ValueError(f"sparse_mla needs num_kv_heads == 1, got {self.num_kv_heads}")
            if self.topk < 1:
                raise ValueError(f"sparse_mla needs topk >= 1, got {self.topk}")
            if self.v_dim > self.head_dim:
                raise ValueError(f"v_dim ({self.v_dim}) must be <= head_dim ({self.head_dim}) for sparse_mla")
            if self.softmax_scale is None:
                raise ValueError(
                    "sparse_mla needs softmax_scale: the model's (qk_nope_head_dim + qk_rope_head_dim) ** -0.5, "
                    "times YaRN's mscale ** 2 where it applies (mla_softmax_scale), not head_dim ** -0.5"
                )
        elif self.topk != 0:  # GQA attention is dense: a top-k would be ignored
            raise ValueError(f"gqa needs topk == 0 (its attention is dense, no top-k is read), got topk={self.topk}")
        elif self.v_dim != self.head_dim:  # GQA kernels read K and V rows of one width (v_cache is k_cache's shape)
            raise ValueError(
                f"gqa needs v_dim == head_dim (its K and V rows have one width), got v_dim={self.v_dim}, "
                f"head_dim={self.head_dim}"
            )
        if self.softmax_scale is None:
            object.__setattr__(self, "softmax_scale", self.head_dim**-0.5)
        object.__setattr__(self, "softmax_scale", check_scale("softmax_scale", self.softmax_scale))

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def queries_per_kv_head(self) -> int:
        return self.num_heads // self.num_kv_heads

    def heads_per_rank(self, tp_size: int, *, ranks: str = "tp_size") -> int:
        """Query heads a rank holds under ``tp_size``-way head tensor parallelism.

        ``ranks`` names the rank count in the message as the caller's user passed it (a Runtime:
        its group's size; the Ray pool: its ``world_size``).

        >>> get_preset("glm5").heads_per_rank(3, ranks="the group's size")
        Traceback (most recent call last):
        ...
        ValueError: the spec's num_heads (64) must be divisible by the group's size (3)
        """
        tp_size = check_int(ranks, tp_size, minimum=1)
        if self.num_heads % tp_size:
            raise ValueError(f"the spec's num_heads ({self.num_heads}) must be divisible by {ranks} ({tp_size})")
        return self.num_heads // tp_size


def mla_softmax_scale(
    qk_nope_head_dim: int, qk_rope_head_dim: int, *, rope_factor: float = 1.0, mscale_all_dim: float = 0.0
) -> float:
    """The softmax scale of an MLA model from its config: ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``,
    times ``mscale ** 2`` with YaRN's ``mscale = 0.1 * mscale_all_dim * ln(rope_factor) + 1`` when
    ``rope_factor > 1`` (the ``rope_scaling`` entries ``factor`` and ``mscale_all_dim`` of a
    DeepSeek-style ``config.json``; the same rule as DeepSeek's reference model code and vLLM).

    >>> mla_softmax_scale(192, 64)
    0.0625
    >>> round(mla_softmax_scale(128, 64, rope_factor=40, mscale_all_dim=1.0), 6)
    0.135234
    """
    qk = check_int("qk_nope_head_dim", qk_nope_head_dim, minimum=0) + check_int(
        "qk_rope_head_dim", qk_rope_head_dim, minimum=0
    )
    if qk < 1:
        raise ValueError(f"qk_nope_head_dim + qk_rope_head_dim must be >= 1, got {qk}")
    factor = check_scale("rope_factor", rope_factor)
    mscale = 0.1 * float(mscale_all_dim) * math.log(factor) + 1.0 if factor > 1 else 1.0
    return qk**-0.5 * mscale * mscale


PRESETS: dict[str, ModelSpec] = {
    # GLM-5 (zai-org/GLM-5 config.json): 64 heads, qk_nope_head_dim 192 + qk_rope_head_dim 64,
    # kv_lora_rank 512, index_topk 2048, default RoPE (no YaRN): scale 256 ** -0.5
    "glm5": ModelSpec("sparse_mla", 64, 1, 576, 512, 2048, 64, softmax_scale=mla_softmax_scale(192, 64)),
    # DeepSeek-V3.2 (deepseek-ai/DeepSeek-V3.2 config.json): 128 heads, qk_nope_head_dim 128 +
    # qk_rope_head_dim 64, index_topk 2048, rope_scaling YaRN factor 40, mscale_all_dim 1.0
    "deepseek-v32": ModelSpec(
        "sparse_mla",
        128,
        1,
        576,
        512,
        2048,
        64,
        softmax_scale=mla_softmax_scale(128, 64, rope_factor=40.0, mscale_all_dim=1.0),
    ),
    # GPT-OSS shape (openai/gpt-oss config.json): 64 query / 8 KV heads of 64 dims, sinks, scale 64 ** -0.5
    "gqa-64-8": ModelSpec("gqa", 64, 8, 64, 64, 0, 32, has_sinks=True, softmax_scale=64**-0.5),
}


def get_preset(name: str) -> ModelSpec:
    """The :class:`ModelSpec` called ``name`` (a key of ``PRESETS``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
