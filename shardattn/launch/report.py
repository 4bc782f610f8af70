"""The launcher's report: one row per (rank, step), printed as a rich table and written as JSON.

A row holds what one rank did in one kind of step: its query tokens, the union ratio of its
grouped top-k rows (``|union of a group's rows| / mean |one query's rows|``, ``None`` when the
path does not group), the kernel path and why the router took it, the step time (median and
the 10th-90th percentile spread over the timed iterations), the throughput (effective TFLOP/s
for prefill, on real heads and valid top-k entries only; bytes of KV read per second for
decode) and, when checked, the largest error of the rows this rank computed against the
single-process reference.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from shardattn._paths import write_text

__all__ = [
    "WIDTH",
    "RankRow",
    "Report",
    "console_for",
    "percentile",
    "render",
    "render_compare",
    "save_json",
    "summarize_times",
    "write_json",
]


#: How a table column aligns its cells (a subset of rich's ``JustifyMethod``).
_Justify = Literal["left", "right"]


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` in [0, 100] of ``values`` (non-empty).

    >>> percentile([1.0, 2.0, 3.0, 4.0], 50)
    2.5
    """
    if not values:
        raise ValueError("values must not be empty")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize_times(seconds: Sequence[float]) -> tuple[float, float, float]:
    """``(median, p10, p90)`` of per-iteration times, in milliseconds.

    >>> summarize_times([0.001, 0.002, 0.003])
    (2.0, 1.2, 2.8)
    """
    ms = [s * 1e3 for s in seconds]
    return statistics.median(ms), round(percentile(ms, 10), 6), round(percentile(ms, 90), 6)


@dataclass
class RankRow:
    """What one rank did in one kind of step (see the module docstring)."""

    rank: int
    step: str
    path: str
    reason: str
    tokens: int
    time_ms: float
    time_p10_ms: float
    time_p90_ms: float
    union_ratio: float | None = None
    tflops: float | None = None
    gbytes_per_s: float | None = None
    error: float | None = None
    tolerance: float | None = None
    variant: str | None = None  # --compare: "head-TP", "ShardQ" or "router"

    @property
    def passed(self) -> bool | None:
        """``None`` when not checked, else whether the error is within the tolerance (NaN fails)."""
        if self.error is None or self.tolerance is None:
            return None
        return bool(self.error <= self.tolerance)  # NaN compares False


@dataclass
class Report:
    """The whole run: configuration, rows and notes; ``passed`` is ``False`` when any check failed."""

    config: dict[str, Any]
    rows: list[RankRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def checked(self) -> bool:
        return any(r.passed is not None for r in self.rows)

    @property
    def passed(self) -> bool:
        return all(r.passed is not False for r in self.rows)

    def to_dict(self) -> dict[str, Any]:
        rows = []
        for r in self.rows:
            d = asdict(r)
            d["passed"] = r.passed
            rows.append({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()})
        return {
            "config": self.config,
            "notes": self.notes,
            "rows": rows,
            "checked": self.checked,
            "passed": self.passed,
            **({"compare": compare_table(self)} if any(r.variant for r in self.rows) else {}),
        }


def _num(v: float | None, fmt: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return format(v, fmt)


#: Columns of the launcher's output when it is not a terminal (a terminal's own width otherwise).
WIDTH = 100


def console_for(file: Any = None) -> Any:
    """A rich console for the report: the terminal's width on a terminal, :data:`WIDTH` columns
    elsewhere (a pipe or a file), so the table fits a 100-column window either way."""
    from rich.console import Console

    probe = Console(file=file)
    return probe if probe.is_terminal else Console(file=file, width=WIDTH)


def _short(v: float | None) -> str:
    """A time or rate in about four significant digits (``12346``, ``215.8``, ``6.748``, ``0.012``)."""
    if v is None:
        return "-"
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    a = abs(v)
    return f"{v:.0f}" if a >= 1000 else f"{v:.1f}" if a >= 100 else f"{v:.2f}" if a >= 10 else f"{v:.3f}"


def _rate(r: RankRow) -> str:
    if r.tflops is not None:
        return f"{_short(r.tflops)} TFLOP/s"
    if r.gbytes_per_s is not None:
        return f"{_short(r.gbytes_per_s)} GB/s"
    return "-"


def _label(r: RankRow) -> str:
    return r.step if r.variant is None else f"{r.step} {r.variant}"


def _why(report: Report) -> list[tuple[str, str]]:
    """``(step and path, reason)`` per distinct (step, path, reason) in run order: the router's
    reason said once, however many ranks took that path (ranks that differ each get their own)."""
    seen: dict[tuple[str, str, str], list[int]] = {}
    for r in report.rows:
        seen.setdefault((_label(r), r.path, r.reason), []).append(r.rank)
    ranks = {r.rank for r in report.rows}
    lines = []
    for (label, path, reason), who in seen.items():
        scope = "" if set(who) == ranks else f" (rank{'s' if len(who) > 1 else ''} {', '.join(map(str, who))})"
        lines.append((f"{label} {path}{scope}:", reason))
    return lines


def render(report: Report, console: Any = None) -> None:
    """Print the report on ``console`` (default :func:`console_for`): a rich table of the ranks'
    rows (fits 100 columns), why each path was taken (once per path), the notes and the check
    verdict. Exact times and the per-item workspace are in the JSON report."""
    from rich import box
    from rich.table import Table

    if console is None:
        console = console_for()
    cfg = report.config
    title = " ".join(f"{k}={cfg[k]}" for k in ("preset", "mode", "world_size", "backend", "dtype") if k in cfg)
    table = Table(
        title=f"shardattn.launch  {title}", title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 0),
        collapse_padding=True, pad_edge=False,
    )  # fmt: skip
    columns: tuple[tuple[str, _Justify, bool], ...] = (
        ("rank", "right", False),
        ("step", "left", True),
        ("tokens", "right", False),
        ("union", "right", False),
        ("path", "left", True),
        ("median ms", "right", False),
        ("p10-p90 ms", "right", False),
        ("rate", "right", False),
        ("max err", "right", False),
    )
    for name, justify, wraps in columns:
        table.add_column(name, justify=justify, overflow="fold", no_wrap=not wraps)
    failed = False
    for r in report.rows:
        err = _num(r.error, ".1e")
        if r.passed is False:
            failed = True
            err = f"[bold red]{err} FAIL[/]"
        elif r.passed:
            err = f"[green]{err}[/]"
        table.add_row(
            str(r.rank),
            _label(r),
            str(r.tokens),
            _num(r.union_ratio, ".3f"),
            r.path,
            _short(r.time_ms),
            f"{_short(r.time_p10_ms)}-{_short(r.time_p90_ms)}",
            _rate(r),
            err,
        )
    console.print(table)
    why = _why(report)
    if why:  # the reasons, once per path: a grid wraps each under itself
        grid = Table.grid(padding=(0, 0, 0, 2))
        grid.add_column(no_wrap=True)
        grid.add_column(overflow="fold")
        for label, reason in why:
            grid.add_row(label, reason)
        console.print("why:", highlight=False)
        console.print(grid, highlight=False)
    for note in report.notes:
        console.print(f"note: {note}", highlight=False)
    if report.checked:
        tolerances = sorted({r.tolerance for r in report.rows if r.tolerance is not None})
        tol = ", ".join(f"{t:.0e}" for t in tolerances)
        if failed:
            console.print(f"[bold red]check FAILED[/]: errors above the tolerance {tol} (FAIL), against the "
                          "single-process fp32 reference on rank 0")  # fmt: skip
        else:
            console.print(f"[green]check passed[/] (within {tol} of the single-process fp32 reference on rank 0)")


def compare_table(report: Report) -> list[dict[str, Any]]:
    """``--compare``: one entry per variant, in run order: its path (rank 0's), the slowest rank's
    median ms and head-TP's median over it (above 1: faster than head-TP, measured in the same run).

    >>> rows = [RankRow(r, "prefill", p, "", 8, ms, ms, ms, variant=v)
    ...         for v, p, ms in (("head-TP", "headtp/x", 4.0), ("router", "shardq/x", 2.0)) for r in (0, 1)]
    >>> [(e["variant"], e["time_ms"], e["x_headtp"]) for e in compare_table(Report({}, rows))]
    [('head-TP', 4.0, 1.0), ('router', 2.0, 2.0)]
    """
    out: dict[str, dict[str, Any]] = {}
    for r in report.rows:
        if r.variant is None:
            continue
        e = out.setdefault(r.variant, {"variant": r.variant, "path": r.path, "reason": r.reason, "time_ms": 0.0})
        e["time_ms"] = max(e["time_ms"], r.time_ms)
        if r.rank == 0:
            e["path"], e["reason"] = r.path, r.reason
    base = out.get("head-TP", {}).get("time_ms")
    for e in out.values():
        e["x_headtp"] = base / e["time_ms"] if base and e["time_ms"] > 0 else None
    return list(out.values())


def render_compare(report: Report, console: Any = None) -> None:
    """Print the ``--compare`` table (:func:`compare_table`) after the per-rank table."""
    from rich import box
    from rich.table import Table

    if console is None:
        console = console_for()
    table = Table(title="prefill paths side by side (slowest rank)", title_justify="left", box=box.SIMPLE_HEAD)
    columns: tuple[tuple[str, _Justify], ...] = (
        ("variant", "left"), ("path", "left"), ("median ms", "right"), ("x head-TP", "right"),
    )  # fmt: skip
    for name, justify in columns:
        table.add_column(name, justify=justify)
    table.add_column("why", overflow="fold")
    for e in compare_table(report):
        table.add_row(e["variant"], e["path"], f"{e['time_ms']:.3f}", _num(e["x_headtp"], ".2f"), e["reason"])
    console.print(table)


def write_json(report: Report, path: str) -> None:
    """Write :meth:`Report.to_dict` to ``path`` (NaN and inf become ``null``)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(_json_text(report))


def _json_text(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=1) + "\n"


def save_json(report: Report, path: str) -> bool:
    """:func:`write_json`, or one line on stderr where the file system refuses it (the path was
    found writable before the run; a disk filled or a directory went away since), naming where
    the report was kept instead: whether it wrote ``path``."""
    refused = write_text(path, _json_text(report))
    if refused is not None:
        line = f"shardattn.launch: error: --json {path}: could not write the report ({refused})"
        print(line, file=sys.stderr, flush=True)
    return refused is None
