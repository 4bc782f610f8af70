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


def _every_other(shape: tuple[int, ...]) -> torch.Tensor:
    """A zeroed destination of ``shape`` whose last dim has stride 2 (every other column)."""
    return torch.zeros(*shape[:-1], 2 * shape[-1])[..., ::2]


def interpreted_strided_destination_cases() -> None:
    """Prefill destinations whose last dim is not unit-stride, and a head-blocked ``q`` of such a
    layout: the kernels wrote ``out`` as if dense (errors of 3.3), and read such a ``q`` so (2.7)."""
    from unittest import mock

    from shardattn.ops import sparse_mla
    from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill

    g = torch.Generator().manual_seed(5)
    t, h, r, k = 5, 4, 20, 6
    q, kv = torch.randn(t, h, 48, generator=g), torch.randn(r, 48, generator=g)
    rows = torch.randint(-1, r + 1, (t, k), generator=g, dtype=torch.int32)
    want = sparse_mla_oracle(q, kv, rows, scale=0.3, v_dim=32)
    for gs in (1, 2, 8):
        out = _every_other((t, h, 32))
        got = sparse_mla_grouped_prefill(q, kv, rows, scale=0.3, v_dim=32, group_size=gs, out=out)
        assert got[0] is out
        _close(f"grouped G={gs}, strided out", got, want)
        blocked = _every_other((2, t, 2, 48))
        blocked.copy_(q.view(t, 2, 2, 48).movedim(1, 0))
        _close(f"grouped G={gs}, head-blocked strided q", sparse_mla_grouped_prefill(
            blocked, kv, rows, scale=0.3, v_dim=32, group_size=gs), want)  # fmt: skip
    with mock.patch.object(sparse_mla, "_per_query_kernel", lambda *a: "triton"):  # its CUDA route, interpreted
        out = _every_other((t, h, 32))
        got = sparse_mla.sparse_mla_attention(q, kv, rows, scale=0.3, v_dim=32, out=out)
        assert got[0] is out
        _close("per-query, strided out", got, want)


@pytest.mark.interpret
def test_strided_small_tensors_give_the_oracles_result_under_the_interpreter() -> None:
    pytest.importorskip("triton", reason="the Triton kernels need triton")
    out = run_interpreted(__name__, "interpreted_strided_cases")
    assert out.count("ok ") == 3 + 1 + 6 + 1 + 1, out


@pytest.mark.interpret
def test_strided_prefill_destinations_give_the_oracles_result_under_the_interpreter() -> None:
    pytest.importorskip("triton", reason="the Triton kernels need triton")
    out = run_interpreted(__name__, "interpreted_strided_destination_cases")
    assert out.count("ok ") == 3 * 2 + 1, out


def test_union_and_merge_destinations_that_would_be_written_wrongly_are_refused() -> None:
    """``build_union(out=)`` of a strided union (written as dense: [[1, 0]] for [[1, 3]]) or of a
    union and lengths sharing bytes, and ``lse_merge`` into an ``out`` overlapping ``lse_out``
    (an error of 1.7), gave wrong results silently; an ``out`` that is no pair failed to unpack."""
    from shardattn.ops.lse_merge import lse_merge, lse_merge_reference
    from shardattn.ops.union import build_union

    rows = torch.tensor([[3, 1]], dtype=torch.int32)
    lens = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^out\[0\] must be contiguous"):
        build_union(rows, group_size=1, num_kv_rows=4, out=(torch.zeros(1, 4, dtype=torch.int32)[:, ::2], lens))
    buf = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^out\[0\] and out\[1\] share memory"):
        build_union(rows, group_size=1, num_kv_rows=4, out=(buf[:2].view(1, 2), buf[1:2]))
    with pytest.raises(TypeError, match=r"^out must be a \(union, lens\) pair of tensors, got Tensor"):
        build_union(rows, group_size=1, num_kv_rows=4, out=torch.zeros(1, 2, dtype=torch.int32))
    good = (torch.zeros(1, 2, dtype=torch.int32), lens)
    assert build_union(rows, group_size=1, num_kv_rows=4, out=good)[0].tolist() == [[1, 3]]

    outs, lses, flat = torch.randn(3, 4, 2, 8), torch.randn(3, 4, 2), torch.zeros(64)
    with pytest.raises(ValueError, match=r"^out and lse_out share memory"):
        lse_merge(outs, lses, out=flat.view(4, 2, 8), lse_out=flat[:8].view(4, 2))
    empty = lse_merge(outs[..., :0], lses)  # no values: the LSEs alone merge
    assert empty[0].shape == (4, 2, 0) and torch.equal(empty[1], lse_merge_reference(outs, lses)[1])


def _mla_case(tokens: int, heads: int, k: int, rows_total: int, seed: int):
    """bf16 MLA-shaped inputs on the GPU: invalid entries anywhere, lengths below the top-k, sinks."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, 576, generator=g).bfloat16().cuda()
    kv = torch.randn(rows_total, 576, generator=g).bfloat16().cuda()
    rows = torch.stack([torch.randperm(rows_total, generator=g)[:k] for _ in range(tokens)]).int()
    rows[torch.rand(tokens, k, generator=g) < 0.1] = -1
    length = torch.randint(k // 2, k + 1, (tokens,), generator=g, dtype=torch.int32)
    length[0] = 0  # a row with no key
    sinks = torch.randn(heads, generator=g)
    return q, kv, rows.cuda(), length.cuda(), sinks.cuda()


def _same(name: str, got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b), (name, (a.float() - b.float()).abs().nan_to_num(1e9).max())


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("tokens", "heads", "k", "backend"),
    [
        (5, 16, 512, "triton"),
        (4, 16, 2048, "gluon_small"),
        (64, 16, 2048, "gluon_stream"),
        (32, 128, 2048, "gluon"),
        (48, 32, 1024, None),
    ],
)
def test_strided_small_tensors_on_the_gpu_give_the_contiguous_result(tokens, heads, k, backend) -> None:
    """Every GPU decode kernel, and the routed prefills, on strided ``topk_length`` / ``sinks``
    (and decode on the same cache viewed as pages): the same bits as on contiguous copies, and
    within bf16 rounding of the fp32 reference."""
    from shardattn.ops.sparse_mla import sparse_mla_attention, sparse_mla_reference
    from shardattn.ops.sparse_mla_decode import sparse_mla_decode
    from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill

    if torch.cuda.get_device_capability() < (9, 0) and backend not in (None, "triton"):
        pytest.skip("the Gluon kernels need sm_90")
    q, kv, rows, length, sinks = _mla_case(tokens, heads, k, 3 * k, seed=tokens * 7 + heads)
    kw = {"scale": 0.04, "backend": backend}
    want = sparse_mla_decode(q, kv, rows, topk_length=length, sinks=sinks, **kw)
    got = sparse_mla_decode(q, kv, rows, topk_length=_column(length), sinks=_column(sinks), **kw)
    _same(f"decode {backend}", got, want)
    paged = sparse_mla_decode(q, kv.view(-1, 64, 576), rows, topk_length=length, sinks=sinks, **kw)
    _same(f"decode {backend} on a paged cache", paged, want)  # [P, page, D]: rows p * page + i
    ref_o, ref_l = sparse_mla_reference(q, kv, rows, scale=0.04, topk_length=length, sinks=sinks)
    torch.testing.assert_close(want[0].float(), ref_o.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(want[1], ref_l.float(), atol=1e-3, rtol=1e-3)
    if backend is None:  # the prefill routes on the same tensors
        for op, extra in ((sparse_mla_attention, {}), (sparse_mla_grouped_prefill, {"group_size": 8})):
            a = op(q, kv, rows, scale=0.04, topk_length=length, sinks=sinks, **extra)
            b = op(q, kv, rows, scale=0.04, topk_length=_column(length), sinks=_column(sinks), **extra)
            _same(op.__name__, b, a)
            torch.testing.assert_close(a[0].float(), ref_o.float(), atol=2e-2, rtol=2e-2)
            out = torch.zeros(*a[0].shape[:-1], 2 * a[0].shape[-1], dtype=q.dtype, device=q.device)[..., ::2]
            c = op(q, kv, rows, scale=0.04, topk_length=length, sinks=sinks, out=out, **extra)
            assert c[0] is out
            _same(f"{op.__name__}, strided out", c, a)


def test_gluon_layouts_need_strides_of_16_elements() -> None:
    """The Gluon kernels are launched on a variant specialised for strides divisible by 16; a bf16
    cache padded to 584 values a row (16-byte aligned rows) failed to compile on an H100 inside
    every routed Gluon decode and the per-query prefill. Such layouts route elsewhere, with the
    reason; 640 values a row, and FP8 rows padded to 672 bytes, run."""
    from shardattn.kernels.gluon.sparse_mla import stride_reason

    q = torch.zeros(4, 16, 576, dtype=torch.bfloat16)
    for width, dtype, cols, ok in [(584, torch.bfloat16, 576, False), (640, torch.bfloat16, 576, True),
                                   (664, torch.uint8, 656, False), (672, torch.uint8, 656, True)]:  # fmt: skip
        base = torch.zeros(128, width, dtype=dtype)
        for view in (base[:, :cols], base.view(2, 64, width)[..., :cols]):  # flat rows, and pages of them
            why = stride_reason(q, view)
            assert (why is None) == ok, (width, why)
            assert ok or f"kv's row stride must be a multiple of 16 elements (the kernels compile for no other), " \
                f"got {width}" == why  # fmt: skip
    wide_q = torch.zeros(4, 16, 584, dtype=torch.bfloat16)[..., :576]
    assert stride_reason(wide_q, torch.zeros(8, 576, dtype=torch.bfloat16)).startswith("q's strides must be")


@pytest.mark.gpu
@pytest.mark.parametrize("width", [584, 580, 640])
def test_padded_bf16_rows_on_the_gpu_give_the_references_result(width: int) -> None:
    """Padded bf16 rows (a row stride past the 576 values): the routed decode and prefill run (no
    compile failure) and match the reference on the same values."""
    from shardattn.ops.sparse_mla import sparse_mla_attention, sparse_mla_reference
    from shardattn.ops.sparse_mla_decode import sparse_mla_decode

    q, kv, rows, length, sinks = _mla_case(32, 64, 1024, 3072, seed=width)
    padded = torch.zeros(kv.shape[0], width, dtype=kv.dtype, device=kv.device)
    padded[:, :576] = kv
    ref_o, ref_l = sparse_mla_reference(q, kv, rows, scale=0.04, topk_length=length, sinks=sinks)
    for op in (sparse_mla_decode, sparse_mla_attention):
        out, lse = op(q, padded[:, :576], rows, scale=0.04, topk_length=length, sinks=sinks)
        torch.testing.assert_close(out.float(), ref_o.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse, ref_l.float(), atol=1e-3, rtol=1e-3)
