"""`make lint`'s type check: mypy over the packages that carry the contracts and the engine.

mypy resolves imports from files alone, and ``pdserve.X`` is the top-level folder ``X/`` only
through pyproject.toml's package-dir (for a wheel) and pdserve/__init__.py's import hook (for a
checkout), neither of which it reads. So it checks a tree of links laid out as the wheel is,
build/typecheck/pdserve/X -> X/, made anew each run from the same package map.

    python -m scripts.typecheck [mypy arguments]
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "typecheck"
CHECKED = ("protocol", "engine", "router", "kv_transfer", "node", "prefill_node", "decode_node")


def link_tree() -> pathlib.Path:
    """build/typecheck/pdserve laid out as the wheel installs it, each folder a link to the source."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    shutil.rmtree(TREE, ignore_errors=True)
    top = TREE / "pdserve"
    top.mkdir(parents=True)
    for entry in (ROOT / package_dir["pdserve"]).iterdir():
        if entry.name != "__pycache__":
            (top / entry.name).symlink_to(entry)
    for package, folder in package_dir.items():
        if package != "pdserve":
            (top / package.removeprefix("pdserve.")).symlink_to(ROOT / folder)
    return TREE


def main(argv: list[str]) -> int:
    tree = link_tree()
    packages = [arg for name in CHECKED for arg in ("-p", f"pdserve.{name}")]
    command = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), *packages, *argv]
    return subprocess.run(command, cwd=tree).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
