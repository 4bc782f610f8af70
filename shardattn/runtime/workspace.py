"""The Runtime's workspace: the planner's byte bounds for every step a config can take, reserved once.

:class:`RuntimeWorkspace` turns :func:`~shardattn.plan.workspace.workspace_bounds` into buffers:
one ``uint8`` arena allocated at construction and never reallocated (graph-visible buffers never
move), viewed as one flat buffer per item. Every step recomputes its needs with the same planner
function and :meth:`RuntimeWorkspace.check` raises :class:`WorkspaceExceededError`, naming the
item, when one does not fit, before any kernel runs.

**One arena for every step.** Each step the config can take (the prefill step, head-TP steps
below the ShardQ gate, the decode step; on one rank, or with the ShardQ gate above
``max_batched_tokens``, a ShardQ mode's prefill is head-TP alone) lays the items it carves
(:data:`STEP_ITEMS`: PCP only its union) from byte 0 of one arena
(:func:`~shardattn.plan.workspace.arena_offsets`; inside the DCP decode step, items never live
at the same time share bytes too, :data:`~shardattn.plan.workspace.ITEM_LIFETIMES`). The arena
holds the largest step, not the sum of all. That is safe because:

* a rank never runs a prefill and a decode step at the same time: a Runtime's steps are issued
  one after another on one stream (a caller that runs them on two streams at once must not share
  one Runtime between them), so stream order puts every write of a step after every read of the
  step before it;
* every shared item is scratch of one step: written before it is read within that step, and
  never read after the step returns. Prefill: ``union`` / ``union_offsets`` (built, then read by
  the kernel), ShardQ's ``topk_rows`` (the rank's rows of the top-k), ``packed_q`` (query
  receive buffer), ``out`` / ``lse`` (output send buffers; the result lands in a new tensor; a
  one-chunk step stages the queries it sends in ``out`` and the outputs it receives in
  ``packed_q``).
  Decode: ``packed_q`` (gathered queries and their head-major copy), ``topk_rows`` (converted
  rows), ``out`` / ``lse`` (the local partial), ``send`` / ``recv`` (the collector's packed
  all-to-all); the merged result is a new tensor;
* a captured decode graph (:mod:`~shardattn.runtime.graphs`) reads and writes these
  decode items at fixed addresses, and a prefill between two replays overwrites them; each replay
  writes them before reading them, so nothing of one replay is needed by the next. What a graph
  needs to persist between replays is outside the arena: its static inputs (the
  :class:`~shardattn.runtime.cudagraph.GraphRunner`'s buffers, reloaded every step, and the KV
  cache), its outputs (the merge's results, in the graph's own memory pool, read by the caller
  before the next step), and the sparse-MLA decode kernels' fp32 split partials (allocated inside
  the captured step, so they live in the graph's pool, and every replay writes them before the
  merge reads them; their count is each kernel's slice plan for the device, which the planner's
  ``split_partials`` item does not bound here, so they are never given an arena buffer).
"""

from __future__ import annotations

import torch

from shardattn._checks import check_choice, check_int
from shardattn.errors import WorkspaceExceededError
from shardattn.plan.spec import ModelSpec
from shardattn.plan.workspace import ITEM_LIFETIMES, arena_offsets, workspace_bounds
from shardattn.runtime.modes import DECODE_STEP, prefill_step_of

__all__ = ["RuntimeWorkspace", "WorkspaceExceededError"]

#: ``{(kind, step): items}``: steps that carve only some of the items the planner bounds for their
#: mode; the rest is allocated by the step itself (PCP: its KV gather and outputs, sized per step),
#: so reserving it would hold memory no step reads. Steps not listed carve every bounded item. GQA
#: prefill steps carve none (:meth:`RuntimeWorkspace.needs`): FA4 allocates its outputs, PCP its
#: KV gather, per step.
STEP_ITEMS: dict[tuple[str, str], tuple[str, ...]] = {("prefill", "pcp"): ("union", "union_offsets")}
#: The parallel steps of each kind a workspace bound is asked for.
STEPS: dict[str, tuple[str, ...]] = {"prefill": ("shardq", "headtp", "pcp"), "decode": ("headtp", "dcp")}


def check_step(kind: object, step: object, tokens: object, topk: object) -> None:
    """A step's ``kind``, ``step``, ``tokens`` and ``topk`` as :meth:`RuntimeWorkspace.needs` takes
    them: ``ValueError`` / ``TypeError`` naming the argument. The Runtime's public questions check
    them; its own steps pass known values, so the per-step path does not."""
    check_choice("kind", kind, tuple(STEPS))
    check_choice("step", step, STEPS[str(kind)])
    check_int("tokens", tokens, minimum=0)
    check_int("topk", topk, minimum=0)


#: ``dcp_*_decode`` workspace key -> the Runtime's workspace item (``decode.<item>``).
_DECODE_BUFFERS = (
    ("q", "packed_q"),
    ("rows", "topk_rows"),
    ("out", "out"),
    ("lse", "lse"),
    ("send", "send"),
    ("recv", "recv"),
)


class RuntimeWorkspace:
    """Per-rank workspace of one Runtime config: one ``uint8`` arena, viewed per step as
    ``{"<kind>.<item>": uint8 tensor}`` (:meth:`step_buffers`).

    Args:
        spec: the model. mode: the Runtime's mode (:data:`~shardattn.runtime.modes.MODES`).
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
        kv_dtype: str | None = None,
    ) -> None:
        self.spec, self.mode, self.world_size = spec, mode, world_size
        self.kv_dtype = kv_dtype  # the KV row format the bounds are sized for (None: spec.dtype)
        self.dtype: torch.dtype = getattr(torch, spec.dtype)  # the dtype the bounds are sized for
        self.max_batched_tokens, self.max_decode_tokens = max_batched_tokens, max_decode_tokens
        self.min_shard_tokens, self.topk = min_shard_tokens, topk
        self._needs: dict[tuple[str, str, int, int], dict[str, int]] = {}  # memo: every step asks
        self.headtp_tokens = headtp_tokens
        #: ``{(kind, step): {"<kind>.<item>": bytes}}`` every step this config can take, at its largest
        self.step_bounds: dict[tuple[str, str], dict[str, int]] = {}
        for kind, step, tokens in self._steps():
            need = self.needs(kind, step, tokens, self.topk)
            mine = self.step_bounds.setdefault((kind, step), {})
            for key, nbytes in need.items():
                mine[key] = max(mine.get(key, 0), nbytes)
        #: ``{"<kind>.<item>": bytes}``: the largest of each item over the steps (what is reported)
        self.bounds: dict[str, int] = {}
        for need in self.step_bounds.values():
            for key, nbytes in need.items():
                self.bounds[key] = max(self.bounds.get(key, 0), nbytes)
        #: ``{(kind, step): ({"<kind>.<item>": byte offset}, bytes)}``: each step's items in the arena
        self.layouts: dict[tuple[str, str], tuple[dict[str, int], int]] = {}
        for (kind, step), need in self.step_bounds.items():
            lifetimes = ITEM_LIFETIMES.get(self._case(kind, step, 0)[0], {})
            offsets, size = arena_offsets(need, {f"{kind}.{k}": v for k, v in lifetimes.items()})
            self.layouts[(kind, step)] = (offsets, size)
        nbytes = max((n for _, n in self.layouts.values()), default=0)
        try:
            self.arena = torch.empty(nbytes, dtype=torch.uint8, device=device)
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            largest = max(self.bounds, key=self.bounds.__getitem__)
            raise MemoryError(
                f"the Runtime's workspace needs {nbytes:,} bytes on {device} (max_batched_tokens="
                f"{max_batched_tokens}, max_decode_tokens={max_decode_tokens}, topk={topk}; the largest item, "
                f"{largest}, {self.bounds[largest]:,} bytes), and allocating it failed: {e}"
            ) from e
        self.views: dict[tuple[str, str], dict[str, torch.Tensor]] = {
            key: {name: self.arena[off : off + self.step_bounds[key][name]] for name, off in offsets.items()}
            for key, (offsets, _) in self.layouts.items()
        }
        #: ``{"<kind>.<item>": uint8 view}``: each item's view in the step where it is largest
        self.buffers: dict[str, torch.Tensor] = {}
        for views in self.views.values():
            for name, view in views.items():
                if name not in self.buffers or view.numel() > self.buffers[name].numel():
                    self.buffers[name] = view

    @property
    def nbytes(self) -> int:
        """Bytes reserved: the arena, as large as the largest step's items (prefill and decode share it)."""
        return int(self.arena.numel())

    def kind_bytes(self, kind: str) -> int:
        """The arena bytes the largest step of ``kind`` (``"prefill"`` / ``"decode"``) lays its items over."""
        return max((n for (k, _), (_, n) in self.layouts.items() if k == kind), default=0)

    def step_buffers(self, kind: str, step: str) -> dict[str, torch.Tensor]:
        """``{"<kind>.<item>": uint8 view}`` of one step's items (empty for a step this config never reserved)."""
        return self.views.get((kind, step), {})

    def decode_buffers(self, step: str) -> dict[str, torch.Tensor]:
        """The decode step's buffers (the ``workspace`` keys of :mod:`~shardattn.parallel.dcp` ->
        ``decode.<item>``): ``{"q", "rows", "out", "lse", "send", "recv"}``, those reserved."""
        views = self.step_buffers("decode", step)
        return {key: views[f"decode.{item}"] for key, item in _DECODE_BUFFERS if f"decode.{item}" in views}

    def _case(self, kind: str, step: str, tokens: int) -> tuple[str, int, int, int]:
        """``(workspace mode, tokens, world_size, tp_size)`` of the planner's bounds for a step."""
        w = self.world_size
        if kind == "decode":
            # DCP: the group is the TP group (each rank holds H/W heads, gathers all H);
            # head-TP decode: no peers, H/W heads
            return ("dcp-decode", tokens, w, w) if step == "dcp" else ("headtp-decode", tokens, w, 1)
        return (step, tokens, w, 1)

    def needs(self, kind: str, step: str, tokens: int, topk: int) -> dict[str, int]:
        """``{"<kind>.<item>": bytes}`` the planner bounds for one step of ``tokens`` tokens and top-k ``topk``
        (memoised: a serving loop asks for the same few sizes every step)."""
        memo = (kind, step, tokens, topk)
        if memo in self._needs:
            return self._needs[memo]
        need: dict[str, int] = {}
        k = topk if self.spec.kind == "sparse_mla" else 0
        ws_mode, m, w, tp = self._case(kind, step, tokens)
        bounds = workspace_bounds(
            self.spec, max_batched_tokens=m, world_size=w, mode=ws_mode, tp_size=tp, topk=k, kv_dtype=self.kv_dtype
        )
        carved = () if (self.spec.kind == "gqa" and kind == "prefill") else STEP_ITEMS.get((kind, step))
        for name, nbytes in bounds.items.items():
            if nbytes and (carved is None or name in carved):
                need[f"{kind}.{name}"] = int(nbytes)
        if len(self._needs) < 4096:
            self._needs[memo] = need
        return need

    @property
    def shardq_possible(self) -> bool:
        """Whether a ShardQ step can be taken at all: never on one rank (nothing to shard: the step
        runs head-TP), nor when the ShardQ gate is above the largest step."""
        return self.world_size > 1 and self.min_shard_tokens <= self.max_batched_tokens

    def _steps(self) -> list[tuple[str, str, int]]:
        """``(kind, step, tokens)``: every step this config can take, at its largest (a ShardQ mode
        that can never shard reserves its head-TP step alone)."""
        steps: list[tuple[str, str, int]] = []
        prefill = prefill_step_of(self.spec.kind, self.mode)
        if prefill == "shardq" and not self.shardq_possible:
            prefill = "headtp"
        if prefill is not None:
            steps.append(("prefill", prefill, self.max_batched_tokens))
            if prefill == "shardq":  # steps below the gate run head-TP
                below = min(self.max_batched_tokens, max(0, self.min_shard_tokens - 1))
                below = below if self.headtp_tokens is None else max(below, self.headtp_tokens)
                if below:
                    steps.append(("prefill", "headtp", below))
        steps.append(("decode", DECODE_STEP[self.mode], self.max_decode_tokens))
        return steps

    def check(self, kind: str, step: str, *, tokens: int, topk: int | None = None) -> None:
        """Raise :class:`WorkspaceExceededError` when a step has more tokens or a wider top-k than the
        workspace was reserved for, or needs more of an item than was reserved.

        Args:
            kind: ``"prefill"`` or ``"decode"``. step: the parallel step (``"shardq"``,
                ``"headtp"``, ``"pcp"``, ``"dcp"``). tokens: the step's new / query tokens.
            topk: the step's top-k width (default: the config's).
        """
        k = self.topk if topk is None else topk
        limit = self.max_batched_tokens if kind == "prefill" else self.max_decode_tokens
        if tokens > limit:
            name = "max_batched_tokens" if kind == "prefill" else "max_decode_tokens"
            raise WorkspaceExceededError(
                f"a {kind} step of {tokens} tokens exceeds {name}={limit}, the size this Runtime reserved its "
                "workspace for; split the step or build the Runtime larger"
            )
        if k > self.topk:
            raise WorkspaceExceededError(
                f"a {kind} step's top-k width {k} exceeds topk={self.topk}, the width this Runtime reserved its "
                "workspace for and warmed its kernels up at; build the Runtime with topk >= the indexer's"
            )
        reserved = self.step_bounds.get((kind, step), {})
        for key, nbytes in self.needs(kind, step, tokens, k).items():
            have = reserved.get(key, 0)
            if nbytes > have:
                raise WorkspaceExceededError(
                    f"workspace item {key!r} needs {nbytes} B for this {step} step ({tokens} tokens, top-k {k}), "
                    f"but {have} B were reserved (max_batched_tokens={self.max_batched_tokens}, "
                    f"max_decode_tokens={self.max_decode_tokens}, topk={self.topk})"
                )
