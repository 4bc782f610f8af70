"""Which ranks of a group share a host: one exchange of host identities -> a :class:`~shardattn.plan.nodes.NodeLayout`.

A rank's host identity is its host name and the kernel's boot id (``/proc/sys/kernel/random/boot_id``
on Linux): two ranks with the same identity run on one host (their GPUs talk over NVLink), others
talk over the network. A launcher may know better and pass its own identity: under ``torchrun``
the agent's node rank (``GROUP_RANK``), so two agents started on one machine count as two nodes
(``shardattn.launch`` does this; tests use it to run a two-node group on one host).

:func:`exchange_node_layout` all-gathers one 63-bit hash of each rank's identity (on its own
:class:`~shardattn.parallel.comm.Comm`, so the caller's collective counts are untouched) and
returns the layout, the same on every rank. The Runtime calls it once, at construction; the same
all-gather carries a hash of what its ranks must agree on (its spec and mode), so ranks built
with different ones fail there, every one of them, naming the ranks that differ, and whether the
caller's work before it failed on this rank (:func:`~shardattn.parallel.agreement.settle`), so
its peers raise at once, naming it, rather than wait for it in a later collective.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from pathlib import Path

from shardattn.parallel.agreement import dissenters, settle, stable_fingerprint
from shardattn.parallel.comm import Comm
from shardattn.parallel.groups import GroupLike
from shardattn.plan.nodes import NodeLayout

__all__ = ["exchange_node_layout", "host_identity"]

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def host_identity() -> str:
    """This process's host: ``"<host name>/<boot id>"`` (the boot id is empty where the OS has none)."""
    try:
        boot = _BOOT_ID.read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def exchange_node_layout(
    group: GroupLike | Comm,
    host_id: str | None = None,
    *,
    agree: Sequence[tuple[str, object]] = (),
    error: Exception | None = None,
    what: str = "exchange_node_layout",
) -> NodeLayout:
    """The node of every rank of ``group``: one all-gather of host identities (every rank calls it).

    Args:
        group: the process group (a ``ProcessGroup``, a 1-D ``DeviceMesh``, ``(mesh, dim name)``,
            or a :class:`~shardattn.parallel.comm.Comm`, whose counts it leaves alone and whose
            device and failure-report grace it takes).
        host_id: this rank's host identity (default :func:`host_identity`); ranks passing equal
            strings share a node.
        agree: ``(what, value)`` pairs every rank must pass equal (compared by
            :func:`~shardattn.parallel.agreement.stable_fingerprint`, so by ``repr``), carried by
            the same all-gather; the same count on every rank (a rank that failed may pass any values).
        error: the exception the caller's work before the exchange raised on this rank, if any:
            the gather carries it to the peers (:func:`~shardattn.parallel.agreement.settle`) and
            it is re-raised here.
        what: what the exchange is part of, for the peers' message.
    Returns:
        the :class:`~shardattn.plan.nodes.NodeLayout`, equal on every rank.
    Raises:
        the given ``error``, or ``TypeError`` (``host_id`` is neither a string nor ``None``), on its
            rank; the gather carries the failure, so every other rank raises
            :class:`~shardattn.errors.PeerFailedError` naming that rank and its exception at once.
        ValueError: on every rank, when the ranks passed different values for one of ``agree``:
            names it, the ranks that differ from the majority and this rank's value.
    """
    if error is None and host_id is not None and not isinstance(host_id, str):
        error = TypeError(f"host_id must be a str or None, got {type(host_id).__name__}")
    if isinstance(group, Comm):  # its own Comm (the caller's counts stay as they are), on the caller's terms
        comm = Comm(group.group, device=group.device, report_grace_s=group.report_grace_s)
    else:
        comm = Comm(group)
    if comm.world_size == 1:
        if error is not None:
            raise error
        return NodeLayout.single(1)
    if error is None:
        key = stable_fingerprint("host", host_identity() if host_id is None else host_id)
        mine = [key, *(stable_fingerprint(name, v) for name, v in agree)]
    else:
        mine = [0] * (1 + len(agree))
    rows = settle(comm, what, mine, error=error)
    for i, (name, value) in enumerate(agree, start=1):
        bad, good = dissenters([row[i] for row in rows])
        if bad:
            raise ValueError(
                f"{name}: rank(s) {bad} disagree with rank(s) {good}; every rank must pass the same {name} "
                f"(rank {comm.rank}'s: {value!r})"
            )
    return NodeLayout.from_host_ids([row[0] for row in rows])
