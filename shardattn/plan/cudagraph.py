"""CUDA-graph support level per parallel mode and kernel; decode query-length analysis.

A CUDA graph replays fixed shapes and fixed host decisions. Which batches a step may capture
depends on the parallel mode (are there host-planned collectives?), the kernel (does it take
ragged query lengths, non-causal drafts, this head dim?) and decode context parallelism.

Levels, weakest first: ``NEVER < UNIFORM_SINGLE_TOKEN_DECODE < UNIFORM_BATCH < ALWAYS``.

===========  ==============  ===============================================================
mode         kernel          level
===========  ==============  ===============================================================
``decode``   triton          UNIFORM_BATCH (causal and non-causal drafts; every request
                             of a captured batch has the same q_len, padded requests of
                             length 0 included; ragged batches would need ALWAYS)
``decode``   flashinfer-xqa  UNIFORM_BATCH if :func:`xqa_head_dim_supported`, else
                             UNIFORM_SINGLE_TOKEN_DECODE (the adapter refuses such a head dim)
``prefill``  triton          ALWAYS (head-TP sparse prefill: every buffer is bounded by
                             the workspace, the grid by the padded token count)
``prefill``  fa4             NEVER (GQA prefill: FA4's host code sizes the grid from the step's
                             token count and allocates the outputs on every call)
``shardq``   any             NEVER (all-to-all split sizes come from a per-step host plan)
``pcp``      any             NEVER (per-step host plan for the split and the KV all-gather)
any          reference       NEVER (torch reference: may allocate and synchronise)
===========  ==============  ===============================================================

Then, with ``dcp_size > 1``, every level above UNIFORM_SINGLE_TOKEN_DECODE drops to it, unless
the step's per-query metadata is planned on the host (``host_meta=True``: the DCP GQA step with
:func:`~shardattn.plan.decode_batch.plan_decode_batch`'s metadata as a static graph input): then
the kernel's level stands.

Ragged batches at UNIFORM_BATCH: a ragged batch (request ``b`` has ``n_b <= Q`` queries) padded to
``Q`` queries per request (the padding queries see no key; :func:`decode_query_lens` of the
padded layout counts the padded requests, :class:`~shardattn.plan.decode_batch.DecodeBatch` the
padding queries) is a uniform batch, so it replays a UNIFORM_BATCH graph; unpadded ragged batches
need ALWAYS.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch

from shardattn._checks import check_bool, check_choice, check_int
from shardattn.plan._common import as_lengths, to_int64_tensor

__all__ = [
    "CG_KERNELS",
    "CG_MODES",
    "CGSupport",
    "DecodeQueryLens",
    "cudagraph_support",
    "decode_query_lens",
    "explain_cudagraph_support",
    "xqa_head_dim_supported",
]

CG_MODES = ("decode", "prefill", "shardq", "pcp")
CG_KERNELS = ("triton", "flashinfer-xqa", "fa4", "reference")


class CGSupport(enum.IntEnum):
    """CUDA-graph capture level, ordered: a larger value allows more batches to be captured."""

    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    UNIFORM_BATCH = 2
    ALWAYS = 3


def xqa_head_dim_supported(head_dim: int) -> bool:
    """FlashInfer XQA's head-dim rule: ``16 <= head_dim <= 256`` and ``head_dim % 16 == 0``.

    The one source of truth, used both by the XQA adapter (``shardattn.kernels.flashinfer_xqa``,
    which refuses what XQA cannot run) and by :func:`cudagraph_support`, so the two never disagree.

    >>> [xqa_head_dim_supported(d) for d in (8, 64, 72, 256, 512)]
    [False, True, False, True, False]
    """
    head_dim = check_int("head_dim", head_dim, minimum=1)
    return 16 <= head_dim <= 256 and head_dim % 16 == 0


def explain_cudagraph_support(
    mode: str,
    kernel: str,
    *,
    head_dim: int,
    dcp_size: int = 1,
    non_causal: bool = False,
    host_meta: bool = False,
) -> tuple[CGSupport, str]:
    """:func:`cudagraph_support` together with a readable reason."""
    check_choice("mode", mode, CG_MODES)
    check_choice("kernel", kernel, CG_KERNELS)
    check_int("head_dim", head_dim, minimum=1)
    dcp_size = check_int("dcp_size", dcp_size, minimum=1)
    check_bool("non_causal", non_causal)
    check_bool("host_meta", host_meta)
    if kernel == "reference":
        return CGSupport.NEVER, "the torch reference may allocate and synchronise: never captured"
    if mode in ("shardq", "pcp"):
        return CGSupport.NEVER, f"{mode} steps depend on a per-step host plan (collective split sizes)"
    if kernel == "fa4" and mode == "decode":
        return CGSupport.NEVER, "kernel 'fa4' is a prefill kernel; no decode graphs"
    if mode == "prefill" and kernel == "fa4":
        return (
            CGSupport.NEVER,
            "GQA prefill on FA4: its host code sizes the grid from the step's tokens and allocates outputs per call",
        )
    if mode == "prefill":
        if kernel != "triton":
            return CGSupport.NEVER, f"kernel {kernel!r} is a decode kernel; no prefill graphs"
        level, why = CGSupport.ALWAYS, "head-TP sparse prefill with workspace-bounded buffers"
    elif kernel == "flashinfer-xqa" and not xqa_head_dim_supported(head_dim):
        level = CGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        why = f"head_dim {head_dim} is outside XQA's limits (16..256, multiple of 16)"
    else:
        level = CGSupport.UNIFORM_BATCH
        why = (
            f"{kernel} decode captures batches of one query length per request"
            + (" (non-causal drafts)" if non_causal else "")
            + "; a ragged batch is captured only padded to that length (masked padding queries), "
            "unpadded it runs eagerly"
        )
    if dcp_size > 1 and level > CGSupport.UNIFORM_SINGLE_TOKEN_DECODE and host_meta:
        return level, why + f"; dcp_size={dcp_size} with host-planned per-query metadata (a static input)"
    if dcp_size > 1 and level > CGSupport.UNIFORM_SINGLE_TOKEN_DECODE:
        return (
            CGSupport.UNIFORM_SINGLE_TOKEN_DECODE,
            f"dcp_size={dcp_size}: decode context parallelism is graph-safe for single-token decode only",
        )
    return level, why


def cudagraph_support(
    mode: str,
    kernel: str,
    *,
    head_dim: int,
    dcp_size: int = 1,
    non_causal: bool = False,
    host_meta: bool = False,
) -> CGSupport:
    """CUDA-graph level for a step of ``mode`` on ``kernel`` (table in the module docstring).

    Args:
        mode: one of ``CG_MODES``: ``"decode"``, ``"prefill"`` (head-TP sparse prefill),
            ``"shardq"``, ``"pcp"``.
        kernel: one of ``CG_KERNELS``.
        head_dim: the model's head dim (checked with :func:`xqa_head_dim_supported` for XQA).
        dcp_size: decode context-parallel ranks; ``> 1`` caps the level at single-token decode.
        non_causal: drafts attend non-causally among themselves (speculative decode).
        host_meta: under DCP, the step's per-query metadata is planned on the host and copied
            into a static input (no device-side index arithmetic): the level is not capped.

    >>> cudagraph_support("decode", "flashinfer-xqa", head_dim=64).name
    'UNIFORM_BATCH'
    >>> cudagraph_support("decode", "flashinfer-xqa", head_dim=512).name
    'UNIFORM_SINGLE_TOKEN_DECODE'
    >>> cudagraph_support("decode", "triton", head_dim=64, dcp_size=2).name
    'UNIFORM_SINGLE_TOKEN_DECODE'
    >>> cudagraph_support("decode", "triton", head_dim=64, dcp_size=2, host_meta=True).name
    'UNIFORM_BATCH'
    >>> cudagraph_support("pcp", "triton", head_dim=576).name
    'NEVER'
    """
    return explain_cudagraph_support(
        mode, kernel, head_dim=head_dim, dcp_size=dcp_size, non_causal=non_causal, host_meta=host_meta
    )[0]


@dataclass(frozen=True, eq=False)
class DecodeQueryLens:
    """Query lengths of the decode requests of a batch.

    Attributes:
        num_decodes: decode requests (graph-padding requests included).
        uniform: every request has exactly ``q_len >= 1`` queries (a total that divides is not
            enough: ``[0, 2, 4, 4, 4]`` over 4 decodes is ragged).
        q_len: that length when uniform, else ``None``.
        max_q_len: the longest request (0 when there is none).
        qo_indptr: ``[num_decodes+1]`` int64 offsets, as given (ragged kernels take these).
        q_lens: ``[num_decodes]`` int64 per-request lengths; 0 marks a padded request of a
            graph batch: it is kept (its rows stay in place and are masked), never dropped.
        num_padded: requests with length 0.
    """

    num_decodes: int
    uniform: bool
    q_len: int | None
    max_q_len: int
    qo_indptr: torch.Tensor
    q_lens: torch.Tensor
    num_padded: int

    @property
    def single_token(self) -> bool:
        """Uniform with one query per request (plain decode)."""
        return self.uniform and self.q_len == 1


def decode_query_lens(qo_indptr: object, num_decodes: int) -> DecodeQueryLens:
    """Analyse the first ``num_decodes`` requests of ``qo_indptr`` (host side).

    Args:
        qo_indptr: ``[>= num_decodes+1]`` non-decreasing query offsets; a list, numpy array or
            CPU tensor (a GPU tensor is refused: reading it would synchronise).
        num_decodes: decode requests at the front of the batch.

    >>> decode_query_lens([0, 2, 4, 6], 3).q_len
    2
    >>> r = decode_query_lens([0, 2, 4, 4, 4], 4)
    >>> r.uniform, r.q_lens.tolist(), r.max_q_len, r.num_padded
    (False, [2, 2, 0, 0], 2, 2)
    """
    num_decodes = check_int("num_decodes", num_decodes, minimum=0)
    ptr = as_lengths("qo_indptr", qo_indptr)
    if ptr.shape[0] < num_decodes + 1:
        raise ValueError(f"qo_indptr must have at least num_decodes+1={num_decodes + 1} entries, got {ptr.shape[0]}")
    ptr = ptr[: num_decodes + 1]
    lens = np.diff(ptr)
    bad = np.flatnonzero(lens < 0)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"qo_indptr must be non-decreasing; qo_indptr[{i + 1}]={ptr[i + 1]} < qo_indptr[{i}]={ptr[i]}")
    first = int(lens[0]) if lens.size else 0
    uniform = bool(lens.size) and first >= 1 and bool((lens == first).all())
    return DecodeQueryLens(
        num_decodes=num_decodes,
        uniform=uniform,
        q_len=first if uniform else None,
        max_q_len=int(lens.max()) if lens.size else 0,
        qo_indptr=to_int64_tensor(ptr),
        q_lens=to_int64_tensor(lens),
        num_padded=int((lens == 0).sum()),
    )
