"""The one record format every benchmark writes with ``--json PATH``, and the table it prints.

A record is one measured number beside the baseline measured in the same run::

    {
      "benchmark": "sparse-prefill",            # the operation: one table of docs/PERFORMANCE.md
      "config": {"heads": 64, "tokens": 4096},  # what was run (str / int / float / bool values)
      "metric": "kernel TFLOP/s",
      "value": 639.0,
      "unit": "TFLOP/s",
      "better": "higher",                       # "higher", "lower" or "none" (e.g. a prediction)
      "baseline": {"name": "FlashMLA, same run", "value": 625.0},   # or null
      "ratio": 1.022,                           # or null; see below
      "gpu": "NVIDIA H200",                     # "2 x NVIDIA H200" for two ranks; "CPU" without CUDA
      "date": "2026-12-01",
      "commit": "661d437",                      # git rev-parse --short HEAD of the measured code
      "command": "python benchmarks/sparse_prefill.py --peer-lib libpeer.so",
      "versions": {"torch": "2.11.0+cu130", "triton": "3.6.0"}
    }

``ratio`` says how many times better ``value`` is than the baseline: ``value / baseline`` when
higher is better, ``baseline / value`` when lower is better, ``value / baseline`` when ``better``
is ``"none"``. It is computed from the two values (:func:`record`); a record whose baseline value
is not known (``"value": null``) may carry the ratio its run reported. The date, GPU, commit,
command and versions are filled in by :func:`environment`. :func:`validate` checks a record;
``benchmarks/performance_page.py`` builds the performance page from files of them.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("benchmark", "config", "metric", "value", "unit", "better", "baseline", "ratio", "gpu", "date", "commit",
          "command", "versions")  # fmt: skip
BETTER = ("higher", "lower", "none")
#: How far a stated ratio may sit from the one its two values give (they are rounded separately).
RATIO_SLACK = 0.02


def git_commit(root: Path = ROOT) -> str:
    """``git rev-parse --short HEAD`` of ``root``, or ``"unknown"`` outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    except OSError:
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def _portable(arg: str) -> str:
    """An absolute path outside the repository (an output file) as its file name, inside it relative
    to the root: the command must run as written on any machine.

    >>> _portable("/somewhere/out/run.json"), _portable("--json"), _portable("4")
    ('run.json', '--json', '4')
    """
    if not arg.startswith("/"):
        return arg
    path = Path(arg)
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return path.name


def portable_command(command: str) -> str:
    """``command`` with each absolute path (a word starting with ``/``) made portable (:func:`_portable`).

    >>> portable_command("cd benchmarks && python run.py --json /out/r.json")
    'cd benchmarks && python run.py --json r.json'
    """
    return re.sub(r"(?<!\S)/\S+", lambda m: _portable(m.group(0)), command)


def command_line(argv: list[str] | None = None) -> str:
    """The command that ran this process, as a user would type it from the repository root
    (``torchrun --nproc-per-node N`` in front when torchrun started it)."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0])
    try:
        script = script.resolve().relative_to(ROOT)
    except ValueError:
        pass
    words = [script.as_posix(), *(_portable(a) for a in argv[1:])]
    if "LOCAL_WORLD_SIZE" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:
        return shlex.join(["torchrun", "--nproc-per-node", os.environ["LOCAL_WORLD_SIZE"], *words])
    return shlex.join(["python", *words])


def gpu_name(world_size: int = 1, device: Any = None) -> str:
    """The name of ``device`` (a ``torch.device`` or its name; default: the current GPU where there
    is one), ``"W x NAME"`` for ``world_size`` ranks; ``"CPU"`` for a device that is not CUDA or
    where there is no GPU."""
    import torch

    dev = None if device is None else torch.device(device)
    on_cpu = dev is not None and dev.type != "cuda"
    name = torch.cuda.get_device_name(dev) if torch.cuda.is_available() and not on_cpu else "CPU"
    return name if world_size == 1 else f"{world_size} x {name}"


def versions() -> dict[str, str]:
    """torch, Triton (``"none"`` when it is not installed) and Python versions, and FlashInfer's
    where the run imported it (a peer some benchmarks time)."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    out = {"torch": torch.__version__, "triton": triton_version, "python": platform.python_version()}
    flashinfer = sys.modules.get("flashinfer")
    if flashinfer is not None:
        out["flashinfer"] = str(getattr(flashinfer, "__version__", "unknown"))
    return out


def environment(world_size: int = 1, device: Any = None) -> dict[str, Any]:
    """The fields a run fills in itself: GPU (:func:`gpu_name` of ``device``), date (UTC), commit,
    command and versions."""
    return {
        "gpu": gpu_name(world_size, device),
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "commit": git_commit(),
        "command": command_line(),
        "versions": versions(),
    }


def ratio_of(value: float, baseline: float, better: str) -> float:
    """How many times better ``value`` is than ``baseline`` (module docstring)."""
    if better not in BETTER:
        raise ValueError(f"better must be one of {BETTER}, got {better!r}")
    return baseline / value if better == "lower" else value / baseline


def record(
    benchmark: str,
    config: dict[str, Any],
    metric: str,
    value: float,
    unit: str,
    better: str,
    baseline: tuple[str, float] | None = None,
    env: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One record (module docstring); ``baseline``: ``(name, value)`` measured in the same run;
    ``env``: :func:`environment` (computed when not given)."""
    base = None if baseline is None else {"name": baseline[0], "value": float(baseline[1])}
    ratio = None if base is None else ratio_of(float(value), base["value"], better)
    rec = {"benchmark": benchmark, "config": dict(config), "metric": metric, "value": float(value), "unit": unit,
           "better": better, "baseline": base, "ratio": ratio, **(env or environment())}  # fmt: skip
    validate(rec)
    return rec


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) != float("inf")


def validate(rec: object) -> None:
    """Raises ``ValueError`` naming the first field of ``rec`` that breaks the format."""
    if not isinstance(rec, dict):
        raise ValueError(f"a record must be a JSON object, got {type(rec).__name__}")
    if tuple(sorted(rec)) != tuple(sorted(FIELDS)):
        missing, extra = sorted(set(FIELDS) - set(rec)), sorted(set(rec) - set(FIELDS))
        raise ValueError(f"record fields: missing {missing}, unexpected {extra}")
    for key in ("benchmark", "metric", "unit", "gpu", "commit", "command"):
        if not isinstance(rec[key], str) or not rec[key]:
            raise ValueError(f"{key} must be a non-empty string, got {rec[key]!r}")
    if not isinstance(rec["config"], dict) or not rec["config"]:
        raise ValueError(f"config must be a non-empty object, got {rec['config']!r}")
    for k, v in rec["config"].items():
        if not isinstance(v, (str, int, float, bool)):
            raise ValueError(f"config[{k!r}] must be a string, number or bool, got {v!r}")
    if not _is_number(rec["value"]):
        raise ValueError(f"value must be a finite number, got {rec['value']!r}")
    if rec["better"] not in BETTER:
        raise ValueError(f"better must be one of {BETTER}, got {rec['better']!r}")
    try:
        datetime.date.fromisoformat(rec["date"])
    except (TypeError, ValueError):
        raise ValueError(f"date must be YYYY-MM-DD, got {rec['date']!r}") from None
    vers = rec["versions"]
    if (
        not isinstance(vers, dict)
        or not {"torch", "triton"} <= set(vers)
        or not all(isinstance(v, str) for v in vers.values())
    ):
        raise ValueError(f"versions must map at least torch and triton to strings, got {vers!r}")
    base, ratio = rec["baseline"], rec["ratio"]
    if ratio is not None and (not _is_number(ratio) or ratio <= 0):
        raise ValueError(f"ratio must be a positive number or null, got {ratio!r}")
    if base is None:
        if ratio is not None:
            raise ValueError("ratio without a baseline")
        return
    if not isinstance(base, dict) or set(base) != {"name", "value"} or not isinstance(base["name"], str):
        raise ValueError(f"baseline must be null or {{'name': str, 'value': number or null}}, got {base!r}")
    if base["value"] is None:
        if ratio is None:
            raise ValueError("a baseline without a value needs the ratio its run reported")
        return
    if not _is_number(base["value"]) or base["value"] <= 0 or rec["value"] <= 0:
        raise ValueError(f"baseline value and value must be positive numbers, got {base['value']!r}, {rec['value']!r}")
    want = ratio_of(rec["value"], base["value"], rec["better"])
    if ratio is None or abs(ratio - want) > RATIO_SLACK * want:
        raise ValueError(f"ratio {ratio!r} does not follow from value and baseline ({want:.4g})")


def key(rec: dict[str, Any]) -> tuple[str, str, str, str]:
    """What a record measures, and on which GPU: a newer record with the same key replaces it on
    the page (a run on another GPU adds rows beside it)."""
    return rec["benchmark"], json.dumps(rec["config"], sort_keys=True), rec["metric"], rec["gpu"]


def write_json(path: str | Path | None, records: list[dict[str, Any]]) -> None:
    """Writes ``records`` (each validated) to ``path`` as a JSON list; nothing when ``path`` is None."""
    if path is None:
        return
    for rec in records:
        validate(rec)
    Path(path).write_text(json.dumps(records, indent=1) + "\n")


def read_json(path: str | Path) -> list[dict[str, Any]]:
    """The records of a file :func:`write_json` wrote, each validated (``ValueError`` names the file)."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of records")
    for i, rec in enumerate(data):
        try:
            validate(rec)
        except ValueError as e:
            raise ValueError(f"{path}, record {i}: {e}") from None
    return data


def fmt(x: float) -> str:
    """A number as a table shows it: four significant digits, no trailing zeros.

    >>> [fmt(x) for x in (639.0, 0.042, 12.1, 285.25, 3419.0, -2.0)]
    ['639', '0.042', '12.1', '285.2', '3419', '-2']
    """
    return f"{x:.4g}" if abs(x) < 1e4 else f"{x:,.0f}"


def config_text(config: dict[str, Any]) -> str:
    """``{"heads": 64, "tokens": 4096}`` -> ``"heads 64, tokens 4096"``."""
    return ", ".join(f"{k} {v}" for k, v in config.items())


def print_table(records: list[dict[str, Any]], title: str | None = None) -> None:
    """The records as a table on stdout (rich): configuration, metric, ours, baseline, ratio."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("benchmark", "configuration", "metric", "ours", "baseline (same run)", "ratio"):
        table.add_column(col)
    for rec in records:
        base = rec["baseline"]
        base_text = (
            "-"
            if base is None
            else f"{base['name']}: " + ("-" if base["value"] is None else f"{fmt(base['value'])} {rec['unit']}")
        )
        ratio = "-" if rec["ratio"] is None else f"{rec['ratio']:.2f}x"
        table.add_row(rec["benchmark"], config_text(rec["config"]), rec["metric"], f"{fmt(rec['value'])} {rec['unit']}",
                      base_text, ratio)  # fmt: skip
    Console(width=200).print(table)


def add_json_argument(parser: Any) -> None:
    """``--json PATH``: where a benchmark writes its records."""
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="write the records (benchmarks/records.py format) here")  # fmt: skip


def add_device_argument(parser: Any, help: str = "cpu: a dry run of the same code at tiny shapes") -> None:
    """``--device cuda|cpu`` (default ``cuda``): where a benchmark runs."""
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=help)


def lacks_gpu(device: str) -> bool:
    """Whether ``--device cuda`` was asked for on a machine without CUDA (said on stderr, in one line)."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu for a dry run)", file=sys.stderr)
        return True
    return False
