"""The pipelined ShardQ step: each rank's tokens in ``C`` chunks, exchanges beside the kernels.

The step is pipelined (:mod:`shardattn.plan.pipeline`): each rank's tokens are cut into ``C``
chunks; chunk ``c``'s kernel waits only for its own query exchange, and chunk ``c``'s output
exchange starts right after its kernel, so the kernels run while later queries and earlier outputs
are in flight. The kernel call gets the wait of its chunk's query exchange as ``q_ready`` and
issues its row sort (union build, which reads only ``rows``) before it, so the sort overlaps the
exchange. The host issues, in this order: chunk 0's query exchange (before any other set-up), then
per chunk ``c``: its union build, chunk ``c + 1``'s query exchange, its kernel, its output
exchange. (Issuing every query exchange first would hold chunk 0's sort and kernel behind about
0.6 ms of host time per further exchange while the device sits idle.) Each
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
device copy of the bytes that cross. Both give the same bits. The queries staged for the peers
(``(W - 1) / W`` of the share at ``D``) outgrow the send buffer's own ``[W, n, H/W, Dv]`` once
``(W - 1) / W * D > Dv`` (the DSA dims from ten ranks on), so the step stages in the whole
workspace buffer, which :func:`check_pipeline_workspace` (and the planner's ``out`` /
``packed_q`` items) size for both uses; only without a workspace may a staging be a new tensor.

Two opt-in options, same bits (neither measured on GPUs yet): ``taper=True`` cuts the shares
``1, 2, ..., 2, 1`` (:func:`~shardattn.plan.pipeline.chunk_weights`): the first query exchange and
the last output exchange, which nothing hides, carry ``1/(2C-2)`` of a share instead of ``1/C``.
``one_union=True`` builds the union of the rank's whole share once, right after chunk 0's query
exchange is issued (:func:`~shardattn.ops.prepared_union.prepare_union`), and gives each
chunk's kernel call its slice (``prepared_union=``), so no row sort runs between two kernels.

Host work per chunk (``tests/test_shardq_host_ops.py`` bounds it): the views of a chunk's token
runs come from one split per buffer (and of ``q`` / ``out`` / ``lse`` once per step), its buffers
from one ``as_strided`` each; the device ops are the three local pieces a rank keeps; nothing
reads device data back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from shardattn.ops.prepared_union import PreparedUnion, prepare_union
from shardattn.parallel.comm import Comm, Pending
from shardattn.parallel.local_attention import AttentionFn, with_lse
from shardattn.parallel.packing import check_byte_buffers, view_bytes
from shardattn.plan.pipeline import CHUNK_ALIGN, PipelinePlan
from shardattn.plan.zigzag import ShardPlan

__all__ = ["run_pipelined"]

#: ``(shape, dtype)`` of each tensor a one-message step stages in a buffer, in the order laid there
Parts = list[tuple[tuple[int, ...], torch.dtype]]


def _carve(
    buf: torch.Tensor | None, name: str, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """Contiguous views ``[shape]`` of ``dtype`` laid one after another (each at a multiple of 256
    bytes) in the uint8 ``buf``, one ``as_strided`` each (new tensors when ``buf`` is None)."""
    if buf is None:
        return [torch.empty(s, dtype=dtype, device=device) for s in shapes]
    starts, end = _offsets([math.prod(s) * dtype.itemsize for s in shapes])
    if end > buf.numel():
        raise ValueError(f"workspace[{name!r}] holds {buf.numel()} B, the pipelined step needs at least {end} B")
    flat = buf[:end].view(dtype)
    base, size = flat.storage_offset(), dtype.itemsize
    return [flat.as_strided(s, _contiguous_strides(s), base + o // size) for s, o in zip(shapes, starts)]


def _offsets(nbytes: list[int]) -> tuple[list[int], int]:
    """``(starts, end)``: the byte offset of each piece of ``nbytes`` laid in turn (each at a
    multiple of :data:`CHUNK_ALIGN`) and the byte the last one ends at (every carve and staging
    of the step, and what its workspace check asks for).

    >>> _offsets([10, 300, 4])
    ([0, 256, 768], 772)
    """
    starts, off, end = [], 0, 0
    for n in nbytes:
        end = off + n
        starts.append(off)
        off += -(-n // CHUNK_ALIGN) * CHUNK_ALIGN
    return starts, end


def _staged_queries(pipe: PipelinePlan, rank: int, heads: int, d: int, dtype: torch.dtype) -> Parts:
    """What a one-message step stages before its query exchange: ``[n_j, heads, d]`` queries of
    every peer ``j``'s tokens, in peer order (chunk 0)."""
    return [((pipe.count(j, 0), heads, d), dtype) for j in range(pipe.world_size) if j != rank]


def _staged_outputs(pipe: PipelinePlan, rank: int, heads: int, v_dim: int, dtype: torch.dtype, lse: bool) -> Parts:
    """What a one-message step's output exchange lands before it is scattered: every peer's
    ``[n_i, heads, v_dim]`` outputs, then (``lse``) their fp32 ``[n_i, heads]`` LSEs (chunk 0)."""
    peers = [i for i in range(pipe.world_size) if i != rank]
    parts: Parts = [((pipe.count(i, 0), heads, v_dim), dtype) for i in peers]
    return parts + ([((pipe.count(i, 0), heads), torch.float32) for i in peers] if lse else [])


def _parts_end(parts: Parts) -> int:
    """The bytes :func:`_staging` lays ``parts`` over."""
    return _offsets([math.prod(shape) * dtype.itemsize for shape, dtype in parts])[1]


def check_pipeline_workspace(
    workspace: dict[str, torch.Tensor] | None,
    pipe: PipelinePlan,
    rank: int,
    q: torch.Tensor,
    v_dim: int,
    topk: int,
    rows_int32: bool,
    one_union: bool = False,
    return_lse: bool = True,
) -> None:
    """A ShardQ step's ``workspace`` against what :func:`run_pipelined` carves from it: each buffer
    given is a flat uint8 tensor on q's device holding the chunks' receive / send buffers (``"q"``,
    ``"out"``, ``"lse"``) and the rank's rows (``"rows"``, int32 rows only); a one-message step
    also stages in them (:func:`_staging`): ``"out"`` holds the queries it sends (``(W - 1)``
    peers' shares at ``D``, more than its own ``Dv``-wide outputs once ``(W - 1) / W * D > Dv``),
    ``"q"`` the peers' outputs and (``return_lse``) LSEs it receives. The union buffers
    (``"union"``, ``"lens"``, ``one_union`` only) may be smaller (a share's union then builds per
    chunk). Each buffer the step reads is contiguous, starts aligned for the widest element it is
    viewed as and shares no memory with another (every one is in use for the whole step). Checked
    before the step's agreement, so a bad buffer raises on every rank instead of leaving the peers
    in an exchange."""
    w, h, d = pipe.world_size, q.shape[1], q.shape[2]
    n_c = [pipe.count(rank, c) for c in range(pipe.chunks)]
    need = {
        "q": _parts_end([((w, n, h, d), q.dtype) for n in n_c]),
        "out": _parts_end([((w, n, h, v_dim), q.dtype) for n in n_c]),
        "lse": _parts_end([((w, n, h), torch.float32) for n in n_c]),
    }
    if pipe.one_message_per_peer:  # the staged queries may outgrow the output send buffer, and the
        # peers' outputs the query receive buffer (wide queries, many ranks, uneven shares)
        need["out"] = max(need["out"], _parts_end(_staged_queries(pipe, rank, h, d, q.dtype)))
        need["q"] = max(need["q"], _parts_end(_staged_outputs(pipe, rank, h, v_dim, q.dtype, return_lse)))
    if rows_int32:
        need["rows"] = sum(n_c) * topk * 4
    if one_union:
        need |= {"union": 0, "lens": 0}
    # the one-message step stages the peers' outputs and fp32 LSEs in the query receive buffer, and
    # the queries it sends in the output send buffer
    widest = q.dtype if q.dtype.itemsize > 4 else torch.float32
    views = {"q": widest, "out": q.dtype, "lse": torch.float32, "rows": torch.int32, "union": torch.int32,
             "lens": torch.int32}  # fmt: skip
    check_byte_buffers(workspace, need, q.device, dtypes=views)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _staging(
    reserved: torch.Tensor | None, spare: torch.Tensor, parts: Parts, device: torch.device
) -> list[torch.Tensor]:
    """Views for ``parts`` (``(shape, dtype)``, 256-byte aligned) in the bytes of a buffer the step
    does not use while the views live: the workspace buffer ``reserved`` where one is given (whole:
    :func:`check_pipeline_workspace` made it large enough), else ``spare`` (a carved chunk buffer),
    with new tensors when they do not fit there."""
    starts, end = _offsets([math.prod(shape) * dtype.itemsize for shape, dtype in parts])
    raw = spare.reshape(-1).view(torch.uint8) if reserved is None else reserved
    if end > raw.numel():
        if reserved is not None:  # never after the check: a staged view must not leave the workspace
            raise ValueError(f"a workspace buffer holds {raw.numel()} B, the one-message step stages {end} B in it")
        return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in parts]
    return [
        raw[o : o + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
        for o, (shape, dtype) in zip(starts, parts)
    ]


def _runs_of(x: torch.Tensor, pipe: PipelinePlan) -> dict[int, torch.Tensor]:
    """Token start -> view of every run (:meth:`PipelinePlan.token_runs`) of the token-order ``x`` (one split)."""
    runs = pipe.token_runs()
    return dict(zip((s for s, _ in runs), x.split([n for _, n in runs])))


def _pieces(buf: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    """A chunk buffer ``[W, n, ...]`` cut into its rank-major runs (``sizes``) by one split."""
    return buf.flatten(0, 1).split(sizes)


def run_pipelined(
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
    # every rank's token ids (rank-major), moved to the device once where the one-message step gathers
    # by them; ids(j, c): rank j's tokens of chunk c
    all_ids = plan.gather_index.to(dev, non_blocking=True) if gathered else plan.gather_index
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
    q_moves: list[Pending] = []

    def start_query_exchange(c: int) -> None:
        if c != len(q_moves) or c >= pipe.chunks:  # issued already, or no such chunk
            return
        q_recv, o_send = q_bufs[c], o_bufs[c]
        if gathered:  # into chunk c's output send buffer, free until chunk c's kernel (which waits for this)
            staged = _staging(ws.get("out"), o_send, _staged_queries(pipe, rank, h, d, q.dtype), dev)
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
    # one_union: the share's union built once, a slice per chunk
    unions: Sequence[PreparedUnion | None] = [None] * pipe.chunks
    if union_groups is not None:
        whole = prepare_union(
            rows_mine, group_size=union_groups, num_kv_rows=kv.shape[0], topk_length=len_mine,
            workspace=(ws.get("union"), ws.get("lens")),
        )  # fmt: skip
        unions = unions if whole is None else whole.split(pipe.bounds[rank].tolist())
    if out is None:
        out = q.new_empty(t, h, v_dim)
    # from here on lse is None exactly when the step returns no LSE (a given lse_out is then left alone)
    if not return_lse:
        lse = None
    elif lse is None:
        lse = torch.empty(t, h, dtype=torch.float32, device=dev)
    out_runs = {} if gathered else _runs_of(out, pipe)
    lse_runs = {} if gathered or lse is None else _runs_of(lse, pipe)

    out_moves, landed = [], []
    for c, (q_recv, o_send, l_send) in enumerate(zip(q_bufs, o_bufs, l_bufs)):
        if n_c[c]:  # reads q in place from the receive buffer, writes into the send buffers;
            # its union build (rows only) is issued before it waits for chunk c's queries
            union_kw = {} if unions[c] is None else {"prepared_union": unions[c]}
            with_lse(attention(
                q_recv, kv, rows_c[c], scale=scale, v_dim=v_dim, sinks=sinks, return_lse=True, topk_length=len_c[c],
                out=o_send, lse_out=l_send, q_ready=lambda c=c: query_ready(c), **union_kw,
            ))  # fmt: skip
        query_ready(c)  # idempotent; a rank with no token in chunk c still issues chunk c + 1's exchange
        if gathered:  # whole send buffers out; the peers' outputs land in the (read) query receive buffer
            recv = _staging(ws.get("q"), q_recv, _staged_outputs(pipe, rank, h, v_dim, q.dtype, lse is not None), dev)
            sends = [(j, o_send[j]) for j in peers] + ([(j, l_send[j]) for j in peers] if lse is not None else [])
            out_moves.append(comm.exchange(sends, list(zip(peers + peers, recv)), tag=2 * c + 1))
            out.index_copy_(0, ids(rank, c), o_send[rank])
            if lse is not None:
                lse.index_copy_(0, ids(rank, c), l_send[rank])
            landed.append(recv)
            continue
        sends, recvs = [], []  # per peer: each run's output, then its LSE
        o_pieces = _pieces(o_send, mine[c])
        l_pieces = _pieces(l_send, mine[c]) if lse is not None else None
        for k, (j, o_piece) in enumerate(zip(peer_of[c], o_pieces)):
            sends += [(j, o_piece)] + ([(j, l_pieces[k])] if l_pieces is not None else [])
        for i in range(w):
            for s, _, _ in pipe.runs(i, c):
                recvs += [(i, out_runs[s])] + ([(i, lse_runs[s])] if lse is not None else [])
        out_moves.append(comm.exchange(sends, recvs, tag=2 * c + 1))
    for c, move in enumerate(out_moves):
        move.wait()
        for k, i in enumerate(peers if gathered else ()):  # scatter the landed outputs to their tokens
            out.index_copy_(0, ids(i, c), landed[c][k])
            if lse is not None:
                lse.index_copy_(0, ids(i, c), landed[c][len(peers) + k])
    return out if lse is None else (out, lse)
