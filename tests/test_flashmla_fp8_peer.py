"""The FlashMLA FP8 decode peer's boundary conversions (benchmarks/peer/flashmla_fp8_decode.py), on
the CPU: the peer itself needs its library and an sm_90 GPU (benchmarks/decode_fp8_peer.py checks
it there against the reference), so what can rot unnoticed here is the conversion of shardattn's
tensors to FlashMLA's and back."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

PEER = Path(__file__).resolve().parents[1] / "benchmarks" / "peer" / "flashmla_fp8_decode.py"


@pytest.fixture(scope="module")
def peer():
    spec = importlib.util.spec_from_file_location("flashmla_fp8_decode", PEER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.mark.parametrize("topk", [1, 63, 64, 65, 2048])
def test_indices_mask_every_invalid_entry_and_pad_to_blocks_of_64(peer, topk: int) -> None:
    g = torch.Generator().manual_seed(topk)
    rows = torch.randint(-3, 40, (5, topk), generator=g, dtype=torch.int32)
    rows[0] = 2**31 - 1
    idx = peer.peer_indices(rows, 37)
    assert idx.dtype == torch.int32 and idx.shape == (5, -(-topk // 64) * 64)
    for t in range(5):
        for k in range(idx.shape[1]):
            r = int(rows[t, k]) if k < topk else -1
            assert int(idx[t, k]) == (r if 0 <= r < 37 else -1)


def test_heads_and_cache_geometry(peer) -> None:
    assert [peer.peer_heads(h) for h in (1, 16, 64, 65, 128)] == [64, 64, 64, 128, 128]
    with pytest.raises(ValueError, match="up to 128 heads"):
        peer.peer_heads(129)
    padded = torch.zeros(3, 5, 656, dtype=torch.uint8)[:, :4]
    assert peer.cache_geometry(padded) == (3, 4, 5 * 656)
    assert peer.cache_geometry(torch.zeros(10, 656, dtype=torch.uint8)) == (10, 1, 656)
    with pytest.raises(ValueError, match="page's rows contiguous"):
        peer.cache_geometry(torch.zeros(4, 3, 656, dtype=torch.uint8).transpose(0, 1))
    with pytest.raises(ValueError, match=r"cache must be uint8 .*fp8_ds_mla"):
        peer.cache_geometry(torch.zeros(10, 576, dtype=torch.bfloat16))


def test_result_turns_flashmla_empty_rows_into_the_merge_identity(peer) -> None:
    out = torch.zeros(2, 64, 512, dtype=torch.bfloat16)
    lse = torch.full((2, 64), 1.5)
    lse[1] = math.inf  # FlashMLA's LSE of a row with no valid key
    call = peer.PeerCall(launch=None, heads=16, out=out, lse=lse, keep=())
    o, s = call.result()
    assert o.shape == (2, 16, 512) and s.shape == (2, 16)
    assert s[0].eq(1.5).all() and torch.isneginf(s[1]).all()
