"""What a pool's steps accept, from its spec and its Runtimes' sizes, and the tensor checks a step's
requests go through on the driver (:mod:`shardattn.serving.requests` validates whole steps with them).

:func:`pool_shapes` gives a pool's :class:`PoolShapes`; :func:`check_q`, :func:`check_topk` and
:func:`kv_parts` check a request's or a step's queries, top-k positions and KV rows against them;
:func:`check_sinks` the pool's attention sinks. Every tensor is on the CPU (the driver's side).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardattn._checks import check_bool, check_int, check_scale, check_sink_logits, check_tensor
from shardattn.parallel.gqa_head_tp import head_tp_kv_heads
from shardattn.plan.kv_format import FP8_DS_MLA_DIMS, FP8_DS_MLA_ROW_BYTES, KV_FP8_DS_MLA, kv_format_name
from shardattn.plan.spec import ModelSpec
from shardattn.runtime.args import as_index
from shardattn.runtime.modes import DECODE_STEP, MODES, prefill_step_of
from shardattn.runtime.options import DecodeOptions, PrefillOptions
from shardattn.serving.kv_cache import plan_rank_cache

__all__ = [
    "CPU",
    "PoolShapes",
    "check_q",
    "check_runtime_scalars",
    "check_sinks",
    "check_topk",
    "dcp_interleave",
    "kv_parts",
    "pool_shapes",
    "prefill_lse",
]

#: The driver's device: every tensor a step is given lives here.
CPU = torch.device("cpu")


@dataclass(frozen=True)
class PoolShapes:
    """What the pool's steps accept (from its spec and Runtime sizes)."""

    kind: str  # "sparse_mla" or "gqa"
    heads: int
    head_dim: int
    kv_rows: tuple[tuple[tuple[int, ...], torch.dtype], ...]  # row shape and dtype of each KV component
    dtype: torch.dtype
    topk: int
    #: whether the Runtime's mode has a prefill step for the spec's kind (queries in a prefill step)
    prefill_attention: bool
    max_prefill_tokens: int
    max_decode_tokens: int
    #: the resident cache's components: ``kv_rows`` as given, or ``((656,), uint8)`` for a sparse-MLA
    #: pool whose Runtimes take ``kv_dtype="fp8_ds_mla"`` (new rows are quantised as they are stored)
    cache_rows: tuple[tuple[tuple[int, ...], torch.dtype], ...] = ()
    #: whether a prefill step can return the LSE (not when the Runtimes take ``PrefillOptions(return_lse=False)``)
    prefill_lse: bool = True


def dcp_interleave(runtime_kwargs: dict[str, Any]) -> int:
    """The DCP interleave the pool's Runtimes use (their ``decode_options``; default 1)."""
    options = runtime_kwargs.get("decode_options")
    if options is None:
        return 1
    if not isinstance(options, DecodeOptions):
        raise TypeError(f"runtime_kwargs['decode_options'] must be a DecodeOptions, got {type(options).__name__}")
    return options.dcp_interleave


def prefill_lse(runtime_kwargs: dict[str, Any]) -> bool:
    """Whether the pool's Runtimes return a prefill step's LSE (their ``prefill_options``; default yes)."""
    options = runtime_kwargs.get("prefill_options")
    if options is None:
        return True
    if not isinstance(options, PrefillOptions):
        raise TypeError(f"runtime_kwargs['prefill_options'] must be a PrefillOptions, got {type(options).__name__}")
    return options.return_lse


#: The :class:`~shardattn.runtime.runtime.Runtime` arguments a pool's ``runtime_kwargs`` may give
#: (the pool gives the spec, the group and the device itself).
RUNTIME_KWARGS = frozenset(
    ("mode", "max_batched_tokens", "max_decode_tokens", "scale", "topk", "prefill_options", "decode_options",
     "warmup", "kv_dtype", "host_id")
)  # fmt: skip


def pool_shapes(spec: ModelSpec, mode: str, runtime_kwargs: dict[str, Any]) -> PoolShapes:
    """What a pool of ``spec`` in ``mode`` accepts (``runtime_kwargs``: the Runtime's sizes and top-k,
    and its scalar arguments, :func:`check_runtime_scalars`, checked here, on the driver, before any
    rank starts)."""
    kw = "runtime_kwargs"
    unknown = sorted(set(runtime_kwargs) - RUNTIME_KWARGS)
    if unknown:
        raise ValueError(
            f"{kw} holds {unknown}, which a pool's Runtime does not take; it takes {sorted(RUNTIME_KWARGS)}"
        )
    check_runtime_scalars(runtime_kwargs)
    dtype = getattr(torch, spec.dtype)
    if spec.kind == "sparse_mla":
        rows: tuple = (((spec.head_dim,), dtype),)
    else:
        rows = (((spec.num_kv_heads, spec.head_dim), dtype), ((spec.num_kv_heads, spec.v_dim), dtype))
    cache_rows = rows
    if runtime_kwargs.get("kv_dtype") is not None:
        fmt = kv_format_name("runtime_kwargs['kv_dtype']", runtime_kwargs["kv_dtype"])
        if fmt == KV_FP8_DS_MLA:
            if spec.kind != "sparse_mla" or (spec.head_dim, spec.v_dim) != FP8_DS_MLA_DIMS:  # before a rank builds
                raise ValueError(
                    f"{kw}['kv_dtype']={fmt!r} holds DSA sparse-MLA rows (576 = 512 latent + 64 rope); the spec is a "
                    f"{spec.kind} model of head_dim {spec.head_dim} / v_dim {spec.v_dim}"
                )
            cache_rows = (((FP8_DS_MLA_ROW_BYTES,), torch.uint8),)
        elif fmt != spec.dtype:  # the pool's queries and resident rows are the spec's dtype
            raise ValueError(
                f"{kw}['kv_dtype']={fmt!r}: a pool's KV rows are its spec's {spec.dtype} (or {KV_FP8_DS_MLA}), "
                f"as are its queries; build the spec with dtype={fmt!r} instead"
            )
    return PoolShapes(
        kind=spec.kind,
        heads=spec.num_heads,
        head_dim=spec.head_dim,
        kv_rows=rows,
        cache_rows=cache_rows,
        dtype=dtype,
        topk=spec.topk
        if runtime_kwargs.get("topk") is None
        else check_int(f"{kw}['topk']", runtime_kwargs["topk"], minimum=1),
        prefill_attention=prefill_step_of(spec.kind, mode) is not None,
        prefill_lse=prefill_lse(runtime_kwargs),
        max_prefill_tokens=check_int(f"{kw}['max_batched_tokens']", runtime_kwargs["max_batched_tokens"], minimum=1),
        max_decode_tokens=check_int(
            f"{kw}['max_decode_tokens']", runtime_kwargs.get("max_decode_tokens", 256), minimum=1
        ),
    )


def check_runtime_scalars(runtime_kwargs: dict[str, Any]) -> None:
    """Check ``runtime_kwargs``' ``scale`` (a finite float > 0 or ``None``), ``warmup`` (a bool)
    and ``host_id`` (a str or ``None``) as the Runtime would on every rank.

    Raises:
        TypeError / ValueError: naming ``runtime_kwargs['...']``.
    """
    kw = "runtime_kwargs"
    if runtime_kwargs.get("scale") is not None:
        check_scale(f"{kw}['scale']", runtime_kwargs["scale"])
    if "warmup" in runtime_kwargs:
        check_bool(f"{kw}['warmup']", runtime_kwargs["warmup"])
    host_id = runtime_kwargs.get("host_id")
    if host_id is not None and not isinstance(host_id, str):
        raise TypeError(f"{kw}['host_id'] must be a str or None, got {type(host_id).__name__} ({host_id!r})")


def check_sinks(sinks: object, spec: ModelSpec) -> torch.Tensor | None:
    """The pool's attention sinks, checked: ``[H]`` fp32 finite logits on the CPU (one per query
    head of the whole model), given exactly when ``spec.has_sinks``; returned contiguous.

    Raises:
        TypeError / ValueError: naming ``sinks``.
    """
    if sinks is None:
        if spec.has_sinks:
            raise ValueError(f"sinks must be given ([{spec.num_heads}] fp32): the spec has has_sinks=True")
        return None
    if not spec.has_sinks:
        raise ValueError("sinks must be None: the spec has has_sinks=False (its kernels are built without sinks)")
    return check_sink_logits(sinks, spec.num_heads, device=CPU).contiguous()


def kv_parts(shapes: PoolShapes, kv: object, name: str, n: int | None) -> list[torch.Tensor]:
    """``kv`` (one tensor, or a ``(k, v)`` pair for GQA) as the list of its components, each checked
    as ``[n, *row]`` in the pool's KV dtype on the CPU (``n`` None: the first component's rows).

    Raises:
        TypeError / ValueError: naming ``name`` (or ``name[i]``).
    """
    parts = list(kv) if isinstance(kv, tuple | list) else [kv]
    if len(parts) != len(shapes.kv_rows):
        want = "one [n, D] tensor" if len(shapes.kv_rows) == 1 else "a (k, v) pair"
        raise TypeError(f"{name} must be {want} for a {shapes.kind} pool, got {type(kv).__name__}")
    rows = parts[0].shape[0] if isinstance(parts[0], torch.Tensor) and parts[0].dim() > 0 else n
    checked = []
    for i, (part, (row, dtype)) in enumerate(zip(parts, shapes.kv_rows)):
        label = name if len(parts) == 1 else f"{name}[{i}]"
        checked.append(check_tensor(label, part, dtypes=(dtype,), shape=(rows if n is None else n, *row), device=CPU))
    return checked


def check_q(shapes: PoolShapes, q: object, name: str) -> int:
    """Check ``q`` as ``[T, H, D]`` in the pool's dtype on the CPU; returns ``T``."""
    q = check_tensor(name, q, dtypes=(shapes.dtype,), shape=(None, shapes.heads, shapes.head_dim), device=CPU)
    return int(q.shape[0])


def check_topk(shapes: PoolShapes, topk: object, name: str, n: int) -> torch.Tensor:
    """``topk`` as ``[n, K]`` int32 on the CPU (int64 converted, its values checked)."""
    topk = as_index(name, topk) if isinstance(topk, torch.Tensor) and topk.device == CPU else topk
    return check_tensor(name, topk, dtypes=(torch.int32,), shape=(n, shapes.topk), device=CPU)


def rank_kv_heads(spec: ModelSpec, dcp: bool, world_size: int, rank: int) -> tuple[int, int] | None:
    """``[start, stop)`` of the KV heads rank ``rank`` keeps of a GQA pool's rows: under head-TP
    decode the rank's (:func:`~shardattn.parallel.gqa_head_tp.head_tp_kv_heads`, what its Runtime
    reads); ``None`` (whole rows) for sparse MLA, DCP or one rank."""
    if spec.kind != "gqa" or dcp or world_size == 1:
        return None
    return head_tp_kv_heads(spec.num_heads, spec.num_kv_heads, world_size, rank)


def rank_cache_rows(shapes: PoolShapes, heads: tuple[int, int] | None) -> tuple:
    """The resident cache's components on a rank that keeps ``heads`` of each row's KV heads."""
    if heads is None:
        return shapes.cache_rows
    return tuple(((heads[1] - heads[0], *row[1:]), dtype) for row, dtype in shapes.cache_rows)


@dataclass(frozen=True)
class PoolPlan:
    """What a pool of a spec builds, decided on the driver before any rank starts.

    Attributes:
        spec: the model. shapes: what its steps accept (:func:`pool_shapes`). sinks: the checked
        sinks (:func:`check_sinks`). decode_lse: whether a decode step can return the LSE (not a
        head-TP GQA pool whose Runtimes skip it). cache_config / cache_spec: the ledger's sizes and
        every rank's KV-cache shard (:func:`~shardattn.serving.kv_cache.plan_rank_cache`).
    """

    spec: ModelSpec
    shapes: PoolShapes
    sinks: torch.Tensor | None
    decode_lse: bool
    cache_config: Any
    cache_spec: dict[str, Any]


def plan_pool(
    spec: object, mode: str, runtime_kwargs: dict[str, Any], world_size: int, sinks: object, max_requests: int,
    max_seq_len: int, num_pages: int | None, memory_limit_bytes: int | None,
) -> PoolPlan:  # fmt: skip
    """Check a pool's model, mode, sinks and Runtime arguments and size its caches (``ValueError`` /
    ``TypeError`` naming the argument, before Ray starts)."""
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"spec must be a ModelSpec or a preset name, got {type(spec).__name__}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES} for a pool, got {mode!r}")
    if mode == "shardq" and spec.kind != "sparse_mla":  # a GQA model has no ShardQ step
        raise ValueError(
            f"mode 'shardq' serves sparse MLA only (ShardQ prefill); use 'headtp', 'mixed', 'pcp' or 'dcp-decode' "
            f"for a {spec.kind} spec"
        )
    sinks = check_sinks(sinks, spec)
    if "max_batched_tokens" not in runtime_kwargs:
        raise ValueError("runtime_kwargs must give max_batched_tokens (the largest prefill step)")
    shapes = pool_shapes(spec, mode, runtime_kwargs)
    dcp = DECODE_STEP[mode] == "dcp"
    interleave = dcp_interleave(runtime_kwargs)  # a decode_options that is not a DecodeOptions: TypeError
    options = runtime_kwargs.get("decode_options")
    decode_lse = options is None or options.return_lse  # every mode's decode drops it without return_lse
    rows = rank_cache_rows(shapes, rank_kv_heads(spec, dcp, world_size, 0))  # every rank's count
    cache_config, cache_spec = plan_rank_cache(
        spec.page_size, rows, dcp, world_size, interleave, max_requests, max_seq_len, num_pages, memory_limit_bytes,
    )  # fmt: skip
    return PoolPlan(spec, shapes, sinks, decode_lse, cache_config, cache_spec)
