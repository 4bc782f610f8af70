"""A single-process mirror of a serving pool, for checking it: random requests and fp64 attention.

:class:`ServingMirror` keeps every request's whole KV cache (as the pool's ranks hold it
together), makes random :class:`~shardattn.serving.requests.PrefillRequest` /
:class:`~shardattn.serving.requests.DecodeRequest` steps, and computes what the pool must
return in float64 straight from the definition (not through the library's kernels):

* sparse MLA: ``out[t, h] = softmax(scale * q[t, h] . kv[p]) @ kv[p, :Dv]`` over the valid top-k
  positions ``p`` of token ``t`` (``0 <= p < L``, ``L`` the request's tokens after the step);
* GQA: causal over the request's cache (query ``j`` of ``Q`` sees ``L - Q + j + 1`` tokens),
  query head ``h`` reading KV head ``h // (H / Hkv)``.

With attention sinks (one fp32 logit ``s_h`` per query head, in the scaled-logit domain), the
softmax denominator gains ``exp(s_h)`` (the numerator does not) and ``lse`` includes it. A row
with no valid key is ``out = 0, lse = -inf`` (``lse = s_h`` with sinks), as the library's kernels.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from shardattn._checks import check_scale
from shardattn.ops.kv_fp8 import dequantize_kv, quantize_kv
from shardattn.plan.kv_format import KV_FP8_DS_MLA, kv_format_name
from shardattn.plan.spec import ModelSpec
from shardattn.serving.requests import DecodeRequest, PrefillRequest

__all__ = ["ServingMirror", "attention_fp64", "softmax_lse_fp64"]


def softmax_lse_fp64(logits: torch.Tensor, sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p [T, H, S], lse [T, H])`` fp64 of masked logits ``[T, H, S]`` (``-inf`` = masked).

    ``sinks [H]`` add ``exp(sink)`` to each denominator only; a row with no key has ``p = 0`` and
    ``lse = -inf`` (``sink`` with sinks).
    """
    logits = logits.double()
    lse = torch.logsumexp(logits, dim=-1)
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.double()[None, :].expand_as(lse))
    p = torch.nan_to_num(torch.exp(logits - lse[..., None]), nan=0.0)
    return p, lse


def attention_fp64(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention in fp64, rows with no key ``(0, -inf)`` (``(0, sink)``).

    ``q [T, H, D]``, ``k [T, H, S, D]``, ``v [T, H, S, Dv]``, ``mask [T, H, S]`` bool, ``sinks [H]``
    fp32 or ``None`` -> ``(out [T, H, Dv], lse [T, H])`` fp64.
    """
    s = torch.einsum("thd,thsd->ths", q.double(), k.double()) * scale
    p, lse = softmax_lse_fp64(s.masked_fill(~mask, float("-inf")), sinks)
    return torch.einsum("ths,thsd->thd", p, v.double()), lse


@dataclass
class _Req:
    kv: list[torch.Tensor] = field(default_factory=list)  # per component [L, *row]

    @property
    def length(self) -> int:
        return int(self.kv[0].shape[0]) if self.kv else 0


def repeated(pos: torch.Tensor) -> torch.Tensor:
    """``[T, K]`` bool: the entries of each row of ``pos`` that repeat an earlier-sorted one (every
    listing of a value but one), so that a position listed twice by a token counts once.

    >>> repeated(torch.tensor([[3, 1, 3, -1, -1]])).tolist()
    [[False, False, True, False, True]]
    """
    srt, order = pos.sort(dim=1, stable=True)
    again = torch.zeros_like(srt, dtype=torch.bool)
    again[:, 1:] = srt[:, 1:] == srt[:, :-1]
    return torch.zeros_like(again).scatter_(1, order, again)


class ServingMirror:
    """Every request's full KV cache and the reference outputs (module docstring).

    Args:
        spec: the pool's model spec. topk: the pool's top-k width (sparse MLA). seed: the generator's.
        sinks: ``[H]`` fp32 sink logits (the pool's), or ``None``.
        scale: the pool's softmax scale (default: the spec's ``softmax_scale``).
        kv_dtype: the pool's resident cache format (``runtime_kwargs["kv_dtype"]``): with
            ``"fp8_ds_mla"`` the reference reads every row as the pool stores it (quantised, then
            dequantised exactly: :mod:`shardattn.ops.kv_fp8`).
    """

    def __init__(
        self,
        spec: ModelSpec,
        *,
        topk: int | None = None,
        seed: int = 0,
        sinks: torch.Tensor | None = None,
        scale: float | None = None,
        kv_dtype: str | None = None,
    ) -> None:
        self.spec = spec
        self.kv_fp8 = kv_dtype is not None and kv_format_name("kv_dtype", kv_dtype) == KV_FP8_DS_MLA
        self.sinks = sinks
        self.topk = spec.topk if topk is None else topk
        self.dtype = getattr(torch, spec.dtype)
        self.gen = torch.Generator().manual_seed(seed)
        self.requests: dict[Hashable, _Req] = {}
        # a ModelSpec's softmax_scale is always set once built (GQA: head_dim ** -0.5), as the Runtime's default
        self.scale = check_scale("scale", spec.softmax_scale if scale is None else scale)

    # -- random inputs -------------------------------------------------------------------------
    def _randn(self, *shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen) * 0.5).to(self.dtype)

    def _kv(self, n: int) -> list[torch.Tensor]:
        s = self.spec
        if s.kind == "sparse_mla":
            return [self._randn(n, s.head_dim)]
        return [self._randn(n, s.num_kv_heads, s.head_dim), self._randn(n, s.num_kv_heads, s.v_dim)]

    def _topk(self, n: int, length: int) -> torch.Tensor:
        """``[n, K]`` int32 distinct positions mostly in ``[0, length)``, some ``-1`` and some out of range."""
        k = self.topk
        rows = []
        for _ in range(n):
            perm = torch.randperm(length + 3, generator=self.gen)[:k]  # length .. length+2: out of range
            row = torch.full((k,), -1, dtype=torch.int64)
            row[: perm.numel()] = perm
            drop = torch.rand(k, generator=self.gen) < 0.15  # invalid entries anywhere in the row
            rows.append(torch.where(drop, torch.full_like(row, -1), row)[torch.randperm(k, generator=self.gen)])
        return torch.stack(rows).to(torch.int32)

    def _pack_kv(self, kv: list[torch.Tensor]) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return kv[0] if len(kv) == 1 else (kv[0], kv[1])

    def prefill_request(self, request_id: Hashable, n: int, *, attend: bool = True) -> PrefillRequest:
        """A chunk of ``n`` new tokens (a new request, or the next chunk of a known one); recorded."""
        req = self.requests.setdefault(request_id, _Req())
        kv = self._kv(n)
        req.kv = kv if not req.kv else [torch.cat([a, b]) for a, b in zip(req.kv, kv)]
        if not attend:
            return PrefillRequest(request_id, kv=self._pack_kv(kv))
        q = self._randn(n, self.spec.num_heads, self.spec.head_dim)
        topk = self._topk(n, req.length) if self.spec.kind == "sparse_mla" else None
        return PrefillRequest(request_id, kv=self._pack_kv(kv), q=q, topk_pos=topk)

    def decode_request(self, request_id: Hashable, q_len: int = 1, *, append: bool = True) -> DecodeRequest:
        """``q_len`` new query tokens of a known request (their KV rows appended when ``append``); recorded."""
        req = self.requests[request_id]
        kv = None
        if append:
            new = self._kv(q_len)
            req.kv = [torch.cat([a, b]) for a, b in zip(req.kv, new)]
            kv = self._pack_kv(new)
        q = self._randn(q_len, self.spec.num_heads, self.spec.head_dim)
        topk = self._topk(q_len, req.length) if self.spec.kind == "sparse_mla" else None
        return DecodeRequest(request_id, q=q, topk_pos=topk, kv=kv)

    def free(self, request_id: Hashable) -> None:
        del self.requests[request_id]

    # -- the reference -------------------------------------------------------------------------
    def expected(
        self, request: PrefillRequest | DecodeRequest, *, device: torch.device | str = "cpu", chunk: int = 64
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fp64 ``(out [n, H, Dv], lse [n, H])`` of a request made by this mirror, after its step.

        Computed on ``device``, ``chunk`` query tokens at a time (a sparse-MLA token gathers its
        ``K`` rows once for all heads); returned on the CPU.
        """
        s, req = self.spec, self.requests[request.id]
        q = request.q
        if q is None:
            raise ValueError("the request has no queries")
        n, h = int(q.shape[0]), s.num_heads
        length = req.length
        dev = torch.device(device)
        if s.kind == "sparse_mla":
            kv = req.kv[0].to(dev)
            if self.kv_fp8:  # the rows as the pool stores them (row by row, so a cache of them is these)
                kv = dequantize_kv(quantize_kv(kv), torch.float32)
            pos_all = request.topk_pos.to(dev, torch.int64)  # type: ignore[union-attr]
            outs, lses = [], []
            for t0 in range(0, n, chunk):
                pos = pos_all[t0 : t0 + chunk]
                valid = (pos >= 0) & (pos < length) & ~repeated(pos)  # a row listed twice is one key
                rows = kv[pos.clamp(0, length - 1)].double()  # [c, K, D]
                logits = torch.bmm(q[t0 : t0 + chunk].to(dev).double(), rows.transpose(1, 2)) * self.scale
                logits = logits.masked_fill(~valid[:, None, :], float("-inf"))  # [c, H, K]
                p, lse = softmax_lse_fp64(logits, None if self.sinks is None else self.sinks.to(dev))
                outs.append(torch.bmm(p, rows[..., : s.v_dim]).cpu())
                lses.append(lse.cpu())
            return torch.cat(outs), torch.cat(lses)
        group = h // s.num_kv_heads
        k = req.kv[0].double().repeat_interleave(group, dim=1).permute(1, 0, 2)  # [H, L, D]
        v = req.kv[1].double().repeat_interleave(group, dim=1).permute(1, 0, 2)
        visible = torch.arange(length)[None, :] < (length - n + torch.arange(n) + 1)[:, None]  # [n, L] causal
        mask = visible[:, None, :].expand(n, h, length)
        return attention_fp64(
            q, k[None].expand(n, -1, -1, -1), v[None].expand(n, -1, -1, -1), mask, self.scale, self.sinks
        )
