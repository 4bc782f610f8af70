"""How the Ray pool's steps travel between the driver and the ranks: the shared-memory region's int32
span holds every int32 section in one copy; a region that cannot be mapped, or that /dev/shm has no
room for, leaves no file behind (the transport is then unavailable); ranks on another node than the
driver decode through the compiled graph instead; shutdown waits for the step in flight; and the
driver's side of a step runs on one torch thread, restoring the count. One Ray instance per module."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from tests import ray_pool_helpers as helpers
from tests.ray_pool_helpers import MLA, needs_ray

ray_instance = helpers.ray_instance  # the module's Ray (a fixture)


def test_int32_span_holds_every_int32_section_in_one_copy(tmp_path: Path) -> None:
    """A rank's one DMA of the int32 span gives the same lengths, block table and top-k as the region."""
    from shardattn.serving.shm import ShmRegion, decode_layout

    lay = decode_layout(2, max_tokens=6, max_requests=4, table_width=3, heads_per_rank=2, head_dim=8, v_dim=4,
                        dtype=torch.float32, topk=5, kv_rows=[((8,), torch.float32)])  # fmt: skip
    region = ShmRegion(str(tmp_path / "region"), lay, create=True)
    b, n_q, width = 3, 5, 2
    host = region.int32_views(region.bytes, 0, b, n_q, width)
    gen = torch.Generator().manual_seed(0)
    for v in host.values():
        v.copy_(torch.randint(-5, 1000, v.shape, generator=gen, dtype=torch.int32))
    lo, hi = region.int32_span(b, n_q, width)
    copied = region.bytes[lo:hi].clone()  # what the device receives
    got = region.int32_views(copied, lo, b, n_q, width)
    assert set(got) == {"seq_lens", "req_ids", "cu_q", "table", "topk"}
    for k in got:
        assert got[k].shape == host[k].shape and torch.equal(got[k], host[k]), k
    assert got["table"].shape == (3, 2) and got["topk"].shape == (5, 5)
    region.close(unlink=True)


def test_a_region_not_mapped_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A region made whose mapping then failed left its file behind (in /dev/shm: memory): removed."""
    import mmap

    from shardattn.serving.shm import ShmRegion, decode_layout

    lay = decode_layout(2, max_tokens=4, max_requests=2, table_width=1, heads_per_rank=2, head_dim=8, v_dim=4,
                        dtype=torch.float32, topk=0, kv_rows=[((8,), torch.float32)])  # fmt: skip

    def refused(*args: object) -> None:
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(mmap, "mmap", refused)
    with pytest.raises(OSError, match="Cannot allocate memory"):
        ShmRegion(str(tmp_path / "region"), lay, create=True)
    assert os.listdir(tmp_path) == []


@needs_ray
@pytest.mark.skipif(not hasattr(os, "posix_fallocate"), reason="no posix_fallocate: the region is a sparse file")
def test_a_dev_shm_without_room_for_the_region_makes_the_transport_unavailable(
    ray_instance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The region was a sparse file: a /dev/shm smaller than it killed the driver with SIGBUS at the
    first step that touched a page past the room. Its pages are allocated when it is made: no room
    raises there, the transport is unavailable (the pool falls back) and no file is left behind."""
    from shardattn.serving import transport
    from shardattn.serving.shm import decode_layout

    lay = decode_layout(2, max_tokens=4, max_requests=2, table_width=1, heads_per_rank=2, head_dim=8, v_dim=4,
                        dtype=torch.float32, topk=0, kv_rows=[((8,), torch.float32)])  # fmt: skip
    sizes: list[int] = []

    def no_room(fd: int, offset: int, size: int) -> None:
        sizes.append(size)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    before = helpers.region_paths()
    with pytest.raises(transport.TransportUnavailable, match=r"region \(\[Errno 28\] No space left on device"):
        transport._start_shm([], [], lay, lambda operation, refs: [], 0.0)
    assert sizes == [lay.size] and helpers.region_paths() == before


@needs_ray
def test_shutdown_waits_for_the_step_in_flight() -> None:
    """shutdown() from another thread closed the doorbells under a running step, which raised
    ValueError ("doorbell ... is closed", a bad input's error): it waits for the step to end."""
    import threading

    from shardattn.serving import RayRankPool

    torn: list[bool] = []

    class Decoder:
        def teardown(self) -> None:
            torn.append(True)

    pool = RayRankPool.__new__(RayRankPool)  # the state shutdown() reads, without Ray
    pool._step_lock, pool._decoder, pool._actors = threading.Lock(), Decoder(), []
    pool._broken, pool._pg, pool._owns_ray = None, None, False
    with pool._step_lock:  # a step runs
        closing = threading.Thread(target=pool.shutdown)
        closing.start()
        closing.join(0.2)
        assert closing.is_alive() and torn == []
    closing.join(10)
    assert not closing.is_alive() and torn == [True]
    with pytest.raises(RuntimeError, match="the pool is shut down"):
        pool.restart()


@needs_ray
def test_shm_falls_back_to_the_compiled_graph_off_host(ray_instance, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank on another node than the driver: the pool warns, decodes through the compiled graph,
    and leaves no region behind."""
    from shardattn.serving import transport
    from shardattn.testing.serving import ServingMirror

    before = helpers.region_paths()
    real = transport.check_local
    monkeypatch.setattr(transport, "check_local", lambda built, node: real(built, "elsewhere"))
    with pytest.warns(RuntimeWarning, match=r"ranks \[0, 1\] run on another node than the driver"):
        pool = helpers.pool(2, MLA, max_requests=2, max_seq_len=32)
    with pool:
        assert pool.transport == "compiled" and helpers.region_paths() == before
        mirror = ServingMirror(MLA, seed=9)
        pool.prefill([mirror.prefill_request("a", 7, attend=False)])
        reqs = [mirror.decode_request("a", 2)]
        helpers.check(pool.decode(reqs, return_lse=True), reqs, mirror)


def test_the_driver_side_of_a_step_runs_on_one_torch_thread_and_restores_the_count() -> None:
    from shardattn.serving.requests import one_host_thread

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with one_host_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with one_host_thread(3):  # a GPU pool's host_threads
            assert torch.get_num_threads() == 3
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError, match="inside"), one_host_thread():
            raise RuntimeError("inside")
        assert torch.get_num_threads() == 2  # restored on the error path too
    finally:
        torch.set_num_threads(before)
