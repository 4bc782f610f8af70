"""Sparse-MLA decode: few query tokens, many heads, each token with its own top-k rows.

Same contract as :func:`~shardattn.ops.sparse_mla.sparse_mla_attention` (and tested against
its reference :func:`~shardattn.ops.sparse_mla.sparse_mla_reference`)::

    out[t, h] = softmax(scale * q[t, h] . kv[rows[t]]^T) @ kv[rows[t], :v_dim]

Decode has one query token per request (or ``q_len`` tokens under speculative decoding: each
draft token has its own top-k row, so it is simply another token). It is memory bound: the
work is reading ``K`` rows of 576 dims per token. The Triton split-KV kernel
(:mod:`~shardattn.kernels.triton.sparse_mla_decode`) runs one program per (head block, token,
split of the top-k row) and merges the splits by LSE (column or row merge:
:func:`~shardattn.plan.decode_routing.route_decode_merge`), as programmatic dependent launches on sm_90.
The torch reference is :func:`~shardattn.ops.sparse_mla.sparse_mla_reference`.

Backends: on an sm_90 GPU with Triton's Gluon, DSA shapes and bf16/fp16, calls of at most
:data:`~shardattn.plan.decode_routing.SMALL_DECODE_MAX_HEADS` heads and
:data:`~shardattn.plan.decode_routing.SMALL_DECODE_MAX_TOKENS` tokens run the small-batch Gluon kernel
(:mod:`~shardattn.kernels.gluon.sparse_mla_decode_small`: one warpgroup per 64 entries of a split,
its rows gathered at once, the heads as the ``wgmma`` N; the same column merge); as many heads
over more tokens (bf16 / fp16 rows; ``fp8_ds_mla`` rows from
:data:`~shardattn.plan.crossovers.STREAM_DECODE_FP8_MIN_BLOCKS_PER_SM` 64-entry blocks per SM) run the
streaming Gluon kernel (:mod:`~shardattn.kernels.gluon.sparse_mla_decode_stream`:
persistent programs, a ``cp.async`` ring of blocks per SM, the heads as the ``wgmma`` N); at
:data:`~shardattn.plan.decode_routing.GLUON_DECODE_MIN_HEADS` heads or more (DSA shapes, bf16/fp16) and
batches of at least :data:`~shardattn.plan.decode_routing.GLUON_DECODE_MIN_QUERY_ROWS` query rows (tokens x heads;
``fp8_ds_mla`` rows: :data:`~shardattn.plan.decode_routing.GLUON_DECODE_FP8_MIN_QUERY_ROWS`),
the call runs the warp-specialised Gluon kernel instead
(:mod:`~shardattn.kernels.gluon.sparse_mla_decode`: one program per token x 64 heads over the
whole row, or over row slices merged by LSE when that leaves SMs idle); same contract, same
outputs. :func:`~shardattn.ops.dispatch.sparse_decode_kernel` says which runs and why;
``backend=`` forces one (and raises where it cannot run). The launch knobs (split count, tiles,
merge kernel) are the private runners' (:func:`~shardattn.kernels.triton.sparse_mla_decode.run_split_decode`,
:func:`~shardattn.ops.sparse_mla_decode_gluon.sparse_mla_decode_gluon`), which benchmarks call.

A row listed twice by one token is one key (the library-wide rule): by default each token's rows
are first de-duplicated by :func:`~shardattn.ops.unique_rows.decode_rows`: each repeat set to
``-1`` in place by a hash per token whose cost does not follow the cache size
(:func:`~shardattn.ops.unique_rows.unique_rows`) up to 8 tokens, and from 9 where the cache's
words are past the bitmap's ratio; else sorted by the bitmap union build
(:func:`~shardattn.ops.union.build_union`, ``G = 1``, in shared memory on sm_90), which also
takes a top-k past the hash's 8,192 entries (D96). ``rows_unique=True`` skips that when the
caller guarantees unique rows (an indexer's top-k is), and duplicates would then count twice in
the kernels (the torch reference, which CPU tensors run, counts a row once whatever the flag).

LSE: fp32 natural log, includes the sink term; a row with no valid key gives ``(0, -inf)``
(``(0, sink)`` with sinks), so a DCP rank with an empty local shard contributes the merge
identity. Capture-safe: no host sync; the grid depends on shapes only.
"""

from __future__ import annotations

import torch

from shardattn._checks import check_bool, check_disjoint, check_int, check_split_workspace, check_tensor
from shardattn.ops.dispatch import decode_path, pdl_supported, sm_count
from shardattn.ops.head_blocked import store_result
from shardattn.ops.sparse_mla import empty_kv_result, has_keys, sparse_mla_reference
from shardattn.ops.sparse_mla_checks import check_destinations, check_sparse_mla_inputs, join_q
from shardattn.ops.unique_rows import decode_rows

__all__ = ["BACKENDS", "run_sparse_mla_decode", "sparse_mla_decode"]

#: ``backend=`` values: routed, or one kernel forced.
BACKENDS = (None, "triton", "gluon", "gluon_small", "gluon_stream")


def sparse_mla_decode(
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    kv: torch.Tensor,
    rows: torch.Tensor,
    *,
    scale: float,
    v_dim: int = 512,
    topk_length: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    rows_unique: bool = False,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    backend: str | None = None,
    kv_format: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse-MLA decode attention with split-KV and a merge; returns the LSE (DCP needs it).

    Args:
        q: ``[T, H, D]`` fp16/bf16/fp32 (``D = 576``: 512 latent + 64 rope), or
            ``(q_latent, q_rope)``. T = decode tokens (requests x draft length).
        kv: ``[R, D]`` KV rows in q's dtype (the value is ``kv[:, :v_dim]``), or ``fp8_ds_mla``
            rows, uint8 ``[R, 656]`` (every kernel dequantises them before its bf16 matrix
            multiplies); either paged, ``[P, page, D]`` / ``[P, page, 656]`` (row ``p * page + i``).
        rows: ``[T, K]`` int32 global rows; ``-1`` / out of range = invalid, anywhere.
        scale: softmax scale, the model's (:func:`~shardattn.plan.spec.mla_softmax_scale`).
        v_dim: value width (512).
        topk_length: ``[T]`` int32 per-row count of leading entries to use, optional.
        sinks: ``[H]`` fp32 sink logits, optional.
        rows_unique: the caller guarantees no row appears twice in a token's list (skips the
            kernels' de-duplication; duplicates would then count twice there, not in the reference).
        out, lse_out: optional destinations ``[T, H, v_dim]`` (q's dtype) and ``[T, H]`` fp32.
        workspace: optional flat (1-D, contiguous) fp32 buffer on q's device for the split
            partials (``num_splits * T * H * (v_dim + 1)`` elements); with ``out``, ``lse_out``
            and it, nothing is allocated. The three share no memory with each other nor with an
            input (the kernels write partials and outputs while other programs still read q,
            rows and keys). A workspace too small for the small-batch kernel's splits routes the
            call to Triton; the Gluon kernels then take fewer row slices; one too small for the
            Triton kernel's splits is a ``ValueError`` before anything runs.
        backend: ``None`` (routed: :func:`~shardattn.ops.dispatch.sparse_decode_kernel`),
            ``"triton"``, ``"gluon"``, ``"gluon_small"`` or ``"gluon_stream"`` (forced, also outside the routing's
            crossovers; a ``ValueError`` where the kernel cannot run these tensors).
        kv_format: the format ``kv`` must hold (as
            :func:`~shardattn.ops.sparse_mla.sparse_mla_attention`'s); ``None`` takes ``kv``'s.
    Returns:
        ``(out [T, H, v_dim] in q's dtype, lse [T, H] fp32 natural log)``; a row with no valid
        key is ``(0, -inf)`` (``(0, sink)`` with sinks). CPU tensors run the reference (routed;
        a forced ``backend`` raises there unless the Triton interpreter runs ``"triton"``).

    Example:
        >>> q, kv = torch.randn(2, 4, 24), torch.randn(9, 24)
        >>> rows = torch.tensor([[0, 8, -1], [-1, -1, -1]], dtype=torch.int32)
        >>> out, lse = sparse_mla_decode(q, kv, rows, scale=0.2, v_dim=16)
        >>> tuple(out.shape), bool(lse[1].isneginf().all())
        ((2, 4, 16), True)
    """
    q = join_q(q)
    kv = check_sparse_mla_inputs(
        q, kv, rows, v_dim=v_dim, topk_length=topk_length, sinks=sinks, scale=scale, kv_format=kv_format
    )
    t, h, _ = q.shape
    if backend not in BACKENDS:
        raise ValueError(f"backend must be None, 'triton', 'gluon', 'gluon_small' or 'gluon_stream', got {backend!r}")
    check_bool("rows_unique", rows_unique)
    if out is not None:
        check_tensor("out", out, dtypes=(q.dtype,), shape=(t, h, v_dim), device=q.device)
    if lse_out is not None:
        check_tensor("lse_out", lse_out, dtypes=(torch.float32,), shape=(t, h), device=q.device)
    if workspace is not None:  # the kernels' split partials are fp32 views of its first elements
        check_split_workspace(workspace, q.device)
    check_disjoint(out=out, lse_out=lse_out, workspace=workspace)
    check_destinations({"out": out, "lse_out": lse_out, "workspace": workspace}, q, kv, rows, topk_length, sinks)
    kernel, _why = decode_path(q, kv, rows, v_dim, backend=backend, workspace=workspace, num_sms=sm_count(q.device))
    return run_sparse_mla_decode(
        q, kv, rows, scale=scale, v_dim=v_dim, topk_length=topk_length, sinks=sinks, rows_unique=rows_unique,
        out=out, lse_out=lse_out, workspace=workspace, kernel=kernel,
    )  # fmt: skip


def run_sparse_mla_decode(
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    *,
    scale: float,
    v_dim: int = 512,
    topk_length: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    rows_unique: bool = False,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    kernel: str = "triton",
    num_splits: int | None = None,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sparse_mla_decode` on arguments already checked, on the named ``kernel`` (no routing):
    ``"reference"``, ``"triton"``, ``"gluon"``, ``"gluon_small"`` or ``"gluon_stream"``
    (:func:`~shardattn.ops.dispatch.decode_path` says which runs where), with the launch knobs the public
    entry keeps private, for tuning, warm-up and benchmarks: ``num_splits`` (the Triton kernel's
    splits, the Gluon kernels' row slices) and ``config`` (the Triton kernel's launch overrides:
    :func:`~shardattn.kernels.triton.sparse_mla_decode_config.decode_launch`; the 64-key Gluon
    kernel's grid, ``{"persistent": bool}``, instead of its plan's). ``q`` is ``[T, H, D]``.

    Raises:
        ValueError: a knob the kernel does not take (``config`` off Triton and Gluon, or other than
            ``{"persistent": bool}`` on Gluon, ``num_splits`` on the
            small-batch kernel, which picks its own), or a ``workspace`` smaller than the Triton
            kernel's splits need, before any kernel runs (the union build included).
    """
    if kernel not in ("reference", "triton", "gluon", "gluon_small", "gluon_stream"):
        raise ValueError(
            f"kernel must be 'reference', 'triton', 'gluon', 'gluon_small' or 'gluon_stream', got {kernel!r}"
        )
    if num_splits is not None:
        check_int("num_splits", num_splits, minimum=1)
        if kernel == "gluon_small":
            raise ValueError("the small-batch kernel chooses its own splits (small_decode_tiles): pass num_splits=None")
    if config is not None and kernel not in ("triton", "gluon"):
        raise ValueError(f"config is the Triton or Gluon kernel's launch configuration; kernel={kernel!r} takes none")
    if config is not None and kernel == "gluon":
        if set(config) != {"persistent"}:
            raise ValueError(f"config of the Gluon kernel is {{'persistent': bool}}, got {config!r}")
        if not isinstance(config["persistent"], bool):
            raise TypeError(f"config['persistent'] must be a bool, got {type(config['persistent']).__name__}")
    t, h, _ = q.shape
    if not has_keys(kv, rows):  # every row is empty, on every kernel
        return store_result(empty_kv_result(q, v_dim, sinks), out, lse_out)
    if kernel == "reference":
        with torch.no_grad():  # inference, as the kernels: no autograd history on any device
            result = sparse_mla_reference(q, kv, rows, scale=scale, v_dim=v_dim, topk_length=topk_length, sinks=sinks)
        return store_result(result, out, lse_out)
    out = torch.empty(t, h, v_dim, dtype=q.dtype, device=q.device) if out is None else out
    lse_out = torch.empty(t, h, dtype=torch.float32, device=q.device) if lse_out is None else lse_out
    if t == 0 or h == 0:
        return out, lse_out
    num_sms = sm_count(q.device)
    if kernel == "gluon":
        from shardattn.ops.sparse_mla_decode_gluon import sparse_mla_decode_gluon

        return sparse_mla_decode_gluon(
            q, kv, rows, scale=float(scale), v_dim=v_dim, out=out, lse_out=lse_out, num_sms=num_sms,
            topk_length=topk_length, sinks=sinks, num_splits=num_splits, rows_unique=rows_unique, workspace=workspace,
            persistent=None if config is None else config["persistent"],
        )  # fmt: skip
    if kernel == "triton":  # the launch, and a workspace's size against it, before the union is built
        from shardattn.kernels.triton.lse_merge import split_partials_numel
        from shardattn.kernels.triton.sparse_mla_decode_config import decode_launch

        launch = decode_launch(
            t, h, rows.shape[1], num_sms, num_splits, config, head_dim=q.shape[2], v_dim=v_dim,
            elem_bytes=q.element_size(), kv_fp8=kv.dtype == torch.uint8,
        )  # fmt: skip
        need = split_partials_numel(launch["num_splits"], t, h, v_dim)
        if workspace is not None and workspace.numel() < need:
            raise ValueError(
                f"workspace must hold >= {need} fp32 elements for the Triton kernel's {launch['num_splits']} "
                f"splits of {t} tokens x {h} heads; it has {workspace.numel()}"
            )
    if not rows_unique and rows.shape[1] > 1:
        # the kernels below are programmatic dependent launches (where the device takes them): the
        # hash lets them launch at once
        rows, topk_length, _packed = decode_rows(rows, num_kv_rows=kv.shape[0], topk_length=topk_length, pdl=True)
    if kernel == "gluon_stream":
        from shardattn.kernels.gluon.sparse_mla_decode_stream import sparse_mla_decode_stream

        return sparse_mla_decode_stream(
            q, kv, rows, scale=float(scale), out=out, lse_out=lse_out, topk_length=topk_length, sinks=sinks,
            workspace=workspace, num_sms=num_sms, pdl=pdl_supported(q.device), num_splits=num_splits,
        )  # fmt: skip
    if kernel == "gluon_small":
        from shardattn.kernels.gluon.sparse_mla_decode_small import sparse_mla_decode_small

        return sparse_mla_decode_small(
            q, kv, rows, scale=float(scale), out=out, lse_out=lse_out, topk_length=topk_length, sinks=sinks,
            workspace=workspace, num_sms=num_sms, pdl=pdl_supported(q.device),
        )  # fmt: skip
    from shardattn.kernels.triton.sparse_mla_decode import run_split_decode

    run_split_decode(
        q, kv, rows, scale=scale, topk_length=topk_length, sinks=sinks, out=out, lse_out=lse_out, launch=launch,
        workspace=workspace,
    )  # fmt: skip
    return out, lse_out
