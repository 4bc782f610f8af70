"""The public API: what ``from shardattn import ...`` gives, that importing the package is cheap, and
that the entry points name the same things the same way."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
import typing

import pytest

import shardattn


@pytest.mark.parametrize("name", sorted(set(shardattn.__all__) - {"__version__"}))
def test_every_public_name_is_its_home_module_object(name):
    home = importlib.import_module(shardattn._PUBLIC[name])
    assert getattr(shardattn, name) is getattr(home, name)


def test_the_type_stub_names_every_public_name_from_its_home_module():
    """``shardattn/__init__.pyi`` gives type checkers the names ``__getattr__`` loads: the same table."""
    import ast
    from pathlib import Path

    stub = ast.parse((Path(shardattn.__file__).parent / "__init__.pyi").read_text())
    typed = {
        alias.asname: node.module
        for node in stub.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.asname == alias.name
    }
    assert typed == shardattn._PUBLIC


def test_the_type_stub_holds_only_re_exports():
    """Every line of the stub re-exports a name (``from M import n as n``) or types ``__version__`` /
    ``__all__``: a signature written out in the stub could drift from the function's own."""
    import ast
    from pathlib import Path

    stub = ast.parse((Path(shardattn.__file__).parent / "__init__.pyi").read_text())
    other = [
        ast.unparse(node)
        for node in stub.body
        if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))  # the docstring
        and not (isinstance(node, ast.ImportFrom) and all(a.asname == a.name for a in node.names))
        and not (isinstance(node, ast.AnnAssign) and ast.unparse(node.target) in ("__version__", "__all__"))
    ]
    assert other == []


def _overloaded() -> list[tuple[str, object]]:
    """The public functions and public classes' methods that declare ``typing.overload`` variants."""
    found = []
    for name in sorted(shardattn._PUBLIC):
        obj = getattr(shardattn, name)
        members = vars(obj).items() if inspect.isclass(obj) else [("", obj)]
        for member, fn in members:
            if inspect.isfunction(fn) and typing.get_overloads(fn):
                found.append((f"{name}.{member}".rstrip("."), fn))
    return found


@pytest.mark.parametrize(("name", "fn"), _overloaded(), ids=[n for n, _ in _overloaded()])
def test_the_typed_overloads_match_their_implementation(name, fn):
    """What a type checker sees of an overloaded function (its ``@overload`` variants) has the
    implementation's parameters: names, order, kinds (keyword-only included) and which take a
    default; a ``return_lse: Literal[b]`` variant has a default exactly when ``b`` is the
    implementation's default (so the call without it types as what it returns)."""
    impl = inspect.signature(fn).parameters
    for variant in typing.get_overloads(fn):
        params = inspect.signature(variant).parameters
        assert [(p.name, p.kind) for p in params.values()] == [(p.name, p.kind) for p in impl.values()], name
        for p in params.values():
            has_default = p.default is not inspect.Parameter.empty
            if p.name == "return_lse" and p.annotation.startswith("Literal["):
                literal = p.annotation == f"Literal[{impl[p.name].default}]"
                assert has_default == literal, (name, p.annotation)
            else:
                assert has_default == (impl[p.name].default is not inspect.Parameter.empty), (name, p.name)


def test_importing_the_package_imports_neither_torch_nor_triton():
    code = "import shardattn, sys; print(sorted(m for m in ('torch', 'triton') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_an_unknown_name_raises_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'sparse_mla_gluon'"):
        _ = shardattn.sparse_mla_gluon


def test_errors_are_one_set_of_classes():
    from shardattn.errors import PeerFailedError, WorkspaceExceededError
    from shardattn.launch.cli import LaunchError
    from shardattn.parallel.comm import PeerFailedError as comm_peer_failed
    from shardattn.plan.calibration import CalibrationWarning
    from shardattn.runtime.workspace import WorkspaceExceededError as runtime_exceeded
    from shardattn.serving import RankFailedError

    assert comm_peer_failed is PeerFailedError and runtime_exceeded is WorkspaceExceededError
    assert shardattn.LaunchError is LaunchError and shardattn.CalibrationWarning is CalibrationWarning
    assert shardattn.RankFailedError is RankFailedError
    assert issubclass(WorkspaceExceededError, ValueError) and issubclass(PeerFailedError, RuntimeError)


def _params(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


def test_entry_points_name_their_arguments_alike():
    """One name for the LSE destination (``lse_out``), for a union built ahead (``prepared_union``)
    and for the caller's promises about rows (``rows_unique`` / ``rows_sorted``); no launch knobs."""
    ops = {
        "sparse_mla_attention": shardattn.sparse_mla_attention,
        "sparse_mla_grouped_prefill": shardattn.sparse_mla_grouped_prefill,
        "sparse_mla_decode": shardattn.sparse_mla_decode,
        "gqa_paged_decode": shardattn.gqa_paged_decode,
        "lse_merge": shardattn.lse_merge,
        "shardq_prefill": shardattn.shardq_prefill,
    }
    for name, fn in ops.items():
        params = _params(fn)
        assert "lse_out" in params and "lse" not in params, name
        assert not params & {"prepared", "topk_unique", "config", "num_splits", "counters"}, name
    assert "prepared_union" in _params(shardattn.sparse_mla_attention) & _params(shardattn.sparse_mla_grouped_prefill)
    assert "rows_unique" in _params(shardattn.sparse_mla_decode) & _params(shardattn.dcp_sparse_mla_decode)
    assert "rows_sorted" in _params(shardattn.sparse_mla_grouped_prefill) & _params(shardattn.build_union)


def test_availability_predicates_return_bools():
    from shardattn.kernels.backend import triton_available
    from shardattn.kernels.gluon.sparse_mla import gluon_available, gluon_unavailable_reason

    assert isinstance(triton_available(), bool) and isinstance(gluon_available(), bool)
    assert (gluon_unavailable_reason() is None) == gluon_available()


def test_the_runtime_names_its_arguments_by_their_meaning():
    """The Runtime's options are the public dataclasses, and its steps name each argument by what it
    holds: ``query_lens`` / ``prefix_lens`` / ``seq_lens``, ``rows`` (global KV rows) beside
    ``topk_pos`` (request positions), ``kv_cache`` / ``kv_new``. Decode's ``topk_unique`` is a promise
    about ``topk_pos`` (positions), so it keeps that name rather than the kernels' ``rows_unique``."""
    runtime = _params(shardattn.Runtime)
    assert {"prefill_options", "decode_options"} <= runtime
    assert not runtime & {"prefill_chunks", "dcp_interleave", "decode_lse", "non_causal", "cost_model"}
    prefill, decode = _params(shardattn.Runtime.prefill), _params(shardattn.Runtime.decode)
    assert {"kv_cache", "rows", "topk_pos", "kv_new", "query_lens", "prefix_lens", "seq_lens"} <= prefill
    assert {"kv_cache", "block_table", "seq_lens", "topk_pos", "req_ids", "topk_unique", "window_left"} <= decode
    assert "rows_unique" not in decode and "rows" not in decode
    assert shardattn.PrefillOptions(chunks=2).chunks == 2 and shardattn.DecodeOptions().causal is True
    assert {"kv_cache", "block_table", "seq_lens"} <= _params(shardattn.shard_kv_cache)
