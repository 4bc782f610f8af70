"""DCP decode of GQA models over a paged KV cache (the layout, collectives and buffers:
:mod:`shardattn.parallel.dcp`).

Every query token runs as a one-token request with its own causal *local* length
(:meth:`~shardattn.plan.DCPLayout.causal_local_lens`), so uniform and ragged speculative drafts
are exact (each draft re-reads its request's local KV); the partials are merged by the collector.
"""

from __future__ import annotations

import itertools

import torch

from shardattn._checks import (
    INDEX_DTYPES,
    check_bool,
    check_choice,
    check_cu_q_lens,
    check_int,
    check_page_size,
    check_pages_in_use,
    check_queries_fit,
    check_same_device,
    check_scale,
    check_tensor,
)
from shardattn.ops.gqa_decode import BACKENDS, run_gqa_paged_decode
from shardattn.parallel.agreement import Fingerprint
from shardattn.parallel.collector import collect_checked, resolve_strategy
from shardattn.parallel.comm import Comm
from shardattn.parallel.dcp import (
    Workspace,
    _check_common,
    _gather_heads,
    _host_values,
    _partial_buffers,
    check_dcp_workspace,
)
from shardattn.parallel.groups import GroupLike
from shardattn.plan.context import DCPLayout

__all__ = ["dcp_gqa_decode"]


def dcp_gqa_decode(
    q_heads_local: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    layout: DCPLayout,
    group: GroupLike | Comm,
    *,
    q_len_per_req: int | None = None,
    cu_q_lens: torch.Tensor | None = None,
    causal: bool = True,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
    scatter_heads: bool = True,
    strategy: str = "auto",
    backend: str = "auto",
    meta: torch.Tensor | tuple[torch.Tensor, torch.Tensor | None] | None = None,
    check: bool = True,
    lens_fingerprint: int | None = None,
    workspace: Workspace | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GQA decode over a paged KV cache split over the DCP group (speculative drafts included).

    Args:
        q_heads_local: ``[total_q, Hq/N, D]`` fp16/bf16/fp32, this rank's query heads, requests'
            queries packed in order.
        k_cache, v_cache: ``[num_pages, page_size, Hkv, D]`` this rank's paged cache (q's dtype),
            holding its local tokens (:meth:`~shardattn.plan.DCPLayout.local_index`);
            ``Hq % Hkv == 0``.
        block_table: ``[B, max_pages]`` int32 this rank's local page table.
        seq_lens: ``[B]`` int32 *global* keys per request, drafts included (0 = padding).
        layout: the DCP layout; ``layout.world_size`` must be the group's size.
        group: the DCP process group or a :class:`~shardattn.parallel.comm.Comm`
            (a ``ProcessGroup``, a 1-D ``DeviceMesh`` or ``(mesh, dim name)``: :mod:`~shardattn.parallel.groups`).
        q_len_per_req: uniform drafts per request (default 1); or
        cu_q_lens: ``[B+1]`` int32 ragged query offsets (rows past ``cu_q_lens[-1]`` are padding).
        causal: drafts see each other causally (query ``j`` of ``Q`` sees ``L - Q + j + 1`` keys).
        sinks: ``[Hq]`` fp32 sink logits, counted once (rank 0), optional.
        scale: softmax scale (default ``D ** -0.5``).
        scatter_heads, strategy: the collector's output layout and strategy.
        backend: the local kernel's backend (:func:`~shardattn.ops.gqa_decode.gqa_paged_decode`).
        meta: ``[2, total_q]`` int32 on q's device, the host-planned metadata of this rank
            (:meth:`~shardattn.plan.decode_batch.DecodeBatch.to`: each query's local KV length, 0
            for padding, and its block-table row). It replaces the per-step index arithmetic
            (the lean path: no torch op besides the kernels, the collectives and one gather of
            block-table rows); ``q_len_per_req`` / ``cu_q_lens`` are then not needed. Also
            a pair of ``[total_q]`` int32 tensors (two static graph inputs), whose second may be
            ``None`` when query ``i`` reads block-table row ``i`` (one query per request: the
            block table is read as it is, with no gather of its rows).
        check: agree on shapes, layout and lengths first (one small all-gather, a host sync).
            Either way the inputs are checked on this rank first; values (lengths, pages) only
            when they live on the CPU, where reading them costs no device synchronisation.
        lens_fingerprint: with ``check``, a host fingerprint of the lengths (a plan's
            :attr:`~shardattn.plan.decode_batch.DecodeBatch.fingerprint`), agreed on instead of
            ``seq_lens`` / ``cu_q_lens`` read back from the device (which costs a sync of its own).
        workspace: optional flat ``uint8`` buffers ``{"q", "out", "lse", "send", "recv"}`` the
            intermediates live in (module docstring; ``"q"``, ``"out"`` and ``"lse"`` may not share
            memory with an input); default: allocated per step.
    Returns:
        ``(out [total_q, Hq/N or Hq, D] in q's dtype, lse [total_q, Hq/N or Hq] fp32)``, equal to
        :func:`~shardattn.ops.gqa_decode.gqa_paged_decode` over the whole cache.

    Example (every rank of a DCP group of ``N`` runs this)::

        out, lse = dcp_gqa_decode(q_local, k_local, v_local, table_local, seq_lens, DCPLayout(N), group,
                                  q_len_per_req=2)
        # q_local [2B, Hq/N, D] -> out [2B, Hq/N, D], lse [2B, Hq/N]
    """
    comm = Comm.wrap(group)
    chosen = ""  # the collector's strategy, resolved by validate()

    def validate() -> int:
        nonlocal chosen
        q = q_heads_local
        _check_common(q, layout, comm, sinks)
        t, h, d = q.shape
        check_tensor("k_cache", k_cache, dtypes=(q.dtype,), ndim=4)
        pages, page, hkv, dk = k_cache.shape
        check_page_size("k_cache", k_cache)
        check_tensor("v_cache", v_cache, dtypes=(q.dtype,), shape=tuple(k_cache.shape))
        if dk != d:
            raise ValueError(f"q_heads_local must have last dim {dk} (k_cache's head dim), got {d}")
        if scale is not None:
            check_scale("scale", scale)
        check_choice("backend", backend, BACKENDS)
        if hkv < 1 or (h * comm.world_size) % hkv:
            raise ValueError(f"query heads ({h} x {comm.world_size} ranks) must be a multiple of KV heads ({hkv})")
        check_tensor("block_table", block_table, dtypes=INDEX_DTYPES, ndim=2)
        b = block_table.shape[0]
        check_tensor("seq_lens", seq_lens, dtypes=INDEX_DTYPES, shape=(b,))
        if q_len_per_req is not None and cu_q_lens is not None:
            raise ValueError("give q_len_per_req (uniform drafts) or cu_q_lens (ragged drafts), not both")
        if cu_q_lens is not None:  # with meta too, where the plan replaces it: its values are still read
            check_tensor("cu_q_lens", cu_q_lens, dtypes=INDEX_DTYPES, shape=(b + 1 if meta is None else None,))
        if q_len_per_req is not None:
            check_int("q_len_per_req", q_len_per_req, minimum=1)
        meta_lens = meta_req = None
        if isinstance(meta, tuple | list):
            if len(meta) != 2:
                raise ValueError(f"meta must be a [2, T] tensor or a (local_lens, req) pair, got {len(meta)} items")
            meta_lens, meta_req = meta
            check_tensor("meta[0]", meta_lens, dtypes=(torch.int32,), shape=(t,))
            if meta_req is None:  # query i reads block-table row i
                if b != t:
                    raise ValueError(
                        f"meta[1] = None reads block_table row i for query i: block_table must have {t} rows, got {b}"
                    )
            else:
                check_tensor("meta[1]", meta_req, dtypes=(torch.int32,), shape=(t,))
        elif meta is not None:
            check_tensor("meta", meta, dtypes=(torch.int32,), shape=(2, t))
            meta_lens, meta_req = meta[0], meta[1]
        elif cu_q_lens is None:
            ql = 1 if q_len_per_req is None else q_len_per_req
            if t != b * ql:
                raise ValueError(f"q_heads_local must have B * q_len_per_req = {b * ql} rows, got {t}")
        check_same_device(
            q_heads_local=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seq_lens=seq_lens,
            cu_q_lens=cu_q_lens, sinks=sinks, meta_lens=meta_lens, meta_req=meta_req,
        )  # fmt: skip
        if seq_lens.device.type == "cpu" and b:  # value checks that would stall a GPU: CPU tensors only
            _check_host_values(
                seq_lens, block_table, layout, comm.rank, pages=pages, page=page, t=t, q_len_per_req=q_len_per_req,
                cu_q_lens=cu_q_lens, meta_lens=meta_lens, meta_req=meta_req,
            )  # fmt: skip
        check_bool("causal", causal)
        check_bool("scatter_heads", scatter_heads)
        check_bool("check", check)
        chosen = resolve_strategy(strategy, comm.backend, scatter_heads=scatter_heads)
        inputs = {
            "q_heads_local": q, "k_cache": k_cache, "v_cache": v_cache, "block_table": block_table,
            "seq_lens": seq_lens, "cu_q_lens": cu_q_lens, "sinks": sinks,
            **({"meta": meta} if isinstance(meta, torch.Tensor) else {"meta[0]": meta_lens, "meta[1]": meta_req}),
        }  # fmt: skip
        check_dcp_workspace(workspace, q, comm.world_size, d, 0, chosen, scatter_heads, inputs)
        if not check:
            return 0  # nothing to agree on: skip hashing on the step's hot path
        lens = (_host_values(seq_lens), _host_values(cu_q_lens)) if lens_fingerprint is None else (lens_fingerprint,)
        return Fingerprint("dcp_gqa", {
            "the DCP layout (interleave)": layout, "q's shape": tuple(q.shape), "q's dtype": q.dtype,
            "the KV heads": hkv, "the requests (block_table rows)": b, "q_len_per_req": q_len_per_req,
            "causal": causal, "sinks (given or not)": sinks is not None,
            "scale": q.shape[-1] ** -0.5 if scale is None else float(scale),  # the scale used, however given
            "scatter_heads / strategy": (scatter_heads, strategy), "a plan's metadata (given or not)": meta is not None,
            "seq_lens / cu_q_lens": tuple(lens),
        })  # fmt: skip

    comm.agree_on("DCP GQA decode inputs", validate, check=check)
    with comm.reporting_failures():  # a failure from here on is reported to the waiting peers
        ws = workspace or {}
        q_full = _gather_heads(q_heads_local, comm, ws)
        t, hq, d = q_full.shape
        b = block_table.shape[0]
        if b == 0 or t == 0:
            out = q_full.new_zeros(t, hq, d)
            lse = torch.full((t, hq), float("-inf"), dtype=torch.float32, device=q_full.device)
            return collect_checked(out, lse, comm, chosen, scatter_heads, ws or None)
        if meta is not None:  # planned on the host: no index arithmetic here
            local_lens, req = meta[0], meta[1]
        else:
            cu = cu_q_lens
            if cu is None:
                ql = 1 if q_len_per_req is None else q_len_per_req
                cu = torch.arange(b + 1, dtype=seq_lens.dtype, device=seq_lens.device) * ql
            # every query becomes a one-token "request" with its own causal local length and its request's pages
            local_lens = layout.causal_local_lens(seq_lens, cu, t, comm.rank, causal=causal).to(torch.int32)
            tok = torch.arange(t, device=cu.device)
            req = torch.searchsorted(cu[1:].to(torch.int64).contiguous(), tok, right=True).clamp(max=b - 1)
        # checked above; the local kernel's arguments are built from checked inputs: no second check
        dest = _partial_buffers(ws, q_full, d)
        out, lse = run_gqa_paged_decode(
            q_full, k_cache, v_cache, block_table if req is None else block_table.index_select(0, req), local_lens,
            q_len_per_req=1, cu_q_lens=None, max_q_len=None, causal=True, window_left=-1,
            sinks=sinks if comm.rank == 0 else None, return_lse=True, scale=d**-0.5 if scale is None else float(scale),
            backend=backend, out=dest.get("out"), lse_out=dest.get("lse_out"),
        )  # fmt: skip
        return collect_checked(out, lse, comm, chosen, scatter_heads, ws or None)


def _check_host_values(
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    layout: DCPLayout,
    rank: int,
    *,
    pages: int,
    page: int,
    t: int,
    q_len_per_req: int | None,
    cu_q_lens: torch.Tensor | None,
    meta_lens: torch.Tensor | None,
    meta_req: torch.Tensor | None,
) -> None:
    """The DCP GQA step's value checks, for CPU tensors only (on a GPU each read would stall the
    host: the step skips them there). Raises ``ValueError`` naming the argument."""
    b, m = block_table.shape
    if int(seq_lens.min()) < 0:
        raise ValueError("seq_lens must be >= 0")
    local = layout.local_seq_lens(seq_lens, rank)
    if int(local.max()) > m * page:
        i = int(local.argmax())
        raise ValueError(
            f"seq_lens[{i}]={int(seq_lens[i])} puts {int(local[i])} tokens on rank {rank}, "
            f"past its block_table's {m} pages of {page}"
        )
    # the pages a request uses on this rank must exist (unused entries may hold anything, e.g. -1)
    check_pages_in_use(block_table, local, page_size=page, num_pages=pages, whose="requests")
    queries = [1 if q_len_per_req is None else q_len_per_req] * b
    if cu_q_lens is not None:
        cu = cu_q_lens.tolist()
        check_cu_q_lens(cu, t)
        queries = [hi - lo for lo, hi in itertools.pairwise(cu)]
    if meta_lens is None:  # meta holds each query's local length, not its request's queries
        check_queries_fit(seq_lens.tolist(), queries)
    if meta_lens is not None and t and int(meta_lens.min()) < 0:
        raise ValueError(f"meta[0] holds negative local lengths (min {int(meta_lens.min())}); 0 marks padding")
    if meta_lens is not None and t and int(meta_lens.max()) > m * page:
        raise ValueError(f"meta[0] holds local lengths past the block_table's {m} pages of {page}")
    if meta_req is not None and t and (int(meta_req.min()) < 0 or int(meta_req.max()) >= b):
        raise ValueError(f"meta[1] holds request rows outside [0, {b})")
    rows = block_table if meta_req is None else block_table[meta_req.long()]  # host values, as every check here
    if meta_lens is not None and t and rows.shape[0] == t:  # the pages each query slot reads, by meta's lengths
        check_pages_in_use(rows, meta_lens, page_size=page, num_pages=pages, whose="meta[0]'s query slots")
