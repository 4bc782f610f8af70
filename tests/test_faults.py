"""Rank failures on gloo: the surviving ranks raise a clear error naming the failing rank, in time.

Each scenario runs one ShardQ prefill step on two ranks over a fresh gloo group with a short
timeout (``TIMEOUT_S``), and rank 1 misbehaves in the middle of the step (inside its local
attention, between the two all-to-alls, while rank 0 already waits in the second one):

* ``raises``: rank 1's kernel raises;
* ``exits``: rank 1's process dies (``os._exit``);
* ``hangs``: rank 1 sleeps past the timeout;
* ``other-plan``: rank 1 passes a different plan (caught by the agreement check, before any
  data collective).

Every other rank must raise within the timeout (plus the short grace it waits for peers' reports), with a
message naming rank 1; every scenario runs ``REPEATS`` times in a row. Each rank writes what it
saw to a file, so the survivor's error is read even when the pool reports the dead rank.

Which ranks a survivor names among those that did not report is a matter of timing, and the test
checks the protocol's rule rather than one outcome: when rank 1 exits, a survivor that was waiting
on rank 1's connection fails at once, while one blocked on a peer that has itself given up (a
point-to-point receive from rank 0, say) fails only at its own timeout; the first may then name
the second too. So a survivor may name a live rank only if that rank raised after this survivor
did (it had not reported within the grace), and rank 1 is always named.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardattn.ops.sparse_mla import sparse_mla_attention
from shardattn.parallel.collector import collect_partials
from shardattn.parallel.comm import Comm, PeerFailedError
from shardattn.parallel.shardq import shardq_prefill
from shardattn.plan.zigzag import zigzag_split
from shardattn.testing.pool import RankFailed
from tests.parallel_helpers import short_timeout_group

#: The fault group's collective timeout (seconds): short, so the file runs in well under a minute.
TIMEOUT_S = 2.0
#: How long a survivor waits for its peers' failure reports.
GRACE_S = 1.5
#: What a survivor may take beyond the timeout: the grace for peers' reports plus scheduling noise
#: on a busy 2-core machine.
SLACK_S = GRACE_S + 2.5
REPEATS = 5
SCENARIOS = ("raises", "exits", "hangs", "other-plan")
SEQ_LENS = [6, 5]


def _attention(scenario: str, rank: int, culprit: int):
    """The culprit rank's local kernel misbehaves as the scenario says; other ranks compute normally."""

    def run(*args: Any, **kwargs: Any):
        if rank == culprit:
            if kwargs.get("q_ready") is not None:  # as every kernel: its queries have arrived first
                kwargs.pop("q_ready")()
            if scenario == "raises":
                raise RuntimeError(f"injected failure in rank {rank}'s attention kernel")
            if scenario == "exits":
                os._exit(3)
            if scenario == "hangs":
                time.sleep(TIMEOUT_S + GRACE_S + 1.0)  # past rank 0's timeout and grace
                raise RuntimeError(f"rank {rank} woke up after hanging")
        return sparse_mla_attention(*args, **kwargs)

    return run


def _step(group: dist.ProcessGroup, scenario: str, outdir: str, culprit: int = 1) -> tuple[str, str]:
    """One ShardQ step on a fresh short-timeout gloo group; writes ``rank<r>.json`` with the outcome."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    dist.barrier(group=group)  # arrive together: the short timeout below also bounds the group's set-up
    fault_group = dist.new_group(
        list(range(world)),
        backend="gloo",
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    g = torch.Generator().manual_seed(0)
    t, h, d = sum(SEQ_LENS), 2 * world, 48  # two heads per rank
    q = torch.randn(t, h, d, generator=g)[:, rank * 2 : rank * 2 + 2]
    kv = torch.randn(20, d, generator=g)
    rows = torch.randint(-1, 20, (t, 4), generator=g, dtype=torch.int32)
    plan = zigzag_split(SEQ_LENS, world, min_tokens=0)
    if scenario == "other-plan" and rank == culprit:
        plan = zigzag_split([5, 6], world, min_tokens=0)  # same token count, different split
    start = time.monotonic()
    try:
        shardq_prefill(
            q,
            kv,
            rows,
            plan,
            Comm(fault_group, report_grace_s=GRACE_S),
            scale=0.125,
            v_dim=32,
            attention=_attention(scenario, rank, culprit),
        )
        kind, message = "ok", ""
        silent = None
    except Exception as e:
        kind, message = type(e).__name__, str(e)
        silent = e.silent if isinstance(e, PeerFailedError) else None
    elapsed = time.monotonic() - start
    Path(outdir, f"rank{rank}.json").write_text(
        json.dumps({"kind": kind, "message": message, "silent": silent, "elapsed": elapsed, "at": time.time()})
    )
    return kind, message


#: What every other rank must say, per scenario (regexes; ``{w}``: the world size). For ``exits`` and
#: ``hangs`` the silent ranks are checked separately (:func:`_check_silent`).
EXPECT = {
    "raises": (PeerFailedError.__name__, r"rank 1 of {w} raised RuntimeError: injected failure"),
    "exits": (PeerFailedError.__name__, r"rank\(s\) \[[0-9, ]+\] of {w} did not report within"),
    "hangs": (PeerFailedError.__name__, r"rank\(s\) \[[0-9, ]+\] of {w} did not report within"),
    "other-plan": ("ValueError", r"ShardQ plan and inputs: rank\(s\) \[1\] disagree"),
}
#: Tolerance (seconds) on the times at which survivors record that they raised.
RECORD_SLACK_S = 0.1


def _check_silent(rank: int, seen: dict[str, Any], survivors: dict[int, dict[str, Any]], where: str) -> None:
    """``rank`` named rank 1 and, besides it, only live ranks that reported after its grace ended.

    Every survivor waits a whole grace for rank 1's report, which never comes in time, so it raises
    a grace after it posted its own; a live rank named silent posted after this survivor's grace
    had ended, so it raised at least a grace after this survivor did.
    """
    silent = seen["silent"]
    assert silent is not None and 1 in silent, where
    for other in silent:
        if other != 1:
            late = survivors[other]["at"] - seen["at"]
            assert late > GRACE_S - RECORD_SLACK_S, f"{where}: rank {other} raised {late:+.2f} s after it"


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_failed_rank_makes_the_others_raise_naming_it(
    dist_pool: Any, nproc: int, scenario: str, tmp_path: Path
) -> None:
    """Every rank of the pool takes part (a group made by a subset of the pool's ranks would leave
    the others' group counters behind); rank 1 fails, every other rank must name it."""
    import re

    if nproc < 2:
        pytest.skip("needs 2 ranks; run with --nproc 2 or more")
    want_kind, want_message = EXPECT[scenario][0], EXPECT[scenario][1].format(w=nproc)
    for attempt in range(REPEATS):
        outdir = tmp_path / str(attempt)
        outdir.mkdir()
        try:
            dist_pool.run(_step, scenario, str(outdir), timeout=TIMEOUT_S + 3 * SLACK_S + 10)
        except RankFailed as e:  # the pool reports the rank that died; the survivor's file tells the rest
            assert scenario == "exits", f"attempt {attempt}: {e}"
        survivors = {r: json.loads((outdir / f"rank{r}.json").read_text()) for r in range(nproc) if r != 1}
        first = min(seen["at"] for seen in survivors.values())
        raised_at = ", ".join(f"rank {r} +{seen['at'] - first:.2f} s" for r, seen in survivors.items())
        for rank, seen in survivors.items():
            where = (
                f"attempt {attempt}: rank {rank} got {seen['kind']}: {seen['message']!r} after {seen['elapsed']:.1f} s"
                f" (survivors raised at {raised_at})"
            )
            assert seen["kind"] == want_kind, where
            assert re.search(want_message, seen["message"]), where
            assert seen["elapsed"] < TIMEOUT_S + SLACK_S, where
            if scenario in ("exits", "hangs"):
                _check_silent(rank, seen, survivors, where)
        if scenario == "exits":
            assert not (outdir / "rank1.json").exists()
        elif scenario != "hangs":
            rank1 = json.loads((outdir / "rank1.json").read_text())
            assert rank1["kind"] in ("RuntimeError", "ValueError"), rank1


def _hang_after_a_failed_step(group: dist.ProcessGroup) -> tuple[dict[int, str], list[int]] | None:
    """Step 1: every rank passes the same bad flag without ``check``, raises before any collective
    and reports it (the ranks stay in step). Step 2: rank 1 hangs before it; the others' error."""
    comm = Comm(short_timeout_group(group, 1.0), report_grace_s=0.3)
    out, lse = torch.zeros(2, 2 * comm.world_size, 4), torch.zeros(2, 2 * comm.world_size)
    with pytest.raises(TypeError, match="scatter_heads must be a bool"):
        collect_partials(out, lse, comm, scatter_heads=1, check=False)  # type: ignore[arg-type]
    if comm.rank == 1:
        time.sleep(1.0 + 0.3 + 0.5)  # past the others' timeout and grace
        return None
    try:
        collect_partials(out, lse, comm)
    except PeerFailedError as e:
        return e.raised, e.silent
    raise AssertionError("step 2 finished without rank 1")


@pytest.mark.distributed
def test_a_report_of_an_earlier_step_is_not_blamed_for_a_later_failure(dist_pool, nproc: int) -> None:
    """Rank 1 is silent in step 2; the report it left in step 1 was read as step 2's (it 'raised TypeError')."""
    if nproc < 2:
        pytest.skip("needs 2 ranks; run with --nproc 2 or more")
    for rank, seen in enumerate(dist_pool.run(_hang_after_a_failed_step)):
        if rank != 1:
            assert seen is not None, rank
            raised, silent = seen
            assert raised == {} and 1 in silent, (rank, seen)
