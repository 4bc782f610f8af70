"""The local kernel a sparse-MLA prefill step runs on each rank, and the ``(out, lse)`` it returns.

ShardQ (:func:`~shardattn.parallel.shardq.shardq_prefill`) and PCP
(:func:`~shardattn.parallel.pcp.pcp_prefill`) take that kernel as ``attention=``: a callable like
:func:`~shardattn.ops.sparse_mla.sparse_mla_attention`, which the steps always call with
``return_lse=True``. :func:`with_lse` is the ``(out, lse)`` of such a call, checked at run time
(the callable is the caller's), or of a Runtime step (whose options may leave the LSE out). The
library's ops need no such check: called with ``return_lse=True`` they are typed ``(out, lse)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["AttentionFn", "with_lse"]

#: The local sparse-MLA kernel (:func:`~shardattn.ops.sparse_mla.sparse_mla_attention`'s
#: signature); called with ``return_lse=True``, it returns ``(out, lse)``.
AttentionFn = Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]


def with_lse(
    result: torch.Tensor | tuple[torch.Tensor, torch.Tensor | None], what: str = "attention"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(out [T, H, Dv] in q's dtype, lse [T, H] fp32)`` of a call asked for its LSE; a result
    without one (the output alone, or ``(out, None)``) raises ``TypeError`` naming ``what``."""
    if isinstance(result, torch.Tensor):
        raise TypeError(f"{what} must return (out, lse) when asked for the LSE, got the output alone")
    out, lse = result
    if lse is None:
        raise TypeError(f"{what} must return (out, lse) when asked for the LSE, got (out, None)")
    return out, lse
