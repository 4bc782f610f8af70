"""Rows of the bad-input table for destinations over inputs (tests/test_bad_input.py).

A kernel entry's destinations (``out``, ``lse_out``, a split or union workspace, a rows buffer,
``status``) may not share memory with what it reads: its programs write results while other
programs still read queries, keys, rows or partials, so an overlap gives a wrong result with no
error (tests/test_alias_destinations.py shows it under the Triton interpreter). Each row lays a
destination over an input and must get a ``ValueError`` naming both, before any kernel runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardattn.ops import kv_fp8 as fp8_mod
from shardattn.ops import prepared_union as prepared_mod
from shardattn.ops import union as union_mod
from shardattn.ops.union import build_union
from tests.bad_input.kernel_rows import SPARSE_ENTRIES, _gqa, _merge, _sparse, _topk
from tests.bad_input.table import Call, Raises, Row, mla

_I32 = torch.int32


def _over(buf: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The first elements of ``buf``'s bytes as a contiguous ``dtype`` tensor of ``shape``."""
    n = 1
    for s in shape:
        n *= s
    return buf.reshape(-1).view(dtype)[:n].view(shape)


def _prepared(x: dict[str, Any]) -> prepared_mod.PreparedUnion:
    """The ``G = 1`` union of :func:`mla`'s rows built into the first bytes of ``x["buf"]``."""
    union, lens = _over(x["buf"], _I32, (3, 4)), torch.zeros(3, dtype=_I32)
    build_union(x["rows"], group_size=1, num_kv_rows=10, out=(union, lens))
    return prepared_mod.PreparedUnion(union, lens, 1, 3)


def _with_buf(x: dict[str, Any]) -> torch.Tensor:
    """One fp32 buffer per row build, shared by the arguments that lay themselves over it."""
    return x.setdefault("buf", torch.zeros(192))


def _sparse_alias_rows() -> list[Row]:
    rows: list[Row] = []
    for name, fn in SPARSE_ENTRIES:
        rows += [
            Row(
                f"{name}-out-over-q",
                _sparse(fn, out=lambda x: _over(x["q"], torch.float32, (3, 2, 32))),
                Raises(ValueError, r"^out shares memory with q"),
            ),
            Row(
                f"{name}-out-over-kv",
                _sparse(fn, out=lambda x: _over(x["kv"], torch.float32, (3, 2, 32))),
                Raises(ValueError, r"^out shares memory with kv"),
            ),
            Row(
                f"{name}-lse-out-over-rows",
                _sparse(fn, lse_out=lambda x: _over(x["rows"], torch.float32, (3, 2))),
                Raises(ValueError, r"^lse_out shares memory with rows"),
            ),
            Row(
                f"{name}-lse-out-over-topk-length",
                _sparse(
                    fn,
                    topk_length=lambda x: _over(_with_buf(x), _I32, (3,)).fill_(4),
                    lse_out=lambda x: _over(_with_buf(x), torch.float32, (3, 2)),
                ),
                Raises(ValueError, r"^lse_out shares memory with topk_length"),
            ),
            Row(
                f"{name}-out-over-sinks",
                _sparse(fn, sinks=lambda x: _with_buf(x)[:2], out=lambda x: _with_buf(x).view(3, 2, 32)),
                Raises(ValueError, r"^out shares memory with sinks"),
            ),
        ]
    for name in ("sparse_mla_attention", "sparse_mla_grouped_prefill"):
        fn = dict(SPARSE_ENTRIES)[name]
        rows.append(
            Row(  # the kernels read the prepared union while others write their outputs
                f"{name}-out-over-prepared-union",
                _sparse(
                    fn,
                    prepared_union=lambda x: _prepared({**x, "buf": _with_buf(x)}),
                    out=lambda x: _with_buf(x).view(3, 2, 32),
                    **({"group_size": 1} if name == "sparse_mla_grouped_prefill" else {}),
                ),
                Raises(ValueError, r"^out shares memory with prepared_union\.union"),
            )
        )
    fn = dict(SPARSE_ENTRIES)["sparse_mla_decode"]
    rows.append(
        Row(  # the split partials written over the queries
            "sparse_mla_decode-workspace-over-q",
            _sparse(fn, workspace=lambda x: x["q"].view(-1)),
            Raises(ValueError, r"^workspace shares memory with q"),
        )
    )
    fn = dict(SPARSE_ENTRIES)["sparse_mla_grouped_prefill"]
    lens = torch.zeros(3, dtype=_I32)
    rows += [
        Row(  # the union build writes over the rows it reads
            "sparse_mla_grouped_prefill-union-over-rows",
            _sparse(fn, union=lambda x: (x["rows"], lens.clone())),
            Raises(ValueError, r"^union\[0\] shares memory with rows"),
        ),
        Row(  # built before the attention reads q
            "sparse_mla_grouped_prefill-union-over-q",
            _sparse(fn, union=lambda x: (_over(x["q"], _I32, (3, 4)), lens.clone())),
            Raises(ValueError, r"^union\[0\] shares memory with q"),
        ),
        Row(
            "sparse_mla_grouped_prefill-union-lens-over-topk-length",
            _sparse(
                fn,
                topk_length=lambda x: _with_buf(x).view(_I32)[:3].fill_(4),
                union=lambda x: (torch.zeros(3, 4, dtype=_I32), _with_buf(x).view(_I32)[:3]),
            ),
            Raises(ValueError, r"^union\[1\] shares memory with topk_length"),
        ),
        Row(  # the attention writes out while other programs still read the union
            "sparse_mla_grouped_prefill-union-overlaps-out",
            _sparse(
                fn,
                out=lambda x: _with_buf(x).view(3, 2, 32),
                union=lambda x: (_over(_with_buf(x), _I32, (3, 4)), lens.clone()),
            ),
            Raises(ValueError, r"^out and union\[0\] share memory"),
        ),
    ]
    return rows


def _union_call(**over: Callable[[torch.Tensor], Any]) -> Callable[[Any], Call]:
    """``build_union`` of :func:`mla`'s rows at ``G = 1``, each of ``over`` made from the rows."""

    def build(_group: Any) -> Call:
        rows = mla()["rows"]
        kw = {"group_size": 1, "num_kv_rows": 10, **{k: v(rows) for k, v in over.items()}}
        return Call(union_mod.build_union, (rows,), kw)

    return build


def _prepare_over_rows(_group: Any) -> Call:
    """``prepare_union`` building into a workspace whose union bytes are the rows' own."""
    rows = mla()["rows"]
    workspace = (rows.view(torch.uint8).view(-1), torch.zeros(12, dtype=torch.uint8))
    return Call(prepared_mod.prepare_union, (rows,), {"group_size": 1, "num_kv_rows": 10, "workspace": workspace})


def _kv_rows(n: int = 2) -> torch.Tensor:
    """``n`` KV rows of the ``fp8_ds_mla`` width (576 dims)."""
    return torch.randn(n, 576, generator=torch.Generator().manual_seed(7))


def _write_status_over_slots(_group: Any) -> Call:
    slots = torch.tensor([2, 0], dtype=_I32)
    return Call(fp8_mod.write_kv, (torch.zeros(4, 656, dtype=torch.uint8), slots, _kv_rows()), {"status": slots})


def _write_cache_over_rows(_group: Any) -> Call:
    rows = _kv_rows()
    return Call(fp8_mod.write_kv, (_over(rows, torch.uint8, (4, 656)), torch.tensor([2, 0], dtype=_I32), rows))


def _quantize_status_over_rows(_group: Any) -> Call:
    rows = _kv_rows()
    return Call(fp8_mod.quantize_kv, (rows,), {"status": _over(rows, _I32, (2,))})


def _other_rows() -> list[Row]:
    return [
        Row(
            "lse_merge-out-over-outs",
            _merge(out=lambda o, lse: o[0]),
            Raises(ValueError, r"^out shares memory with outs"),
        ),
        Row(
            "lse_merge-lse-out-over-lses",
            _merge(lse_out=lambda o, lse: lse[1]),
            Raises(ValueError, r"^lse_out shares memory with lses"),
        ),
        Row(
            "lse_merge-lse-out-over-outs",
            _merge(lse_out=lambda o, lse: _over(o[1], torch.float32, (3, 4))),
            Raises(ValueError, r"^lse_out shares memory with outs"),
        ),
        Row(  # one program's rows written over the positions the next reads
            "convert_topk-out-over-topk-pos",
            _topk(out=lambda x: x["pos"]),
            Raises(ValueError, r"^out shares memory with topk_pos"),
        ),
        Row(
            "convert_topk-out-over-block-table",
            _topk(
                block_table=lambda x: x.setdefault("buf", torch.zeros(8, dtype=_I32))[:6].view(2, 3).copy_(x["table"]),
                out=lambda x: x["buf"].view(2, 4),
            ),
            Raises(ValueError, r"^out shares memory with block_table"),
        ),
        Row(
            "convert_topk-out-over-req-ids",
            _topk(
                req_ids=lambda x: x.setdefault("buf", torch.zeros(8, dtype=_I32))[:2].copy_(x["req"]),
                out=lambda x: x["buf"].view(2, 4),
            ),
            Raises(ValueError, r"^out shares memory with req_ids"),
        ),
        Row(
            "build_union-out-over-rows",
            _union_call(out=lambda r: (r, torch.zeros(3, dtype=_I32))),
            Raises(ValueError, r"^out\[0\] shares memory with rows"),
        ),
        Row(
            "build_union-lens-over-rows",
            _union_call(out=lambda r: (torch.zeros(3, 4, dtype=_I32), r[0, :3])),
            Raises(ValueError, r"^out\[1\] shares memory with rows"),
        ),
        Row(
            "build_union-block-marks-over-rows",
            _union_call(block_marks=lambda r: r[0, :1]),
            Raises(ValueError, r"^block_marks shares memory with rows"),
        ),
        Row(
            "prepare_union-workspace-over-rows",
            _prepare_over_rows,
            Raises(ValueError, r"^workspace\[0\] shares memory with rows"),
        ),
        Row(
            "write_kv-status-over-slots",
            _write_status_over_slots,
            Raises(ValueError, r"^status shares memory with slots"),
        ),
        Row(
            "write_kv-cache-over-rows",
            _write_cache_over_rows,
            Raises(ValueError, r"^cache shares memory with rows"),
        ),
        Row(
            "quantize_kv-status-over-rows",
            _quantize_status_over_rows,
            Raises(ValueError, r"^status shares memory with rows"),
        ),
    ]


def _self_overlap_rows() -> list[Row]:
    """A destination whose own elements share memory (an expanded view): a kernel's programs write
    one element over another with no error (on the CPU torch's copy raised an error naming none)."""

    def expanded(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Callable[..., torch.Tensor]:
        return lambda *_: torch.zeros(1, *shape[1:], dtype=dtype).expand(shape)

    rows: list[Row] = []
    for name, fn in SPARSE_ENTRIES:
        rows += [
            Row(
                f"{name}-out-self-overlapping",
                _sparse(fn, out=expanded((3, 2, 32))),
                Raises(ValueError, r"^out has elements that may share memory"),
            ),
            Row(
                f"{name}-lse-out-self-overlapping",
                _sparse(fn, lse_out=expanded((3, 2))),
                Raises(ValueError, r"^lse_out has elements that may share memory"),
            ),
        ]
    rows += [
        Row(
            "gqa_paged_decode-out-self-overlapping",
            _gqa(out=expanded((2, 4, 16))),
            Raises(ValueError, r"^out has elements that may share memory"),
        ),
        Row(
            "gqa_paged_decode-lse-out-self-overlapping",
            _gqa(lse_out=expanded((2, 4))),
            Raises(ValueError, r"^lse_out has elements that may share memory"),
        ),
        Row(
            "lse_merge-out-self-overlapping",
            _merge(out=expanded((3, 4, 8))),
            Raises(ValueError, r"^out has elements that may share memory"),
        ),
        Row(
            "lse_merge-lse-out-self-overlapping",
            _merge(lse_out=expanded((3, 4))),
            Raises(ValueError, r"^lse_out has elements that may share memory"),
        ),
        Row(
            "convert_topk-out-self-overlapping",
            _topk(out=expanded((2, 4), _I32)),
            Raises(ValueError, r"^out has elements that may share memory"),
        ),
    ]
    return rows


def alias_rows() -> list[Row]:
    """Every destination-over-input row, and the destinations over themselves."""
    return [*_sparse_alias_rows(), *_other_rows(), *_self_overlap_rows()]
