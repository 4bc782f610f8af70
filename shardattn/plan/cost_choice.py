"""The fastest predicted path of a prefill step, with the gates first (:func:`choose_prefill`).

:class:`~shardattn.plan.cost.CostModel` predicts every candidate; this module picks one and says
why, naming the predicted ms of the chosen and of the best rejected path. Pure host code.

>>> from shardattn.plan.calibration import CONSERVATIVE
>>> model = CostModel(CONSERVATIVE)
>>> shape = StepShape(heads=64, world_size=2, tokens=8192, topk=2048)
>>> choice = choose_prefill(model, shape, min_shard_tokens=1024)
>>> choice.best.name in {p.name for p in model.predict(shape)}
True
>>> choose_prefill(model, StepShape(heads=64, world_size=1, tokens=8192, topk=2048)).best.step
'headtp'
"""

from __future__ import annotations

from dataclasses import dataclass

from shardattn.plan.cost import CALIBRATE_COMMAND, CostModel, Prediction
from shardattn.plan.kv_format import DENSE_KV_FORMATS, kv_format_name
from shardattn.plan.step_shape import StepShape

__all__ = ["RouteChoice", "choose_prefill"]


@dataclass(frozen=True)
class RouteChoice:
    """The chosen prediction, the best rejected one (``None`` when nothing competed) and why."""

    best: Prediction
    rejected: Prediction | None
    reason: str


def choose_prefill(
    model: CostModel,
    shape: StepShape,
    *,
    min_shard_tokens: int = 1024,
    steps: tuple[str, ...] = ("headtp", "shardq"),
    allowed_groups: dict[str, tuple[int, ...]] | None = None,
) -> RouteChoice:
    """The fastest predicted path of a step, with the gates first: one rank, or fewer than
    ``min_shard_tokens`` new tokens, is head-TP (nothing to shard). ``allowed_groups[step]``
    limits the group sizes a step may take (default: every ``G`` that fits a tile).

    The reason names the predicted ms of the chosen and of the best rejected path, and for a step
    on ``fp8_ds_mla`` rows which kernel points priced it (the table's own of that format, else its
    bfloat16 ones, with the command that measures them).
    """
    if shape.world_size == 1 or shape.tokens < min_shard_tokens:
        why = "one rank" if shape.world_size == 1 else f"{shape.tokens} tokens < min_shard_tokens={min_shard_tokens}"
        steps = ("headtp",)
    else:
        why = ""
    preds = [
        p
        for p in model.predict(shape, steps=steps)
        if allowed_groups is None or p.group_size in allowed_groups.get(p.step, (p.group_size,))
    ]
    if not preds:
        preds = [model.predict_step(shape, steps[0], 1)]
    best = preds[0]
    rivals = [p for p in preds[1:] if p.step != best.step] or preds[1:]
    rejected = rivals[0] if rivals else None
    cal = model.calibration
    source = "the conservative default" if cal.conservative else cal.gpu
    text = f"cost model ({source}): {best.name} {best.ms:.2f} ms predicted"
    if rejected is not None:
        text += f", best rejected {rejected.name} {rejected.ms:.2f} ms"
    if why:
        text += f" ({why}: head-TP)"
    kv = None if shape.kv_format is None else kv_format_name("kv_format", shape.kv_format)
    if kv is not None and kv not in DENSE_KV_FORMATS:  # a dense format runs the bf16 kernels' code
        priced = model.kernel_format(kv)
        text += (
            f"; {kv} KV rows priced by its own kernel points"
            if priced == kv
            else f"; {kv} KV rows priced by the table's {priced} kernel points (it has none of {kv}: "
            f"measure them with `{CALIBRATE_COMMAND}`)"
        )
    rpn = shape.ranks_per_node
    if rpn is not None and rpn < shape.world_size and not why:
        net = model.network
        text += f"; ranks on several hosts, {rpn} on the smallest, network {net.busbw_gbps:g} GB/s ({net.name})"
    return RouteChoice(best, rejected, text)
