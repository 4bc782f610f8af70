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
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

from shardattn._ints import next_pow2
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
    "candidate_group_sizes",
    "load_calibration",
    "same_gpu",
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
COLLECTIVES = ("all_to_all", "all_gather")
"""The collectives a table rates (ShardQ's exchanges, PCP's all-gather)."""
STEPS = ("headtp", "shardq", "pcp")
"""The steps a table holds overheads of (:meth:`shardattn.plan.cost.CostModel.predict_step`'s)."""


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
    with ``X`` = its collectives and copies (``hidden``: the share that overlaps the kernel; a table keeps
    ``factor * hidden <= 1``, so no step hides more than its kernel lasts)."""

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
        """Parse and validate a table. Raises ``ValueError`` naming what is wrong: not JSON, an
        unknown format, a field missing, unknown (a misspelt name) or of the wrong JSON type, or a
        value :meth:`validate` refuses. Optional fields: a kernel point's ``kv_format``, a rate's
        ``ranks_per_node``, a step's ``hidden`` (0), ``source``, ``conservative``, ``network``."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON: {e}") from None
        except RecursionError:  # arrays or objects nested past the parser's depth
            raise ValueError("not a calibration table: JSON nested too deeply to read") from None
        d = _fields(d, "the table", _TABLE_FIELDS, optional=("source", "conservative", "network"))
        if d["format"] not in READABLE_FORMATS:
            raise ValueError(f"format {d['format']!r}, expected one of {READABLE_FORMATS}")
        kernels, colls = d["kernels"], d["collectives"]
        for name, value in (("kernels", kernels), ("collectives", colls), ("union_ratio", d["union_ratio"])):
            if not isinstance(value, list if name != "union_ratio" else dict):
                raise ValueError(f"{name} must be a JSON {'array' if name != 'union_ratio' else 'object'}")
        steps = d["steps"]
        if not isinstance(steps, dict):
            raise ValueError("steps must be a JSON object of step -> overhead")
        union = {}
        for g, u in d["union_ratio"].items():
            if not (g.isascii() and g.isdigit()) or not _is_number(u):  # "²" is a digit int() refuses
                raise ValueError(f"union_ratio must map a group size to a number, got {g!r}: {u!r}")
            union[int(g)] = float(u)
        network = d.get("network")
        cal = cls(
            gpu=d["gpu"],
            kernels=tuple(KernelPoint(**_fields(k, "a kernel point", _POINT_FIELDS, ("kv_format",))) for k in kernels),
            collectives=tuple(
                CollectiveRate(**_fields(c, "a collective rate", _RATE_FIELDS, ("ranks_per_node",))) for c in colls
            ),
            copy_gbps=float(d["copy_gbps"]),
            union_ratio=union,
            steps={k: StepOverhead(**_fields(v, f"steps.{k}", _STEP_FIELDS, ("hidden",))) for k, v in steps.items()},
            source=d.get("source", ""),
            conservative=d.get("conservative", False),
            network=None if network is None else LinkRate(**_fields(network, "network", _LINK_FIELDS, ("source",))),
        )
        cal.validate()
        return cal

    def validate(self) -> None:
        """Raise ``ValueError`` unless every rate is finite and positive, a per-query point exists and
        no collective has two rates at one layout."""
        if not any(k.group_size == 1 and k.kv_format == "bfloat16" for k in self.kernels):
            raise ValueError("the table has no per-query kernel point on bfloat16 rows")
        for k in self.kernels:
            if min(k.heads, k.tile, k.group_size, k.tokens, k.topk) < 1 or not (k.ms > 0 and math.isfinite(k.ms)):
                raise ValueError(f"bad kernel point {k}")
            if k.tile != TILE or k.group_size not in candidate_group_sizes(k.heads):  # what the kernels run
                raise ValueError(
                    f"bad kernel point {k}: tile must be {TILE} and group_size one whose queries fit it "
                    f"({candidate_group_sizes(k.heads)} at {k.heads} heads)"
                )
            if k.kv_format not in KV_FORMATS:
                raise ValueError(f"bad KV format {k.kv_format!r} in {k} (one of {', '.join(KV_FORMATS)})")
            if not (k.union_ratio >= 1.0 and math.isfinite(k.union_ratio)):
                raise ValueError(f"bad union ratio in {k}")
        seen: set[tuple[str, int, int | None]] = set()
        for c in self.collectives:
            layout = (c.op, c.world_size, c.ranks_per_node)
            if layout in seen:  # the model would take the first and ignore the other silently
                raise ValueError(
                    f"bad collective rate {c}: a second rate of {c.op} at this world_size and ranks_per_node"
                )
            seen.add(layout)
            if c.op not in COLLECTIVES:
                raise ValueError(f"bad collective rate {c}: op must be one of {COLLECTIVES}")
            if c.world_size < 2 or not (_finite(c.busbw_gbps) > 0 and _finite(c.latency_ms) >= 0):
                raise ValueError(f"bad collective rate {c}")
            rpn = c.ranks_per_node
            if rpn is not None and (isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 1 or c.world_size % rpn):
                raise ValueError(f"bad collective rate {c}: ranks_per_node must divide world_size")
        if self.network is not None:
            self.network.validate()
        if not (self.copy_gbps > 0 and math.isfinite(self.copy_gbps)):
            raise ValueError(f"bad copy_gbps {self.copy_gbps}")
        for g, u in self.union_ratio.items():
            if g not in GROUPS or not _finite(u) >= 1.0:
                raise ValueError(f"bad union ratio {u} at G={g}")
        for name, s in self.steps.items():
            if name not in STEPS:
                raise ValueError(f"bad step overhead {name!r}: steps are {STEPS}")
            if not (_finite(s.fixed_ms) >= 0 and _finite(s.factor) >= 0 and 0 <= _finite(s.hidden) <= 1):
                raise ValueError(f"bad step overhead {name}: {s}")
            if s.factor * s.hidden > 1:  # it would hide more than the kernel lasts: a larger step predicted faster
                raise ValueError(
                    f"bad step overhead {name}: {s}: factor * hidden must be <= 1 (a step hides at most its kernel's "
                    f"time), got {s.factor * s.hidden:g}"
                )


def candidate_group_sizes(heads: int, *, tile: int = TILE) -> tuple[int, ...]:
    """Group sizes whose ``G`` queries of ``heads`` (padded to a power of two) fit one tile, 1 first.

    >>> candidate_group_sizes(8), candidate_group_sizes(32), candidate_group_sizes(64)
    ((1, 2, 4, 8), (1, 2), (1,))
    """
    padded = next_pow2(heads)
    return (1, *(g for g in GROUPS if g * padded <= tile))


def _finite(x: float) -> float:
    """``x``, or NaN where it is not finite (every comparison with it fails)."""
    return x if math.isfinite(x) else math.nan


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# JSON type of each field: int, a finite number (int or float), str, bool, or int / null
_INT, _NUM, _STR, _BOOL = "an integer", "a finite number", "a string", "true or false"
_INT_OR_NULL = "an integer or null"
_POINT_FIELDS = {"heads": _INT, "tile": _INT, "group_size": _INT, "union_ratio": _NUM, "tokens": _INT, "topk": _INT,
                 "ms": _NUM, "kv_format": _STR}  # fmt: skip
_RATE_FIELDS = {"op": _STR, "world_size": _INT, "latency_ms": _NUM, "busbw_gbps": _NUM, "ranks_per_node": _INT_OR_NULL}
_STEP_FIELDS = {"fixed_ms": _NUM, "factor": _NUM, "hidden": _NUM}
_LINK_FIELDS = {"name": _STR, "latency_ms": _NUM, "busbw_gbps": _NUM, "source": _STR}
_TABLE_FIELDS = {"format": _INT, "gpu": _STR, "kernels": None, "collectives": None, "copy_gbps": _NUM,
                 "union_ratio": None, "steps": None, "source": _STR, "conservative": _BOOL,
                 "network": None}  # fmt: skip


def _has_type(value: object, kind: str) -> bool:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if kind == _INT:
        return is_int
    if kind == _INT_OR_NULL:
        return value is None or is_int
    if kind == _NUM:
        return _is_number(value)
    return isinstance(value, str if kind == _STR else bool)


def _fields(d: object, where: str, types: Mapping[str, str | None], optional: tuple[str, ...]) -> dict:
    """``d`` checked as a JSON object of exactly ``types``' fields (``optional`` may be absent),
    each of its JSON type (``None``: checked by the caller). Raises ``ValueError`` naming ``where``."""
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(d).__name__}")
    unknown = sorted(set(d) - set(types))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown} (fields: {', '.join(types)})")
    missing = [k for k in types if k not in d and k not in optional]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}")
    for k, v in d.items():
        kind = types[k]
        if kind is not None and not _has_type(v, kind):
            raise ValueError(f"{where}: {k} must be {kind}, got {v!r}")
    return d


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


def same_gpu(a: str, b: str) -> bool:
    """Whether two GPU names are one (case and spacing aside: ``"NVIDIA  h200"`` is ``"NVIDIA H200"``)."""
    return " ".join(a.lower().split()) == " ".join(b.lower().split())


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
        if same_gpu(cal.gpu, gpu_name):
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
        except (OSError, UnicodeDecodeError, ValueError, TypeError) as e:
            _warn(f"calibration file {p} is unusable ({e})")
            return CONSERVATIVE
        if gpu_name is None or same_gpu(cal.gpu, gpu_name):
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
