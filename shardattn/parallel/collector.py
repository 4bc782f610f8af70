"""The collector: merge per-rank partial attention results by their LSEs, across a process group.

Every rank holds a partial ``(out [T, H, Dv], lse [T, H])`` over its own share of the keys
(its DCP shard of the KV cache, say) for the *same* ``T`` query tokens and ``H`` heads. The
collector returns, on every rank, the merge of all ``W`` partials
(:func:`shardattn.ops.lse_merge.merge_weights` / :func:`~shardattn.ops.lse_merge.lse_merge`,
the one implementation of the math) for the rank's head slice ``[T, H/W, Dv]``
(``scatter_heads=True``, heads ``rank*H/W .. (rank+1)*H/W``) or for all heads.

A rank that owns nothing for a row passes ``(0, -inf)`` there, the merge identity; a row empty
on every rank comes back as ``(0, -inf)``, never NaN.

Strategies (bytes one rank sends; ``b`` = the output's element size, LSEs are fp32):

* ``"all_to_all"``: one all-to-all of packed ``out + lse`` bytes; each rank receives its head
  slice of every partial and merges locally. ``scatter_heads=True`` only.
  Sends ``(W-1)/W * T*H*(b*Dv + 4)``.
* ``"all_gather"``: one all-gather of packed ``out + lse``, then a local merge. Any backend,
  either output layout. Sends ``T*H*(b*Dv + 4)`` (received ``W-1`` times).
* ``"reduce_scatter"``: all-gather of the LSEs, local rescale in fp32, reduce-scatter over heads
  (all-reduce for all heads). Sends ``T*H*4 + (W-1)/W * T*H*Dv*4``. Where the backend lacks a
  reduce-scatter, :class:`~shardattn.parallel.comm.Comm` falls back to an all-gather.

``"auto"`` takes ``"all_to_all"`` for the head-sliced layout on NCCL and gloo (fewest bytes:
the fp32 reduce-scatter sends about twice as much for bf16 outputs, in two collectives) and
``"all_gather"`` otherwise (all heads, or a backend whose all-to-all support is unknown).
"""

from __future__ import annotations

import math

import torch

from shardattn._checks import (
    FLOAT_DTYPES,
    check_bool,
    check_choice,
    check_disjoint,
    check_not_inputs,
    check_same_device,
    check_tensor,
)
from shardattn.ops.lse_merge import merge_weights, run_lse_merge, weighted
from shardattn.parallel.agreement import Fingerprint
from shardattn.parallel.comm import Comm, pack_rows, unpack_rows
from shardattn.parallel.groups import GroupLike
from shardattn.parallel.packing import check_byte_buffers, packed_nbytes, view_bytes

__all__ = ["STRATEGIES", "collect_checked", "collect_partials", "resolve_strategy"]

STRATEGIES = ("auto", "all_to_all", "all_gather", "reduce_scatter")
_ALL_TO_ALL_BACKENDS = ("nccl", "gloo")


def resolve_strategy(strategy: str, backend: str, *, scatter_heads: bool) -> str:
    """The concrete strategy ``"auto"`` stands for (others are returned as given, if valid).

    >>> resolve_strategy("auto", "nccl", scatter_heads=True), resolve_strategy("auto", "gloo", scatter_heads=False)
    ('all_to_all', 'all_gather')
    """
    check_choice("strategy", strategy, STRATEGIES)
    if strategy == "auto":
        return "all_to_all" if scatter_heads and backend in _ALL_TO_ALL_BACKENDS else "all_gather"
    if strategy == "all_to_all" and not scatter_heads:
        raise ValueError(
            "strategy='all_to_all' leaves each rank with its head slice only; "
            "use scatter_heads=True, or strategy='all_gather' / 'reduce_scatter' for all heads"
        )
    return strategy


def check_partials(out: torch.Tensor, lse: torch.Tensor, world_size: int, *, scatter_heads: bool) -> None:
    """Validate one rank's partial (shapes, dtypes, head split); raises before any collective."""
    check_tensor("out", out, dtypes=FLOAT_DTYPES, ndim=3)
    t, h, _ = out.shape
    check_tensor("lse", lse, dtypes=(torch.float32,), shape=(t, h))
    check_same_device(out=out, lse=lse)
    if scatter_heads and h % world_size:
        raise ValueError(
            f"out has {h} heads, not divisible by world_size={world_size} (scatter_heads=True gives "
            f"every rank H / world_size heads)"
        )


def collect_partials(
    out: torch.Tensor,
    lse: torch.Tensor,
    group: GroupLike | Comm,
    *,
    scatter_heads: bool = True,
    strategy: str = "auto",
    check: bool = True,
    buffers: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge every rank's partial attention result; each rank gets its head slice (or all heads).

    Args:
        out: ``[T, H, Dv]`` fp16/bf16/fp32, this rank's partial output over its keys (all heads).
        lse: ``[T, H]`` fp32 natural-log LSE of ``out``; ``-inf`` where this rank saw no key
            (``out`` must then be 0 there).
        group: the process group of the partials (or a :class:`~shardattn.parallel.comm.Comm`)
            (a ``ProcessGroup``, a 1-D ``DeviceMesh`` or ``(mesh, dim name)``: :mod:`~shardattn.parallel.groups`).
        scatter_heads: return heads ``rank*H/W .. (rank+1)*H/W`` only (``H % W == 0``);
            ``False``: all ``H`` heads on every rank.
        strategy: ``"auto"``, ``"all_to_all"``, ``"all_gather"`` or ``"reduce_scatter"`` (module
            docstring).
        check: first check that every rank passes the same shapes and dtype (one small
            all-gather, a host synchronisation); a mismatch raises ``ValueError`` on every rank.
        buffers: optional flat ``uint8`` buffers ``{"send", "recv"}`` of at least
            ``W * packed_nbytes`` bytes each: the ``"all_to_all"`` strategy packs into the first and
            receives into the second instead of allocating (a Runtime's reserved workspace); other
            strategies allocate. ``"send"`` may not share memory with ``out`` or ``lse`` (``"recv"``
            may: the partial has been packed by the time it is written).
    Returns:
        ``(out [T, H/W or H, Dv] in out's dtype, lse [T, H/W or H] fp32)``; rows empty on every
        rank are ``(0, -inf)``. No autograd history (inputs that require grad are read as values).

    Example (every rank runs this; ``group`` is a gloo group of ``W`` ranks)::

        out, lse = sparse_mla_attention(q_all_heads, kv_local, rows_local, scale=s)  # [T, H, 512]
        out, lse = collect_partials(out, lse, group)        # [T, H / W, 512], [T, H / W]
    """
    comm = Comm.wrap(group)
    chosen = ""

    def validate() -> int:
        nonlocal chosen
        check_bool("check", check)
        check_bool("scatter_heads", scatter_heads)
        if buffers is not None and not isinstance(buffers, dict):
            raise TypeError(f"buffers must be a dict {{'send', 'recv'}} of uint8 buffers, got {type(buffers).__name__}")
        check_partials(out, lse, comm.world_size, scatter_heads=scatter_heads)
        chosen = resolve_strategy(strategy, comm.backend, scatter_heads=scatter_heads)
        t, h, dv = out.shape
        check_byte_buffers(buffers, exchange_bytes(t, h, dv, out.dtype, comm.world_size, scatter_heads, chosen),
                           out.device, "buffers", dtypes=exchange_dtypes(out.dtype))  # fmt: skip
        if buffers is not None:  # the exchange reads one while it writes the other
            check_disjoint(**{f"buffers['{k}']": v for k, v in buffers.items() if isinstance(v, torch.Tensor)})
            # the partial is packed into "send" as it is read; "recv" is written once it has been read
            check_not_inputs({"buffers['send']": buffers.get("send")}, {"out": out, "lse": lse}, reader="the collector")
        if not check:
            return 0  # nothing to agree on
        return Fingerprint(
            "collect_partials",
            {
                "out's shape": tuple(out.shape),
                "out's dtype": out.dtype,
                "scatter_heads": scatter_heads,
                "strategy": chosen,
            },
        )

    comm.agree_on("collector input (out shape and dtype, scatter_heads, strategy)", validate, check=check)
    # a failure from here on is reported to the waiting peers; inference: partials that require
    # grad are read as their values (the collectives write in place), as by the ops
    with comm.reporting_failures(), torch.no_grad():
        return collect_checked(out, lse, comm, chosen, scatter_heads, buffers)


def _exchange_specs(t: int, heads: int, dv: int, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The packed rows one rank sends another under ``"all_to_all"``: ``heads`` of ``T`` outputs and LSEs."""
    return [((t, heads, dv), dtype), ((t, heads), torch.float32)]


def exchange_bytes(
    t: int, heads: int, dv: int, dtype: torch.dtype, world_size: int, scatter_heads: bool, strategy: str
) -> dict[str, int]:
    """Bytes of the ``{"send", "recv"}`` buffers a collection of partials ``[T, heads, dv]`` reads
    under ``strategy`` (none but ``"all_to_all"``'s)."""
    if strategy != "all_to_all" or world_size == 1:
        return {}
    hs = heads // world_size if scatter_heads else heads
    n = world_size * packed_nbytes(_exchange_specs(t, hs, dv, dtype))
    return {"send": n, "recv": n}


def exchange_dtypes(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The widest element the ``"all_to_all"`` exchange views its ``{"send", "recv"}`` buffers as
    (outputs of ``dtype`` and fp32 LSEs, packed side by side): their starts must be aligned for it."""
    widest = dtype if dtype.itemsize > 4 else torch.float32
    return {"send": widest, "recv": widest}


def collect_checked(
    out: torch.Tensor,
    lse: torch.Tensor,
    comm: Comm,
    strategy: str,
    scatter_heads: bool,
    buffers: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`collect_partials` after validation: ``out`` / ``lse`` checked (or built by a step
    from its own checked inputs), ``strategy`` resolved (:func:`resolve_strategy`), the ranks
    agreed (or the caller skips agreement). No checks, no agreement: the step's hot path.
    ``buffers``: as :func:`collect_partials`'s (default: allocated per call)."""
    buffers = buffers or {}
    w, rank = comm.world_size, comm.rank
    t, h, dv = out.shape
    hs = h // w if scatter_heads else h
    h0 = rank * hs if scatter_heads else 0
    if t == 0 or h == 0:  # nothing to exchange (the same on every rank); Dv = 0 still merges the LSEs
        return out[:, h0 : h0 + hs].clone(), lse[:, h0 : h0 + hs].clone()
    if w == 1:  # one partial, as the merge of several gives: (0, -inf) for lse +-inf, a NaN lse a NaN
        # row, every other row its own bits (torch ops: no merge kernel a Runtime's warm-up would compile)
        o, s = out[:, h0 : h0 + hs], lse[:, h0 : h0 + hs]
        empty, broken = s.isinf(), s.isnan()
        o = o.masked_fill(empty[..., None], 0).masked_fill(broken[..., None], math.nan)
        return o, s.masked_fill(empty, -math.inf)
    if strategy == "reduce_scatter":
        return _reduce_scatter(out, lse, comm, scatter_heads)
    specs = _exchange_specs(t, hs, dv, out.dtype)
    if strategy == "all_to_all":
        # row j = what rank j needs: its head slice of this rank's partial
        outs = out.reshape(t, w, hs, dv).permute(1, 0, 2, 3)
        lses = lse.reshape(t, w, hs).permute(1, 0, 2)
        shape = (w, packed_nbytes(specs))
        buf = pack_rows([outs, lses], out=view_bytes(buffers.get("send"), shape, torch.uint8, "send", "buffers"))
        recv = view_bytes(buffers.get("recv"), shape, torch.uint8, "recv", "buffers")
        got = comm.all_to_all(buf, [1] * w, [1] * w, out=recv)  # [W, nbytes]: every rank's partial, my heads
        part_out, part_lse = unpack_rows(got, specs)
    else:  # all_gather
        buf = pack_rows([out.unsqueeze(0), lse.unsqueeze(0)])[0]
        got = comm.all_gather(buf)  # [W, nbytes]
        full_out, full_lse = unpack_rows(got, [((t, h, dv), out.dtype), ((t, h), torch.float32)])
        part_out, part_lse = full_out[:, :, h0 : h0 + hs], full_lse[:, :, h0 : h0 + hs]
    return run_lse_merge(part_out, part_lse)  # the partials were checked (or built) by the caller


def _reduce_scatter(
    out: torch.Tensor, lse: torch.Tensor, comm: Comm, scatter_heads: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather LSEs, rescale this rank's partial in fp32, sum over ranks (scattered by heads)."""
    w, rank = comm.world_size, comm.rank
    t, h, dv = out.shape
    lses = comm.all_gather(lse)  # [W, T, H]
    weights, merged_lse = merge_weights(lses)
    scaled = weighted(weights[rank], out)  # [T, H, Dv] fp32; 0 on rows empty here
    if not scatter_heads:
        return comm.all_reduce(scaled).to(out.dtype), merged_lse
    hs = h // w
    by_rank = scaled.view(t, w, hs, dv).permute(1, 0, 2, 3).reshape(w, t * hs * dv)
    mine = comm.reduce_scatter(by_rank).view(t, hs, dv)
    return mine.to(out.dtype), merged_lse[:, rank * hs : (rank + 1) * hs].contiguous()
