"""The Runtime's options beyond its model, group and sizes: :class:`PrefillOptions` and :class:`DecodeOptions`.

Both are frozen dataclasses, checked when built (a bad field raises ``TypeError`` /
``ValueError`` naming ``PrefillOptions.<field>`` before any Runtime exists), so one value
describes a configuration and can be compared, logged and reused across Runtimes. The defaults
are the planner's; the common case passes neither::

    rt = Runtime("glm5", tp_group, mode="mixed", max_batched_tokens=16384)
    rt = Runtime(
        "glm5", tp_group, mode="mixed", max_batched_tokens=16384,
        prefill_options=PrefillOptions(chunks=2, min_shard_tokens=2048),
        decode_options=DecodeOptions(dcp_interleave=4),
    )

>>> PrefillOptions(chunks=99)
Traceback (most recent call last):
...
ValueError: PrefillOptions.chunks must be in [1, 8], got 99
>>> DecodeOptions().causal, DecodeOptions().return_lse
(True, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shardattn._checks import check_bool, check_int
from shardattn.plan.cost import CostModel
from shardattn.plan.crossovers import DEFAULT_MIN_TOKENS
from shardattn.plan.pipeline import MAX_CHUNKS

__all__ = ["DecodeOptions", "PrefillOptions", "given_options"]


@dataclass(frozen=True)
class PrefillOptions:
    """How a Runtime routes, sizes and pipelines its sparse-MLA prefill steps.

    Attributes:
        max_kv_rows: the most KV-cache rows a prefill addresses (default ``max_batched_tokens * 16``);
            routes and warm-up cover both sides of the grouped path's ``2**24 - 1`` row limit anyway.
        min_shard_tokens: the ShardQ gate: steps with fewer new tokens run head-TP (default: the
            planner's, 1,024).
        min_group_tokens: the grouped kernel path's gate, tokens per kernel call (default 1,024).
        cost_model: how ``shardq`` / ``mixed`` steps above the ShardQ gate choose between ShardQ
            and head-TP (:mod:`~shardattn.plan.cost_route`): a
            :class:`~shardattn.plan.cost.CostModel`, a calibration file, ``"auto"`` (default: the
            table shipped for the GPU; none on the CPU) or ``None`` (ShardQ whenever the gate passes).
        chunks: pipeline depth of ShardQ steps: ``None`` (default) = the planner's
            :func:`~shardattn.plan.pipeline.choose_chunks` of each step; an int in
            ``[1, MAX_CHUNKS]`` forces it (1 = not pipelined). Every value gives the same bits.
        taper: cut pipelined ShardQ steps into tapered chunks (first and last half the middle
            ones; :func:`~shardattn.plan.pipeline.chunk_weights`). Opt-in; same bits.
        one_union: ShardQ steps build the union of the rank's whole share once, not one per
            chunk (:func:`~shardattn.parallel.shardq.shardq_prefill`'s ``one_union``). Opt-in.
        return_lse: :meth:`Runtime.prefill <shardattn.runtime.runtime.Runtime.prefill>` returns
            the LSE (default). ``False``: it returns ``(out, None)``, and a GQA step calls FA4's
            variant without one where no merge needs it (what an engine's prefill calls).
    """

    max_kv_rows: int | None = None
    min_shard_tokens: int = DEFAULT_MIN_TOKENS
    min_group_tokens: int = DEFAULT_MIN_TOKENS
    cost_model: CostModel | str | Path | None = "auto"
    chunks: int | None = None
    taper: bool = False
    one_union: bool = False
    return_lse: bool = True

    def __post_init__(self) -> None:
        if self.max_kv_rows is not None:
            check_int("PrefillOptions.max_kv_rows", self.max_kv_rows, minimum=1)
        check_int("PrefillOptions.min_shard_tokens", self.min_shard_tokens, minimum=0)
        check_int("PrefillOptions.min_group_tokens", self.min_group_tokens, minimum=0)
        if self.cost_model is not None and not isinstance(self.cost_model, CostModel | str | Path):
            raise TypeError(
                "PrefillOptions.cost_model must be a CostModel, 'auto', a calibration file or None, "
                f"got {type(self.cost_model).__name__}"
            )
        if self.chunks is not None:
            check_int("PrefillOptions.chunks", self.chunks)
            if not 1 <= self.chunks <= MAX_CHUNKS:
                raise ValueError(f"PrefillOptions.chunks must be in [1, {MAX_CHUNKS}], got {self.chunks}")
        check_bool("PrefillOptions.taper", self.taper)
        check_bool("PrefillOptions.one_union", self.one_union)
        check_bool("PrefillOptions.return_lse", self.return_lse)


@dataclass(frozen=True)
class DecodeOptions:
    """How a Runtime runs its decode steps.

    Attributes:
        dcp_interleave: DCP interleave size ``I``: KV tokens per rank block (token ``t`` lives on
            rank ``(t // I) % W``). Only the DCP modes read it.
        causal: speculative drafts of one request see each other causally (default); ``False``:
            every draft sees all the request's KV tokens (the graph policy follows).
        return_lse: :meth:`Runtime.decode <shardattn.runtime.runtime.Runtime.decode>` returns the
            LSE (default). ``False``: every decode step returns ``(out, None)``, in every mode and
            for both kinds of model. The step computes it all the same (the decode kernels write
            it, and DCP's merge across ranks needs it): the option drops it, it saves no work.
    """

    dcp_interleave: int = 1
    causal: bool = True
    return_lse: bool = True

    def __post_init__(self) -> None:
        check_int("DecodeOptions.dcp_interleave", self.dcp_interleave, minimum=1)
        check_bool("DecodeOptions.causal", self.causal)
        check_bool("DecodeOptions.return_lse", self.return_lse)


def given_options(prefill_options: object, decode_options: object) -> tuple[PrefillOptions, DecodeOptions]:
    """A Runtime's ``prefill_options`` / ``decode_options`` as passed, ``None`` the defaults; anything
    else than the dataclasses is a ``TypeError`` naming the argument.

    >>> given_options(None, DecodeOptions(dcp_interleave=4))[1].dcp_interleave
    4
    """
    for name, value, kind in (
        ("prefill_options", prefill_options, PrefillOptions),
        ("decode_options", decode_options, DecodeOptions),
    ):
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"{name} must be a {kind.__name__} or None, got {type(value).__name__}")
    prefill = PrefillOptions() if prefill_options is None else prefill_options
    decode = DecodeOptions() if decode_options is None else decode_options
    return prefill, decode  # type: ignore[return-value]
