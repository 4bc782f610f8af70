"""The sizes of one prefill step the cost model prices (:class:`StepShape`).

Pure host code: no torch, no GPU, no process group.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from shardattn._checks import check_choice, check_int, check_positive
from shardattn.plan.calibration import GROUPS
from shardattn.plan.kv_format import kv_format_name, kv_row_bytes
from shardattn.plan.spec import ModelSpec

__all__ = ["StepShape"]


@dataclass(frozen=True)
class StepShape:
    """The sizes of one prefill step the model needs.

    Attributes:
        heads: query heads of the model (all ranks), a multiple of ``world_size`` (head-TP gives
            each rank ``heads / world_size``, ShardQ's all-to-alls move as many per token).
        world_size: ranks of the group.
        tokens: new tokens of the step. topk: valid keys per query (mean).
        head_dim / v_dim / dtype_bytes: q row width, output width, activation bytes.
        rank_tokens: the most tokens a rank holds under ShardQ / PCP (default ``ceil(T / W)``,
            at most ``T``).
        union_ratio: ``{G: ratio}`` of the step's top-k, when known (default: the table's): ``G``
            a grouped size (2, 4 or 8), each ratio a finite float > 0; stored as a new ``dict``.
        kv_format: the KV rows' format (:data:`shardattn.plan.kv_format.KV_FORMATS`; ``None``:
            rows of ``dtype_bytes`` values): which kernel points price the calls, and the bytes of
            a KV row PCP all-gathers.
        ranks_per_node: ranks on each host (the smallest host's; ``None``: every rank on one
            host); below ``world_size`` the step's collectives cross the network.
    """

    heads: int
    world_size: int
    tokens: int
    topk: int
    head_dim: int = 576
    v_dim: int = 512
    dtype_bytes: int = 2
    rank_tokens: int | None = None
    union_ratio: dict[int, float] | None = None
    kv_format: str | None = None
    ranks_per_node: int | None = None

    def __post_init__(self) -> None:
        for name in ("heads", "world_size", "head_dim", "v_dim", "dtype_bytes"):
            check_int(f"StepShape.{name}", getattr(self, name), minimum=1)
        for name in ("tokens", "topk"):
            check_int(f"StepShape.{name}", getattr(self, name), minimum=0)
        if self.heads % self.world_size:
            raise ValueError(
                f"StepShape.heads must be a multiple of StepShape.world_size (each rank's heads under head-TP), "
                f"got heads={self.heads}, world_size={self.world_size}"
            )
        if self.rank_tokens is not None:  # the most a rank holds: at least its even share, at most all
            share = -(-self.tokens // self.world_size)
            check_int("StepShape.rank_tokens", self.rank_tokens, minimum=share, maximum=self.tokens)
        if self.ranks_per_node is not None:
            check_int("StepShape.ranks_per_node", self.ranks_per_node, minimum=1)
        if self.kv_format is not None:
            kv_format_name("StepShape.kv_format", self.kv_format)
        if self.union_ratio is not None:
            object.__setattr__(self, "union_ratio", _union_ratios(self.union_ratio))

    @property
    def per_rank(self) -> int:
        """The most tokens a rank holds (``rank_tokens``, default ``ceil(tokens / world_size)``)."""
        return self.rank_tokens if self.rank_tokens is not None else -(-self.tokens // self.world_size)

    @property
    def kv_row_bytes(self) -> int:
        """Bytes of one KV row (656 for ``fp8_ds_mla``)."""
        if self.kv_format is None:
            return self.head_dim * self.dtype_bytes
        return kv_row_bytes(self.kv_format, self.head_dim, self.v_dim)

    @classmethod
    def of(
        cls,
        spec: ModelSpec,
        world_size: int,
        tokens: int,
        *,
        topk: int | None = None,
        rank_tokens: int | None = None,
        kv_format: str | None = None,
        ranks_per_node: int | None = None,
    ) -> StepShape:
        """The shape of a step of ``spec``'s model (its heads, dims and dtype; top-k default the spec's;
        ``kv_format``: the KV rows', default rows of the spec's dtype)."""
        return cls(
            heads=spec.num_heads,
            world_size=world_size,
            tokens=tokens,
            topk=spec.topk if topk is None else topk,
            head_dim=spec.head_dim,
            v_dim=spec.v_dim,
            dtype_bytes=spec.dtype_bytes,
            rank_tokens=rank_tokens,
            kv_format=kv_format,
            ranks_per_node=ranks_per_node,
        )


def _union_ratios(value: object) -> dict[int, float]:
    """``StepShape.union_ratio`` checked: a mapping of grouped sizes ``G`` (:data:`GROUPS`) to
    finite ratios > 0, as a new ``{int: float}`` dict."""
    if not isinstance(value, Mapping):
        raise TypeError(f"StepShape.union_ratio must be a dict of G -> ratio, got {type(value).__name__}")
    out: dict[int, float] = {}
    for g, ratio in value.items():
        g = check_int("StepShape.union_ratio's G", g)
        check_choice("StepShape.union_ratio's G", g, GROUPS)
        out[g] = check_positive(f"StepShape.union_ratio[{g}]", ratio)
    return out
