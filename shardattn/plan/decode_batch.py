"""Host plan of one decode batch: padding to a graph bucket and the step's metadata in one tensor.

A decode step's per-query metadata (how many KV tokens of this rank each query sees, which
request, hence which block-table row, it belongs to) depends only on host-known lengths, so the
planner computes it once per batch, on the host (numpy), into one small int32 tensor that
reaches the device in one transfer (staged through a reused pinned buffer). The DCP decode step then issues no
index arithmetic of its own.

The same plan lays a batch out for a captured graph: requests are padded up to a *bucket* of
``padded_requests`` slots of ``q_len`` queries each. A ragged batch (request ``b`` has
``n_b <= q_len`` queries) keeps query ``j`` of request ``b`` at row ``b * q_len + j``; the other
rows of the slot, and every row of a padded request, are *padding*: their local length is 0, so
the kernel writes ``(out 0, lse -inf)`` there and :attr:`DecodeBatch.token_rows` leaves them out
of what is returned::

    q_lens [1, 3, 2], q_len 4, bucket 4 requests     rows  0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12..15
                                                     query a . . . | b b b . | c c .  .  | . . . .
    token_rows = [0, 4, 5, 6, 8, 9]                  (a '.' row is padding: KV length 0)

Metadata (``meta [2, padded_requests * q_len]`` int32):

* ``meta[0, s]``: KV tokens query slot ``s`` sees on this rank: the causal global length
  (query ``j`` of ``n`` sees ``L - n + j + 1``; all ``L`` for non-causal drafts) mapped to the
  rank's share by the DCP layout (:func:`~shardattn.plan.context.dcp_local_seq_lens`); 0 for
  padding.
* ``meta[1, s]``: the request slot ``s`` belongs to (``s // q_len``), the block-table row the
  kernel reads.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch

from shardattn._checks import check_bool, check_int
from shardattn.plan._common import as_lengths, check_token_counts
from shardattn.plan.context import DCPLayout
from shardattn.plan.cudagraph import DecodeQueryLens, decode_query_lens

__all__ = ["DecodeBatch", "bucket_for", "plan_decode_batch", "shard_of"]


def bucket_for(num_requests: int, buckets: tuple[int, ...] | list[int]) -> int | None:
    """The smallest bucket ``>= num_requests``, or ``None`` when the batch is larger than all.

    >>> bucket_for(3, (1, 2, 4, 8)), bucket_for(9, (1, 2, 4, 8))
    (4, None)
    """
    check_int("num_requests", num_requests, minimum=0)
    fits = [b for b in buckets if b >= num_requests]
    return min(fits) if fits else None


@dataclass(frozen=True, eq=False)
class DecodeBatch:
    """One decode batch laid out in ``padded_requests`` slots of ``q_len`` queries.

    Attributes:
        num_requests: real requests ``B``. padded_requests: slots (``>= B``; a graph bucket).
        q_len: queries per slot (the longest request's, or the captured graph's).
        packed: real queries back to back (eager), not in ``q_len`` slots.
        slot_q_lens: ``[padded_requests]`` int64 real queries per request slot (0: padded).
        token_rows: ``[num_tokens]`` int64 row of every real query (request order) in the
            padded layout; rows not listed are padding and are never returned.
        meta: ``[2, padded_requests * q_len]`` int32 (see the module docstring); :meth:`to`
            moves it in one copy.
        seq_lens: ``[padded_requests]`` int32 global KV lengths (0 for padded requests).
        max_kv_len: the most KV tokens of this rank any query sees (``max(meta[0])``, 0 when
            empty): the step checks it against the block table's width on the host.
        shard: ``(world_size, interleave, rank)`` of the DCP layout the local lengths were made
            for; ``(1, 1, 0)`` when the rank holds every token (no layout, or one rank).
        causal: the drafts' causality the lengths were made for; ``None`` when no request has
            two queries (the same plan either way). A step refuses a plan of another shard or
            causality (its lengths would read other KV tokens).
        on_device: ``{device: (meta[0], meta[1]) there}``, filled by the step that first moves
            ``meta`` to a device; the steps of every later layer reuse that copy (no transfer, no
            host work). Use a plan on the stream it was first used on.
    """

    num_requests: int
    padded_requests: int
    q_len: int
    packed: bool
    slot_q_lens: np.ndarray
    token_rows: torch.Tensor
    meta: torch.Tensor
    seq_lens: torch.Tensor
    max_kv_len: int = 0
    shard: tuple[int, int, int] = (1, 1, 0)
    causal: bool | None = None
    on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    @functools.cached_property
    def query_lens(self) -> DecodeQueryLens:
        """The planner's analysis of the padded layout (:func:`decode_query_lens`): ``num_padded``
        requests of length 0, ``uniform`` when no request is short (computed on first use)."""
        ptr = np.concatenate([[0], np.cumsum(self.slot_q_lens)])
        return decode_query_lens(ptr, self.padded_requests)

    @functools.cached_property
    def fingerprint(self) -> int:
        """A 63-bit hash of the batch's global lengths and layout, equal on every rank that
        planned the same batch (its per-rank metadata and rank are not hashed; the DCP layout and
        causality are): what ranks agree on instead of reading the lengths back from the device."""
        h = hashlib.blake2b(digest_size=8)
        h.update(repr((self.num_requests, self.padded_requests, self.q_len, self.packed)).encode())
        h.update(repr((self.shard[:2], self.causal)).encode())
        h.update(np.ascontiguousarray(self.seq_lens.numpy(), dtype=np.int64).tobytes())
        h.update(np.ascontiguousarray(self.slot_q_lens, dtype=np.int64).tobytes())
        return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)

    @property
    def num_tokens(self) -> int:
        """Real query tokens (``sum n_b``)."""
        return int(self.token_rows.shape[0])

    @property
    def num_slots(self) -> int:
        """Query rows of the layout (``padded_requests * q_len``; packed: ``num_tokens``)."""
        return int(self.meta.shape[1])

    @property
    def padding_queries(self) -> int:
        """Query rows that are padding."""
        return self.num_slots - self.num_tokens

    @property
    def rows_are_requests(self) -> bool:
        """Query row ``s`` belongs to request ``s`` (``meta[1]`` is ``arange``): one query per
        request slot, so the step reads the block table as it is, with no gather of its rows."""
        return self.q_len == 1 and (not self.packed or self.num_tokens == self.num_requests)

    @property
    def identity_rows(self) -> bool:
        """Every real query sits at its own index (no padding inside or before the real rows)."""
        return self.packed or self.q_len * self.num_requests == self.num_tokens

    @functools.cached_property
    def pinned_meta(self) -> torch.Tensor:
        """``meta`` in pinned memory, made once and kept with the plan (a graph captured with this
        plan copies from it at every replay, so it must live as long as the plan)."""
        return self.meta if self.meta.is_pinned() else self.meta.pin_memory()

    def to(self, device: torch.device | str) -> torch.Tensor:
        """``meta`` on ``device``: one host-to-device copy (non-blocking when ``meta`` is pinned;
        the Runtime's step stages it through a reused pinned buffer instead)."""
        return self.meta.to(device, non_blocking=self.meta.is_pinned())

    def pad_rows(self, x: torch.Tensor, out: torch.Tensor | None = None, *, name: str = "x") -> torch.Tensor:
        """``x [num_tokens, ...]`` (request order) placed in the padded layout ``[num_slots, ...]``
        (padding rows 0): one scatter; a view-free copy when the layout is the identity. ``name``:
        the argument named in the error for another row count."""
        if x.shape[0] != self.num_tokens:
            raise ValueError(f"{name} must have the plan's num_tokens={self.num_tokens} rows, got {list(x.shape)}")
        dst = x.new_zeros((self.num_slots, *x.shape[1:])) if out is None else out.zero_()
        rows = self.token_rows.to(x.device, non_blocking=True)
        return dst.index_copy_(0, rows, x)

    def real_rows(self, y: torch.Tensor) -> torch.Tensor:
        """The real queries' rows of a padded-layout output ``y [num_slots, ...]`` (request
        order): a slice when the real rows lead, else one gather. Padding never comes back."""
        if y.shape[0] != self.num_slots:
            raise ValueError(f"y must have num_slots={self.num_slots} rows, got {list(y.shape)}")
        if self.identity_rows:
            return y[: self.num_tokens]
        return y.index_select(0, self.token_rows.to(y.device, non_blocking=True))


def _lengths(name: str, values: object, count: int | None = None) -> np.ndarray:
    """``values`` as int64 numpy: :func:`as_lengths`, with vectorised checks for lists and arrays."""
    if isinstance(values, list | tuple | np.ndarray) and not (
        isinstance(values, list | tuple) and bool in map(type, values)
    ):
        arr = np.asarray(values)
        # signed integers only: unsigned ones (and ints past int64, an object array) take the checked path
        if arr.ndim == 1 and (arr.size == 0 or np.issubdtype(arr.dtype, np.signedinteger)):
            arr = arr.astype(np.int64, copy=False)
            if count is not None and arr.shape[0] != count:
                raise ValueError(f"{name} must have {count} entries, got {arr.shape[0]}")
            if arr.size and int(arr.min()) < 0:
                raise ValueError(f"{name} must be non-negative, got {arr.tolist()[:16]}")
            return arr
    return as_lengths(name, values, count=count)  # tensors, and the messages for bad entries (bools too)


def plan_decode_batch(
    seq_lens: object,
    qo_indptr: object | None = None,
    *,
    layout: DCPLayout | None = None,
    rank: int = 0,
    q_len: int | None = None,
    padded_requests: int | None = None,
    causal: bool = True,
    packed: bool = False,
    pin: bool = False,
) -> DecodeBatch:
    """Plan one decode batch on the host (numpy; no device work, no synchronisation).

    The lengths are those of :func:`~shardattn.plan.context.causal_token_seq_lens` and
    :func:`~shardattn.plan.context.dcp_local_seq_lens` (tests compare them), computed here in
    numpy: a step plans every batch on the host, so the plan costs tens of microseconds, not
    a torch op per line.

    Args:
        seq_lens: ``[B]`` global KV tokens per request, drafts included (list, numpy or CPU tensor).
        qo_indptr: ``[B+1]`` query offsets (ragged drafts); ``None``: one query per request, or
            ``q_len`` each when ``q_len`` is given.
        layout, rank: the DCP layout and this rank, in ``[0, layout.world_size)`` (default: no
            DCP, and the rank, whichever it is, holds every token).
        q_len: queries per slot; default the longest request's (at least 1). A request with more
            queries is refused.
        padded_requests: slots (a graph bucket, ``>= B``); default ``B``.
        causal: drafts see each other causally (query ``j`` of ``n`` sees ``L - n + j + 1``).
        packed: lay the real queries back to back (an eager step: no padding rows, ``q_len``
            is the longest request's, 0 when no request has a query, and ``token_rows`` the
            identity) instead of in slots.
        pin: pin ``meta`` (a fresh pinned allocation costs far more than the plan: the Runtime
            stages ``meta`` through a reused pinned buffer instead).
    Raises:
        ValueError: lengths that do not fit (a request with more queries than ``q_len``, or than
            its KV tokens where it has any: a request with none has empty query rows; a
            ``qo_indptr`` not starting at 0;
            ``padded_requests < B``; negative lengths or lengths past int32), a ``rank`` outside
            the layout.
        TypeError: a non-integer length, ``rank`` or ``q_len``; a non-bool ``causal`` /
            ``packed`` / ``pin``.

    >>> p = plan_decode_batch([9, 5, 7], [0, 1, 4, 6], q_len=4, padded_requests=4)
    >>> p.token_rows.tolist(), p.meta[0].tolist()[:12], p.query_lens.num_padded
    ([0, 4, 5, 6, 8, 9], [9, 0, 0, 0, 3, 4, 5, 0, 6, 7, 0, 0], 1)
    """
    lens = check_token_counts("seq_lens", _lengths("seq_lens", seq_lens))
    for flag, value in (("causal", causal), ("packed", packed), ("pin", pin)):
        check_bool(flag, value)
    b = int(lens.shape[0])
    if qo_indptr is None and b and (q_len is None or check_int("q_len", q_len, minimum=1) == 1):
        return _one_query_each(lens, layout, rank, padded_requests, packed, pin)  # plain decode
    if qo_indptr is None:
        ql0 = 1 if q_len is None else check_int("q_len", q_len, minimum=1)
        ptr = np.arange(b + 1, dtype=np.int64) * ql0
    else:
        ptr = _lengths("qo_indptr", qo_indptr, count=b + 1)
        if ptr[0] != 0:  # offsets of q's rows, as the ops' cu_q_lens: not relative to a first one
            raise ValueError(f"qo_indptr must start at 0 (offsets of q's rows), got {ptr.tolist()[:8]}")
    n = np.diff(ptr)
    if (n < 0).any():
        raise ValueError(f"qo_indptr must be non-decreasing, got {ptr.tolist()}")
    longest = int(n.max()) if b else 0
    ql = max(1, longest) if q_len is None else check_int("q_len", q_len, minimum=1)
    if longest > ql:
        i = int(n.argmax())
        raise ValueError(f"request {i} has {longest} queries, more than q_len={ql}")
    short = np.flatnonzero((lens > 0) & (n > lens))
    if short.size:
        raise ValueError(f"requests {short[:8].tolist()} have more queries than KV tokens (seq_lens counts the drafts)")
    slots = _slots(b, padded_requests, layout, rank)
    slot_n = np.zeros(slots, dtype=np.int64)
    slot_n[:b] = n
    slot_lens = np.zeros(slots, dtype=np.int64)
    slot_lens[:b] = lens
    total = int(n.sum())
    owner_real = np.repeat(np.arange(b, dtype=np.int64), n)  # request of each real query
    j_real = np.arange(total, dtype=np.int64) - ptr[:-1][owner_real] + ptr[0] if total else owner_real
    if packed:  # eager: real queries back to back, request order; padded requests have no rows
        ql = longest
        rows_np = np.arange(total, dtype=np.int64)
        owner = owner_real
        num_rows = total
    else:  # graph: slot b holds rows [b*q_len, (b+1)*q_len), its queries first
        rows_np = owner_real * ql + j_real
        owner = np.arange(slots * ql, dtype=np.int64) // ql
        num_rows = slots * ql
    # query j of n sees L - n + j + 1 global tokens (all L when non-causal) ...
    seen = lens[owner_real] - (n[owner_real] - 1 - j_real) if causal else lens[owner_real]
    seen = np.maximum(seen, 0)
    # ... of which this rank holds (L // (N*I)) * I + clamp(L % (N*I) - rank * I, 0, I)
    if layout is not None:
        seen = _local_lens(seen, layout, rank)
    meta_np = np.zeros((2, num_rows), dtype=np.int32)
    meta_np[0, rows_np] = seen
    meta_np[1] = owner
    max_kv_len = int(seen.max()) if seen.size else 0
    meta = torch.from_numpy(meta_np)
    if pin:
        meta = meta.pin_memory()
    return DecodeBatch(
        num_requests=b,
        padded_requests=slots,
        q_len=ql,
        packed=packed,
        slot_q_lens=slot_n,
        token_rows=torch.from_numpy(rows_np),
        meta=meta,
        seq_lens=torch.from_numpy(slot_lens.astype(np.int32)),
        max_kv_len=max_kv_len,
        shard=shard_of(layout, rank),
        causal=causal if longest > 1 else None,
    )


def _slots(b: int, padded_requests: object, layout: object, rank: object) -> int:
    """The plan's request slots (``padded_requests``, default ``b``), after checking them, the
    layout's type and ``rank`` (one of the layout's ranks; any rank without a layout)."""
    slots = b if padded_requests is None else check_int("padded_requests", padded_requests, minimum=0)
    if slots < b:
        raise ValueError(f"padded_requests={slots} is smaller than the batch ({b} requests)")
    if layout is not None and not isinstance(layout, DCPLayout):
        raise TypeError(f"layout must be a DCPLayout, got {type(layout).__name__}")
    check_int("rank", rank, minimum=0, maximum=None if layout is None else layout.world_size - 1)
    return slots


def shard_of(layout: DCPLayout | None, rank: int) -> tuple[int, int, int]:
    """``(world_size, interleave, rank)`` of the tokens a plan's lengths count: ``(1, 1, 0)`` when
    the rank holds every token (no layout, or a layout of one rank).

    >>> shard_of(None, 3), shard_of(DCPLayout(1, 4), 0), shard_of(DCPLayout(2, 4), 1)
    ((1, 1, 0), (1, 1, 0), (2, 4, 1))
    """
    if layout is None or layout.world_size == 1:
        return (1, 1, 0)
    return (layout.world_size, layout.interleave, rank)


def _local_lens(seen: np.ndarray, layout: DCPLayout, rank: int) -> np.ndarray:
    """Of ``seen`` global tokens, the rank holds ``(L // (N*I)) * I + clamp(L % (N*I) - rank * I, 0, I)``."""
    w, i = layout.world_size, layout.interleave
    rest = seen % (w * i) - rank * i
    np.maximum(rest, 0, out=rest)
    np.minimum(rest, i, out=rest)
    return (seen // (w * i)) * i + rest


def _one_query_each(
    lens: np.ndarray,
    layout: DCPLayout | None,
    rank: int,
    padded_requests: int | None,
    packed: bool,
    pin: bool,
) -> DecodeBatch:
    """:func:`plan_decode_batch` of one query per request (``B >= 1``), the plain decode step:
    the same plan as the general path (tests compare them) in a few numpy calls. Query ``b``
    sees all ``L_b`` tokens (causal or not) and reads block-table row ``b``."""
    b = int(lens.shape[0])
    slots = _slots(b, padded_requests, layout, rank)
    seen = lens if layout is None else _local_lens(lens, layout, rank)
    rows = b if packed else slots
    meta_np = np.zeros((2, rows), dtype=np.int32)
    meta_np[0, :b] = seen
    meta_np[1] = np.arange(rows, dtype=np.int32)
    slot_n = np.zeros(slots, dtype=np.int64)
    slot_n[:b] = 1
    slot_lens = np.zeros(slots, dtype=np.int32)
    slot_lens[:b] = lens
    meta = torch.from_numpy(meta_np)
    return DecodeBatch(
        num_requests=b,
        padded_requests=slots,
        q_len=1,
        packed=packed,
        slot_q_lens=slot_n,
        token_rows=torch.from_numpy(np.arange(b, dtype=np.int64)),
        meta=meta.pin_memory() if pin else meta,
        seq_lens=torch.from_numpy(slot_lens),
        max_kv_len=int(seen.max()),
        shard=shard_of(layout, rank),
    )
