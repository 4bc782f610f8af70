"""Options a run's steps would not use are refused (one line), as is a ``--calibration`` file
that does not load: an option accepted and then ignored would report a run the user did not ask for."""

from __future__ import annotations

from pathlib import Path

import torch

from shardattn.launch.cli import Options, usage_error
from shardattn.plan.calibration import Calibration, same_gpu
from shardattn.runtime.modes import DECODE_STEP

__all__ = ["check_calibration_file", "check_options_used"]


def check_options_used(opts: Options, *, mode: str, steps: tuple[str, ...], mla: bool) -> None:
    """Raise :class:`LaunchError` for the first option given that none of ``steps`` uses, saying why.

    ``steps``: the run's steps (``("prefill", "decode")``, ``("decode",)`` in dcp-decode mode,
    ``("prefill",)`` with ``--compare``); ``mla``: a sparse-MLA preset (else GQA)."""
    prefill, decode = "prefill" in steps, "decode" in steps
    routes = mla and prefill and (mode in ("shardq", "mixed") or opts.compare)  # ShardQ's gate and the router
    runs = "--compare runs prefills only" if opts.compare else f"mode {mode} runs {' and '.join(steps)} only"
    no_shardq = (
        f"{opts.preset} is a GQA model (no ShardQ step)"
        if not mla
        else runs
        if not prefill
        else f"mode {mode}'s prefill never takes ShardQ"
    )
    unused = [
        ("--tokens", opts.tokens is not None and not prefill, f"sets the prefill's new tokens; {runs}"),
        ("--topk", opts.topk is not None and not mla, f"sets a sparse-MLA top-k; {opts.preset} is a GQA model"),
        ("--overlap", opts.overlap != "dsa" and not mla, f"shapes a sparse-MLA top-k; {opts.preset} is a GQA model"),
        ("--topk-file", opts.topk_file is not None and not mla, f"holds a sparse-MLA top-k; {opts.preset} is GQA"),
        ("--topk-unique", opts.topk_unique and not mla, f"is a sparse-MLA top-k's promise; {opts.preset} is GQA"),
        ("--min-shard-tokens", opts.min_shard_tokens is not None and not routes, f"is ShardQ's gate; {no_shardq}"),
        ("--calibration", opts.calibration is not None and not routes, f"routes ShardQ steps; {no_shardq}"),
        ("--query-len", opts.query_lens is not None and not decode, f"sets the decode's queries; {runs}"),
        (
            "--interleave",
            opts.interleave != 1 and not (decode and DECODE_STEP[mode] == "dcp"),
            f"is DCP's interleave; {runs if not decode else f'mode {mode} decodes with head-TP'}",
        ),
        (
            "--non-causal",
            not opts.causal and not (decode and max(opts.query_lens or (1,)) > 1),
            "lets speculative drafts see every KV token of their request; "
            + (runs if not decode else "every request decodes one query (--query-len 1), which sees them either way"),
        ),
        (
            # the recorded top-k replaces the prefill's synthetic one; a decode step still draws its own
            "--overlap",
            opts.overlap != "dsa" and mla and opts.topk_file is not None and not decode,
            f"shapes a synthetic top-k; --topk-file gives the prefill's and {runs}",
        ),
    ]
    for flag, given, why in unused:
        if given:
            raise usage_error(f"{flag} {why}: drop it (nothing in this run would use it)")


def check_calibration_file(path: str, device: torch.device) -> None:
    """``--calibration``: a table that loads, measured on this GPU (on a CPU any GPU's table is
    used as it is). Raise :class:`LaunchError` naming the file; the Runtime would only warn, and
    route by the conservative default."""
    try:
        table = Calibration.from_json(Path(path).read_text())
    except FileNotFoundError:
        raise usage_error(f"--calibration {path}: no such file (python -m shardattn.calibrate measures one)") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise usage_error(f"--calibration {path}: not a calibration table ({e})") from None
    if device.type == "cuda" and not same_gpu(table.gpu, here := torch.cuda.get_device_name(device)):
        raise usage_error(f"--calibration {path}: measured on {table.gpu!r}, this GPU is {here!r}")
