"""The memory a launcher run needs per rank, and what the rank has: checked before any tensor is
built, so a step too large for the machine is one line instead of an allocation failure."""

from __future__ import annotations

import os
from typing import Any

import torch

from shardattn.plan.spec import ModelSpec

__all__ = ["free_bytes", "step_bytes", "token_bytes"]


def token_bytes(spec: ModelSpec, dtype: torch.dtype) -> int:
    """The bytes one query token of a step holds at least: its query, output and fp32 LSE over every
    head. Every request of a step has a token, so ``requests * token_bytes`` bounds a run before
    its per-request lengths are listed.

    >>> from shardattn.plan.spec import get_preset
    >>> token_bytes(get_preset("glm5"), torch.float32)
    278784
    """
    elem = torch.finfo(dtype).bits // 8
    return spec.num_heads * ((spec.head_dim + spec.v_dim) * elem + 4)


def step_bytes(spec: ModelSpec, shape: Any, dtype: torch.dtype, steps: tuple[str, ...], *, check: bool = False) -> int:
    """A lower bound on the bytes the run's synthetic steps hold on one rank: the larger step's whole
    KV cache, queries, top-k rows and outputs (fp32 LSE beside them), and with ``check`` the
    fp64 reference's copies of the queries and outputs and its logits (a step holds more: the
    rank's copies, the workspace). A run that cannot hold even these is refused before it starts, not killed by the
    allocator part way.

    >>> from shardattn.plan.spec import get_preset
    >>> from shardattn.launch.cli import Shape
    >>> s = Shape(tokens=256, requests=2, cached=(128, 128), topk=64, query_lens=(1, 1), reduced=True)
    >>> step_bytes(get_preset("glm5"), s, torch.float32, ("prefill", "decode")) // 2**20
    69
    """
    elem = torch.finfo(dtype).bits // 8
    mla = spec.kind == "sparse_mla"
    row = spec.head_dim if mla else 2 * spec.num_kv_heads * spec.head_dim
    topk = shape.topk if mla else 0
    sizes = [shape.tokens] if "prefill" in steps else []
    sizes += [sum(shape.query_lens)] if "decode" in steps else []
    cache = sum(shape.cached)

    def one_step(t: int) -> int:
        keys = topk if mla else cache + t  # a query's keys in the reference (GQA: the whole context)
        reference = t * spec.num_heads * (spec.head_dim + spec.v_dim + keys) * 8 if check else 0
        return (cache + t) * row * elem + t * (token_bytes(spec, dtype) + topk * 4) + reference

    # the steps are built one after the other: the larger one's cache (once), queries, rows and outputs
    return max(one_step(t) for t in sizes)


def free_bytes(device: torch.device, world_size: int) -> int | None:
    """Bytes free for one rank: the GPU's free memory, or the host's available memory over the
    ranks that share it (all of them, as far as this rank knows before the group forms); ``None``
    where unknown."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        return _host_available_bytes() // max(local, 1)
    except (OSError, ValueError, RuntimeError, AttributeError):
        return None


def _host_available_bytes() -> int:
    """The host memory a new allocation can take: Linux's ``MemAvailable`` (free memory and the
    page cache it can reclaim), else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
