"""Every public entry point against every kind of bad argument: one table, one test.

Each row of ``ROWS`` names an entry point and a bad argument, and states what it must get:

* ``Raises(TypeError | ValueError, match)``: the error names the argument (``match`` is a regex
  on the message), it is raised before any kernel runs (the kernels and references of
  :data:`KERNELS` are replaced by spies that record calls) and, for distributed steps, before
  any data collective (only the agreement all-gather may have run);
* ``Gives(check)``: a defined result (for instance ``out = 0, lse = -inf`` for rows whose
  indices are all out of range); ``check(result)`` returns ``None`` or what is wrong.

Either way the caller's inputs are left as they were (cloned before, compared after).

Distributed steps and the ``Runtime`` run on a one-rank gloo group of the test worker pool
(``dist_pool.run(..., world_size=1)``); rows travel there by id, so the table is rebuilt in the
worker. Mismatched devices use the ``meta`` device, so no GPU is needed.

The Ray pool's bad requests are not here: ``shardattn/launch/ray_pool.py`` tests its own calls in
``tests/test_ray_pool*.py``. Multi-rank failures (a rank that raises, exits, hangs, or passes a
different plan) are in ``tests/test_faults.py``.
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from shardattn import plan as P
from shardattn.kernels import gqa_decode as gqa_mod
from shardattn.kernels import lse_merge as merge_mod
from shardattn.kernels import sparse_mla as mla_mod
from shardattn.kernels import sparse_mla_decode as decode_mod
from shardattn.kernels import sparse_mla_grouped as grouped_mod
from shardattn.kernels import topk as topk_mod
from shardattn.kernels import union as union_mod
from shardattn.launch.cli import LaunchError, parse_options

META = torch.device("meta")
NAN, INF = float("nan"), float("inf")

# -- what each row must get ---------------------------------------------------------------------


@dataclass(frozen=True)
class Raises:
    """The call raises ``kind`` whose message matches ``match`` (which names the argument)."""

    kind: type[Exception]
    match: str


@dataclass(frozen=True)
class Gives:
    """The call returns; ``check(result)`` is ``None`` or a description of what is wrong."""

    check: Callable[[Any], str | None]


@dataclass(frozen=True)
class Call:
    fn: Callable[..., Any]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    comm: Any = None  # the Comm whose collectives are counted (distributed rows)


@dataclass(frozen=True)
class Row:
    id: str
    build: Callable[[Any], Call]  # build(group) -> the call; group is None for local rows
    expect: Raises | Gives
    dist: bool = False


# -- inputs -------------------------------------------------------------------------------------


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def mla(t: int = 3, h: int = 2, d: int = 48, r: int = 10, k: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """Small valid sparse-MLA inputs: q [t, h, d], kv [r, d], rows [t, k] int32 (value width 32)."""
    g = _gen(seed)
    rows = torch.randint(-1, r, (t, k), generator=g, dtype=torch.int32)
    return {"q": torch.randn(t, h, d, generator=g), "kv": torch.randn(r, d, generator=g), "rows": rows}


def gqa(b: int = 2, hq: int = 4, hkv: int = 2, d: int = 16, page: int = 4, pages: int = 6) -> dict[str, Any]:
    """Small valid GQA decode inputs (one query per request)."""
    g = _gen(1)
    return {
        "q": torch.randn(b, hq, d, generator=g),
        "k": torch.randn(pages, page, hkv, d, generator=g),
        "v": torch.randn(pages, page, hkv, d, generator=g),
        "table": torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)[:b],
        "lens": torch.tensor([9, 5], dtype=torch.int32)[:b],
    }


def topk_inputs() -> dict[str, torch.Tensor]:
    return {
        "pos": torch.tensor([[0, 5, -1, 9], [3, 4, 8, 2]], dtype=torch.int32),
        "req": torch.tensor([0, 1], dtype=torch.int32),
        "table": torch.tensor([[2, 0, 1], [1, 3, -1]], dtype=torch.int32),
    }


def _noncontig(x: torch.Tensor) -> torch.Tensor:
    """The same values, laid out with a stride (a transposed copy transposed back)."""
    y = x.transpose(0, -1).contiguous().transpose(0, -1)
    assert not y.is_contiguous() and torch.equal(x, y)
    return y


# -- result checks ------------------------------------------------------------------------------


def all_empty(v_dim: int | None = None) -> Callable[[Any], str | None]:
    """Every row is ``(out = 0, lse = -inf)``."""

    def check(res: Any) -> str | None:
        out, lse = res
        if v_dim is not None and out.shape[-1] != v_dim:
            return f"out has width {out.shape[-1]}, want {v_dim}"
        if bool(out.ne(0).any()):
            return "out is not 0"
        if not bool(lse.isneginf().all()):
            return f"lse is not -inf: {lse}"
        return None

    return check


def same_as(make_expected: Callable[[], Any]) -> Callable[[Any], str | None]:
    """The result equals ``make_expected()`` exactly (tensors or tuples of tensors)."""

    def check(res: Any) -> str | None:
        want = make_expected()
        got_t = res if isinstance(res, tuple) else (res,)
        want_t = want if isinstance(want, tuple) else (want,)
        for i, (a, b) in enumerate(zip(got_t, want_t, strict=True)):
            if not _same(a, b):
                return f"result {i} differs from the expected one"
        return None

    return check


def _same(a: Any, b: Any) -> bool:
    """Exact equality of tensors, NaN at the same places counting as equal; meta: shape and dtype."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            return False
        if a.device.type == "meta":
            return True
        if a.is_floating_point():
            na, nb = a.isnan(), b.isnan()
            return torch.equal(na, nb) and torch.equal(a[~na], b[~nb])
        return torch.equal(a, b)
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return True  # not a tensor: the table passes immutable values or objects it does not compare


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.clone()
    if type(x) in (tuple, list):
        return type(x)(_clone(v) for v in x)
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return x  # immutable values (ints, named tuples of ints, plans) are shared


def _merge_without_inf() -> tuple[torch.Tensor, torch.Tensor]:
    outs, lses = _merge_inputs()
    return merge_mod.lse_merge_reference(outs[1:], lses[1:])


def _merge_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(3)
    outs, lses = torch.randn(3, 4, 2, 8, generator=g), torch.randn(3, 4, 2, generator=g)
    lses[0] = INF  # partial 0: a peer whose kernel marks empty rows with +inf (FlashMLA)
    lses[1:, 2] = -INF  # row 2: empty in every partial
    return outs, lses


# -- the kernels a bad call must not reach ------------------------------------------------------

#: (module, attribute): every kernel launcher and torch reference a public entry may call.
KERNELS = [
    ("shardattn.kernels.sparse_mla", "sparse_mla_reference"),
    ("shardattn.kernels.sparse_mla_grouped", "sparse_mla_reference"),
    ("shardattn.kernels.sparse_mla_grouped", "launch_attention"),
    ("shardattn.kernels.sparse_mla_grouped", "build_union"),
    ("shardattn.kernels.sparse_mla_decode", "sparse_mla_reference"),
    ("shardattn.kernels.sparse_mla_decode", "launch_lse_merge"),
    ("shardattn.kernels.sparse_mla_decode", "build_union"),
    ("shardattn.kernels.gqa_decode", "sparse_mla_reference"),
    ("shardattn.kernels.gqa_decode", "gqa_paged_decode_reference"),
    ("shardattn.kernels.gqa_decode", "_run_triton"),
    ("shardattn.kernels.lse_merge", "lse_merge_reference"),
    ("shardattn.kernels.lse_merge", "launch_lse_merge"),
    ("shardattn.kernels.topk", "convert_topk_reference"),
    ("shardattn.kernels.union", "build_union_reference"),
    ("shardattn.kernels.union", "_sort_build"),
]


@contextlib.contextmanager
def spy_kernels() -> Iterator[list[str]]:
    """Wrap every entry of :data:`KERNELS` so that calls are recorded (and still run)."""
    called: list[str] = []
    saved = []
    for mod_name, attr in KERNELS:
        mod = importlib.import_module(mod_name)
        if not hasattr(mod, attr):
            continue
        orig = getattr(mod, attr)

        def wrapper(*a: Any, _orig: Any = orig, _name: str = f"{mod_name}.{attr}", **k: Any) -> Any:
            called.append(_name)
            return _orig(*a, **k)

        saved.append((mod, attr, orig))
        setattr(mod, attr, wrapper)
    try:
        yield called
    finally:
        for mod, attr, orig in saved:
            setattr(mod, attr, orig)


# -- the table ----------------------------------------------------------------------------------


def _sparse(fn: Callable[..., Any], **over: Any) -> Callable[[Any], Call]:
    """A sparse-MLA kernel call on :func:`mla` inputs with some arguments replaced."""

    def build(_group: Any) -> Call:
        x = mla()
        kw = {"scale": 0.125, "v_dim": 32}
        args = [x["q"], x["kv"], x["rows"]]
        for name, value in over.items():
            value = value(x) if callable(value) and name != "fn" else value
            if name in ("q", "kv", "rows"):
                args[("q", "kv", "rows").index(name)] = value
            else:
                kw[name] = value
        return Call(fn, tuple(args), kw)

    return build


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
            Row(
                f"{name}-q-wrong-width",
                _sparse(fn, q=lambda x: torch.randn(3, 2, 40)),
                Raises(ValueError, r"^q must have last dim 48 \(kv's row width\), got 40"),
            ),
            Row(
                f"{name}-kv-dtype", _sparse(fn, kv=lambda x: x["kv"].half()), Raises(TypeError, r"^kv must have dtype")
            ),
            Row(f"{name}-kv-3d", _sparse(fn, kv=lambda x: x["kv"][None]), Raises(ValueError, r"^kv must have 2 dim")),
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
            Row(f"{name}-v-dim-too-big", _sparse(fn, v_dim=49), Raises(ValueError, r"^v_dim must be in \(0, 48\]")),
            Row(
                f"{name}-topk-length-shape",
                _sparse(fn, topk_length=torch.ones(2, dtype=torch.int32)),
                Raises(ValueError, r"^topk_length must have shape \[3\]"),
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
        ]
    rows += [
        Row(
            "sparse_mla_attention-dsa-q-500",  # issue 11: the message blamed kv
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
        Row(
            "sparse_mla_decode-num-splits-0",
            _sparse(decode_mod.sparse_mla_decode, num_splits=0),
            Raises(ValueError, r"^num_splits must be >= 1"),
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
    ]
    return rows


def _gqa(**over: Any) -> Callable[[Any], Call]:
    def build(_group: Any) -> Call:
        x = gqa()
        args = [x["q"], x["k"], x["v"], x["table"], x["lens"]]
        names = ("q", "k_cache", "v_cache", "block_table", "seq_lens")
        kw: dict[str, Any] = {"return_lse": True}
        for name, value in over.items():
            value = value(x) if callable(value) else value
            if name in names:
                args[names.index(name)] = value
            else:
                kw[name] = value
        return Call(gqa_mod.gqa_paged_decode, tuple(args), kw)

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
        Row(f"{n}-q-len-0", _gqa(q_len_per_req=0), Raises(ValueError, r"^q_len_per_req must be >= 1")),
        Row(f"{n}-q-rows-vs-batch", _gqa(q_len_per_req=2), Raises(ValueError, r"^q must have batch \* q_len_per_req")),
        Row(f"{n}-backend", _gqa(backend="cuda"), Raises(ValueError, r"^backend must be one of")),
        Row(
            f"{n}-cu-q-lens-decreasing",
            _gqa(cu_q_lens=torch.tensor([0, 2, 1], dtype=torch.int32)),
            Raises(ValueError, r"^cu_q_lens must start at 0, not decrease"),
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
        Row(f"{n}-num-splits-0", _gqa(num_splits=0), Raises(ValueError, r"^num_splits must be >= 1")),
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
        args = [outs, lses]
        kw: dict[str, Any] = {}
        for name, value in over.items():
            value = value(outs, lses) if callable(value) else value
            if name in ("outs", "lses"):
                args[("outs", "lses").index(name)] = value
            else:
                kw[name] = value
        return Call(merge_mod.lse_merge, tuple(args), kw)

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
            f"{n}-pos-inf-is-empty",  # issue 11: +inf (FlashMLA's empty row) gave NaN
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
        args = [x["pos"], x["req"], x["table"]]
        names = ("topk_pos", "req_ids", "block_table")
        kw: dict[str, Any] = {"block_size": 4}
        for name, value in over.items():
            value = value(x) if callable(value) else value
            if name in names:
                args[names.index(name)] = value
            else:
                kw[name] = value
        return Call(topk_mod.convert_topk, tuple(args), kw)

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
        Row(
            f"{n}-seq-lens-shape",
            _topk(seq_lens=torch.ones(3, dtype=torch.int32)),
            Raises(ValueError, r"^seq_lens must have shape \[2\]"),
        ),
        Row(f"{n}-dcp-rank-past-world", _topk(dcp=topk_mod.DcpShard(2, 1, 2)), Raises(ValueError, r"^dcp must have")),
        Row(f"{n}-dcp-not-a-shard", _topk(dcp=(2, 1)), Raises(TypeError, r"^dcp must be DcpShard")),
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


def _union_rows() -> list[Row]:
    n = "build_union"
    return [
        Row(f"{n}-rows-float", _union(rows=lambda r: r.float()), Raises(TypeError, r"^rows must have dtype")),
        Row(f"{n}-group-size-3", _union(group_size=3), Raises(ValueError, r"^group_size must be one of")),
        Row(f"{n}-num-kv-rows-negative", _union(num_kv_rows=-1), Raises(ValueError, r"^num_kv_rows must be >= 0")),
        Row(f"{n}-num-kv-rows-past-24-bits", _union(num_kv_rows=2**24), Raises(ValueError, r"^num_kv_rows must be <=")),
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
            lambda _g: Call(merge_mod.split_partials, (torch.zeros(10), 2, 3, 4, 8, torch.device("cpu"))),
            Raises(ValueError, r"^workspace must be a float32 tensor on cpu with >= 216 elements"),
        ),
        Row(
            "split_partials-workspace-fp16",
            lambda _g: Call(
                merge_mod.split_partials, (torch.zeros(400, dtype=torch.half), 2, 3, 4, 8, torch.device("cpu"))
            ),
            Raises(ValueError, r"^workspace must be a float32"),
        ),
    ]


def _plan_rows() -> list[Row]:
    def row(rid: str, fn: Callable[..., Any], args: tuple, kw: dict, expect: Raises | Gives) -> Row:
        return Row(rid, lambda _g: Call(fn, args, kw), expect)

    pos = torch.arange(6)
    spec = P.get_preset("glm5")
    return [
        row(
            "zigzag_split-seq-lens-negative",
            P.zigzag_split,
            ([3, -1], 2),
            {},
            Raises(ValueError, r"^seq_lens\[1\] must be >= 0"),
        ),
        row(
            "zigzag_split-seq-lens-float",
            P.zigzag_split,
            ([3.0], 2),
            {},
            Raises(TypeError, r"^seq_lens\[0\] must be an int"),
        ),
        row(
            "zigzag_split-seq-lens-2d",
            P.zigzag_split,
            (np.ones((2, 2), dtype=np.int64), 2),
            {},
            Raises(ValueError, r"^seq_lens must be 1-D"),
        ),
        row(
            "zigzag_split-seq-lens-on-meta",
            P.zigzag_split,
            (torch.ones(2, dtype=torch.int64, device=META), 2),
            {},
            Raises(ValueError, r"^seq_lens must be a CPU tensor"),
        ),
        row("zigzag_split-world-size-0", P.zigzag_split, ([3], 0), {}, Raises(ValueError, r"^world_size must be >= 1")),
        row("zigzag_split-align-0", P.zigzag_split, ([3], 2), {"align": 0}, Raises(ValueError, r"^align must be >= 1")),
        row(
            "zigzag_split-prefix-count",
            P.zigzag_split,
            ([3, 4], 2),
            {"prefix_lens": [1]},
            Raises(ValueError, r"^prefix_lens must have 2 entries"),
        ),
        row(
            "zigzag_split-no-request",
            P.zigzag_split,
            ([], 2),
            {"min_tokens": 0},
            Gives(lambda plan: None if plan.num_tokens == 0 else "tokens"),
        ),
        row(
            "cost_balanced_split-world-size-float",
            P.cost_balanced_split,
            ([3], 1.5),
            {},
            Raises(TypeError, r"^world_size must be an int"),
        ),
        row(
            "zigzag_chunk_bounds-align-negative",
            P.zigzag_chunk_bounds,
            ([3], 2),
            {"align": -1},
            Raises(ValueError, r"^align must be >= 1"),
        ),
        row(
            "balance_report-topk-0", P.balance_report, ([3], 2), {"topk": 0}, Raises(ValueError, r"^topk must be >= 1")
        ),
        row("pcp_plan-world-size-0", P.pcp_plan, ([3], 0), {}, Raises(ValueError, r"^world_size must be >= 1")),
        row(
            "pcp_plan-prefix-negative",
            P.pcp_plan,
            ([3], 2),
            {"prefix_lens": [-2]},
            Raises(ValueError, r"^prefix_lens\[0\] must be >= 0"),
        ),
        row("token_cost-topk-0", P.token_cost, (np.arange(3), 0), {}, Raises(ValueError, r"^topk must be >= 1")),
        row(
            "dcp_owner-positions-float",
            P.dcp_owner,
            (pos.float(), 2),
            {},
            Raises(TypeError, r"^positions must have dtype"),
        ),
        row("dcp_owner-world-size-0", P.dcp_owner, (pos, 0), {}, Raises(ValueError, r"world_size must be >= 1")),
        row(
            "dcp_local_index-interleave-0",
            P.dcp_local_index,
            (pos, 2, 0),
            {},
            Raises(ValueError, r"interleave must be >= 1"),
        ),
        row(
            "dcp_global_index-rank-past-world", P.dcp_global_index, (pos, 2, 2), {}, Raises(ValueError, r"rank must be")
        ),
        row(
            "dcp_local_seq_lens-seq-lens-float",
            P.dcp_local_seq_lens,
            (pos.float(), 0, 2),
            {},
            Raises(TypeError, r"^seq_lens must have dtype"),
        ),
        row(
            "dcp_translate_topk-seq-lens-shape",
            P.dcp_translate_topk,
            (pos.view(2, 3), 0, 2),
            {"seq_lens": torch.ones(3, dtype=torch.int64)},
            Raises(ValueError, r"^seq_lens must have shape \[2\]"),
        ),
        row(
            "dcp_translate_topk-seq-lens-on-meta",
            P.dcp_translate_topk,
            (pos.view(2, 3), 0, 2),
            {"seq_lens": torch.ones(2, dtype=torch.int64, device=META)},
            Raises(ValueError, r"seq_lens differs"),
        ),
        row(
            "causal_token_seq_lens-qo-indptr-float",
            P.causal_token_seq_lens,
            (torch.tensor([3, 4]), torch.tensor([0.0, 1.0, 2.0]), 2),
            {},
            Raises(TypeError, r"^qo_indptr must have dtype"),
        ),
        row(
            "dcp_causal_local_lens-rank-negative",
            P.dcp_causal_local_lens,
            (torch.tensor([3, 4]), torch.tensor([0, 1, 2]), 2, -1, 2),
            {},
            Raises(ValueError, r"rank must be"),
        ),
        row("DCPLayout-world-size-0", P.DCPLayout, (0,), {}, Raises(ValueError, r"world_size must be >= 1")),
        row(
            "ModelSpec-kind",
            P.ModelSpec,
            ("mla", 8, 1, 48, 32, 16, 16),
            {},
            Raises(ValueError, r"^kind must be one of"),
        ),
        row(
            "ModelSpec-heads-float",
            P.ModelSpec,
            ("gqa", 8.0, 1, 48, 32, 0, 16),
            {},
            Raises(TypeError, r"^num_heads must be an int"),
        ),
        row(
            "ModelSpec-v-dim-past-head-dim",
            P.ModelSpec,
            ("sparse_mla", 8, 1, 48, 64, 16, 16),
            {},
            Raises(ValueError, r"v_dim \(64\) must be <= head_dim"),
        ),
        row("get_preset-unknown", P.get_preset, ("llama",), {}, Raises(ValueError, r"unknown model preset 'llama'")),
        row(
            "route_prefill-heads-0",
            P.route_prefill,
            (0,),
            {"num_tokens": 8, "kv_rows": 8},
            Raises(ValueError, r"num_heads must be >= 1"),
        ),
        row(
            "route_prefill-tokens-negative",
            P.route_prefill,
            (8,),
            {"num_tokens": -1, "kv_rows": 8},
            Raises(ValueError, r"num_tokens must be >= 0"),
        ),
        row("route_decode-spec-str", P.route_decode, ("glm5",), {}, Raises(TypeError, r"^spec must be a ModelSpec")),
        row(
            "route_decode-dcp-size-0",
            P.route_decode,
            (spec,),
            {"dcp_size": 0},
            Raises(ValueError, r"dcp_size must be >= 1"),
        ),
        row("tile_group_size-heads-0", P.tile_group_size, (0,), {}, Raises(ValueError, r"num_heads must be >= 1")),
        row(
            "grouped_group_size-heads-str",
            P.grouped_group_size,
            ("8",),
            {},
            Raises(TypeError, r"num_heads must be an int"),
        ),
        row(
            "workspace_bounds-mode",
            P.workspace_bounds,
            (spec,),
            {"max_batched_tokens": 8, "world_size": 2, "mode": "ring"},
            Raises(ValueError, r"^mode must be one of"),
        ),
        row(
            "workspace_bounds-tokens-negative",
            P.workspace_bounds,
            (spec,),
            {"max_batched_tokens": -1, "world_size": 2, "mode": "shardq"},
            Raises(ValueError, r"^max_batched_tokens must be >= 0"),
        ),
        row(
            "cudagraph_support-mode",
            P.cudagraph_support,
            ("train", "triton"),
            {"head_dim": 64},
            Raises(ValueError, r"^mode must be one of"),
        ),
        row(
            "explain_cudagraph_support-kernel",
            P.explain_cudagraph_support,
            ("decode", "cutlass"),
            {"head_dim": 64},
            Raises(ValueError, r"^kernel must be one of"),
        ),
        row(
            "xqa_head_dim_supported-0",
            P.xqa_head_dim_supported,
            (0,),
            {},
            Raises(ValueError, r"^head_dim must be >= 1"),
        ),
        row(
            "decode_query_lens-decreasing",
            P.decode_query_lens,
            ([0, 2, 1], 2),
            {},
            Raises(ValueError, r"^qo_indptr must be non-decreasing"),
        ),
        row(
            "decode_query_lens-too-short",
            P.decode_query_lens,
            ([0, 2], 2),
            {},
            Raises(ValueError, r"^qo_indptr must have at least"),
        ),
    ]


# -- distributed steps (a one-rank gloo group) ---------------------------------------------------

MLA_SPEC = P.ModelSpec("sparse_mla", 8, 1, 48, 32, 16, 16, dtype="float32")
GQA_SPEC = P.ModelSpec("gqa", 8, 2, 16, 16, 0, 4, dtype="float32")


def _shardq(**over: Any) -> Callable[[Any], Call]:
    def build(group: Any) -> Call:
        from shardattn.parallel import Comm, shardq_prefill

        comm = Comm(group)
        x = mla(t=5)
        args = {
            "q_heads_local": x["q"],
            "kv": x["kv"],
            "rows": x["rows"],
            "plan": P.zigzag_split([2, 3], 1, min_tokens=0),
        }
        kw: dict[str, Any] = {"scale": 0.125, "v_dim": 32}
        for name, value in over.items():
            value = value(x) if callable(value) else value
            (args if name in args else kw)[name] = value
        return Call(shardq_prefill, (*args.values(), comm), kw, comm)

    return build


def _dcp_mla(**over: Any) -> Callable[[Any], Call]:
    def build(group: Any) -> Call:
        from shardattn.parallel import Comm, dcp_sparse_mla_decode

        comm = Comm(group)
        x = topk_inputs()
        q = torch.randn(2, 2, 48, generator=_gen(4))
        kv = torch.randn(16, 48, generator=_gen(5))
        names = ("q_heads_local", "kv_cache", "topk_pos", "req_ids", "block_table", "layout")
        args = dict(zip(names, (q, kv, x["pos"], x["req"], x["table"], P.DCPLayout(1))))
        kw: dict[str, Any] = {"block_size": 4, "scale": 0.125, "v_dim": 32}
        for name, value in over.items():
            value = value(args) if callable(value) else value
            (args if name in args else kw)[name] = value
        return Call(dcp_sparse_mla_decode, (*args.values(), comm), kw, comm)

    return build


def _dcp_gqa(**over: Any) -> Callable[[Any], Call]:
    def build(group: Any) -> Call:
        from shardattn.parallel import Comm, dcp_gqa_decode

        comm = Comm(group)
        x = gqa()
        names = ("q_heads_local", "k_cache", "v_cache", "block_table", "seq_lens", "layout")
        args = dict(zip(names, (x["q"], x["k"], x["v"], x["table"], x["lens"], P.DCPLayout(1))))
        kw: dict[str, Any] = {}
        for name, value in over.items():
            value = value(args) if callable(value) else value
            (args if name in args else kw)[name] = value
        return Call(dcp_gqa_decode, (*args.values(), comm), kw, comm)

    return build


def _pcp(**over: Any) -> Callable[[Any], Call]:
    def build(group: Any) -> Call:
        from shardattn.parallel import Comm, pcp_prefill

        comm = Comm(group)
        g = _gen(6)
        q, kv_new = torch.randn(5, 2, 48, generator=g), torch.randn(5, 48, generator=g)
        pos = torch.randint(-1, 5, (5, 3), generator=g, dtype=torch.int32)
        args = {"q": q, "kv_new": kv_new, "topk_pos": pos, "plan": P.pcp_plan([2, 3], 1)}
        kw: dict[str, Any] = {"scale": 0.125, "v_dim": 32}
        for name, value in over.items():
            value = value(args) if callable(value) else value
            (args if name in args else kw)[name] = value
        return Call(pcp_prefill, (*args.values(), comm), kw, comm)

    return build


def _collect(**over: Any) -> Callable[[Any], Call]:
    def build(group: Any) -> Call:
        from shardattn.parallel import Comm, collect_partials

        comm = Comm(group)
        g = _gen(7)
        args = {"out": torch.randn(3, 4, 8, generator=g), "lse": torch.randn(3, 4, generator=g)}
        kw: dict[str, Any] = {}
        for name, value in over.items():
            value = value(args) if callable(value) else value
            (args if name in args else kw)[name] = value
        return Call(collect_partials, (args["out"], args["lse"], comm), kw, comm)

    return build


def _runtime_new(**over: Any) -> Callable[[Any], Call]:
    def build(group: Any) -> Call:
        from shardattn.parallel.runtime import Runtime

        kw: dict[str, Any] = {"max_batched_tokens": 64, "mode": "shardq", "warmup": False, **over}
        spec = kw.pop("spec", MLA_SPEC)
        return Call(Runtime, (spec, group), kw)

    return build


def _runtime_step(step: str, spec: P.ModelSpec, mode: str, **over: Any) -> Callable[[Any], Call]:
    def build(group: Any) -> Call:
        from shardattn.parallel.runtime import Runtime

        rt = Runtime(spec, group, max_batched_tokens=64, mode=mode, warmup=False)
        rt.comm.reset_counts()
        if step == "prefill":
            x = mla(t=5, h=8, k=16)
            args = {"q": x["q"], "kv": x["kv"], "rows": x["rows"]}
            kw: dict[str, Any] = {"seq_lens": [2, 3]}
        elif spec.kind == "sparse_mla":
            x = topk_inputs()
            args = {
                "q": torch.randn(2, 8, 48, generator=_gen(8)),
                "kv_cache": torch.randn(16, 48, generator=_gen(9)),
                "block_table": x["table"],
                "seq_lens": torch.tensor([10, 9], dtype=torch.int32),
            }
            kw = {"topk_pos": x["pos"], "req_ids": x["req"]}
        else:
            x = gqa(hq=8)
            args = {"q": x["q"], "kv_cache": (x["k"], x["v"]), "block_table": x["table"], "seq_lens": x["lens"]}
            kw = {}
        for name, value in over.items():
            value = value(args) if callable(value) else value
            (args if name in args else kw)[name] = value
        fn = rt.prefill if step == "prefill" else rt.decode
        return Call(fn, tuple(args.values()), kw, rt.comm)

    return build


def _dist_rows() -> list[Row]:
    two_rank_plan = P.zigzag_split([2, 3], 2, min_tokens=0)
    rows = [
        # ShardQ
        (
            "shardq_prefill-plan-for-2-ranks",
            _shardq(plan=two_rank_plan),
            Raises(ValueError, r"^plan is for world_size=2, but the group has 1 ranks"),
        ),
        ("shardq_prefill-plan-not-a-plan", _shardq(plan=[2, 3]), Raises(TypeError, r"^plan must be a ShardPlan")),
        (
            "shardq_prefill-q-wrong-width",
            _shardq(q_heads_local=lambda x: torch.randn(5, 2, 40)),
            Raises(ValueError, r"^q_heads_local must have last dim 48"),
        ),
        (
            "shardq_prefill-q-tokens-vs-plan",
            _shardq(q_heads_local=lambda x: x["q"][:4]),
            Raises(ValueError, r"^q_heads_local must hold the step's 5 tokens"),
        ),
        (
            "shardq_prefill-rows-int64",
            _shardq(rows=lambda x: x["rows"].long()),
            Raises(TypeError, r"^rows must have dtype"),
        ),
        ("shardq_prefill-kv-on-meta", _shardq(kv=lambda x: x["kv"].to(META)), Raises(ValueError, r"kv differs")),
        ("shardq_prefill-scale-nan", _shardq(scale=NAN), Raises(ValueError, r"^scale must be a finite number > 0")),
        ("shardq_prefill-scale-negative", _shardq(scale=-1.0), Raises(ValueError, r"^scale must be a finite")),
        (
            "shardq_prefill-sinks-count",
            _shardq(sinks=torch.zeros(3)),
            Raises(ValueError, r"^sinks must have shape \[2\]"),
        ),
        ("shardq_prefill-kv-without-rows", _shardq(kv=lambda x: x["kv"][:0]), Gives(all_empty(32))),
        # DCP sparse MLA
        (
            "dcp_sparse_mla_decode-layout-for-2-ranks",
            _dcp_mla(layout=P.DCPLayout(2)),
            Raises(ValueError, r"^layout is for world_size=2, but the group has 1"),
        ),
        (
            "dcp_sparse_mla_decode-layout-not-a-layout",
            _dcp_mla(layout=2),
            Raises(TypeError, r"^layout must be a DCPLayout"),
        ),
        (
            "dcp_sparse_mla_decode-q-wrong-width",
            _dcp_mla(q_heads_local=torch.randn(2, 2, 40)),
            Raises(ValueError, r"^q_heads_local must have last dim 48"),
        ),
        ("dcp_sparse_mla_decode-scale-inf", _dcp_mla(scale=INF), Raises(ValueError, r"^scale must be a finite")),
        ("dcp_sparse_mla_decode-block-size-0", _dcp_mla(block_size=0), Raises(ValueError, r"^block_size must be >= 1")),
        (
            "dcp_sparse_mla_decode-table-past-cache",
            _dcp_mla(kv_cache=lambda a: a["kv_cache"][:8]),
            Raises(ValueError, r"^block_table points past kv_cache"),
        ),
        (
            "dcp_sparse_mla_decode-req-ids-on-meta",
            _dcp_mla(req_ids=lambda a: a["req_ids"].to(META)),
            Raises(ValueError, r"req_ids differs"),
        ),
        ("dcp_sparse_mla_decode-strategy", _dcp_mla(strategy="ring"), Raises(ValueError, r"^strategy must be one of")),
        (
            "dcp_sparse_mla_decode-kv-without-rows",
            _dcp_mla(kv_cache=lambda a: a["kv_cache"][:0], block_table=torch.full((2, 3), -1, dtype=torch.int32)),
            Gives(all_empty(32)),
        ),
        # DCP GQA
        (
            "dcp_gqa_decode-layout-for-2-ranks",
            _dcp_gqa(layout=P.DCPLayout(2)),
            Raises(ValueError, r"^layout is for world_size=2"),
        ),
        (
            "dcp_gqa_decode-q-wrong-width",
            _dcp_gqa(q_heads_local=torch.randn(2, 4, 8)),
            Raises(ValueError, r"^q_heads_local must have last dim 16"),
        ),
        ("dcp_gqa_decode-scale-zero", _dcp_gqa(scale=0.0), Raises(ValueError, r"^scale must be a finite")),
        (
            "dcp_gqa_decode-seq-lens-negative",
            _dcp_gqa(seq_lens=torch.tensor([-1, 3], dtype=torch.int32)),
            Raises(ValueError, r"^seq_lens must be >= 0"),
        ),
        (
            "dcp_gqa_decode-seq-lens-past-table",
            _dcp_gqa(seq_lens=torch.tensor([40, 3], dtype=torch.int32)),
            Raises(ValueError, r"^seq_lens\[0\]=40 puts 40 tokens on rank 0"),
        ),
        ("dcp_gqa_decode-q-len-0", _dcp_gqa(q_len_per_req=0), Raises(ValueError, r"^q_len_per_req must be >= 1")),
        ("dcp_gqa_decode-padded-requests", _dcp_gqa(seq_lens=torch.zeros(2, dtype=torch.int32)), Gives(all_empty(16))),
        # PCP
        (
            "pcp_prefill-plan-for-2-ranks",
            _pcp(plan=P.pcp_plan([2, 3], 2)),
            Raises(ValueError, r"^plan is for world_size=2"),
        ),
        ("pcp_prefill-q-wrong-width", _pcp(q=torch.randn(5, 2, 40)), Raises(ValueError, r"^q must have last dim 48")),
        (
            "pcp_prefill-kv-new-rows",
            _pcp(kv_new=lambda a: a["kv_new"][:4]),
            Raises(ValueError, r"^kv_new must hold one row per token"),
        ),
        ("pcp_prefill-scale-nan", _pcp(scale=NAN), Raises(ValueError, r"^scale must be a finite")),
        (
            "pcp_prefill-cache-without-table",
            _pcp(kv_cache=torch.randn(8, 48)),
            Raises(ValueError, r"^kv_cache, block_table and block_size go together"),
        ),
        (
            "pcp_prefill-prefix-without-cache",
            _pcp(plan=P.pcp_plan([2, 3], 1, prefix_lens=[4, 0])),
            Raises(ValueError, r"cached prefixes .* pass kv_cache"),
        ),
        (
            "pcp_prefill-cache-without-rows",
            _pcp(
                plan=P.pcp_plan([2, 3], 1, prefix_lens=[0, 0]),
                kv_cache=torch.randn(0, 48),
                block_table=torch.full((2, 1), -1, dtype=torch.int32),
                block_size=4,
                topk_pos=torch.full((5, 3), 7, dtype=torch.int32),  # every position past its request
            ),
            Gives(all_empty(32)),
        ),
        # collector
        (
            "collect_partials-lse-fp16",
            _collect(lse=lambda a: a["lse"].half()),
            Raises(TypeError, r"^lse must have dtype"),
        ),
        ("collect_partials-out-2d", _collect(out=lambda a: a["out"][0]), Raises(ValueError, r"^out must have 3 dim")),
        ("collect_partials-lse-on-meta", _collect(lse=lambda a: a["lse"].to(META)), Raises(ValueError, r"lse differs")),
        ("collect_partials-strategy", _collect(strategy="tree"), Raises(ValueError, r"^strategy must be one of")),
        (
            "collect_partials-all-to-all-all-heads",
            _collect(strategy="all_to_all", scatter_heads=False),
            Raises(ValueError, r"^strategy='all_to_all' leaves each rank with its head slice"),
        ),
        # Runtime
        ("Runtime-mode", _runtime_new(mode="ring"), Raises(ValueError, r"^mode must be one of")),
        ("Runtime-spec-int", _runtime_new(spec=3), Raises(TypeError, r"^spec must be a ModelSpec")),
        (
            "Runtime-spec-unknown-preset",
            _runtime_new(spec="llama"),
            Raises(ValueError, r"unknown model preset 'llama'"),
        ),
        (
            "Runtime-max-batched-tokens-0",
            _runtime_new(max_batched_tokens=0),
            Raises(ValueError, r"^max_batched_tokens must be >= 1"),
        ),
        (
            "Runtime-dcp-interleave-0",
            _runtime_new(dcp_interleave=0),
            Raises(ValueError, r"^dcp_interleave must be >= 1"),
        ),
        ("Runtime-non-causal-str", _runtime_new(non_causal="yes"), Raises(TypeError, r"^non_causal must be a bool")),
        ("Runtime-topk-0", _runtime_new(topk=0), Raises(ValueError, r"^topk must be >= 1")),
        (
            "Runtime-gqa-shardq",
            _runtime_new(spec=GQA_SPEC),
            Raises(ValueError, r"mode 'shardq' runs a sparse-MLA prefill"),
        ),
        (
            "Runtime.prefill-no-seq-lens",
            _runtime_step("prefill", MLA_SPEC, "shardq", seq_lens=None),
            Raises(ValueError, r"prefill needs seq_lens"),
        ),
        (
            "Runtime.prefill-plan-not-a-plan",
            _runtime_step("prefill", MLA_SPEC, "shardq", plan="x"),
            Raises(TypeError, r"^plan must be a PrefillPlan"),
        ),
        (
            "Runtime.prefill-rows-int64",
            _runtime_step("prefill", MLA_SPEC, "shardq", rows=lambda a: a["rows"].long()),
            Raises(TypeError, r"^rows must have dtype"),
        ),
        (
            "Runtime.prefill-q-wrong-width",
            _runtime_step("prefill", MLA_SPEC, "shardq", q=torch.randn(5, 8, 40)),
            Raises(ValueError, r"^q(_heads_local)? must have last dim 48"),
        ),
        (
            "Runtime.prefill-pcp-q-wrong-width",
            _runtime_step("prefill", MLA_SPEC, "pcp", q=torch.randn(5, 8, 40), kv=torch.randn(5, 48)),
            Raises(ValueError, r"^q must have last dim 48"),
        ),
        (
            "Runtime.prefill-tokens-past-workspace",
            _runtime_step("prefill", MLA_SPEC, "shardq", seq_lens=[40, 40]),
            Raises(ValueError, r"workspace"),
        ),
        (
            "Runtime.decode-no-topk",
            _runtime_step("decode", MLA_SPEC, "headtp", topk_pos=None),
            Raises(ValueError, r"sparse-MLA decode needs topk_pos"),
        ),
        (
            "Runtime.decode-kv-pair-for-mla",
            _runtime_step("decode", MLA_SPEC, "headtp", kv_cache=lambda a: (a["kv_cache"], a["kv_cache"])),
            Raises(TypeError, r"^kv_cache of a sparse-MLA model"),
        ),
        (
            "Runtime.decode-dcp-q-wrong-width",
            _runtime_step("decode", MLA_SPEC, "mixed", q=torch.randn(2, 8, 40)),
            Raises(ValueError, r"^q_heads_local must have last dim 48"),
        ),
        (
            "Runtime.decode-dcp-table-int64",
            _runtime_step("decode", MLA_SPEC, "mixed", block_table=lambda a: a["block_table"].long()),
            Raises(TypeError, r"^block_table must have dtype"),
        ),
        (
            "Runtime.decode-headtp-kv-without-rows",
            _runtime_step("decode", MLA_SPEC, "headtp", kv_cache=torch.randn(0, 48)),
            Gives(all_empty(32)),
        ),
        (
            "Runtime.decode-gqa-kv-not-a-pair",
            _runtime_step("decode", GQA_SPEC, "dcp-decode", kv_cache=lambda a: a["kv_cache"][0]),
            Raises(TypeError, r"^kv_cache of a GQA model must be a \(k_cache, v_cache\) pair"),
        ),
        (
            "Runtime.decode-gqa-seq-lens-negative",
            _runtime_step("decode", GQA_SPEC, "dcp-decode", seq_lens=torch.tensor([-1, 3], dtype=torch.int32)),
            Raises(ValueError, r"^seq_lens must be >= 0"),
        ),
        (
            "Runtime.decode-gqa-headtp-q-len-0",
            _runtime_step("decode", GQA_SPEC, "headtp", q_len_per_req=0),
            Raises(ValueError, r"^q_len_per_req must be >= 1"),
        ),
    ]
    return [Row(rid, build, expect, dist=True) for rid, build, expect in rows]


ROWS: list[Row] = [
    *_sparse_rows(),
    *_gqa_rows(),
    *_merge_rows(),
    *_topk_rows(),
    *_union_rows(),
    *_small_kernel_rows(),
    *_plan_rows(),
    *_dist_rows(),
]
BY_ID = {r.id: r for r in ROWS}
assert len(BY_ID) == len(ROWS), "row ids must be unique"


# -- running one row ----------------------------------------------------------------------------


def run_row(group: Any, row_id: str) -> dict[str, Any]:
    """Build and run one row (here, or on a rank of the worker pool); report what happened."""
    row = BY_ID[row_id]
    call = row.build(group)
    before = _clone((call.args, call.kwargs))
    report: dict[str, Any] = {"error": None, "message": "", "check": None}
    with spy_kernels() as called:
        try:
            result = call.fn(*call.args, **call.kwargs)
        except Exception as e:  # every exception is reported; the test decides
            report["error"], report["message"] = type(e).__name__, str(e)
            report["is_expected_kind"] = isinstance(row.expect, Raises) and isinstance(e, row.expect.kind)
        else:
            report["check"] = row.expect.check(result) if isinstance(row.expect, Gives) else "no error raised"
    report["kernels"] = list(called)
    report["inputs_unchanged"] = _same(before, (call.args, call.kwargs))
    report["collectives"] = {k: v for k, v in call.comm.counts.items() if k != "agreement"} if call.comm else {}
    return report


@pytest.mark.parametrize("row_id", [r.id for r in ROWS])
def test_bad_input(row_id: str, dist_pool: Any) -> None:
    row = BY_ID[row_id]
    report = dist_pool.run(run_row, row_id, world_size=1)[0] if row.dist else run_row(None, row_id)
    assert report["inputs_unchanged"], "the call modified the caller's inputs"
    if isinstance(row.expect, Raises):
        assert report["error"] is not None, f"no error raised (check: {report['check']})"
        assert report["is_expected_kind"], f"{report['error']}: {report['message']}"
        assert re.search(row.expect.match, report["message"]), report["message"]
        assert report["kernels"] == [], f"kernels ran before the error: {report['kernels']}"
        assert report["collectives"] == {}, f"collectives ran before the error: {report['collectives']}"
    else:
        assert report["error"] is None, f"{report['error']}: {report['message']}"
        assert report["check"] is None, report["check"]


# -- the launcher's options: a bad option exits with status 2 and one line ------------------------

LAUNCH_ROWS = [
    (["--mode", "ring"], r"argument --mode: invalid choice: 'ring'"),
    (["--tokens", "-5"], r"--tokens must be >= 1, got -5"),
    (["--timeout", "nan"], r"--timeout must be"),
    (["--timeout", "inf"], r"--timeout must be"),
    (["--topk", "0"], r"--topk must be >= 1"),
    (["--dtype", "int8"], r"argument --dtype: invalid choice"),
    (["--device", "tpu"], r"argument --device: invalid choice"),
    (["--fail-rank", "-1"], r"--fail-rank must be >= 0"),
    (["--interleave", "0"], r"--interleave must be >= 1"),
    (["--q-len", "1,x"], r"expected comma-separated integers"),
    (["--warmup", "-1"], r"--warmup must be >= 0"),
]


@pytest.mark.parametrize(("argv", "match"), LAUNCH_ROWS, ids=[" ".join(a) for a, _ in LAUNCH_ROWS])
def test_bad_launch_option(argv: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(LaunchError, match=match) as info:
        parse_options(argv)
    assert info.value.status == 2 and "\n" not in str(info.value)
    from shardattn.launch.__main__ import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("shardattn.launch: error: "), err


def test_table_covers_every_public_kernel_and_plan_function() -> None:
    """A new public entry point must get rows here (or be listed as not taking user input)."""
    covered = {r.id.split("-")[0] for r in ROWS}
    plan_functions = {n for n in P.__all__ if callable(getattr(P, n)) and not isinstance(getattr(P, n), type)}
    plan_functions |= {"DCPLayout", "ModelSpec"}
    not_user_input = {"CGSupport", "explain_cudagraph_support"} - {"explain_cudagraph_support"}
    missing = plan_functions - covered - not_user_input
    assert not missing, f"plan functions without a row: {sorted(missing)}"
    kernels = {
        "sparse_mla_attention", "sparse_mla_grouped_prefill", "sparse_mla_decode", "gqa_paged_decode",
        "lse_merge", "convert_topk", "build_union", "split_partials",
    }  # fmt: skip
    assert kernels <= covered, sorted(kernels - covered)
    steps = {"shardq_prefill", "dcp_sparse_mla_decode", "dcp_gqa_decode", "pcp_prefill", "collect_partials"}
    assert steps | {"Runtime", "Runtime.prefill", "Runtime.decode"} <= covered


def interpreted_pos_inf_merge() -> None:
    """Runs under ``TRITON_INTERPRET=1`` (a subprocess): the Triton merge equals the reference."""
    from shardattn.kernels.registry import use_triton

    outs, lses = _merge_inputs()
    assert use_triton(outs), "the interpreter is not on"
    with spy_kernels() as called:
        out, lse = merge_mod.lse_merge(outs, lses)
    assert called == ["shardattn.kernels.lse_merge.launch_lse_merge"], called
    want_out, want_lse = _merge_without_inf()
    assert not bool(out.isnan().any()) and torch.equal(lse.isneginf(), want_lse.isneginf())
    torch.testing.assert_close(out, want_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, want_lse, atol=1e-6, rtol=1e-6)
    print("ok")


@pytest.mark.interpret
def test_lse_merge_pos_inf_is_empty_on_the_triton_kernel() -> None:
    """issue 11: the Triton merge kernel reads +inf as an empty partial, like the reference."""
    from shardattn.kernels.registry import triton_available
    from shardattn.testing.interpret import run_interpreted

    if not triton_available():
        pytest.skip("triton is not installed")
    assert run_interpreted(__name__, "interpreted_pos_inf_merge", timeout=300).strip().endswith("ok")


# -- regression tests of issue 11, as a user met them (also rows of the table above) --------------


def _dsa_step(t: int = 2, d: int = 576) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _gen(11)
    return (
        torch.randn(t, 4, d, generator=g),
        torch.randn(9, 576, generator=g),
        torch.tensor([[0, 5, -1], [8, 2, 2]], dtype=torch.int32),
    )


@pytest.mark.parametrize("scale", [NAN, INF, -INF, 0.0, -0.05], ids=["nan", "inf", "-inf", "zero", "negative"])
def test_issue11_scale_that_is_not_finite_and_positive_is_refused(scale: float) -> None:
    q, kv, rows = _dsa_step()
    with pytest.raises(ValueError, match=r"^scale must be a finite number > 0"):
        mla_mod.sparse_mla_attention(q, kv, rows, scale=scale)


def test_issue11_kv_cache_without_rows_gives_empty_rows_not_index_error() -> None:
    q, _, rows = _dsa_step()
    out, lse = mla_mod.sparse_mla_attention(q, torch.zeros(0, 576), rows, scale=576**-0.5)
    assert out.shape == (2, 4, 512) and bool((out == 0).all()) and bool(lse.isneginf().all())


def test_issue11_q_of_the_wrong_width_is_blamed_on_q() -> None:
    q, kv, rows = _dsa_step(d=500)
    with pytest.raises(ValueError, match=r"^q must have last dim 576 \(kv's row width\), got 500"):
        mla_mod.sparse_mla_attention(q, kv, rows, scale=576**-0.5)


def test_issue11_pos_inf_lse_merges_as_an_empty_partial() -> None:
    outs, lses = _merge_inputs()
    out, lse = merge_mod.lse_merge(outs, lses)
    want_out, want_lse = _merge_without_inf()
    assert not bool(out.isnan().any()) and not bool(lse.isnan().any())
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
