"""The sparse-prefill Triton kernel reading q and writing out / LSE head-blocked, under the interpreter.

Run as ``TRITON_INTERPRET=1 python -m tests.interpret.head_blocked_cases`` (tests/test_shardq_chunked.py
does this in a subprocess). Head-blocked ``[B, T, H/B, ...]`` tensors are all-to-all buffers the
pipelined ShardQ step hands the kernel in place; the result must equal the plain ``[T, H, ...]``
launch bit for bit (same kernel, same arithmetic, other addresses), and every element of the
destinations must be written. fp16 and fp32 (the interpreter mishandles bf16 dots).
"""

from __future__ import annotations

import torch

from shardattn.kernels.sparse_mla_grouped import sparse_mla_grouped_prefill
from shardattn.kernels.sparse_mla_triton import sparse_mla_per_query

D_V, D = 32, 48
FAILURES: list[str] = []


def _check(name: str, ok: bool) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}", flush=True)
    if not ok:
        FAILURES.append(name)


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float16, torch.float32):
        for b, hb, g in ((2, 8, 1), (4, 2, 1), (2, 4, 2), (1, 8, 2)):
            t, k, r = 9, 13, 40
            q = torch.randn(b, t + 2, hb, D, generator=gen).to(dtype)[:, 1:-1]  # a strided view
            kv = torch.randn(r, D, generator=gen).to(dtype)
            rows = torch.randint(-2, r + 2, (t, k), generator=gen, dtype=torch.int32)
            rows[3] = -1
            plain = q.movedim(0, 1).reshape(t, b * hb, D)
            out = torch.full((b, t, hb, D_V), float("nan"), dtype=dtype)
            lse = torch.full((b, t, hb), float("nan"))
            name = f"{dtype}".replace("torch.", "") + f"[B={b},Hb={hb},G={g}]"
            if g == 1:
                want = sparse_mla_per_query(plain, kv, rows, scale=0.3, v_dim=D_V)
                sparse_mla_per_query(q, kv, rows, scale=0.3, v_dim=D_V, out=out, lse=lse)
            else:
                want = sparse_mla_grouped_prefill(plain, kv, rows, scale=0.3, v_dim=D_V, group_size=g)
                sparse_mla_grouped_prefill(q, kv, rows, scale=0.3, v_dim=D_V, group_size=g, out=out, lse=lse)
            got_out = out.movedim(0, 1).reshape(t, b * hb, D_V)
            got_lse = lse.movedim(0, 1).reshape(t, b * hb)
            written = not got_out.isnan().any() and not got_lse.isnan().any()
            _check(name, written and torch.equal(got_out, want[0]) and torch.equal(got_lse, want[1]))
    print(f"{len(FAILURES)} failures", flush=True)
    raise SystemExit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
