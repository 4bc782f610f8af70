"""The inputs and check of ``benchmarks/decode_fp8_peer.py``, on the CPU: a cache past
``DENSE_MAX_ROWS`` is drawn in chunks with each token's rows a permutation's (a cache of real size
fits), and the check dequantises only the rows the top-k names, attending the keys a dequantisation
of the whole cache would."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from shardattn.ops.kv_fp8 import dequantize_kv, quantize_kv
from shardattn.ops.sparse_mla import sparse_mla_reference
from shardattn.ops.sparse_mla_decode import sparse_mla_decode

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def peer_bench():
    sys.path.insert(0, str(BENCH))
    sys.path.insert(0, str(BENCH / "peer"))
    import decode_fp8_peer

    yield decode_fp8_peer
    sys.path.remove(str(BENCH))
    sys.path.remove(str(BENCH / "peer"))


@pytest.mark.parametrize("dense", [True, False], ids=["as-recorded", "drawn-in-chunks"])
def test_a_case_holds_unique_rows_of_its_cache(peer_bench, monkeypatch, dense: bool) -> None:
    if not dense:
        monkeypatch.setattr(peer_bench, "DENSE_MAX_ROWS", 64)  # 300 rows: five chunks, a short one last
    source, cache = peer_bench.make_cache(300, 16, seed=1, device="cpu")
    q, rows, valid = peer_bench.make_queries(4, 8, 32, 300, 16, seed=1, device="cpu")
    kv = source.whole()
    assert kv.dtype == torch.bfloat16 and kv.shape == (300, 576) and bool(kv.float().abs().sum(1).gt(0).all())
    stored = cache[torch.arange(300) // 16, torch.arange(300) % 16]
    assert torch.equal(stored, quantize_kv(kv)), "the cache holds the rows, quantised"
    assert bool((cache[-1, 300 % 16 :] == 0).all()), "the last page's tail is empty"
    assert q.shape == (4, 8, 576) and rows.shape == (4, 32) and bool((rows[1] == -1).all())
    for token in rows:
        keys = token[(token >= 0) & (token < 300)]
        assert keys.unique().numel() == keys.numel(), "an indexer's top-k names a row once"
    past = (rows >= 300) & (rows != -(-300 // 16) * 16 + 5)
    assert not bool(past.any()), "invalid entries are -1 or past the cache's pages"
    assert valid == int(((rows >= 0) & (rows < 300)).sum())


def test_the_check_attends_the_keys_of_the_whole_dequantised_cache(peer_bench) -> None:
    source, cache = peer_bench.make_cache(300, 16, seed=2, device="cpu")
    q, rows, _ = peer_bench.make_queries(4, 8, 32, 300, 16, seed=2, device="cpu")
    kv = source.whole()
    rows[0, :8] = rows[0, 8:16]  # a row listed twice is one key, here as in the whole cache
    whole = dequantize_kv(cache.reshape(-1, 656), torch.float32)
    want = sparse_mla_reference(q.float(), whole, rows, scale=peer_bench.SCALE)
    picked, local = peer_bench.referenced(rows, cache.shape[0] * cache.shape[1])
    got = sparse_mla_reference(q.float(), whole[picked], local, scale=peer_bench.SCALE)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert bool((local[1] == -1).all()) and int(local.max()) < picked.numel()
    ours = sparse_mla_decode(q, cache.reshape(-1, 656), rows, scale=peer_bench.SCALE)
    assert peer_bench.check("CPU", *ours, q, cache, rows, kv)["out_rel_err"] < 1e-2
    bad = (ours[0] * 1.5, ours[1])
    with pytest.raises(RuntimeError, match="differs from the reference"):
        peer_bench.check("CPU, scaled", *bad, q, cache, rows, kv)


def test_source_rows_draw_again_the_rows_of_the_whole_cache(peer_bench, monkeypatch) -> None:
    """A check on a cache whose bf16 rows are not held draws the chunks it needs again: the same rows
    as the whole draw, in the order asked, and the same errors from ``check``."""
    monkeypatch.setattr(peer_bench, "DENSE_MAX_ROWS", 64)  # 300 rows: five chunks, a short one last
    source, cache = peer_bench.make_cache(300, 16, seed=3, device="cpu")
    whole = source.whole()
    assert torch.equal(cache[torch.arange(300) // 16, torch.arange(300) % 16], quantize_kv(whole))
    picked = torch.tensor([299, 0, 65, 64, 63, 200, 256, 0])
    assert torch.equal(source.gather(picked), whole[picked])
    q, rows, _ = peer_bench.make_queries(4, 8, 32, 300, 16, seed=4, device="cpu")
    out = sparse_mla_decode(q, cache.reshape(-1, 656), rows, scale=peer_bench.SCALE)
    assert peer_bench.check("CPU", *out, q, cache, rows, source) == peer_bench.check("CPU", *out, q, cache, rows, whole)
    other = peer_bench.SourceRows(300, 4, "cpu")  # another seed: other rows, a larger error against them
    assert peer_bench.check("CPU", *out, q, cache, rows, other)["vs_bf16"] > 0.5
