"""What one launcher rank does: resolve the run, build the Runtime and the steps, time, check, report.

:func:`plan_run` turns the options and the world size into a :class:`RunConfig`, raising
:class:`~shardattn.launch.cli.LaunchError` (one line) for impossible configurations; it runs on
every rank before the process group exists. :func:`run` then, on every rank:

1. makes the ranks agree on the configuration (one all-gather on the gloo control group: a rank
   started with other options or another version stops every rank with a clear message);
2. builds a :class:`~shardattn.parallel.runtime.Runtime` on the data group (workspace, warm-up);
3. for each step kind (prefill, decode): builds the synthetic step from the shared seed, runs
   ``--warmup`` untimed and ``--iters`` timed iterations (ranks start each together), and with
   ``--check`` gathers the outputs on rank 0 and compares them with the single-process reference;
4. gathers the per-rank rows on rank 0, which prints the table (and writes ``--json``), and
   agrees with every rank on the exit status.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardattn import __version__
from shardattn.kernels.gqa_decode import gqa_paged_decode_reference
from shardattn.kernels.sparse_mla import sparse_mla_reference, valid_mask
from shardattn.kernels.sparse_mla_triton import flops
from shardattn.kernels.topk import DcpShard, convert_topk
from shardattn.launch.cli import (
    EXIT_CHECK_FAILED,
    EXIT_INJECTED,
    EXIT_USAGE,
    LaunchError,
    Options,
    Shape,
    resolve_shape,
)
from shardattn.launch.process_group import LaunchGroups
from shardattn.launch.report import RankRow, Report, render, summarize_times, write_json
from shardattn.launch.workloads import build_decode, build_gqa_decode, build_prefill, overlap_model
from shardattn.parallel.comm import Comm, stable_fingerprint
from shardattn.parallel.runtime import Runtime
from shardattn.plan.spec import ModelSpec, get_preset
from shardattn.plan.zigzag import DEFAULT_MIN_TOKENS
from shardattn.workload import load_topk_dump, union_ratio

__all__ = ["TOLERANCE", "RunConfig", "plan_run", "run"]

#: Largest error (output, and LSE relative to its magnitude) a check accepts, per dtype.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: Timed iterations above which rank 0 shows a progress bar.
_PROGRESS_ITERS = 10


def _fail(message: str) -> LaunchError:
    return LaunchError(f"shardattn.launch: error: {message}", EXIT_USAGE)


@dataclass(frozen=True)
class RunConfig:
    """Everything a rank needs to run, resolved identically on every rank (see :func:`plan_run`)."""

    opts: Options
    spec: ModelSpec
    mode: str
    shape: Shape
    device: torch.device
    dtype: torch.dtype
    world_size: int
    steps: tuple[str, ...]
    check: bool
    iters: int
    min_shard_tokens: int
    min_group_tokens: int
    recorded: tuple[torch.Tensor, torch.Tensor] | None
    notes: tuple[str, ...]

    def fingerprint(self) -> int:
        """Equal on ranks that will run the same thing (options, version, world size, device type)."""
        fields = {k: v for k, v in dataclasses.asdict(self.opts).items() if k not in ("json", "progress")}
        rec = None if self.recorded is None else (tuple(self.recorded[0].shape), int(self.recorded[0].sum()))
        return stable_fingerprint(
            __version__, sorted(fields.items()), self.world_size, self.device.type, self.dtype, self.shape, rec
        )

    def describe(self) -> dict[str, Any]:
        s = self.shape
        return {
            "preset": self.opts.preset,
            "mode": self.mode,
            "world_size": self.world_size,
            "backend": "nccl" if self.device.type == "cuda" else "gloo",
            "device": self.device.type,
            "dtype": str(self.dtype).replace("torch.", ""),
            "tokens": s.tokens,
            "requests": s.requests,
            "cached": list(s.cached),
            "topk": s.topk,
            "q_lens": list(s.q_lens),
            "overlap": self.opts.overlap,
            "topk_file": self.opts.topk_file,
            "iters": self.iters,
            "warmup": self.opts.warmup,
            "seed": self.opts.seed,
            "check": self.check,
            "reduced_shape": s.reduced,
            "version": __version__,
        }


def plan_run(opts: Options, world_size: int, device: torch.device) -> RunConfig:
    """Resolve presets, defaults and the steps to run; raise :class:`LaunchError` for impossible configurations."""
    try:
        spec = get_preset(opts.preset)
    except ValueError as e:
        raise _fail(f"--preset: {e}") from None
    try:
        overlap_model(opts.overlap)
    except ValueError as e:
        raise _fail(f"--{e}") from None
    on_gpu = device.type == "cuda"
    mla = spec.kind == "sparse_mla"
    mode = opts.mode or ("mixed" if mla else "dcp-decode")
    if not mla and mode != "dcp-decode":
        raise _fail(
            f"--mode {mode} needs a sparse-MLA preset; {opts.preset} is a GQA model (decode only): "
            "use --mode dcp-decode"
        )
    if spec.num_heads % world_size:
        divisors = [d for d in range(1, spec.num_heads + 1) if spec.num_heads % d == 0]
        raise _fail(
            f"preset {opts.preset} has {spec.num_heads} query heads, which {world_size} ranks cannot split evenly "
            f"(each rank holds heads / world size); run {', '.join(map(str, divisors[:8]))}"
            f"{' ...' if len(divisors) > 8 else ''} ranks"
        )
    if opts.fail_rank is not None and opts.fail_rank >= world_size:
        raise _fail(f"--fail-rank {opts.fail_rank} is not a rank of this world of {world_size}")
    steps = {"dcp-decode": ("decode",), "mixed": ("prefill", "decode")}.get(mode, ("prefill",))
    recorded = None
    if opts.topk_file is not None:
        if "prefill" not in steps:
            raise _fail("--topk-file holds prefill top-k; use a prefill mode (shardq, headtp, pcp, mixed)")
        if not os.path.exists(opts.topk_file):
            raise _fail(f"--topk-file {opts.topk_file}: no such file")
        try:
            recorded = load_topk_dump(opts.topk_file)
        except (ValueError, TypeError, OSError, RuntimeError) as e:
            raise _fail(f"--topk-file {opts.topk_file}: {e}") from None
    shape = resolve_shape(opts, on_gpu=on_gpu, preset_topk=spec.topk or 1, decode_only=steps == ("decode",))
    if recorded is not None:
        t, k = recorded[0].shape
        shape = dataclasses.replace(
            shape, tokens=t, requests=1, cached=shape.cached[:1], topk=k, q_lens=shape.q_lens[:1], reduced=False
        )
    if "prefill" in steps and shape.tokens < shape.requests:
        raise _fail(f"--tokens {shape.tokens} gives some of the {shape.requests} requests no new token")
    if mla and recorded is None:
        longest = max(
            ([c + n for c, n in zip(shape.cached, _split(shape.tokens, shape.requests))] if "prefill" in steps else [])
            + ([c + q for c, q in zip(shape.cached, shape.q_lens)] if "decode" in steps else [])
        )
        if shape.topk > longest:
            raise _fail(
                f"--topk {shape.topk} is larger than the KV cache of the longest request ({longest} tokens): "
                "a query cannot pick more rows than exist; lower --topk or raise --cached / --tokens"
            )
    if opts.dtype == "auto":
        dtype = torch.bfloat16 if on_gpu else torch.float32
    else:
        dtype = _DTYPES[opts.dtype]
    if opts.graph and not on_gpu:
        raise _fail("--graph captures CUDA graphs and needs a GPU per rank")
    if opts.graph and "decode" not in steps:
        raise _fail(f"--graph captures the decode step; mode {mode} has none")
    check = (not on_gpu) if opts.check is None else opts.check
    iters = opts.iters if opts.iters is not None else (20 if on_gpu else 3)
    min_shard = opts.min_shard_tokens if opts.min_shard_tokens is not None else (DEFAULT_MIN_TOKENS if on_gpu else 1)
    min_group = DEFAULT_MIN_TOKENS if on_gpu else 1
    notes = []
    if shape.reduced:
        parts = []
        if "prefill" in steps:
            parts.append(
                f"prefill of {shape.tokens} new tokens over {shape.requests} requests (cached {list(shape.cached)})"
            )
        if "decode" in steps:
            what = (
                "decode"
                if "prefill" in steps
                else f"decode of {shape.requests} requests (context {list(shape.cached)})"
            )
            parts.append(f"{what} with query lengths {list(shape.q_lens)}")
        topk = f", top-k {shape.topk}" if mla else ""
        dt = str(dtype).replace("torch.", "")
        notes.append(
            f"CPU run at a reduced step: {'; '.join(parts)}{topk}, {spec.num_heads} heads of {opts.preset}, {dt} "
            "(GPU defaults: 8192 new tokens over 4 requests, 8192 cached each, 64 requests in dcp-decode mode, "
            "the preset's top-k)"
        )
    if not on_gpu and opts.min_shard_tokens is None and "prefill" in steps:
        notes.append(f"ShardQ gate lowered to {min_shard} token (planner default {DEFAULT_MIN_TOKENS}) on the CPU")
    return RunConfig(
        opts,
        spec,
        mode,
        shape,
        device,
        dtype,
        world_size,
        steps,
        check,
        iters,
        min_shard,
        min_group,
        recorded,
        tuple(notes),
    )


def _split(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def _token_rows(step: Any, page: int) -> torch.Tensor:
    """``[T]`` int64 KV-cache row of every new token of a prefill step (its own key and value)."""
    starts = torch.tensor([0, *step.seq_lens], device=step.q.device).cumsum(0)[:-1]
    req = step.req_ids.long()
    pos = torch.tensor(step.prefix_lens, device=step.q.device)[req] + torch.arange(len(req), device=req.device)
    pos = pos - starts[req]
    return step.block_table.long()[req, pos // page] * page + pos % page


# -- one step kind --------------------------------------------------------------------------------
@dataclass
class _Prepared:
    """A step ready to time: the call, what the report says about it, and how to check it."""

    step: str
    call: Callable[[bool], tuple[torch.Tensor, torch.Tensor]]  # call(check): one step on this rank
    path: str
    reason: str
    tokens: int
    union: float | None
    work: float  # FLOPs (prefill) or bytes (decode) of one call on this rank
    reference: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None  # rank 0 only: full (out, lse)
    part: Callable[[torch.Tensor, int], torch.Tensor]  # (full reference tensor, rank) -> what that rank returns


def _heads(rt: Runtime, x: torch.Tensor, rank: int | None = None) -> torch.Tensor:
    h, r = rt.heads_per_rank, rt.rank if rank is None else rank
    return x[:, r * h : (r + 1) * h]


def _prepare_prefill(cfg: RunConfig, rt: Runtime) -> _Prepared:
    s, spec = cfg.shape, cfg.spec
    step = build_prefill(
        heads=spec.num_heads,
        head_dim=spec.head_dim,
        tokens=s.tokens,
        requests=s.requests,
        cached=s.cached,
        topk=s.topk,
        overlap=overlap_model(cfg.opts.overlap),
        dtype=cfg.dtype,
        device=cfg.device,
        seed=cfg.opts.seed,
        recorded=cfg.recorded,
        block_size=spec.page_size,
    )
    plan = rt.plan_prefill(step.seq_lens, step.prefix_lens, kv_rows=int(step.kv.shape[0]))
    mine = plan.tokens_of(rt.rank).to(cfg.device)
    rows_mine = step.rows.index_select(0, mine)
    length = None if step.topk_length is None else step.topk_length.index_select(0, mine)
    keys = int(valid_mask(rows_mine, int(step.kv.shape[0]), length).sum())
    heads = spec.num_heads if plan.step in ("shardq", "pcp") else rt.heads_per_rank
    g = plan.route.group_size
    ratio = union_ratio(rows_mine, g, length) if g > 1 else None
    scale = rt.scale

    def reference() -> tuple[torch.Tensor, torch.Tensor]:
        return sparse_mla_reference(
            step.q, step.kv, step.rows, scale=scale, v_dim=spec.v_dim, topk_length=step.topk_length
        )

    if plan.step == "pcp":  # every head of the rank's own tokens; their new KV rows; prefix from the cache
        q_tok = step.q.index_select(0, mine).contiguous()
        pos_mine = step.positions.index_select(0, mine)
        own = _token_rows(step, spec.page_size).index_select(0, mine)
        kv_new = step.kv.index_select(0, own).contiguous()
        tokens_of = {r: plan.tokens_of(r).to(cfg.device) for r in range(rt.world_size)}

        def call(check: bool) -> tuple[torch.Tensor, torch.Tensor]:
            return rt.prefill(
                q_tok,
                kv_new,
                pos_mine,
                plan=plan,
                topk_length=length,
                kv_cache=step.kv,
                block_table=step.block_table,
                check=check,
            )

        def part(full: torch.Tensor, r: int) -> torch.Tensor:
            return full.index_select(0, tokens_of[r].to(full.device))

    else:
        q_local = _heads(rt, step.q).contiguous()

        def call(check: bool) -> tuple[torch.Tensor, torch.Tensor]:
            return rt.prefill(q_local, step.kv, step.rows, plan=plan, topk_length=step.topk_length, check=check)

        def part(full: torch.Tensor, r: int) -> torch.Tensor:
            return _heads(rt, full, r)

    path = f"{plan.step}/{plan.route.path}" + (f" G={g}" if g > 1 else "")
    return _Prepared(
        "prefill",
        call,
        path,
        plan.route.reason,
        int(mine.numel()),
        None if ratio is None or math.isnan(ratio) else ratio,
        flops(keys, heads, spec.head_dim, spec.v_dim),
        reference if rt.rank == 0 else None,
        part,
    )


def _prepare_decode(cfg: RunConfig, rt: Runtime) -> _Prepared:
    s, spec = cfg.shape, cfg.spec
    dcp = rt.decode_is_dcp
    shard = DcpShard(rt.world_size if dcp else 1, rt.layout.interleave if dcp else 1, rt.rank if dcp else 0)
    elem = torch.finfo(cfg.dtype).bits // 8
    route = rt.decode_route
    if spec.kind == "sparse_mla":
        step = build_decode(
            heads=spec.num_heads,
            head_dim=spec.head_dim,
            requests=s.requests,
            cached=s.cached,
            q_lens=s.q_lens,
            topk=s.topk,
            overlap=overlap_model(cfg.opts.overlap),
            causal=cfg.opts.causal,
            dtype=cfg.dtype,
            device=cfg.device,
            seed=cfg.opts.seed,
            shard=shard,
            block_size=spec.page_size,
        )
        q_local = _heads(rt, step.q).contiguous()
        local_rows, _ = convert_topk(
            step.positions, step.req_ids, step.local_table, block_size=spec.page_size, seq_lens=step.seq_lens, dcp=shard
        )
        keys = int((local_rows >= 0).sum())
        heads = spec.num_heads if dcp else rt.heads_per_rank
        work = keys * spec.head_dim * elem + step.num_tokens * heads * (spec.head_dim + spec.v_dim) * elem

        def call(check: bool) -> tuple[torch.Tensor, torch.Tensor]:
            return rt.decode(
                q_local,
                step.local_kv,
                step.local_table,
                step.seq_lens,
                topk_pos=step.positions,
                req_ids=step.req_ids,
                check=check,
            )

        def reference() -> tuple[torch.Tensor, torch.Tensor]:
            return sparse_mla_reference(step.q, step.kv, step.rows, scale=rt.scale, v_dim=spec.v_dim)

        tokens = step.num_tokens
    else:
        g = build_gqa_decode(
            q_heads=spec.num_heads,
            kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            sinks=spec.has_sinks,
            requests=s.requests,
            cached=s.cached,
            q_lens=s.q_lens,
            dtype=cfg.dtype,
            device=cfg.device,
            seed=cfg.opts.seed,
            shard=shard,
            block_size=spec.page_size,
        )
        q_local = _heads(rt, g.q).contiguous()
        local_lens = rt.layout.local_seq_lens(g.seq_lens, rt.rank) if dcp else g.seq_lens
        work = int(local_lens.sum()) * spec.num_kv_heads * spec.head_dim * 2 * elem
        work += g.num_tokens * spec.num_heads * spec.head_dim * 2 * elem
        causal = cfg.opts.causal

        # the host plan of the batch (DCP: per-query local lengths and block-table rows, one
        # pinned tensor, one copy per step): the lean step, no device index arithmetic
        batch = rt.decode_step.plan(g.seq_lens.tolist(), g.cu_q_lens.tolist()) if dcp else None

        def call(check: bool) -> tuple[torch.Tensor, torch.Tensor]:
            return rt.decode(
                q_local,
                (g.local_k_cache, g.local_v_cache),
                g.local_block_table,
                g.seq_lens,
                cu_q_lens=g.cu_q_lens,
                sinks=g.sinks,
                batch=batch,
                check=check,
            )

        def reference() -> tuple[torch.Tensor, torch.Tensor]:
            return gqa_paged_decode_reference(
                g.q,
                g.k_cache,
                g.v_cache,
                g.block_table,
                g.seq_lens,
                g.cu_q_lens,
                causal=causal,
                sinks=g.sinks,
                scale=rt.scale,
            )

        tokens = g.num_tokens
    path = f"{'dcp' if dcp else 'headtp'}/{route.path}"
    return _Prepared(
        "decode",
        call,
        path,
        route.reason,
        tokens,
        None,
        float(work),
        reference if rt.rank == 0 else None,
        lambda full, r: _heads(rt, full, r),
    )


# -- timing and checking ---------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(prep: _Prepared, cfg: RunConfig, control: dist.ProcessGroup, progress: Any) -> tuple[list[float], Any]:
    """``--warmup`` untimed and ``--iters`` timed calls; the first call makes the ranks agree on the
    step's plan and inputs (the steps' own check), the timed ones skip that host round trip."""
    result = None
    dist.barrier(group=control)  # on the host (gloo): a dead peer fails here, not inside a GPU collective
    for i in range(cfg.opts.warmup):
        result = prep.call(i == 0)
    times = []
    task = progress.add_task(f"{prep.step} ({prep.path})", total=cfg.iters) if progress is not None else None
    for i in range(cfg.iters):
        dist.barrier(group=control)  # ranks start each iteration together; a dead peer shows up here
        _sync(cfg.device)
        t0 = time.perf_counter()
        result = prep.call(cfg.opts.warmup == 0 and i == 0)
        _sync(cfg.device)
        times.append(time.perf_counter() - t0)
        if task is not None:
            progress.advance(task)
    return times, result


def _graph_row(
    prep: _Prepared, cfg: RunConfig, rt: Runtime, control: dist.ProcessGroup, rank: int, eager: Any
) -> dict[str, Any]:
    """``--graph``: capture the decode step once (the Runtime's policy decides whether it may: a
    forbidden capture raises its ValueError), time ``--iters`` replays like the eager step, and
    require a replay to equal the eager output bitwise (so the eager step's check covers it)."""
    from shardattn.parallel.cudagraph import DecodeGraph

    q_lens = cfg.shape.q_lens
    rt.check_capture("decode", q_len_per_req=max(q_lens), ragged=len(set(q_lens)) > 1)
    dist.barrier(group=control)
    graph = DecodeGraph(lambda: prep.call(False), {})  # the step's inputs are fixed tensors here
    replayed = graph.replay()
    _sync(cfg.device)
    if not all(torch.equal(a, b) for a, b in zip(replayed, eager) if a is not None):
        raise RuntimeError(f"rank {rank}: the CUDA graph replay of the decode step differs from the eager step")
    times = []
    for _ in range(cfg.iters):
        dist.barrier(group=control)
        _sync(cfg.device)
        t0 = time.perf_counter()
        graph.replay()
        _sync(cfg.device)
        times.append(time.perf_counter() - t0)
    med, p10, p90 = summarize_times(times)
    return {
        "rank": rank,
        "step": "decode",
        "path": f"{prep.path} (graph)",
        "reason": f"CUDA graph replay ({rt.cudagraph_support('decode').name}), bitwise equal to the eager step",
        "tokens": prep.tokens,
        "time_ms": med,
        "time_p10_ms": p10,
        "time_p90_ms": p90,
        "union_ratio": prep.union,
        "tflops": None,
        "gbytes_per_s": prep.work / (med * 1e-3) / 1e9 if med > 0 else math.nan,
    }


def _profile(prep: _Prepared, cfg: RunConfig, control: dist.ProcessGroup, rank: int) -> None:
    """``--profile``: one more step under torch.profiler; rank 0 prints its busiest host ops.

    Host-side calls (kernel launches, synchronisations, copies to the host) show where a step's
    time goes when the device is not the bottleneck.
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cfg.device.type == "cuda" else [])
    dist.barrier(group=control)
    _sync(cfg.device)
    with profile(activities=activities) as prof:
        prep.call(False)
        _sync(cfg.device)
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


def _check(prep: _Prepared, result: tuple[torch.Tensor, torch.Tensor], rt: Runtime, control: dist.ProcessGroup):
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


def run(cfg: RunConfig, groups: LaunchGroups) -> int:
    """Run the configured steps on this rank (module docstring); returns the exit status, equal on every rank."""
    control = Comm(groups.control)
    try:
        control.check_agreement(cfg.fingerprint(), "launcher options (command line, version, device type)")
    except ValueError as e:  # the same verdict on every rank, before any data collective
        raise _fail(str(e)) from None
    rank = groups.rank
    rt = Runtime(
        cfg.spec if cfg.dtype == getattr(torch, cfg.spec.dtype) else _with_dtype(cfg.spec, cfg.dtype),
        groups.data,
        max_batched_tokens=max(cfg.shape.tokens, 1),
        mode=cfg.mode,
        device=cfg.device,
        topk=cfg.shape.topk if cfg.spec.kind == "sparse_mla" else None,
        max_decode_tokens=max(1, sum(cfg.shape.q_lens)),
        dcp_interleave=cfg.opts.interleave,
        min_shard_tokens=cfg.min_shard_tokens,
        min_group_tokens=cfg.min_group_tokens,
        non_causal=not cfg.opts.causal,
    )
    reserved = control.gather_ints([rt.workspace_bytes])
    if rank == 0:
        per_rank = ", ".join(f"rank {r}: {v[0] / 1e9:.3f} GB" for r, v in enumerate(reserved))
        items = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sorted(rt.bounds.items()) if v)
        print(f"workspace reserved per rank ({cfg.mode}): {per_rank} [{items}]", flush=True)
    progress = None
    if rank == 0 and cfg.opts.progress and cfg.iters >= _PROGRESS_ITERS:
        from rich.progress import Progress

        progress = Progress(transient=True)
        progress.start()
    rows: list[dict[str, Any]] = []
    all_errors: dict[str, list[float]] = {}
    try:
        for kind in cfg.steps:
            prep = _prepare_prefill(cfg, rt) if kind == "prefill" else _prepare_decode(cfg, rt)
            if cfg.opts.fail_rank == rank and cfg.opts.fail_at == "step":
                os._exit(EXIT_INJECTED)  # debug: die right before the step's first collective
            times, result = _time(prep, cfg, groups.control, progress)
            if cfg.opts.profile:
                _profile(prep, cfg, groups.control, rank)
            if cfg.check:
                errors = _check(prep, result, rt, groups.control)
                if errors is not None:
                    all_errors[kind] = errors
            med, p10, p90 = summarize_times(times)
            rate = prep.work / (med * 1e-3) if med > 0 else math.nan
            rows.append(
                {
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
                }
            )
            if cfg.opts.graph and kind == "decode":  # after the eager row; its check applies (bitwise equal)
                rows.append(_graph_row(prep, cfg, rt, groups.control, rank, result))
    finally:
        if progress is not None:
            progress.stop()
    gathered: list[Any] = [None] * groups.world_size if rank == 0 else []
    dist.gather_object(rows, gathered if rank == 0 else None, dst=0, group=groups.control)
    status = 0
    if rank == 0:
        tol = TOLERANCE[cfg.dtype]
        report = Report(cfg.describe(), notes=list(cfg.notes))
        for kind in cfg.steps:
            for r, rank_rows in enumerate(gathered):
                for row in rank_rows:
                    if row["step"] != kind:
                        continue
                    err = all_errors[kind][r] if kind in all_errors else None
                    report.rows.append(RankRow(**row, error=err, tolerance=tol if err is not None else None))
        render(report)
        if cfg.opts.json:
            write_json(report, cfg.opts.json)
        status = 0 if report.passed else EXIT_CHECK_FAILED
    verdict = [status]
    dist.broadcast_object_list(verdict, src=0, group=groups.control)
    return int(verdict[0])


def _with_dtype(spec: ModelSpec, dtype: torch.dtype) -> ModelSpec:
    return dataclasses.replace(spec, dtype=str(dtype).replace("torch.", ""))
