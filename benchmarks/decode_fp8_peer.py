"""FlashMLA's SM90 FP8 sparse decode (the peer of the coming FP8 read path) checked and timed on
shardattn's tensors, beside shardattn's bf16 decode on the same rows. Prints a table; ``--json``
writes records (``benchmarks/records.py``, benchmark ``fp8-decode-peer``: ours = the routed bf16
decode, peer = FlashMLA's FP8 decode, both in microseconds per step).

Build the peer first (FlashMLA and the CUTLASS it pins are not part of shardattn)::

    benchmarks/peer/build_flashmla_peer.sh $FLASHMLA $FLASHMLA/csrc/cutlass flashmla_fp8_decode.so fp8_decode
    python benchmarks/decode_fp8_peer.py --peer-lib flashmla_fp8_decode.so --json decode_fp8_peer.json

Each case: a KV cache of ``--kv-rows`` random bf16 rows written into a paged fp8_ds_mla cache by
:func:`shardattn.ops.kv_fp8.write_kv` (pages of ``--page-size`` rows, a padding row after each
page as FlashMLA allocates them), ``T`` decode tokens of ``H`` heads, unique random top-k rows
per token with invalid entries (-1, past the cache) sprinkled in, and (``T >= 2``) one token with
no valid row. Check: the peer's output and LSE against the fp32 reference on the dequantised
rows (:func:`shardattn.ops.kv_fp8.dequantize_kv`, :func:`shardattn.ops.sparse_mla.sparse_mla_reference`),
the empty token exactly ``(0, -inf)``. Timing: CUDA-graph replays with the L2 flushed
(``graph_timing.replay_us``; eager launches if they do not capture, said in the peer's name) of the
peer's split-KV kernel + combine (scheduler metadata once per
shape, as FlashMLA reuses it across layers) and of shardattn's routed bf16 decode on the same
rows. Effective TFLOP/s count real heads and valid keys; KV GB/s count the rows' bytes read
(656 FP8 / 1152 bf16 a row).
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


def make_case(tokens: int, heads: int, topk: int, kv_rows: int, page_size: int, seed: int):
    """``(q, kv_bf16 [N, 576], cache [pages, page_size, 656], rows [T, K] int32, valid keys)``."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    kv = (torch.randn(kv_rows, 576, device="cuda", generator=g) * 2).bfloat16()
    pages = -(-kv_rows // page_size)
    cache = torch.zeros(pages, page_size + 1, 656, dtype=torch.uint8, device="cuda")[:, :page_size]
    write_kv(cache, torch.arange(kv_rows, device="cuda"), kv)
    q = torch.randn(tokens, heads, 576, device="cuda", generator=g).bfloat16()
    rows = torch.rand(tokens, kv_rows, device="cuda", generator=g).topk(topk, dim=1).indices.int()
    noise = torch.rand(tokens, topk, device="cuda", generator=g)
    past = pages * page_size + 5  # past the cache's last row
    rows = torch.where(noise < 0.03, -1, torch.where(noise > 0.99, past, rows)).int()
    if tokens >= 2:
        rows[1] = -1  # a token with no valid row
    valid = int(((rows >= 0) & (rows < kv_rows)).sum())
    return q, kv, cache, rows, valid


def check(peer_out, peer_lse, q, cache, rows) -> dict:
    """The peer against the fp32 reference on the dequantised cache; raises when it is off."""
    deq = dequantize_kv(cache, torch.float32).reshape(-1, 576)  # row = page * page_size + offset
    ref_out, ref_lse = sparse_mla_reference(q.float(), deq, rows, scale=SCALE)
    empty = torch.isneginf(ref_lse)
    err = ((peer_out.float() - ref_out).norm() / ref_out.norm()).item()
    lse_gap = (peer_lse[~empty] - ref_lse[~empty]).abs().max().item() if (~empty).any() else 0.0
    empty_ok = bool((peer_out[empty] == 0).all()) and bool(torch.isneginf(peer_lse[empty]).all())
    if not (err < 2e-2 and lse_gap < 5e-3 and empty_ok and torch.equal(torch.isneginf(peer_lse), empty)):
        raise RuntimeError(
            f"peer differs from the reference: out rel err {err}, lse gap {lse_gap}, empty ok {empty_ok}"
        )
    return {"out_rel_err": err, "lse_max_abs_err": lse_gap, "empty_rows": int(empty.any(dim=1).sum())}


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
    for heads in args.heads:
        for tokens in args.tokens:
            q, kv, cache, rows, valid = make_case(tokens, heads, args.topk, args.kv_rows, args.page_size, seed=tokens)
            call = peer.prepare(q, cache, rows, SCALE)
            call.run()
            torch.cuda.synchronize()
            res = check(*call.result(), q, cache, rows)
            peer_us, timing = peer_time(call.run)
            ours_us = replay_us(lambda q=q, kv=kv, rows=rows: sparse_mla_decode(q, kv, rows, scale=SCALE))
            tf = flops(valid, heads) / (peer_us * 1e-6) / 1e12
            gbs = valid * 656 / (peer_us * 1e-6) / 1e9
            print(f"{heads} heads x {tokens}: peer {peer_us:.1f} us ({tf:.0f} TF/s, KV {gbs:.0f} GB/s, {timing}), "
                  f"bf16 routed {ours_us:.1f} us; peer out rel err {res['out_rel_err']:.1e}, "
                  f"LSE err {res['lse_max_abs_err']:.1e}", flush=True)  # fmt: skip
            config = {"heads": heads, "tokens": tokens, "topk": args.topk, "kv_rows": args.kv_rows}
            name = "FlashMLA FP8 decode" + (", eager launches" if timing == "eager" else "") + ", same run"
            records.append(record("fp8-decode-peer", config, "step us", ours_us, "us", "lower", (name, peer_us), env))
    print_table(records, "sparse-MLA decode: bf16 (ours) and FlashMLA's FP8 decode")
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
