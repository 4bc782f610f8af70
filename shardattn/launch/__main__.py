"""``python -m shardattn.launch``: run synthetic sharded-attention steps on every rank of a torchrun world.

Usage (one rank per GPU; without a GPU gloo and the CPU path, at a small step checked
against the single-process reference)::

    torchrun --nproc-per-node 4 -m shardattn.launch
    torchrun --nproc-per-node 2 -m shardattn.launch --preset glm5 --mode shardq --tokens 16384 --check

Exit status: 0 on success, 2 for a bad option or an impossible configuration (every rank, one
line on rank 0), 3 when ``--check`` finds an error above tolerance (every rank), 4 when a peer
rank died or went silent for ``--timeout`` seconds, 1 for any other error.
"""

from __future__ import annotations

import os
import sys
import traceback

from shardattn.launch.cli import EXIT_INJECTED, EXIT_PEER_FAILED, LaunchError, parse_options


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


def _env_rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit status (see the module docstring)."""
    try:  # options first: a bad one fails before torch is even imported
        opts = parse_options(argv)
    except LaunchError as e:
        if _env_rank() == 0:
            print(str(e), file=sys.stderr, flush=True)
        return e.status
    from shardattn.launch.process_group import DistEnv, destroy_groups, init_groups, pick_device
    from shardattn.launch.runner import plan_run, run

    try:
        env = DistEnv.from_env()
    except ValueError as e:
        print(f"shardattn.launch: error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        try:
            device = pick_device(opts.device, env)
        except ValueError as e:
            raise LaunchError(f"shardattn.launch: error: {e}") from None
        config = plan_run(opts, env.world_size, device)  # raises LaunchError for impossible configurations
    except LaunchError as e:
        if env.rank == 0:  # every rank reached the same verdict from the same inputs; one line is enough
            print(str(e), file=sys.stderr, flush=True)
        return e.status
    if opts.fail_rank == env.rank and opts.fail_at == "setup":
        os._exit(EXIT_INJECTED)  # debug: die before the rendezvous
    try:
        groups = init_groups(env, device, timeout_s=opts.timeout)
    except Exception as e:  # rendezvous timed out or a peer vanished during it
        _say(env.rank, f"shardattn.launch: rank {env.rank}: could not form the process group: {e}")
        os._exit(EXIT_PEER_FAILED)
    try:
        status = run(config, groups)
    except LaunchError as e:
        if env.rank == 0:
            print(str(e), file=sys.stderr, flush=True)
        status = e.status
    except Exception as e:
        if _is_peer_failure(e):
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            _say(
                env.rank,
                f"shardattn.launch: rank {env.rank}: a peer rank failed or went silent "
                f"(timeout {opts.timeout:g} s): {first}",
            )
            os._exit(EXIT_PEER_FAILED)  # skip teardown: it would wait for the dead peer
        _say(env.rank, f"shardattn.launch: rank {env.rank}: {type(e).__name__}: {e}")
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
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
