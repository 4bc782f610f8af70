"""Requests a pool step takes, and their validation on the driver before any rank runs.

A step is a list of requests. Every tensor is on the CPU (the driver's side), the model's dtype
for activations and KV, int32 for top-k positions:

* :class:`PrefillRequest`: a request's new prompt tokens (a first chunk, or a later chunk of a
  chunked prefill): their KV rows, and (with an attention step) their queries and, for sparse
  MLA, top-k (a GQA prefill is causal).
* :class:`DecodeRequest`: new query tokens of a request already prefilled (``Q`` > 1: drafts),
  their top-k (sparse MLA), and optionally their KV rows, written before the step attends.
* a whole decode step as tensors (:func:`check_decode_batch`, the pool's ``decode_batch``):
  ``q [T, H, D]``, ``topk [T, K]``, the requests' ids and query lengths; checked with array
  operations, no Python work per request.

:func:`pack_step` checks a step against the pool's
:class:`~shardattn.serving.pool_shapes.PoolShapes` and the KV ledger and
concatenates it (request-major, token order); any problem is a ``ValueError`` / ``TypeError``
naming the request and the argument, and nothing has changed yet.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from shardattn._checks import check_choice, check_tensor
from shardattn.plan.kv_pages import ID_DTYPES, PagedKVBook
from shardattn.plan.request_ids import as_int64_ids, shown
from shardattn.serving.pool_shapes import PoolShapes, check_q, check_topk, kv_parts

__all__ = [
    "BatchStep",
    "DecodeRequest",
    "PackedStep",
    "PrefillRequest",
    "check_decode_batch",
    "one_host_thread",
    "pack_step",
]


@contextlib.contextmanager
def one_host_thread(threads: int = 1) -> Iterator[None]:
    """Run the driver's side of a step on one torch CPU thread (or ``threads``), then restore the
    caller's count.

    The step's host work is small copies and checks; with torch's default of one thread per core
    the driver's parallel regions contended with the rank actors' threads on the same host and
    stalled the step by about 5 ms each (two H200s, a 64-request decode; docs/DECISIONS.md, D44).
    """
    n = torch.get_num_threads()
    if n == threads:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(n)


KV = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


@dataclass
class PrefillRequest:
    """New prompt tokens of one request (``n`` tokens).

    Attributes:
        id: any hashable; a new id admits the request, a known one extends it (chunked prefill).
        kv: sparse MLA ``[n, D]`` latent rows; GQA ``(k [n, Hkv, D], v [n, Hkv, Dv])``.
        q: ``[n, H, D]`` queries of every head, or ``None`` to only write the KV (required
            ``None`` when the pool's mode has no prefill attention: ``"dcp-decode"``). A GQA
            pool attends causally: the token at position ``p`` reads the request's KV positions
            ``<= p`` (cached prefix included).
        topk_pos: ``[n, K]`` int32 (int64 is converted) top-k positions inside the request
            (cached prefix included; ``-1`` / out of range = invalid, anywhere), with ``q`` on
            a sparse-MLA pool; ``None`` on a GQA pool.
    """

    id: Hashable
    kv: KV
    q: torch.Tensor | None = None
    topk_pos: torch.Tensor | None = None


@dataclass
class DecodeRequest:
    """New query tokens of a prefilled request (``Q`` tokens: 1, or more with drafts).

    Attributes:
        id: a request id the pool holds KV state for.
        q: ``[Q, H, D]`` queries of every head.
        topk_pos: ``[Q, K]`` int32 top-k positions inside the request (sparse MLA; ``None`` for GQA).
        kv: the ``Q`` tokens' own KV rows (as in :class:`PrefillRequest`), appended before the
            step attends; ``None`` attends over the cache as it is.
    """

    id: Hashable
    q: torch.Tensor
    topk_pos: torch.Tensor | None = None
    kv: KV | None = None


@dataclass
class PackedStep:
    """A validated step, concatenated request-major.

    Attributes:
        ids: the requests. starts: ``[B]`` tokens cached before the step. counts: ``[B]`` new
        tokens (KV rows written). q_counts: ``[B]`` query tokens. q: ``[T, H, D]`` or ``None``.
        kv: per component ``[sum(counts), *row]`` (empty list when nothing is written).
        topk: ``[T, K]`` int32 or ``None``.
    """

    ids: list[Hashable]
    starts: list[int]
    counts: list[int]
    q_counts: list[int]
    q: torch.Tensor | None
    kv: list[torch.Tensor]
    topk: torch.Tensor | None

    @property
    def seq_lens(self) -> list[int]:
        """Tokens of each request after the step."""
        return [s + n for s, n in zip(self.starts, self.counts)]

    def queries(self) -> torch.Tensor:
        """``q``, which every decode step holds (:func:`pack_step` requires each request's)."""
        if self.q is None:
            raise RuntimeError("the step has no queries: a prefill step that only writes KV rows")
        return self.q


def pack_step(
    kind: str,
    requests: Sequence[PrefillRequest | DecodeRequest],
    shapes: PoolShapes,
    book: PagedKVBook,
    *,
    into: dict[str, torch.Tensor] | None = None,
) -> PackedStep:
    """Validate a ``"prefill"`` or ``"decode"`` step and concatenate it; the ledger is not changed.

    ``into``: buffers to concatenate into once the step is valid (``q``, ``topk``, ``kv0`` /
    ``kv1``, each at least the step's rows: a shared-memory region's inputs); the packed
    tensors are then views of their leading rows.

    Raises:
        TypeError / ValueError: naming the request and argument (wrong type, dtype, shape or
            device; unknown id; over ``max_seq_len`` / ``max_requests``; out of pages; a step
            larger than the Runtime's sizes).
    """
    check_choice("kind", kind, ("prefill", "decode"))
    cls = PrefillRequest if kind == "prefill" else DecodeRequest
    if isinstance(requests, PrefillRequest | DecodeRequest) or not isinstance(requests, Sequence):
        raise TypeError(f"{kind} takes a list of {cls.__name__}, got {type(requests).__name__}")
    if not requests:
        raise ValueError(f"{kind} needs at least one request")
    ids: list[Hashable] = []
    starts: list[int] = []
    counts: list[int] = []
    q_counts: list[int] = []
    qs: list[torch.Tensor] = []
    kvs: list[list[torch.Tensor]] = []
    topks: list[torch.Tensor] = []
    for i, req in enumerate(requests):
        if not isinstance(req, cls):
            raise TypeError(f"requests[{i}] must be a {cls.__name__}, got {type(req).__name__}")
        where = f"request {shown(req.id)}"
        topk = None
        if kind == "prefill":
            assert isinstance(req, PrefillRequest)
            parts = kv_parts(shapes, req.kv, f"{where}: kv", None)
            n = int(parts[0].shape[0])
            if n < 1:
                raise ValueError(f"{where}: kv must hold at least one token")
            if req.q is not None and not shapes.prefill_attention:
                raise ValueError(f"{where}: q must be None: this pool's mode has no prefill attention (KV is written)")
            if req.q is None and req.topk_pos is not None:
                raise ValueError(f"{where}: topk_pos given without q")
            if req.q is not None:
                if check_q(shapes, req.q, f"{where}: q") != n:
                    raise ValueError(f"{where}: q must have one row per KV row ({n}), got {req.q.shape[0]}")
                if shapes.kind == "sparse_mla":
                    if req.topk_pos is None:
                        raise ValueError(f"{where}: a sparse-MLA prefill with q needs topk_pos [n, K]")
                    topk = check_topk(shapes, req.topk_pos, f"{where}: topk_pos", n)
                elif req.topk_pos is not None:
                    raise ValueError(f"{where}: topk_pos must be None for a GQA pool (its prefill is causal)")
            q_n = n if req.q is not None else 0
        else:
            assert isinstance(req, DecodeRequest)
            q_n = check_q(shapes, req.q, f"{where}: q")
            if q_n < 1:
                raise ValueError(f"{where}: q must hold at least one query token")
            parts = [] if req.kv is None else kv_parts(shapes, req.kv, f"{where}: kv", q_n)
            n = q_n if parts else 0
            if shapes.kind == "sparse_mla":
                if req.topk_pos is None:
                    raise ValueError(f"{where}: a sparse-MLA decode needs topk_pos [Q, K]")
                topk = check_topk(shapes, req.topk_pos, f"{where}: topk_pos", q_n)
            elif req.topk_pos is not None:
                raise ValueError(f"{where}: topk_pos must be None for a GQA pool")
        ids.append(req.id)
        counts.append(n)
        q_counts.append(q_n)
        if q_n:
            qs.append(req.q)  # type: ignore[arg-type]
            if topk is not None:
                topks.append(topk)
        kvs.append(parts)
    if kind == "prefill" and sum(q_counts) > 0 and min(q_counts) == 0:
        with_q, without = ids[q_counts.index(max(q_counts))], ids[q_counts.index(0)]
        raise ValueError(
            f"a prefill step either attends for every request (q given) or for none: request {shown(with_q)} "
            f"gives q, request {shown(without)} none"
        )
    if len({bool(p) for p in kvs}) > 1:
        flags = [bool(p) for p in kvs]
        with_kv, without = ids[flags.index(True)], ids[flags.index(False)]
        raise ValueError(
            f"a decode step either writes KV for every request (kv given) or for none: request {shown(with_kv)} "
            f"gives kv, request {shown(without)} none"
        )
    total_q = sum(q_counts)
    limit = shapes.max_prefill_tokens if kind == "prefill" else shapes.max_decode_tokens
    if total_q > limit:
        name = "max_batched_tokens" if kind == "prefill" else "max_decode_tokens"
        raise ValueError(f"the step has {total_q} query tokens, over the pool's {name}={limit}")
    book.check_growth(list(zip(ids, counts)), new_ok=kind == "prefill")
    starts.extend(book.seq_len(rid) if rid in book else 0 for rid in ids)
    if kind == "decode":
        empty = [i for i, s, n in zip(ids, starts, counts) if s + n == 0]
        if empty:
            raise ValueError(f"decode of requests with no cached tokens: {shown(empty)}")
        if shapes.kind == "gqa":  # a GQA query attends the keys before it: the ranks would fail the step
            short = [i for i, s, n, q_n in zip(ids, starts, counts, q_counts) if s + n < q_n]
            if short:
                raise ValueError(f"requests {shown(short[:8])} have more queries than keys after the step (the cached "
                                 "tokens and the step's KV rows)")  # fmt: skip

    def cat(parts: list[torch.Tensor], name: str) -> torch.Tensor:
        parts = [p.detach() for p in parts]  # inference: a q that requires grad is read as its values
        if into is None or name not in into:
            return torch.cat(parts)
        rows, buf = sum(int(p.shape[0]) for p in parts), into[name]
        # the region's buffer itself, never a resized copy: it must hold the step as it is
        check_tensor(f"into[{name!r}]", buf, dtypes=(parts[0].dtype,), device=parts[0].device)
        if buf.dim() != parts[0].dim() or buf.shape[0] < rows or buf.shape[1:] != parts[0].shape[1:]:
            raise ValueError(f"into[{name!r}] must hold [{rows}, *{list(parts[0].shape[1:])}], got {list(buf.shape)}")
        region = buf.untyped_storage().data_ptr()
        if any(p.untyped_storage().data_ptr() == region for p in parts):  # requests on step_inputs() rows
            return buf[:rows].copy_(torch.cat(parts))  # through a copy: cat cannot write over its inputs
        return torch.cat(parts, out=buf[:rows])

    kv_cat = [cat([p[c] for p in kvs], f"kv{c}") for c in range(len(kvs[0]))] if kvs[0] else []
    topk_cat = cat(topks, "topk") if topks else None
    return PackedStep(ids, starts, counts, q_counts, cat(qs, "q") if qs else None, kv_cat, topk_cat)


@dataclass
class BatchStep:
    """A validated decode step of whole-step tensors (:func:`check_decode_batch`).

    Attributes:
        slots: ``[B]`` int64 the requests' slots in the ledger. starts: ``[B]`` int64 cached
        tokens before the step. counts: ``[B]`` int64 KV rows the step writes (``q_lens`` or 0).
        q_lens: ``[B]`` int64 query tokens. q: ``[T, H, D]``. topk: ``[T, K]`` int32 or
        ``None``. kv: per component ``[T, *row]`` (empty: nothing written).
    """

    slots: np.ndarray
    starts: np.ndarray
    counts: np.ndarray
    q_lens: np.ndarray
    q: torch.Tensor
    topk: torch.Tensor | None
    kv: list[torch.Tensor]

    @property
    def num_tokens(self) -> int:
        return int(self.q_lens.sum())


def _index_array(
    name: str, value: object, dtypes: tuple[torch.dtype, ...] = (torch.int64, torch.int32)
) -> np.ndarray | Sequence[Hashable]:
    """A 1-D integer tensor (of ``dtypes``) / array as int64 NumPy (CPU only); another sequence as it is."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU, got {value.device}")
        if value.dtype not in dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise TypeError(f"{name} must have dtype in ({names}), got {str(value.dtype).replace('torch.', '')}")
        if value.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {list(value.shape)}")
        return value.numpy().astype(np.int64, copy=False)
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "iu" or value.ndim != 1:
            raise TypeError(f"{name} must be a 1-D integer array, got {value.dtype} of shape {list(value.shape)}")
        return as_int64_ids(name, value)
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a 1-D int64 tensor or a sequence, got {type(value).__name__}")
    return value


def check_decode_batch(
    shapes: PoolShapes,
    book: PagedKVBook,
    request_ids: object,
    q: object,
    topk_pos: object = None,
    *,
    query_lens: object = None,
    kv: object = None,
) -> BatchStep:
    """Validate a decode step given as whole-step tensors; nothing changes. Array checks only.

    Args:
        request_ids: ``[B]`` integer tensor (a dtype of :data:`~shardattn.plan.kv_pages.ID_DTYPES`,
            as the ledger and the pool's ``free`` take ids) or NumPy array of distinct prefilled
            request ids, or a sequence of ids (any hashables; looked up one by one).
        q: ``[T, H, D]`` queries, request-major (request ``b``'s ``query_lens[b]`` tokens in order).
        topk_pos: ``[T, K]`` int32 (int64 is converted) top-k positions inside each token's
            request (sparse MLA); ``None`` for GQA.
        query_lens: ``[B]`` query tokens per request (default: one each, ``T == B``).
        kv: the ``T`` tokens' own KV rows (``[T, D]``; GQA ``(k [T, Hkv, D], v [T, Hkv, Dv])``),
            appended before the step attends; ``None`` attends over the cache as it is.
    Raises:
        TypeError / ValueError: naming the argument (and ``request_ids[i]`` for a request:
            unknown, repeated, over ``max_seq_len``), or out of pages.
    """
    ids = _index_array("request_ids", request_ids, ID_DTYPES)
    b = len(ids)
    if b == 0:
        raise ValueError("request_ids must name at least one request")
    t = check_q(shapes, q, "q")
    assert isinstance(q, torch.Tensor)
    if query_lens is None:
        if t != b:
            raise ValueError(
                f"q must have one row per request ({b}) without query_lens, got {t}; pass query_lens for drafts"
            )
        lens = np.ones(b, dtype=np.int64)
    else:
        lens_in = _index_array("query_lens", query_lens)
        lens = np.asarray(lens_in) if not isinstance(lens_in, np.ndarray) else lens_in
        if lens.dtype.kind not in "iu":
            raise TypeError(f"query_lens must hold integers, got {lens.dtype}")
        if lens.dtype.kind == "u" and lens.size and int(lens.max()) > np.iinfo(np.int64).max:
            raise ValueError(f"query_lens must be below 2**63, got {int(lens.max())}")
        lens = lens.astype(np.int64, copy=False)
        if lens.shape != (b,):
            raise ValueError(f"query_lens must have shape [{b}] (one per request), got {list(lens.shape)}")
        if b and int(lens.min()) < 1:
            raise ValueError(f"query_lens must be >= 1, got query_lens[{int(lens.argmin())}]={int(lens.min())}")
        if b and int(lens.max()) > t:  # before the sum, which int64 would wrap
            i = int(lens.argmax())
            raise ValueError(f"query_lens[{i}]={int(lens[i])} is more than q's {t} rows")
        if int(lens.sum()) != t:
            raise ValueError(f"q must have sum(query_lens)={int(lens.sum())} rows, got {t}")
    if t > shapes.max_decode_tokens:
        raise ValueError(f"q has {t} query tokens, over the pool's max_decode_tokens={shapes.max_decode_tokens}")
    topk: torch.Tensor | None = None
    if shapes.kind == "sparse_mla":
        if topk_pos is None:
            raise ValueError("topk_pos must be given ([T, K] int32) for a sparse-MLA pool")
        topk = check_topk(shapes, topk_pos, "topk_pos", t)
    elif topk_pos is not None:
        raise ValueError("topk_pos must be None for a GQA pool")
    parts = [] if kv is None else kv_parts(shapes, kv, "kv", t)
    slots = book.slots(ids)
    counts = lens if parts else np.zeros(b, dtype=np.int64)
    book.check_slots(slots, counts)
    starts = book.lens[slots]
    if shapes.kind == "gqa":  # a GQA query attends the keys before it: the ranks would fail the step
        short = np.flatnonzero(starts + counts < lens)
        if short.size:
            raise ValueError(f"request_ids[{int(short[0])}] has {int(lens[short[0]])} queries but "
                             f"{int(starts[short[0]] + counts[short[0]])} keys after the step (the cached "
                             "tokens and the step's KV rows)")  # fmt: skip
    return BatchStep(slots, starts, counts, lens, q, topk, parts)
