"""The argument checks every sparse-MLA entry shares (:func:`~shardattn.ops.sparse_mla.sparse_mla_attention`,
:func:`~shardattn.ops.sparse_mla_grouped.sparse_mla_grouped_prefill`,
:func:`~shardattn.ops.sparse_mla_decode.sparse_mla_decode`, and the KV rows of the parallel steps):
each raises ``TypeError`` / ``ValueError`` naming the argument before any kernel runs.

Example:
    >>> q = (torch.zeros(2, 4, 512), torch.zeros(2, 4, 64))
    >>> tuple(join_q(q).shape)
    (2, 4, 576)
    >>> check_kv_rows("kv", torch.zeros(10, 64), torch.zeros(2, 4, 576), v_dim=512)
    Traceback (most recent call last):
    ...
    ValueError: q must have last dim 64 (kv's row width), got 576 (q [2, 4, 576], kv [10, 64])
"""

from __future__ import annotations

import torch

from shardattn._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_bool,
    check_disjoint,
    check_int,
    check_not_inputs,
    check_same_device,
    check_scale,
    check_sink_logits,
    check_tensor,
)
from shardattn.ops.head_blocked import check_destination, shape_stand_in

__all__ = [
    "check_destinations",
    "check_head_dim",
    "check_kv_rows",
    "check_sparse_mla_inputs",
    "check_sparse_prefill_inputs",
    "check_union_workspace",
    "join_q",
]


def join_q(q: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Accept ``q`` whole (``[T, H, D]``) or split into latent and rope views.

    Args:
        q: ``[T, H, D]`` or a tuple ``(q_latent [T, H, Dl], q_rope [T, H, Dr])``.
    Returns:
        ``[T, H, Dl + Dr]`` (the input itself when not split).
    """
    if isinstance(q, tuple | list):
        if len(q) != 2:
            raise ValueError(f"q as a tuple must be (q_latent, q_rope), got {len(q)} parts")
        latent, rope = q
        check_tensor("q_latent", latent, dtypes=FLOAT_DTYPES, ndim=3)
        check_tensor("q_rope", rope, dtypes=(latent.dtype,), shape=(latent.shape[0], latent.shape[1], None))
        return torch.cat([latent, rope], dim=-1)
    return q


def check_sparse_mla_inputs(
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    *,
    v_dim: int,
    topk_length: torch.Tensor | None,
    sinks: torch.Tensor | None,
    scale: object,
    kv_format: str | None = None,
) -> torch.Tensor:
    """Validate the arguments of every sparse-MLA entry (all backends); raises before any kernel runs.

    ``scale`` is required (a float, finite and > 0: there is no default, the model's scale is not
    ``D ** -0.5`` of the absorbed rows; ``None`` is a ``TypeError``). ``kv`` holds
    rows in q's dtype or ``fp8_ds_mla`` rows (``kv_format``: :func:`~shardattn.ops.kv_fp8_layout.resolve_kv`).
    Returns ``kv`` as ``[R, row]`` rows (a paged FP8 cache as a flat view).
    """
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3)
    t, h, d = q.shape
    kv = check_kv_rows("kv", kv, q, v_dim=v_dim, kv_format=kv_format)
    check_tensor("rows", rows, dtypes=INDEX_DTYPES, ndim=2)
    if rows.shape[0] != t:
        raise ValueError(f"rows must have one row per query token ({t}), got shape {list(rows.shape)}")
    check_int("v_dim", v_dim)
    if not 0 < v_dim <= d:
        raise ValueError(f"v_dim must be in (0, {d}], got {v_dim}")
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtypes=INDEX_DTYPES, shape=(t,))
    if sinks is not None:
        check_sink_logits(sinks, h)
    check_scale("scale", scale)
    check_same_device(q=q, kv=kv, rows=rows, topk_length=topk_length, sinks=sinks)
    return kv


def check_sparse_prefill_inputs(
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    kv: torch.Tensor,
    rows: torch.Tensor,
    *,
    v_dim: int,
    topk_length: torch.Tensor | None,
    sinks: torch.Tensor | None,
    scale: object,
    kv_format: str | None,
    return_lse: object,
    out: torch.Tensor | None,
    lse_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate the arguments a sparse-MLA prefill entry shares (:func:`check_sparse_mla_inputs`,
    ``return_lse``, the destinations ``out [T, H, v_dim]`` in q's dtype and ``lse_out [T, H]`` fp32,
    plain or head-blocked); raises before any kernel runs.

    Returns:
        ``(q, q3, kv)``: ``q`` joined (:func:`join_q`; ``[T, H, D]`` or head-blocked
        ``[B, T, H/B, D]``), its ``[T, H, D]`` stand-in for shapes
        (:func:`~shardattn.ops.head_blocked.shape_stand_in`) and ``kv`` as ``[R, row]`` rows.
    """
    q = check_tensor("q", join_q(q))  # a tensor before its dims are read (head-blocked or not)
    q3 = shape_stand_in(q)
    kv = check_sparse_mla_inputs(
        q3, kv, rows, v_dim=v_dim, topk_length=topk_length, sinks=sinks, scale=scale, kv_format=kv_format
    )
    check_bool("return_lse", return_lse)
    if out is not None:
        check_destination("out", out, q3, (v_dim,), q.dtype)
    if lse_out is not None:
        check_destination("lse_out", lse_out, q3, (), torch.float32)
    check_disjoint(out=out, lse_out=lse_out)
    return q, q3, kv


def check_destinations(
    written: dict[str, torch.Tensor | None],
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    topk_length: torch.Tensor | None,
    sinks: torch.Tensor | None,
    union: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """The buffers a sparse-MLA call writes (``written``: ``out``, ``lse_out``, a split or union
    workspace) share no memory with what it reads: ``q`` (joined, plain or head-blocked: the
    tensor the kernels read, not a shape stand-in), ``kv``, ``rows``, ``topk_length``, ``sinks`` and
    a prepared ``union`` (``(union, lens)``). The kernels' programs write their output tiles
    while other programs still read queries, rows and keys, so an overlap gives wrong results with
    no error (:func:`~shardattn._checks.check_not_inputs`; host-side, no device sync). Raises
    ``ValueError`` naming both arguments."""
    read = {"q": q, "kv": kv, "rows": rows, "topk_length": topk_length, "sinks": sinks}
    if union is not None:
        read.update({"prepared_union.union": union[0], "prepared_union.lens": union[1]})
    check_not_inputs(written, read)


def check_kv_rows(
    name: str, kv: object, q: torch.Tensor, *, v_dim: int, kv_format: str | None = None, q_name: str = "q"
) -> torch.Tensor:
    """``kv`` as the KV rows of queries ``q [..., D]``: rows of ``D`` values in q's dtype, or
    ``fp8_ds_mla`` rows (``D = 576``, ``v_dim = 512``; any float q). ``kv_format``: the format
    declared (``None``: taken from ``kv``'s dtype). Returns ``[R, row]`` rows (a paged FP8 cache as
    a flat view); raises ``TypeError`` / ``ValueError`` naming ``name`` (and the format)."""
    from shardattn.ops.kv_fp8_layout import resolve_kv

    rows, _ = resolve_kv(name, kv, head_dim=q.shape[-1], v_dim=v_dim, kv_format=kv_format)
    if rows.dtype != torch.uint8:
        check_tensor(name, rows, dtypes=(q.dtype,), ndim=2)
        check_head_dim(q_name, q, name, rows)
    return rows


def check_head_dim(q_name: str, q: torch.Tensor, kv_name: str, kv: torch.Tensor) -> None:
    """``q [..., D]`` and ``kv [R, D]`` share ``D``; a mismatch blames the query (the per-call tensor)."""
    if q.shape[-1] != kv.shape[-1]:
        raise ValueError(
            f"{q_name} must have last dim {kv.shape[-1]} ({kv_name}'s row width), got {q.shape[-1]} "
            f"({q_name} {list(q.shape)}, {kv_name} {list(kv.shape)})"
        )


def check_union_workspace(
    union: object, device: torch.device, name: str = "union"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``union``: a grouped prefill's union workspace, as :func:`~shardattn.ops.union.build_union`
    returns and takes as ``out``: ``(union [groups, G*K], lens [groups])``, both contiguous int32 on
    ``device`` (rows'), the two not sharing bytes (the build writes both). Its size is the path's
    ``G`` (checked where the union is built). Raises ``TypeError`` / ``ValueError`` naming ``name``.

    >>> cpu = torch.device("cpu")
    >>> u = check_union_workspace((torch.zeros(2, 8, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)), cpu)
    >>> check_union_workspace((u[0], u[1].long()), cpu)
    Traceback (most recent call last):
    ...
    TypeError: union[1] must have dtype in (int32), got int64
    """
    if not (isinstance(union, tuple | list) and len(union) == 2):
        got = f"{len(union)} items" if isinstance(union, tuple | list) else type(union).__name__
        raise TypeError(f"{name} must be a (union, lens) pair of tensors, got {got}")
    buf = check_tensor(f"{name}[0]", union[0], dtypes=INDEX_DTYPES, ndim=2, device=device)
    lens = check_tensor(f"{name}[1]", union[1], dtypes=INDEX_DTYPES, shape=(buf.shape[0],), device=buf.device)
    for i, t in enumerate((buf, lens)):
        if not t.is_contiguous():
            raise ValueError(f"{name}[{i}] must be contiguous (the union build writes it as a dense buffer)")
    check_disjoint(**{f"{name}[0]": buf, f"{name}[1]": lens})
    return buf, lens
