"""Paged KV-cache bookkeeping for a serving pool: which pages each request holds, host-side.

A pool of ``N`` ranks keeps each request's KV cache split by a :class:`~shardattn.plan.DCPLayout`
(DCP decode: token ``t`` on rank ``(t // I) % N``; a replicated cache is the layout of one rank).
Every rank uses the *same* page ids for a request, sized for the rank that holds the most of it
(rank 0), so one block table serves every rank; the other ranks leave at most one page's tail
unused. A request of ``L`` tokens holds ``ceil(layout.max_local_len(L) / page_size)`` pages.

:class:`PagedKVBook` is the driver's ledger: :meth:`~PagedKVBook.check_growth` validates a whole
step (unknown request, over ``max_seq_len``, too many requests, out of pages) without changing
anything, :meth:`~PagedKVBook.grow` then commits it, :meth:`~PagedKVBook.release` frees requests.

>>> from shardattn.plan.context import DCPLayout
>>> cfg = KVCacheConfig(page_size=4, layout=DCPLayout(2), max_requests=2, max_seq_len=16)
>>> cfg.pages_per_request, cfg.num_pages
(2, 4)
>>> book = PagedKVBook(cfg)
>>> book.grow([("a", 9)]); book.seq_len("a"), book.pages("a")
(9, [0, 1])
>>> book.check_growth([("b", 17)])
Traceback (most recent call last):
    ...
ValueError: request 'b': 17 tokens would exceed max_seq_len=16
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from shardattn._checks import check_int
from shardattn.plan.context import DCPLayout

__all__ = ["KVCacheConfig", "PagedKVBook"]


@dataclass(frozen=True)
class KVCacheConfig:
    """Size of a pool's paged KV cache (the same on every rank).

    Attributes:
        page_size: tokens per page (the model spec's).
        layout: how a request's tokens are spread over the ranks (``DCPLayout(1)``: every rank
            holds every token).
        max_requests: requests that may hold pages at once.
        max_seq_len: the most tokens of one request (prompt and decoded tokens together).
        num_pages: pages per rank (default: enough for ``max_requests`` requests of ``max_seq_len``).
    """

    page_size: int
    layout: DCPLayout
    max_requests: int
    max_seq_len: int
    num_pages: int | None = None

    def __post_init__(self) -> None:
        check_int("page_size", self.page_size, minimum=1)
        check_int("max_requests", self.max_requests, minimum=1)
        check_int("max_seq_len", self.max_seq_len, minimum=1)
        if not isinstance(self.layout, DCPLayout):
            raise TypeError(f"layout must be a DCPLayout, got {type(self.layout).__name__}")
        if self.num_pages is None:
            object.__setattr__(self, "num_pages", self.max_requests * self.pages_per_request)
        check_int("num_pages", self.num_pages, minimum=1)

    def pages_for(self, seq_len: int) -> int:
        """Pages a request of ``seq_len`` tokens holds (on every rank)."""
        return -(-self.layout.max_local_len(seq_len) // self.page_size)

    @property
    def pages_per_request(self) -> int:
        """Pages of a request at ``max_seq_len`` (the width of a block table)."""
        return self.pages_for(self.max_seq_len)

    @property
    def rows_per_rank(self) -> int:
        """KV rows (tokens) each rank's cache holds."""
        return int(self.num_pages) * self.page_size


@dataclass
class _Entry:
    seq_len: int = 0
    pages: list[int] = field(default_factory=list)


class PagedKVBook:
    """The driver's ledger of a paged KV cache (see the module docstring). Host-only, no tensors."""

    def __init__(self, config: KVCacheConfig) -> None:
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
        self.config = config
        self.reset()

    def reset(self) -> None:
        """Forget every request (all pages free)."""
        self._free = list(range(int(self.config.num_pages) - 1, -1, -1))  # pop() hands out page 0 first
        self._requests: dict[Hashable, _Entry] = {}

    # -- queries -------------------------------------------------------------------------------
    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    @property
    def request_ids(self) -> list[Hashable]:
        """Requests holding KV state, in admission order."""
        return list(self._requests)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def seq_len(self, request_id: Hashable) -> int:
        """Tokens cached for a request (``ValueError`` when unknown)."""
        return self._entry(request_id).seq_len

    def pages(self, request_id: Hashable) -> list[int]:
        return list(self._entry(request_id).pages)

    def _entry(self, request_id: Hashable) -> _Entry:
        try:
            return self._requests[request_id]
        except (KeyError, TypeError):
            raise ValueError(f"unknown request id {request_id!r} (never prefilled, or freed)") from None

    def table(self, request_ids: Sequence[Hashable], width: int | None = None) -> list[list[int]]:
        """Block-table rows of ``request_ids`` (padded with ``-1`` to ``width``, default the longest)."""
        rows = [self._entry(r).pages for r in request_ids]
        w = max((len(p) for p in rows), default=0) if width is None else width
        return [p + [-1] * (w - len(p)) for p in rows]

    # -- changes -------------------------------------------------------------------------------
    def check_growth(self, growth: Iterable[tuple[Hashable, int]], *, new_ok: bool = True) -> int:
        """Validate adding ``new_tokens`` to each ``(request_id, new_tokens)`` of one step; nothing changes.

        Unknown ids are new requests when ``new_ok`` (prefill), else an error (decode).
        Returns the pages the step would take.

        Raises:
            ValueError: a repeated or (with ``new_ok=False``) unknown id, a request past
                ``max_seq_len``, more than ``max_requests`` requests, or not enough free pages.
        """
        cfg = self.config
        seen: set[Hashable] = set()
        need = admitted = 0
        for request_id, new_tokens in growth:
            try:
                hash(request_id)
            except TypeError:
                raise TypeError(f"request ids must be hashable, got {type(request_id).__name__}") from None
            if request_id in seen:
                raise ValueError(f"request {request_id!r} appears twice in one step")
            seen.add(request_id)
            n = check_int(f"new tokens of request {request_id!r}", new_tokens, minimum=0)
            entry = self._requests.get(request_id)
            if entry is None:
                if not new_ok:
                    raise ValueError(f"unknown request id {request_id!r} (never prefilled, or freed)")
                entry, admitted = _Entry(), admitted + 1
            total = entry.seq_len + n
            if total > cfg.max_seq_len:
                raise ValueError(f"request {request_id!r}: {total} tokens would exceed max_seq_len={cfg.max_seq_len}")
            need += cfg.pages_for(total) - len(entry.pages)
        if len(self._requests) + admitted > cfg.max_requests:
            raise ValueError(
                f"{admitted} new requests would make {len(self._requests) + admitted} active, "
                f"over max_requests={cfg.max_requests}; free some first"
            )
        if need > len(self._free):
            raise ValueError(f"out of KV pages: the step needs {need}, {len(self._free)} of {cfg.num_pages} are free")
        return need

    def grow(self, growth: Sequence[tuple[Hashable, int]], *, new_ok: bool = True) -> None:
        """Commit a step validated by :meth:`check_growth` (which it runs again first)."""
        self.check_growth(growth, new_ok=new_ok)
        for request_id, n in growth:
            entry = self._requests.setdefault(request_id, _Entry())
            entry.seq_len += int(n)
            while len(entry.pages) < self.config.pages_for(entry.seq_len):
                entry.pages.append(self._free.pop())

    def release(self, request_ids: Iterable[Hashable]) -> int:
        """Free requests' pages (``ValueError`` naming an unknown id; then nothing is freed). Returns pages freed."""
        ids = list(request_ids)
        for r in ids:
            self._entry(r)
        if len(set(ids)) != len(ids):
            raise ValueError(f"request ids to free must be distinct, got {ids!r}")
        freed = 0
        for r in ids:
            entry = self._requests.pop(r)
            self._free.extend(reversed(entry.pages))
            freed += len(entry.pages)
        return freed
