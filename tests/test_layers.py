"""The import rules of docs/ARCHITECTURE.md, checked on the source (``ast``: module-level and
function-level imports alike):

* ``plan/`` is pure host code: it imports only ``shardattn._checks``, ``shardattn._ints``,
  ``shardattn.errors`` and itself, and never ``torch.distributed``;
* ``kernels/`` imports nothing above it (no ``ops/``, ``parallel/``, ``runtime/``, ...);
* ``ops/`` and ``kernels/`` never talk to a process group (no ``torch.distributed``);
* ``parallel/`` imports no ``runtime/``; neither imports ``serving/`` or ``launch/``;
* only ``launch/``, ``serving/`` and ``testing/`` create process groups or Ray actors.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import shardattn

PACKAGE = Path(shardattn.__file__).parent

#: Layer -> the top-level parts of shardattn it may import.
ALLOWED = {
    "plan": {"_checks", "_ints", "errors", "plan"},
    "kernels": {"_checks", "_ints", "errors", "plan", "kernels"},
    "ops": {"_checks", "_ints", "errors", "plan", "kernels", "ops"},
    "parallel": {"_checks", "_ints", "errors", "plan", "kernels", "ops", "parallel"},
    "runtime": {"_checks", "_ints", "errors", "plan", "kernels", "ops", "parallel", "runtime"},
    "errors.py": set(),
    "_checks.py": set(),
    "_ints.py": set(),
}
NO_PROCESS_GROUPS = ("plan", "kernels", "ops")
#: Calls that create a process group or a Ray actor.
CREATORS = {"init_process_group", "new_group", "new_subgroups", "init_device_mesh", "remote"}
MAY_CREATE = {"launch", "serving", "testing"}


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _layer(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0]


def test_the_scan_sees_every_layer():
    layers = {_layer(p) for p in _modules()}
    assert {"plan", "kernels", "ops", "parallel", "runtime", "serving", "launch"} <= layers


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_each_layer_imports_only_what_lies_below_it(layer):
    bad = []
    for path in _modules():
        if _layer(path) != layer:
            continue
        for line, module in _imports(ast.parse(path.read_text())):
            parts = module.split(".")
            if parts[0] == "shardattn" and len(parts) > 1 and parts[1] not in ALLOWED[layer]:
                bad.append(f"{path.relative_to(PACKAGE)}:{line} imports {module}")
            if layer in NO_PROCESS_GROUPS and module.startswith("torch.distributed"):
                bad.append(f"{path.relative_to(PACKAGE)}:{line} imports {module}")
    assert bad == []


def test_only_launch_serving_and_testing_create_groups_or_actors():
    bad = []
    for path in _modules():
        if _layer(path) in MAY_CREATE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
                if name in CREATORS:
                    bad.append(f"{path.relative_to(PACKAGE)}:{node.lineno} calls {name}")
    assert bad == []
