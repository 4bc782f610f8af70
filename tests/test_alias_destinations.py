"""A destination laid over an input is refused where the Triton kernels would give a wrong result.

The cases (tests/interpret/alias_cases.py) run under ``TRITON_INTERPRET=1`` in a subprocess: each
lays ``out`` / a workspace / a rows or union buffer over what a later program reads, checks the
``ValueError`` naming both, and that the same call with the check taken out gives a result unlike
the one on separate buffers. The other overlaps refused (every entry and destination) are rows of
the bad-input table (tests/bad_input/alias_rows.py).
"""

from __future__ import annotations

import pytest

from shardattn.ops.dispatch import triton_available
from tests.interpret import run_cases


@pytest.mark.interpret
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_destination_over_input_is_refused_instead_of_a_wrong_result():
    lines = run_cases("alias_cases")
    assert lines[-1] == "0 failures: []", "\n".join(lines)
    refused = [ln for ln in lines if ln.startswith("ok") and ": refused" in ln]
    wrong = [ln for ln in lines if ln.startswith("ok") and "wrong without the check" in ln]
    assert len(refused) == len(wrong) == 7
