"""The pool's page ledger (host-only): sizes per DCP layout, step validation that changes nothing, reuse."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardattn.plan.context import DCPLayout
from shardattn.plan.kv_cache_config import KVCacheConfig
from shardattn.plan.kv_pages import PagedKVBook


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


@pytest.mark.parametrize(
    ("sizes", "match"),
    [
        ({"max_requests": 4, "max_seq_len": 2**40}, r"^max_seq_len must be <= 2,147,483,647, got 1,099,511,627,776$"),
        ({"max_requests": 2**40, "max_seq_len": 48}, r"^max_requests \* max_seq_len \(num_pages' default\) gives"),
        ({"max_requests": 4, "max_seq_len": 48, "num_pages": 2**29}, r"^num_pages gives 2,147,483,648 KV rows per"),
    ],
    ids=["positions-past-int32", "default-pages-past-int32-rows", "pages-past-int32-rows"],
)
def test_sizes_past_int32_positions_or_rows_are_refused_naming_them(sizes: dict[str, int], match: str) -> None:
    """Regression: a pool's max_seq_len or max_requests past int32 positions or rows reached the
    ledger, whose allocation of one entry per page failed with a bare MemoryError (or held page ids
    past int32 in its block table); they are refused naming the size, before anything is allocated."""
    with pytest.raises(ValueError, match=match):
        KVCacheConfig(page_size=4, layout=DCPLayout(2), **sizes)
    largest = KVCacheConfig(page_size=4, layout=DCPLayout(1), max_requests=1, max_seq_len=4, num_pages=2**29 - 1)
    assert largest.rows_per_rank == 2**31 - 4  # the rows an int32 index reaches are fine


@pytest.mark.parametrize(("world", "pages"), [(1, 11), (2, 5)])
def test_fewer_pages_than_one_request_of_max_seq_len_are_refused(world: int, pages: int) -> None:
    """A pool whose cache cannot hold one request of its max_seq_len is refused when it is sized
    (it was built, and the first long prefill ran out of pages)."""
    with pytest.raises(ValueError, match=rf"^num_pages={pages} is fewer than the {pages + 1} pages one request of "):
        KVCacheConfig(page_size=4, layout=DCPLayout(world), max_requests=4, max_seq_len=48, num_pages=pages)
    fits = KVCacheConfig(page_size=4, layout=DCPLayout(world), max_requests=4, max_seq_len=48, num_pages=pages + 1)
    assert fits.pages_per_request == pages + 1


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


def test_grow_reads_a_generator_once_like_a_list() -> None:
    """``grow`` of a generator commits it (its check used to consume it, leaving nothing to commit)."""
    cfg = KVCacheConfig(page_size=4, layout=DCPLayout(2), max_requests=4, max_seq_len=32)
    listed, generated = PagedKVBook(cfg), PagedKVBook(cfg)
    for book in (listed, generated):
        book.grow([("a", 5)])
    step = [("a", 9), ("b", 3)]
    listed.grow(step)
    generated.grow(item for item in step)
    assert generated.request_ids == listed.request_ids == ["a", "b"]
    assert [generated.seq_len(r) for r in "ab"] == [listed.seq_len(r) for r in "ab"] == [14, 3]
    assert generated.table(["a", "b"]) == listed.table(["a", "b"]) and generated.free_pages == listed.free_pages


def _held_seven() -> PagedKVBook:
    """Request 7 holds 20 tokens over two ranks: 10 on rank 0, 3 pages of 4."""
    book = PagedKVBook(KVCacheConfig(page_size=4, layout=DCPLayout(2), max_requests=4, max_seq_len=32))
    book.grow([(7, 20)])
    assert book.pages(7) == [0, 1, 2]
    return book


@pytest.mark.parametrize("width", [1, 0, -2], ids=["narrow", "zero", "negative"])
def test_table_width_below_the_pages_held_is_refused(width: int) -> None:
    """A row is never cut: a width below the pages a request holds (or negative, which sliced from
    the end) is a ValueError naming width."""
    book = _held_seven()
    with pytest.raises(
        ValueError, match=rf"^width must be >= 3 \(the most pages one of the requests holds\), got {width}"
    ):
        book.table([7], width=width)
    with pytest.raises(ValueError, match=r"^width must be >= 3"):
        book.table_rows(book.slots([7]), width)
    with pytest.raises(TypeError, match=r"^width must be an int, got float"):
        book.table([7], width=3.0)
    assert book.table([7], width=3) == [[0, 1, 2]] and book.table([7], width=4) == [[0, 1, 2, -1]]


@pytest.mark.parametrize(
    ("counts", "exc", "match"),
    [
        (-30, ValueError, r"^counts must be >= 0, got -30"),
        (1.5, TypeError, r"^counts must be an int, got float"),
        (True, TypeError, r"^counts must be an int, got bool"),
        (np.array([-1]), ValueError, r"^counts\[0\] must be >= 0, got -1"),
        (np.array([1.0]), TypeError, r"^counts must hold integers"),
        ([1, 2], ValueError, r"^counts must have 1 entries \(one per request\), got 2"),
    ],
    ids=["negative", "float", "bool", "entry-negative", "float-array", "length"],
)
@pytest.mark.parametrize("method", ["check_slots", "grow_slots", "undo_growth"])
def test_counts_are_checked_before_anything_changes(method: str, counts: object, exc: type, match: str) -> None:
    """Wherever counts enter (a negative one gave a negative page need, and grow_slots(s, -20) left
    a request of 0 tokens holding its pages), a bad one raises naming counts and the ledger stays."""
    book = _held_seven()
    slots = book.slots([7])
    before = (book.lens.copy(), book.npages.copy(), book.block_table.copy(), book.free_pages)
    with pytest.raises(exc, match=match):
        getattr(book, method)(slots, counts)
    assert np.array_equal(book.lens, before[0]) and np.array_equal(book.npages, before[1])
    assert np.array_equal(book.block_table, before[2]) and book.free_pages == before[3]


def test_counts_as_int_array_or_tensor_step_alike() -> None:
    """One int, a list, an int32 array and a CPU tensor of counts take the same pages; undoing more
    tokens than a request holds is refused."""
    needs = []
    for counts in (8, [8], np.array([8], dtype=np.int32), torch.tensor([8])):
        book = _held_seven()
        slots = book.slots([7])
        needs.append(book.check_slots(slots, counts))
        book.grow_slots(slots, counts)
        assert book.seq_len(7) == 28 and book.pages(7) == [0, 1, 2, 3]
        book.undo_growth(slots, counts)
        assert book.seq_len(7) == 20 and book.pages(7) == [0, 1, 2] and book.free_pages == book.config.num_pages - 3
    assert needs == [1, 1, 1, 1]
    book = _held_seven()
    with pytest.raises(ValueError, match=r"^counts=21 is more than the 20 tokens request 7 holds"):
        book.undo_growth(book.slots([7]), 21)
    with pytest.raises(ValueError, match=r"^counts\[0\]=21 is more than the 20 tokens request 7 holds"):
        book.undo_growth(book.slots([7]), np.array([21]))
    assert book.seq_len(7) == 20 and book.pages(7) == [0, 1, 2]


def test_slots_takes_a_cpu_integer_tensor() -> None:
    """``slots`` looks a CPU integer tensor up as the NumPy array of its values; a float or meta
    tensor is refused naming the argument."""
    book = _held_seven()
    book.grow([(3, 4), ("x", 1)])
    want = book.slots(np.array([3, 7])).tolist()
    assert book.slots(torch.tensor([3, 7])).tolist() == want
    assert book.slots(torch.tensor([3, 7], dtype=torch.int32)).tolist() == want
    with pytest.raises(ValueError, match=r"^request_ids\[1\]: unknown request id 9"):
        book.slots(torch.tensor([3, 9]))
    with pytest.raises(TypeError, match=r"^ids must have dtype in \(int8, int16, int32, int64, uint8\), got float32"):
        book.slots(torch.tensor([3.0]), name="ids")
    with pytest.raises(ValueError, match=r"^request_ids must be on cpu, got meta"):
        book.slots(torch.tensor([3], device="meta"))


def test_an_int_id_past_int64_leaves_array_lookups_of_the_others_working() -> None:
    """Any hashable is a request id; an int past int64 is named by a sequence only. Once held, it
    broke every integer-array lookup (an OverflowError building the sorted index)."""
    book = _held_seven()
    book.grow([(2**64, 3), (-(2**70), 1)])
    assert book.slots(np.array([7])).tolist() == book.slots([7]).tolist()
    assert book.slots(torch.tensor([7])).tolist() == book.slots([7]).tolist()
    assert len(set(book.slots([2**64, -(2**70), 7]).tolist())) == 3


@pytest.mark.parametrize("world", [1, 2])
def test_out_of_pages_names_the_first_request_that_does_not_fit(world: int) -> None:
    """A step exactly at the cache's free pages takes them all; one token more is refused naming the
    request whose pages first pass the free ones, in step order (the error named no request),
    through the per-request and the array side alike, and nothing changes."""
    cfg = KVCacheConfig(page_size=2, layout=DCPLayout(world), max_requests=4, max_seq_len=8 * world, num_pages=6)
    book = PagedKVBook(cfg)
    tok = 2 * world  # one page of every rank's share
    book.grow([("a", tok)])
    full = [("a", tok), ("b", 3 * tok), ("c", tok)]  # 1 + 3 + 1 more pages: the 5 free
    assert book.check_growth(full) == 5
    cases = [
        ([("a", tok + 1), ("b", 3 * tok + 1), ("c", tok)], "request 'b'", 4, 7),  # 2 + 4 > 5, then c's 1
        ([("a", tok), ("b", 3 * tok), ("c", tok + 1)], "request 'c'", 2, 6),  # 1 + 3 + 2 > 5
        ([("z", 1), ("y", 4 * tok), ("x", tok)], "request 'x'", 1, 6),  # 1 + 4 + 1 > 5
    ]
    for growth, who, own, need in cases:
        with pytest.raises(ValueError, match=rf"^out of KV pages: the step needs {need}, 5 of 6 are free; {who} is the "
                           rf"first that does not fit \(it needs {own} more\)"):  # fmt: skip
            book.check_growth(growth)
        assert book.request_ids == ["a"] and book.free_pages == 5 and book.seq_len("a") == tok
    book.grow(full)
    assert book.free_pages == 0 and sorted(p for r in "abc" for p in book.pages(r)) == list(range(6))
    slots = book.slots(["c", "b", "a"])
    assert book.check_slots(slots, np.zeros(3, dtype=np.int64)) == 0
    with pytest.raises(ValueError, match=r"are free; request_ids\[2\]: request 'a' is the first that does not fit "
                                         r"\(it needs 1 more\)"):  # fmt: skip
        book.check_slots(slots, np.array([0, 0, 1]))
    with pytest.raises(ValueError, match=r"^out of KV pages: the step needs 1, 0 of 6 are free; request 'c' is"):
        book.check_growth([("c", 1)], new_ok=False)
    book.release(["b"])
    assert book.check_growth([("c", 3 * tok)], new_ok=False) == 3  # exactly the 3 pages b gave back
