"""Creating the launcher's process groups, with a timeout, and failing fast when a peer dies.

``torchrun`` (or any launcher that sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``) starts one process per rank; :func:`init_groups` joins
them into:

* ``data``: the group the attention steps run over (NCCL with one GPU per rank, else gloo);
* ``control``: a gloo group over the same ranks for small host-side messages: the agreement
  check before each step's collectives, and the gathering of results and reports. A rank that
  died closes its gloo connections, so its peers' next control message fails at once, and a
  rank that hangs makes it fail after ``timeout_s``. Running the agreement on gloo before the
  NCCL collectives means a dead peer is noticed on the host, where it can be reported, rather
  than inside a GPU collective.

Without ``RANK`` in the environment the launcher runs as a world of one (a hash store, no
network).
"""

from __future__ import annotations

import datetime
import gc
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DistEnv",
    "HostGroups",
    "LaunchGroups",
    "destroy_groups",
    "host_groups",
    "init_groups",
    "nccl_options",
    "pick_device",
    "world_group",
]


@dataclass(frozen=True)
class DistEnv:
    """Rank, world size and rendezvous address, as torchrun sets them in the environment.

    ``node_rank``: torchrun's ``GROUP_RANK``, the rank of this process's agent (one per node),
    when set; :attr:`host_id` turns it into the host identity the Runtime groups ranks by.
    """

    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None
    node_rank: int | None = None

    @property
    def host_id(self) -> str | None:
        """The host identity of this rank for :class:`~shardattn.runtime.runtime.Runtime`'s
        ``host_id``: torchrun's agent (``"torchrun-node-<GROUP_RANK>"``), so every agent counts as
        one node, also two agents started on one machine; ``None`` (the Runtime's own host name and
        boot id) without torchrun.

        >>> DistEnv(3, 4, 1, "127.0.0.1", 29500, node_rank=1).host_id
        'torchrun-node-1'
        """
        return None if self.node_rank is None else f"torchrun-node-{self.node_rank}"

    @property
    def launched(self) -> bool:
        """``True`` under torchrun (or another launcher that sets ``RANK``)."""
        return self.master_addr is not None

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> DistEnv:
        """Read the torchrun variables; a world of one when they are absent.

        >>> DistEnv.from_env({}).world_size
        1
        >>> DistEnv.from_env({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2",
        ...                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}).rank
        2
        """
        env = os.environ if environ is None else environ
        if "RANK" not in env:
            return cls(0, 1, 0, None, None)
        try:
            rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
            local = int(env.get("LOCAL_RANK", rank))
            port = int(env["MASTER_PORT"])
            node = int(env["GROUP_RANK"]) if "GROUP_RANK" in env else None
        except (KeyError, ValueError) as e:
            raise ValueError(f"incomplete torchrun environment: {e!r} (need RANK, WORLD_SIZE, MASTER_PORT)") from None
        if not 0 <= rank < world:
            raise ValueError(f"RANK must be in [0, WORLD_SIZE={world}), got {rank}")
        return cls(rank, world, local, env.get("MASTER_ADDR", "127.0.0.1"), port, node)


def pick_device(choice: str, env: DistEnv) -> torch.device:
    """The device of this rank: ``cuda:LOCAL_RANK`` when a GPU is asked for or visible, else CPU.

    Raises:
        ValueError: ``cuda`` was asked for without enough visible GPUs for one per local rank.
    """
    if choice == "cpu":
        return torch.device("cpu")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if choice == "auto" and visible == 0:
        return torch.device("cpu")
    if env.local_rank >= visible:
        raise ValueError(
            f"--device {choice}: local rank {env.local_rank} needs GPU {env.local_rank}, but {visible} visible "
            "(one rank per GPU; pass --device cpu to run on the CPU)"
        )
    return torch.device("cuda", env.local_rank)


@dataclass
class LaunchGroups:
    """The process groups of one launcher process (see the module docstring)."""

    env: DistEnv
    device: torch.device
    data: dist.ProcessGroup
    control: dist.ProcessGroup
    backend: str
    timeout_s: float

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size


def nccl_options() -> object:
    """Options of the launchers' NCCL groups: collectives on a high-priority stream.

    A ShardQ step's exchanges run beside its attention kernels, whose programs fill every SM;
    with a high-priority stream the block scheduler gives NCCL's blocks the next free SMs instead
    of the kernel's next wave (measured on two H200s: docs/DECISIONS.md, D40).
    """
    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = True
    return opts


def init_groups(env: DistEnv, device: torch.device, *, timeout_s: float) -> LaunchGroups:
    """Join the world (rendezvous and every collective time out after ``timeout_s``).

    The data group uses NCCL on CUDA devices and gloo on the CPU; the control group is always
    gloo. Raises whatever the rendezvous raises when a peer never arrives within the timeout.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs: dict[str, object] = {"backend": backend, "timeout": timeout}
    if env.launched:
        kwargs.update(init_method="env://", rank=env.rank, world_size=env.world_size)
    else:
        kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
    if device.type == "cuda":
        kwargs["device_id"] = device  # eager NCCL init: a bad GPU fails here, not mid-step
        kwargs["pg_options"] = nccl_options()
    dist.init_process_group(**kwargs)  # type: ignore[arg-type]
    data = world_group()
    if backend == "gloo":
        control = data
    else:  # host-side messages never wait behind GPU work, and a dead peer shows up here first
        control = dist.new_group(list(range(env.world_size)), backend="gloo", timeout=timeout)
    return LaunchGroups(env, device, data, control, backend, timeout_s)


def world_group() -> dist.ProcessGroup:
    """The world's group once this process has joined it (``dist.init_process_group``); raises
    ``RuntimeError`` before."""
    group = dist.group.WORLD
    if group is None:
        raise RuntimeError("the default process group is not initialized: join the world first")
    return group


@dataclass(frozen=True)
class HostGroups:
    """Sub-groups of a group spread over hosts (:func:`host_groups`): ``leaders`` one rank per host
    (the first of each), ``first_host`` the ranks of host 0 (``None`` when it has one rank); each
    ``None`` on the ranks outside it."""

    leaders: dist.ProcessGroup | None
    first_host: dist.ProcessGroup | None


def host_groups(group: dist.ProcessGroup, nodes: Any) -> HostGroups:
    """The sub-groups ``python -m shardattn.calibrate`` measures the network and one host with
    (``nodes``: the group's :class:`~shardattn.plan.nodes.NodeLayout`). Every rank of the world
    calls it: creating a group is collective."""
    rank = dist.get_rank(group)
    global_ranks = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
    leaders = [nodes.ranks_on(n)[0] for n in range(nodes.num_nodes)]
    first = list(nodes.ranks_on(0))
    lead_group = dist.new_group([global_ranks[r] for r in leaders])
    host_group = dist.new_group([global_ranks[r] for r in first]) if len(first) > 1 else None
    return HostGroups(lead_group if rank in leaders else None, host_group if rank in first else None)


def destroy_groups() -> None:
    """Leave the world (a no-op when it was never joined).

    First frees what the rank's work left in reference cycles (a Runtime, its communicator, their
    work handles) while the groups still exist: collected only at interpreter exit, a gloo group's
    objects may be torn down after what they use, and the rank aborts after its work is done."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
