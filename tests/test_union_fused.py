"""The fused union builder (``method="fused"``, ``rows_sorted``): under the interpreter against the old
builders on fresh random inputs (tests/interpret/union_cases.py, in a subprocess because the
interpreter must be switched on before Triton is imported), and on the torch path."""

from __future__ import annotations

import pytest
import torch

from shardattn.kernels.triton.union_fused import search_steps
from shardattn.ops.dispatch import triton_available
from shardattn.ops.union import build_union, build_union_reference
from tests.interpret import run_cases
from tests.interpret.union_cases import make_rows


@pytest.mark.interpret
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_fused_builder_matches_the_old_builders_under_interpreter():
    lines = run_cases("union_cases")
    names = [ln.split()[1] for ln in lines if ln.startswith("ok")]
    for g in (1, 2, 4, 8):  # every group size, sorted and unsorted input, the broken-order contract
        assert any(n.startswith(f"fused[G={g},") and "rows_sorted=True" in n for n in names)
        assert any(n.startswith(f"fused[G={g},") and "sorted=False" in n for n in names)
        assert f"broken_order[G={g}]" in names
    assert lines[-1].startswith("0 failures")


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


@pytest.mark.parametrize("group_size", [2, 4, 8])
def test_split_search_steps_pin_the_merge_path_split_at_real_widths(group_size):
    """The kernel's binary split search, replayed in Python at K = 2048: after ``search_steps + LEVEL``
    rounds every diagonal of every level has its split, the true merge-path one."""
    topk, gen = 2048, torch.Generator().manual_seed(2)
    steps = search_steps(topk)
    for level in range(group_size.bit_length() - 1):
        width = topk << level
        la, lb = torch.randint(0, width + 1, (2,), generator=gen).tolist()
        keys = torch.randperm(8 * width, generator=gen)[: la + lb]
        a, b = sorted(keys[:la].tolist()), sorted(keys[la:].tolist())
        merged = sorted(a + b)
        for d in [*torch.randint(0, la + lb + 1, (40,), generator=gen).tolist(), 0, la + lb]:
            lo, hi = max(d - lb, 0), min(d, la)
            for _ in range(steps + level):
                if lo < hi:
                    mid = (lo + hi) // 2
                    if a[mid] < b[d - 1 - mid]:
                        lo = mid + 1
                    else:
                        hi = mid
            assert lo == hi and sorted(a[:lo] + b[: d - lo]) == merged[:d]


@pytest.mark.parametrize("rows_sorted", [False, True], ids=["unsorted", "sorted"])
def test_workspace_prefill_passes_the_flag_to_every_pass_and_keeps_the_result(monkeypatch, rows_sorted):
    """A rank's kernel call in passes over a small union workspace hands ``rows_sorted`` to each
    pass's build; the output equals one unsplit call (CPU: the reference path)."""
    import shardattn.runtime.prefill as pa
    from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill
    from shardattn.plan.routing import Route

    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs["rows_sorted"])
        return sparse_mla_grouped_prefill(*args, **kwargs)

    monkeypatch.setattr(pa, "sparse_mla_grouped_prefill", spy)
    gen = torch.Generator().manual_seed(4)
    q, kv = torch.randn(11, 2, 48, generator=gen), torch.randn(30, 48, generator=gen)
    rows = make_rows(4, 11, 6, 30, sort=rows_sorted)
    union_ws = torch.empty(4 * 6 * 4, dtype=torch.uint8)  # one group of G = 4 per pass
    lens_ws = torch.empty(4, dtype=torch.uint8)
    route = Route("triton", 4, "test")
    out, lse = pa.workspace_prefill_attention(
        q, kv, rows, route=route, union_ws=union_ws, lens_ws=lens_ws, scale=0.2, v_dim=32, rows_sorted=rows_sorted
    )
    want_out, want_lse = sparse_mla_grouped_prefill(q, kv, rows, scale=0.2, v_dim=32, group_size=4)
    assert seen == [rows_sorted] * 3
    torch.testing.assert_close(out, want_out, atol=0, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)
