"""The examples run as a user would run them: their ``main(group)`` on 2 ranks, and one script end to end.

On the ranks, the library references an example checks itself against are swapped for the
independent fp64 oracles of tests/oracle.py, so an example's own "max error" line measures the
step against code that shares nothing with it.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.fp8_oracle import fp8_rows_decode
from tests.oracle import gqa_oracle, sparse_mla_oracle, topk_rows_oracle

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NAMES = ["shardq_prefill", "dcp_decode", "gqa_spec_decode", "fp8_cache_decode"]
RAY_NAMES = ["ray_service"]  # run by tests/test_ray_pool_fp64.py, on that module's Ray instance


def _sparse_mla_reference(q, kv, rows, *, scale, v_dim, **kw):
    out, lse = sparse_mla_oracle(q, kv, rows, scale=scale, v_dim=v_dim, **kw)
    return out.to(q.device), lse.to(q.device)


def _convert_topk(topk_pos, req_ids, block_table, *, block_size, **kw):
    rows = topk_rows_oracle(topk_pos, req_ids, block_table, block_size=block_size, **kw).to(topk_pos.device)
    return rows, (rows >= 0).sum(dim=1, dtype=torch.int32)


def _dequantize_kv(packed, dtype=torch.bfloat16):
    return torch.from_numpy(fp8_rows_decode(packed.cpu().numpy())).to(dtype).to(packed.device)


def _gqa_paged_decode_reference(q, k_cache, v_cache, block_table, seq_lens, cu_q_lens, *, scale, **kw):
    out, lse = gqa_oracle(q, k_cache, v_cache, block_table, seq_lens, cu_q_lens.tolist(), scale=scale, **kw)
    return out.to(q.device), lse.to(q.device)


#: The library functions an example may check itself with, and their oracle stand-ins.
ORACLES = {
    "sparse_mla_reference": _sparse_mla_reference,
    "convert_topk": _convert_topk,
    "gqa_paged_decode_reference": _gqa_paged_decode_reference,
    "dequantize_kv": _dequantize_kv,
}
#: What each example checks itself against (every one of them must be replaced).
CHECKED_WITH = {
    "shardq_prefill": {"sparse_mla_reference", "convert_topk"},
    "dcp_decode": {"sparse_mla_reference", "convert_topk"},
    "gqa_spec_decode": {"gqa_paged_decode_reference"},
    "fp8_cache_decode": {"sparse_mla_reference", "convert_topk", "dequantize_kv"},
}


def _lse_off_runtime(offset: float):
    """A ``Runtime`` whose steps return their LSE moved by ``offset`` (their outputs untouched)."""
    from shardattn import Runtime

    class LseOffRuntime(Runtime):
        def prefill(self, *args, **kwargs):
            out, lse = super().prefill(*args, **kwargs)
            return out, None if lse is None else lse + offset

        def decode(self, *args, **kwargs):
            out, lse = super().decode(*args, **kwargs)
            return out, None if lse is None else lse + offset

    return LseOffRuntime


def _run_example(group, name: str, lse_offset: float = 0.0) -> str:
    """Load ``examples/<name>.py`` on this rank and run its ``main(group)``; returns what it printed
    (with ``lse_offset``, the Runtime's steps return LSEs off by that much)."""
    import contextlib
    import io

    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    replaced = {n for n in ORACLES if hasattr(module, n)}
    assert replaced == CHECKED_WITH[name], f"{name} checks itself with {replaced}"
    for n in replaced:
        setattr(module, n, ORACLES[n])
    if lse_offset:
        module.Runtime = _lse_off_runtime(lse_offset)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        module.main(group)  # raises SystemExit when its own check fails
    return buf.getvalue()


def test_every_example_is_listed() -> None:
    assert sorted(p.stem for p in EXAMPLES.glob("*.py")) == sorted(NAMES + RAY_NAMES)


@pytest.mark.distributed
@pytest.mark.parametrize("name", NAMES)
def test_example_main_on_two_ranks(dist_pool, name: str) -> None:
    printed = dist_pool.run(_run_example, name, world_size=2)
    for rank, text in enumerate(printed):
        assert text.startswith(f"rank {rank}: "), text
        error = float(text.rsplit(" ", 1)[-1])
        assert error <= 1e-4, text


def _example_refusal(group, name: str, lse_offset: float) -> str | None:
    try:
        _run_example(group, name, lse_offset)
    except SystemExit as e:
        return str(e)
    return None


@pytest.mark.distributed
@pytest.mark.parametrize("offset", [0.01, math.nan], ids=["off", "nan"])
@pytest.mark.parametrize("name", NAMES)
def test_example_checks_the_lse_it_returns(dist_pool, name: str, offset: float) -> None:
    """Each example compares the step's LSE with one process's too, not its output alone: an LSE
    off by 0.01 or NaN (outputs right) fails its check on every rank (every example passed: the
    LSE was not compared, and a NaN error passed ``err > tol``)."""
    refusals = dist_pool.run(_example_refusal, name, offset, world_size=2)
    for rank, message in enumerate(refusals):
        assert message is not None and message.startswith(f"rank {rank}: error "), message


def test_example_script_spawns_its_own_ranks() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "gqa_spec_decode.py")], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    # the two ranks print concurrently: their lines may run together, so find each rank's report
    reports = re.findall(r"rank (\d): drafts \[1, 3, 2\] -> out \(6, 32, 64\)", proc.stdout)
    assert sorted(reports) == ["0", "1"], proc.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt", "40", "8"], "--prompt MIN MAX must have 1 <= MIN <= MAX, got 40 8"),
        (["--max-batch", "0"], "--max-batch must be >= 1, got 0"),
        (["--ranks", "0"], "--ranks must be >= 1, got 0"),
        (["--preset", "gqa-64-8"], "argument --preset: invalid choice: 'gqa-64-8'"),
    ],
    ids=["prompt-range", "max-batch", "ranks", "gqa-preset"],
)
def test_the_service_example_refuses_bad_arguments_before_starting(capsys, monkeypatch, argv, message) -> None:
    """One usage line and status 2 before Ray or any rank starts (a GQA preset needs sinks the
    example does not make; an empty prompt range raised inside the running service)."""
    module = _service_module(monkeypatch)
    with pytest.raises(SystemExit) as info:
        module.parse(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def _service_module(monkeypatch):
    """``examples/ray_service.py`` loaded as a module (nothing started)."""
    spec = importlib.util.spec_from_file_location("ray_service_args", EXAMPLES / "ray_service.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ranks", "3"], "--ranks 3 must divide the model's 8 heads"),
        (["--preset", "glm5", "--heads", "24", "--ranks", "5"], "--ranks 5 must divide the model's 24 heads"),
        (["--softmax-scale", "-1"], "--softmax-scale must be a finite number > 0, got -1.0"),
        (["--head-dim", "48", "--v-dim", "64"], "--v-dim (64) must be <= --head-dim (48)"),
        (["--preset", "glm5", "--head-dim", "48"], "--head-dim sets the model dims without --preset"),
        (["--preset", "deepseek-v32", "--v-dim", "32"], "--v-dim sets the model dims without --preset"),
        (["--preset", "glm5", "--page", "4"], "--page sets the model dims without --preset"),
    ],
    ids=["ranks-heads", "ranks-preset-heads", "scale", "v-dim", "preset-head-dim", "preset-v-dim", "preset-page"],
)
def test_the_service_example_refuses_a_model_it_cannot_build_before_starting(capsys, monkeypatch, argv, message):
    """A model the flags cannot make, or a flag the preset overrides, is one usage line and
    status 2 (a ``ValueError`` traceback from the pool's constructor, or a flag silently
    ignored, before)."""
    module = _service_module(monkeypatch)
    with pytest.raises(SystemExit) as info:
        module.model(module.parse(argv))
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_the_service_example_takes_heads_over_a_preset(monkeypatch) -> None:
    """``--heads`` overrides the preset's query heads (as the launcher's does; it was ignored)."""
    module = _service_module(monkeypatch)
    spec = module.model(module.parse(["--preset", "glm5", "--heads", "16"]))
    assert (spec.num_heads, spec.head_dim, spec.v_dim, spec.page_size) == (16, 576, 512, 64)
    spec = module.model(module.parse([]))
    assert (spec.num_heads, spec.head_dim, spec.v_dim, spec.page_size) == (8, 48, 32, 4)


@pytest.mark.parametrize(
    ("gpus", "device", "dtype"), [(0, "cpu", "float32"), (1, "cpu", "float32"), (2, "cuda", "bfloat16")]
)
def test_the_service_example_resolves_auto_device_before_its_dtype(monkeypatch, gpus, device, dtype) -> None:
    """``--device auto`` without a GPU per rank runs on the CPU in fp32, as ``--device cpu`` does
    (it ran bf16 on the CPU: the dtype was chosen before the device was resolved)."""
    module = _service_module(monkeypatch)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    args = module.parse(["--device", "auto", "--ranks", "2"])
    assert (args.device, module.model(args).dtype) == (device, dtype)


class _NoPool:
    backend = "gloo"

    def __init__(self, *args, **kwargs) -> None:
        self.shapes = None

    def shutdown(self) -> None:
        pass


@pytest.mark.parametrize(
    ("error", "fails"), [(5e-5, False), (2e-3, "2.00e-03"), (math.nan, "nan")], ids=["within", "beyond", "nan"]
)
def test_the_service_example_check_fails_beyond_its_tolerance(monkeypatch, capsys, error, fails) -> None:
    """``--check`` is a check: an output further than the dtype's tolerance from fp64 attention
    ends the run with an error, as the other examples do (it printed the error and exited 0)."""
    module = _service_module(monkeypatch)
    stats = {
        "requests": 1, "steps": 2, "wall_s": 0.1, "tokens_per_s": 1.0, "decode_tokens_per_s": 1.0,
        "ttft_ms": {50: 1.0}, "decode_token_ms": {50: 1.0}, "step_ms": {50: 1.0}, "max_error": error,
    }  # fmt: skip

    async def serve(args, pool, spec):
        return stats

    monkeypatch.setattr(module, "RayRankPool", _NoPool)
    monkeypatch.setattr(module, "serve", serve)
    if fails:
        with pytest.raises(SystemExit, match=rf"max \|out - fp64 reference\| {fails} > 1e-04 \(float32\)"):
            module.main(["--check"])
    else:
        assert module.main(["--check"]) is stats


@pytest.mark.parametrize("name", NAMES)
def test_example_help_prints_its_docstring_and_a_flag_it_lacks_is_refused(name: str) -> None:
    """``--help`` prints the example's description without running it; a flag is a usage error."""
    script = str(EXAMPLES / f"{name}.py")
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    run = {"env": env, "capture_output": True, "text": True, "timeout": 120}
    shown = subprocess.run([sys.executable, script, "--help"], **run)
    assert shown.returncode == 0, shown.stderr
    first_line = (EXAMPLES / f"{name}.py").read_text().split('"""')[1].splitlines()[0]
    assert first_line in shown.stdout and "rank 0" not in shown.stdout, shown.stdout
    refused = subprocess.run([sys.executable, script, "--tokens", "8"], **run)
    assert refused.returncode == 2 and "unrecognized arguments: --tokens 8" in refused.stderr, refused.stderr
