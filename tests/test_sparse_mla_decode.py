"""Sparse-MLA decode: the CPU path and the Triton kernel (interpreter) against the independent fp64
oracle (tests/oracle.py), the kernel on the GPU against ``sparse_mla_reference``; splits, sinks,
empty rows, invalid indices anywhere, validation."""

from __future__ import annotations

import pytest
import torch

from shardattn.kernels.triton.lse_merge import split_partials_numel
from shardattn.kernels.triton.sparse_mla_decode_config import decode_launch, partials_dtype, sparse_mla_decode_config
from shardattn.ops.sparse_mla import sparse_mla_reference
from shardattn.ops.sparse_mla_decode import run_sparse_mla_decode, sparse_mla_decode
from shardattn.plan.crossovers import COLUMN_MERGE_MAX_ROWS
from shardattn.plan.decode_routing import route_decode_merge
from shardattn.runtime.graph_capture import DecodeGraph
from shardattn.testing.interpret import run_interpreted
from tests.oracle import sparse_mla_oracle

# (name, tokens, heads, dim, v_dim, kv rows, topk, topk_length?, sinks?, splits)
CASES = [
    ("one_token_per_request", 3, 16, 48, 32, 50, 40, False, False, None),
    ("heads_not_a_tile_multiple", 3, 20, 48, 32, 50, 70, True, True, 3),
    ("many_splits_sinks", 2, 16, 48, 32, 64, 130, False, True, 5),
    ("drafts_with_topk_length", 4, 16, 32, 32, 30, 20, True, False, 2),
]


def make_inputs(t, h, d, r, k, with_len, with_sinks, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g).to(dtype)
    kv = torch.randn(r, d, generator=g).to(dtype)
    rows = torch.randint(0, r, (t, k), generator=g, dtype=torch.int32)
    bad = torch.rand(t, k, generator=g) < 0.2  # invalid entries anywhere in a row
    rows = torch.where(bad, torch.randint(-3, 0, (t, k), generator=g, dtype=torch.int32) * (1 - 2 * (t % 2)), rows)
    rows[:, -1] = r + 7  # out of range at the tail
    rows[0] = -1  # a row with no valid key
    topk_length = torch.randint(0, k + 1, (t,), generator=g, dtype=torch.int32) if with_len else None
    sinks = torch.randn(h, generator=g) * 2 if with_sinks else None
    move = lambda x: None if x is None else x.to(device)
    return move(q), move(kv), move(rows), move(topk_length), move(sinks)


def assert_same_lse(lse, ref, atol):
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref))
    fin = torch.isfinite(ref)
    torch.testing.assert_close(lse[fin], ref[fin], atol=atol, rtol=0)


def test_cpu_path_matches_the_oracle():
    q, kv, rows, tlen, sinks = make_inputs(3, 4, 24, 30, 12, True, True)
    out, lse = sparse_mla_decode(q, kv, rows, scale=0.3, v_dim=16, topk_length=tlen, sinks=sinks)
    ref_out, ref_lse = sparse_mla_oracle(q, kv, rows, scale=0.3, v_dim=16, topk_length=tlen, sinks=sinks)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=0)
    assert_same_lse(lse.double(), ref_lse, atol=1e-5)
    # an empty row: out 0, lse = the sink (the sink is the only softmax term)
    assert float(out[0].abs().sum()) == 0.0 and torch.equal(lse[0], sinks)


def test_cpu_writes_into_given_buffers():
    q, kv, rows, _, _ = make_inputs(2, 4, 24, 30, 12, False, False)
    out, lse = torch.full((2, 4, 16), float("nan")), torch.full((2, 4), float("nan"))
    got_out, got_lse = sparse_mla_decode(q, kv, rows, scale=0.3, v_dim=16, out=out, lse_out=lse)
    assert got_out.data_ptr() == out.data_ptr() and got_lse.data_ptr() == lse.data_ptr()
    assert not out.isnan().any() and torch.isneginf(lse[0]).all()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"rows": torch.zeros(3, 4, dtype=torch.int64)}, TypeError, "rows must have dtype"),
        ({"rows": torch.zeros(2, 4, dtype=torch.int32)}, ValueError, "one row per query token"),
        ({"out": torch.zeros(3, 4, 8)}, ValueError, "out must have shape"),
        ({"lse_out": torch.zeros(3, 4, dtype=torch.float64)}, TypeError, "lse_out must have dtype"),
        ({"num_splits": 2}, TypeError, "unexpected keyword argument 'num_splits'"),
        ({"config": {"pdl": False}}, TypeError, "unexpected keyword argument 'config'"),
    ],
    ids=["rows_dtype", "rows_tokens", "out_shape", "lse_dtype", "no_splits_knob", "no_config_knob"],
)
def test_bad_input_is_refused_with_the_argument_named(kwargs, error, match):
    q, kv, rows, _, _ = make_inputs(3, 4, 24, 30, 12, False, False)
    args = {"rows": rows, **kwargs}
    with pytest.raises(error, match=match):
        sparse_mla_decode(q, kv, args.pop("rows"), scale=0.3, v_dim=16, **args)


def test_config_splits_shrink_as_tokens_grow():
    one = sparse_mla_decode_config(1, 128, 2048, 132)
    many = sparse_mla_decode_config(256, 128, 2048, 132)
    assert one["num_splits"] * one["chunk"] >= 2048 and one["num_splits"] > 1
    assert many["num_splits"] == 1 and many["BLOCK_H"] == 64
    assert sparse_mla_decode_config(8, 16, 2048, 132)["BLOCK_H"] == 16


def test_config_routes_the_column_merge_to_few_rows():
    # measured: columns at 16 heads x 1-8 tokens and 128 heads x 1 token, rows at 128 x 8
    for t, h, kind in ((1, 16, "columns"), (8, 16, "columns"), (1, 128, "columns"), (8, 128, "rows")):
        cfg = sparse_mla_decode_config(t, h, 2048, 132)
        assert cfg["num_splits"] > 1 and cfg["merge"] == kind, (t, h, cfg)
        assert f"{kind[:-1] if kind == 'columns' else 'row'} merge" in cfg["reason"]
        assert cfg["reason"].endswith(route_decode_merge(t, h, cfg["num_splits"]).reason)
    n = COLUMN_MERGE_MAX_ROWS
    assert route_decode_merge(n, 1, 2).path == "columns" and route_decode_merge(n + 1, 1, 2).path == "rows"
    one = sparse_mla_decode_config(1, 16, 64, 132)
    assert one["num_splits"] == 1 and one["merge"] == "none" and "no merge" in one["reason"]


def test_private_runner_checks_its_launch_knobs_before_any_kernel():
    q, kv = torch.zeros(2, 4, 48), torch.zeros(8, 48)
    rows = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        run_sparse_mla_decode(q, kv, rows, scale=0.2, v_dim=32, kernel="triton", num_splits=0)
    with pytest.raises(ValueError, match="config keys must be among"):
        run_sparse_mla_decode(q, kv, rows, scale=0.2, v_dim=32, kernel="triton", config={"BLOCK_M": 16})
    with pytest.raises(ValueError, match=r"config\['merge'\] must be 'rows' or 'columns'"):
        run_sparse_mla_decode(q, kv, rows, scale=0.2, v_dim=32, kernel="triton", config={"merge": "tree"})
    with pytest.raises(ValueError, match="takes none"):
        run_sparse_mla_decode(q, kv, rows, scale=0.2, v_dim=32, kernel="reference", config={"merge": "rows"})
    with pytest.raises(ValueError, match=r"config of the Gluon kernel is \{'persistent': bool\}"):
        run_sparse_mla_decode(q, kv, rows, scale=0.2, v_dim=32, kernel="gluon", config={"merge": "rows"})
    with pytest.raises(TypeError, match=r"config\['persistent'\] must be a bool"):
        run_sparse_mla_decode(q, kv, rows, scale=0.2, v_dim=32, kernel="gluon", config={"persistent": 1})
    with pytest.raises(ValueError, match="kernel must be"):
        run_sparse_mla_decode(q, kv, rows, scale=0.2, v_dim=32, kernel="cuda")
    with pytest.raises(TypeError, match=r"config\['pdl'\] must be a bool"):
        run_sparse_mla_decode(q, kv, rows, scale=0.2, v_dim=32, kernel="triton", config={"pdl": 1})
    with pytest.raises(ValueError, match=r"config\['partials'\] must be"):
        run_sparse_mla_decode(q, kv, rows, scale=0.2, v_dim=32, kernel="triton", config={"partials": "bf16"})


def test_a_workspace_too_small_for_the_triton_splits_is_refused_before_the_union(monkeypatch):
    """The Triton kernel's split count is known from shapes alone: a workspace below its partials
    is a ValueError naming the sizes before the union is built (no kernel, no allocation)."""
    import shardattn.ops.sparse_mla_decode as decode_op

    def no_union(*args, **kwargs):
        raise AssertionError("the union was built before the workspace was checked")

    monkeypatch.setattr(decode_op, "decode_rows", no_union)
    q, kv = torch.zeros(2, 4, 48), torch.zeros(300, 48)
    rows = torch.arange(256, dtype=torch.int32).repeat(2, 1)
    need = 4 * 2 * 4 * (32 + 1)  # 4 splits x 2 tokens x 4 heads x (32 values + the LSE)
    with pytest.raises(ValueError, match=rf"workspace must hold >= {need} fp32 elements .* 4 splits .* has {need - 1}"):
        run_sparse_mla_decode(
            q, kv, rows, scale=0.2, v_dim=32, kernel="triton", num_splits=4, workspace=torch.zeros(need - 1)
        )


def test_partials_are_half_width_only_under_the_row_merge():
    """Measured: 2-byte partials pay under the row merge (bandwidth-bound), not under the column
    merge; fp32 inputs keep fp32 partials; a caller's choice wins."""
    for dt in (torch.bfloat16, torch.float16):
        assert partials_dtype(dt, "rows") == dt
        assert partials_dtype(dt, "columns") == torch.float32
        assert partials_dtype(dt, "columns", "input") == dt and partials_dtype(dt, "rows", "fp32") == torch.float32
    assert partials_dtype(torch.float32, "rows") == partials_dtype(torch.float32, "rows", "input") == torch.float32


# ---- Triton interpreter (subprocess) ----


def interpreted_cases(dtype_name: str) -> None:
    dtype = getattr(torch, dtype_name)
    atol = 2e-3 if dtype == torch.float16 else 1e-5
    for name, t, h, d, dv, r, k, with_len, with_sinks, splits in CASES:
        q, kv, rows, tlen, sinks = make_inputs(t, h, d, r, k, with_len, with_sinks, dtype)
        out, lse = run_sparse_mla_decode(
            q, kv, rows, scale=0.2, v_dim=dv, topk_length=tlen, sinks=sinks, num_splits=splits, kernel="triton"
        )
        ref_out, ref_lse = sparse_mla_oracle(q, kv, rows, scale=0.2, v_dim=dv, topk_length=tlen, sinks=sinks)
        assert out.shape == ref_out.shape and out.dtype == q.dtype, name
        torch.testing.assert_close(out.float(), ref_out.float(), atol=atol, rtol=0, msg=name)
        assert_same_lse(lse, ref_lse.float(), atol=1e-4)
    # rows_unique=True skips the de-duplication; on unique rows the result is the same
    g = torch.Generator().manual_seed(1)
    q, kv = torch.randn(2, 16, 48, generator=g).to(dtype), torch.randn(90, 48, generator=g).to(dtype)
    rows = torch.stack([torch.randperm(90, generator=g)[:70] for _ in range(2)]).int()
    rows[1, 5:9] = -1
    out, lse = run_sparse_mla_decode(q, kv, rows, scale=0.2, v_dim=32, rows_unique=True, num_splits=2, kernel="triton")
    ref_out, ref_lse = sparse_mla_oracle(q, kv, rows, scale=0.2, v_dim=32)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=atol, rtol=0)
    assert_same_lse(lse, ref_lse.float(), atol=1e-4)
    # the row merge (fp16 inputs: half-width partials) and the column merge give the oracle's result
    q, kv, rows, tlen, sinks = make_inputs(3, 20, 48, 50, 70, True, True, dtype)
    ref_out, ref_lse = sparse_mla_oracle(q, kv, rows, scale=0.2, v_dim=32, topk_length=tlen, sinks=sinks)
    for merge in ("rows", "columns"):
        out, lse = run_sparse_mla_decode(
            q,
            kv,
            rows,
            scale=0.2,
            v_dim=32,
            topk_length=tlen,
            sinks=sinks,
            num_splits=3,
            config={"merge": merge},
            kernel="triton",
        )
        torch.testing.assert_close(out.float(), ref_out.float(), atol=atol, rtol=0, msg=merge)
        assert_same_lse(lse, ref_lse.float(), atol=1e-4)
    # lists of 1 to 3 entries over a 3-row cache: a repeated row is one key (the kernel's input
    # de-duplicated at every length), invalid entries anywhere, rows with no key, topk_length, sinks;
    # a workspace of exactly the splits' partials is enough
    for k in (1, 2, 3):
        q, kv = torch.randn(6, 16, 48, generator=g).to(dtype), torch.randn(3, 48, generator=g).to(dtype)
        rows = torch.randint(-1, 4, (6, k), generator=g, dtype=torch.int32)
        rows[0], rows[1] = 2, -1
        if k > 1:
            rows[2, -2:] = torch.tensor([0, 0])
        tlen, sinks = torch.tensor([k, 0, k, 1, k + 1, k - 1], dtype=torch.int32), torch.randn(16, generator=g)
        launch = decode_launch(6, 16, k, 132, 2, None, head_dim=48, v_dim=32, elem_bytes=q.element_size())
        ws = torch.full((split_partials_numel(launch["num_splits"], 6, 16, 32),), float("nan"))
        for kw in (dict(topk_length=None, sinks=None), dict(topk_length=tlen, sinks=sinks)):
            out, lse = run_sparse_mla_decode(
                q, kv, rows, scale=0.2, v_dim=32, num_splits=2, workspace=ws, kernel="triton", **kw
            )
            ref_out, ref_lse = sparse_mla_oracle(q, kv, rows, scale=0.2, v_dim=32, **kw)
            torch.testing.assert_close(out.float(), ref_out.float(), atol=atol, rtol=0, msg=f"K={k}")
            assert_same_lse(lse, ref_lse.float(), atol=1e-4)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype_name", ["float16", "float32"])
def test_triton_kernel_matches_reference_under_interpreter(dtype_name):
    pytest.importorskip("triton", reason="the Triton kernel needs triton")
    run_interpreted(__name__, "interpreted_cases", dtype_name)


def interpreted_merge_cases(dtype_name: str) -> None:
    """Both merges (column, row; forced) against the fp64 oracle:
    invalid rows anywhere, a token with no valid key, topk_length, sinks, head and row tails,
    a split whose every row is invalid; the partials' workspace poisoned with NaN first."""
    dtype = getattr(torch, dtype_name)
    atol = 2e-3 if dtype == torch.float16 else 1e-5
    one = ("one_token_all_splits_but_one_empty", 1, 16, 40, 24, 200, 190, False, False, 3)
    for name, t, h, d, dv, r, k, with_len, with_sinks, splits in [*CASES, one]:
        q, kv, rows, tlen, sinks = make_inputs(t, h, d, r, k, with_len, with_sinks, dtype)
        if t == 1:
            rows = torch.randperm(r, generator=torch.Generator().manual_seed(3))[:k].int()[None]
            rows[0, 64:] = -1  # splits 2 and 3 see no key: (0, -inf) partials merge away
        ref_out, ref_lse = sparse_mla_oracle(q, kv, rows, scale=0.2, v_dim=dv, topk_length=tlen, sinks=sinks)
        cfg = sparse_mla_decode_config(t, h, k, 132, splits, head_dim=d, v_dim=dv)
        assert cfg["merge"] in ("columns", "none"), (name, cfg)  # tiny shapes route the column merge
        for merge in ("columns", "rows"):
            ws = torch.full((64 * t * h * (dv + 1),), float("nan"))
            out = torch.full((t, h, dv), float("nan"), dtype=dtype)
            lse = torch.full((t, h), float("nan"))
            run_sparse_mla_decode(
                q, kv, rows, scale=0.2, v_dim=dv, topk_length=tlen, sinks=sinks, num_splits=splits,
                config={"merge": merge}, out=out, lse_out=lse, workspace=ws, rows_unique=t == 1, kernel="triton",
            )  # fmt: skip
            torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=0, msg=f"{name} {merge}")
            assert_same_lse(lse.double(), ref_lse, atol=1e-4)
            print("ok", name, merge)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype_name", ["float16", "float32"])
def test_column_and_row_merges_match_the_oracle_under_interpreter(dtype_name):
    pytest.importorskip("triton", reason="the Triton kernel needs triton")
    out = run_interpreted(__name__, "interpreted_merge_cases", dtype_name)
    assert out.count("ok ") == 2 * (len(CASES) + 1)


# ---- GPU: real shapes, poisoned outputs ----


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [128, 16])
@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize("splits", [None, 1, 7])
def test_triton_kernel_on_gpu(heads, tokens, splits):
    q, kv, rows, tlen, sinks = make_inputs(
        tokens, heads, 576, 40000, 2048, True, tokens == 5, dtype=torch.bfloat16, device="cuda"
    )
    out = torch.full((tokens, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((tokens, heads), float("nan"), device="cuda")
    run_sparse_mla_decode(
        q, kv, rows, scale=576**-0.5, topk_length=tlen, sinks=sinks, num_splits=splits, out=out, lse_out=lse,
        kernel="triton",
    )  # fmt: skip
    ref_out, ref_lse = sparse_mla_reference(q, kv, rows, scale=576**-0.5, topk_length=tlen, sinks=sinks)
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=0)
    assert_same_lse(lse, ref_lse, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("heads, tokens", [(16, 1), (16, 8), (128, 1), (128, 8)])
def test_routed_merge_on_gpu_matches_reference_and_replays_exactly(heads, tokens):
    """Real shapes (top-k 2048 of 2^16 rows, bf16, D 576 / Dv 512): the routed merge (column merge
    where the config says so) against the fp32 reference, with sinks and topk_length; repeated
    calls give the same bits; the forced row merge agrees."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    q, kv, rows, tlen, sinks = make_inputs(tokens, heads, 576, 1 << 16, 2048, True, True, torch.bfloat16, "cuda")
    ref_out, ref_lse = sparse_mla_reference(q, kv, rows, scale=576**-0.5, topk_length=tlen, sinks=sinks)
    cfg = sparse_mla_decode_config(tokens, heads, 2048, torch.cuda.get_device_properties(0).multi_processor_count)
    outs = []
    for kw in ({}, {}, {"config": {"merge": "rows"}}):
        out = torch.full((tokens, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((tokens, heads), float("nan"), device="cuda")
        run_sparse_mla_decode(
            q, kv, rows, scale=576**-0.5, topk_length=tlen, sinks=sinks, out=out, lse_out=lse, kernel="triton", **kw
        )  # fmt: skip
        assert not out.isnan().any() and not lse.isnan().any(), cfg
        torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=0)
        assert_same_lse(lse, ref_lse, atol=1e-3)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@pytest.mark.parametrize("heads, tokens", [(16, 1), (16, 8), (128, 8)])
def test_programmatic_dependent_launch_changes_no_bit(heads, tokens):
    """The split kernel and its merge launched as programmatic dependent launches (the default
    where the GPU has them) give the same bits as plain launches, eagerly and from a CUDA graph
    replayed on new inputs each time: a merge that read the partials before the split kernel had
    written them all would differ."""
    from shardattn.ops.dispatch import pdl_supported

    if not torch.cuda.is_available() or not pdl_supported(torch.device("cuda")):
        pytest.skip("needs a GPU with programmatic dependent launch (sm_90+)")
    q, kv, rows, tlen, sinks = make_inputs(tokens, heads, 576, 1 << 16, 2048, True, True, torch.bfloat16, "cuda")
    out = torch.full((tokens, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((tokens, heads), float("nan"), device="cuda")

    def step(pdl: bool):
        run_sparse_mla_decode(
            q, kv, rows, scale=576**-0.5, topk_length=tlen, sinks=sinks, out=out, lse_out=lse, kernel="triton",
            rows_unique=False, config={"pdl": pdl},
        )  # fmt: skip
        return out.clone(), lse.clone()

    plain = step(False)
    assert all(torch.equal(a, b) for a, b in zip(step(True), plain))

    def routed() -> None:  # the default configuration: PDL on this GPU
        sparse_mla_decode(
            q, kv, rows, scale=576**-0.5, topk_length=tlen, sinks=sinks, out=out, lse_out=lse, backend="triton",
            rows_unique=False,
        )  # fmt: skip

    graph = DecodeGraph(routed, {})  # warmed up on a side stream, then captured
    gen = torch.Generator(device="cuda").manual_seed(3)
    for _ in range(20):
        q.copy_(torch.randn(q.shape, generator=gen, device="cuda"))
        rows.copy_(torch.randint(-2, kv.shape[0], rows.shape, generator=gen, device="cuda", dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        got = (out.clone(), lse.clone())
        want = step(False)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
