"""The lm-eval suite (`make eval`): kept out of the default run, which selects `not chaos` only.

Its tests carry the `eval` marker and run only when the -m expression names it (`-m eval`);
under any other expression they are deselected, so `make test` never needs lm-eval installed.
"""

from __future__ import annotations

import re

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "eval: lm-eval-harness end-to-end checks (make eval)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if re.search(r"\beval\b", config.getoption("markexpr") or ""):
        return  # named in -m: pytest's own filtering decides (`-m eval` keeps, `-m "not eval"` drops)
    deselected = [item for item in items if item.get_closest_marker("eval")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("eval")]
