"""Helpers shared by the planner modules: argument coercion and fingerprints.

Planner inputs are small host-side integer lists (one entry per request). They may arrive as a
Python sequence, a numpy array or a CPU torch tensor; every function turns them into a 1-D
``numpy.int64`` array and rejects anything else with a message naming the argument.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Set

import numpy as np
import torch

from shardattn._checks import check_int

__all__ = [
    "MAX_TOKENS",
    "MAX_WORLD_SIZE",
    "as_lengths",
    "check_token_counts",
    "check_world_size",
    "fingerprint_arrays",
    "to_int64_tensor",
]

#: The most ranks a plan takes (far past any deployment; a bound so that a wrong value is an
#: error naming it rather than an allocation of one entry per rank that cannot succeed).
MAX_WORLD_SIZE = 1 << 16

#: The most tokens of one request (KV positions, lengths, top-k): the kernels, the block tables and
#: a decode batch's metadata hold them in int32.
MAX_TOKENS = 2**31 - 1

_INT64_MAX = 2**63 - 1


def check_world_size(world_size: object, name: str = "world_size") -> int:
    """``world_size`` as an int in ``[1, MAX_WORLD_SIZE]``; raises naming ``name``.

    >>> check_world_size(8)
    8
    """
    w = check_int(name, world_size, minimum=1)
    if w > MAX_WORLD_SIZE:
        raise ValueError(f"{name} must be <= {MAX_WORLD_SIZE}, got {w}")
    return w


def as_lengths(name: str, values: object, *, count: int | None = None) -> np.ndarray:
    """Return ``values`` as a 1-D ``int64`` numpy array of non-negative integers.

    Accepts a sequence of ints, a 1-D integer numpy array or a 1-D integer CPU torch tensor.
    ``count`` (optional) is the required length. Raises ``TypeError`` for non-integers (bools
    included) and unordered collections (a set, a dict), and ``ValueError`` for negative entries,
    entries past int64, a wrong length or a GPU tensor (planning happens on the host; moving a GPU
    tensor here would synchronise).

    >>> as_lengths("seq_lens", [3, 0, 5]).tolist()
    [3, 0, 5]
    """
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor or a sequence of ints, got a tensor on {values.device}")
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got dtype {str(values.dtype).replace('torch.', '')}")
        values = values.numpy()
    if isinstance(values, np.ndarray):
        if not np.issubdtype(values.dtype, np.integer):
            raise TypeError(f"{name} must hold integers, got dtype {values.dtype}")
        if values.dtype == np.uint64 and values.size and int(values.max()) > _INT64_MAX:
            i = int(np.flatnonzero(values > _INT64_MAX)[0])
            raise ValueError(f"{name}[{i}] must be < 2**63, got {int(values[i])}")
        arr = values.astype(np.int64)
    elif isinstance(values, str | bytes | Set | Mapping) or not isinstance(values, Iterable):
        what = "an unordered " if isinstance(values, Set | Mapping) else ""
        raise TypeError(f"{name} must be a sequence of ints, got {what}{type(values).__name__}")
    else:
        items = list(values)
        for i, v in enumerate(items):
            if check_int(f"{name}[{i}]", v) > _INT64_MAX:
                raise ValueError(f"{name}[{i}] must be < 2**63, got {int(v)}")
        arr = np.asarray([int(v) for v in items], dtype=np.int64).reshape(-1)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {list(arr.shape)}")
    if count is not None and arr.shape[0] != count:
        raise ValueError(f"{name} must have {count} entries (one per request), got {arr.shape[0]}")
    neg = np.flatnonzero(arr < 0)
    if neg.size:
        i = int(neg[0])
        raise ValueError(f"{name}[{i}] must be >= 0, got {int(arr[i])}")
    return arr


def check_token_counts(name: str, counts: np.ndarray) -> np.ndarray:
    """``counts`` (non-negative int64, one per request) checked against :data:`MAX_TOKENS`; raises
    naming ``name`` and the first request past it.

    >>> check_token_counts("seq_lens", np.array([5, 2**31]))
    Traceback (most recent call last):
    ...
    ValueError: seq_lens[1] must be <= 2147483647 (tokens are int32), got 2147483648
    """
    over = np.flatnonzero(counts > MAX_TOKENS)
    if over.size:
        i = int(over[0])
        raise ValueError(f"{name}[{i}] must be <= {MAX_TOKENS} (tokens are int32), got {int(counts[i])}")
    return counts


def to_int64_tensor(arr: np.ndarray) -> torch.Tensor:
    """A contiguous ``torch.int64`` CPU tensor holding a copy of ``arr``."""
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.int64).copy())


def fingerprint_arrays(tag: str, *parts: object) -> int:
    """Stable 63-bit hash of a tag and a list of scalars / arrays / tensors.

    The value is identical across processes and machines for equal contents (blake2b over the
    little-endian int64 bytes), and fits an ``int64`` tensor so ranks can all-gather and compare it.
    """
    h = hashlib.blake2b(digest_size=8)
    h.update(tag.encode())
    for p in parts:
        if isinstance(p, torch.Tensor):
            p = p.detach().cpu().numpy()
        if isinstance(p, np.ndarray):
            a = np.ascontiguousarray(p, dtype="<i8")
            h.update(b"A" + str(a.shape).encode())
            h.update(a.tobytes())
        else:
            h.update(b"S" + repr(p).encode())
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)
