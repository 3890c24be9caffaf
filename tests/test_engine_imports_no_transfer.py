"""ARCHITECTURE.md: the engine imports nothing from kv_transfer (function-level imports included);
the node wraps the executor's rank pools for the transfer (node/transfer_caches.py)."""

from __future__ import annotations

from tests.test_import_rules import ROOT, imported_modules


def test_no_engine_module_imports_kv_transfer():
    offenders = [
        f"{path.relative_to(ROOT)}: {module}"
        for path in sorted((ROOT / "engine").rglob("*.py"))
        for module in sorted(imported_modules(path))
        if module == "pdserve.kv_transfer" or module.startswith("pdserve.kv_transfer.")
    ]
    assert not offenders, offenders
