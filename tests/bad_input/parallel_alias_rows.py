"""Rows of the bad-input table for a parallel step's destinations laid over its inputs (tests/test_bad_input.py).

A step's ``out`` / ``lse_out``, its ``workspace`` buffers written while it still reads its inputs,
and the collector's ``buffers["send"]`` may not share memory with what the step reads: its
exchanges and kernels write them while later chunks or kernels still read queries, keys, rows or
the partial, so an overlap gives a wrong result with no error (tests/test_parallel_alias.py shows
it on two ranks). Each row lays a destination over an input and must get a ``ValueError`` naming
both, in the step's agreement, before any data collective. Run on a one-rank gloo group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tests.bad_input.parallel_rows import _collect, _dcp_gqa, _dcp_mla, _shardq
from tests.bad_input.table import Call, Raises, Row

_WS_BYTES = 1 << 14  # room for any workspace buffer of the table's small steps


def _into(buf: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t``'s values copied to the first bytes of ``buf`` (flat ``uint8``), as a tensor over them."""
    n = t.numel() * t.element_size()
    buf[:n].copy_(t.contiguous().view(-1).view(torch.uint8))
    return buf[:n].view(t.dtype).view(t.shape)


def _with_buf(x: dict[str, Any]) -> torch.Tensor:
    """One flat ``uint8`` buffer per row build, shared by the arguments that lay themselves over it."""
    return x.setdefault("buf", torch.zeros(_WS_BYTES, dtype=torch.uint8))


def _shardq_over(dest: str, src: str, **extra: Any) -> Callable[[Any], Call]:
    """A ShardQ call whose ``dest`` (``"out"``, ``"lse_out"`` or a ``workspace`` key) lies over the
    input ``src`` (the bytes of the mla inputs' ``src``, or ``extra[src]``'s, copied into one buffer)."""

    def place(x: dict[str, Any]) -> torch.Tensor:
        return _into(_with_buf(x), extra[src](x) if src in extra else x[src])

    arg = {"q": "q_heads_local"}.get(src, src)
    over: dict[str, Any] = {k: v for k, v in extra.items() if k != src}
    over[arg] = place
    if dest in ("out", "lse_out"):
        shape = (5, 2, 32) if dest == "out" else (5, 2)
        over[dest] = lambda x: _with_buf(x).view(torch.float32)[: 5 * 2 * (32 if dest == "out" else 1)].view(shape)
    else:
        over["workspace"] = lambda x: {dest: _with_buf(x)}
    return _shardq(**over)


def _dcp_over(
    make: Callable[..., Callable[[Any], Call]],
    key: str,
    src: str,
    value: Callable[[dict[str, Any]], torch.Tensor] | None = None,
) -> Callable[[Any], Call]:
    """A DCP step (``make``: the table's builder) whose ``workspace[key]`` lies over its input ``src``
    (the builder's, or ``value(args)``)."""

    def build(group: Any) -> Call:
        buf = torch.zeros(_WS_BYTES, dtype=torch.uint8)
        place = (lambda a: _into(buf, a[src])) if value is None else (lambda a: _into(buf, value(a)))
        return make(**{src: place}, workspace={key: buf})(group)

    return build


def _collect_send_over(src: str) -> Callable[[Any], Call]:
    """The collector's ``buffers["send"]`` over its partial's ``src`` (``"out"`` or ``"lse"``)."""

    def build(group: Any) -> Call:
        buf = torch.zeros(_WS_BYTES, dtype=torch.uint8)
        return _collect(**{src: lambda a: _into(buf, a[src])}, buffers={"send": buf})(group)

    return build


def _dcp_gqa_meta(a: dict[str, Any]) -> torch.Tensor:
    """The host-planned ``[2, T]`` metadata of the table's one-rank GQA step: each request's length, its row."""
    return torch.stack([a["seq_lens"], torch.arange(2, dtype=torch.int32)])


def parallel_alias_rows() -> list[Row]:
    """Every parallel step's destination-over-input row (``dist=True``)."""
    ws_over = r"^workspace\['{}'\] shares memory with {}: the step reads"
    rows = [
        (
            "shardq_prefill-out-over-q-heads-local",
            _shardq_over("out", "q"),
            Raises(ValueError, r"^out shares memory with q_heads_local: the step reads q_heads_local after writing"),
        ),
        ("shardq_prefill-out-over-kv", _shardq_over("out", "kv"), Raises(ValueError, r"^out shares memory with kv")),
        (
            "shardq_prefill-lse-out-over-rows",
            _shardq_over("lse_out", "rows"),
            Raises(ValueError, r"^lse_out shares memory with rows"),
        ),
        (
            "shardq_prefill-lse-out-over-topk-length",
            _shardq_over("lse_out", "topk_length", topk_length=lambda x: torch.full((5,), 3, dtype=torch.int32)),
            Raises(ValueError, r"^lse_out shares memory with topk_length"),
        ),
        (
            "shardq_prefill-out-over-sinks",
            _shardq_over("out", "sinks", sinks=lambda x: torch.zeros(2)),
            Raises(ValueError, r"^out shares memory with sinks"),
        ),
        (
            "shardq_prefill-workspace-q-over-kv",
            _shardq_over("q", "kv"),
            Raises(ValueError, ws_over.format("q", "kv")),
        ),
        (
            "shardq_prefill-workspace-rows-over-rows",
            _shardq_over("rows", "rows"),
            Raises(ValueError, ws_over.format("rows", "rows")),
        ),
        (
            "dcp_sparse_mla_decode-workspace-q-over-topk-pos",
            _dcp_over(_dcp_mla, "q", "topk_pos"),
            Raises(ValueError, ws_over.format("q", "topk_pos")),
        ),
        (
            "dcp_sparse_mla_decode-workspace-rows-over-kv-cache",
            _dcp_over(_dcp_mla, "rows", "kv_cache"),
            Raises(ValueError, ws_over.format("rows", "kv_cache")),
        ),
        (
            "dcp_sparse_mla_decode-workspace-out-over-kv-cache",
            _dcp_over(_dcp_mla, "out", "kv_cache"),
            Raises(ValueError, ws_over.format("out", "kv_cache")),
        ),
        (
            "dcp_gqa_decode-workspace-q-over-k-cache",
            _dcp_over(_dcp_gqa, "q", "k_cache"),
            Raises(ValueError, ws_over.format("q", "k_cache")),
        ),
        (
            "dcp_gqa_decode-workspace-lse-over-v-cache",
            _dcp_over(_dcp_gqa, "lse", "v_cache"),
            Raises(ValueError, ws_over.format("lse", "v_cache")),
        ),
        (
            "dcp_gqa_decode-workspace-out-over-meta",
            _dcp_over(_dcp_gqa, "out", "meta", _dcp_gqa_meta),
            Raises(ValueError, ws_over.format("out", "meta")),
        ),
        (
            "collect_partials-buffers-send-over-out",
            _collect_send_over("out"),
            Raises(ValueError, r"^buffers\['send'\] shares memory with out: the collector reads out after writing"),
        ),
        (
            "collect_partials-buffers-send-over-lse",
            _collect_send_over("lse"),
            Raises(ValueError, r"^buffers\['send'\] shares memory with lse"),
        ),
    ]
    return [Row(rid, build, expect, dist=True) for rid, build, expect in rows]
