"""Which entries of a token's row list are keys: the contract every sparse-MLA path shares.

An entry is a key when it lies in ``[0, R)`` and before the token's ``topk_length``; a row listed
twice by one token is one key (its first occurrence). The torch reference applies these masks;
the kernels apply the same rules in their own loads. Row ``2**31 - 1`` (int32's largest, the union
builders' sentinel) is a key of no cache, as in :mod:`shardattn.ops.union`: an int32 row list
addresses at most that many rows, whatever ``R``.
"""

from __future__ import annotations

import torch

from shardattn.kernels.union_layout import MAX_PLAIN_ROW

__all__ = ["first_occurrences", "valid_mask"]


def valid_mask(rows: torch.Tensor, num_kv_rows: int, topk_length: torch.Tensor | None) -> torch.Tensor:
    """``[T, K]`` bool: entry is a valid key (in ``[0, min(R, 2**31 - 1))`` and within ``topk_length``)."""
    # R past int32 would wrap when compared with int32 rows: every row of the list is then in range
    valid = (rows >= 0) & (rows < min(num_kv_rows, MAX_PLAIN_ROW + 1))
    if topk_length is not None:
        k = rows.shape[1]
        valid &= torch.arange(k, device=rows.device)[None, :] < topk_length[:, None].to(torch.int64)
    return valid


def first_occurrences(rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[T, K]`` bool: ``valid`` with every later duplicate of a row within a token cleared.

    >>> rows = torch.tensor([[4, 2, 4, -1, 2]], dtype=torch.int32)
    >>> first_occurrences(rows, rows >= 0).tolist()
    [[True, True, False, False, False]]
    """
    k = rows.shape[1]
    if k < 2:
        return valid
    # invalid entries get distinct negative keys so they never pair with anything
    keys = torch.where(valid, rows.long(), -1 - torch.arange(k, device=rows.device)[None, :])
    ordered, order = keys.sort(dim=1, stable=True)
    dup_sorted = torch.zeros_like(valid)
    dup_sorted[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
    dup = torch.zeros_like(valid).scatter_(1, order, dup_sorted)
    return valid & ~dup
