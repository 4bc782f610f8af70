"""The size of a serving pool's paged KV cache: :class:`KVCacheConfig` (the same on every rank).

A pool of ``N`` ranks keeps each request's KV cache split by a :class:`~shardattn.plan.DCPLayout`
(DCP decode: token ``t`` on rank ``(t // I) % N``; a replicated cache is the layout of one rank).
Every rank uses the *same* page ids for a request, sized for the rank that holds the most of it
(rank 0), so one block table serves every rank; the other ranks leave at most one page's tail
unused. A request of ``L`` tokens holds ``ceil(layout.max_local_len(L) / page_size)`` pages.

>>> from shardattn.plan.context import DCPLayout
>>> cfg = KVCacheConfig(page_size=4, layout=DCPLayout(2), max_requests=2, max_seq_len=16)
>>> cfg.pages_per_request, cfg.num_pages, cfg.pages_for(9)
(2, 4, 2)
"""

from __future__ import annotations

from dataclasses import dataclass

from shardattn._checks import check_int
from shardattn.plan._common import MAX_TOKENS
from shardattn.plan.context import DCPLayout

__all__ = ["KVCacheConfig"]


@dataclass(frozen=True)
class KVCacheConfig:
    """Size of a pool's paged KV cache (the same on every rank).

    Attributes:
        page_size: tokens per page (the model spec's).
        layout: how a request's tokens are spread over the ranks (``DCPLayout(1)``: every rank
            holds every token).
        max_requests: requests that may hold pages at once.
        max_seq_len: the most tokens of one request (prompt and decoded tokens together).
        num_pages: pages per rank (default: enough for ``max_requests`` requests of ``max_seq_len``;
            at least the pages of one such request).
    """

    page_size: int
    layout: DCPLayout
    max_requests: int
    max_seq_len: int
    num_pages: int | None = None

    def __post_init__(self) -> None:
        check_int("page_size", self.page_size, minimum=1)
        check_int("max_requests", self.max_requests, minimum=1)
        check_int("max_seq_len", self.max_seq_len, minimum=1, maximum=MAX_TOKENS)  # int32 positions
        if not isinstance(self.layout, DCPLayout):
            raise TypeError(f"layout must be a DCPLayout, got {type(self.layout).__name__}")
        given = self.num_pages is not None
        if self.num_pages is None:
            object.__setattr__(self, "num_pages", self.max_requests * self.pages_per_request)
        check_int("num_pages", self.num_pages, minimum=1)
        if self.pages_per_rank < self.pages_per_request:  # no request could reach max_seq_len
            raise ValueError(
                f"num_pages={self.num_pages} is fewer than the {self.pages_per_request} pages one request of "
                f"max_seq_len={self.max_seq_len} holds (pages of {self.page_size}); raise num_pages or lower "
                "max_seq_len"
            )
        if self.rows_per_rank > MAX_TOKENS:  # a rank's rows, and its page ids, are int32 (before any allocation)
            sized = "num_pages" if given else "max_requests * max_seq_len (num_pages' default)"
            raise ValueError(
                f"{sized} gives {self.rows_per_rank:,} KV rows per rank ({self.num_pages:,} pages of "
                f"{self.page_size}), past int32 rows ({MAX_TOKENS:,}); lower max_requests, max_seq_len or num_pages"
            )

    def pages_for(self, seq_len: int) -> int:
        """Pages a request of ``seq_len`` tokens holds (on every rank)."""
        return -(-self.layout.max_local_len(seq_len) // self.page_size)

    @property
    def pages_per_request(self) -> int:
        """Pages of a request at ``max_seq_len`` (the width of a block table)."""
        return self.pages_for(self.max_seq_len)

    @property
    def pages_per_rank(self) -> int:
        """Pages each rank's cache holds: ``num_pages``, its default resolved at construction."""
        if self.num_pages is None:  # __post_init__ sets it
            raise RuntimeError("KVCacheConfig.num_pages was not resolved at construction")
        return int(self.num_pages)

    @property
    def rows_per_rank(self) -> int:
        """KV rows (tokens) each rank's cache holds."""
        return self.pages_per_rank * self.page_size
