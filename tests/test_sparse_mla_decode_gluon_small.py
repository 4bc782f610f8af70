"""The small-batch Gluon decode kernel (sm_90): routing, tiles, warm-up sizes and argument checks
(CPU), its sm_90 compile (CPU, ahead of time), and on an sm_90 GPU the kernel against the fp32
reference and the fp64 oracle at real shapes (NaN-poisoned outputs, invalid rows anywhere, a
split and a token with no key, ``topk_length`` 0 / short, sinks, tails of the top-k, fewer heads
than the tile, fp16), one split written directly, a workspace too small, and CUDA-graph replay."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from shardattn.kernels.gluon.sparse_mla_decode_small import (
    LATENT_CHUNKS,
    MAX_HEADS,
    MAX_SPLITS,
    compile_for_sm90,
    small_decode_limits,
    small_decode_unsupported_reason,
    small_decode_warps,
)
from shardattn.kernels.triton.lse_merge import split_partials_numel
from shardattn.ops.dispatch import sparse_decode_kernel
from shardattn.ops.sparse_mla import sparse_mla_reference
from shardattn.ops.sparse_mla_decode import run_sparse_mla_decode, sparse_mla_decode
from shardattn.plan.crossovers import SMALL_DECODE_HEAD_GROUP as HEAD_GROUP
from shardattn.plan.crossovers import SMALL_MERGE_COLUMNS, SMALL_MERGE_WARPS
from shardattn.plan.decode_routing import (
    SMALL_DECODE_MAX_HEADS,
    SMALL_DECODE_MAX_TOKENS,
    route_sparse_decode_kernel,
    small_decode_heads,
    small_decode_tiles,
)
from shardattn.runtime.decode_warmup import small_kernel_sizes
from shardattn.runtime.graph_capture import DecodeGraph
from tests.oracle import sparse_mla_oracle
from tests.test_sparse_mla_decode_gluon import SCALE, _check, _gpu_case, needs_sm90

# ---- routing, tiles, warm-up sizes (CPU) ----


def test_routing_sends_small_calls_on_sm90_to_the_small_kernel_and_says_why():
    assert SMALL_DECODE_MAX_HEADS == MAX_HEADS  # the routing's bound is the kernel's tile
    for t in range(1, SMALL_DECODE_MAX_TOKENS + 1):
        for h in (1, 8, SMALL_DECODE_MAX_HEADS):
            route = route_sparse_decode_kernel(h, num_tokens=t, sm=90, small_missing=None)
            assert route.path == "gluon_small" and "small-batch" in route.reason and "measured" in route.reason
    beyond = route_sparse_decode_kernel(16, num_tokens=SMALL_DECODE_MAX_TOKENS + 1, sm=90, small_missing=None)
    assert beyond.path == "triton"
    assert route_sparse_decode_kernel(SMALL_DECODE_MAX_HEADS + 1, num_tokens=1, sm=90, small_missing=None).path == (
        "triton"
    )
    assert route_sparse_decode_kernel(16, num_tokens=0, sm=90, small_missing=None).path == "triton"
    assert route_sparse_decode_kernel(16, num_tokens=None, sm=90, small_missing=None).path == "triton"
    assert route_sparse_decode_kernel(16, num_tokens=4, sm=90).path == "triton"  # callers that do not ask
    assert route_sparse_decode_kernel(16, num_tokens=4, sm=90, small_missing="top-k 9000").path == "triton"
    assert route_sparse_decode_kernel(16, num_tokens=4, sm=100, small_missing=None).path == "triton"
    assert route_sparse_decode_kernel(16, num_tokens=4, sm=90, gluon_missing="no gluon").path == "triton"
    assert route_sparse_decode_kernel(16, num_tokens=4, device_type="cpu", small_missing=None).path == "reference"
    with pytest.raises(ValueError, match="small_max_tokens"):
        route_sparse_decode_kernel(16, num_tokens=4, sm=90, small_missing=None, small_max_tokens=-1)


@pytest.mark.parametrize("kv_fp8", [False, True])
@pytest.mark.parametrize("sms", [132, 78])
def test_routing_passes_the_small_kernel_over_where_its_splits_exceed_a_wave_and_the_stream_can_run(kv_fp8, sms):
    """With the streaming kernel taking the call, one of at most 16 tokens goes to the small-batch kernel
    while its 128-entry splits' programs (tokens x ceil(top-k / 128)) fill one wave of the SMs, else to
    the streaming kernel, which says why; without it, to the small-batch kernel at every size."""
    for t, h, topk in itertools.product(range(1, SMALL_DECODE_MAX_TOKENS + 1), (8, 16), (256, 1000, 2048, 8192)):
        kw = {"num_tokens": t, "sm": 90, "small_missing": None, "topk": topk, "num_sms": sms, "kv_fp8": kv_fp8}
        route = route_sparse_decode_kernel(h, stream_missing=None, **kw)
        one_wave = t * -(-topk // 128) <= sms
        assert route.path == ("gluon_small" if one_wave else "gluon_stream"), (t, h, topk)
        if not one_wave:
            assert f"waves of {sms} SMs > 1" in route.reason and "not the small-batch kernel" in route.reason
        assert route_sparse_decode_kernel(h, stream_missing="no stream", **kw).path == "gluon_small"
        refused = route_sparse_decode_kernel(h, stream_missing=None, stream_min_blocks_per_sm=1e9, **kw)
        assert refused.path == "gluon_small"  # a streaming kernel that would not take the call passes nothing over
    assert route_sparse_decode_kernel(16, num_tokens=12, sm=90, small_missing=None, topk=2048).path == "gluon_small"


@pytest.mark.parametrize("kv_fp8", [False, True])
@pytest.mark.parametrize("sms", [132, 78, 16])
@pytest.mark.parametrize("topk", [1, 63, 64, 65, 100, 2048, 128 * MAX_SPLITS])
def test_tiles_cover_the_row_in_one_wave_of_64_entry_splits_or_use_128(sms, topk, kv_fp8):
    # 64-entry splits while their programs fill half the SMs (bf16 / fp16 rows) or all of them (FP8 rows)
    per_sm = 1 if kv_fp8 else 2
    for t in range(1, SMALL_DECODE_MAX_TOKENS + 1):
        block_n, splits = small_decode_tiles(t, topk, sms, kv_fp8=kv_fp8)
        assert block_n in (64, 128) and splits == -(-topk // block_n)
        assert (splits - 1) * block_n < topk <= splits * block_n  # every entry in exactly one split
        assert (block_n == 64) == (per_sm * t * -(-topk // 64) <= sms and -(-topk // 64) <= MAX_SPLITS)
        assert small_decode_warps(block_n) == block_n // 16  # one warpgroup per 64 entries
        assert splits <= MAX_SPLITS
        # the merge after it: one warp a program holds every split's partial of its columns, at
        # most 4,096 fp32 values (BLOCK_P x columns), 128 a thread
        block_p = max(2, 1 << (splits - 1).bit_length())
        per_program = SMALL_MERGE_COLUMNS * block_p
        assert per_program <= 4096 and per_program // (32 * SMALL_MERGE_WARPS) <= 128


@pytest.mark.parametrize("sms", [132, 78, 16])
@pytest.mark.parametrize("heads", [1, 3, 8, 9, 12, 16])
def test_heads_split_in_groups_of_8_only_while_the_programs_fit_one_wave(sms, heads):
    for topk in (64, 100, 2048, 128 * MAX_SPLITS):
        for t in range(1, SMALL_DECODE_MAX_TOKENS + 1):
            splits = small_decode_tiles(t, topk, sms)[1]
            group = small_decode_heads(t, splits, heads, sms)
            if heads <= HEAD_GROUP:
                assert group == heads  # one program holds them all (the 8-wide wgmma)
            else:
                assert group == (HEAD_GROUP if t * splits * 2 <= sms else heads)
    # at 16 heads, top-k 2048 on 132 SMs: two groups of 8 at 1-4 tokens (64-128 programs), one group from 5
    groups = [small_decode_heads(t, small_decode_tiles(t, 2048, 132)[1], 16, 132) for t in range(1, 9)]
    assert groups == [8, 8, 8, 8, 16, 16, 16, 16]
    # on FP8 rows 3-4 tokens keep 64-entry splits (96-128 programs): one group of 16
    groups = [small_decode_heads(t, small_decode_tiles(t, 2048, 132, kv_fp8=True)[1], 16, 132) for t in range(1, 9)]
    assert groups == [8, 8, 16, 16, 16, 16, 16, 16]


@pytest.mark.parametrize("kv_fp8", [False, True])
def test_warmup_sizes_reach_every_compiled_variant_the_routed_batches_use(kv_fp8):
    for topk, sms, most, heads in ((2048, 132, 64, 16), (2048, 132, 3, 16), (512, 132, 16, 16), (2048, 78, 16, 16),
                                   (100, 132, 16, 16), (2048, 132, 16, 8), (2048, 132, 16, 12)):  # fmt: skip
        sizes = small_kernel_sizes(topk, most, sms, heads, kv_fp8=kv_fp8)

        def variant(t, topk=topk, sms=sms, heads=heads):
            block_n, splits = small_decode_tiles(t, topk, sms, kv_fp8=kv_fp8)
            return block_n, small_decode_heads(t, splits, heads, sms)

        used = {variant(t) for t in range(1, min(most, SMALL_DECODE_MAX_TOKENS) + 1)}
        assert {variant(t) for t in sizes} == used
        assert min(sizes) == 1 and max(sizes) <= min(most, SMALL_DECODE_MAX_TOKENS)


def test_support_names_what_the_kernel_does_not_take():
    q, kv = torch.zeros(2, MAX_HEADS, 576), torch.zeros(4, 576)
    rows = torch.zeros(2, 2048, dtype=torch.int32)
    assert small_decode_limits(q, rows) is None
    assert "at most 16 heads" in small_decode_limits(torch.zeros(2, MAX_HEADS + 1, 576), rows)
    assert "top-k 0" in small_decode_limits(q, rows[:, :0])
    assert small_decode_limits(q, torch.zeros(2, 128 * MAX_SPLITS, dtype=torch.int32)) is None
    too_many = torch.zeros(2, 128 * MAX_SPLITS + 1, dtype=torch.int32)
    assert f"top-k {128 * MAX_SPLITS + 1}" in small_decode_limits(q, too_many)
    assert small_decode_unsupported_reason(q, kv, rows, 512) is not None  # CPU tensors: the Gluon rules refuse first


def test_backend_argument_checks_on_cpu():
    q, kv = torch.zeros(2, 16, 576), torch.zeros(4, 576)
    rows = torch.zeros(2, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="'gluon_small' cannot run here"):
        sparse_mla_decode(q, kv, rows, scale=0.1, backend="gluon_small")
    with pytest.raises(ValueError, match="chooses its own splits"):
        run_sparse_mla_decode(q, kv, rows, scale=0.1, kernel="gluon_small", num_splits=2)
    with pytest.raises(ValueError, match="takes none"):
        run_sparse_mla_decode(q, kv, rows, scale=0.1, kernel="gluon_small", config={"merge": "rows"})
    with pytest.raises(ValueError, match="'gluon_small'"):
        sparse_mla_decode(q, kv, rows, scale=0.1, backend="cuda")
    assert sparse_decode_kernel(q, kv, 512, rows)[0] == "reference"


def test_a_head_group_out_of_range_is_refused_before_any_launch():
    from shardattn.kernels.gluon.sparse_mla_decode_small import launch_small_split

    q, kv, rows = torch.zeros(1, 16, 576), torch.zeros(4, 576), torch.zeros(1, 64, dtype=torch.int32)
    out, lse = torch.zeros(1, 16, 512), torch.zeros(1, 16)
    for bad in (0, 17, -8, 4.0):
        with pytest.raises(ValueError, match=f"heads_per_program must be an int in \\[1, 16\\]; got {bad!r}"):
            launch_small_split(q, kv, rows, None, None, out, lse, 64, 1, 0.1, False, heads_per_program=bad)
        with pytest.raises(ValueError, match="heads_per_program must be an int"):
            compile_for_sm90(64, heads_per_program=bad)


# ---- the sm_90 compile (CPU, ahead of time) ----


@pytest.mark.parametrize(
    ("block_n", "split", "even_k", "with_len", "sinks", "dtype", "group"),
    [
        (64, True, True, False, False, "bf16", 16),
        (128, True, True, True, True, "bf16", 16),
        (64, False, False, True, True, "fp16", 16),
        (128, True, False, False, False, "bf16", 16),
        (64, True, True, True, True, "bf16", 8),  # a group of 8 heads: the 8-wide wgmma
        (128, True, False, False, False, "bf16", 8),
        (64, False, True, False, True, "fp16", 3),
    ],
)
def test_kernel_compiles_for_sm90_with_wgmma_cp_async_and_pdl(block_n, split, even_k, with_len, sinks, dtype, group):
    from shardattn.kernels.gluon.sparse_mla import gluon_available, gluon_unavailable_reason

    if not gluon_available():
        pytest.skip(gluon_unavailable_reason())
    compiled = compile_for_sm90(
        block_n, split=split, even_k=even_k, topk_length=with_len, sinks=sinks, dtype=dtype, heads_per_program=group,
    )  # fmt: skip
    ptx = compiled.asm["ptx"]
    width = 8 if group <= 8 else 16  # the heads as the wgmma's N
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))
    assert shapes == {f"m64n{width}k16"}
    groups = small_decode_warps(block_n) // 4
    assert compiled.metadata.num_warps == 4 * groups
    # S^T: one 64-row M tile per 64 entries x 36 k-steps of 16 (576 columns); O^T: 8 M tiles x block_n / 16;
    # with two warpgroups each issues half of the M tiles (the PTX is one warpgroup's)
    assert ptx.count("wgmma.mma_async") == (block_n // 64 // groups) * 36 + (8 // groups) * (block_n // 16)
    assert ptx.count("cp.async.cg.shared.global") > 0  # 16-byte gathers, not element loads
    assert ptx.count("griddepcontrol.wait") == 1 and ptx.count("griddepcontrol.launch_dependents") == 1
    assert compiled.metadata.shared <= 232448  # fits an sm_90 SM
    # Q and the rope columns, then the latent columns in LATENT_CHUNKS groups, waited for in turn,
    # with no wgmma wait between the chunks' Q.K^T (it runs while later chunks arrive)
    assert ptx.count("cp.async.commit_group") == 1 + LATENT_CHUNKS
    waits = re.findall(r"cp\.async\.wait_group\s+(\d+);", ptx)
    assert [int(w) for w in waits] == list(range(LATENT_CHUNKS, -1, -1))
    first_wait, last_wait = ptx.index("cp.async.wait_group"), ptx.rindex("cp.async.wait_group")
    assert "wgmma.wait_group" not in ptx[first_wait:last_wait]
    if split:
        assert "st.global.v4.b32" in ptx  # fp32 partials stored 16 bytes a thread


# ---- on an sm_90 GPU ----


def _small_case(tokens, heads, seed, k=2048, dtype=torch.bfloat16):
    """``_gpu_case``'s inputs with each token's valid rows made unique (an indexer's top-k: what
    ``rows_unique=True`` promises), its invalid entries kept where they were."""
    q, kv, rows, length, sinks = _gpu_case(tokens, 16, seed, k=k)
    r = kv.shape[0]
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    unique = torch.argsort(torch.rand(tokens, r, device="cuda", generator=gen), dim=1)[:, :k].int()
    rows = torch.where((rows < 0) | (rows >= r), rows, unique)
    q = q[:, :heads].contiguous().to(dtype)
    kv = kv.to(dtype)
    if k >= 256 and tokens > 3:
        rows[3, 128:256] = -1  # a whole 128-entry split (two 64-entry ones) with no key; the rest has keys
    return q, kv, rows, length, sinks[:heads].contiguous()


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(
    ("tokens", "heads", "k", "with_len", "with_sinks", "dtype"),
    [
        (1, 16, 2048, False, False, torch.bfloat16),
        (2, 16, 2048, True, True, torch.bfloat16),
        (4, 16, 2048, True, False, torch.bfloat16),
        (3, 16, 2048, False, True, torch.bfloat16),  # 128-entry splits on two warpgroups
        (5, 16, 2048, False, True, torch.bfloat16),
        (8, 16, 2048, True, True, torch.bfloat16),
        (16, 16, 2048, True, False, torch.bfloat16),  # two waves of splits: routed to the streaming kernel
        (6, 8, 1000, True, True, torch.bfloat16),  # fewer heads than the tile; a top-k tail
        (4, 3, 200, False, True, torch.float16),
        (3, 16, 64, True, True, torch.bfloat16),  # one split: the result written directly
        (2, 12, 2048, True, True, torch.bfloat16),  # two groups of heads: 8 and 4
        (1, 9, 1000, False, True, torch.bfloat16),  # two groups: 8 and 1; a top-k tail
        (1, 16, 8192, True, True, torch.bfloat16),  # MAX_SPLITS splits of 128: the one-warp merge's widest
        (2, 16, 8192, False, False, torch.bfloat16),
    ],
)
def test_small_kernel_matches_reference(tokens, heads, k, with_len, with_sinks, dtype):
    q, kv, rows, length, sinks = _small_case(tokens, heads, seed=tokens * 31 + heads + k, k=k, dtype=dtype)
    length = length.clamp(max=k) if with_len else None
    sinks = sinks if with_sinks else None
    one_wave = tokens * -(-k // 128) <= torch.cuda.get_device_properties(q.device).multi_processor_count
    assert sparse_decode_kernel(q, kv, 512, rows)[0] == ("gluon_small" if one_wave else "gluon_stream")
    out = torch.full((tokens, heads, 512), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((tokens, heads), float("nan"), device=q.device)
    sparse_mla_decode(
        q, kv, rows, scale=SCALE, topk_length=length, sinks=sinks, out=out, lse_out=lse, rows_unique=True,
        backend="gluon_small",
    )  # fmt: skip
    ref_o, ref_l = sparse_mla_reference(q, kv, rows, scale=SCALE, topk_length=length, sinks=sinks)
    _check(out, lse, ref_o, ref_l)
    check_empty_rows_and_oracle(out, lse, q, kv, rows, length, sinks, oracle=tokens == 1)


def check_empty_rows_and_oracle(out, lse, q, kv, rows, length, sinks, *, oracle):
    """On ``_gpu_case``'s inputs: the token with no key gives ``(0, -inf)`` (``(0, sink)`` with
    sinks), the token of ``topk_length`` 0 gives 0, and with ``oracle`` the whole call matches the
    independent fp64 oracle."""
    tokens, heads = q.shape[:2]
    if tokens > 2:
        empty = sinks if sinks is not None else torch.full((heads,), float("-inf"), device=q.device)
        assert (out[tokens // 2] == 0).all()  # no key at all: (0, -inf), or (0, sink) with sinks
        torch.testing.assert_close(lse[tokens // 2], empty.float(), atol=1e-5, rtol=1e-6)
    if length is not None and tokens > 2:
        assert (out[1] == 0).all()  # topk_length 0
    if oracle:  # the independent fp64 oracle, on the whole call
        o64, l64 = sparse_mla_oracle(q, kv, rows, scale=SCALE, v_dim=512, topk_length=length, sinks=sinks)
        torch.testing.assert_close(out.double().cpu(), o64, atol=2e-2, rtol=0)
        torch.testing.assert_close(lse.double().cpu(), l64, atol=1e-4, rtol=0)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(
    ("tokens", "group"), [(2, 8), (8, 16), (2, 16), (8, 8), (5, 4), (2, 5)],
)  # fmt: skip
def test_every_head_group_matches_reference(tokens, group):
    """Head groups the routing does not take at that batch (one group at 2 tokens; 8, 5 or 4 heads
    a program where it takes 16): the same result through the column merge, invalid rows and an
    empty split included."""
    from shardattn.kernels.gluon.sparse_mla_decode_small import launch_small_split
    from shardattn.kernels.triton.lse_merge import launch_lse_merge_columns, split_partials

    q, kv, rows, length, sinks = _small_case(tokens, 16, seed=70 + tokens * group)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    block_n, splits = small_decode_tiles(tokens, rows.shape[1], sms)
    part, part_lse = split_partials(None, splits, tokens, 16, 512, q.device)
    out = torch.full((tokens, 16, 512), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((tokens, 16), float("nan"), device=q.device)
    launch_small_split(
        q, kv, rows, length, sinks, part, part_lse, block_n, splits, SCALE, False, heads_per_program=group,
    )  # fmt: skip
    launch_lse_merge_columns(part, part_lse, out, lse)
    _check(out, lse, *sparse_mla_reference(q, kv, rows, scale=SCALE, topk_length=length, sinks=sinks))


@pytest.mark.gpu
@needs_sm90
def test_small_kernel_matches_triton_on_the_union_path_and_with_duplicates():
    """Default ``rows_unique=False``: duplicates are one key (the rows are de-duplicated first);
    the result equals the Triton kernel's on the same call."""
    q, kv, rows, length, sinks = _small_case(4, 16, seed=3)
    rows[0, 1000:1100] = rows[0, 0:100]
    got = sparse_mla_decode(q, kv, rows, scale=SCALE, topk_length=length, sinks=sinks, backend="gluon_small")
    tri = sparse_mla_decode(q, kv, rows, scale=SCALE, topk_length=length, sinks=sinks, backend="triton")
    ref = sparse_mla_reference(q, kv, rows, scale=SCALE, topk_length=length, sinks=sinks)
    _check(*got, *ref)
    assert ((got[0].float() - tri[0].float()).norm() / tri[0].float().norm()).item() < 1e-2
    assert torch.equal(torch.isneginf(got[1]), torch.isneginf(tri[1]))


@pytest.mark.gpu
@needs_sm90
def test_a_workspace_too_small_runs_triton_when_routed_and_raises_when_forced():
    from shardattn.kernels.triton.sparse_mla_decode_config import sparse_mla_decode_config

    tokens = SMALL_DECODE_MAX_TOKENS
    q, kv, rows, length, sinks = _small_case(tokens, 16, seed=9)
    ref = sparse_mla_reference(q, kv, rows, scale=SCALE, topk_length=length, sinks=sinks)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = small_decode_tiles(tokens, 2048, sms)[1]
    tri_splits = sparse_mla_decode_config(tokens, 16, 2048, sms)["num_splits"]
    too_small = torch.empty(split_partials_numel(splits - 1, tokens, 16, 512), device="cuda")
    with pytest.raises(ValueError, match="small-batch kernel"):
        sparse_mla_decode(q, kv, rows, scale=SCALE, rows_unique=True, workspace=too_small, backend="gluon_small")
    if tri_splits < splits:  # routed: the Triton kernel's own split count fits, so it runs
        ws = torch.full((split_partials_numel(tri_splits, tokens, 16, 512),), float("nan"), device="cuda")
        out, lse = sparse_mla_decode(
            q, kv, rows, scale=SCALE, topk_length=length, sinks=sinks, rows_unique=True, workspace=ws
        )
        _check(out, lse, *ref)
    ws = torch.full((split_partials_numel(splits, tokens, 16, 512),), float("nan"), device="cuda")
    out, lse = sparse_mla_decode(q, kv, rows, scale=SCALE, topk_length=length, sinks=sinks, rows_unique=True,
                                 workspace=ws)  # fmt: skip
    _check(out, lse, *ref)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("tokens", [1, 8])
def test_small_kernel_graph_capture_replays_bitwise(tokens):
    q, kv, rows, length, sinks = _small_case(tokens, 16, seed=41)
    s_q, s_rows, s_len = q.clone(), rows.clone(), length.clone()
    out = torch.empty(tokens, 16, 512, dtype=q.dtype, device="cuda")
    lse = torch.empty(tokens, 16, device="cuda")
    assert sparse_decode_kernel(q, kv, 512, rows)[0] == "gluon_small"

    def step():
        sparse_mla_decode(s_q, kv, s_rows, scale=SCALE, topk_length=s_len, sinks=sinks, out=out, lse_out=lse,
                          rows_unique=True)  # fmt: skip

    graph = DecodeGraph(step, {})  # warmed up on a side stream, then captured
    for seed in (51, 52):  # new inputs copied into the static buffers, outputs poisoned
        q2, _, rows2, len2, _ = _small_case(tokens, 16, seed=seed)
        s_q.copy_(q2), s_rows.copy_(rows2), s_len.copy_(len2)
        out.fill_(float("nan")), lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager_o, eager_l = sparse_mla_decode(q2, kv, rows2, scale=SCALE, topk_length=len2, sinks=sinks,
                                             rows_unique=True)  # fmt: skip
        assert torch.equal(out, eager_o) and torch.equal(lse, eager_l)
        _check(out, lse, *sparse_mla_reference(q2, kv, rows2, scale=SCALE, topk_length=len2, sinks=sinks))
