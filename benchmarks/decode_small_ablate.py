"""What the split kernel of small-batch sparse-MLA decode spends beyond reading its rows (one GPU).

Shapes: 16 heads, top-k 2048 unique random rows of 262,144, bf16, D 576 / Dv 512, batch 1 / 2 /
4 / 8 (issue 13's <= 12 us). For each batch, on the routed tiling (``sparse_mla_decode_config``:
splits, rows per split, warps), graph replays with the L2 flushed between replays (as
``decode.py``), in rounds (the minimum per variant is printed):

* a graph of one 1-element kernel (the replay floor);
* ``read``: the read-only kernel of ``decode_small_sweep.py`` on the same grid (indices, then the
  rows; no math);
* ``routed split`` / ``routed step``: the library's split kernel alone, and the whole routed call
  (split kernel and merge);
* a one-step split kernel written here for the ablation (``_split_ablate``: the routed split's
  math in one step, no loop) in full, and without one piece each: the 512-column Q.K^T
  (``no_qk_nope``: scores from the 64 rope columns only), the fp32 partial store (``no_store``:
  one float per head instead of 512), or with the partial stored in bf16 (``bf16_store``).

The differences give the cost of each piece on the critical path; ``no_qk_nope`` and
``no_store`` compute wrong results on purpose (they time, they are not attention). The full
variant is checked against the fp32 reference through the column merge before anything is timed.

    python benchmarks/decode_small_ablate.py
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from decode_small_sweep import _read_rows_kernel  # beside this script
from graph_timing import gpu_banner, replay_us, trivial_graph_us

from shardattn.kernels.triton.lse_merge import launch_lse_merge_columns, split_partials, split_partials_numel
from shardattn.kernels.triton.sparse_mla_decode import launch_split_kernel, sparse_mla_decode_config
from shardattn.ops.sparse_mla import sparse_mla_reference
from shardattn.ops.sparse_mla_decode import sparse_mla_decode

ROWS, TOPK, SCALE, LOG2E = 1 << 18, 2048, 576**-0.5, 1.4426950408889634
ABLATIONS = ("full", "no_qk_nope", "no_store", "bf16_store")


@triton.jit
def _split_ablate(Q, KV, Rows, Out, Lse, stride_qt, stride_qh, stride_kvr, K, R, chunk,
                  s_os, s_ot, s_oh, s_ls, s_lt, qk_scale,
                  BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                  QK_NOPE: tl.constexpr, STORE: tl.constexpr):  # fmt: skip
    """Program (token, split): softmax of ``BLOCK_N`` rows in one step, partial and LSE out.
    ``STORE``: 0 the fp32 partial, 1 one float per head, 2 the partial in bf16 (into ``Out``'s bytes)."""
    tok = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, 512)
    qb = Q + tok * stride_qt + heads[:, None] * stride_qh
    r = tl.load(Rows + tok * K + split * chunk + tl.arange(0, BLOCK_N))
    valid = (r >= 0) & (r < R)
    rp = KV + tl.where(valid, r, 0).to(tl.int64)[:, None] * stride_kvr
    rope = 512 + tl.arange(0, 64)
    kpe = tl.load(rp + rope[None, :], mask=valid[:, None], other=0.0)
    s = tl.dot(tl.load(qb + rope[None, :]), tl.trans(kpe))
    k = tl.load(rp + cols[None, :], mask=valid[:, None], other=0.0)
    if QK_NOPE:
        s += tl.dot(tl.load(qb + cols[None, :]), tl.trans(k))
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m = tl.max(s, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    p = tl.math.exp2(s - m_safe[:, None])
    denom = tl.sum(p, 1)
    has = denom > 0.0
    d_safe = tl.where(has, denom, 1.0)
    lse = tl.where(has, (m_safe + tl.math.log2(d_safe)) * 0.6931471805599453, float("-inf"))
    o = tl.dot(p.to(k.dtype), k) / d_safe[:, None]
    ob = Out + split * s_os + tok * s_ot + heads[:, None] * s_oh
    if STORE == 0:
        tl.store(ob + cols[None, :], o)
    elif STORE == 1:
        tl.store(Out + split * s_os + tok * s_ot + heads * s_oh, tl.sum(o, 1))
    else:
        tl.store(ob.to(tl.pointer_type(tl.bfloat16)) + cols[None, :], o.to(tl.bfloat16))
    tl.store(Lse + split * s_ls + tok * s_lt + heads, lse)


def launch_ablate(q, kv, rows, po, pl, cfg: dict, ablation: str) -> None:
    """``_split_ablate`` on the routed tiling ``cfg`` (one step: ``BLOCK_N`` = the split's rows)."""
    t, h, _ = q.shape
    splits, chunk = cfg["num_splits"], cfg["chunk"]
    _split_ablate[(1, t, splits)](q, kv, rows, po, pl, q.stride(0), q.stride(1), kv.stride(0), TOPK, kv.shape[0], chunk,
                                  po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1), SCALE * LOG2E,
                                  BLOCK_H=h, BLOCK_N=chunk, QK_NOPE=ablation != "no_qk_nope",
                                  STORE={"full": 0, "no_qk_nope": 0, "no_store": 1, "bf16_store": 2}[ablation],
                                  num_warps=cfg["num_warps"], num_stages=1)  # fmt: skip


def ablate_batch(kv: torch.Tensor, batch: int, sms: int, rounds: int) -> tuple[str, dict[str, float]]:
    """The routed tiling at ``batch`` tokens (in words) and the fastest replay of each variant (us)."""
    q = torch.randn(batch, 16, 576, device="cuda").bfloat16()
    rows = torch.argsort(torch.rand(batch, ROWS, device="cuda"), dim=1)[:, :TOPK].int()
    cfg = sparse_mla_decode_config(batch, 16, TOPK, sms)
    if cfg["chunk"] * cfg["num_splits"] != TOPK or cfg["chunk"] != cfg["BLOCK_N"]:
        raise SystemExit(f"batch {batch}: the routed tiling is not one step per split ({cfg})")
    out = torch.empty(batch, 16, 512, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(batch, 16, device="cuda")
    ws = torch.empty(split_partials_numel(cfg["num_splits"], batch, 16, 512), device="cuda")
    po, pl = split_partials(ws, cfg["num_splits"], batch, 16, 512, q.device)
    launch_ablate(q, kv, rows, po, pl, cfg, "full")
    launch_lse_merge_columns(po, pl, out, lse)
    ref_out, ref_lse = sparse_mla_reference(q.float(), kv.float(), rows, scale=SCALE)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=0)
    reads = torch.empty(batch, cfg["num_splits"], device="cuda")

    def read() -> None:
        _read_rows_kernel[(batch, cfg["num_splits"])](
            kv, rows, reads, kv.stride(0), TOPK, cfg["chunk"], BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"]
        )

    variants = {
        "read": read,
        "routed split": lambda: launch_split_kernel(q, kv, rows, None, None, po, pl, out, lse, cfg, SCALE),
        "routed step": lambda: sparse_mla_decode(
            q, kv, rows, scale=SCALE, out=out, lse_out=lse, workspace=ws, rows_unique=True
        ),
    }
    variants.update({a: (lambda a=a: launch_ablate(q, kv, rows, po, pl, cfg, a)) for a in ABLATIONS})
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, fn in variants.items():
            times.setdefault(name, []).append(replay_us(fn, rep=40))
    return f"{cfg['num_splits']} x {cfg['chunk']}, {cfg['num_warps']}", {k: min(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(gpu_banner(), flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kv = torch.randn(ROWS, 576, device="cuda").bfloat16()
    print(f"graph of one 1-element kernel: {trivial_graph_us(rounds=args.rounds):.2f} us")
    head = ["batch", "splits x rows, warps", "read", "routed split", "routed step"]
    head += [f"one-step {a}" for a in ABLATIONS]
    print("| " + " | ".join(head) + " |\n" + "|---" * len(head) + "|")
    for batch in map(int, args.batches.split(",")):
        tiling, times = ablate_batch(kv, batch, sms, args.rounds)
        print(f"| {batch} | {tiling} | " + " | ".join(f"{t:.2f}" for t in times.values()) + " |", flush=True)


if __name__ == "__main__":
    main()
