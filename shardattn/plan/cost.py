"""A cost model of sparse-MLA prefill steps, from a calibration table: which path is fastest.

A prefill step of ``T`` new tokens with ``H`` heads on ``W`` ranks can run as

* **head-TP**: every rank runs its ``H / W`` heads over all ``T`` tokens, nothing moves;
* **ShardQ**: two all-to-alls turn head shards into token shards, every rank runs all ``H``
  heads over its ``~T / W`` zigzag tokens;
* **PCP**: every rank runs all heads of its own tokens after an all-gather of the new KV
  (its inputs are laid out differently, so only a ``pcp`` Runtime runs it; predicted here for
  comparison);

each with the per-query kernel or the grouped kernel at a group size ``G`` that fits the tile.
:class:`CostModel` predicts each candidate's step time::

    kernel(heads, G, tokens)                   fitted per (heads, tile, G) as a + b * tokens * topk
                                               from measured points; grouped slopes scale with the
                                               union ratio; heads between points interpolate,
                                               never falling as the heads grow
    + collectives(bytes, W)                    latency + bytes * (W - 1) / W / bus bandwidth;
                                               across hosts (``ranks_per_node < W``) the NVLink
                                               and network shares run side by side, the slower
                                               bounds it (:mod:`shardattn.plan.links`)
    + overhead                                 fixed_ms + factor * (X - hidden * min(X, kernel)),
                                               X = collectives + one read and one write of the
                                               moved bytes at the copy rate

``fixed_ms``, ``factor`` and ``hidden`` of each sharded step are fitted by ``python -m
shardattn.calibrate`` from whole steps measured on the machine (they hold the step's packing
copies and launches, and the share of its collectives a pipelined step hides behind its kernel),
so the model follows the implementation it was calibrated with.

The table and its loading live in :mod:`shardattn.plan.calibration` (re-exported here):
:func:`load_calibration` takes a file, else the table shipped for the GPU the caller names, else
:data:`CONSERVATIVE` with a :class:`CalibrationWarning` naming the command that measures one.
This module is pure host code: no torch, no GPU, no process group; the measurements live in
:mod:`shardattn.calibrate`.

The step's sizes are a :class:`~shardattn.plan.step_shape.StepShape`; the choice among the
predictions, with the gates, is :func:`~shardattn.plan.cost_choice.choose_prefill`'s.

>>> model = CostModel(CONSERVATIVE)
>>> shape = StepShape(heads=64, world_size=2, tokens=8192, topk=2048)
>>> [p.step for p in model.predict(shape)][0] in ("headtp", "shardq", "pcp")
True
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardattn._checks import check_choice, check_int
from shardattn.plan.calibration import (
    CALIBRATE_COMMAND,
    COLLECTIVES,
    CONSERVATIVE,
    FORMAT_VERSION,
    GROUPS,
    STEPS,
    TILE,
    Calibration,
    CalibrationWarning,
    CollectiveRate,
    KernelPoint,
    StepOverhead,
    candidate_group_sizes,
    load_calibration,
    shipped_calibration,
)
from shardattn.plan.kv_format import kv_format_name
from shardattn.plan.links import LinkRate, cross_node_rate, resolve_link
from shardattn.plan.step_shape import StepShape

__all__ = [
    "CALIBRATE_COMMAND",
    "CONSERVATIVE",
    "FORMAT_VERSION",
    "Calibration",
    "CalibrationWarning",
    "CollectiveRate",
    "CostModel",
    "KernelPoint",
    "Prediction",
    "StepOverhead",
    "candidate_group_sizes",
    "load_calibration",
    "shipped_calibration",
]


@dataclass(frozen=True)
class Prediction:
    """One candidate path and its predicted step time (ms), split into kernel, collectives and the rest."""

    step: str
    kernel: str
    group_size: int
    ms: float
    kernel_ms: float
    comm_ms: float
    other_ms: float

    @property
    def name(self) -> str:
        """``"<step>/<kernel>[ G=g]"``, e.g. ``"shardq/per-query"``, ``"headtp/grouped G=8"``."""
        return f"{self.step}/{self.kernel}" + (f" G={self.group_size}" if self.group_size > 1 else "")


class CostModel:
    """Predicts prefill step times from a :class:`Calibration` (module docstring).

    Args:
        calibration: the table. collective_overrides: ``{op: CollectiveRate}`` used on one host
            for every world size instead of the table's (``benchmarks/scaling.py --simulate`` sets
            the all-to-all rate this way).
        network: the rate between hosts: a :class:`~shardattn.plan.links.LinkRate` or a link type
            of :data:`~shardattn.plan.links.LINKS` (``"ib-ndr"``, ...); default: the table's
            measured one, else ``"ib-ndr"``'s line rate.
    """

    def __init__(
        self,
        calibration: Calibration,
        *,
        collective_overrides: dict[str, CollectiveRate] | None = None,
        network: LinkRate | str | None = None,
    ) -> None:
        if not isinstance(calibration, Calibration):
            raise TypeError(f"calibration must be a Calibration, got {type(calibration).__name__}")
        calibration.validate()
        self.calibration = calibration
        self.overrides = _checked_overrides(collective_overrides)
        self.network = resolve_link(network, calibration.network)
        self._fits: dict[tuple[str, int, int, int], tuple[float, float, float]] = {}
        groups: dict[tuple[str, int, int, int], list[KernelPoint]] = {}
        for k in calibration.kernels:
            groups.setdefault((k.kv_format, k.heads, k.tile, k.group_size), []).append(k)
        for key, pts in groups.items():
            self._fits[key] = _fit_line(pts)

    def kernel_format(self, kv_format: str | None) -> str:
        """The KV format whose kernel points price calls on ``kv_format`` rows: its own where the
        table holds per-query points of it, else ``"bfloat16"`` (a table measured without
        ``--kv-dtype fp8_ds_mla``: ``python -m shardattn.calibrate``)."""
        fmt = "bfloat16" if kv_format is None else kv_format_name("kv_format", kv_format)
        return fmt if any(f == fmt and g == 1 for (f, _h, _t, g) in self._fits) else "bfloat16"

    def __repr__(self) -> str:
        return f"CostModel({self.calibration.gpu!r}, {len(self.calibration.kernels)} kernel points)"

    # -- parts -------------------------------------------------------------------------------
    def kernel_ms(
        self,
        heads: int,
        tokens: int,
        topk: int,
        *,
        group_size: int = 1,
        union_ratio: float | None = None,
        kv_format: str | None = None,
    ) -> float:
        """Predicted time of one kernel call on ``kv_format`` rows (:meth:`kernel_format`: its own
        points, else bf16's; heads between calibrated counts interpolate linearly; below the
        smallest, the smallest's time (tiles pad); above the largest, proportional). A calibrated
        count is priced at least at any smaller count's fit (a table's 8-head points can be slower
        than its 16-head ones), so the time never falls as the heads grow. ``group_size``:
        1 (per-query) or a grouped size of :data:`~shardattn.plan.calibration.GROUPS`."""
        _check_group_size(group_size)
        check_int("heads", heads, minimum=1)
        check_int("tokens", tokens, minimum=0)
        check_int("topk", topk, minimum=0)
        if tokens == 0 or topk == 0:
            return 0.0
        g = group_size
        tile = TILE
        fmt = self.kernel_format(kv_format)
        hs = sorted(h for (f, h, t, gg) in self._fits if f == fmt and gg == g and t == tile)
        if not hs:  # this G was not calibrated: the per-query kernel scaled by union / G (optimistic)
            u = union_ratio or self.calibration.union_ratio.get(g, float(g))
            return self.kernel_ms(heads, tokens, topk, kv_format=fmt) * u / g
        work = tokens * topk

        def line(h: int) -> float:
            a, b, u_cal = self._fits[(fmt, h, tile, g)]
            scale = 1.0 if g == 1 or union_ratio is None else union_ratio / u_cal
            return a + b * work * scale

        def at(h: int) -> float:  # the slowest calibrated count up to h: more heads never price cheaper
            return max(line(x) for x in hs if x <= h)

        if heads <= hs[0]:
            return at(hs[0])
        if heads >= hs[-1]:
            return at(hs[-1]) * heads / hs[-1]
        hi = next(h for h in hs if h >= heads)
        lo = max(h for h in hs if h <= heads)
        if hi == lo:
            return at(lo)
        w = (heads - lo) / (hi - lo)
        return at(lo) * (1 - w) + at(hi) * w

    def collective(self, op: str, world_size: int, ranks_per_node: int | None = None) -> CollectiveRate:
        """The rate of ``op`` at ``world_size`` ranks, ``ranks_per_node`` on each host (``None``: one host).

        On one host: an override, the table's, or the nearest world size's. Across hosts: the
        table's rate measured at that layout, else the one-host rate of ``ranks_per_node`` ranks
        and :attr:`network` combined (:func:`~shardattn.plan.links.cross_node_rate`).
        """
        check_choice("op", op, COLLECTIVES)
        check_int("world_size", world_size, minimum=1)
        if ranks_per_node is not None:
            check_int("ranks_per_node", ranks_per_node, minimum=1)
        if ranks_per_node is None or ranks_per_node >= world_size:
            return self._one_host(op, world_size)
        measured = [
            c
            for c in self.calibration.collectives
            if c.op == op and c.world_size == world_size and c.ranks_per_node == ranks_per_node
        ]
        if measured:
            return measured[0]
        nvlink = self._one_host(op, max(2, ranks_per_node))
        lat, gbps = cross_node_rate(
            op,
            world_size,
            ranks_per_node,
            nvlink_latency_ms=nvlink.latency_ms,
            nvlink_gbps=nvlink.busbw_gbps,
            link=self.network,
        )
        return CollectiveRate(op, world_size, lat, gbps, ranks_per_node)

    def _one_host(self, op: str, world_size: int) -> CollectiveRate:
        if op in self.overrides:
            return replace(self.overrides[op], world_size=world_size, ranks_per_node=None)
        rates = [c for c in self.calibration.collectives if c.op == op and c.one_host]
        if not rates:
            rates = [c for c in CONSERVATIVE.collectives if c.op == op]
        exact = [c for c in rates if c.world_size == world_size]
        best = exact[0] if exact else min(rates, key=lambda c: abs(c.world_size - world_size))
        return replace(best, world_size=world_size, ranks_per_node=None)

    def collective_ms(self, op: str, nbytes: float, world_size: int, ranks_per_node: int | None = None) -> float:
        """Predicted ms of collective ``op`` moving ``nbytes`` per rank (:meth:`collective`'s rate)."""
        return self.collective(op, world_size, ranks_per_node).ms(nbytes)

    def _ratio(self, shape: StepShape, g: int) -> float | None:
        if g == 1:
            return None
        if shape.union_ratio and g in shape.union_ratio:
            return shape.union_ratio[g]
        return self.calibration.union_ratio.get(g)

    def _overhead(self, step: str) -> StepOverhead:
        return self.calibration.steps.get(step, CONSERVATIVE.steps.get(step, StepOverhead()))

    # -- steps -------------------------------------------------------------------------------
    def predict_step(self, shape: StepShape, step: str, group_size: int = 1) -> Prediction:
        """Predict one candidate: ``step`` in ``headtp`` / ``shardq`` / ``pcp`` with kernel group size ``G``
        (1, or a grouped size of :data:`~shardattn.plan.calibration.GROUPS`). At one rank every step
        is head-TP's (nothing to shard); ``step`` and ``group_size`` are checked all the same."""
        if not isinstance(shape, StepShape):
            raise TypeError(f"shape must be a StepShape, got {type(shape).__name__}")
        if step not in STEPS:
            raise ValueError(f"step must be 'headtp', 'shardq' or 'pcp', got {step!r}")
        _check_group_size(group_size)
        w, h, e = shape.world_size, shape.heads, shape.dtype_bytes
        g = group_size
        kernel = "per-query" if g == 1 else "grouped"
        fmt = shape.kv_format
        if step == "headtp" or w == 1:
            k_ms = self.kernel_ms(
                h // w, shape.tokens, shape.topk, group_size=g, union_ratio=self._ratio(shape, g), kv_format=fmt
            )
            ov = self._overhead("headtp")
            return Prediction("headtp", kernel, g, k_ms + ov.fixed_ms, k_ms, 0.0, ov.fixed_ms)
        k_ms = self.kernel_ms(
            h, shape.per_rank, shape.topk, group_size=g, union_ratio=self._ratio(shape, g), kv_format=fmt
        )
        q_bytes = shape.tokens * (h // w) * shape.head_dim * e  # this rank's heads of every token
        out_bytes = shape.tokens * (h // w) * (shape.v_dim * e + 4)  # output and fp32 LSE
        rpn = shape.ranks_per_node
        if step == "shardq":
            comm = sum(self.collective_ms("all_to_all", n, w, rpn) for n in (q_bytes, out_bytes))
            moved = q_bytes + out_bytes
        else:  # PCP: all-gather of the new tokens' KV rows; q and out stay on their rank
            comm = self.collective_ms("all_gather", shape.tokens * shape.kv_row_bytes, w, rpn)
            moved = shape.tokens * shape.kv_row_bytes + shape.per_rank * h * (shape.v_dim * e + 4)
        copy_ms = 2 * moved / (self.calibration.copy_gbps * 1e9) * 1e3
        ov = self._overhead(step)
        other = ov.ms(comm + copy_ms, k_ms) - comm
        return Prediction(step, kernel, g, k_ms + comm + other, k_ms, comm, other)

    def predict(
        self, shape: StepShape, *, steps: tuple[str, ...] = ("headtp", "shardq", "pcp"), grouping: bool = True
    ) -> list[Prediction]:
        """Every candidate of ``steps`` (per-query, and each grouped ``G`` that fits a tile), fastest first."""
        out = []
        for step in steps:
            if step != "headtp" and shape.world_size == 1:
                continue
            heads = shape.heads if step != "headtp" else shape.heads // shape.world_size
            sizes = candidate_group_sizes(heads) if grouping else (1,)
            out += [self.predict_step(shape, step, g) for g in sizes]
        return sorted(out, key=lambda p: p.ms)


def _checked_overrides(overrides: object) -> dict[str, CollectiveRate]:
    """``collective_overrides`` checked: ``{op: CollectiveRate of that op}`` with valid rates."""
    if overrides is None:
        return {}
    if not isinstance(overrides, dict):
        raise TypeError(f"collective_overrides must be a dict of op -> CollectiveRate, got {type(overrides).__name__}")
    for op, rate in overrides.items():
        check_choice("collective_overrides' op", op, COLLECTIVES)
        if not isinstance(rate, CollectiveRate) or rate.op != op:
            raise TypeError(f"collective_overrides[{op!r}] must be a CollectiveRate of op {op!r}, got {rate!r}")
        if not (0 < rate.busbw_gbps < float("inf") and 0 <= rate.latency_ms < float("inf")):
            raise ValueError(f"collective_overrides[{op!r}]: rates must be finite, bus bandwidth > 0, got {rate}")
    return dict(overrides)


def _check_group_size(group_size: object) -> int:
    """``group_size``: 1 (per-query) or a grouped size of :data:`GROUPS`."""
    g = check_int("group_size", group_size, minimum=1)
    check_choice("group_size", g, (1, *GROUPS))
    return g


def _fit_line(points: list[KernelPoint]) -> tuple[float, float, float]:
    """``(a, b, union_ratio)`` of ``ms = a + b * tokens * topk`` by least squares (``a >= 0``)."""
    xs = [p.tokens * p.topk for p in points]
    ys = [p.ms for p in points]
    u = sum(p.union_ratio for p in points) / len(points)
    if len(set(xs)) < 2:
        return 0.0, sum(ys) / sum(xs), u
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    if a < 0 or b <= 0:  # keep the line through the origin rather than a negative intercept
        return 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs), u
    return a, b, u
