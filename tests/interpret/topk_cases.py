"""The top-k conversion kernel under the interpreter, on fresh random inputs, against an
independent oracle (tests/oracle.py's Python loops over the contract of :mod:`shardattn.ops.topk`).

Run as ``TRITON_INTERPRET=1 python -m tests.interpret.topk_cases`` (tests/test_topk.py does this in
a subprocess). Each hypothesis example draws ``T``, ``K`` (0, tails, several kernel blocks), the
block table (unallocated blocks), request ids out of range, positions near int32's top, request
lengths, ``topk_length`` (negative, partial, past ``K``), a block stride, a DCP shard (up to
``world * interleave = 2**31 - 1``, int32's largest position round) and ``packed``; the kernel's
rows and counts must equal the oracle's exactly. A DCP shard whose ``world * interleave`` passes
int32 is a ``ValueError`` naming ``dcp`` before the kernel runs (the kernel computes that product
in int32). Prints one line per check and exits 1 on any mismatch.
"""

from __future__ import annotations

import sys

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardattn.ops.topk import DcpShard, convert_topk
from tests.interpret.union_cases import _report, run_checks
from tests.oracle import topk_rows_oracle

INT32_MAX = 2**31 - 1


def oracle(pos, req, table, *, packed, **kw):
    """``(rows [T, K], counts [T])`` int32 of the contract: tests/oracle.py's loops, packed here."""
    rows = topk_rows_oracle(pos, req, table, **kw)
    counts = (rows >= 0).sum(dim=1, dtype=torch.int32)
    if packed:  # each token's valid rows in order at the front
        rows = torch.stack([torch.cat([r[r >= 0], r[r < 0]]) for r in rows]) if rows.numel() else rows
    return rows, counts


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(
    tokens=st.integers(1, 6),
    topk=st.sampled_from([0, 1, 5, 16, 37, 1030]),
    batch=st.integers(1, 3),
    width=st.integers(1, 5),
    block_size=st.sampled_from([1, 3, 4, 64]),
    extra_stride=st.sampled_from([0, 5, 2**28]),
    high_positions=st.booleans(),
    with_seq=st.booleans(),
    with_length=st.booleans(),
    dcp=st.sampled_from(
        [None, (1, 1, 0), (2, 1, 1), (3, 2, 2), (2, 2**30 - 1, 1), (3, 715827882, 0), (1, INT32_MAX, 0)]
    ),
    packed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def kernel_matches_oracle(
    tokens, topk, batch, width, block_size, extra_stride, high_positions, with_seq, with_length, dcp, packed, seed
):
    gen = torch.Generator().manual_seed(seed)
    span = width * block_size * (dcp[0] if dcp else 1) + 3
    pos = torch.randint(-2, span, (tokens, topk), generator=gen, dtype=torch.int32)
    if high_positions:  # past every block, and the int32 top for large interleaves
        pos[:, ::2] = torch.randint(INT32_MAX - 40, INT32_MAX, pos[:, ::2].shape, generator=gen, dtype=torch.int32)
    req = torch.randint(-1, batch + 1, (tokens,), generator=gen, dtype=torch.int32)  # -1 and batch: bad ids
    table = torch.randint(-1, 30, (batch, width), generator=gen, dtype=torch.int32)  # -1: unallocated
    seq = torch.randint(0, span, (batch,), generator=gen, dtype=torch.int32) if with_seq else None
    length = torch.randint(-1, topk + 2, (tokens,), generator=gen, dtype=torch.int32) if with_length else None
    shard = None if dcp is None else DcpShard(*dcp)
    kw = dict(block_size=block_size, block_stride=block_size + extra_stride, seq_lens=seq, topk_length=length)
    got = convert_topk(pos, req, table, dcp=shard, packed=packed, **kw)
    want = oracle(pos, req, table, dcp=dcp, packed=packed, **kw)
    name = f"topk[T={tokens},K={topk},bs={block_size},stride+{extra_stride},dcp={dcp},packed={packed}]"
    _report(name, torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]))


def dcp_round_past_int32() -> None:
    """world * interleave past int32: refused before the kernel (it wrapped there and read the
    block table out of bounds)."""
    pos = torch.tensor([[0, 1, 5, 9]], dtype=torch.int32)
    req = torch.zeros(1, dtype=torch.int32)
    table = torch.tensor([[3, 1, 2]], dtype=torch.int32)
    for dcp in (DcpShard(2, 2**30, 0), DcpShard(2, INT32_MAX, 1), DcpShard(INT32_MAX, 2, 0)):
        try:
            convert_topk(pos, req, table, block_size=4, dcp=dcp)
        except ValueError as e:
            _report(f"dcp_round_past_int32[{tuple(dcp)}]", "dcp" in str(e) and "world * interleave" in str(e))
        else:
            _report(f"dcp_round_past_int32[{tuple(dcp)}]", False)


def row_at_int32_top() -> None:
    """The largest row that fits int32 is a row; one past it is -1 (block ``top`` of 8 rows ends at
    ``2**31 - 1``, block ``top + 1`` starts past it), plain and packed, against the oracle."""
    top = INT32_MAX // 8
    table = torch.tensor([[top, top + 1, 3]], dtype=torch.int32)
    pos = torch.tensor([[7, 6, -1, 8, 0, 17, 15]], dtype=torch.int32)
    req = torch.zeros(1, dtype=torch.int32)
    for packed in (False, True):
        got = convert_topk(pos, req, table, block_size=8, packed=packed)
        want = oracle(pos, req, table, block_size=8, packed=packed)
        same = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        _report(f"row_at_int32_top[packed={packed}]", same and INT32_MAX in got[0][0].tolist() and int(got[1][0]) == 4)


def main() -> int:
    return run_checks(kernel_matches_oracle, dcp_round_past_int32, row_at_int32_top)


if __name__ == "__main__":
    sys.exit(main())
