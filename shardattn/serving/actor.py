"""The body of one pool actor: one rank, its process group, its Runtime and its KV-cache shard.

Ray turns :class:`RankActor` into an actor (:mod:`~shardattn.serving.pool`); this module does
not import Ray. Steps run one at a time; :meth:`RankActor.health` runs in its own concurrency
group, so it answers while a step is running (or stuck in a collective).

A step's arguments are the step's *new* tensors only: ``shared`` (one object for every rank:
block table, lengths, new KV rows, top-k) and this rank's heads of the queries (a PCP prefill:
every head of this rank's zigzag tokens). Results come back on the CPU: this rank's heads of the
outputs and LSE (a PCP prefill: its tokens'). The sinks (``[H]`` fp32, or none) stay resident.
The prefill steps are :mod:`~shardattn.serving.actor_prefill`'s, the shared-memory decode path
:mod:`~shardattn.serving.actor_shm`'s.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch

from shardattn.serving.actor_prefill import PrefillSteps
from shardattn.serving.actor_shm import ShmDecode
from shardattn.serving.wire import from_wire, to_wire

__all__ = ["FAULT_KINDS", "FAULT_OPERATIONS", "RankActor", "check_fault"]

#: Faults :meth:`RankActor.arm_fault` can inject (tests and drills): exit the process, raise, or hang.
FAULT_KINDS = ("exit", "raise", "hang")
FAULT_OPERATIONS = ("prefill", "decode")


def check_fault(kind: object, operation: object) -> None:
    """A fault drill's ``kind`` (:data:`FAULT_KINDS`) and ``operation`` (:data:`FAULT_OPERATIONS`)."""
    if kind not in FAULT_KINDS:
        raise ValueError(f"kind must be one of {FAULT_KINDS}, got {kind!r}")
    if operation not in FAULT_OPERATIONS:
        raise ValueError(f"operation must be one of {FAULT_OPERATIONS}, got {operation!r}")


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return -1


class RankActor(PrefillSteps, ShmDecode):
    """Rank ``rank`` of a ``world_size`` pool on ``device`` (``"cpu"`` or ``"cuda:0"``, its only GPU);
    prefill steps: :class:`~shardattn.serving.actor_prefill.PrefillSteps`; decode steps through
    shared memory: :class:`~shardattn.serving.actor_shm.ShmDecode`."""

    def __init__(self, rank: int, world_size: int, device: str) -> None:
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.group: Any = None
        self.mesh: Any = None
        self.runtime: Any = None
        self.cache: Any = None
        self.comm: Any = None
        self.sinks: torch.Tensor | None = None
        self.topk_unique = False
        self.state = "starting"
        self.steps = 0
        self.last_step_s: float | None = None
        self._fault: tuple[str, str] | None = None
        self._step_t0 = 0.0
        self._shm: Any = None
        torch.set_num_threads(1)

    # -- forming the group ---------------------------------------------------------------------
    def address(self) -> tuple[str, int]:
        """This actor's node address and a free TCP port on it (rank 0 hosts the rendezvous)."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return host, int(s.getsockname()[1])

    def join(self, host: str, port: int, timeout_s: float) -> str:
        import datetime

        import torch.distributed as dist

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            torch.cuda.set_device(self.device)
            kwargs["device_id"] = self.device
        dist.init_process_group(
            backend,
            init_method=f"tcp://{host}:{port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            **kwargs,
        )
        from torch.distributed.device_mesh import init_device_mesh

        self.group = dist.group.WORLD
        # the pool's layout as serving code hands it around: a 1-D mesh over the ranks (its group is WORLD)
        self.mesh = init_device_mesh(self.device.type, (self.world_size,), mesh_dim_names=("pool",))
        self.state = "joined"
        return backend

    def build(
        self,
        spec: Any,
        runtime_kwargs: dict[str, Any],
        cache: dict[str, Any],
        sinks: torch.Tensor | None = None,
        topk_unique: bool = False,
    ) -> dict[str, Any]:
        """Build the Runtime on the pool's 1-D ``DeviceMesh`` (dim ``"pool"``, formed by :meth:`join`),
        then the KV-cache shard (``cache``: pages, page size, layout, row shapes).

        ``sinks``: ``[H]`` fp32 sink logits of every head (checked by the driver), held on the
        device and passed to every step (under DCP the step counts them on rank 0 only).
        ``topk_unique``: the pool's promise (sparse MLA), passed to every step's Runtime call."""
        from shardattn.parallel.comm import Comm
        from shardattn.runtime.runtime import Runtime
        from shardattn.serving.kv_cache import RankKVCache
        from shardattn.serving.pool_shapes import rank_kv_heads

        self.runtime = Runtime(spec, self.mesh, device=self.device, **runtime_kwargs)
        limit = cache.get("memory_limit_bytes")
        need = self.runtime.workspace_bytes + cache["bytes"]
        if limit is not None and need > limit:
            raise ValueError(
                f"rank {self.rank}: workspace {self.runtime.workspace_bytes} B + KV cache {cache['bytes']} B "
                f"exceed memory_limit_bytes={limit}; lower max_requests, max_seq_len or num_pages"
            )
        self.cache = RankKVCache(
            cache["rows"],
            num_pages=cache["num_pages"],
            page_size=cache["page_size"],
            layout=cache["layout"],
            rank=self.rank,
            device=self.device,
            heads=rank_kv_heads(spec, self.runtime.decode_is_dcp, self.world_size, self.rank),
        )
        self.set_sinks(sinks)
        self.topk_unique = bool(topk_unique)
        self.comm = Comm(self.mesh)  # the pool's own collectives (prefix gathers), counted apart from the Runtime's
        self.state = "ready"
        import ray

        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "workspace_bytes": self.runtime.workspace_bytes,
            "cache_bytes": self.cache.nbytes,
        }

    def set_sinks(self, sinks: torch.Tensor | None) -> None:
        """Hold ``sinks`` (``[H]`` fp32, or ``None``) on this rank's device for every later step."""
        self.sinks = None if sinks is None else sinks.to(self.device, torch.float32).contiguous()

    # -- steps ---------------------------------------------------------------------------------
    def arm_fault(self, kind: str, operation: str) -> None:
        """Make the next ``operation`` step (``"prefill"`` / ``"decode"``) fail: ``kind`` in :data:`FAULT_KINDS`.

        The fault strikes after the step has written its KV rows and before its first
        collective, so the other ranks are left waiting in that collective.
        """
        check_fault(kind, operation)
        self._fault = (kind, operation)

    def _maybe_fail(self, operation: str) -> None:
        if self._fault is None or self._fault[1] != operation:
            return
        kind, self._fault = self._fault[0], None
        if kind == "exit":
            os._exit(17)
        if kind == "hang":
            time.sleep(24 * 3600)
        raise RuntimeError(f"injected fault in {operation} on rank {self.rank}")

    def _begin(self, operation: str) -> float:
        if self.runtime is None:
            raise RuntimeError("build() must run before a step")
        self.state = operation  # health() shows a step in progress (or stuck) and since when
        self._step_t0 = time.perf_counter()
        return self._step_t0

    def _end(self, t0: float) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_step_s = time.perf_counter() - t0
        self.steps += 1
        self.state = "ready"

    def _result(self, out: torch.Tensor, lse: torch.Tensor | None, return_lse: bool) -> tuple[Any, Any]:
        return to_wire((out, lse if return_lse else None))

    def decode(self, shared: dict[str, Any], q_local: Any) -> tuple[Any, Any]:
        """Write the query tokens' KV rows (when given), then one decode step (DCP or head-TP, by mode).

        ``q_local``: ``[T, H/W, D]``. Returns ``(out [T, H/W, Dv], lse [T, H/W] or None)``.
        """
        t0 = self._begin("decode")
        shared, q_local = from_wire(shared), from_wire(q_local)
        out, lse = self._decode(shared, q_local)
        result = self._result(out, lse, shared["return_lse"])
        self._end(t0)
        return result

    def _decode(self, shared: dict[str, Any], q_local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode step on this rank's device: ``(out [T, H/W, Dv], lse [T, H/W])``. Inputs on
        the CPU are copied without blocking (page-locked ones asynchronously; :meth:`_end` syncs)."""
        table, starts, counts, q_counts = shared["table"], shared["starts"], shared["counts"], shared["q_counts"]
        if shared["kv"]:
            self.cache.write(table, starts, counts, shared["kv"])
        self._maybe_fail("decode")
        dev = self.device
        seq_lens = torch.tensor([s + n for s, n in zip(starts, counts)], dtype=torch.int32, device=dev)
        table_d = table.to(dev, non_blocking=True)
        q = q_local.to(dev, non_blocking=True)
        if self.runtime.spec.kind == "sparse_mla":
            req_ids = torch.repeat_interleave(
                torch.arange(len(q_counts), dtype=torch.int32), torch.tensor(q_counts)
            ).to(dev)
            topk = shared["topk"].to(dev, non_blocking=True)
            return self._run_decode(q, table_d, seq_lens, topk=topk, req_ids=req_ids)
        cu = torch.tensor([0, *torch.cumsum(torch.tensor(q_counts), 0).tolist()], dtype=torch.int32, device=dev)
        return self._run_decode(q, table_d, seq_lens, cu_q=cu)

    def _run_decode(
        self,
        q: torch.Tensor,
        table: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        topk: torch.Tensor | None = None,
        req_ids: torch.Tensor | None = None,
        cu_q: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The Runtime's decode over this rank's cache shard, every input on the device: ``q [T,
        H/W, D]``, ``table [B, M]`` / ``seq_lens [B]`` int32; sparse MLA ``topk [T, K]`` /
        ``req_ids [T]`` int32; GQA ``cu_q [B + 1]`` int32. Unchecked (the driver checked)."""
        if self.runtime.spec.kind == "sparse_mla":
            return self.runtime.decode(
                q, self.cache.flat(0), table, seq_lens, topk_pos=topk, req_ids=req_ids, topk_unique=self.topk_unique,
                sinks=self.sinks, check=False,
            )  # fmt: skip
        kv = (self.cache.pages[0], self.cache.pages[1])
        return self.runtime.decode(q, kv, table, seq_lens, cu_q_lens=cu_q, sinks=self.sinks, check=False)

    def step(self, payload: dict[str, Any]) -> tuple[Any, Any] | None:
        """One step from a compiled graph: ``payload`` holds the kind, the shared part and every rank's queries."""
        method = self.prefill if payload["kind"] == "prefill" else self.decode
        return method(payload["shared"], payload["qs"][self.rank])

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """``fn(group, *args, **kwargs)`` on this rank."""
        return fn(self.group, *args, **kwargs)

    # -- reporting and leaving -----------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """State, memory, last step time and collectives entered of this rank (answers even while a step runs)."""
        report: dict[str, Any] = {
            "rank": self.rank,
            "state": self.state,
            "pid": os.getpid(),
            "node": socket.gethostname(),
            "device": str(self.device),
            "steps": self.steps,
            "last_step_s": self.last_step_s,
            "step_running_s": time.perf_counter() - self._step_t0 if self.state in ("prefill", "decode") else None,
            "rss_bytes": _rss_bytes(),
            "cache_bytes": self.cache.nbytes if self.cache is not None else 0,
            # collectives entered on this rank (counted as they start, a reduce-scatter once it returns; a CUDA
            # graph's replays add none)
            "collectives": sum(c.counts.total() for c in (self.comm, getattr(self.runtime, "comm", None)) if c),
            "workspace_bytes": self.runtime.workspace_bytes if self.runtime is not None else 0,
        }
        if self.device.type == "cuda":
            report["cuda_allocated_bytes"] = int(torch.cuda.memory_allocated(self.device))
            report["cuda_reserved_bytes"] = int(torch.cuda.memory_reserved(self.device))
        return report

    def leave(self) -> None:
        from shardattn.launch.process_group import destroy_groups

        destroy_groups()
        self.state = "left"
