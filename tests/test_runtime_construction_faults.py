"""One rank's Runtime construction fails: its peers raise within the failure-report grace, naming it.

Two gloo ranks on a fresh group whose collectives time out after ``TIMEOUT_S`` (the bound of a
peer that waits for the failed rank instead; gloo's default would be 30 minutes). Rank 1 fails
before the construction's host all-gather (a bad mode, options of the wrong type) or after it
(a workspace it cannot allocate, a warm-up that raises); rank 1 raises its own error, and rank 0
must raise :class:`~shardattn.errors.PeerFailedError` naming rank 1 and its exception well before
the group's timeout.
"""

from __future__ import annotations

import contextlib
import time
from unittest import mock

import pytest
import torch.distributed as dist

from shardattn.errors import PeerFailedError
from shardattn.runtime.runtime import Runtime
from tests.parallel_helpers import short_timeout_group
from tests.test_runtime import MLA

#: The fault group's collective timeout (seconds): how long a peer left waiting would block.
TIMEOUT_S = 10.0
#: What a peer may take to raise: the failure-report grace (1 s) plus scheduling noise on a busy host.
FAST_S = 4.0

#: rank 1's fault -> (its Runtime arguments, the start of its own error)
FAULTS = {
    "bad-mode": ({"mode": "no-such-mode"}, "ValueError: mode must be one of"),
    "options-dict": ({"prefill_options": {"min_shard_tokens": 1}}, "TypeError: prefill_options must be"),
    "workspace": ({"max_batched_tokens": 1 << 50}, "MemoryError: the Runtime's workspace needs"),
    "warmup": ({"warmup": True}, "RuntimeError: injected warm-up failure"),
}


def _failing_warmup(self: Runtime) -> int:
    raise RuntimeError(f"injected warm-up failure on rank {self.rank}")


def _build(group: dist.ProcessGroup, fault: str) -> dict:
    """Build a Runtime on a short-timeout group, rank 1 with ``fault``; what each rank raised and when.

    Rank 1 stays alive (as a serving process that catches the error does) until rank 0 is done:
    a peer waiting for it learns nothing from a closed connection. A peer whose construction
    returned goes on to a step's first collective, as an engine would, and records how that ends."""
    short = short_timeout_group(group, TIMEOUT_S)
    rank = dist.get_rank(short)
    kwargs: dict = {"mode": "headtp", "max_batched_tokens": 8, "warmup": False}
    result: dict = {"type": None, "error": None}
    with contextlib.ExitStack() as stack:
        if rank == 1:
            kwargs.update(FAULTS[fault][0])
            if fault == "warmup":
                stack.enter_context(mock.patch.object(Runtime, "warmup", _failing_warmup))
        start = time.monotonic()
        try:
            rt = Runtime(MLA, short, **kwargs)
        except Exception as e:
            result = {"type": type(e).__name__, "error": str(e)}
        result["s"] = time.monotonic() - start
    if result["type"] is None:  # built: the next step's agreement waits for rank 1 (until the timeout)
        try:
            rt.comm.check_agreement(0, "first step")
            result["first_step"] = "ok"
        except Exception as e:
            result["first_step"] = f"{type(e).__name__}: {str(e)[:120]}"
        result["first_step_s"] = time.monotonic() - start
    dist.barrier(group=group)  # on the pool's group: rank 1 keeps its end of ``short`` open until here
    dist.destroy_process_group(short)
    return result


@pytest.mark.distributed
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_one_ranks_construction_failure_reaches_its_peer_at_once(dist_pool, fault: str) -> None:
    peer, failed = dist_pool.run(_build, fault, world_size=2)
    own = FAULTS[fault][1]
    assert failed["error"] is not None and f"{failed['type']}: {failed['error']}".startswith(own), failed
    assert peer["type"] == PeerFailedError.__name__, peer
    assert peer["error"].startswith(f"Runtime construction on rank 0 failed because rank 1 of 2 raised {own}"), peer
    assert peer["s"] < FAST_S, peer  # within the report grace, not at the group's timeout (TIMEOUT_S)

