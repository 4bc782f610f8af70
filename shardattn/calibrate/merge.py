"""``python -m shardattn.calibrate --merge-into TABLE``: fresh kernel points merged into a table."""

from __future__ import annotations

import dataclasses
import re

import torch

from shardattn.plan.calibration import Calibration, KernelPoint, same_gpu

__all__ = ["measure_device", "merge_kernel_points", "merged_source", "this_gpu"]

#: A merge's note in a table's ``source``: ``"; <format> kernel points re-measured: <run>"``, one
#: per KV format (a note without a format, from before formats were named, is of bfloat16 points).
_NOTE = re.compile(r"; (?:(\S+) )?kernel points re-measured: ")


def merged_source(table_source: str, fresh_source: str, formats: set[str]) -> str:
    """``table_source`` with a note that ``formats``' kernel points were re-measured by the run
    ``fresh_source`` names (its first part), in place of older notes of those formats; the notes of
    other formats stay, so each point's provenance is kept.

    >>> merged_source("two-rank run; kernel points re-measured: run A", "run B, 3 passes", {"fp8_ds_mla"})
    'two-rank run; bfloat16 kernel points re-measured: run A; fp8_ds_mla kernel points re-measured: run B, 3 passes'
    """
    parts = _NOTE.split(table_source)
    notes = {fmt or "bfloat16": run for fmt, run in zip(parts[1::2], parts[2::2], strict=True)}
    notes.update(dict.fromkeys(formats, fresh_source.split(";")[0]))
    return parts[0] + "".join(f"; {fmt} kernel points re-measured: {run}" for fmt, run in sorted(notes.items()))


def merge_kernel_points(table: Calibration, fresh: Calibration) -> Calibration:
    """``table`` with ``fresh``'s kernel points in place of its points of the same KV format, heads,
    group size and tokens (its other points kept: an FP8 run adds to a bf16 table), ``fresh``'s
    union ratios of the group sizes it measured and its copy rate, and ``table``'s collectives and
    step overheads; both must be of the same GPU. Raises ``ValueError`` otherwise, or where the
    result is no usable table."""
    if not same_gpu(fresh.gpu, table.gpu):
        raise ValueError(f"--merge-into: the table is for {table.gpu!r}, this GPU is {fresh.gpu!r}")

    def key(p: KernelPoint) -> tuple[str, int, int, int]:
        return (p.kv_format, p.heads, p.group_size, p.tokens)

    new = {key(p) for p in fresh.kernels}
    measured = {p.group_size for p in fresh.kernels if p.group_size > 1}  # else fresh's ratios are defaults
    kept = tuple(p for p in table.kernels if key(p) not in new)
    merged = dataclasses.replace(
        table,
        kernels=tuple(sorted(kept + fresh.kernels, key=lambda p: (p.kv_format, p.group_size, p.heads, p.tokens))),
        union_ratio={**table.union_ratio, **{g: u for g, u in fresh.union_ratio.items() if g in measured}},
        copy_gbps=fresh.copy_gbps,
        source=merged_source(table.source, fresh.source, {p.kv_format for p in fresh.kernels}),
    )
    merged.validate()
    return merged


def measure_device(cpu: bool) -> torch.device:
    """Where ``calibrate`` measures: this rank's GPU, the CPU without CUDA or with ``--cpu``."""
    if cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def this_gpu(device: torch.device) -> str:
    """The name a table measured on ``device`` records (``"cpu"`` for the CPU)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
