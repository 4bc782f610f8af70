"""The routed Gluon per-query prefill kernel timed beside the GPU's SM clock, power and temperature.

Run-to-run spread of the 128-head kernel reached 7 % on one H200 (benchmarks/RESULTS.md, "Per-query
prefill after the change"), and T = 16K measured below T = 4K. This script asks whether the clock
explains it: ``nvidia-smi`` samples the SM clock, power, temperature and the active clock-event
(throttle) reasons every 20 ms in the background while

1. each case (heads x T, DSA-like top-k 2048, KV 64K / 128K rows as in ``gluon_check.py``) is timed
   as there (L2 flushed, device held after each flush, CUDA-event medians); the table gives the
   median ms, the effective TF/s, the mean SM clock over the case's timed window and the TF/s the
   kernel would reach at the GPU's maximum SM clock if its time scaled with the clock (a
   compute-bound kernel's does; labelled as the assumption it is);
2. the last case runs back to back for ``--sustain`` seconds (no flush, no pause), and the clock
   and power are reported per quarter of that window;
3. every case is timed again, right after, on the hot GPU;
4. with ``--variants``, first, each named ``gluon_check.py`` variant runs back to back on the last
   case for ``--sustain`` seconds, in turn, twice: TF/s, clock, power and joules per TFLOP at the
   power limit (``--variants-only``: just that).

With ``--peer-lib`` (a shared library built by ``benchmarks/peer/build_flashmla_peer.sh`` from a
FlashMLA checkout, which is not part of shardattn) FlashMLA's SM90 sparse-prefill kernel runs on the
same inputs: its output is checked against the routed kernel's, it is timed beside it in every
pass, and ``flashmla`` may be named among ``--variants``.

    python benchmarks/prefill_clocks.py --heads 64 128 --tokens 4096 16384 --out clocks.json
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import json
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from prefill_inputs import D_R, D_V, attention_buffers, make_case, random_qkv, rel_err, timed, union_buffers

from shardattn.kernels.gluon.sparse_mla import gluon_config, launch_gluon_attention
from shardattn.ops.sparse_mla import flops
from shardattn.ops.union import build_union

FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


class Sampler:
    """``nvidia-smi`` sampling GPU 0 every ``period_ms`` into a temporary file until :meth:`stop`."""

    def __init__(self, period_ms: int = 20):
        self.file = tempfile.NamedTemporaryFile("w+", suffix=".csv")  # noqa: SIM115 - closed in stop()
        cmd = ["nvidia-smi", "-i", "0", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits"]
        cmd.append(f"--loop-ms={period_ms}")
        self.proc = subprocess.Popen(cmd, stdout=self.file, stderr=subprocess.DEVNULL)
        time.sleep(0.5)

    def stop(self) -> list[tuple[dt.datetime, float, float, float, str]]:
        """Stops sampling; returns ``(local time, SM MHz, W, deg C, reasons)`` per sample."""
        self.proc.terminate()
        self.proc.wait()
        self.file.seek(0)
        lines = self.file.readlines()
        self.file.close()
        samples = []
        for line in lines:
            parts = [p.strip() for p in line.split(",")]
            try:
                when = dt.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f")
                samples.append((when, float(parts[1]), float(parts[2]), float(parts[3]), parts[4]))
            except (ValueError, IndexError):
                continue
        return samples


def window(samples, start: dt.datetime, end: dt.datetime) -> dict:
    """Mean SM clock / power / temperature and the reasons seen between ``start`` and ``end``."""
    inside = [s for s in samples if start <= s[0] <= end]
    if not inside:
        return {"samples": 0}
    return {
        "samples": len(inside),
        "sm_mhz": round(statistics.fmean(s[1] for s in inside), 1),
        "sm_mhz_min": min(s[1] for s in inside),
        "watts": round(statistics.fmean(s[2] for s in inside), 1),
        "temp_c": max(s[3] for s in inside),
        "reasons": sorted({s[4] for s in inside}),
    }


def max_sm_clock() -> float:
    out = subprocess.run(
        ["nvidia-smi", "-i", "0", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return float(out.stdout.strip())


PEER = "flashmla"


def peer_runner(lib: ctypes.CDLL, q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, scale: float):
    """A closure launching FlashMLA's SM90 sparse prefill (``lib``, built by
    ``benchmarks/peer/build_flashmla_peer.sh``) on ``q [T, H, 576]``, ``kv [N, 576]`` and per-query
    ``rows [T, topk]`` int32 (-1 invalid); returns ``(run, out [T, H, 512] bf16, lse [T, H] fp32)``."""
    t, h, d = q.shape
    if h not in (64, 128) or rows.shape[1] % 128 or d != D_V + D_R:
        raise ValueError(f"the peer takes 64 or 128 heads and top-k a multiple of 128, got {h} / {rows.shape[1]}")
    out = torch.empty(t, h, D_V, dtype=q.dtype, device=q.device)
    lse = torch.empty(t, h, dtype=torch.float32, device=q.device)
    max_logits = torch.empty_like(lse)
    idx = rows.contiguous()
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    fn = lib.flashmla_sparse_prefill_sm90
    fn.restype = ctypes.c_int
    ptr = ctypes.c_void_p
    args = (ptr(q.data_ptr()), ptr(kv.data_ptr()), ptr(idx.data_ptr()), ptr(out.data_ptr()),
            ptr(max_logits.data_ptr()), ptr(lse.data_ptr()), t, kv.shape[0], h, idx.shape[1],
            q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), ctypes.c_float(scale), sms)  # fmt: skip

    def run(_alive=(q, kv, idx, out, max_logits, lse)):  # the peer gets raw pointers: keep the tensors
        rc = fn(*args, ptr(torch.cuda.current_stream().cuda_stream))
        if rc:
            raise RuntimeError(f"flashmla_sparse_prefill_sm90 returned {rc}")

    return run, out, lse


def setup(heads: int, tokens: int, topk: int, config=None, peer: ctypes.CDLL | None = None):
    """Inputs of one case and a closure launching the per-query Gluon kernel on them: ``config``
    (a :class:`~shardattn.kernels.gluon.sparse_mla.GluonConfig`), the routed one by default; with
    ``peer`` (FlashMLA's library) the closure launches the peer instead, after checking its output
    against the routed kernel's on these inputs."""
    dev = torch.device("cuda")
    kv_rows = 65536 if tokens <= 4096 else 131072
    _, _, _, _, rows, counts = make_case(tokens, kv_rows, topk, "dsa", 0)
    q, kv = random_qkv(tokens, heads, kv_rows, 0, dev)
    u, ln = union_buffers(tokens, topk, 1, dev)
    build_union(rows, group_size=1, num_kv_rows=kv_rows, out=(u, ln))
    out, lse = attention_buffers(q)
    cfg = config or gluon_config(heads, 1)
    scale = (D_V + D_R) ** -0.5

    def run():
        launch_gluon_attention(q, kv, u, ln, scale=scale, v_dim=D_V, config=cfg, out=out, lse=lse)

    if peer is None:
        return run, flops(int(counts.sum()), heads), cfg.label
    run()
    peer_run, peer_out, peer_lse = peer_runner(peer, q, kv, rows, scale)
    peer_out.fill_(float("nan"))
    peer_run()
    torch.cuda.synchronize()
    err = rel_err(peer_out, out)
    has_rows = counts > 0
    lse_gap = (peer_lse[has_rows] - lse[has_rows]).abs().max().item()
    print(f"peer check {heads} x {tokens}: out rel err {err:.2e}, max |lse - routed lse| {lse_gap:.2e}")
    if not err < 2e-2:
        raise RuntimeError(f"the peer's output differs from the routed kernel's: rel err {err}")
    return peer_run, flops(int(counts.sum()), heads), PEER


def time_cases(cases, runs, flush, reps: int, what: str) -> list[tuple]:
    """Each case timed as ``gluon_check.py`` does; ``(case, kernel, flops, ms, start, end, what)``."""
    marks = []
    for c in cases:
        run, fl, label = runs[c]
        start = dt.datetime.now()
        ms = timed(run, flush, reps)
        marks.append((c, label, fl, ms, start, dt.datetime.now(), what))
    return marks


def sustained(run, seconds: float) -> tuple[int, float, dt.datetime, dt.datetime]:
    """``run`` back to back (no flush, no pause) for ``seconds``: ``(runs, seconds, start, end)``."""
    start = dt.datetime.now()
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            run()
        torch.cuda.synchronize()
        n += 10
    return n, time.perf_counter() - t0, start, dt.datetime.now()


def variant_config(label: str):
    """``gluon_check.py``'s variant named ``label`` (a :class:`~shardattn.kernels.gluon.sparse_mla.GluonConfig`)."""
    from gluon_check import VARIANTS

    by_label = {v.label: v for v in VARIANTS}
    if label not in by_label:
        raise ValueError(f"unknown variant {label!r}; gluon_check.py has {sorted(by_label)}")
    return by_label[label]


def compare_variants(
    labels: list[str], case: tuple[int, int], topk: int, seconds: float, rounds: int = 2, peer=None
) -> None:
    """Each of ``gluon_check.py``'s variants ``labels`` (or :data:`PEER`, with ``peer``) run
    sustained on ``case`` for ``seconds``, ``rounds`` times in turn, with the clock and power of each
    window: at the power limit the variant that spends fewer joules per FLOP runs at a higher clock."""
    if PEER in labels and peer is None:
        raise ValueError(f"variant {PEER!r} needs --peer-lib")
    h, t = case
    runs = {k: setup(h, t, topk, peer=peer) if k == PEER else setup(h, t, topk, variant_config(k)) for k in labels}
    for run, _, _ in runs.values():
        run()
    torch.cuda.synchronize()
    sampler = Sampler()
    marks = []
    for r in range(rounds):
        for label in labels:
            run, fl, _ = runs[label]
            n, secs, start, end = sustained(run, seconds)
            marks.append((r, label, fl * n / secs / 1e12, start, end))
    samples = sampler.stop()
    print(f"\nvariants sustained on {case} ({seconds} s each, {rounds} rounds in turn):")
    print("| round | variant | TF/s | SM MHz | W | J per TFLOP | TF/s per GHz |")
    print("|---|---|---|---|---|---|---|")
    for r, label, tf, start, end in marks:
        w = window(samples, start + (end - start) / 4, end)  # the first quarter settles
        mhz, watts = w.get("sm_mhz", float("nan")), w.get("watts", float("nan"))
        print(f"| {r + 1} | {label} | {tf:.0f} | {mhz:.0f} | {watts:.0f} | {watts / tf:.3f} | {tf / mhz * 1e3:.0f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--sustain", type=float, default=4.0, help="seconds of back-to-back runs of the first case")
    ap.add_argument("--out", default=None)
    ap.add_argument("--variants", nargs="*", default=[],
                    help="gluon_check.py variant labels, each run --sustain seconds on the last case")  # fmt: skip
    ap.add_argument("--variants-only", action="store_true", help="only the variant comparison")
    ap.add_argument("--peer-lib", default=None, help="FlashMLA's sparse prefill, built by benchmarks/peer/")
    ap.add_argument("--kernel", default=None, help="a gluon_check.py variant label to time instead of the routed one")
    ap.add_argument("--once", action="store_true", help="set up, check, launch each kernel once more and stop "
                    "(for a profiler such as ncu)")  # fmt: skip
    args = ap.parse_args(argv)
    peer = ctypes.CDLL(args.peer_lib) if args.peer_lib else None
    cases = [(h, t) for t in args.tokens for h in args.heads]
    config = variant_config(args.kernel) if args.kernel else None
    kernels = [None, PEER] if peer is not None else [None]
    if args.once:
        for c in cases:
            for k in kernels:
                setup(c[0], c[1], args.topk, config, peer=peer if k else None)[0]()
        torch.cuda.synchronize()
        return 0
    if args.variants:
        compare_variants(args.variants, cases[-1], args.topk, args.sustain, peer=peer)
        if args.variants_only:
            return 0
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    peak = max_sm_clock()
    runs = {(c, k): setup(c[0], c[1], args.topk, config, peer=peer if k else None) for c in cases for k in kernels}
    for run, _, _ in runs.values():  # compile and warm every kernel before the sampler starts
        run()
    torch.cuda.synchronize()
    sampler = Sampler()
    marks = [time_cases(list(runs), runs, flush, args.reps, "first pass")]
    run, fl, _ = runs[(cases[-1], None)]
    n, elapsed, sustain_start, sustain_end = sustained(run, args.sustain)
    marks.append(time_cases(list(runs), runs, flush, args.reps, "after the sustained runs"))
    samples = sampler.stop()
    rows = []
    print(f"max SM clock {peak:.0f} MHz; {len(samples)} samples")
    print("| pass | heads | T | kernel | ms | TF/s | SM MHz (mean / min) | W | deg C "
          "| TF/s at max clock (time ~ 1/clock) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for ((h, t), _), label, fl_c, ms, s, e, what in [m for ms_ in marks for m in ms_]:
        w = window(samples, s, e)
        tf = fl_c / (ms * 1e-3) / 1e12
        scaled = tf * peak / w["sm_mhz"] if w.get("sm_mhz") else float("nan")
        rows.append({"pass": what, "heads": h, "tokens": t, "kernel": label, "ms": ms, "tflops": tf,
                     "at_max_clock": scaled, **w})  # fmt: skip
        clock = f"{w.get('sm_mhz', 0):.0f} / {w.get('sm_mhz_min', 0):.0f}"
        print(f"| {what} | {h} | {t} | {label} | {ms:.3f} | {tf:.0f} | {clock} | {w.get('watts', 0):.0f} "
              f"| {w.get('temp_c', 0):.0f} | {scaled:.0f} |")  # fmt: skip
        print(f"    clock-event reasons in the window: {w.get('reasons')}")
    tf_sus = fl * n / elapsed / 1e12
    print(f"\nsustained: {cases[-1]} x {n} runs back to back in {elapsed:.2f} s: {tf_sus:.0f} TF/s (host-timed)")
    quarter = (sustain_end - sustain_start) / 4
    quarters = []
    for i in range(4):
        w = window(samples, sustain_start + i * quarter, sustain_start + (i + 1) * quarter)
        quarters.append(w)
        print(f"  quarter {i + 1}: {w}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"max_sm_mhz": peak, "cases": rows, "sustained": quarters, "sustained_tflops": tf_sus}, f,
                      indent=1, default=str)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
