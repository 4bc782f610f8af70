"""Triton's Gluon for the sm_90 sparse-MLA kernels, imported once.

Both Gluon kernels (:mod:`~shardattn.kernels.gluon.sparse_mla`, :mod:`~shardattn.kernels.gluon.sparse_mla_epilogue`)
take the Gluon modules, the Hopper ops, the spellings that changed between Triton 3.6 and 3.9, and
the shared-memory operand layout from here. ``HAS_GLUON`` is ``False`` (and ``GLUON_IMPORT_ERROR``
says why) without Triton, or with a Triton that lacks Gluon or its Hopper ops.
"""

from __future__ import annotations

from shardattn.kernels.backend import COMPILE_OPTIONS

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )

    # Triton 3.6 spells the CTA barrier ``thread_barrier``; later versions ``barrier``.
    cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    # ... and the cp.async gather ``async_copy_global_to_shared``; later versions ``async_load``.
    async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
    from triton.language.core import builtin as _builtin

    @_builtin
    def reinterpret_smem(desc, dtype, shape, layout, _semantic=None):
        """``desc`` viewed as ``dtype`` / ``shape`` / ``layout`` (Triton 3.6 spells it
        ``_reinterpret``; later versions ``reinterpret``)."""
        view = getattr(desc, "reinterpret", None) or desc._reinterpret
        return view(dtype, shape, layout, _semantic=_semantic)

    HAS_GLUON = True
    GLUON_IMPORT_ERROR = ""
except Exception as exc:  # no Triton, or a Triton without Gluon / Hopper ops
    HAS_GLUON = False
    GLUON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

__all__ = [
    "GLUON_IMPORT_ERROR",
    "HAS_GLUON",
    "async_load",
    "compile_sm90",
    "cp",
    "cta_barrier",
    "fence_async_shared",
    "gl",
    "gluon",
    "grid_dependency",
    "mbarrier",
    "nvmma_layout",
    "reinterpret_smem",
    "warpgroup_mma",
    "warpgroup_mma_init",
    "warpgroup_mma_wait",
]

if HAS_GLUON:

    @gluon.constexpr_function
    def nvmma_layout(inner: int, bitwidth: int):
        """128-byte swizzled (or narrower for short rows) wgmma operand layout of ``[rows, inner]``."""
        width = min(128, inner * bitwidth // 8)
        return gl.NVMMASharedLayout(swizzle_byte_width=width, element_bitwidth=bitwidth, rank=2)

    @gluon.jit
    def grid_dependency(instruction: gl.constexpr):
        """``griddepcontrol.wait`` / ``griddepcontrol.launch_dependents`` (programmatic dependent
        launch) in a Gluon kernel, as inline PTX (Gluon has no wrapper for them)."""
        gl.inline_asm_elementwise(instruction + "; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


def compile_sm90(fn, signature: dict[str, str], constexprs: dict, *, aligned=(), options: dict | None = None):
    """Compile the Gluon kernel ``fn`` for sm_90 ahead of time (no GPU needed); returns Triton's
    compiled kernel (``asm["ptx"]``, ``metadata``). ``signature``: every argument's type
    (``"constexpr"`` for those in ``constexprs``); ``aligned``: argument names the launcher would
    see 16-byte divisible at run time (pointers, strides). Raises RuntimeError without Gluon."""
    if not HAS_GLUON:
        raise RuntimeError(f"triton.experimental.gluon unavailable ({GLUON_IMPORT_ERROR})")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = GluonASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={**COMPILE_OPTIONS, **(options or {})})
