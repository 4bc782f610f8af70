"""Rows of the bad-input table for the planner's lengths and ranks: entries past int32 / int64,
unordered collections, bools, and a rank outside a DCP layout (tests/test_bad_input.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from shardattn import plan as P
from tests.bad_input.table import Call, Raises, Row


def plan_length_rows() -> list[Row]:
    """Rows of :func:`~shardattn.plan.zigzag_split` and :func:`~shardattn.plan.plan_decode_batch`."""

    def row(rid: str, fn: Callable[..., Any], args: tuple, kw: dict, expect: Raises) -> Row:
        return Row(rid, lambda _g: Call(fn, args, kw), expect)

    two = P.DCPLayout(2)
    split, batch = P.zigzag_split, P.plan_decode_batch
    return [
        # a rank outside the layout read another rank's lengths (rank 2 of 2 planned rank 0's)
        row("plan_decode_batch-rank-past-layout", batch, ([11],), {"layout": two, "rank": 2},
            Raises(ValueError, r"^rank must be <= 1, got 2")),
        row("plan_decode_batch-rank-negative", batch, ([11], [0, 2]), {"layout": two, "rank": -1},
            Raises(ValueError, r"^rank must be >= 0, got -1")),
        row("plan_decode_batch-rank-bool", batch, ([11],), {"layout": two, "rank": True},
            Raises(TypeError, r"^rank must be an int, got bool")),
        row("plan_decode_batch-rank-float", batch, ([11],), {"layout": two, "rank": 1.0},
            Raises(TypeError, r"^rank must be an int, got float")),
        row("plan_decode_batch-rank-negative-without-layout", batch, ([11],), {"rank": -3},
            Raises(ValueError, r"^rank must be >= 0, got -3")),
        # int32 metadata: a length past it wrapped negative
        row("plan_decode_batch-seq-len-past-int32", batch, ([5, 2**31],), {},
            Raises(ValueError, r"^seq_lens\[1\] must be <= 2147483647 \(tokens are int32\)")),
        row("plan_decode_batch-seq-len-past-int32-drafts", batch, ([2**32 + 5],), {"q_len": 2},
            Raises(ValueError, r"^seq_lens\[0\] must be <= 2147483647")),
        row("plan_decode_batch-seq-lens-bool", batch, ([True, 3],), {},
            Raises(TypeError, r"^seq_lens\[0\] must be an int, got bool")),
        row("plan_decode_batch-causal-str", batch, ([3],), {"causal": "no"},
            Raises(TypeError, r"^causal must be a bool, got str")),
        row("plan_decode_batch-packed-int", batch, ([3], [0, 2]), {"packed": 1},
            Raises(TypeError, r"^packed must be a bool, got int")),
        row("plan_decode_batch-pin-none", batch, ([3],), {"pin": None},
            Raises(TypeError, r"^pin must be a bool, got NoneType")),
        # the planner's lengths: ordered, and within int64 / int32
        row("zigzag_split-query-lens-set", split, ({5, 3}, 2), {},
            Raises(TypeError, r"^query_lens must be a sequence of ints, got an unordered set")),
        row("zigzag_split-query-lens-dict", split, ({7: 100}, 2), {},
            Raises(TypeError, r"^query_lens must be a sequence of ints, got an unordered dict")),
        row("zigzag_split-query-len-past-int64", split, ([2**70], 2), {},
            Raises(ValueError, r"^query_lens\[0\] must be < 2\*\*63")),
        row("zigzag_split-query-lens-uint64-past-int64", split, (np.array([4, 2**63], dtype=np.uint64), 2), {},
            Raises(ValueError, r"^query_lens\[1\] must be < 2\*\*63, got 9223372036854775808")),
        row("zigzag_split-query-len-past-int32", split, ([2**31], 2), {},
            Raises(ValueError, r"^query_lens\[0\] must be <= 2147483647")),
        row("zigzag_split-prefix-past-int32", split, ([8], 2), {"min_tokens": 0, "prefix_lens": [2**62]},
            Raises(ValueError, r"^prefix_lens\[0\] must be <= 2147483647")),
        row("zigzag_split-prefix-plus-query-past-int32", split, ([8, 8], 2), {"prefix_lens": [0, 2**31 - 4]},
            Raises(ValueError, r"^prefix_lens \+ query_lens\[1\] must be <= 2147483647")),
        row("zigzag_split-topk-past-int32", split, ([8], 2), {"min_tokens": 0, "topk": 2**62},
            Raises(ValueError, r"^topk must be <= 2,147,483,647")),
    ]  # fmt: skip
