"""The routed kernels' PTX is what the baseline says: Python changes left the generated code alone.

Compiles the representative routed variants (:data:`shardattn.testing.ptx_digest.CI_VARIANTS`)
for sm_90 on the CPU and compares the digests of their debug-stripped PTX with
``tests/ptx_digests.json`` for the installed Triton. A kernel change that is meant updates the
baseline in the same commit: ``python -m shardattn.testing.ptx_digest --write tests/ptx_digests.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardattn.kernels.backend import triton_available
from shardattn.testing import ptx_digest

BASELINE = Path(__file__).parent / "ptx_digests.json"


def _baseline() -> dict[str, str] | None:
    return json.loads(BASELINE.read_text()).get(ptx_digest.triton_key())


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_routed_kernels_compile_to_the_baseline_ptx():
    expected = _baseline()
    if expected is None:
        pytest.skip(f"{BASELINE.name} has no digests for {ptx_digest.triton_key()}")
    actual = ptx_digest.compute(list(ptx_digest.CI_VARIANTS))
    assert ptx_digest.compare(expected, actual) == []


def test_baseline_lists_every_variant_and_ci_subset_is_known():
    data = json.loads(BASELINE.read_text())
    assert data, "the baseline holds at least one Triton version"
    for key, digests in data.items():
        assert set(digests) == set(ptx_digest.VARIANTS), key
    assert set(ptx_digest.CI_VARIANTS) <= set(ptx_digest.VARIANTS)


def test_strip_debug_ignores_locations_and_comments_but_not_instructions():
    a = ".entry k()\n{\n\t.loc 1 10 2\n\tadd.s32 %r1, %r2, %r3; // x\n$L__tmp0:\n\tret;\n}"
    b = ".entry k()\n{\n\t.loc 7 99 1\n\tadd.s32 %r1, %r2, %r3;\n\tret;\n}\n.section .debug_info\n{\n.b8 1\n}"
    c = ".entry k()\n{\n\tsub.s32 %r1, %r2, %r3;\n\tret;\n}"
    assert ptx_digest.digest(a) == ptx_digest.digest(b) != ptx_digest.digest(c)
