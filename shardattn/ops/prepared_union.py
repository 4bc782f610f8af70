"""A union built once for several kernel calls: the whole share's build, sliced per call.

A pipelined ShardQ step (:mod:`shardattn.parallel.shardq`) runs one kernel call per chunk of a
rank's tokens, and each call would build its own union (:func:`~shardattn.ops.union.build_union`:
the row sort, a few launches) between two kernels. :func:`prepare_union` builds the union of all
the rank's tokens once instead, and :meth:`PreparedUnion.tokens` hands each call its slice. The
build is the same function on the same rows, and a group's entries depend only on its own ``G``
queries and their positions ``t % G``, so slicing at a multiple of ``G`` gives the very entries
(and lengths) a build of the slice would::

    tokens  0 1 | 2 3 | 4 5 | 6        G = 2, chunks [0, 4) and [4, 7)
    groups   g0 |  g1 |  g2 | g3       chunk 0: groups g0 g1; chunk 1: g2 g3 (the tail, query 6 alone)

At ``G = 1``, where a call of its own would drop each query's repeats by hash instead of building
(a cache past the bitmap's count, :func:`union_for_call`), the slice holds the same rows sorted:
the same keys, in another order of the kernel's sums.

Cut at multiples of ``SLICE_GROUPS`` groups (ShardQ's ``one_union`` chunk boundaries are) so the
slices keep the alignment the kernels were compiled for. The kernel entries take it as ``prepared_union=``
(:func:`~shardattn.ops.sparse_mla.sparse_mla_attention` with ``G = 1``,
:func:`~shardattn.ops.sparse_mla_grouped.sparse_mla_grouped_prefill`) and then build nothing;
the torch reference path checks it and ignores it (it reads ``rows``).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

from shardattn._checks import check_disjoint, check_int, check_not_inputs, check_tensor
from shardattn.kernels.gluon.union_smem import smem_unsupported_reason
from shardattn.kernels.triton.pack_rows import pack_rows
from shardattn.ops.kv_fp8_stage import kernel_rows, stage_marks, stage_touched, stages_packed
from shardattn.ops.union import build_union, check_union_args, num_groups
from shardattn.ops.unique_rows import unique_rows
from shardattn.plan.union_routing import route_row_dedup

__all__ = ["SLICE_GROUPS", "PreparedUnion", "check_prepared_union", "prepare_union", "union_for_call"]

#: Slices that start at a multiple of this many groups start their ``lens`` (int32) at a multiple of
#: 16 bytes, like a union built for the slice alone: Triton and Gluon specialise a kernel on its
#: pointers' 16-byte alignment, so such slices reuse the kernel compiled (and warmed up) for
#: whole builds. (The union rows are ``G * K * 4`` bytes, 16-byte multiples for ``K % 4 == 0``.)
SLICE_GROUPS = 4


@dataclass(frozen=True)
class PreparedUnion:
    """The union of ``num_tokens`` consecutive query tokens, built ahead of their kernel call(s).

    Attributes:
        union: ``[ceil(T/G), G*K]`` int32, :func:`~shardattn.ops.union.build_union`'s output.
        lens: ``[ceil(T/G)]`` int32 entries used per group.
        group_size: ``G``; num_tokens: ``T``.
    """

    union: torch.Tensor
    lens: torch.Tensor
    group_size: int
    num_tokens: int

    def tokens(self, start: int, stop: int) -> PreparedUnion:
        """The union of tokens ``start .. stop`` (views, no copy): ``start`` a multiple of ``G``,
        ``stop`` one too or the last token's end.

        >>> rows = torch.tensor([[1, 2], [2, 5], [5, -1]], dtype=torch.int32)
        >>> whole = prepare_union(rows, group_size=2, num_kv_rows=8)
        >>> part = whole.tokens(2, 3)
        >>> part.num_tokens, part.lens.tolist(), part.union.tolist()  # row 5, picked by query 0 of the group
        (1, [1], [[16777221, -1, -1, -1]])
        >>> torch.equal(part.union, prepare_union(rows[2:], group_size=2, num_kv_rows=8).union)
        True
        """
        g, t = self.group_size, self.num_tokens
        check_int("start", start, minimum=0)
        check_int("stop", stop, minimum=start)
        if stop > t:
            raise ValueError(f"stop must be <= the prepared union's {t} tokens, got {stop}")
        if start % g or (stop % g and stop != t):
            raise ValueError(
                f"start and stop must be multiples of the group size {g} (stop may be the last token's end {t}), "
                f"got {start}..{stop}"
            )
        g0, g1 = start // g, num_groups(stop, g)
        return PreparedUnion(self.union[g0:g1], self.lens[g0:g1], g, stop - start)

    def split(self, bounds: list[int]) -> list[PreparedUnion]:
        """:meth:`tokens` of ``bounds[i] .. bounds[i + 1]`` for every ``i`` (one split per tensor):
        ``bounds`` non-decreasing from 0 to the last token's end, multiples of ``G`` but the last.

        >>> rows = torch.tensor([[1], [2], [3], [4], [5]], dtype=torch.int32)
        >>> [p.num_tokens for p in prepare_union(rows, group_size=2, num_kv_rows=8).split([0, 2, 2, 5])]
        [2, 0, 3]
        """
        g, t = self.group_size, self.num_tokens
        if not bounds or bounds[0] != 0 or bounds[-1] != t or any(b < a for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"bounds must rise from 0 to the prepared union's {t} tokens, got {list(bounds)}")
        if any(b % g for b in bounds[:-1]):
            raise ValueError(f"bounds must be multiples of the group size {g} (but the last), got {list(bounds)}")
        sizes = [num_groups(b, g) - a // g for a, b in itertools.pairwise(bounds)]
        parts = zip(self.union.split(sizes), self.lens.split(sizes), bounds, bounds[1:])
        return [PreparedUnion(u, n, g, b - a) for u, n, a, b in parts]


def _workspace_pair(workspace: object, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``workspace`` checked: ``None``, or ``(union_bytes, lens_bytes)``, each ``None`` or a flat
    contiguous uint8 buffer on ``device`` whose start is int32-aligned, the two not sharing bytes."""
    if workspace is None:
        return None, None
    if not (isinstance(workspace, tuple | list) and len(workspace) == 2):
        raise TypeError(f"workspace must be a (union_bytes, lens_bytes) pair, got {type(workspace).__name__}")
    bufs = []
    for i, buf in enumerate(workspace):
        if buf is not None:
            check_tensor(f"workspace[{i}]", buf, dtypes=(torch.uint8,), ndim=1, device=device)
            if not buf.is_contiguous() or buf.data_ptr() % 4:
                raise ValueError(f"workspace[{i}] must be a contiguous buffer starting on a 4-byte boundary")
        bufs.append(buf)
    a, b = bufs
    check_disjoint(**{"workspace[0]": a, "workspace[1]": b})
    return a, b


def prepare_union(
    rows: torch.Tensor,
    *,
    group_size: int,
    num_kv_rows: int,
    topk_length: torch.Tensor | None = None,
    workspace: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
) -> PreparedUnion | None:
    """Build the union of all ``rows`` once (:func:`~shardattn.ops.union.build_union`), for
    calls on slices of them (:meth:`PreparedUnion.tokens`).

    Args:
        rows: ``[T, K]`` int32 global KV rows (``-1`` / out of range invalid, anywhere).
        group_size: ``G`` in ``(1, 2, 4, 8)``, the kernel path's. num_kv_rows: ``R``.
        topk_length: ``[T]`` int32 per-row count of leading entries to use, optional.
        workspace: optional ``(union_bytes, lens_bytes)`` ``uint8`` buffers to build into (a
            Runtime's ``prefill.union`` / ``prefill.union_offsets``); ``None`` entries or no
            workspace: allocated. The bytes the build writes share no memory with ``rows`` or
            ``topk_length``.
    Returns:
        the :class:`PreparedUnion`, or ``None`` when ``workspace`` is given and too small for the
        whole union (the caller then builds per call, as without it: same results).
    """
    # every argument checked before a workspace too small returns None: a bad one is an error either way
    check_union_args(rows, group_size, num_kv_rows, topk_length)
    g = group_size
    t, k = rows.shape
    n_groups = num_groups(t, g)
    out = None
    union_ws, lens_ws = _workspace_pair(workspace, rows.device)
    if union_ws is not None and lens_ws is not None:
        need_union, need_lens = n_groups * g * k * 4, n_groups * 4
        if need_union > union_ws.numel() or need_lens > lens_ws.numel():
            return None
        union = union_ws[:need_union].view(torch.int32).view(n_groups, g * k)
        out = (union, lens_ws[:need_lens].view(torch.int32))
        # the bytes the build writes, named as the caller passed them
        check_not_inputs({"workspace[0]": out[0], "workspace[1]": out[1]}, {"rows": rows, "topk_length": topk_length})
    union, lens = build_union(rows, group_size=g, num_kv_rows=num_kv_rows, topk_length=topk_length, out=out)
    return PreparedUnion(union, lens, g, t)


def check_prepared_union(
    prepared: object, rows: torch.Tensor, group_size: int | None = None, name: str = "prepared_union"
) -> PreparedUnion:
    """``prepared`` is a :class:`PreparedUnion` for ``rows`` ``[T, K]`` (``T`` tokens, width
    ``G * K``, rows' device) and, when given, for ``group_size``; raises ``TypeError`` /
    ``ValueError`` naming ``name`` otherwise."""
    if not isinstance(prepared, PreparedUnion):
        raise TypeError(f"{name} must be a PreparedUnion (from prepare_union), got {type(prepared).__name__}")
    t, k = rows.shape
    g = prepared.group_size
    if group_size is not None and g != check_int("group_size", group_size):
        raise ValueError(f"{name} was built for group size {g}, but this call's kernel path uses G = {group_size}")
    if prepared.num_tokens != t:
        raise ValueError(f"{name} holds {prepared.num_tokens} tokens, rows has {t}")
    n = num_groups(t, g)
    check_tensor(f"{name}.union", prepared.union, dtypes=(torch.int32,), shape=(n, g * k), device=rows.device)
    check_tensor(f"{name}.lens", prepared.lens, dtypes=(torch.int32,), shape=(n,), device=rows.device)
    return prepared


def _hashes(rows: torch.Tensor, num_kv_rows: int, rows_sorted: bool) -> bool:
    """A per-query call de-duplicates ``rows`` ``[T, K]`` by hash rather than by a union build:
    where the build would sort (:func:`~shardattn.plan.union_routing.route_row_dedup` by the
    cache's size, whatever the token count: a prefill call is not latency-bound as a few-token
    decode is); sorted rows keep the build, which then needs no sort."""
    if rows_sorted:
        return False
    shared_memory = smem_unsupported_reason(rows, 1) is None
    return route_row_dedup(rows.shape[1], num_kv_rows, shared_memory=shared_memory) == "unique"


def union_for_call(
    prepared: PreparedUnion | None,
    rows: torch.Tensor,
    kv: torch.Tensor,
    *,
    group_size: int,
    dtype: torch.dtype,
    topk_length: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    rows_sorted: bool = False,
    rows_unique: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prefill kernel call's ``(kv, union, lens)``: the ``prepared`` union (already checked against
    ``rows``), else :func:`~shardattn.ops.union.build_union` of ``rows`` now (into ``out`` when
    given). On ``fp8_ds_mla`` rows, the staged rows and union where staging pays: on a large cache
    the union is built over the staged rows (packed layout,
    :func:`~shardattn.ops.kv_fp8_stage.stage_touched`); on a mirrored one the union build marks
    the touched blocks (:func:`~shardattn.ops.kv_fp8_stage.stage_marks`); a prepared union is
    staged at the call (:func:`~shardattn.ops.kv_fp8_stage.kernel_rows`). ``dtype``: the staged
    rows' (q's). At ``G = 1`` on rows in q's dtype the kernels need no row order, so the union is
    each query's valid rows packed to the front in their order
    (:func:`~shardattn.kernels.triton.pack_rows.pack_rows`, one pass): as given under
    ``rows_unique`` (no row twice in a query's list, trusted; docs/DECISIONS.md, D107), else after
    :func:`~shardattn.ops.unique_rows.unique_rows` drops each repeat, where
    :func:`~shardattn.plan.union_routing.route_row_dedup` prefers that hash to the union build
    (a cache too large for the bitmap's count, where the build would sort; D108)."""
    if prepared is not None:
        kv, union = kernel_rows(kv, prepared.union, prepared.lens, group_size=group_size, dtype=dtype)
        return kv, union, prepared.lens
    if group_size == 1 and kv.dtype != torch.uint8 and (rows_unique or _hashes(rows, kv.shape[0], rows_sorted)):
        if not rows_unique:
            rows = unique_rows(rows, num_kv_rows=kv.shape[0], topk_length=topk_length)
        return kv, *pack_rows(rows, num_kv_rows=kv.shape[0], width=rows.shape[1], topk_length=topk_length, out=out)
    build = functools.partial(
        build_union, group_size=group_size, topk_length=topk_length, out=out, rows_sorted=rows_sorted
    )
    groups, width = num_groups(rows.shape[0], group_size), group_size * rows.shape[1]
    if stages_packed(kv, groups * width):
        staged = stage_touched(kv, rows, topk_length, group_size=group_size, dtype=dtype, build=build)
        return staged if staged is not None else (kv, *build(rows, num_kv_rows=kv.shape[0]))
    marks = stage_marks(kv, groups, width)
    union, lens = build(rows, num_kv_rows=kv.shape[0], block_marks=marks)
    kv, union = kernel_rows(kv, union, lens, group_size=group_size, dtype=dtype, marks=marks)
    return kv, union, lens
