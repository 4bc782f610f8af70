"""The Ray pool's whole-step entry ``decode_batch``: it equals ``decode(requests)`` bit for bit and
fp64 attention, with inputs written in place into the pool's staging rows (``step_inputs()``, sub-
batches of later rows included) and outputs taken as views of the shared-memory region; staging
views that another step wrote over are refused naming the input, a step refused for its ``out``
leaves them valid, and a prefill that failed on the driver leaves the ledger as it was. Steps from
two threads run one at a time. One Ray instance per module."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests import ray_pool_helpers as helpers
from tests.ray_pool_helpers import ATOL, MLA, needs_ray

ray_instance = helpers.ray_instance  # the module's Ray (a fixture)
pool2 = helpers.pool2  # the module's two-rank pool (a fixture)


def test_stale_staging_rows_and_a_prefill_failed_on_the_driver_leave_nothing_wrong(pool2) -> None:
    """``step_inputs()`` rows written over by another step (another thread's, or ``decode``'s
    requests) were attended silently (an error of 0.65): such views are refused until taken again.
    A prefill that failed on the driver after the ledger grew kept its tokens (the next decode read
    rows no rank wrote, an error of 0.27): the ledger is as it was."""
    from unittest import mock

    from shardattn.serving import DecodeRequest, PrefillRequest
    from shardattn.testing.serving import ServingMirror

    mirror = ServingMirror(MLA, seed=12)
    pool2.prefill([mirror.prefill_request("a", 9, attend=False), mirror.prefill_request("b", 6, attend=False)])
    ra, rb = mirror.decode_request("a", append=False), mirror.decode_request("b", append=False)
    for other_step in (lambda: pool2.decode_batch(["b"], rb.q, rb.topk_pos), lambda: pool2.decode([rb])):
        staged = pool2.step_inputs(1)
        staged["q"].copy_(ra.q)
        staged["topk_pos"].copy_(ra.topk_pos)
        other_step()
        with pytest.raises(ValueError, match=r"^q is the pool's staging rows \(step_inputs\(\)\), but a step"):
            pool2.decode_batch(["a"], staged["q"], staged["topk_pos"])
    staged = pool2.step_inputs(1)  # taken again: the step runs
    staged["q"].copy_(ra.q)
    staged["topk_pos"].copy_(ra.topk_pos)
    helpers.check([pool2.decode_batch(["a"], staged["q"], staged["topk_pos"], return_lse=True)], [ra], mirror)
    on_rows = DecodeRequest("a", q=staged["q"], topk_pos=staged["topk_pos"])  # a request built on those rows
    helpers.check(pool2.decode([on_rows], return_lse=True), [ra], mirror)  # raised torch's aliasing error

    pages, lens = pool2.book.free_pages, (pool2.book.seq_len("a"), pool2.book.seq_len("b"))
    chunk = [PrefillRequest("a", kv=torch.zeros(4, MLA.head_dim)), PrefillRequest("c", kv=torch.zeros(3, MLA.head_dim))]
    with mock.patch("ray.put", side_effect=RuntimeError("object store full")), pytest.raises(RuntimeError):
        pool2.prefill(chunk)
    assert not pool2.broken and "c" not in pool2.book and pool2.book.free_pages == pages
    assert (pool2.book.seq_len("a"), pool2.book.seq_len("b")) == lens
    ra = mirror.decode_request("a")
    helpers.check(pool2.decode([ra], return_lse=True), [ra], mirror)
    pool2.free(["a", "b"])


@needs_ray
def test_stale_top_k_and_kv_staging_views_are_refused_naming_them(pool2) -> None:
    """Fresh queries with top-k positions or KV rows from ``step_inputs()`` that another step wrote
    over: the step attended the other request's positions (an error of 0.79), or wrote its KV row
    into the cache for good. Every staged input is checked: refused, naming it (decode()'s request
    objects too); nothing changes."""
    from shardattn.serving import DecodeRequest
    from shardattn.testing.serving import ServingMirror

    mirror = ServingMirror(MLA, seed=12)
    pool2.prefill([mirror.prefill_request("a", 9, attend=False), mirror.prefill_request("b", 6, attend=False)])
    ra = mirror.decode_request("a", append=False)
    staged = pool2.step_inputs(1)
    staged["topk_pos"].copy_(ra.topk_pos)
    staged["kv"].copy_(torch.randn(1, MLA.head_dim))
    rb = mirror.decode_request("b")  # its query, top-k and KV row go over the staging rows
    helpers.check(pool2.decode([rb], return_lse=True), [rb], mirror)
    stale = r" is the pool's staging rows \(step_inputs\(\)\), but a step has written other inputs over them"
    with pytest.raises(ValueError, match="^topk_pos" + stale):
        pool2.decode_batch(["a"], ra.q.clone(), staged["topk_pos"])
    with pytest.raises(ValueError, match="^kv" + stale):
        pool2.decode_batch(["a"], ra.q.clone(), ra.topk_pos.clone(), kv=staged["kv"])
    stale_request = DecodeRequest("a", ra.q.clone(), staged["topk_pos"])  # as decode()'s request objects
    with pytest.raises(ValueError, match=r"^requests\[0\]\.topk_pos" + stale):
        pool2.decode([stale_request])
    assert pool2.book.seq_len("a") == 9 and not pool2.broken
    helpers.check([pool2.decode_batch(["a"], ra.q, ra.topk_pos, return_lse=True)], [ra], mirror)  # a's cache as it was
    pool2.free(["a", "b"])


@needs_ray
def test_decode_batch_takes_later_rows_of_the_staging_area(pool2) -> None:
    """Rows 1..3 of a staged batch of three (a sub-batch, KV rows included) raised torch's aliasing
    error: they are read before the step's inputs are written over the leading rows."""
    from shardattn.testing.serving import ServingMirror

    mirror = ServingMirror(MLA, seed=7)
    pool2.prefill([mirror.prefill_request(i, n, attend=False) for i, n in ((20, 5), (21, 6), (22, 7))])
    reqs = [mirror.decode_request(20, append=False), mirror.decode_request(21), mirror.decode_request(22)]
    staged = pool2.step_inputs(3)
    torch.cat([r.q for r in reqs], out=staged["q"])
    torch.cat([r.topk_pos for r in reqs], out=staged["topk_pos"])
    staged["kv"][0].normal_()
    torch.cat([r.kv for r in reqs[1:]], out=staged["kv"][1:])
    out, lse = pool2.decode_batch([21, 22], staged["q"][1:], staged["topk_pos"][1:], kv=staged["kv"][1:],
                                  return_lse=True)  # fmt: skip
    helpers.check(list(zip(out.split(1), lse.split(1))), reqs[1:], mirror)
    assert [pool2.book.seq_len(i) for i in (20, 21, 22)] == [5, 7, 8]
    pool2.free([20, 21, 22])


@needs_ray
def test_a_refused_out_leaves_the_staging_views_valid(pool2) -> None:
    """A step refused for its ``out`` writes nothing, but counted as a step written over the staging
    rows: this thread's valid ``step_inputs()`` views were then refused."""
    from shardattn.testing.serving import ServingMirror

    mirror = ServingMirror(MLA, seed=9)
    pool2.prefill([mirror.prefill_request("a", 9, attend=False)])
    ra = mirror.decode_request("a", append=False)
    staged = pool2.step_inputs(1)
    staged["q"].copy_(ra.q)
    staged["topk_pos"].copy_(ra.topk_pos)
    with pytest.raises(ValueError, match=r"^out must have shape \[1, 8, 32\]"):
        pool2.decode_batch(["a"], ra.q.clone(), ra.topk_pos, out=torch.empty(1, 8, 999))
    helpers.check([pool2.decode_batch(["a"], staged["q"], staged["topk_pos"], return_lse=True)], [ra], mirror)
    pool2.free(["a"])


@needs_ray
def test_steps_from_two_threads_run_one_at_a_time(pool2) -> None:
    """A service's threads may share a pool: one step runs at a time (the other thread's call waits),
    each equal to fp64 attention, and the ledger counts every token once."""
    import threading

    from shardattn.testing.serving import ServingMirror

    mirror = ServingMirror(MLA, seed=7)
    reqs = [mirror.prefill_request("t1", 6), mirror.prefill_request("t2", 5)]
    helpers.check(pool2.prefill(reqs, return_lse=True), reqs, mirror)
    plans = {rid: [] for rid in ("t1", "t2")}  # each thread's steps, their references taken as made
    for _ in range(4):
        for rid in plans:
            req = mirror.decode_request(rid)
            plans[rid].append((req, mirror.expected(req)))
    results: dict[str, list] = {rid: [] for rid in plans}

    def serve(rid: str) -> None:
        for req, _ in plans[rid]:
            q, topk, kv, _lens = helpers.batch([req])
            results[rid].append(pool2.decode_batch([rid], q, topk, kv=kv, return_lse=True))

    threads = [threading.Thread(target=serve, args=(rid,)) for rid in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for rid in plans:
        assert len(results[rid]) == 4, rid
        for (out, lse), (_req, (ref_out, ref_lse)) in zip(results[rid], plans[rid]):
            assert torch.allclose(out.double(), ref_out, atol=ATOL, rtol=0), (out.double() - ref_out).abs().max()
            fin = torch.isfinite(ref_lse)
            assert torch.allclose(lse.double()[fin], ref_lse[fin], atol=ATOL, rtol=0)
    assert pool2.book.seq_len("t1") == 10 and pool2.book.seq_len("t2") == 9 and not pool2.broken
    pool2.free(["t1", "t2"])


@needs_ray
def test_decode_batch_equals_decode_and_fp64_attention(pool2) -> None:
    """Whole-step tensors in, one output tensor out: the reference across prefill, decode (drafts,
    with and without new KV rows), free and reuse of the pages; the same step through
    decode(requests) gives the same outputs bit for bit; ids as an int64 tensor or a list."""
    from shardattn.testing.serving import ServingMirror

    mirror = ServingMirror(MLA, seed=12)
    reqs = [mirror.prefill_request(i, n) for i, n in enumerate((13, 7, 5))]
    helpers.check(pool2.prefill(reqs, return_lse=True), reqs, mirror)
    for q_lens in ((1, 1, 1), (1, 2, 1), (3, 1, 2)):
        reqs = [mirror.decode_request(i, n) for i, n in enumerate(q_lens)]
        q, topk, kv, lens = helpers.batch(reqs)
        out, lse = pool2.decode_batch(torch.tensor([0, 1, 2]), q, topk, query_lens=torch.tensor(lens), kv=kv,
                                      return_lse=True)  # fmt: skip
        assert out.shape == (sum(lens), 8, 32) and lse.shape == (sum(lens), 8)
        helpers.check(list(zip(out.split(lens), lse.split(lens))), reqs, mirror)
    reqs = [mirror.decode_request(i, n, append=False) for i, n in ((2, 1), (0, 2))]  # no new KV: repeatable
    q, topk, _, lens = helpers.batch(reqs)
    out, lse = pool2.decode_batch([2, 0], q, topk, query_lens=lens, return_lse=True)  # ids as a list
    helpers.check(list(zip(out.split(lens), lse.split(lens))), reqs, mirror)
    again = pool2.decode(reqs, return_lse=True)
    strided = q.transpose(0, 1).contiguous().transpose(0, 1)  # the same values, not contiguous
    assert torch.equal(pool2.decode_batch(torch.tensor([2, 0]), strided, topk, query_lens=torch.tensor(lens))[0], out)
    # a q that requires grad (a model run without no_grad) is read as its values, in both entries
    graded = q.clone().requires_grad_(True)
    assert torch.equal(pool2.decode_batch([2, 0], graded, topk, query_lens=lens)[0], out)
    graded_reqs = [dataclasses.replace(r, q=r.q.clone().requires_grad_(True)) for r in reqs]
    assert all(torch.equal(a, b) for a, b in zip(pool2.decode(graded_reqs), out.split(lens)))
    assert all(torch.equal(a, b) and torch.equal(c, d) for (a, c), b, d in zip(again, out.split(lens), lse.split(lens)))
    assert pool2.free([1]) > 0
    mirror.free(1)
    reqs = [mirror.prefill_request(3, 17)]  # takes request 1's pages
    helpers.check(pool2.prefill(reqs, return_lse=True), reqs, mirror)
    reqs = [mirror.decode_request(i) for i in (3, 0, 2)]
    q, topk, kv, _ = helpers.batch(reqs)
    dest = torch.full((3, 8, 32), float("nan"))
    out, lse = pool2.decode_batch(torch.tensor([3, 0, 2]), q, topk, kv=kv, out=dest)
    assert out.data_ptr() == dest.data_ptr() and lse is None
    ref = [mirror.expected(r)[0] for r in reqs]
    assert torch.allclose(out.double(), torch.cat(ref), atol=ATOL, rtol=0)
    assert pool2.last_step["kind"] == "decode" and len(pool2.last_step["timeline"]["ranks"]) == 2
    pool2.free([0, 2, 3])


@needs_ray
def test_decode_batch_in_place_inputs_and_view_outputs_equal_fp64_attention(pool2) -> None:
    """Inputs written into step_inputs() (the region's own rows under shm) and outputs taken as
    views of the region: the reference, drafts and KV rows included; the view is the region's
    (the next step overwrites it, a copy does not change); the same step with copies agrees bit
    for bit."""
    from shardattn.testing.serving import ServingMirror

    assert pool2.transport == "shm"
    mirror = ServingMirror(MLA, seed=21)
    reqs = [mirror.prefill_request(i, n) for i, n in ((10, 11), (11, 4), (12, 30))]
    helpers.check(pool2.prefill(reqs, return_lse=True), reqs, mirror)
    ids = torch.tensor([12, 10, 11])
    views = []
    for q_lens, with_kv in (((1, 1, 1), True), ((2, 1, 3), True), ((1, 3, 1), False)):
        reqs = [mirror.decode_request(int(i), n, append=with_kv) for i, n in zip(ids, q_lens)]
        q, topk, kv, lens = helpers.batch(reqs)
        slots = pool2.step_inputs(sum(lens))
        slots["q"].copy_(q)
        slots["topk_pos"].copy_(topk)
        if with_kv:
            slots["kv"].copy_(kv)
        out, lse = pool2.decode_batch(ids, slots["q"], slots["topk_pos"], query_lens=torch.tensor(lens),
                                      kv=slots["kv"] if with_kv else None, return_lse=True, view=True)  # fmt: skip
        assert out.shape == (sum(lens), 8, 32) and lse.shape == (sum(lens), 8)
        helpers.check(list(zip(out.split(lens), lse.split(lens))), reqs, mirror)
        views.append((out, out.clone()))
    assert views[0][0].data_ptr() == views[1][0].data_ptr()  # the region's rows: one buffer
    again, _ = pool2.decode_batch(ids, q, topk, query_lens=torch.tensor(lens))  # no new KV: repeatable
    assert torch.equal(again, views[-1][1]) and not torch.equal(views[0][0][:3], views[0][1])  # overwritten
    assert again.data_ptr() != views[-1][0].data_ptr()  # a copy by default
    pool2.free([10, 11, 12])
