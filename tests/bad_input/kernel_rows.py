"""Rows of the bad-input table for the kernel entry points (tests/test_bad_input.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardattn.kernels.triton import lse_merge as triton_merge
from shardattn.ops import gqa_decode as gqa_mod
from shardattn.ops import lse_merge as merge_mod
from shardattn.ops import prepared_union as prepared_mod
from shardattn.ops import sparse_mla as mla_mod
from shardattn.ops import sparse_mla_decode as decode_mod
from shardattn.ops import sparse_mla_grouped as grouped_mod
from shardattn.ops import topk as topk_mod
from shardattn.ops import union as union_mod
from tests.bad_input.table import (
    INF,
    META,
    NAN,
    Call,
    Gives,
    Raises,
    Row,
    _gen,
    _merge_inputs,
    _merge_without_inf,
    _noncontig,
    all_empty,
    gqa,
    mla,
    override,
    same_as,
    topk_inputs,
)

#: One fp32 buffer that rows carve overlapping destinations from.
_SHARED = torch.zeros(1024)


def _sparse(fn: Callable[..., Any], **over: Any) -> Callable[[Any], Call]:
    """A sparse-MLA kernel call on :func:`mla` inputs with some arguments replaced."""

    def build(_group: Any) -> Call:
        x = mla()
        kw: dict[str, Any] = {"scale": 0.125, "v_dim": 32}
        args = {"q": x["q"], "kv": x["kv"], "rows": x["rows"]}
        override(args, kw, over, x)
        return Call(fn, tuple(args.values()), kw)

    return build


def _dsa_q(_x: Any) -> torch.Tensor:
    """DSA-width queries for the ``fp8_ds_mla`` rows (3 tokens, 2 heads, 576 dims)."""
    return torch.randn(3, 2, 576, generator=torch.Generator().manual_seed(5))


def _fp8_cache(n: int) -> torch.Tensor:
    """``n`` ``fp8_ds_mla`` rows."""
    from shardattn.ops.kv_fp8 import quantize_kv

    return quantize_kv(torch.randn(n, 576, generator=torch.Generator().manual_seed(6)))


SPARSE_ENTRIES = [
    ("sparse_mla_attention", mla_mod.sparse_mla_attention),
    ("sparse_mla_grouped_prefill", grouped_mod.sparse_mla_grouped_prefill),
    ("sparse_mla_decode", decode_mod.sparse_mla_decode),
]


def _sparse_rows() -> list[Row]:
    rows: list[Row] = []
    for name, fn in SPARSE_ENTRIES:
        rows += [
            Row(f"{name}-q-int", _sparse(fn, q=lambda x: x["q"].int()), Raises(TypeError, r"^q must have dtype")),
            Row(f"{name}-q-2d", _sparse(fn, q=lambda x: x["q"][0]), Raises(ValueError, r"^q must have 3 dim")),
            Row(f"{name}-q-none", _sparse(fn, q=lambda x: None), Raises(TypeError, r"^q must be a torch.Tensor")),
            Row(  # an array is not read as queries: it has no strides the kernels could take
                f"{name}-q-numpy",
                _sparse(fn, q=lambda x: x["q"].numpy()),
                Raises(TypeError, r"^q must be a torch.Tensor, got ndarray"),
            ),
            Row(
                f"{name}-q-wrong-width",
                _sparse(fn, q=lambda x: torch.randn(3, 2, 40)),
                Raises(ValueError, r"^q must have last dim 48 \(kv's row width\), got 40"),
            ),
            Row(
                f"{name}-kv-dtype", _sparse(fn, kv=lambda x: x["kv"].half()), Raises(TypeError, r"^kv must have dtype")
            ),
            Row(  # a paged cache: its rows, p * page + i
                f"{name}-kv-paged",
                _sparse(fn, kv=lambda x: x["kv"].view(2, 5, 48)),
                Gives(same_as(lambda fn=fn: _call(_sparse(fn)(None)))),
            ),
            Row(
                f"{name}-kv-padded-pages",
                _sparse(fn, kv=lambda x: torch.zeros(2, 6, 48)[:, :5]),
                Raises(ValueError, r"^kv's pages must follow one another"),
            ),
            Row(
                f"{name}-kv-4d",
                _sparse(fn, kv=lambda x: x["kv"][None, None]),
                Raises(ValueError, r"^kv must have 2 dim"),
            ),
            Row(f"{name}-rows-int64", _sparse(fn, rows=lambda x: x["rows"].long()), Raises(TypeError, r"^rows must")),
            Row(
                f"{name}-rows-count",
                _sparse(fn, rows=lambda x: x["rows"][:2]),
                Raises(ValueError, r"^rows must have one row per query token"),
            ),
            Row(f"{name}-kv-on-meta", _sparse(fn, kv=lambda x: x["kv"].to(META)), Raises(ValueError, r"kv differs")),
            Row(f"{name}-scale-nan", _sparse(fn, scale=NAN), Raises(ValueError, r"^scale must be a finite number > 0")),
            Row(f"{name}-scale-inf", _sparse(fn, scale=INF), Raises(ValueError, r"^scale must be a finite")),
            Row(f"{name}-scale-zero", _sparse(fn, scale=0.0), Raises(ValueError, r"^scale must be a finite")),
            Row(f"{name}-scale-negative", _sparse(fn, scale=-0.1), Raises(ValueError, r"^scale must be a finite")),
            Row(f"{name}-scale-str", _sparse(fn, scale="0.1"), Raises(TypeError, r"^scale must be a float")),
            Row(  # regression: None reached the reference, whose product raised a raw TypeError
                f"{name}-scale-none",
                _sparse(fn, scale=None),
                Raises(TypeError, r"^scale must be a float, got NoneType"),
            ),
            Row(f"{name}-v-dim-too-big", _sparse(fn, v_dim=49), Raises(ValueError, r"^v_dim must be in \(0, 48\]")),
            Row(f"{name}-v-dim-float", _sparse(fn, v_dim=32.0), Raises(TypeError, r"^v_dim must be an int")),
            Row(
                f"{name}-out-shape",
                _sparse(fn, out=torch.empty(3, 2, 48)),
                Raises(ValueError, r"^out must have shape \[3, 2, 32\]"),
            ),
            Row(
                f"{name}-lse-out-dtype",
                _sparse(fn, lse_out=torch.empty(3, 2, dtype=torch.float64)),
                Raises(TypeError, r"^lse_out must have dtype"),
            ),
            Row(  # one fp32 buffer carved twice: the LSEs would land on the outputs
                f"{name}-out-overlaps-lse-out",
                _sparse(fn, out=_SHARED[:192].view(3, 2, 32), lse_out=_SHARED[186:192].view(3, 2)),
                Raises(ValueError, r"^out and lse_out share memory"),
            ),
            Row(
                f"{name}-topk-length-shape",
                _sparse(fn, topk_length=torch.ones(2, dtype=torch.int32)),
                Raises(ValueError, r"^topk_length must have shape \[3\]"),
            ),
            Row(
                f"{name}-sinks-nan",
                _sparse(fn, sinks=torch.tensor([0.5, float("nan")])),
                Raises(ValueError, r"^sinks must be finite, got sinks\[1\]=nan"),
            ),
            Row(
                f"{name}-sinks-dtype",
                _sparse(fn, sinks=torch.zeros(2, dtype=torch.float16)),
                Raises(TypeError, r"^sinks must have dtype"),
            ),
            # defined results
            Row(
                f"{name}-kv-without-rows",
                _sparse(fn, kv=lambda x: torch.randn(0, 48)),
                Gives(all_empty(32)),
            ),
            Row(
                f"{name}-rows-without-entries",
                _sparse(fn, rows=lambda x: torch.zeros(3, 0, dtype=torch.int32)),
                Gives(all_empty(32)),
            ),
            Row(
                f"{name}-rows-out-of-range",
                _sparse(fn, rows=lambda x: torch.tensor([[10, 11, -1, 2**31 - 1]] * 3, dtype=torch.int32)),
                Gives(all_empty(32)),
            ),
            Row(
                f"{name}-topk-length-past-topk",
                _sparse(fn, topk_length=torch.full((3,), 99, dtype=torch.int32)),
                Gives(same_as(lambda fn=fn: fn(*(mla()[k] for k in ("q", "kv", "rows")), scale=0.125, v_dim=32))),
            ),
            Row(
                f"{name}-q-non-contiguous",
                _sparse(fn, q=lambda x: _noncontig(x["q"])),
                Gives(same_as(lambda fn=fn: fn(*(mla()[k] for k in ("q", "kv", "rows")), scale=0.125, v_dim=32))),
            ),
            Row(
                f"{name}-no-tokens",
                _sparse(fn, q=lambda x: x["q"][:0], rows=lambda x: x["rows"][:0]),
                Gives(lambda res: None if res[0].shape == (0, 2, 32) and res[1].shape == (0, 2) else "shape"),
            ),
            # fp8_ds_mla KV rows: the format's width, dtype, dims and page layout, named with the format
            Row(
                f"{name}-fp8-kv-width",
                _sparse(fn, q=_dsa_q, v_dim=512, kv=lambda x: torch.zeros(8, 650, dtype=torch.uint8)),
                Raises(ValueError, r"^kv must be uint8 \[rows, 656\] .*\(fp8_ds_mla rows\), got uint8 \[8, 650\]"),
            ),
            Row(
                f"{name}-fp8-declared-bf16-given",
                _sparse(fn, q=_dsa_q, v_dim=512, kv=lambda x: torch.zeros(8, 576), kv_format="fp8_ds_mla"),
                Raises(ValueError, r"^kv must be uint8 \[rows, 656\].*\(fp8_ds_mla rows\), got float32 \[8, 576\]"),
            ),
            Row(
                f"{name}-fp8-given-bf16-declared",
                _sparse(fn, q=_dsa_q, v_dim=512, kv=lambda x: _fp8_cache(8), kv_format="bf16"),
                Raises(ValueError, r"^kv must be bfloat16 \[rows, 576\] \(bfloat16 KV rows\), got uint8"),
            ),
            Row(
                f"{name}-fp8-kv-format-unknown",
                _sparse(fn, q=_dsa_q, v_dim=512, kv=lambda x: _fp8_cache(8), kv_format="int4"),
                Raises(ValueError, r"^kv_format must be one of bfloat16, float16, float32, fp8_ds_mla"),
            ),
            Row(
                f"{name}-fp8-not-dsa-dims",
                _sparse(fn, kv=lambda x: _fp8_cache(8)),
                Raises(ValueError, r"^kv holds fp8_ds_mla rows .*the query must have 576 dims and v_dim 512, got 48"),
            ),
            Row(
                f"{name}-fp8-typed-view",
                _sparse(fn, q=_dsa_q, v_dim=512, kv=lambda x: _fp8_cache(8).view(torch.float8_e4m3fn)),
                Raises(ValueError, r"^kv must be uint8 .*an fp8-typed view: pass \.view\(torch\.uint8\)"),
            ),
            Row(
                f"{name}-fp8-padded-pages",
                _sparse(fn, q=_dsa_q, v_dim=512, kv=lambda x: _fp8_cache(12).view(3, 4, 656)[:, :2]),
                Raises(ValueError, r"^kv's pages must follow one another"),
            ),
            Row(
                f"{name}-fp8-paged-equals-flat",
                _sparse(fn, q=_dsa_q, v_dim=512, kv=lambda x: _fp8_cache(12).view(3, 4, 656)),
                Gives(same_as(lambda fn=fn: fn(_dsa_q(None), _fp8_cache(12), mla()["rows"], scale=0.125, v_dim=512))),
            ),
        ]
    rows += [
        Row(
            "sparse_mla_attention-dsa-q-500",  # regression: the message once blamed kv
            lambda _g: Call(
                mla_mod.sparse_mla_attention,
                (torch.randn(1, 1, 500), torch.randn(4, 576), torch.zeros(1, 1, dtype=torch.int32)),
                {"scale": 576**-0.5},
            ),
            Raises(ValueError, r"^q must have last dim 576"),
        ),
        Row(
            "sparse_mla_attention-q-tuple-of-3",
            _sparse(mla_mod.sparse_mla_attention, q=lambda x: (x["q"], x["q"], x["q"])),
            Raises(ValueError, r"^q as a tuple must be \(q_latent, q_rope\)"),
        ),
        Row(
            "sparse_mla_attention-q-rope-dtype",
            _sparse(mla_mod.sparse_mla_attention, q=lambda x: (x["q"][..., :32], x["q"][..., 32:].double())),
            Raises(TypeError, r"^q_rope must have dtype"),
        ),
        Row(
            "sparse_mla_grouped_prefill-group-size-3",
            _sparse(grouped_mod.sparse_mla_grouped_prefill, group_size=3),
            Raises(ValueError, r"^group_size must be one of"),
        ),
        Row(  # True == 1 and 2.0 == 2: membership in the sizes alone let them through
            "sparse_mla_grouped_prefill-group-size-bool",
            _sparse(grouped_mod.sparse_mla_grouped_prefill, group_size=True),
            Raises(TypeError, r"^group_size must be an int, got bool"),
        ),
        Row(
            "sparse_mla_grouped_prefill-group-size-float",
            _sparse(grouped_mod.sparse_mla_grouped_prefill, group_size=2.0),
            Raises(TypeError, r"^group_size must be an int, got float"),
        ),
        Row(
            "sparse_mla_grouped_prefill-rows-sorted-int",
            _sparse(grouped_mod.sparse_mla_grouped_prefill, rows_sorted=1),
            Raises(TypeError, r"^rows_sorted must be a bool"),
        ),
        Row(
            "sparse_mla_attention-return-lse-str",
            _sparse(mla_mod.sparse_mla_attention, return_lse="no"),
            Raises(TypeError, r"^return_lse must be a bool, got str \('no'\)"),
        ),
        Row(
            "sparse_mla_grouped_prefill-return-lse-int",
            _sparse(grouped_mod.sparse_mla_grouped_prefill, return_lse=0),
            Raises(TypeError, r"^return_lse must be a bool"),
        ),
        Row(
            "sparse_mla_decode-rows-unique-int",
            _sparse(decode_mod.sparse_mla_decode, rows_unique=1),
            Raises(TypeError, r"^rows_unique must be a bool"),
        ),
        Row(
            "sparse_mla_decode-out-dtype",
            _sparse(decode_mod.sparse_mla_decode, out=torch.zeros(3, 2, 32, dtype=torch.float16)),
            Raises(TypeError, r"^out must have dtype"),
        ),
        Row(
            "sparse_mla_decode-lse-out-shape",
            _sparse(decode_mod.sparse_mla_decode, lse_out=torch.zeros(3, 3)),
            Raises(ValueError, r"^lse_out must have shape \[3, 2\]"),
        ),
        Row(
            "sparse_mla_decode-backend-unknown",
            _sparse(decode_mod.sparse_mla_decode, backend="flashmla"),
            Raises(ValueError, r"^backend must be None, 'triton', 'gluon', 'gluon_small' or 'gluon_stream'"),
        ),
        # the split partials' workspace: a flat contiguous fp32 buffer on q's device (split_partials')
        Row(
            "sparse_mla_decode-workspace-list",
            _sparse(decode_mod.sparse_mla_decode, workspace=[0.0] * 400),
            Raises(TypeError, r"^workspace must be a torch.Tensor, got list"),
        ),
        Row(
            "sparse_mla_decode-workspace-int8",
            _sparse(decode_mod.sparse_mla_decode, workspace=torch.zeros(400, dtype=torch.int8)),
            Raises(TypeError, r"^workspace must have dtype in \(float32\), got int8"),
        ),
        Row(
            "sparse_mla_decode-workspace-on-meta",
            _sparse(decode_mod.sparse_mla_decode, workspace=torch.zeros(400, device=META)),
            Raises(ValueError, r"^workspace must be on cpu, got meta"),
        ),
        Row(
            "sparse_mla_decode-workspace-2d",
            _sparse(decode_mod.sparse_mla_decode, workspace=torch.zeros(4, 100)),
            Raises(ValueError, r"^workspace must have 1 dimensions"),
        ),
        Row(
            "sparse_mla_decode-workspace-strided",
            _sparse(decode_mod.sparse_mla_decode, workspace=torch.zeros(800)[::2]),
            Raises(ValueError, r"^workspace must be a contiguous \(flat\) float32 buffer"),
        ),
        Row(  # the split partials would be written over the LSEs
            "sparse_mla_decode-workspace-overlaps-lse-out",
            _sparse(decode_mod.sparse_mla_decode, lse_out=_SHARED[:6].view(3, 2), workspace=_SHARED),
            Raises(ValueError, r"^lse_out and workspace share memory"),
        ),
        Row(  # the reference path allocates nothing, but a valid workspace is accepted
            "sparse_mla_decode-workspace-on-cpu-path",
            _sparse(decode_mod.sparse_mla_decode, workspace=torch.zeros(400)),
            Gives(same_as(lambda: _call(_sparse(decode_mod.sparse_mla_decode)(None)))),
        ),
        # the union workspace: (union [groups, G*K], lens [groups]) int32 on rows' device (build_union's out)
        Row(
            "sparse_mla_grouped_prefill-union-tensor",
            _sparse(grouped_mod.sparse_mla_grouped_prefill, union=torch.zeros(3, 4, dtype=torch.int32)),
            Raises(TypeError, r"^union must be a \(union, lens\) pair of tensors, got Tensor"),
        ),
        Row(
            "sparse_mla_grouped_prefill-union-of-3",
            _sparse(grouped_mod.sparse_mla_grouped_prefill, union=(_union_ws(), _union_ws(), _union_ws())),
            Raises(TypeError, r"^union must be a \(union, lens\) pair of tensors, got 3 items"),
        ),
        Row(
            "sparse_mla_grouped_prefill-union-not-tensors",
            _sparse(grouped_mod.sparse_mla_grouped_prefill, union=([0] * 12, [0] * 3)),
            Raises(TypeError, r"^union\[0\] must be a torch.Tensor, got list"),
        ),
        Row(
            "sparse_mla_grouped_prefill-union-int64",
            _sparse(grouped_mod.sparse_mla_grouped_prefill, union=(_union_ws().long(), _union_ws()[:, 0])),
            Raises(TypeError, r"^union\[0\] must have dtype in \(int32\), got int64"),
        ),
        Row(
            "sparse_mla_grouped_prefill-union-lens-float",
            _sparse(grouped_mod.sparse_mla_grouped_prefill, union=(_union_ws(), torch.zeros(3))),
            Raises(TypeError, r"^union\[1\] must have dtype in \(int32\), got float32"),
        ),
        Row(
            "sparse_mla_grouped_prefill-union-on-meta",
            _sparse(grouped_mod.sparse_mla_grouped_prefill, union=(_union_ws(META), _union_ws(META)[:, 0])),
            Raises(ValueError, r"^union\[0\] must be on cpu, got meta"),
        ),
        Row(
            "sparse_mla_grouped_prefill-union-1d",
            _sparse(grouped_mod.sparse_mla_grouped_prefill, union=(_union_ws().view(-1), _union_ws()[:, 0])),
            Raises(ValueError, r"^union\[0\] must have 2 dimensions"),
        ),
        Row(
            "sparse_mla_grouped_prefill-union-lens-count",
            _sparse(grouped_mod.sparse_mla_grouped_prefill, union=(_union_ws(), _union_ws()[:2, 0])),
            Raises(ValueError, r"^union\[1\] must have shape \[3\]"),
        ),
        Row(
            "sparse_mla_grouped_prefill-union-lens-strided",
            _sparse(grouped_mod.sparse_mla_grouped_prefill, union=(_union_ws(), _union_ws()[:, 0])),
            Raises(ValueError, r"^union\[1\] must be contiguous"),
        ),
        Row(
            "sparse_mla_grouped_prefill-union-shares-bytes",
            _sparse(grouped_mod.sparse_mla_grouped_prefill, union=lambda x: _overlapping_union()),
            Raises(ValueError, r"^union\[0\] and union\[1\] share memory"),
        ),
        Row(  # the reference path builds no union, but a valid workspace is accepted
            "sparse_mla_grouped_prefill-union-on-cpu-path",
            _sparse(grouped_mod.sparse_mla_grouped_prefill, union=(_union_ws(), _union_ws()[:, 0].clone())),
            Gives(same_as(lambda: _call(_sparse(grouped_mod.sparse_mla_grouped_prefill)(None)))),
        ),
    ]
    return rows


def _union_ws(device: torch.device | str = "cpu") -> torch.Tensor:
    """A union buffer for :func:`mla`'s rows at ``G = 1``: ``[3, 4]`` int32."""
    return torch.zeros(3, 4, dtype=torch.int32, device=device)


def _overlapping_union() -> tuple[torch.Tensor, torch.Tensor]:
    """``(union [3, 4], lens [3])`` int32 views of one buffer whose last entry of ``union`` is ``lens[0]``."""
    buf = torch.zeros(14, dtype=torch.int32)
    return buf[:12].view(3, 4), buf[11:14]


def _call(call: Call) -> Any:
    return call.fn(*call.args, **call.kwargs)


def _gqa(**over: Any) -> Callable[[Any], Call]:
    def build(_group: Any) -> Call:
        x = gqa()
        names = ("q", "k_cache", "v_cache", "block_table", "seq_lens")
        args = dict(zip(names, (x["q"], x["k"], x["v"], x["table"], x["lens"])))
        kw: dict[str, Any] = {"return_lse": True}
        override(args, kw, over, x)
        return Call(gqa_mod.gqa_paged_decode, tuple(args.values()), kw)

    return build


def _gqa_rows() -> list[Row]:
    n = "gqa_paged_decode"
    return [
        Row(
            f"{n}-q-bf16-cache-fp32",
            _gqa(q=lambda x: x["q"].bfloat16()),
            Raises(TypeError, r"^k_cache must have dtype"),
        ),
        Row(f"{n}-q-wrong-width", _gqa(q=lambda x: x["q"][..., :8]), Raises(ValueError, r"^q must have last dim 16")),
        Row(f"{n}-heads-not-multiple", _gqa(q=lambda x: x["q"][:, :3]), Raises(ValueError, r"q heads \(3\) must be")),
        Row(  # regression: 0 query heads passed (0 is a multiple of any head count), the Triton path divided by 0
            f"{n}-no-query-heads",
            _gqa(q=lambda x: x["q"][:, :0]),
            Raises(ValueError, r"^q must hold at least one head of head_dim >= 1, got shape \[2, 0, 16\]"),
        ),
        Row(  # regression: head_dim 0 raised ZeroDivisionError from the default scale
            f"{n}-head-dim-0",
            _gqa(q=lambda x: x["q"][..., :0], k_cache=lambda x: x["k"][..., :0], v_cache=lambda x: x["v"][..., :0]),
            Raises(ValueError, r"^q must hold at least one head of head_dim >= 1, got shape \[2, 4, 0\]"),
        ),
        Row(f"{n}-v-cache-shape", _gqa(v_cache=lambda x: x["v"][:5]), Raises(ValueError, r"^v_cache must have shape")),
        Row(f"{n}-table-int64", _gqa(block_table=lambda x: x["table"].long()), Raises(TypeError, r"^block_table must")),
        Row(
            f"{n}-seq-lens-negative",
            _gqa(seq_lens=torch.tensor([-1, 5], dtype=torch.int32)),
            Raises(ValueError, r"^seq_lens must be >= 0"),
        ),
        Row(
            f"{n}-seq-lens-past-table",
            _gqa(seq_lens=torch.tensor([13, 5], dtype=torch.int32)),
            Raises(ValueError, r"^seq_lens must be <= max_pages"),
        ),
        Row(
            f"{n}-page-out-of-range",
            _gqa(block_table=torch.tensor([[0, 1, 6], [3, 4, 5]], dtype=torch.int32)),
            Raises(ValueError, r"^block_table holds pages outside \[0, 6\) for requests \[0\]"),
        ),
        Row(f"{n}-scale-nan", _gqa(scale=NAN), Raises(ValueError, r"^scale must be a finite number > 0")),
        Row(f"{n}-scale-negative", _gqa(scale=-1.0), Raises(ValueError, r"^scale must be a finite")),
        Row(f"{n}-window-left--2", _gqa(window_left=-2), Raises(ValueError, r"^window_left must be >= -1")),
        Row(
            f"{n}-workspace-overlaps-out",
            _gqa(out=_SHARED[:128].view(2, 4, 16), workspace=_SHARED[64:]),
            Raises(ValueError, r"^out and workspace share memory"),
        ),
        # a destination over an input: the Triton kernel zeroes out before reading q (ragged drafts),
        # and its programs read pages other programs' outputs were written over
        Row(f"{n}-out-is-q", _gqa(out=lambda x: x["q"]), Raises(ValueError, r"^out shares memory with q")),
        Row(
            f"{n}-out-over-k-cache",
            _gqa(out=lambda x: x["k"].view(-1)[: 2 * 4 * 16].view(2, 4, 16)),
            Raises(ValueError, r"^out shares memory with k_cache"),
        ),
        Row(
            f"{n}-lse-out-over-v-cache",
            _gqa(lse_out=lambda x: x["v"].view(-1)[:8].view(2, 4)),
            Raises(ValueError, r"^lse_out shares memory with v_cache"),
        ),
        Row(f"{n}-q-len-0", _gqa(q_len_per_req=0), Raises(ValueError, r"^q_len_per_req must be >= 1")),
        Row(f"{n}-q-rows-vs-batch", _gqa(q_len_per_req=2), Raises(ValueError, r"^q must have batch \* q_len_per_req")),
        Row(f"{n}-backend", _gqa(backend="cuda"), Raises(ValueError, r"^backend must be one of")),
        Row(f"{n}-causal-int", _gqa(causal=0), Raises(TypeError, r"^causal must be a bool")),
        Row(f"{n}-sinks-inf", _gqa(sinks=torch.full((4,), INF)), Raises(ValueError, r"^sinks must be finite")),
        Row(f"{n}-return-lse-str", _gqa(return_lse="yes"), Raises(TypeError, r"^return_lse must be a bool")),
        Row(
            f"{n}-cu-q-lens-decreasing",
            _gqa(cu_q_lens=torch.tensor([0, 2, 1], dtype=torch.int32)),
            Raises(ValueError, r"^cu_q_lens must start at 0, not decrease"),
        ),
        Row(f"{n}-workspace-int8", _gqa(workspace=torch.zeros(64, dtype=torch.int8)), Raises(TypeError, r"^workspace")),
        Row(f"{n}-workspace-on-meta", _gqa(workspace=torch.zeros(64, device=META)), Raises(ValueError, r"^workspace")),
        Row(
            f"{n}-workspace-strided",
            _gqa(workspace=torch.zeros(128)[::2]),
            Raises(ValueError, r"^workspace must be a contiguous \(flat\) float32 buffer"),
        ),
        Row(  # regression: the Triton kernel left the queries past max_q_len at (0, -inf)
            f"{n}-max-q-len-below-longest-draft",
            _gqa(cu_q_lens=torch.tensor([0, 2, 2], dtype=torch.int32), max_q_len=1),
            Raises(ValueError, r"^max_q_len must be >= 2 \(the most queries of a request in cu_q_lens\), got 1"),
        ),
        Row(  # regression: without cu_q_lens, max_q_len went unchecked (any value, any type)
            f"{n}-max-q-len-negative-uniform",
            _gqa(max_q_len=-3),
            Raises(ValueError, r"^max_q_len must be >= 0, got -3"),
        ),
        Row(f"{n}-max-q-len-str-uniform", _gqa(max_q_len="2"), Raises(TypeError, r"^max_q_len must be an int")),
        Row(
            f"{n}-max-q-len-above-longest-draft",
            _gqa(cu_q_lens=torch.tensor([0, 2, 2], dtype=torch.int32), max_q_len=5),
            Gives(same_as(lambda: _call(_gqa(cu_q_lens=torch.tensor([0, 2, 2], dtype=torch.int32))(None)))),
        ),
        Row(
            f"{n}-more-queries-than-keys-ragged",
            _gqa(cu_q_lens=torch.tensor([0, 2, 2], dtype=torch.int32), seq_lens=torch.tensor([1, 5]).int()),
            Raises(ValueError, r"^requests \[0\] have more queries than keys \(seq_lens counts the drafts\)"),
        ),
        Row(  # regression: uniform drafts put the query past the keys at position -1, (0, -inf)
            f"{n}-more-queries-than-keys-uniform",
            _gqa(q=torch.randn(4, 4, 16), q_len_per_req=2, seq_lens=torch.tensor([1, 5]).int()),
            Raises(ValueError, r"^requests \[0\] have more queries than keys \(seq_lens counts the drafts\)"),
        ),
        Row(
            f"{n}-padded-request-with-drafts",
            _gqa(q=torch.randn(4, 4, 16), q_len_per_req=2, seq_lens=torch.tensor([0, 5]).int()),
            Gives(lambda res: None if bool(res[1][:2].isneginf().all()) else "request 0 is not (0, -inf)"),
        ),
        Row(
            f"{n}-both-q-lens",
            _gqa(q_len_per_req=1, cu_q_lens=torch.tensor([0, 1, 2], dtype=torch.int32)),
            Raises(ValueError, r"q_len_per_req .* or cu_q_lens .*, not both"),
        ),
        Row(f"{n}-sinks-shape", _gqa(sinks=torch.zeros(3)), Raises(ValueError, r"^sinks must have shape \[4\]")),
        Row(
            f"{n}-table-on-meta",
            _gqa(block_table=lambda x: x["table"].to(META)),
            Raises(ValueError, r"block_table differs"),
        ),
        Row(
            f"{n}-flashinfer-lse",
            _gqa(backend="flashinfer"),
            Raises(ValueError, r"backend='flashinfer' .* returns no LSE"),
        ),
        Row(
            f"{n}-padded-requests",
            _gqa(seq_lens=torch.zeros(2, dtype=torch.int32)),
            Gives(all_empty(16)),
        ),
        Row(
            f"{n}-cache-without-pages",
            _gqa(
                k_cache=lambda x: x["k"][:0],
                v_cache=lambda x: x["v"][:0],
                block_table=torch.zeros(2, 0, dtype=torch.int32),
                seq_lens=torch.zeros(2, dtype=torch.int32),
            ),
            Gives(all_empty(16)),
        ),
    ]


def _merge(**over: Any) -> Callable[[Any], Call]:
    def build(_group: Any) -> Call:
        g = _gen(2)
        outs, lses = torch.randn(2, 3, 4, 8, generator=g), torch.randn(2, 3, 4, generator=g)
        args = {"outs": outs, "lses": lses}
        kw: dict[str, Any] = {}
        override(args, kw, over, outs, lses)
        return Call(merge_mod.lse_merge, tuple(args.values()), kw)

    return build


def _merge_rows() -> list[Row]:
    n = "lse_merge"
    return [
        Row(f"{n}-outs-3d", _merge(outs=lambda o, lse: o[0]), Raises(ValueError, r"^outs must have 4 dim")),
        Row(f"{n}-outs-int", _merge(outs=lambda o, lse: o.int()), Raises(TypeError, r"^outs must have dtype")),
        Row(f"{n}-lses-fp16", _merge(lses=lambda o, lse: lse.half()), Raises(TypeError, r"^lses must have dtype")),
        Row(
            f"{n}-lses-shape",
            _merge(lses=lambda o, lse: lse[:, :2]),
            Raises(ValueError, r"^lses must have shape \[2, 3, 4\]"),
        ),
        Row(
            f"{n}-no-partial",
            _merge(outs=lambda o, lse: o[:0], lses=lambda o, lse: lse[:0]),
            Raises(ValueError, r"^outs must hold at least one"),
        ),
        Row(f"{n}-lses-on-meta", _merge(lses=lambda o, lse: lse.to(META)), Raises(ValueError, r"lses differs")),
        Row(
            f"{n}-out-shape", _merge(out=torch.zeros(3, 4, 9)), Raises(ValueError, r"^out must have shape \[3, 4, 8\]")
        ),
        Row(
            f"{n}-lse-out-dtype",
            _merge(lse_out=torch.zeros(3, 4, dtype=torch.float64)),
            Raises(TypeError, r"^lse_out must"),
        ),
        Row(
            f"{n}-pos-inf-is-empty",  # regression: +inf (FlashMLA's empty row) once gave NaN
            lambda _g: Call(merge_mod.lse_merge, _merge_inputs()),
            Gives(same_as(_merge_without_inf)),
        ),
        Row(
            f"{n}-all-empty",
            _merge(lses=lambda o, lse: torch.full_like(lse, -INF)),
            Gives(all_empty()),
        ),
    ]


def _topk(**over: Any) -> Callable[[Any], Call]:
    def build(_group: Any) -> Call:
        x = topk_inputs()
        args = {"topk_pos": x["pos"], "req_ids": x["req"], "block_table": x["table"]}
        kw: dict[str, Any] = {"block_size": 4}
        override(args, kw, over, x)
        return Call(topk_mod.convert_topk, tuple(args.values()), kw)

    return build


def _rows_all_invalid(res: Any) -> str | None:
    rows, counts = res
    return None if bool((rows == -1).all()) and bool((counts == 0).all()) else f"rows {rows.tolist()}"


def _topk_rows() -> list[Row]:
    n = "convert_topk"
    base = _topk()
    return [
        Row(
            f"{n}-pos-int64", _topk(topk_pos=lambda x: x["pos"].long()), Raises(TypeError, r"^topk_pos must have dtype")
        ),
        Row(f"{n}-pos-1d", _topk(topk_pos=lambda x: x["pos"][0]), Raises(ValueError, r"^topk_pos must have 2 dim")),
        Row(
            f"{n}-req-ids-shape",
            _topk(req_ids=lambda x: x["req"][:1]),
            Raises(ValueError, r"^req_ids must have shape \[2\]"),
        ),
        Row(f"{n}-block-size-0", _topk(block_size=0), Raises(ValueError, r"^block_size must be >= 1")),
        Row(f"{n}-block-size-float", _topk(block_size=4.0), Raises(TypeError, r"^block_size must be an int")),
        Row(f"{n}-block-stride-0", _topk(block_stride=0), Raises(ValueError, r"^block_stride must be >= 1")),
        Row(f"{n}-block-stride-huge", _topk(block_stride=2**64 - 1), Raises(ValueError, r"^block_stride must be <=")),
        Row(f"{n}-block-size-huge", _topk(block_size=2**63), Raises(ValueError, r"^block_size must be <=")),
        Row(  # regression: a stride below the block size made rows of consecutive blocks alias
            f"{n}-block-stride-below-block-size",
            _topk(block_stride=2),
            Raises(ValueError, r"^block_stride must be >= block_size \(4\)"),
        ),
        Row(
            f"{n}-block-stride-past-block-size",
            _topk(block_stride=10),
            Gives(lambda res: None if res[0].tolist() == [[20, 1, -1, 11], [13, 30, -1, 12]] else f"{res[0].tolist()}"),
        ),
        Row(
            f"{n}-dcp-world-huge", _topk(dcp=topk_mod.DcpShard(2**62, 2**62, 0)), Raises(ValueError, r"^dcp must have")
        ),
        Row(
            f"{n}-seq-lens-shape",
            _topk(seq_lens=torch.ones(3, dtype=torch.int32)),
            Raises(ValueError, r"^seq_lens must have shape \[2\]"),
        ),
        Row(
            f"{n}-seq-lens-negative",
            _topk(seq_lens=torch.tensor([5, -1], dtype=torch.int32)),
            Raises(ValueError, r"^seq_lens must be >= 0, got -1 \(request 1\)"),
        ),
        Row(f"{n}-dcp-rank-past-world", _topk(dcp=topk_mod.DcpShard(2, 1, 2)), Raises(ValueError, r"^dcp must have")),
        Row(f"{n}-dcp-not-a-shard", _topk(dcp=(2, 1)), Raises(TypeError, r"^dcp must be DcpShard")),
        Row(
            f"{n}-out-shape",
            _topk(out=lambda x: torch.empty(x["pos"].shape[0], x["pos"].shape[1] + 1, dtype=torch.int32)),
            Raises(ValueError, r"^out must have shape"),
        ),
        Row(
            f"{n}-out-int64",
            _topk(out=lambda x: torch.empty(x["pos"].shape, dtype=torch.int64)),
            Raises(TypeError, r"^out must have dtype"),
        ),
        Row(
            f"{n}-table-on-meta",
            _topk(block_table=lambda x: x["table"].to(META)),
            Raises(ValueError, r"block_table differs"),
        ),
        Row(
            f"{n}-req-ids-out-of-range",
            _topk(req_ids=torch.tensor([2, -1], dtype=torch.int32)),
            Gives(_rows_all_invalid),
        ),
        Row(
            f"{n}-table-without-blocks",
            _topk(block_table=torch.zeros(2, 0, dtype=torch.int32)),
            Gives(_rows_all_invalid),
        ),
        Row(f"{n}-no-requests", _topk(block_table=torch.zeros(0, 3, dtype=torch.int32)), Gives(_rows_all_invalid)),
        Row(
            f"{n}-topk-length-past-topk",
            _topk(topk_length=torch.full((2,), 50, dtype=torch.int32)),
            Gives(same_as(lambda: (lambda c: c.fn(*c.args, **c.kwargs))(base(None)))),
        ),
    ]


def _union(**over: Any) -> Callable[[Any], Call]:
    def build(_group: Any) -> Call:
        kw: dict[str, Any] = {"group_size": 2, "num_kv_rows": 10}
        rows = mla()["rows"]
        for name, value in over.items():
            if name == "rows":
                rows = value(rows)
            else:
                kw[name] = value
        return Call(union_mod.build_union, (rows,), kw)

    return build


def _prepared_small(**over: Any) -> Callable[[Any], Call]:
    """``prepare_union`` of :func:`mla`'s rows into a workspace too small for their union (it then
    returns ``None``, and the caller builds per call), with some arguments replaced."""

    def build(_group: Any) -> Call:
        small = (torch.zeros(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8))
        kw: dict[str, Any] = {"group_size": 2, "num_kv_rows": 10, "workspace": small, **over}
        return Call(prepared_mod.prepare_union, (mla()["rows"],), kw)

    return build


def _union_rows() -> list[Row]:
    n = "build_union"
    p = "prepare_union-small-workspace"  # regression: a too-small workspace returned None before any check
    return [
        Row(f"{p}-fits-not", _prepared_small(), Gives(lambda res: None if res is None else f"got {res!r}")),
        Row(
            f"{p}-num-kv-rows-negative",
            _prepared_small(num_kv_rows=-1),
            Raises(ValueError, r"^num_kv_rows must be >= 0"),
        ),
        Row(
            f"{p}-num-kv-rows-past-24-bits",
            _prepared_small(num_kv_rows=2**24),
            Raises(ValueError, r"^num_kv_rows must be <= 16777215 for group_size > 1"),
        ),
        Row(
            f"{p}-topk-length-int64",
            _prepared_small(topk_length=torch.ones(3, dtype=torch.int64)),
            Raises(TypeError, r"^topk_length must have dtype in \(int32\)"),
        ),
        Row(f"{n}-rows-float", _union(rows=lambda r: r.float()), Raises(TypeError, r"^rows must have dtype")),
        Row(f"{n}-group-size-3", _union(group_size=3), Raises(ValueError, r"^group_size must be one of")),
        Row(f"{n}-rows-sorted-str", _union(rows_sorted="yes"), Raises(TypeError, r"^rows_sorted must be a bool")),
        Row(f"{n}-method-unknown", _union(method="bitonic"), Raises(ValueError, r"^method must be one of")),
        Row(f"{n}-num-kv-rows-negative", _union(num_kv_rows=-1), Raises(ValueError, r"^num_kv_rows must be >= 0")),
        Row(f"{n}-num-kv-rows-past-24-bits", _union(num_kv_rows=2**24), Raises(ValueError, r"^num_kv_rows must be <=")),
        Row(
            f"{n}-bitmap-num-kv-rows-past-24-bits",
            _union(group_size=1, method="bitmap", num_kv_rows=2**24),
            Raises(ValueError, r"^num_kv_rows must be <= 16777215 for method='bitmap'"),
        ),
        Row(
            f"{n}-topk-length-shape",
            _union(topk_length=torch.ones(2, dtype=torch.int32)),
            Raises(ValueError, r"^topk_length must have shape \[3\]"),
        ),
        Row(
            f"{n}-kv-without-rows",
            _union(num_kv_rows=0),
            Gives(lambda res: None if bool((res[1] == 0).all()) else f"lens {res[1].tolist()}"),
        ),
    ]


def _small_kernel_rows() -> list[Row]:
    return [
        Row(
            "split_partials-workspace-too-small",
            lambda _g: Call(triton_merge.split_partials, (torch.zeros(10), 2, 3, 4, 8, torch.device("cpu"))),
            Raises(ValueError, r"^workspace must be a float32 tensor on cpu with >= 216 elements"),
        ),
        Row(
            "split_partials-workspace-fp16",
            lambda _g: Call(
                triton_merge.split_partials, (torch.zeros(400, dtype=torch.half), 2, 3, 4, 8, torch.device("cpu"))
            ),
            Raises(ValueError, r"^workspace must be a float32"),
        ),
    ]


def kernel_rows() -> list[Row]:
    """Every kernel entry point's rows."""
    return [*_sparse_rows(), *_gqa_rows(), *_merge_rows(), *_topk_rows(), *_union_rows(), *_small_kernel_rows()]
