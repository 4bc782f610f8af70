"""``python -m shardattn.launch``: run synthetic sharded-attention steps on every rank of a torchrun world.

Usage (one rank per GPU; without a GPU gloo and the CPU path, at a small step checked
against the single-process reference)::

    torchrun --nproc-per-node 4 -m shardattn.launch
    torchrun --nproc-per-node 2 -m shardattn.launch --preset glm5 --mode shardq --tokens 16384 --check

Exit status: 0 on success, 2 for a bad option or an impossible configuration (every rank; one
line from the first rank to find it, :mod:`~shardattn.launch.one_line`), 3 when ``--check``
finds an error above tolerance (every rank), 4 when a peer rank died or went silent for
``--timeout`` seconds, 1 for any other error (the rank that raised prints its traceback, then one
line). A step that does not fit the memory is 2 on the rank whose allocation failed (one line from
each such rank; its peers then exit 4), and so is a ``--json`` report the file system refuses at
the end, after the table (one line from rank 0, status 2 on every rank).
"""

from __future__ import annotations

import os
import sys
import traceback

from shardattn.launch.cli import EXIT_INJECTED, EXIT_PEER_FAILED, EXIT_USAGE, LaunchError, parse_options
from shardattn.launch.logs import configure_logging
from shardattn.launch.one_line import report_once


def _say(rank: int, message: str) -> None:
    print(f"[rank {rank}] {message}" if rank else message, file=sys.stderr, flush=True)


def _is_peer_failure(err: BaseException) -> bool:
    """A collective failed because a peer died or timed out (rather than a bug on this rank)."""
    import torch.distributed as dist

    from shardattn.parallel.comm import PeerFailedError

    kinds = tuple(k for k in (getattr(dist, "DistError", None), PeerFailedError) if k is not None)
    if kinds and isinstance(err, kinds):
        return True
    text = str(err).lower()
    needles = ("connection closed", "connection reset", "timed out", "timeout", "broken pipe", "peer", "gloo")
    return isinstance(err, RuntimeError) and any(n in text for n in needles)


def _is_out_of_memory(err: BaseException) -> bool:
    """An allocation that failed (host or device): the run asked for more memory than there is."""
    if isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError":
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit status (see the module docstring)."""
    try:  # options first: a bad one fails before torch is even imported
        opts = parse_options(argv)
    except LaunchError as e:  # every rank reaches the same verdict: one of them says it
        return report_once(str(e), e.status)
    from shardattn.launch.process_group import DistEnv, destroy_groups, init_groups, pick_device
    from shardattn.launch.progress import RunProgress
    from shardattn.launch.runner import plan_run, run

    try:
        env = DistEnv.from_env()
    except ValueError as e:
        return report_once(f"shardattn.launch: error: {e}", EXIT_USAGE)
    configure_logging(opts.log_level, env.rank)
    try:
        try:
            device = pick_device(opts.device, env)
        except ValueError as e:
            raise LaunchError(f"shardattn.launch: error: {e}") from None
        config = plan_run(opts, env.world_size, device)  # raises LaunchError for impossible configurations
    except LaunchError as e:
        return report_once(str(e), e.status)
    if opts.fail_rank == env.rank and opts.fail_at == "setup":
        os._exit(EXIT_INJECTED)  # debug: die before the rendezvous
    progress = RunProgress("shardattn.launch", enabled=opts.progress and env.rank == 0, quiet_s=opts.progress_after)
    progress.phase(f"forming the process group of {env.world_size} rank(s)")
    try:
        groups = init_groups(env, device, timeout_s=opts.timeout)
    except Exception as e:  # rendezvous timed out or a peer vanished during it
        progress.close()
        _say(env.rank, f"shardattn.launch: rank {env.rank}: could not form the process group: {e}")
        os._exit(EXIT_PEER_FAILED)
    try:
        status = run(config, groups, progress)
    except LaunchError as e:
        status = report_once(str(e), e.status)
    except Exception as e:
        if _is_out_of_memory(e):  # the sizes asked for, not a bug: one line, as for an impossible configuration
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            _say(
                env.rank,
                f"shardattn.launch: rank {env.rank}: error: the step does not fit this machine's memory ({first}); "
                "ask for fewer --tokens, --cached, --requests or --query-len",
            )
            os._exit(EXIT_USAGE)  # skip teardown: the peers may still wait in a collective
        if _is_peer_failure(e):
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            _say(
                env.rank,
                f"shardattn.launch: rank {env.rank}: a peer rank failed or went silent "
                f"(timeout {opts.timeout:g} s): {first}",
            )
            os._exit(EXIT_PEER_FAILED)  # skip teardown: it would wait for the dead peer
        traceback.print_exc(file=sys.stderr)  # a bug, not a bad option: where it happened, then what
        _say(env.rank, f"shardattn.launch: rank {env.rank}: {type(e).__name__}: {e}")
        os._exit(1)
    destroy_groups()
    return status


def exit_now(status: int) -> None:
    """Leave the process with ``status`` once its output is flushed, skipping the interpreter's
    teardown: the step's work and the ranks' agreed verdict are done by then, and on a loaded
    host the C++ finalisers of torch's background threads (gloo, the profiler) have aborted a
    finished rank ("terminate called without an active exception", exit -6), failing the run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    exit_now(main())
