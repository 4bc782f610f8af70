"""The warm-up side of a Runtime: every kernel variant its routes can launch, run once at start-up.

:class:`RuntimeWarmup` is a part of :class:`~shardattn.parallel.runtime.Runtime` (it reads the
Runtime's spec, mode, group size, device and routes), as :class:`~shardattn.parallel.runtime_graphs.RuntimeGraphs`
is: the kernel shapes a config's prefill routes can produce (:meth:`RuntimeWarmup.prefill_specs`),
the variants one route launches (:meth:`RuntimeWarmup.route_keys`) and the warm-up itself, so
that no step compiles.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from shardattn.kernels.topk import DcpShard
from shardattn.kernels.warmup import CompileKey, PrefillSpec, compile_keys, warmup
from shardattn.parallel.decode_warmup import warm_up_decode
from shardattn.parallel.modes import GQA_BACKEND, PREFILL_STEP
from shardattn.plan.routing import Route, prefill_group_size

__all__ = ["RuntimeWarmup"]


class RuntimeWarmup:
    """Kernel warm-up of a Runtime (mixed into it)."""

    # provided by the Runtime
    spec: Any
    mode: str
    world_size: int
    rank: int
    heads_per_rank: int
    topk: int
    dtype: torch.dtype
    device: torch.device
    gluon: bool
    scale: float
    max_decode_tokens: int
    layout: Any
    decode_options: Any
    ws: Any
    warmed_keys: frozenset[CompileKey]
    warmup_launches: int

    if TYPE_CHECKING:

        @property
        def decode_is_dcp(self) -> bool: ...

        @property
        def decode_route(self) -> Route: ...

    def prefill_specs(self) -> list[PrefillSpec]:
        """Kernel shapes this Runtime's prefill routes can launch: every head count its steps run
        (ShardQ / PCP: all heads; head-TP and ShardQ below its gate: ``H / W``), each with the
        route's group size (grouped) and 1 (per-query: small steps, caches past ``2**24 - 1`` rows),
        with and without ``topk_length``."""
        step = PREFILL_STEP[self.mode]
        if self.spec.kind != "sparse_mla" or step is None:
            return []
        heads = {self.heads_per_rank}
        if step == "pcp" or (step == "shardq" and self.ws.shardq_possible):
            heads.add(self.spec.num_heads)
        return [
            PrefillSpec(
                heads=h,
                topk=self.topk,
                dtype=self.dtype,
                v_dim=self.spec.v_dim,
                rope_dim=self.spec.head_dim - self.spec.v_dim,
                group_size=prefill_group_size(h, gluon=self.gluon) or 1,
                sinks=self.spec.has_sinks,
                topk_length=with_len,
            )
            for h in sorted(heads)
            for with_len in (False, True)
        ]

    def route_keys(self, route: Route, heads: int, *, topk_length: bool = False) -> set[CompileKey]:
        """The kernel variants a prefill kernel call on ``route`` with ``heads`` heads launches."""
        spec = PrefillSpec(
            heads=heads,
            topk=self.topk,
            dtype=self.dtype,
            v_dim=self.spec.v_dim,
            rope_dim=self.spec.head_dim - self.spec.v_dim,
            group_size=route.group_size,
            sinks=self.spec.has_sinks,
            topk_length=topk_length,
        )
        return {k for k in compile_keys(spec) if k.kernel == "convert_topk" or k.params.get("G") == route.group_size}

    def warmup(self) -> int:
        """Launch every kernel variant the routes can produce, and one tiny decode; returns the launches."""
        specs = self.prefill_specs()
        launches = warmup(self.device, *specs) if specs else 0
        self.warmed_keys = frozenset(k for s in specs for k in compile_keys(s))
        launches += self._warmup_decode()
        self.warmup_launches = launches
        return launches

    def _warmup_decode(self) -> int:
        """Run the decode kernels on tiny inputs (:func:`~shardattn.parallel.decode_warmup.warm_up_decode`)."""
        dcp = self.decode_is_dcp
        return warm_up_decode(
            self.spec,
            device=self.device,
            dtype=self.dtype,
            heads=self.spec.num_heads if dcp else self.heads_per_rank,
            kv_heads=self.spec.num_kv_heads if dcp else max(1, self.spec.num_kv_heads // self.world_size),
            topk=self.topk,
            max_decode_tokens=self.max_decode_tokens,
            scale=self.scale,
            dcp=DcpShard(self.world_size, self.layout.interleave, self.rank) if dcp else None,
            need_lse=self.decode_options.return_lse or dcp,
            gqa_backend=GQA_BACKEND[self.decode_route.path],
        )
