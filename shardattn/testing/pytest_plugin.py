"""pytest plugin: ``--nproc N`` runs distributed tests on N ranks, ``gpu`` tests skip without a GPU.

Registered through the ``pytest11`` entry point of the package, so any ``pytest`` run in an
environment where shardattn is installed has it.

Options:
    ``--nproc N``          ranks of the worker pool (default 1).
    ``--dist-timeout S``   seconds before a distributed call counts as hung (default 120).

Two ways to write a distributed test (mark it ``@pytest.mark.distributed``):

1. Ask for the ``dist_pool`` fixture and call ``dist_pool.run(fn, *args, world_size=W)``: the test
   body (hypothesis draws included) runs once, in the test process, and ``fn(group, *args)`` runs
   on every rank. A ``world_size`` above ``--nproc`` skips the test, saying so.
2. Give the test function a first parameter named ``group``: its whole body then runs on every
   rank (``world_size=`` on the marker, default ``--nproc``), other parameters coming from
   ``parametrize`` (they must be picklable).

A test that needs a one-rank group in its own process (a one-rank Runtime, say) asks for the
``one_rank_group`` fixture, which forms it and destroys it after the test.

Tests marked ``gpu`` skip with the reason when CUDA is not available, and tests marked
``interpret`` when the installed Triton interpreter cannot run the kernels (probed once:
:func:`~shardattn.testing.interpret.interpreter_unusable_reason`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest

from shardattn.testing.pool import DEFAULT_TIMEOUT_S, DistributedPool

_POOL_KEY = pytest.StashKey["PoolHandle"]()
_INTERPRETER_KEY = pytest.StashKey[str | None]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("shardattn")
    group.addoption("--nproc", type=int, default=1, help="ranks for tests marked distributed (default 1)")
    group.addoption(
        "--dist-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds before a distributed call counts as hung (default {DEFAULT_TIMEOUT_S:.0f})",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "distributed: the test runs on the ranks of the --nproc worker pool")
    config.addinivalue_line("markers", "gpu: the test needs a CUDA GPU and skips without one")
    config.addinivalue_line("markers", "interpret: runs Triton kernels under TRITON_INTERPRET=1 in a subprocess")
    nproc = config.getoption("--nproc", default=1)
    if nproc is not None and nproc < 1:
        raise pytest.UsageError(f"--nproc must be >= 1, got {nproc}")
    timeout = config.getoption("--dist-timeout", default=DEFAULT_TIMEOUT_S)
    if not 0 < timeout < math.inf:  # 0 or less: every call would count as hung at once
        raise pytest.UsageError(f"--dist-timeout must be a positive number of seconds, got {timeout}")
    config.stash[_POOL_KEY] = PoolHandle(nproc or 1, timeout)


def pytest_unconfigure(config: pytest.Config) -> None:
    handle = config.stash.get(_POOL_KEY, None)
    if handle is not None:
        handle.close()


def cuda_skip_reason() -> str | None:
    """Why GPU tests cannot run here, or None when they can."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"no CUDA GPU visible (torch {torch.__version__}, built with CUDA {torch.version.cuda})"
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None:
        reason = cuda_skip_reason()
        if reason is not None:
            pytest.skip(f"needs a CUDA GPU: {reason}")
    if item.get_closest_marker("interpret") is not None:
        reason = _interpreter_reason(item.config)
        if reason is not None:
            pytest.skip(f"needs Triton's interpreter: {reason}")


def _interpreter_reason(config: pytest.Config) -> str | None:
    """:func:`~shardattn.testing.interpret.interpreter_unusable_reason`, probed once a test run."""
    if _INTERPRETER_KEY not in config.stash:
        from shardattn.testing.interpret import interpreter_unusable_reason

        config.stash[_INTERPRETER_KEY] = interpreter_unusable_reason()
    return config.stash[_INTERPRETER_KEY]


class PoolHandle:
    """The test run's worker pool, started on first use; what the ``dist_pool`` fixture returns."""

    def __init__(self, nproc: int, timeout_s: float) -> None:
        self.nproc = nproc
        self.timeout_s = timeout_s
        self._pool: DistributedPool | None = None

    def run(self, fn: Any, *args: Any, world_size: int | None = None, backend: str = "gloo", **kwargs: Any) -> list:
        """Run ``fn(group, *args, **kwargs)`` on ``world_size`` ranks (default ``--nproc``).

        Skips the calling test when ``world_size`` exceeds ``--nproc``, or when ``backend="nccl"``
        and fewer GPUs than ranks are visible.
        """
        world_size = self.nproc if world_size is None else world_size
        if world_size > self.nproc:
            pytest.skip(f"needs {world_size} ranks; run with --nproc {world_size} or more")
        if backend == "nccl":
            import torch

            visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if visible < world_size:
                pytest.skip(f"nccl needs {world_size} GPUs, {visible} visible")
        if self._pool is None:
            self._pool = DistributedPool(self.nproc, timeout_s=self.timeout_s)
        return self._pool.run(fn, *args, world_size=world_size, backend=backend, **kwargs)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


@pytest.fixture
def dist_pool(request: pytest.FixtureRequest) -> PoolHandle:
    """The test run's worker pool of ``--nproc`` ranks (see the module docstring)."""
    return request.config.stash[_POOL_KEY]


@pytest.fixture
def nproc(request: pytest.FixtureRequest) -> int:
    """The ``--nproc`` value of this test run."""
    return int(request.config.getoption("--nproc"))


@pytest.fixture
def one_rank_group() -> Iterator[Any]:
    """A one-rank gloo process group in the test's own process (the default group), destroyed
    after the test, so that a later test may form its own; one already formed is lent as it is."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield dist.group.WORLD
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture
def group() -> None:
    """Placeholder: in a ``distributed`` test the plugin passes each rank's ProcessGroup instead."""
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    marker = pyfuncitem.get_closest_marker("distributed")
    argnames = list(pyfuncitem._fixtureinfo.argnames)
    if marker is None or not argnames or argnames[0] != "group":
        return None
    handle: PoolHandle = pyfuncitem.config.stash[_POOL_KEY]
    kwargs = {name: pyfuncitem.funcargs[name] for name in argnames[1:]}
    handle.run(
        pyfuncitem.obj,
        world_size=marker.kwargs.get("world_size"),
        backend=marker.kwargs.get("backend", "gloo"),
        **kwargs,
    )
    return True
