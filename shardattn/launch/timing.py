"""Timing, profiling and checking one prepared step on every rank of the launcher.

Times are whole steps on each rank: host clock around the call with the device synchronised
before and after, ranks starting each iteration together (a barrier on the gloo control group,
where a dead peer shows up). ``--check`` gathers every rank's output on rank 0 and compares it
with its slice of the single-process reference.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from shardattn.launch.prepare import Prepared
from shardattn.launch.progress import RunProgress
from shardattn.launch.report import summarize_times
from shardattn.runtime.runtime import Runtime

if TYPE_CHECKING:
    from shardattn.launch.run_config import RunConfig

__all__ = ["check_step", "graph_row", "profile_step", "step_row", "sync", "time_step"]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(
    prep: Prepared, cfg: RunConfig, control: dist.ProcessGroup, progress: RunProgress, label: str
) -> tuple[list[float], Any]:
    """``--warmup`` untimed and ``--iters`` timed calls; the first call makes the ranks agree on the
    step's plan and inputs (the steps' own check), the timed ones skip that host round trip.
    ``progress`` (rank 0's) counts both phases under ``label``."""
    result = None
    dist.barrier(group=control)  # on the host (gloo): a dead peer fails here, not inside a GPU collective
    progress.phase(f"{label}: warm-up ({prep.path})", total=cfg.opts.warmup)
    for i in range(cfg.opts.warmup):
        result = prep.call(i == 0)
        progress.advance()
    times = []
    progress.phase(f"{label}: timing ({prep.path})", total=cfg.iters)
    for i in range(cfg.iters):
        dist.barrier(group=control)  # ranks start each iteration together; a dead peer shows up here
        sync(cfg.device)
        t0 = time.perf_counter()
        result = prep.call(cfg.opts.warmup == 0 and i == 0)
        sync(cfg.device)
        times.append(time.perf_counter() - t0)
        progress.advance()
    return times, result


def graph_row(
    prep: Prepared, cfg: RunConfig, rt: Runtime, control: dist.ProcessGroup, rank: int, eager: Any
) -> dict[str, Any]:
    """``--graph``: capture the decode step once (the Runtime's policy decides whether it may: a
    forbidden capture raises its ValueError), time ``--iters`` replays like the eager step, and
    require a replay to equal the eager output bitwise (so the eager step's check covers it)."""
    from shardattn.runtime.graph_capture import DecodeGraph

    q_lens = cfg.shape.query_lens
    rt.check_capture("decode", q_len_per_req=max(q_lens), ragged=len(set(q_lens)) > 1)
    dist.barrier(group=control)
    graph = DecodeGraph(lambda: prep.call(False), {})  # the step's inputs are fixed tensors here
    replayed = graph.replay()
    sync(cfg.device)
    if not all(torch.equal(a, b) for a, b in zip(replayed, eager) if a is not None):
        raise RuntimeError(f"rank {rank}: the CUDA graph replay of the decode step differs from the eager step")
    times = []
    for _ in range(cfg.iters):
        dist.barrier(group=control)
        sync(cfg.device)
        t0 = time.perf_counter()
        graph.replay()
        sync(cfg.device)
        times.append(time.perf_counter() - t0)
    row = step_row(rank, "decode", prep, times)
    row["path"] = f"{prep.path} (graph)"
    row["reason"] = f"CUDA graph replay ({rt.cudagraph_support('decode').name}), bitwise equal to the eager step"
    return row


def profile_step(prep: Prepared, cfg: RunConfig, control: dist.ProcessGroup, rank: int) -> None:
    """``--profile``: one more step under torch.profiler; rank 0 prints its busiest host ops.

    Host-side calls (kernel launches, synchronisations, copies to the host) show where a step's
    time goes when the device is not the bottleneck.
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cfg.device.type == "cuda" else [])
    dist.barrier(group=control)
    sync(cfg.device)
    with profile(activities=activities) as prof:
        prep.call(False)
        sync(cfg.device)
    if rank == 0:
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
        print(f"profile of one {prep.step} step on rank 0 ({prep.path}):\n{table}", flush=True)


def _error(got: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor]) -> float:
    """Largest output error, and LSE error relative to ``max(1, |lse|)``; inf when -inf patterns differ.

    Computed in fp32 on the reference's device (the GPU on a GPU run).
    """
    rout, rlse = (t.detach().float() for t in ref)
    out, lse = (t.detach().to(rout.device).float() for t in got)
    if out.shape != rout.shape or lse.shape != rlse.shape:
        return math.inf
    if bool(torch.isnan(out).any()) or bool(torch.isnan(lse).any()):
        return math.nan
    finite = torch.isfinite(rlse)
    if not torch.equal(finite, torch.isfinite(lse)):
        return math.inf
    err = float((out - rout).abs().max()) if out.numel() else 0.0
    if bool(finite.any()):
        rel = (lse[finite] - rlse[finite]).abs() / rlse[finite].abs().clamp(min=1.0)
        err = max(err, float(rel.max()))
    return err


def check_step(prep: Prepared, result: tuple[torch.Tensor, torch.Tensor], rt: Runtime, control: dist.ProcessGroup):
    """Gather every rank's output on rank 0 and compare each with its slice of the reference."""
    mine = (result[0].detach().cpu(), result[1].detach().cpu())
    gathered: list[Any] = [None] * rt.world_size if rt.rank == 0 else []
    dist.gather_object(mine, gathered if rt.rank == 0 else None, dst=0, group=control)
    if rt.rank != 0:
        return None
    if prep.reference is None:
        raise RuntimeError("rank 0 has no reference to check against")
    ref_out, ref_lse = prep.reference()
    return [_error(got, (prep.part(ref_out, r), prep.part(ref_lse, r))) for r, got in enumerate(gathered)]


def step_row(rank: int, kind: str, prep: Prepared, times: list[float], *, variant: str | None = None) -> dict[str, Any]:
    """The report row (:class:`~shardattn.launch.report.RankRow` fields) of one timed step kind."""
    med, p10, p90 = summarize_times(times)
    rate = prep.work / (med * 1e-3) if med > 0 else math.nan
    return {
        "rank": rank,
        "step": kind,
        "path": prep.path,
        "reason": prep.reason,
        "tokens": prep.tokens,
        "time_ms": med,
        "time_p10_ms": p10,
        "time_p90_ms": p90,
        "union_ratio": prep.union,
        "tflops": rate / 1e12 if kind == "prefill" else None,
        "gbytes_per_s": rate / 1e9 if kind == "decode" else None,
        "variant": variant,
    }
