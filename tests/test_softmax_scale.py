"""The softmax scale is the model's: presets carry their models' values, ``Runtime(scale=...)``
overrides it, the launcher takes ``--softmax-scale``; sparse-MLA specs cannot silently fall back to
``head_dim ** -0.5`` (576 ** -0.5 = 0.0417, never a real MLA model's scale).

The expected values are computed here from the models' configs, not read from the library.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from shardattn.launch.cli import LaunchError, parse_options
from shardattn.launch.runner import plan_run
from shardattn.launch.workloads import build_decode
from shardattn.ops.topk import DcpShard
from shardattn.plan.spec import ModelSpec, get_preset, mla_softmax_scale
from shardattn.runtime.runtime import Runtime
from tests.oracle import sparse_mla_oracle

# GLM-5: qk_nope_head_dim 192 + qk_rope_head_dim 64, no YaRN
GLM5_SCALE = 1 / math.sqrt(192 + 64)
# DeepSeek-V3.2: qk_nope_head_dim 128 + qk_rope_head_dim 64, YaRN factor 40, mscale_all_dim 1
DSV32_SCALE = (1 / math.sqrt(128 + 64)) * (0.1 * math.log(40) + 1) ** 2


@pytest.mark.parametrize(
    ("preset", "scale"),
    [("glm5", GLM5_SCALE), ("deepseek-v32", DSV32_SCALE), ("gqa-64-8", 1 / 8)],
    ids=["glm5", "deepseek-v32", "gqa-64-8"],
)
def test_presets_carry_their_models_softmax_scale(preset: str, scale: float) -> None:
    assert get_preset(preset).softmax_scale == pytest.approx(scale, rel=1e-12)


def test_mla_softmax_scale_follows_yarn_mscale() -> None:
    assert mla_softmax_scale(192, 64) == GLM5_SCALE
    assert mla_softmax_scale(128, 64, rope_factor=40.0, mscale_all_dim=1.0) == pytest.approx(DSV32_SCALE, rel=1e-12)
    assert mla_softmax_scale(128, 64, rope_factor=1.0, mscale_all_dim=1.0) == 192**-0.5  # no scaling: no mscale
    with pytest.raises(ValueError, match="rope_factor"):
        mla_softmax_scale(128, 64, rope_factor=0.0)


def test_sparse_mla_spec_without_a_scale_is_refused() -> None:
    with pytest.raises(ValueError, match="softmax_scale"):
        ModelSpec("sparse_mla", 8, 1, 576, 512, 2048, 64)


@pytest.mark.parametrize(
    ("value", "error"),
    [(float("nan"), ValueError), (0.0, ValueError), (-0.1, ValueError), (float("inf"), ValueError), ("0.1", TypeError)],
    ids=["nan", "zero", "negative", "inf", "string"],
)
def test_bad_softmax_scale_names_the_argument(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="softmax_scale"):
        ModelSpec("sparse_mla", 8, 1, 576, 512, 2048, 64, softmax_scale=value)  # type: ignore[arg-type]


def test_gqa_spec_defaults_to_inverse_sqrt_head_dim() -> None:
    assert ModelSpec("gqa", 8, 2, 128, 128, 0, 16).softmax_scale == 128**-0.5


def test_launcher_softmax_scale_reaches_the_spec() -> None:
    opts = parse_options(["--preset", "glm5", "--softmax-scale", "0.2", "--mode", "headtp"])
    cfg = plan_run(opts, 2, torch.device("cpu"))
    assert cfg.spec.softmax_scale == 0.2 and cfg.describe()["softmax_scale"] == 0.2
    default = plan_run(parse_options(["--preset", "deepseek-v32", "--mode", "headtp"]), 2, torch.device("cpu"))
    assert default.spec.softmax_scale == pytest.approx(DSV32_SCALE, rel=1e-12)
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(LaunchError, match="softmax-scale"):
            parse_options(["--softmax-scale", bad])


def _glm5_decode_body(group, scale: float | None) -> dict:
    """A DCP decode step of the glm5 preset (64 heads, 576 dims; tiny top-k, CPU)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    rt = Runtime("glm5", group, max_batched_tokens=8, mode="dcp-decode", topk=8, max_decode_tokens=4, scale=scale)
    spec = rt.spec
    s = build_decode(
        heads=spec.num_heads, head_dim=spec.head_dim, requests=2, cached=(40, 9), q_lens=(1, 2), topk=8,
        overlap="random", causal=True, dtype=torch.float32, device=torch.device("cpu"), seed=4,
        shard=DcpShard(world, 1, rank), block_size=spec.page_size,
    )  # fmt: skip
    h = rt.heads_per_rank
    out, lse = rt.decode(
        s.q[:, rank * h : (rank + 1) * h].contiguous(), s.local_kv, s.local_table, s.seq_lens,
        topk_pos=s.positions, req_ids=s.req_ids,
    )  # fmt: skip
    errs = {}
    for name, at in (("model", GLM5_SCALE if scale is None else scale), ("head_dim", 576**-0.5)):
        ref_out, ref_lse = sparse_mla_oracle(s.q, s.kv, s.rows, scale=at, v_dim=512)
        ref_out, ref_lse = ref_out[:, rank * h : (rank + 1) * h], ref_lse[:, rank * h : (rank + 1) * h]
        errs[name] = max(float((out - ref_out).abs().max()), float((lse - ref_lse).abs().max()))
    return errs


@pytest.mark.distributed
@pytest.mark.parametrize("scale", [None, 0.2], ids=["preset", "override"])
def test_glm5_runtime_decodes_at_the_models_scale(dist_pool, scale: float | None) -> None:
    """The regression: a Runtime that scaled by ``head_dim ** -0.5`` matches the second oracle, not the first."""
    for errs in dist_pool.run(_glm5_decode_body, scale, world_size=2):
        assert errs["model"] <= 1e-5, errs
        assert errs["head_dim"] > 1e-3, errs


def _bad_scale_body(group, scale: object) -> str:
    try:
        Runtime("glm5", group, max_batched_tokens=8, mode="headtp", warmup=False, scale=scale)
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "accepted"


@pytest.mark.distributed
def test_runtime_scale_is_checked(dist_pool) -> None:
    for bad, kind in ((-1.0, "ValueError"), (float("nan"), "ValueError"), ("0.1", "TypeError")):
        for msg in dist_pool.run(_bad_scale_body, bad, world_size=2):
            assert msg.startswith(kind) and "scale" in msg, msg
