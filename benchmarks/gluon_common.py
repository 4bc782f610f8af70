"""Checks shared by the Gluon benchmarks: edge-case rows, comparison with the fp32 reference,
the compiled kernels' resources."""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from prefill_inputs import D_R, D_V, make_case, rel_err

from shardattn.ops.sparse_mla import sparse_mla_reference


def edge_rows(rows: torch.Tensor, kv_rows: int, seed: int):
    """Rows with invalid entries anywhere, an empty row, duplicates, out-of-range rows, short lengths."""
    t = rows.shape[0]
    rows = rows.clone()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rows[(torch.rand(rows.shape, generator=gen) < 0.05).to(rows.device)] = -1
    rows[5] = -1  # empty
    half = rows.shape[1] // 2
    rows[7, :half] = rows[7, half : 2 * half]  # every row twice
    rows[9, -10:] = kv_rows + 5  # out of range
    rows[9, :3] = -7
    length = torch.full((t,), rows.shape[1], dtype=torch.int32, device=rows.device)
    length[11] = 100
    length[12] = 0
    length[13] = 1
    length[t - 1] = 65  # a tail tile of one key
    return rows, length


def check_inputs(t: int, kv_rows: int, topk: int, seed: int, kv_seed: int):
    """A check's inputs on the GPU: DSA rows of ``t`` tokens with :func:`edge_rows`' edge cases,
    their lengths, and a bf16 KV cache ``[kv_rows, D_V + D_R]`` drawn from a generator seeded
    ``kv_seed``, returned too (the caller draws its queries from it)."""
    _, _, _, _, rows, _ = make_case(t, kv_rows, topk, "dsa", seed)
    rows, length = edge_rows(rows, kv_rows, seed)
    gen = torch.Generator(device=rows.device).manual_seed(kv_seed)
    kv = torch.randn(kv_rows, D_V + D_R, device=rows.device, generator=gen).to(torch.bfloat16)
    return rows, length, gen, kv


def compare(out, lse, q, kv, rows, length, sinks, scale) -> dict:
    """Every element written, out rel. error and LSE error against the fp32 reference, empty rows."""
    ref_o, ref_l = sparse_mla_reference(q, kv, rows, scale=scale, v_dim=D_V, topk_length=length, sinks=sinks)
    fin = torch.isfinite(ref_l)
    empty = ~torch.isfinite(ref_l[:, 0]) if sinks is None else length == 0
    res = {
        "all_written": bool(torch.isfinite(out).all()) and not bool(lse.isnan().any()),
        "out_rel_err": rel_err(out, ref_o),
        "lse_max_abs_err": (lse[fin] - ref_l[fin]).abs().max().item(),
        "lse_inf_match": bool(torch.equal(torch.isneginf(lse), torch.isneginf(ref_l))),
        "empty_rows_zero": bool((out[empty] == 0).all()),
    }
    res["ok"] = (
        res["all_written"] and res["out_rel_err"] < 1e-2 and res["lse_max_abs_err"] < 1e-2 and res["lse_inf_match"]
    ) and res["empty_rows_zero"]
    return res


def kernel_report() -> list[dict]:
    from shardattn.kernels.gluon.sparse_mla_kernel import ws64_kernel

    rep = []
    kernels = (ws64_kernel(),)
    for entry in [c for k in kernels for c in k.device_caches.values()]:
        for kern in entry[0].values():
            ptx = kern.asm.get("ptx", "")
            md = kern.metadata
            rep.append({
                "name": getattr(md, "name", "?"), "shared": getattr(md, "shared", None),
                "n_regs": getattr(kern, "n_regs", None), "n_spills": getattr(kern, "n_spills", None),
                "wgmma_in_ptx": ptx.count("wgmma.mma_async"), "cp_async_in_ptx": ptx.count("cp.async.cg"),
            })  # fmt: skip
    return rep
