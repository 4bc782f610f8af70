"""ShardQ prefill: turn head sharding into token sharding for sparse MLA, and back.

Under tensor parallelism every rank holds ``H / W`` heads of every query token and the whole
(replicated) KV cache. A sparse MLA kernel tiles 64 or 128 query rows per step, so 8 or 16 heads
per rank leave most of each tile as padding. ShardQ moves queries so each rank runs *every* head
for a zigzag slice of the step's tokens (:func:`~shardattn.plan.zigzag_split`), then moves the
outputs back::

    rank r: q [T, H/W, D] (all tokens, its heads)
        -- first all-to-all -->  q [T_r, H, D] (its zigzag tokens, all heads)
        -- local sparse attention over the replicated KV, rows[tokens of r] -->
           out [T_r, H, Dv], lse [T_r, H]
        -- second all-to-all (out and lse, one message each per peer) -->
           out [T, H/W, Dv], lse [T, H/W] in token order

The step is pipelined (:mod:`shardattn.plan.pipeline`): each rank's tokens are cut into ``C``
chunks; chunk ``c``'s kernel waits only for its own query exchange, and chunk ``c``'s output
exchange starts right after its kernel, so the kernels run while later queries and earlier outputs
are in flight. The kernel call gets the wait of its chunk's query exchange as ``q_ready`` and
issues its row sort (union build, which reads only ``rows``) before it, so the sort overlaps the
exchange. The host issues, in this order: chunk 0's query exchange (before any other set-up), then
per chunk ``c``: its union build, chunk ``c + 1``'s query exchange, its kernel, its output
exchange. (Issuing every query exchange first, as an earlier version did, held chunk 0's sort and
kernel behind about 0.6 ms of host time per further exchange while the device sat idle.) Each
exchange issues its messages before its local copy. Ordering is by the process group's stream events
(:class:`~shardattn.parallel.comm.Pending`): no host synchronisation inside the step.

Messages: a zigzag share is two token runs per request. A chunked step sends each run as its own
message, in place: queries go out as contiguous token runs of ``q_heads_local`` and land in a
receive buffer ``[W, n_c, H/W, D]`` the kernel reads in place (head-blocked strides); the kernel
writes ``out`` / ``lse`` into send buffers ``[W, n_c, H/W, ...]`` whose runs land directly at
their token positions of the result. A message costs about 30 us of host time, which an
unchunked step would pay before its device starts, so a one-chunk step
(:attr:`~shardattn.plan.pipeline.PipelinePlan.one_message_per_peer`) sends one message per peer
and direction instead: it gathers the tokens for peer ``j`` (one ``index_select``) into the
output send buffer (free until the kernel, which waits for this exchange), sends its send
buffers whole, receives the peers' outputs into the query receive buffer (read by then) and
scatters them to their tokens (one ``index_copy_`` per peer) after the exchange; the price is one
device copy of the bytes that cross. Both give the same bits.

Two opt-in options, same bits (neither measured on GPUs yet): ``taper=True`` cuts the shares
``1, 2, ..., 2, 1`` (:func:`~shardattn.plan.pipeline.chunk_weights`): the first query exchange and
the last output exchange, which nothing hides, carry ``1/(2C-2)`` of a share instead of ``1/C``.
``one_union=True`` builds the union of the rank's whole share once, right after chunk 0's query
exchange is issued (:func:`~shardattn.kernels.prepared_union.prepare_union`), and gives each
chunk's kernel call its slice (``prepared_union=``), so no row sort runs between two kernels.

Host work per chunk (``tests/test_shardq_host_ops.py`` bounds it): the views of a chunk's token
runs come from one split per buffer (and of ``q`` / ``out`` / ``lse`` once per step), its buffers
from one ``as_strided`` each; the device ops are the three local pieces a rank keeps; nothing
reads device data back.

Exactly ``2 C`` exchanges (each counted as one ``"all_to_all"``) per sharded step (plus, with
``check=True``, one small all-gather that makes the ranks agree on the plan and shapes first). A
plan that is not sharded (fewer tokens than ``min_tokens``) runs head-TP locally with no
collective at all.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from shardattn._checks import FLOAT_DTYPES, INDEX_DTYPES, check_int, check_same_device, check_scale, check_tensor
from shardattn.kernels.prepared_union import SLICE_GROUPS, prepare_union
from shardattn.kernels.sparse_mla import check_head_dim, sparse_mla_attention
from shardattn.kernels.union import GROUP_SIZES, MAX_PACKED_ROWS
from shardattn.parallel.comm import Comm, stable_fingerprint
from shardattn.parallel.groups import GroupLike
from shardattn.parallel.packing import view_bytes
from shardattn.plan.pipeline import CHUNK_ALIGN, PipelinePlan, choose_chunks, pipeline_plan
from shardattn.plan.zigzag import ShardPlan

__all__ = ["shardq_prefill"]

AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _check_inputs(
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    plan: ShardPlan,
    comm: Comm,
    v_dim: int,
    topk_length: torch.Tensor | None,
    sinks: torch.Tensor | None,
    scale: float,
    check: bool,
    pipeline: tuple[int | None, int, bool, bool],
) -> int:
    """Validate one rank's ShardQ inputs; returns the fingerprint the ranks must agree on
    (``pipeline``: ``(chunks, align, taper, one_union)``, which every rank must cut alike)."""
    if not isinstance(plan, ShardPlan):
        raise TypeError(f"plan must be a ShardPlan (from zigzag_split), got {type(plan).__name__}")
    if plan.world_size != comm.world_size:
        raise ValueError(f"plan is for world_size={plan.world_size}, but the group has {comm.world_size} ranks")
    check_tensor("q_heads_local", q, dtypes=FLOAT_DTYPES, ndim=3)
    t, h, d = q.shape
    if t != plan.num_tokens:
        raise ValueError(f"q_heads_local must hold the step's {plan.num_tokens} tokens (plan), got {t}")
    if h < 1:
        raise ValueError(f"q_heads_local must hold at least one head, got shape {list(q.shape)}")
    check_tensor("kv", kv, dtypes=(q.dtype,), ndim=2)
    check_head_dim("q_heads_local", q, "kv", kv)
    check_scale("scale", scale)
    check_tensor("rows", rows, dtypes=INDEX_DTYPES, ndim=2)
    if rows.shape[0] != t:
        raise ValueError(f"rows must have one row per token ({t}), got shape {list(rows.shape)}")
    check_int("v_dim", v_dim, minimum=1)
    if v_dim > d:
        raise ValueError(f"v_dim must be <= the head dim {d}, got {v_dim}")
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtypes=INDEX_DTYPES, shape=(t,))
    if sinks is not None:
        check_tensor("sinks", sinks, dtypes=(torch.float32,), shape=(h * comm.world_size,))
    check_same_device(q_heads_local=q, kv=kv, rows=rows, topk_length=topk_length, sinks=sinks)
    chunks, align, taper, one_union = pipeline
    if chunks is not None:
        check_int("chunks", chunks, minimum=1)
    check_int("align", align, minimum=1)
    if not isinstance(taper, bool):
        raise TypeError(f"taper must be a bool, got {type(taper).__name__}")
    if not isinstance(one_union, bool):
        raise TypeError(f"one_union must be a bool, got {type(one_union).__name__}")
    if one_union and align not in GROUP_SIZES:  # the union's G (checked here, before any message)
        raise ValueError(f"align must be one of {GROUP_SIZES} with one_union (the union's group size), got {align}")
    if one_union and align > 1 and kv.shape[0] > MAX_PACKED_ROWS:
        raise ValueError(
            f"one_union with align={align} needs kv with <= {MAX_PACKED_ROWS} rows (24-bit packed union entries), "
            f"got {kv.shape[0]}; use align=1 (the per-query path) for such caches"
        )
    return stable_fingerprint(
        "shardq",
        plan.fingerprint() if check else None,
        pipeline,
        tuple(q.shape),
        q.dtype,
        rows.shape[1],
        v_dim,
        sinks is not None,
    )


def shardq_prefill(
    q_heads_local: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    plan: ShardPlan,
    group: GroupLike | Comm,
    *,
    scale: float,
    v_dim: int = 512,
    topk_length: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = True,
    attention: AttentionFn = sparse_mla_attention,
    check: bool = True,
    chunks: int | None = 1,
    align: int = 1,
    taper: bool = False,
    one_union: bool = False,
    workspace: dict[str, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA prefill with queries moved from head shards to zigzag token shards and back.

    Every rank of ``group`` calls this with the same ``plan`` and its own head slice (heads
    ``rank * H/W .. (rank+1) * H/W``, the usual TP split).

    Args:
        q_heads_local: ``[T, H/W, D]`` fp16/bf16/fp32, this rank's heads of all ``T`` tokens of
            the step (``D = 576`` for DSA models).
        kv: ``[R, D]`` the KV rows in q's dtype, identical on every rank (replicated under TP);
            the value is ``kv[:, :v_dim]``.
        rows: ``[T, K]`` int32 global KV rows of every token's top-k (identical on every rank);
            ``-1`` / out of range = invalid, anywhere in a row.
        plan: :func:`~shardattn.plan.zigzag_split` of the step (``world_size`` = the group's).
        group: the TP process group, or a :class:`~shardattn.parallel.comm.Comm` over it
            (a ``ProcessGroup``, a 1-D ``DeviceMesh`` or ``(mesh, dim name)``: :mod:`~shardattn.parallel.groups`).
        scale: softmax scale. v_dim: value width (512 for DSA models).
        topk_length: ``[T]`` int32 per-token count of leading ``rows`` entries to use, optional.
        sinks: ``[H]`` fp32 per-head sink logits (all heads), optional.
        return_lse: also return the LSE (packed into the second all-to-all).
        attention: the local kernel, called like
            :func:`~shardattn.kernels.sparse_mla.sparse_mla_attention` with ``return_lse=True``
            and ``out=``/``lse=`` destinations; sharded steps pass it head-blocked ``q``, ``out``
            and ``lse`` (``[W, n, H/W, ...]``: the receive and send buffers, used in place) and
            ``q_ready=``, a callable it must run before it reads ``q`` (the wait of the chunk's
            query exchange: work that needs only ``rows``, like the union build, goes before it).
        check: make the ranks agree on the plan and shapes first (one small all-gather, a host
            sync); bad input or a different plan on any rank then raises on every rank.
        chunks: pipeline depth ``C``; ``None``: the planner's
            :func:`~shardattn.plan.pipeline.choose_chunks` of the largest rank share's work. Every
            value gives the same result, bit for bit. Default 1 (not pipelined); the Runtime passes
            ``None``.
        align: chunk boundaries are multiples of it (the kernel's group size ``G``).
        taper: cut the first and last chunks half as large as the middle ones (``C >= 3``;
            :func:`~shardattn.plan.pipeline.chunk_weights`): the exposed first query exchange and
            last output exchange shrink. Opt-in (not measured on GPUs yet); same bits.
        one_union: build the union of the rank's whole share once, right after chunk 0's query
            exchange is issued (:func:`~shardattn.kernels.prepared_union.prepare_union`, ``G =
            align``), and hand each chunk's kernel call its slice as ``prepared_union=`` (so no
            row sort runs between two chunks' kernels). ``attention`` must then take that keyword
            and use ``G = align`` (the Runtime's and the library's entries do); chunk boundaries
            are then multiples of ``4 G`` (:data:`~shardattn.kernels.prepared_union.SLICE_GROUPS`:
            aligned slices, the kernels' compiled variants). Opt-in; same bits. A ``workspace``
            without room for the whole union: per-chunk builds, as without it.
        workspace: optional ``uint8`` buffers ``{"q", "out", "lse", "rows", "union", "lens"}`` the
            receive / send buffers, the rank's rows of ``rows`` (int32) and, with ``one_union``,
            the whole share's union and lengths are carved from (the Runtime's ``prefill.packed_q``
            / ``.out`` / ``.lse`` / ``.topk_rows`` / ``.union`` / ``.union_offsets``); default:
            allocated per step.
        out / lse: optional destinations ``[T, H/W, v_dim]`` / ``[T, H/W]`` (contiguous).
    Returns:
        ``out [T, H/W, v_dim]`` in q's dtype, token order, this rank's heads; and
        ``lse [T, H/W]`` fp32 natural log with ``return_lse``. A token with no valid row is
        ``(0, -inf)`` (``(0, sink)`` with sinks). Equal to running the kernel on all heads of
        all tokens in one process.

    Example (every rank of a TP group of ``W`` runs this)::

        plan = zigzag_split(seq_lens, W, align=G, min_tokens=1024)   # same on every rank
        out, lse = shardq_prefill(q_local, kv, rows, plan, group, scale=576 ** -0.5)
        # q_local [T, H/W, 576] -> out [T, H/W, 512], lse [T, H/W]
    """
    comm = Comm.wrap(group)
    pipeline = (chunks, align, taper, one_union)
    comm.agree_on(
        "ShardQ plan and inputs",
        lambda: _check_inputs(q_heads_local, kv, rows, plan, comm, v_dim, topk_length, sinks, scale, check, pipeline),
        check=check,
    )
    with comm.reporting_failures():  # a failure from here on is reported to the waiting peers
        q = q_heads_local
        h, rank = q.shape[1], comm.rank
        if not plan.sharded:  # head-TP: all tokens, this rank's heads, nothing moves
            local_sinks = None if sinks is None else sinks[rank * h : (rank + 1) * h]
            kw = {} if out is None and lse is None else {"out": out, "lse": lse}
            out, lse = attention(
                q, kv, rows, scale=scale, v_dim=v_dim, topk_length=topk_length, sinks=local_sinks, return_lse=True, **kw
            )
            return (out, lse) if return_lse else out

        if chunks is None:  # the planner's pick from the largest share's work
            chunks = choose_chunks(int(plan.counts.max()), heads=h * comm.world_size, topk=max(1, rows.shape[1]))
        # one_union: chunk slices of the union start 16-byte aligned (SLICE_GROUPS), as whole builds do
        pipe = pipeline_plan(plan, chunks, align=align * (SLICE_GROUPS if one_union else 1), taper=taper)
        return _pipelined(
            q, kv, rows, plan, pipe, comm, scale=scale, v_dim=v_dim, topk_length=topk_length, sinks=sinks,
            return_lse=return_lse, attention=attention, workspace=workspace, out=out, lse=lse,
            union_groups=align if one_union else None,
        )  # fmt: skip


def _carve(
    buf: torch.Tensor | None, name: str, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """Contiguous views ``[shape]`` of ``dtype`` laid one after another (each at a multiple of 256
    bytes) in the uint8 ``buf``, one ``as_strided`` each (new tensors when ``buf`` is None)."""
    if buf is None:
        return [torch.empty(s, dtype=dtype, device=device) for s in shapes]
    starts, off, end = [], 0, 0
    for s in shapes:
        end = off + math.prod(s) * dtype.itemsize
        if end > buf.numel():
            raise ValueError(f"workspace[{name!r}] holds {buf.numel()} B, the pipelined step needs at least {end} B")
        starts.append(off)
        off += -(-(end - off) // CHUNK_ALIGN) * CHUNK_ALIGN
    flat = buf[:end].view(dtype)
    base, size = flat.storage_offset(), dtype.itemsize
    return [flat.as_strided(s, _contiguous_strides(s), base + o // size) for s, o in zip(shapes, starts)]


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _staging(
    spare: torch.Tensor, parts: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device
) -> list[torch.Tensor]:
    """Views for ``parts`` (``(shape, dtype)``, 256-byte aligned) in the bytes of ``spare``, a buffer
    the step does not use while the views live; new tensors when they do not fit (very uneven
    chunks)."""
    need, off = [], 0
    for shape, dtype in parts:
        need.append(off)
        off += -(-math.prod(shape) * dtype.itemsize // CHUNK_ALIGN) * CHUNK_ALIGN
    raw = spare.reshape(-1).view(torch.uint8)
    if off > raw.numel():
        return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in parts]
    return [
        raw[o : o + math.prod(shape) * dtype.itemsize].view(dtype).view(shape) for o, (shape, dtype) in zip(need, parts)
    ]


def _runs_of(x: torch.Tensor, pipe: PipelinePlan) -> dict[int, torch.Tensor]:
    """Token start -> view of every run (:meth:`PipelinePlan.token_runs`) of the token-order ``x`` (one split)."""
    runs = pipe.token_runs()
    return dict(zip((s for s, _ in runs), x.split([n for _, n in runs])))


def _pieces(buf: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    """A chunk buffer ``[W, n, ...]`` cut into its rank-major runs (``sizes``) by one split."""
    return buf.flatten(0, 1).split(sizes)


def _pipelined(
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    plan: ShardPlan,
    pipe: PipelinePlan,
    comm: Comm,
    *,
    scale: float,
    v_dim: int,
    topk_length: torch.Tensor | None,
    sinks: torch.Tensor | None,
    return_lse: bool,
    attention: AttentionFn,
    workspace: dict[str, torch.Tensor] | None,
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    union_groups: int | None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The sharded step, chunk by chunk (module docstring); ``union_groups``: ``G`` of the share's
    union built once (``one_union``), or None (each kernel call builds its own)."""
    w, rank = comm.world_size, comm.rank
    t, h, d = q.shape
    dev = q.device
    q_src = q.contiguous()
    ws = workspace or {}
    n_c = [pipe.count(rank, c) for c in range(pipe.chunks)]
    gathered = pipe.one_message_per_peer
    peers = [j for j in range(w) if j != rank]
    # every rank's token ids (rank-major) on the device, once; ids(j, c): rank j's tokens of chunk c
    all_ids = plan.gather_index.to(dev, non_blocking=True) if gathered else None
    first = plan.rank_offsets.tolist()

    def ids(j: int, c: int) -> torch.Tensor:
        return all_ids[first[j] + int(pipe.bounds[j, c]) : first[j] + int(pipe.bounds[j, c + 1])]

    # views made once per step, not per chunk and run: every run of q (token start -> view); a chunk
    # buffer [W, n, ...] is cut into rank-major pieces, one per run of mine: their sizes, and the
    # peer each piece comes from (queries) or goes to (outputs)
    q_runs = {} if gathered else _runs_of(q_src, pipe)
    mine = [[n for _ in range(w) for _, _, n in pipe.runs(rank, c)] for c in range(pipe.chunks)]
    peer_of = [[i for i in range(w) for _ in pipe.runs(rank, c)] for c in range(pipe.chunks)]
    q_bufs = _carve(ws.get("q"), "q", [(w, n, h, d) for n in n_c], q.dtype, dev)
    o_bufs = _carve(ws.get("out"), "out", [(w, n, h, v_dim) for n in n_c], q.dtype, dev)
    l_bufs = _carve(ws.get("lse"), "lse", [(w, n, h) for n in n_c], torch.float32, dev)
    # chunk c's query exchange is issued before any other set-up of chunk c (it waits only for q), and
    # chunk c + 1's right after chunk c's union build is issued (see _pipelined's docstring)
    q_moves: list = []

    def start_query_exchange(c: int) -> None:
        if c != len(q_moves) or c >= pipe.chunks:  # issued already, or no such chunk
            return
        q_recv, o_send = q_bufs[c], o_bufs[c]
        if gathered:  # into chunk c's output send buffer, free until chunk c's kernel (which waits for this)
            staged = _staging(o_send, [((pipe.count(j, c), h, d), q.dtype) for j in peers], dev)
            for j, buf in zip(peers, staged):
                torch.index_select(q_src, 0, ids(j, c), out=buf)
            q_moves.append(comm.exchange(list(zip(peers, staged)), [(i, q_recv[i]) for i in peers], tag=2 * c))
            torch.index_select(q_src, 0, ids(rank, c), out=q_recv[rank])
        else:  # contiguous token runs of q, straight into the receive buffer
            sends = [(j, q_runs[s]) for j in range(w) for s, _, _ in pipe.runs(j, c)]
            q_moves.append(comm.exchange(sends, list(zip(peer_of[c], _pieces(q_recv, mine[c]))), tag=2 * c))

    def query_ready(c: int) -> None:
        start_query_exchange(c + 1)
        q_moves[c].wait()

    start_query_exchange(0)
    ids_mine = all_ids[first[rank] : first[rank + 1]] if gathered else plan.token_ids(rank).to(dev, non_blocking=True)
    rows_buf = (
        None
        if rows.dtype != torch.int32
        else view_bytes(ws.get("rows"), (ids_mine.numel(), rows.shape[1]), rows.dtype, "rows")
    )
    rows_mine = (
        rows.index_select(0, ids_mine) if rows_buf is None else torch.index_select(rows, 0, ids_mine, out=rows_buf)
    )
    len_mine = None if topk_length is None else topk_length.index_select(0, ids_mine)
    rows_c = rows_mine.split(n_c)
    len_c = [None] * pipe.chunks if len_mine is None else len_mine.split(n_c)
    unions: list = [None] * pipe.chunks  # one_union: the share's union built once, a slice per chunk
    if union_groups is not None:
        whole = prepare_union(
            rows_mine, group_size=union_groups, num_kv_rows=kv.shape[0], topk_length=len_mine,
            workspace=(ws.get("union"), ws.get("lens")),
        )  # fmt: skip
        unions = unions if whole is None else whole.split(pipe.bounds[rank].tolist())
    if out is None:
        out = q.new_empty(t, h, v_dim)
    if lse is None and return_lse:
        lse = torch.empty(t, h, dtype=torch.float32, device=dev)
    out_runs = {} if gathered else _runs_of(out, pipe)
    lse_runs = {} if gathered or not return_lse else _runs_of(lse, pipe)

    out_moves, landed = [], []
    for c, (q_recv, o_send, l_send) in enumerate(zip(q_bufs, o_bufs, l_bufs)):
        if n_c[c]:  # reads q in place from the receive buffer, writes into the send buffers;
            # its union build (rows only) is issued before it waits for chunk c's queries
            union_kw = {} if unions[c] is None else {"prepared_union": unions[c]}
            attention(
                q_recv, kv, rows_c[c], scale=scale, v_dim=v_dim, sinks=sinks, return_lse=True, topk_length=len_c[c],
                out=o_send, lse=l_send, q_ready=lambda c=c: query_ready(c), **union_kw,
            )  # fmt: skip
        query_ready(c)  # idempotent; a rank with no token in chunk c still issues chunk c + 1's exchange
        if gathered:  # whole send buffers out; the peers' outputs land in the (read) query receive buffer
            parts = [((pipe.count(i, c), h, v_dim), q.dtype) for i in peers]
            parts += [((pipe.count(i, c), h), torch.float32) for i in peers] if return_lse else []
            recv = _staging(q_recv, parts, dev)
            sends = [(j, o_send[j]) for j in peers] + ([(j, l_send[j]) for j in peers] if return_lse else [])
            out_moves.append(comm.exchange(sends, list(zip(peers + peers, recv)), tag=2 * c + 1))
            out.index_copy_(0, ids(rank, c), o_send[rank])
            if return_lse:
                lse.index_copy_(0, ids(rank, c), l_send[rank])
            landed.append(recv)
            continue
        sends, recvs = [], []  # per peer: each run's output, then its LSE
        o_pieces = _pieces(o_send, mine[c])
        l_pieces = _pieces(l_send, mine[c]) if return_lse else [None] * len(o_pieces)
        for j, o_piece, l_piece in zip(peer_of[c], o_pieces, l_pieces):
            sends += [(j, o_piece)] + ([(j, l_piece)] if return_lse else [])
        for i in range(w):
            for s, _, _ in pipe.runs(i, c):
                recvs += [(i, out_runs[s])] + ([(i, lse_runs[s])] if return_lse else [])
        out_moves.append(comm.exchange(sends, recvs, tag=2 * c + 1))
    for c, move in enumerate(out_moves):
        move.wait()
        for k, i in enumerate(peers if gathered else ()):  # scatter the landed outputs to their tokens
            out.index_copy_(0, ids(i, c), landed[c][k])
            if return_lse:
                lse.index_copy_(0, ids(i, c), landed[c][len(peers) + k])
    return (out, lse) if return_lse else out
