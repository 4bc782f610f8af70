"""The interpreter probe: whether the installed Triton interpreter runs the kernels' loops, why not
where it cannot, and the plugin's skip of ``interpret`` tests on that reason (probed once a run)."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest

import shardattn.testing.interpret as interpret
from shardattn.ops.dispatch import triton_available
from shardattn.testing import pytest_plugin


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_the_interpreter_runs_a_computed_loop_bound_here():
    # where this fails, every interpret test skips with the same reason: the kernels go unchecked
    assert interpret.interpreter_unusable_reason() is None


def test_a_failing_probe_is_a_reason_naming_the_versions_and_the_error(monkeypatch):
    pytest.importorskip("triton")
    import numpy
    import triton

    def failed(*args, **kwargs):
        return subprocess.CompletedProcess(args, 1, stdout="", stderr="Traceback ...\nTypeError: no scalar\n")

    monkeypatch.setattr(interpret.subprocess, "run", failed)
    reason = interpret.interpreter_unusable_reason()
    assert reason is not None
    assert f"Triton {triton.__version__}" in reason and f"numpy {numpy.__version__}" in reason
    assert "TypeError: no scalar" in reason and "numpy < 2.4" in reason


def test_the_plugin_probes_once_a_run_and_skips_interpret_tests_on_the_reason(monkeypatch):
    calls = []
    monkeypatch.setattr(interpret, "interpreter_unusable_reason", lambda: calls.append(1) or "no interpreter")
    config = SimpleNamespace(stash=pytest.Stash())
    item = SimpleNamespace(config=config, get_closest_marker=lambda name: object() if name == "interpret" else None)
    for _ in range(2):
        with pytest.raises(pytest.skip.Exception, match="needs Triton's interpreter: no interpreter"):
            pytest_plugin.pytest_runtest_setup(item)
    assert calls == [1]
    unmarked = SimpleNamespace(config=config, get_closest_marker=lambda name: None)
    pytest_plugin.pytest_runtest_setup(unmarked)  # no marker: runs
