"""The bad-input table's harness: what a row must get, small valid inputs, result checks, kernel spies.

See tests/test_bad_input.py for the table itself and how a row runs.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from shardattn.ops import lse_merge as merge_mod

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


def override(args: dict[str, Any], kw: dict[str, Any], over: dict[str, Any], *inputs: Any) -> None:
    """Put each value of ``over`` in place of the positional argument of that name in ``args``, or
    else as the keyword ``kw[name]``; a callable value is first called on ``inputs`` (a row's bad
    argument is often derived from the valid ones)."""
    for name, value in over.items():
        value = value(*inputs) if callable(value) else value
        (args if name in args else kw)[name] = value


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
    ("shardattn.ops.sparse_mla", "sparse_mla_reference"),
    ("shardattn.ops.sparse_mla", "sparse_mla_per_query"),
    ("shardattn.ops.sparse_mla_grouped", "sparse_mla_reference"),
    ("shardattn.ops.sparse_mla_grouped", "launch_attention"),
    ("shardattn.ops.sparse_mla_grouped", "launch_gluon_attention"),
    ("shardattn.ops.prepared_union", "build_union"),
    ("shardattn.ops.sparse_mla_decode", "run_sparse_mla_decode"),
    ("shardattn.ops.sparse_mla_decode", "decode_rows"),
    ("shardattn.ops.unique_rows", "launch_unique_rows"),
    ("shardattn.ops.unique_rows", "unique_rows_reference"),
    ("shardattn.ops.gqa_decode_reference", "sparse_mla_reference"),
    ("shardattn.ops.gqa_decode", "gqa_paged_decode_reference"),
    ("shardattn.ops.gqa_decode", "run_triton"),
    ("shardattn.ops.lse_merge", "lse_merge_reference"),
    ("shardattn.ops.lse_merge", "launch_lse_merge"),
    ("shardattn.ops.topk", "convert_topk_reference"),
    ("shardattn.ops.union", "build_union_reference"),
    ("shardattn.ops.union", "sort_union"),
    ("shardattn.ops.union", "fused_union"),
    ("shardattn.ops.gqa_prefill_kernels", "segment_attention_reference"),
    ("shardattn.ops.kv_fp8", "quantize_kv_reference"),
    ("shardattn.ops.kv_fp8", "_launch"),
    ("shardattn.kernels.fa4", "_run"),
]


@contextlib.contextmanager
def spy_kernels() -> Iterator[list[str]]:
    """Wrap every entry of :data:`KERNELS` so that calls are recorded (and still run)."""
    called: list[str] = []
    saved = []
    for mod_name, attr in KERNELS:
        mod = importlib.import_module(mod_name)
        if not hasattr(mod, attr):  # a renamed launcher must not drop out of the watch silently
            raise AttributeError(f"bad-input spy: {mod_name} has no {attr}; update KERNELS")
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
