"""Rows of the bad-input table for the parallel steps and the Runtime, run on a one-rank gloo group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardattn import plan as P
from tests.bad_input.table import (
    INF,
    META,
    NAN,
    Call,
    Gives,
    Raises,
    Row,
    _gen,
    all_empty,
    gqa,
    mla,
    override,
    topk_inputs,
)

MLA_SPEC = P.ModelSpec("sparse_mla", 8, 1, 48, 32, 16, 16, dtype="float32", softmax_scale=0.3)
MLA_SINKS_SPEC = P.ModelSpec("sparse_mla", 8, 1, 48, 32, 16, 16, dtype="float32", softmax_scale=0.3, has_sinks=True)
GQA_SPEC = P.ModelSpec("gqa", 8, 2, 16, 16, 0, 4, dtype="float32")


def _fp8_rows(n: int) -> torch.Tensor:
    """``n`` ``fp8_ds_mla`` rows (uint8 ``[n, 656]``)."""
    from shardattn.ops.kv_fp8 import quantize_kv

    return quantize_kv(torch.randn(n, 576, generator=_gen(5)))


def _shardq(**over: Any) -> Callable[[Any], Call]:
    def build(group: Any) -> Call:
        from shardattn.parallel import Comm, shardq_prefill

        comm = Comm(group)
        x = mla(t=5)
        args = {
            "q_heads_local": x["q"],
            "kv": x["kv"],
            "rows": x["rows"],
            "plan": P.zigzag_split([2, 3], 1, min_tokens=0),
        }
        kw: dict[str, Any] = {"scale": 0.125, "v_dim": 32}
        override(args, kw, over, x)
        return Call(shardq_prefill, (*args.values(), comm), kw, comm)

    return build


def _dcp_mla(**over: Any) -> Callable[[Any], Call]:
    def build(group: Any) -> Call:
        from shardattn.parallel import Comm, dcp_sparse_mla_decode

        comm = Comm(group)
        x = topk_inputs()
        q = torch.randn(2, 2, 48, generator=_gen(4))
        kv = torch.randn(16, 48, generator=_gen(5))
        names = ("q_heads_local", "kv_cache", "topk_pos", "req_ids", "block_table", "layout")
        args = dict(zip(names, (q, kv, x["pos"], x["req"], x["table"], P.DCPLayout(1))))
        kw: dict[str, Any] = {"block_size": 4, "scale": 0.125, "v_dim": 32}
        override(args, kw, over, args)
        return Call(dcp_sparse_mla_decode, (*args.values(), comm), kw, comm)

    return build


def _dcp_gqa(**over: Any) -> Callable[[Any], Call]:
    def build(group: Any) -> Call:
        from shardattn.parallel import Comm, dcp_gqa_decode

        comm = Comm(group)
        x = gqa()
        names = ("q_heads_local", "k_cache", "v_cache", "block_table", "seq_lens", "layout")
        args = dict(zip(names, (x["q"], x["k"], x["v"], x["table"], x["lens"], P.DCPLayout(1))))
        kw: dict[str, Any] = {}
        override(args, kw, over, args)
        return Call(dcp_gqa_decode, (*args.values(), comm), kw, comm)

    return build


def _pcp(**over: Any) -> Callable[[Any], Call]:
    def build(group: Any) -> Call:
        from shardattn.parallel import Comm, pcp_prefill

        comm = Comm(group)
        g = _gen(6)
        q, kv_new = torch.randn(5, 2, 48, generator=g), torch.randn(5, 48, generator=g)
        pos = torch.randint(-1, 5, (5, 3), generator=g, dtype=torch.int32)
        args = {"q": q, "kv_new": kv_new, "topk_pos": pos, "plan": P.pcp_plan([2, 3], 1)}
        kw: dict[str, Any] = {"scale": 0.125, "v_dim": 32}
        override(args, kw, over, args)
        return Call(pcp_prefill, (*args.values(), comm), kw, comm)

    return build


def _collect(**over: Any) -> Callable[[Any], Call]:
    def build(group: Any) -> Call:
        from shardattn.parallel import Comm, collect_partials

        comm = Comm(group)
        g = _gen(7)
        args = {"out": torch.randn(3, 4, 8, generator=g), "lse": torch.randn(3, 4, generator=g)}
        kw: dict[str, Any] = {}
        override(args, kw, over, args)
        return Call(collect_partials, (args["out"], args["lse"], comm), kw, comm)

    return build


def _runtime_new(**over: Any) -> Callable[[Any], Call]:
    def build(group: Any) -> Call:
        from shardattn.runtime.runtime import Runtime

        kw: dict[str, Any] = {"max_batched_tokens": 64, "mode": "shardq", "warmup": False, **over}
        spec = kw.pop("spec", MLA_SPEC)
        return Call(Runtime, (spec, group), kw)

    return build


def _options(name: str, **fields: Any) -> Callable[[Any], Call]:
    def build(group: Any) -> Call:
        from shardattn.runtime import options

        return Call(getattr(options, name), (), fields)

    return build


def _runtime_step(
    step: str, spec: P.ModelSpec, mode: str, *, kv_dtype: str | None = None, **over: Any
) -> Callable[[Any], Call]:
    """A Runtime step's call (a Runtime of ``kv_dtype``) on small valid inputs with ``over`` replacing
    some; ``decode_plan=(seq_lens, cu_q_lens)`` passes ``batch=`` the Runtime's own decode plan of those lengths."""

    def build(group: Any) -> Call:
        from shardattn.runtime.runtime import Runtime

        rt = Runtime(spec, group, max_batched_tokens=64, mode=mode, warmup=False, kv_dtype=kv_dtype)
        rt.comm.reset_counts()
        given = dict(over)
        if "decode_plan" in given:
            given["batch"] = rt.decode_step.plan(*given.pop("decode_plan"))
        if step == "prefill":
            x = mla(t=5, h=8, k=16)
            args = {"q": x["q"], "kv_cache": x["kv"], "rows": x["rows"]}
            kw: dict[str, Any] = {"query_lens": [2, 3]}
        elif spec.kind == "sparse_mla":
            x = topk_inputs()
            args = {
                "q": torch.randn(2, 8, 48, generator=_gen(8)),
                "kv_cache": torch.randn(64, 48, generator=_gen(9)),  # the table's 4 pages of 16
                "block_table": x["table"],
                "seq_lens": torch.tensor([10, 9], dtype=torch.int32),
            }
            kw = {"topk_pos": x["pos"], "req_ids": x["req"]}
        else:
            x = gqa(hq=8)
            args = {"q": x["q"], "kv_cache": (x["k"], x["v"]), "block_table": x["table"], "seq_lens": x["lens"]}
            kw = {}
        override(args, kw, given, args)
        fn = rt.prefill if step == "prefill" else rt.decode
        return Call(fn, tuple(args.values()), kw, rt.comm)

    return build


def _on_meta(build: Callable[[Any], Call]) -> Callable[[Any], Call]:
    """``build``'s call with its positional tensors on the meta device (a GPU's stand-in: the
    step reads no value there); host lists stay lists."""

    def on_meta(group: Any) -> Call:
        call = build(group)
        args = tuple(
            tuple(c.to(META) for c in a) if isinstance(a, tuple) else a.to(META) if isinstance(a, torch.Tensor) else a
            for a in call.args
        )
        return Call(call.fn, args, call.kwargs, call.comm)

    return on_meta


def parallel_rows() -> list[Row]:
    """Rows of the parallel steps and the Runtime (``dist=True``: run on a one-rank gloo group)."""
    two_rank_plan = P.zigzag_split([2, 3], 2, min_tokens=0)
    rows = [
        # ShardQ
        (
            "shardq_prefill-plan-for-2-ranks",
            _shardq(plan=two_rank_plan),
            Raises(ValueError, r"^plan is for world_size=2, but the group has 1 ranks"),
        ),
        ("shardq_prefill-plan-not-a-plan", _shardq(plan=[2, 3]), Raises(TypeError, r"^plan must be a ShardPlan")),
        (
            "shardq_prefill-q-wrong-width",
            _shardq(q_heads_local=lambda x: torch.randn(5, 2, 40)),
            Raises(ValueError, r"^q_heads_local must have last dim 48"),
        ),
        (
            "shardq_prefill-q-tokens-vs-plan",
            _shardq(q_heads_local=lambda x: x["q"][:4]),
            Raises(ValueError, r"^q_heads_local must hold the step's 5 tokens"),
        ),
        (
            "shardq_prefill-rows-int64",
            _shardq(rows=lambda x: x["rows"].long()),
            Raises(TypeError, r"^rows must have dtype"),
        ),
        ("shardq_prefill-kv-on-meta", _shardq(kv=lambda x: x["kv"].to(META)), Raises(ValueError, r"kv differs")),
        ("shardq_prefill-scale-nan", _shardq(scale=NAN), Raises(ValueError, r"^scale must be a finite number > 0")),
        ("shardq_prefill-scale-negative", _shardq(scale=-1.0), Raises(ValueError, r"^scale must be a finite")),
        (
            "shardq_prefill-sinks-count",
            _shardq(sinks=torch.zeros(3)),
            Raises(ValueError, r"^sinks must have shape \[2\]"),
        ),
        ("shardq_prefill-kv-without-rows", _shardq(kv=lambda x: x["kv"][:0]), Gives(all_empty(32))),
        ("shardq_prefill-return-lse-int", _shardq(return_lse=1), Raises(TypeError, r"^return_lse must be a bool")),
        ("shardq_prefill-chunks-past-max", _shardq(chunks=9), Raises(ValueError, r"^chunks must be in \[1, 8\]")),
        # DCP sparse MLA
        (
            "dcp_sparse_mla_decode-layout-for-2-ranks",
            _dcp_mla(layout=P.DCPLayout(2)),
            Raises(ValueError, r"^layout is for world_size=2, but the group has 1"),
        ),
        (
            "dcp_sparse_mla_decode-layout-not-a-layout",
            _dcp_mla(layout=2),
            Raises(TypeError, r"^layout must be a DCPLayout"),
        ),
        (
            "dcp_sparse_mla_decode-q-wrong-width",
            _dcp_mla(q_heads_local=torch.randn(2, 2, 40)),
            Raises(ValueError, r"^q_heads_local must have last dim 48"),
        ),
        ("dcp_sparse_mla_decode-scale-inf", _dcp_mla(scale=INF), Raises(ValueError, r"^scale must be a finite")),
        ("dcp_sparse_mla_decode-block-size-0", _dcp_mla(block_size=0), Raises(ValueError, r"^block_size must be >= 1")),
        (
            "dcp_sparse_mla_decode-table-past-cache",
            _dcp_mla(kv_cache=lambda a: a["kv_cache"][:8]),
            Raises(ValueError, r"^block_table points past kv_cache"),
        ),
        (
            # pages of 8 rows where the block table's blocks hold 4: read as blocks, they are other rows
            "dcp_sparse_mla_decode-pages-of-another-size",
            _dcp_mla(kv_cache=lambda a: a["kv_cache"].view(2, 8, 48)),
            Raises(ValueError, r"^kv_cache's pages hold 8 rows, but block_size is 4"),
        ),
        (
            "dcp_sparse_mla_decode-fp8-pages-of-another-size",
            _dcp_mla(
                q_heads_local=torch.randn(2, 2, 576, generator=_gen(4)),
                kv_cache=lambda a: _fp8_rows(16).view(2, 8, 656),
                v_dim=512,
            ),
            Raises(ValueError, r"^kv_cache's pages hold 8 rows, but block_size is 4"),
        ),
        (
            "dcp_sparse_mla_decode-req-ids-on-meta",
            _dcp_mla(req_ids=lambda a: a["req_ids"].to(META)),
            Raises(ValueError, r"req_ids differs"),
        ),
        ("dcp_sparse_mla_decode-strategy", _dcp_mla(strategy="ring"), Raises(ValueError, r"^strategy must be one of")),
        (
            "dcp_sparse_mla_decode-kv-without-rows",
            _dcp_mla(kv_cache=lambda a: a["kv_cache"][:0], block_table=torch.full((2, 3), -1, dtype=torch.int32)),
            Gives(all_empty(32)),
        ),
        # DCP GQA
        (
            "dcp_gqa_decode-layout-for-2-ranks",
            _dcp_gqa(layout=P.DCPLayout(2)),
            Raises(ValueError, r"^layout is for world_size=2"),
        ),
        (
            "dcp_gqa_decode-q-wrong-width",
            _dcp_gqa(q_heads_local=torch.randn(2, 4, 8)),
            Raises(ValueError, r"^q_heads_local must have last dim 16"),
        ),
        (
            "dcp_gqa_decode-head-dim-0",
            _dcp_gqa(
                q_heads_local=lambda x: x["q_heads_local"][..., :0],
                k_cache=lambda x: x["k_cache"][..., :0],
                v_cache=lambda x: x["v_cache"][..., :0],
            ),
            Raises(ValueError, r"^q_heads_local must hold at least one head of head_dim >= 1, got shape \[2, 4, 0\]"),
        ),
        ("dcp_gqa_decode-scale-zero", _dcp_gqa(scale=0.0), Raises(ValueError, r"^scale must be a finite")),
        (
            "dcp_gqa_decode-seq-lens-negative",
            _dcp_gqa(seq_lens=torch.tensor([-1, 3], dtype=torch.int32)),
            Raises(ValueError, r"^seq_lens must be >= 0"),
        ),
        (
            "dcp_gqa_decode-seq-lens-past-table",
            _dcp_gqa(seq_lens=torch.tensor([40, 3], dtype=torch.int32)),
            Raises(ValueError, r"^seq_lens\[0\]=40 puts 40 tokens on rank 0"),
        ),
        (  # regression: the query past the keys ran silently (a local length of 0: out 0, lse -inf)
            "dcp_gqa_decode-more-queries-than-keys-uniform",
            _dcp_gqa(q_heads_local=torch.randn(4, 4, 16), q_len_per_req=2, seq_lens=torch.tensor([1, 5]).int()),
            Raises(ValueError, r"^requests \[0\] have more queries than keys \(seq_lens counts the drafts\)"),
        ),
        (
            "dcp_gqa_decode-more-queries-than-keys-ragged",
            _dcp_gqa(cu_q_lens=torch.tensor([0, 1, 2]).int(), seq_lens=torch.tensor([9, 0]).int()),
            Gives(lambda res: None if bool(res[1][1].isneginf().all()) else "padded request 1 is not (0, -inf)"),
        ),
        (
            "dcp_gqa_decode-more-queries-than-keys-ragged-drafts",
            _dcp_gqa(cu_q_lens=torch.tensor([0, 0, 2]).int(), seq_lens=torch.tensor([9, 1]).int()),
            Raises(ValueError, r"^requests \[1\] have more queries than keys \(seq_lens counts the drafts\)"),
        ),
        ("dcp_gqa_decode-q-len-0", _dcp_gqa(q_len_per_req=0), Raises(ValueError, r"^q_len_per_req must be >= 1")),
        ("dcp_gqa_decode-padded-requests", _dcp_gqa(seq_lens=torch.zeros(2, dtype=torch.int32)), Gives(all_empty(16))),
        # PCP
        (
            "pcp_prefill-plan-for-2-ranks",
            _pcp(plan=P.pcp_plan([2, 3], 2)),
            Raises(ValueError, r"^plan is for world_size=2"),
        ),
        ("pcp_prefill-q-wrong-width", _pcp(q=torch.randn(5, 2, 40)), Raises(ValueError, r"^q must have last dim 48")),
        (
            "pcp_prefill-kv-new-a-list",
            _pcp(kv_new=lambda a: a["kv_new"].tolist()),
            Raises(TypeError, r"^kv_new must be a torch.Tensor, got list"),
        ),
        (
            "pcp_prefill-kv-new-rows",
            _pcp(kv_new=lambda a: a["kv_new"][:4]),
            Raises(ValueError, r"^kv_new must hold one row per token"),
        ),
        ("pcp_prefill-scale-nan", _pcp(scale=NAN), Raises(ValueError, r"^scale must be a finite")),
        (
            "pcp_prefill-cache-without-table",
            _pcp(kv_cache=torch.randn(8, 48)),
            Raises(ValueError, r"^kv_cache, block_table and block_size go together"),
        ),
        (
            "pcp_prefill-prefix-without-cache",
            _pcp(plan=P.pcp_plan([2, 3], 1, prefix_lens=[4, 0])),
            Raises(ValueError, r"cached prefixes .* pass kv_cache"),
        ),
        (
            "pcp_prefill-cache-without-rows",
            _pcp(
                plan=P.pcp_plan([2, 3], 1, prefix_lens=[0, 0]),
                kv_cache=torch.randn(0, 48),
                block_table=torch.full((2, 1), -1, dtype=torch.int32),
                block_size=4,
                topk_pos=torch.full((5, 3), 7, dtype=torch.int32),  # every position past its request
            ),
            Gives(all_empty(32)),
        ),
        # collector
        (
            "collect_partials-lse-fp16",
            _collect(lse=lambda a: a["lse"].half()),
            Raises(TypeError, r"^lse must have dtype"),
        ),
        ("collect_partials-out-2d", _collect(out=lambda a: a["out"][0]), Raises(ValueError, r"^out must have 3 dim")),
        (
            "collect_partials-scatter-heads-str",
            _collect(scatter_heads="no"),
            Raises(TypeError, r"^scatter_heads must be a bool"),
        ),
        ("collect_partials-check-str", _collect(check="no"), Raises(TypeError, r"^check must be a bool")),
        ("collect_partials-buffers-list", _collect(buffers=[]), Raises(TypeError, r"^buffers must be a dict")),
        ("collect_partials-lse-on-meta", _collect(lse=lambda a: a["lse"].to(META)), Raises(ValueError, r"lse differs")),
        ("collect_partials-strategy", _collect(strategy="tree"), Raises(ValueError, r"^strategy must be one of")),
        (
            "collect_partials-all-to-all-all-heads",
            _collect(strategy="all_to_all", scatter_heads=False),
            Raises(ValueError, r"^strategy='all_to_all' leaves each rank with its head slice"),
        ),
        # Runtime
        ("Runtime-mode", _runtime_new(mode="ring"), Raises(ValueError, r"^mode must be one of")),
        ("Runtime-spec-int", _runtime_new(spec=3), Raises(TypeError, r"^spec must be a ModelSpec")),
        (
            "Runtime-spec-unknown-preset",
            _runtime_new(spec="llama"),
            Raises(ValueError, r"unknown model preset 'llama'"),
        ),
        (
            "Runtime-max-batched-tokens-0",
            _runtime_new(max_batched_tokens=0),
            Raises(ValueError, r"^max_batched_tokens must be >= 1"),
        ),
        (
            "DecodeOptions-dcp-interleave-0",
            _options("DecodeOptions", dcp_interleave=0),
            Raises(ValueError, r"^DecodeOptions\.dcp_interleave must be >= 1"),
        ),
        (
            "DecodeOptions-causal-str",
            _options("DecodeOptions", causal="yes"),
            Raises(TypeError, r"^DecodeOptions\.causal must be a bool"),
        ),
        (
            "PrefillOptions-min-shard-tokens-negative",
            _options("PrefillOptions", min_shard_tokens=-1),
            Raises(ValueError, r"^PrefillOptions\.min_shard_tokens must be >= 0"),
        ),
        (
            "PrefillOptions-cost-model-int",
            _options("PrefillOptions", cost_model=3),
            Raises(TypeError, r"^PrefillOptions\.cost_model must be a CostModel"),
        ),
        (
            "Runtime-decode-options-a-dict",
            _runtime_new(decode_options={"dcp_interleave": 2}),
            Raises(TypeError, r"^decode_options must be a DecodeOptions"),
        ),
        ("Runtime-topk-0", _runtime_new(topk=0), Raises(ValueError, r"^topk must be >= 1")),
        ("Runtime-device-unknown", _runtime_new(device="gpu0"), Raises(ValueError, r"^device must be a torch.device")),
        (
            "Runtime-workspace-past-memory",
            _runtime_new(topk=2**40),
            Raises(MemoryError, r"^the Runtime's workspace needs [\d,]+ bytes on cpu .*topk=1099511627776"),
        ),
        (
            "Runtime-gqa-shardq",
            _runtime_new(spec=GQA_SPEC),
            Raises(ValueError, r"mode 'shardq' runs a sparse-MLA prefill"),
        ),
        (
            "Runtime.prefill-q-a-list",
            _runtime_step("prefill", MLA_SPEC, "shardq", q=[[0.0]]),
            Raises(TypeError, r"^q must be a torch.Tensor"),
        ),
        (
            "Runtime.decode-q-a-list",
            _runtime_step("decode", MLA_SPEC, "mixed", q=[[0.0]]),
            Raises(TypeError, r"^q must be a torch.Tensor"),
        ),
        (
            "Runtime.prefill-check-an-int",
            _runtime_step("prefill", MLA_SPEC, "shardq", check=1),
            Raises(TypeError, r"^check must be a bool, got int"),
        ),
        (
            "Runtime.decode-check-an-int",
            _runtime_step("decode", MLA_SPEC, "mixed", check=1),
            Raises(TypeError, r"^check must be a bool, got int"),
        ),
        (
            "Runtime.prefill-no-query-lens",
            _runtime_step("prefill", MLA_SPEC, "shardq", query_lens=None),
            Raises(ValueError, r"prefill needs query_lens"),
        ),
        (
            "Runtime.prefill-plan-not-a-plan",
            _runtime_step("prefill", MLA_SPEC, "shardq", plan="x"),
            Raises(TypeError, r"^plan must be a PrefillPlan"),
        ),
        (
            "Runtime.prefill-rows-float",
            _runtime_step("prefill", MLA_SPEC, "shardq", rows=lambda a: a["rows"].float()),
            Raises(TypeError, r"^rows must have dtype"),
        ),
        (
            "Runtime.prefill-rows-int64-past-int32",
            _runtime_step("prefill", MLA_SPEC, "shardq", rows=lambda a: a["rows"].long() + 2**40),
            Raises(ValueError, r"^rows must fit int32"),
        ),
        (
            "Runtime.prefill-query-lens-past-q",
            _runtime_step("prefill", MLA_SPEC, "shardq", query_lens=[2, 8]),
            Raises(ValueError, r"^q holds 5 tokens, but query_lens sums to 10"),
        ),
        (
            "Runtime.prefill-seq-lens-below-query-lens",
            _runtime_step("prefill", MLA_SPEC, "shardq", seq_lens=[1, 3]),
            Raises(ValueError, r"^seq_lens\[0\] = 1 is less than query_lens\[0\] = 2"),
        ),
        (
            "Runtime.prefill-prefix-and-seq-lens-disagree",
            _runtime_step("prefill", MLA_SPEC, "shardq", seq_lens=[2, 4], prefix_lens=[0, 0]),
            Raises(ValueError, r"^prefix_lens and seq_lens disagree"),
        ),
        (
            "Runtime.prefill-headtp-every-head",
            _runtime_step("prefill", MLA_SPEC, "headtp", q=torch.randn(5, 16, 48)),
            Raises(ValueError, r"^q must hold this rank's 8 heads"),
        ),
        (
            "Runtime.prefill-topk-pos-outside-pcp",
            _runtime_step("prefill", MLA_SPEC, "shardq", topk_pos=lambda a: a["rows"]),
            Raises(ValueError, r"^topk_pos is PCP's"),
        ),
        *(
            (
                f"Runtime.prefill-{mode}-block-table",
                _runtime_step("prefill", MLA_SPEC, mode, block_table=torch.zeros(2, 1, dtype=torch.int32)),
                Raises(ValueError, r"^block_table is PCP's \(the pages of the cached prefixes\); a \w+ step reads"),
            )
            for mode in ("shardq", "headtp")
        ),
        (
            "Runtime.prefill-pcp-rows",
            _runtime_step("prefill", MLA_SPEC, "pcp", kv_new=torch.randn(5, 48)),
            Raises(ValueError, r"^rows are global KV rows"),
        ),
        (
            "Runtime.prefill-q-wrong-width",
            _runtime_step("prefill", MLA_SPEC, "shardq", q=torch.randn(5, 8, 40)),
            Raises(ValueError, r"^q must have last dim 48"),
        ),
        (
            "Runtime.prefill-pcp-q-wrong-width",
            _runtime_step(
                "prefill",
                MLA_SPEC,
                "pcp",
                q=torch.randn(5, 8, 40),
                topk_pos=lambda a: a["rows"],
                rows=None,
                kv_new=torch.randn(5, 48),
            ),
            Raises(ValueError, r"^q must have last dim 48"),
        ),
        (
            "Runtime.prefill-tokens-past-workspace",
            _runtime_step("prefill", MLA_SPEC, "shardq", query_lens=[40, 40]),
            Raises(ValueError, r"workspace"),
        ),
        (
            "Runtime.decode-no-topk",
            _runtime_step("decode", MLA_SPEC, "headtp", topk_pos=None),
            Raises(ValueError, r"sparse-MLA decode needs topk_pos"),
        ),
        (
            "Runtime.decode-topk-unique-not-a-bool",
            _runtime_step("decode", MLA_SPEC, "headtp", topk_unique=1),
            Raises(TypeError, r"^topk_unique must be a bool"),
        ),
        (
            "Runtime.decode-kv-pair-for-mla",
            _runtime_step("decode", MLA_SPEC, "headtp", kv_cache=lambda a: (a["kv_cache"], a["kv_cache"])),
            Raises(TypeError, r"^kv_cache of a sparse-MLA model"),
        ),
        (
            "Runtime.decode-dcp-q-wrong-width",
            _runtime_step("decode", MLA_SPEC, "mixed", q=torch.randn(2, 8, 40)),
            Raises(ValueError, r"^q must have last dim 48"),
        ),
        (
            "Runtime.decode-dcp-table-float",
            _runtime_step("decode", MLA_SPEC, "mixed", block_table=lambda a: a["block_table"].float()),
            Raises(TypeError, r"^block_table must have dtype"),
        ),
        (  # its dtype is the one checked first, by name (not through the cache's dtype)
            "Runtime.decode-q-float64",
            _runtime_step("decode", MLA_SPEC, "mixed", q=torch.randn(2, 8, 48, dtype=torch.float64)),
            Raises(TypeError, r"^q must have dtype in \(float16, bfloat16, float32\), got float64"),
        ),
        (
            "Runtime.decode-gqa-q-float64",
            _runtime_step("decode", GQA_SPEC, "headtp", q=lambda a: a["q"].double()),
            Raises(TypeError, r"^q must have dtype in \(float16, bfloat16, float32\), got float64"),
        ),
        (  # a table of no column holds no token: not a silently empty step
            "Runtime.decode-dcp-table-without-columns",
            _runtime_step("decode", MLA_SPEC, "mixed", block_table=torch.empty(2, 0, dtype=torch.int32)),
            Raises(ValueError, r"^seq_lens\[0\]=10 puts 10 tokens on rank 0, but its block_table holds 0 blocks"),
        ),
        (
            "Runtime.decode-headtp-every-head",
            _runtime_step("decode", MLA_SPEC, "headtp", q=torch.randn(2, 16, 48)),
            Raises(ValueError, r"^q must hold this rank's 8 heads"),
        ),
        (
            "Runtime.decode-window-under-dcp",
            _runtime_step("decode", GQA_SPEC, "dcp-decode", window_left=4),
            Raises(ValueError, r"^window_left=4: sliding windows are supported by head-TP GQA decode only"),
        ),
        (
            "Runtime.decode-window-sparse-mla",
            _runtime_step("decode", MLA_SPEC, "headtp", window_left=4),
            Raises(ValueError, r"^window_left=4: sliding windows"),
        ),
        (
            "Runtime.decode-seq-lens-int64-past-int32",
            _runtime_step("decode", MLA_SPEC, "headtp", seq_lens=torch.tensor([10, 2**33])),
            Raises(ValueError, r"^seq_lens must fit int32"),
        ),
        (
            "Runtime.decode-mla-seq-lens-negative",
            _runtime_step("decode", MLA_SPEC, "headtp", seq_lens=[10, -2]),
            Raises(ValueError, r"^seq_lens must be >= 0, got -2 \(request 1\)"),
        ),
        (
            "Runtime.prefill-kv-cache-a-list",
            _runtime_step("prefill", MLA_SPEC, "headtp", kv_cache=lambda a: a["kv_cache"].tolist()),
            Raises(TypeError, r"^kv_cache must be a torch.Tensor, got list"),
        ),
        (
            "Runtime.decode-headtp-kv-without-rows",  # its table names pages the cache lacks (as DCP)
            _runtime_step("decode", MLA_SPEC, "headtp", kv_cache=torch.randn(0, 48)),
            Raises(ValueError, r"^block_table points past kv_cache: block 3 needs rows up to 64, kv_cache has 0"),
        ),
        (
            "Runtime.decode-gqa-kv-not-a-pair",
            _runtime_step("decode", GQA_SPEC, "dcp-decode", kv_cache=lambda a: a["kv_cache"][0]),
            Raises(TypeError, r"^kv_cache of a GQA model must be a \(k_cache, v_cache\) pair"),
        ),
        (
            "Runtime.decode-gqa-seq-lens-negative",
            _runtime_step("decode", GQA_SPEC, "dcp-decode", seq_lens=torch.tensor([-1, 3], dtype=torch.int32)),
            Raises(ValueError, r"^seq_lens must be >= 0"),
        ),
        (
            "Runtime.decode-gqa-headtp-kv-other-heads",
            _runtime_step("decode", GQA_SPEC, "headtp", kv_cache=lambda a: tuple(c[:, :, :1] for c in a["kv_cache"])),
            Raises(ValueError, r"^kv_cache\[0\] must have shape \[pages, 4, 2, 16\] \(this rank's 2 KV head"),
        ),
        (
            "Runtime.decode-gqa-dcp-kv-other-heads",
            _runtime_step(
                "decode", GQA_SPEC, "dcp-decode", kv_cache=lambda a: tuple(c[:, :, :1] for c in a["kv_cache"])
            ),
            Raises(ValueError, r"^kv_cache\[0\] must have shape \[pages, 4, 2, 16\] \(all 2 KV heads under DCP"),
        ),
        (
            "Runtime.decode-gqa-kv-other-pages",
            _runtime_step(
                "decode", GQA_SPEC, "headtp", kv_cache=lambda a: tuple(c.view(-1, 2, 2, 16) for c in a["kv_cache"])
            ),
            Raises(ValueError, r"^kv_cache\[0\] must hold pages of 4 tokens \(the model's page_size"),
        ),
        (
            "Runtime.decode-gqa-topk-pos",
            _runtime_step("decode", GQA_SPEC, "headtp", topk_pos=torch.zeros(2, 4, dtype=torch.int32)),
            Raises(ValueError, r"^topk_pos is sparse MLA's; a GQA decode attends every earlier token"),
        ),
        (
            "Runtime.decode-headtp-sinks-of-the-rank",
            _runtime_step("decode", MLA_SINKS_SPEC, "headtp", sinks=torch.zeros(4)),
            Raises(ValueError, r"^sinks must have shape \[8\]"),
        ),
        (
            "Runtime.decode-gqa-dcp-more-queries-than-keys",
            _runtime_step("decode", GQA_SPEC, "dcp-decode", q=torch.randn(4, 8, 16), q_len_per_req=2, seq_lens=[1, 5]),
            Raises(ValueError, r"^requests \[0\] have more queries than keys \(seq_lens counts the drafts\)"),
        ),
        (
            "Runtime.decode-gqa-headtp-more-queries-than-keys",
            _runtime_step("decode", GQA_SPEC, "headtp", q=torch.randn(4, 8, 16), q_len_per_req=2, seq_lens=[5, 1]),
            Raises(ValueError, r"^requests \[1\] have more queries than keys \(seq_lens counts the drafts\)"),
        ),
        # on a device the step moves host lists to q's device, where the op reads no values: the
        # Runtime checks them first (meta tensors stand in for a GPU's)
        (  # regression: the query past the keys ran silently, (0, -inf)
            "Runtime.decode-gqa-headtp-on-device-more-queries-than-keys",
            _on_meta(
                _runtime_step("decode", GQA_SPEC, "headtp", q=torch.randn(4, 8, 16), q_len_per_req=2, seq_lens=[5, 1])
            ),
            Raises(ValueError, r"^requests \[1\] have more queries than keys \(seq_lens counts the drafts\)"),
        ),
        (
            "Runtime.decode-gqa-headtp-on-device-more-queries-than-keys-ragged",
            _on_meta(_runtime_step("decode", GQA_SPEC, "headtp", seq_lens=[9, 1], cu_q_lens=[0, 0, 2])),
            Raises(ValueError, r"^requests \[1\] have more queries than keys \(seq_lens counts the drafts\)"),
        ),
        (
            "Runtime.decode-gqa-headtp-on-device-cu-q-lens-decreasing",
            _on_meta(_runtime_step("decode", GQA_SPEC, "headtp", cu_q_lens=[0, 2, 1])),
            Raises(ValueError, r"^cu_q_lens must start at 0, not decrease and end <= "),
        ),
        (
            "Runtime.decode-gqa-dcp-on-device-cu-q-lens-past-q",
            _on_meta(_runtime_step("decode", GQA_SPEC, "dcp-decode", cu_q_lens=[0, 1, 99])),
            Raises(ValueError, r"^cu_q_lens must start at 0, not decrease and end <= "),
        ),
        (  # regression: the Triton kernel left the queries past max_q_len at (0, -inf)
            "Runtime.decode-gqa-headtp-on-device-max-q-len-below-longest-draft",
            _on_meta(_runtime_step("decode", GQA_SPEC, "headtp", max_q_len=1, cu_q_lens=[0, 2, 2])),
            Raises(ValueError, r"^max_q_len must be >= 2 \(the most queries of a request in cu_q_lens\), got 1"),
        ),
        (  # the Runtime's host check passes what the op passes: a padded request (0 keys) with drafts
            "Runtime.decode-gqa-headtp-padded-request-with-drafts",
            _runtime_step("decode", GQA_SPEC, "headtp", max_q_len=2, seq_lens=[0, 5], cu_q_lens=[0, 2, 2]),
            Gives(lambda res: None if bool(res[1].isneginf().all()) else "padded request 0 is not (0, -inf)"),
        ),
        (  # regression: under DCP too (a local length of 0: out 0, lse -inf)
            "Runtime.decode-gqa-dcp-on-device-more-queries-than-keys",
            _on_meta(
                _runtime_step(
                    "decode", GQA_SPEC, "dcp-decode", q=torch.randn(4, 8, 16), q_len_per_req=2, seq_lens=[1, 5]
                )
            ),
            Raises(ValueError, r"^requests \[0\] have more queries than keys \(seq_lens counts the drafts\)"),
        ),
        (
            "Runtime.decode-gqa-dcp-on-device-more-queries-than-keys-ragged",
            _on_meta(_runtime_step("decode", GQA_SPEC, "dcp-decode", seq_lens=[1, 5], cu_q_lens=[0, 2, 2])),
            Raises(ValueError, r"^requests \[0\] have more queries than keys \(seq_lens counts the drafts\)"),
        ),
        (
            "Runtime.decode-gqa-headtp-q-len-0",
            _runtime_step("decode", GQA_SPEC, "headtp", q_len_per_req=0),
            Raises(ValueError, r"^q_len_per_req must be >= 1"),
        ),
    ]
    return [Row(rid, build, expect, dist=True) for rid, build, expect in rows]
