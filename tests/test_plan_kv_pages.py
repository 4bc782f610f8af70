"""The pool's page ledger (host-only): sizes per DCP layout, step validation that changes nothing, reuse."""

from __future__ import annotations

import numpy as np
import pytest

from shardattn.plan.context import DCPLayout
from shardattn.plan.kv_pages import KVCacheConfig, PagedKVBook


@pytest.mark.parametrize(
    "world,interleave,seq_len,pages",
    [(1, 1, 17, 5), (2, 1, 17, 3), (2, 4, 17, 3), (4, 2, 17, 2), (4, 1, 3, 1), (2, 1, 0, 0)],
    ids=["replica", "dcp2", "dcp2-I4", "dcp4-I2", "short", "empty"],
)
def test_pages_cover_rank_zero_share(world: int, interleave: int, seq_len: int, pages: int) -> None:
    cfg = KVCacheConfig(page_size=4, layout=DCPLayout(world, interleave), max_requests=3, max_seq_len=32)
    assert cfg.pages_for(seq_len) == pages
    lay = cfg.layout
    assert all(lay.local_len(seq_len, r) <= pages * 4 for r in range(world))  # every rank's share fits
    assert cfg.num_pages == 3 * cfg.pages_for(32) and cfg.rows_per_rank == cfg.num_pages * 4


def test_growth_is_checked_before_anything_changes() -> None:
    book = PagedKVBook(KVCacheConfig(page_size=4, layout=DCPLayout(2), max_requests=2, max_seq_len=20, num_pages=4))
    book.grow([("a", 9)])  # 5 local tokens on rank 0: 2 pages
    assert book.pages("a") == [0, 1] and book.free_pages == 2
    cases = [
        ([("a", 12)], "21 tokens would exceed max_seq_len=20"),
        ([("b", 1), ("c", 1)], "over max_requests=2"),
        ([("b", 20)], "out of KV pages: the step needs 3, 2 of 4 are free"),
        ([("a", 1), ("a", 1)], "appears twice"),
    ]
    book.grow([("a", 0)])
    for growth, match in cases:
        with pytest.raises(ValueError, match=match):
            book.check_growth(growth)
        with pytest.raises(ValueError, match=match):
            book.grow(growth)
        assert book.request_ids == ["a"] and book.free_pages == 2 and book.seq_len("a") == 9
    with pytest.raises(ValueError, match="unknown request id 'z'"):
        book.check_growth([("z", 1)], new_ok=False)
    with pytest.raises(TypeError, match="must be hashable"):
        book.check_growth([(["x"], 1)])


def test_freed_pages_are_reused_and_tables_padded() -> None:
    book = PagedKVBook(KVCacheConfig(page_size=2, layout=DCPLayout(1), max_requests=3, max_seq_len=8))
    book.grow([("a", 3), ("b", 5)])
    assert book.pages("a") == [0, 1] and book.pages("b") == [2, 3, 4]
    assert book.table(["a", "b"]) == [[0, 1, -1], [2, 3, 4]]
    assert book.table(["a"], width=4) == [[0, 1, -1, -1]]
    with pytest.raises(ValueError, match="unknown request id 'c'"):
        book.release(["a", "c"])  # nothing freed
    assert book.free_pages == book.config.num_pages - 5
    assert book.release(["a"]) == 2
    book.grow([("c", 4)])
    assert book.pages("c") == [0, 1]  # a's pages, lowest first
    book.grow([("b", 1)])  # 6 tokens: still 3 pages
    assert book.pages("b") == [2, 3, 4] and book.seq_len("b") == 6
    book.reset()
    assert len(book) == 0 and book.free_pages == book.config.num_pages


@pytest.mark.parametrize("world,interleave", [(1, 1), (2, 1), (2, 4), (4, 2)])
def test_array_side_matches_the_per_request_side(world: int, interleave: int) -> None:
    """A decode step through slots (vectorised lookup, checks, growth, table rows) leaves the
    ledger as the per-request methods do, and names the offending request_ids[i]."""
    cfg = KVCacheConfig(page_size=4, layout=DCPLayout(world, interleave), max_requests=4, max_seq_len=24)
    books = [PagedKVBook(cfg), PagedKVBook(cfg)]
    for book in books:
        book.grow([(7, 3), (2, 9), ("s", 5)])
    a, b = books
    assert a.pages_for(np.array([0, 1, 17, 24])).tolist() == [cfg.pages_for(n) for n in (0, 1, 17, 24)]
    for step in range(6):
        slots = a.slots(np.array([2, 7]))
        counts = np.array([1, 1 + step % 2])
        assert a.check_slots(slots, counts) == b.check_growth([(2, 1), (7, 1 + step % 2)], new_ok=False)
        a.grow_slots(slots, counts)
        b.grow([(2, 1), (7, 1 + step % 2)], new_ok=False)
        assert a.table_rows(slots).tolist() == b.table([2, 7]) and a.free_pages == b.free_pages
        assert [a.seq_len(i) for i in (2, 7, "s")] == [b.seq_len(i) for i in (2, 7, "s")]
    assert list(a.slots(["s", 7])) == [a.slots(["s"])[0], a.slots(np.array([7]))[0]]
    cases = [
        (lambda: a.slots(np.array([7, 3])), r"request_ids\[1\]: unknown request id 3"),
        (lambda: a.slots(["s", "t"]), r"request_ids\[1\]: unknown request id 't'"),
        (lambda: a.check_slots(a.slots(np.array([2, 7, 2])), 1), r"request_ids\[2\]: request 2 appears twice"),
        (
            lambda: a.check_slots(a.slots(np.array([7, 2])), np.array([1, 10])),
            r"request_ids\[1\]: request 2: 25 tokens",
        ),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    a.release([7])
    with pytest.raises(ValueError, match=r"request_ids\[0\]: unknown request id 7"):
        a.slots(np.array([7]))  # the integer index is rebuilt after a free
    a.grow([(7, 1)])
    assert a.seq_len(7) == 1 and len(a.pages(7)) == 1 and a.request_ids[-1] == 7
    assert a.table_rows(a.slots(np.array([7])), width=3).tolist() == [[*a.pages(7), -1, -1]]


@pytest.mark.parametrize("world", [1, 2])
def test_undo_growth_restores_the_ledger_of_a_step_that_did_not_run(world: int) -> None:
    """``undo_growth`` is ``grow_slots``' inverse: lengths, pages held, table rows and free pages as
    before; the next step takes the same pages."""
    book = PagedKVBook(KVCacheConfig(page_size=4, layout=DCPLayout(world), max_requests=3, max_seq_len=40))
    book.grow([("a", 7), ("b", 3), ("c", 8)])
    slots, counts = book.slots(["a", "b", "c"]), np.array([6, 1, 2])
    before = (book.lens.copy(), book.npages.copy(), book.block_table.copy(), sorted(book._free))
    book.check_slots(slots, counts)
    book.grow_slots(slots, counts)
    grown = book.block_table.copy()
    assert (book.lens[slots] == before[0][slots] + counts).all() and book.free_pages < len(before[3])
    book.undo_growth(slots, counts)
    after = (book.lens, book.npages, book.block_table, sorted(book._free))
    assert all(np.array_equal(x, y) for x, y in zip(before[:3], after[:3])) and before[3] == after[3]
    book.grow_slots(slots, counts)
    assert np.array_equal(book.block_table, grown)
