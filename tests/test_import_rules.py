"""ARCHITECTURE.md's import rules, read from the source: the router, the transfer and the shared
contracts import no engine module (anywhere, function-level imports included), so the router
stays torch-free and the contracts live in protocol/."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NO_ENGINE = ("router", "kv_transfer", "protocol", "grammar", "detok", "launcher")


def imported_modules(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


@pytest.mark.parametrize("package", NO_ENGINE)
def test_package_imports_no_engine_module(package):
    offenders = [
        f"{path.relative_to(ROOT)}: {module}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for module in sorted(imported_modules(path))
        if module == "engine" or module.startswith("engine.")
    ]
    assert not offenders, offenders


def test_the_rule_sees_a_function_level_import(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text("def f():\n    from engine.sampler import Sampler\n    import engine\n")
    assert imported_modules(sample) == {"engine.sampler", "engine"}


def test_no_router_function_is_longer_than_40_lines():
    """Issue 30's bar for the router: each function reads in one screen."""
    long = []
    for path in sorted((ROOT / "router").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 40:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    assert not long, long
