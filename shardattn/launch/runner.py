"""What one launcher rank does: resolve the run, build the Runtime and the steps, time, check, report.

:func:`plan_run` turns the options and the world size into a :class:`RunConfig`, raising
:class:`~shardattn.launch.cli.LaunchError` (one line) for impossible configurations; it runs on
every rank before the process group exists. :func:`run` then, on every rank:

1. makes the ranks agree on the configuration (one all-gather on the gloo control group: a rank
   started with other options or another version stops every rank with a clear message);
2. builds a :class:`~shardattn.runtime.runtime.Runtime` on the data group (workspace, warm-up);
3. for each step kind (prefill, decode): builds the synthetic step from the shared seed, runs
   ``--warmup`` untimed and ``--iters`` timed iterations (ranks start each together), and with
   ``--check`` gathers the outputs on rank 0 and compares them with the single-process reference;
4. gathers the per-rank rows on rank 0, which prints the table (and writes ``--json``), and
   agrees with every rank on the exit status.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist

from shardattn.launch.cli import (
    EXIT_CHECK_FAILED,
    EXIT_INJECTED,
    EXIT_USAGE,
    Options,
    resolve_shape,
    usage_error,
)
from shardattn.launch.memory import free_bytes, step_bytes, token_bytes
from shardattn.launch.option_use import check_calibration_file, check_options_used
from shardattn.launch.prepare import prepare_decode, prepare_prefill
from shardattn.launch.process_group import LaunchGroups
from shardattn.launch.progress import RunProgress
from shardattn.launch.report import RankRow, Report, render, render_compare, save_json
from shardattn.launch.run_config import RunConfig
from shardattn.launch.timing import check_step, graph_row, profile_step, step_row, time_step
from shardattn.launch.workloads import overlap_model
from shardattn.parallel.comm import Comm
from shardattn.plan.cost import CostModel, load_calibration
from shardattn.plan.kv_format import FP8_DS_MLA_DIMS, KV_FP8_DS_MLA
from shardattn.plan.spec import ModelSpec, get_preset
from shardattn.plan.zigzag import DEFAULT_MIN_TOKENS
from shardattn.runtime.modes import DECODE_STEP
from shardattn.runtime.options import DecodeOptions, PrefillOptions
from shardattn.runtime.runtime import Runtime
from shardattn.workload import first_repeat, load_topk_dump

__all__ = ["TOLERANCE", "RunConfig", "plan_run", "run"]

#: Largest error (output, and LSE relative to its magnitude) a check accepts, per dtype.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def plan_run(opts: Options, world_size: int, device: torch.device) -> RunConfig:
    """Resolve presets, defaults and the steps to run; raise :class:`LaunchError` for impossible configurations."""
    try:
        spec = get_preset(opts.preset)
    except ValueError as e:
        raise usage_error(f"--preset: {e}") from None
    if opts.heads is not None:
        try:
            spec = dataclasses.replace(spec, num_heads=opts.heads)
        except ValueError as e:
            raise usage_error(f"--heads {opts.heads}: {e}") from None
    if opts.softmax_scale is not None:
        spec = dataclasses.replace(spec, softmax_scale=opts.softmax_scale)
    try:
        overlap_model(opts.overlap)
    except ValueError as e:
        raise usage_error(f"--{e}") from None
    on_gpu = device.type == "cuda"
    mla = spec.kind == "sparse_mla"
    mode = opts.mode or ("mixed" if mla else "dcp-decode")
    if not mla and mode == "shardq":
        raise usage_error(
            f"--mode shardq needs a sparse-MLA preset; {opts.preset} is a GQA model: use --mode headtp "
            "(head-TP prefill), pcp (PCP prefill), mixed (head-TP prefill and DCP decode) or dcp-decode"
        )
    if spec.num_heads % world_size:
        divisors = [d for d in range(1, spec.num_heads + 1) if spec.num_heads % d == 0]
        heads = f"--heads {opts.heads} gives" if opts.heads is not None else f"preset {opts.preset} has"
        raise usage_error(
            f"{heads} {spec.num_heads} query heads, which {world_size} ranks cannot split evenly "
            f"(each rank holds heads / world size); run {', '.join(map(str, divisors[:8]))}"
            f"{' ...' if len(divisors) > 8 else ''} ranks"
        )
    if opts.fail_rank is not None and opts.fail_rank >= world_size:
        raise usage_error(f"--fail-rank {opts.fail_rank} is not a rank of this world of {world_size}")
    # each mode's steps (runtime.modes); --compare sets prefill paths side by side, nothing else
    steps = ("decode",) if mode == "dcp-decode" else ("prefill",) if opts.compare else ("prefill", "decode")
    if opts.window >= 0 and mla:
        raise usage_error(f"--window is a GQA model's sliding window; {opts.preset} is a sparse-MLA model")
    if opts.window >= 0 and DECODE_STEP[mode] == "dcp":
        raise usage_error(
            f"--window: mode {mode} decodes with DCP, which refuses a sliding window (a global window is not a "
            "local one); use --mode headtp"
        )
    if opts.compare and not mla:
        raise usage_error(f"--compare sets sparse-MLA prefill steps side by side; {opts.preset} is a GQA model")
    check_options_used(opts, mode=mode, steps=steps, mla=mla)
    if opts.calibration is not None:
        check_calibration_file(opts.calibration, device)
    recorded = None
    if opts.topk_file is not None:
        if "prefill" not in steps:
            raise usage_error("--topk-file holds prefill top-k; use a prefill mode (shardq, headtp, pcp, mixed)")
        shaped = [
            flag
            for flag, given in (
                ("--tokens", opts.tokens is not None),
                ("--requests", opts.requests is not None),
                ("--topk", opts.topk is not None),
                ("--cached", opts.cached is not None and len(opts.cached) > 1),
                ("--query-len", opts.query_lens is not None and len(opts.query_lens) > 1),
            )
            if given
        ]
        if shaped:
            raise usage_error(
                f"--topk-file sets the step's shape (its tokens, one request, its top-k): drop {', '.join(shaped)}"
            )
        if not os.path.exists(opts.topk_file):
            raise usage_error(f"--topk-file {opts.topk_file}: no such file")
        try:
            recorded = load_topk_dump(opts.topk_file)
        except (ValueError, TypeError, OSError, RuntimeError) as e:
            raise usage_error(f"--topk-file {opts.topk_file}: {e}") from None
        if 0 in recorded[0].shape:  # its shape sizes the step: a step of no token, or of no entry a token
            raise usage_error(
                f"--topk-file {opts.topk_file}: its top-k is [{', '.join(map(str, recorded[0].shape))}]; a step needs "
                "at least one token with at least one entry"
            )
        repeat = first_repeat(*recorded) if opts.topk_unique else None
        if repeat is not None:  # the promise would make the steps count that key twice
            raise usage_error(
                f"--topk-file {opts.topk_file}: token {repeat[0]} lists position {repeat[1]} twice, which "
                "--topk-unique promises it does not: drop --topk-unique (the steps then de-duplicate the top-k)"
            )
    dtype = (torch.bfloat16 if on_gpu else torch.float32) if opts.dtype == "auto" else _DTYPES[opts.dtype]
    have = free_bytes(device, world_size)
    floor = (opts.requests or 0) * token_bytes(spec, dtype)  # every request has a token in every step
    if have is not None and floor > have:  # refused before its per-request lengths are listed
        raise usage_error(_too_large(floor, have, device, "ask for fewer --requests"))
    shape = resolve_shape(opts, on_gpu=on_gpu, preset_topk=spec.topk or 1, decode_only=steps == ("decode",))
    if recorded is not None:
        t, k = recorded[0].shape
        shape = dataclasses.replace(
            shape, tokens=t, requests=1, cached=shape.cached[:1], topk=k, query_lens=shape.query_lens[:1], reduced=False
        )
    if "prefill" in steps and shape.tokens < shape.requests:
        raise usage_error(f"--tokens {shape.tokens} gives some of the {shape.requests} requests no new token")
    if mla and recorded is None:
        longest = max(
            ([c + n for c, n in zip(shape.cached, _split(shape.tokens, shape.requests))] if "prefill" in steps else [])
            + ([c + q for c, q in zip(shape.cached, shape.query_lens)] if "decode" in steps else [])
        )
        if shape.topk > longest:
            raise usage_error(
                f"--topk {shape.topk} is larger than the KV cache of the longest request ({longest} tokens): "
                "a query cannot pick more rows than exist; lower --topk or raise --cached / --tokens"
            )
    sized = shape
    if recorded is not None:  # the recorded positions size the request's cache (global rows beyond it too)
        kv_len = max(shape.cached[0] + shape.tokens, int(recorded[0].max()) + 1 if recorded[0].numel() else 0)
        sized = dataclasses.replace(shape, cached=(kv_len - shape.tokens,))
    checked = opts.check if opts.check is not None else not on_gpu
    need = step_bytes(spec, sized, dtype, steps, check=checked)
    if have is not None and need > have:
        fewer = (
            f"--topk-file {opts.topk_file}'s positions (up to {kv_len - 1:,}) make a KV cache of {kv_len:,} rows"
            if recorded is not None
            else "ask for fewer --heads, --tokens, --cached, --requests or --query-len"
        )
        raise usage_error(_too_large(need, have, device, fewer))
    if opts.compare and ("prefill" not in steps or mode == "pcp"):
        raise usage_error(
            "--compare runs the head-TP, ShardQ and routed prefill steps of a sparse-MLA preset; "
            f"mode {mode} {'takes another input layout' if mode == 'pcp' else 'has no such prefill'}"
        )
    if opts.kv_dtype == KV_FP8_DS_MLA and (not mla or (spec.head_dim, spec.v_dim) != FP8_DS_MLA_DIMS):
        raise usage_error(
            f"--kv-dtype {KV_FP8_DS_MLA} holds DSA sparse-MLA rows (576 = 512 latent + 64 rope); preset "
            f"{opts.preset} is a {spec.kind} model of head dim {spec.head_dim}"
        )
    if opts.graph and not on_gpu:
        raise usage_error("--graph captures CUDA graphs and needs a GPU per rank")
    if opts.graph and "decode" not in steps:
        why = "--compare runs prefill steps only" if opts.compare else f"mode {mode} has none"
        raise usage_error(f"--graph captures the decode step; {why}")
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
            parts.append(f"{what} with query lengths {list(shape.query_lens)}")
        topk = f", top-k {shape.topk}" if mla else ""
        dt = str(dtype).replace("torch.", "")
        preset_topk = ", the preset's top-k" if mla else ""
        notes.append(
            f"CPU run at a reduced step: {'; '.join(parts)}{topk}, {spec.num_heads} heads of {opts.preset}, {dt} "
            f"(GPU defaults: 8192 new tokens over 4 requests, 8192 cached each, 64 requests in dcp-decode mode"
            f"{preset_topk})"
        )
    # the modes whose prefill may take ShardQ (never on one rank)
    shardq_runs = mla and world_size > 1 and (mode in ("shardq", "mixed") or opts.compare)
    if not on_gpu and opts.min_shard_tokens is None and "prefill" in steps and shardq_runs:
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


def _too_large(need: int, have: int, device: torch.device, fewer: str) -> str:
    """The one line of a run whose tensors need more than a rank has (``fewer``: what to ask for)."""
    return (
        f"the step's tensors need at least {need / 2**30:.1f} GiB per rank (KV cache, queries, top-k, outputs), "
        f"but {have / 2**30:.1f} GiB are free on this {device.type} for each of its ranks; {fewer}"
    )


def _split(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def workspace_line(reserved: list[int], layouts: dict[tuple[str, str], tuple[dict[str, int], int]]) -> str:
    """The launcher's one line about the workspace: bytes per rank (once when every rank holds the
    same) and each step's share of the one arena (the items are in the JSON report).

    >>> steps = {("prefill", "shardq"): ({}, 71_500_000), ("decode", "dcp"): ({}, 900_000)}
    >>> workspace_line([72_000_000] * 4, steps)
    'workspace: 0.072 GB per rank, one arena for prefill shardq 71.5 MB and decode dcp 0.9 MB'
    """
    per_rank = (
        f"{reserved[0] / 1e9:.3f} GB per rank"
        if len(set(reserved)) == 1
        else ", ".join(f"rank {r} {n / 1e9:.3f} GB" for r, n in enumerate(reserved))
    )
    steps = [f"{kind} {step} {n / 1e6:.1f} MB" for (kind, step), (_, n) in layouts.items()]
    shares = " and ".join(steps) if len(steps) <= 2 else ", ".join(steps)
    return f"workspace: {per_rank}, one arena for {shares}" if steps else f"workspace: {per_rank}"


def run(cfg: RunConfig, groups: LaunchGroups, progress: RunProgress | None = None) -> int:
    """Run the configured steps on this rank (module docstring); returns the exit status, equal on every rank.

    ``progress``: rank 0's :class:`~shardattn.launch.progress.RunProgress` (phases and counts), closed here.
    """
    progress = RunProgress("shardattn.launch", enabled=False) if progress is None else progress
    try:
        return _run(cfg, groups, progress)
    finally:
        progress.close()


def _run(cfg: RunConfig, groups: LaunchGroups, progress: RunProgress) -> int:
    control = Comm(groups.control)
    try:
        control.check_agreement(cfg.fingerprint(), "launcher options (command line, version, device type)")
    except ValueError as e:  # the same verdict on every rank, before any data collective
        raise usage_error(str(e)) from None
    rank = groups.rank
    progress.phase("building the Runtime (workspace, kernel warm-up)")
    rt = _runtime(cfg, groups, cfg.mode, cfg.opts.calibration or "auto")
    reserved = [v[0] for v in control.gather_ints([rt.workspace_bytes])]
    if rank == 0:
        print(workspace_line(reserved, rt.ws.layouts), flush=True)
        print(f"hosts: {rt.nodes} (node of each rank: {list(rt.nodes.node_of)})", flush=True)
    rows: list[dict[str, Any]] = []
    all_errors: dict[tuple[str, str | None], list[float]] = {}
    for kind in cfg.steps:
        variants: list[tuple[str | None, Runtime]] = [(None, rt)]
        if kind == "prefill" and cfg.opts.compare:
            progress.phase("building the compared Runtimes (head-TP, ShardQ, router)")
            variants = [(label, _runtime(cfg, groups, m, cm)) for label, m, cm in compare_variants(cfg)]
        for variant, vrt in variants:
            label = kind if variant is None else f"{kind} ({variant})"
            progress.phase(f"{label}: building the step")
            prep = prepare_prefill(cfg, vrt) if kind == "prefill" else prepare_decode(cfg, vrt)
            if cfg.opts.fail_rank == rank and cfg.opts.fail_at == "step":
                os._exit(EXIT_INJECTED)  # debug: die right before the step's first collective
            times, result = time_step(prep, cfg, groups.control, progress, label)
            if cfg.opts.profile:
                progress.phase(f"{label}: profiling one more step")
                profile_step(prep, cfg, groups.control, rank)
            if cfg.check:
                progress.phase(f"{label}: checking against the single-process reference")
                errors = check_step(prep, result, vrt, groups.control)
                if errors is not None:
                    all_errors[(kind, variant)] = errors
            rows.append(step_row(rank, kind, prep, times, variant=variant))
            if cfg.opts.graph and kind == "decode":  # after the eager row; its check applies (bitwise equal)
                progress.phase(f"{label}: capturing and replaying a CUDA graph", total=cfg.iters)
                rows.append(graph_row(prep, cfg, vrt, groups.control, rank, result))
    progress.phase("gathering the report")
    gathered: list[Any] = [None] * groups.world_size if rank == 0 else []
    dist.gather_object(rows, gathered if rank == 0 else None, dst=0, group=groups.control)
    progress.close()  # the bar goes before the report is printed
    status = 0
    if rank == 0:
        tol = TOLERANCE[cfg.dtype]
        config = {**cfg.describe(), "workspace_bytes": reserved, "workspace_items": dict(sorted(rt.bounds.items()))}
        report = Report(config, notes=list(cfg.notes))
        for kind in cfg.steps:
            for r, rank_rows in enumerate(gathered):
                for row in rank_rows:
                    if row["step"] != kind:
                        continue
                    errs = all_errors.get((kind, row.get("variant")))
                    err = errs[r] if errs is not None else None
                    report.rows.append(RankRow(**row, error=err, tolerance=tol if err is not None else None))
        render(report)
        if cfg.opts.compare:
            render_compare(report)
        status = 0 if report.passed else EXIT_CHECK_FAILED
        if cfg.opts.json and not save_json(report, cfg.opts.json):  # the table is printed: one line, status 2
            status = status or EXIT_USAGE
    verdict = [status]
    dist.broadcast_object_list(verdict, src=0, group=groups.control)
    return int(verdict[0])


def _runtime(cfg: RunConfig, groups: LaunchGroups, mode: str, cost_model: Any) -> Runtime:
    """The run's Runtime for ``mode`` on the data group (``cost_model``: the Runtime's argument).

    A configuration the Runtime refuses (``ValueError`` / ``TypeError``, the same on every rank)
    is a :class:`~shardattn.launch.cli.LaunchError`: one line, exit status 2."""
    try:
        return _build_runtime(cfg, groups, mode, cost_model)
    except (TypeError, ValueError) as e:
        raise usage_error(f"{type(e).__name__}: {e}") from None


def _build_runtime(cfg: RunConfig, groups: LaunchGroups, mode: str, cost_model: Any) -> Runtime:
    return Runtime(
        cfg.spec if cfg.dtype == getattr(torch, cfg.spec.dtype) else _with_dtype(cfg.spec, cfg.dtype),
        groups.data,
        mode=mode,
        max_batched_tokens=max(cfg.shape.tokens, 1),
        max_decode_tokens=max(1, sum(cfg.shape.query_lens)),
        device=cfg.device,
        topk=cfg.shape.topk if cfg.spec.kind == "sparse_mla" else None,
        prefill_options=PrefillOptions(
            min_shard_tokens=cfg.min_shard_tokens, min_group_tokens=cfg.min_group_tokens, cost_model=cost_model
        ),
        decode_options=DecodeOptions(dcp_interleave=cfg.opts.interleave, causal=cfg.opts.causal),
        kv_dtype=KV_FP8_DS_MLA if cfg.opts.kv_dtype == KV_FP8_DS_MLA else None,
        host_id=groups.env.host_id,
    )


def compare_variants(cfg: RunConfig) -> list[tuple[str, str, Any]]:
    """``--compare``: ``(label, Runtime mode, cost_model)`` of head-TP, ShardQ (the gate only) and
    the router (the calibration for the GPU; on the CPU the conservative default table, so the
    choice logic runs there too)."""
    routed: Any = cfg.opts.calibration or "auto"
    if cfg.device.type != "cuda":
        routed = CostModel(load_calibration(None, cfg.opts.calibration))
    return [("head-TP", "headtp", None), ("ShardQ", "shardq", None), ("router", "shardq", routed)]


def _with_dtype(spec: ModelSpec, dtype: torch.dtype) -> ModelSpec:
    return dataclasses.replace(spec, dtype=str(dtype).replace("torch.", ""))
