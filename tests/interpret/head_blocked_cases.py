"""The sparse-prefill Triton kernel reading q and writing out / LSE head-blocked, under the interpreter.

Run as ``TRITON_INTERPRET=1 python -m tests.interpret.head_blocked_cases`` (tests/test_shardq_chunked.py
does this in a subprocess). Head-blocked ``[B, T, H/B, ...]`` tensors are all-to-all buffers the
pipelined ShardQ step hands the kernel in place; the result must equal the plain ``[T, H, ...]``
launch bit for bit (same kernel, same arithmetic, other addresses), and every element of the
destinations must be written. fp16 and fp32 (the interpreter mishandles bf16 dots).

Also: kernel calls on ``G``-aligned chunks of a share, each handed its slice of the share's union
built once (``prepared_union``, ShardQ's ``one_union``), equal the calls that build their own
union and one call over the whole share, bit for bit (Triton union builders and kernel).
"""

from __future__ import annotations

import torch

from shardattn.ops.prepared_union import prepare_union
from shardattn.ops.sparse_mla import sparse_mla_per_query
from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill

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
                sparse_mla_per_query(q, kv, rows, scale=0.3, v_dim=D_V, out=out, lse_out=lse)
            else:
                want = sparse_mla_grouped_prefill(plain, kv, rows, scale=0.3, v_dim=D_V, group_size=g)
                sparse_mla_grouped_prefill(q, kv, rows, scale=0.3, v_dim=D_V, group_size=g, out=out, lse_out=lse)
            got_out = out.movedim(0, 1).reshape(t, b * hb, D_V)
            got_lse = lse.movedim(0, 1).reshape(t, b * hb)
            written = not got_out.isnan().any() and not got_lse.isnan().any()
            _check(name, written and torch.equal(got_out, want[0]) and torch.equal(got_lse, want[1]))
    prepared_union_cases(gen)
    print(f"{len(FAILURES)} failures", flush=True)
    raise SystemExit(1 if FAILURES else 0)


def prepared_union_cases(gen: torch.Generator) -> None:
    """Chunks [0, 4), [4, 8), [8, 11) of an 11-token share (a tail group), invalid rows anywhere,
    an empty row, topk_length; per-query (G = 1) and grouped G = 1 / 2 / 4 entries."""
    t, h, k, r = 11, 4, 9, 30
    q = torch.randn(t, h, D, generator=gen)
    kv = torch.randn(r, D, generator=gen)
    rows = torch.randint(-3, r + 3, (t, k), generator=gen, dtype=torch.int32)
    rows[5] = -1
    length = torch.randint(0, k + 1, (t,), generator=gen, dtype=torch.int32)
    for name, g in (("per-query", 1), ("grouped", 1), ("grouped", 2), ("grouped", 4)):
        kw: dict = dict(scale=0.3, v_dim=D_V)
        if name == "per-query":  # the per-query Triton launcher itself (the public entry takes it on GPUs)
            call, key = sparse_mla_per_query, "prepared_union"
        else:
            call, key = sparse_mla_grouped_prefill, "prepared_union"
            kw["group_size"] = g
        whole = prepare_union(rows, group_size=g, num_kv_rows=r, topk_length=length)
        one_call = call(q, kv, rows, topk_length=length, **kw)
        ok = True
        for b0, b1 in ((0, 4), (4, 8), (8, t)):
            part = (q[b0:b1], kv, rows[b0:b1])
            mine = call(*part, topk_length=length[b0:b1], **{key: whole.tokens(b0, b1)}, **kw)
            own = call(*part, topk_length=length[b0:b1], **kw)
            ok &= all(torch.equal(a, b) and torch.equal(a, c[b0:b1]) for a, b, c in zip(mine, own, one_call))
        # the kernel does read the prepared union: chunk [4, 8) given chunk [0, 4)'s union differs
        wrong = call(q[4:8], kv, rows[4:8], topk_length=length[4:8], **{key: whole.tokens(0, 4)}, **kw)
        ok &= not torch.equal(wrong[0], one_call[0][4:8])
        _check(f"prepared union slices [{name}, G={g}]", ok)


if __name__ == "__main__":
    main()
