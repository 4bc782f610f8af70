"""The network between hosts, as the cost model prices it: link rates and collectives that cross hosts.

A collective over ``W`` ranks on ``W / R`` hosts of ``R`` ranks each moves part of its bytes over
NVLink (between the ``R`` ranks of a host) and part over the network (one NIC per GPU on HGX /
DGX H100 and H200 nodes). Each rank's two kinds of traffic run at the same time, so the slower
one bounds the collective. The model is deliberately simple (no congestion, no topology beyond
"same host or not"):

* **all-to-all** (ShardQ's exchanges): a rank sends ``nbytes / W`` to every rank; ``(R - 1) / W``
  of its buffer stays on the host, ``(W - R) / W`` crosses its NIC::

      ms = max(lat_nvlink, lat_net) + max(nbytes (R-1)/W / bw_nvlink, nbytes (W-R)/W / bw_net)

* **all-gather** (PCP's KV gather; a ring): every byte a rank receives passes every hop of the
  ring, and the ring crosses hosts, so the slowest hop (the NIC) bounds it::

      ms = max(lat_nvlink, lat_net) + nbytes (W-1)/W / min(bw_nvlink, bw_net)

Both are returned as one effective rate on the ``nbytes (W - 1) / W`` bytes a collective's
bus-bandwidth convention counts (:func:`cross_node_rate`), so the cost model keeps one formula.

A measured table (``python -m shardattn.calibrate`` on two or more nodes) carries the network's
own rate (:class:`LinkRate`, one rank per node exchanging); without one the model takes the
default of a link type from :data:`LINKS`. Those defaults are line rates, an upper bound of what
NCCL reaches (its bus bandwidth on a healthy fabric is typically 80-95 % of line rate), with an
assumed latency; measure the machine for real numbers.

Pure host code.

>>> lat, bw = cross_node_rate("all_to_all", 16, 8, nvlink_latency_ms=0.045, nvlink_gbps=300.0, link=LINKS["ib-ndr"])
>>> round(bw, 2)  # 8 of 16 peers behind the 50 GB/s NIC: 1/2 the buffer in nbytes (15/16) / 93.75 GB/s
93.75
>>> cross_node_rate("all_gather", 16, 8, nvlink_latency_ms=0.045, nvlink_gbps=300.0, link=LINKS["ib-ndr"])[1]
50.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["DEFAULT_LINK", "LINKS", "LinkRate", "cross_node_rate", "resolve_link"]


@dataclass(frozen=True)
class LinkRate:
    """The network between hosts as one GPU sees it: ``latency_ms + moved_bytes / busbw``.

    Attributes:
        name: a link type of :data:`LINKS`, or ``"measured"``.
        latency_ms: latency of one small collective across hosts.
        busbw_gbps: bytes per second (1e9) through one GPU's NIC.
        source: where the numbers come from (a measurement's command and date, or a datasheet).
    """

    name: str
    latency_ms: float
    busbw_gbps: float
    source: str = ""

    def validate(self) -> None:
        """Raise ``ValueError`` unless the rate is finite and positive and the latency non-negative."""
        if not (self.busbw_gbps > 0 and math.isfinite(self.busbw_gbps)):
            raise ValueError(f"bad network bandwidth in {self}")
        if not (self.latency_ms >= 0 and math.isfinite(self.latency_ms)):
            raise ValueError(f"bad network latency in {self}")


#: Default link rates per link type (one NIC per GPU): line rates and an assumed latency.
LINKS: dict[str, LinkRate] = {
    "ib-ndr": LinkRate(
        "ib-ndr",
        0.03,
        50.0,
        "InfiniBand NDR, one 400 Gb/s ConnectX-7 NIC per GPU (HGX / DGX H100 and H200 nodes): 400 Gb/s = "
        "50 GB/s line rate per GPU; latency 30 us assumed for a small NCCL collective across hosts",
    ),
    "roce-400": LinkRate(
        "roce-400",
        0.04,
        50.0,
        "RoCE v2, one 400 GbE NIC per GPU: 50 GB/s line rate; latency 40 us assumed",
    ),
    "ib-hdr": LinkRate(
        "ib-hdr",
        0.03,
        25.0,
        "InfiniBand HDR, one 200 Gb/s NIC per GPU (HGX A100 nodes): 25 GB/s line rate; latency 30 us assumed",
    ),
    "eth-100": LinkRate(
        "eth-100",
        0.05,
        12.5,
        "100 GbE per GPU: 12.5 GB/s line rate; latency 50 us assumed",
    ),
}
DEFAULT_LINK = "ib-ndr"
"""The link type assumed when neither the table nor the caller names one (HGX H200 nodes)."""


def resolve_link(link: LinkRate | str | None, measured: LinkRate | None = None) -> LinkRate:
    """A link rate: ``link`` itself, the default of the type it names, else ``measured`` (a table's),
    else :data:`DEFAULT_LINK`'s. Raises ``ValueError`` for an unknown type."""
    if isinstance(link, LinkRate):
        link.validate()
        return link
    if link is None:
        return measured if measured is not None else LINKS[DEFAULT_LINK]
    if link not in LINKS:
        raise ValueError(f"network must be a LinkRate or one of {sorted(LINKS)}, got {link!r}")
    return LINKS[link]


def cross_node_rate(
    op: str,
    world_size: int,
    ranks_per_node: int,
    *,
    nvlink_latency_ms: float,
    nvlink_gbps: float,
    link: LinkRate,
) -> tuple[float, float]:
    """``(latency_ms, bus GB/s)`` of ``op`` over ``world_size`` ranks on hosts of ``ranks_per_node``
    (module docstring); the bus bandwidth applies to ``nbytes * (W - 1) / W``.

    Args:
        op: ``"all_to_all"`` or ``"all_gather"``.
        nvlink_latency_ms / nvlink_gbps: the collective's rate among the ``ranks_per_node`` ranks
            of one host (unused when it is 1).
        link: the network's rate.
    """
    w, r = int(world_size), int(ranks_per_node)
    if not 1 <= r < w:
        raise ValueError(f"ranks_per_node must be in [1, world_size={w}) for a collective across hosts, got {r}")
    latency = max(link.latency_ms, nvlink_latency_ms if r > 1 else 0.0)
    if op == "all_gather":
        return latency, min(link.busbw_gbps, nvlink_gbps) if r > 1 else link.busbw_gbps
    if op != "all_to_all":
        raise ValueError(f"op must be 'all_to_all' or 'all_gather', got {op!r}")
    # seconds per byte of the buffer: the NVLink share and the NIC share run side by side
    per_byte = max((r - 1) / nvlink_gbps if r > 1 else 0.0, (w - r) / link.busbw_gbps)
    return latency, (w - 1) / per_byte
