"""The collectives the parallel steps use, over one ``ProcessGroup``, counted and checked.

:class:`Comm` resolves the group's rank, size, backend and the device of its small tensors
once; every step takes a ``ProcessGroup`` (or a ``DeviceMesh``, :mod:`~shardattn.parallel.groups`)
or a ``Comm`` (:meth:`Comm.wrap`). Each collective it
issues is counted by kind in :attr:`Comm.counts`, so tests can assert, e.g., that a ShardQ
prefill issues exactly two all-to-alls. Misuse (split sizes that do not add up, a tensor on the
wrong device for the backend, shapes that do not divide) raises ``ValueError`` before anything
is sent.

Ranks that disagree (different plans, different shapes, a rank whose inputs failed validation)
would otherwise enter mismatched collectives and hang or corrupt data. :meth:`Comm.check_agreement`
all-gathers one ``int64`` fingerprint and an error flag per rank and raises the same clear
``ValueError`` on every rank, naming the ranks that disagree, instead.

A rank that fails *during* a step (its kernel raises, its process exits, it hangs) leaves the
others waiting in a collective until the group's timeout or a closed connection. Each collective
here turns that into :class:`PeerFailedError` naming the failing rank: a rank whose step raised
posts a one-line report to the group's store (:meth:`Comm.reporting_failures`), and a rank whose
collective failed posts that it is alive, waits up to :data:`REPORT_GRACE_S` for its peers'
reports, and names the ranks that raised, or, failing that, the ranks that did not report (they
exited or hang). Survivors learn of the failure when the group's timeout expires (a rank that
raised or hangs) or, those waiting on the connection of a rank whose process exited, at once;
a survivor that learns at once may also name a live peer that is still blocked until its own
timeout (waiting on a rank that has already given up): it had not reported either. Reports stay
in the group's store: a group in which a step failed is not to be reused (its ranks are out of
step anyway).

Mixed-dtype payloads (a bf16 output and its fp32 LSE) travel in one collective as bytes:
:func:`~shardattn.parallel.packing.pack_rows` / :func:`~shardattn.parallel.packing.unpack_rows`
(re-exported here). The failure reports live in :mod:`shardattn.parallel.peer_failures`.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from shardattn.parallel.groups import GroupLike, resolve_group
from shardattn.parallel.packing import pack_rows, packed_nbytes, unpack_rows
from shardattn.parallel.peer_failures import (
    REPORT_GRACE_S,
    PeerFailedError,
    ReportingFailures,
    looks_like_peer_failure,
    name_failed_peers,
    report_failure,
)

__all__ = ["Comm", "PeerFailedError", "Pending", "pack_rows", "packed_nbytes", "stable_fingerprint", "unpack_rows"]

#: Collective kinds counted by :class:`Comm` (keys of :attr:`Comm.counts`).
KINDS = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce", "agreement")

# torch >= 2.13 renamed the tensor collectives (the old names warn); resolve once, read-only.
_ALL_GATHER_TENSOR = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_TENSOR = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_MASK64 = (1 << 64) - 1


def stable_fingerprint(*parts: object) -> int:
    """A 63-bit hash of scalars, strings, dtypes and shapes, equal in every process.

    Python's ``hash`` of a string differs between processes; this does not.

    >>> stable_fingerprint("q", (4, 2, 8), torch.bfloat16) == stable_fingerprint("q", (4, 2, 8), torch.bfloat16)
    True
    """
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\x00")
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def _destination(out: torch.Tensor | None, x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``out`` checked to be a contiguous ``shape`` tensor of x's dtype and device, or a new one."""
    if out is None:
        return x.new_empty(shape)
    if tuple(out.shape) != tuple(shape) or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {list(shape)} {x.dtype} tensor on {x.device}, "
            f"got {list(out.shape)} {out.dtype} on {out.device}"
        )
    return out


def _to_int64(value: int) -> int:
    """Fold any Python int into the signed int64 range (two's complement of its low 64 bits)."""
    v = int(value) & _MASK64
    return v - (1 << 64) if v >= 1 << 63 else v


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
                self._comm._collective(self._kind, w.wait)


class Comm:
    """A ``ProcessGroup`` with its rank, size and backend resolved once, counting its collectives.

    Args:
        group: the process group the step runs over (ranks ``0 .. world_size - 1`` of it): a
            ``ProcessGroup``, a 1-D ``DeviceMesh`` or ``(mesh, dim name)``
            (:func:`~shardattn.parallel.groups.resolve_group`).
        device: where small control tensors (fingerprints, counts) live; default ``cuda``'s
            current device for NCCL, CPU otherwise.
        report_grace_s: seconds a rank whose collective failed waits for its peers' failure
            reports (default :data:`REPORT_GRACE_S`).

    Attributes:
        rank, world_size, backend: of ``group``.
        counts: ``Counter`` of collectives issued, by kind (``"all_to_all"``, ``"all_gather"``,
            ``"reduce_scatter"``, ``"all_reduce"``, ``"agreement"``); :meth:`reset_counts`
            clears it.

    Example (every rank of ``group`` runs this)::

        comm = Comm(group)
        comm.check_agreement(plan.fingerprint(), "ShardQ plan")  # raises on every rank if they differ
        x = comm.all_to_all(rows, send_splits=plan.counts.tolist(), recv_splits=[n_mine] * comm.world_size)
        dict(comm.counts)                                        # {'agreement': 1, 'all_to_all': 1}
    """

    def __init__(
        self,
        group: GroupLike,
        *,
        device: torch.device | str | None = None,
        report_grace_s: float = REPORT_GRACE_S,
    ) -> None:
        if isinstance(group, Comm):
            raise TypeError("group is already a Comm; use Comm.wrap(group) to accept either")
        group = resolve_group(group)
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("this process is not a member of group")
        self.group = group
        self.rank = rank
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group)).lower()
        # point-to-point messages name their peer by its global rank (a sub-group's rank j is not rank j)
        self._global_ranks = [dist.get_global_rank(group, r) for r in range(self.world_size)]
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else "cpu"
        self.device = torch.device(device)
        self.counts: Counter[str] = Counter()
        if not report_grace_s >= 0:
            raise ValueError(f"report_grace_s must be >= 0, got {report_grace_s}")
        self.report_grace_s = float(report_grace_s)
        self._reduce_scatter_ok: bool | None = None

    @classmethod
    def wrap(cls, group: GroupLike | Comm) -> Comm:
        """``group`` itself when it is a ``Comm`` (its counts keep accumulating), else a new one
        (over a ``ProcessGroup``, a 1-D ``DeviceMesh`` or ``(mesh, dim name)``)."""
        return group if isinstance(group, Comm) else cls(group)

    def reset_counts(self) -> None:
        """Forget the collectives counted so far."""
        self.counts.clear()

    def __repr__(self) -> str:
        return f"Comm(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r})"

    # -- checks ------------------------------------------------------------------------------
    def _check_tensor(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if self.backend == "nccl" and x.device.type != "cuda":
            raise ValueError(f"{name} must be a CUDA tensor for the nccl backend, got {x.device}")
        return x.contiguous()

    def _check_splits(self, name: str, splits: Sequence[int], total: int) -> list[int]:
        sizes = [int(s) for s in splits]
        if len(sizes) != self.world_size:
            raise ValueError(f"{name} must have world_size={self.world_size} entries, got {len(sizes)}")
        if any(s < 0 for s in sizes):
            raise ValueError(f"{name} must be non-negative, got {sizes}")
        if sum(sizes) != total:
            raise ValueError(f"{name} must add up to {total} (dim 0 of the tensor), got {sizes} = {sum(sizes)}")
        return sizes

    # -- collectives -------------------------------------------------------------------------
    def all_to_all(
        self,
        x: torch.Tensor,
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Send ``x[offset_j : offset_j + send_splits[j]]`` to rank ``j``; receive from every rank.

        Args:
            x: ``[sum(send_splits), ...]`` any dtype.
            send_splits: ``[W]`` rows of ``x`` for each destination, in rank order.
            recv_splits: ``[W]`` rows arriving from each source (``send_splits`` of the others).
            out: optional contiguous destination ``[sum(recv_splits), ...]`` of x's dtype (a
                reserved workspace buffer); default: allocated.
        Returns:
            ``[sum(recv_splits), ...]``, sources in rank order (``out`` when given).
        """
        x = self._check_tensor("x", x)
        if x.dim() == 0:
            raise ValueError("x must have at least one dimension")
        send = self._check_splits("send_splits", send_splits, x.shape[0])
        recv = [int(s) for s in recv_splits]
        self._check_splits("recv_splits", recv, sum(recv))
        out = _destination(out, x, (sum(recv), *x.shape[1:]))
        self.counts["all_to_all"] += 1
        if self.world_size == 1:
            out.copy_(x)
            return out
        self._collective("all_to_all", lambda: dist.all_to_all_single(out, x, recv, send, group=self.group))
        return out

    def exchange(
        self,
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
        mine_out = [x for p, x in sends if p == self.rank]
        mine_in = [y for p, y in recvs if p == self.rank]
        if len(mine_out) != len(mine_in):
            raise ValueError(f"exchange: {len(mine_out)} pieces sent to this rank itself but {len(mine_in)} received")
        ops = []
        for kind, pairs in ((dist.isend, sends), (dist.irecv, recvs)):
            seen: Counter[int] = Counter()
            for peer, x in pairs:
                if not 0 <= peer < self.world_size:
                    raise ValueError(f"exchange: peer {peer} is not a rank of the group of {self.world_size}")
                self._check_tensor("piece", x)
                if not x.is_contiguous():
                    raise ValueError("exchange: every piece must be contiguous (it is moved in place)")
                if peer != self.rank and x.numel():
                    to = self._global_ranks[peer]
                    ops.append(dist.P2POp(kind, x, to, group=self.group, tag=(tag << 16) + seen[peer]))
                seen[peer] += 1
        for x, y in zip(mine_out, mine_in):
            if x.shape != y.shape or x.dtype != y.dtype:
                raise ValueError(
                    f"exchange: a piece to this rank is {list(x.shape)} {x.dtype}, its slot {list(y.shape)}"
                )
        self.counts["all_to_all"] += 1
        works: list[dist.Work] = []
        if ops:  # the messages first: NCCL's stream then need not wait for the local copies below
            self._collective("all_to_all", lambda: works.extend(dist.batch_isend_irecv(ops)))
        for x, y in zip(mine_out, mine_in):
            y.copy_(x)
        return Pending(works, comm=self, kind="all_to_all") if works else Pending()

    def all_gather_async(self, x: torch.Tensor) -> tuple[torch.Tensor, Pending]:
        """:meth:`all_gather` started now, completed by the returned :class:`Pending`'s ``wait``.

        Returns:
            ``([W, ...] gathered, pending)``; read the first only after ``pending.wait()``.
        """
        x = self._check_tensor("x", x)
        self.counts["all_gather"] += 1
        out = x.new_empty((self.world_size, *x.shape))
        if self.world_size == 1:
            out[0].copy_(x)
            return out, Pending()
        works: list[dist.Work] = []
        self._collective(
            "all_gather",
            lambda: works.append(_ALL_GATHER_TENSOR(out.view(-1), x.reshape(-1), group=self.group, async_op=True)),
        )
        return out, Pending(works, comm=self, kind="all_gather")

    def all_gather(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Gather an equal-shaped tensor from every rank.

        Args:
            x: ``[...]`` the same shape and dtype on every rank.
            out: optional contiguous destination ``[W, ...]`` of x's dtype (a reserved workspace
                buffer); default: allocated.
        Returns:
            ``[W, ...]``, ranks in order (``out`` when given).
        """
        x = self._check_tensor("x", x)
        self.counts["all_gather"] += 1
        return self._all_gather(x, out)

    def _all_gather(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        out = _destination(out, x, (self.world_size, *x.shape))
        if self.world_size == 1:
            out[0].copy_(x)
            return out
        self._collective("all_gather", lambda: _ALL_GATHER_TENSOR(out.view(-1), x.reshape(-1), group=self.group))
        return out

    def all_gather_uneven(self, x: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
        """Gather tensors whose dim 0 differs by rank: padded to the largest, one all-gather.

        Args:
            x: ``[sizes[rank], ...]``; trailing dims and dtype equal on every rank.
            sizes: ``[W]`` dim 0 of every rank's ``x`` (host ints, known to every rank).
        Returns:
            ``W`` tensors ``[sizes[j], ...]`` (views into one gathered buffer).
        """
        x = self._check_tensor("x", x)
        sizes = [int(s) for s in sizes]
        if len(sizes) != self.world_size:
            raise ValueError(f"sizes must have world_size={self.world_size} entries, got {len(sizes)}")
        if x.dim() == 0 or x.shape[0] != sizes[self.rank]:
            raise ValueError(f"x must have sizes[rank={self.rank}]={sizes[self.rank]} rows, got shape {list(x.shape)}")
        pad = max(sizes) if sizes else 0
        if x.shape[0] != pad:
            padded = x.new_zeros((pad, *x.shape[1:]))
            padded[: x.shape[0]] = x
            x = padded
        gathered = self.all_gather(x)
        return [gathered[j, : sizes[j]] for j in range(self.world_size)]

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over ranks and keep this rank's slice of dim 0.

        Falls back to an all-gather plus a local sum when the backend has no reduce-scatter
        (counted then as ``"all_gather"``). The sum runs in ``x``'s dtype: pass fp32 for accuracy.

        Args:
            x: ``[W * n, ...]``, the same shape on every rank.
        Returns:
            ``[n, ...]``: rows ``rank * n : (rank + 1) * n`` of the sum.
        """
        x = self._check_tensor("x", x)
        if x.dim() == 0 or x.shape[0] % self.world_size:
            raise ValueError(f"x must have dim 0 divisible by world_size={self.world_size}, got {list(x.shape)}")
        n = x.shape[0] // self.world_size
        if self.world_size == 1:
            self.counts["reduce_scatter"] += 1
            return x.clone()
        if self._reduce_scatter_ok is not False:
            out = x.new_empty((n, *x.shape[1:]))
            try:
                _REDUCE_SCATTER_TENSOR(out.view(-1), x.view(-1), group=self.group)
            except RuntimeError as e:  # raised before any data moves, identically on every rank
                if "support" not in str(e).lower():
                    if not looks_like_peer_failure(e):
                        raise
                    raise self._peer_failed("reduce_scatter", e) from e
                self._reduce_scatter_ok = False
            else:
                self._reduce_scatter_ok = True
                self.counts["reduce_scatter"] += 1
                return out
        gathered = self.all_gather(x)
        return gathered[:, self.rank * n : (self.rank + 1) * n].sum(dim=0)

    @property
    def has_reduce_scatter(self) -> bool | None:
        """Whether the backend ran a reduce-scatter (``None`` until one was tried; NCCL: True)."""
        return True if self.backend == "nccl" else self._reduce_scatter_ok

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over ranks (a new tensor; ``x`` is left alone)."""
        x = self._check_tensor("x", x).clone()
        self.counts["all_reduce"] += 1
        if self.world_size > 1:
            self._collective("all_reduce", lambda: dist.all_reduce(x, group=self.group))
        return x

    # -- rank failures -----------------------------------------------------------------------
    def _collective(self, kind: str, run: Callable[[], object]) -> None:
        """Run one collective; a failure (a peer died, hung or left) becomes :class:`PeerFailedError`."""
        try:
            run()
        except RuntimeError as e:  # DistError and gloo / NCCL errors are RuntimeErrors
            if not looks_like_peer_failure(e):
                raise  # a local misuse (dtype, layout) is this rank's error, not a peer's
            raise self._peer_failed(kind, e) from e

    def report_failure(self, error: BaseException) -> None:
        """Tell the peers (through the group's store) that this rank's step raised ``error``.

        Best effort and cheap (one store write); called by :meth:`reporting_failures`.
        """
        report_failure(self.group, self.rank, error)

    def reporting_failures(self) -> ReportingFailures:
        """Around a step's work after its agreement check: an exception is reported to the peers
        (which are, or soon will be, waiting for this rank in a collective), then re-raised.
        (A plain context manager, not a generator: it sits on every step's hot path.)"""
        return ReportingFailures(self)

    def _peer_failed(self, kind: str, error: BaseException) -> PeerFailedError:
        """Name the peers that made ``kind`` fail (:func:`~shardattn.parallel.peer_failures.name_failed_peers`)."""
        return name_failed_peers(self.group, self.rank, self.world_size, kind, error, grace_s=self.report_grace_s)

    def gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """All-gather a few host ints per rank (a small tensor, no pickling).

        Args:
            values: the same count of ints on every rank (each folded into int64).
        Returns:
            ``W`` lists of ints, ranks in order. Synchronises with the device (host values).
        """
        self.counts["all_gather"] += 1
        return self._gather_ints(values)

    def _gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        t = torch.tensor([_to_int64(v) for v in values], dtype=torch.int64, device=self.device)
        return self._all_gather(t).tolist()

    def check_agreement(self, fingerprint: int, what: str, *, error: BaseException | None = None) -> None:
        """Raise the same ``ValueError`` on every rank unless all ranks hold the same fingerprint.

        One all-gather of ``[fingerprint, failed]`` per rank (counted as ``"agreement"`` only, so
        the data collectives of a step can be counted on their own). Call it on every rank before
        a step's data collectives; pass the local validation error, if any, as ``error`` so ranks
        whose inputs were fine fail too instead of waiting in a collective for the rank that
        raised.

        Args:
            fingerprint: any Python int (folded to int64), e.g. ``plan.fingerprint()``.
            what: what the fingerprint describes, for the message (``"ShardQ plan"``).
            error: this rank's validation error; re-raised here after the exchange.
        Raises:
            the given ``error`` on its rank; ``ValueError`` naming the failing ranks on the
            others, or naming the ranks whose fingerprint differs from the majority's.
        """
        self.counts["agreement"] += 1
        rows = self._gather_ints([fingerprint, 1 if error is not None else 0])
        failed = [r for r, (_, f) in enumerate(rows) if f]
        if error is not None:
            raise error
        if failed:
            raise ValueError(
                f"{what}: rank(s) {failed} of {self.world_size} rejected their inputs (see the error on "
                f"that rank); rank {self.rank} stops too instead of waiting for them in a collective"
            )
        values = [v for v, _ in rows]
        tally = Counter(values)
        if len(tally) == 1:
            return
        top = max(tally.values())
        # majority value; on a tie, the one of the lowest rank among the tied values
        majority = next(v for v in values if tally[v] == top)
        bad = [r for r, v in enumerate(values) if v != majority]
        good = [r for r, v in enumerate(values) if v == majority]
        raise ValueError(
            f"{what} differs across ranks: rank(s) {bad} disagree with rank(s) {good} "
            f"(fingerprints {values}); every rank must pass the same {what}"
        )

    def agree_on(self, what: str, validate: Callable[[], int], *, check: bool = True) -> None:
        """Validate this rank's inputs, then (with ``check``) make every rank agree on them.

        ``validate()`` raises ``TypeError`` / ``ValueError`` for bad input and otherwise returns a
        fingerprint of everything the step's collectives depend on (plan, shapes, dtypes). With
        ``check`` the fingerprint and the error, if any, go through :meth:`check_agreement`, so a
        rank with bad input, or with a different plan, makes *every* rank raise before any data
        collective. Without ``check`` a local error is raised at once (other ranks may then wait
        in the step's first collective until the group's timeout).
        """
        try:
            fingerprint = validate()
        except (TypeError, ValueError) as e:
            if not check:  # the peers will wait in the step's first collective: tell them why
                self.report_failure(e)
                raise
            self.check_agreement(0, what, error=e)
            raise  # unreachable: check_agreement re-raises e
        if check:
            self.check_agreement(fingerprint, what)
