"""The Ray pool's configuration: a pool without Ray installed names the extra to install; bad
specs, modes, sinks, limits, timeouts, placements and Runtime arguments are refused before any
actor starts (a CPU pool of no CPUs before Ray starts, or with the Ray it started stopped); the
pool's Runtime arguments are exactly the Runtime's own but those it sets itself; and a pool whose
Runtimes drop the decode LSE knows it in every mode."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from shardattn.plan.spec import ModelSpec
from shardattn.runtime.options import DecodeOptions
from shardattn.serving.errors import require_ray
from tests.ray_pool_helpers import GQA, GQA_SINKS, MLA, NAN_SINKS, needs_ray


def test_without_ray_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # "import ray" raises ImportError
    with pytest.raises(ImportError, match=r"shardattn\[ray\]"):
        require_ray()
    from shardattn.serving import RayRankPool

    with pytest.raises(ImportError, match="'ray' extra"):
        RayRankPool(2)


@needs_ray
def test_bad_pool_configs_raise_before_any_actor_starts() -> None:
    from shardattn.serving import RayRankPool

    small = {"max_batched_tokens": 8}
    cases = [
        ({"spec": "gqa-64-8", "mode": "dcp-decode", "runtime_kwargs": small}, r"sinks must be given \(\[64\] fp32\)"),
        ({"spec": MLA, "runtime_kwargs": small, "sinks": torch.zeros(8)}, "sinks must be None"),
        ({"spec": GQA_SINKS, "mode": "dcp-decode", "runtime_kwargs": small, "sinks": torch.zeros(4)}, "sinks must"),
        ({"spec": GQA_SINKS, "mode": "dcp-decode", "runtime_kwargs": small, "sinks": NAN_SINKS}, "sinks must be fin"),
        ({"spec": MLA, "runtime_kwargs": small, "memory_limit_bytes": 1000}, "over memory_limit_bytes=1000"),
        ({"spec": MLA, "mode": "pcp-decode", "runtime_kwargs": small}, "mode must be one of"),
        ({"spec": MLA}, "runtime_kwargs must give max_batched_tokens"),
        ({"spec": MLA, "runtime_kwargs": small, "transport": "grpc"}, "transport must be one of"),
        ({"spec": MLA, "runtime_kwargs": small, "device": "tpu"}, "device must be"),
        ({"spec": MLA, "runtime_kwargs": small, "timeout_s": math.nan}, r"^timeout_s must be a finite number > 0"),
        ({"spec": MLA, "runtime_kwargs": small, "timeout_s": 0}, r"^timeout_s must be a finite number > 0"),
        ({"spec": MLA, "runtime_kwargs": small, "placement_timeout_s": -5}, r"^placement_timeout_s must be a finite"),
        ({"spec": MLA, "runtime_kwargs": small, "num_cpus": -1}, r"^num_cpus must be a finite number >= 0"),
        ({"spec": MLA, "runtime_kwargs": small, "placement_strategy": "BOGUS"}, r"^placement_strategy must be one of"),
        ({"spec": MLA, "runtime_kwargs": {"max_batched_tokens": -1}}, r"max_batched_tokens'\] must be >= 1"),
        ({"spec": MLA, "runtime_kwargs": {**small, "topk": 0}}, r"runtime_kwargs\['topk'\] must be >= 1"),
        ({"spec": MLA, "runtime_kwargs": {**small, "scale": -1.0}}, r"runtime_kwargs\['scale'\] must be a finite"),
        ({"spec": MLA, "runtime_kwargs": {**small, "scale": math.nan}}, r"runtime_kwargs\['scale'\] must be a fin"),
        ({"spec": MLA, "runtime_kwargs": {**small, "devcie": "cpu"}}, r"runtime_kwargs holds \['devcie'\]"),
        ({"spec": MLA, "runtime_kwargs": {**small, "mode": "pcp"}}, r"runtime_kwargs must not give mode"),
        ({"spec": GQA, "mode": "shardq", "runtime_kwargs": small}, r"mode 'shardq' serves sparse MLA only"),
        (
            {"spec": GQA, "mode": "dcp-decode", "runtime_kwargs": {**small, "kv_dtype": "fp8_ds_mla"}},
            r"kv_dtype'\]='fp8_ds_mla' holds DSA sparse-MLA rows",
        ),
        # a pool's queries and resident rows are the spec's dtype: every step was refused on the ranks
        (
            {"spec": MLA, "runtime_kwargs": {**small, "kv_dtype": "bf16"}},
            r"^runtime_kwargs\['kv_dtype'\]='bfloat16': a pool's KV rows are its spec's float32 \(or fp8_ds_mla\)",
        ),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            RayRankPool(2, init_ray=False, **kwargs)
    with pytest.raises(TypeError, match="sinks must have dtype"):
        RayRankPool(2, GQA_SINKS, mode="dcp-decode", runtime_kwargs=small, sinks=torch.zeros(8).double())
    for kwargs, match in (
        ({"runtime_kwargs": {"max_batched_tokens": 2.7}}, r"max_batched_tokens'\] must be an int"),
        ({"runtime_kwargs": small, "memory_limit_bytes": "big"}, r"^memory_limit_bytes must be an int"),
        ({"runtime_kwargs": small, "timeout_s": "60"}, r"^timeout_s must be a float"),
        ({"runtime_kwargs": {**small, "warmup": "yes"}}, r"^runtime_kwargs\['warmup'\] must be a bool"),
        ({"runtime_kwargs": {**small, "host_id": 5}}, r"^runtime_kwargs\['host_id'\] must be a str or None"),
    ):
        with pytest.raises(TypeError, match=match):
            RayRankPool(2, MLA, init_ray=False, **kwargs)


@needs_ray
def test_a_cpu_pool_of_no_cpus_is_refused_before_ray_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """``device="cpu", num_cpus=0`` was refused after the pool started Ray, which kept running: it
    is refused first; ``device="auto"`` (known to be a CPU pool once Ray runs) stops the Ray it started."""
    import ray

    from shardattn.serving import RayRankPool

    calls: list[str] = []

    def start(**kwargs) -> None:
        calls.append("init")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", start)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0})
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    small = {"max_batched_tokens": 8, "warmup": False}
    with pytest.raises(ValueError, match=r"^num_cpus must be > 0 for a CPU pool"):
        RayRankPool(2, MLA, device="cpu", num_cpus=0, runtime_kwargs=small)
    assert calls == []
    with pytest.raises(ValueError, match=r"^num_cpus must be > 0 for a CPU pool"):
        RayRankPool(2, MLA, device="auto", num_cpus=0, runtime_kwargs=small)
    assert calls == ["init", "shutdown"]


def test_the_pool_names_every_runtime_argument_it_does_not_set_itself() -> None:
    """``runtime_kwargs`` may give exactly the Runtime's arguments but the spec, group and device."""
    import inspect

    from shardattn.runtime.runtime import Runtime
    from shardattn.serving.pool_shapes import RUNTIME_KWARGS

    assert set(inspect.signature(Runtime.__init__).parameters) - {"self", "spec", "group", "device"} == RUNTIME_KWARGS


@pytest.mark.parametrize("mode", ["shardq", "headtp", "pcp", "dcp-decode", "mixed"])
@pytest.mark.parametrize("spec", [MLA, GQA], ids=["mla", "gqa"])
def test_a_pool_whose_runtimes_drop_the_decode_lse_knows_it_in_every_mode(mode: str, spec: ModelSpec) -> None:
    """Its Runtimes return ``(out, None)`` from every decode step with ``DecodeOptions(return_lse=False)``,
    DCP's and sparse MLA's too: the pool refuses ``return_lse=True`` rather than failing on a rank."""
    from shardattn.serving.pool_shapes import plan_pool

    if mode == "shardq" and spec.kind == "gqa":
        pytest.skip("a GQA model has no ShardQ mode")
    kwargs = {"max_batched_tokens": 16, "decode_options": DecodeOptions(return_lse=False)}
    assert plan_pool(spec, mode, kwargs, 2, None, 2, 32, None, None).decode_lse is False
    assert plan_pool(spec, mode, {"max_batched_tokens": 16}, 2, None, 2, 32, None, None).decode_lse is True
