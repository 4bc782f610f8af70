"""The --nproc worker pool: results per rank, sub-worlds, failing ranks and hung collectives."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

from shardattn.testing.pool import RankFailed, RankTimeout


def _rank_and_sum(group: dist.ProcessGroup, offset: int) -> tuple[int, int, int]:
    rank = dist.get_rank(group)
    t = torch.tensor([rank + offset])
    dist.all_reduce(t, group=group)
    return rank, dist.get_world_size(group), int(t.item())


def _fail_on_rank_one(group: dist.ProcessGroup) -> None:
    if dist.get_rank(group) == 1:
        raise ValueError("rank one says no")
    dist.barrier(group=group)  # the others wait for the dead rank


def _rank_zero_waits_forever(group: dist.ProcessGroup) -> None:
    if dist.get_rank(group) == 0:
        t = torch.zeros(1)
        dist.recv(t, src=1, group=group)  # nobody sends


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2, 3, 4], ids=lambda w: f"world{w}")
def test_pool_runs_on_every_rank_of_a_sub_world(dist_pool, world_size: int) -> None:
    results = dist_pool.run(_rank_and_sum, 10, world_size=world_size)
    expected_sum = sum(r + 10 for r in range(world_size))
    assert results == [(r, world_size, expected_sum) for r in range(world_size)]


@pytest.mark.distributed
def test_failing_rank_is_named_and_pool_recovers(dist_pool, nproc: int) -> None:
    if nproc < 2:
        pytest.skip("needs 2 ranks; run with --nproc 2 or more")
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"rank 1 of 2 failed[\s\S]*ValueError: rank one says no"):
        dist_pool.run(_fail_on_rank_one, world_size=2, timeout=60)
    assert time.monotonic() - start < 30, "the other rank must not hang the call"
    assert dist_pool.run(_rank_and_sum, 0, world_size=2) == [(0, 2, 1), (1, 2, 1)]


def _rank_one_exits_rank_zero_sleeps(group: dist.ProcessGroup) -> None:
    import os

    if dist.get_rank(group) == 1:
        os._exit(3)
    time.sleep(60)  # busy, not in a collective with the dead rank


@pytest.mark.distributed
def test_a_rank_that_exits_fails_the_call_after_the_grace_not_the_timeout(dist_pool, nproc: int) -> None:
    """A dead worker is found by its exit; the others get the short grace a rank that raised gives,
    not the call's whole timeout (it waited the 60 s out); the pool recovers."""
    if nproc < 2:
        pytest.skip("needs 2 ranks; run with --nproc 2 or more")
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"worker process of rank 1 died \(exit code 3\)"):
        dist_pool.run(_rank_one_exits_rank_zero_sleeps, world_size=2, timeout=60)
    assert time.monotonic() - start < 30, "the call waited out its timeout for a dead rank"
    assert dist_pool.run(_rank_and_sum, 0, world_size=2) == [(0, 2, 1), (1, 2, 1)]


def _skips(group: dist.ProcessGroup, kind: str) -> None:
    if kind == "skip":
        pytest.skip("not on this backend")
    pytest.xfail("known")


@pytest.mark.distributed
def test_skip_and_xfail_in_a_rank_body_are_outcomes_not_failures(dist_pool, nproc: int) -> None:
    """``pytest.skip`` / ``pytest.xfail`` on the ranks come back as the test's skip / xfail (they
    were a RankFailed with the outcome's traceback, and restarted the pool)."""
    world = min(nproc, 2)
    with pytest.raises(pytest.skip.Exception, match="not on this backend"):
        dist_pool.run(_skips, "skip", world_size=world)
    with pytest.raises(pytest.xfail.Exception, match="known"):
        dist_pool.run(_skips, "xfail", world_size=world)
    assert dist_pool.run(_rank_and_sum, 0, world_size=world)[0][1] == world


@pytest.mark.distributed
def test_hung_collective_times_out_and_pool_recovers(dist_pool, nproc: int) -> None:
    if nproc < 2:
        pytest.skip("needs 2 ranks; run with --nproc 2 or more")
    with pytest.raises(RankTimeout, match=r"ranks \[0\] of 2 did not finish within 3 s"):
        dist_pool.run(_rank_zero_waits_forever, world_size=2, timeout=3)
    assert dist_pool.run(_rank_and_sum, 1, world_size=2)[0] == (0, 2, 3)


@pytest.mark.distributed
def test_body_runs_on_every_rank(group, nproc: int) -> None:
    world = dist.get_world_size(group)
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    assert world == nproc
    assert t.item() == world


def test_world_size_above_nproc_skips(dist_pool, nproc: int) -> None:
    with pytest.raises(pytest.skip.Exception, match=f"needs {nproc + 1} ranks"):
        dist_pool.run(_rank_and_sum, 0, world_size=nproc + 1)


def _returns_a_lock(group: dist.ProcessGroup) -> object:
    return threading.Lock()


@pytest.mark.distributed
def test_a_result_that_cannot_be_sent_back_fails_the_call_at_once_naming_it(dist_pool, nproc: int) -> None:
    """A rank whose return value does not pickle fails the call with that error (it was lost in the
    queue's feeder thread, and the call waited out its timeout as a hung collective)."""
    world = min(nproc, 2)
    start = time.monotonic()
    # every rank fails alike, in whichever order they answer: the first to answer leads
    with pytest.raises(RankFailed, match=rf"rank \d of {world} failed[\s\S]*return value[\s\S]*cannot pickle"):
        dist_pool.run(_returns_a_lock, world_size=world, timeout=20)
    assert time.monotonic() - start < 10, "the call waited out its timeout"
    assert dist_pool.run(_rank_and_sum, 0, world_size=world)[0][1] == world


@pytest.mark.distributed
def test_an_argument_that_cannot_be_sent_is_a_type_error_before_any_rank_runs(dist_pool, nproc: int) -> None:
    """Arguments that do not pickle are refused in the test process, naming the function (they were
    lost in the queue's feeder thread and the call waited out its timeout)."""
    start = time.monotonic()
    with pytest.raises(TypeError, match=r"_rank_and_sum.*cannot be sent to the ranks.*cannot pickle"):
        dist_pool.run(_rank_and_sum, threading.Lock(), world_size=1, timeout=20)
    assert time.monotonic() - start < 10, "the call waited out its timeout"
    assert dist_pool.run(_rank_and_sum, 0, world_size=1) == [(0, 1, 0)]


def _rank_one_raises_the_others_time_out(group: dist.ProcessGroup) -> None:
    quick = dist.new_group(list(range(dist.get_world_size())), timeout=datetime.timedelta(seconds=1))
    if dist.get_rank(group) == 1:
        raise ValueError("rank one says no")
    dist.barrier(group=quick)  # times out after 1 s: a later failure, caused by rank 1's


@pytest.mark.distributed
def test_the_first_rank_to_fail_is_shown_not_a_lower_rank_failing_after_it(dist_pool, nproc: int) -> None:
    """Rank 1 raises; rank 0 fails a second later, waiting for it. The report leads with rank 1's
    error (it showed only rank 0's collective timeout, hiding the cause) and still shows rank 0's."""
    if nproc < 2:
        pytest.skip("needs 2 ranks; run with --nproc 2 or more")
    with pytest.raises(RankFailed) as info:
        dist_pool.run(_rank_one_raises_the_others_time_out, timeout=30)
    message = str(info.value)
    assert message.startswith(f"rank 1 of {nproc} failed first"), message[:300]
    assert "ValueError: rank one says no" in message.split("rank 0 ")[0], message
    assert "rank 0 failed too" in message and "Timed out" in message, message


@pytest.mark.parametrize(("option", "value"), [("--dist-timeout", "0"), ("--dist-timeout", "-5"), ("--nproc", "0")])
def test_a_bad_pool_option_is_a_usage_error_naming_it(option: str, value: str) -> None:
    """A timeout of 0 or less would fail every distributed call at once as hung."""
    import subprocess
    import sys

    args = ["-q", "-p", "no:cacheprovider", "--collect-only", f"{option}={value}", __file__]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 4, done.stdout + done.stderr  # pytest's usage error
    assert f"{option} must be" in done.stderr, done.stderr
