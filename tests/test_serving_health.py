"""Which late rank a timed-out pool step names: the one the others wait for, from their health reports."""

from __future__ import annotations

import pytest

from shardattn.serving.health import holding_up


def _report(rank: int, collectives: int | None, state: str = "decode") -> dict:
    report = {"rank": rank, "state": state}
    if collectives is not None:
        report["collectives"] = collectives
    return report


@pytest.mark.parametrize(
    ("reports", "late", "expect"),
    [
        # rank 2 never reached the collective ranks 0 and 1 entered
        (
            [_report(0, 12), _report(1, 12), _report(2, 11)],
            [0, 1, 2],
            (2, "entered 11 collectives, the fewest; ranks [0, 1]"),
        ),
        ([_report(0, 5), _report(1, 7), _report(2, 6)], [0, 1, 2], (0, "ranks [1, 2] entered [7, 6]")),
        ([_report(0, 5), _report(1, 7), _report(2, 5)], [0, 1, 2], (0, "the fewest (as did ranks [2])")),
        # a rank that does not answer its health check either, beside ranks level in their counts
        ([_report(0, 4), {"rank": 1, "state": "unresponsive"}], [0, 1], (1, "did not answer its health check")),
        # counts that differ decide before a silent rank (a loaded rank may answer late)
        ([_report(0, 4), _report(1, 3), {"rank": 2, "state": "unresponsive"}], [0, 1, 2], (1, "entered 3")),
        ([_report(0, 4), _report(1, 4)], [0, 1], None),  # stuck inside a collective both entered
        ([{"rank": 0, "state": "unresponsive"}, {"rank": 1, "state": "unresponsive"}], [0, 1], None),
        ([_report(0, 4), _report(1, None)], [0, 1], None),  # no count to compare
        ([_report(0, 9), _report(1, 3), _report(2, 9)], [0, 2], None),  # only the late ranks count
    ],
    ids=["behind", "three-counts", "tied", "silent", "counts-first", "level", "all-silent", "no-count", "late-only"],
)
def test_holding_up_names_the_rank_the_others_wait_for(reports: list, late: list, expect: tuple | None) -> None:
    got = holding_up(reports, late)
    if expect is None:
        assert got is None
    else:
        assert got is not None and got[0] == expect[0] and expect[1] in got[1]
