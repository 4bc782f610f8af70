"""The hash de-duplication kernel under the interpreter, on fresh random inputs, against an
independent oracle (a Python loop keeping each row at its first occurrence, -1 elsewhere).

Run as ``TRITON_INTERPRET=1 python -m tests.interpret.unique_rows_cases``
(tests/test_unique_rows.py does this in a subprocess). Each hypothesis example draws ``T``,
``K`` (not a power of two, tails included), the cache size, invalid entries anywhere, duplicates
within a row, rows with no valid key, int32 or int64 rows, ``topk_length`` and the parts a token
is spread over (or the default); a grid adds a row of one row repeated, rows past the cache,
tables small enough that collisions take many rounds, and the public
:func:`~shardattn.ops.unique_rows.unique_rows` on rows ``R - 1``, ``R`` and ``R + 1`` (the bound
the op hands the kernel). The kernel's ``out`` must equal the oracle's exactly, every entry
(it starts as ``-7``, so an entry no program writes fails). Prints one line per check and exits
1 on any mismatch.
"""

from __future__ import annotations

import sys

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardattn.kernels.triton.unique_rows import launch_unique_rows
from shardattn.ops.unique_rows import unique_rows
from tests.interpret.union_cases import _report, make_rows, run_checks


def oracle(rows: torch.Tensor, num_kv_rows: int, length: torch.Tensor | None) -> torch.Tensor:
    t, k = rows.shape
    out = torch.full((t, k), -1, dtype=torch.int32)
    for i in range(t):
        seen: set[int] = set()
        end = k if length is None else max(0, min(k, int(length[i])))  # a negative length: no entry
        for pos, row in enumerate(rows[i, :end].tolist()):
            if 0 <= row < num_kv_rows and row not in seen:
                seen.add(row)
                out[i, pos] = row
    return out


def kernel(rows: torch.Tensor, num_kv_rows: int, length: torch.Tensor | None, parts: int | None = None) -> torch.Tensor:
    out = torch.full(rows.shape, -7, dtype=torch.int32)
    launch_unique_rows(rows, length, num_kv_rows - 1, out, parts=parts)
    return out


def _check(
    name: str, rows: torch.Tensor, num_kv_rows: int, length: torch.Tensor | None, parts: int | None = None
) -> None:
    _report(name, torch.equal(kernel(rows, num_kv_rows, length, parts), oracle(rows, num_kv_rows, length)))


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(
    tokens=st.integers(1, 9),
    topk=st.integers(1, 300),
    num_kv_rows=st.sampled_from([1, 5, 60, 1000, 70_000, 2**31 - 1]),
    use_length=st.booleans(),
    wide=st.booleans(),
    parts=st.sampled_from([None, 1, 2, 8]),
    seed=st.integers(0, 10_000),
)
def matches_oracle(tokens, topk, num_kv_rows, use_length, wide, parts, seed):
    rows = make_rows(seed, tokens, topk, min(num_kv_rows, 10**6), sort=False)
    if num_kv_rows > 10**6:  # rows anywhere in int32, some past the cache in int64
        gen = torch.Generator().manual_seed(seed + 2)
        rows = torch.where(rows >= 0, torch.randint(0, 2**31 - 1, rows.shape, generator=gen, dtype=torch.int32), rows)
    rows = rows.long() if wide else rows
    if wide:
        rows[:, 0] = num_kv_rows + 5  # past the cache in int64
    gen = torch.Generator().manual_seed(seed + 1)
    length = torch.randint(0, topk + 2, (tokens,), generator=gen, dtype=torch.int32) if use_length else None
    parts = None if parts is None else min(parts, max(16, 1 << (topk - 1).bit_length()))  # at most BLOCK
    name = f"T={tokens},K={topk},R={num_kv_rows},len={use_length},int64={wide},parts={parts},seed={seed}"
    _check(f"unique[{name}]", rows, num_kv_rows, length, parts)


def grid() -> None:
    # through the public op (the bound it hands the kernel): rows R - 1, R and R + 1 anywhere, repeated
    for r in (1, 7, 1000):
        gen = torch.Generator().manual_seed(r)
        rows = torch.tensor([-1, r - 1, r, r + 1, 0], dtype=torch.int32)[torch.randint(0, 5, (5, 37), generator=gen)]
        rows[0] = r  # only the row one past the cache: no valid entry
        length = torch.randint(0, 39, (5,), generator=gen, dtype=torch.int32)
        for name, ln in ((f"op_cache_edge[R={r}]", None), (f"op_cache_edge[R={r},len]", length)):
            _report(name, torch.equal(unique_rows(rows, num_kv_rows=r, topk_length=ln), oracle(rows, r, ln)))
    _check("one_row_repeated", torch.full((3, 77), 4, dtype=torch.int32), 10, None)
    _check("one_row_repeated[parts=4]", torch.full((3, 77), 4, dtype=torch.int32), 10, None, 4)
    _check("all_invalid", torch.tensor([[-1, 10, -5, 11]], dtype=torch.int32), 10, None)
    _check("empty_length", torch.arange(8, dtype=torch.int32)[None, :], 10, torch.zeros(1, dtype=torch.int32))
    # every row distinct in a full table of 2 x 512 slots: many rounds of collisions
    gen = torch.Generator().manual_seed(3)
    rows = torch.randperm(50_000, generator=gen)[:1024].to(torch.int32).view(2, 512)
    rows[1, 256:] = rows[1, :256].flip(0)  # the second token lists each row twice, reversed
    for parts in (1, 4, 512):  # 512: a table of two slots a part
        _check(f"full_table[parts={parts}]", rows, 50_000, None, parts)


def main() -> int:
    return run_checks(grid, matches_oracle)


if __name__ == "__main__":
    sys.exit(main())
