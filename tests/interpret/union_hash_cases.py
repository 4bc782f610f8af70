"""The hashed union builder under the interpreter, on fresh random inputs, against the torch reference.

Run as ``TRITON_INTERPRET=1 python -m tests.interpret.union_hash_cases`` (tests/test_union_hash.py
does this in a subprocess). Each hypothesis example draws ``G``, ``T`` (tails included), ``K``, the
KV rows, invalid entries anywhere, duplicates within a row, rows with no valid key and
``topk_length``; ``method="hash"`` must give the reference's ``lens`` and, per group, the same
entries (rows and membership bits) in any order. Prints one line per check, exits 1 on a mismatch.
"""

from __future__ import annotations

import sys

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardattn.kernels.registry import interpreter_enabled
from shardattn.kernels.union import build_union, build_union_reference
from tests.interpret.union_cases import make_rows

FAILURES: list[str] = []
CHECKS: list[str] = []


def same_sets(got, want) -> bool:
    """``lens`` equal and each group's first ``lens[g]`` entries equal as sets (no repeats)."""
    (ug, lg), (uw, lw) = got, want
    if not torch.equal(lg, lw):
        return False
    for g, n in enumerate(lw.tolist()):
        a, b = ug[g, :n].tolist(), uw[g, :n].tolist()
        if len(set(a)) != n or sorted(a) != sorted(b):
            return False
    return True


def _report(name: str, ok: bool) -> None:
    CHECKS.append(name)
    print(f"{'ok  ' if ok else 'FAIL'} {name}", flush=True)
    if not ok:
        FAILURES.append(name)


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(
    group_size=st.sampled_from([2, 4, 8]),
    tokens=st.integers(1, 21),
    topk=st.integers(1, 40),
    num_kv_rows=st.integers(1, 60),
    use_length=st.booleans(),
    seed=st.integers(0, 10_000),
)
def hash_matches_reference(group_size, tokens, topk, num_kv_rows, use_length, seed):
    rows = make_rows(seed, tokens, topk, num_kv_rows, sort=False)
    gen = torch.Generator().manual_seed(seed + 1)
    length = torch.randint(0, topk + 2, (tokens,), generator=gen, dtype=torch.int32) if use_length else None
    kw = {"group_size": group_size, "num_kv_rows": num_kv_rows, "topk_length": length}
    got = build_union(rows, method="hash", **kw)
    name = f"G={group_size},T={tokens},K={topk},R={num_kv_rows},len={use_length},seed={seed}"
    _report(f"hash[{name}]", same_sets(got, build_union_reference(rows, **kw)))


def edges() -> None:
    """Every G on a tail shape; the largest packable row listed by all 8 queries (its entry is -2,
    next to the empty slot's -1); a group whose rows are all the same row; a group with no key."""
    for g in (2, 4, 8):
        for use_length in (False, True):
            hash_matches_reference.hypothesis.inner_test(g, 13, 20, 30, use_length, 10 * g + use_length)
    top = 2**24 - 2
    rows = torch.full((16, 5), -1, dtype=torch.int32)
    rows[:8, 0] = top  # group 0: row 2**24 - 2 in every query (entry 0xFFFFFFFE)
    rows[:8, 1] = 3
    rows[8:12, :] = 7  # group 1: one row, listed five times by four queries
    kw = {"group_size": 8, "num_kv_rows": 2**24 - 1}
    got = build_union(rows, method="hash", **kw)
    _report("hash[top row in all 8 queries, repeats, keyless tail]", same_sets(got, build_union_reference(rows, **kw)))
    _report("hash[entry -2 present]", -2 in got[0][0, : int(got[1][0])].tolist())


def main() -> int:
    if not interpreter_enabled():
        print("run with TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    edges()
    hash_matches_reference()
    print(f"{len(FAILURES)} failures of {len(CHECKS)}: {FAILURES[:5]}", flush=True)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
