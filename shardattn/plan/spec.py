"""Model attention specs: the shapes the planner, the kernels and the Runtime agree on.

>>> get_preset("glm5").num_heads, get_preset("glm5").head_dim, get_preset("glm5").topk
(64, 576, 2048)
>>> get_preset("gqa-64-8").queries_per_kv_head
8
"""

from __future__ import annotations

from dataclasses import dataclass

from shardattn._checks import check_choice, check_int

__all__ = ["DTYPE_BYTES", "KINDS", "PRESETS", "ModelSpec", "get_preset"]

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
        v_dim: value/output dims (512 for MLA: the first 512 dims of the KV row).
        topk: KV rows each query attends to (2048 for DSA); 0 = dense (GQA).
        page_size: tokens per KV-cache page.
        has_sinks: one learned sink logit per head (GPT-OSS).
        dtype: activation / KV dtype name, a key of ``DTYPE_BYTES``.
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

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, KINDS)
        check_int("num_heads", self.num_heads, minimum=1)
        check_int("num_kv_heads", self.num_kv_heads, minimum=1)
        check_int("head_dim", self.head_dim, minimum=1)
        check_int("v_dim", self.v_dim, minimum=1)
        check_int("topk", self.topk, minimum=0)
        check_int("page_size", self.page_size, minimum=1)
        check_choice("dtype", self.dtype, tuple(DTYPE_BYTES))
        if not isinstance(self.has_sinks, bool):
            raise TypeError(f"has_sinks must be a bool, got {type(self.has_sinks).__name__}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.kind == "sparse_mla":
            if self.num_kv_heads != 1:
                raise ValueError(f"sparse_mla needs num_kv_heads == 1, got {self.num_kv_heads}")
            if self.topk < 1:
                raise ValueError(f"sparse_mla needs topk >= 1, got {self.topk}")
            if self.v_dim > self.head_dim:
                raise ValueError(f"v_dim ({self.v_dim}) must be <= head_dim ({self.head_dim}) for sparse_mla")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def queries_per_kv_head(self) -> int:
        return self.num_heads // self.num_kv_heads

    def heads_per_rank(self, tp_size: int) -> int:
        """Query heads a rank holds under ``tp_size``-way head tensor parallelism."""
        tp_size = check_int("tp_size", tp_size, minimum=1)
        if self.num_heads % tp_size:
            raise ValueError(f"num_heads ({self.num_heads}) must be divisible by tp_size ({tp_size})")
        return self.num_heads // tp_size


PRESETS: dict[str, ModelSpec] = {
    "glm5": ModelSpec("sparse_mla", 64, 1, 576, 512, 2048, 64),
    "deepseek-v32": ModelSpec("sparse_mla", 128, 1, 576, 512, 2048, 64),
    "gqa-64-8": ModelSpec("gqa", 64, 8, 64, 64, 0, 32, has_sinks=True),
}


def get_preset(name: str) -> ModelSpec:
    """The :class:`ModelSpec` called ``name`` (a key of ``PRESETS``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
