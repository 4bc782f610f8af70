"""The Runtime's arguments as the user passed them: lengths, index tensors, head counts.

One meaning per name, in every mode and step (vLLM's, where vLLM has the name):

* ``query_lens``: ``[B]`` new (query) tokens of each request in this step.
* ``prefix_lens``: ``[B]`` tokens of each request already in the KV cache before this step.
* ``seq_lens``: ``[B]`` KV tokens of each request *including* the cached prefix and this step's
  tokens (``prefix_lens + query_lens``; decode: drafts included).
* ``cu_q_lens``: ``[B + 1]`` offsets of each request's new (query) tokens in ``q``
  (``[0, cumsum(query_lens)]``; GQA prefill and decode).
* ``rows``: ``[T, K]`` global KV-cache rows (indices into ``kv_cache`` itself).
* ``topk_pos``: ``[T, K]`` positions inside the token's request (``0 .. seq_len - 1``), turned into
  rows through a ``block_table``.

Lengths may be host lists (or tensors); index tensors may be int64 (what ``torch.arange`` gives):
:func:`as_index` converts them to the kernels' int32 once, checking the values on CPU tensors
(exact, or a ``ValueError`` naming the argument) and saturating them on a device (no
synchronisation; a value past int32 stays out of range, so an invalid entry stays invalid).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import NoReturn, overload

import numpy as np
import torch

from shardattn._checks import (
    FLOAT_DTYPES,
    check_block_table_holds,
    check_bool,
    check_cu_q_lens,
    check_int,
    check_max_q_len,
    check_queries_fit,
    check_tensor,
)
from shardattn.parallel.comm import Comm
from shardattn.plan._common import as_lengths
from shardattn.plan.decode_batch import DecodeBatch

__all__ = [
    "as_index",
    "check_drafts_on_host",
    "check_gqa_cache",
    "check_paged_rows",
    "check_plan_lengths",
    "check_queries",
    "check_sinks_declared",
    "check_step_flag",
    "check_table_on_host",
    "host_lengths",
    "prefill_lengths",
    "reject",
]

_INT32 = torch.iinfo(torch.int32)
#: Integer dtypes converted to int32 (narrower ones are exact; int64 is checked or saturated).
_CONVERTIBLE = (torch.int64, torch.int16, torch.int8, torch.uint8)


def host_lengths(name: str, value: object) -> list[int]:
    """``value`` (a sequence of ints, numpy array or tensor; a device tensor is read back once)
    as a list of non-negative ints; errors name ``name``.

    >>> host_lengths("query_lens", torch.tensor([3, 4]))
    [3, 4]
    """
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        value = value.cpu()
    return as_lengths(name, value).tolist()


def prefill_lengths(
    query_lens: object, prefix_lens: object | None, seq_lens: object | None
) -> tuple[list[int], list[int] | None]:
    """``(query_lens, prefix_lens)`` of a prefill step from what the caller passed: ``prefix_lens``,
    or ``seq_lens`` (prefix included, ``prefix = seq - query``), or neither (no cached prefix).

    >>> prefill_lengths([3, 4], None, [10, 4])
    ([3, 4], [7, 0])
    >>> prefill_lengths([3], None, [2])
    Traceback (most recent call last):
    ...
    ValueError: seq_lens[0] = 2 is less than query_lens[0] = 3 (seq_lens counts the cached prefix and the new tokens)
    """
    query = host_lengths("query_lens", query_lens)
    prefix = None if prefix_lens is None else host_lengths("prefix_lens", prefix_lens)
    if seq_lens is None:
        if prefix is not None and len(prefix) != len(query):
            raise ValueError(
                f"prefix_lens must have {len(query)} entries (one per request of query_lens), got {len(prefix)}"
            )
        return query, prefix
    total = host_lengths("seq_lens", seq_lens)
    if len(total) != len(query):
        raise ValueError(f"seq_lens must have {len(query)} entries (one per request of query_lens), got {len(total)}")
    for i, (s, n) in enumerate(zip(total, query)):
        if s < n:
            raise ValueError(
                f"seq_lens[{i}] = {s} is less than query_lens[{i}] = {n} "
                "(seq_lens counts the cached prefix and the new tokens)"
            )
    from_seq = [s - n for s, n in zip(total, query)]
    if prefix is not None and prefix != from_seq:
        i = next(i for i, (a, b) in enumerate(zip(prefix, from_seq)) if a != b)
        raise ValueError(
            f"prefix_lens and seq_lens disagree: prefix_lens[{i}] = {prefix[i]}, but seq_lens[{i}] - query_lens[{i}] "
            f"= {from_seq[i]}; pass one of them"
        )
    return query, from_seq


@overload
def as_index(name: str, value: None, device: torch.device | None = None) -> None: ...
@overload
def as_index(name: str, value: torch.Tensor | Sequence[int], device: torch.device | None = None) -> torch.Tensor: ...
@overload
def as_index(
    name: str, value: torch.Tensor | Sequence[int] | None, device: torch.device | None = None
) -> torch.Tensor | None: ...
def as_index(name: str, value: object, device: torch.device | None = None) -> object:
    """An index or length argument as int32: ``None`` stays ``None``; a host sequence of ints (a
    list, tuple or range) or an integer NumPy array becomes a tensor on ``device``; an int64 (or
    narrower integer) tensor is converted once (values checked on the CPU, saturated on a device:
    see the module docstring).
    Other dtypes, and values of any other type, pass through unchanged, for the step's own check
    to name (the overloads state the contract for the declared argument types).

    >>> as_index("rows", torch.arange(3)).dtype
    torch.int32
    >>> as_index("rows", torch.tensor([2**40]))
    Traceback (most recent call last):
    ...
    ValueError: rows must fit int32 (the kernels' index type), got a value of 1099511627776
    """
    if value is None:
        return None
    if isinstance(value, np.ndarray):  # host values, as a list's
        value = torch.from_numpy(np.ascontiguousarray(value))
        if value.dtype == torch.int32:
            return value if device is None else value.to(device)
        if value.dtype not in _CONVERTIBLE:
            return value  # floats, bools, uint64: the step's dtype check names them
        value = as_index(name, value)
        return value if device is None else value.to(device)
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):  # a list, tuple, range
        try:
            value = torch.tensor(value)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"{name} must be a tensor or a list of ints, got {type(value).__name__}") from None
        if value.numel() == 0:
            value = value.to(torch.int64)
        if value.dtype != torch.int64:
            return value  # floats or bools: the step's dtype check names them
        value = as_index(name, value)
        return value if device is None else value.to(device)
    if not isinstance(value, torch.Tensor) or value.dtype not in _CONVERTIBLE:
        return value
    if value.device.type == "cpu":
        if value.numel() and value.dtype == torch.int64:
            lo, hi = int(value.min()), int(value.max())
            bad = lo if lo < _INT32.min else hi if hi > _INT32.max else None
            if bad is not None:
                raise ValueError(f"{name} must fit int32 (the kernels' index type), got a value of {bad}")
        return value.to(torch.int32)
    return value.clamp(_INT32.min, _INT32.max).to(torch.int32)


def _host_ints(name: str, value: object) -> list[int] | None:
    """``value``'s ints when they are on the host (a sequence of ints, a 1-D integer NumPy array or
    a 1-D integer CPU tensor); ``None`` for a device tensor (reading it would sync) or anything else."""
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):  # read as it is: no tensor made
        return list(value) if all(isinstance(v, int) and not isinstance(v, bool) for v in value) else None
    if isinstance(value, np.ndarray):
        ok = value.ndim == 1 and np.issubdtype(value.dtype, np.integer)
        return [int(v) for v in value.tolist()] if ok else None
    if not isinstance(value, torch.Tensor) or value.device.type != "cpu" or value.dim() != 1:
        return None
    return value.tolist() if value.dtype in (torch.int32, *_CONVERTIBLE) else None


def check_drafts_on_host(
    seq_lens: object,
    cu_q_lens: object,
    *,
    q_len_per_req: object,
    max_q_len: object,
    tokens: int,
    requests: int,
) -> None:
    """A GQA decode step's drafts against ``seq_lens`` and ``max_q_len``, on the values as the
    caller passed them: the step moves host lists to q's device, where the op reads no value (a
    read would sync). Raises the op's ``ValueError`` (:func:`~shardattn._checks.check_queries_fit`,
    :func:`~shardattn._checks.check_max_q_len`) or ``TypeError`` / ``ValueError`` for a
    ``max_q_len`` or ``q_len_per_req`` that is not an int in range (:func:`~shardattn._checks.check_int`).

    ``tokens``: q's rows; ``requests``: the block table's rows. Uniform drafts (no ``cu_q_lens``)
    must fill q (a ``ValueError`` naming q, as the head-TP op's). Reads host values only (a list,
    tuple or range of ints, or a 1-D integer CPU tensor). Checks nothing the op refuses on other
    grounds first, which it names: ``seq_lens`` or ``cu_q_lens`` of another length, both
    ``q_len_per_req`` and ``cu_q_lens``. Host ``cu_q_lens`` that
    does not start at 0, decreases or ends past q's rows raises the op's message
    (:func:`~shardattn._checks.check_cu_q_lens`). ``max_q_len=None``: no bound to check.
    """
    if q_len_per_req is not None and cu_q_lens is not None:
        return
    seq = _host_ints("seq_lens", seq_lens)
    if seq is not None and len(seq) != requests:
        seq = None
    if cu_q_lens is not None:
        cu = _host_ints("cu_q_lens", cu_q_lens)
        if cu is None or len(cu) != requests + 1:
            return
        check_cu_q_lens(cu, tokens)
        queries = [hi - lo for lo, hi in itertools.pairwise(cu)]
        if max_q_len is not None:
            check_max_q_len(check_int("max_q_len", max_q_len, minimum=0), queries)
        if seq is not None:
            check_queries_fit(seq, queries)
    else:  # uniform drafts fill q: named as the caller passed it (the DCP step's own name is another)
        q_len = 1 if q_len_per_req is None else check_int("q_len_per_req", q_len_per_req, minimum=1)
        if tokens != requests * q_len:
            raise ValueError(
                f"q must have batch * q_len_per_req = {requests} * {q_len} = {requests * q_len} rows, got {tokens}"
            )
        if seq is not None:
            check_queries_fit(seq, [q_len] * requests)


def check_table_on_host(block_table: object, seq_lens: object, *, page_size: int, kv_rows: int) -> None:
    """A head-TP sparse-MLA decode's ``block_table`` points into the cache's ``kv_rows`` rows and
    holds each request's ``seq_lens`` tokens, where both are CPU integer tensors (as the DCP step
    checks its shard's: :func:`~shardattn._checks.check_block_table_holds`); the step's own checks
    name anything else."""
    if not (isinstance(block_table, torch.Tensor) and block_table.device.type == "cpu" and block_table.dim() == 2):
        return
    if block_table.dtype not in (torch.int32, torch.int64):
        return
    lens = None
    if isinstance(seq_lens, torch.Tensor) and seq_lens.device.type == "cpu" and seq_lens.dim() == 1:
        lens = seq_lens if seq_lens.shape[0] == block_table.shape[0] else None
    check_block_table_holds(block_table, page_size, kv_rows, lens)


def check_plan_lengths(batch: object, seq_lens: object, cu_q_lens: object, *, q_len_per_req: object) -> None:
    """A DCP GQA decode's host plan ``batch`` against the lengths passed beside it, where those are
    on the host (a list, or a CPU tensor; a device tensor is not read, which would sync). The
    plan's lengths replace them in the step, so a plan of other lengths would give wrong rows.

    ``seq_lens`` and ``cu_q_lens``' queries compare per request (``B`` entries) or per slot (the
    plan's padded requests, padded slots 0); ``q_len_per_req`` must be every request's query count.
    Raises ``TypeError`` (``batch`` not a :class:`~shardattn.plan.decode_batch.DecodeBatch`) or
    ``ValueError`` naming the argument that disagrees.
    """
    if not isinstance(batch, DecodeBatch):
        raise TypeError(f"batch must be a DecodeBatch from plan(), got {type(batch).__name__}")
    b = batch.num_requests

    def matches(given: list[int], planned: list[int]) -> bool:
        return len(given) in (b, len(planned)) and given == planned[: len(given)]

    seq = _host_ints("seq_lens", seq_lens)
    if seq is not None and not matches(seq, planned_lens := batch.seq_lens.tolist()):
        raise ValueError(
            f"seq_lens must be the lengths batch was planned for: got {seq[:16]}, batch has {planned_lens[:16]}"
        )
    cu = _host_ints("cu_q_lens", cu_q_lens)
    if cu is not None:
        queries = [hi - lo for lo, hi in itertools.pairwise(cu)]
        if not matches(queries, planned_q := batch.slot_q_lens.tolist()):
            raise ValueError(
                f"cu_q_lens must be the query offsets batch was planned for: got {cu[:17]}, "
                f"batch has {planned_q[:16]} queries per request"
            )
    if q_len_per_req is not None:
        q_len = check_int("q_len_per_req", q_len_per_req, minimum=1)
        if any(int(n) != q_len for n in batch.slot_q_lens[:b]):
            raise ValueError(
                f"q_len_per_req={q_len} is not the plan's: batch has {batch.slot_q_lens[:16].tolist()} queries per "
                "request (pass the plan alone: its lengths replace q_len_per_req and cu_q_lens)"
            )


def check_queries(q: object, *, tokens: int, heads: int, head_dim: int, tokens_from: str, heads_from: str) -> None:
    """``q`` is ``[tokens, heads, head_dim]`` in a float dtype; a mismatch names ``q`` and where the
    expected count comes from (``tokens_from`` / ``heads_from``, for the message)."""
    q = check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3)
    t, h, d = q.shape
    if t != tokens:
        raise ValueError(f"q holds {t} tokens, but {tokens_from} {tokens}")
    if h != heads:
        raise ValueError(f"q must hold {heads_from}, got {h} heads (shape {list(q.shape)})")
    if d != head_dim:
        raise ValueError(f"q must have last dim {head_dim} (the model's head_dim), got {d}")


def check_gqa_cache(
    kv_cache: object, *, page_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
    kv_heads_from: Callable[[], str],
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``kv_cache`` is a GQA ``(k_cache, v_cache)`` pair, each ``[pages, page_size, kv_heads,
    head_dim]`` in ``dtype`` on ``device``; returns the pair. A mismatch names the tensor, and for
    the head count where it comes from (``kv_heads_from()``, called for the message only): a cache of the wrong
    heads or pages would be read as another one, silently."""
    if not (isinstance(kv_cache, tuple | list) and len(kv_cache) == 2):
        got = type(kv_cache).__name__
        raise TypeError(f"kv_cache of a GQA model must be a (k_cache, v_cache) pair of tensors, got {got}")
    kc, vc = kv_cache
    want = (page_size, kv_heads, head_dim)
    if not (type(kc) is torch.Tensor and kc.dim() == 4 and tuple(kc.shape[1:]) == want and kc.dtype == dtype
            and kc.device == device):  # fmt: skip
        check_tensor("kv_cache[0]", kc, dtypes=(dtype,), ndim=4, device=device)
        if kc.shape[2:] != want[1:]:
            raise ValueError(
                f"kv_cache[0] must have shape [pages, {page_size}, {kv_heads}, {head_dim}] ({kv_heads_from()}), "
                f"got {list(kc.shape)}"
            )
        check_paged_rows("kv_cache[0]", kc, page_size)
    if not (type(vc) is torch.Tensor and vc.shape == kc.shape and vc.dtype == dtype and vc.device == device):
        check_tensor("kv_cache[1]", vc, dtypes=(dtype,), shape=tuple(kc.shape), device=device)
    return kc, vc


def check_sinks_declared(sinks: object, *, has_sinks: bool, heads: int) -> None:
    """``sinks`` is given exactly when the model has them (``ModelSpec.has_sinks``): a model with
    sinks run without them gives wrong attention silently, and sinks on a model declared without
    them run kernels its warm-up did not build (nor a CUDA graph capture expects). Only whether
    it is ``None`` is read here; its shape and dtype are checked where the step takes it.

    Raises:
        ValueError: naming ``sinks`` and ``has_sinks``.
    """
    if has_sinks and sinks is None:
        raise ValueError(
            f"sinks: the spec has has_sinks=True (one sink logit per head): pass the model's [{heads}] fp32 sink logits"
        )
    if not has_sinks and sinks is not None:
        raise ValueError(
            "sinks: the spec has has_sinks=False: build the Runtime with ModelSpec(..., has_sinks=True) to use sinks"
        )


def check_topk_unique(topk_unique: object, *, kind: str) -> None:
    """``topk_unique`` is a bool, and ``True`` only on a sparse-MLA spec (``kind``): a GQA step reads
    no top-k, so the promise would be about nothing (and a caller passing it expects a step it
    does not get).

    Raises:
        TypeError: not a bool. ValueError: ``True`` on a GQA spec, naming ``topk_unique``.
    """
    check_bool("topk_unique", topk_unique)
    if topk_unique and kind != "sparse_mla":
        raise ValueError(f"topk_unique=True: a {kind} step reads no top-k (it is a sparse-MLA promise); pass False")


def check_paged_rows(name: str, cache: torch.Tensor, page_size: int) -> None:
    """A paged cache ``[pages, page, ...]`` holds the model's ``page_size`` rows a page: its block
    table's pages are read as ``page_size`` tokens each (``ModelSpec.page_size``)."""
    if cache.shape[1] != page_size:
        raise ValueError(
            f"{name} must hold pages of {page_size} tokens (the model's page_size, which its block_table's pages "
            f"follow; a ModelSpec with page_size={cache.shape[1]} reads this cache), got shape {list(cache.shape)}"
        )


def check_step_flag(comm: Comm, check: object, *, collective: bool) -> None:
    """A step's ``check`` must be a bool: else ``TypeError``, reported to the peers through the group's
    store (:func:`reject` without the agreement: the flag decides whether the agreement runs, so a
    rank whose flag is bad cannot know whether its peers are in it or in the step's first collective).
    """
    try:
        check_bool("check", check)
    except TypeError as e:
        reject(comm, e, collective=collective, check=False)


def reject(comm: Comm, error: BaseException, *, collective: bool, check: bool) -> NoReturn:
    """Raise ``error`` (this rank's bad argument) without leaving the peers waiting for it.

    In a step with collectives the peers are about to run the step's agreement check (``check``)
    or its first collective: with ``check`` this rank's error joins that agreement, so every rank
    raises (the peers naming this rank); without, it is reported through the group's store so a
    waiting peer names it when its collective fails. A step without collectives just raises.
    """
    if collective:
        comm.begin_step()  # the step the peers begin: this rank's report must name it
        if check:
            comm.check_agreement(0, "the step's inputs", error=error)  # re-raises error here
        comm.report_failure(error)
    raise error
