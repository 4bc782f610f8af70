"""The references' softmax (``shardattn.ops.softmax_rows``) against an independent fp64 formulation
(``logsumexp`` over the logits with the sink as one more column) on fresh random logits: masked
keys anywhere, rows with no key, with and without sinks, a NaN logit."""

from __future__ import annotations

import math

import pytest
import torch

from shardattn.ops.softmax_rows import softmax_rows


@pytest.mark.parametrize("with_sink", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_weights_and_lse_equal_logsumexp_with_a_sink_column(seed: int, with_sink: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(5, 3, 17, generator=g, dtype=torch.float64) * 4
    logits[torch.rand(logits.shape, generator=g) < 0.4] = -math.inf  # masked keys anywhere
    logits[1, 2] = -math.inf  # a row with no key
    sink = torch.randn(5, 3, generator=g, dtype=torch.float64) if with_sink else None
    p, lse = softmax_rows(logits, sink)
    cols = logits if sink is None else torch.cat([logits, sink[..., None]], dim=-1)
    want_lse = torch.logsumexp(cols, dim=-1)
    safe = torch.where(torch.isfinite(want_lse), want_lse, torch.zeros_like(want_lse))
    want_p = torch.exp(logits - safe[..., None])
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(p, want_p, rtol=1e-12, atol=1e-12)
    if sink is None:
        assert lse[1, 2] == -math.inf and not p[1, 2].any()
    else:
        assert lse[1, 2] == sink[1, 2] and not p[1, 2].any()


def test_a_nan_logit_propagates_and_no_key_at_all_is_empty() -> None:
    logits = torch.tensor([[0.0, float("nan")], [1.0, 2.0]])
    p, lse = softmax_rows(logits, None)
    assert torch.isnan(lse[0]) and torch.isnan(p[0]).all() and torch.isfinite(lse[1])
    p, lse = softmax_rows(torch.empty(3, 0), torch.tensor([0.5, -math.inf, 0.0]))
    assert p.shape == (3, 0) and lse.tolist() == [0.5, -math.inf, 0.0]
