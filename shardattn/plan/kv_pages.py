"""Paged KV-cache bookkeeping for a serving pool: which pages each request holds, host-side.

:class:`PagedKVBook` is the driver's ledger over a :class:`~shardattn.plan.kv_cache_config.KVCacheConfig`
(one set of page ids per request, the same on every rank, so one block table serves every rank):
:meth:`~PagedKVBook.check_growth` validates a whole step (unknown request, over ``max_seq_len``,
too many requests, out of pages) without changing anything, :meth:`~PagedKVBook.grow` then
commits it, :meth:`~PagedKVBook.release` frees requests.

>>> from shardattn.plan.context import DCPLayout
>>> from shardattn.plan.kv_cache_config import KVCacheConfig
>>> book = PagedKVBook(KVCacheConfig(page_size=4, layout=DCPLayout(2), max_requests=2, max_seq_len=16))
>>> book.grow([("a", 9)]); book.seq_len("a"), book.pages("a")
(9, [0, 1])
>>> book.check_growth([("b", 17)])
Traceback (most recent call last):
    ...
ValueError: request 'b': 17 tokens would exceed max_seq_len=16
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import numpy as np
import torch

from shardattn._checks import check_int, check_tensor
from shardattn.plan._common import as_lengths
from shardattn.plan.kv_cache_config import KVCacheConfig
from shardattn.plan.request_ids import as_int64_ids, shown

__all__ = ["PagedKVBook"]


#: Tensor dtypes integer request ids are taken in (:meth:`PagedKVBook.slots`, :meth:`PagedKVBook.ids_of`,
#: and the serving pool's ``decode_batch`` and ``free``).
ID_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
#: New tokens of a step's requests: one int for all, or one per slot (a sequence, an integer
#: array or a CPU integer tensor).
Counts = int | Sequence[int] | np.ndarray | torch.Tensor


class PagedKVBook:
    """The driver's ledger of a paged KV cache (see the module docstring). Host-only, no tensors.

    Each request holds a *slot* (``0 .. max_requests - 1``) of three arrays: its cached tokens,
    its pages, and its block-table row (``[max_requests, pages_per_request]`` int32, ``-1``
    padded). The per-request methods (:meth:`check_growth`, :meth:`grow`, :meth:`table`) take ids;
    a decode step of many requests uses the array ones (:meth:`slots`, :meth:`check_slots`,
    :meth:`grow_slots`, :meth:`table_rows`), which do no Python work per request.
    """

    def __init__(self, config: KVCacheConfig) -> None:
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
        self.config = config
        self.reset()

    def reset(self) -> None:
        """Forget every request (all pages free)."""
        cfg = self.config
        self._free = list(range(cfg.pages_per_rank - 1, -1, -1))  # pop() hands out page 0 first
        self._slot: dict[Hashable, int] = {}  # admission order
        self._free_slots = list(range(cfg.max_requests - 1, -1, -1))
        #: per slot: cached tokens, pages held, block-table row
        self.lens = np.zeros(cfg.max_requests, dtype=np.int64)
        self.npages = np.zeros(cfg.max_requests, dtype=np.int64)
        self.block_table = np.full((cfg.max_requests, max(1, cfg.pages_per_request)), -1, dtype=np.int32)
        self._int_index: tuple[np.ndarray, np.ndarray] | None = None  # sorted int ids and their slots

    # -- queries -------------------------------------------------------------------------------
    def __contains__(self, request_id: object) -> bool:
        try:
            return request_id in self._slot
        except TypeError:
            return False

    def __len__(self) -> int:
        return len(self._slot)

    def ids_of(self, ids: torch.Tensor | np.ndarray, name: str = "request_ids") -> list[int]:
        """Integer request ids given as a 1-D CPU tensor or array (as :meth:`slots` takes them), as
        the Python ints the ledger keys them by; ``TypeError`` / ``ValueError`` naming ``name``."""
        if isinstance(ids, torch.Tensor):
            check_tensor(name, ids, dtypes=ID_DTYPES, ndim=1, device=torch.device("cpu"))
            ids = ids.numpy()
        if ids.dtype.kind not in "iu" or ids.ndim != 1:
            raise TypeError(f"{name} must be a 1-D integer array, got {ids.dtype} of shape {list(ids.shape)}")
        return as_int64_ids(name, ids).tolist()

    @property
    def request_ids(self) -> list[Hashable]:
        """Requests holding KV state, in admission order."""
        return list(self._slot)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def seq_len(self, request_id: Hashable) -> int:
        """Tokens cached for a request (``ValueError`` when unknown)."""
        return int(self.lens[self._slot_of(request_id)])

    def pages(self, request_id: Hashable) -> list[int]:
        s = self._slot_of(request_id)
        return self.block_table[s, : self.npages[s]].tolist()

    def _slot_of(self, request_id: Hashable) -> int:
        try:
            return self._slot[request_id]
        except (KeyError, TypeError):
            raise ValueError(f"unknown request id {shown(request_id)} (never prefilled, or freed)") from None

    def table(self, request_ids: Sequence[Hashable], width: int | None = None) -> list[list[int]]:
        """Block-table rows of ``request_ids`` (padded with ``-1`` to ``width``, default the longest;
        :meth:`table_rows`: ``width`` below the pages of one of them is a ``ValueError``)."""
        slots = np.array([self._slot_of(r) for r in request_ids], dtype=np.int64)
        return self.table_rows(slots, width).tolist()

    def pages_for(self, seq_lens: np.ndarray) -> np.ndarray:
        """:meth:`KVCacheConfig.pages_for` of an int64 array, elementwise."""
        lay, cfg = self.config.layout, self.config
        n, i = lay.world_size, lay.interleave
        local = (seq_lens // (n * i)) * i + np.minimum(seq_lens % (n * i), i)  # rank 0's share
        return -(-local // cfg.page_size)

    # -- the array side (one decode step of many requests) --------------------------------------
    def slots(self, request_ids: object, name: str = "request_ids") -> np.ndarray:
        """``[B]`` int64 slots of known requests: an integer array (NumPy, or a CPU tensor of an
        integer dtype; looked up vectorised) or a sequence of ids.

        Raises:
            ValueError: an unknown id (named as ``name[i]``), a tensor off the CPU. TypeError: not ids.
        """
        if isinstance(request_ids, torch.Tensor):
            check_tensor(name, request_ids, dtypes=ID_DTYPES, device=torch.device("cpu"))
            request_ids = request_ids.numpy()
        if isinstance(request_ids, np.ndarray) and request_ids.dtype.kind in "iu":
            ids = as_int64_ids(name, request_ids).reshape(-1)
            keys, slots = self._int_ids()
            pos = np.minimum(np.searchsorted(keys, ids), max(0, keys.size - 1))
            found = keys[pos] == ids if keys.size else np.zeros(ids.shape, dtype=bool)
            if not found.all():
                b = int(np.argmin(found))
                raise ValueError(f"{name}[{b}]: unknown request id {int(ids[b])} (never prefilled, or freed)")
            return slots[pos]
        if isinstance(request_ids, str | bytes) or not isinstance(request_ids, Sequence):
            raise TypeError(f"{name} must be an integer array or a sequence of request ids, got "
                            f"{type(request_ids).__name__}")  # fmt: skip
        out = np.empty(len(request_ids), dtype=np.int64)
        for b, r in enumerate(request_ids):
            try:
                out[b] = self._slot[r]
            except (KeyError, TypeError):
                raise ValueError(f"{name}[{b}]: unknown request id {shown(r)} (never prefilled, or freed)") from None
        return out

    def _int_ids(self) -> tuple[np.ndarray, np.ndarray]:
        """The integer ids held, sorted, and their slots (rebuilt after admissions and frees); an int
        id outside int64 is left out (no integer array holds it: only a sequence names it)."""
        if self._int_index is None:
            ints = (int, np.integer)
            items = [
                (k, s)
                for k, s in self._slot.items()
                if isinstance(k, ints) and not isinstance(k, bool) and -(2**63) <= int(k) < 2**63
            ]
            keys = np.array([k for k, _ in items], dtype=np.int64)
            slots = np.array([s for _, s in items], dtype=np.int64)
            order = np.argsort(keys, kind="stable")
            self._int_index = keys[order], slots[order]
        return self._int_index

    def _counts(self, slots: np.ndarray, counts: Counts) -> np.ndarray | int:
        """``counts`` checked: one int, or ``[B]`` ints (a sequence, an array or a CPU tensor, one per
        slot), none negative. Raises naming ``counts``."""
        if isinstance(counts, Iterable) and not isinstance(counts, str | bytes):
            return as_lengths("counts", counts, count=int(np.size(slots)))
        return check_int("counts", counts, minimum=0)

    def check_slots(self, slots: np.ndarray, counts: Counts, name: str = "request_ids") -> int:
        """Validate adding ``counts`` (``[B]`` or one int, none negative) tokens to known ``slots``;
        nothing changes. Returns the pages the step would take.

        Raises:
            ValueError: a repeated slot, a request past ``max_seq_len``, not enough free pages (the
                first request that does not fit named; requests named as ``name[i]``); negative
                ``counts`` or not one per slot.
            TypeError: ``counts`` not ints.
        """
        cfg = self.config
        counts = self._counts(slots, counts)
        if np.unique(slots).size != slots.size:
            order = np.argsort(slots, kind="stable")
            dup = order[1:][slots[order][1:] == slots[order][:-1]][0]
            rid = self._id_of(int(slots[dup]))
            raise ValueError(f"{name}[{int(dup)}]: request {shown(rid)} appears twice in one step")
        total = self.lens[slots] + counts
        over = total > cfg.max_seq_len
        if over.any():
            b = int(np.argmax(over))
            raise ValueError(f"{name}[{b}]: request {shown(self._id_of(int(slots[b])))}: {int(total[b])} tokens would "
                             f"exceed max_seq_len={cfg.max_seq_len}")  # fmt: skip
        needs = self.pages_for(total) - self.npages[slots]
        need = int(needs.sum())
        if need > len(self._free):
            b = int(np.argmax(np.cumsum(needs) > len(self._free)))
            raise self._out_of_pages(need, f"{name}[{b}]: request {shown(self._id_of(int(slots[b])))}", int(needs[b]))
        return need

    def _out_of_pages(self, need: int, request: str, own: int) -> ValueError:
        """The step's error when its ``need`` pages are more than are free: it names ``request``, the
        first (in step order) whose ``own`` new pages do not fit after those before it."""
        return ValueError(
            f"out of KV pages: the step needs {need}, {len(self._free)} of {self.config.num_pages} are free; "
            f"{request} is the first that does not fit (it needs {own} more); free some requests first"
        )

    def grow_slots(self, slots: np.ndarray, counts: Counts) -> None:
        """Commit a step of known requests validated by :meth:`check_slots`: only requests that
        cross into a new page take one (a loop over those only). ``counts`` is checked again as
        :meth:`check_slots` does (before anything changes)."""
        counts = self._counts(slots, counts)
        self.lens[slots] += counts
        want = self.pages_for(self.lens[slots])
        for b in np.nonzero(want > self.npages[slots])[0].tolist():
            s = int(slots[b])
            while self.npages[s] < want[b]:
                self.block_table[s, self.npages[s]] = self._free.pop()
                self.npages[s] += 1

    def undo_growth(self, slots: np.ndarray, counts: Counts) -> None:
        """Undo :meth:`grow_slots` ``(slots, counts)`` of a step that did not run: the lengths back,
        and the pages they took back on the free list (the next step takes them again).

        Raises:
            ValueError / TypeError: ``counts`` as :meth:`check_slots` refuses it, or more tokens than
                a request holds (nothing changes then).
        """
        counts = self._counts(slots, counts)
        held = self.lens[slots]
        short = held < counts
        if short.any():
            b = int(np.argmax(short))
            what = f"counts[{b}]={int(counts[b])}" if isinstance(counts, np.ndarray) else f"counts={counts}"
            rid = self._id_of(int(slots[b]))
            raise ValueError(f"{what} is more than the {int(held[b])} tokens request {shown(rid)} holds")
        self.lens[slots] -= counts
        want = self.pages_for(self.lens[slots])
        # back in the reverse order grow_slots took them, so the free list is as it was
        for b in reversed(np.nonzero(want < self.npages[slots])[0].tolist()):
            s = int(slots[b])
            while self.npages[s] > want[b]:
                self.npages[s] -= 1
                self._free.append(int(self.block_table[s, self.npages[s]]))
                self.block_table[s, self.npages[s]] = -1

    def table_rows(self, slots: np.ndarray, width: int | None = None) -> np.ndarray:
        """``[B, width]`` int32 block-table rows of ``slots``, ``-1`` padded (default width: the most
        pages held).

        Raises:
            ValueError: ``width`` below the most pages one of ``slots`` holds (a row would lose pages).
            TypeError: ``width`` not an int.
        """
        most = int(self.npages[slots].max(initial=0))
        w = most if width is None else check_int("width", width)
        if w < most:
            raise ValueError(f"width must be >= {most} (the most pages one of the requests holds), got {w}")
        rows = self.block_table[slots, : min(w, self.block_table.shape[1])]
        if w > rows.shape[1]:
            rows = np.concatenate([rows, np.full((rows.shape[0], w - rows.shape[1]), -1, dtype=np.int32)], axis=1)
        return rows

    def _id_of(self, slot: int) -> Hashable:
        return next(k for k, s in self._slot.items() if s == slot)

    # -- changes -------------------------------------------------------------------------------
    def check_growth(self, growth: Iterable[tuple[Hashable, int]], *, new_ok: bool = True) -> int:
        """Validate adding ``new_tokens`` to each ``(request_id, new_tokens)`` of one step; nothing changes.

        Unknown ids are new requests when ``new_ok`` (prefill), else an error (decode).
        Returns the pages the step would take.

        Raises:
            ValueError: a repeated or (with ``new_ok=False``) unknown id, a request past
                ``max_seq_len``, more than ``max_requests`` requests, or not enough free pages
                (naming the first request, in step order, that does not fit).
        """
        cfg = self.config
        seen: set[Hashable] = set()
        need = admitted = 0
        short: tuple[Hashable, int] | None = None  # the first request past the free pages, and its pages
        for request_id, new_tokens in growth:
            try:
                hash(request_id)
            except TypeError:
                raise TypeError(f"request ids must be hashable, got {type(request_id).__name__}") from None
            if request_id in seen:
                raise ValueError(f"request {shown(request_id)} appears twice in one step")
            seen.add(request_id)
            n = check_int(f"new tokens of request {shown(request_id)}", new_tokens, minimum=0)
            slot = self._slot.get(request_id)
            if slot is None:
                if not new_ok:
                    raise ValueError(f"unknown request id {shown(request_id)} (never prefilled, or freed)")
                admitted += 1
                cached = held = 0
            else:
                cached, held = int(self.lens[slot]), int(self.npages[slot])
            total = cached + n
            if total > cfg.max_seq_len:
                raise ValueError(
                    f"request {shown(request_id)}: {total} tokens would exceed max_seq_len={cfg.max_seq_len}"
                )
            need += cfg.pages_for(total) - held
            if short is None and need > len(self._free):
                short = (request_id, cfg.pages_for(total) - held)
        if len(self._slot) + admitted > cfg.max_requests:
            raise ValueError(
                f"{admitted} new requests would make {len(self._slot) + admitted} active, "
                f"over max_requests={cfg.max_requests}; free some first"
            )
        if short is not None:
            raise self._out_of_pages(need, f"request {shown(short[0])}", short[1])
        return need

    def grow(self, growth: Iterable[tuple[Hashable, int]], *, new_ok: bool = True) -> None:
        """Commit a step validated by :meth:`check_growth` (which it runs again first); ``growth``
        may be any iterable (a generator too: it is read once)."""
        growth = list(growth)
        self.check_growth(growth, new_ok=new_ok)
        for request_id, n in growth:
            slot = self._slot.get(request_id)
            if slot is None:
                slot = self._slot[request_id] = self._free_slots.pop()
                self._int_index = None
            self.lens[slot] += int(n)
            want = self.config.pages_for(int(self.lens[slot]))
            while self.npages[slot] < want:
                self.block_table[slot, self.npages[slot]] = self._free.pop()
                self.npages[slot] += 1

    def release(self, request_ids: Iterable[Hashable]) -> int:
        """Free requests' pages (``ValueError`` naming an unknown id; then nothing is freed). Returns pages freed."""
        ids = list(request_ids)
        for r in ids:
            self._slot_of(r)
        if len(set(ids)) != len(ids):
            raise ValueError(f"request ids to free must be distinct, got {shown(ids)}")
        freed = 0
        for r in ids:
            slot = self._slot.pop(r)
            n = int(self.npages[slot])
            self._free.extend(reversed(self.block_table[slot, :n].tolist()))
            self.block_table[slot, :n] = -1
            self.lens[slot] = self.npages[slot] = 0
            self._free_slots.append(slot)
            freed += n
        self._int_index = None
        return freed
