"""An all-to-all of contiguous pieces moved in place (:func:`exchange`), and collectives in flight
(:class:`Pending`).

The ShardQ steps move each token run straight between its place in the sender's and the
receiver's buffers: one point-to-point message per piece and peer, nothing gathered, permuted or
packed. :meth:`Comm.exchange <shardattn.parallel.comm.Comm.exchange>` is this function on its group.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from shardattn.parallel.comm import Comm

__all__ = ["Pending", "exchange"]


class Pending:
    """Collectives in flight: :meth:`wait` orders the current stream after them (NCCL: a device-side
    wait on the group's stream, no host synchronisation; gloo: the host waits)."""

    def __init__(self, works: Sequence[dist.Work] = (), *, comm: Comm | None = None, kind: str = "all_to_all") -> None:
        self._works = list(works)
        self._comm, self._kind = comm, kind

    def wait(self) -> None:
        """Make later work on the current stream see the results (idempotent).

        Raises:
            PeerFailedError: a peer died, hung or raised (as for the blocking collectives).
        """
        works, self._works = self._works, []
        for w in works:
            if self._comm is None:
                w.wait()
            else:
                self._comm.run_collective(self._kind, w.wait)


def exchange(
    comm: Comm,
    sends: Sequence[tuple[int, torch.Tensor]],
    recvs: Sequence[tuple[int, torch.Tensor]],
    *,
    tag: int = 0,
) -> Pending:
    """An all-to-all of contiguous pieces, moved in place: ``sends[i] = (peer, x)`` goes to
    ``peer``, ``recvs[i] = (peer, y)`` is filled from ``peer`` (counted as one ``"all_to_all"``).

    The ``k``-th send of rank ``a`` to rank ``b`` fills the ``k``-th receive of ``b`` from ``a``
    (same shape and dtype); pieces for this rank itself are copied locally, in order. Started
    on the current stream's position, completed by :meth:`Pending.wait` (no host sync on NCCL).

    Args:
        sends / recvs: ``(peer, contiguous tensor)`` pairs, on the backend's device.
        tag: distinguishes exchanges in flight at the same time (gloo matches by tag).
    Returns:
        a :class:`Pending`; do not touch the tensors until it was waited for.
    """
    mine_out = [x for p, x in sends if p == comm.rank]
    mine_in = [y for p, y in recvs if p == comm.rank]
    if len(mine_out) != len(mine_in):
        raise ValueError(f"exchange: {len(mine_out)} pieces sent to this rank itself but {len(mine_in)} received")
    ops = []
    for kind, pairs in ((dist.isend, sends), (dist.irecv, recvs)):
        seen: Counter[int] = Counter()
        for peer, x in pairs:
            if not 0 <= peer < comm.world_size:
                raise ValueError(f"exchange: peer {peer} is not a rank of the group of {comm.world_size}")
            comm.check_tensor("piece", x)
            if not x.is_contiguous():
                raise ValueError("exchange: every piece must be contiguous (it is moved in place)")
            if peer != comm.rank and x.numel():
                to = comm.global_ranks[peer]
                ops.append(dist.P2POp(kind, x, to, group=comm.group, tag=(tag << 16) + seen[peer]))
            seen[peer] += 1
    for x, y in zip(mine_out, mine_in):
        if x.shape != y.shape or x.dtype != y.dtype:
            raise ValueError(
                f"exchange: a piece to this rank is {list(x.shape)} {x.dtype}, its slot {list(y.shape)} {y.dtype}"
            )
    comm.counts["all_to_all"] += 1
    works: list[dist.Work] = []
    if ops:  # the messages first: NCCL's stream then need not wait for the local copies below
        comm.run_collective("all_to_all", lambda: works.extend(dist.batch_isend_irecv(ops)))
    for x, y in zip(mine_out, mine_in):
        y.copy_(x)
    return Pending(works, comm=comm, kind="all_to_all") if works else Pending()
