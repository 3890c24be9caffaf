"""The import graph between the package's top-level folders, read from the files alone.

Each ``import pdserve.X...`` of every module is resolved the way a type checker or an IDE does it:
by looking for the file on disk from the repository root, through pdserve/X (a link to the
top-level folder X/), never by importing anything. So it finds exactly the arrows a tool that
reads files sees; an import it cannot resolve is an error (exit status 1), since such a tool would
not see it either. docs/design.md's table (between the ``import-graph`` markers) is this script's
output, and tests/test_docs_facts.py fails while the two differ.

    python -m scripts.import_graph            # print the table
    python -m scripts.import_graph --write    # rewrite the table in docs/design.md
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import sys
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "pdserve"
DESIGN = ROOT / "docs" / "design.md"
BEGIN, END = "<!-- import-graph: python -m scripts.import_graph --write -->", "<!-- /import-graph -->"


def folders(root: pathlib.Path = ROOT) -> list[str]:
    """The package's top-level folders: pdserve/ itself and each X/ that pdserve/X links to."""
    package = root / PACKAGE
    return [PACKAGE, *sorted(p.name for p in package.iterdir() if p.is_symlink() and p.is_dir())]


def modules_of(folder: pathlib.Path) -> Iterator[tuple[str, pathlib.Path]]:
    """(dotted name under ``pdserve``, file) of each module in ``folder`` (its real files only:
    pdserve/'s links are the other folders, walked on their own)."""
    for path in sorted(folder.rglob("*.py")):  # rglob does not descend into links
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(folder).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        top = [] if folder.name == PACKAGE else [folder.name]
        yield ".".join([PACKAGE, *top, *parts]), path


def imported_names(path: pathlib.Path, module: str) -> set[str]:
    """Every module name ``path`` imports (function-level ones too), relative imports made absolute;
    for ``from a import b`` both ``a`` and ``a.b`` (b may be a submodule)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join([*anchor, *filter(None, [base])])
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names if alias.name != "*"}
    return found


def resolve(name: str, root: pathlib.Path = ROOT) -> pathlib.Path | None:
    """The file or folder that module ``name`` is, found on disk from ``root``; None if none is."""
    path = root.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py", path):
        if candidate.exists():
            return candidate
    return None


def graph(root: pathlib.Path = ROOT) -> tuple[dict[str, set[str]], list[str]]:
    """folder -> the other folders its modules import; and the ``pdserve`` imports no file answers."""
    arrows: dict[str, set[str]] = {name: set() for name in folders(root)}
    unresolved: list[str] = []
    for name in arrows:
        for module, path in modules_of(root / name):
            for imported in sorted(imported_names(path, module)):
                if imported.split(".")[0] != PACKAGE:
                    continue
                target = resolve(imported, root)
                if target is None:
                    # `from pdserve.x import Name`: the name, not a module; the module itself counts
                    if resolve(imported.rpartition(".")[0], root) is None:
                        unresolved.append(f"{path.relative_to(root)}: {imported}")
                    continue
                real = target.resolve().relative_to(root.resolve()).parts[0]
                if real != name:
                    arrows[name].add(real)
    return arrows, sorted(set(unresolved))


def render(arrows: dict[str, set[str]]) -> str:
    """A Markdown table: each folder, what it imports and what imports it."""
    users = {name: sorted(src for src, dst in arrows.items() if name in dst) for name in arrows}
    count = sum(len(dst) for dst in arrows.values())
    lines = [
        f"{len(arrows)} folders, {count} arrows.",
        "",
        "| folder | imports | imported by |",
        "|---|---|---|",
    ]
    for name in arrows:
        out = ", ".join(f"`{d}`" for d in sorted(arrows[name])) or "—"
        into = ", ".join(f"`{s}`" for s in users[name]) or "—"
        lines.append(f"| `{name}` | {out} | {into} |")
    return "\n".join(lines) + "\n"


def splice(page: str, table: str) -> str:
    """``page`` with the text between the markers replaced by ``table``."""
    head, begin, rest = page.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"docs/design.md lacks the markers {BEGIN!r} ... {END!r}")
    return f"{head}{BEGIN}\n{table}{END}{tail}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the table in docs/design.md")
    args = parser.parse_args(argv)
    arrows, unresolved = graph()
    if unresolved:
        print("imports no file answers:\n  " + "\n  ".join(unresolved), file=sys.stderr)
        return 1
    table = render(arrows)
    if args.write:
        DESIGN.write_text(splice(DESIGN.read_text(), table))
    else:
        print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
