"""The XQA adapter's host side on the CPU, with a stand-in that reads ``q``, ``out`` and the block
table as XQA does: through their data pointers as dense arrays (FlashInfer's ``xqa_wrapper.cu``
passes only the caches' strides; the kernel indexes the page list ``[batch][pages]``), the
attention itself from the fp64 oracle. Views of another layout (a ``q`` split from a fused qkv,
a column slice of a wider block table, a strided ``out``) must give the dense result, and a call
with no request must launch nothing."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from shardattn.kernels import flashinfer_xqa
from shardattn.ops.gqa_decode import gqa_paged_decode
from tests.oracle import gqa_oracle


def _dense(t: torch.Tensor) -> torch.Tensor:
    """What a read through ``data_ptr()`` with the logical shape sees."""
    return torch.as_strided(t, t.shape, torch.empty(t.shape).stride(), t.storage_offset())


class _XQAStandIn:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, query, kv_cache, workspace, block_tables, seq_lens, max_seq_len, *, bmm1_scale, out, **kw):
        self.calls += 1
        k, v = kv_cache
        b = block_tables.shape[0]
        lens = seq_lens.view(torch.int32)
        want, _ = gqa_oracle(_dense(query), k, v, _dense(block_tables), lens, list(range(b + 1)), scale=bmm1_scale)
        _dense(out).copy_(want.to(out.dtype))
        return out


def _run(xqa: _XQAStandIn, *args, **kw) -> torch.Tensor:
    with (
        mock.patch.object(flashinfer_xqa, "unavailable_reason", lambda *a, **k: None),
        mock.patch.object(flashinfer_xqa, "get_xqa", lambda: xqa),
        mock.patch.object(flashinfer_xqa, "_workspace", lambda device: torch.zeros(8, dtype=torch.uint8)),
    ):
        return gqa_paged_decode(*args, backend="flashinfer", **kw)


def _case():
    g = torch.Generator().manual_seed(0)
    b, h, hkv, d, page, pages = 3, 8, 2, 64, 16, 12
    k = torch.randn(pages, page, hkv, d, generator=g).bfloat16()
    v = torch.randn(pages, page, hkv, d, generator=g).bfloat16()
    wide = torch.randperm(pages, generator=g).to(torch.int32)[: b * 4].view(b, 4)  # an engine's wider table
    lens = torch.tensor([20, 32, 7], dtype=torch.int32)
    qkv = torch.randn(b, h + 2 * hkv, d, generator=g).bfloat16()
    return qkv, k, v, wide, lens


@pytest.mark.parametrize("view", ["q-from-qkv", "table-column-slice", "strided-out"])
def test_views_of_another_layout_give_the_dense_result(view: str) -> None:
    qkv, k, v, wide, lens = _case()
    q, table = qkv[:, :8], wide[:, :2]  # neither is contiguous
    want = _run(_XQAStandIn(), q.contiguous(), k, v, table.contiguous(), lens)
    ref, _ = gqa_oracle(q.contiguous(), k, v, table.contiguous(), lens, [0, 1, 2, 3], scale=64**-0.5)
    torch.testing.assert_close(want.double(), ref, atol=2e-2, rtol=0)
    if view == "q-from-qkv":
        got = _run(_XQAStandIn(), q, k, v, table.contiguous(), lens)
    elif view == "table-column-slice":
        got = _run(_XQAStandIn(), q.contiguous(), k, v, table, lens)
    else:
        out = torch.full((3, 8, 128), 7.0, dtype=torch.bfloat16)[..., :64]
        got = _run(_XQAStandIn(), q.contiguous(), k, v, table.contiguous(), lens, out=out)
        assert got is out
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()


def test_a_call_with_no_request_launches_nothing() -> None:
    """Two padding rows of no request (``cu_q_lens = [0]``): zeros, as on every other backend."""
    _qkv, k, v, _wide, _lens = _case()
    xqa = _XQAStandIn()
    q = torch.randn(2, 8, 64).bfloat16()
    table = torch.zeros(0, 2, dtype=torch.int32)
    got = _run(xqa, q, k, v, table, torch.zeros(0, dtype=torch.int32), cu_q_lens=torch.zeros(1, dtype=torch.int32))
    assert xqa.calls == 0 and got.shape == q.shape and not got.any()


def test_xqa_refuses_non_causal_drafts_on_sm100_only() -> None:
    """XQA runs causal drafts only on SM100: ``gqa_paged_decode(backend="flashinfer")`` refuses
    non-causal ones there (with this reason), and only drafts."""
    assert flashinfer_xqa.sm_reason(10, non_causal_drafts=True) == "XQA runs causal drafts only on SM100"
    assert flashinfer_xqa.sm_reason(10, non_causal_drafts=False) is None
    assert flashinfer_xqa.sm_reason(9, non_causal_drafts=True) is None
