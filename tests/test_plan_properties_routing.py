"""Property tests of the routes: deterministic, reasons that name the deciding numbers, and never a
kernel that cannot run the shape (checked against the kernels' own limits on the CPU)."""

from __future__ import annotations

import copy
import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from shardattn.kernels.gluon.sparse_mla import BLOCK_H
from shardattn.kernels.triton.sparse_mla import tile_config
from shardattn.plan.decode_routing import (
    SMALL_DECODE_MAX_SPLITS,
    route_decode_merge,
    route_sparse_decode_kernel,
    small_decode_heads,
    small_decode_tiles,
)
from shardattn.plan.routing import (
    GROUP_SIZES,
    MAX_GROUPED_KV_ROWS,
    prefill_group_size,
    route_prefill,
    route_prefill_kernel,
)

heads = st.integers(1, 256)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    h=heads, tokens=st.integers(0, 1 << 20), rows=st.integers(0, 1 << 26), min_tokens=st.integers(0, 4096),
    gluon=st.booleans(), device=st.sampled_from(["cuda", "cpu"]), sm=st.sampled_from([None, 80, 90, 100]),
)  # fmt: skip
def test_prefill_routes_are_deterministic_and_runnable(h, tokens, rows, min_tokens, gluon, device, sm) -> None:
    args = dict(num_tokens=tokens, kv_rows=rows, device_type=device, min_tokens=min_tokens, gluon=gluon)
    route = route_prefill(h, **args)
    assert route == route_prefill(h, **copy.deepcopy(args)) == pickle.loads(pickle.dumps(route))  # every rank alike
    g = route.group_size
    if route.path == "grouped":
        assert g in GROUP_SIZES and rows < MAX_GROUPED_KV_ROWS and tokens >= min_tokens
        assert f"{h} heads" in route.reason and str(g) in route.reason
        # the workspace reserves the union for the largest G a device routes: this one fits it
        assert g <= (prefill_group_size(h, gluon=True) or 1)
    else:
        assert g == 1
    if route.path == "per-query" and tokens < min_tokens and rows < MAX_GROUPED_KV_ROWS:
        assert f"{tokens} tokens < min_tokens={min_tokens}" in route.reason
    kernel = route_prefill_kernel(h, device_type=device, sm=sm, group_size=g)
    assert kernel == route_prefill_kernel(h, device_type=device, sm=sm, group_size=g)
    if kernel.path == "gluon" and g > 1:  # launch_gluon_attention's own check
        assert h <= BLOCK_H // g
    if kernel.path in ("triton", "gluon"):  # the Triton tile: 16 to 64 rows, G <= 8 membership bits
        tile = tile_config(h, g)
        assert 16 <= tile.group_size * tile.block_h <= 64 or g == 1
        assert tile.group_size <= 8


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    h=heads, tokens=st.one_of(st.none(), st.integers(0, 4096)), topk=st.one_of(st.none(), st.integers(0, 1 << 15)),
    fp8=st.booleans(), small=st.booleans(), stream=st.booleans(), sms=st.integers(1, 264),
)  # fmt: skip
def test_decode_routes_are_deterministic_and_name_their_numbers(h, tokens, topk, fp8, small, stream, sms) -> None:
    small_missing = None if small and topk is not None and 1 <= topk <= 128 * SMALL_DECODE_MAX_SPLITS else "no"
    args = dict(
        num_tokens=tokens, sm=90, topk=topk, num_sms=sms, kv_fp8=fp8, small_missing=small_missing,
        stream_missing=None if stream else "no",
    )  # fmt: skip
    route = route_sparse_decode_kernel(h, **args)
    assert route == route_sparse_decode_kernel(h, **copy.deepcopy(args))
    assert str(h) in route.reason
    if route.path == "gluon_small":
        assert small_missing is None and tokens is not None and tokens >= 1 and h <= 16
        block_n, splits = small_decode_tiles(tokens, topk, sms, kv_fp8=fp8)
        assert block_n in (64, 128) and splits * block_n >= topk and splits <= SMALL_DECODE_MAX_SPLITS
        assert 1 <= small_decode_heads(tokens, splits, h, sms) <= max(h, 8)
    if route.path == "gluon_stream":
        assert stream and h <= 16 and ("fp8_ds_mla" in route.reason) == fp8
    if route.path == "triton" and "query rows" in route.reason:
        assert ("fp8_ds_mla" in route.reason) == fp8


@settings(max_examples=100, deadline=None, derandomize=True)
@given(tokens=st.integers(0, 4096), h=heads, splits=st.integers(1, 64))
def test_decode_merge_route_names_its_rows(tokens, h, splits) -> None:
    route = route_decode_merge(tokens, h, splits)
    assert route.path == "none" if splits == 1 else str(tokens * h) in route.reason
