"""Destinations laid over inputs, on the Triton kernels under the interpreter.

Run as ``TRITON_INTERPRET=1 python -m tests.interpret.alias_cases`` (tests/test_alias_destinations.py
does this in a subprocess). Each case lays a destination over an input such that one program
writes its result over what a later program reads (the interpreter runs programs in grid order,
as a GPU may): the call must raise ``ValueError`` naming both before any kernel runs, and with the
check taken out the same call must give a result unlike the one on separate buffers (the wrong
result the refusal replaces). Prints one line per check and exits 1 on any failure.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import Any

import torch

from shardattn.ops import lse_merge as merge_mod
from shardattn.ops import sparse_mla_decode as decode_mod
from shardattn.ops import sparse_mla_grouped as grouped_mod
from shardattn.ops import topk as topk_mod
from shardattn.ops import union as union_mod
from shardattn.ops.dispatch import interpreter_enabled

FAILURES: list[str] = []
T, H, D, V = 4, 16, 48, 32


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _queries_before_out(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` copied into a buffer with ``out [T, H, V]`` laid over it so that ``out[t]`` covers
    ``q[t + 1]``: the program of token ``t`` writes over the queries the next one reads."""
    buf = torch.zeros(T + 1, H, D)
    buf[:T] = q
    return buf[:T], buf.view(-1)[H * D :][: T * H * V].view(T, H, V)


def grouped_out_over_q() -> tuple[Callable[[], Any], Callable[[], Any]]:
    g = _gen(1)
    q, kv = torch.randn(T, H, D, generator=g), torch.randn(20, D, generator=g)
    rows = torch.randint(-1, 20, (T, 8), generator=g, dtype=torch.int32)
    kw = {"scale": 0.1, "v_dim": V, "group_size": 1}
    qa, out = _queries_before_out(q)
    return (
        lambda: grouped_mod.sparse_mla_grouped_prefill(qa, kv, rows, out=out, **kw)[0],
        lambda: grouped_mod.sparse_mla_grouped_prefill(q, kv, rows, **kw)[0],
    )


def grouped_out_over_kv() -> tuple[Callable[[], Any], Callable[[], Any]]:
    g = _gen(2)
    q, kv = torch.randn(T, H, D, generator=g), torch.randn(20, D, generator=g)
    rows = torch.randint(-1, 20, (T, 8), generator=g, dtype=torch.int32)
    kw = {"scale": 0.1, "v_dim": V, "group_size": 1}
    buf = torch.zeros(T * H * V)
    buf[: 20 * D] = kv.view(-1)
    out = buf.view(T, H, V)  # token 0 writes over keys the later tokens read
    return (
        lambda: grouped_mod.sparse_mla_grouped_prefill(q, buf[: 20 * D].view(20, D), rows, out=out, **kw)[0],
        lambda: grouped_mod.sparse_mla_grouped_prefill(q, kv, rows, **kw)[0],
    )


def decode_out_over_q() -> tuple[Callable[[], Any], Callable[[], Any]]:
    g = _gen(3)
    q, kv = torch.randn(T, H, D, generator=g), torch.randn(20, D, generator=g)
    rows = torch.randint(-1, 20, (T, 8), generator=g, dtype=torch.int32)
    kw = {"scale": 0.1, "v_dim": V, "backend": "triton"}
    qa, out = _queries_before_out(q)
    return (
        lambda: decode_mod.sparse_mla_decode(qa, kv, rows, out=out, **kw)[0],
        lambda: decode_mod.sparse_mla_decode(q, kv, rows, **kw)[0],
    )


def decode_workspace_over_kv() -> tuple[Callable[[], Any], Callable[[], Any]]:
    g, r = _gen(4), 300
    q, kv = torch.randn(T, H, D, generator=g), torch.randn(r, D, generator=g)
    rows = torch.randint(-1, r, (T, 256), generator=g, dtype=torch.int32)  # enough for split partials
    kw = {"scale": 0.1, "v_dim": V, "backend": "triton"}
    workspace = torch.zeros(100_000)
    workspace[: r * D] = kv.view(-1)  # the split partials land on keys other splits read
    return (
        lambda: decode_mod.sparse_mla_decode(q, workspace[: r * D].view(r, D), rows, workspace=workspace, **kw)[0],
        lambda: decode_mod.sparse_mla_decode(q, kv, rows, **kw)[0],
    )


def merge_out_over_outs() -> tuple[Callable[[], Any], Callable[[], Any]]:
    g = _gen(5)
    outs, lses = torch.randn(2, 40, 4, 64, generator=g), torch.randn(2, 40, 4, generator=g)
    given = outs.clone()
    out = given.view(-1)[64 * 64 :][: 40 * 4 * 64].view(40, 4, 64)  # 64 rows a program: over the next one's
    return (lambda: merge_mod.lse_merge(given, lses, out=out)[0], lambda: merge_mod.lse_merge(outs, lses)[0])


def topk_out_over_positions() -> tuple[Callable[[], Any], Callable[[], Any]]:
    pos = torch.tensor([[0, 5, -1, 9], [3, 4, 8, 2], [1, 2, 3, 0]], dtype=torch.int32)
    req = torch.tensor([0, 1, 1], dtype=torch.int32)
    table = torch.tensor([[2, 0, 1], [1, 3, -1]], dtype=torch.int32)
    buf = torch.zeros(16, dtype=torch.int32)
    buf[:12] = pos.view(-1)
    out = buf[4:].view(3, 4)  # token t's rows over token t + 1's positions
    return (
        lambda: topk_mod.convert_topk(buf[:12].view(3, 4), req, table, block_size=4, out=out)[0],
        lambda: topk_mod.convert_topk(pos, req, table, block_size=4)[0],
    )


def union_out_over_rows() -> tuple[Callable[[], Any], Callable[[], Any]]:
    rows = torch.randint(-1, 20, (T, 8), generator=_gen(6), dtype=torch.int32)
    buf = torch.zeros(T + 1, 8, dtype=torch.int32)
    buf[:T] = rows
    out = (buf[1:], torch.zeros(T, dtype=torch.int32))  # token t's union over token t + 1's rows
    kw = {"group_size": 1, "num_kv_rows": 20, "method": "bitmap"}

    def used(res: tuple[torch.Tensor, torch.Tensor]) -> list[list[int]]:
        union, lens = res
        return [union[i, :n].tolist() for i, n in enumerate(lens.tolist())]

    return (
        lambda: used(union_mod.build_union(buf[:T], out=out, **kw)),
        lambda: used(union_mod.build_union(rows, **kw)),
    )


CASES = [
    ("sparse_mla_grouped_prefill out over q", grouped_out_over_q, r"^out shares memory with q\b"),
    ("sparse_mla_grouped_prefill out over kv", grouped_out_over_kv, r"^out shares memory with kv\b"),
    ("sparse_mla_decode out over q", decode_out_over_q, r"^out shares memory with q\b"),
    ("sparse_mla_decode workspace over kv", decode_workspace_over_kv, r"^workspace shares memory with kv\b"),
    ("lse_merge out over outs", merge_out_over_outs, r"^out shares memory with outs\b"),
    ("convert_topk out over topk_pos", topk_out_over_positions, r"^out shares memory with topk_pos\b"),
    ("build_union out over rows", union_out_over_rows, r"^out\[0\] shares memory with rows\b"),
]

#: (module, name) of each check the cases take out to show the result it replaces.
CHECKS = [
    (grouped_mod, "check_destinations"),
    (decode_mod, "check_destinations"),
    (merge_mod, "check_not_inputs"),
    (topk_mod, "check_not_inputs"),
    (union_mod, "check_not_inputs"),
]


def _same(a: Any, b: Any) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def _report(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        FAILURES.append(name)


def run_case(name: str, make: Callable[[], Any], match: str) -> None:
    aliased, _ = make()
    try:
        aliased()
    except ValueError as e:
        _report(f"{name}: refused", re.search(match, str(e)) is not None, str(e))
    else:
        _report(f"{name}: refused", False, "no error raised")
    saved = [(mod, attr, getattr(mod, attr, None)) for mod, attr in CHECKS]
    for mod, attr, _ in saved:
        setattr(mod, attr, lambda *a, **k: None)
    try:
        aliased, separate = make()  # fresh buffers: the refused call wrote nothing
        want = separate()
        _report(f"{name}: wrong without the check", not _same(aliased(), want))
    finally:
        for mod, attr, orig in saved:
            if orig is None:
                delattr(mod, attr)
            else:
                setattr(mod, attr, orig)


def main() -> int:
    if not interpreter_enabled():
        print("set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    for name, make, match in CASES:
        run_case(name, make, match)
    print(f"{len(FAILURES)} failures: {FAILURES}")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
