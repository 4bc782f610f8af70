"""Model presets, routing and the CUDA-graph policy: decisions, reasons and bad input."""

from __future__ import annotations

import dataclasses

import pytest

from shardattn.plan import (
    MAX_GROUPED_KV_ROWS,
    PRESETS,
    CGSupport,
    ModelSpec,
    cudagraph_support,
    decode_query_lens,
    explain_cudagraph_support,
    get_preset,
    grouped_group_size,
    route_decode,
    route_prefill,
    xqa_head_dim_supported,
)

GQA = get_preset("gqa-64-8")
GLM5 = get_preset("glm5")


# ---- spec --------------------------------------------------------------------------------------


def test_presets():
    assert (GLM5.kind, GLM5.num_heads, GLM5.num_kv_heads, GLM5.head_dim, GLM5.v_dim, GLM5.topk) == (
        "sparse_mla",
        64,
        1,
        576,
        512,
        2048,
    )
    assert get_preset("deepseek-v32").num_heads == 128
    assert (GQA.num_heads, GQA.num_kv_heads, GQA.head_dim, GQA.has_sinks) == (64, 8, 64, True)
    assert set(PRESETS) == {"glm5", "deepseek-v32", "gqa-64-8"}
    assert GLM5.heads_per_rank(4) == 16 and GLM5.dtype_bytes == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        GLM5.num_heads = 1  # type: ignore[misc]


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown model preset 'glm6'; known presets: deepseek-v32, glm5, gqa-64-8"):
        get_preset("glm6")


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(kind="mha"), ValueError, "kind must be one of"),
        (dict(num_heads=0), ValueError, "num_heads must be >= 1"),
        (dict(num_kv_heads=3), ValueError, "must be a multiple of num_kv_heads"),
        (dict(kind="sparse_mla", num_kv_heads=8), ValueError, "sparse_mla needs num_kv_heads == 1"),
        (dict(kind="sparse_mla", num_kv_heads=1, topk=0), ValueError, "sparse_mla needs topk >= 1"),
        (dict(topk=16), ValueError, r"^gqa needs topk == 0 \(its attention is dense, no top-k is read\), got topk=16$"),
        (dict(dtype="int8"), ValueError, "dtype must be one of"),
        (dict(has_sinks=1), TypeError, "has_sinks must be a bool"),
        (dict(head_dim=64.0), TypeError, "head_dim must be an int"),
    ],
    ids=[
        "kind",
        "heads-0",
        "kv-not-divisor",
        "mla-kv-heads",
        "mla-topk-0",
        "gqa-topk",
        "dtype",
        "sinks-int",
        "head-dim-float",
    ],
)
def test_bad_spec_raises(kwargs, exc, match):
    base = dict(kind="gqa", num_heads=64, num_kv_heads=8, head_dim=64, v_dim=64, topk=0, page_size=32)
    base.update(kwargs)
    with pytest.raises(exc, match=match):
        ModelSpec(**base)


def test_heads_per_rank_must_divide():
    with pytest.raises(ValueError, match="divisible by tp_size"):
        GLM5.heads_per_rank(3)


# ---- routing -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("heads", "g"), [(2, 8), (4, 8), (8, 8), (16, None), (32, None), (64, None), (128, None), (24, None)], ids=str
)
def test_group_size_from_heads(heads, g):
    assert grouped_group_size(heads) == g
    route = route_prefill(heads, num_tokens=4096, kv_rows=1 << 20)
    if g is None:
        assert (route.path, route.group_size) == ("per-query", 1)
        assert f"{heads} heads > 8: grouping is slower than the per-query kernel" in route.reason
    else:
        assert (route.path, route.group_size) == ("grouped", g)


@pytest.mark.parametrize(("heads", "g"), [(16, 8), (32, 4), (64, 2), (128, None), (24, 4)], ids=str)
def test_group_size_of_a_128_row_backend(heads, g):
    # G = 128 / heads, for a backend with a 128-row tile whose grouping pays at every head count
    # (heads are padded to a power of two: 24 heads take a 32-row slot)
    assert grouped_group_size(heads, grouped_max_heads=128, tile_rows=128) == g
    route = route_prefill(heads, num_tokens=4096, kv_rows=1 << 20, grouped_max_heads=128, tile_rows=128)
    assert (route.path, route.group_size) == (("grouped", g) if g else ("per-query", 1))


@pytest.mark.parametrize(
    ("kwargs", "path", "reason"),
    [
        (dict(device_type="cpu"), "reference", "no GPU"),
        (dict(kv_rows=MAX_GROUPED_KV_ROWS), "per-query", "2^24 - 1"),
        (dict(kv_rows=MAX_GROUPED_KV_ROWS - 1), "grouped", "8 queries per 64-row tile"),
        (dict(num_tokens=1023), "per-query", "min_tokens=1024"),
        (dict(num_tokens=1024), "grouped", "8 queries per 64-row tile"),
        (dict(num_tokens=100, min_tokens=0), "grouped", "8 queries"),
        (dict(need_lse=True), "grouped", "8 queries"),
        (dict(need_lse=True, grouped_supports_lse=False), "per-query", "LSE is needed"),
        (dict(device_type="cpu", kv_rows=1 << 30), "reference", "no GPU"),
    ],
    ids=[
        "cpu",
        "kv-rows-at-limit",
        "kv-rows-below-limit",
        "below-min-tokens",
        "at-min-tokens",
        "min-tokens-0",
        "lse-served-by-grouped",
        "lse-not-served",
        "cpu-first",
    ],
)
def test_route_prefill_fallbacks(kwargs, path, reason):
    args = dict(num_tokens=4096, kv_rows=1 << 20)
    args.update(kwargs)
    route = route_prefill(8, **args)
    assert route.path == path and reason in route.reason
    assert route.group_size == (8 if path == "grouped" else 1)


@pytest.mark.parametrize("changes", [{}, dict(page_size=8), dict(head_dim=72, v_dim=72), dict(dtype="float32")])
def test_route_decode_gqa_is_the_triton_kernel_which_returns_the_lse(changes):
    """Triton matched or beat XQA on the same inputs (D46, D81): every GQA spec on a GPU takes it."""
    route = route_decode(dataclasses.replace(GQA, **changes))
    assert route.path == "triton" and "matched or beat FlashInfer XQA" in route.reason
    assert route_decode(GQA, device_type="cpu").path == "reference"


def test_the_graph_policy_degrades_xqa_by_the_shared_head_dim_rule():
    for head_dim in (8, 72, 512):
        assert not xqa_head_dim_supported(head_dim)
        assert cudagraph_support("decode", "flashinfer-xqa", head_dim=head_dim) == CGSupport.UNIFORM_SINGLE_TOKEN_DECODE


def test_route_decode_sparse_mla():
    assert route_decode(GLM5).path == "triton"
    assert "LSE" in route_decode(GLM5).reason
    assert route_decode(GLM5, device_type="cpu").path == "reference"


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: route_prefill(0, num_tokens=1, kv_rows=1), ValueError, "num_heads must be >= 1"),
        (lambda: route_prefill(64, num_tokens=-1, kv_rows=1), ValueError, "num_tokens must be >= 0"),
        (lambda: route_prefill(64, num_tokens=1, kv_rows=1, need_lse=1), TypeError, "need_lse must be a bool"),
        (lambda: route_prefill(64, num_tokens=1, kv_rows=1, device_type=3), TypeError, "device_type must be"),
        (lambda: route_decode("gqa"), TypeError, "spec must be a ModelSpec"),
        (lambda: route_decode(GQA, device_type=3), TypeError, "device_type must be"),
    ],
    ids=["heads-0", "tokens-negative", "lse-int", "device-int", "spec-str", "decode-device-int"],
)
def test_routing_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# ---- CUDA-graph policy -------------------------------------------------------------------------


def test_levels_are_ordered():
    assert CGSupport.NEVER < CGSupport.UNIFORM_SINGLE_TOKEN_DECODE < CGSupport.UNIFORM_BATCH < CGSupport.ALWAYS


@pytest.mark.parametrize(
    ("head_dim", "ok"), [(8, False), (16, True), (64, True), (72, False), (256, True), (272, False), (512, False)]
)
def test_xqa_head_dim_rule(head_dim, ok):
    assert xqa_head_dim_supported(head_dim) is ok


@pytest.mark.parametrize(
    ("mode", "kernel", "kwargs", "level"),
    [
        ("decode", "triton", {}, CGSupport.UNIFORM_BATCH),
        ("decode", "triton", dict(non_causal=True), CGSupport.UNIFORM_BATCH),
        ("decode", "triton", dict(dcp_size=2), CGSupport.UNIFORM_SINGLE_TOKEN_DECODE),
        ("decode", "flashinfer-xqa", {}, CGSupport.UNIFORM_BATCH),
        ("decode", "flashinfer-xqa", dict(non_causal=True), CGSupport.UNIFORM_BATCH),
        ("decode", "flashinfer-xqa", dict(head_dim=512), CGSupport.UNIFORM_SINGLE_TOKEN_DECODE),
        ("decode", "flashinfer-xqa", dict(dcp_size=4), CGSupport.UNIFORM_SINGLE_TOKEN_DECODE),
        ("decode", "reference", {}, CGSupport.NEVER),
        ("prefill", "triton", {}, CGSupport.ALWAYS),
        ("prefill", "triton", dict(dcp_size=2), CGSupport.UNIFORM_SINGLE_TOKEN_DECODE),
        ("prefill", "flashinfer-xqa", {}, CGSupport.NEVER),
        ("shardq", "triton", {}, CGSupport.NEVER),
        ("pcp", "triton", {}, CGSupport.NEVER),
        ("pcp", "triton", dict(dcp_size=2), CGSupport.NEVER),
    ],
    ids=lambda v: (
        v
        if isinstance(v, str)
        else ("-".join(f"{k}={x}" for k, x in v.items()) or "base")
        if isinstance(v, dict)
        else getattr(v, "name", str(v))
    ),
)
def test_cudagraph_table(mode, kernel, kwargs, level):
    args = dict(head_dim=64)
    args.update(kwargs)
    assert cudagraph_support(mode, kernel, **args) == level
    got, reason = explain_cudagraph_support(mode, kernel, **args)
    assert got == level and reason
    if got == CGSupport.UNIFORM_BATCH:  # the reason must not promise what the level forbids
        assert "ragged" not in reason or "eagerly" in reason, reason


def test_dcp_never_raises_a_level():
    for mode in ("decode", "prefill", "shardq", "pcp"):
        for kernel in ("triton", "flashinfer-xqa", "reference"):
            for nc in (False, True):
                base = cudagraph_support(mode, kernel, head_dim=128, non_causal=nc)
                dcp = cudagraph_support(mode, kernel, head_dim=128, non_causal=nc, dcp_size=2)
                assert dcp <= min(base, CGSupport.UNIFORM_SINGLE_TOKEN_DECODE)


def test_gqa_prefill_on_fa4_is_never_captured():
    for mode in ("prefill", "pcp", "decode"):
        level, why = explain_cudagraph_support(mode, "fa4", head_dim=64)
        assert level == CGSupport.NEVER, (mode, why)
    assert "allocates outputs per call" in explain_cudagraph_support("prefill", "fa4", head_dim=64)[1]


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: cudagraph_support("mixed", "triton", head_dim=64), ValueError, "mode must be one of"),
        (lambda: cudagraph_support("decode", "flashmla", head_dim=64), ValueError, "kernel must be one of"),
        (lambda: cudagraph_support("decode", "triton", head_dim=0), ValueError, "head_dim must be >= 1"),
        (lambda: cudagraph_support("decode", "triton", head_dim=64, dcp_size=0), ValueError, "dcp_size must be"),
        (lambda: cudagraph_support("decode", "triton", head_dim=64, non_causal=None), TypeError, "non_causal"),
    ],
    ids=["mode", "kernel", "head-dim", "dcp-0", "non-causal-none"],
)
def test_cudagraph_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# ---- decode query lengths ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("indptr", "num_decodes", "uniform", "q_len", "lens", "max_q", "padded"),
    [
        ([0, 1, 2, 3], 3, True, 1, [1, 1, 1], 1, 0),
        ([0, 2, 4, 6], 3, True, 2, [2, 2, 2], 2, 0),
        ([0, 2, 4, 4, 4], 4, False, None, [2, 2, 0, 0], 2, 2),
        ([0, 3, 3], 2, False, None, [3, 0], 3, 1),
        ([0, 1, 3, 4], 3, False, None, [1, 2, 1], 2, 0),
        ([0, 0, 0], 2, False, None, [0, 0], 0, 2),
        ([0, 2, 4, 9], 2, True, 2, [2, 2], 2, 0),
        ([0], 0, False, None, [], 0, 0),
    ],
    ids=[
        "single-token",
        "uniform-2",
        "regression-0-2-4-4-4",
        "regression-0-3-3",
        "ragged",
        "all-padding",
        "prefills-after-decodes-ignored",
        "no-decodes",
    ],
)
def test_decode_query_lens(indptr, num_decodes, uniform, q_len, lens, max_q, padded):
    r = decode_query_lens(indptr, num_decodes)
    assert (r.uniform, r.q_len, r.max_q_len, r.num_padded) == (uniform, q_len, max_q, padded)
    assert r.q_lens.tolist() == lens
    # padded requests are kept: offsets cover every decode request
    assert r.qo_indptr.tolist() == indptr[: num_decodes + 1]
    assert r.single_token == (uniform and q_len == 1)


@pytest.mark.parametrize(
    ("args", "exc", "match"),
    [
        (([0, 2, 1], 2), ValueError, r"non-decreasing; qo_indptr\[2\]=1 < qo_indptr\[1\]=2"),
        (([0, 1], 2), ValueError, "at least num_decodes\\+1=3 entries"),
        (([0, 1], -1), ValueError, "num_decodes must be >= 0"),
        (([0, -1], 1), ValueError, r"qo_indptr\[1\] must be >= 0"),
        (([0.0, 1.0], 1), TypeError, r"qo_indptr\[0\] must be an int"),
    ],
    ids=["decreasing", "too-short", "negative-count", "negative-offset", "float"],
)
def test_decode_query_lens_bad_arguments(args, exc, match):
    with pytest.raises(exc, match=match):
        decode_query_lens(*args)


def test_grouped_gluon_routes_up_to_its_measured_head_count() -> None:
    """On sm_90 with Gluon, grouping pays up to GLUON_GROUPED_MAX_HEADS heads (64-row tile: G = 64 / heads);
    elsewhere the Triton grouped kernel's limit holds."""
    from shardattn.plan.routing import GLUON_GROUPED_MAX_HEADS, prefill_group_size, route_prefill

    for heads in (8, 16, 32, 64, 128):
        on = route_prefill(heads, num_tokens=8192, kv_rows=1 << 20, gluon=True)
        off = route_prefill(heads, num_tokens=8192, kv_rows=1 << 20, gluon=False)
        want = 64 // heads if heads <= GLUON_GROUPED_MAX_HEADS else None
        assert (on.group_size if on.path == "grouped" else None) == want, on
        assert prefill_group_size(heads, gluon=True) == want
        assert off.path == ("grouped" if heads <= 8 else "per-query"), off
    # below the token gate, or with too many KV rows, no grouping even with Gluon
    assert route_prefill(16, num_tokens=100, kv_rows=1 << 20, gluon=True).path == "per-query"
    assert route_prefill(16, num_tokens=8192, kv_rows=1 << 24, gluon=True).path == "per-query"
