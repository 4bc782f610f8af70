"""Ranks agreeing on a step before its data collectives: one fingerprint and error flag per rank.

Ranks that disagree (different plans, different shapes, a rank whose inputs failed validation)
would otherwise enter mismatched collectives and hang or corrupt data. :func:`check_agreement`
all-gathers one ``int64`` fingerprint (:func:`stable_fingerprint`) and an error flag per rank and
raises the same clear ``ValueError`` on every rank, naming the ranks that disagree, instead;
:func:`agree_on` validates a rank's inputs first. :class:`~shardattn.parallel.comm.Comm` offers
both as methods (``comm.check_agreement``, ``comm.agree_on``).

:func:`settle` ends a phase of work that every rank runs and that may raise anywhere (building a
Runtime: its checks, its workspace, its warm-up): one all-gather of a failure flag (and any
values the ranks exchange) per rank, so that a rank whose phase raised reaches its peers at once
(they raise :class:`~shardattn.errors.PeerFailedError` naming it and its exception, posted to the
group's store before the gather, :mod:`~shardattn.parallel.peer_failures`) instead of leaving
them in the next collective until the group's timeout.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from shardattn.parallel.peer_failures import name_raised_peers

if TYPE_CHECKING:
    from shardattn.parallel.comm import Comm

log = logging.getLogger(__name__)

__all__ = [
    "Fingerprint",
    "agree_on",
    "check_agreement",
    "dissenters",
    "settle",
    "stable_fingerprint",
    "to_int64",
]

_MASK64 = (1 << 64) - 1
#: Named parts a disagreement compares one by one (a fingerprint's first this many; the rest count in
#: the whole): every rank sends this many (a launcher's options are 35), so the all-gather has one size.
MAX_PARTS = 40


def stable_fingerprint(*parts: object) -> int:
    """A 63-bit hash of scalars, strings, dtypes and shapes, equal in every process.

    Python's ``hash`` of a string differs between processes; this does not.

    >>> stable_fingerprint("q", (4, 2, 8), "bfloat16") == stable_fingerprint("q", (4, 2, 8), "bfloat16")
    True
    """
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\x00")
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


class Fingerprint(int):
    """The fingerprint of a step ``tag`` over ``parts`` (an int: ``stable_fingerprint(tag, *values)``,
    one hash) that keeps the parts under the names the caller passed the arguments by
    (``{"q's shape": (4, 8, 576), "the plan (query_lens, prefix_lens)": plan.fingerprint()}``), so
    that ranks that disagree learn on what (:func:`check_agreement` hashes the parts one by one only
    then): ``parts`` is ``((name, value), ...)``.

    >>> a = Fingerprint("step", {"q shape": (4, 8), "v_dim": 512})
    >>> b = Fingerprint("step", {"q shape": (4, 8), "v_dim": 256})
    >>> a == b, [n for (n, x), (_, y) in zip(a.parts, b.parts) if x != y]
    (False, ['v_dim'])
    """

    tag: str
    parts: tuple[tuple[str, object], ...]

    def __new__(cls, tag: str, parts: dict[str, object]) -> Fingerprint:
        made = super().__new__(cls, stable_fingerprint(tag, *parts.values()))
        made.tag = tag
        made.parts = tuple(parts.items())
        return made

    def part_hashes(self) -> list[int]:
        """Each part's own fingerprint (the first :data:`MAX_PARTS`), zeros after them."""
        named = [stable_fingerprint(name, value) for name, value in self.parts[:MAX_PARTS]]
        return named + [0] * (MAX_PARTS - len(named))


def to_int64(value: int) -> int:
    """Fold any Python int into the signed int64 range (two's complement of its low 64 bits)."""
    v = int(value) & _MASK64
    return v - (1 << 64) if v >= 1 << 63 else v


def dissenters(values: Sequence[int]) -> tuple[list[int], list[int]]:
    """``(ranks whose value differs from the majority's, ranks that hold it)``; on a tie, the majority
    is the value of the lowest rank among the tied ones. Nobody dissents where all agree.

    >>> dissenters([7, 7, 9]), dissenters([1, 2]), dissenters([3, 3])
    (([2], [0, 1]), ([1], [0]), ([], [0, 1]))
    """
    tally = Counter(values)
    top = max(tally.values())
    majority = next(v for v in values if tally[v] == top)
    return [r for r, v in enumerate(values) if v != majority], [r for r, v in enumerate(values) if v == majority]


def check_agreement(comm: Comm, fingerprint: int, what: str, *, error: BaseException | None = None) -> None:
    """Raise the same ``ValueError`` on every rank unless all ranks hold the same fingerprint.

    One all-gather of ``[fingerprint, failed, step]`` per rank (counted as ``"agreement"`` only, so
    the data collectives of a step can be counted on their own), and where the fingerprints differ
    a second one of the parts' (every rank sees the same difference, so every rank joins it).
    Call it on every rank before a step's data collectives; pass the local validation error, if
    any, as ``error`` so ranks whose inputs were fine fail too instead of waiting in a collective
    for the rank that raised. The ranks also agree on the step they are in (the failure reports name it,
    :mod:`~shardattn.parallel.peer_failures`): a rank that counted fewer steps catches up.

    Args:
        fingerprint: any Python int (folded to int64), e.g. ``plan.fingerprint()``; a
            :class:`Fingerprint` also has its named parts compared,
            so that a disagreement names the parts that differ.
        what: what the fingerprint describes, for the message (``"ShardQ plan"``).
        error: this rank's validation error; re-raised here after the exchange.
    Raises:
        the given ``error`` on its rank; ``ValueError`` naming the failing ranks on the
        others, or naming the ranks whose fingerprint differs from the majority's (and on what, or
        that they run another step: a :class:`Fingerprint` of another tag).
    """
    rows = comm.gather_ints([fingerprint, 1 if error is not None else 0, comm.step], kind="agreement")
    comm.catch_up(max(row[2] for row in rows))  # a rank that began no step here counts it now
    failed = [r for r, row in enumerate(rows) if row[1]]
    if error is not None:
        raise error
    if failed:
        raise ValueError(
            f"{what}: rank(s) {failed} of {comm.world_size} rejected their inputs (see the error on "
            f"that rank); rank {comm.rank} stops too instead of waiting for them in a collective"
        )
    values = [row[0] for row in rows]
    bad, good = dissenters(values)
    if not bad:
        return
    differ = _differing_parts(comm, fingerprint, bad, good[0])
    if differ is None:  # another step: its parts are other parts, comparing them would name them all
        raise ValueError(
            f"{what}: rank(s) {bad} run another step than rank(s) {good} (rank {comm.rank} runs the one of "
            f"{what}; fingerprints {values}); every rank must run the same step at once"
        )
    on = f" on {', '.join(differ)}" if differ else ""
    raise ValueError(
        f"{what}: rank(s) {bad} disagree with rank(s) {good}{on} (fingerprints {values}); every rank must pass "
        f"the same {what}"
    )


def _differing_parts(comm: Comm, fingerprint: int, bad: list[int], good: int) -> list[str] | None:
    """The names of this rank's parts whose fingerprints differ between a rank of ``bad`` and rank
    ``good`` (one more all-gather, on every rank: a plain int sends zeros and names nothing);
    ``None`` where a rank of ``bad`` fingerprinted another step (another tag) than rank ``good``."""
    parts: tuple[tuple[str, object], ...] = ()
    tag, hashes = 0, [0] * MAX_PARTS
    if isinstance(fingerprint, Fingerprint):
        parts, hashes = fingerprint.parts[:MAX_PARTS], fingerprint.part_hashes()
        tag = stable_fingerprint(fingerprint.tag)
    rows = comm.gather_ints([tag, *hashes], kind=None)
    if any(rows[r][0] != rows[good][0] for r in bad):
        return None
    return [name for i, (name, _) in enumerate(parts) if any(rows[r][i + 1] != rows[good][i + 1] for r in bad)]


def agree_on(comm: Comm, what: str, validate: Callable[[], int], *, check: bool = True) -> None:
    """Validate this rank's inputs, then (with ``check``) make every rank agree on them.

    ``validate()`` raises ``TypeError`` / ``ValueError`` for bad input and otherwise returns a
    fingerprint of everything the step's collectives depend on (plan, shapes, dtypes). With
    ``check`` the fingerprint and the error, if any, go through :func:`check_agreement`, so a
    rank with bad input, or with a different plan, makes *every* rank raise before any data
    collective. Without ``check`` a local error is raised at once, reported through the group's
    store (other ranks may then wait in the step's first collective until the group's timeout,
    and name this rank). Any other exception ``validate()`` raises (a bug, an ``AttributeError``
    of an argument of the wrong type) takes the same way: the peers learn that this rank failed,
    and the original exception is re-raised here.

    Each call begins a step (:meth:`~shardattn.parallel.comm.Comm.begin_step`): a failure report
    of an earlier step is not read as this one's.
    """
    comm.begin_step()  # failure reports of this rank name the step from here on
    try:
        fingerprint = validate()
    except Exception as e:
        if not check:  # the peers will wait in the step's first collective: tell them why
            comm.report_failure(e)
            raise
        check_agreement(comm, 0, what, error=e)
        raise  # unreachable: check_agreement re-raises e
    if check:
        check_agreement(comm, fingerprint, what)


def settle(comm: Comm, what: str, values: Sequence[int] = (), *, error: Exception | None = None) -> list[list[int]]:
    """End a phase of ``what`` that every rank of ``comm`` runs: one all-gather of
    ``[failed, *values]`` per rank (counted as ``"all_gather"``), raising on every rank if any failed.

    Call it on every rank once its phase is done, passing the exception the phase raised on this
    rank, if any, as ``error``: this rank posts it to the group's store
    (:meth:`~shardattn.parallel.comm.Comm.report_failure`) before it enters the gather, so a peer
    that reads the flag finds the report (it waits at most ``comm.report_grace_s`` for one that
    has not reached the store).

    Args:
        what: the phase, for the message (``"Runtime construction"``).
        values: the same count of ints on every rank (each folded into int64); a rank that failed
            sends zeros in their place.
        error: this rank's exception; re-raised here after the gather.
    Returns:
        ``W`` lists of the ranks' ``values``, ranks in order (where no rank failed).
    Raises:
        the given ``error`` on its rank (also where the gather itself fails: this rank's own error
        is what it reports, the gather's failure is logged); :class:`~shardattn.errors.PeerFailedError`
        on the others, naming every rank that failed and its exception (``"<what> on rank 0 failed
        because rank 1 of 2 raised ValueError: ..."``).
    """
    if error is not None:
        comm.report_failure(error)  # before the gather: a peer that sees the flag finds the report
        values = [0] * len(values)
    try:
        rows = comm.gather_ints([1 if error is not None else 0, *values])
    except Exception as gather_error:
        if error is None:
            raise
        log.warning("%s on rank %d: the gather that tells its peers failed too: %s", what, comm.rank, gather_error)
        raise error from None
    if error is not None:
        raise error
    failed = [r for r, row in enumerate(rows) if row[0]]
    if failed:
        raise name_raised_peers(
            comm.group,
            comm.rank,
            comm.world_size,
            what,
            failed,
            grace_s=comm.report_grace_s,
            step=comm.step,
            generation=comm.generation,
        )
    return [row[1:] for row in rows]
