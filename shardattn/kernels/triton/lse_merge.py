"""The Triton LSE-merge kernels and their launchers (the math and its reference: :mod:`shardattn.ops.lse_merge`).

* :func:`launch_lse_merge`: one program per block of ``(t, h)`` rows, two passes over the ``P``
  LSEs, one over the partial outputs (few wide programs: many rows).
* :func:`launch_lse_merge_columns`: one program per (row block, column block) loading all ``P``
  LSEs and its ``[P, block_rows, block_d]`` slice at once, so the merge costs one memory latency
  however many splits there are.
* :func:`split_partials`: the fp32 workspace views a split-KV kernel writes its partials into.

Both kernels read ``+inf`` (FlashMLA's empty row) as empty, like ``-inf``, and with ``pdl=True``
are programmatic dependent launches that wait for the grid that wrote their partials.
"""

from __future__ import annotations

import torch

from shardattn.kernels.backend import COMPILE_OPTIONS

try:  # Triton is optional: without it every path runs the torch reference.
    import triton
    import triton.language as tl

    try:  # grid-dependency control (programmatic dependent launch), Triton 3.3+
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:  # pragma: no cover - older Triton: pdl_supported() is False, PDL never compiles
        gdc_launch_dependents = gdc_wait = None
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None

#: ``True`` when Triton imports (the kernels below exist).
HAVE_TRITON = triton is not None

__all__ = [
    "HAVE_TRITON",
    "gdc_launch_dependents",
    "gdc_wait",
    "launch_lse_merge",
    "launch_lse_merge_columns",
    "split_partials",
    "split_partials_numel",
]


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
        **COMPILE_OPTIONS,
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
    block_rows: int = 1,
    num_warps: int = 4,
    pdl: bool = False,
) -> None:
    """:func:`launch_lse_merge` for many partials: one program per (``block_rows`` rows, ``block_d``
    columns) loads all ``P`` LSEs and its ``[P, block_rows, block_d]`` slice of the partials in one
    step (no loop over ``P``), so the merge costs one memory latency however many splits there are.

    Args:
        outs: ``[P, T, H, D]``; lses: ``[P, T, H]`` fp32; out: ``[T, H, D]``; lse: ``[T, H]`` fp32.
        Any strides; validated tensors, no checks, no allocation, no sync.
        block_d, block_rows, num_warps: columns, (token, head) rows and warps of one program
            (tuning; ``P * block_rows * block_d`` fp32 live).
        pdl: a programmatic dependent launch, as in :func:`launch_lse_merge`.
    """
    p, t, h, d = outs.shape
    n_rows = t * h
    if n_rows == 0:
        return
    block_d = min(triton.next_power_of_2(d), block_d)
    grid = (triton.cdiv(n_rows, block_rows), triton.cdiv(d, block_d))
    _lse_merge_columns_kernel[grid](
        outs,
        lses,
        out,
        lse,
        p,
        h,
        d,
        n_rows,
        *_merge_strides(outs, lses, out, lse),
        BLOCK_P=max(2, triton.next_power_of_2(p)),
        BLOCK_R=block_rows,
        BLOCK_D=block_d,
        PDL=pdl,
        num_warps=num_warps,
        launch_pdl=pdl,
        **COMPILE_OPTIONS,
    )


if triton is not None:

    @triton.jit
    def merge_partials_tile(li, o):
        """The merge of ``P`` partials of ``R`` (token, head) rows over a slice of their columns, in
        registers: ``li [P, R]`` fp32 LSEs (``-inf`` for a masked-off partial), ``o [P, R, N]`` partial
        outputs; returns ``(out [R, N] fp32, lse [R])``, the column merge's register tile."""
        # +inf (FlashMLA's empty row) is empty, like -inf: the reference's empty_as_neg_inf
        li = tl.where(li == float("inf"), float("-inf"), li)
        m = tl.max(li, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp(li - m_safe[None, :])
        total = tl.sum(w, 0)
        # an empty partial (w = 0) contributes nothing, even if its output holds garbage
        acc = tl.sum(tl.where(w[:, :, None] == 0, 0.0, w[:, :, None] * o.to(tl.float32)), 0)
        res = acc / tl.where(total == 0, 1.0, total)[:, None]
        return res, tl.where(total == 0, float("-inf"), m_safe + tl.log(total))

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
            acc += tl.where(w[:, None] == 0, 0.0, w[:, None] * o)
        lse = tl.where(total == 0, float("-inf"), m_safe + tl.log(total))
        res = acc / tl.where(total == 0, 1.0, total)[:, None]
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
        BLOCK_P: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Merge columns ``[pid1 * BLOCK_D, ...)`` of rows ``[pid0 * BLOCK_R, ...)`` of the flattened
        ``(t, h)`` axis; every partial's LSEs and slices are loaded at once (``BLOCK_P >= P``;
        ``PDL``: after waiting for the grid that wrote them)."""
        if PDL:
            gdc_wait()
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < n_rows
        t = (rows // H).to(tl.int64)
        h = (rows % H).to(tl.int64)
        offs_p = tl.arange(0, BLOCK_P)
        offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        lmask = (offs_p < P)[:, None] & rmask[None, :]
        lse_ptrs = Lses + offs_p[:, None] * stride_lp + (t * stride_lt + h * stride_lh)[None, :]
        li = tl.load(lse_ptrs, mask=lmask, other=float("-inf"))
        dmask = offs_d < D
        o_ptrs = (
            Outs
            + offs_p[:, None, None] * stride_op
            + (t * stride_ot + h * stride_oh)[None, :, None]
            + offs_d[None, None, :] * stride_od
        )
        o = tl.load(o_ptrs, mask=lmask[:, :, None] & dmask[None, None, :], other=0.0)
        res, lse = merge_partials_tile(li, o)
        y_ptrs = Out + (t * stride_yt + h * stride_yh)[:, None] + offs_d[None, :] * stride_yd
        tl.store(y_ptrs, res.to(Out.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])
        if tl.program_id(1) == 0:
            tl.store(Lse + t * stride_zt + h * stride_zh, lse, mask=rmask)
