"""A pool rank's KV-cache shard: rows written at their owners and gathered back, whole or by KV head."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardattn.plan.context import DCPLayout
from shardattn.serving.kv_cache import RankKVCache

LENS = [5, 0, 11, 1]  # tokens of each request (one with none)
PAGE = 4


def _rows(kv_heads: int) -> list[torch.Tensor]:
    """Every request's K ``[n, Hkv, 8]`` and V ``[n, Hkv, 4]`` rows, request-major (the same on every rank)."""
    gen = torch.Generator().manual_seed(3)
    n = sum(LENS)
    return [torch.randn(n, kv_heads, 8, generator=gen), torch.randn(n, kv_heads, 4, generator=gen)]


def _gather(group: dist.ProcessGroup, kv_heads: int, interleave: int, heads: list[tuple[int, int]]) -> list:
    from shardattn.parallel.comm import Comm

    comm = Comm(group)
    pages = -(-max(LENS) // PAGE)
    table = torch.arange(len(LENS) * pages, dtype=torch.int32).view(len(LENS), pages)
    cache = RankKVCache(
        [((kv_heads, 8), torch.float32), ((kv_heads, 4), torch.float32)], num_pages=len(LENS) * pages,
        page_size=PAGE, layout=DCPLayout(comm.world_size, interleave), rank=comm.rank, device=torch.device("cpu"),
    )  # fmt: skip
    cache.write(table, [0] * len(LENS), LENS, _rows(kv_heads))
    results = []
    for i in range(2):
        whole = cache.gather_full(table, LENS, comm, i)
        comm.reset_counts()
        mine = cache.gather_full(table, LENS, comm, i, rank_heads=heads)
        results.append((whole, mine, dict(comm.counts)))
    return results


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("world_size", "kv_heads", "interleave", "heads"),
    [
        (2, 2, 1, [(0, 1), (1, 2)]),  # a KV head a rank: one all-to-all
        (3, 6, 2, [(0, 2), (2, 4), (4, 6)]),
        (4, 2, 1, [(0, 1), (0, 1), (1, 2), (1, 2)]),  # fewer KV heads than ranks: each kept by two
        (3, 4, 1, [(1, 3), (0, 4), (3, 4)]),  # uneven ranges
        (2, 3, 2, [(0, 3), (0, 3)]),  # every rank every head: the all-gather
        (1, 2, 1, [(1, 2)]),  # one rank: its cache read in place
    ],
    ids=["2-a-head-each", "3-I2", "4-replicated", "3-uneven", "2-all-heads", "1-rank"],
)
def test_gather_full_returns_global_rows_and_each_ranks_heads(
    dist_pool, world_size: int, kv_heads: int, interleave: int, heads: list[tuple[int, int]]
) -> None:
    results = dist_pool.run(_gather, kv_heads, interleave, heads, world_size=world_size)
    expect = [part.split(LENS) for part in _rows(kv_heads)]
    for r, per_component in enumerate(results):
        lo, hi = heads[r]
        for i, (whole, mine, counts) in enumerate(per_component):
            # each rank's heads alone: one all-to-all where they differ, the all-gather where not
            assert counts == (
                {} if world_size == 1 else {"all_gather": 1} if len(set(heads)) == 1 else {"all_to_all": 1}
            )
            assert [tuple(x.shape) for x in mine] == [(n, hi - lo, 8 if i == 0 else 4) for n in LENS]
            for b in range(len(LENS)):
                torch.testing.assert_close(whole[b], expect[i][b], rtol=0, atol=0)
                torch.testing.assert_close(mine[b], expect[i][b][:, lo:hi], rtol=0, atol=0)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("page", [-1, 3], ids=["unset-page", "page-past-cache"])
def test_write_refuses_a_table_page_outside_the_cache_before_writing(fp8: bool, page: int) -> None:
    """A block table naming a page the cache does not have: the FP8 cache's write skipped the row
    (``write_kv`` skips slots outside the cache) and the dense one failed inside ``index_copy_``."""
    row = ((656,), torch.uint8) if fp8 else ((576,), torch.bfloat16)
    cache = RankKVCache([row], num_pages=3, page_size=PAGE, layout=DCPLayout(1), rank=0, device=torch.device("cpu"))
    table = torch.tensor([[0, page], [1, 2]], dtype=torch.int32)
    rows = torch.randn(10, 576, generator=torch.Generator().manual_seed(5)).bfloat16()
    match = rf"^table names page {page} for position 4 of request 0, outside this rank's 3 pages"
    with pytest.raises(ValueError, match=match):
        cache.write(table, [0, 0], [6, 4], [rows])
    assert not cache.pages[0].any()  # nothing written, the rows of valid pages included
    cache.write(table, [0, 0], [4, 4], [rows[:8]])  # the pages it has: stored
    stored = cache.pages[0][[0, 1]].flatten(0, 1)
    if fp8:
        from shardattn.ops.kv_fp8 import quantize_kv

        assert torch.equal(stored, quantize_kv(rows[:8]))
    else:
        assert torch.equal(stored, rows[:8])
