"""Options of ``python -m shardattn.launch``: parsing, defaults per device, and validation.

Every check here runs on every rank *before* the process group exists, on values that are the
same on every rank (the command line and the world size), so a bad option or an impossible
configuration stops every rank with the same message and nobody waits in a rendezvous. This
module imports nothing heavy (no torch), so a bad option fails in a fraction of a second.

:class:`LaunchError` carries the one line printed for the user and the exit status.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from shardattn._paths import unwritable_reason
from shardattn.errors import LaunchError
from shardattn.launch.logs import LOG_LEVELS
from shardattn.runtime.modes import MODES

#: Exit status for bad options and impossible configurations (argparse's convention).
EXIT_USAGE = 2
#: Exit status when a ``--check`` fails.
EXIT_CHECK_FAILED = 3
#: Exit status when a peer rank failed or timed out.
EXIT_PEER_FAILED = 4
#: Exit status a ``--fail-rank`` rank dies with.
EXIT_INJECTED = 17


def usage_error(message: str) -> LaunchError:
    """A bad option or impossible configuration: ``shardattn.launch: error: <message>``, status 2."""
    return LaunchError(f"shardattn.launch: error: {message}", EXIT_USAGE)


DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "bf16", "fp16", "fp32")
#: ``--kv-dtype``: rows in the activation dtype, or the FP8 row format (shardattn.ops.kv_fp8).
KV_DTYPES = ("bf16", "fp8_ds_mla")
FAIL_POINTS = ("setup", "step")


@dataclass(frozen=True)
class Shape:
    """Step sizes the launcher runs (after device defaults are applied).

    Attributes:
        tokens: new prefill tokens of the step, all requests together.
        requests: requests of the step (prefill and decode).
        cached: cached prefix length per request (prefill); decode context before the step's
            query tokens.
        topk: top-k entries per query token (sparse MLA).
        query_lens: query tokens per decode request (1 = plain decode, more = speculative drafts).
        reduced: ``True`` when these are the small CPU defaults rather than real model shapes.
    """

    tokens: int
    requests: int
    cached: tuple[int, ...]
    topk: int
    query_lens: tuple[int, ...]
    reduced: bool


@dataclass(frozen=True)
class Options:
    """Parsed options (see ``python -m shardattn.launch --help``). Sizes left ``None`` take device defaults."""

    preset: str = "glm5"
    heads: int | None = None
    softmax_scale: float | None = None
    mode: str | None = None
    tokens: int | None = None
    requests: int | None = None
    cached: tuple[int, ...] | None = None
    topk: int | None = None
    overlap: str = "dsa"
    topk_file: str | None = None
    topk_unique: bool = False
    query_lens: tuple[int, ...] | None = None
    causal: bool = True
    window: int = -1
    interleave: int = 1
    min_shard_tokens: int | None = None
    iters: int | None = None
    warmup: int = 1
    check: bool | None = None
    json: str | None = None
    seed: int = 0
    timeout: float = 120.0
    device: str = "auto"
    dtype: str = "auto"
    kv_dtype: str = "bf16"
    progress: bool = True
    progress_after: float = 2.0
    log_level: str = "warning"
    profile: bool = False
    graph: bool = False
    compare: bool = False
    calibration: str | None = None
    fail_rank: int | None = None
    fail_at: str = "step"


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors raise :class:`LaunchError` (one line) instead of printing usage."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise LaunchError(f"shardattn.launch: error: {message} (see --help)")

    def format_help(self) -> str:
        """The help, with ``--preset`` listing the presets and ``--softmax-scale`` their scales (read
        only here: the planner imports torch, which parsing a command line does not need)."""
        from shardattn.plan.spec import PRESETS, get_preset

        scales = ", ".join(f"{name} {get_preset(name).softmax_scale:.4g}" for name in sorted(PRESETS))
        for action in self._actions:
            if action.dest == "preset":
                action.help = f"model preset: {', '.join(sorted(PRESETS))} (default glm5)"
            if action.dest == "softmax_scale":
                action.help = f"softmax scale of every step (default: the preset's, the model's own: {scales})"
        return super().format_help()


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip() != "")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one integer, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    """The launcher's argument parser."""
    p = _Parser(
        prog="python -m shardattn.launch",
        description=(
            "Run synthetic sharded-attention steps on every rank of a torchrun world and report per-rank "
            "timings (one rank per GPU; gloo and the CPU path when no GPU is visible)."
        ),
        epilog="Example: torchrun --nproc-per-node 4 -m shardattn.launch --preset glm5 --mode shardq",
    )
    a = p.add_argument
    a("--preset", default="glm5", help="model preset (default glm5)")
    a(
        "--heads",
        type=int,
        default=None,
        help="override the preset's query heads (e.g. 16 on 2 GPUs: the 8 heads per rank of GLM-5 at TP8)",
    )
    a(
        "--softmax-scale",
        type=float,
        default=None,
        help="softmax scale of every step (default: the preset's, the model's own)",
    )
    a("--mode", choices=MODES, default=None, help="step to run (default: mixed for sparse MLA, dcp-decode for GQA)")
    a("--tokens", type=int, default=None, help="new prefill tokens of the step (default: 256 CPU, 8192 GPU)")
    a("--requests", type=int, default=None, help="requests of the step (default: 2 CPU; GPU 4, 64 in dcp-decode)")
    a(
        "--cached",
        type=_int_list,
        default=None,
        help="cached prefix length, one or one per request (L or L1,L2,..; default 128 CPU, 8192 GPU)",
    )
    a("--topk", type=int, default=None, help="top-k entries per query token (default: 64 CPU, the preset's on GPU)")
    a(
        "--overlap",
        default="dsa",
        help="neighbour overlap of the synthetic top-k: dsa, dsa_low, random, or a correlation in [0, 1] (default dsa)",
    )
    a("--topk-file", default=None, help="recorded top-k: a torch file with 'topk' [T, K] int32 positions")
    a(
        "--topk-unique",
        action="store_true",
        help="sparse MLA: each token's top-k lists a position at most once (an indexer's; the synthetic top-k "
        "does), so prefill and decode skip de-duplicating it (Runtime's topk_unique); a --topk-file that "
        "repeats a position is refused",
    )
    a(
        "--query-len",
        "--q-len",
        dest="query_lens",
        type=_int_list,
        default=None,
        help="decode query tokens per request, drafts included (Q or Q1,..; default 1)",
    )
    a("--non-causal", dest="causal", action="store_false", help="speculative drafts see every KV token")
    a(
        "--window",
        type=int,
        default=-1,
        help="GQA presets: a sliding window, each query sees its last N + 1 keys (prefill and head-TP decode; "
        "default -1: none)",
    )
    a("--interleave", type=int, default=1, help="DCP interleave size (KV tokens per rank block)")
    a("--min-shard-tokens", type=int, default=None, help="ShardQ gate (default: 1 CPU, the planner's on GPU)")
    a("--iters", type=int, default=None, help="timed iterations (default: 3 CPU, 20 GPU)")
    a("--warmup", type=int, default=1, help="untimed iterations before timing (default 1)")
    a("--check", dest="check", action="store_true", default=None, help="compare with the single-process reference")
    a("--no-check", dest="check", action="store_false", help="skip the reference check (default on GPU)")
    a("--json", default=None, metavar="PATH", help="also write the report as JSON to PATH (rank 0)")
    a("--seed", type=int, default=0, help="seed of the synthetic inputs (default 0)")
    a("--timeout", type=float, default=120.0, help="seconds before a silent peer counts as failed (default 120)")
    a("--device", choices=DEVICES, default="auto", help="cuda when a GPU is visible, else cpu (default auto)")
    a("--dtype", choices=DTYPES, default="auto", help="activation dtype (default: bf16 GPU, fp32 CPU)")
    a(
        "--kv-dtype",
        choices=KV_DTYPES,
        default="bf16",
        help="KV-cache rows: bf16 = rows in the activation dtype (--dtype; bf16 on a GPU), fp8_ds_mla = 656-byte "
        "FP8 rows (512 e4m3 latent, 4 fp32 scales, 64 bf16 rope; sparse-MLA presets) (default bf16)",
    )
    a(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress (a bar on a terminal, else a line per phase of a run longer than 2 s)",
    )
    a("--progress-after", type=float, default=2.0, help=argparse.SUPPRESS)  # seconds before lines off a terminal
    a(
        "--log-level",
        choices=LOG_LEVELS,
        default="warning",
        help="the library's log messages shown on stderr (debug: every route decision; default warning)",
    )
    a(
        "--graph",
        action="store_true",
        help="GPU: also capture the decode step in a CUDA graph (where the policy allows) and time its replays",
    )
    a(
        "--compare",
        action="store_true",
        help="prefill: run head-TP, ShardQ and the router's choice in one run and print them side by side "
        "(on the CPU the router row routes by the conservative default cost table: a CPU run routes by the "
        "ShardQ gate alone otherwise)",
    )
    a(
        "--calibration",
        default=None,
        metavar="FILE",
        help="cost-model table for the router (default: the one shipped for the GPU; python -m shardattn.calibrate)",
    )
    a("--profile", action="store_true", help="after timing, profile one more step per rank and print rank 0's top ops")
    a("--fail-rank", type=int, default=None, help=argparse.SUPPRESS)  # debug: this rank dies
    a("--fail-at", choices=FAIL_POINTS, default="step", help=argparse.SUPPRESS)
    return p


def option_flags() -> dict[str, str]:
    """Each option's field of :class:`Options` -> its flag (``"query_lens"`` -> ``"--query-len"``)."""
    flags: dict[str, str] = {}
    for action in build_parser()._actions:  # the first flag of the first action of each field
        if action.option_strings and action.dest != "help":
            flags.setdefault(action.dest, action.option_strings[0])
    return flags


def parse_options(argv: list[str] | None = None) -> Options:
    """Parse the command line into :class:`Options` (raises :class:`LaunchError`, one line)."""
    ns = build_parser().parse_args(argv)
    opts = Options(**vars(ns))
    _check_ranges(opts)
    return opts


#: The largest size an option takes: positions and rows are int32.
MAX_SIZE = 2**31 - 1
#: The longest --timeout in seconds (a group's timeout is a timedelta; past about 1e14 s it overflows).
MAX_TIMEOUT_S = 1e6


def _check_ranges(o: Options) -> None:
    def positive(name: str, value: int | float | None, minimum: float = 1, maximum: float = MAX_SIZE) -> None:
        if value is None:
            return
        if value != value or value == float("inf"):  # NaN; an infinite --timeout overflows the group's timedelta
            raise LaunchError(f"shardattn.launch: error: --{name} must be a finite number >= {minimum:g}, got {value}")
        if value < minimum:
            raise LaunchError(f"shardattn.launch: error: --{name} must be >= {minimum:g}, got {value}")
        if value > maximum:
            bound = f"{maximum:,}" if isinstance(maximum, int) else f"{maximum:,.0f}"
            raise LaunchError(f"shardattn.launch: error: --{name} must be <= {bound}, got {value:,}")

    positive("heads", o.heads)
    positive("tokens", o.tokens)
    positive("requests", o.requests)
    positive("topk", o.topk)
    positive("iters", o.iters)
    positive("warmup", o.warmup, 0)
    positive("interleave", o.interleave)
    positive("window", o.window, -1)
    positive("min-shard-tokens", o.min_shard_tokens)
    positive("timeout", o.timeout, 1, MAX_TIMEOUT_S)
    positive("seed", o.seed, -(2**63), 2**64 - 1)  # torch.manual_seed's range
    positive("progress-after", o.progress_after, 0)
    if o.softmax_scale is not None and not (0 < o.softmax_scale < float("inf")):  # NaN fails this too
        raise LaunchError(
            f"shardattn.launch: error: --softmax-scale must be a finite number > 0, got {o.softmax_scale}"
        )
    for name, values in (("cached", o.cached), ("query-len", o.query_lens)):
        if values is not None and min(values) < (0 if name == "cached" else 1):
            raise LaunchError(f"shardattn.launch: error: --{name} entries must be >= {0 if name == 'cached' else 1}")
        if values is not None and max(values) > MAX_SIZE:
            raise LaunchError(f"shardattn.launch: error: --{name} entries must be <= {MAX_SIZE:,}, got {max(values):,}")
    # on the rank that writes the report (rank 0): another host may lack the path, and does not need it
    writes = os.environ.get("RANK", "0") == "0"
    if o.json is not None and writes and (why := unwritable_reason(o.json)) is not None:
        raise LaunchError(f"shardattn.launch: error: --json {o.json}: cannot write a report there ({why})")
    if o.fail_rank is not None and o.fail_rank < 0:
        raise LaunchError(f"shardattn.launch: error: --fail-rank must be >= 0, got {o.fail_rank}")


def _per_request(name: str, values: tuple[int, ...], requests: int) -> tuple[int, ...]:
    if len(values) == 1:
        return values * requests
    if len(values) != requests:
        raise LaunchError(
            f"shardattn.launch: error: --{name} takes one value or one per request ({requests}), got {len(values)}"
        )
    return values


def resolve_shape(o: Options, *, on_gpu: bool, preset_topk: int, decode_only: bool) -> Shape:
    """Fill unset sizes with the device's defaults (small on CPU, real shapes on GPU)."""
    requests = o.requests if o.requests is not None else ((64 if decode_only else 4) if on_gpu else 2)
    tokens = o.tokens if o.tokens is not None else (8192 if on_gpu else 256)
    cached = o.cached if o.cached is not None else ((8192,) if on_gpu else (128,))
    topk = o.topk if o.topk is not None else (preset_topk if on_gpu else 64)
    query_lens = o.query_lens if o.query_lens is not None else (1,)
    reduced = not on_gpu and (o.tokens is None or o.topk is None)
    return Shape(
        tokens=tokens,
        requests=requests,
        cached=_per_request("cached", cached, requests),
        topk=topk,
        query_lens=_per_request("query-len", query_lens, requests),
        reduced=reduced,
    )
