"""The read-floor kernel of ``benchmarks/decode_floor.py``: what it reads is what its reference sums."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from shardattn.kernels.backend import triton_available
from tests.interpret import run_cases

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from read_floor import row_words


@pytest.mark.skipif(not triton_available(), reason="needs Triton")
def test_read_floor_kernel_under_the_interpreter_equals_its_reference() -> None:
    lines = run_cases("read_floor_cases")
    assert len(lines) == 2 * 3 * 4 and all(line.startswith("ok") for line in lines), lines


def test_row_words_refuses_rows_that_are_not_whole_words() -> None:
    assert row_words(torch.zeros(4, 576, dtype=torch.bfloat16)).shape == (4, 288)
    assert row_words(torch.zeros(2, 64, 656, dtype=torch.uint8)).shape == (128, 164)
    with pytest.raises(ValueError, match="multiple of 4 bytes"):
        row_words(torch.zeros(4, 655, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        row_words(torch.zeros(4, 1152, dtype=torch.uint8)[:, :656])
