"""The cost model's calibration table: measured kernel points, collective rates, step overheads.

A table is JSON (:meth:`Calibration.to_json` / :meth:`Calibration.from_json`, validated).
:func:`load_calibration` takes a file, else the table shipped for the GPU the caller names
(``shardattn/plan/data/*.json``), else :data:`CONSERVATIVE` with a :class:`CalibrationWarning`
naming the command that measures one (``python -m shardattn.calibrate``). Pure host code.

Format 2 adds what a table measured across hosts holds: a collective rate's ``ranks_per_node``
(absent or ``null``: every rank on one host, as in format 1) and the ``network`` rate between
hosts (:class:`~shardattn.plan.links.LinkRate`; absent: the cost model assumes a link type's
default). Format 1 tables are read as they are.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

from shardattn.errors import CalibrationWarning
from shardattn.plan.kv_format import KV_FORMATS
from shardattn.plan.links import LinkRate

__all__ = [
    "CALIBRATE_COMMAND",
    "CONSERVATIVE",
    "FORMAT_VERSION",
    "Calibration",
    "CalibrationWarning",
    "CollectiveRate",
    "KernelPoint",
    "StepOverhead",
    "load_calibration",
    "shipped_calibration",
]

FORMAT_VERSION = 2
#: Formats :meth:`Calibration.from_json` reads (1: one host only; 2: ranks per node and the network).
READABLE_FORMATS = (1, 2)
CALIBRATE_COMMAND = "torchrun --nproc-per-node <W> -m shardattn.calibrate --out FILE"
"""How to measure a table on the current machine (``W`` = the ranks the steps will run on)."""
_DATA = "data"
TILE = 64
"""Rows of the Triton kernel's grouped tile (``plan.routing.TILE_ROWS``), the ``tile`` of its points."""
GROUPS = (2, 4, 8)
"""Group sizes the membership byte allows (``plan.routing.GROUP_SIZES``)."""


@dataclass(frozen=True)
class KernelPoint:
    """One measured prefill kernel call (union build or row sort included, as the steps call it).

    Attributes:
        heads: query heads of the call. tile: rows of the grouped backend's tile.
        group_size: ``G`` (1 = per-query). union_ratio: mean union of a group's rows over one
            query's (1.0 for per-query). tokens: query tokens. topk: valid keys per query. ms: time.
        kv_format: the KV rows the kernel read (:data:`shardattn.plan.kv_format.KV_FORMATS`; a
            table written before the key existed holds ``"bfloat16"`` points).
    """

    heads: int
    tile: int
    group_size: int
    union_ratio: float
    tokens: int
    topk: int
    ms: float
    kv_format: str = "bfloat16"


@dataclass(frozen=True)
class CollectiveRate:
    """``op`` (``"all_to_all"`` / ``"all_gather"``) on ``world_size`` ranks: ``latency_ms + moved / busbw``.

    ``ranks_per_node``: ranks on each host where it was measured across hosts (``None``: every
    rank on one host)."""

    op: str
    world_size: int
    latency_ms: float
    busbw_gbps: float
    ranks_per_node: int | None = None

    @property
    def one_host(self) -> bool:
        return self.ranks_per_node is None or self.ranks_per_node >= self.world_size

    def ms(self, nbytes: float) -> float:
        """Time of one collective over ``nbytes`` per rank (of which ``(W-1)/W`` leave the rank)."""
        if self.world_size <= 1 or nbytes <= 0:
            return 0.0
        moved = nbytes * (self.world_size - 1) / self.world_size
        return self.latency_ms + moved / (self.busbw_gbps * 1e9) * 1e3


@dataclass(frozen=True)
class StepOverhead:
    """What a step costs beyond its kernel: ``fixed_ms + factor * (X - hidden * min(X, kernel))``
    with ``X`` = its collectives and copies (``hidden``: the share that overlaps the kernel)."""

    fixed_ms: float = 0.0
    factor: float = 1.0
    hidden: float = 0.0

    def ms(self, exposed: float, kernel_ms: float) -> float:
        """The overhead of a step with ``exposed`` ms of collectives and copies and a ``kernel_ms`` kernel."""
        return self.fixed_ms + self.factor * (exposed - self.hidden * min(exposed, kernel_ms))


@dataclass(frozen=True)
class Calibration:
    """A calibration table (see the module docstring); ``conservative`` marks the fallback."""

    gpu: str
    kernels: tuple[KernelPoint, ...]
    collectives: tuple[CollectiveRate, ...]
    copy_gbps: float
    union_ratio: dict[int, float]
    steps: dict[str, StepOverhead] = field(default_factory=dict)
    source: str = ""
    conservative: bool = False
    network: LinkRate | None = None

    def to_json(self) -> str:
        """The table as JSON (the format :meth:`from_json` reads)."""
        d = asdict(self)
        d["format"] = FORMAT_VERSION
        d["union_ratio"] = {str(k): v for k, v in self.union_ratio.items()}
        return json.dumps(d, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        """Parse and validate a table. Raises ``ValueError`` naming what is wrong."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError("the table must be a JSON object")
        if d.get("format") not in READABLE_FORMATS:
            raise ValueError(f"format {d.get('format')!r}, expected one of {READABLE_FORMATS}")
        try:
            kernels = tuple(KernelPoint(**k) for k in d["kernels"])
            colls = tuple(CollectiveRate(**c) for c in d["collectives"])
            steps = {k: StepOverhead(**v) for k, v in d.get("steps", {}).items()}
            network = None if d.get("network") is None else LinkRate(**d["network"])
            cal = cls(
                gpu=str(d["gpu"]),
                kernels=kernels,
                collectives=colls,
                copy_gbps=float(d["copy_gbps"]),
                union_ratio={int(k): float(v) for k, v in d["union_ratio"].items()},
                steps=steps,
                source=str(d.get("source", "")),
                conservative=bool(d.get("conservative", False)),
                network=network,
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"missing or malformed field: {e}") from None
        cal.validate()
        return cal

    def validate(self) -> None:
        """Raise ``ValueError`` unless every rate is finite and positive and a per-query point exists."""
        if not any(k.group_size == 1 and k.kv_format == "bfloat16" for k in self.kernels):
            raise ValueError("the table has no per-query kernel point on bfloat16 rows")
        for k in self.kernels:
            if min(k.heads, k.tile, k.group_size, k.tokens, k.topk) < 1 or not (k.ms > 0 and math.isfinite(k.ms)):
                raise ValueError(f"bad kernel point {k}")
            if k.kv_format not in KV_FORMATS:
                raise ValueError(f"bad KV format {k.kv_format!r} in {k} (one of {', '.join(KV_FORMATS)})")
            if not (k.union_ratio >= 1.0 and math.isfinite(k.union_ratio)):
                raise ValueError(f"bad union ratio in {k}")
        for c in self.collectives:
            if c.world_size < 2 or not (c.busbw_gbps > 0 and c.latency_ms >= 0):
                raise ValueError(f"bad collective rate {c}")
            rpn = c.ranks_per_node
            if rpn is not None and (isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 1 or c.world_size % rpn):
                raise ValueError(f"bad collective rate {c}: ranks_per_node must divide world_size")
        if self.network is not None:
            self.network.validate()
        if not (self.copy_gbps > 0 and math.isfinite(self.copy_gbps)):
            raise ValueError(f"bad copy_gbps {self.copy_gbps}")
        for g, u in self.union_ratio.items():
            if g not in GROUPS or not u >= 1.0:
                raise ValueError(f"bad union ratio {u} at G={g}")
        for name, s in self.steps.items():
            if not (s.fixed_ms >= 0 and s.factor >= 0 and 0 <= s.hidden <= 1):
                raise ValueError(f"bad step overhead {name}: {s}")


def _h200_points() -> tuple[KernelPoint, ...]:
    """Kernel steps measured on one H200 on 2026-11-29 (``benchmarks/sparse_prefill.py`` of that
    day, DSA-like top-k 2048): per-query (row sort + kernel) and grouped (merge union + kernel)."""
    perq = {8: (2.217, 8.516), 16: (2.121, 8.151), 32: (2.895, 11.15), 64: (4.614, 17.89), 128: (8.826, 35.05)}
    grouped = {(8, 8, 1.44): (1.538, 6.130), (16, 4, 1.30): (2.224, 8.875), (32, 2, 1.16): (3.391, 13.33)}
    pts = [KernelPoint(h, TILE, 1, 1.0, t, 2048, ms) for h, v in perq.items() for t, ms in zip((4096, 16384), v)]
    pts += [
        KernelPoint(h, TILE, g, u, t, 2048, ms) for (h, g, u), v in grouped.items() for t, ms in zip((4096, 16384), v)
    ]
    return tuple(pts)


CONSERVATIVE = Calibration(
    gpu="default (conservative)",
    kernels=_h200_points(),
    # a PCIe-class link: ShardQ and PCP must win by a wide margin before the model takes them
    collectives=(CollectiveRate("all_to_all", 2, 0.05, 20.0), CollectiveRate("all_gather", 2, 0.05, 20.0)),
    copy_gbps=1000.0,
    union_ratio={2: 1.16, 4: 1.30, 8: 1.44},
    steps={"headtp": StepOverhead(0.05, 1.0), "shardq": StepOverhead(0.2, 2.5), "pcp": StepOverhead(0.2, 2.5)},
    source="built in: H200 kernel rates of 2026-11-29, PCIe-class collectives (20 GB/s), overhead factor 2.5",
    conservative=True,
)
"""The fallback table: H200 kernel rates with slow collectives (favours head-TP)."""


def _warn(message: str) -> None:
    warnings.warn(
        f"{message}; using the conservative default cost model (it favours head-TP). "
        f"Measure this machine with `{CALIBRATE_COMMAND}` and pass the file.",
        CalibrationWarning,
        stacklevel=3,
    )


def _norm(name: str) -> str:
    return " ".join(name.lower().split())


def shipped_calibration(gpu_name: str) -> Calibration | None:
    """The table shipped with the package for ``gpu_name`` (e.g. ``"NVIDIA H200"``), or ``None``."""
    try:
        files = [f for f in resources.files("shardattn.plan").joinpath(_DATA).iterdir() if f.name.endswith(".json")]
    except (FileNotFoundError, OSError, ModuleNotFoundError):
        return None
    for f in sorted(files, key=lambda f: f.name):
        try:
            cal = Calibration.from_json(f.read_text())
        except (ValueError, OSError):
            continue
        if _norm(cal.gpu) == _norm(gpu_name):
            return cal
    return None


def load_calibration(gpu_name: str | None, path: str | Path | None = None) -> Calibration:
    """The calibration for ``gpu_name`` (``None``: no GPU): the file ``path`` when given (missing,
    corrupt or measured on another GPU: a :class:`CalibrationWarning` naming the file and the
    problem, and :data:`CONSERVATIVE`; never an exception); without a file, the table shipped for
    that GPU, else :data:`CONSERVATIVE` with a warning.
    """
    if path is not None:
        p = Path(path)
        try:
            cal = Calibration.from_json(p.read_text())
        except FileNotFoundError:
            _warn(f"calibration file {p} does not exist")
            return CONSERVATIVE
        except (OSError, UnicodeDecodeError, ValueError) as e:
            _warn(f"calibration file {p} is unusable ({e})")
            return CONSERVATIVE
        if gpu_name is None or _norm(cal.gpu) == _norm(gpu_name):
            return cal
        _warn(f"calibration file {p} was measured on {cal.gpu!r}, not on this {gpu_name!r}")
        return CONSERVATIVE
    if gpu_name is None:
        return CONSERVATIVE
    shipped = shipped_calibration(gpu_name)
    if shipped is not None:
        return shipped
    _warn(f"no calibration table ships for GPU {gpu_name!r}")
    return CONSERVATIVE
