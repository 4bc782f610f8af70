"""The collectives the parallel steps use, over one ``ProcessGroup``, counted and checked.

:class:`Comm` resolves the group's rank, size, backend and the device of its small tensors
once; every step takes a ``ProcessGroup`` (or a ``DeviceMesh``, :mod:`~shardattn.parallel.groups`)
or a ``Comm`` (:meth:`Comm.wrap`). Each collective it issues is counted by kind in
:attr:`Comm.counts`, so tests can assert, e.g., that a ShardQ prefill issues exactly two
all-to-alls. Misuse (split sizes that do not add up, a tensor on the wrong device for the
backend, shapes that do not divide) raises ``ValueError`` before anything is sent.

Ranks that disagree (different plans, different shapes, a rank whose inputs failed validation)
would otherwise enter mismatched collectives and hang or corrupt data. :meth:`Comm.check_agreement`
and :meth:`Comm.agree_on` (:mod:`shardattn.parallel.agreement`) raise the same clear ``ValueError``
on every rank, naming the ranks that disagree, instead. :meth:`Comm.exchange`
(:mod:`shardattn.parallel.exchange`) moves contiguous pieces in place, point to point.

A rank that fails *during* a step (its kernel raises, its process exits, it hangs) leaves the
others waiting in a collective until the group's timeout or a closed connection. Each collective
here turns that into :class:`PeerFailedError` naming the failing rank: a rank whose step raised
posts a one-line report to the group's store (:meth:`Comm.reporting_failures`), and a rank whose
collective failed posts that it is alive, waits up to :data:`REPORT_GRACE_S` for its peers'
reports, and names the ranks that raised, or, failing that, the ranks that did not report (they
exited or hang). Survivors learn of the failure when the group's timeout expires (a rank that
raised or hangs) or, those waiting on the connection of a rank whose process exited, at once;
such a survivor may also name a live peer still blocked until its own timeout. A report names
the Comm (:attr:`Comm.generation`) and step (:meth:`Comm.begin_step`) it was made in, and a rank
reads only its peers' reports of its own Comm and step, so an earlier step's or numbered Comm's
(another Runtime's) is never blamed for a later failure; steps given a raw group make unnumbered
Comms (no store round trip a call), which may read each other's. A group in which a step failed
mid-step is not to be reused (its ranks are out of step).

Mixed-dtype payloads (a bf16 output and its fp32 LSE) travel in one collective as bytes:
:func:`~shardattn.parallel.packing.pack_rows` / :func:`~shardattn.parallel.packing.unpack_rows`
(re-exported here). The failure reports live in :mod:`shardattn.parallel.peer_failures`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from shardattn.parallel.agreement import agree_on, check_agreement, to_int64
from shardattn.parallel.exchange import Pending, exchange
from shardattn.parallel.groups import GroupLike, resolve_group
from shardattn.parallel.packing import pack_rows, packed_nbytes, unpack_rows
from shardattn.parallel.peer_failures import (
    REPORT_GRACE_S,
    PeerFailedError,
    ReportingFailures,
    check_grace,
    comm_generation,
    looks_like_peer_failure,
    name_failed_peers,
    report_failure,
)

__all__ = ["Comm", "PeerFailedError", "Pending", "pack_rows", "packed_nbytes", "unpack_rows"]

#: Collective kinds counted by :class:`Comm` (keys of :attr:`Comm.counts`).
KINDS = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce", "agreement")

# torch >= 2.13 renamed the tensor collectives (the old names warn); resolve once, read-only.
_ALL_GATHER_TENSOR = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_TENSOR = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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


class Comm:
    """A ``ProcessGroup`` with its rank, size and backend resolved once, counting its collectives.

    Args:
        group: the process group the step runs over (ranks ``0 .. world_size - 1`` of it): a
            ``ProcessGroup``, a 1-D ``DeviceMesh`` or ``(mesh, dim name)``
            (:func:`~shardattn.parallel.groups.resolve_group`).
        device: where small control tensors (fingerprints, counts) live; default ``cuda``'s
            current device for NCCL, CPU otherwise.
        report_grace_s: seconds a rank whose collective failed waits for its peers' failure
            reports (default :data:`REPORT_GRACE_S`): a finite number >= 0.
        numbered: take a generation from the group's store (a round trip); :meth:`wrap`'s are not.

    Attributes:
        rank, world_size, backend: of ``group``.
        global_ranks: each rank of ``group``'s global rank, which point-to-point messages name.
        generation: the numbered Comms this rank made on ``group``, this one included (equal on
            every rank, which make them in one order); 0 if unnumbered. Its reports name it.
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
        numbered: bool = True,
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
        self.global_ranks = [dist.get_global_rank(group, r) for r in range(self.world_size)]
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else "cpu"
        self.device = torch.device(device)
        self.counts: Counter[str] = Counter()
        self.report_grace_s = check_grace(report_grace_s)
        #: steps this rank began on the group (:meth:`begin_step`); failure reports name it
        self.step = 0
        self.generation = comm_generation(group, rank, self.world_size) if numbered else 0
        self._reduce_scatter_ok: bool | None = None

    @classmethod
    def wrap(cls, group: GroupLike | Comm) -> Comm:
        """``group`` itself when it is a ``Comm`` (its counts keep accumulating), else a new,
        unnumbered one (over a ``ProcessGroup``, a 1-D ``DeviceMesh`` or ``(mesh, dim name)``: a
        step's own, made without a store round trip)."""
        return group if isinstance(group, Comm) else cls(group, numbered=False)

    def reset_counts(self) -> None:
        """Forget the collectives counted so far."""
        self.counts.clear()

    def __repr__(self) -> str:
        return f"Comm(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r})"

    # -- checks ------------------------------------------------------------------------------
    def check_tensor(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``x`` contiguous, after checking it is a tensor on this backend's device type (``name`` in errors)."""
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
    def exchange(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
        *,
        tag: int = 0,
    ) -> Pending:
        """An all-to-all of contiguous pieces moved in place, counted as one ``"all_to_all"``
        (:func:`~shardattn.parallel.exchange.exchange`: which piece fills which, the tag)."""
        return exchange(self, sends, recvs, tag=tag)

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
        x = self.check_tensor("x", x)
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
        self.run_collective("all_to_all", lambda: dist.all_to_all_single(out, x, recv, send, group=self.group))
        return out

    def all_gather_async(self, x: torch.Tensor) -> tuple[torch.Tensor, Pending]:
        """:meth:`all_gather` started now, completed by the returned :class:`Pending`'s ``wait``.

        Returns:
            ``([W, ...] gathered, pending)``; read the first only after ``pending.wait()``.
        """
        x = self.check_tensor("x", x)
        self.counts["all_gather"] += 1
        out = x.new_empty((self.world_size, *x.shape))
        if self.world_size == 1:
            out[0].copy_(x)
            return out, Pending()
        works: list[dist.Work] = []
        self.run_collective(
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
        x = self.check_tensor("x", x)
        self.counts["all_gather"] += 1
        return self._all_gather(x, out)

    def _all_gather(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        out = _destination(out, x, (self.world_size, *x.shape))
        if self.world_size == 1:
            out[0].copy_(x)
            return out
        self.run_collective("all_gather", lambda: _ALL_GATHER_TENSOR(out.view(-1), x.reshape(-1), group=self.group))
        return out

    def all_gather_uneven(self, x: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
        """Gather tensors whose dim 0 differs by rank: padded to the largest, one all-gather.

        Args:
            x: ``[sizes[rank], ...]``; trailing dims and dtype equal on every rank.
            sizes: ``[W]`` dim 0 of every rank's ``x`` (host ints, known to every rank).
        Returns:
            ``W`` tensors ``[sizes[j], ...]`` (views into one gathered buffer).
        """
        x = self.check_tensor("x", x)
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
        x = self.check_tensor("x", x)
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
        x = self.check_tensor("x", x).clone()
        self.counts["all_reduce"] += 1
        if self.world_size > 1:
            self.run_collective("all_reduce", lambda: dist.all_reduce(x, group=self.group))
        return x

    # -- rank failures -----------------------------------------------------------------------
    def run_collective(self, kind: str, run: Callable[[], object]) -> None:
        """Run one collective (``run()`` issues it; counted by the caller); a failure (a peer died,
        hung or left) becomes :class:`PeerFailedError`."""
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
        report_failure(self.group, self.rank, error, step=self.step, generation=self.generation)

    def begin_step(self) -> None:
        """Count a step this rank begins on the group (:attr:`step`): its failure reports name the
        step, and it reads its peers' of the same step (of this Comm) only. Every step's :meth:`agree_on` calls
        it; a caller that abandons a step before its agreement (its own checks failed) calls it
        before it reports or agrees, so that it counts the same steps as its peers."""
        self.step += 1

    def catch_up(self, step: int) -> None:
        """Count ``step`` steps where this rank counted fewer (the most any rank counted, which an
        agreement learns: a rank that raised before its step's agreement began no step there)."""
        self.step = max(self.step, step)

    def reporting_failures(self) -> ReportingFailures:
        """Around a step's work after its agreement check: an exception is reported to the peers
        (which are, or soon will be, waiting for this rank in a collective), then re-raised.
        (A plain context manager, not a generator: it sits on every step's hot path.)"""
        return ReportingFailures(self)

    def _peer_failed(self, kind: str, error: BaseException) -> PeerFailedError:
        """Name the peers that made ``kind`` fail (:func:`~shardattn.parallel.peer_failures.name_failed_peers`)."""
        return name_failed_peers(
            self.group,
            self.rank,
            self.world_size,
            kind,
            error,
            grace_s=self.report_grace_s,
            step=self.step,
            generation=self.generation,
        )

    def gather_ints(self, values: Sequence[int], *, kind: str | None = "all_gather") -> list[list[int]]:
        """All-gather a few host ints per rank (a small tensor, no pickling).

        Args:
            values: the same count of ints on every rank (each folded into int64).
            kind: the :attr:`counts` key it is counted under; ``None``: not counted (a second
                exchange of a collective already counted, as an agreement's follow-up).
        Returns:
            ``W`` lists of ints, ranks in order. Synchronises with the device (host values).
        """
        if kind is not None:
            self.counts[kind] += 1
        t = torch.tensor([to_int64(v) for v in values], dtype=torch.int64, device=self.device)
        return self._all_gather(t).tolist()

    # -- agreement (shardattn.parallel.agreement) ------------------------------------------------
    def check_agreement(self, fingerprint: int, what: str, *, error: BaseException | None = None) -> None:
        """Raise the same ``ValueError`` on every rank unless all ranks hold the same fingerprint
        (:func:`~shardattn.parallel.agreement.check_agreement`; counted as ``"agreement"``)."""
        check_agreement(self, fingerprint, what, error=error)

    def agree_on(self, what: str, validate: Callable[[], int], *, check: bool = True) -> None:
        """Validate this rank's inputs, then (with ``check``) make every rank agree on them
        (:func:`~shardattn.parallel.agreement.agree_on`)."""
        agree_on(self, what, validate, check=check)
