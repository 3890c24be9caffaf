"""The docs hold to what they promise: docs/flags.md is what scripts/flag_reference.py makes from
the command line's parser, the README stays a short front page with the two set-up commands, and
no relative link in README.md or docs/ points to a file that is not there."""

from __future__ import annotations

import re

from scripts.flag_reference import render
from tests.cluster import ROOT

README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 150
# [text](target) and ![alt](target); a target ends at whitespace (a title may follow) or ")"
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?[^)]*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
EXTERNAL = ("http://", "https://", "mailto:")


def relative_links(text: str) -> list[str]:
    """The link targets in Markdown ``text`` that name a file here, #anchors stripped; code
    blocks and inline code are not links."""
    text = re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))
    targets = (m.group(1) for m in LINK.finditer(text))
    return [t.split("#", 1)[0] for t in targets if not t.startswith(EXTERNAL) and not t.startswith("#")]


def test_flag_reference_matches_the_parser():
    assert (ROOT / "docs" / "flags.md").read_text() == render(), (
        "docs/flags.md is stale: run `python -m scripts.flag_reference --write`"
    )


def test_readme_is_short_and_gives_the_two_set_up_commands():
    text = README.read_text()
    num_lines = len(text.splitlines())
    assert num_lines <= MAX_README_LINES, f"README.md has {num_lines} lines; keep it to {MAX_README_LINES}"
    assert "make run" in text and "make test" in text


def test_every_relative_link_in_the_readme_and_docs_names_a_file_that_exists():
    missing = [
        f"{page.relative_to(ROOT)}: {target}"
        for page in [README, *DOCS]
        for target in relative_links(page.read_text())
        if not (page.parent / target).exists()
    ]
    assert not missing, "links to nothing:\n" + "\n".join(missing)


def test_link_finder_sees_links_and_images_but_not_code_or_anchors():
    text = (
        "[a](docs/a.md#part) ![plot](plots/p.png) [web](https://x.org) [here](#top)\n"
        "`[not](a link)`\n```\n[no](in/a/block.md)\n```\n"
    )
    assert relative_links(text) == ["docs/a.md", "plots/p.png"]
