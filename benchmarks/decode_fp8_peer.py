"""FP8 sparse decode: shardattn's routed decode on fp8_ds_mla rows beside FlashMLA's SM90 FP8 sparse
decode on the same rows, timed and checked, and the error FP8 costs against the bf16 rows it was
quantised from, ours beside FlashMLA's. Prints a table; ``--json`` writes records
(``benchmarks/records.py``): ``fp8-decode-peer`` (ours = the routed FP8 decode, baseline FlashMLA's
FP8 decode, microseconds per step) and ``fp8-decode-accuracy`` (relative error of the output
against the fp32 reference on the original bf16 rows: ours, baseline FlashMLA's).

Build the peer first (FlashMLA and the CUTLASS it pins are not part of shardattn)::

    benchmarks/peer/build_flashmla_peer.sh $FLASHMLA $FLASHMLA/csrc/cutlass flashmla_fp8_decode.so fp8_decode
    python benchmarks/decode_fp8_peer.py --peer-lib flashmla_fp8_decode.so --json decode_fp8_peer.json

One KV cache for every case: ``--kv-rows`` DSA-like bf16 rows (:class:`SourceRows`) written into a
paged fp8_ds_mla cache by :func:`shardattn.ops.kv_fp8.write_kv` (pages of ``--page-size`` rows, a
padding row after each page as FlashMLA allocates them; shardattn reads the same rows from a copy
without the padding: its kernels address row ``r`` at ``r * 656``), and for each case ``T`` decode
tokens of ``H`` heads, unique random top-k rows per token with invalid entries (-1, past the cache)
sprinkled in, and (``T >= 2``) one token with no valid row. The rows are drawn in chunks of
``DENSE_MAX_ROWS`` (2**22), each from a generator of its own, and each token's rows past that size
from a permutation, so ``--kv-rows 40000000`` holds the FP8 cache's 26 GB and its unpadded copy's
24 GB (an H100 holds them), the bf16 rows' 46 GB besides only where they fit (an H200: then the
bf16 decode is timed on them too), not a [T, rows] draw or the cache in fp32. Checks: both
outputs and LSEs against the fp32 reference on the dequantised rows (only those the top-k names)
(:func:`shardattn.ops.kv_fp8.dequantize_kv`, :func:`shardattn.ops.sparse_mla.sparse_mla_reference`),
the empty token exactly ``(0, -inf)``. Timing: CUDA-graph replays with the L2 flushed
(``graph_timing.replay_us``; eager launches if the peer's do not capture, said in its name) of
the peer's split-KV kernel + combine (scheduler metadata once per shape, as FlashMLA reuses it
across layers), of shardattn's routed FP8 decode and of its routed bf16 decode on the original
rows (printed). Effective TFLOP/s count real heads and valid keys; KV GB/s count the rows' bytes
read (656 FP8 / 1152 bf16 a row). Ours is timed twice: as called by default (a row listed twice by
a token is one key, so the rows are de-duplicated first) and with ``rows_unique=True``, the
contract FlashMLA's kernel has (an indexer's top-k never repeats a row).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "peer"))
from flashmla_fp8_decode import FlashMLAFp8Decode  # beside its .cu in peer/
from graph_timing import replay_us  # beside this script
from records import add_json_argument, environment, print_table, record, write_json

from shardattn.ops.kv_fp8 import dequantize_kv, write_kv
from shardattn.ops.sparse_mla import flops, sparse_mla_reference
from shardattn.ops.sparse_mla_decode import sparse_mla_decode
from shardattn.plan.spec import get_preset

SCALE = get_preset("deepseek-v32").softmax_scale  # the model's: 192**-0.5 * mscale**2


#: Caches of more rows are drawn in chunks of this many (each from its own generator, so any
#: chunk can be drawn again), and each token's top-k by a random permutation: a cache of real size
#: (tens of millions of rows) in fp32, or a [T, rows] draw, would not fit beside it.
DENSE_MAX_ROWS = 1 << 22


class SourceRows:
    """The DSA-like bf16 rows ``[N, 576]`` a cache is quantised from (normal values times a
    per-channel magnitude drawn log-normally: MLA latents carry a few large channels), drawn in
    chunks of :data:`DENSE_MAX_ROWS`, chunk ``c`` from a generator of its own: :meth:`whole` makes
    them all, :meth:`gather` only the chunks that hold the rows asked for (a check needs a few
    thousand rows of a 46 GB cache, which then need not be held)."""

    def __init__(self, num_rows: int, seed: int, device: str) -> None:
        self.num_rows, self.seed, self.device = num_rows, seed, device
        g = torch.Generator(device=device).manual_seed(seed)
        self.channel = torch.exp(torch.randn(576, device=device, generator=g) * 0.8)

    def chunk(self, c: int) -> torch.Tensor:
        """Rows ``[c * DENSE_MAX_ROWS, ...)``, bf16."""
        n = min(DENSE_MAX_ROWS, self.num_rows - c * DENSE_MAX_ROWS)
        g = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + 1 + c)
        x = torch.randn(n, 576, device=self.device, generator=g)
        return x.mul_(self.channel).bfloat16()  # in place: a 40M-row check holds one fp32 chunk

    def chunks(self) -> range:
        return range(-(-self.num_rows // DENSE_MAX_ROWS))

    def whole(self) -> torch.Tensor:
        """Every row, ``[N, 576]`` bf16."""
        kv = torch.empty(self.num_rows, 576, dtype=torch.bfloat16, device=self.device)
        for c in self.chunks():
            kv[c * DENSE_MAX_ROWS : (c + 1) * DENSE_MAX_ROWS] = self.chunk(c)
        return kv

    def gather(self, picked: torch.Tensor) -> torch.Tensor:
        """Rows ``picked [n]`` (int64, in ``[0, N)``), ``[n, 576]`` bf16."""
        out = torch.empty(picked.numel(), 576, dtype=torch.bfloat16, device=self.device)
        which = picked // DENSE_MAX_ROWS
        for c in torch.unique(which).tolist():
            sel = which == c
            out[sel] = self.chunk(c)[picked[sel] - c * DENSE_MAX_ROWS]
        return out


def make_cache(kv_rows: int, page_size: int, seed: int, device: str = "cuda") -> tuple[SourceRows, torch.Tensor]:
    """``(source rows, cache [pages, page_size, 656])``: the paged FP8 cache of :class:`SourceRows`
    (a padding row after each page), written chunk by chunk."""
    source = SourceRows(kv_rows, seed, device)
    pages = -(-kv_rows // page_size)
    cache = torch.zeros(pages, page_size + 1, 656, dtype=torch.uint8, device=device)[:, :page_size]
    for c in source.chunks():
        start = c * DENSE_MAX_ROWS
        chunk = source.chunk(c)
        write_kv(cache, torch.arange(start, start + chunk.shape[0], device=device), chunk)
    return source, cache


def make_queries(tokens: int, heads: int, topk: int, kv_rows: int, page_size: int, seed: int, device: str = "cuda"):
    """``(q [T, H, 576] bf16, rows [T, K] int32, valid keys)`` over a cache of ``kv_rows`` rows in
    pages of ``page_size``: unique random rows a token, a few -1 and past-the-cache entries, and
    (``T >= 2``) token 1 with no valid row."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(tokens, heads, 576, device=device, generator=g).bfloat16()
    if kv_rows <= DENSE_MAX_ROWS:
        rows = torch.rand(tokens, kv_rows, device=device, generator=g).topk(topk, dim=1).indices.int()
    else:  # unique rows per token, as an indexer's top-k
        # .int() copies each token's top-k out of its permutation, so that the permutations are freed
        rows = torch.stack([torch.randperm(kv_rows, device=device, generator=g)[:topk].int() for _ in range(tokens)])
    noise = torch.rand(tokens, topk, device=device, generator=g)
    past = -(-kv_rows // page_size) * page_size + 5  # past the cache's last row
    rows = torch.where(noise < 0.03, -1, torch.where(noise > 0.99, past, rows)).int()
    if tokens >= 2:
        rows[1] = -1  # a token with no valid row
    valid = int(((rows >= 0) & (rows < kv_rows)).sum())
    return q, rows, valid


def referenced(rows: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(picked [n] int64, local [T, K] int32)``: the distinct rows of ``rows`` in ``[0, num_rows)``,
    sorted, and ``rows`` renumbered into them (-1 where invalid). A reference over ``x[picked]`` with
    ``local`` attends the keys one over ``x`` with ``rows`` does, without ``x`` whole in fp32."""
    valid = (rows >= 0) & (rows < num_rows)
    picked = torch.unique(rows[valid].long())
    local = torch.searchsorted(picked, rows.long().clamp(min=0)).int()
    return picked, torch.where(valid, local, -1).int()


def check(what: str, out, lse, q, cache, rows, kv: torch.Tensor | SourceRows) -> dict:
    """``what``'s output against the fp32 reference on the dequantised cache (raises when it is
    off) and against the one on the original bf16 rows ``kv`` (the error FP8 costs: ``[N, 576]``,
    or the :class:`SourceRows` that draws them). Only the rows the top-k names are dequantised
    (cache row = page * page_size + offset) or drawn."""
    page = cache.shape[1]
    picked, local = referenced(rows, cache.shape[0] * page)
    deq = dequantize_kv(cache[picked // page, picked % page], torch.float32)
    ref_out, ref_lse = sparse_mla_reference(q.float(), deq, local, scale=SCALE)
    num_rows = kv.num_rows if isinstance(kv, SourceRows) else kv.shape[0]
    picked, local = referenced(rows, num_rows)
    source = kv.gather(picked) if isinstance(kv, SourceRows) else kv[picked]
    bf16_out, _ = sparse_mla_reference(q.float(), source.float(), local, scale=SCALE)
    empty = torch.isneginf(ref_lse)
    err = ((out.float() - ref_out).norm() / ref_out.norm()).item()
    lse_gap = (lse[~empty] - ref_lse[~empty]).abs().max().item() if (~empty).any() else 0.0
    empty_ok = bool((out[empty] == 0).all()) and bool(torch.isneginf(lse[empty]).all())
    if not (err < 2e-2 and lse_gap < 5e-3 and empty_ok and torch.equal(torch.isneginf(lse), empty)):
        raise RuntimeError(f"{what} differs from the reference: out rel err {err}, lse gap {lse_gap}, empty {empty_ok}")
    vs_bf16 = ((out.float() - bf16_out).norm() / bf16_out.norm()).item()
    return {"out_rel_err": err, "lse_max_abs_err": lse_gap, "vs_bf16": vs_bf16}


def bf16_rows_if_they_fit(source: SourceRows) -> torch.Tensor | None:
    """The bf16 rows whole (the bf16 decode is timed on them) where they fit in the GPU's free
    memory beside a chunk's draw (fp32 and bf16) with 2 GiB to spare, else ``None`` (said on
    stdout): 40M rows' 46 GB fit beside the FP8 caches on an H200, not on an H100."""
    need = source.num_rows * 576 * 2
    free = torch.cuda.mem_get_info()[0]
    if free < need + DENSE_MAX_ROWS * 576 * 6 + (2 << 30):
        print(
            f"the bf16 rows ({need / 1e9:.0f} GB) do not fit beside the FP8 caches: bf16 decode not timed", flush=True
        )
        return None
    return source.whole()


def peer_time(run) -> tuple[float, str]:
    """``(us, how)``: graph replays with the L2 flushed; CUDA events around eager launches (L2
    flushed too, ``triton.testing.do_bench``) if the peer's launches do not capture."""
    try:
        return replay_us(run), "graph"
    except RuntimeError as e:
        print(f"peer graph capture failed ({e}); timing eager launches", flush=True)
        import triton.testing

        return 1e3 * triton.testing.do_bench(run, warmup=5, rep=25, return_mode="median"), "eager"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer-lib", default=None, help="built by build_flashmla_peer.sh ... fp8_decode (required)")
    ap.add_argument("--heads", type=int, nargs="+", default=[128, 64, 16])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 128])
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--kv-rows", type=int, default=65536)
    ap.add_argument("--page-size", type=int, default=64)
    add_json_argument(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.peer_lib is None:
        print("--peer-lib: the library build_flashmla_peer.sh ... fp8_decode writes is required", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (sm_90)", file=sys.stderr)
        return 2
    env = environment()
    print(f"{env['gpu']}, torch {env['versions']['torch']}, Triton {env['versions']['triton']}", flush=True)
    peer = FlashMLAFp8Decode(args.peer_lib)
    records = []
    source, cache = make_cache(args.kv_rows, args.page_size, seed=0)  # one cache for every case
    rows_fp8 = cache.reshape(-1, 656)  # the same rows without the page padding (a copy)
    kv = bf16_rows_if_they_fit(source)
    for heads in args.heads:
        for tokens in args.tokens:
            q, rows, valid = make_queries(tokens, heads, args.topk, args.kv_rows, args.page_size, seed=tokens)
            call = peer.prepare(q, cache, rows, SCALE)
            call.run()
            torch.cuda.synchronize()
            peer_res = check("FlashMLA", *call.result(), q, cache, rows, source)
            ours = sparse_mla_decode(q, rows_fp8, rows, scale=SCALE)
            ours_res = check("shardattn FP8", *ours, q, cache, rows, source)
            unique = sparse_mla_decode(q, rows_fp8, rows, scale=SCALE, rows_unique=True)
            check("shardattn FP8, rows_unique=True", *unique, q, cache, rows, source)
            peer_us, timing = peer_time(call.run)
            ours_us = replay_us(lambda q=q, c=rows_fp8, rows=rows: sparse_mla_decode(q, c, rows, scale=SCALE))
            unique_us = replay_us(
                lambda q=q, c=rows_fp8, rows=rows: sparse_mla_decode(q, c, rows, scale=SCALE, rows_unique=True)
            )
            bf16 = "not timed"
            if kv is not None:
                bf16 = f"{replay_us(lambda q=q, kv=kv, rows=rows: sparse_mla_decode(q, kv, rows, scale=SCALE)):.1f} us"
            tf = {k: flops(valid, heads) / (v * 1e-6) / 1e12 for k, v in (("ours", ours_us), ("peer", peer_us))}
            gbs = valid * 656 / (ours_us * 1e-6) / 1e9
            err_ours, err_peer = ours_res["vs_bf16"], peer_res["vs_bf16"]
            print(
                f"{heads} heads x {tokens}: FP8 ours {ours_us:.1f} us ({tf['ours']:.0f} TF/s, KV {gbs:.0f} GB/s), "
                f"rows_unique {unique_us:.1f} us, FlashMLA {peer_us:.1f} us ({tf['peer']:.0f} TF/s, {timing}), "
                f"bf16 ours {bf16}; "
                f"error against the bf16 rows: ours {err_ours:.2e}, FlashMLA {err_peer:.2e}",
                flush=True,
            )
            config = {"heads": heads, "tokens": tokens, "topk": args.topk, "kv_rows": args.kv_rows}
            name = "FlashMLA FP8 decode" + (", eager launches" if timing == "eager" else "") + ", same run"
            records.append(record("fp8-decode-peer", config, "step us", ours_us, "us", "lower", (name, peer_us), env))
            metric = "step us, rows_unique=True"  # FlashMLA's contract: no row twice in a token's list
            records.append(record("fp8-decode-peer", config, metric, unique_us, "us", "lower", (name, peer_us), env))
            peer_err = ("FlashMLA FP8 decode, same inputs", err_peer)
            metric = "out rel. error vs bf16 rows"
            records.append(record("fp8-decode-accuracy", config, metric, err_ours, "relative", "lower", peer_err, env))
    print_table(records, "sparse-MLA decode on fp8_ds_mla rows: shardattn and FlashMLA")
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
