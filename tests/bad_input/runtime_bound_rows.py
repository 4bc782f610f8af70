"""Rows of the bad-input table for the Runtime's arguments bound to one kind, mode or Runtime: a
DCP GQA plan (``batch=``) against the lengths passed beside it, arguments of another kind's or
mode's decode, a prefill plan of another Runtime; and errors named as the caller passed the
arguments, not as a step inside names them (tests/test_bad_input.py; a one-rank gloo group)."""

from __future__ import annotations

from typing import Any

import torch

from shardattn import plan as P
from tests.bad_input.parallel_rows import GQA_SPEC, MLA_SPEC, _runtime_step
from tests.bad_input.table import Call, Raises, Row, override


def _plan_of(spec: P.ModelSpec, mode: str) -> Any:
    """A prefill plan of another Runtime (``spec`` in ``mode``) on the row's group, for
    :func:`_runtime_step`'s prefill (2 requests of 2 and 3 tokens)."""

    def build(group: Any) -> Call:
        from shardattn.runtime.runtime import Runtime

        plan = Runtime(spec, group, max_batched_tokens=64, mode=mode, warmup=False).plan_prefill([2, 3])
        call = _runtime_step("prefill", MLA_SPEC, "shardq", plan=plan)(group)
        call.kwargs.pop("query_lens", None)
        return call

    return build


def _pcp_prefill(prefix_lens: list[int], *, kv_dtype: str | None = None, **over: Any) -> Any:
    """``Runtime.prefill`` in mode ``pcp`` (2 requests of 2 and 3 new tokens after ``prefix_lens``
    cached ones; a Runtime of ``kv_dtype``) on small valid inputs, with ``over`` replacing some."""

    def build(group: Any) -> Call:
        from shardattn.runtime.runtime import Runtime

        rt = Runtime(MLA_SPEC, group, max_batched_tokens=64, mode="pcp", warmup=False, kv_dtype=kv_dtype)
        rt.comm.reset_counts()
        plan = rt.plan_prefill([2, 3], prefix_lens=prefix_lens)
        g = torch.Generator().manual_seed(3)
        args = {"q": torch.randn(5, 8, 48, generator=g), "kv_cache": torch.randn(64, 48, generator=g)}
        kw: dict[str, Any] = {
            "topk_pos": torch.randint(0, 6, (5, 16), generator=g, dtype=torch.int32),
            "kv_new": torch.randn(5, 48, generator=g),
            "block_table": torch.tensor([[0], [1]], dtype=torch.int32),
            "plan": plan,
        }
        override(args, kw, over, args)
        return Call(rt.prefill, tuple(args.values()), kw, rt.comm)

    return build


def runtime_bound_rows() -> list[Row]:
    """Rows of ``Runtime.decode`` (the GQA inputs: 2 requests of 9 and 5 tokens, one query each)
    and ``Runtime.prefill``."""
    dcp, headtp = ("decode", GQA_SPEC, "dcp-decode"), ("decode", GQA_SPEC, "headtp")
    rows = [
        # the plan's lengths replace the ones passed: a plan of other lengths would give wrong rows
        ("Runtime.decode-gqa-batch-of-other-seq-lens", _runtime_step(*dcp, decode_plan=([7, 5],)),
         Raises(ValueError, r"^seq_lens must be the lengths batch was planned for: got \[9, 5\], batch has \[7, 5\]")),
        ("Runtime.decode-gqa-batch-of-other-queries", _runtime_step(*dcp, decode_plan=([9, 5],), cu_q_lens=[0, 0, 2]),
         Raises(ValueError, r"^cu_q_lens must be the query offsets batch was planned for")),
        ("Runtime.decode-gqa-batch-and-other-q-len", _runtime_step(*dcp, decode_plan=([9, 5],), q_len_per_req=2),
         Raises(ValueError, r"^q_len_per_req=2 is not the plan's")),
        ("Runtime.decode-gqa-batch-not-a-plan", _runtime_step(*dcp, batch="junk"),
         Raises(TypeError, r"^batch must be a DecodeBatch from plan\(\), got str")),
        ("Runtime.decode-gqa-batch-and-meta",
         _runtime_step(*dcp, decode_plan=([9, 5],), meta=lambda a: (a["seq_lens"], None)),
         Raises(ValueError, r"^pass batch \(a host plan\) or meta")),
        ("Runtime.decode-gqa-headtp-batch", _runtime_step(*headtp, decode_plan=([9, 5],)),
         Raises(ValueError, r"^batch is a DCP decode's plan; a head-TP step plans nothing")),
        ("Runtime.decode-gqa-headtp-meta", _runtime_step(*headtp, meta=lambda a: (a["seq_lens"], None)),
         Raises(ValueError, r"^meta is a DCP decode's plan")),
        # GQA-only arguments on a sparse-MLA decode were ignored
        *(
            (f"Runtime.decode-mla-{mode}-{name}", _runtime_step("decode", MLA_SPEC, mode, **{name: value}),
             Raises(ValueError, rf"^{name} is GQA decode's; a sparse-MLA step reads topk_pos"))
            for mode in ("headtp", "mixed")
            for name, value in (("cu_q_lens", [0, 1, 2]), ("q_len_per_req", 1), ("max_q_len", 1), ("batch", "junk"))
        ),
        # topk_unique is a promise about a sparse-MLA top-k: a GQA step ignored it
        *(
            (f"Runtime.{step}-gqa-{mode}-topk-unique", _runtime_step(step, GQA_SPEC, mode, topk_unique=True),
             Raises(ValueError, r"^topk_unique=True: a gqa step reads no top-k"))
            for step, mode in (("decode", "dcp-decode"), ("decode", "headtp"), ("prefill", "headtp"))
        ),
        # named as the caller passed them (the DCP step's q_heads_local; req_ids blamed for topk_pos)
        ("Runtime.decode-gqa-dcp-uniform-drafts-past-q", _runtime_step(*dcp, q_len_per_req=2),
         Raises(ValueError, r"^q must have batch \* q_len_per_req = 2 \* 2 = 4 rows, got 2")),
        ("Runtime.decode-mla-headtp-topk-pos-past-q",
         _runtime_step("decode", MLA_SPEC, "headtp", topk_pos=torch.zeros(3, 4, dtype=torch.int32)),
         Raises(ValueError, r"^topk_pos must have one row per query \(2\), got shape \[3, 4\]")),
        # a KV cache (or PCP's new rows) of another width than the model's blamed q, or an inner name
        *(
            (f"Runtime.decode-mla-{mode}-kv-cache-wrong-width",
             _runtime_step("decode", MLA_SPEC, mode, kv_cache=torch.zeros(64, 40)),
             Raises(ValueError, r"^kv_cache must have last dim 48 \(the model's head_dim\), got shape \[64, 40\]"))
            for mode in ("headtp", "mixed")
        ),
        ("Runtime.prefill-pcp-kv-new-wrong-width", _pcp_prefill([0, 0], kv_new=torch.zeros(5, 40)),
         Raises(ValueError, r"^kv_new must have last dim 48 \(the model's head_dim\), got shape \[5, 40\]")),
        # so with the rows' format declared (kv_dtype), which the rows' width was not checked against
        ("Runtime.prefill-pcp-declared-kv-new-wrong-width",
         _pcp_prefill([0, 0], kv_dtype="float32", kv_new=torch.zeros(5, 40)),
         Raises(ValueError, r"^kv_new must have last dim 48 \(the model's head_dim\), got shape \[5, 40\]")),
        ("Runtime.prefill-pcp-declared-kv-cache-wrong-width",
         _pcp_prefill([4, 1], kv_dtype="float32", kv_cache=torch.zeros(4, 16, 40)),
         Raises(ValueError, r"^kv_cache must have last dim 48 \(the model's head_dim\), got shape \[4, 16, 40\]")),
        *(
            (f"Runtime.prefill-{mode}-declared-kv-cache-wrong-width",
             _runtime_step("prefill", MLA_SPEC, mode, kv_dtype="float32", kv_cache=torch.zeros(64, 40)),
             Raises(ValueError, r"^kv_cache must have last dim 48 \(the model's head_dim\), got shape \[64, 40\]"))
            for mode in ("shardq", "headtp")
        ),
        # PCP's cache arguments named as Runtime.prefill takes them (it has no block_size)
        ("Runtime.prefill-pcp-kv-cache-without-block-table", _pcp_prefill([4, 1], block_table=None),
         Raises(ValueError, r"^kv_cache and block_table go together")),
        ("Runtime.prefill-pcp-block-table-without-kv-cache", _pcp_prefill([4, 1], kv_cache=None),
         Raises(ValueError, r"^kv_cache and block_table go together")),
        ("Runtime.prefill-pcp-prefix-without-cache", _pcp_prefill([4, 1], kv_cache=None, block_table=None),
         Raises(ValueError, r"^the plan has cached prefixes \(prefix_lens=\[4, 1\]\): pass kv_cache and block_table ")),
        # a request longer than its table: its top-k positions past the table were dropped (DCP raised)
        ("Runtime.decode-mla-headtp-seq-lens-past-table",
         _runtime_step("decode", MLA_SPEC, "headtp", seq_lens=torch.tensor([10, 49], dtype=torch.int32)),
         Raises(ValueError, r"^seq_lens\[1\]=49 needs 49 tokens, but its block_table holds 3 blocks of 16")),
        # a plan of another Runtime's configuration: a misleading error, or a workspace of 0 B
        ("Runtime.prefill-plan-of-another-mode", _plan_of(MLA_SPEC, "headtp"),
         Raises(ValueError, r"^plan was made by a Runtime for a sparse_mla model of 8 heads, mode 'headtp'")),
        ("Runtime.prefill-plan-of-another-kind", _plan_of(GQA_SPEC, "headtp"),
         Raises(ValueError, r"^plan was made by a Runtime for a gqa model of 8 heads")),
    ]  # fmt: skip
    return [Row(rid, build, expect, dist=True) for rid, build, expect in rows]
