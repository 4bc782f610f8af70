"""FA4's compiled forward called directly, for the calls of a plan that repeat its arguments.

FA4's public ``flash_attn_varlen_func`` runs about 50 us of Python on a host core before it launches
anything (flash-attn-4 4.0.0b36's ``interface.py`` on CPU tensors, its GPU libraries stubbed, its
compile key already cached, FA4's fake mode stopping it just before the launch; median of 3,000
calls on a 2-core x86 host, 2026-12-02): an autograd ``Function.apply`` and its context (34
arguments unwrapped, 15 tensors saved), about 40 asserts, 10 alignment canonicalisations, the tile
configuration, a 66-part compile key built, hashed and looked up twice, and the output and LSE
allocated. Then it calls the compiled kernel (a TVM-FFI function that takes the torch tensors as
they are and launches on the current stream) with 18 (SM90) or 25 (SM100) positional arguments.
Of those, only the query, key, value, output, LSE and sinks tensors change between the layers of
one step; the rest (lengths, page table, scale, window, and the tile-scheduler tensors FA4 derives
from the query lengths above 256 sequences) depend on the plan alone.

:class:`FA4Launch` is one call form of one plan (:class:`FA4Launches` holds a plan's):

* **first call** (resolve): the public function runs and its result is the call's, while FA4's
  compile cache is observed (:func:`observing`: the kernel it looks up and the arguments it passes
  are kept). They are accepted only when FA4 passed the call's own q, k, v, sinks and plan tensors
  in their documented positions (:data:`KERNEL_CALL_PARAMS`), exactly one kernel was looked up,
  and no per-call tensor sits elsewhere in the arguments; otherwise the form stays public, with
  the reason in :attr:`FA4Launch.off`.
* **later calls** whose q, k, v have the resolved shapes, strides, dtypes and device, 16-byte
  aligned data and no autograd (so FA4 would neither copy them nor pick another kernel), and sinks
  of the resolved presence, ``[H]`` fp32 on that device: the output and LSE are allocated as FA4
  allocates them, the kept arguments get the six per-call tensors, and the kernel runs. No other
  Python runs: the same kernel on the same arguments, so the same bits as the public call (a GPU
  test compares them).
* **anything else**: the public function.

Private pieces of FA4 are used only behind :func:`check_fast_launch`: the installed version is
exactly :data:`FAST_LAUNCH_VERSION`, ``interface._flash_attn_fwd.compile_cache`` has the cache
protocol FA4 uses (``in``, ``[key]``, ``[key] =``), and the SM90 and SM100 forward kernels' call
signatures start with :data:`KERNEL_CALL_PARAMS`. When it fails every call takes the public path
and the reason says why.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "FAST_LAUNCH_VERSION",
    "KERNEL_CALL_PARAMS",
    "FA4Launch",
    "FA4Launches",
    "FA4Private",
    "check_fast_launch",
    "observing",
]

FAST_LAUNCH_VERSION = "4.0.0b36"
"""The one flash-attn-4 version whose private pieces this module was written against."""

#: The leading parameters of FA4's forward kernels' ``__call__`` (after ``self``): the positions of
#: the compiled function's arguments that this module reads or replaces.
KERNEL_CALL_PARAMS = (
    "mQ", "mK", "mV", "mO", "mLSE", "softmax_scale", "mCuSeqlensQ", "mCuSeqlensK", "mSeqUsedQ", "mSeqUsedK",
    "mPageTable", "window_size_left", "window_size_right", "learnable_sink",
)  # fmt: skip
_Q, _K, _V, _OUT, _LSE, _SCALE, _CU_Q, _CU_K, _USED_Q, _USED_K, _TABLE, _WIN_L, _WIN_R, _SINK = range(14)
#: The forward kernel classes ``interface`` launches for SM90 and SM100 (SM80 / SM120 are not routed).
KERNEL_CLASSES = ("FlashAttentionForwardSm90", "FlashAttentionForwardSm100")
#: The public function's keyword arguments the adapter passes.
PUBLIC_KEYWORDS = (
    "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "page_table", "softmax_scale", "causal", "window_size",
    "learnable_sink", "return_lse",
)  # fmt: skip
#: FA4 maps inputs whose data pointer is not 16-byte aligned to an aligned copy (``maybe_contiguous``).
ALIGN_BYTES = 16


@dataclass(frozen=True)
class FA4Private:
    """The FA4 pieces a fast launch uses, from :func:`check_fast_launch`.

    Attributes:
        public: ``flash_attn_varlen_func`` (resolving calls and every fallback run it).
        fwd: ``_flash_attn_fwd``, the function whose ``compile_cache`` attribute FA4 reads on each call.
        version: the installed flash-attn-4 version.
    """

    public: Callable
    fwd: Any
    version: str


def _leading_params(fn: Callable, skip: int, count: int) -> tuple[str, ...] | None:
    try:
        return tuple(inspect.signature(fn).parameters)[skip : skip + count]
    except (TypeError, ValueError):
        return None


def check_fast_launch(version: str | None, interface: Any) -> tuple[FA4Private | None, str]:
    """Whether FA4's compiled forward may be called directly, and why (or why not).

    Args:
        version: the installed flash-attn-4 version (``None``: not installed).
        interface: the ``flash_attn.cute.interface`` module (tests pass a stand-in).
    Returns:
        ``(FA4Private, reason)`` when every check passes, else ``(None, reason)``.

    >>> check_fast_launch("4.0.0b37", None)[1]
    'FA4 fast launch off: flash-attn-4 4.0.0b37 is installed, the launch is checked against 4.0.0b36 only'
    """

    def off(why: str) -> tuple[None, str]:
        return None, f"FA4 fast launch off: {why}"

    if version != FAST_LAUNCH_VERSION:
        return off(f"flash-attn-4 {version} is installed, the launch is checked against {FAST_LAUNCH_VERSION} only")
    public = getattr(interface, "flash_attn_varlen_func", None)
    fwd = getattr(interface, "_flash_attn_fwd", None)
    if not callable(public) or not callable(fwd):
        return off("flash_attn.cute.interface lacks flash_attn_varlen_func or _flash_attn_fwd")
    params = inspect.signature(public).parameters
    missing = [name for name in PUBLIC_KEYWORDS if name not in params]
    if missing:
        return off(f"flash_attn_varlen_func takes no {missing}")
    cache = getattr(fwd, "compile_cache", None)
    if cache is None or not all(hasattr(type(cache), m) for m in ("__contains__", "__getitem__", "__setitem__")):
        return off("_flash_attn_fwd.compile_cache is missing or is not a cache FA4 indexes by compile key")
    for name in KERNEL_CLASSES:
        cls = getattr(interface, name, None)
        got = None if cls is None else _leading_params(cls.__call__, 1, len(KERNEL_CALL_PARAMS))
        if got != KERNEL_CALL_PARAMS:
            return off(f"{name}.__call__ does not start with {', '.join(KERNEL_CALL_PARAMS)} (got {got})")
    return FA4Private(public, fwd, version), (
        f"FA4 fast launch: the compiled kernel called directly after one public call per plan and call form "
        f"(flash-attn-4 {version})"
    )


# -- observing one public call ------------------------------------------------------------------------


class _Observer:
    """Stands in for ``_flash_attn_fwd.compile_cache`` during one call: delegates everything, and
    keeps ``(kernel, args)`` of each kernel the observing thread looks up and calls."""

    def __init__(self, cache: Any) -> None:
        self._cache = cache
        self._thread = threading.get_ident()
        self.seen: list[tuple[Callable, tuple]] = []

    def __contains__(self, key: object) -> bool:
        return key in self._cache

    def __setitem__(self, key: object, fn: Callable) -> None:
        self._cache[key] = fn

    def __getitem__(self, key: object) -> Callable:
        kernel = self._cache[key]
        if threading.get_ident() != self._thread:
            return kernel

        def call(*args: Any) -> Any:
            self.seen.append((kernel, args))
            return kernel(*args)

        return call

    def __getattr__(self, name: str) -> Any:  # the cache's other attributes (its dict, clear, ...)
        return getattr(self._cache, name)


_OBSERVING = threading.Lock()  # one observed call at a time: the attribute swapped is FA4's, process-wide


@contextlib.contextmanager
def observing(fwd: Any) -> Iterator[_Observer]:
    """Observe the kernels FA4 looks up while the block runs (``fwd``: ``_flash_attn_fwd``).

    ``fwd.compile_cache`` is replaced by an :class:`_Observer` of it for the block's duration and
    restored after it, whatever happens; calls on other threads meanwhile pass through unrecorded.
    """
    with _OBSERVING:
        cache = fwd.compile_cache
        observer = _Observer(cache)
        fwd.compile_cache = observer
        try:
            yield observer
        finally:
            fwd.compile_cache = cache


# -- one call form of one plan --------------------------------------------------------------------------


def _layout(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device


def _same_view(a: object, b: torch.Tensor | None) -> bool:
    """``a`` is a tensor viewing exactly ``b``'s elements (``b`` itself or a detached alias)."""
    if b is None or not isinstance(a, torch.Tensor):
        return a is None and b is None
    return a.data_ptr() == b.data_ptr() and _layout(a) == _layout(b)


class FA4Launch:
    """One call form of one plan (module docstring): the plan's arguments, held and compared by identity.

    Args:
        private: :func:`check_fast_launch`'s pieces.
        cu_q: ``[S + 1]`` int32; cu_k: ``[S + 1]`` int32 or ``None``; k_len: ``[S]`` int32 or ``None``;
            page_table: ``[S, M]`` int32 or ``None``: the plan's tensors, as the adapter passes them.
        scale, causal, window_left (``-1``: none), return_lse, sinks (whether sinks are passed):
            the form's other arguments.

    Attributes:
        off: why this form stays on the public path (``None``: it does not, or is not resolved yet).
        public_calls, fast_calls: calls run each way.
    """

    def __init__(
        self,
        private: FA4Private,
        *,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor | None,
        k_len: torch.Tensor | None,
        page_table: torch.Tensor | None,
        scale: float,
        causal: bool,
        window_left: int,
        return_lse: bool,
        sinks: bool,
    ) -> None:
        self.private = private
        self.tensors = (cu_q, cu_k, k_len, page_table)
        self.scalars = (scale, causal, window_left, return_lse, sinks)
        self.kwargs = dict(
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=k_len, page_table=page_table, softmax_scale=scale,
            causal=causal, window_size=(window_left if window_left >= 0 else None, None), return_lse=return_lse,
        )  # fmt: skip
        self.off: str | None = None
        self.public_calls = 0
        self.fast_calls = 0
        self._kernel: Callable | None = None
        self._args: list = []
        self._inputs: tuple = ()
        self._out: tuple = ()
        self._lse_shape: tuple[int, ...] | None = None

    def serves(self, private: FA4Private, tensors: tuple, scalars: tuple) -> bool:
        """Whether a call with these plan tensors (by identity) and scalars is this form."""
        mine = self.tensors
        return (
            tensors[0] is mine[0] and tensors[1] is mine[1] and tensors[2] is mine[2] and tensors[3] is mine[3]
            and private is self.private and scalars == self.scalars
        )  # fmt: skip

    @property
    def resolved(self) -> bool:
        """The compiled kernel and its arguments are kept (later fitting calls launch it directly)."""
        return self._kernel is not None

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """FA4 on this form's plan arguments: ``(out [T, H, D], lse [H, T] fp32 or None)`` as FA4 returns them.

        Args:
            q: ``[T, H, D]``; k, v: ``[Tk, Hkv, D]`` or paged ``[pages, page, Hkv, D]``; sinks: ``[H]`` or None.
        """
        if sinks is not None and (sinks.dtype is not torch.float32 or sinks.requires_grad or not sinks.is_contiguous()):
            sinks = sinks.detach().float().contiguous()  # what the public path passes
        if self._kernel is not None:
            if self._fits(q, k, v, sinks):
                return self._launch(q, k, v, sinks)
            return self._public(q, k, v, sinks)
        if self.off is not None:
            return self._public(q, k, v, sinks)
        return self._resolve(q, k, v, sinks)

    def _public(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None) -> tuple:
        self.public_calls += 1
        with torch.no_grad():  # inference: FA4's autograd function saves nothing then
            return self.private.public(q, k, v, learnable_sink=sinks, **self.kwargs)

    def _fits(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None) -> bool:
        if (_layout(q), _layout(k), _layout(v)) != self._inputs:
            return False
        if (q.data_ptr() | k.data_ptr() | v.data_ptr()) % ALIGN_BYTES:  # FA4 would copy a misaligned input
            return False
        if q.requires_grad or k.requires_grad or v.requires_grad:
            return False
        if sinks is None:
            return not self.scalars[4]
        return self.scalars[4] and sinks.shape == self._out[0][1:2] and sinks.device == self._out[2]

    def _launch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None) -> tuple:
        kernel = self._kernel
        if kernel is None:
            raise RuntimeError("the FA4 fast launch has no compiled kernel yet")
        shape, dtype, device = self._out
        out = torch.empty(shape, dtype=dtype, device=device)
        lse = None if self._lse_shape is None else torch.empty(self._lse_shape, dtype=torch.float32, device=device)
        args = self._args.copy()
        args[_Q], args[_K], args[_V], args[_OUT], args[_LSE], args[_SINK] = q, k, v, out, lse, sinks
        kernel(*args)
        self.fast_calls += 1
        return out, lse

    def _resolve(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None) -> tuple:
        with observing(self.private.fwd) as observer:
            out, lse = self._public(q, k, v, sinks)
        why = self._adopt(observer.seen, q, k, v, sinks, out, lse)
        if why is not None:
            self.off = f"FA4 fast launch off for this call form: {why}"
        return out, lse

    def _adopt(self, seen: list, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
               out: torch.Tensor, lse: torch.Tensor | None) -> str | None:  # fmt: skip
        """Keep the observed kernel and arguments when they are exactly what this module replaces;
        else say why not."""
        if len(seen) != 1:
            return f"FA4 called {len(seen)} compiled kernels in one call (one expected)"
        kernel, args = seen[0]
        if len(args) < len(KERNEL_CALL_PARAMS):
            return f"FA4 passed {len(args)} arguments to its kernel (at least {len(KERNEL_CALL_PARAMS)} expected)"
        per_call = {_Q: q, _K: k, _V: v, _OUT: out, _LSE: lse, _SINK: sinks}
        for pos, t in per_call.items():
            if not _same_view(args[pos], t):
                return f"FA4's kernel argument {KERNEL_CALL_PARAMS[pos]} is not the call's tensor (copied or moved)"
        cu_q, cu_k, k_len, table = self.tensors
        for pos, t in ((_CU_Q, cu_q), (_CU_K, cu_k), (_USED_Q, None), (_USED_K, k_len), (_TABLE, table)):
            if args[pos] is not t:
                return f"FA4's kernel argument {KERNEL_CALL_PARAMS[pos]} is not the plan's tensor"
        if args[_SCALE] != self.scalars[0]:
            return f"FA4 passed softmax_scale {args[_SCALE]!r}, not {self.scalars[0]!r}"
        ptrs = {t.data_ptr() for t in per_call.values() if t is not None}
        for i, a in enumerate(args):
            if i not in per_call and isinstance(a, torch.Tensor) and a.data_ptr() in ptrs:
                return f"FA4's kernel argument {i} holds a per-call tensor"
        self._kernel = kernel
        self._args = list(args)
        for pos in per_call:
            self._args[pos] = None  # hold no per-call tensor between calls
        self._inputs = (_layout(q), _layout(k), _layout(v))
        self._out = (tuple(out.shape), out.dtype, out.device)
        self._lse_shape = None if lse is None else tuple(lse.shape)
        return None


class FA4Launches:
    """The :class:`FA4Launch` of each call form of one plan (a plan holds one; its layers share it).

    At most :attr:`MAX_FORMS` forms are kept (a step meets a few: the paged call, the prefix and
    new-key calls, with or without the LSE); calls of further forms take the public path.
    """

    MAX_FORMS = 8

    def __init__(self) -> None:
        self.forms: list[FA4Launch] = []

    def get(
        self,
        private: FA4Private,
        *,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor | None,
        k_len: torch.Tensor | None,
        page_table: torch.Tensor | None,
        scale: float,
        causal: bool,
        window_left: int,
        return_lse: bool,
        sinks: bool,
    ) -> FA4Launch | None:
        """The form of these arguments (made on first use; ``None`` past :attr:`MAX_FORMS`)."""
        tensors = (cu_q, cu_k, k_len, page_table)
        scalars = (scale, causal, window_left, return_lse, sinks)
        for form in self.forms:
            if form.serves(private, tensors, scalars):
                return form
        if len(self.forms) >= self.MAX_FORMS:
            return None
        form = FA4Launch(
            private, cu_q=cu_q, cu_k=cu_k, k_len=k_len, page_table=page_table, scale=scale, causal=causal,
            window_left=window_left, return_lse=return_lse, sinks=sinks,
        )  # fmt: skip
        self.forms.append(form)
        return form
