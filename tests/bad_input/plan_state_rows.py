"""Rows of the bad-input table for the planner's ledgers and sizes: the paged-KV book's counts,
widths and ids, a step's shape and its pricing, the decode kernels' tiles and merge, the arena's
lifetimes and a DCP shard's pages (tests/test_bad_input.py)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from shardattn import plan as P
from shardattn.plan.cost import CONSERVATIVE, CostModel
from shardattn.plan.decode_routing import (
    SPARSE_DECODE_KERNELS,
    route_decode_merge,
    route_sparse_decode_kernel,
    small_decode_heads,
    small_decode_tiles,
)
from shardattn.plan.kv_cache_config import KVCacheConfig
from shardattn.plan.kv_pages import PagedKVBook
from shardattn.plan.step_shape import StepShape
from tests.bad_input.table import META, Call, Gives, Raises, Row

#: In a book row's arguments: the slot of request 7 (looked up when the row is built).
SLOT = object()


def _book() -> PagedKVBook:
    """A book of page size 4 over two DCP ranks holding request 7: 20 tokens, 3 pages on rank 0."""
    book = PagedKVBook(KVCacheConfig(page_size=4, layout=P.DCPLayout(2), max_requests=4, max_seq_len=32))
    book.grow([(7, 20)])
    return book


def _on_book(method: str, *args: Any, **kw: Any) -> Callable[[Any], Call]:
    """A row's build: ``method`` of a fresh :func:`_book` (the slot of request 7 for :data:`SLOT`)."""

    def build(_g: Any) -> Call:
        book = _book()
        slot = book.slots([7])
        return Call(getattr(book, method), tuple(slot if a is SLOT else a for a in args), kw)

    return build


def _book_unchanged(method: str, *args: Any, kind: type[Exception], match: str) -> Callable[[Any], Call]:
    """A row's build whose call runs ``method`` of a fresh :func:`_book`, which must raise ``kind``
    matching ``match`` and leave the ledger as it was; the call returns ``None`` or what went wrong
    (the row's check is ``Gives(lambda why: why)``)."""

    def call() -> str | None:
        book = _book()
        slot = book.slots([7])
        arrays: tuple[np.ndarray, ...] = (book.lens.copy(), book.npages.copy(), book.block_table.copy())
        free = list(book._free)
        try:
            getattr(book, method)(*(slot if a is SLOT else a for a in args))
        except kind as e:
            if not re.search(match, str(e)):
                return f"message {str(e)!r} does not match {match!r}"
            now: tuple[np.ndarray, ...] = (book.lens, book.npages, book.block_table)
            same = all(np.array_equal(x, y) for x, y in zip(arrays, now)) and free == book._free
            return None if same else "the refused call changed the ledger"
        return "no error raised"

    return lambda _g: Call(call)


def _shape(**kw: Any) -> dict[str, Any]:
    return {"heads": 8, "world_size": 2, "tokens": 4096, "topk": 2048, **kw}


def _predict(shape: dict[str, Any], *args: Any) -> Callable[[Any], Call]:
    return lambda _g: Call(CostModel(CONSERVATIVE).predict_step, (StepShape(**shape), *args))


def plan_state_rows() -> list[Row]:
    """Rows of :class:`~shardattn.plan.kv_pages.PagedKVBook`, :class:`~shardattn.plan.step_shape.StepShape`,
    :meth:`~shardattn.plan.cost.CostModel.predict_step`, the decode tile and merge routes,
    :func:`~shardattn.plan.arena_offsets` and :func:`~shardattn.plan.shard_kv_cache`."""

    def row(rid: str, fn: Callable[..., Any], args: tuple, kw: dict, expect: Raises | Gives) -> Row:
        return Row(rid, lambda _g: Call(fn, args, kw), expect)

    shard = P.shard_kv_cache
    one_page = torch.tensor([[0]], dtype=torch.int32)
    return [
        # the book: a width below a request's pages cut its row; counts were never checked
        Row("PagedKVBook.table-width-below-pages", _on_book("table", [7], width=1),
            Raises(ValueError, r"^width must be >= 3 \(the most pages one of the requests holds\), got 1")),
        Row("PagedKVBook.table_rows-width-negative", _on_book("table_rows", SLOT, -2),
            Raises(ValueError, r"^width must be >= 3 .*, got -2")),
        Row("PagedKVBook.table_rows-width-float", _on_book("table_rows", SLOT, 3.0),
            Raises(TypeError, r"^width must be an int, got float")),
        Row("PagedKVBook.table_rows-width-wider", _on_book("table_rows", SLOT, 5),
            Gives(lambda rows: None if rows.tolist() == [[0, 1, 2, -1, -1]] else f"rows {rows.tolist()}")),
        Row("PagedKVBook.check_slots-counts-negative", _on_book("check_slots", SLOT, -30),
            Raises(ValueError, r"^counts must be >= 0, got -30")),
        Row("PagedKVBook.check_slots-counts-float", _on_book("check_slots", SLOT, 1.5),
            Raises(TypeError, r"^counts must be an int, got float")),
        Row("PagedKVBook.check_slots-counts-entry-negative", _on_book("check_slots", SLOT, np.array([-1])),
            Raises(ValueError, r"^counts\[0\] must be >= 0, got -1")),
        Row("PagedKVBook.check_slots-counts-length", _on_book("check_slots", SLOT, np.array([1, 2])),
            Raises(ValueError, r"^counts must have 1 entries")),
        Row("PagedKVBook.check_slots-counts-tensor", _on_book("check_slots", SLOT, torch.tensor([8])),
            Gives(lambda need: None if need == 1 else f"{need} pages for 8 more tokens, want 1")),
        Row("PagedKVBook.grow_slots-counts-negative",
            _book_unchanged("grow_slots", SLOT, -20, kind=ValueError, match=r"^counts must be >= 0, got -20"),
            Gives(lambda why: why)),
        Row("PagedKVBook.grow_slots-counts-float",
            _book_unchanged("grow_slots", SLOT, np.array([1.0]), kind=TypeError,
                            match=r"^counts must hold integers, got dtype float64"),
            Gives(lambda why: why)),
        Row("PagedKVBook.undo_growth-counts-past-held", _on_book("undo_growth", SLOT, 21),
            Raises(ValueError, r"^counts=21 is more than the 20 tokens request 7 holds")),
        Row("PagedKVBook.undo_growth-counts-negative",
            _book_unchanged("undo_growth", SLOT, [-4], kind=ValueError, match=r"^counts\[0\] must be >= 0, got -4"),
            Gives(lambda why: why)),
        Row("PagedKVBook.slots-tensor-on-meta", _on_book("slots", torch.tensor([7], device=META)),
            Raises(ValueError, r"^request_ids must be on cpu, got meta")),
        Row("PagedKVBook.slots-tensor-float", _on_book("slots", torch.tensor([7.0])),
            Raises(TypeError, r"^request_ids must have dtype in \(int8, int16, int32, int64, uint8\), got float32")),
        Row("PagedKVBook.slots-tensor-int32", _on_book("slots", torch.tensor([7], dtype=torch.int32)),
            Gives(lambda slots: None if slots.tolist() == [0] else f"slots {slots.tolist()}")),
        # a step's shape: heads that do not divide priced ShardQ's exchange at 0 bytes
        row("StepShape-heads-not-a-multiple-of-world-size", StepShape, (), _shape(heads=4, world_size=8),
            Raises(ValueError, r"^StepShape.heads must be a multiple of StepShape.world_size .*heads=4, world_size=8")),
        row("StepShape-union-ratio-negative", StepShape, (), _shape(union_ratio={2: -5.0}),
            Raises(ValueError, r"^StepShape.union_ratio\[2\] must be a finite number > 0, got -5.0")),
        row("StepShape-union-ratio-nan", StepShape, (), _shape(union_ratio={4: float("nan")}),
            Raises(ValueError, r"^StepShape.union_ratio\[4\] must be a finite number > 0, got nan")),
        row("StepShape-union-ratio-str", StepShape, (), _shape(union_ratio={2: "1.2"}),
            Raises(TypeError, r"^StepShape.union_ratio\[2\] must be a float")),
        row("StepShape-union-ratio-group-1", StepShape, (), _shape(union_ratio={1: 1.0}),
            Raises(ValueError, r"^StepShape.union_ratio's G must be one of \(2, 4, 8\), got 1")),
        row("StepShape-union-ratio-list", StepShape, (), _shape(union_ratio=[1.2]),
            Raises(TypeError, r"^StepShape.union_ratio must be a dict of G -> ratio, got list")),
        Row("CostModel.predict_step-step-unknown-at-one-rank", _predict(_shape(world_size=1), "bogus"),
            Raises(ValueError, r"^step must be 'headtp', 'shardq' or 'pcp', got 'bogus'")),
        Row("CostModel.predict_step-group-size-0", _predict(_shape(), "shardq", 0),
            Raises(ValueError, r"^group_size must be >= 1, got 0")),
        Row("CostModel.predict_step-group-size-3", _predict(_shape(), "shardq", 3),
            Raises(ValueError, r"^group_size must be one of \(1, 2, 4, 8\), got 3")),
        Row("CostModel.predict_step-shape-dict",
            lambda _g: Call(CostModel(CONSERVATIVE).predict_step, (_shape(), "shardq")),
            Raises(TypeError, r"^shape must be a StepShape, got dict")),
        Row("CostModel.kernel_ms-group-size-0",
            lambda _g: Call(CostModel(CONSERVATIVE).kernel_ms, (8, 4096, 2048), {"group_size": 0}),
            Raises(ValueError, r"^group_size must be >= 1, got 0")),
        # the decode kernels' merge and tiles: negative sizes routed, top-k 0 gave 0 splits
        row("route_decode_merge-num-tokens-negative", route_decode_merge, (-5, 16, 4), {},
            Raises(ValueError, r"^num_tokens must be >= 0, got -5")),
        row("route_decode_merge-num-tokens-float", route_decode_merge, (1.5, 16, 4), {},
            Raises(TypeError, r"^num_tokens must be an int, got float")),
        row("route_decode_merge-num-heads-negative", route_decode_merge, (1, -16, 4), {},
            Raises(ValueError, r"^num_heads must be >= 0, got -16")),
        row("route_decode_merge-num-splits-0", route_decode_merge, (1, 16, 0), {},
            Raises(ValueError, r"^num_splits must be >= 1, got 0")),
        row("small_decode_tiles-topk-0", small_decode_tiles, (1, 0, 132), {},
            Raises(ValueError, r"^topk must be >= 1, got 0")),
        row("small_decode_tiles-topk-negative", small_decode_tiles, (1, -64, 132), {},
            Raises(ValueError, r"^topk must be >= 1, got -64")),
        row("small_decode_tiles-num-tokens-negative", small_decode_tiles, (-1, 2048, 132), {},
            Raises(ValueError, r"^num_tokens must be >= 0, got -1")),
        row("small_decode_tiles-num-sms-0", small_decode_tiles, (1, 2048, 0), {},
            Raises(ValueError, r"^num_sms must be >= 1, got 0")),
        row("small_decode_tiles-kv-fp8-int", small_decode_tiles, (1, 2048, 132), {"kv_fp8": 1},
            Raises(TypeError, r"^kv_fp8 must be a bool, got int")),
        row("small_decode_heads-heads-negative", small_decode_heads, (1, 32, -3, 132), {},
            Raises(ValueError, r"^heads must be >= 1, got -3")),
        row("small_decode_heads-splits-0", small_decode_heads, (1, 0, 16, 132), {},
            Raises(ValueError, r"^splits must be >= 1, got 0")),
        row("small_decode_heads-num-sms-float", small_decode_heads, (1, 32, 16, 132.0), {},
            Raises(TypeError, r"^num_sms must be an int, got float")),
        row("route_sparse_decode_kernel-stream-is-a-listed-kernel", route_sparse_decode_kernel, (16,),
            {"num_tokens": 64, "topk": 2048, "sm": 90, "stream_missing": None},
            Gives(lambda r: None if r.path == "gluon_stream" and r.path in SPARSE_DECODE_KERNELS else r.path)),
        # the arena: a list of lifetimes raised AttributeError, numpy ends were refused and bools taken
        row("arena_offsets-lifetimes-list", P.arena_offsets, ({"a": 1}, [("a", (0, 1))]), {},
            Raises(TypeError, r"^lifetimes must be a dict of item -> \(first, last\) or None, got list")),
        row("arena_offsets-lifetime-bool", P.arena_offsets, ({"a": 1}, {"a": (False, True)}), {},
            Raises(TypeError, r"^lifetimes\['a'\]\[0\] must be an int, got bool")),
        row("arena_offsets-lifetime-float", P.arena_offsets, ({"a": 1}, {"a": (0, 1.0)}), {},
            Raises(TypeError, r"^lifetimes\['a'\]\[1\] must be an int, got float")),
        row("arena_offsets-lifetime-numpy-ints", P.arena_offsets,
            ({"a": 8, "b": 8}, {"a": (np.int64(0), np.int64(1)), "b": (np.int32(2), np.int32(2))}), {"align": 1},
            Gives(lambda res: None if res == ({"a": 0, "b": 0}, 8) else f"offsets {res}")),
        # a DCP shard: pages of 0 rows divided by zero; page_size=True passed for pages of 1 row
        row("shard_kv_cache-pages-of-0-rows", shard, (torch.zeros(3, 0, 2), one_page, [0], P.DCPLayout(1), 0), {},
            Raises(ValueError, r"^kv_cache must have pages of >= 1 rows \(\[pages, page_size, \.\.\.\]\), got shape")),
        row("shard_kv_cache-pair-pages-of-0-rows", shard,
            ((torch.zeros(3, 0, 1, 2), torch.zeros(3, 0, 1, 2)), one_page, [0], P.DCPLayout(1), 0), {},
            Raises(ValueError, r"^kv_cache\[0\] must have pages of >= 1 rows")),
        row("shard_kv_cache-page-size-bool-paged", shard, (torch.zeros(3, 1, 2), one_page, [1], P.DCPLayout(1), 0),
            {"page_size": True}, Raises(TypeError, r"^page_size must be an int, got bool")),
        row("shard_kv_cache-page-size-0-paged", shard, (torch.zeros(3, 1, 2), one_page, [1], P.DCPLayout(1), 0),
            {"page_size": 0}, Raises(ValueError, r"^page_size must be >= 1, got 0")),
    ]  # fmt: skip
