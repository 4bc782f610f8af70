"""A servable pool of Ray actors: one rank each, resident KV caches, requests in, outputs out.

:class:`RayRankPool` reserves a placement group of one bundle per rank (``STRICT_PACK`` by
default: NCCL ranks share a host), starts rank ``r`` in bundle ``r``, joins the actors into one
process group (gloo on CPU, NCCL with one GPU per actor) and, given a model spec, builds on every
rank a :class:`~shardattn.runtime.runtime.Runtime` and that rank's shard of a paged KV cache,
once, sized from ``max_requests`` and ``max_seq_len`` (the decode layout of the mode: DCP
interleave under ``mixed`` / ``dcp-decode`` / ``pcp``, a replica under head-TP decode)::

    pool = RayRankPool(2, spec, mode="mixed", max_requests=64, max_seq_len=8192,
                       runtime_kwargs={"max_batched_tokens": 8192, "max_decode_tokens": 64})
    outs = pool.prefill([PrefillRequest("a", kv=kv_a, q=q_a, topk_pos=pos_a)])   # [n, H, Dv] each
    outs = pool.decode([DecodeRequest("a", q=q_a1, topk_pos=pos_a1, kv=kv_a1)])   # ShardQ / DCP
    out, lse = pool.decode_batch(ids, q, pos, kv=kv, return_lse=True)   # the whole step's tensors
    pool.free(["a"])

:meth:`RayRankPool.decode_batch` takes a decode step as whole-step tensors (``ids [B]`` int64,
``q [T, H, D]``, ``topk_pos [T, K]``, optional ``query_lens [B]`` and new KV rows) and returns
``out [T, H, Dv]`` (and ``lse [T, H]``) as one tensor each: checked with array operations and
packed with one copy per tensor, no Python work per request (``out.split(query_lens.tolist())``
splits it per request). With the inputs written into :meth:`RayRankPool.step_inputs` (under
``shm``, the shared-memory region's own rows) and ``view=True`` (outputs as views of the region,
valid until the next step), the driver copies nothing. :meth:`RayRankPool.decode` checks request
objects one by one, then runs the same step.

A pool built with ``topk_unique=True`` (an indexer's top-k lists a position at most once, as
DeepSeek-V3.2's does) passes the Runtime's ``topk_unique`` to every sparse-MLA step: no
de-duplication of the top-k (a repeated position would count twice).

Attention sinks (a spec with ``has_sinks``: ``sinks=`` ``[H]`` fp32, one per query head of the
whole model) are checked on the driver, held on every actor and passed to every step (DCP counts
them on rank 0 only); :meth:`RayRankPool.set_sinks` replaces them.

Under ``pcp`` (sparse MLA and GQA), a prefill step runs PCP: rank ``r`` gets every head of its
zigzag tokens' queries (``pcp_plan(...).shard.token_ids(r)``, the driver reassembles token order)
and passes those tokens' KV (every KV head) as PCP's new rows; a GQA prefill is causal, a sparse
one reads each token's top-k. The resident cache keeps *one* layout, the DCP interleave that
decode reads: each rank writes the new tokens it owns under that layout (not its zigzag tokens).
PCP reads a cached prefix from a paged cache the same on every rank, so a chunked prefill step
all-gathers the requests' prefixes from the shards into a step-local paged copy
(``sum(ceil(prefix / page_size)) * page_size`` rows per rank: ``D`` wide for sparse MLA, K and V
of every KV head for GQA; freed after the step), as ShardQ's chunked prefill gathers its prefix;
no replica of the whole cache is kept. Decode is DCP, as under ``dcp-decode``.

Only the step's new tensors cross Ray's object store: the block table, lengths, new KV rows and
top-k once for every rank (one ``ray.put``), and each rank's heads of the queries (PCP prefill:
its tokens' queries); they travel as
NumPy arrays, which Ray reads out of shared memory without a copy (:mod:`~shardattn.serving.wire`). Bad requests
raise ``ValueError`` / ``TypeError`` before any rank runs (:mod:`~shardattn.serving.requests`).
A rank that dies, raises or does not answer within ``timeout_s`` makes the call raise one
:class:`~shardattn.serving.errors.RankFailedError`; the pool is then broken (every call raises
that error) until :meth:`RayRankPool.restart`, which re-forms actors and group in the same
placement group and returns the requests whose KV state was lost. The pool's bases hold the
request API (:class:`~shardattn.serving.steps.RequestSteps`) and the calls to the ranks, their
faults and health (:class:`~shardattn.serving.rank_calls.RankCalls`); this module builds, restarts
and shuts down.

Decode steps go through shared memory when every rank runs on the driver's node (the default
``transport="shm"``: one region in ``/dev/shm`` that driver and ranks map, page-locked on GPU
ranks, :mod:`~shardattn.serving.shm`), else through a Ray compiled graph (``"compiled"``), or
actor calls (``"calls"``); :mod:`~shardattn.serving.transport` chooses and falls back with a
warning. Prefill steps and every other call are actor calls.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from shardattn._checks import check_bool, check_int
from shardattn.plan.kv_pages import PagedKVBook
from shardattn.plan.spec import ModelSpec, get_preset
from shardattn.serving.errors import RankFailedError, require_ray
from shardattn.serving.health import HEALTH_GROUP
from shardattn.serving.placement import (
    bundle_options,
    check_placement,
    kill_actors,
    release_bundles,
    reserve_bundles,
)
from shardattn.serving.pool_shapes import check_sinks, plan_pool
from shardattn.serving.steps import RequestSteps
from shardattn.serving.transport import SERVE_GROUP, TRANSPORTS, start_decode_transport

__all__ = ["RayRankPool"]


def _check_cpu_bundle(num_cpus: float) -> None:
    """A CPU pool's bundles must reserve a CPU each (``ValueError`` naming ``num_cpus``)."""
    if num_cpus == 0:
        raise ValueError("num_cpus must be > 0 for a CPU pool (a bundle of no resource is no reservation)")


@functools.lru_cache(maxsize=4)
def _actor_class(num_cpus: float, num_gpus: float) -> Any:
    import ray

    from shardattn.serving.actor import RankActor

    groups = {HEALTH_GROUP: 1, SERVE_GROUP: 1}
    # concurrency_groups is an actor option of ray.remote that Ray's overloads leave out
    remote = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0, concurrency_groups=groups)  # type: ignore[call-overload]
    return remote(RankActor)


class RayRankPool(RequestSteps):
    """``world_size`` Ray actors forming one process group, serving requests (module docstring).

    Args:
        world_size: ranks (actors).
        spec: a :class:`~shardattn.plan.spec.ModelSpec` or preset name; ``None`` forms the group
            only (:meth:`run` works, the request API does not).
        mode: the Runtime's mode (``"mixed"``: ShardQ prefill (GQA: head-TP), DCP decode; ``"dcp-decode"``: no
            prefill attention; ``"shardq"`` / ``"headtp"``: head-TP decode over a replicated cache, ``"shardq"``
            sparse MLA only (a GQA model has no ShardQ step); ``"pcp"``: PCP prefill, DCP decode; module docstring).
        max_requests, max_seq_len: requests holding KV at once, and tokens per request.
        num_pages: KV pages per rank (default: ``max_requests`` requests of ``max_seq_len``; at least
            one such request's pages).
        runtime_kwargs: more :class:`~shardattn.runtime.runtime.Runtime` arguments
            (``max_batched_tokens`` is required with a spec; ``max_decode_tokens``, ``topk``,
            ``prefill_options``, ``decode_options``: its ``dcp_interleave`` lays out the caches).
        sinks: ``[H]`` fp32 finite sink logits (CPU), required exactly when ``spec.has_sinks``.
        topk_unique: sparse MLA: every request's top-k lists a position at most once (an indexer's
            top-k, as DeepSeek-V3.2's), so every prefill and decode step passes the Runtime's
            ``topk_unique`` and skips de-duplicating it (a repeated position would then count
            twice). A promise the driver does not check; ``True`` needs a sparse-MLA spec.
        memory_limit_bytes: refuse to build when a rank's workspace plus KV cache exceed it.
        device: ``"cpu"`` (gloo), ``"cuda"`` (NCCL, one GPU per actor), ``"auto"`` (cuda when the
            cluster has ``world_size`` GPUs).
        timeout_s: limit of every call (and of the group's collectives).
        placement_strategy: Ray placement strategy of the bundles (``"STRICT_PACK"``, ...).
        placement_timeout_s: wait for the bundles this long (default ``timeout_s``).
        num_cpus: CPUs per bundle (> 0 for a CPU pool; checked before Ray starts where ``device="cpu"``).
        transport: how decode steps reach the ranks: ``"shm"`` (a shared-memory region sized from
            ``max_decode_tokens``; every rank on the driver's node, else ``"compiled"``),
            ``"compiled"`` (a Ray compiled graph) or ``"calls"`` (actor calls, as prefill goes).
        host_threads: torch CPU threads of the driver's side of a step (its checks, and its copies
            of the step's tensors into the transport and of the outputs out of it). Default: 4 on
            a GPU pool whose host has 16 cores or more (on two H200s the copies of a 64-request
            step took less than half the time on 4 threads; docs/DECISIONS.md, D44), else
            1 (the CPU ranks need the cores; torch's default of a thread per core stalled steps,
            :func:`~shardattn.serving.requests.one_host_thread`).
        init_ray: start a local Ray when none is running.

    Raises:
        ImportError: Ray is missing (names the ``ray`` extra). ValueError / TypeError: bad sizes.
        PlacementTimeoutError: the bundles were not reserved in time (names what is short).
    """

    def __init__(
        self,
        world_size: int,
        spec: ModelSpec | str | None = None,
        *,
        mode: str = "mixed",
        max_requests: int = 8,
        max_seq_len: int = 4096,
        num_pages: int | None = None,
        runtime_kwargs: dict[str, Any] | None = None,
        sinks: torch.Tensor | None = None,
        topk_unique: bool = False,
        memory_limit_bytes: int | None = None,
        device: str = "auto",
        timeout_s: float = 120.0,
        placement_strategy: str = "STRICT_PACK",
        placement_timeout_s: float | None = None,
        num_cpus: float = 1.0,
        transport: str = "shm",
        host_threads: int | None = None,
        init_ray: bool = True,
    ) -> None:
        require_ray()
        import ray

        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        # everything checked before Ray starts or a bundle is asked for
        check_placement(placement_strategy, timeout_s, placement_timeout_s, num_cpus)
        if memory_limit_bytes is not None:
            check_int("memory_limit_bytes", memory_limit_bytes, minimum=1)
        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
        if device == "cpu":
            _check_cpu_bundle(num_cpus)
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.transport = self._asked_transport = transport
        if host_threads is not None:
            check_int("host_threads", host_threads, minimum=1)
        self._decoder: Any = None  # the decode transport's runner (None: actor calls)
        self._step_lock = threading.Lock()  # one step at a time: a call from another thread waits
        self._staging_writes = 0  # steps that wrote their inputs over the shm staging rows
        self._staging_seen: dict[int, int] = {}  # per thread: staging writes when it took step_inputs()
        self._decode_lse = True
        self.world_size, self.timeout_s = world_size, float(timeout_s)
        self._actors: list[Any] = []
        self._pg: Any = None
        self._broken: RankFailedError | None = None
        self._owns_ray = False
        #: driver-side times of the last prefill / decode (``check_ms``, ``prepare_ms``, ``ranks_ms``, ``assemble_ms``;
        #: a decode step under ``shm`` also its ``timeline`` on every rank, :meth:`ShmSteps.timeline`)
        self.last_step: dict[str, Any] = {}
        self.spec = get_preset(spec) if isinstance(spec, str) else spec
        self._runtime_kwargs = dict(runtime_kwargs or {})
        if "mode" in self._runtime_kwargs:
            raise ValueError("runtime_kwargs must not give mode: pass mode= to the pool")
        self._runtime_kwargs["mode"] = mode
        self.mode = self._runtime_kwargs["mode"]
        self._memory_limit = memory_limit_bytes
        self._sinks = sinks
        check_bool("topk_unique", topk_unique)
        if self.spec is not None:  # (a spec that is no ModelSpec: a TypeError here)
            self._plan_cache(max_requests, max_seq_len, num_pages)
        if topk_unique and (self.spec is None or self.spec.kind != "sparse_mla"):
            kind = "no spec" if self.spec is None else f"a {self.spec.kind} spec"
            raise ValueError(f"topk_unique=True promises a sparse-MLA top-k, but the pool has {kind}; pass False")
        self.topk_unique = topk_unique
        if init_ray and not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)
            self._owns_ray = True  # started here, so stopped by shutdown()
        try:
            if device == "auto":
                device = "cuda" if ray.cluster_resources().get("GPU", 0) >= world_size else "cpu"
                if device == "cpu":
                    _check_cpu_bundle(num_cpus)
            self.device = device
            if host_threads is None:
                host_threads = 4 if device == "cuda" and (os.cpu_count() or 1) >= 16 else 1
            self.host_threads = host_threads
            bundle = {"CPU": float(num_cpus), **({"GPU": 1.0} if device == "cuda" else {})}
            self._pg = reserve_bundles(
                world_size,
                bundle,
                strategy=placement_strategy,
                timeout_s=self.timeout_s if placement_timeout_s is None else placement_timeout_s,
            )
            self._cls = _actor_class(float(num_cpus), 1.0 if device == "cuda" else 0.0)
            self._form()
        except BaseException:
            self.shutdown()
            raise

    # -- building ------------------------------------------------------------------------------
    def _plan_cache(self, max_requests: int, max_seq_len: int, num_pages: int | None) -> None:
        plan = plan_pool(
            self.spec, self.mode, self._runtime_kwargs, self.world_size, self._sinks, max_requests, max_seq_len,
            num_pages, self._memory_limit,
        )  # fmt: skip
        self.shapes, self._sinks, self._decode_lse = plan.shapes, plan.sinks, plan.decode_lse
        self.cache_config, self._cache_spec = plan.cache_config, plan.cache_spec
        self.book = PagedKVBook(self.cache_config)
        self.heads_per_rank = plan.spec.heads_per_rank(self.world_size, ranks="world_size")

    def _form(self) -> None:
        """Start the actors in their bundles, join the group, build Runtimes and caches."""
        dev = "cuda:0" if self.device == "cuda" else "cpu"  # each actor sees only its own GPU
        self._actors = [
            self._cls.options(**bundle_options(self._pg, r)).remote(r, self.world_size, dev)
            for r in range(self.world_size)
        ]
        host, port = self._call("start", [self._actors[0].address.remote()], ranks=[0])[0]
        backends = self._call("join", [a.join.remote(host, port, self.timeout_s) for a in self._actors])
        self.backend = backends[0]
        self.built: list[dict[str, Any]] = []
        if self.spec is not None:
            kw = {k: v for k, v in self._runtime_kwargs.items()}
            args = (self.spec, kw, self._cache_spec, self._sinks, self.topk_unique)
            self.built = self._call("build", [a.build.remote(*args) for a in self._actors])
            self._start_decode(self.spec)

    def _start_decode(self, spec: ModelSpec) -> None:
        from shardattn.serving.compiled import channel_bytes
        from shardattn.serving.shm import decode_layout

        shapes, cfg, h, dv = self.shapes, self.cache_config, self.heads_per_rank, spec.v_dim
        sizes = {"max_tokens": shapes.max_decode_tokens, "max_requests": cfg.max_requests, "heads_per_rank": h}
        sizes.update(table_width=cfg.pages_per_request, head_dim=shapes.head_dim, v_dim=dv)
        sizes.update(dtype=shapes.dtype, topk=shapes.topk if shapes.kind == "sparse_mla" else 0, kv_rows=shapes.kv_rows)
        self.transport, self._decoder = start_decode_transport(
            self._asked_transport,
            self._actors,
            self.built,
            layout=lambda: decode_layout(self.world_size, **sizes),
            channel_bytes=lambda: channel_bytes(shapes, h, dv, cfg),
            call=self._call,
            spin_s=0.005 if self.device == "cuda" else 0.0,  # CPU ranks need their cores for the step
        )

    # -- the request API (prefill, decode, decode_batch: :class:`~shardattn.serving.steps.RequestSteps`)
    def set_sinks(self, sinks: torch.Tensor | None) -> None:
        """Replace the attention sinks every rank holds (``[H]`` fp32, finite; ``None`` when the
        spec has none); checked on the driver first, so a bad value changes nothing."""
        self._check_usable()
        checked = check_sinks(sinks, self._need_spec())
        with self._step_lock:
            self._call("set_sinks", [a.set_sinks.remote(checked) for a in self._actors])
            self._sinks = checked

    def free(self, request_ids: Sequence[Hashable]) -> int:
        """Release requests' pages (host bookkeeping; no rank runs). Returns the pages freed."""
        self._check_usable()
        self._need_spec()
        if isinstance(request_ids, str | bytes) or not isinstance(request_ids, Iterable):  # a str: one-letter ids
            raise TypeError(f"request_ids must be a sequence of ids, got {type(request_ids).__name__} {request_ids!r}")
        if isinstance(request_ids, torch.Tensor | np.ndarray):  # integer ids, as decode_batch takes them
            request_ids = self.book.ids_of(request_ids)
        with self._step_lock:
            return self.book.release(request_ids)

    def restart(self) -> list[Hashable]:
        """Stop every actor, start new ones in the same bundles, re-form the group and rebuild.

        Returns the request ids whose KV state was lost (every request the pool held): the
        caller re-prefills them. The pool is usable again afterwards (not after :meth:`shutdown`);
        a restart that fails leaves it broken, and the next one returns those requests.
        """
        with self._step_lock:
            if self._pg is None:
                raise RuntimeError("the pool is shut down")
            self._teardown_decoder()
            kill_actors(self._actors)
            self._actors = []
            lost = self.book.request_ids if self.spec is not None else []
            self._broken = None
            try:  # a failure breaks the pool: the ledger keeps the requests for the next restart
                self._form()
            except BaseException as e:
                if self._broken is None:  # the driver's own error (not a rank's): the pool is no more usable
                    self._fail(0, f"the restart failed on the driver ({type(e).__name__}: {e})", "restart", probe=False)
                raise
            if self.spec is not None:
                self.book.reset()
            return lost

    def shutdown(self) -> None:
        """Leave the group, stop the actors, free the bundles (and stop Ray when this pool started it).

        A step running on another thread ends first (it returns, or fails within ``timeout_s``);
        a call made afterwards raises ``RuntimeError`` (the pool is shut down)."""
        import ray

        with self._step_lock:
            self._teardown_decoder()
            actors, self._actors = self._actors, []
            if actors and self._broken is None:
                try:
                    ray.get([a.leave.remote() for a in actors], timeout=10)
                except Exception:
                    pass
            kill_actors(actors)
            if self._pg is not None:
                release_bundles(self._pg)
                self._pg = None
            if self._owns_ray:
                ray.shutdown()
                self._owns_ray = False

    def __enter__(self) -> RayRankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
