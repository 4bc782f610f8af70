"""The hashed union builder (``method="hash"``): under the interpreter against the torch reference on
fresh random inputs (tests/interpret/union_hash_cases.py, in a subprocess because the interpreter
must be switched on before Triton is imported), and on the torch path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardattn.kernels.registry import triton_available
from shardattn.kernels.union import build_union, build_union_reference
from shardattn.kernels.union_hash import hash_union_slots
from tests.interpret.union_cases import make_rows

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.interpret
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_hash_builder_gives_the_reference_sets_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.interpret.union_hash_cases"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    names = [ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("ok")]
    for g in (2, 4, 8):
        assert any(n.startswith(f"hash[G={g},") for n in names)
    assert "hash[entry" in " ".join(names)  # the entry that equals -2 survived next to empty slots
    assert proc.stdout.splitlines()[-1].startswith("0 failures")


@pytest.mark.parametrize("group_size", [1, 2, 4, 8])
def test_torch_path_takes_the_method_and_gives_the_reference(group_size):
    rows = make_rows(5, 13, 9, 37, sort=False)
    kw = {"group_size": group_size, "num_kv_rows": 37}
    got = build_union(rows, method="hash", **kw)
    want = build_union_reference(rows, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_tables_are_at_most_half_full():
    for g, k in ((2, 2048), (4, 2048), (8, 2048), (8, 1), (4, 300)):
        slots = hash_union_slots(g, k)
        assert slots >= 2 * g * k and slots & (slots - 1) == 0 and slots < 4 * g * k + 4
