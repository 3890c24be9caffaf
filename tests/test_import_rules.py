"""ARCHITECTURE.md's import rules, read from the source: the router, the transfer and the shared
contracts import no engine module (anywhere, function-level imports included), so the router
stays torch-free and the contracts live in protocol/; and every import of the project's own code
goes through the one installed name, ``pdserve``."""

from __future__ import annotations

import ast
import pathlib

import pytest

from tests.test_packaging import linked_folders

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
        if module == "pdserve.engine" or module.startswith("pdserve.engine.")
    ]
    assert not offenders, offenders


def _python_files() -> list[pathlib.Path]:
    skip = {".venv", ".git", "build"}
    return sorted(p for p in ROOT.rglob("*.py") if not skip & set(p.relative_to(ROOT).parts))


def test_no_module_imports_a_project_package_by_its_bare_folder_name():
    # From the repository root `import router` would work (the folder is on sys.path) and load a
    # second copy of the module beside pdserve.router; installed, it fails. Only pdserve.X is real.
    bare = set(linked_folders()) | {"pdserve_cli"}
    offenders = [
        f"{path.relative_to(ROOT)}: {module}"
        for path in _python_files()
        for module in sorted(imported_modules(path))
        if module.split(".")[0] in bare
    ]
    assert not offenders, offenders


def test_the_rule_sees_a_function_level_import(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text(
        "def f():\n    from pdserve.engine.sampling.sampler import Sampler\n    import pdserve.engine\n"
    )
    assert imported_modules(sample) == {"pdserve.engine.sampling.sampler", "pdserve.engine"}


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
