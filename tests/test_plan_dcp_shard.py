"""``shard_kv_cache``: a rank's DCP shard of a whole paged cache, checked position by position
against the layout's contract (written out here, not read from the library), and refused inputs."""

from __future__ import annotations

import pytest
import torch

from shardattn.plan import DCPLayout, shard_kv_cache


def _whole(lens: list[int], page: int, row: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole cache of shuffled pages, ``[pages * page, *row]`` values, and its ``[B, M]`` int32 table."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // page) for n in lens]
    order = torch.randperm(sum(need) + 3, generator=g)  # spare pages nobody owns
    table = torch.full((len(lens), max(need) + 1), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = order[used : used + n].to(torch.int32)
        used += n
    return torch.randn((sum(need) + 3) * page, *row, generator=g), table


@pytest.mark.parametrize(
    ("world", "interleave", "page", "lens"),
    [(2, 1, 4, [9, 0, 13]), (4, 2, 4, [30, 1, 7]), (3, 4, 8, [50, 24]), (1, 1, 4, [5])],
    ids=["w2", "w4-i2", "w3-i4-page8", "one-rank"],
)
@pytest.mark.parametrize("paged", [False, True], ids=["rows", "gqa-pages"])
def test_every_owned_token_lands_at_its_local_index(world: int, interleave: int, page: int, lens, paged: bool) -> None:
    rows, table = _whole(lens, page, (3, 2) if paged else (6,), seed=world * 10 + interleave)
    layout = DCPLayout(world, interleave)
    covered = [set() for _ in lens]
    for r in range(world):
        if paged:
            cache = (rows.view(-1, page, 3, 2), (rows * 2).view(-1, page, 3, 2))
            (k, v), local = shard_kv_cache(cache, table, lens, layout, r)
            assert k.shape[1:] == (page, 3, 2) and torch.equal(v, 2 * k)
            shard = k.reshape(-1, 3, 2)
        else:
            shard, local = shard_kv_cache(rows, table, torch.tensor(lens), layout, r, page_size=page)
        assert local.dtype == torch.int32 and local.shape[0] == len(lens)
        pages_used = []
        for b, n in enumerate(lens):
            # the contract: token t lives on rank (t // I) % W at local index (t // (W*I)) * I + t % I
            mine = [t for t in range(n) if (t // interleave) % world == r]
            for t in mine:
                j = (t // (world * interleave)) * interleave + t % interleave
                got = shard[int(local[b, j // page]) * page + j % page]
                want = rows[int(table[b, t // page]) * page + t % page]
                assert torch.equal(got, want), (r, b, t)
                covered[b].add(t)
            n_pages = -(-len(mine) // page)
            assert (local[b, n_pages:] == -1).all(), (r, b, local[b])
            pages_used += local[b, :n_pages].tolist()
        assert sorted(pages_used) == list(range(len(pages_used))), "fresh pages, each used once"
        assert shard.shape[0] == len(pages_used) * page
    assert covered == [set(range(n)) for n in lens], "the ranks together hold every token once"


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(page_size=None), ValueError, "page_size is required"),
        (dict(seq_lens=[9, 24]), ValueError, r"seq_lens\[1\]=24 needs 6 pages, past block_table's 5"),
        (dict(seq_lens=[9, 20]), ValueError, r"block_table\[1\] names a page outside the cache's 10"),
        (dict(seq_lens=[9]), ValueError, "seq_lens must have 2 entries"),
        (dict(rank=2), ValueError, "rank must be < the layout's world_size=2"),
        (dict(layout=2), TypeError, "layout must be a DCPLayout"),
        (dict(block_table=torch.zeros(2, 4)), TypeError, "block_table must have dtype"),
        (dict(kv_cache=torch.zeros(10, 6)), ValueError, "whole pages of 4 rows"),
        (dict(kv_cache=(torch.zeros(3, 4, 1, 2),) * 3), TypeError, r"\(k_cache, v_cache\) pair"),
        (dict(kv_cache=torch.zeros(3, 0, 2)), ValueError, r"^kv_cache must have pages of >= 1 rows"),
        (dict(kv_cache=(torch.zeros(3, 0, 1, 2),) * 2), ValueError, r"^kv_cache\[0\] must have pages of >= 1 rows"),
        (dict(kv_cache=torch.zeros(10, 4, 1, 6), page_size=True), TypeError, r"^page_size must be an int, got bool"),
        (dict(kv_cache=torch.zeros(10, 1, 1, 6), page_size=True), TypeError, r"^page_size must be an int, got bool"),
        (dict(kv_cache=torch.zeros(10, 4, 1, 6), page_size=4.0), TypeError, r"^page_size must be an int, got float"),
    ],
    ids=[
        "no-page-size",
        "past-table",
        "page-minus-one",
        "lens-count",
        "rank",
        "layout",
        "table-float",
        "partial-page",
        "triple",
        "pages-of-0-rows",
        "pair-pages-of-0-rows",
        "page-size-bool",
        "page-size-true-for-pages-of-1",
        "page-size-float",
    ],
)
def test_bad_arguments_name_themselves(kwargs: dict, exc: type, match: str) -> None:
    rows, table = _whole([9, 13], 4, (6,), seed=1)
    args = dict(kv_cache=rows, block_table=table, seq_lens=[9, 13], layout=DCPLayout(2), rank=1, page_size=4)
    args.update(kwargs)
    page_size = args.pop("page_size")
    with pytest.raises(exc, match=match):
        shard_kv_cache(**args, page_size=page_size)
