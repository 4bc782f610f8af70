"""Which ranks of a group share a host: the node layout the cost model prices collectives by.

Ranks on one host talk over NVLink (hundreds of GB/s); ranks on different hosts over the
network (one 400 Gb/s NIC per GPU is ~50 GB/s). A :class:`NodeLayout` says which node each rank
of a group runs on; the Runtime builds it at construction from one exchange of host identities
(:func:`~shardattn.parallel.hosts.exchange_node_layout`), and the cost model
(:mod:`shardattn.plan.cost`) reads ``ranks_per_node`` to price an exchange that crosses hosts.

Pure host code: no torch, no process group.

>>> nodes = NodeLayout.from_host_ids(["a", "a", "b", "b"])
>>> nodes.node_of, nodes.num_nodes, nodes.ranks_per_node, nodes.multi_node
((0, 0, 1, 1), 2, 2, True)
>>> str(NodeLayout.uniform(2, 8)), str(NodeLayout.single(4))
('2 nodes x 8 ranks', '1 node x 4 ranks')
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["NodeLayout"]


@dataclass(frozen=True)
class NodeLayout:
    """The node of every rank of a group; nodes are numbered in the order of their first rank.

    Attributes:
        node_of: ``[W]`` node index of each rank (``0 .. num_nodes - 1``, first appearances in order).
    """

    node_of: tuple[int, ...]

    def __post_init__(self) -> None:
        nodes = tuple(self.node_of)
        if not nodes:
            raise ValueError("node_of must name the node of at least one rank")
        if any(isinstance(n, bool) or not isinstance(n, int) for n in nodes):
            raise TypeError(f"node_of must hold ints, got {list(nodes)}")
        seen: list[int] = []
        for n in nodes:
            if n not in seen:
                seen.append(n)
        if seen != list(range(len(seen))):
            raise ValueError(f"node_of must number nodes 0, 1, ... in the order of their first rank, got {list(nodes)}")
        object.__setattr__(self, "node_of", nodes)

    @classmethod
    def from_host_ids(cls, host_ids: Sequence[Hashable]) -> NodeLayout:
        """The layout of ranks whose host identities are ``host_ids`` (equal ids: one node)."""
        index: dict[Hashable, int] = {}
        return cls(tuple(index.setdefault(h, len(index)) for h in host_ids))

    @classmethod
    def single(cls, world_size: int) -> NodeLayout:
        """Every rank on one host."""
        return cls((0,) * int(world_size))

    @classmethod
    def uniform(cls, nodes: int, ranks_per_node: int) -> NodeLayout:
        """``nodes`` hosts of ``ranks_per_node`` consecutive ranks each (torchrun's numbering)."""
        if nodes < 1 or ranks_per_node < 1:
            raise ValueError(f"nodes and ranks_per_node must be >= 1, got {nodes} and {ranks_per_node}")
        return cls(tuple(r // ranks_per_node for r in range(nodes * ranks_per_node)))

    @property
    def world_size(self) -> int:
        return len(self.node_of)

    @property
    def num_nodes(self) -> int:
        return max(self.node_of) + 1

    @property
    def node_sizes(self) -> tuple[int, ...]:
        """Ranks on each node."""
        return tuple(self.node_of.count(n) for n in range(self.num_nodes))

    @property
    def ranks_per_node(self) -> int:
        """Ranks of the smallest node: the rank there sends the largest share of an exchange off its
        host, which bounds the step (equal to ``world_size`` on one host)."""
        return min(self.node_sizes)

    @property
    def multi_node(self) -> bool:
        return self.num_nodes > 1

    def ranks_on(self, node: int) -> tuple[int, ...]:
        """The ranks of ``node``, in rank order."""
        return tuple(r for r, n in enumerate(self.node_of) if n == node)

    def __str__(self) -> str:
        sizes = self.node_sizes
        if len(set(sizes)) == 1:
            return f"{len(sizes)} node{'s' if len(sizes) > 1 else ''} x {sizes[0]} rank{'s' if sizes[0] > 1 else ''}"
        return f"{len(sizes)} nodes of {'/'.join(map(str, sizes))} ranks"
