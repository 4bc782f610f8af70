"""How a pool's decode steps reach its rank actors, chosen once when the pool forms.

* ``"shm"`` (the default): a shared-memory region mapped by the driver and every rank
  (:mod:`~shardattn.serving.shm`), page-locked on GPU ranks; each rank runs a serve loop.
  Needs every rank on the driver's node; otherwise the pool warns and falls back to ``"compiled"``.
* ``"compiled"``: a Ray compiled graph (:mod:`~shardattn.serving.compiled`); falls back to
  ``"calls"`` with a warning when Ray cannot compile it.
* ``"calls"``: actor calls through the object store, as prefill steps and every other call go.

:func:`start_decode_transport` returns the transport actually in use and its runner (``None``
for calls), which has ``teardown()`` and runs a step one of two ways. The compiled graph's:
``run(step, q, qs, timeout_s) -> [(out, lse) of rank r]`` (``q [T, H, D]``, ``qs[r]`` its heads).
The shared-memory one's: ``run_batch(step, timeout_s) -> (out, lse)``, the step already merged,
with ``inputs()`` (the region's tensors a step is packed into:
:func:`~shardattn.serving.requests.pack_step`'s ``into``), ``holds(t)`` (whether a tensor lies on
those rows) and ``timeline()``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

from shardattn.serving.wire import from_wire, to_wire

__all__ = ["SERVE_GROUP", "TRANSPORTS", "check_local", "decode_on_ranks", "start_decode_transport"]

TRANSPORTS = ("shm", "compiled", "calls")
#: the actors' concurrency group of the shared-memory serve loop (other calls keep being served)
SERVE_GROUP = "serve"


class TransportUnavailable(RuntimeError):
    """A transport cannot serve this pool (the message says why); the pool falls back."""


def check_local(built: Sequence[dict[str, Any]], driver_node: str) -> None:
    """Raise :class:`TransportUnavailable` naming the ranks whose actor is on another node.

    >>> check_local([{"rank": 0, "node_id": "a"}, {"rank": 1, "node_id": "a"}], "a")
    >>> check_local([{"rank": 0, "node_id": "a"}, {"rank": 1, "node_id": "b"}], "a")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    shardattn.serving.transport.TransportUnavailable: ranks [1] run on another node than the driver; ...
    """
    remote = [b["rank"] for b in built if b.get("node_id") != driver_node]
    if remote:
        raise TransportUnavailable(f"ranks {remote} run on another node than the driver; shared memory needs one host")


class _CompiledDecode:
    """:class:`~shardattn.serving.compiled.CompiledSteps` behind the ``run(step, qs)`` interface."""

    def __init__(self, steps: Any) -> None:
        self.steps = steps

    def run(self, step: dict[str, Any], q: Any, qs: Sequence[Any], timeout_s: float) -> list[Any]:
        payload = {"kind": "decode", "shared": to_wire(step), "qs": [to_wire(q) for q in qs]}
        return from_wire(self.steps.run(payload, timeout_s))

    def running(self) -> list[int]:
        """Ranks sent the last step that have not answered it (:attr:`CompiledSteps.running`)."""
        return list(self.steps.running)

    def teardown(self) -> None:
        self.steps.teardown()


class _ShmDecode:
    """:class:`~shardattn.serving.shm_steps.ShmSteps` and its serve loops."""

    def __init__(self, steps: Any) -> None:
        self.steps = steps

    def inputs(self) -> dict[str, Any]:
        return self.steps.inputs()

    def holds(self, t: Any) -> bool:
        return self.steps.holds(t)

    def run_batch(self, step: dict[str, Any], timeout_s: float) -> tuple[Any, Any]:
        return self.steps.run(step, timeout_s)

    def timeline(self) -> dict[str, Any]:
        return self.steps.timeline()

    def running(self) -> list[int]:
        """Ranks rung for the last step that have not answered it (:attr:`ShmSteps.running`)."""
        return list(self.steps.running)

    def teardown(self) -> None:
        try:
            self.steps.stop()
        finally:
            self.steps.close()


def _start_shm(
    actors: Sequence[Any], built: Sequence[dict[str, Any]], layout: Any, call: Callable[..., list[Any]], spin_s: float
) -> _ShmDecode:
    import ray

    from shardattn.serving.shm_steps import ShmSteps

    check_local(built, ray.get_runtime_context().get_node_id())
    try:
        steps = ShmSteps(layout, spin_s=spin_s)
    except OSError as e:
        raise TransportUnavailable(f"cannot create the shared-memory region ({e})") from None
    try:
        attached = call("attach_shm", [a.attach_shm.remote(steps.path, layout) for a in actors])
        steps.pinned = [bool(a["pinned"]) for a in attached]
        loops = [a.serve_shm.options(concurrency_group=SERVE_GROUP).remote(spin_s) for a in actors]
        steps.serving(loops)
    except BaseException:
        steps.close()
        raise
    return _ShmDecode(steps)


def start_decode_transport(
    transport: str,
    actors: Sequence[Any],
    built: Sequence[dict[str, Any]],
    *,
    layout: Callable[[], Any],
    channel_bytes: Callable[[], int],
    call: Callable[..., list[Any]],
    spin_s: float,
) -> tuple[str, Any]:
    """``(transport in use, its runner or None for calls)``; falls back ``shm -> compiled -> calls``
    with a ``RuntimeWarning`` naming the reason. ``layout`` / ``channel_bytes`` size the region /
    the graph's channels; ``call(operation, refs)`` is the pool's fault-checked wait."""
    if transport == "shm":
        try:
            return "shm", _start_shm(actors, built, layout(), call, spin_s)
        except TransportUnavailable as e:
            warnings.warn(f"shared-memory decode unavailable ({e}); decode steps use a Ray compiled graph",
                          RuntimeWarning, stacklevel=4)  # fmt: skip
            transport = "compiled"
    if transport == "compiled":
        from shardattn.serving.compiled import CompiledSteps

        try:
            return "compiled", _CompiledDecode(CompiledSteps(actors, [b["pid"] for b in built], channel_bytes()))
        except Exception as e:  # keep serving, loudly, on the transport that always works
            warnings.warn(f"Ray compiled graph unavailable ({type(e).__name__}: {e}); decode steps use actor calls",
                          RuntimeWarning, stacklevel=4)  # fmt: skip
    return "calls", None


def decode_on_ranks(
    decoder: Any,
    actors: Sequence[Any],
    call: Callable[..., list[Any]],
    batch: Any,
    table: Any,
    return_lse: bool,
    heads_per_rank: int,
    timeout_s: float,
) -> tuple[list[tuple[Any, Any]], dict[str, Any] | None]:
    """One checked decode step (a :class:`~shardattn.serving.requests.BatchStep`, its block
    table ``[B, w]`` int32 NumPy) on the ranks through the pool's transport (``decoder``; ``None``:
    actor calls through ``call``). Returns each rank's ``(out [T, H/W, Dv], lse [T, H/W] or
    None)`` and ``None``; under ``shm`` instead one pair, ``(out [T, H, Dv], lse [T, H] or
    None)``, every head (views of the region, valid until the next step), and the step's
    timeline on every rank (:meth:`~shardattn.serving.shm_steps.ShmSteps.timeline`).
    Raises :class:`~shardattn.serving.errors.RankStepError` (or what ``call`` raises); under
    ``shm``, every failure once the ranks' doorbells were rung is one."""
    import torch

    from shardattn.serving.split import query_parts

    if isinstance(decoder, _ShmDecode):
        step = {"table": table, "starts": batch.starts, "counts": batch.counts, "q_lens": batch.q_lens,
                "q": batch.q, "topk": batch.topk, "kv": batch.kv, "return_lse": return_lse}  # fmt: skip
        return [decoder.run_batch(step, timeout_s)], decoder.timeline()
    q = batch.q
    step = {"table": torch.from_numpy(table), "starts": batch.starts.tolist(), "counts": batch.counts.tolist()}
    step.update(q_counts=batch.q_lens.tolist(), kv=batch.kv, topk=batch.topk, return_lse=return_lse)
    qs = query_parts(q, len(actors), heads_per_rank, None)
    if decoder is not None:
        return decoder.run(step, q, qs, timeout_s), None
    import ray

    shared_ref = ray.put(to_wire(step))  # once for every rank
    refs = [a.decode.remote(shared_ref, to_wire(qs[r])) for r, a in enumerate(actors)]
    return from_wire(call("decode", refs)), None
