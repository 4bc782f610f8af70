"""Union builders against each other and the grouped steps they feed (``sparse_prefill.py --union-only``).

One command (one device call)::

    python benchmarks/sparse_prefill.py --union-only --heads 8 16 32 --tokens 4096 16384

times the union builders (``method`` sort / merge, ``row_sort`` torch / triton) per G against the
``"sort"`` builder in the same run, checks each exactly against the torch reference on edge-case
rows (and rows up to ``2**24 - 2``), then times the grouped step (union + kernel) at ``--heads``
with the old and the fastest new builder, and the per-query path with each row sort.
"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from prefill_inputs import D_R, D_V, attention_buffers, make_case, random_qkv, timed, union_buffers

from shardattn.kernels.sparse_mla_triton import flops, launch_attention, tile_config
from shardattn.kernels.union import build_union, build_union_reference
from shardattn.plan.routing import tile_group_size

UNION_VARIANTS = (("sort", "torch"), ("merge", "torch"), ("merge", "triton"), ("sort", "triton"))


def _edge_rows(rows: torch.Tensor, kv_rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with invalid entries, an empty row, duplicates, out-of-range rows, a short length."""
    t = rows.shape[0] - 3  # a tail group for every G
    rows = rows[:t].clone()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rows[(torch.rand(rows.shape, generator=gen) < 0.05).to(rows.device)] = -1
    rows[5] = -1
    half = rows.shape[1] // 2
    rows[7, :half] = rows[7, half : 2 * half]
    rows[9, -10:] = kv_rows + 5
    rows[12] = rows[13]  # identical neighbours
    length = torch.full((t,), rows.shape[1], dtype=torch.int32, device=rows.device)
    length[11] = min(100, half)
    return rows, length


def _union_exact(got, want) -> bool:
    (u, n), (ru, rn) = got, want
    prefix = torch.arange(u.shape[1], device=u.device)[None, :] < rn[:, None]
    return bool(torch.equal(n, rn) and torch.equal(u[prefix], ru[prefix]))


def _time_union_variants(rows, tokens, kv_rows, topk, reps, flush) -> list[dict]:
    """Every builder per G on ``rows`` (timed) and on edge-case rows (exact vs the reference)."""
    dev = rows.device
    edge, length = _edge_rows(rows, kv_rows, 1)
    out = []
    for g in (1, 2, 4, 8):
        want = build_union_reference(edge, group_size=g, num_kv_rows=kv_rows, topk_length=length)
        buf = union_buffers(tokens, topk, g, dev)
        base = None
        for method, row_sort in UNION_VARIANTS:
            if (g == 1 and method == "merge") or (g > 1 and (method, row_sort) == ("sort", "triton")):
                continue  # G = 1 has no merge; row_sort only matters to the merge builder when G > 1
            kw = {"group_size": g, "num_kv_rows": kv_rows, "method": method, "row_sort": row_sort}
            exact = _union_exact(build_union(edge, topk_length=length, **kw), want)
            ms = timed(lambda kw=kw: build_union(rows, out=buf, **kw), flush, reps)  # noqa: B023
            base = ms if base is None else base
            r = {"mode": "union", "tokens": tokens, "G": g, "method": method, "row_sort": row_sort,
                 "ms": round(ms, 4), "x_sort": round(base / ms, 2), "exact": exact}  # fmt: skip
            out.append(r)
            print(f"{tokens:>6} {g:>2} {method:>6} {row_sort:>6} | {ms:>7.3f} {base / ms:>6.2f} | {exact}", flush=True)
    return out


def _top_rows_exact(topk: int) -> list[dict]:
    """Exactness with rows up to ``2**24 - 2`` (KV cache of ``2**24 - 1`` rows), every builder."""
    gen = torch.Generator(device="cpu").manual_seed(2)
    top = torch.randint(2**24 - 6000, 2**24 + 2, (61, topk), generator=gen, dtype=torch.int32).cuda()
    top[:, ::7] = 2**24 - 2
    out = []
    for g in (1, 2, 4, 8):
        want = build_union_reference(top, group_size=g, num_kv_rows=2**24 - 1)
        for method, row_sort in UNION_VARIANTS:
            got = build_union(top, group_size=g, num_kv_rows=2**24 - 1, method=method, row_sort=row_sort)
            out.append({"mode": "union_top_rows", "G": g, "method": method, "row_sort": row_sort,
                        "exact": _union_exact(got, want)})  # fmt: skip
    return out


def _step_case(heads, tokens, kv_rows, topk, best, reps, flush) -> dict:
    """Grouped step with the old (sort) and the ``best`` builder; per-query path per row sort."""
    dev = torch.device("cuda")
    scale = (D_V + D_R) ** -0.5
    _, _, _, _, rows, counts = make_case(tokens, kv_rows, topk, "dsa", 0)
    g = tile_group_size(heads)
    q, kv = random_qkv(tokens, heads, kv_rows, 0, dev)
    u, ln = union_buffers(tokens, topk, g, dev)
    u1, l1 = union_buffers(tokens, topk, 1, dev)
    out, lse = attention_buffers(q)
    cfg_g, cfg_1 = tile_config(heads, g), tile_config(heads, 1)

    def union(method, row_sort):
        build_union(rows, group_size=g, num_kv_rows=kv_rows, out=(u, ln), method=method, row_sort=row_sort)

    def step(method, row_sort):
        union(method, row_sort)
        launch_attention(q, kv, u, ln, scale=scale, v_dim=D_V, config=cfg_g, out=out, lse=lse)

    def perq(row_sort):
        build_union(rows, group_size=1, num_kv_rows=kv_rows, out=(u1, l1), row_sort=row_sort)
        launch_attention(q, kv, u1, l1, scale=scale, v_dim=D_V, config=cfg_1, out=out, lse=lse)

    new = (best["method"], best["row_sort"])
    ms = {
        "union_old": timed(lambda: union("sort", "torch"), flush, reps),
        "union_new": timed(lambda: union(*new), flush, reps),
        "step_old": timed(lambda: step("sort", "torch"), flush, reps),
        "step_new": timed(lambda: step(*new), flush, reps),
        "perq_torch": timed(lambda: perq("torch"), flush, reps),
        "perq_triton": timed(lambda: perq("triton"), flush, reps),
    }
    fl = flops(int(counts.sum()), heads)
    return {
        "mode": "step",
        "heads": heads,
        "tokens": tokens,
        "G": g,
        "variant": list(new),
        "ms": {k: round(v, 4) for k, v in ms.items()},
        "tflops": {k: round(fl / (v * 1e-3) / 1e12, 1) for k, v in ms.items() if not k.startswith("union")},
        "share_old": round(ms["union_old"] / ms["step_old"], 3),
        "share_new": round(ms["union_new"] / ms["step_new"], 3),
    }


def union_only(args, flush) -> list[dict]:
    """Union builders per G (old sort vs merge), exactness on the GPU, then grouped steps."""
    results = []
    print(f"{'T':>6} {'G':>2} {'method':>6} {'rows':>6} | {'ms':>7} {'x sort':>6} | exact", flush=True)
    for tokens in args.tokens:
        kv_rows = args.kv_rows or (65536 if tokens <= 4096 else 131072)
        _, _, _, _, rows, _ = make_case(tokens, kv_rows, args.topk, "dsa", 0)
        results += _time_union_variants(rows, tokens, kv_rows, args.topk, args.reps, flush)
    results += _top_rows_exact(args.topk)
    print("rows up to 2**24-2 exact:", all(r["exact"] for r in results if r["mode"] == "union_top_rows"), flush=True)
    print(f"{'H':>4} {'T':>6} {'G':>2} | {'union old':>9} {'new':>7} {'variant':>13} | {'step old':>8} {'new':>7} "
          f"{'share old/new':>13} | {'perq torch':>10} {'triton':>7}", flush=True)  # fmt: skip
    for tokens in args.tokens:
        kv_rows = args.kv_rows or (65536 if tokens <= 4096 else 131072)
        for heads in args.heads:
            g = tile_group_size(heads)
            unions = [r for r in results if r["mode"] == "union" and r["tokens"] == tokens and r["G"] == g]
            best = min(unions, key=lambda r: r["ms"])
            r = _step_case(heads, tokens, kv_rows, args.topk, best, args.reps, flush)
            results.append(r)
            ms, var = r["ms"], "/".join(r["variant"])
            print(f"{heads:>4} {tokens:>6} {g:>2} | {ms['union_old']:>9.3f} {ms['union_new']:>7.3f} {var:>13} | "
                  f"{ms['step_old']:>8.3f} {ms['step_new']:>7.3f} {r['share_old']:>6.2f}/{r['share_new']:<6.2f} | "
                  f"{ms['perq_torch']:>10.3f} {ms['perq_triton']:>7.3f}", flush=True)  # fmt: skip
    return results
