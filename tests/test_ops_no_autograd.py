"""The public ops are inference ops on every device: inputs that require grad are read as their
values, and neither the outputs nor a caller's ``out=`` buffers take an autograd history (the GPU
kernels record none; the torch references the CPU runs must not either)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from shardattn.ops.gqa_decode import gqa_paged_decode
from shardattn.ops.gqa_prefill import gqa_prefill
from shardattn.ops.lse_merge import lse_merge
from shardattn.ops.sparse_mla import sparse_mla_attention
from shardattn.ops.sparse_mla_decode import sparse_mla_decode
from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill


def _mla(call: Callable, grad: bool) -> tuple:
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, 2, 48, generator=g).requires_grad_(grad)
    kv = torch.randn(32, 48, generator=g)
    rows = torch.randint(-1, 32, (4, 8), generator=g, dtype=torch.int32)
    out, lse = torch.empty(4, 2, 32), torch.empty(4, 2)
    return call(q, kv, rows, scale=0.3, v_dim=32, out=out, lse_out=lse), (out, lse)


def _gqa_decode(grad: bool) -> tuple:
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 16, generator=g).requires_grad_(grad)
    k, v = torch.randn(2, 2, 4, 2, 16, generator=g).unbind(0)  # 2 pages of 4 tokens, 2 KV heads
    table = torch.tensor([[0, 1], [1, 0]], dtype=torch.int32)
    out, lse = torch.empty(2, 4, 16), torch.empty(2, 4)
    lens = torch.tensor([5, 3], dtype=torch.int32)
    return gqa_paged_decode(q, k, v, table, lens, return_lse=True, out=out, lse_out=lse), (out, lse)


def _gqa_prefill(grad: bool) -> tuple:
    g = torch.Generator().manual_seed(5)
    q = torch.randn(6, 4, 16, generator=g).requires_grad_(grad)
    k, v = torch.randn(2, 6, 2, 16, generator=g).unbind(0)
    return gqa_prefill(q, k, v, torch.tensor([0, 2, 6], dtype=torch.int32), return_lse=True), ()


def _merge(grad: bool) -> tuple:
    g = torch.Generator().manual_seed(6)
    outs = torch.randn(3, 4, 2, 8, generator=g).requires_grad_(grad)
    lses = torch.randn(3, 4, 2, generator=g)
    out, lse = torch.empty(4, 2, 8), torch.empty(4, 2)
    return lse_merge(outs, lses, out=out, lse_out=lse), (out, lse)


CASES = {
    "sparse_mla_attention": lambda grad: _mla(sparse_mla_attention, grad),
    "sparse_mla_grouped_prefill": lambda grad: _mla(sparse_mla_grouped_prefill, grad),
    "sparse_mla_decode": lambda grad: _mla(sparse_mla_decode, grad),
    "gqa_paged_decode": _gqa_decode,
    "gqa_prefill": _gqa_prefill,
    "lse_merge": _merge,
}


@pytest.mark.parametrize("op", sorted(CASES))
def test_inputs_that_require_grad_are_read_as_values_and_leave_no_history(op: str) -> None:
    results, buffers = CASES[op](True)
    plain, _ = CASES[op](False)
    for got, want in zip(results, plain, strict=True):
        assert not got.requires_grad and got.grad_fn is None
        assert torch.equal(got, want)
    assert all(not b.requires_grad for b in buffers)  # a caller's out= buffer stays a plain buffer
