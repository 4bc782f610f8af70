"""Bad requests and arguments to the Ray pool raise on the driver before any rank runs, naming the
argument (unknown or repeated ids, lengths over the limits, wrong dtypes and shapes of queries, top-k
positions, KV rows, query lengths and outputs, bad fault drills); the ledger, the ranks' step counts
and the cache are as they were and the pool serves on. The checks take every integer id dtype the
ledger takes, and refuse query lengths whose sum wraps. One Ray instance per module."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests import ray_pool_helpers as helpers
from tests.ray_pool_helpers import MLA, needs_ray

ray_instance = helpers.ray_instance  # the module's Ray (a fixture)
pool2 = helpers.pool2  # the module's two-rank pool (a fixture)


@needs_ray
def test_bad_requests_raise_before_any_rank_runs(pool2, monkeypatch) -> None:
    from shardattn.serving import DecodeRequest, PrefillRequest
    from shardattn.testing.serving import ServingMirror

    mirror = ServingMirror(MLA, seed=3)
    good = mirror.prefill_request("x", 9)
    helpers.check(pool2.prefill([good], return_lse=True), [good], mirror)
    steps_before = [r["steps"] for r in pool2.health()["ranks"]]
    free_before = pool2.book.free_pages
    q1 = mirror.decode_request("x", append=False).q
    topk1 = torch.zeros(1, 16, dtype=torch.int32)
    kv1 = torch.zeros(1, 48)
    cases = [
        (lambda: pool2.decode([DecodeRequest("nope", q=q1, topk_pos=topk1)]), ValueError, "unknown request id 'nope'"),
        (lambda: pool2.prefill([PrefillRequest("x", kv=torch.zeros(40, 48))]), ValueError, "exceed max_seq_len=48"),
        (
            lambda: pool2.prefill([PrefillRequest(i, kv=torch.zeros(40, 48)) for i in "pqr"]),
            ValueError,
            "out of KV pages",
        ),
        (
            lambda: pool2.prefill([PrefillRequest(i, kv=torch.zeros(1, 48)) for i in "pqrs"]),
            ValueError,
            "over max_requests=4",
        ),
        (lambda: pool2.decode([DecodeRequest("x", q=q1.double(), topk_pos=topk1)]), TypeError, "q must have dtype"),
        (
            lambda: pool2.decode([DecodeRequest("x", q=q1[:, :4], topk_pos=topk1)]),
            ValueError,
            r"q must have shape \[\*, 8, 48\]",
        ),
        (
            lambda: pool2.decode([DecodeRequest("x", q=q1, topk_pos=topk1.float())]),
            TypeError,
            "topk_pos must have dtype",
        ),
        (
            lambda: pool2.decode([DecodeRequest("x", q=q1, topk_pos=topk1[:, :8])]),
            ValueError,
            r"topk_pos must have shape",
        ),
        (lambda: pool2.decode([DecodeRequest("x", q=q1, topk_pos=None)]), ValueError, "needs topk_pos"),
        (
            lambda: pool2.decode([DecodeRequest("x", q=q1, topk_pos=topk1, kv=kv1[:, :8])]),
            ValueError,
            "kv must have shape",
        ),
        (
            lambda: pool2.decode([DecodeRequest("x", q=q1, topk_pos=topk1), DecodeRequest("x", q=q1, topk_pos=topk1)]),
            ValueError,
            "appears twice",
        ),
        (lambda: pool2.decode(DecodeRequest("x", q=q1, topk_pos=topk1)), TypeError, "takes a list of DecodeRequest"),
        (lambda: pool2.free(["x", "nope"]), ValueError, "unknown request id 'nope'"),
        (lambda: pool2.free("x"), TypeError, "request_ids must be a sequence of ids, got str 'x'"),
        (lambda: pool2.free(7), TypeError, "^request_ids must be a sequence of ids, got int 7"),
        (lambda: pool2.free(torch.tensor([7])), ValueError, r"^unknown request id 7 \(never prefilled"),
        (
            lambda: pool2.decode_batch(np.array([2**64 - 1], dtype=np.uint64), q1, topk1),
            ValueError,
            r"^request_ids must be below 2\*\*63",  # it wrapped onto request -1
        ),
        (lambda: pool2.free(["x" * 10**6]), ValueError, r"^unknown request id 'x{10,}\.\.\.x+' \(never prefilled"),
        (lambda: pool2.decode([DecodeRequest("x", q=q1, topk_pos=topk1)], return_lse="no"), TypeError, "return_lse"),
        (
            lambda: pool2.decode_batch(["x"], q1, topk1, kv=kv1, return_lse=None),
            TypeError,
            "^return_lse must be a bool",
        ),
        (lambda: pool2.prefill([good], return_lse=1), TypeError, "^return_lse must be a bool"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
    assert pool2.book.free_pages == free_before and list(pool2.book.request_ids) == ["x"]
    # a step that fails on the driver after its checks, before any rank runs (say, its inputs overlap
    # the shared-memory rows they are copied to): the ledger is as before, no token was added
    import shardattn.serving.decode_steps as steps_mod

    def fails_on_the_driver(*args, **kwargs):
        raise RuntimeError("unsupported operation: some elements of the input tensor overlap")

    length = pool2.book.seq_len("x")
    monkeypatch.setattr(steps_mod, "decode_on_ranks", fails_on_the_driver)
    with pytest.raises(RuntimeError, match="overlap"):
        pool2.decode_batch(["x"], q1, topk1, kv=kv1)
    monkeypatch.undo()
    assert pool2.book.seq_len("x") == length and pool2.book.free_pages == free_before and not pool2.broken
    health = pool2.health()
    assert health["state"] == "healthy" and [r["steps"] for r in health["ranks"]] == steps_before
    reqs = [mirror.decode_request("x")]  # still serving, with the request's KV intact
    helpers.check(pool2.decode(reqs, return_lse=True), reqs, mirror)
    pool2.free(["x"])


@needs_ray
def test_bad_decode_batch_raises_naming_the_argument(pool2) -> None:
    """Bad whole-step tensors raise before any rank runs, naming the argument; the pool stays healthy."""
    from shardattn.testing.serving import ServingMirror

    mirror = ServingMirror(MLA, seed=13)
    pool2.prefill([mirror.prefill_request(i, n, attend=False) for i, n in ((5, 9), (6, 47))])
    steps_before = [r["steps"] for r in pool2.health()["ranks"]]
    free_before, lens_before = pool2.book.free_pages, (pool2.book.seq_len(5), pool2.book.seq_len(6))
    reqs = [mirror.decode_request(i, append=False) for i in (5, 6)]
    q, topk, _, _ = helpers.batch(reqs)
    ids = torch.tensor([5, 6])
    kv2 = torch.zeros(2, 48)
    cases = [
        (lambda: pool2.decode_batch(ids, q.double(), topk), TypeError, "q must have dtype"),
        (lambda: pool2.decode_batch(ids, q[:, :4], topk), ValueError, r"q must have shape \[\*, 8, 48\]"),
        (lambda: pool2.decode_batch(ids, q[:1], topk[:1]), ValueError, r"q must have one row per request \(2\)"),
        (lambda: pool2.decode_batch(ids, q, topk.float()), TypeError, "topk_pos must have dtype"),
        (lambda: pool2.decode_batch(ids, q, topk[:, :8]), ValueError, "topk_pos must have shape"),
        (lambda: pool2.decode_batch(ids, q, None), ValueError, "topk_pos must be given"),
        (lambda: pool2.decode_batch(ids, q, topk, kv=kv2[:, :8]), ValueError, "kv must have shape"),
        (lambda: pool2.decode_batch(ids.float(), q, topk), TypeError, "request_ids must have dtype"),
        (lambda: pool2.decode_batch(ids[None], q, topk), ValueError, "request_ids must be 1-D"),
        (lambda: pool2.decode_batch(ids[:0], q[:0], topk[:0]), ValueError, "request_ids must name at least one"),
        (
            lambda: pool2.decode_batch(torch.tensor([5, 99]), q, topk),
            ValueError,
            r"request_ids\[1\]: unknown request id 99",
        ),
        (lambda: pool2.decode_batch(["x", 5], q, topk), ValueError, r"request_ids\[0\]: unknown request id 'x'"),
        (
            lambda: pool2.decode_batch(torch.tensor([5, 5]), q, topk),
            ValueError,
            r"request_ids\[1\]: request 5 appears twice",
        ),
        (
            lambda: pool2.decode_batch(
                torch.tensor([6, 5]), q.repeat(2, 1, 1), topk.repeat(2, 1), query_lens=[2, 2], kv=torch.zeros(4, 48)
            ),
            ValueError,
            r"request_ids\[0\]: request 6: 49 tokens would exceed max_seq_len=48",
        ),
        (
            lambda: pool2.decode_batch(ids, q, topk, query_lens=torch.tensor([1, 0])),
            ValueError,
            "query_lens must be >= 1",
        ),
        (lambda: pool2.decode_batch(ids, q, topk, query_lens=[1.0, 1.0]), TypeError, "query_lens must hold integers"),
        (
            lambda: pool2.decode_batch(ids, q, topk, query_lens=torch.tensor([1, 2])),
            ValueError,
            r"q must have sum\(query_lens\)=3 rows, got 2",
        ),
        (
            lambda: pool2.decode_batch(ids, q, topk, query_lens=torch.tensor([2])),
            ValueError,
            r"query_lens must have shape \[2\]",
        ),
        (
            lambda: pool2.decode_batch(ids, q.repeat(9, 1, 1), topk.repeat(9, 1), query_lens=[9, 9]),
            ValueError,
            "over the pool's max_decode_tokens=16",
        ),
        (lambda: pool2.decode_batch(ids, q, topk, out=torch.empty(2, 8, 16)), ValueError, "out must have shape"),
        (lambda: pool2.decode_batch("ab", q, topk), TypeError, "request_ids must be"),
        (lambda: pool2.decode_batch(ids, q, topk, view=1), TypeError, "view must be a bool"),
        (lambda: pool2.decode_batch(ids, q, topk, view=True, out=torch.empty(2, 8, 32)), ValueError, "takes no out"),
        (lambda: pool2.step_inputs(0), ValueError, "num_tokens must be"),
        (lambda: pool2.step_inputs(17), ValueError, "num_tokens=17 is over the pool's max_decode_tokens=16"),
        # a fault drill's bad arguments: refused on the driver (a rank's ValueError broke the pool)
        (lambda: pool2.arm_fault(1, "bogus"), ValueError, "kind must be one of"),
        (lambda: pool2.arm_fault(1, "raise", "free"), ValueError, "operation must be one of"),
        (lambda: pool2.arm_fault(5), ValueError, "rank must be <= 1, got 5"),
        (lambda: pool2.arm_fault(True), TypeError, "rank must be an int"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
    assert pool2.book.free_pages == free_before and (pool2.book.seq_len(5), pool2.book.seq_len(6)) == lens_before
    health = pool2.health()
    assert health["state"] == "healthy" and [r["steps"] for r in health["ranks"]] == steps_before
    out, lse = pool2.decode_batch(ids, q, topk, return_lse=True)  # still serving, the KV intact
    helpers.check(list(zip(out.split(1), lse.split(1))), reqs, mirror)
    # int64 positions (torch.arange's) are converted on the driver: the same step, bit for bit
    assert torch.equal(pool2.decode_batch(ids, q, topk.long())[0], out)
    pool2.free([5, 6])


def test_query_lens_whose_sum_wraps_are_refused_naming_them() -> None:
    """Lengths whose int64 sum wraps to q's row count passed every check (the transport then failed,
    or crashed the driver): a length over q's rows is refused before the sum."""
    from shardattn.plan.context import DCPLayout
    from shardattn.plan.kv_cache_config import KVCacheConfig
    from shardattn.plan.kv_pages import PagedKVBook
    from shardattn.serving.pool_shapes import pool_shapes
    from shardattn.serving.requests import check_decode_batch

    shapes = pool_shapes(MLA, "mixed", {"max_batched_tokens": 64, "max_decode_tokens": 16})
    book = PagedKVBook(KVCacheConfig(4, DCPLayout(2), 8, 48))
    book.grow([(i, 5) for i in range(4)])
    lens = np.array([2**62, 2**62, 2**62, 2**62 + 1], dtype=np.int64)  # their int64 sum: 1
    q, topk = torch.zeros(1, 8, 48), torch.zeros(1, 16, dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"^query_lens\[3\]={2**62 + 1} is more than q's 1 rows"):
        check_decode_batch(shapes, book, torch.arange(4), q, topk, query_lens=lens)
    assert book.lens[:4].tolist() == [5, 5, 5, 5]


def test_decode_batch_takes_the_id_dtypes_the_ledger_and_free_take() -> None:
    """One rule for integer id tensors: decode_batch's check takes every dtype the ledger (and so
    the pool's free) looks ids up in, and refuses the others naming request_ids."""
    from shardattn.plan.context import DCPLayout
    from shardattn.plan.kv_cache_config import KVCacheConfig
    from shardattn.plan.kv_pages import ID_DTYPES, PagedKVBook
    from shardattn.serving.pool_shapes import pool_shapes
    from shardattn.serving.requests import check_decode_batch

    shapes = pool_shapes(MLA, "mixed", {"max_batched_tokens": 64, "max_decode_tokens": 16})
    book = PagedKVBook(KVCacheConfig(4, DCPLayout(2), 8, 48))
    book.grow([(i, 5) for i in range(4)])
    q, topk = torch.zeros(2, 8, 48), torch.zeros(2, 16, dtype=torch.int32)
    for dtype in ID_DTYPES:
        ids = torch.tensor([2, 1], dtype=dtype)
        assert book.ids_of(ids) == [2, 1]
        batch = check_decode_batch(shapes, book, ids, q, topk)
        assert batch.slots.tolist() == book.slots(ids).tolist()
    for dtype in (torch.float32, torch.bool, torch.uint16):
        with pytest.raises(TypeError, match=r"^request_ids must have dtype in \(int8, int16, int32, int64, uint8\)"):
            check_decode_batch(shapes, book, torch.tensor([2, 1]).to(dtype), q, topk)
        with pytest.raises(TypeError, match=r"^request_ids must have dtype in \(int8, int16, int32, int64, uint8\)"):
            book.ids_of(torch.tensor([2, 1]).to(dtype))


def test_a_step_mixing_requests_with_and_without_q_or_kv_names_one_of_each() -> None:
    """A prefill step where some requests attend and others only write KV, or a decode step where
    some write KV and others do not, is refused naming a request of each kind (the message named
    none)."""
    from shardattn.plan.context import DCPLayout
    from shardattn.plan.kv_cache_config import KVCacheConfig
    from shardattn.plan.kv_pages import PagedKVBook
    from shardattn.serving.pool_shapes import pool_shapes
    from shardattn.serving.requests import DecodeRequest, PrefillRequest, pack_step

    shapes = pool_shapes(MLA, "mixed", {"max_batched_tokens": 64, "max_decode_tokens": 16})
    book = PagedKVBook(KVCacheConfig(4, DCPLayout(2), 8, 48))

    def q(n: int) -> torch.Tensor:
        return torch.zeros(n, 8, 48)

    def topk(n: int) -> torch.Tensor:
        return torch.zeros(n, 16, dtype=torch.int32)

    step = [PrefillRequest("a", torch.zeros(2, 48)), PrefillRequest("b", torch.zeros(3, 48), q(3), topk(3))]
    with pytest.raises(ValueError, match=r"or for none: request 'b' gives q, request 'a' none$"):
        pack_step("prefill", step, shapes, book)
    book.grow([("a", 5), ("b", 5)])
    step = [DecodeRequest("a", q(1), topk(1), torch.zeros(1, 48)), DecodeRequest("b", q(1), topk(1))]
    with pytest.raises(ValueError, match=r"or for none: request 'a' gives kv, request 'b' none$"):
        pack_step("decode", step, shapes, book)
    assert book.lens[:2].tolist() == [5, 5]
