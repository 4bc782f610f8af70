"""The fused union builder under the interpreter, on fresh random inputs, against the old builders.

Run as ``TRITON_INTERPRET=1 python -m tests.interpret.union_cases`` (tests/test_union_fused.py does
this in a subprocess). Each hypothesis example draws ``G``, ``T`` (tails included), ``K``, the KV
rows, invalid entries anywhere, duplicates within a row, rows with no valid key, ``topk_length``
and whether the rows arrive sorted; the fused builder (``rows_sorted`` as drawn, and ``False``)
must equal the torch reference and the sorting Triton builder (``"sort"``) exactly:
``lens`` and every entry below it. Prints one line per check and exits 1 on any mismatch.
"""

from __future__ import annotations

import sys

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardattn.ops.dispatch import interpreter_enabled
from shardattn.ops.union import build_union, build_union_reference, unpack_entries

FAILURES: list[str] = []
CHECKS: list[str] = []


def _equal(a, b) -> bool:
    (ua, la), (ub, lb) = a, b
    return torch.equal(la, lb) and all(torch.equal(ua[i, :n], ub[i, :n]) for i, n in enumerate(lb.tolist()))


def _report(name: str, ok: bool) -> None:
    CHECKS.append(name)
    print(f"{'ok  ' if ok else 'FAIL'} {name}", flush=True)
    if not ok:
        FAILURES.append(name)


def make_rows(seed: int, tokens: int, topk: int, num_kv_rows: int, sort: bool) -> torch.Tensor:
    """Random rows: invalid (-1, negative, past the cache) anywhere, duplicates, empty rows; ``sort``:
    each row's valid entries ascending (the invalid ones stay where they are)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(-2, num_kv_rows + 3, (tokens, topk), generator=gen, dtype=torch.int32)
    rows[torch.rand(tokens, topk, generator=gen) < 0.3] = -1
    if tokens > 2:
        rows[1] = -1  # no valid key
        rows[2, : topk // 2] = rows[2, topk - topk // 2 :]  # duplicates within a row
    if tokens > 4:
        rows[3] = rows[4]  # identical neighbours
    if sort:
        valid = (rows >= 0) & (rows < num_kv_rows)
        for t in range(tokens):
            rows[t, valid[t]] = rows[t, valid[t]].sort().values
    return rows


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(
    group_size=st.sampled_from([1, 2, 4, 8]),
    tokens=st.integers(1, 19),
    topk=st.integers(1, 40),
    num_kv_rows=st.integers(1, 60),
    sort=st.booleans(),
    use_length=st.booleans(),
    seed=st.integers(0, 10_000),
)
def fused_matches_old(group_size, tokens, topk, num_kv_rows, sort, use_length, seed):
    rows = make_rows(seed, tokens, topk, num_kv_rows, sort)
    gen = torch.Generator().manual_seed(seed + 1)
    length = torch.randint(0, topk + 2, (tokens,), generator=gen, dtype=torch.int32) if use_length else None
    kw = {"group_size": group_size, "num_kv_rows": num_kv_rows, "topk_length": length}
    want = build_union_reference(rows, **kw)
    old = build_union(rows, method="sort", **kw)
    name = f"G={group_size},T={tokens},K={topk},R={num_kv_rows},sorted={sort},len={use_length},seed={seed}"
    _report(f"old[{name}]", _equal(old, want))
    for rows_sorted in {False, sort}:
        got = build_union(rows, method="fused", rows_sorted=rows_sorted, **kw)
        _report(f"fused[{name},rows_sorted={rows_sorted}]", _equal(got, want) and _equal(got, old))


def grid() -> None:
    """Every G x sorted / unsorted x with / without ``topk_length`` on a tail shape (T = 13)."""
    for g in (1, 2, 4, 8):
        for sort in (False, True):
            for use_length in (False, True):
                seed = 100 * g + 2 * sort + use_length
                fused_matches_old.hypothesis.inner_test(g, 13, 20, 30, sort, use_length, seed)


def _members(union, lens, group_size) -> set[tuple[int, int, int]]:
    out = set()
    for g, n in enumerate(lens.tolist()):
        rows, bits = unpack_entries(union[g, :n]) if group_size > 1 else (union[g, :n].long(), None)
        for i, r in enumerate(rows.tolist()):
            for j in range(group_size):
                if bits is None or (int(bits[i]) >> j) & 1:
                    out.add((g, r, j))
    return out


def broken_order_stays_in_bounds() -> None:
    """``rows_sorted=True`` on rows that are not sorted: an unspecified union, but ``lens`` within the
    width, entries sorted and unique, and every (row, member) one the query really listed."""
    for g in (1, 2, 4, 8):
        rows = make_rows(7 + g, 11, 17, 30, sort=False)
        want = _members(*build_union_reference(rows, group_size=g, num_kv_rows=30), g)
        union, lens = build_union(rows, group_size=g, num_kv_rows=30, method="fused", rows_sorted=True)
        ok = bool((lens <= g * 17).all())
        for i, n in enumerate(lens.tolist()):
            r = (union[i, :n].long() & 0xFFFFFF) if g > 1 else union[i, :n].long()
            ok = ok and r.tolist() == sorted(set(r.tolist()))
        _report(f"broken_order[G={g}]", ok and _members(union, lens, g) <= want)


def run_checks(*checks) -> int:
    """Run each check (they report through ``_report``) under the interpreter; the exit status."""
    if not interpreter_enabled():
        print("run with TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    for check in checks:
        check()
    print(f"{len(FAILURES)} failures of {len(CHECKS)}: {FAILURES[:5]}", flush=True)
    return 1 if FAILURES else 0


def main() -> int:
    return run_checks(grid, fused_matches_old, broken_order_stays_in_bounds)


if __name__ == "__main__":
    sys.exit(main())
