"""Property tests: every step a Runtime's workspace accepts fits the buffers the parallel steps view.

A :class:`~shardattn.runtime.workspace.RuntimeWorkspace` (on the ``meta`` device: bytes counted,
none allocated) is built for a random model, world size, mode and limits; random steps within those
limits are planned as the Runtime plans them, and each one that :meth:`RuntimeWorkspace.check`
accepts must pass the step's own workspace check (ShardQ's pipelined receive / send buffers and
rank rows at every chunking, the DCP decode step's buffers) on the views reserved for it.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardattn.parallel.dcp import check_dcp_workspace
from shardattn.parallel.shardq_pipeline import check_pipeline_workspace
from shardattn.plan.pipeline import MAX_CHUNKS, pipeline_plan
from shardattn.plan.spec import ModelSpec
from shardattn.plan.workspace import workspace_bounds
from shardattn.plan.zigzag import zigzag_split
from shardattn.runtime.modes import DECODE_STEP, prefill_step_of
from shardattn.runtime.workspace import RuntimeWorkspace, WorkspaceExceededError

META = torch.device("meta")
_DCP_KEYS = (("q", "packed_q"), ("rows", "topk_rows"), ("out", "out"), ("lse", "lse"), ("send", "send"),
             ("recv", "recv"))  # fmt: skip


@st.composite
def configs(draw):
    kind = draw(st.sampled_from(["sparse_mla", "gqa"]))
    w = draw(st.integers(1, 8))
    heads = w * draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    dtype = draw(st.sampled_from(["bfloat16", "float16", "float32"]))
    if kind == "sparse_mla":
        d, dv = draw(st.sampled_from([(576, 512), (48, 32), (48, 16)]))  # queries staged past Dv
        spec = ModelSpec(kind, heads, 1, d, dv, draw(st.integers(1, 64)), 16, dtype=dtype, softmax_scale=0.1)
    else:
        kv = draw(st.sampled_from([h for h in (1, 2, 4, 8) if heads % h == 0]))
        d = draw(st.sampled_from([16, 64]))
        spec = ModelSpec(kind, heads, kv, d, d, 0, 16, dtype=dtype)
    modes = ["headtp", "pcp", "dcp-decode", "mixed"] + (["shardq"] if kind == "sparse_mla" else [])
    mode = draw(st.sampled_from(modes))
    kv_dtype = "fp8_ds_mla" if kind == "sparse_mla" and (d, dv) == (576, 512) and draw(st.booleans()) else None
    return dict(
        spec=spec, mode=mode, world_size=w, max_batched_tokens=draw(st.integers(1, 300)),
        max_decode_tokens=draw(st.integers(1, 64)), min_shard_tokens=draw(st.sampled_from([0, 1, 16, 64, 1000])),
        topk=max(spec.topk, 1), cost_routed=draw(st.booleans()), kv_dtype=kv_dtype,
    )  # fmt: skip


def _workspace(cfg: dict) -> RuntimeWorkspace:
    return RuntimeWorkspace(
        cfg["spec"], cfg["mode"], cfg["world_size"], device=META, max_batched_tokens=cfg["max_batched_tokens"],
        max_decode_tokens=cfg["max_decode_tokens"], min_shard_tokens=cfg["min_shard_tokens"], topk=cfg["topk"],
        headtp_tokens=cfg["max_batched_tokens"] if cfg["cost_routed"] else None, kv_dtype=cfg["kv_dtype"],
    )  # fmt: skip


def _lengths(data, total: int) -> list[int]:
    """Ragged request lengths summing to at most ``total`` (zeros included)."""
    lens = data.draw(st.lists(st.integers(0, total), min_size=1, max_size=6))
    out, left = [], total
    for n in lens:
        out.append(min(n, left))
        left -= out[-1]
    return out


@settings(max_examples=60, deadline=None, derandomize=True)
@given(cfg=configs(), data=st.data())
def test_every_accepted_prefill_step_fits_its_reserved_buffers(cfg, data) -> None:
    ws = _workspace(cfg)
    spec, w = cfg["spec"], cfg["world_size"]
    step = prefill_step_of(spec.kind, cfg["mode"])
    if step is None:
        return
    for i in range(4):  # the largest step first (whose one-chunk staging is the largest), then ragged ones
        lens = [cfg["max_batched_tokens"]] if i == 0 else _lengths(data, cfg["max_batched_tokens"])
        tokens = sum(lens)
        topk = data.draw(st.integers(0, cfg["topk"])) if spec.kind == "sparse_mla" else None
        planned = "headtp" if step == "shardq" and not ws.shardq_possible else step
        shard = None
        if planned == "shardq":  # as Runtime.plan_prefill splits it
            shard = zigzag_split(lens, w, min_tokens=cfg["min_shard_tokens"])
            if not shard.sharded or (cfg["cost_routed"] and data.draw(st.booleans())):
                planned, shard = "headtp", None
        ws.check("prefill", planned, tokens=tokens, topk=topk)  # within the limits: accepted
        if shard is None:
            continue
        views = {k.split(".", 1)[1]: v for k, v in ws.step_buffers("prefill", "shardq").items()}
        buffers = {"q": views["packed_q"], "out": views["out"], "lse": views["lse"], "rows": views["topk_rows"]}
        q = torch.empty(tokens, spec.num_heads // w, spec.head_dim, dtype=getattr(torch, spec.dtype), device=META)
        pipe = pipeline_plan(
            shard, data.draw(st.integers(1, MAX_CHUNKS)), align=data.draw(st.sampled_from([1, 2, 4, 8])),
            taper=data.draw(st.booleans()),
        )  # fmt: skip
        for rank in range(w):  # every rank's share, at any chunking the step may take
            check_pipeline_workspace(buffers, pipe, rank, q, spec.v_dim, topk, True)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(cfg=configs(), data=st.data())
def test_every_accepted_decode_step_fits_its_reserved_buffers(cfg, data) -> None:
    ws = _workspace(cfg)
    spec, w = cfg["spec"], cfg["world_size"]
    step = DECODE_STEP[cfg["mode"]]
    for _ in range(3):
        t = data.draw(st.integers(0, cfg["max_decode_tokens"]))
        k = data.draw(st.integers(1, cfg["topk"])) if spec.kind == "sparse_mla" else 0
        ws.check("decode", step, tokens=t, topk=k if k else None)
        views = ws.step_buffers("decode", step)
        if step != "dcp":  # head-TP decode: the converted rows alone
            assert views.get("decode.topk_rows", torch.empty(0)).numel() >= (t * k * 4)
            continue
        buffers = {key: views[f"decode.{item}"] for key, item in _DCP_KEYS if f"decode.{item}" in views}
        q = torch.empty(t, spec.num_heads // w, spec.head_dim, dtype=getattr(torch, spec.dtype), device=META)
        v_dim = spec.v_dim  # the GQA step's outputs are head_dim wide: a GQA spec's v_dim is its head_dim
        check_dcp_workspace(buffers, q, w, v_dim, k, "all_to_all" if w > 1 else "all_gather", True)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(cfg=configs(), extra=st.integers(1, 64))
def test_a_step_past_the_limits_is_refused_up_front(cfg, extra) -> None:
    ws = _workspace(cfg)
    spec = cfg["spec"]
    step = prefill_step_of(spec.kind, cfg["mode"])
    if step is not None:
        step = "headtp" if step == "shardq" and not ws.shardq_possible else step
        with pytest.raises(WorkspaceExceededError, match="max_batched_tokens"):
            ws.check("prefill", step, tokens=cfg["max_batched_tokens"] + extra)
        if spec.kind == "sparse_mla":  # every sparse step carves a union sized by the top-k
            with pytest.raises(WorkspaceExceededError, match="top-k"):
                ws.check("prefill", step, tokens=cfg["max_batched_tokens"], topk=cfg["topk"] + extra)
    with pytest.raises(WorkspaceExceededError, match="max_decode_tokens"):
        ws.check("decode", DECODE_STEP[cfg["mode"]], tokens=cfg["max_decode_tokens"] + extra)


@pytest.mark.parametrize("v_dim", [8, 32])
def test_a_gqa_spec_whose_values_are_not_head_dim_wide_is_refused(v_dim: int) -> None:
    """GQA steps read V rows of the K rows' width and return ``head_dim``-wide outputs, while the
    workspace sizes a DCP decode step's partials by ``v_dim``: such a spec would be accepted and its
    full-sized decode steps fail inside the step."""
    with pytest.raises(ValueError, match="v_dim == head_dim"):
        ModelSpec("gqa", 4, 2, 16, v_dim, 0, 16, dtype="float32")


def test_the_dcp_decode_bound_holds_the_gqa_steps_outputs() -> None:
    spec = ModelSpec("gqa", 4, 2, 16, 16, 0, 16, dtype="float32")
    wb = workspace_bounds(spec, max_batched_tokens=4, world_size=2, mode="dcp-decode")
    assert wb.out == 4 * 4 * spec.head_dim * 4  # M x every head x head_dim x fp32
