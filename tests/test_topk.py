"""Top-k conversion (the CPU path against hand-derived rows and the plain-loop oracle of tests/oracle.py;
the Triton kernel against that oracle under the interpreter: tests/interpret/topk_cases.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardattn.ops.dispatch import triton_available
from shardattn.ops.topk import DcpShard, convert_topk
from tests.interpret import run_cases
from tests.oracle import topk_rows_oracle


def test_convert_known_rows_and_counts():
    pos = torch.tensor([[0, 5, -1, 9, 12], [3, 4, 8, 2, 1]], dtype=torch.int32)
    req = torch.tensor([0, 1], dtype=torch.int32)
    table = torch.tensor([[2, 0, 1], [1, 3, -1]], dtype=torch.int32)
    rows, counts = convert_topk(pos, req, table, block_size=4)
    # 12 // 4 = 3 is past the table's width; request 1's block 2 is unallocated (-1)
    assert rows.tolist() == [[8, 1, -1, 5, -1], [7, 12, -1, 6, 5]]
    assert counts.tolist() == [3, 4]


def test_seq_lens_topk_length_and_block_stride():
    pos = torch.tensor([[0, 5, 6, 7]], dtype=torch.int32)
    req = torch.zeros(1, dtype=torch.int32)
    table = torch.tensor([[3, 1]], dtype=torch.int32)
    rows, counts = convert_topk(
        pos, req, table, block_size=4, block_stride=10,
        seq_lens=torch.tensor([7], dtype=torch.int32), topk_length=torch.tensor([3], dtype=torch.int32),
    )  # fmt: skip
    assert rows.tolist() == [[30, 11, 12, -1]]  # 7 >= seq_len and index 3 >= topk_length
    assert counts.tolist() == [3]


def test_position_at_seq_len_is_invalid():
    pos = torch.tensor([[3, 4, 5]], dtype=torch.int32)
    rows, counts = convert_topk(
        pos, torch.zeros(1, dtype=torch.int32), torch.tensor([[0, 1]], dtype=torch.int32), block_size=4,
        seq_lens=torch.tensor([4], dtype=torch.int32),
    )  # fmt: skip
    assert rows.tolist() == [[3, -1, -1]] and counts.tolist() == [1]


def test_a_row_at_int32_max_is_kept_and_the_next_is_invalid():
    """The largest row that fits int32 is a row (``<= 2**31 - 1``); one past it is ``-1``. Block
    ``entry`` of stride 8 holds rows ``8 * entry + i``: the last block below int32's top ends at
    ``2**31 - 1``, the next starts past it; positions out of order, a -1, ``packed`` too."""
    top = (2**31 - 1) // 8  # block of rows [2**31 - 8, 2**31 - 1]
    table = torch.tensor([[top, top + 1, 3]], dtype=torch.int32)
    pos = torch.tensor([[7, 6, -1, 8, 0, 17, 15]], dtype=torch.int32)
    req = torch.zeros(1, dtype=torch.int32)
    want = topk_rows_oracle(pos, req, table, block_size=8)
    assert want.tolist() == [[2**31 - 1, 2**31 - 2, -1, -1, 2**31 - 8, 25, -1]]  # the oracle, by hand
    rows, counts = convert_topk(pos, req, table, block_size=8)
    assert torch.equal(rows, want) and counts.tolist() == [4]
    rows, counts = convert_topk(pos, req, table, block_size=8, packed=True)
    assert rows.tolist() == [[2**31 - 1, 2**31 - 2, 2**31 - 8, 25, -1, -1, -1]] and counts.tolist() == [4]


def test_bad_request_id_empties_the_row():
    pos = torch.tensor([[0, 1]], dtype=torch.int32)
    rows, counts = convert_topk(pos, torch.tensor([5], dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32),
                                block_size=4)  # fmt: skip
    assert rows.tolist() == [[-1, -1]] and counts.tolist() == [0]


@settings(max_examples=25, deadline=None, derandomize=True)
@given(world=st.integers(1, 4), inter=st.integers(1, 3), block=st.sampled_from([1, 2, 4]), seed=st.integers(0, 99))
def test_dcp_ranks_partition_the_valid_positions(world, inter, block, seed):
    """Every valid position is kept by exactly its owner rank, at the DCP layout's local index."""
    gen = torch.Generator().manual_seed(seed)
    ctx = 40
    pos = torch.randint(-2, ctx, (6, 10), generator=gen, dtype=torch.int32)
    req = torch.zeros(6, dtype=torch.int32)
    blocks = -(-ctx // block) + 1
    table = torch.arange(blocks, dtype=torch.int32)[None, :]  # identity: row == local position
    owners = torch.zeros_like(pos)
    for rank in range(world):
        rows, counts = convert_topk(pos, req, table, block_size=block, dcp=DcpShard(world, inter, rank))
        p = pos.long()
        mine = (pos >= 0) & ((p // inter) % world == rank)
        local = (p // (world * inter)) * inter + p % inter
        assert torch.equal(rows, torch.where(mine, local, -1).to(torch.int32))
        assert torch.equal(counts, mine.sum(1, dtype=torch.int32))
        owners += mine.int()
    assert torch.equal(owners, (pos >= 0).int())


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"topk_pos": torch.zeros(2, 3)}, TypeError, "topk_pos must have dtype"),
        ({"req_ids": torch.zeros(3, dtype=torch.int32)}, ValueError, "req_ids must have shape"),
        ({"block_size": 0}, ValueError, "block_size must be >= 1"),
        ({"dcp": DcpShard(2, 1, 2)}, ValueError, "dcp must have"),
        ({"seq_lens": torch.zeros(5, dtype=torch.int32)}, ValueError, "seq_lens must have shape"),
    ],
    ids=["float-positions", "req-ids-shape", "block-size", "dcp-rank", "seq-lens-shape"],
)
def test_bad_inputs_raise_naming_the_argument(kwargs, error, match):
    args = {
        "topk_pos": torch.zeros(2, 3, dtype=torch.int32),
        "req_ids": torch.zeros(2, dtype=torch.int32),
        "block_table": torch.zeros(1, 4, dtype=torch.int32),
        "block_size": 4,
    }
    args.update(kwargs)
    pos, req, table = args.pop("topk_pos"), args.pop("req_ids"), args.pop("block_table")
    with pytest.raises(error, match=match):
        convert_topk(pos, req, table, **args)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    block=st.sampled_from([1, 2, 4]),
    stride=st.sampled_from([None, 5, 2**29]),
    use_seq=st.booleans(),
    use_len=st.booleans(),
    dcp=st.sampled_from([None, (2, 1, 0), (2, 1, 1), (3, 2, 2)]),
    seed=st.integers(0, 2**16),
)
def test_cpu_path_matches_the_loop_oracle(block, stride, use_seq, use_len, dcp, seed):
    """Bad request ids, unallocated blocks, blocks past the table, seq_lens, topk_length, DCP shards,
    and rows past int32 (a huge block stride), against plain loops over the documented rule."""
    gen = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))
    tokens, k, batch, width = draw(3, 6), draw(4, 9), draw(1, 3), draw(1, 4)
    pos = torch.randint(-3, 4 * block + 3, (tokens, k), generator=gen, dtype=torch.int32)
    req = torch.randint(-1, batch + 1, (tokens,), generator=gen, dtype=torch.int32)
    table = torch.randint(-1, 9, (batch, width), generator=gen, dtype=torch.int32)
    seq = torch.randint(0, 4 * block + 2, (batch,), generator=gen, dtype=torch.int32) if use_seq else None
    if seq is not None:  # the edges: a position at seq_lens[req] (invalid) and just below it
        edge = seq[req.clamp(0, batch - 1).long()]
        pos[:, 0] = edge
        pos[:, -1] = edge - 1
    length = torch.randint(0, k + 2, (tokens,), generator=gen, dtype=torch.int32) if use_len else None
    kw = dict(block_size=block, block_stride=stride, seq_lens=seq, topk_length=length)
    shard = None if dcp is None else DcpShard(*dcp)
    rows, counts = convert_topk(pos, req, table, dcp=shard, **kw)
    want = topk_rows_oracle(pos, req, table, dcp=dcp, **kw)
    assert torch.equal(rows, want), (rows, want)
    assert torch.equal(counts, (want >= 0).sum(dim=1, dtype=torch.int32))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(use_len=st.booleans(), dcp=st.sampled_from([None, (2, 1, 0), (3, 2, 2)]), seed=st.integers(0, 2**16))
def test_packed_rows_are_the_valid_rows_in_order_then_minus_one(use_len, dcp, seed):
    """``packed=True``: each token's valid rows (the unpacked call's, in its order) at the front,
    ``-1`` after them; the counts are the unpacked call's; ``out`` receives the packed rows."""
    gen = torch.Generator().manual_seed(seed)
    tokens, k, batch, width = 5, int(torch.randint(1, 40, (1,), generator=gen)), 3, 6
    pos = torch.randint(-3, 30, (tokens, k), generator=gen, dtype=torch.int32)
    req = torch.randint(-1, batch + 1, (tokens,), generator=gen, dtype=torch.int32)
    table = torch.randint(-1, 9, (batch, width), generator=gen, dtype=torch.int32)
    length = torch.randint(0, k + 2, (tokens,), generator=gen, dtype=torch.int32) if use_len else None
    kw = dict(block_size=4, topk_length=length, dcp=None if dcp is None else DcpShard(*dcp))
    want = topk_rows_oracle(pos, req, table, block_size=4, topk_length=length, dcp=dcp)
    out = torch.full((tokens, k), 99, dtype=torch.int32)
    rows, counts = convert_topk(pos, req, table, packed=True, out=out, **kw)
    assert rows is out and torch.equal(counts, (want >= 0).sum(dim=1, dtype=torch.int32))
    for t in range(tokens):
        valid = want[t][want[t] >= 0]
        assert torch.equal(rows[t, : valid.numel()], valid) and (rows[t, valid.numel() :] == -1).all()


def test_packed_must_be_a_bool():
    pos, req, table = (
        torch.zeros(1, 2, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
        torch.zeros(1, 1, dtype=torch.int32),
    )
    with pytest.raises(TypeError, match="packed must be a bool"):
        convert_topk(pos, req, table, block_size=4, packed=1)


@pytest.mark.interpret
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_kernel_matches_the_oracle_under_interpreter():
    lines = run_cases("topk_cases")
    names = [ln.split(maxsplit=1)[1] for ln in lines if ln.startswith("ok")]
    assert sum(n.startswith("topk[") for n in names) >= 30
    assert any("dcp=(1, 2147483647, 0)" in n for n in names) and any("packed=True" in n for n in names)
    assert sum(n.startswith("dcp_round_past_int32") for n in names) == 3
    assert lines[-1].startswith("0 failures")


def test_dcp_round_past_int32_is_refused_naming_dcp():
    pos = torch.zeros(1, 2, dtype=torch.int32)
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"dcp must have world \* interleave <= 2147483647"):
        convert_topk(pos, torch.zeros(1, dtype=torch.int32), table, block_size=4, dcp=DcpShard(2, 2**30, 0))
