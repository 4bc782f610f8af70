"""The fused union builder (``method="fused"``, ``rows_sorted``): under the interpreter against the old
builders on fresh random inputs (tests/interpret/union_cases.py, in a subprocess because the
interpreter must be switched on before Triton is imported), and on the torch path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardattn.kernels.registry import triton_available
from shardattn.kernels.union import build_union, build_union_reference
from tests.interpret.union_cases import make_rows

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.interpret
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_fused_builder_matches_the_old_builders_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.interpret.union_cases"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    names = [ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("ok")]
    for g in (1, 2, 4, 8):  # every group size, sorted and unsorted input, the broken-order contract
        assert any(n.startswith(f"fused[G={g},") and "rows_sorted=True" in n for n in names)
        assert any(n.startswith(f"fused[G={g},") and "sorted=False" in n for n in names)
        assert f"broken_order[G={g}]" in names
    assert proc.stdout.splitlines()[-1].startswith("0 failures")


@pytest.mark.parametrize("rows_sorted", [False, True], ids=["unsorted", "sorted"])
@pytest.mark.parametrize("group_size", [1, 2, 4, 8])
def test_torch_path_takes_the_flag_and_gives_the_reference(group_size, rows_sorted):
    rows = make_rows(3, 13, 9, 37, sort=rows_sorted)
    length = torch.randint(0, 11, (13,), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    kw = {"group_size": group_size, "num_kv_rows": 37, "topk_length": length}
    got = build_union(rows, method="fused", rows_sorted=rows_sorted, **kw)
    want = build_union_reference(rows, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_reference_ignores_a_false_sorted_claim():
    # the flag is a promise the Triton builder trusts; the torch path sorts anyway (exact union)
    rows = torch.tensor([[9, 2, 5], [5, 1, 1]], dtype=torch.int32)
    got = build_union(rows, group_size=2, num_kv_rows=10, rows_sorted=True)
    want = build_union_reference(rows, group_size=2, num_kv_rows=10)
    assert torch.equal(got[0], want[0]) and got[1].tolist() == [4]
