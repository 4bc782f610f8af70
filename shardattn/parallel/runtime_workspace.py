"""The Runtime's workspace: the planner's byte bounds for every step a config can take, reserved once.

:class:`RuntimeWorkspace` turns :func:`~shardattn.plan.workspace.workspace_bounds` into buffers:
one ``uint8`` tensor per item, allocated at construction and never reallocated (graph-visible
buffers never move). Every step recomputes its needs with the same planner function and
:meth:`RuntimeWorkspace.check` raises :class:`WorkspaceExceededError`, naming the item, when one
does not fit, before any kernel runs.
"""

from __future__ import annotations

import torch

from shardattn.parallel.modes import DECODE_STEP, PREFILL_STEP
from shardattn.plan.spec import ModelSpec
from shardattn.plan.workspace import workspace_bounds

__all__ = ["RuntimeWorkspace", "WorkspaceExceededError"]


class WorkspaceExceededError(ValueError):
    """A step needs more of a workspace item than the Runtime reserved for its config."""


class RuntimeWorkspace:
    """Per-rank workspace of one Runtime config: ``{"<kind>.<item>": uint8 tensor}``.

    Args:
        spec: the model. mode: the Runtime's mode (:data:`~shardattn.parallel.modes.MODES`).
        world_size: ranks of the group. device: where the buffers live.
        max_batched_tokens / max_decode_tokens: the largest prefill / decode step.
        min_shard_tokens: the ShardQ gate (steps below it run head-TP and are reserved for too).
        topk: top-k entries per query.
        headtp_tokens: under ``shardq``, the most tokens a head-TP step may have (default: the
            steps below the gate; a cost-routed Runtime passes ``max_batched_tokens``).
    """

    def __init__(
        self,
        spec: ModelSpec,
        mode: str,
        world_size: int,
        *,
        device: torch.device,
        max_batched_tokens: int,
        max_decode_tokens: int,
        min_shard_tokens: int,
        topk: int,
        headtp_tokens: int | None = None,
    ) -> None:
        self.spec, self.mode, self.world_size = spec, mode, world_size
        self.max_batched_tokens, self.max_decode_tokens = max_batched_tokens, max_decode_tokens
        self.min_shard_tokens, self.topk = min_shard_tokens, topk
        self._needs: dict[tuple[str, str, int, int], dict[str, int]] = {}  # memo: every step asks
        self.headtp_tokens = headtp_tokens
        self.bounds: dict[str, int] = self._reservation()
        self.buffers: dict[str, torch.Tensor] = {
            name: torch.empty(nbytes, dtype=torch.uint8, device=device) for name, nbytes in self.bounds.items()
        }

    @property
    def nbytes(self) -> int:
        """Bytes reserved, all items together."""
        return sum(int(t.numel()) for t in self.buffers.values())

    def _cases(self, kind: str, step: str, tokens: int) -> list[tuple[str, int, int, int]]:
        """``(workspace mode, tokens, world_size, tp_size)`` of the planner's bounds for a step."""
        w = self.world_size
        if kind == "decode":
            # DCP: the group is the TP group (each rank holds H/W heads, gathers all H);
            # head-TP decode: no peers, H/W heads
            return [("dcp-decode", tokens, w, w)] if step == "dcp" else [("dcp-decode", tokens, 1, w)]
        if step == "pcp":
            return [("pcp", tokens, w, 1)]
        return [(step, tokens, w, 1)]

    def needs(self, kind: str, step: str, tokens: int, topk: int) -> dict[str, int]:
        """``{"<kind>.<item>": bytes}`` the planner bounds for one step of ``tokens`` tokens and top-k ``topk``
        (memoised: a serving loop asks for the same few sizes every step)."""
        memo = (kind, step, tokens, topk)
        if memo in self._needs:
            return self._needs[memo]
        need: dict[str, int] = {}
        k = topk if self.spec.kind == "sparse_mla" else 0
        for ws_mode, m, w, tp in self._cases(kind, step, tokens):
            bounds = workspace_bounds(self.spec, max_batched_tokens=m, world_size=w, mode=ws_mode, tp_size=tp, topk=k)
            for name, nbytes in bounds.items.items():
                if nbytes:
                    key = f"{kind}.{name}"
                    need[key] = max(need.get(key, 0), int(nbytes))
        if len(self._needs) < 4096:
            self._needs[memo] = need
        return need

    def _reservation(self) -> dict[str, int]:
        """Itemwise maximum over every step this config can take, at its largest sizes."""
        steps: list[tuple[str, str, int]] = []
        prefill = PREFILL_STEP[self.mode] if self.spec.kind == "sparse_mla" else None
        if prefill is not None:
            steps.append(("prefill", prefill, self.max_batched_tokens))
            if prefill == "shardq":  # steps below the gate run head-TP
                below = min(self.max_batched_tokens, max(0, self.min_shard_tokens - 1))
                below = below if self.headtp_tokens is None else max(below, self.headtp_tokens)
                if below:
                    steps.append(("prefill", "headtp", below))
        steps.append(("decode", DECODE_STEP[self.mode], self.max_decode_tokens))
        total: dict[str, int] = {}
        for kind, step, tokens in steps:
            for key, nbytes in self.needs(kind, step, tokens, self.topk).items():
                total[key] = max(total.get(key, 0), nbytes)
        return total

    def check(self, kind: str, step: str, *, tokens: int, topk: int | None = None) -> None:
        """Raise :class:`WorkspaceExceededError` when a step needs more of an item than was reserved.

        Args:
            kind: ``"prefill"`` or ``"decode"``. step: the parallel step (``"shardq"``,
                ``"headtp"``, ``"pcp"``, ``"dcp"``). tokens: the step's new / query tokens.
            topk: the step's top-k width (default: the config's).
        """
        limit = self.max_batched_tokens if kind == "prefill" else self.max_decode_tokens
        if tokens > limit:
            name = "max_batched_tokens" if kind == "prefill" else "max_decode_tokens"
            raise WorkspaceExceededError(
                f"a {kind} step of {tokens} tokens exceeds {name}={limit}, the size this Runtime reserved its "
                "workspace for; split the step or build the Runtime larger"
            )
        k = self.topk if topk is None else topk
        for key, nbytes in self.needs(kind, step, tokens, k).items():
            have = int(self.buffers[key].numel()) if key in self.buffers else 0
            if nbytes > have:
                raise WorkspaceExceededError(
                    f"workspace item {key!r} needs {nbytes} B for this {step} step ({tokens} tokens, top-k {k}), "
                    f"but {have} B were reserved (max_batched_tokens={self.max_batched_tokens}, "
                    f"max_decode_tokens={self.max_decode_tokens}, topk={self.topk})"
                )
