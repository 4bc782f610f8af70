"""The parallel steps on fp8_ds_mla caches, called as an engine calls them, against an fp64 oracle
that decodes the 656-byte rows itself (its own e4m3 / fp32 / bf16 bit decoding, no library code):
DCP decode (interleaves, page sizes that are not a multiple of the interleave, requests shorter
than the group, ranks holding no row of a request), PCP prefill (prefixes, ranks with no token),
head-TP (convert_topk then the decode and prefill ops on a rank's heads), convert_topk's DCP
shards and the compact cache of kv_compact. Inputs are fresh random bytes (any finite code, scales
that are powers of two or not), with invalid entries anywhere in a row (-1, negative, past the
request, int32's largest), duplicates, topk_length (negative, past K), sinks and custom scales.
Queries are fp32 so the steps' error is the fp32 softmax's alone."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from shardattn.ops.kv_compact import compact_rows
from shardattn.ops.sparse_mla import sparse_mla_attention
from shardattn.ops.sparse_mla_decode import sparse_mla_decode
from shardattn.ops.topk import DcpShard, convert_topk
from shardattn.parallel.comm import Comm
from shardattn.parallel.dcp import dcp_sparse_mla_decode
from shardattn.parallel.pcp import pcp_prefill
from shardattn.plan import DCPLayout, pcp_plan

ROW, LATENT, ROPE, TILE = 656, 512, 64, 128
TOL = 2e-4  # fp32 steps against fp64: out relative to max(1, |out|), lse absolute


def decode_rows(raw: np.ndarray) -> np.ndarray:
    """``[R, 656]`` bytes -> ``[R, 576]`` fp64: e4m3 codes from their bits times the tile's
    little-endian fp32 scale, then the bf16 rope values from their bits."""
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, ROW)
    code = b[:, :LATENT].astype(np.int64)
    exp, man = (code >> 3) & 15, code & 7
    mag = np.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * np.exp2(exp - 7.0))
    mag = np.where((exp == 15) & (man == 7), np.nan, mag)
    lat = np.where(code >> 7 == 1, -mag, mag)
    scales = b[:, LATENT : LATENT + 16].copy().view("<f4").astype(np.float64)
    lat = lat * np.repeat(scales, TILE, axis=1)
    rope = (b[:, LATENT + 16 :].copy().view("<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return np.concatenate([lat, rope], axis=1)


def random_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` random fp8_ds_mla rows: any finite code, scales near 2**-8 (half of them not powers of two)."""
    b = np.zeros((n, ROW), dtype=np.uint8)
    code = rng.integers(0, 256, size=(n, LATENT))
    b[:, :LATENT] = np.where(code & 0x7F == 0x7F, code - 1, code)  # no NaN code
    scale = np.ldexp(1.0, rng.integers(-10, -5, size=(n, 4))) * np.where(rng.random((n, 4)) < 0.5, 1, 1.3)
    b[:, LATENT : LATENT + 16] = scale.astype("<f4").view(np.uint8).reshape(n, 16)
    rope = rng.normal(0, 0.3, (n, ROPE)).astype(np.float32)
    b[:, LATENT + 16 :] = (rope.view(np.uint32) >> 16).astype("<u2").view(np.uint8).reshape(n, 2 * ROPE)
    return b


def attend(q: np.ndarray, keys: list[np.ndarray], scale: float, sinks: np.ndarray | None) -> tuple:
    """fp64 sparse MLA: ``q [T, H, 576]``, ``keys[t]`` token t's distinct valid key rows ``[n, 576]``;
    a sink in the denominator only; no key: ``(0, -inf)`` (``(0, sink)``). Natural-log LSE."""
    t_count, heads, _ = q.shape
    out, lse = np.zeros((t_count, heads, LATENT)), np.full((t_count, heads), -math.inf)
    for t in range(t_count):
        for h in range(heads):
            logits = [float(x) for x in keys[t] @ q[t, h] * scale]
            terms = logits + ([float(sinks[h])] if sinks is not None else [])
            if terms:
                m = max(terms)
                lse[t, h] = m + math.log(sum(math.exp(x - m) for x in terms))
                for x, k in zip(logits, keys[t]):
                    out[t, h] += math.exp(x - lse[t, h]) * k[:LATENT]
    return out, lse


def keys_of(kv: np.ndarray, pos: np.ndarray, length: int, k_len: int | None) -> np.ndarray:
    """The distinct positions in ``[0, length)`` among the first ``k_len`` entries, decoded."""
    seen: list[int] = []
    for p in pos[: len(pos) if k_len is None else max(0, k_len)]:
        if 0 <= p < length and int(p) not in seen:
            seen.append(int(p))
    return decode_rows(kv[seen]) if seen else np.zeros((0, LATENT + ROPE))


def assert_close(out: torch.Tensor, lse: torch.Tensor, ref: tuple, what: str) -> None:
    ref_out, ref_lse = ref
    o, lse_ = out.double().numpy(), lse.double().numpy()
    assert o.shape == ref_out.shape and lse_.shape == ref_lse.shape, what
    assert np.array_equal(np.isneginf(lse_), np.isneginf(ref_lse)), f"{what}: empty rows differ"
    fin = np.isfinite(ref_lse)
    assert np.abs(lse_[fin] - ref_lse[fin]).max(initial=0) <= TOL, f"{what}: lse"
    vmax = max(1.0, np.abs(ref_out).max(initial=0))
    assert not np.isnan(o).any() and np.abs(o - ref_out).max(initial=0) <= TOL * vmax, f"{what}: out"


def junk_positions(rng: np.random.Generator, t: int, k: int, hi: int) -> np.ndarray:
    """``[t, k]`` int32 positions in ``[0, hi)`` with invalid entries anywhere and duplicates."""
    pos = rng.integers(0, max(hi, 1), size=(t, k))
    u = rng.random((t, k))
    for lo, value in ((0.0, -1), (0.06, -7), (0.12, hi + 3), (0.18, 2**31 - 1)):
        pos = np.where((u >= lo) & (u < lo + 0.06), value, pos)
    for row in pos:
        if k > 2:
            row[rng.integers(0, k)] = row[rng.integers(0, k)]
    return pos.astype(np.int32)


def _case(seed: int, world: int) -> dict:
    rng = np.random.default_rng(seed)
    lens = [int(rng.choice([0, 1, world - 1, int(rng.integers(0, 30))])) for _ in range(int(rng.integers(1, 4)))]
    k = int(rng.integers(0 if seed % 5 == 0 else 1, 10))
    t = int(rng.integers(0 if seed % 7 == 0 else 1, 5))
    return {
        "rng": rng, "lens": lens, "k": k, "t": t, "heads": world * int(rng.integers(1, 3)),
        "kv": [random_rows(rng, n) for n in lens], "req": rng.integers(0, len(lens), size=t).astype(np.int32),
        "pos": junk_positions(rng, t, k, max(lens) + 1),
        "topk_length": rng.integers(-1, k + 3, size=t).astype(np.int32) if seed % 2 else None,
        "sinks": rng.normal(0, 1, 8).astype(np.float32) if seed % 3 else None,
        "scale": float(rng.uniform(0.01, 0.2)), "interleave": int(rng.choice([1, 2, 3, 5])),
        "block_size": int(rng.choice([1, 2, 3, 4, 7])), "q": rng.normal(0, 1, (t, 8, 576)).astype(np.float32),
    }  # fmt: skip


def _expected(c: dict, heads: slice, lens: list[int] | None = None) -> tuple:
    lens = c["lens"] if lens is None else lens
    tl = c["topk_length"]
    keys = [
        keys_of(c["kv"][r], c["pos"][i], lens[r], None if tl is None else int(tl[i])) for i, r in enumerate(c["req"])
    ]
    sinks = None if c["sinks"] is None else c["sinks"][: c["heads"]][heads].astype(np.float64)
    return attend(c["q"][:, : c["heads"]][:, heads].astype(np.float64), keys, c["scale"], sinks)


def _dcp_shard(c: dict, world: int, rank: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Rank's paged shard (junk in every unused row) and local block table (-1 past its blocks)."""
    inter, bs = c["interleave"], c["block_size"]
    owned = [[p for p in range(n) if (p // inter) % world == rank] for n in c["lens"]]
    blocks = [-(-len(o) // bs) for o in owned]
    pages = rng.permutation(sum(blocks) + 2)
    cache = random_rows(rng, len(pages) * bs)
    table = np.full((len(owned), max(blocks) + 1), -1, dtype=np.int32)
    for r, own in enumerate(owned):
        table[r, : blocks[r]] = pages[sum(blocks[:r]) : sum(blocks[:r]) + blocks[r]]
        for p in own:
            local = (p // (world * inter)) * inter + p % inter
            cache[table[r, local // bs] * bs + local % bs] = c["kv"][r][p]
    return cache, table


def _run_dcp(group: dist.ProcessGroup, seeds: list[int]) -> list[str]:
    comm = Comm(group)
    w, rank = comm.world_size, comm.rank
    for seed in seeds:
        c = _case(seed, w)
        cache, table = _dcp_shard(c, w, rank, np.random.default_rng(seed * 10 + rank))
        kv = torch.from_numpy(cache)
        kv = kv.view(-1, c["block_size"], ROW) if seed % 2 else kv
        h = c["heads"] // w
        scatter = seed % 4 != 3
        pos = c["pos"]
        unique = seed % 5 == 1
        if unique:  # an indexer's top-k: a position once per row
            pos = np.array([[p if p < 0 or p not in row[:j] else -1 for j, p in enumerate(row)] for row in pos])
            pos = pos.reshape(c["pos"].shape).astype(np.int32)
            c["pos"] = pos
        out, lse = dcp_sparse_mla_decode(
            torch.from_numpy(c["q"][:, rank * h : (rank + 1) * h]).contiguous(), kv, torch.from_numpy(pos),
            torch.from_numpy(c["req"]), torch.from_numpy(table), DCPLayout(w, c["interleave"]), comm,
            block_size=c["block_size"], scale=c["scale"], seq_lens=torch.tensor(c["lens"], dtype=torch.int32),
            topk_length=None if c["topk_length"] is None else torch.from_numpy(c["topk_length"]),
            sinks=None if c["sinks"] is None else torch.from_numpy(c["sinks"][: c["heads"]]),
            scatter_heads=scatter, rows_unique=unique,
            strategy=("auto", "all_gather", "reduce_scatter")[seed % 3] if not scatter else "auto",
        )  # fmt: skip
        heads = slice(rank * h, (rank + 1) * h) if scatter else slice(None)
        assert_close(out, lse, _expected(c, heads), f"seed {seed} rank {rank} of {w}")
    return []


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2, 3], ids=["world1", "world2", "world3"])
def test_dcp_decode_on_fp8_shards_equals_the_byte_oracle(dist_pool, world: int) -> None:
    dist_pool.run(_run_dcp, list(range(30)), world_size=world)


def _pcp_inputs(seed: int, world: int) -> dict:
    rng = np.random.default_rng(seed)
    n_req = int(rng.integers(1, 4))
    new = [int(rng.choice([0, 1, world, int(rng.integers(0, 14))])) for _ in range(n_req)]
    prefix = [int(rng.choice([0, 1, int(rng.integers(0, 14))])) for _ in range(n_req)]
    c = _case(seed, 1)
    c["lens"] = [p + n for p, n in zip(prefix, new)]
    c["kv"] = [random_rows(rng, n) for n in c["lens"]]
    c["req"] = np.repeat(np.arange(n_req), new).astype(np.int32)
    t = len(c["req"])
    c["pos"] = junk_positions(rng, t, c["k"], max(c["lens"]) + 1)
    c["topk_length"] = rng.integers(-1, c["k"] + 3, size=t).astype(np.int32) if seed % 2 else None
    c["q"] = rng.normal(0, 1, (t, 8, 576)).astype(np.float32)
    bs = c["block_size"]
    blocks = [-(-p // bs) for p in prefix]
    pages = rng.permutation(sum(blocks) + 1)
    cache, table = random_rows(rng, len(pages) * bs), np.full((n_req, max(blocks) + 1), -1, dtype=np.int32)
    for r in range(n_req):
        table[r, : blocks[r]] = pages[sum(blocks[:r]) : sum(blocks[:r]) + blocks[r]]
        for p in range(prefix[r]):
            cache[table[r, p // bs] * bs + p % bs] = c["kv"][r][p]
    c.update(new=new, prefix=prefix, cache=cache, table=table)
    c["kv_new"] = np.concatenate([c["kv"][r][prefix[r] :] for r in range(n_req)])
    return c


def _run_pcp(group: dist.ProcessGroup, seeds: list[int]) -> list[str]:
    comm = Comm(group)
    for seed in seeds:
        c = _pcp_inputs(seed, comm.world_size)
        plan = pcp_plan(c["new"], comm.world_size, prefix_lens=c["prefix"])
        ids = plan.shard.token_ids(comm.rank)
        mine = {k: torch.from_numpy(c[k])[ids] for k in ("q", "kv_new", "pos")}
        cached = any(c["prefix"]) or seed % 2
        cache = torch.from_numpy(c["cache"])
        out, lse = pcp_prefill(
            mine["q"][:, : c["heads"]].contiguous(), mine["kv_new"], mine["pos"], plan, comm, scale=c["scale"],
            kv_cache=(cache.view(-1, c["block_size"], ROW) if seed % 3 else cache) if cached else None,
            block_table=torch.from_numpy(c["table"]) if cached else None,
            block_size=c["block_size"] if cached else None,
            topk_length=None if c["topk_length"] is None else torch.from_numpy(c["topk_length"])[ids],
            sinks=None if c["sinks"] is None else torch.from_numpy(c["sinks"][: c["heads"]]),
            gather_output=seed % 4 == 0,
        )  # fmt: skip
        ref_out, ref_lse = _expected(c, slice(None))
        if seed % 4:
            ref_out, ref_lse = ref_out[ids.numpy()], ref_lse[ids.numpy()]
        assert_close(out, lse, (ref_out, ref_lse), f"seed {seed} rank {comm.rank} of {comm.world_size}")
    return []


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2, 3], ids=["world1", "world2", "world3"])
def test_pcp_prefill_on_fp8_rows_equals_the_byte_oracle(dist_pool, world: int) -> None:
    dist_pool.run(_run_pcp, list(range(30)), world_size=world)


@pytest.mark.parametrize("seed", range(12))
def test_head_tp_convert_topk_and_ops_on_fp8_cache_equal_the_byte_oracle(seed: int) -> None:
    """Head-TP as an engine runs it: every rank holds the whole paged cache and its heads; the top-k
    converted by convert_topk feeds the decode op and the prefill op."""
    world = 1 + seed % 3
    c = _case(seed, world)
    c["interleave"] = 1
    cache, table = _dcp_shard(c, 1, 0, c["rng"])
    args = {
        "scale": c["scale"], "topk_length": None if c["topk_length"] is None else torch.from_numpy(c["topk_length"]),
    }  # fmt: skip
    rows, _ = convert_topk(
        torch.from_numpy(c["pos"]), torch.from_numpy(c["req"]), torch.from_numpy(table), block_size=c["block_size"],
        seq_lens=torch.tensor(c["lens"], dtype=torch.int32),
        **({} if seed % 2 else {"topk_length": args["topk_length"]}),
    )  # fmt: skip
    if seed % 2 == 0:  # the rows already cut at topk_length: the ops take none
        args["topk_length"] = None
    h = c["heads"] // world
    for rank in range(world):
        heads = slice(rank * h, (rank + 1) * h)
        q = torch.from_numpy(c["q"][:, heads]).contiguous()
        sinks = None if c["sinks"] is None else torch.from_numpy(c["sinks"][heads]).contiguous()
        ref = _expected(c, heads)
        assert_close(*sparse_mla_decode(q, torch.from_numpy(cache), rows, sinks=sinks, **args), ref, "decode")
        paged_kv = torch.from_numpy(cache).view(-1, c["block_size"], ROW)
        prefill = sparse_mla_attention(q, paged_kv, rows, sinks=sinks, return_lse=True, **args)
        assert_close(*prefill, ref, "prefill")


@pytest.mark.parametrize("seed", range(40))
def test_convert_topk_dcp_shards_cover_every_valid_position_once(seed: int) -> None:
    """convert_topk with each rank's DcpShard (packed or not): every valid position of a row is the
    local row of exactly one rank, the one that owns it, and nothing else is a row."""
    world = 1 + seed % 3
    c = _case(seed, world)
    tl = c["topk_length"]
    valid_pos = [
        {int(p) for p in c["pos"][i][: None if tl is None else max(0, int(tl[i]))] if 0 <= p < c["lens"][r]}
        for i, r in enumerate(c["req"])
    ]
    found: list[list[int]] = [[] for _ in c["req"]]
    for rank in range(world):
        cache, table = _dcp_shard(c, world, rank, np.random.default_rng(seed))
        packed = (seed + rank) % 2 == 1
        rows, counts = convert_topk(
            torch.from_numpy(c["pos"]), torch.from_numpy(c["req"]), torch.from_numpy(table),
            block_size=c["block_size"], seq_lens=torch.tensor(c["lens"], dtype=torch.int32),
            topk_length=None if tl is None else torch.from_numpy(tl),
            dcp=DcpShard(world, c["interleave"], rank), packed=packed,
        )  # fmt: skip
        assert torch.equal(counts, (rows >= 0).sum(1, dtype=torch.int32))
        for i, row in enumerate(rows.tolist()):
            if packed:
                assert all(x >= 0 for x in row[: counts[i]]) and all(x == -1 for x in row[counts[i] :])
            for x in row:
                if x >= 0:  # the row holds the bytes of a valid position this rank owns
                    hits = [p for p in valid_pos[i] if np.array_equal(cache[x], c["kv"][c["req"][i]][p])]
                    assert hits and all((p // c["interleave"]) % world == rank for p in hits), (seed, rank, i)
                    found[i].append(hits[0])
    for i, want in enumerate(valid_pos):
        assert set(found[i]) == want, (seed, i)


@pytest.mark.parametrize("seed", range(12))
def test_compact_fp8_cache_keeps_every_row(seed: int) -> None:
    """kv_compact.compact_rows over fp8_ds_mla rows: every valid entry names the same 656 bytes in the
    compact cache, every other entry -1, and the attention over it equals the byte oracle."""
    rng = np.random.default_rng(seed)
    n = int(rng.choice([0, 1, 63, 64, 65, int(rng.integers(100, 400))]))
    cache = random_rows(rng, n)
    t, k = int(rng.integers(1, 5)), int(rng.integers(1, 12))
    rows = junk_positions(rng, t, k, n + 1)
    tl = rng.integers(-1, k + 3, size=t).astype(np.int32) if seed % 2 else None
    q = rng.normal(0, 1, (t, 3, 576)).astype(np.float32)
    kv_c, rows_c = compact_rows(
        torch.from_numpy(cache), torch.from_numpy(rows), None if tl is None else torch.from_numpy(tl), max_rows=1 << 24
    )
    valid = (rows >= 0) & (rows < n)
    if tl is not None:
        valid &= np.arange(k)[None, :] < tl[:, None]
    moved = rows_c.numpy()
    assert np.array_equal(moved >= 0, valid)
    assert np.array_equal(kv_c.numpy()[moved[valid]], cache[rows[valid]])
    keys = [keys_of(cache, rows[i], n, None if tl is None else int(tl[i])) for i in range(t)]
    out = sparse_mla_decode(
        torch.from_numpy(q), kv_c, rows_c, scale=0.1, topk_length=None if tl is None else torch.from_numpy(tl)
    )
    assert_close(*out, attend(q.astype(np.float64), keys, 0.1, None), "compact")


def _run_pcp_one_token(group: dist.ProcessGroup, kv_row: np.ndarray, q: np.ndarray) -> tuple:
    comm = Comm(group)
    plan = pcp_plan([1], comm.world_size)
    ids = plan.shard.token_ids(comm.rank).numpy()
    # numpy's rows of the rank's tokens: a rank with none passes [0, 656] with strides (0, 0)
    kv_new, pos = torch.from_numpy(kv_row[ids]), torch.zeros(len(ids), 1, dtype=torch.int32)
    return pcp_prefill(torch.from_numpy(q[ids]), kv_new, pos, plan, comm, scale=0.1)


@pytest.mark.distributed
def test_fp8_rows_of_no_row_with_any_strides_are_accepted(dist_pool) -> None:
    """Regression: a cache or new rows of no fp8_ds_mla row whose strides were not a row's (numpy's
    empty arrays give strides (0, 0); torch calls any empty tensor contiguous) was refused ("must
    have contiguous, non-overlapping fp8_ds_mla rows"): a PCP rank holding no token, an empty
    shard. No byte of it is read, so it is every op's empty cache."""
    empty = torch.empty_strided((0, ROW), (0, 0), dtype=torch.uint8)
    q = torch.randn(2, 2, 576)
    rows = torch.tensor([[0, -1], [3, 5]], dtype=torch.int32)
    for kv in (empty, empty.view(0, 4, ROW), torch.from_numpy(np.zeros((0, ROW), np.uint8))):
        for out, lse in (
            sparse_mla_decode(q, kv, rows, scale=0.1),
            sparse_mla_attention(q, kv, rows, scale=0.1, return_lse=True),
        ):
            assert torch.equal(out, torch.zeros(2, 2, LATENT)) and bool(lse.isneginf().all())
    rng = np.random.default_rng(0)
    kv_row, q1 = random_rows(rng, 1), rng.normal(0, 1, (1, 2, 576)).astype(np.float32)
    ref = attend(q1.astype(np.float64), [decode_rows(kv_row)], 0.1, None)
    (out, lse), (out1, lse1) = dist_pool.run(_run_pcp_one_token, kv_row, q1, world_size=2)
    assert_close(out, lse, ref, "rank 0 (the token)")
    assert out1.shape == (0, 2, LATENT) and lse1.shape == (0, 2)
