"""A Ray pool whose driver is interrupted (``KeyboardInterrupt``) while it waits for the ranks of a
shared-memory decode step or of a prefill step: the interrupt is raised as it is and the pool is
broken, as by a failed step (the ranks may still read and write the step's rows), until restart;
one before the ranks were sent the step leaves the ledger as it was. One Ray instance per module."""

from __future__ import annotations

import pytest
import torch

from tests import ray_pool_helpers as helpers

ray_instance = helpers.ray_instance  # the module's Ray (a fixture)


@helpers.needs_ray
def test_an_interrupt_while_ranks_run_a_shm_step_breaks_the_pool_until_restart(
    ray_instance, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardattn.serving import RankFailedError
    from shardattn.serving.shm_steps import ShmSteps
    from shardattn.testing.serving import ServingMirror

    with helpers.pool(2, helpers.MLA, max_requests=4, max_seq_len=48, num_pages=16) as pool:
        assert pool.transport == "shm"
        mirror = ServingMirror(helpers.MLA, seed=21)
        pool.prefill([mirror.prefill_request(i, n, attend=False) for i, n in ((1, 9), (2, 13))])
        reqs = [mirror.decode_request(i, append=False) for i in (1, 2)]
        q = torch.cat([r.q for r in reqs])
        topk = torch.cat([r.topk_pos for r in reqs])
        ids = torch.tensor([1, 2])

        def interrupted(self, timeout_s, pending=None):  # Ctrl-C in the driver's poll(2) wait
            raise KeyboardInterrupt

        with monkeypatch.context() as m:
            m.setattr(ShmSteps, "_wait", interrupted)
            with pytest.raises(KeyboardInterrupt):
                pool.decode_batch(ids, q, topk)
        # the next call must not start a step over the ranks that may still run the interrupted one
        with pytest.raises(RankFailedError, match=r"interrupted \(KeyboardInterrupt\) while ranks \[0, 1\]") as info:
            pool.decode_batch(ids, q, topk)
        with pytest.raises(RankFailedError) as again:
            pool.free([1])
        assert again.value is info.value and info.value.operation == "decode"
        assert pool.health()["state"] == "broken" and pool._decoder is None
        assert sorted(pool.restart()) == [1, 2]
        mirror = ServingMirror(helpers.MLA, seed=22)
        reqs = [mirror.prefill_request(5, 7, attend=False)]
        pool.prefill(reqs)
        reqs = [mirror.decode_request(5)]
        helpers.check(pool.decode(reqs, return_lse=True), reqs, mirror)


@helpers.needs_ray
def test_an_interrupted_prefill_leaves_no_unwritten_tokens_and_never_runs_beside_a_step(
    ray_instance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupt before the prefill reached the ranks kept its tokens in the ledger (a request
    admitted on pages no rank wrote: its decode read whatever lay there); one while the ranks ran
    it left the pool usable, so the next shared-memory decode ran beside the prefill on the ranks
    (a rank died in the two steps' collectives, blamed on the decode). The ledger is as it was,
    and the pool is broken, naming the interrupt, until restart."""
    import ray

    from shardattn.serving import RankFailedError
    from shardattn.testing.serving import ServingMirror

    with helpers.pool(2, helpers.MLA, max_requests=4, max_seq_len=48, num_pages=16) as pool:
        mirror = ServingMirror(helpers.MLA, seed=23)
        pool.prefill([mirror.prefill_request("a", 9, attend=False)])
        pages = pool.book.free_pages
        with monkeypatch.context() as m:
            m.setattr(ray, "put", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
            with pytest.raises(KeyboardInterrupt):
                pool.prefill([mirror.prefill_request("a", 4), mirror.prefill_request("c", 5)])
        assert pool.book.request_ids == ["a"] and pool.book.seq_len("a") == 9 and pool.book.free_pages == pages
        assert not pool.broken
        mirror.requests["a"].kv = [x[:9] for x in mirror.requests["a"].kv]  # the chunk never reached the ranks
        ra = mirror.decode_request("a")
        helpers.check(pool.decode([ra], return_lse=True), [ra], mirror)

        pool.arm_fault(1, "hang", "prefill")  # rank 1 still runs the next prefill when the driver is interrupted
        with monkeypatch.context() as m:
            m.setattr(ray, "wait", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
            with pytest.raises(KeyboardInterrupt):
                pool.prefill([mirror.prefill_request("a", 6)])
        interrupted = r"interrupted \(KeyboardInterrupt\) while ranks \[0, 1\] ran the step"
        with pytest.raises(RankFailedError, match=interrupted) as info:
            pool.decode([mirror.decode_request("a", append=False)])
        assert info.value.operation == "prefill" and pool.health()["state"] == "broken"
        assert pool.restart() == ["a"]
        mirror = ServingMirror(helpers.MLA, seed=24)
        reqs = [mirror.prefill_request("a", 11)]
        helpers.check(pool.prefill(reqs, return_lse=True), reqs, mirror)
        reqs = [mirror.decode_request("a")]
        helpers.check(pool.decode(reqs, return_lse=True), reqs, mirror)


@helpers.needs_ray
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # Ray's graph, its actors killed
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_interrupt_while_ranks_run_a_compiled_graph_step_breaks_the_pool(
    ray_instance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compiled-graph decode step the driver left (``KeyboardInterrupt`` in its wait) took its
    tokens back and left the pool usable while the ranks still ran it, so the next prefill (an
    actor call, which the actors serve beside the graph) ran beside it: the pool is broken, naming
    the interrupt, until restart."""
    import ray

    from shardattn.serving import RankFailedError
    from shardattn.testing.serving import ServingMirror

    with helpers.pool(2, helpers.MLA, max_requests=4, max_seq_len=48, num_pages=16, transport="compiled") as pool:
        assert pool.transport == "compiled"
        mirror = ServingMirror(helpers.MLA, seed=25)
        pool.prefill([mirror.prefill_request("a", 9, attend=False)])
        pool.arm_fault(1, "hang", "decode")  # rank 1 still runs the step when the driver is interrupted
        get = ray.get

        def interrupted(*args, **kwargs):  # Ctrl-C in the driver's wait for the graph's outputs
            if "timeout" in kwargs:
                raise KeyboardInterrupt
            return get(*args, **kwargs)

        with monkeypatch.context() as m:
            m.setattr(ray, "get", interrupted)
            with pytest.raises(KeyboardInterrupt):
                pool.decode([mirror.decode_request("a")])
        with pytest.raises(RankFailedError, match=r"interrupted \(KeyboardInterrupt\) while ranks \[0, 1\] ran"):
            pool.prefill([mirror.prefill_request("b", 3, attend=False)])
        assert pool.health()["state"] == "broken" and pool.restart() == ["a"]
        mirror = ServingMirror(helpers.MLA, seed=26)
        pool.prefill([mirror.prefill_request("a", 7, attend=False)])
        reqs = [mirror.decode_request("a")]
        helpers.check(pool.decode(reqs, return_lse=True), reqs, mirror)
