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

from shardattn.ops.sparse_mla import sparse_mla_attention
from shardattn.ops.sparse_mla_decode import sparse_mla_decode
from shardattn.parallel.comm import Comm
from shardattn.parallel.pcp import pcp_prefill
from shardattn.plan import pcp_plan

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
