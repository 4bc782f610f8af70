"""What a Runtime holds, declared once for the parts mixed into it (:class:`RuntimeState`).

:class:`~shardattn.runtime.runtime.Runtime` sets these at construction; its parts
(:class:`~shardattn.runtime.planning.RuntimePlanning`, :class:`~shardattn.runtime.steps.RuntimeSteps`,
:class:`~shardattn.runtime.graphs.RuntimeGraphs`, :class:`~shardattn.runtime.warmup.RuntimeWarmup`)
read them. Annotations only: nothing here exists at run time but the class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from shardattn.ops.gqa_prefill_kernels import SegmentKernel
    from shardattn.parallel.comm import Comm
    from shardattn.plan.context import DCPLayout
    from shardattn.plan.cost import CostModel
    from shardattn.plan.routing import Route
    from shardattn.plan.spec import ModelSpec
    from shardattn.runtime.gqa_prefill import GQAInputs
    from shardattn.runtime.options import DecodeOptions, PrefillOptions
    from shardattn.runtime.prefill import PCPInputs, PrefillPlan, RowInputs
    from shardattn.runtime.workspace import RuntimeWorkspace

__all__ = ["RuntimeState"]


class RuntimeState:
    """The attributes of a Runtime its parts read (set by the Runtime), and what one part offers
    another (``decode_route``, ``gqa_kernel``, ...)."""

    spec: ModelSpec
    mode: str
    comm: Comm
    rank: int
    world_size: int
    heads_per_rank: int
    device: torch.device
    dtype: torch.dtype
    gluon: bool
    topk: int
    scale: float
    kv_format: str
    _kv_declared: str | None
    max_batched_tokens: int
    max_decode_tokens: int
    max_kv_rows: int
    cost_model: CostModel | None
    prefill_options: PrefillOptions
    decode_options: DecodeOptions
    layout: DCPLayout
    ws: RuntimeWorkspace
    warmed_keys: frozenset
    warmup_launches: int
    _warned_dtype: bool
    _route: Callable[..., Route]
    _prefill_inputs: Callable[..., tuple[PrefillPlan, RowInputs | PCPInputs | GQAInputs]]
    gqa_kernel_for: Callable[[torch.dtype], SegmentKernel]

    if TYPE_CHECKING:  # read-only: the Runtime's properties, and the parts' own (cached)

        @property
        def min_shard_tokens(self) -> int: ...
        @property
        def min_group_tokens(self) -> int: ...
        @property
        def causal(self) -> bool: ...
        @property
        def decode_is_dcp(self) -> bool: ...
        @property
        def _prefill_agrees(self) -> bool: ...
        @property
        def decode_route(self) -> Route: ...
        @property
        def gqa_prefill_route(self) -> Route: ...
        @property
        def gqa_kernel(self) -> SegmentKernel: ...
