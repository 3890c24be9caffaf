"""Numbers and tables the docs state that the code decides, read from the code so that the docs
cannot drift from it: the wire protocol's version, and the import graph between the top-level
folders (docs/design.md, "Layers, from the imports", which scripts/import_graph.py writes).

A new fact is one row of FACTS: the page, a pattern whose one group is the value as written, and
a function of no arguments that reads the value from the code. Each page must state it at least
once, and every place it does must say the code's value."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import pytest

from scripts import import_graph
from tests.cluster import ROOT


@dataclasses.dataclass(frozen=True)
class Fact:
    page: str  # relative to the repository root
    pattern: str  # a regex with one group: the value as the page writes it
    value: Callable[[], object]  # the value, read from the code when the test runs

    def __str__(self) -> str:
        return f"{self.page}: {self.pattern}"


def protocol_version() -> int:
    from pdserve.protocol.codec import PROTOCOL_VERSION

    return PROTOCOL_VERSION


FACTS = [
    Fact("docs/design.md", r"protocol is version (\d+)\b", protocol_version),
    Fact("docs/contributing.md", r"`PROTOCOL_VERSION` \(`protocol/codec\.py`, now (\d+)\)", protocol_version),
]


def wrong(fact: Fact) -> str | None:
    """What the page gets wrong about ``fact``; None where every statement of it is right."""
    text = " ".join((ROOT / fact.page).read_text().split())  # a phrase may wrap onto the next line
    stated = set(re.findall(fact.pattern, text))
    want = str(fact.value())
    if not stated:
        return f"{fact.page} no longer says /{fact.pattern}/: update the page or this fact"
    if stated != {want}:
        return f"{fact.page} says {sorted(stated)} where the code has {want}"
    return None


@pytest.mark.parametrize("fact", FACTS, ids=str)
def test_the_page_states_the_value_the_code_has(fact):
    assert wrong(fact) is None, wrong(fact)


def test_a_stale_or_missing_statement_is_caught():
    stale = Fact("docs/design.md", r"protocol is version (\d+)\b", lambda: protocol_version() + 1)
    assert "where the code has" in (wrong(stale) or "")
    gone = Fact("docs/design.md", r"protocol is numbered (\d+)", protocol_version)
    assert "no longer says" in (wrong(gone) or "")


def test_the_layer_table_is_the_import_graph_the_files_give():
    arrows, unresolved = import_graph.graph()
    assert not unresolved, unresolved  # every pdserve.X import resolves to a file through the links
    page = import_graph.DESIGN.read_text()
    assert import_graph.splice(page, import_graph.render(arrows)) == page, (
        "docs/design.md's import table is stale: run `python -m scripts.import_graph --write`"
    )


def test_the_import_graph_finds_arrows_into_and_out_of_the_engine_through_the_links():
    arrows, _ = import_graph.graph()
    assert len(arrows) == 14  # pdserve/ and the 13 folders it links to
    # through the links, not through any hook: the engine's own imports, and the roles' of it
    assert {"protocol", "kernels"} <= arrows["engine"]
    assert {"engine", "kv_transfer", "node", "protocol"} <= arrows["prefill_node"]
    assert "engine" not in arrows["router"] and "engine" not in arrows["kv_transfer"]
