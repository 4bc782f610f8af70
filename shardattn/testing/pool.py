"""A pool of worker processes, one rank each of a torch.distributed world, that runs functions on all ranks.

The pytest plugin (:mod:`shardattn.testing.pytest_plugin`) starts one pool of ``--nproc`` workers per
test run, so a distributed test costs a message round trip rather than a process spawn. Each call
runs ``fn(group, *args)`` on ranks ``0 .. world_size - 1`` (a sub-group when ``world_size`` is below
the pool's size) and returns the per-rank results.

Failure handling:

* a rank that raises fails the call with :class:`RankFailed`, naming the rank that failed first
  and its traceback, then every other failed rank's (a rank that failed later, waiting on the first
  one, comes after it whatever its number); the other ranks, possibly stuck in a collective with
  the dead one, get a short grace period and the pool is then restarted for the next call;
* a rank's return value that does not pickle fails the call the same way (its rank, the pickling
  error); a function or arguments that do not pickle are a ``TypeError`` before any rank runs;
* a call that does not finish within ``timeout`` seconds (a hung collective) fails with
  :class:`RankTimeout` naming the ranks that did not answer, and the pool is restarted;
* a rank whose body calls ``pytest.skip`` / ``pytest.xfail`` (a pytest outcome, not an error)
  skips / xfails the call with its message (after the grace, should other ranks still wait).

Workers run with one CPU thread each (ranks share the machine's cores) and, when the call asks
for ``backend="nccl"``, rank ``r`` uses ``cuda:r``.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

#: Seconds a call may take before its ranks count as hung.
DEFAULT_TIMEOUT_S = 120.0
#: Seconds the other ranks get to report after one rank failed.
FAILURE_GRACE_S = 5.0


class RankFailed(RuntimeError):
    """A rank raised; the message holds its rank number and traceback."""


class RankTimeout(TimeoutError):
    """Some ranks did not finish within the call's timeout (likely a hung collective)."""


def _pytest_outcome(error: BaseException) -> tuple[str, str] | None:
    """``("skip" | "xfail", message)`` for pytest's skip / xfail outcome exceptions, else ``None``."""
    kind = {"Skipped": "skip", "XFailed": "xfail"}.get(type(error).__name__)
    if kind is None or not any(c.__name__ == "OutcomeException" for c in type(error).__mro__):
        return None  # pytest's outcome classes (their module reads "builtins")
    return kind, str(getattr(error, "msg", None) or error)


@dataclass(frozen=True)
class _Call:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    world_size: int
    backend: str
    call_id: int


def free_port() -> int:
    """A TCP port on the loopback interface that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker_main(rank: int, world_size: int, init_file: str, inbox: Any, outbox: Any, timeout_s: float) -> None:
    """Body of one worker process: join the world, then run calls until told to stop."""
    import torch
    import torch.distributed as dist

    from shardattn.launch.process_group import destroy_groups

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    store = dist.FileStore(init_file, world_size)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    groups: dict[tuple[str, int], Any] = {}

    def group_for(backend: str, size: int) -> Any:
        key = (backend, size)
        if key not in groups:
            if backend == "nccl":
                torch.cuda.set_device(rank % max(1, torch.cuda.device_count()))
            if backend == "gloo" and size == world_size:
                groups[key] = dist.group.WORLD
            else:  # every rank of the world takes part in creating a sub-group
                groups[key] = dist.new_group(list(range(size)), backend=backend, timeout=timeout)
        return groups[key]

    outbox.put((rank, -1, "ready", None))
    while True:
        message = inbox.get()
        if message is None:
            break
        call_id, payload = message
        try:
            call: _Call = ForkingPickler.loads(payload)
            group = group_for(call.backend, call.world_size)
            if rank >= call.world_size:
                outbox.put((rank, call_id, "idle", None))
                continue
            result = call.fn(group, *call.args, **call.kwargs)
        except BaseException as e:  # report everything, including KeyboardInterrupt of a test body
            outcome = _pytest_outcome(e)
            if outcome is not None:  # a skip or xfail of the test body: its kind and message
                outbox.put((rank, call_id, "outcome", outcome))
            else:
                outbox.put((rank, call_id, "error", traceback.format_exc()))
            continue
        try:  # pickled here: a queue's feeder thread would only print the error, and the call hang
            outbox.put((rank, call_id, "ok", bytes(ForkingPickler.dumps(result))))
        except Exception:
            outbox.put((rank, call_id, "error", f"its return value ({type(result).__name__}) cannot be sent back:\n"
                        + traceback.format_exc()))  # fmt: skip
    destroy_groups()


def _failure_report(errors: dict[int, str], missing: list[int], world_size: int) -> str:
    """The message of a call's :class:`RankFailed`: ``errors`` (rank -> traceback, in the order
    they came) led by the first, then each later one; ``missing``: ranks that never answered."""
    first, *later = errors
    if not later:
        head = f"rank {first} of {world_size} failed"
    else:
        head = f"rank {first} of {world_size} failed first (ranks {sorted(errors)} failed)"
    if missing:
        head += f"; ranks {missing} did not answer"
    return "\n".join([f"{head}:\n{errors[first]}", *(f"rank {r} failed too:\n{errors[r]}" for r in later)])


class DistributedPool:
    """``size`` worker processes forming one gloo world; runs functions on all of them.

    Args:
        size: number of ranks (``--nproc``).
        timeout_s: default per-call timeout in seconds (also the collectives' own timeout).

    Example (in a test; ``_body`` must be a module-level function)::

        results = pool.run(_body, x, world_size=2)   # _body(group, x) on ranks 0 and 1
    """

    def __init__(self, size: int, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self.timeout_s = timeout_s
        self._procs: list[Any] = []
        self._inboxes: list[Any] = []
        self._outbox: Any = None
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        self._call_id = 0

    # -- lifecycle -------------------------------------------------------------------------
    def _start(self) -> None:
        import torch.multiprocessing as mp

        # forkserver with torch preloaded: a (re)start forks a process that imported torch once,
        # instead of importing it again in every worker (seconds on a busy machine). The server
        # starts before any worker and never initialises CUDA, so workers may still use GPUs.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed"])
        self._tmpdir = tempfile.TemporaryDirectory(prefix="shardattn-pool-")
        init_file = os.path.join(self._tmpdir.name, "store")
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(self.size)]
        self._procs = [
            ctx.Process(
                target=_worker_main,
                args=(rank, self.size, init_file, self._inboxes[rank], self._outbox, self.timeout_s),
                daemon=True,
            )
            for rank in range(self.size)
        ]
        for p in self._procs:
            p.start()
        ready = self._collect(set(range(self.size)), -1, self.timeout_s)
        failed = {r: v for r, (status, v) in ready.items() if status != "ready"}
        if failed:
            self.close()
            raise RankFailed(f"worker start failed: {failed}")

    def close(self, *, force: bool = False) -> None:
        """Stop every worker: politely, or at once with ``force`` (ranks wedged in collectives)."""
        if not force:
            for box in self._inboxes:
                try:
                    box.put(None)
                except (OSError, ValueError):
                    pass
            for p in self._procs:
                p.join(timeout=2)
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        self._procs, self._inboxes, self._outbox = [], [], None
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def _alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    # -- calls -----------------------------------------------------------------------------
    def _collect(self, ranks: set[int], call_id: int, timeout_s: float) -> dict[int, tuple[str, Any]]:
        """Gather ``(status, value)`` from ``ranks`` for ``call_id`` until done or timed out."""
        import time

        deadline = time.monotonic() + timeout_s
        got: dict[int, tuple[str, Any]] = {}
        while len(got) < len(ranks):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, cid, status, value = self._outbox.get(timeout=min(remaining, 0.25))
            except queue.Empty:
                dead = [r for r in ranks if r not in got and not self._procs[r].is_alive()]
                for r in dead:
                    got[r] = ("error", f"worker process of rank {r} died (exit code {self._procs[r].exitcode})")
                if dead:  # as for a rank that raised: the others get a short grace, not the whole timeout
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
                continue
            if cid != call_id:
                continue  # a late answer to an earlier, abandoned call
            if status == "ok":
                try:
                    value = ForkingPickler.loads(value)
                except Exception:
                    status, value = "error", "its return value cannot be read back:\n" + traceback.format_exc()
            got[rank] = (status, value)
            if status in ("error", "outcome"):  # others may be stuck waiting on this rank
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        return got

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        world_size: int | None = None,
        backend: str = "gloo",
        timeout: float | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(group, *args, **kwargs)`` on ranks ``0 .. world_size - 1``.

        Args:
            fn: a module-level (picklable) function taking the rank's ProcessGroup first.
            world_size: ranks taking part (default: the whole pool); at most ``size``.
            backend: ``"gloo"`` or ``"nccl"`` (rank ``r`` then uses ``cuda:r``).
            timeout: seconds before the call counts as hung (default: the pool's).
        Returns:
            the per-rank return values, in rank order.
        Raises:
            TypeError: ``fn`` or its arguments do not pickle (nothing ran).
            RankFailed: a rank raised, or its return value did not pickle (message: the rank that
                failed first and its traceback, then every other failed rank's).
            RankTimeout: some ranks did not answer in time.
            pytest's skip / xfail outcome: a rank's body skipped or xfailed (no rank failed).
        """
        world_size = self.size if world_size is None else world_size
        if not 1 <= world_size <= self.size:
            raise ValueError(f"world_size must be in [1, {self.size}], got {world_size}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if not self._alive():
            self.close()
            self._start()
        self._call_id += 1
        call = _Call(fn, args, kwargs, world_size, backend, self._call_id)
        try:  # one pickle a rank (a tensor's shared memory is handed over once); a queue's feeder
            # thread would only print the error, and the call wait out its timeout
            payloads = [bytes(ForkingPickler.dumps(call)) for _ in self._inboxes]
        except Exception as e:
            name = getattr(fn, "__qualname__", repr(fn))
            raise TypeError(f"{name}: the function and its arguments cannot be sent to the ranks: {e}") from e
        for box, payload in zip(self._inboxes, payloads):
            box.put((call.call_id, payload))
        got = self._collect(set(range(self.size)), call.call_id, self.timeout_s if timeout is None else timeout)
        errors = {r: v for r, (status, v) in got.items() if status == "error"}  # in the order they came
        outcomes = [v for _, (status, v) in sorted(got.items()) if status == "outcome"]
        missing = sorted(set(range(self.size)) - set(got))
        if errors or missing:
            self.close(force=True)  # ranks may be wedged in collectives: start afresh next call
        if outcomes and not errors:  # the test body skipped or xfailed (on the ranks that answered)
            import pytest

            kind, message = outcomes[0]
            if kind == "skip":
                pytest.skip(message)
            pytest.xfail(message)
        if errors:
            raise RankFailed(_failure_report(errors, missing, world_size))
        if missing:
            raise RankTimeout(
                f"ranks {missing} of {world_size} did not finish within "
                f"{self.timeout_s if timeout is None else timeout:.0f} s (hung collective?)"
            )
        return [got[r][1] for r in range(world_size)]
