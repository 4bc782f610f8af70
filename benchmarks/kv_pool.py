"""Paged KV pools of a given size with the requests' pages scattered over them, as an engine's
allocator leaves them; shared by the benchmarks.

:func:`scattered_pages` draws distinct page ids of a pool in seeded random order (the sparse-MLA
prefill's shuffled block table, ``prefill_inputs.make_case``, and the GQA pools below);
:func:`place_pages` puts a GQA cache's pages at such ids of a pool of ``--pool-gb`` GB (the
``gqa`` section of ``decode.py``, ``gqa_prefill.py``, ``decode_dcp.py``) and points the block
table at them. The pool is allocated once and filled with zeros (a memset), then only the
requests' pages are written, so a pool of tens of GB is never materialised twice; the pages hold
the same values in both layouts, so a step reads the same keys either way.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

__all__ = ["GB", "add_pool_argument", "page_bytes", "place_pages", "pool_config", "pool_pages", "scattered_pages"]

#: Bytes of a GB (``--pool-gb``).
GB = 10**9


def scattered_pages(used: int, pool: int, generator: torch.Generator) -> torch.Tensor:
    """``[used]`` int64 on the CPU: distinct page ids of ``[0, pool)`` in random order (the first
    ``used`` of a permutation of the pool drawn from ``generator``, a CPU generator)."""
    if used > pool:
        raise ValueError(f"the requests need {used:,} pages; the pool holds {pool:,}")
    return torch.randperm(pool, generator=generator)[:used]


def positive_gb(text: str) -> float:
    """``--pool-gb``'s value: a finite number of GB above 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a number of GB above 0, got {text!r}")
    return value


def add_pool_argument(ap: argparse.ArgumentParser, what: str) -> None:
    """``--pool-gb G`` (default: none, the cache holds exactly the requests' pages)."""
    ap.add_argument("--pool-gb", type=positive_gb, default=None, metavar="G",
                    help=f"place {what} at scattered page ids of a paged KV pool of G GB (10^9 bytes, K and V "
                         "together; e.g. 40); default: a cache of exactly the requests' pages")  # fmt: skip


def pool_config(pool_gb: float | None) -> dict:
    """The records' configuration entry of a pool: ``{"pool_gb": G}``, nothing for the default cache."""
    return {} if pool_gb is None else {"pool_gb": pool_gb}


def page_bytes(caches: Sequence[torch.Tensor]) -> int:
    """Bytes of one page of every cache together (K and V): each ``[pages, ...]``."""
    return sum(c[0].numel() * c.element_size() for c in caches)


def pool_pages(pool_gb: float, nbytes: int, used: int) -> int:
    """Pages of ``nbytes`` (K and V of a page together) in a pool of ``pool_gb`` GB; ``ValueError``
    naming ``--pool-gb`` when they are fewer than the ``used`` pages the requests need."""
    pages = int(pool_gb * GB) // nbytes
    if pages < used:
        raise ValueError(
            f"--pool-gb {pool_gb:g} holds {pages:,} pages of {nbytes:,} bytes; the requests need {used:,} "
            f"({used * nbytes / GB:.3g} GB): pass a larger pool"
        )
    return pages


def place_pages(
    caches: Sequence[torch.Tensor], table: torch.Tensor, pool_gb: float | None, seed: int = 0
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The requests' pages at scattered page ids of a pool of ``pool_gb`` GB, and their table.

    ``caches``: the pages (K and V, each ``[pages, ...]`` on one device), page ``i`` the one
    ``table`` (``[B, M]``, ``-1`` past a request's pages) names ``i``. Returns ``(pools, table)``:
    each pool ``[pool pages, ...]`` zeros but for the requests' pages, written at
    :func:`scattered_pages` ids drawn from ``seed``, and the table naming those ids (same dtype and
    device, ``-1`` kept). ``pool_gb`` None: ``caches`` and ``table`` as given."""
    if pool_gb is None:
        return list(caches), table
    used = int(caches[0].shape[0])
    pages = pool_pages(pool_gb, page_bytes(caches), used)
    ids = scattered_pages(used, pages, torch.Generator().manual_seed(seed)).to(caches[0].device)
    pools = []
    for cache in caches:
        pool = torch.zeros((pages, *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
        pool[ids] = cache
        pools.append(pool)
    moved = ids.to(table.device)[table.clamp(min=0).long()]
    return pools, torch.where(table >= 0, moved, table.long()).to(table.dtype)
