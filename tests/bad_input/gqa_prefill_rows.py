"""Rows of the bad-input table for GQA prefill: the op (local) and its head-TP and PCP steps (one rank)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardattn import plan as P
from shardattn.ops import gqa_prefill as op_mod
from tests.bad_input.table import INF, META, NAN, Call, Gives, Raises, Row, _gen, override, same_as


def prefill_inputs() -> dict[str, Any]:
    """Small valid inputs: 2 requests of 2 and 3 new tokens, 4 query / 2 KV heads, d 16, the second
    request after 5 cached tokens in pages 2 and 0 of a 3-page cache (page 4)."""
    g = _gen(11)
    return {
        "q": torch.randn(5, 4, 16, generator=g),
        "k": torch.randn(5, 2, 16, generator=g),
        "v": torch.randn(5, 2, 16, generator=g),
        "cu_q_lens": torch.tensor([0, 2, 5], dtype=torch.int32),
        "k_cache": torch.randn(3, 4, 2, 16, generator=g),
        "v_cache": torch.randn(3, 4, 2, 16, generator=g),
        "block_table": torch.tensor([[1, -1], [2, 0]], dtype=torch.int32),
        "prefix_lens": torch.tensor([0, 5], dtype=torch.int32),
    }


CACHE = ("k_cache", "v_cache", "block_table", "prefix_lens")


def _op(**over: Any) -> Callable[[Any], Call]:
    def build(_group: Any) -> Call:
        x = prefill_inputs()
        args = {n: x[n] for n in ("q", "k", "v", "cu_q_lens")}
        kw: dict[str, Any] = {n: x[n] for n in CACHE} | {"return_lse": True}
        override(args, kw, over, x)
        return Call(op_mod.gqa_prefill, tuple(args.values()), kw)

    return build


def _no_prefix_result() -> Any:
    x = prefill_inputs()
    return op_mod.gqa_prefill(x["q"], x["k"], x["v"], x["cu_q_lens"], return_lse=True)


def _empty_result(res: Any) -> str | None:
    out, lse = res
    return None if out.shape == (0, 4, 16) and lse.shape == (0, 4) else f"shapes {out.shape}, {lse.shape}"


def op_rows() -> list[Row]:
    n = "gqa_prefill"
    zero = torch.zeros(0, 4, 16)
    return [
        Row(f"{n}-k-bf16", _op(k=lambda x: x["k"].bfloat16()), Raises(TypeError, r"^k must have dtype in \(float32\)")),
        Row(f"{n}-k-tokens", _op(k=lambda x: x["k"][:4]), Raises(ValueError, r"^k must have shape \[5, Hkv, 16\]")),
        Row(f"{n}-heads-not-multiple", _op(k=lambda x: torch.randn(5, 3, 16)), Raises(ValueError, r"q heads \(4\)")),
        Row(  # regression: 0 query heads passed the head check, then a ZeroDivisionError in the reference
            f"{n}-no-query-heads",
            _op(q=lambda x: x["q"][:, :0]),
            Raises(ValueError, r"^q must hold at least one head of head_dim >= 1, got shape \[5, 0, 16\]"),
        ),
        Row(  # regression: head_dim 0 raised ZeroDivisionError from the default scale
            f"{n}-head-dim-0",
            _op(
                q=lambda x: x["q"][..., :0],
                k=lambda x: x["k"][..., :0],
                v=lambda x: x["v"][..., :0],
                k_cache=lambda x: x["k_cache"][..., :0],
                v_cache=lambda x: x["v_cache"][..., :0],
            ),
            Raises(ValueError, r"^q must hold at least one head of head_dim >= 1, got shape \[5, 4, 0\]"),
        ),
        Row(f"{n}-v-shape", _op(v=lambda x: x["v"][:, :1]), Raises(ValueError, r"^v must have shape \[5, 2, 16\]")),
        Row(
            f"{n}-cu-int64",
            _op(cu_q_lens=lambda x: x["cu_q_lens"].long()),
            Raises(TypeError, r"^cu_q_lens must have dtype in \(int32\)"),
        ),
        Row(
            f"{n}-cu-short-of-tokens",
            _op(cu_q_lens=torch.tensor([0, 2, 4], dtype=torch.int32)),
            Raises(ValueError, r"^cu_q_lens must start at 0, not decrease and end at q's 5 tokens"),
        ),
        Row(
            f"{n}-cu-decreasing",
            _op(
                cu_q_lens=torch.tensor([0, 3, 2, 5], dtype=torch.int32),
                block_table=torch.zeros(3, 2).int(),
                prefix_lens=torch.zeros(3, dtype=torch.int32),
            ),
            Raises(ValueError, r"^cu_q_lens must start at 0, not decrease"),
        ),
        Row(f"{n}-window-left--2", _op(window_left=-2), Raises(ValueError, r"^window_left must be >= -1")),
        Row(f"{n}-window-float", _op(window_left=3.0), Raises(TypeError, r"^window_left must be an int")),
        Row(f"{n}-scale-nan", _op(scale=NAN), Raises(ValueError, r"^scale must be a finite number > 0")),
        Row(f"{n}-scale-negative", _op(scale=-0.5), Raises(ValueError, r"^scale must be a finite number > 0")),
        Row(f"{n}-sinks-shape", _op(sinks=torch.zeros(2)), Raises(ValueError, r"^sinks must have shape \[4\]")),
        Row(f"{n}-sinks-bf16", _op(sinks=torch.zeros(4).bfloat16()), Raises(TypeError, r"^sinks must have dtype")),
        Row(f"{n}-backend", _op(backend="triton"), Raises(ValueError, r"^backend must be one of")),
        Row(
            f"{n}-fa4-on-cpu", _op(backend="fa4"), Raises(ValueError, r"^backend='fa4' is unavailable: FA4 needs CUDA")
        ),
        Row(f"{n}-return-lse-int", _op(return_lse=1), Raises(TypeError, r"^return_lse must be a bool")),
        Row(
            f"{n}-cache-without-table",
            _op(block_table=None),
            Raises(ValueError, r"^k_cache, v_cache, block_table and prefix_lens go together"),
        ),
        Row(
            f"{n}-cache-heads",
            _op(k_cache=lambda x: x["k_cache"][:, :, :1], v_cache=lambda x: x["v_cache"][:, :, :1]),
            Raises(ValueError, r"^k_cache must have shape \[\*, \*, 2, 16\] \(k's 2 KV heads, q's head_dim 16"),
        ),
        Row(
            f"{n}-v-cache-shape",
            _op(v_cache=lambda x: x["v_cache"][:2]),
            Raises(ValueError, r"^v_cache must have shape \[3, 4, 2, 16\]"),
        ),
        Row(
            f"{n}-table-rows",
            _op(block_table=lambda x: x["block_table"][:1]),
            Raises(ValueError, r"^block_table must have one row per request \(2\)"),
        ),
        Row(
            f"{n}-prefix-negative",
            _op(prefix_lens=torch.tensor([-1, 5], dtype=torch.int32)),
            Raises(ValueError, r"^prefix_lens must be in \[0, max_pages \* page_size = 8\]"),
        ),
        Row(
            f"{n}-prefix-past-table",
            _op(prefix_lens=torch.tensor([0, 9], dtype=torch.int32)),
            Raises(ValueError, r"^prefix_lens must be in \[0, max_pages \* page_size = 8\]"),
        ),
        Row(
            f"{n}-page-outside-cache",
            _op(block_table=torch.tensor([[1, -1], [2, 3]], dtype=torch.int32)),
            Raises(ValueError, r"^block_table holds pages outside \[0, 3\) for the prefixes of requests \[1\]"),
        ),
        Row(  # regression: the pages of new tokens read from the cache went unchecked (-1: the last page)
            f"{n}-new-keys-in-cache-page-minus-1",
            _op(
                k=None,
                v=None,
                prefix_lens=torch.tensor([0, 3], dtype=torch.int32),
                block_table=torch.tensor([[1, -1], [2, -1]], dtype=torch.int32),
            ),
            Raises(ValueError, r"^block_table holds pages outside \[0, 3\) for the new tokens of requests \[1\]"),
        ),
        Row(  # regression: a raw IndexError from inside the reference
            f"{n}-new-keys-in-cache-page-outside-cache",
            _op(k=None, v=None, block_table=torch.tensor([[3, -1], [2, 0]], dtype=torch.int32)),
            Raises(ValueError, r"^block_table holds pages outside \[0, 3\) for the new tokens of requests \[0\]"),
        ),
        Row(
            f"{n}-new-keys-in-cache-unread-page-minus-1",  # 1 + 3 tokens: one page read, the -1 after it not
            _op(
                k=None,
                v=None,
                prefix_lens=torch.tensor([0, 1], dtype=torch.int32),
                block_table=torch.tensor([[1, -1], [2, -1]], dtype=torch.int32),
            ),
            Gives(lambda res: None if bool(res[1].isfinite().all()) else "an empty row"),
        ),
        Row(f"{n}-cu-on-meta", _op(cu_q_lens=lambda x: x["cu_q_lens"].to(META)), Raises(ValueError, r"cu_q_lens")),
        Row(
            f"{n}-zero-prefix-is-no-prefix",
            _op(prefix_lens=torch.zeros(2, dtype=torch.int32)),
            Gives(same_as(_no_prefix_result)),
        ),
        Row(
            f"{n}-no-tokens",
            _op(q=zero, k=zero[:, :2], v=zero[:, :2], cu_q_lens=torch.zeros(3, dtype=torch.int32)),
            Gives(_empty_result),
        ),
    ]


def _head_tp(**over: Any) -> Callable[[Any], Call]:
    def build(group: Any) -> Call:
        from shardattn.parallel import Comm, gqa_prefill_head_tp

        comm = Comm(group)
        x = prefill_inputs()
        args = {n: x[n] for n in ("q", "k", "v", "cu_q_lens")}
        kw: dict[str, Any] = {n: x[n] for n in CACHE} | {"num_kv_heads": 2}
        override(args, kw, over, x)
        return Call(gqa_prefill_head_tp, (*args.values(), comm), kw, comm)

    return build


def _pcp(**over: Any) -> Callable[[Any], Call]:
    def build(group: Any) -> Call:
        from shardattn.parallel import Comm, gqa_prefill_pcp

        comm = Comm(group)
        x = prefill_inputs()
        args = {"q": x["q"], "k_new": x["k"], "v_new": x["v"], "plan": P.pcp_plan([2, 3], 1, prefix_lens=[0, 5])}
        kw: dict[str, Any] = {n: x[n] for n in CACHE[:3]}
        override(args, kw, over, x)
        return Call(gqa_prefill_pcp, (*args.values(), comm), kw, comm)

    return build


def step_rows() -> list[Row]:
    """The steps' rows (``dist=True``: run on a one-rank gloo group)."""
    rows = [
        (
            "gqa_prefill_head_tp-kv-heads-for-another-rank-count",
            _head_tp(k=lambda x: x["k"][:, :1], v=lambda x: x["v"][:, :1]),
            Raises(ValueError, r"^k must hold this rank's 2 KV head\(s\) \(KV heads \[0, 2\) of 2"),
        ),
        (
            "gqa_prefill_head_tp-kv-heads-do-not-divide",
            _head_tp(num_kv_heads=3),
            Raises(
                ValueError, r"^q's query heads \(4 per rank, 4 over 1 rank\) must be a multiple of num_kv_heads \(3\)"
            ),
        ),
        (
            "gqa_prefill_head_tp-sinks-of-local-heads-only",
            _head_tp(sinks=torch.zeros(2)),
            Raises(ValueError, r"^sinks must have shape \[4\]"),
        ),
        ("gqa_prefill_head_tp-scale-inf", _head_tp(scale=float("inf")), Raises(ValueError, r"^scale must be a finite")),
        (
            "gqa_prefill_head_tp-equals-the-op-on-one-rank",
            _head_tp(sinks=torch.linspace(-1, 1, 4), return_lse=True),
            Gives(same_as(lambda: _op_with(sinks=torch.linspace(-1, 1, 4)))),
        ),
        (
            "gqa_prefill_pcp-plan-for-2-ranks",
            _pcp(plan=P.pcp_plan([2, 3], 2, prefix_lens=[0, 5])),
            Raises(ValueError, r"^plan is for world_size=2, but the group has 1 ranks"),
        ),
        ("gqa_prefill_pcp-plan-not-a-plan", _pcp(plan=[2, 3]), Raises(TypeError, r"^plan must be a PCPPlan")),
        (
            "gqa_prefill_pcp-q-tokens-vs-plan",
            _pcp(q=lambda x: x["q"][:4]),
            Raises(ValueError, r"^q must hold rank 0's 5 tokens \(plan\), got 4"),
        ),
        (
            "gqa_prefill_pcp-no-query-heads",
            _pcp(q=lambda x: x["q"][:, :0]),
            Raises(ValueError, r"^q must hold at least one head of head_dim >= 1, got shape \[5, 0, 16\]"),
        ),
        (
            "gqa_prefill_pcp-head-dim-0",
            _pcp(
                q=lambda x: x["q"][..., :0],
                k_new=lambda x: x["k"][..., :0],
                v_new=lambda x: x["v"][..., :0],
                k_cache=lambda x: x["k_cache"][..., :0],
                v_cache=lambda x: x["v_cache"][..., :0],
            ),
            Raises(ValueError, r"^q must hold at least one head of head_dim >= 1, got shape \[5, 4, 0\]"),
        ),
        (
            "gqa_prefill_pcp-k-new-heads",
            _pcp(k_new=lambda x: torch.randn(5, 3, 16), v_new=lambda x: torch.randn(5, 3, 16)),
            Raises(ValueError, r"^q heads \(4\) must be a multiple of k_new's KV heads \(3\)"),
        ),
        (
            "gqa_prefill_pcp-prefix-without-cache",
            _pcp(k_cache=None, v_cache=None, block_table=None),
            Raises(ValueError, r"^the plan has cached prefixes \(prefix_lens=\[0, 5\]\)"),
        ),
        (
            "gqa_prefill_pcp-page-outside-cache",
            _pcp(block_table=torch.tensor([[1, -1], [2, 7]], dtype=torch.int32)),
            Raises(ValueError, r"^block_table holds pages outside \[0, 3\)"),
        ),
        (  # regression: the pages of new tokens read from the cache went unchecked (-1: the last page)
            "gqa_prefill_pcp-new-keys-in-cache-page-minus-1",
            _pcp(
                k_new=None,
                v_new=None,
                plan=P.pcp_plan([2, 3], 1, prefix_lens=[0, 3]),
                block_table=torch.tensor([[1, -1], [2, -1]], dtype=torch.int32),
            ),
            Raises(ValueError, r"^block_table holds pages outside \[0, 3\) for the new tokens of requests \[1\]"),
        ),
        (  # regression: a raw IndexError from inside the reference
            "gqa_prefill_pcp-new-keys-in-cache-page-outside-cache",
            _pcp(k_new=None, v_new=None, block_table=torch.tensor([[3, -1], [2, 0]], dtype=torch.int32)),
            Raises(ValueError, r"^block_table holds pages outside \[0, 3\) for the new tokens of requests \[0\]"),
        ),
        (
            "gqa_prefill_pcp-new-keys-in-cache-unread-page-minus-1",  # 1 + 3 tokens: one page read, the -1 after it not
            _pcp(
                k_new=None,
                v_new=None,
                plan=P.pcp_plan([2, 3], 1, prefix_lens=[0, 1]),
                block_table=torch.tensor([[1, -1], [2, -1]], dtype=torch.int32),
            ),
            Gives(lambda res: None if bool(res[1].isfinite().all()) else "an empty row"),
        ),
        ("gqa_prefill_pcp-window--3", _pcp(window_left=-3), Raises(ValueError, r"^window_left must be >= -1")),
        ("gqa_prefill_pcp-gather-output-str", _pcp(gather_output="yes"), Raises(TypeError, r"^gather_output must")),
        (
            "gqa_prefill_pcp-cache-on-meta",
            _pcp(v_cache=lambda x: x["v_cache"].to(META)),
            Raises(ValueError, r"v_cache differs"),
        ),
        (
            "gqa_prefill_pcp-equals-the-op-on-one-rank",
            _pcp(sinks=torch.linspace(-1, 1, 4)),
            Gives(same_as(lambda: _op_with(sinks=torch.linspace(-1, 1, 4)))),
        ),
    ]
    return [Row(rid, build, expect, dist=True) for rid, build, expect in rows]


def _op_with(**kw: Any) -> Any:
    x = prefill_inputs()
    return op_mod.gqa_prefill(x["q"], x["k"], x["v"], x["cu_q_lens"], **{n: x[n] for n in CACHE}, **kw, return_lse=True)


def _runtime(mode: str = "headtp", spec: Any = None, **over: Any) -> Callable[[Any], Call]:
    """``Runtime.prefill`` of a GQA spec (4 query / 2 KV heads, d 16, page 4; with sinks where the
    row passes them) on the inputs of :func:`prefill_inputs` (one rank: head-TP holds every head)."""

    def build(group: Any) -> Call:
        from shardattn.plan.spec import ModelSpec
        from shardattn.runtime.runtime import Runtime

        gqa = ModelSpec("gqa", 4, 2, 16, 16, 0, 4, dtype="float32", has_sinks="sinks" in over)
        rt = Runtime(gqa if spec is None else spec, group, mode=mode, max_batched_tokens=16, warmup=False)
        x = prefill_inputs()
        args = {"q": x["q"], "kv_cache": (x["k_cache"], x["v_cache"])}
        kw: dict[str, Any] = {"kv_new": (x["k"], x["v"]), "block_table": x["block_table"],
                              "query_lens": [2, 3], "prefix_lens": [0, 5]}  # fmt: skip
        override(args, kw, over, x)
        return Call(rt.prefill, tuple(args.values()), kw, rt.comm)

    return build


def runtime_rows() -> list[Row]:
    """``Runtime.prefill``'s GQA arguments (one rank)."""
    n = "Runtime.prefill-gqa"
    rows = [
        (
            f"{n}-kv-new-one-tensor",
            _runtime(kv_new=lambda x: x["k"]),
            Raises(TypeError, r"^kv_new must be a \(k, v\) pair"),
        ),
        (
            f"{n}-kv-new-other-heads",
            _runtime(kv_new=lambda x: (x["k"][:, :1], x["v"][:, :1])),
            Raises(ValueError, r"^kv_new\[0\] must have shape \[5, 2, 16\], got \[5, 1, 16\]"),
        ),
        (
            f"{n}-kv-cache-other-heads",
            _runtime(kv_cache=lambda x: (x["k_cache"][:, :, :1], x["v_cache"][:, :, :1])),
            Raises(ValueError, r"^kv_cache\[0\] must have shape \[pages, 4, 2, 16\] \(this rank.s 2 KV head"),
        ),
        (
            f"{n}-kv-cache-other-pages",
            _runtime(kv_cache=lambda x: (x["k_cache"].view(-1, 2, 2, 16), x["v_cache"].view(-1, 2, 2, 16))),
            Raises(ValueError, r"^kv_cache\[0\] must hold pages of 4 tokens \(the model's page_size"),
        ),
        (
            f"{n}-rows-given",
            _runtime(rows=lambda x: torch.zeros(5, 4, dtype=torch.int32)),
            Raises(ValueError, r"^rows is sparse MLA's top-k"),
        ),
        (f"{n}-window-minus-2", _runtime(window_left=-2), Raises(ValueError, r"^window_left must be >= -1")),
        (
            f"{n}-sinks-other-heads",
            _runtime(sinks=lambda x: torch.zeros(3)),
            Raises(ValueError, r"^sinks must have shape \[4\], got \[3\]"),
        ),
        (
            f"{n}-sinks-fp16",
            _runtime(sinks=lambda x: torch.zeros(4, dtype=torch.float16)),
            Raises(TypeError, r"^sinks must have dtype in \(float32\), got float16"),
        ),
        (  # of the expected shape: head-TP ran it (NaN outputs), PCP refused it
            f"{n}-sinks-nan",
            _runtime(sinks=lambda x: torch.tensor([0.0, NAN, 0.0, 0.0])),
            Raises(ValueError, r"^sinks must be finite, got sinks\[1\]=nan"),
        ),
        (
            f"{n}-sinks-inf",
            _runtime(sinks=lambda x: torch.tensor([INF, 0.0, 0.0, 0.0])),
            Raises(ValueError, r"^sinks must be finite, got sinks\[0\]=inf"),
        ),
        (
            f"{n}-prefix-without-cache",
            _runtime(kv_cache=None, block_table=None),
            Raises(ValueError, r"^the step has cached prefixes \(prefix_lens up to 5\): pass kv_cache"),
        ),
        (
            f"{n}-cache-without-table",
            _runtime(block_table=None),
            Raises(ValueError, r"^kv_cache needs its block_table"),
        ),
        (
            f"{n}-keys-in-cache-past-the-table",
            _runtime(kv_new=None, prefix_lens=[0, 6]),
            Raises(ValueError, r"^block_table holds 8 positions per request, but seq_lens \(prefix and new .* reach 9"),
        ),
        (
            f"{n}-table-page-outside-cache",
            _runtime(block_table=lambda x: torch.tensor([[1, -1], [2, 7]], dtype=torch.int32)),
            Raises(ValueError, r"^block_table holds pages outside \[0, 3\) for requests \[1\]"),
        ),
        (
            f"{n}-pcp-keys-in-cache-page-minus-1",
            _runtime(
                "pcp",
                kv_new=None,
                prefix_lens=[0, 3],
                block_table=lambda x: torch.tensor([[1, -1], [2, -1]], dtype=torch.int32),
            ),
            Raises(ValueError, r"^block_table holds pages outside \[0, 3\) for requests \[1\]"),
        ),
        (
            f"{n}-shardq-mode",
            lambda group: Call(_gqa_runtime, (group,), {"mode": "shardq"}),
            Raises(ValueError, r"mode 'shardq' runs a sparse-MLA prefill \(ShardQ\), but the spec is a GQA model"),
        ),
        (
            "PrefillOptions-return-lse-int",
            lambda group: Call(_prefill_options, (), {"return_lse": 1}),
            Raises(TypeError, r"^PrefillOptions\.return_lse must be a bool"),
        ),
    ]
    return [Row(rid, build, expect, dist=True) for rid, build, expect in rows]


def _gqa_runtime(group: Any, mode: str) -> Any:
    from shardattn.plan.spec import ModelSpec
    from shardattn.runtime.runtime import Runtime

    return Runtime(ModelSpec("gqa", 4, 2, 16, 16, 0, 4), group, mode=mode, max_batched_tokens=16, warmup=False)


def _prefill_options(**fields: Any) -> Any:
    from shardattn.runtime.options import PrefillOptions

    return PrefillOptions(**fields)


def gqa_prefill_rows() -> list[Row]:
    """Every row of the GQA prefill entry points."""
    return [*op_rows(), *step_rows(), *runtime_rows()]
