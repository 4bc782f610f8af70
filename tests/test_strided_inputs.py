"""Small index, length and sink tensors given as strided views (a column of a metadata tensor):
the Triton kernels read entry ``i`` at ``ptr + i``, so each launcher takes a unit-stride copy
(:func:`~shardattn.kernels.backend.unit_stride`). Under the interpreter every op must give, on
strided views, the fp64 oracle's result (before: wrong rows, wrong LSEs, wrong union lengths)."""

from __future__ import annotations

import pytest
import torch

from shardattn.testing.interpret import run_interpreted
from tests.oracle import gqa_oracle, sparse_mla_oracle, topk_rows_oracle


def _column(x: torch.Tensor) -> torch.Tensor:
    """The same values as a stride-2 view (column 0 of a ``[N, 2]`` tensor)."""
    return torch.stack([x, torch.zeros_like(x)], dim=1)[:, 0]


def _close(name: str, got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    for a, b in zip(got, want, strict=True):
        a, b = a.double(), b.double()
        assert torch.equal(a.isneginf(), b.isneginf()), name
        fin = torch.isfinite(b)
        torch.testing.assert_close(a[fin], b[fin], atol=2e-4, rtol=0, msg=name)
    print("ok", name)


def interpreted_strided_cases() -> None:
    from shardattn.ops.gqa_decode import gqa_paged_decode
    from shardattn.ops.sparse_mla_decode import sparse_mla_decode
    from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill
    from shardattn.ops.topk import convert_topk
    from shardattn.ops.union import build_union

    g = torch.Generator().manual_seed(3)
    t, h, r, k = 6, 4, 25, 11
    q, kv = torch.randn(t, h, 48, generator=g), torch.randn(r, 48, generator=g)
    rows = torch.randint(-1, r + 1, (t, k), generator=g, dtype=torch.int32)  # invalid anywhere
    length = torch.randint(0, k + 1, (t,), generator=g, dtype=torch.int32)
    sinks = torch.randn(h, generator=g)
    want = sparse_mla_oracle(q, kv, rows, scale=0.3, v_dim=32, topk_length=length, sinks=sinks)
    for gs in (1, 2, 8):
        got = sparse_mla_grouped_prefill(
            q, kv, rows, scale=0.3, v_dim=32, group_size=gs, topk_length=_column(length), sinks=_column(sinks)
        )
        _close(f"grouped G={gs}", got, want)
    got = sparse_mla_decode(q, kv, rows, scale=0.3, v_dim=32, topk_length=_column(length), sinks=_column(sinks))
    _close("sparse decode", got, want)
    for method in ("sort", "fused", "bitmap"):
        for gs in (1, 2):
            union = build_union(rows, group_size=gs, num_kv_rows=r, topk_length=_column(length), method=method)
            plain = build_union(rows, group_size=gs, num_kv_rows=r, topk_length=length.clone(), method=method)
            assert torch.equal(union[1], plain[1]), (method, gs, union[1], plain[1])
            print("ok union", method, gs)

    # top-k conversion: strided req_ids / seq_lens / topk_length, and a strided destination
    table = torch.tensor([[2, 0, 1], [1, 3, -1]], dtype=torch.int32)
    pos = torch.randint(-2, 14, (t, k), generator=g, dtype=torch.int32)
    req = torch.randint(0, 2, (t,), generator=g, dtype=torch.int32)
    lens = torch.tensor([11, 7], dtype=torch.int32)
    ref = topk_rows_oracle(pos, req, table, block_size=4, seq_lens=lens, topk_length=length)
    out = torch.full((k, t), 7, dtype=torch.int32).t()  # unit stride on the other dim
    got_rows, _ = convert_topk(
        pos, _column(req), table, block_size=4, seq_lens=_column(lens), topk_length=_column(length), out=out
    )
    assert got_rows is out and torch.equal(out, ref), (out, ref)
    print("ok convert_topk")

    # GQA decode: strided seq_lens / cu_q_lens / sinks, a block table of non-unit last stride
    b, hkv, page, pages, d = 3, 2, 4, 10, 32
    kc, vc = torch.randn(pages, page, hkv, d, generator=g), torch.randn(pages, page, hkv, d, generator=g)
    bt = torch.stack([torch.randperm(pages, generator=g)[:4] for _ in range(b)]).int()
    seq = torch.tensor([5, 16, 2], dtype=torch.int32)
    cu = torch.tensor([0, 1, 3, 4], dtype=torch.int32)
    qg, sk = torch.randn(4, h, d, generator=g), torch.randn(h, generator=g)
    want = gqa_oracle(qg, kc, vc, bt, seq, cu.tolist(), scale=0.2, sinks=sk)
    got = gqa_paged_decode(
        qg, kc, vc, bt.t().contiguous().t(), _column(seq), cu_q_lens=_column(cu), max_q_len=2, sinks=_column(sk),
        scale=0.2, return_lse=True, backend="triton",
    )  # fmt: skip
    _close("gqa decode", got, want)


@pytest.mark.interpret
def test_strided_small_tensors_give_the_oracles_result_under_the_interpreter() -> None:
    pytest.importorskip("triton", reason="the Triton kernels need triton")
    out = run_interpreted(__name__, "interpreted_strided_cases")
    assert out.count("ok ") == 3 + 1 + 6 + 1 + 1, out
