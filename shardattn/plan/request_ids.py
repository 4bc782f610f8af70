"""Request ids in the ledger's errors and arrays: :func:`shown` (an id cut to a readable length
for a message) and :func:`as_int64_ids` (an integer id array as int64, refusing a value the cast
would wrap onto another id).
"""

from __future__ import annotations

import reprlib

import numpy as np

__all__ = ["as_int64_ids", "shown"]


_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 64
_SHOWN.maxlist = _SHOWN.maxtuple = 8


def shown(request_id: object) -> str:
    """``repr`` of a request id (or ids) cut to a readable length for an error message.

    >>> shown("x" * 100)[:8], len(shown("x" * 100)) < 70, shown(7)
    ("'xxxxxxx", True, '7')
    """
    return _SHOWN.repr(request_id)


def as_int64_ids(name: str, ids: np.ndarray) -> np.ndarray:
    """An integer array of request ids as int64; ``ValueError`` naming ``name`` for an unsigned
    value of 2**63 or more (the cast would wrap it onto another id).

    >>> as_int64_ids("ids", np.array([2**64 - 1], dtype=np.uint64))
    Traceback (most recent call last):
    ...
    ValueError: ids must be below 2**63 (int64 ids), got 18446744073709551615
    """
    if ids.dtype.kind == "u" and ids.size and int(ids.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{name} must be below 2**63 (int64 ids), got {int(ids.max())}")
    return ids.astype(np.int64, copy=False)
