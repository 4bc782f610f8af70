"""The CUDA-graph side of a Runtime: the planner's level for its steps, and decode capture.

:class:`RuntimeGraphs` is a part of :class:`~shardattn.parallel.runtime.Runtime` (it reads the
Runtime's spec, mode, group size and routes); it keeps the capture logic out of the Runtime's
own module. :class:`~shardattn.parallel.decode_graphs.DecodeGraphs` builds on
:meth:`RuntimeGraphs.capture_decode` for the DCP GQA step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from shardattn._checks import check_choice
from shardattn.parallel.cudagraph import GraphInput, GraphRunner, check_capture_allowed
from shardattn.parallel.modes import PREFILL_STEP
from shardattn.plan.cudagraph import CGSupport, explain_cudagraph_support

__all__ = ["RuntimeGraphs"]


class RuntimeGraphs:
    """CUDA-graph policy and decode capture of a Runtime (mixed into it; no state of its own)."""

    # provided by the Runtime
    spec: Any
    mode: str
    world_size: int
    heads_per_rank: int
    max_batched_tokens: int
    max_kv_rows: int
    causal: bool
    device: Any
    _route: Callable[..., Any]

    if TYPE_CHECKING:

        @property
        def decode_is_dcp(self) -> bool: ...

        @property
        def decode_route(self) -> Any: ...

    def explain_cudagraph_support(self, step: str = "decode") -> tuple[CGSupport, str]:
        """The planner's CUDA-graph level for this Runtime's ``"decode"`` or ``"prefill"`` steps, with why."""
        check_choice("step", step, ("decode", "prefill"))
        if step == "decode":
            kernel = self.decode_route.path
            dcp = self.world_size if self.decode_is_dcp else 1
            return explain_cudagraph_support(
                "decode", kernel, head_dim=self.spec.head_dim, dcp_size=dcp, non_causal=not self.causal,
                host_meta=self.spec.kind == "gqa",  # the DCP GQA step takes host-planned metadata
            )  # fmt: skip
        prefill = PREFILL_STEP[self.mode]
        if prefill is None or self.spec.kind != "sparse_mla":
            return CGSupport.NEVER, f"mode {self.mode!r} has no prefill step"
        route = self._route(self.heads_per_rank, self.max_batched_tokens, self.max_kv_rows)
        kernel = "reference" if route.path == "reference" else "triton"
        cg_mode = {"shardq": "shardq", "pcp": "pcp", "headtp": "prefill"}[prefill]
        return explain_cudagraph_support(cg_mode, kernel, head_dim=self.spec.head_dim)

    def cudagraph_support(self, step: str = "decode") -> CGSupport:
        """The planner's CUDA-graph level for this Runtime's ``"decode"`` or ``"prefill"`` steps."""
        return self.explain_cudagraph_support(step)[0]

    def check_capture(
        self, step: str = "decode", *, q_len_per_req: int = 1, ragged: bool = False, padded: bool = False
    ) -> None:
        """Raise ``ValueError`` when the policy forbids capturing such a step (the message names the level)."""
        level, why = self.explain_cudagraph_support(step)
        try:
            check_capture_allowed(level, q_len_per_req=q_len_per_req, ragged=ragged, padded=padded)
        except ValueError as e:
            raise ValueError(f"Runtime(mode={self.mode!r}) {step}: {e} [{why}]") from None

    def capture_decode(
        self,
        fn: Callable[..., Any],
        inputs: Sequence[GraphInput],
        *,
        batch_sizes: Sequence[int],
        q_len_per_req: int = 1,
        ragged: bool = False,
        capture: bool = True,
    ) -> GraphRunner:
        """Capture a decode step at several padded batch sizes (buckets), when the policy allows it.

        ``fn(**inputs)`` is typically a closure over this Runtime's :meth:`decode`;
        :class:`~shardattn.parallel.decode_graphs.DecodeGraphs` is the ready-made one for DCP GQA
        (host-planned metadata, ragged drafts padded to ``q_len_per_req``).

        Args:
            ragged: steps may be ragged batches padded to ``q_len_per_req`` queries per request.
            capture: capture now (default); ``False`` returns a runner that is never captured
                (no policy check: it pads, validates and runs eagerly; on the CPU too).
        Raises:
            ValueError: the mode's CUDA-graph level forbids the capture (names the level and why).
        """
        if capture:
            self.check_capture("decode", q_len_per_req=q_len_per_req, ragged=ragged, padded=True)
        runner = GraphRunner(
            fn,
            inputs,
            support=self.cudagraph_support("decode") if capture else None,
            batch_sizes=batch_sizes,
            q_len_per_req=q_len_per_req,
            ragged=ragged,
            device=self.device,
        )
        return runner.capture() if capture else runner
