"""Every kernel launch and ahead-of-time compile of the library names its compile options.

Triton 3.9 contracts multiplies and adds (FMA) unless told otherwise, warns that a later release will
not, and ``TRITON_DEFAULT_FP_FUSION`` changes the default: the kernels were measured and their PTX
digested with contraction on, so the library asks for it by name (``COMPILE_OPTIONS``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import shardattn.kernels
from shardattn.kernels.backend import COMPILE_OPTIONS

KERNELS = Path(shardattn.kernels.__file__).parent


def _launches(tree: ast.AST) -> list[ast.Call]:
    """``kernel[grid](...)`` calls: a subscripted name called."""
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript) and isinstance(n.func.value, ast.Name)
    ]


def _passes_options(call: ast.Call) -> bool:
    unpacked = [k.value for k in call.keywords if k.arg is None]  # the **mappings of the call
    return any(isinstance(v, ast.Name) and v.id == "COMPILE_OPTIONS" for v in unpacked)


def test_compile_options_ask_for_fp_fusion():
    assert dict(COMPILE_OPTIONS) == {"enable_fp_fusion": True}


def test_every_kernel_launch_passes_the_compile_options():
    launches = {}
    for path in sorted(KERNELS.rglob("*.py")):
        for call in _launches(ast.parse(path.read_text())):
            launches[f"{path.relative_to(KERNELS)}:{call.lineno}"] = _passes_options(call)
    assert len(launches) >= 20, launches  # the scan finds the launches (24 when written)
    assert [where for where, ok in launches.items() if not ok] == []


@pytest.mark.parametrize("fusion_default", ["0", "1"])
def test_an_ahead_of_time_compile_contracts_whatever_the_environment_says(monkeypatch, fusion_default):
    """``TRITON_DEFAULT_FP_FUSION=0`` would compile without contraction; the library's compile does not."""
    from shardattn.kernels.gluon.compat import HAS_GLUON

    if not HAS_GLUON:
        pytest.skip("needs Triton's Gluon (compiles for sm_90 without a GPU)")
    from shardattn.kernels.gluon.union_smem import compile_for_sm90

    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", fusion_default)
    compiled = compile_for_sm90(4, topk=256, num_kv_rows=4096)
    assert compiled.metadata.enable_fp_fusion is True
