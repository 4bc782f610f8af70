"""A pool of Ray actors, one rank each of a torch.distributed world, for services.

A service that already runs on Ray (a router, a disaggregated prefill/decode tier) gets the
sharded attention steps without torchrun: :class:`RayRankPool` starts ``N`` actors, joins them
into one process group (gloo on CPU, NCCL with one GPU per actor), and then

* :meth:`RayRankPool.run` runs a function ``fn(group, *args)`` on every rank, and
* :meth:`RayRankPool.build_runtime` / :meth:`RayRankPool.step` keep one
  :class:`~shardattn.parallel.runtime.Runtime` per actor and call its ``prefill`` / ``decode``
  with per-rank arguments.

Ray is an optional dependency (``pip install shardattn[ray]``); importing this module does not
import it. Results come back through Ray's object store, so return CPU tensors or small values.

Example (needs Ray)::

    pool = RayRankPool(2)                                    # gloo on CPU
    ranks = pool.run(lambda group: torch.distributed.get_rank(group))   # [0, 1]
    pool.shutdown()
"""

from __future__ import annotations

import functools
import socket
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["RayRankPool", "ray_unavailable_reason"]


def ray_unavailable_reason() -> str | None:
    """Why the pool cannot run here (``None`` when Ray imports)."""
    try:
        import ray  # noqa: F401
    except ImportError as e:
        return f"ray is not installed ({e}); pip install 'shardattn[ray]'"
    return None


class _RankActorImpl:
    """The body of one actor: one rank, its process group and (optionally) its Runtime."""

    def __init__(self, rank: int, world_size: int, device: str) -> None:
        import torch

        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.group: Any = None
        self.runtime: Any = None
        torch.set_num_threads(1)

    def address(self) -> tuple[str, int]:
        """This actor's node address and a free TCP port on it (rank 0 hosts the store)."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return host, int(s.getsockname()[1])

    def join(self, host: str, port: int, timeout_s: float) -> str:
        import datetime

        import torch
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
        self.group = dist.group.WORLD
        return backend

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        return fn(self.group, *args, **kwargs)

    def build_runtime(self, spec: Any, kwargs: dict) -> dict[str, Any]:
        from shardattn.parallel.runtime import Runtime

        self.runtime = Runtime(spec, self.group, device=self.device, **kwargs)
        return {"rank": self.rank, "workspace_bytes": self.runtime.workspace_bytes}

    def step(self, method: str, args: tuple, kwargs: dict) -> Any:
        if self.runtime is None:
            raise RuntimeError("build_runtime must be called before step")
        if method not in ("prefill", "decode"):
            raise ValueError(f"method must be 'prefill' or 'decode', got {method!r}")
        result = getattr(self.runtime, method)(*_to_device(args, self.device), **_to_device(kwargs, self.device))
        return _to_cpu(result)

    def leave(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _map_tensors(value: Any, fn: Callable[[Any], Any]) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(_map_tensors(v, fn) for v in value)
    if isinstance(value, list):
        return [_map_tensors(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


def _to_device(value: Any, device: Any) -> Any:
    return _map_tensors(value, lambda t: t.to(device))


def _to_cpu(value: Any) -> Any:
    return _map_tensors(value, lambda t: t.cpu())


@functools.lru_cache(maxsize=2)
def _actor_class(num_gpus: float) -> Any:
    import ray

    return ray.remote(num_cpus=1, num_gpus=num_gpus)(_RankActorImpl)


class RayRankPool:
    """``world_size`` Ray actors forming one process group (see the module docstring).

    Args:
        world_size: number of actors (ranks).
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, one GPU per actor); ``"auto"`` picks
            ``cuda`` when the Ray cluster has at least ``world_size`` GPUs.
        timeout_s: seconds for forming the group and for every call (also the collectives'
            timeout); a dead or hung actor makes the call raise ``TimeoutError`` or Ray's
            actor error instead of hanging.
        init_ray: start a local Ray instance when none is running.

    Raises:
        ImportError: Ray is not installed (the message says how to install it).
    """

    def __init__(self, world_size: int, *, device: str = "auto", timeout_s: float = 120.0, init_ray: bool = True):
        reason = ray_unavailable_reason()
        if reason is not None:
            raise ImportError(reason)
        import ray

        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
        self._owns_ray = False
        if init_ray and not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)
            self._owns_ray = True  # started here, so stopped by shutdown()
        if device == "auto":
            device = "cuda" if ray.cluster_resources().get("GPU", 0) >= world_size else "cpu"
        self.world_size = world_size
        self.device = device
        self.timeout_s = timeout_s
        cls = _actor_class(1.0 if device == "cuda" else 0.0)
        # each actor sees only its own GPU, so it is cuda:0 inside the actor
        self._actors = [cls.remote(r, world_size, "cuda:0" if device == "cuda" else "cpu") for r in range(world_size)]
        try:
            host, port = self._get([self._actors[0].address.remote()])[0]
            backends = self._get([a.join.remote(host, port, timeout_s) for a in self._actors])
        except BaseException:
            self.shutdown()
            raise
        self.backend = backends[0]

    def _get(self, refs: Sequence[Any]) -> list[Any]:
        import ray

        try:
            return ray.get(list(refs), timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"ranks did not answer within {self.timeout_s:g} s (a dead or hung actor?)") from None

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``fn(group, *args, **kwargs)`` on every rank; the per-rank results, in rank order."""
        return self._get([a.run.remote(fn, args, kwargs) for a in self._actors])

    def build_runtime(self, spec: Any, **kwargs: Any) -> list[dict[str, Any]]:
        """Build one :class:`~shardattn.parallel.runtime.Runtime` per rank (``Runtime(spec, group, **kwargs)``)."""
        return self._get([a.build_runtime.remote(spec, kwargs) for a in self._actors])

    def step(self, method: str, per_rank_args: Sequence[tuple], **kwargs: Any) -> list[Any]:
        """Call ``runtime.<method>(*per_rank_args[r], **kwargs)`` on every rank r (``"prefill"`` / ``"decode"``).

        Tensor arguments are moved to the actor's device; tensor results come back on the CPU.
        """
        if len(per_rank_args) != self.world_size:
            raise ValueError(
                f"per_rank_args must have one tuple per rank ({self.world_size}), got {len(per_rank_args)}"
            )
        return self._get([a.step.remote(method, tuple(args), kwargs) for a, args in zip(self._actors, per_rank_args)])

    def shutdown(self) -> None:
        """Leave the group and stop the actors (and Ray itself, when this pool started it)."""
        import ray

        actors, self._actors = getattr(self, "_actors", []), []
        if actors:
            try:
                ray.get([a.leave.remote() for a in actors], timeout=10)
            except Exception:
                pass
        for a in actors:
            ray.kill(a)
        if getattr(self, "_owns_ray", False):
            ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> RayRankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
