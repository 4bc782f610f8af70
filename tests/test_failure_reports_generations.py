"""A failure report belongs to the Comm and step that made it: a later one never reads it.

Every numbered :class:`~shardattn.parallel.comm.Comm` counts its steps from zero, so a report that
an earlier Comm on the group left in the store (an earlier Runtime's, an earlier Runtime
construction's) names the same step as a later Comm's; a step called twice with one Comm must
read only its own call's. Each scenario runs over a fresh group with a short timeout: rank 1
fails once and reports it, then stalls past rank 0's timeout without a new report; rank 0 must
name rank 1 as silent, not blame its old error."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.distributed as dist

from shardattn.errors import PeerFailedError
from shardattn.parallel.collector import collect_partials
from shardattn.parallel.comm import Comm
from shardattn.runtime.runtime import Runtime
from tests.parallel_helpers import short_timeout_group
from tests.test_runtime import MLA

#: The group's collective timeout (seconds) and the grace a survivor waits for its peers' reports.
TIMEOUT_S, GRACE_S = 1.0, 0.3
#: How long rank 1 stalls: past two of rank 0's timeouts and graces (one for the failed step, one for the next).
STALL_S = 2 * (TIMEOUT_S + GRACE_S) + 1.0
OLD_ERROR = "stale failure of an earlier"


def _outcome(run) -> tuple[dict[int, str], list[int]] | str:
    """``(raised, silent)`` of the PeerFailedError ``run()`` raised, or what it raised instead."""
    try:
        run()
    except PeerFailedError as e:
        return e.raised, e.silent
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "finished"


def _two_comms(group: dist.ProcessGroup) -> object:
    """Comm A: rank 1's step raises and is reported. Comm B, on the same group: rank 1 stalls in step 1."""
    group = short_timeout_group(group, TIMEOUT_S)
    first = Comm(group, report_grace_s=GRACE_S)
    first.begin_step()
    if first.rank == 1:
        first.report_failure(RuntimeError(f"{OLD_ERROR} Comm's step"))
    second = Comm(group, report_grace_s=GRACE_S)
    second.begin_step()
    if second.rank == 1:
        time.sleep(STALL_S)
        return None
    return _outcome(lambda: second.gather_ints([1]))


def _two_calls(group: dist.ProcessGroup) -> object:
    """A parallel step called twice with one Comm (as a caller of many steps passes it): in the
    first call rank 1's argument is bad (reported, no agreement); in the second, rank 1 stalls
    before it."""
    comm = Comm(short_timeout_group(group, TIMEOUT_S), report_grace_s=GRACE_S)
    rank, world = comm.rank, comm.world_size
    out, lse = torch.zeros(2, 2 * world, 4), torch.zeros(2, 2 * world)
    flag = 1 if rank == 1 else True  # rank 1's scatter_heads is not a bool
    first = _outcome(lambda: collect_partials(out, lse, comm, scatter_heads=flag, check=False))
    if rank == 1:
        assert isinstance(first, str) and first.startswith("TypeError: scatter_heads must be a bool"), first
        time.sleep(STALL_S)
        return None
    assert first != "finished" and not isinstance(first, str), first  # rank 0 named rank 1's TypeError
    return _outcome(lambda: collect_partials(out, lse, comm, check=False))


def _two_runtimes(group: dist.ProcessGroup) -> object:
    """Runtime A's construction fails on rank 1 (reported); rank 1 stalls before Runtime B's."""
    group = short_timeout_group(group, TIMEOUT_S)
    rank = dist.get_rank(group)
    tokens = 0 if rank == 1 else 128  # rank 1's max_batched_tokens is out of range
    spec = dataclasses.replace(MLA, num_heads=24)  # heads that 2, 3 or 4 ranks split
    first = _outcome(lambda: Runtime(spec, group, mode="shardq", max_batched_tokens=tokens, warmup=False))
    if rank == 1:
        assert isinstance(first, str) and first.startswith("ValueError: max_batched_tokens"), first
        time.sleep(STALL_S)
        return None
    assert not isinstance(first, str) and first[0], first  # rank 0 named rank 1's ValueError
    return _outcome(lambda: Runtime(spec, group, mode="shardq", max_batched_tokens=128, warmup=False))


def _check(results: list[object]) -> None:
    for rank, seen in enumerate(results):
        if rank == 1:
            continue
        assert isinstance(seen, tuple), (rank, seen)
        raised, silent = seen
        assert raised == {} and 1 in silent, f"rank {rank} blamed an earlier Comm's report: {seen}"


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", [_two_comms, _two_calls, _two_runtimes], ids=lambda f: f.__name__[1:])
def test_a_report_of_an_earlier_comm_is_not_blamed_for_a_later_failure(dist_pool, nproc: int, scenario) -> None:
    if nproc < 2:
        pytest.skip("needs 2 ranks; run with --nproc 2 or more")
    _check(dist_pool.run(scenario))


def _generations(group: dist.ProcessGroup) -> list[int]:
    """The generations of three Comms every rank creates in the same order, on a fresh group."""
    group = short_timeout_group(group, 30.0)
    if dist.get_rank(group) == 1:
        time.sleep(0.2)  # the ranks create them at different times
    return [Comm(group).generation for _ in range(3)]


@pytest.mark.distributed
def test_comms_created_in_the_same_order_have_the_same_generation_on_every_rank(dist_pool, nproc: int) -> None:
    if nproc < 2:
        pytest.skip("needs 2 ranks; run with --nproc 2 or more")
    results = dist_pool.run(_generations)
    assert all(gens == results[0] for gens in results), results
    assert len(set(results[0])) == 3, results  # and a different one each
