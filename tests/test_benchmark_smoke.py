"""The GPU benchmarks still run: each one's CPU dry run (gloo, tiny sizes) finishes and prints its table.

A benchmark that rots is found on the GPU machine, where time is scarce; these dry runs find it in CI.
They check that the scripts run end to end and that their own correctness checks pass (ShardQ's
bits equal the unpipelined step's), not their speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def _run(args: list[str], timeout: float = 240.0) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


def _torchrun(script: str, *args: str) -> str:
    return _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(BENCH / script), *args])


def test_shardq_overlap_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "shardq.json"
    text = _torchrun(
        "shardq_overlap.py", "--cpu", "--presets", "glm5", "--tokens", "1024", "--topk", "16",
        "--requests", "1", "--cached", "64", "--iters", "2", "--json", str(out),
        "--chunks", "4", "--taper", "--one-union",
    )  # fmt: skip
    assert "| glm5 | 1024 |" in text
    rows = json.loads(out.read_text())  # one record per (preset, tokens)
    # every variant (tapered, one union build, both) is timed and gave the plain step's bits
    assert rows and all(r["bit_equal_c1_before"] and r["finite"] and r["one_union_fits"] for r in rows)
    assert all(set(r["variants"]) == {"shardq_c4_taper", "shardq_c4_1u", "shardq_c4_taper_1u"} for r in rows)
    assert "| glm5 | 1024 | shardq_c4_taper_1u | 4 |" in text


def test_scaling_dry_run_and_predictions(tmp_path: Path) -> None:
    out = tmp_path / "scaling.json"
    text = _torchrun(
        "scaling.py", "--tokens", "512", "--topk", "16", "--reps", "1", "--configs", "0", "--json", str(out)
    )
    assert "| glm5 (64 heads) | 512 |" in text
    assert out.exists() and json.loads(out.read_text())
    text = _run([sys.executable, str(BENCH / "scaling.py"), "--predict-only", "--simulate", "4", "8"])
    assert "| 8 | 1 x 8 | glm5" in text and "| 4 | 1 x 4 | deepseek-v32" in text


def test_scaling_simulates_hosts_and_shows_where_the_network_changes_the_route(tmp_path: Path) -> None:
    """2 x 8 and 4 x 8 H200s on the shipped table: ShardQ's all-to-all sends half (3/4) of its bytes
    over a 50 GB/s NIC, so glm5 at 32K tokens on 2 x 8 takes head-TP where one host of 16 takes ShardQ."""
    out = tmp_path / "sim.json"
    args = ["--predict-only", "--gpu", "NVIDIA H200", "--simulate", "16", "32", "--nodes", "2", "4"]
    text = _run([sys.executable, str(BENCH / "scaling.py"), *args, "--json", str(out)])
    assert "between hosts: ib-ndr, 50 GB/s per GPU" in text and "| 16 | 2 x 8 | glm5" in text
    rows = json.loads(out.read_text())["simulated"]
    assert {(r["world_size"], r["nodes"]) for r in rows} == {(16, 2), (32, 4)}
    glm5 = next(r for r in rows if r["label"] == "glm5" and r["world_size"] == 16 and r["tokens"] == 32768)
    assert glm5["router_path"].startswith("shardq/") and glm5["router_nodes_path"].startswith("headtp/")
    assert glm5["shardq_nodes_ms"] > glm5["headtp_ms"] > glm5["shardq_ms"]
    assert "glm5 T=32768 W=16: one host shardq/per-query" in text
    # crossing hosts only ever adds to ShardQ's time here (the network is slower than NVLink)
    assert all(r["shardq_nodes_ms"] >= r["shardq_ms"] for r in rows)


def test_ptx_hints_rewrite_every_gather_and_wait() -> None:
    """``benchmarks/ptx_hints.py``'s rewrites (FlashMLA's L2 hints, CUTLASS's suspend hint) reach
    every ``cp.async`` gather and mbarrier wait of the routed kernel's PTX as Triton emits it, so an
    emitter change that makes them silently rewrite nothing fails here."""
    import pytest

    from shardattn.kernels.sparse_mla_gluon import compile_for_sm90, gluon_available

    if gluon_available() is not None:
        pytest.skip(gluon_available())
    sys.path.insert(0, str(BENCH))
    import ptx_hints

    ptx = compile_for_sm90("prefill", 64)
    gathers, waits = ptx.count("cp.async.cg.shared.global ["), ptx.count("mbarrier.try_wait.parity")
    assert gathers > 0 and waits > 0
    assert ptx_hints.rewrite(ptx, "none") == ptx
    assert ptx_hints.rewrite(ptx, "256").count("cp.async.cg.shared.global.L2::256B [") == gathers
    evict = ptx_hints.rewrite(ptx, "el256")
    assert evict.count("L2::cache_hint.L2::256B [") == gathers and evict.count("createpolicy") == 1
    assert ptx_hints.rewrite(ptx, "sleep").count(", 10000000;") == waits


def test_small_decode_probes_compile_for_sm90(tmp_path: Path) -> None:
    """The small-decode probes that run only on a GPU still compile for sm_90 (CPU, ahead of time):
    ``decode_combine_floor.py``'s two-launch kernel and its 16-block cluster kernel (the barrier
    only from stage 2, per-block stores), and ``decode_small_timeline.py``'s stamped copy of the
    library's split kernel (every stamp statement found, ten clock reads)."""
    import pytest

    from shardattn.kernels.gluon_compat import compile_sm90
    from shardattn.kernels.sparse_mla_gluon import gluon_available

    if gluon_available() is not None:
        pytest.skip(gluon_available())
    sys.path.insert(0, str(BENCH))
    import decode_combine_floor
    import decode_small_tiles
    import decode_small_timeline

    from shardattn.kernels.sparse_mla_decode_gluon_small import small_decode_warps

    # the tile probe times every tile the routing can take
    assert {(b, small_decode_warps(b)) for b in (64, 128)} <= set(decode_small_tiles.TILES)

    names = ["KV", "Rows", "Part", "Lse", "Out", "LseOut", "stride_kv", "K", "T"]
    types = ["*bf16", "*i32", "*fp32", "*fp32", "*fp32", "*fp32", "i32", "i32", "i32"]
    aligned = ("KV", "Rows", "Part", "Out", "stride_kv", "K")
    for stage in range(4):
        sig = {**dict(zip(names, types, strict=True)), "BN": "constexpr", "STAGE": "constexpr"}
        ptx = compile_sm90(decode_combine_floor._cluster_combine, sig, {"BN": 128, "STAGE": stage}, aligned=aligned,
                           options={"num_warps": 4, "num_ctas": 16}).asm["ptx"]  # fmt: skip
        assert ".reqnctapercluster 16" in ptx and "%cluster_ctarank" in ptx
        assert ("barrier.cluster.arrive.release" in ptx) == (stage >= 2)
        assert ("st.global.v4.f32" in ptx) == (stage >= 1)  # the partial, from every block
    sig = {**dict(zip(names[:5] + names[6:], types[:5] + types[6:], strict=True)), "BN": "constexpr"}
    sig["PARTIAL"] = "constexpr"
    plain_aligned = ("KV", "Rows", "Part", "stride_kv", "K")
    sig["HG"] = "constexpr"
    for group in (16, 8):
        ptx = compile_sm90(decode_combine_floor._gather_partial, sig, {"BN": 64, "PARTIAL": True, "HG": group},
                           aligned=plain_aligned, options={"num_warps": 4}).asm["ptx"]  # fmt: skip
        assert ptx.count("griddepcontrol.wait") == 1 and ptx.count("griddepcontrol.launch_dependents") == 1
    stamped = decode_small_timeline.stamped_module(tmp_path)
    src = (tmp_path / "small_stamped.py").read_text()
    assert src.count("        _stamp(Tm, ") == 10
    small_sig = ["Q", "KV", "Rows", "TopkLen", "Sinks", "Out", "Lse", "stride_qt", "stride_qh", "stride_kvr",
                 "stride_rt", "stride_rk", "K", "R", "H", "HG", "stride_os", "stride_ot", "stride_oh", "stride_ls",
                 "stride_lt", "stride_lh", "qk_scale", "Tm"]  # fmt: skip
    small_types = ["*bf16", "*bf16", "*i32", "*i32", "*fp32", "*fp32", "*fp32"] + ["i32"] * 15 + ["fp32", "*i64"]
    constexprs = {"HP": 8, "BLOCK_N": 64, "DV": 512, "DR": 64, "EVEN_K": True, "HAS_TOPK_LEN": False,
                  "HAS_SINKS": False, "PDL": False, "NCHUNK": 4, "W": 4}  # fmt: skip
    sig = {**dict(zip(small_sig, small_types, strict=True)), **dict.fromkeys(constexprs, "constexpr")}
    aligned = ("Q", "KV", "Rows", "Out", "stride_qt", "stride_qh", "stride_kvr", "stride_rt", "K", "stride_os",
               "stride_ot", "stride_oh")  # fmt: skip
    ptx = compile_sm90(stamped._small_split_kernel, sig, constexprs, aligned=aligned,
                       options={"num_warps": 4}).asm["ptx"]  # fmt: skip
    assert ptx.count("%clock64") == 10
