"""The GQA benchmarks' ``--pool-gb`` (``benchmarks/kv_pool.py``): the requests' pages at scattered
page ids of a pool of a given size give the same outputs as the cache of exactly their pages, the
benchmarks' own checks pass on it, the records name the pool, and a bad pool is refused clearly.

``decode.py`` and ``decode_dcp.py`` time on GPUs only: their input builders and checks run here
on the CPU (the DCP step on a one-rank gloo group); ``gqa_prefill.py`` runs its CPU dry run.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _module(name: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


def test_place_pages_scatters_distinct_pages_and_keeps_their_values() -> None:
    kv_pool = _module("kv_pool")
    k, v = torch.randn(6, 4, 2, 8), torch.randn(6, 4, 2, 8)
    table = torch.tensor([[3, 0, 5], [1, 4, -1]], dtype=torch.int32)
    assert kv_pool.place_pages((k, v), table, None) == ([k, v], table)  # the default: as given
    page = kv_pool.page_bytes((k, v))
    assert page == 2 * 4 * 2 * 8 * 4
    (pk, pv), pt = kv_pool.place_pages((k, v), table, 100 * page / kv_pool.GB, seed=3)
    assert pk.shape == (100, 4, 2, 8) and pv.shape == pk.shape and pt.dtype == torch.int32
    assert pt[1, 2] == -1 and int(pt.max()) < 100 and len(set(pt[pt >= 0].tolist())) == 5
    assert not torch.equal(pt[pt >= 0].sort().values, table[table >= 0].sort().values)  # moved
    valid = table >= 0
    assert torch.equal(pk[pt[valid].long()], k[table[valid].long()])
    assert torch.equal(pv[pt[valid].long()], v[table[valid].long()])
    assert int((pk != 0).flatten(1).any(1).sum()) == 6  # zeros but for the requests' pages
    again = kv_pool.place_pages((k, v), table, 100 * page / kv_pool.GB, seed=3)[1]
    assert torch.equal(again, pt)  # seeded
    with pytest.raises(ValueError, match=r"--pool-gb .* holds 5 pages .* the requests need 6"):
        kv_pool.place_pages((k, v), table, 5.5 * page / kv_pool.GB)


@pytest.mark.parametrize("name", ["decode", "gqa_prefill", "decode_dcp"])
@pytest.mark.parametrize("bad", ["0", "-2", "nan", "inf", "forty"])
def test_a_bad_pool_gb_is_refused_by_the_parser(name: str, bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = _module(name).build_parser()
    assert parser.parse_args([]).pool_gb is None
    assert parser.parse_args(["--pool-gb", "40"]).pool_gb == 40.0
    with pytest.raises(SystemExit):
        parser.parse_args(["--pool-gb", bad])
    assert f"argument --pool-gb: must be a number of GB above 0, got '{bad}'" in capsys.readouterr().err


def test_decode_refuses_a_pool_smaller_than_the_gqa_requests(capsys: pytest.CaptureFixture[str]) -> None:
    decode = _module("decode")
    assert decode.main(["--only", "gqa", "--pool-gb", "1"]) == 2  # 16,384 pages of 64 KiB: 1.07 GB
    assert "--pool-gb 1 holds 15,258 pages of 65,536 bytes; the requests need 16,384" in capsys.readouterr().err
    assert decode.gqa_pool_pages(40) == 610_351


def test_decode_gqa_inputs_on_a_pool_give_the_same_outputs() -> None:
    """The gqa section's steps (one query, uniform and ragged drafts) on a cache built once and
    scattered over a pool: the same queries and outputs as on the default cache, which still draws
    what the section drew before the pool existed."""
    decode = _module("decode")
    from shardattn.ops.gqa_decode import gqa_paged_decode

    shape = dict(hq=8, hkv=2, d=16, page=4, device="cpu")
    batch, ctx = 3, 21
    page_bytes = 2 * 2 * 4 * 2 * 16
    pooled = decode.gqa_cache(batch, ctx, 2, 16, 4, pool_gb=50 * page_bytes / 1e9, device="cpu")
    assert pooled.k.shape[0] == 50 and int(pooled.table.max()) < 50
    for q_len, ragged in ((1, False), (4, False), (4, True)):
        plain, kw = decode.gqa_inputs(batch, ctx, q_len, ragged=ragged, **shape)
        scattered, kw_pool = decode.gqa_inputs(batch, ctx, q_len, ragged=ragged, cache=pooled, **shape)
        assert torch.equal(plain[0], scattered[0]) and kw.keys() == kw_pool.keys()
        ref = decode.gqa_reference(scattered, kw_pool, requests=batch)
        assert torch.equal(ref, decode.gqa_reference(plain, kw, requests=batch))
        got = gqa_paged_decode(*scattered, backend="reference", **kw_pool)
        decode.check(f"GQA decode q_len {q_len} on a pool", got, ref)  # the section's check
        assert torch.equal(got, gqa_paged_decode(*plain, backend="reference", **kw))
    # the default cache: the draws of the section before --pool-gb (k, v, table, then q)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3 * 6, 4, 2, 16, generator=g).bfloat16()
    v = torch.randn(3 * 6, 4, 2, 16, generator=g).bfloat16()
    table = torch.randperm(18, generator=g).view(3, 6).int()
    q = torch.randn(3, 8, 16, generator=g).bfloat16()
    (q1, k1, v1, t1, _), _ = decode.gqa_inputs(batch, ctx, 1, **shape)
    assert all(torch.equal(a, b) for a, b in ((q, q1), (k, k1), (v, v1), (table, t1)))


def test_gqa_prefill_cpu_run_on_a_pool_checks_and_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The dry run with ``--pool-gb``: every check of the benchmark passes (it raises otherwise);
    only the cached-prefix case reads the pool, and only its records name it."""
    bench, records = _module("gqa_prefill"), _module("records")
    out = tmp_path / "gqa_prefill_pool.json"
    argv = ["--device", "cpu", "--iters", "1", "--warmup", "0", "--tp", "1", "8"]
    assert bench.main([*argv, "--pool-gb", "0.0001", "--json", str(out)]) == 0
    recs = records.read_json(out)
    named = {r["config"]["case"] for r in recs if r["config"].get("pool_gb") == 0.0001}
    assert named == {"2x(24 on 40)"} and len(recs) == 36
    assert bench.main([*argv, "--pool-gb", "0.00001"]) == 2
    assert "--pool-gb 1e-05 holds 2 pages of 4,096 bytes; the requests need 8" in capsys.readouterr().err


def test_gqa_prefill_inputs_on_a_pool_give_the_same_op_output() -> None:
    bench = _module("gqa_prefill")
    from shardattn.ops.gqa_prefill import gqa_prefill

    case = bench.Case("2x(24 on 40)", 2, 24, 40)
    outs = []
    for pool_gb in (None, 0.0001):
        x = bench.make_inputs(case, 8, 2, 16, 16, "cpu", torch.float32, pool_gb)
        prefix = {n: x[n] for n in ("k_cache", "v_cache", "prefix_lens")} | {"block_table": x["table"]}
        outs.append(gqa_prefill(x["q"], x["k"], x["v"], x["cu"], sinks=x["sinks"], scale=0.25, **prefix)[0])
        if pool_gb is not None:  # 100,000 bytes of 4,096-byte pages: 24, 8 of them the requests'
            assert x["k_cache"].shape[0] == 24 and len(set(x["table"].flatten().tolist())) == 8
    assert torch.equal(outs[0], outs[1])


def test_decode_dcp_shard_on_a_pool_passes_the_reference_check(one_rank_group: dist.ProcessGroup) -> None:
    """The DCP step (one rank: the shard is the whole cache) on the rank's pages scattered over a
    pool: the benchmark's reference check passes and the output is the in-order cache's."""
    bench = _module("decode_dcp")
    from shardattn.runtime.runtime import Runtime

    rt = Runtime("gqa-64-8", one_rank_group, max_batched_tokens=1, mode="dcp-decode", max_decode_tokens=8, device="cpu")
    b, ctx = 2, 70
    seq = torch.full((b,), ctx, dtype=torch.int32)
    q = torch.randn(b, rt.heads_per_rank, rt.spec.head_dim, generator=torch.Generator().manual_seed(5)).bfloat16()
    sinks = torch.randn(rt.spec.num_heads, generator=torch.Generator().manual_seed(2))
    page = 2 * 2 * 32 * 8 * 64
    outs = []
    for pool_gb in (None, 40 * page / 1e9):
        whole, (k, v), table = bench.rank_cache(rt, b, ctx, 0, pool_gb, device="cpu")
        out = rt.decode(q, (k, v), table, seq, q_len_per_req=1, sinks=sinks, check=False)[0]
        assert bench.reference_error(out, q, whole, seq, sinks, 0, rt.scale, requests=b) <= bench.TOL
        outs.append(out)
        if pool_gb is not None:
            assert k.shape[0] == 40 and len(set(table[table >= 0].tolist())) == 6
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(ValueError, match=r"--pool-gb .* holds 5 pages of 65,536 bytes; the requests need 6"):
        bench.rank_cache(rt, b, ctx, 0, 5 * page / 1e9, device="cpu")
