"""What a launcher rank runs, resolved identically on every rank: :class:`RunConfig`.

Built by :func:`shardattn.launch.runner.plan_run`; read by the step builders
(:mod:`~shardattn.launch.prepare`), the timing (:mod:`~shardattn.launch.timing`) and the runner.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from shardattn import __version__
from shardattn.launch.cli import Options, Shape, option_flags
from shardattn.parallel.agreement import Fingerprint
from shardattn.plan.spec import ModelSpec

__all__ = ["RunConfig"]


@dataclass(frozen=True)
class RunConfig:
    """Everything a rank needs to run, resolved identically on every rank (see
    :func:`~shardattn.launch.runner.plan_run`)."""

    opts: Options
    spec: ModelSpec
    mode: str
    shape: Shape
    device: torch.device
    dtype: torch.dtype
    world_size: int
    steps: tuple[str, ...]
    check: bool
    iters: int
    min_shard_tokens: int
    min_group_tokens: int
    recorded: tuple[torch.Tensor, torch.Tensor] | None
    notes: tuple[str, ...]

    def fingerprint(self) -> Fingerprint:
        """Equal on ranks that will run the same thing (options, version, world size, device type);
        its parts are named by their flags, so ranks that disagree are told which differ."""
        local = ("json", "progress", "progress_after", "log_level")  # how this rank reports, not what it runs
        flags = option_flags()
        rec = None if self.recorded is None else (tuple(self.recorded[0].shape), int(self.recorded[0].sum()))
        parts: dict[str, object] = {
            "the shardattn version": __version__, "the world size": self.world_size,
            "the device type": self.device.type, "the dtype": str(self.dtype), "--topk-file's top-k": rec,
        }  # fmt: skip
        parts.update({flags.get(k, k): v for k, v in dataclasses.asdict(self.opts).items() if k not in local})
        parts["the step's shape"] = self.shape  # what the options resolve to (after the flags: they name it)
        return Fingerprint("launch", parts)

    def describe(self) -> dict[str, Any]:
        s = self.shape
        return {
            "preset": self.opts.preset,
            "heads": self.spec.num_heads,
            "softmax_scale": self.spec.softmax_scale,
            "mode": self.mode,
            "world_size": self.world_size,
            "backend": "nccl" if self.device.type == "cuda" else "gloo",
            "device": self.device.type,
            "dtype": str(self.dtype).replace("torch.", ""),
            "kv_dtype": self.opts.kv_dtype,
            "tokens": s.tokens,
            "requests": s.requests,
            "cached": list(s.cached),
            "topk": s.topk,
            "query_lens": list(s.query_lens),
            "causal": self.opts.causal,
            "window": self.opts.window,
            "interleave": self.opts.interleave,
            "overlap": self.opts.overlap,
            "topk_file": self.opts.topk_file,
            "topk_unique": self.opts.topk_unique,
            "iters": self.iters,
            "warmup": self.opts.warmup,
            "seed": self.opts.seed,
            "check": self.check,
            "compare": self.opts.compare,
            "calibration": self.opts.calibration,
            "reduced_shape": s.reduced,
            "version": __version__,
        }
