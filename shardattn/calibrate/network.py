"""Measure collectives across hosts for a calibration table: the network between them and the group's own rates.

When the ranks of ``python -m shardattn.calibrate`` run on two or more hosts (a
:class:`~shardattn.plan.nodes.NodeLayout` with more than one node), the table gains:

* the network's rate (:class:`~shardattn.plan.links.LinkRate`): one rank per host (the first of
  each) all-to-all among themselves while the others wait, so every byte crosses the network
  through one GPU's NIC, fitted to ``latency + moved / bus bandwidth``;
* the one-host rates of the first host's ranks (NVLink), for the model's combination of the two
  at layouts that were not measured (:func:`~shardattn.plan.links.cross_node_rate`);
* the whole group's all-to-all and all-gather, tagged with its ranks per node, which the model
  takes as they are at that layout.

Every rank of the group calls :func:`multi_node_rates`, with the sub-groups
:func:`~shardattn.launch.process_group.host_groups` made (one rank per host; the first host).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardattn.calibrate.kernels import collective_rates, fit_latency_bandwidth
from shardattn.calibrate.timing import median_ms
from shardattn.plan.cost import CollectiveRate
from shardattn.plan.links import LinkRate
from shardattn.plan.nodes import NodeLayout

__all__ = ["multi_node_rates", "network_rate"]


def network_rate(
    group: dist.ProcessGroup | None,
    *,
    device: torch.device,
    sizes_mib: Sequence[float] = (4, 32, 128, 512),
    reps: int = 5,
) -> LinkRate | None:
    """The all-to-all rate among one rank per host (``group``: those ranks; ``None`` on the others,
    which return ``None``), as a :class:`LinkRate` named ``"measured"``."""
    if group is None:
        return None
    w = dist.get_world_size(group)
    samples = []
    for mib in sizes_mib:
        n = int(mib * (1 << 20))
        n -= n % w
        src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
        dst = torch.empty(n, dtype=torch.uint8, device=device)

        def call(dst: torch.Tensor = dst, src: torch.Tensor = src) -> None:
            dist.all_to_all_single(dst, src, group=group)

        ms = median_ms(call, device=device, reps=reps, group=group)
        samples.append((n * (w - 1) / w, ms))
    lat, gbps = fit_latency_bandwidth(samples)
    source = f"python -m shardattn.calibrate, all-to-all among {w} hosts (one rank each), {datetime.date.today()}"
    return LinkRate("measured", lat, gbps, source)


def multi_node_rates(
    group: dist.ProcessGroup,
    nodes: NodeLayout,
    host_groups: Any,
    *,
    device: torch.device,
    sizes_mib: Sequence[float] = (4, 32, 128, 512),
    reps: int = 5,
    advance: Callable[[], None] = lambda: None,
) -> tuple[list[CollectiveRate], LinkRate | None]:
    """``(collective rates, network rate)`` of a group spread over ``nodes`` (module docstring; the
    network rate is returned on the ranks that measured it, the first of each host, else ``None``).
    ``host_groups``: :class:`~shardattn.launch.process_group.HostGroups` of ``group`` and ``nodes``.

    Raises:
        ValueError: ``nodes`` is one host, or not the group's size.
    """
    world = dist.get_world_size(group)
    if not nodes.multi_node or nodes.world_size != world:
        raise ValueError(f"nodes must spread the group's {world} ranks over several hosts, got {nodes}")
    net = network_rate(host_groups.leaders, device=device, sizes_mib=sizes_mib, reps=reps)
    advance()
    intra: list[CollectiveRate] = []
    if host_groups.first_host is not None:
        intra = collective_rates(host_groups.first_host, device=device, sizes_mib=sizes_mib, reps=reps)
    dist.barrier(group=group)
    whole = collective_rates(group, device=device, sizes_mib=sizes_mib, reps=reps, advance=advance)
    rpn = nodes.ranks_per_node
    return intra + [CollectiveRate(c.op, c.world_size, c.latency_ms, c.busbw_gbps, rpn) for c in whole], net
