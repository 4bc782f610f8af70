"""Run a function on every rank of a small local world: under ``torchrun``, or by spawning ranks.

For scripts and examples: ``run_ranks(main)`` calls ``main(group)`` on each rank, with one GPU per
rank (NCCL) when each host has a GPU for each of its ranks and CPU ranks (gloo) otherwise. Under
``torchrun`` the world is torchrun's (its hosts' ranks: ``LOCAL_WORLD_SIZE``, each on GPU
``LOCAL_RANK``); run directly, it spawns ``world_size`` processes that meet on a free loopback port.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardattn.launch.process_group import destroy_groups, nccl_options, world_group
from shardattn.testing.pool import free_port

#: Seconds a collective may wait for a peer before the rank fails.
DEFAULT_TIMEOUT_S = 120.0


def _join(
    rank: int, world_size: int, init_method: str | None, timeout_s: float, cpu: bool = False, local_ranks: int = 0
) -> str:
    """Join the world; NCCL when this host has a GPU for each of its ``local_ranks`` (default: every rank)."""
    nccl = not cpu and torch.cuda.is_available() and torch.cuda.device_count() >= (local_ranks or world_size)
    if nccl:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    backend = "nccl" if nccl else "gloo"
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        pg_options=nccl_options() if nccl else None,
    )
    return backend


def _spawned(
    rank: int, main: Callable[[dist.ProcessGroup], None], world_size: int, port: int, timeout_s: float, cpu: bool
):
    _join(rank, world_size, f"tcp://127.0.0.1:{port}", timeout_s, cpu)
    try:
        main(world_group())
    finally:
        destroy_groups()


def run_ranks(
    main: Callable[[dist.ProcessGroup], None],
    *,
    world_size: int = 2,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    cpu: bool = False,
) -> None:
    """Run ``main(group)`` on every rank (torchrun's world, else ``world_size`` spawned ranks).

    Args:
        main: a module-level function taking the world's ProcessGroup.
        world_size: ranks to spawn when not under torchrun.
        timeout_s: collective timeout; a rank whose peer died fails after it instead of hanging.
        cpu: gloo ranks even where there are GPUs enough for NCCL.
    """
    if "RANK" in os.environ:  # under torchrun
        world = int(os.environ["WORLD_SIZE"])
        _join(int(os.environ["RANK"]), world, None, timeout_s, cpu, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        try:
            main(world_group())
        finally:
            destroy_groups()
        return
    mp.spawn(_spawned, args=(main, world_size, free_port(), timeout_s, cpu), nprocs=world_size)
