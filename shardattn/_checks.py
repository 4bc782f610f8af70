"""Argument validation shared by every public entry point.

Every check raises ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong shape, value,
device or combination) whose message names the argument and what was expected, before any
kernel runs. Checks never synchronise with a GPU unless their docstring says so.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence

import torch


def check_tensor(
    name: str,
    value: object,
    *,
    dtypes: Iterable[torch.dtype] | None = None,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check that ``value`` is a tensor with the given dtype set, rank, shape and device.

    ``shape`` entries of ``None`` match any size. Returns ``value`` typed as a tensor.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if dtypes is not None:
        allowed = tuple(dtypes)
        if value.dtype not in allowed:
            names = ", ".join(str(d).replace("torch.", "") for d in allowed)
            raise TypeError(f"{name} must have dtype in ({names}), got {str(value.dtype).replace('torch.', '')}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(value.shape)}")
    if shape is not None:
        if value.dim() != len(shape) or any(s is not None and s != v for s, v in zip(shape, value.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {list(value.shape)}")
    if device is not None and value.device != device:
        raise ValueError(f"{name} must be on {device}, got {value.device}")
    return value


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    """All given tensors (``None`` skipped) live on one device; returns it."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if not devices:
        raise ValueError("no tensor given")
    first = next(iter(devices.values()))
    for name, dev in devices.items():
        if dev != first:
            names = ", ".join(f"{n}={d}" for n, d in devices.items())
            raise ValueError(f"all tensors must be on one device; {name} differs ({names})")
    return first


def check_int(name: str, value: object, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` is an int (not a bool, not a float), at least ``minimum`` and at most ``maximum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import numpy as np

            if isinstance(value, np.integer):
                value = int(value)
            else:
                raise TypeError
        except TypeError:
            raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum:,}, got {value:,}")
    return value


def check_sink_logits(sinks: object, heads: int, *, device: torch.device | None = None) -> torch.Tensor:
    """``sinks``: ``[heads]`` fp32 per-head sink logits (on ``device`` when given); a CPU tensor must
    also be finite (checked where it costs no device sync). Raises naming ``sinks``."""
    sinks = check_tensor("sinks", sinks, dtypes=(torch.float32,), shape=(heads,), device=device)
    if sinks.device.type == "cpu" and not bool(torch.isfinite(sinks).all()):
        bad = int((~torch.isfinite(sinks)).nonzero()[0, 0])
        raise ValueError(f"sinks must be finite, got sinks[{bad}]={float(sinks[bad])}")
    return sinks


def check_page_size(name: str, cache: torch.Tensor) -> int:
    """A paged cache ``[num_pages, page, ...]`` (checked as a tensor by the caller) has pages of at
    least one token; returns ``page``. Every position ``k`` is read at page ``k // page``: a page of
    0 tokens would divide by zero. Raises ``ValueError`` naming ``name``.

    >>> check_page_size("k_cache", torch.zeros(2, 0, 1, 8))
    Traceback (most recent call last):
    ...
    ValueError: k_cache must have pages of at least one token (dim 1), got shape [2, 0, 1, 8]
    """
    if cache.shape[1] < 1:
        raise ValueError(f"{name} must have pages of at least one token (dim 1), got shape {list(cache.shape)}")
    return int(cache.shape[1])


def check_pages_in_use(
    block_table: torch.Tensor, lens: torch.Tensor | Sequence[int], *, page_size: int, num_pages: int, whose: str
) -> None:
    """The pages holding each request's first ``lens[b]`` tokens (``block_table[b, :ceil(lens[b] / page_size)]``)
    are in ``[0, num_pages)``; entries past them are not read and may hold anything (``-1``). Reads
    ``block_table`` and ``lens``: host values only (the callers check CPU tensors). Raises
    ``ValueError`` naming ``block_table`` and up to 8 of the requests (``whose``: how the message
    names them, e.g. ``"requests"``).

    >>> table = torch.tensor([[0, -1], [1, 5]], dtype=torch.int32)
    >>> check_pages_in_use(table, [3, 4], page_size=4, num_pages=2, whose="requests")
    >>> check_pages_in_use(table, [3, 5], page_size=4, num_pages=2, whose="requests")
    Traceback (most recent call last):
    ...
    ValueError: block_table holds pages outside [0, 2) for requests [1]
    """
    n = torch.as_tensor(lens, dtype=torch.int64).reshape(-1, 1)
    used = torch.arange(block_table.shape[1]) < (n + page_size - 1) // page_size
    bad = (((block_table < 0) | (block_table >= num_pages)) & used).any(1).nonzero().flatten()[:8].tolist()
    if bad:
        raise ValueError(f"block_table holds pages outside [0, {num_pages}) for {whose} {bad}")


def check_queries_fit(seq_lens: Sequence[int], query_lens: Sequence[int]) -> None:
    """No request has more queries than keys: ``seq_lens[b]`` counts request ``b``'s drafts, so its
    ``query_lens[b]`` queries sit at positions ``seq_lens[b] - query_lens[b] + j``, none negative
    (a request of 0 keys is padding, whatever its queries). Host values; raises ``ValueError``
    naming up to 8 of the requests.

    >>> check_queries_fit([3, 0], [2, 2])
    >>> check_queries_fit([1, 5], [2, 2])
    Traceback (most recent call last):
    ...
    ValueError: requests [0] have more queries than keys (seq_lens counts the drafts)
    """
    short = [b for b, (n, q) in enumerate(zip(seq_lens, query_lens, strict=True)) if 0 < n < q]
    if short:
        raise ValueError(f"requests {short[:8]} have more queries than keys (seq_lens counts the drafts)")


def check_cu_q_lens(cu_q_lens: Sequence[int], total_q: int) -> None:
    """Host offsets of each request's queries in ``q``: from 0, never decreasing, ending at or
    before ``total_q`` (q's rows; rows past the last request are padding). Raises ``ValueError``.

    >>> check_cu_q_lens([0, 2, 2, 5], 6)
    >>> check_cu_q_lens([0, 2, 1], 6)
    Traceback (most recent call last):
    ...
    ValueError: cu_q_lens must start at 0, not decrease and end <= 6, got [0, 2, 1]
    """
    cu = list(cu_q_lens)
    if not cu or cu[0] != 0 or any(b < a for a, b in itertools.pairwise(cu)) or cu[-1] > total_q:
        raise ValueError(f"cu_q_lens must start at 0, not decrease and end <= {total_q}, got {cu}")


def check_max_q_len(max_q_len: int, query_lens: Sequence[int]) -> None:
    """``max_q_len`` (an int, checked by the caller) bounds every request's queries: at least the
    most ``query_lens[b]`` (from ``cu_q_lens``; the Triton kernel's query tiles per request are
    sized from it). Host values; raises ``ValueError``.

    >>> check_max_q_len(2, [2, 0])
    >>> check_max_q_len(1, [2, 0])
    Traceback (most recent call last):
    ...
    ValueError: max_q_len must be >= 2 (the most queries of a request in cu_q_lens), got 1
    """
    longest = max(query_lens, default=0)
    if max_q_len < longest:
        raise ValueError(
            f"max_q_len must be >= {longest} (the most queries of a request in cu_q_lens), got {max_q_len}"
        )


def check_queries_tensor(name: str, q: object) -> torch.Tensor:
    """``q``: ``[T, H, D]`` fp16/bf16/fp32 queries with at least one head and ``D >= 1`` (0 heads
    pass a head-multiple check, since 0 is a multiple of any head count, and ``D = 0`` makes the
    default scale ``D ** -0.5`` divide by zero). Raises naming ``name``.

    >>> check_queries_tensor("q", torch.zeros(2, 0, 16))
    Traceback (most recent call last):
    ...
    ValueError: q must hold at least one head of head_dim >= 1, got shape [2, 0, 16]
    """
    q = check_tensor(name, q, dtypes=FLOAT_DTYPES, ndim=3)
    if q.shape[1] < 1 or q.shape[2] < 1:
        raise ValueError(f"{name} must hold at least one head of head_dim >= 1, got shape {list(q.shape)}")
    return q


def check_bool(name: str, value: object) -> bool:
    """``value`` is a bool (not an int)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")
    return value


def check_scale(name: str, value: object) -> float:
    """A softmax scale: :func:`check_positive` (NaN, an infinity, zero or a negative scale would
    give NaN or meaningless outputs silently).

    >>> check_scale("scale", 576 ** -0.5) > 0
    True
    """
    return check_positive(name, value)


def check_positive(name: str, value: object) -> float:
    """``value`` is a real number, finite and > 0 (a scale, a timeout, a share); returns it as a float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        try:
            import numpy as np

            if not isinstance(value, np.floating | np.integer):
                raise TypeError
        except TypeError:
            raise TypeError(f"{name} must be a float, got {type(value).__name__} ({value!r})") from None
    scale = float(value)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {scale!r}")
    return scale


def check_choice(name: str, value: object, choices: Iterable[object]) -> None:
    """``value`` is one of ``choices``."""
    options = tuple(choices)
    if value not in options:
        raise ValueError(f"{name} must be one of {options}, got {value!r}")


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32,)


def check_split_workspace(workspace: object, device: torch.device) -> None:
    """A decode's optional ``workspace``: a flat (1-D, contiguous) fp32 buffer on ``device``, whose
    first elements the split-KV kernels view as their partials."""
    buffer = check_tensor("workspace", workspace, dtypes=(torch.float32,), ndim=1, device=device)
    if not buffer.is_contiguous():
        raise ValueError("workspace must be a contiguous (flat) float32 buffer: the split partials are views of it")


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last)`` bytes of memory a non-empty tensor's elements reach (strided views included;
    torch strides are never negative)."""
    start = t.data_ptr()
    if t.is_contiguous():  # the common case, without the per-dim sum
        return start, start + t.nbytes
    reach = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return start, start + (reach + 1) * t.element_size()


def has_internal_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory (an expanded view, a stride below the extent
    of the dims inside it): with its dims of more than one element in order of stride, one's
    stride is below the extent of those before it. Strides only, no device access.

    >>> has_internal_overlap(torch.zeros(4, 3)[:, :2]), has_internal_overlap(torch.zeros(1, 3).expand(4, 3))
    (False, True)
    """
    if t.is_contiguous():
        return False
    extent = 1
    for stride, size in sorted((t.stride(d), t.shape[d]) for d in range(t.dim()) if t.shape[d] > 1):
        if stride < extent:
            return True
        extent = stride * size
    return False


def check_disjoint(**tensors: torch.Tensor | None) -> None:
    """The named buffers a kernel writes (a caller's ``out``, ``lse_out``, ``workspace``) share no
    memory, with each other or among their own elements (an expanded view): one written over
    another would corrupt a result with no error. Host-side (pointers and strides, no GPU sync);
    ``None``, empty and meta tensors are skipped.

    Example:
        >>> buf = torch.zeros(10)
        >>> check_disjoint(out=buf[:4], workspace=buf[4:])
        >>> check_disjoint(out=buf[:5], workspace=buf[4:])
        Traceback (most recent call last):
        ...
        ValueError: out and workspace share memory: a kernel's writes to one would overwrite the other
    """
    present = {name: t for name, t in tensors.items() if t is not None and t.numel() > 0 and not t.is_meta}
    for name, t in present.items():
        if has_internal_overlap(t):
            raise ValueError(
                f"{name} has elements that may share memory (strides {t.stride()} for shape {list(t.shape)}): a "
                "kernel's writes to one would overwrite another"
            )
    spans = [(name, _byte_span(t)) for name, t in present.items()]
    for (name_a, (lo_a, hi_a)), (name_b, (lo_b, hi_b)) in itertools.combinations(spans, 2):
        if lo_a < hi_b and lo_b < hi_a:
            raise ValueError(f"{name_a} and {name_b} share memory: a kernel's writes to one would overwrite the other")


def check_not_inputs(
    written: dict[str, torch.Tensor | None], read: dict[str, torch.Tensor | None], *, reader: str = "the kernel"
) -> None:
    """The buffers a kernel writes (``written``: a caller's ``out``, ``lse_out``, ``workspace``, a
    union or rows buffer) share no memory with the inputs it reads (``read``): its programs read
    inputs after other programs wrote their results, so a destination over an input corrupts the
    result with no error. A parallel step (``reader="the step"``, as the message names it) reads
    inputs for later chunks or kernels after its exchanges or kernels wrote its destinations.
    Host-side (pointers and strides, no GPU sync; nothing is looked at when no destination is
    given); ``None`` and other non-tensors (checked elsewhere), empty and meta tensors are skipped,
    and tensors on different devices never overlap.

    Example:
        >>> q = torch.zeros(4, 2)
        >>> check_not_inputs({"out": torch.zeros(4, 2)}, {"q": q})
        >>> check_not_inputs({"out": q[2:]}, {"q": q})
        Traceback (most recent call last):
        ...
        ValueError: out shares memory with q: the kernel reads q after writing out
    """

    def spans(tensors: dict[str, torch.Tensor | None]) -> list[tuple[str, torch.device, tuple[int, int]]]:
        return [
            (name, t.device, _byte_span(t))
            for name, t in tensors.items()
            if isinstance(t, torch.Tensor) and t.numel() > 0 and not t.is_meta
        ]

    outputs = spans(written)
    if not outputs:  # the common call: no destination given
        return
    inputs = spans(read)
    for name_w, dev_w, (lo_w, hi_w) in outputs:
        for name_r, dev_r, (lo_r, hi_r) in inputs:
            if lo_w < hi_r and lo_r < hi_w and dev_w == dev_r:  # the address test first: cheaper
                raise ValueError(
                    f"{name_w} shares memory with {name_r}: {reader} reads {name_r} after writing {name_w}"
                )


def check_block_table_holds(
    block_table: torch.Tensor,
    block_size: int,
    kv_rows: int | None,
    seq_lens: torch.Tensor | None,
    local_lens: torch.Tensor | None = None,
    rank: int | None = None,
) -> None:
    """A CPU ``block_table [B, M]`` of ``block_size``-row blocks (checked by the caller) points into a
    cache of ``kv_rows`` rows (``None``: not checked; rows past the cache are then invalid keys),
    and holds each request's tokens: ``seq_lens [B]`` (``local_lens``, the tokens ``rank`` keeps of
    them under DCP). A position past its table would read no key and be dropped with no error.
    Reads values: call it on CPU tensors only (no device sync).

    >>> check_block_table_holds(torch.tensor([[0, 1]]), 4, 8, torch.tensor([9]))
    Traceback (most recent call last):
    ...
    ValueError: seq_lens[0]=9 needs 9 tokens, but its block_table holds 2 blocks of 4
    """
    b, m = block_table.shape
    top = int(block_table.max()) if block_table.numel() else -1  # a table of no column holds no token
    if kv_rows is not None and (top + 1) * block_size > kv_rows:
        raise ValueError(
            f"block_table points past kv_cache: block {top} needs rows up to {(top + 1) * block_size}, "
            f"kv_cache has {kv_rows}"
        )
    if seq_lens is None or not b:
        return
    local = seq_lens if local_lens is None else local_lens
    if int(local.max()) > m * block_size:
        i = int(local.argmax())
        held = f"puts {int(local[i])} tokens on rank {rank}" if rank is not None else f"needs {int(local[i])} tokens"
        raise ValueError(
            f"seq_lens[{i}]={int(seq_lens[i])} {held}, but its block_table holds {m} blocks of {block_size}"
        )
