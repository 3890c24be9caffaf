"""Print pyproject.toml's requirements one a line, for the image build to install before the code.

    python scripts/pyproject_requirements.py torch            # torch's pin alone
    python scripts/pyproject_requirements.py rest [EXTRA...]  # every other dependency, plus extras

The Dockerfile installs torch alone (the only package that may need PyTorch's own index), then the
rest from the plain index, then the code with --no-deps: the dependency layers are rebuilt only
when pyproject.toml changes. Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def requirement_name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower()


def requirements(part: str, extras: list[str], pyproject: Path = PYPROJECT) -> list[str]:
    """``part`` "torch": the torch requirement; "rest": the other dependencies and ``extras``'s."""
    if part not in ("torch", "rest"):
        raise ValueError(f"part must be 'torch' or 'rest', got {part!r}")
    project = tomllib.loads(pyproject.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise ValueError(f"no such extra in {pyproject.name}: {', '.join(unknown)}")
    wanted = project["dependencies"] + [r for extra in extras for r in optional[extra]]
    return [r for r in wanted if (requirement_name(r) == "torch") == (part == "torch")]


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit(__doc__)
    print("\n".join(requirements(argv[0], argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
