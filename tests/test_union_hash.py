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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("group_size", [2, 4, 8])
@pytest.mark.parametrize("with_length", [False, True], ids=["nolen", "len"])
def test_hash_builder_gives_the_sorted_builders_sets_on_gpu(group_size, with_length):
    """Real width (K = 2048), many groups racing on their tables: invalid and out-of-range entries
    anywhere, duplicates, a keyless group, a tail group, rows up to 2**24 - 2; the same entries
    per group as the sorted builder, and the grouped kernel's output from either union agrees."""
    from shardattn.kernels.sparse_mla import sparse_mla_reference
    from shardattn.kernels.sparse_mla_triton import launch_attention, tile_config

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(group_size)
    t, k, r = 1027, 2048, 2**24 - 1
    rows = torch.randint(0, 5000, (t, k), device=dev, generator=gen, dtype=torch.int32) * 3355
    rows[torch.rand(t, k, device=dev, generator=gen) < 0.05] = -1
    rows[:, 7] = r + 4  # out of range
    rows[:, 100:150] = rows[:, 0:50]  # duplicates
    rows[16:24] = -1  # a keyless group
    rows[30:34, 0] = r - 1  # the largest packable row
    length = torch.randint(0, k + 1, (t,), device=dev, generator=gen, dtype=torch.int32) if with_length else None
    kw = {"group_size": group_size, "num_kv_rows": r, "topk_length": length}
    uh, lh = build_union(rows, method="hash", **kw)
    us, ls = build_union(rows, method="fused", **kw)
    assert torch.equal(lh, ls)
    width = int(ls.max())
    keep = torch.arange(width, device=dev)[None, :] < ls[:, None]
    big = torch.iinfo(torch.int32).max
    for u in (uh, us):
        u[:, :width] = torch.where(keep, u[:, :width], big)
    assert torch.equal(torch.sort(uh[:, :width], dim=1).values, torch.sort(us[:, :width], dim=1).values)
    # the grouped Triton kernel on a hashed union (a smaller cache: the same rows modulo its size)
    small = torch.where(rows >= 0, rows % 65536, -1)
    heads = 64 // group_size
    q = torch.randn(t, heads, 576, device=dev, generator=gen).bfloat16()
    kv = torch.randn(65536, 576, device=dev, generator=gen).bfloat16()
    u, n = build_union(small, method="hash", group_size=group_size, num_kv_rows=65536, topk_length=length)
    out, lse = launch_attention(q, kv, u, n, scale=0.05, v_dim=512, config=tile_config(heads, group_size))
    ref_o, ref_l = sparse_mla_reference(q, kv, small, scale=0.05, topk_length=length)
    assert ((out.float() - ref_o.float()).norm() / ref_o.float().norm()).item() < 1e-2
    fin = torch.isfinite(ref_l)
    assert torch.equal(fin, torch.isfinite(lse)) and (lse[fin] - ref_l[fin]).abs().max().item() < 1e-2
