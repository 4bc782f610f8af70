"""Adapter to FA4 (flash-attn-cute, the optional extra ``shardattn[fa4]``): dense GQA prefill forward.

FA4 is imported lazily behind a cached getter (:func:`get_fa4`); nothing here runs at import time,
and without FA4 every caller takes the torch reference (:func:`fa4_supports` says why). The extra
installs ``flash-attn-4>=4.0.0b36`` and what it requires (the CuTe DSL, quack-kernels, tvm-ffi);
``flash-attn-4[cu13]`` selects the CuTe DSL's CUDA 13 libraries.

What this adapter relies on, read from the source of flash-attn-4 4.0.0b36
(``flash_attn/cute/interface.py``, ``softmax.py``, ``mask.py``, ``seqlen_info.py``):

* Entry point ``flash_attn.cute.interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q=,
  cu_seqlens_k=, seqused_k=, page_table=, softmax_scale=, causal=, window_size=(left, right),
  learnable_sink=, return_lse=)`` returns ``(out [total_q, H, D], lse)``.
* LSE: fp32, **natural log** (the kernel keeps base-2 statistics and multiplies by ``ln 2`` when
  it writes the LSE, ``Softmax.finalize``), laid out **``[H, total_q]``** (heads first) in varlen
  mode. The sink is included. A row with no visible key gives ``out = 0`` and ``lse = -inf``, or
  ``lse = sink`` with a sink. Converted here once to the library's ``[total_q, H]``.
* Masks are aligned **bottom-right** per sequence: query ``i`` of a sequence of ``m`` queries and
  ``L`` keys sees key ``j`` when ``j <= i + L - m`` (causal) and ``j >= i + L - m - left`` (window
  ``(left, right)``; ``causal=True`` sets ``right = 0``).
* Keys of sequence ``b``: rows ``[cu_seqlens_k[b], cu_seqlens_k[b] + seqused_k[b])`` of ``k`` /
  ``v`` when ``seqused_k`` is given (the offset comes from ``cu_seqlens_k``, the length from
  ``seqused_k``, so the ranges may overlap), or positions ``j`` at
  ``k[page_table[b, j // page], j % page]`` with ``page_table`` (``cu_seqlens_k`` must then be
  ``None``; ``k``, ``v`` are ``[num_pages, page, Hkv, D]``, the library's paged layout).
* ``learnable_sink``: ``[H]`` logits in natural-log units, **not** multiplied by
  ``softmax_scale``: one extra softmax column with no value (the library's sink contract).
* dtypes fp16 / bf16 (fp8 on SM100 only), q, k, v alike; head dims: SM90 ``8..256`` and SM100
  ``8..128`` (or 256), multiples of 8 (``_validate_head_dims``); query heads a multiple of KV heads.
* Paged tiles may load whole pages: FA4 needs rows past ``seqused_k`` in a sequence's last page
  to be finite when pages load by TMA (``page_size`` equal to the key tile, 128 at head_dim 64 on
  SM90); other unused pages may hold anything. On the cp.async path (other page sizes) a sequence
  with no key still reads its first page-table entry, so page ids are clamped here into
  ``[0, num_pages)``.
* Every compile key (dtype, head dims, query heads per KV head, causal / local, sink dtype, the
  varlen or paged form, LSE or not, tile, arch, more than 256 sequences, ...) compiles once per
  process (2-3 s on an H200); sequence lengths, offsets, the window width and the scale are
  runtime values. :func:`~shardattn.kernels.fa4_warmup.warm_up` compiles the keys of given
  :class:`~shardattn.kernels.fa4_warmup.FA4Variant` s.

Calls given a plan's :class:`~shardattn.kernels.fa4_launch.FA4Launches` (``launches=``, with
``private=`` from :func:`fast_launch_support`) run FA4's compiled kernel directly after the plan's
first call of each form (:mod:`shardattn.kernels.fa4_launch`: what that skips, the guard, why the
bits are the same); without them, or when the guard fails, the public function runs.

Calls here never pass ``max_seqlen_q`` (on SM90 it changes no kernel; without it the compiled kernel
does not depend on how long the sequences are). They ask for the LSE only when the caller needs it
(a merge of partials, or a returned LSE), and pass ``seqused_k`` only when the key ranges are not
``cu_seqlens_k``'s own (PCP runs, a prefix tail, paged keys): the call of whole requests over their
own new keys without an LSE is the call an engine makes of FA4 directly, the same compile key.
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Callable

import torch

from shardattn.kernels.backend import unit_stride
from shardattn.kernels.fa4_launch import FA4Launches, FA4Private, check_fast_launch

__all__ = [
    "FA4_SM_MAJORS",
    "fa4_paged",
    "fa4_supports",
    "fa4_unsupported_reason",
    "fa4_varlen",
    "fast_launch_support",
    "get_fa4",
    "lse_tokens_major",
    "page_table_for_fa4",
]

FA4_SM_MAJORS = (9, 10)
"""Compute-capability majors the adapter routes to FA4: SM90 (Hopper, measured on an H200) and SM100."""
FA4_DTYPES = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=1)
def _load() -> tuple[Callable | None, str | None]:
    try:
        from flash_attn.cute.interface import flash_attn_varlen_func
    except Exception as exc:  # ImportError, or a broken install (CuTe DSL, CUDA libraries)
        return None, f"FA4 (flash-attn-cute) is not importable ({type(exc).__name__}: {exc}); install shardattn[fa4]"
    return flash_attn_varlen_func, None


def get_fa4() -> Callable | None:
    """``flash_attn.cute.interface.flash_attn_varlen_func``, or ``None`` when not importable (cached)."""
    return _load()[0]


@functools.lru_cache(maxsize=1)
def fast_launch_support() -> tuple[FA4Private | None, str]:
    """The guard of FA4's fast launch (:func:`~shardattn.kernels.fa4_launch.check_fast_launch`),
    checked once per process, when FA4 is first imported here: ``(FA4Private, reason)`` or
    ``(None, why not)``."""
    if get_fa4() is None:
        return None, f"FA4 fast launch off: {_load()[1]}"
    try:
        from flash_attn.cute import interface

        version = importlib.metadata.version("flash-attn-4")
    except (ImportError, importlib.metadata.PackageNotFoundError) as exc:
        return None, f"FA4 fast launch off: flash-attn-4's version or interface not found ({type(exc).__name__})"
    return check_fast_launch(version, interface)


def _head_dim_reason(head_dim: int, major: int) -> str | None:
    if head_dim % 8:
        return f"FA4 needs head_dim a multiple of 8, got {head_dim}"
    if major == 9 and not 8 <= head_dim <= 256:
        return f"FA4 on SM90 supports head_dim 8..256, got {head_dim}"
    if major == 10 and not 8 <= head_dim <= 128:
        # FA4's SM100 head-dim-256 kernel asserts no sinks, no seqused_k (every paged, prefix and PCP
        # call here passes it), no window and 128-token pages: not the calls this library makes
        return f"FA4 on SM100 runs this library's calls at head_dim 8..128, got {head_dim}"
    return None


def fa4_unsupported_reason(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why FA4 does not run a prefill of ``dtype`` queries and keys of ``head_dim`` on ``device``
    (``None``: it does). No tensor needed (a Runtime asks once for its config); no device sync.

    >>> fa4_unsupported_reason("cpu", torch.bfloat16, 64)
    "FA4 needs CUDA tensors, got device type 'cpu'"
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"FA4 needs CUDA tensors, got device type {device.type!r}"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in FA4_SM_MAJORS:
        return f"FA4 is routed on SM90 and SM100, this GPU is SM{major}{minor}"
    if dtype not in FA4_DTYPES:
        return f"FA4 needs fp16/bf16 q and k of one dtype, got {dtype}"
    why = _head_dim_reason(head_dim, major)
    if why is not None:
        return why
    if get_fa4() is None:
        return _load()[1]
    return None


def fa4_supports(q: torch.Tensor, k: torch.Tensor) -> tuple[bool, str]:
    """Whether FA4 runs a prefill of these tensors here, and why (or why not). No device sync.

    Args:
        q: ``[T, H, D]`` queries; k: ``[..., Hkv, D]`` keys (contiguous or paged) in q's dtype.
    Returns:
        ``(True, reason)`` or ``(False, reason)``.

    >>> fa4_supports(torch.zeros(2, 4, 64), torch.zeros(2, 1, 64))
    (False, "FA4 needs CUDA tensors, got device type 'cpu'")
    """
    if k.dtype != q.dtype:
        return False, f"FA4 needs fp16/bf16 q and k of one dtype, got {q.dtype} and {k.dtype}"
    why = fa4_unsupported_reason(q.device, q.dtype, q.shape[-1])
    if why is not None:
        return False, why
    major, minor = torch.cuda.get_device_capability(q.device)
    return True, f"FA4 (flash-attn-cute) on SM{major}{minor}, head_dim {q.shape[-1]}"


def lse_tokens_major(lse_heads_major: torch.Tensor) -> torch.Tensor:
    """FA4's varlen LSE ``[H, T]`` (fp32, natural log) as the library's ``[T, H]``: a transposed
    view (no copy; callers that hand it out make it contiguous, merges copy it anyway).

    Both already use natural log, ``-inf`` for an empty row without a sink and the sink for one
    with a sink, so only the layout changes.

    >>> lse_tokens_major(torch.tensor([[0.0, 1.0, 2.0], [3.0, 4.0, float("-inf")]])).tolist()
    [[0.0, 3.0], [1.0, 4.0], [2.0, -inf]]
    """
    return lse_heads_major.float().t()


def page_table_for_fa4(block_table: torch.Tensor, num_pages: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``block_table`` ``[S, M]`` int32 with every entry clamped into ``[0, num_pages)``, contiguous
    (written into ``out``, a contiguous int32 tensor of that shape, where given).

    Entries past a sequence's keys may be ``-1`` in the library's tables; FA4's cp.async path reads
    a sequence's first entry even when it has no key, so none may point outside the cache. Entries
    a sequence uses are in range where the caller validated them (host tables); a device table
    is not read on the host, and an out-of-range entry in use there reads the nearest page
    instead of faulting.

    >>> page_table_for_fa4(torch.tensor([[3, -1], [0, 9]], dtype=torch.int32), 4).tolist()
    [[3, 0], [0, 3]]
    """
    if out is not None:
        return torch.clamp(block_table.to(torch.int32), 0, max(num_pages - 1, 0), out=out)
    return block_table.clamp(0, max(num_pages - 1, 0)).to(torch.int32).contiguous()


def _window(window_left: int) -> tuple[int | None, None]:
    return (window_left if window_left >= 0 else None, None)


def _run(
    fn: Callable | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor | None,
    k_len: torch.Tensor | None,
    page_table: torch.Tensor | None,
    causal: bool,
    window_left: int,
    sinks: torch.Tensor | None,
    scale: float,
    return_lse: bool,
    launches: FA4Launches | None = None,
    private: FA4Private | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    t, h, _ = q.shape
    if t == 0:
        lse = torch.zeros(0, h, dtype=torch.float32, device=q.device) if return_lse else None
        return q.new_zeros(0, h, v.shape[-1]), lse
    if launches is not None and private is not None:
        launch = launches.get(
            private, cu_q=_int32(cu_q), cu_k=cu_k, k_len=None if k_len is None else _int32(k_len),
            page_table=page_table, scale=float(scale), causal=bool(causal), window_left=window_left,
            return_lse=return_lse, sinks=sinks is not None,
        )  # fmt: skip
        if launch is not None:
            out, lse = launch(q, k, v, unit_stride(sinks))  # an LSE where the form was resolved with one
            if not return_lse:
                return out, None
            if lse is None:
                raise RuntimeError("FA4's fast launch returned no LSE for a call that asked for it")
            return out, lse_tokens_major(lse)
    fn = get_fa4() if fn is None else fn
    if fn is None:
        raise RuntimeError(f"FA4 cannot run: {_load()[1]}")
    with torch.no_grad():  # inference: FA4's autograd function saves nothing then
        out, lse = fn(
            q,
            k,
            v,
            cu_seqlens_q=_int32(cu_q),
            cu_seqlens_k=cu_k,
            seqused_k=None if k_len is None else _int32(k_len),
            page_table=page_table,
            softmax_scale=float(scale),
            causal=bool(causal),
            window_size=_window(window_left),
            learnable_sink=None if sinks is None else sinks.detach().float().contiguous(),
            return_lse=return_lse,
        )
    return out, (lse_tokens_major(lse) if return_lse else None)


def _int32(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a contiguous int32 tensor (itself when it is one: no launch)."""
    return x if x.dtype == torch.int32 and x.is_contiguous() else x.to(torch.int32).contiguous()


def fa4_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    k_len: torch.Tensor | None,
    *,
    causal: bool,
    window_left: int,
    sinks: torch.Tensor | None,
    scale: float,
    return_lse: bool = True,
    fn: Callable | None = None,
    launches: FA4Launches | None = None,
    private: FA4Private | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FA4 over segments of contiguous keys (arguments validated by the caller).

    Segment ``s`` holds query rows ``[cu_q[s], cu_q[s + 1])`` and keys ``[cu_k[s], cu_k[s] +
    k_len[s])`` of ``k`` / ``v`` (ranges may overlap; ``cu_k[S]`` is not read), or, with ``k_len``
    ``None``, keys ``[cu_k[s], cu_k[s + 1])``; masks bottom-right aligned (module docstring).

    Args:
        q: ``[T, H, D]`` fp16/bf16; k, v: ``[Tk, Hkv, D]`` in q's dtype (last dim contiguous).
        cu_q, cu_k: ``[S + 1]`` int32; k_len: ``[S]`` int32 or ``None``, all on q's device.
        causal, window_left (``-1`` = none), sinks (``[H]`` fp32 or None), scale: the masks and softmax.
        return_lse: compute the LSE (``False``: FA4's variant without one; ``None`` is returned).
        fn: the FA4 function (default: :func:`get_fa4`); tests pass a stand-in.
        launches, private: the plan's launches and :func:`fast_launch_support`'s pieces (both given:
            the fast launch, :mod:`~shardattn.kernels.fa4_launch`; ``fn`` is then not called).
    Returns:
        ``(out [T, H, D] in q's dtype, lse [T, H] fp32 natural log or None)``, the LSE a
        transposed view of FA4's ``[H, T]`` buffer (:func:`lse_tokens_major`).
    """
    return _run(
        fn, q, k, v, cu_q=cu_q, cu_k=_int32(cu_k), k_len=k_len, page_table=None, causal=causal,
        window_left=window_left, sinks=sinks, scale=scale, return_lse=return_lse, launches=launches, private=private,
    )  # fmt: skip


def fa4_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_q: torch.Tensor,
    k_len: torch.Tensor,
    *,
    causal: bool,
    window_left: int,
    sinks: torch.Tensor | None,
    scale: float,
    return_lse: bool = True,
    fn: Callable | None = None,
    launches: FA4Launches | None = None,
    private: FA4Private | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FA4 over segments whose keys live in a paged cache, through FA4's ``page_table``.

    Segment ``s`` holds query rows ``[cu_q[s], cu_q[s + 1])`` and its first ``k_len[s]`` key
    positions; position ``j`` is at ``k_cache[page_table[s, j // page], j % page]``.

    Args:
        q: ``[T, H, D]`` fp16/bf16; k_cache, v_cache: ``[num_pages, page, Hkv, D]`` in q's dtype.
        page_table: ``[S, M]`` int32, every entry inside the cache (:func:`page_table_for_fa4`
            makes a table so; the caller does it once per step).
        cu_q: ``[S + 1]`` int32; k_len: ``[S]`` int32 keys per segment.
        causal, window_left, sinks, scale, return_lse, fn, launches, private: as in :func:`fa4_varlen`.
    Returns:
        ``(out [T, H, D] in q's dtype, lse [T, H] fp32 natural log or None)`` (the LSE a transposed view).
    """
    return _run(
        fn, q, k_cache, v_cache, cu_q=cu_q, cu_k=None, k_len=k_len, page_table=page_table, causal=causal,
        window_left=window_left, sinks=sinks, scale=scale, return_lse=return_lse, launches=launches, private=private,
    )  # fmt: skip
