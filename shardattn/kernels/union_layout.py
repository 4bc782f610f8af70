"""How a union of KV rows is laid out in memory: the membership encoding every union builder
writes and every grouped kernel reads (docs/ARCHITECTURE.md, "Membership encoding").

Group ``g`` holds queries ``g*G .. g*G + G - 1``; its entries are sorted by row, unique, padded
with ``-1`` to ``G * K`` and counted by ``lens[g]``::

    entry = row | (member_bits << 24)      row < 2**24 - 1, bit j set <=> query g*G + j picked row

as int32 (bit 31 is query 7's bit, so an entry may be negative; ``-1`` = 0xFFFFFFFF cannot be an
entry because rows stop below ``2**24 - 1``). With ``G = 1`` entries are plain rows.

Example:
    >>> rows, bits = torch.tensor([5, 9]), torch.tensor([1, 128])
    >>> [tuple(x.tolist()) for x in unpack_entries(pack_entries(rows, bits))]
    [(5, 9), (1, 128)]
"""

from __future__ import annotations

import torch

#: Rows at or above this cannot be packed (24 bits, ``0xFFFFFF`` reserved so ``-1`` is no entry).
MAX_PACKED_ROWS = 2**24 - 1
#: Group sizes the membership byte allows.
GROUP_SIZES = (1, 2, 4, 8)
ROW_BITS = 24
#: Largest row the G = 1 path accepts (int32 max is the sort sentinel).
MAX_PLAIN_ROW = 2**31 - 2


def num_groups(num_tokens: int, group_size: int) -> int:
    """``ceil(num_tokens / group_size)``."""
    return -(-num_tokens // group_size)


def pack_entries(rows: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Pack ``row | bits << 24`` into int32 (two's complement when bit 31 is set).

    Args:
        rows: int64 rows ``< 2**24 - 1``; bits: int64 membership bits ``< 256``.
    Returns:
        int32 entries.
    """
    v = rows | (bits << ROW_BITS)
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def unpack_entries(entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_entries`: ``(rows int64, bits int64)``."""
    e = entries.long() & 0xFFFFFFFF
    return e & 0xFFFFFF, e >> ROW_BITS
