"""A doorbell between two processes of one host that also orders their memory: a named pipe (FIFO).

The Ray pool's shared-memory transport (:mod:`shardattn.serving.shm`) writes a step's tensors
into a mapped region, then tells the ranks; a rank that learns of the step must see the tensors
written before it. A plain store of a sequence number to the region does not promise that on
every CPU: x86 keeps stores (and loads) in order, Arm (Grace Hopper, Grace Blackwell) does not,
and Python has no atomics to make the store a release and the load an acquire.

A pipe does. ``write(2)`` and ``read(2)`` on one pipe both take the pipe's lock in the kernel
(Linux: ``pipe->mutex`` in ``pipe_write`` / ``pipe_read``): the writer's unlock is a release, the
reader's lock an acquire, so everything the writer stored before its ``write`` is visible to the
reader once its ``read`` returned the bytes, on any CPU the kernel runs on. The 8-byte token
(the step's sequence number) is written in one piece (pipes write up to ``PIPE_BUF`` bytes
atomically). A FIFO is a pipe with a name, so the processes need not be related (Ray actors are
not the driver's children): each side opens it by path.

:class:`Doorbell` is one direction: :meth:`ring` writes a token, :meth:`poll` takes one without
waiting (spinning callers poll), :meth:`wait` sleeps in ``poll(2)`` until one arrives (the
kernel wakes the sleeper when the writer writes: no polling interval). ``poll(2)`` takes any
file descriptor (``select(2)`` only those below 1024, which a driver holding many sockets or
files has passed). Both ends open the FIFO
read-write and non-blocking (Linux), so opening never waits for the other side and a side that
died leaves the other's calls working.

Cost (``benchmarks/shm_roundtrip.py``): one ``write`` and one ``read`` per direction and rank per
step, a few microseconds each.
"""

from __future__ import annotations

import os
import select
import struct

__all__ = ["Doorbell", "wait_any"]

_TOKEN = struct.Struct("<q")


class Doorbell:
    """One direction of a FIFO at ``path`` (module docstring).

    Args:
        path: the FIFO's file name (the driver's region file plus a suffix).
        create: make the FIFO (the side that owns it: it fails if the name exists) or open it.
    """

    def __init__(self, path: str, *, create: bool) -> None:
        self.path = path
        if create:
            os.mkfifo(path, 0o600)
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_NONBLOCK)

    def fileno(self) -> int:
        if self._fd is None:
            raise ValueError(f"doorbell {self.path} is closed")
        return self._fd

    def ring(self, token: int) -> None:
        """Write ``token`` (an int64). Everything this process stored before is visible to the
        process whose :meth:`poll` / :meth:`wait` returns it."""
        os.write(self.fileno(), _TOKEN.pack(int(token)))

    def poll(self) -> int | None:
        """The oldest token rung and not taken yet, without waiting; ``None`` when there is none."""
        try:
            data = os.read(self.fileno(), _TOKEN.size)
        except BlockingIOError:
            return None
        if len(data) != _TOKEN.size:  # tokens are written whole (<= PIPE_BUF): never a part
            raise RuntimeError(f"doorbell {self.path}: read {len(data)} bytes of an 8-byte token")
        return _TOKEN.unpack(data)[0]

    def wait(self, timeout_s: float) -> int | None:
        """:meth:`poll`, sleeping up to ``timeout_s`` for a token to be rung (``None``: none came)."""
        token = self.poll()
        if token is not None:
            return token
        return self.poll() if _readable([self.fileno()], timeout_s) else None

    def close(self, *, unlink: bool = False) -> None:
        """Close this side (and remove the name, ``unlink``: the side that created it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def wait_any(bells: list[Doorbell], timeout_s: float) -> list[int]:
    """Sleep until one of ``bells`` has a token or ``timeout_s`` passed; the indices of those with one
    (their tokens not taken: :meth:`Doorbell.poll` them)."""
    if not bells:
        return []
    fds = _readable([b.fileno() for b in bells], timeout_s)
    return [i for i, b in enumerate(bells) if b.fileno() in fds]


def _readable(fds: list[int], timeout_s: float) -> set[int]:
    """Those of ``fds`` with an event (a token to read), after sleeping in ``poll(2)`` until one has
    one or ``timeout_s`` passed (rounded up to a millisecond); any descriptor number."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return {fd for fd, _ in poller.poll(max(0.0, timeout_s) * 1e3)}
