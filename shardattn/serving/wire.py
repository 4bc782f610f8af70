"""Tensors across Ray's object store without copies: as NumPy arrays, which Ray reads in place.

Ray pickles a ``torch.Tensor`` into the object store (a copy in, a copy out), but hands a NumPy
array out of shared memory without copying it. :func:`to_wire` turns every CPU tensor in a nested
structure (dicts, lists, tuples) into a :class:`WireTensor` (an array of the tensor's bytes and
its dtype name: bf16 travels as int16), :func:`from_wire` turns them back into tensors that share
the array's memory (read-only: callers copy before writing). Measured on CPU in the pool's
decode payload (64 tokens, 2.4 MB of queries per rank): about half the round-trip time of
pickled tensors.

>>> t = torch.arange(6, dtype=torch.bfloat16).view(2, 3)
>>> back = from_wire(to_wire({"x": [t]}))["x"][0]
>>> back.dtype, torch.equal(back, t)
(torch.bfloat16, True)
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["WireTensor", "from_wire", "to_wire"]

_CARRIER = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.bool: torch.uint8}


@dataclass(frozen=True)
class WireTensor:
    """A CPU tensor's bytes as a NumPy array (``array``) and its torch dtype's name."""

    array: np.ndarray
    dtype: str


def to_wire(value: Any) -> Any:
    """Every tensor in ``value`` (moved to the CPU, made contiguous) as a :class:`WireTensor`."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        carrier = _CARRIER.get(t.dtype)
        arr = (t.view(carrier) if carrier is not None else t).numpy()
        return WireTensor(arr, str(t.dtype).removeprefix("torch."))
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(to_wire(v) for v in value)
    return value


def from_wire(value: Any) -> Any:
    """The inverse of :func:`to_wire`: tensors sharing the arrays' memory."""
    if isinstance(value, WireTensor):
        dtype = getattr(torch, value.dtype)
        with warnings.catch_warnings():  # the object store's arrays are read-only; nothing writes to them
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(value.array)
        return t.view(dtype) if dtype in _CARRIER else t
    if isinstance(value, dict):
        return {k: from_wire(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(from_wire(v) for v in value)
    return value
