"""Workspace bounds: the contract example, monotonicity in every input, coverage of real plans."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardattn.kernels.triton.lse_merge import split_partials
from shardattn.plan import (
    ITEM_LIFETIMES,
    WORKSPACE_ITEMS,
    WORKSPACE_MODES,
    arena_offsets,
    get_preset,
    pcp_plan,
    workspace_bounds,
    zigzag_split,
)
from shardattn.plan.routing import prefill_group_size

GLM5 = get_preset("glm5")
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)


def test_contract_union_example():
    # 65,536 batched tokens, TP4, 2 queries per group, top-k 2048: 16,384 / 2 * 4,096 * 4 B
    wb = workspace_bounds(GLM5, max_batched_tokens=65536, world_size=4, mode="shardq", group_size=2, topk=2048)
    assert wb.union == 134_217_728 == 16_384 // 2 * 4_096 * 4
    assert wb.rank_tokens == 16_384 and wb.group_size == 2
    auto = workspace_bounds(GLM5, max_batched_tokens=65536, world_size=4, mode="shardq")
    assert auto.union == wb.union  # G * (tokens / G) * K entries whatever G the routing picks


def test_table_rows_and_total():
    wb = workspace_bounds(GLM5, max_batched_tokens=8192, world_size=4, mode="shardq")
    rows = wb.table()
    assert [r["item"] for r in rows] == [*WORKSPACE_ITEMS, "total"]
    assert rows[-1]["bytes"] == wb.total == sum(wb.items.values())
    assert all(r["formula"] for r in rows[:-1] if r["bytes"])
    # shardq moves queries and outputs in place: its receive (packed_q) and send (out, lse) buffers
    assert wb.packed_q > 0 and wb.out > 0 and wb.lse > 0 and wb.send == wb.recv == 0 and wb.split_partials == 0


@pytest.mark.parametrize("mode", WORKSPACE_MODES)
def test_every_mode_has_its_items(mode):
    wb = workspace_bounds(GLM5, max_batched_tokens=4096, world_size=2, mode=mode, num_kv_splits=4)
    # head-TP steps write the caller's result directly: no output item of their own
    assert (wb.out > 0) == (wb.lse > 0) == (mode not in ("headtp", "headtp-decode"))
    assert (wb.union > 0) == (mode not in ("dcp-decode", "headtp-decode"))
    assert (wb.topk_rows > 0) == (mode != "headtp")  # head-TP prefill reads the caller's rows
    assert (wb.split_partials > 0) == (mode in ("dcp-decode", "headtp-decode"))
    assert (wb.recv > 0) == (wb.send > 0) == (mode in ("pcp", "dcp-decode"))
    assert (wb.packed_q > 0) == (mode in ("shardq", "dcp-decode"))


def test_headtp_groups_at_eight_heads():
    wb = workspace_bounds(GLM5, max_batched_tokens=1000, world_size=8, mode="headtp")
    assert wb.group_size == 8 and wb.heads == 8 and wb.rank_tokens == 1000
    wb16 = workspace_bounds(GLM5, max_batched_tokens=1000, world_size=4, mode="headtp")
    # the bound covers the largest G any device routes: the grouped Gluon kernel's G = 4 at 16 heads
    assert wb16.group_size == 4 and wb16.heads == 16
    wb64 = workspace_bounds(GLM5, max_batched_tokens=1000, world_size=1, mode="headtp")
    assert wb64.group_size == 1 and wb64.heads == 64  # no kernel groups 64 heads


@SETTINGS
@given(
    st.sampled_from(WORKSPACE_MODES),
    st.sampled_from(["glm5", "deepseek-v32", "gqa-64-8"]),
    st.integers(1, 70000),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([1, 2, 4]),
    st.sampled_from([1, 2, 4, 8]),
    st.integers(0, 4096),
    st.integers(1, 8),
)
def test_monotone_in_every_input(mode, preset, tokens, w, tp, g, topk, splits):
    spec = get_preset(preset)
    base = dict(max_batched_tokens=tokens, world_size=w, mode=mode, tp_size=tp, group_size=g, topk=topk)
    base["num_kv_splits"] = splits

    def items(spec_=spec, **kw):
        return workspace_bounds(spec_, **{**base, **kw}).items

    ref = items()
    gqa = spec.kind == "gqa"
    bigger = [
        items(max_batched_tokens=tokens + 1),
        items(max_batched_tokens=2 * tokens),
        items(topk=topk + 1),
        items(num_kv_splits=splits + 1),
        items(q_dtype="float32", kv_dtype="float32", out_dtype="float32"),
        # a GQA spec's values are its keys' width: head_dim alone grows only for sparse MLA
        items(spec_=dataclasses.replace(spec, head_dim=spec.head_dim + 16, v_dim=spec.v_dim + 16 * gqa)),
        items(spec_=dataclasses.replace(spec, v_dim=spec.v_dim + 16, head_dim=spec.head_dim + 16)),
        items(spec_=dataclasses.replace(spec, num_heads=spec.num_heads * 2)),
    ]
    if g < 8:
        bigger.append(items(group_size=g * 2))
    for other in bigger:
        assert all(other[k] >= ref[k] for k in WORKSPACE_ITEMS), (ref, other)
    # world size and tp size: each item moves one way only over the whole range
    for key, values in (("world_size", [1, 2, 4, 8]), ("tp_size", [1, 2, 4])):
        series = [items(**{key: v}) for v in values]
        for k in WORKSPACE_ITEMS:
            seq = [s[k] for s in series]
            assert seq == sorted(seq) or seq == sorted(seq, reverse=True), (key, k, seq)


@SETTINGS
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=8), st.sampled_from([2, 4, 8]), st.sampled_from([1, 2, 4]))
def test_bounds_cover_real_plans(lens, w, g):
    m = sum(lens)
    wb = workspace_bounds(GLM5, max_batched_tokens=m, world_size=w, mode="shardq", group_size=g)
    plan = zigzag_split(lens, w, align=g, min_tokens=0)
    assert plan.padded_count <= wb.rank_tokens_max
    assert plan.padded_count * GLM5.num_heads * GLM5.head_dim * 2 <= wb.packed_q
    pwb = workspace_bounds(GLM5, max_batched_tokens=m, world_size=w, mode="pcp", group_size=g)
    pplan = pcp_plan(lens, w, align=g)
    assert pplan.gathered_rows * GLM5.head_dim * 2 <= pwb.recv


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(mode="ring"), ValueError, "mode must be one of"),
        (dict(world_size=0), ValueError, "world_size must be >= 1"),
        (dict(world_size=3), ValueError, r"num_heads \(64\) must be divisible by world_size \(3\)"),
        (dict(max_batched_tokens=-1), ValueError, "max_batched_tokens must be >= 0"),
        (dict(group_size=3), ValueError, "group_size must be one of"),
        (dict(topk=-1), ValueError, "topk must be >= 0"),
        (dict(q_dtype="int4"), ValueError, "q_dtype must be one of"),
        (dict(mode="pcp", tp_size=5), ValueError, r"divisible by tp_size \(5\)"),
        (dict(num_kv_splits=0), ValueError, "num_kv_splits must be >= 1"),
    ],
    ids=["mode", "world-0", "heads-not-divisible", "tokens-negative", "group-3", "topk", "dtype", "tp", "splits"],
)
def test_bad_arguments_raise(kwargs, exc, match):
    args = dict(max_batched_tokens=1024, world_size=4, mode="shardq")
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        workspace_bounds(GLM5, **args)


def test_spec_must_be_a_model_spec():
    with pytest.raises(TypeError, match="spec must be a ModelSpec"):
        workspace_bounds("glm5", max_batched_tokens=1, world_size=1, mode="shardq")


@SETTINGS
@given(
    st.dictionaries(
        st.sampled_from(WORKSPACE_ITEMS),
        st.tuples(st.integers(0, 5000), st.integers(0, 6), st.integers(0, 3)),
        min_size=1,
    ),
    st.sampled_from([1, 16, 256]),
)
def test_arena_offsets_never_overlap_items_live_together(items, align):
    sizes = {k: n for k, (n, _, _) in items.items()}
    lifetimes = {k: (first, first + span) for k, (_, first, span) in items.items() if k != "union"}  # union: always
    offsets, total = arena_offsets(sizes, lifetimes, align=align)
    assert set(offsets) == {k for k, n in sizes.items() if n} and all(o % align == 0 for o in offsets.values())
    assert total <= sum(-(-n // align) * align for n in sizes.values())
    always = (-1, 99)
    for a in offsets:
        assert offsets[a] + sizes[a] <= total
        for b in offsets:
            la, lb = lifetimes.get(a, always), lifetimes.get(b, always)
            if a < b and not (la[1] < lb[0] or lb[1] < la[0]):  # live in a common phase: disjoint bytes
                assert offsets[a] + sizes[a] <= offsets[b] or offsets[b] + sizes[b] <= offsets[a], (a, b, offsets)
    # without lifetimes, one after another: the sum
    assert arena_offsets(sizes, align=align)[1] == sum(-(-n // align) * align for n in sizes.values())


def test_dcp_decode_step_shares_bytes_where_its_items_are_never_live_together():
    # GLM-5, W = 8, 1,024 decode tokens: the send buffer reuses the queries' bytes, the receive buffer
    # the (dead) gathered queries as well; the partial and the rows need their own
    wb = workspace_bounds(GLM5, max_batched_tokens=1024, world_size=8, mode="dcp-decode")
    offsets, total = arena_offsets({k: v for k, v in wb.items.items() if v}, ITEM_LIFETIMES["dcp-decode"])
    assert total == 226_754_560 < wb.total == 361_496_576
    assert offsets["send"] < wb.packed_q and offsets["recv"] < wb.packed_q  # inside the queries' bytes
    assert offsets["out"] >= wb.packed_q  # the kernel reads q while writing its partial


@pytest.mark.parametrize(
    ("lifetimes", "exc", "match"),
    [
        ([("a", (0, 1))], TypeError, r"^lifetimes must be a dict of item -> \(first, last\) or None, got list"),
        ({"a": (False, True)}, TypeError, r"^lifetimes\['a'\]\[0\] must be an int, got bool"),
        ({"a": (0, 1.0)}, TypeError, r"^lifetimes\['a'\]\[1\] must be an int, got float"),
        ({"a": [0, 1]}, TypeError, r"^lifetimes\['a'\] must be a \(first, last\) pair of ints"),
        ({"a": (2, 1)}, ValueError, r"^lifetimes\['a'\] must have first <= last, got \(2, 1\)"),
    ],
    ids=["list", "bools", "float", "span-list", "reversed"],
)
def test_arena_lifetimes_are_checked(lifetimes, exc, match):
    """A list of lifetimes raised AttributeError, and bools passed as phase numbers."""
    with pytest.raises(exc, match=match):
        arena_offsets({"a": 8, "b": 8}, lifetimes)


def test_arena_lifetimes_take_numpy_ints():
    """NumPy integer phases (the ends of an array of lifetimes) lay out as the same ints do."""
    sizes = {"a": 100, "b": 50, "c": 60}
    plain = {"a": (0, 1), "b": (2, 2), "c": (1, 2)}
    as_numpy = {k: (np.int64(a), np.int32(b)) for k, (a, b) in plain.items()}
    assert (
        arena_offsets(sizes, as_numpy, align=1)
        == arena_offsets(sizes, plain, align=1)
        == ({"a": 0, "c": 100, "b": 0}, 160)
    )


@pytest.mark.parametrize(("heads", "group"), [(8, 8), (16, 4), (32, 2), (64, 1), (128, 1)])
def test_default_group_size_is_the_grouped_gluon_kernels(heads, group):
    """The default ``G`` that ``workspace_bounds``' docstring states: the grouped Gluon kernel's for
    the kernel's heads (8 / 16 / 32 heads: 8 / 4 / 2), 1 above 32 heads, 1 for the decode modes."""
    spec = dataclasses.replace(GLM5, num_heads=heads)
    for mode, world, kernel_heads in (("shardq", 2, heads), ("headtp", 2, heads // 2), ("pcp", 2, heads)):
        wb = workspace_bounds(spec, max_batched_tokens=1024, world_size=world, mode=mode)
        assert wb.group_size == (prefill_group_size(kernel_heads, gluon=True) or 1), (mode, wb.group_size)
    assert workspace_bounds(spec, max_batched_tokens=1024, world_size=1, mode="shardq").group_size == group
    assert workspace_bounds(spec, max_batched_tokens=1024, world_size=2, mode="dcp-decode").group_size == 1


@pytest.mark.parametrize("m", [1023, 1017, 1024])
def test_headtp_union_holds_one_pass_of_every_token_in_whole_groups(m):
    # the union of M tokens is [ceil(M / G), G * K] int32; it was sized M * K * 4, so a step of
    # the largest size ran its grouped kernel in two passes
    spec = get_preset("glm5")
    wb = workspace_bounds(spec, max_batched_tokens=m, world_size=8, mode="headtp")
    g = wb.group_size
    assert g > 1 and wb.union >= -(-m // g) * g * spec.topk * 4
    assert wb.union // (spec.topk * 4) // g * g >= m  # the Runtime's tokens per pass


@pytest.mark.parametrize(
    ("mode", "w", "splits"), [("dcp-decode", 4, 3), ("headtp-decode", 8, 2), ("dcp-decode", 2, 16)]
)
def test_split_partials_hold_what_the_split_kv_kernel_carves(mode, w, splits):
    # the split-KV decode kernels take their fp32 partial outputs and LSEs as views of one buffer of
    # split_partials_numel elements: the item is that buffer for the step's tokens and kernel heads
    m = 37
    wb = workspace_bounds(GLM5, max_batched_tokens=m, world_size=w, mode=mode, num_kv_splits=splits)
    heads = GLM5.num_heads if mode == "dcp-decode" else GLM5.num_heads // w  # all heads gathered / a TP share
    partials = split_partials(None, splits, m, heads, GLM5.v_dim, torch.device("cpu"))
    assert wb.split_partials == sum(p.numel() * p.element_size() for p in partials)
    # one split: the kernel writes the merged result directly, no partials
    assert workspace_bounds(GLM5, max_batched_tokens=m, world_size=w, mode=mode).split_partials == 0
