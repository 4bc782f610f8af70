"""Merging partial attention results by their log-sum-exp (LSE).

Contract (docs/ARCHITECTURE.md, "LSE"): an LSE is fp32, natural log, shape ``[tokens, heads]``;
a row with no valid key is ``(out = 0, lse = -inf)``, the identity of the merge.

Merge of P partials (the one implementation of this math; every other path calls it or is
tested against it)::

    m   = max_i lse_i
    lse = m + log(sum_i exp(lse_i - m))
    out = sum_i exp(lse_i - lse) * out_i          (fp32 accumulation)

All ``-inf`` gives ``(0, -inf)``, never NaN. Derivation: each partial is
``out_i = sum_j p_ij v_j / Z_i`` with ``Z_i = exp(lse_i)``; the full softmax has
``Z = sum_i Z_i`` and ``out = sum_i (Z_i / Z) out_i``.

Empty partials: ``-inf`` is this library's marker; ``+inf`` (FlashMLA's value for a row with no
valid key) is read as empty too, by the reference and the Triton kernel alike, so a partial from
such a kernel merges as the identity instead of turning the row into NaN. A NaN LSE is not a
marker and propagates. Base-2 LSEs (FlashInfer's merge API) must be multiplied by ``ln 2`` by
whoever brings them; no adapter here returns one (the XQA decode adapter returns no LSE).

On CUDA tensors (or under ``TRITON_INTERPRET=1``) :func:`lse_merge` runs the Triton kernel
``_lse_merge_kernel`` (one program per ``BLOCK_R`` rows of ``(t, h)``, two passes over the ``P``
LSEs, one over the partial outputs); it is tested against :func:`lse_merge_reference`. The
kernel is capture-safe: no host synchronisation, and no allocation when ``out=`` / ``lse_out=``
are given.
:func:`launch_lse_merge_columns` is the same math for few rows and many partials (one program per
(row, column block) loading every partial at once, tested against the reference too); split-KV
decode picks one or the other (:func:`~shardattn.ops.sparse_mla_decode.merge_kind`). Its
register-tile merge, ``merge_partials_tile``, is also what split-KV decode's one-launch spread
merge runs inside the split kernel.
"""

from __future__ import annotations

import math

import torch

from shardattn._checks import FLOAT_DTYPES, check_same_device, check_tensor
from shardattn.kernels.backend import use_triton

try:  # Triton is optional: without it every path runs the torch reference.
    import triton
    import triton.language as tl

    try:  # grid-dependency control (programmatic dependent launch), Triton 3.3+
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:  # pragma: no cover - older Triton: pdl_supported() is False, PDL never compiles
        gdc_launch_dependents = gdc_wait = None
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None


def empty_as_neg_inf(lses: torch.Tensor) -> torch.Tensor:
    """fp32 ``lses`` with ``+inf`` (FlashMLA's empty row) mapped to ``-inf`` (this library's).

    >>> empty_as_neg_inf(torch.tensor([1.0, float("inf"), float("-inf")])).tolist()
    [1.0, -inf, -inf]
    """
    lses = lses.float()
    return torch.where(torch.isposinf(lses), torch.full_like(lses, -math.inf), lses)


def merge_weights(lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge's per-partial weights and merged LSE.

    Args:
        lses: ``[P, ...]`` fp32 LSEs; ``-inf`` or ``+inf`` marks an empty partial (weight 0).
    Returns:
        ``(weights [P, ...] fp32, lse [...] fp32)`` with ``weights = exp(lse_i - lse)``;
        positions empty in every partial give weights 0 and lse ``-inf``. A NaN LSE is not an
        empty marker: it propagates (NaN weights and lse), so a broken partial is seen.
    """
    lses = empty_as_neg_inf(lses)
    m = lses.amax(dim=0)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    scaled = torch.exp(lses - m_safe)
    total = scaled.sum(dim=0)
    lse = torch.where(total > 0, m_safe + torch.log(total), torch.full_like(m, -math.inf))
    weights = scaled / torch.where(total > 0, total, torch.ones_like(total))
    return weights, lse


def lse_merge_reference(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`lse_merge` (fp32 throughout).

    Args:
        outs: ``[P, T, H, D]`` partial outputs (any float dtype).
        lses: ``[P, T, H]`` fp32 natural-log LSEs, ``-inf`` or ``+inf`` for empty partial rows.
    Returns:
        ``(out [T, H, D] in outs.dtype, lse [T, H] fp32)``.
    """
    weights, lse = merge_weights(lses)
    out = (weights.unsqueeze(-1) * outs.float()).sum(dim=0)
    return out.to(outs.dtype), lse


def check_merge_inputs(outs: torch.Tensor, lses: torch.Tensor) -> None:
    """Validate :func:`lse_merge` arguments (shapes, dtypes, devices); no GPU sync."""
    check_tensor("outs", outs, dtypes=FLOAT_DTYPES, ndim=4)
    check_tensor("lses", lses, dtypes=(torch.float32,), shape=tuple(outs.shape[:3]))
    check_same_device(outs=outs, lses=lses)
    if outs.shape[0] < 1:
        raise ValueError(f"outs must hold at least one partial, got shape {list(outs.shape)}")


def lse_merge(
    outs: torch.Tensor,
    lses: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``P`` partial attention results by their LSEs.

    Args:
        outs: ``[P, T, H, D]`` partial outputs (fp16 / bf16 / fp32).
        lses: ``[P, T, H]`` fp32 natural-log LSEs; ``-inf`` (or ``+inf``, FlashMLA's marker)
            is an empty partial row, which contributes nothing whatever its ``outs`` hold.
        out: optional ``[T, H, D]`` destination (any float dtype; a CUDA graph passes its own).
        lse_out: optional ``[T, H]`` fp32 destination.
    Returns:
        ``(out [T, H, D] in outs.dtype (or out's dtype), lse [T, H] fp32)``; a row empty in every
        partial is ``(0, -inf)``. On CUDA tensors the Triton kernel runs, else the reference.

    Example:
        >>> outs, lses = torch.ones(2, 3, 4, 8), torch.zeros(2, 3, 4)
        >>> out, lse = lse_merge(outs, lses)
        >>> tuple(out.shape), tuple(lse.shape), round(float(lse[0, 0]), 4)
        ((3, 4, 8), (3, 4), 0.6931)
    """
    check_merge_inputs(outs, lses)
    _, t, h, d = outs.shape
    if out is not None:
        check_tensor("out", out, dtypes=FLOAT_DTYPES, shape=(t, h, d))
    if lse_out is not None:
        check_tensor("lse_out", lse_out, dtypes=(torch.float32,), shape=(t, h))
    check_same_device(outs=outs, out=out, lse_out=lse_out)
    return run_lse_merge(outs, lses, out=out, lse_out=lse_out)


def run_lse_merge(
    outs: torch.Tensor,
    lses: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`lse_merge` on arguments already checked (by it, or by a step whose partials came
    from this library's own kernels): the Triton kernel on CUDA tensors, else the reference; no
    argument checks. Shapes and return value: :func:`lse_merge`."""
    _, t, h, d = outs.shape
    if triton is None or not use_triton(outs):
        ref_out, ref_lse = lse_merge_reference(outs, lses)
        if out is None and lse_out is None:
            return ref_out, ref_lse
        out = ref_out if out is None else out.copy_(ref_out)
        lse_out = ref_lse if lse_out is None else lse_out.copy_(ref_lse)
        return out, lse_out
    out = torch.empty(t, h, d, dtype=outs.dtype, device=outs.device) if out is None else out
    lse_out = torch.empty(t, h, dtype=torch.float32, device=outs.device) if lse_out is None else lse_out
    launch_lse_merge(outs, lses, out, lse_out)
    return out, lse_out


def split_partials_numel(num_splits: int, tokens: int, heads: int, dim: int) -> int:
    """fp32 elements a split-KV kernel needs for its partial outputs and LSEs (0 when not split)."""
    if num_splits <= 1:
        return 0
    return num_splits * tokens * heads * (dim + 1)


def split_partials(
    workspace: torch.Tensor | None,
    num_splits: int,
    tokens: int,
    heads: int,
    dim: int,
    device: torch.device,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of ``workspace`` (allocated when ``None``) for a split-KV kernel's partial results.

    Args:
        workspace: fp32 buffer of at least :func:`split_partials_numel` elements on ``device``, or None.
        num_splits, tokens, heads, dim: the partials' shape.
        out_dtype: the partial outputs' dtype (fp32, or a 2-byte float: they then take half the
            room and the LSEs follow them); the LSEs are fp32.
    Returns:
        ``(outs [num_splits, tokens, heads, dim] out_dtype, lses [num_splits, tokens, heads] fp32)``,
        to be merged by :func:`launch_lse_merge`.
    Raises:
        ValueError: ``workspace`` is too small, not fp32 or on another device.
    """
    need = split_partials_numel(num_splits, tokens, heads, dim)
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.float32, device=device)
    elif workspace.dtype != torch.float32 or workspace.numel() < need or workspace.device != device:
        raise ValueError(f"workspace must be a float32 tensor on {device} with >= {need} elements")
    n_out = num_splits * tokens * heads * dim
    n_lse = num_splits * tokens * heads
    words = n_out if out_dtype == torch.float32 else -(-n_out // 2)  # fp32 words the outputs take
    outs = workspace[:words].view(out_dtype)[:n_out].view(num_splits, tokens, heads, dim)
    lses = workspace[words : words + n_lse].view(num_splits, tokens, heads)
    return outs, lses


def launch_lse_merge(
    outs: torch.Tensor,
    lses: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    block_elems: int = 4096,
    num_warps: int = 4,
    pdl: bool = False,
) -> None:
    """Launch the Triton merge kernel on validated tensors (no checks, no allocation, no sync).

    Args:
        outs: ``[P, T, H, D]``; lses: ``[P, T, H]`` fp32; out: ``[T, H, D]``; lse: ``[T, H]`` fp32.
        Any strides; ``D`` is read in one tile (``next_power_of_2(D)`` lanes).
        block_elems, num_warps: tile size (rows x padded D) and warps of one program (tuning).
        pdl: launch as a programmatic dependent launch (only where
            :func:`~shardattn.kernels.backend.pdl_supported`): the kernel starts behind the one
            that writes ``outs`` / ``lses`` and waits for it before reading them.
    """
    p, t, h, d = outs.shape
    n_rows = t * h
    if n_rows == 0:
        return
    block_d = triton.next_power_of_2(d)
    block_r = max(1, min(64, block_elems // block_d))
    grid = (triton.cdiv(n_rows, block_r),)
    _lse_merge_kernel[grid](
        outs,
        lses,
        out,
        lse,
        p,
        h,
        d,
        n_rows,
        *_merge_strides(outs, lses, out, lse),
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        PDL=pdl,
        num_warps=num_warps,
        launch_pdl=pdl,
    )


def _merge_strides(outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> tuple[int, ...]:
    """The merge kernels' stride arguments: ``outs`` (4), ``lses`` (3), ``out`` (3), ``lse`` (2)."""
    return (*outs.stride(), *lses.stride(), *out.stride(), *lse.stride())


def launch_lse_merge_columns(
    outs: torch.Tensor,
    lses: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    block_d: int = 128,
    num_warps: int = 4,
    pdl: bool = False,
) -> None:
    """:func:`launch_lse_merge` for few rows and many partials: one program per (row, ``block_d``
    columns) loads all ``P`` LSEs and its ``[P, block_d]`` slice of the partials in one step (no
    loop over ``P``), so the merge costs one memory latency however many splits there are.

    Args:
        outs: ``[P, T, H, D]``; lses: ``[P, T, H]`` fp32; out: ``[T, H, D]``; lse: ``[T, H]`` fp32.
        Any strides; validated tensors, no checks, no allocation, no sync.
        block_d, num_warps: columns and warps of one program (tuning; ``P * block_d`` fp32 live).
        pdl: a programmatic dependent launch, as in :func:`launch_lse_merge`.
    """
    p, t, h, d = outs.shape
    n_rows = t * h
    if n_rows == 0:
        return
    block_d = min(triton.next_power_of_2(d), block_d)
    grid = (n_rows, triton.cdiv(d, block_d))
    _lse_merge_columns_kernel[grid](
        outs,
        lses,
        out,
        lse,
        p,
        h,
        d,
        *_merge_strides(outs, lses, out, lse),
        BLOCK_P=max(2, triton.next_power_of_2(p)),
        BLOCK_D=block_d,
        PDL=pdl,
        num_warps=num_warps,
        launch_pdl=pdl,
    )


if triton is not None:

    @triton.jit
    def merge_partials_tile(li, o):
        """The merge of ``P`` partials of one (token, head) over a slice of its columns, in registers:
        ``li [P]`` fp32 LSEs (``-inf`` for a masked-off partial), ``o [P, N]`` partial outputs; returns
        ``(out [N] fp32, lse)`` (a scalar). Used by the column merge and by split-KV decode's
        one-launch merge (:mod:`~shardattn.kernels.triton.sparse_mla_decode`)."""
        # +inf (FlashMLA's empty row) is empty, like -inf: the reference's empty_as_neg_inf
        li = tl.where(li == float("inf"), float("-inf"), li)
        m = tl.max(li, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp(li - m_safe)
        total = tl.sum(w, 0)
        # an empty partial (w = 0) contributes nothing, even if its output holds garbage
        acc = tl.sum(tl.where(w[:, None] > 0, w[:, None] * o.to(tl.float32), 0.0), 0)
        res = acc / tl.where(total > 0, total, 1.0)
        return res, tl.where(total > 0, m_safe + tl.log(total), float("-inf"))

    @triton.jit
    def _lse_merge_kernel(
        Outs,
        Lses,
        Out,
        Lse,
        P,
        H,
        D,
        n_rows,
        stride_op,
        stride_ot,
        stride_oh,
        stride_od,
        stride_lp,
        stride_lt,
        stride_lh,
        stride_yt,
        stride_yh,
        stride_yd,
        stride_zt,
        stride_zh,
        BLOCK_R: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Merge rows ``[pid * BLOCK_R, ...)`` of the flattened ``(t, h)`` axis over ``P`` partials
        (``PDL``: first wait for the grid that wrote them)."""
        if PDL:
            gdc_wait()
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        offs_d = tl.arange(0, BLOCK_D)
        rmask = rows < n_rows
        t = (rows // H).to(tl.int64)
        h = (rows % H).to(tl.int64)
        lse_ptrs = Lses + t * stride_lt + h * stride_lh
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        # +inf (FlashMLA's empty row) is empty, like -inf: the reference's empty_as_neg_inf
        for i in range(P):
            li = tl.load(lse_ptrs + i * stride_lp, mask=rmask, other=float("-inf"))
            m = tl.maximum(m, tl.where(li == float("inf"), float("-inf"), li))
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        total = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        omask = rmask[:, None] & (offs_d[None, :] < D)
        o_ptrs = Outs + t[:, None] * stride_ot + h[:, None] * stride_oh + offs_d[None, :] * stride_od
        for i in range(P):
            li = tl.load(lse_ptrs + i * stride_lp, mask=rmask, other=float("-inf"))
            w = tl.exp(tl.where(li == float("inf"), float("-inf"), li) - m_safe)
            o = tl.load(o_ptrs + i * stride_op, mask=omask, other=0.0).to(tl.float32)
            total += w
            # an empty partial (w = 0) contributes nothing, even if its output holds garbage
            acc += tl.where(w[:, None] > 0, w[:, None] * o, 0.0)
        lse = tl.where(total > 0, m_safe + tl.log(total), float("-inf"))
        res = acc / tl.where(total > 0, total, 1.0)[:, None]
        y_ptrs = Out + t[:, None] * stride_yt + h[:, None] * stride_yh + offs_d[None, :] * stride_yd
        tl.store(y_ptrs, res.to(Out.dtype.element_ty), mask=omask)
        tl.store(Lse + t * stride_zt + h * stride_zh, lse, mask=rmask)

    @triton.jit
    def _lse_merge_columns_kernel(
        Outs,
        Lses,
        Out,
        Lse,
        P,
        H,
        D,
        stride_op,
        stride_ot,
        stride_oh,
        stride_od,
        stride_lp,
        stride_lt,
        stride_lh,
        stride_yt,
        stride_yh,
        stride_yd,
        stride_zt,
        stride_zh,
        BLOCK_P: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Merge columns ``[pid1 * BLOCK_D, ...)`` of row ``pid0`` of the flattened ``(t, h)`` axis;
        every partial's LSE and slice are loaded at once (``BLOCK_P >= P``; ``PDL``: after waiting
        for the grid that wrote them)."""
        if PDL:
            gdc_wait()
        row = tl.program_id(0)
        t = (row // H).to(tl.int64)
        h = (row % H).to(tl.int64)
        offs_p = tl.arange(0, BLOCK_P)
        offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        pmask = offs_p < P
        li = tl.load(Lses + offs_p * stride_lp + t * stride_lt + h * stride_lh, mask=pmask, other=float("-inf"))
        omask = pmask[:, None] & (offs_d[None, :] < D)
        o_ptrs = Outs + offs_p[:, None] * stride_op + t * stride_ot + h * stride_oh + offs_d[None, :] * stride_od
        o = tl.load(o_ptrs, mask=omask, other=0.0)
        res, lse = merge_partials_tile(li, o)
        tl.store(
            Out + t * stride_yt + h * stride_yh + offs_d * stride_yd, res.to(Out.dtype.element_ty), mask=offs_d < D
        )
        if tl.program_id(1) == 0:
            tl.store(Lse + t * stride_zt + h * stride_zh, lse)
